"""Whisper transcription on the MLX delegate: lowering `models.whisper`'s two methods into one
program, and greedy decoding over 30 s windows with the language / task / no-timestamps prompt and
the same token suppression as `transformers`' `generate`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from .. import audio as A
from ..models.whisper import MAX_TARGET, export
from .lowering import Lowering, lower_methods
from .transcript import Transcript


def lower(model: nn.Module, max_len: int | None = None, partitioner: Any = None) -> Lowering:
    """Export and lower `encode` and `decode` into one ExecuTorch program (`MLXPartitioner` unless
    given another)."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass

    # The encoder's features and the first step's cross K/V need not be copied into planned memory.
    config = ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False))
    return lower_methods(export(model, max_len), partitioner, config)


# --- Greedy decoding ----------------------------------------------------------------

@dataclass
class Prompt:
    sot: int
    eot: int
    language: int | None
    task: int | None
    no_timestamps: int | None
    suppress: list[int] = field(default_factory=list)
    suppress_at_begin: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [t for t in (self.sot, self.language, self.task, self.no_timestamps) if t is not None]

    @classmethod
    def from_generation_config(cls, gen: Any, language: str | None = "en",
                               task: str = "transcribe") -> "Prompt":
        lang = None
        if getattr(gen, "is_multilingual", False) and language is not None:
            key = language if language.startswith("<|") else f"<|{language}|>"
            if key not in gen.lang_to_id:
                raise ValueError(f"unknown language {language!r}")
            lang = gen.lang_to_id[key]
        task_id = gen.task_to_id.get(task) if getattr(gen, "is_multilingual", False) else None
        return cls(sot=gen.decoder_start_token_id, eot=gen.eos_token_id, language=lang, task=task_id,
                   no_timestamps=getattr(gen, "no_timestamps_token_id", None),
                   suppress=list(gen.suppress_tokens or []),
                   suppress_at_begin=list(gen.begin_suppress_tokens or []))


class WhisperRunner:
    """Greedy transcription with a lowered Whisper program."""

    def __init__(self, buffer: bytes, tokenizer: Any, prompt: Prompt, n_mels: int = 80,
                 max_len: int = MAX_TARGET) -> None:
        from executorch.runtime import Runtime

        self.program = Runtime.get().load_program(buffer)  # keep referenced while methods run
        self.encode_method = self.program.load_method("encode")
        self.decode_method = self.program.load_method("decode")
        self.tokenizer, self.prompt, self.n_mels, self.max_len = tokenizer, prompt, n_mels, max_len

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        return self.encode_method.execute([features.contiguous()])[0]

    def step(self, token: int, pos: int, cross_update: torch.Tensor) -> torch.Tensor:
        """Logits after `token` at `pos`; `cross_update` (cross_kv or its first rows) is stored first."""
        return self.decode_method.execute([torch.tensor([[token]]), torch.tensor([pos]), cross_update])[0]

    def generate(self, features: torch.Tensor) -> list[int]:
        """Greedy tokens for one window of features [1, n_mels, frames]."""
        cross_kv = self.encode(features)
        first_rows = cross_kv[:, :, :, :, :2].contiguous()  # rewriting them leaves the stored K/V as they are

        def step(tok: int, pos: int) -> torch.Tensor:
            return self.step(tok, pos, cross_kv if pos == 0 else first_rows)

        return greedy(step, self.prompt, self.max_len)

    def transcribe(self, audio: np.ndarray) -> Transcript:
        start = time.perf_counter()
        windows = [self.generate(A.log_mel_spectrogram(w, self.n_mels)[None]) for w in A.split_windows(audio)]
        texts = [self.tokenizer.decode(t, skip_special_tokens=True).strip() for t in windows]
        return Transcript(" ".join(t for t in texts if t), windows, len(audio) / A.SAMPLE_RATE,
                          time.perf_counter() - start)


def greedy(step: Any, prompt: Prompt, max_len: int = MAX_TARGET) -> list[int]:
    """Greedy decoding after `prompt.tokens`; `step(token, pos) -> logits [1, V]` advances the cache."""
    tokens = prompt.tokens
    for pos, tok in enumerate(tokens[:-1]):
        step(tok, pos)
    out: list[int] = []
    suppress = torch.tensor(prompt.suppress, dtype=torch.long)
    at_begin = torch.tensor(prompt.suppress_at_begin, dtype=torch.long)
    pos = len(tokens) - 1
    tok = tokens[-1]
    while pos < max_len - 1:
        logits = step(tok, pos)[0].clone()
        logits[suppress] = -float("inf")
        if not out:
            logits[at_begin] = -float("inf")
        tok = int(logits.argmax())
        if tok == prompt.eot:
            break
        out.append(tok)
        pos += 1
    return out


def load(model: nn.Module, tokenizer: Any, language: str | None = "en", task: str = "transcribe",
         max_len: int | None = None, buffer: bytes | None = None) -> WhisperRunner:
    """Lower `model` (or reuse a lowered `buffer`) and return a runner."""
    buffer = buffer if buffer is not None else lower(model, max_len).buffer
    prompt = Prompt.from_generation_config(model.generation_config, language, task)
    return WhisperRunner(buffer, tokenizer, prompt, model.config.num_mel_bins,
                         max_len or model.config.max_target_positions)


def eager_generate(model: nn.Module, features: torch.Tensor, language: str | None = "en",
                   task: str = "transcribe", max_len: int | None = None) -> list[int]:
    """The reference: transformers' own greedy `generate` with the same prompt, generated tokens only."""
    gen = model.generation_config
    kwargs: dict[str, Any] = dict(do_sample=False, num_beams=1, max_length=max_len or gen.max_length)
    if getattr(gen, "is_multilingual", False):
        kwargs.update(language=language, task=task)
    with torch.no_grad():
        ids = model.generate(features, **kwargs)[0].tolist()
    return _strip(ids, Prompt.from_generation_config(gen, language, task))


def _strip(ids: Sequence[int], prompt: Prompt) -> list[int]:
    ids = list(ids)
    n = len(prompt.tokens)
    if ids[:n] == prompt.tokens:
        ids = ids[n:]
    return ids[:ids.index(prompt.eot)] if prompt.eot in ids else ids
