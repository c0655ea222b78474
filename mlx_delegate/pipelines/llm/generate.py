"""Token generation with an exported LLM program (see `llm.export`) on the stock
ExecuTorch runtime.

`Generator` keeps the position in the KV cache across calls (the cache itself
lives in the delegate), so a conversation can continue where it stopped. It
checks that the tokens fit the cache before each call, so a full context is a
`ContextFull` here rather than the delegate's error for an out-of-range position.
Single-token steps all have one input signature, so after the first the
delegate serves them with one compiled graph;
a program exported with a sampler returns the token: "greedy" the argmax,
"sample" the token its sampler draws (`next_token` feeds it the settings and
one uniform draw); one exported with logits is sampled here on the host;
`reset()` reloads the program, whose delegate starts from an empty cache
(executorch.runtime caches loaded methods, so reloading only the method would
hand back the same one).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from executorch.runtime import Runtime

from ... import _runtime  # noqa: F401  (registers the backend)
from ...memory import peak_rss_mb
from .sampling import Sampler

SAMPLER_INPUTS = 4  # llm.export.SAMPLER_INPUTS (not imported: export pulls in the lowering stack)
INT64 = 4  # ExecuTorch's ScalarType::Long, as the method metadata reports dtypes

META_MAX_SEQ_LEN = "get_max_seq_len"


class ContextFull(ValueError):
    """The tokens would not fit in the KV cache."""


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0  # after the first token (which the prefill produces)
    peak_rss_mb: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_s if self.decode_s and steps > 0 else 0.0

    def summary(self) -> str:
        return (f"prefill {self.prompt_tokens} tokens at {self.prefill_tps:.1f} tok/s, "
                f"decode {self.generated_tokens} tokens at {self.decode_tps:.1f} tok/s, "
                f"peak RSS {self.peak_rss_mb:.0f} MB")


class Generator:
    """An exported LLM program with its position in the KV cache."""

    def __init__(self, program: str | Path | bytes, tokenizer: Any = None,
                 eos_token_ids: Iterable[int] | None = None) -> None:
        self.source = program if isinstance(program, bytes) else str(program)
        self.program = Runtime.get().load_program(self.source)
        self.max_seq_len = int(self.program.load_method(META_MAX_SEQ_LEN).execute([])[0])
        self.tokenizer = tokenizer
        eos = eos_token_ids if eos_token_ids is not None else [getattr(tokenizer, "eos_token_id", None)]
        self.eos_token_ids = {int(t) for t in eos if t is not None}
        self.method = self.program.load_method("forward")
        # What the program returns: logits, or the token chosen in it (see llm.export.SAMPLERS).
        meta = self.method.metadata
        self.samples_on_device = meta.num_inputs() == 2 + SAMPLER_INPUTS
        self.greedy_on_device = not self.samples_on_device and meta.output_tensor_meta(0).dtype() == INT64
        self.pos = 0
        self.stats = Stats()

    def reset(self) -> None:
        """Empty the KV cache: a freshly loaded program starts from the buffers' initial values."""
        self.method = self.program = None  # free the old weights and cache first
        self.program = Runtime.get().load_program(self.source)
        self.method = self.program.load_method("forward")
        self.pos = 0

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` at the current position; the next-token logits [vocab] (a program
        that samples on device returns tokens: use `next_token`)."""
        if self.samples_on_device or self.greedy_on_device:
            raise ValueError("this program chooses the token on device and returns its id; use next_token()")
        return self._run(tokens, [])[0, -1]

    def next_token(self, tokens: list[int], sampler: Sampler) -> int:
        """Feed `tokens` at the current position; the next token, drawn by `sampler`."""
        if self.samples_on_device:
            return int(self._run(tokens, sampler.device_inputs())[0])
        if self.greedy_on_device:
            if not sampler.greedy:
                raise ValueError("this program returns the argmax token (exported with sampler='greedy'); "
                                 "sampling needs a sampler='sample' or logits program")
            return int(self._run(tokens, [])[0])
        return sampler(self._run(tokens, [])[0, -1])

    def _run(self, tokens: list[int], extra: list[torch.Tensor]) -> torch.Tensor:
        if not tokens:
            raise ValueError("no tokens to feed")
        if self.pos + len(tokens) > self.max_seq_len:
            raise ContextFull(f"{len(tokens)} tokens at position {self.pos} exceed the KV cache of "
                              f"{self.max_seq_len} positions (export with a larger max_seq_len, or reset())")
        out = self.method.execute([torch.tensor([tokens], dtype=torch.long),
                                   torch.tensor([self.pos], dtype=torch.long), *extra])[0]
        self.pos += len(tokens)
        return out

    def warm_up(self, prompt_tokens: int, decode_steps: int = 2) -> float:
        """Run a prefill of `prompt_tokens` and `decode_steps` single-token steps, then rewind to
        position 0; returns the seconds taken. The first call of each shape compiles its MLX graph,
        so timings taken afterwards are steady-state ones. Rewinding is enough: attention masks
        every cache entry past the current position, and a real step rewrites an entry before
        any query reads it. Does nothing when the steps would not fit the cache."""
        if prompt_tokens < 1 or prompt_tokens + decode_steps > self.max_seq_len - self.pos:
            return 0.0
        # The program's own kind of step, with throwaway sampler settings: the caller's sampler
        # keeps its random stream, so a seeded run draws the same tokens with or without warm-up.
        extra = Sampler(temperature=1.0, seed=0).device_inputs() if self.samples_on_device else []
        start, saved = time.perf_counter(), self.pos
        self._run([0] * prompt_tokens, extra)
        for _ in range(decode_steps):
            self._run([0], extra)
        self.pos = saved
        return time.perf_counter() - start

    def generate_ids(self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler | None = None,
                     ) -> Iterator[int]:
        """Prefill `prompt_ids`, then yield up to `max_new_tokens` ids (stopping after an EOS id)."""
        sampler = sampler or Sampler()
        self.stats = stats = Stats(prompt_tokens=len(prompt_ids))
        start = time.perf_counter()
        token = self.next_token(list(prompt_ids), sampler)
        stats.prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        for i in range(max_new_tokens):
            stats.generated_tokens += 1
            yield token
            if token in self.eos_token_ids or i + 1 == max_new_tokens or self.pos >= self.max_seq_len:
                break
            token = self.next_token([token], sampler)
            stats.decode_s = time.perf_counter() - start
        stats.peak_rss_mb = peak_rss_mb()

    def encode_prompt(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids for `prompt`, through the chat template when the tokenizer has one."""
        tok = self._need_tokenizer()
        if chat and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                           add_generation_prompt=True)
            return list(tok.encode(text, add_special_tokens=False))
        return list(tok.encode(prompt))

    def generate(self, prompt: str, max_new_tokens: int = 64, sampler: Sampler | None = None,
                 chat: bool = True) -> Iterator[str]:
        """Stream the completion of `prompt` as text pieces."""
        tok = self._need_tokenizer()
        ids: list[int] = []
        shown = ""
        for token in self.generate_ids(self.encode_prompt(prompt, chat), max_new_tokens, sampler):
            ids.append(token)
            text = tok.decode(ids, skip_special_tokens=True)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                continue
            yield text[len(shown):]
            shown = text

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("this Generator has no tokenizer; use generate_ids with token ids")
        return self.tokenizer
