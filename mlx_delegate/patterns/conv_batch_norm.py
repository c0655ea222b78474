"""Eval-mode BatchNorm after a convolution, folded into the convolution's constants:

    batch_norm(conv(x, W, b), gamma, beta, mean, var, eps)
        = conv(x, W * s, (b - mean) * s + beta),   s = gamma / sqrt(var + eps)

per output channel. The BatchNorm node (a full pass over the activation on every call) disappears
and the convolution's bias add carries its offset. The folded values are computed once here, in
float64, and stored in the dtype of the constants they replace: the weight's own placeholder takes
W * s, and the bias goes to BatchNorm's beta placeholder (or the convolution's bias placeholder),
so no placeholder is added. Only placeholders that nothing else reads are rewritten, and only
non-transposed convolutions (a transposed one stores its output channels on axis 1).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from .common import aten, constant_value, erase_dead, is_op, only_user

BN = aten._native_batch_norm_legit_no_training.default


def _constant(ep: ExportedProgram, n: Any) -> torch.Tensor | None:
    """The value of placeholder `n` itself (no casts looked through: it is going to be rewritten)."""
    if not isinstance(n, torch.fx.Node) or n.op != "placeholder":
        return None
    return constant_value(ep, n)


def _set_constant(ep: ExportedProgram, n: torch.fx.Node, value: torch.Tensor) -> None:
    for spec in ep.graph_signature.input_specs:
        if spec.arg.name == n.name and spec.kind in (InputKind.PARAMETER, InputKind.BUFFER,
                                                     InputKind.CONSTANT_TENSOR):
            store = ep.state_dict if spec.target in ep.state_dict else ep.constants
            store[spec.target] = value
            return
    raise KeyError(f"{n.name} is not a constant placeholder")


def _sole_reader(n: Any, reader: torch.fx.Node) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "placeholder" and only_user(n, reader)


def _fold(ep: ExportedProgram, bn: torch.fx.Node) -> bool:
    conv = bn.args[0]
    if not is_op(conv, aten.convolution.default) or not only_user(conv, bn) or conv.args[6]:
        return False
    # Only the normalised output may be read (inference's saved statistics are empty anyway).
    users = list(bn.users)
    if not all(u.target is operator.getitem and (u.args[1] == 0 or not u.users) for u in users):
        return False
    w_node, b_node = conv.args[1], conv.args[2]
    gamma_node, beta_node, mean_node, var_node = bn.args[1:5]
    eps = bn.args[-1]
    w, mean, var = _constant(ep, w_node), _constant(ep, mean_node), _constant(ep, var_node)
    if w is None or mean is None or var is None or not isinstance(eps, float) or not _sole_reader(w_node, conv):
        return False
    gamma = None if gamma_node is None else _constant(ep, gamma_node)
    beta = None if beta_node is None else _constant(ep, beta_node)
    bias = None if b_node is None else _constant(ep, b_node)
    if (gamma_node is not None and gamma is None) or (beta_node is not None and beta is None) or \
            (b_node is not None and bias is None):
        return False
    # Where the folded bias goes: a placeholder only this pair reads.
    if _sole_reader(beta_node, bn):
        bias_node = beta_node
    elif _sole_reader(b_node, conv):
        bias_node = b_node
    else:
        return False
    out = w.shape[0]
    scale = torch.ones(out, dtype=torch.float64) if gamma is None else gamma.double()
    scale = scale / torch.sqrt(var.double() + eps)
    folded_bias = ((torch.zeros(out, dtype=torch.float64) if bias is None else bias.double()) - mean.double()) * scale
    if beta is not None:
        folded_bias = folded_bias + beta.double()
    _set_constant(ep, w_node, (w.double() * scale.reshape(-1, *[1] * (w.dim() - 1))).to(w.dtype))
    _set_constant(ep, bias_node, folded_bias.to(_constant(ep, bias_node).dtype))
    conv.args = (*conv.args[:2], bias_node, *conv.args[3:])
    for u in users:
        if u.args[1] == 0:
            u.replace_all_uses_with(conv)
            for spec in ep.graph_signature.output_specs:  # outputs are named after their nodes
                if getattr(spec.arg, "name", None) == u.name:
                    spec.arg.name = conv.name
    erase_dead(ep.graph, users)
    return True


def apply(ep: ExportedProgram) -> int:
    return sum(_fold(ep, bn) for bn in [n for n in ep.graph.nodes if is_op(n, BN)])
