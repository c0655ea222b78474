"""The Llama path end to end: export with the KV cache resident in the delegate,
then generation through the stock ExecuTorch runtime, compared with HF eager."""

import json
from pathlib import Path

import pytest
import torch
from executorch.runtime import Runtime
from torch.export.graph_signature import OutputKind
from transformers import LlamaConfig, LlamaForCausalLM

import mlx_delegate
from mlx_delegate.ir import nodes as N
from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.pipelines.llm.generate import ContextFull, Generator
from mlx_delegate.pipelines.llm.sampling import Sampler, top_p_filter
from mlx_delegate.models import loading
from mlx_delegate.models.llama import Model, ModelArgs
from mlx_delegate.pipelines.cache import CacheKey, cached_pte
from mlx_delegate.testing import assert_steps_match_hf, delegate_summary, hf_greedy, hf_next_logits

MAX_SEQ_LEN = 64
NEW_TOKENS = 40


def tiny_config() -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, max_position_embeddings=MAX_SEQ_LEN,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


@pytest.fixture(scope="module")
def tiny():
    """(our model, HF model with the same random weights, lowered edge program, .pte bytes)."""
    loaded = loading.from_config(tiny_config(), max_seq_len=MAX_SEQ_LEN, seed=0)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(tiny_config()).eval()
    edge = llm_export.lower(llm_export.export_model(loaded.model),
                            constant_methods=llm_export.metadata(loaded.model))
    return loaded.model, hf, edge, edge.to_executorch().buffer


PROMPT = [5, 17, 99, 3, 42, 7]


def test_cache_lives_inside_the_delegate(tiny):
    model, _, edge, _ = tiny
    segments, leftover = delegate_summary(edge)
    assert (segments, leftover) == (1, [])
    ep = edge.exported_program()
    # The delegate call takes the user inputs only and returns the logits only.
    call = next(n for n in ep.graph.nodes if n.op == "call_function")
    assert [a.name for a in call.args[1:]] == ["tokens", "input_pos"]
    assert [s.kind for s in ep.graph_signature.output_specs] == [OutputKind.USER_OUTPUT]
    assert not any("cache" in s.target for s in ep.graph_signature.input_specs if s.target)
    # ... and keeps every cache as a resident mutable buffer, updated in place.
    lowered = getattr(ep.graph_module, call.args[0].target)
    program = N.deserialize(lowered.processed_bytes)
    caches = sorted(b.name for b in program.buffers)
    assert len(caches) == 2 * model.args.num_hidden_layers
    assert all(b.update is not None for b in program.buffers)
    assert all(name.endswith(("k_cache", "v_cache")) for name in caches)


def test_greedy_generation_matches_hf(tiny, runtime_path):
    _, hf, _, pte = tiny
    gen = Generator(pte, eos_token_ids=[])
    ours = list(gen.generate_ids(PROMPT, NEW_TOKENS))
    assert ours == hf_greedy(hf, PROMPT, NEW_TOKENS)
    assert gen.stats.generated_tokens == NEW_TOKENS and gen.stats.decode_tps > 0


def test_step_logits_match_hf(tiny, runtime_path):
    _, hf, _, pte = tiny
    gen = Generator(pte, eos_token_ids=[])
    # A warm-up longer than the prompt leaves stale cache entries past it: masked, then rewritten.
    assert gen.warm_up(len(PROMPT) + 5) > 0 and gen.pos == 0
    assert_steps_match_hf(gen, hf, PROMPT, steps=8)


def decode_with_compile(pte: bytes, compiled: bool, steps: int) -> tuple[list[torch.Tensor], dict[str, int]]:
    """Greedy prefill + `steps` single-token steps with compiled graphs on or off:
    (logits per call, compile counters spent)."""
    runtime = mlx_delegate._runtime
    was = runtime.compile_enabled()
    runtime.set_compile(compiled)
    try:
        gen = Generator(pte, eos_token_ids=[])
        before = runtime.compile_stats()
        logits = [gen.step(PROMPT)]
        for _ in range(steps):
            logits.append(gen.step([int(logits[-1].argmax())]))
        return logits, {k: v - before[k] for k, v in runtime.compile_stats().items()}
    finally:
        runtime.set_compile(was)


