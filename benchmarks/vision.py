"""Vision models on CPU: the delegate, eager torch and ExecuTorch XNNPACK, interleaved in one process.

ResNet-18/50, MobileNetV2/V3, EfficientNet-B0 and a ViT-B/16-shaped model at 224x224, batch 1 and 8,
built from transformers configs with random weights (timm and torchvision are not installable beside
our torch pin), rescaled to a trained network's scale (`trained_like`: EfficientNet's own init sends
every activation to zero), in eval mode. Each engine is checked against eager torch, then the engines take turns
in rotating rounds, each turn one untimed call and then calls back to back for ~50 ms (an engine's steady
state, as a serving loop runs it, not the hand-over from the engine before); each sample records the
turn's wall time and the process's CPU time per call (every thread counts, so a runtime that spins while
waiting shows it). transformers has no MobileNetV3 (and timm
needs torchvision), so MobileNetV3-Large is built here from `torch.nn` modules after the paper's layer table.

- mlx_delegate: `MLXPartitioner`, loaded by the stock `executorch.runtime`, compiled graphs (default)
- eager torch: the module itself under `torch.no_grad()`, 2 threads
- ET XNNPACK: the same export lowered with `XnnpackPartitioner`

    python benchmarks/vision.py [--quick] [--models resnet18,mobilenet_v2] [--batches 1,8]
                                [--engines delegate,eager,xnnpack] [--budget S] [--json out.json]
                                [--off fold_conv_pad+fuse_conv_residual,fuse_conv_activation]
                                [--conv-tiles-off] [--winograd 0,2,4] [--threads N] [--int8]

--off: one more delegate engine per comma-separated entry, lowered with those `MLXPartitioner`
switches off (`+` joins several in one engine), timed in turn with the others (a fusion's A/B).
--conv-tiles-off: one more delegate engine running the CPU convolution's whole-image passes and
row-by-row depthwise loop (`_runtime.set_conv_tiles(False)` around its calls) instead of its tiles,
channel blocks and padded depthwise grid (the kernel's A/B, same program).
--winograd MODES: one more delegate engine per mode with the CPU convolution's Winograd switch at that
mode during its calls (`_runtime.set_conv_winograd`: 0 off, i.e. im2col for every 3x3; 2 / 4 F(2x2) /
F(4x4) on every 3x3 stride-1 convolution; the default engine runs 1, the measured gate).
--threads N: eager torch's thread count (default 2); `taskset -c 1 ... --threads 1` compares the
engines' work on one core, where a loaded machine's scheduling weighs least.

--int8: the models quantized as ExecuTorch documents for XNNPACK (PT2E, XNNPACKQuantizer, static
per-channel int8, calibrated on the input): every engine runs the converted model (eager: its
quantize / dequantize arithmetic in float; XNNPACK: its int8 kernels; the delegate: float products on
weights dequantized at lowering, activations quantized and dequantized as the model says).
--quick: ResNet-18 and MobileNetV2 at batch 1, fewer rounds. Nothing fails here.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from typing import Any

import common
import numpy as np
import torch
from common import ENGINES, QUICK, Settings, Workload, fmt_time, format_table, machine_meta

import mlx_delegate
import mlx_delegate.partitioner


def _hf(model_cls: str, config_cls: str, **config: Any) -> torch.nn.Module:
    """A transformers image classifier with random weights, taking pixels and returning logits."""
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**config)
    return Logits(getattr(transformers, model_cls)(cfg).eval())


class Logits(torch.nn.Module):
    """A transformers image model returning its first output tensor only (the engines compare tensors)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.inner(pixel_values=pixel_values)[0]


def _divisible8(c: float) -> int:
    """Channels rounded to a multiple of 8, never more than 10 % below c (MobileNet's rule)."""
    r = max(8, int(c + 4) // 8 * 8)
    return r + 8 if r < 0.9 * c else r


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1,
             act: type[torch.nn.Module] | None = None) -> torch.nn.Sequential:
    layers = [torch.nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), torch.nn.BatchNorm2d(cout)]
    return torch.nn.Sequential(*layers, *([act()] if act else []))


