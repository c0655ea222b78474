"""Bad inputs and corrupt payloads give named errors; the process and the method survive."""

import random

import pytest
import torch

import mlx_delegate
from mlx_delegate import _runtime
from mlx_delegate.backend.preprocess import MLXDelegateBackend
from mlx_delegate.testing import assert_close, lower


class Small(torch.nn.Module):
    def forward(self, x, y):
        return torch.exp(x) * y + 1.0


@pytest.fixture(scope="module")
def lowered():
    return lower(Small(), (torch.randn(2, 3), torch.randn(2, 3)))


@pytest.mark.parametrize(
    "bad, message",
    [
        ((torch.randn(3, 3), torch.randn(2, 3)), ("dimension 0", "Expected shape (2, 3)")),
        ((torch.randn(2, 3, 1), torch.randn(2, 3)), ("rank", "input 0")),
        ((torch.randn(2, 3).to(torch.float16), torch.randn(2, 3)), ("dtype", "Input 0 has unexpected scalar type")),
        ((torch.randint(0, 4, (2, 3)), torch.randn(2, 3)), ("dtype", "Input 0 has unexpected scalar type")),
    ],
    ids=["shape", "rank", "dtype-half", "dtype-int"],
)
def test_bad_input_is_a_named_error_and_method_keeps_working(lowered, capfd, bad, message):
    method = lowered.method()
    with pytest.raises(Exception):
        method.execute(list(bad))
    # The stock runtime or our backend rejects it; either way the message names the problem.
    err = capfd.readouterr().err + _runtime.last_error()
    assert any(m in err for m in message), err
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    assert_close(method.execute([x, y]), Small()(x, y), 1e-5, 1e-6)


def test_wrong_number_of_inputs(lowered):
    with pytest.raises(Exception):
        lowered.method().execute([torch.randn(2, 3)])


def _payload(lowered) -> bytes:
    edge_ep = lowered.edge.exported_program()
    mod = next(m for _, m in edge_ep.graph_module.named_children() if hasattr(m, "processed_bytes"))
    return mod.processed_bytes


def test_check_payload_accepts_real_payload(lowered):
    # No named data is needed: this program has no constants besides a scalar, which is inline.
    payload = _payload(lowered)
    try:
        _runtime.check_payload(payload)
    except ValueError as e:  # constants live in the .pte's named data map
        assert "named data" in str(e)


@pytest.mark.parametrize("seed", range(40))
def test_corrupt_payload_is_rejected_without_crashing(lowered, seed):
    payload = bytearray(_payload(lowered))
    rng = random.Random(seed)
    for _ in range(rng.randint(1, 8)):
        payload[rng.randrange(len(payload))] = rng.randrange(256)
    if seed % 5 == 0:
        payload = payload[: rng.randrange(len(payload))]
    try:
        _runtime.check_payload(bytes(payload))
    except ValueError as e:
        assert str(e)  # the message names the problem


@pytest.mark.parametrize("seed", range(10))
def test_corrupt_pte_fails_cleanly(lowered, seed):
    from executorch.runtime import Runtime

    payload = _payload(lowered)
    buf = bytearray(lowered.buffer)
    start = bytes(buf).find(payload)
    assert start >= 0
    rng = random.Random(seed)
    for _ in range(4):
        buf[start + rng.randrange(len(payload))] ^= 0xFF
    program = Runtime.get().load_program(bytes(buf))
    try:
        method = program.load_method("forward")
        x, y = torch.randn(2, 3), torch.randn(2, 3)
        method.execute([x, y])  # a flip in a non-structural byte may still run
    except RuntimeError:
        pass


def test_backend_id_matches_runtime():
    assert _runtime.backend_id() == MLXDelegateBackend.__name__ == mlx_delegate.BACKEND_ID
    assert _runtime.register_backend()