def test_decode_steps_share_one_compiled_graph(tiny):
    """The position is a tensor: every single-token step has one signature, so the first runs
    node by node, the second traces it and the rest replay it. Same tokens as HF, logits as
    node by node."""
    _, hf, _, pte = tiny
    steps = 20
    plain, plain_stats = decode_with_compile(pte, False, steps)
    compiled, stats = decode_with_compile(pte, True, steps)
    assert plain_stats == {"interpreted_calls": steps + 1, "compiled_calls": 0, "traces": 0, "rejected": 0}
    # prefill and the first step node by node; the other 19 steps on one graph
    assert stats == {"interpreted_calls": 2, "compiled_calls": steps - 1, "traces": 1, "rejected": 0}
    tokens = [int(x.argmax()) for x in compiled]
    assert tokens == [int(x.argmax()) for x in plain] == hf_greedy(hf, PROMPT, steps + 1)
    for a, b in zip(plain, compiled):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [True, False])
def test_decode_step_updates_the_cache_in_place(compiled):
    """MLX's allocator counters (its libmlx is the delegate's): a decode step allocates far less than
    one layer's cache, so no cache is copied; the prefill, whose caches start from the program's
    initial values (shared, so not donated), copies each of them once."""
    import mlx.core as mx

    seq = 4096
    config = tiny_config()
    config.max_position_embeddings = seq
    model = loading.from_config(config, max_seq_len=seq, seed=0).model
    cache_bytes = model.model.layers[0].self_attn.k_cache.nbytes
    runtime = mlx_delegate._runtime
    was = runtime.compile_enabled()
    runtime.set_compile(compiled)
    try:
        program = Runtime.get().load_program(llm_export.to_pte(model))  # referenced while it runs
        method = program.load_method("forward")

        def allocated(tokens: list[int], pos: int) -> int:
            """Peak bytes over what was allocated before the call."""
            active = mx.get_active_memory()
            mx.reset_peak_memory()
            method.execute([torch.tensor([tokens]), torch.tensor([pos])])
            return mx.get_peak_memory() - active

        assert allocated(PROMPT, 0) >= 2 * config.num_hidden_layers * cache_bytes
        steps = [allocated([7], len(PROMPT) + i) for i in range(6)]
    finally:
        runtime.set_compile(was)
    assert max(steps) < cache_bytes / 2, (steps, cache_bytes)


# Relative bound on half-type logits against HF fp32 (atol scaled by the largest |logit|): bf16 keeps 8
# mantissa bits, fp16 11, so fp16 is held 8x tighter. Observed (2026-11-25): at most 0.0085 (bf16) and
# 0.0008 (fp16) of the largest |logit| over the five steps.
HALF_LOGIT_TOLERANCE = {torch.bfloat16: 0.05, torch.float16: 0.006}


@pytest.mark.parametrize("dtype", list(HALF_LOGIT_TOLERANCE), ids=str)
def test_half_step_logits_close_to_fp32(tiny, dtype, compile_on):
    """bf16 / fp16 weights and activations: per-step logits (prefill, then decode steps, the last of them
    replayed from a compiled graph) within the dtype's tolerance of HF fp32."""
    _, hf, _, _ = tiny
    start = mlx_delegate._runtime.compile_stats()["compiled_calls"]
    loaded = loading.from_config(tiny_config(), dtype=dtype, max_seq_len=MAX_SEQ_LEN, seed=0)
    edge = llm_export.lower(llm_export.export_model(loaded.model),
                            constant_methods=llm_export.metadata(loaded.model))
    assert delegate_summary(edge) == (1, [])
    gen = Generator(edge.to_executorch().buffer, eos_token_ids=[])
    tol = HALF_LOGIT_TOLERANCE[dtype]
    tokens = list(PROMPT)
    logits = gen.step(tokens)
    for step in range(5):  # prefill, then decode steps: the second 1-token call traces, later ones replay
        assert logits.dtype == dtype
        expected = hf_next_logits(hf, tokens)
        torch.testing.assert_close(logits.float(), expected, rtol=tol, atol=tol * float(expected.abs().max()))
        if step < 4:
            tokens.append(int(expected.argmax()))
            logits = gen.step(tokens[-1:])
    assert mlx_delegate._runtime.compile_stats()["compiled_calls"] > start, "no decode step was replayed compiled"


