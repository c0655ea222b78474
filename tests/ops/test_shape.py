"""Parity tests for shape and layout ops (mlx_delegate/ops/shape.py and layout.py).

A delegate partition made only of `view_copy` is not worth a call, so rows that
test a bare reshape add some work (`* 2`, a permute) around it.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

from mlx_delegate.testing import FLOATS, cases, lower_and_compare

# int8 and int16 too: the narrow types wrap on overflow and promote differently in torch
# (sums and products to int64) than MLX does by itself.
INTS = (torch.int8, torch.int16, torch.int32, torch.int64)
ALL = FLOATS + INTS + (torch.bool,)
FP32 = (torch.float32,)


def make(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(*shape).to(dtype)
    if dtype == torch.bool:
        return torch.rand(*shape) > 0.5
    return torch.randint(-50, 50, shape, dtype=dtype)


def rows(name, fn, *shapes, dtypes=FLOATS, **kw):
    """One config per dtype; every input tensor gets that dtype."""
    out = []
    for dt in dtypes:
        out += cases(name, fn, lambda dt=dt: tuple(make(s, dt) for s in shapes), (dt,), **kw)
    return out


def dynamic(name, fn, shapes, dims, more, dtypes=FP32):
    """Rows exported with a dynamic dim per input ({axis: Dim}) and run at more shapes."""
    out = []
    for dt in dtypes:
        out += cases(name, fn, lambda dt=dt: tuple(make(s, dt) for s in shapes), (dt,),
                     dynamic_shapes=(dims,),  # Lambda's inputs arrive as one *args tuple
                     more_inputs=lambda dt=dt: [tuple(make(s, dt) for s in run) for run in more])
    return out


B = Dim("b", min=2, max=16)
N = Dim("n", min=4, max=32)  # x[1:n-1] guards n - 2 != 1

RESHAPE = [
    *rows("reshape_noncontig", lambda x: x.t().reshape(3, 8), (4, 6), dtypes=ALL),
    *rows("view_minus1", lambda x: x.view(-1, 4) * 2, (2, 3, 4)),
    *rows("flatten", lambda x: x.flatten(1) * 2, (2, 3, 4), dtypes=FP32 + INTS),
    *rows("flatten_all", lambda x: x.transpose(0, 1).flatten(), (2, 3, 4), dtypes=FP32),
    *rows("unflatten", lambda x: x.unflatten(1, (2, 3)) * 2, (4, 6)),
    *rows("view_zero_size", lambda x: x.view(3, 0, 2) * 2, (0, 6), dtypes=FP32),
    *rows("view_to_scalar", lambda x: x.view(()) * 2, (1, 1), dtypes=FP32),
    *rows("permute", lambda x: x.permute(2, 0, 1), (2, 3, 4), dtypes=ALL),
    *rows("permute_negative", lambda x: x.permute(-1, -3, -2), (2, 3, 4), dtypes=FP32),
    *rows("permute_zero_size", lambda x: x.permute(1, 0, 2), (2, 0, 4), dtypes=FP32),
    *rows("transpose", lambda x: x.transpose(0, 2), (2, 3, 4), dtypes=FLOATS + INTS),
    *rows("transpose_same_dim", lambda x: x.transpose(1, 1) * 2, (2, 3), dtypes=FP32),
    *rows("t", lambda x: x.t(), (3, 5), dtypes=FLOATS + (torch.bool,)),
    *rows("t_1d", lambda x: x.t() * 2, (5,), dtypes=FP32),
    *rows("mT", lambda x: x.mT, (2, 3, 5), dtypes=FP32),
    *rows("unsqueeze", lambda x: x.t().unsqueeze(1), (3, 4), dtypes=FLOATS + INTS),
    *rows("unsqueeze_last", lambda x: x.unsqueeze(-1) * 2, (3, 4), dtypes=FP32),
    *rows("unsqueeze_scalar", lambda x: x[0].unsqueeze(0) * 2, (3,), dtypes=FP32),
    *rows("squeeze_all", lambda x: x.squeeze() * 2, (1, 3, 1, 4), dtypes=FLOATS + INTS),
    *rows("squeeze_dim", lambda x: x.squeeze(2) * 2, (1, 3, 1, 4), dtypes=FP32),
    *rows("squeeze_dims", lambda x: x.squeeze((0, -2)) * 2, (1, 3, 1, 4), dtypes=FP32),
    *rows("squeeze_not_one", lambda x: x.squeeze(1) * 2, (1, 3, 1, 4), dtypes=FP32),
    *rows("squeeze_noncontig", lambda x: x.transpose(0, 3).squeeze(3), (1, 3, 1, 4), dtypes=FP32),
]

EXPAND = [
    *rows("expand", lambda x: x.expand(3, 4), (3, 1), dtypes=ALL),
    *rows("expand_new_dims", lambda x: x.expand(2, 3, 4), (3, 1), dtypes=FLOATS),
    *rows("expand_minus1", lambda x: x.expand(2, -1, 5), (3, 1), dtypes=FP32),
    *rows("expand_as", lambda x, y: x.expand_as(y), (1, 6), (4, 6), dtypes=FP32 + INTS),
    *rows("broadcast_to", lambda x: torch.broadcast_to(x.t(), (2, 4, 3)), (3, 4), dtypes=FP32),
    *rows("expand_zero", lambda x: x.expand(0, 4), (1, 4), dtypes=FP32),
    *rows("repeat", lambda x: x.repeat(2, 3), (3, 4), dtypes=ALL),
    *rows("repeat_more_dims", lambda x: x.repeat(2, 1, 2), (3, 4), dtypes=FLOATS),
    *rows("repeat_zero", lambda x: x.repeat(0, 2), (3, 4), dtypes=FP32),
    *rows("repeat_noncontig", lambda x: x.t().repeat(1, 2), (3, 4), dtypes=FP32 + INTS),
    *rows("tile", lambda x: x.tile((2,)), (3, 4), dtypes=FP32),
    *rows("repeat_interleave", lambda x: x.repeat_interleave(2, dim=1), (3, 4), dtypes=FLOATS + INTS),
    *rows("repeat_interleave_flat", lambda x: x.repeat_interleave(3), (2, 3), dtypes=FP32),
]

SLICING = [
    *rows("slice_step", lambda x: x[:, 1:5:2], (4, 6), dtypes=ALL),
    *rows("slice_start", lambda x: x[1:] * 2, (4, 6), dtypes=FP32),
    *rows("slice_negative", lambda x: x[-3:, :-1] * 2, (4, 6), dtypes=FLOATS),
    *rows("slice_clamped", lambda x: x[2:100, -100:2] * 2, (4, 6), dtypes=FP32),
    *rows("slice_empty", lambda x: x[3:1] * 2, (4, 6), dtypes=FP32),
    *rows("slice_big_step", lambda x: x[..., ::4] * 2, (2, 3, 9), dtypes=FP32 + INTS),
    *rows("slice_noncontig", lambda x: x.t()[1:3], (4, 6), dtypes=FP32),
    *rows("narrow", lambda x: x.narrow(1, 1, 3) * 2, (4, 6), dtypes=FLOATS + INTS),
    *rows("select", lambda x: x[1] * 2, (4, 6), dtypes=FLOATS + INTS),
    *rows("select_negative", lambda x: x[:, -1] * 2, (4, 6), dtypes=FP32),
    *rows("select_noncontig", lambda x: x.transpose(0, 2)[..., 1], (2, 3, 4), dtypes=FP32 + (torch.bool,)),
    *rows("select_to_scalar", lambda x: x[2] * 2, (5,), dtypes=FP32),
    *rows("unbind", lambda x: x.unbind(1), (3, 4), dtypes=FLOATS + INTS),
    *rows("unbind_first", lambda x: [t * 2 for t in x.unbind(0)], (2, 3, 4), dtypes=FP32),
    *rows("split", lambda x: x.split(4, 1), (4, 10), dtypes=FLOATS + INTS + (torch.bool,)),
    *rows("split_even", lambda x: [t * 2 for t in x.split(2, 0)], (4, 3), dtypes=FP32),
    *rows("split_with_sizes", lambda x: x.split([1, 3, 2], -1), (4, 6), dtypes=FLOATS),
    *rows("split_zero_piece", lambda x: x.t().split([0, 4], 1), (4, 6), dtypes=FP32),
    *rows("chunk", lambda x: x.chunk(3, 0), (7, 2), dtypes=FP32 + INTS),
    *rows("tensor_split", lambda x: x.tensor_split(3, 1), (2, 7), dtypes=FP32),
]

JOINING = [
    *rows("cat", lambda x, y: torch.cat([x, y], 1), (2, 3), (2, 5), dtypes=ALL),
    *rows("cat_three_negative_dim", lambda x, y, z: torch.cat([x, y, z], -1), (2, 1), (2, 3), (2, 2)),
    *rows("cat_dim0_noncontig", lambda x, y: torch.cat([x.t(), y]), (4, 3), (2, 4), dtypes=FP32),
    *rows("cat_zero_size", lambda x, y: torch.cat([x, y], 0), (0, 4), (3, 4), dtypes=FP32 + INTS),
    *rows("cat_legacy_empty", lambda x, y: torch.cat([x, y]) * 2, (0,), (3, 4), dtypes=FP32),
    *rows("cat_same_input", lambda x: torch.cat([x, x, x], 1), (2, 2), dtypes=FP32),
    *cases("cat_promote", lambda x, y: torch.cat([x, y], 0), lambda: (torch.randn(2, 3),
                                                                     torch.randint(0, 9, (1, 3))), (None,)),
    *rows("stack", lambda x, y: torch.stack([x, y]), (2, 3), (2, 3), dtypes=ALL),
    *rows("stack_last", lambda x, y: torch.stack([x, y.t()], -1), (2, 3), (3, 2), dtypes=FLOATS),
    *rows("stack_middle_one", lambda x: torch.stack([x], 1) * 2, (2, 3), dtypes=FP32),
    *rows("hstack", lambda x, y: torch.hstack([x, y]), (2, 3), (2, 1), dtypes=FP32),
]

MOVING = [
    *rows("roll", lambda x: x.roll(2, 1), (4, 6), dtypes=ALL),
    *rows("roll_two_dims", lambda x: x.roll((1, -2), (0, 1)), (4, 6), dtypes=FLOATS),
    *rows("roll_flat", lambda x: x.roll(3), (3, 4), dtypes=FP32 + INTS),
    *rows("roll_big_shift", lambda x: x.roll(100, -1), (3, 7), dtypes=FP32),
    *rows("roll_noncontig", lambda x: x.t().roll(-1, 0), (3, 4), dtypes=FP32),
    *rows("flip", lambda x: x.flip(0), (4, 6), dtypes=ALL),
    *rows("flip_two", lambda x: x.flip((0, -1)), (2, 3, 4), dtypes=FLOATS),
    *rows("flip_zero_size", lambda x: x.flip(1) * 2, (3, 0), dtypes=FP32),
    *rows("fliplr", lambda x: torch.fliplr(x.t()), (3, 4), dtypes=FP32 + INTS),
    *rows("tril", lambda x: x.tril(), (4, 5), dtypes=FLOATS + INTS),
    *rows("tril_batched_offset", lambda x: x.tril(-1), (2, 4, 4), dtypes=FP32),
    *rows("triu", lambda x: x.triu(1), (5, 4), dtypes=FLOATS + (torch.bool,)),
    *rows("triu_noncontig", lambda x: x.t().triu(), (3, 4), dtypes=FP32),
]

PADDING = [
    *rows("pad_constant", lambda x: F.pad(x, (1, 2)), (3, 4), dtypes=FLOATS + INTS),
    *rows("pad_constant_2d_value", lambda x: F.pad(x, (1, 2, 3, 0), value=1.5), (2, 3, 4)),
    *rows("pad_constant_int_value", lambda x: F.pad(x, (0, 1, 1, 0), value=7), (3, 4), dtypes=INTS),
    *rows("pad_bool", lambda x: F.pad(x, (2, 1), value=True), (3, 4), dtypes=(torch.bool,)),
    *rows("pad_negative_crops", lambda x: F.pad(x, (-1, 2, 0, -2)), (4, 5), dtypes=FP32),
    *rows("pad_zero_size", lambda x: F.pad(x, (1, 1)), (0, 3), dtypes=FP32),
    *rows("pad_noncontig", lambda x: F.pad(x.t(), (1, 0, 0, 2)), (3, 4), dtypes=FP32),
    *rows("reflect_1d", lambda x: F.pad(x, (2, 3), mode="reflect"), (2, 3, 6)),
    *rows("reflect_1d_unbatched", lambda x: F.pad(x, (1, 1), mode="reflect"), (3, 4), dtypes=FP32),
    *rows("reflect_2d", lambda x: F.pad(x, (1, 2, 2, 1), mode="reflect"), (1, 2, 4, 5)),
    *rows("replicate_1d", lambda x: F.pad(x, (2, 3), mode="replicate"), (2, 3, 6)),
    *rows("replicate_2d", lambda x: F.pad(x, (0, 2, 3, 1), mode="replicate"), (1, 2, 4, 5)),
    *rows("replicate_3d", lambda x: F.pad(x, (1, 1, 0, 1, 2, 0), mode="replicate"), (1, 2, 3, 3, 4),
          dtypes=FP32),
    *rows("reflect_noncontig", lambda x: F.pad(x.transpose(1, 2), (1, 1), mode="reflect"), (2, 5, 3),
          dtypes=FP32),
]

DYNAMIC = [
    *dynamic("dyn_reshape", lambda x: x.reshape(x.shape[0], -1) * 2, [(3, 2, 4)], ({0: B},),
             [[(5, 2, 4)], [(2, 2, 4)]]),
    *dynamic("dyn_view_merge", lambda x: x.transpose(0, 1).reshape(2, -1), [(3, 2)], ({0: B},), [[(7, 2)]]),
    *dynamic("dyn_permute", lambda x: x.permute(1, 0, 2), [(3, 2, 4)], ({0: B},), [[(6, 2, 4)]],
             dtypes=FLOATS),
    *dynamic("dyn_unsqueeze_expand", lambda x: x.unsqueeze(1).expand(-1, 3, -1), [(3, 4)], ({0: B},),
             [[(9, 4)]]),
    *dynamic("dyn_expand_to_sym", lambda x, y: x.expand(y.shape[0], 4) + y, [(1, 4), (3, 4)],
             (None, {0: B}), [[(1, 4), (8, 4)]]),
    *dynamic("dyn_slice", lambda x: x[:, 1:x.shape[1] - 1], [(2, 6)], ({1: N},), [[(2, 9)], [(2, 4)]]),
    *dynamic("dyn_slice_tail", lambda x: x[:, -2:] * 2, [(2, 6)], ({1: N},), [[(2, 11)]]),
    *dynamic("dyn_select_last", lambda x: x[:, -1] * 2, [(2, 6)], ({1: N},), [[(2, 13)]]),
    *dynamic("dyn_cat", lambda x, y: torch.cat([x, y], 1), [(2, 5), (2, 4)], ({1: N}, None),
             [[(2, 9), (2, 4)]], dtypes=FLOATS),
    *dynamic("dyn_stack", lambda x, y: torch.stack([x, y], 1), [(3, 4), (3, 4)], ({0: B}, {0: B}),
             [[(5, 4), (5, 4)]]),
    *dynamic("dyn_split_sizes", lambda x: x.split([2, x.shape[1] - 2], 1), [(3, 6)], ({1: N},), [[(3, 11)]]),
    # Split along a static dim that follows a dynamic one: to_edge specialises the dynamic dim
    # (ExecuTorch, independent of this delegate), so the dynamic dim comes last here.
    *dynamic("dyn_chunk_static_dim", lambda x: x.chunk(2, 0), [(6, 5)], ({1: N},), [[(6, 9)]]),
    *dynamic("dyn_unbind", lambda x: x.unbind(1), [(3, 2)], ({0: B},), [[(7, 2)]]),
    *dynamic("dyn_repeat", lambda x: x.repeat(2, 3), [(3, 4)], ({0: B},), [[(5, 4)]]),
    *dynamic("dyn_roll", lambda x: x.roll(2, 0), [(4, 3)], ({0: B},), [[(3, 3)], [(9, 3)]]),
    *dynamic("dyn_flip", lambda x: x.flip(0), [(4, 3)], ({0: B},), [[(7, 3)]]),
    *dynamic("dyn_pad", lambda x: F.pad(x, (1, 2, 0, 1)), [(4, 3)], ({0: B},), [[(7, 3)]]),
    *dynamic("dyn_pad_to_multiple", lambda x: F.pad(x, (0, (-x.shape[1]) % 4)), [(2, 5)], ({1: N},),
             [[(2, 8)], [(2, 11)]]),
    *dynamic("dyn_reflect", lambda x: F.pad(x, (2, 2), mode="reflect"), [(2, 3, 5)], ({2: N},),
             [[(2, 3, 9)]]),
    *dynamic("dyn_tril", lambda x: x.tril(), [(4, 5)], ({0: B},), [[(6, 5)]]),
]

# Values a double cannot hold exactly are refused, so the op stays on ExecuTorch (and stays right).
REFUSED = [
    *rows("pad_int64_beyond_double", lambda x: F.pad(x, (1, 1), value=2**60 + 1), (2, 3),
          dtypes=(torch.int64,), segments=0, allowed_fallback=frozenset({"constant_pad_nd"})),
]

CASES = RESHAPE + EXPAND + SLICING + JOINING + MOVING + PADDING + DYNAMIC + REFUSED


@pytest.mark.parametrize("case", CASES, ids=str)
def test_shape(case):
    lower_and_compare(case)