class _SqueezeExcite(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        mid = _divisible8(c / 4)
        self.gate = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Conv2d(c, mid, 1), torch.nn.ReLU(),
                                        torch.nn.Conv2d(mid, c, 1), torch.nn.Hardsigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(x)


class _InvertedResidual(torch.nn.Module):
    """Expand 1x1 (skipped when it would not widen), depthwise k x k, optional squeeze-excite, project 1x1."""

    def __init__(self, cin: int, k: int, expand: int, cout: int, se: bool, act: type[torch.nn.Module],
                 stride: int) -> None:
        super().__init__()
        layers = [] if expand == cin else [_conv_bn(cin, expand, 1, act=act)]
        layers += [_conv_bn(expand, expand, k, stride, groups=expand, act=act)]
        layers += [_SqueezeExcite(expand)] if se else []
        layers += [_conv_bn(expand, cout, 1)]
        self.block = torch.nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


# MobileNetV3-Large's bottlenecks (Howard et al. 2019, table 1): kernel, expansion, out, SE, hard-swish, stride.
_V3_LARGE = [(3, 16, 16, 0, 0, 1), (3, 64, 24, 0, 0, 2), (3, 72, 24, 0, 0, 1), (5, 72, 40, 1, 0, 2),
             (5, 120, 40, 1, 0, 1), (5, 120, 40, 1, 0, 1), (3, 240, 80, 0, 1, 2), (3, 200, 80, 0, 1, 1),
             (3, 184, 80, 0, 1, 1), (3, 184, 80, 0, 1, 1), (3, 480, 112, 1, 1, 1), (3, 672, 112, 1, 1, 1),
             (5, 672, 160, 1, 1, 2), (5, 960, 160, 1, 1, 1), (5, 960, 160, 1, 1, 1)]


class MobileNetV3Large(torch.nn.Module):
    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers, c = [_conv_bn(3, 16, 3, 2, act=torch.nn.Hardswish)], 16
        for k, e, out, se, hs, s in _V3_LARGE:
            layers.append(_InvertedResidual(c, k, e, out, bool(se), torch.nn.Hardswish if hs else torch.nn.ReLU, s))
            c = out
        layers += [_conv_bn(c, 960, 1, act=torch.nn.Hardswish), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()]
        self.features = torch.nn.Sequential(*layers)
        self.head = torch.nn.Sequential(torch.nn.Linear(960, 1280), torch.nn.Hardswish(), torch.nn.Dropout(0.2),
                                        torch.nn.Linear(1280, classes))
        self.eval()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(pixel_values))


@torch.no_grad()
def trained_like(module: torch.nn.Module) -> torch.nn.Module:
    """Weights at a trained network's scale: He-initialised convolutions and BatchNorm statistics and
    affine terms near identity. Without it transformers' EfficientNet (BatchNorm weights drawn with std
    0.02) sends every activation to zero or subnormal values within a few blocks, and MobileNetV2's logits
    fall to ~1e-21: the parity check then compares zeros, and every engine runs on subnormals."""
    g = torch.Generator().manual_seed(0)
    for m in module.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (2.0 / m.weight[0].numel()) ** 0.5)
        elif isinstance(m, torch.nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.rand(n, generator=g) * 0.2 - 0.1)
            m.running_var.copy_(torch.rand(n, generator=g) + 0.5)
            m.weight.copy_(torch.rand(n, generator=g) + 0.5)
            m.bias.copy_(torch.rand(n, generator=g) * 0.2 - 0.1)
    return module


# name -> builder. Shapes follow the reference architectures at 224x224 with 1000 classes.
MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "resnet18": lambda: _hf("ResNetForImageClassification", "ResNetConfig", layer_type="basic", depths=[2, 2, 2, 2],
                            hidden_sizes=[64, 128, 256, 512], embedding_size=64, num_labels=1000),
    "resnet50": lambda: _hf("ResNetForImageClassification", "ResNetConfig", layer_type="bottleneck",
                            depths=[3, 4, 6, 3], hidden_sizes=[256, 512, 1024, 2048], embedding_size=64,
                            num_labels=1000),
    "mobilenet_v2": lambda: _hf("MobileNetV2ForImageClassification", "MobileNetV2Config", image_size=224,
                                depth_multiplier=1.0, num_labels=1000),
    "mobilenet_v3": MobileNetV3Large,
    "efficientnet_b0": lambda: _hf("EfficientNetForImageClassification", "EfficientNetConfig", image_size=224,
                                   width_coefficient=1.0, depth_coefficient=1.0, dropout_rate=0.2,
                                   hidden_dim=1280, num_labels=1000),
    "vit_b16": lambda: _hf("ViTForImageClassification", "ViTConfig", image_size=224, patch_size=16,
                           hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                           num_labels=1000),
}
QUICK_MODELS = ("resnet18", "mobilenet_v2")
VISION_ENGINES = ("delegate", "eager", "xnnpack")