def test_cache_survives_calls_and_resets(tiny):
    model, hf, _, pte = tiny
    gen = Generator(pte, eos_token_ids=[])
    # Chunked prefill: later chunks attend to what earlier calls left in the cache.
    gen.step(PROMPT[:2])
    gen.step(PROMPT[2:5])
    torch.testing.assert_close(gen.step(PROMPT[5:]), hf_next_logits(hf, PROMPT), rtol=1e-4, atol=1e-4)
    # A token at position 6 sees the cache: the prompt's keys now ...
    stale = gen.step([9])
    torch.testing.assert_close(stale, hf_next_logits(hf, PROMPT + [9]), rtol=1e-4, atol=1e-4)
    # ... and zeros once the method is reloaded (same answer as the eager model on an empty cache).
    gen.reset()
    gen.pos = len(PROMPT)
    fresh = gen.step([9])
    model.reset_cache()
    with torch.no_grad():
        expected = model(torch.tensor([[9]]), torch.tensor([len(PROMPT)]))[0, -1]
    torch.testing.assert_close(fresh, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(fresh, stale)


def test_prompt_longer_than_cache_is_refused(tiny):
    _, _, _, pte = tiny
    gen = Generator(pte, eos_token_ids=[])
    with pytest.raises(ContextFull, match="exceed the KV cache of 64"):
        gen.step(list(range(MAX_SEQ_LEN + 1)))
    gen.step(PROMPT)
    with pytest.raises(ContextFull, match=f"at position {len(PROMPT)}"):
        gen.step([1] * (MAX_SEQ_LEN - len(PROMPT) + 1))
    gen.step([1] * (MAX_SEQ_LEN - len(PROMPT) - 1))
    gen.step([2])  # a decode step into the last cache slot
    with pytest.raises(ContextFull):
        gen.step([3])
    # The program itself refuses too: ExecuTorch bounds the token count, the delegate checks
    # the cache write position on the host (tests/ops/test_kv_cache_update_at.py).
    method = Runtime.get().load_program(pte).load_method("forward")
    with pytest.raises(RuntimeError):
        method.execute([torch.zeros(1, MAX_SEQ_LEN + 1, dtype=torch.long), torch.tensor([0])])
    with pytest.raises(RuntimeError):
        method.execute([torch.zeros(1, 8, dtype=torch.long), torch.tensor([MAX_SEQ_LEN - 4])])
    assert "slice update start" in mlx_delegate._runtime.last_error()
    method.execute([torch.zeros(1, 4, dtype=torch.long), torch.tensor([MAX_SEQ_LEN - 4])])  # still works


def test_sampling():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5])
    assert Sampler()(logits) == 1
    draws = [Sampler(temperature=1.0, seed=7)(logits) for _ in range(3)]
    assert draws == [draws[0]] * 3  # seeded: reproducible
    kept = top_p_filter(torch.softmax(logits, -1), 0.6)
    assert kept.nonzero().flatten().tolist() == [1, 3] and abs(float(kept.sum()) - 1) < 1e-6
    with pytest.raises(ValueError):
        Sampler(top_p=0)


