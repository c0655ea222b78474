"""Untrusted .pte files through the stock ExecuTorch Python runtime never kill the process.

Each test drives the runtime in a child process (fuzz/fuzz_stock.py), so an abort or segfault fails
the test instead of killing pytest: the regression corpus (files that once aborted the process),
then a bounded run of the stock-path fuzzer.
"""

import json
import subprocess
import sys
from pathlib import Path

import torch

from mlx_delegate import _runtime
from mlx_delegate.testing import lower

ROOT = Path(__file__).resolve().parents[2]
FUZZER = ROOT / "fuzz" / "fuzz_stock.py"
CORPUS = ROOT / "tests" / "data" / "corpus"
FUZZ_SECONDS = 60

sys.path.insert(0, str(ROOT / "fuzz"))
import fuzz_stock  # noqa: E402
from seeds import Elementwise, seed_inputs_by_name  # noqa: E402


def test_printable_escapes_and_caps():
    assert _runtime.printable(b"node 'x\xbe\xff\n'") == "node 'x\\xbe\\xff\\x0a'"
    assert _runtime.printable("caf\u00e9".encode()) == "caf\\xc3\\xa9"  # valid UTF-8 is escaped too: ASCII only
    long = _runtime.printable(b"a" * 5000)
    assert len(long) == 1024 and long.endswith("...")
    # An escape is never cut in half, and the output maps to itself.
    cut = _runtime.printable(b"ab" + b"\xbe" * 10, 11)
    assert cut == "ab\\xbe...", cut
    text = _runtime.printable(bytes(range(256)))
    assert _runtime.printable(text.encode()) == text


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(FUZZER), *args], cwd=ROOT, capture_output=True, text=True,
                          errors="replace", timeout=timeout)


def test_corpus_is_rejected_cleanly_and_the_process_keeps_working(tmp_path):
    files = sorted(CORPUS.glob("*.bin"))
    assert len(files) >= 3
    good_inputs = seed_inputs_by_name()["elementwise"]
    good = lower(Elementwise(), tuple(good_inputs))
    (tmp_path / "good.pte").write_bytes(good.buffer)
    proc = _run(["--replay", *map(str, files), "--good", f"elementwise={tmp_path / 'good.pte'}"], timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    assert "terminate called" not in log and "Fatal Python error" not in log
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    replayed = [r for r in results if "file" in r]
    assert {r["file"] for r in replayed} == {f.name for f in files}
    assert len(replayed) == 2 * len(files)  # each file loaded from bytes and from a path
    for r in replayed:
        # A clear error: rejected with a message (no corpus file is a valid program).
        assert r["outcome"].startswith(("rejected", "failed")), r
        assert r["message"].split(":", 1)[1].strip(), r
    # The log lines that used to abort arrive escaped.
    assert "\\x" in proc.stderr, proc.stderr[-2000:]
    (ran,) = [r for r in results if "good" in r]
    want = Elementwise()(*good_inputs)
    torch.testing.assert_close(torch.tensor(ran["outputs"][0]), want, rtol=1e-4, atol=1e-5)


def test_stock_runtime_fuzz_bounded(tmp_path):
    # A fixed seed: case i is the same mutation on every run; the time limit bounds how many run.
    proc = _run(["--runs", "1000000", "--max-seconds", str(FUZZ_SECONDS), "--seed", "20261125",
                 "--artifacts", str(tmp_path), "--json", str(tmp_path / "summary.json")], timeout=FUZZ_SECONDS + 300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["crashes"] == 0 and summary["findings"] == 0, summary
    assert summary["mutations"] >= 500, summary
    # The mutants reach every stage: rejected by the loader, by our backend's init, at run time, or run.
    outcomes = summary["outcomes"]
    assert outcomes["rejected at load_program"] and outcomes["rejected at load_method"], summary
    assert outcomes["ran"] and summary["executions"] >= outcomes["ran"], summary
    assert summary["log_lines"] > 0, summary  # the binding's log path was exercised
    # Mutants that ran were checked against the seed's outputs: some changed files that still hand the
    # delegate the seed's bytes (so must give its result bit for bit, and did: no finding), and some
    # that compute something else.
    results = summary["results"]
    assert results["reads the seed's bytes"] > results["file unchanged"], summary
    assert results["result changed"] and results["result unchanged"], summary
    assert results["result changed"] + results["result unchanged"] == outcomes["ran"], summary


def test_result_check_can_fail():
    """check_result flags a different value where the delegate read the seed's bytes, and outputs of the
    wrong number, dtype or (static seeds) shape always."""
    ref = [torch.tensor([1.0, float("nan"), -0.0]), torch.tensor([3], dtype=torch.int64)]
    same = [t.clone() for t in ref]
    off = [torch.tensor([1.0, float("nan"), 0.0]), ref[1].clone()]  # -0.0 -> 0.0: one bit
    check = fuzz_stock.check_result
    assert check(same, ref, same_reads=True, static=True) == (None, True)
    assert check(off, ref, same_reads=True, static=True) == (fuzz_stock.WRONG_RESULT, False)
    assert check(off, ref, same_reads=False, static=True) == (None, False)  # a different program
    assert check(same[:1], ref, same_reads=False, static=True)[0] == fuzz_stock.MALFORMED
    assert check([ref[0].half(), ref[1]], ref, same_reads=False, static=True)[0] == fuzz_stock.MALFORMED
    longer = [torch.zeros(4), ref[1]]
    assert check(longer, ref, same_reads=False, static=True)[0] == fuzz_stock.MALFORMED
    assert check(longer, ref, same_reads=False, static=False) == (None, False)  # dynamic outputs may resize


def test_reads_sees_what_the_delegate_reads():
    """A byte of the delegate blob changes what `reads` returns; the header's segment_data_size (which
    resolves no region) does not."""
    pte = lower(Elementwise(), tuple(seed_inputs_by_name()["elementwise"])).buffer
    lay = fuzz_stock.layout(pte)
    (start, _), = lay.regions["blob"]
    blob = bytearray(pte)
    blob[start + 40] ^= 1
    header = bytearray(pte)
    header[32] ^= 1  # extended header: segment_data_size
    assert fuzz_stock.reads(pte) is not None
    assert fuzz_stock.reads(bytes(blob)) != fuzz_stock.reads(pte)
    assert fuzz_stock.reads(bytes(header)) == fuzz_stock.reads(pte)