def pt2e_int8(module: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
    """`module` quantized as ExecuTorch documents for XNNPACK: PT2E with XNNPACKQuantizer, static
    per-channel int8, calibrated on `x`."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer, get_symmetric_quantization_config)
    from torchao.quantization.pt2e import allow_exported_model_train_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    prepared = prepare_pt2e(torch.export.export(module.eval(), (x,)).module(), quantizer)
    with torch.no_grad():
        prepared(x)
    converted = convert_pt2e(prepared)
    allow_exported_model_train_eval(converted)  # the engines call .eval() on every module
    return Converted(converted)


class Converted(torch.nn.Module):
    """A PT2E graph module behind a plain module (its own .eval() returns None)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def workloads(models: Sequence[str], batches: Sequence[int], int8: bool = False) -> Any:
    for name in models:
        module = trained_like(MODELS[name]())
        for batch in batches:
            x = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(batch))
            if int8:  # each batch size is its own export (PT2E's graph module has fixed shapes)
                yield Workload(f"{name} int8 b{batch}", pt2e_int8(module, x), (x,), mlx_factory=lambda: None)
            else:
                yield Workload(f"{name} b{batch}", module, (x,), mlx_factory=lambda: None)
        del module
        gc.collect()


# Each engine's turn in a round: one untimed call, then calls back to back for about this long. A turn of
# one call measured the hand-over, not the engine: after eager torch's call its OpenMP worker spins for
# milliseconds against the next engine's threads (XNNPACK's ResNet-18 b1 14.6 ms in that rotation against
# 7.9 back to back, 2026-11-28), and the delegate's OpenMP-team lending turned that spin to its own use.
TURN_S = 0.05


def time_wall_cpu(runs: dict[str, Callable[[], Any]], estimate_s: dict[str, float],
                  s: Settings) -> dict[str, list[tuple[float, float]]]:
    """(wall, CPU) seconds per call, one sample per round: the mean over one engine's turn (an untimed
    call, then calls back to back for about TURN_S), engines taking turns in a rotating order."""
    inner = {k: max(1, min(200, round(TURN_S / max(estimate_s[k], 1e-9)))) for k in runs}
    rounds = {k: max(s.min_rounds, min(s.max_rounds, int(s.budget_s / max(estimate_s[k] * (inner[k] + 1), 1e-9))))
              for k in runs}
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    order = list(runs)
    gc.disable()  # a collection inside one engine's turn would be charged to it
    try:
        for r in range(max(rounds.values(), default=0)):
            active = [k for k in order if r < rounds[k]]
            shift = r % len(active) if active else 0
            for k in active[shift:] + active[:shift]:
                runs[k]()  # the hand-over from the previous engine
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(inner[k]):
                    runs[k]()
                n = inner[k]
                samples[k].append(((time.perf_counter() - t0) / n, (time.process_time() - c0) / n))
    finally:
        gc.enable()
    return samples


def run_case(w: Workload, engines: Sequence[str], s: Settings) -> list[dict[str, Any]]:
    with torch.no_grad():
        reference = common.to_numpy(w.module.eval()(*w.inputs))
    results = {k: common.Result(w.case, ENGINES[k][0]) for k in engines}
    ready = {}
    for k in engines:
        print(f"  {w.case}: preparing {ENGINES[k][0]} ...", file=sys.stderr, flush=True)
        got = common._prepare(k, w, reference, s, results)
        if got is not None:
            ready[k] = got
    print(f"  {w.case}: timing {len(ready)} engines ...", file=sys.stderr, flush=True)
    samples = time_wall_cpu({k: p.run for k, (p, _) in ready.items()}, {k: e for k, (_, e) in ready.items()}, s)
    rows = []
    for k, res in results.items():
        xs = samples.get(k, [])
        row = asdict(res) | {"key": k, "cpu_s": None}
        if xs:
            row |= {"median_s": float(np.median([a for a, _ in xs])), "cpu_s": float(np.median([c for _, c in xs])),
                    "rounds": len(xs)}
        rows.append(row)
    del ready
    gc.collect()
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Wall and CPU per call side by side, with the delegate's speed relative to eager and XNNPACK."""
    by = {(r["case"], r["key"]): r["median_s"] for r in rows}
    headers = ["case", "engine", "wall", "CPU", "n", "x eager", "x XNNPACK", "max|err|", "load", "delegation / error"]
    out, last = [], None
    for r in rows:
        wall = r["median_s"]
        rel = lambda key: "-" if not wall or not by.get((r["case"], key)) else f"{by[(r['case'], key)] / wall:.2f}x"
        err = r["max_abs_err"]
        out.append([r["case"] if r["case"] != last else "", r["engine"], fmt_time(wall), fmt_time(r["cpu_s"]),
                    str(r["rounds"] or "-"), rel("eager"), rel("xnnpack"), "-" if err is None else f"{err:.1e}",
                    fmt_time(r["load_s"]), f"ERROR {r['error']}" if r["error"] else r["note"]])
        last = r["case"]
    note = "x eager / x XNNPACK: that engine's wall time over this row's (above 1.00x: this row is faster)"
    return format_table(headers, out, [False, False] + [True] * 7 + [False]) + "\n" + note