@pytest.mark.slow
def test_smollm2_greedy_matches_hf():
    path = loading.smollm2_path()
    config, state = loading.read_gguf(path)
    hf = LlamaForCausalLM(config).eval()
    hf.load_state_dict(state, strict=False)
    key = CacheKey("smollm2-test", (path,), (("max_seq_len", 128),))

    def build(out: Path) -> None:
        model = loading.load_weights(Model(ModelArgs.from_hf(config, 128)), state).eval()
        llm_export.save_pte(model, out)

    pte, _ = cached_pte(key, build)
    tokenizer = loading.load_tokenizer(path)
    gen = Generator(pte, tokenizer, eos_token_ids=[])
    prompt = gen.encode_prompt("Once upon a time")
    assert list(gen.generate_ids(prompt, 32)) == hf_greedy(hf, prompt, 32)


@pytest.mark.slow
def test_generate_cli_on_a_checkpoint_dir(tmp_path, monkeypatch, capsys):
    """`mlx-delegate generate` on an HF directory (random weights, SmolLM2's tokenizer and chat template)."""
    from mlx_delegate.cli import main

    tokenizer = loading.load_tokenizer(loading.smollm2_path())
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    monkeypatch.setenv("MLX_DELEGATE_CACHE", str(tmp_path / "cache"))
    args = ["generate", "Hello", "--model", str(tmp_path / "tiny"), "--max-new-tokens", "8",
            "--max-seq-len", "64"]
    assert main([*args, "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    # Lowering shows its stages (on stderr, so --json output stays parseable).
    for line in ("[mlx-delegate] exporting (torch.export): ", "[mlx-delegate] lowering to the MLX delegate: ",
                 "[mlx-delegate] delegate segment: ", "[mlx-delegate] serialising the program: ",
                 "[mlx-delegate] warm-up (loading and compiling the prefill and decode graphs): "):
        assert line in err, err
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tokenize=False,
                                           add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    expected = hf_greedy(hf, ids, 8)
    eos = expected.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in expected else len(expected)
    assert result["text"] == tokenizer.decode(expected[:eos], skip_special_tokens=True)
    assert result["generated_tokens"] == eos and result["decode_tok_s"] > 0
    assert len(list((tmp_path / "cache").glob("*.pte"))) == 1
    # Sampling: a second program (the sampler inside), seeded, one for every setting.
    sampled = []
    for setting in (["--temperature", "1.5", "--seed", "3"], ["--temperature", "1.5", "--seed", "3"],
                    ["--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--seed", "4"]):
        assert main([*args, "--no-chat", "--json", *setting]) == 0
        sampled.append(json.loads(capsys.readouterr()[0])["text"])
    assert sampled[0] == sampled[1]
    assert len(list((tmp_path / "cache").glob("*.pte"))) == 2
    assert main([*args, "--top-k", "-1"]) == 2 and "top_k >= 0" in capsys.readouterr().err
    # A prompt longer than the cache: a one-line error, no traceback.
    long_prompt = ["generate", "Hello there, how are you doing today?", "--model", str(tmp_path / "tiny"),
                   "--max-seq-len", "4", "--no-chat"]
    assert main(long_prompt) == 2
    assert "exceed the KV cache of 4 positions" in capsys.readouterr().err


def test_pte_stores_each_weight_once():
    """Tied embedding/head stored once; the .pte is the unique weights plus a small program."""
    config = tiny_config()
    config.vocab_size, config.tie_word_embeddings = 4096, True
    loaded = loading.from_config(config, max_seq_len=MAX_SEQ_LEN)
    params = {p.data_ptr(): p for p in loaded.model.parameters()}  # tied weights share storage
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    embedding_bytes = config.vocab_size * config.hidden_size * 4
    pte = llm_export.to_pte(loaded.model)
    print(f"pte {len(pte)} bytes, unique weights {weight_bytes} bytes")
    assert weight_bytes <= len(pte) < weight_bytes + embedding_bytes // 4
