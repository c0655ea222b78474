"""The CPU RoPE kernel (cpp/kernels/rope_cpu.cpp) that replaces MLX's composed mx::fast::rope on the CPU:
it runs (call counter), and matches eager PyTorch and the kernels-off path (MLX's own composition) for
int and tensor offsets, traditional and half-split layouts, base and explicit frequencies, rotating
fewer features than the head size, a position scale, every float dtype, one and several positions,
and inside a compiled graph."""

import pytest
import torch
from executorch.runtime import Runtime
from torch.export import Dim

from mlx_delegate import _runtime
from mlx_delegate.custom_ops import rope, rope_at
from mlx_delegate.ir import nodes as N
from mlx_delegate.pipelines.llm.export import lower as lower_with_patterns
from mlx_delegate.testing import TOLERANCE, assert_close, cpu_kernels_active, delegate_payload

HEAD, HEADS, MAX_LEN, BASE = 16, 3, 8, 10000.0
DTYPE_NAMES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# (L, first position): the start, a middle position, the last steps of a 4096-token context.
RUNS = [(3, 0), (1, 5), (5, 5), (1, 4095), (MAX_LEN, 4088)]


def standard_freqs(dims: int) -> torch.Tensor:
    return 1.0 / (BASE ** (torch.arange(0, dims, 2, dtype=torch.float32) / dims))


def scaled_freqs(dims: int) -> torch.Tensor:
    """Not base ** (-2i / D) (llama3-like): the frequencies travel as a tensor."""
    f = standard_freqs(dims)
    return torch.where(f < 1e-3, f / 8, f)


class RopeAt(torch.nn.Module):
    """The position as a one-element tensor (the compiled decode graph's form)."""

    def __init__(self, freqs: torch.Tensor, traditional: bool, base: float | None) -> None:
        super().__init__()
        self.register_buffer("inv_freq", freqs)
        self.traditional, self.base = traditional, base

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return rope_at(x, self.inv_freq, pos, self.traditional, self.base)


class RopeInt(RopeAt):
    """The position as an int read on the host (an int offset in the IR)."""

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        start = pos.item()
        torch._check(start >= 0)
        return rope(x, self.inv_freq, start, self.traditional, self.base)


def payload(offset: str, traditional: bool, with_base: bool, dtype: torch.dtype,
            dims: int = HEAD, scale: float = 1.0) -> tuple[bytes, dict]:
    """The delegate payload of one RoPE over x [1, HEADS, L, HEAD] (L dynamic); the RopeNode is then
    given `dims` and `scale` (the exporter always writes the whole head and scale 1)."""
    freqs = standard_freqs(HEAD) if with_base else scaled_freqs(HEAD)
    module = (RopeAt if offset == "tensor" else RopeInt)(freqs, traditional, BASE if with_base else None)
    x = torch.randn(1, HEADS, 2, HEAD).to(dtype)
    ep = torch.export.export(module.eval(), (x, torch.tensor([0])),
                             dynamic_shapes=({2: Dim("L", min=1, max=MAX_LEN)}, None), strict=True)
    data, named = delegate_payload(lower_with_patterns(ep))
    program = N.deserialize(data)
    (node,) = [i.node for i in program.instructions if type(i.node).__name__ == "RopeNode"]
    node.dims, node.scale = dims, scale
    return N.serialize(program), named


def run(data: bytes, named: dict, x: torch.Tensor, pos: int) -> torch.Tensor:
    given = {"x": (DTYPE_NAMES[x.dtype], list(x.shape), x.contiguous().view(torch.uint8).numpy().tobytes()),
             "pos": ("i64", [1], torch.tensor([pos]).numpy().tobytes())}
    # The delegate's inputs in its own order (the int-position graph reads the position first).
    order = [slot.name for slot in N.deserialize(data).inputs]
    ((name, shape, out),) = _runtime.run_payload(data, named, [given[k] for k in order])
    assert name == DTYPE_NAMES[x.dtype]
    return torch.frombuffer(bytearray(out), dtype=x.dtype).reshape(shape)


