"""Whisper on the MLX delegate.

Two methods in one program, both built from a `transformers`
`WhisperForConditionalGeneration` (weights shared, not copied):

- `encode(features [1, n_mels, 2T]) -> cross_kv [L, 2, 1, H, T, Dh]`: the encoder
  followed by every decoder layer's cross-attention K/V projection, so a window's
  audio is projected once instead of once per token.
- `decode(token [1, 1], pos [1], cross_update [L, 2, 1, H, n, Dh]) -> logits [1, V]`: one
  decoder step. The self-attention caches and the cross-attention K/V are mutable
  buffers that stay inside the delegate; `cross_update` overwrites the first `n`
  cross positions. The first step of a window passes all of `cross_kv`, later steps
  its first two rows again (a no-op write; export's dynamic dims start at 2),
  because passing the whole 37 MB (Whisper base) to every call costs more than
  the step itself.

`WhisperRunner` does greedy decoding over 30 s windows with the language / task /
no-timestamps prompt and the same token suppression as `transformers`' `generate`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import audio as A

MAX_TARGET = 448  # decoder positions (prompt included)


def _heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H*Dh] -> [B, H, T, Dh]."""
    b, t, d = x.shape
    return x.view(b, t, n_heads, d // n_heads).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, Dh] -> [B, T, H*Dh]."""
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)


class Encode(nn.Module):
    """Encoder and all cross-attention K/V projections of one window."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.encoder = model.model.encoder
        self.cross = nn.ModuleList(layer.encoder_attn for layer in model.model.decoder.layers)
        self.n_heads = model.config.decoder_attention_heads

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        h = self.encoder(features).last_hidden_state
        kv = [torch.stack([_heads(a.k_proj(h), self.n_heads), _heads(a.v_proj(h), self.n_heads)])
              for a in self.cross]
        return torch.stack(kv)


class DecodeStep(nn.Module):
    """One decoder token; self-attention caches and cross-attention K/V are buffers."""

    def __init__(self, model: nn.Module, max_len: int = MAX_TARGET) -> None:
        super().__init__()
        cfg = model.config
        self.decoder, self.proj_out = model.model.decoder, model.proj_out
        self.n_heads, self.max_len = cfg.decoder_attention_heads, max_len
        dh = cfg.d_model // self.n_heads
        dtype = self.proj_out.weight.dtype
        for i in range(cfg.decoder_layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(1, self.n_heads, max_len, dh, dtype=dtype))
            self.register_buffer(f"v_cache_{i}", torch.zeros(1, self.n_heads, max_len, dh, dtype=dtype))
        self.register_buffer("cross_kv", torch.zeros(cross_kv_shape(model), dtype=dtype))

    def forward(self, token: torch.Tensor, pos: torch.Tensor, cross_update: torch.Tensor) -> torch.Tensor:
        # index_copy_ rather than a slice assignment, which would specialise the row count.
        rows = torch.arange(cross_update.shape[4], device=pos.device)
        cross_kv = self.cross_kv.index_copy_(4, rows, cross_update)
        dec = self.decoder
        x = dec.embed_tokens(token) + dec.embed_positions.weight.index_select(0, pos)[None]
        # Positions written so far (stale entries beyond `pos` from an earlier window are masked).
        mask = (torch.arange(self.max_len, device=pos.device) <= pos).view(1, 1, 1, self.max_len)
        for i, layer in enumerate(dec.layers):
            x = x + self._self_attention(layer.self_attn, layer.self_attn_layer_norm(x), pos, mask, i)
            a = layer.encoder_attn
            q = _heads(a.q_proj(layer.encoder_attn_layer_norm(x)), self.n_heads)
            x = x + a.out_proj(_merge(F.scaled_dot_product_attention(q, cross_kv[i, 0], cross_kv[i, 1])))
            h = layer.final_layer_norm(x)
            x = x + layer.fc2(F.gelu(layer.fc1(h)))
        return self.proj_out(dec.layer_norm(x))[:, -1]

    def _self_attention(self, a: nn.Module, h: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                        i: int) -> torch.Tensor:
        q, k, v = (_heads(p(h), self.n_heads) for p in (a.q_proj, a.k_proj, a.v_proj))
        k_cache = getattr(self, f"k_cache_{i}").index_copy_(2, pos, k)
        v_cache = getattr(self, f"v_cache_{i}").index_copy_(2, pos, v)
        return a.out_proj(_merge(F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)))


# --- Export and lowering -----------------------------------------------------------

def cross_kv_shape(model: nn.Module) -> tuple[int, ...]:
    cfg = model.config
    heads = cfg.decoder_attention_heads
    return (cfg.decoder_layers, 2, 1, heads, cfg.max_source_positions, cfg.d_model // heads)


def example_inputs(model: nn.Module) -> dict[str, tuple]:
    cfg = model.config
    features = torch.zeros(1, cfg.num_mel_bins, 2 * cfg.max_source_positions)
    cross = torch.zeros(cross_kv_shape(model))
    return {"encode": (features,),
            "decode": (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), cross)}


def export(model: nn.Module, max_len: int | None = None) -> dict[str, torch.export.ExportedProgram]:
    """The `encode` and `decode` methods as exported programs."""
    max_len = max_len or model.config.max_target_positions
    inputs = example_inputs(model)
    modules = {"encode": Encode(model).eval(), "decode": DecodeStep(model, max_len).eval()}
    rows = torch.export.Dim("cross_rows", min=2, max=model.config.max_source_positions)
    shapes = {"encode": None, "decode": {"token": None, "pos": None, "cross_update": {4: rows}}}
    with torch.no_grad():
        return {k: torch.export.export(m, inputs[k], dynamic_shapes=shapes[k], strict=False)
                for k, m in modules.items()}


@dataclass
class Lowering:
    buffer: bytes
    fallback: dict[str, list[str]]  # method -> ops left on ExecuTorch's CPU kernels
    segments: dict[str, int]


def lower(model: nn.Module, max_len: int | None = None, partitioner: Any = None) -> Lowering:
    """Export and lower both methods into one ExecuTorch program (`MLXPartitioner` unless given another)."""
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    from ..partitioner import MLXPartitioner
    from ..testing import delegate_summary

    programs = export(model, max_len)
    edge = to_edge_transform_and_lower(programs, partitioner=[partitioner or MLXPartitioner()])
    fallback, segments = {}, {}
    for name in programs:
        segments[name], fallback[name] = delegate_summary(_Method(edge, name))
    # The encoder's features and the first step's cross K/V need not be copied into planned memory.
    config = ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False))
    return Lowering(edge.to_executorch(config).buffer, fallback, segments)


class _Method:
    """Adapter giving `delegate_summary` one method of a multi-method edge program."""

    def __init__(self, edge: Any, name: str) -> None:
        self.edge, self.name = edge, name

    def exported_program(self) -> Any:
        return self.edge.exported_program(self.name)


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


@dataclass
class Transcript:
    text: str
    tokens: list[list[int]]  # generated tokens per window (prompt and end token excluded)
    audio_seconds: float
    seconds: float  # features, encoder and decoding

    @property
    def real_time_factor(self) -> float:
        return self.seconds / self.audio_seconds if self.audio_seconds else float("nan")


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
