"""Fuzzing of the delegate's load + run entry point (atheris / libFuzzer).

Each fuzz input is one selector byte followed by a delegate payload. The
selector picks the seed program whose constants and inputs go with the payload
(low bits) and whether its named data is damaged too (high bits: a constant
dropped or truncated). Seeds are real payloads lowered at start-up.
`_runtime.run_payload` verifies, loads and runs the payload; every rejection
must be a ValueError with a message. Anything else (another exception, a crash,
a hang past -timeout) is a finding.

The runtime is not built with coverage instrumentation, so libFuzzer alone
would shrink the corpus to nothing; a custom mutator therefore always starts
from a seed (or a well-formed mutant of one) and applies libFuzzer's byte
mutations plus FlatBuffers-aware ones: aligned 32-bit words (slot ids, axes,
offsets, sizes) set to boundary values, and single bytes (dtypes, enum ops).

    python fuzz/fuzz_payload.py -max_total_time=3600          # long run
    python fuzz/fuzz_payload.py -max_total_time=45 -timeout=30  # what the test runs
    python fuzz/fuzz_payload.py crash-<hash>                  # replay one finding

Flags are libFuzzer's. Without a corpus directory argument the seeds are
written to a fresh temporary directory and used as the corpus.
"""

from __future__ import annotations

import collections
import random
import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlx_delegate import _runtime  # before mlx: installs the fast BLAS route

import mlx.core as mx  # noqa: E402
import torch  # noqa: E402

from mutate import set_byte, set_word  # noqa: E402
from seeds import Seed, build_seeds, from_arg  # noqa: E402

# Keep every tensor a fuzzed program may build small, so a run is quick and
# an absurd shape is a clean error rather than an out-of-memory kill.
MAX_TENSOR_BYTES = 16 << 20
MAX_OUTPUT_BYTES = 16 << 20

SEEDS: list[Seed] = []
OUTCOMES: collections.Counter[str] = collections.Counter()  # ran / rejected at load / failed at run


def run(seed: Seed, payload: bytes) -> list:
    return _runtime.run_payload(payload, seed.named_data, list(seed.inputs), MAX_OUTPUT_BYTES)


def check_seeds() -> None:
    """The unmodified seeds run and match eager PyTorch (proves the harness reaches execution)."""
    for seed in SEEDS:
        outs = [from_arg(o) for o in run(seed, seed.payload)]
        assert len(outs) == len(seed.expected), seed.name
        for got, want in zip(outs, seed.expected):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{seed.name}: {m}")


NAMED_DATA_MODES = 3  # keep, drop one constant, truncate one constant


def named_data(seed: Seed, mode: int) -> dict[str, bytes]:
    if mode == 0 or not seed.named_data:
        return seed.named_data
    data = dict(seed.named_data)
    key = sorted(data)[len(data) // 2]
    if mode == 1:
        del data[key]
    else:
        data[key] = data[key][: len(data[key]) // 2]
    return data


def test_one_input(data: bytes) -> None:
    if len(data) < 2:
        return
    seed = SEEDS[data[0] % len(SEEDS)]
    mode = (data[0] // len(SEEDS)) % NAMED_DATA_MODES
    try:
        _runtime.run_payload(data[1:], named_data(seed, mode), list(seed.inputs), MAX_OUTPUT_BYTES)
        OUTCOMES["ran"] += 1
    except ValueError as e:
        if not str(e):
            raise AssertionError("rejection without a message") from e
        OUTCOMES["failed at run" if str(e).startswith(("node ", "input ", "output ")) else "rejected at load"] += 1
    total = sum(OUTCOMES.values())
    if total & (total - 1) == 0 and total >= 1024:  # libFuzzer exits without atexit: report as it goes
        print(f"fuzz_payload outcomes after {total} runs: {dict(OUTCOMES)}", flush=True)


def mutate(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    # Start from a seed unless the current input still looks like a payload.
    if len(data) < 9 or data[5:9] != b"MXD1" or rng.random() < 0.3:
        i = rng.randrange(len(SEEDS))
        data = bytes([i + len(SEEDS) * rng.choice((0, 0, 0, 0, 1, 2))]) + SEEDS[i].payload
    selector, buf = data[0], bytearray(data[1:])
    for _ in range(rng.randint(1, 4)):
        kind = rng.random()
        if kind < 0.4:
            set_word(buf, rng)
        elif kind < 0.7:
            set_byte(buf, rng)
        else:
            buf = bytearray(atheris.Mutate(bytes(buf), max(max_size - 1, len(buf))))
    return bytes([selector]) + bytes(buf[: max_size - 1])


def write_corpus(directory: Path) -> None:
    for i, seed in enumerate(SEEDS):
        (directory / f"seed-{seed.name}").write_bytes(bytes([i]) + seed.payload)


def main(argv: list[str]) -> None:
    _runtime.set_max_tensor_bytes(MAX_TENSOR_BYTES)
    mx.set_cache_limit(0)  # freed buffers go back to the system: RSS tracks live memory
    SEEDS.extend(build_seeds())
    check_seeds()
    print(f"fuzz_payload: {len(SEEDS)} seeds ok: {', '.join(s.name for s in SEEDS)}", flush=True)
    args = list(argv)
    if not any(a.startswith("-rss_limit_mb=") for a in args):
        args.insert(1, "-rss_limit_mb=4096")  # torch + the seed programs alone take ~1.5 GB
    if not any(not a.startswith("-") for a in args[1:]):
        corpus = Path(tempfile.mkdtemp(prefix="mlxd-fuzz-"))
        write_corpus(corpus)
        args.append(str(corpus))
    atheris.Setup(args, test_one_input, custom_mutator=mutate)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