def reference(x: torch.Tensor, pos: int, inv_freq: torch.Tensor, traditional: bool, dims: int,
              scale: float) -> torch.Tensor:
    """Eager RoPE in float32, rounded once to x's dtype: features [0, dims) rotated at positions
    (pos + l) * scale, the rest copied."""
    positions = (torch.arange(x.shape[-2], dtype=torch.float32) + pos) * scale
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    xf, rest = x[..., :dims].float(), x[..., dims:].float()
    if traditional:
        a, b = xf[..., 0::2], xf[..., 1::2]
        rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)
    else:
        a, b = xf[..., : dims // 2], xf[..., dims // 2:]
        rotated = torch.cat((a * cos - b * sin, a * sin + b * cos), -1)
    return torch.cat((rotated, rest), -1).to(x.dtype)


def reference_freqs(with_base: bool, dims: int) -> torch.Tensor:
    """The frequencies as MLX's rope takes them: exp(-i * log(base) / half) for a base (over the
    rotated dims), else the given ones through MLX's two float32 reciprocals."""
    if with_base:
        half = dims // 2
        step = torch.log(torch.tensor(BASE, dtype=torch.float32)) / half
        return torch.exp(-torch.arange(half, dtype=torch.float32) * step)
    return 1.0 / (1.0 / scaled_freqs(dims))


def rope_calls() -> int:
    return _runtime.cpu_kernel_call_counts().get("rope", 0)


def mlx_tolerance(dtype: torch.dtype, pos: int) -> tuple[float, float]:
    """A frequency 1 ulp apart moves the angle at position p by about p * 2^-24 rad."""
    rtol, atol = TOLERANCE[dtype]
    return rtol, atol + 4 * pos * 2.0 ** -24


@pytest.fixture
def kernels_on():
    """The CPU kernels switched on; yields how many rope-kernel calls one rope node makes: 1
    where they are active, 0 where they cannot be (MLX_DELEGATE_CPU_KERNELS=0 at start-up, or a
    GPU default device, where MLX's own rope runs and the results must still hold)."""
    was = _runtime.cpu_kernels_enabled()
    _runtime.set_cpu_kernels(True)
    yield int(cpu_kernels_active())
    _runtime.set_cpu_kernels(was)


@pytest.mark.parametrize("dtype", list(DTYPE_NAMES), ids=str)
@pytest.mark.parametrize("offset", ["tensor", "int"])
@pytest.mark.parametrize("traditional", [False, True], ids=["halves", "traditional"])
# Fewer rotated features than the head only with a base: MLX takes dims / 2 explicit frequencies and
# the exporter writes the whole head's.
@pytest.mark.parametrize("with_base,dims,scale", [(True, HEAD, 1.0), (False, HEAD, 1.0), (True, HEAD // 2, 0.5)],
                         ids=["base", "freqs", "base-part-scaled"])
def test_rope_kernel_matches_eager_and_mlx(kernels_on, dtype, offset, traditional, with_base, dims, scale):
    data, named = payload(offset, traditional, with_base, dtype, dims, scale)
    freqs = reference_freqs(with_base, dims)
    for length, pos in RUNS:
        x = torch.randn(1, HEADS, length, HEAD).to(dtype)
        before = rope_calls()
        got = run(data, named, x, pos)
        assert rope_calls() - before == kernels_on
        # Where the kernel cannot run, MLX's own rope serves `got`: its tolerance (below).
        tol = TOLERANCE[dtype] if kernels_on else mlx_tolerance(dtype, pos)
        assert_close([got], reference(x, pos, freqs, traditional, dims, scale), *tol)
        _runtime.set_cpu_kernels(False)
        try:
            mlx_own = run(data, named, x, pos)
        finally:
            _runtime.set_cpu_kernels(True)
        assert rope_calls() - before == kernels_on
        # MLX rounds cos / sin and each product to x's dtype (half types get their tolerance) and
        # computes exp for the base frequencies its own way (float32 angles drift with the position).
        assert_close([got], mlx_own, *mlx_tolerance(dtype, pos))
        assert torch.equal(got[..., dims:], x[..., dims:])


def test_rope_kernel_handles_a_transposed_input(kernels_on):
    """x [B, L, H, D] transposed to [B, H, L, D] (how attention feeds q and k) is read through its strides."""

    class Transposed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("inv_freq", standard_freqs(HEAD))

        def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return rope_at(x.transpose(1, 2), self.inv_freq, pos, False, BASE)

    module = Transposed().eval()
    x = torch.randn(1, 4, HEADS, HEAD)
    ep = torch.export.export(module, (x, torch.tensor([0])), strict=True)
    method_program = Runtime.get().load_program(lower_with_patterns(ep).to_executorch().buffer)
    method = method_program.load_method("forward")
    before = rope_calls()
    (got,) = method.execute([x, torch.tensor([7])])
    assert rope_calls() - before == kernels_on
    expected = reference(x.transpose(1, 2), 7, reference_freqs(True, HEAD), False, HEAD, 1.0)
    assert_close([got], expected, *(TOLERANCE[torch.float32] if kernels_on else mlx_tolerance(torch.float32, 7)))


def test_rope_kernel_in_a_compiled_graph(kernels_on, compile_on):
    """One compiled graph serves every position: the kernel reads the position when it runs."""
    module = RopeAt(standard_freqs(HEAD), False, BASE).eval()
    ep = torch.export.export(module, (torch.randn(1, HEADS, 1, HEAD), torch.tensor([0])), strict=True)
    program = Runtime.get().load_program(lower_with_patterns(ep).to_executorch().buffer)
    method = program.load_method("forward")
    stats_before, calls_before = _runtime.compile_stats(), rope_calls()
    positions = (0, 7, 3, 4095, 12)
    for pos in positions:
        x = torch.randn(1, HEADS, 1, HEAD)
        expected = reference(x, pos, reference_freqs(True, HEAD), False, HEAD, 1.0)
        tol = TOLERANCE[torch.float32] if kernels_on else mlx_tolerance(torch.float32, pos)  # MLX's rope
        assert_close(method.execute([x, torch.tensor([pos])]), expected, *tol)
    stats = {k: v - stats_before[k] for k, v in _runtime.compile_stats().items()}
    assert stats == {"interpreted_calls": 1, "compiled_calls": 4, "traces": 1, "rejected": 0}
    assert rope_calls() - calls_before == len(positions) * kernels_on