def _conv_tiles_off(engine: common.Engine) -> common.Engine:
    """`engine` with the CPU convolution's tiled path off during its calls (the same program)."""
    from mlx_delegate import _runtime

    return common.switched(engine, _runtime.conv_tiles, _runtime.set_conv_tiles, False)


def _winograd(engine: common.Engine, mode: int) -> common.Engine:
    """`engine` with the CPU convolution's Winograd mode at `mode` during its calls (its own program)."""
    from mlx_delegate import _runtime

    return common.switched(engine, _runtime.conv_winograd, _runtime.set_conv_winograd, mode)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="ResNet-18 and MobileNetV2 at batch 1, fewer rounds")
    p.add_argument("--models", help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--batches", help="comma-separated batch sizes (default 1,8; --quick: 1)")
    p.add_argument("--engines", default=",".join(VISION_ENGINES), help=f"subset of {','.join(ENGINES)}")
    p.add_argument("--budget", type=float, help="timed seconds per engine and case")
    p.add_argument("--json", metavar="PATH", help="also write meta and results as JSON")
    p.add_argument("--off", help="extra delegate engines with partitioner switches off: a,b+c")
    p.add_argument("--threads", type=int, help="eager torch's thread count (default 2)")
    p.add_argument("--int8", action="store_true", help="the models quantized with PT2E (XNNPACKQuantizer, per channel)")
    p.add_argument("--conv-tiles-off", action="store_true",
                   help="an extra delegate engine with the CPU convolution's tiled path off")
    p.add_argument("--winograd", help="extra delegate engines at these Winograd modes: 0 (off), 2, 4")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    models = args.models.split(",") if args.models else list(QUICK_MODELS if args.quick else MODELS)
    if unknown := set(models) - set(MODELS):
        p.error(f"unknown models {sorted(unknown)}; choose from {list(MODELS)}")
    batches = [int(b) for b in (args.batches or ("1" if args.quick else "1,8")).split(",")]
    engines = [k for k in ENGINES if k in args.engines.split(",")]
    for entry in filter(None, (args.off or "").split(",")):
        off = frozenset(entry.split("+"))
        if unknown := off - set(mlx_delegate.partitioner.SWITCHES):
            p.error(f"unknown switches {sorted(unknown)}; choose from {mlx_delegate.partitioner.SWITCHES}")
        key = f"delegate-{entry}-off"
        ENGINES[key] = (f"mlx_delegate, {entry} off",
                        common._executorch(lambda off=off: mlx_delegate.MLXPartitioner(disable=off)))
        engines.insert(1, key)
    if args.conv_tiles_off:
        ENGINES["delegate-tiles-off"] = ("mlx_delegate, conv tiles off", _conv_tiles_off(ENGINES["delegate"][1]))
        engines.insert(1, "delegate-tiles-off")
    for mode in filter(None, (args.winograd or "").split(",")):
        key = f"delegate-winograd-{mode}"
        ENGINES[key] = (f"mlx_delegate, winograd {mode}", _winograd(ENGINES["delegate"][1], int(mode)))
        engines.insert(1, key)
    settings = replace(QUICK if args.quick else Settings(budget_s=6.0, max_rounds=30), warmup=2)
    if args.budget is not None:
        settings = replace(settings, budget_s=args.budget)
    started = time.perf_counter()
    meta = machine_meta(bandwidth=False) | {"quick": args.quick, "int8": args.int8}
    rows: list[dict[str, Any]] = []
    for w in workloads(models, batches, args.int8):
        rows += run_case(w, engines, settings)
    meta |= {"loadavg_end": [round(x, 2) for x in os.getloadavg()], "peak_rss_mb": round(common.peak_rss_mb()),
             "wall_s": round(time.perf_counter() - started, 1)}
    common.print_report(meta, table(rows), args.json, {"results": rows})


if __name__ == "__main__":
    main()
