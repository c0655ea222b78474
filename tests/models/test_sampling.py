"""On-device sampling: the sampler lowered alone draws from the exact softmax / top-k / top-p
distribution (chi-square against torch, fixed seed), and inside a tiny Llama program greedy gives the
same tokens as host argmax over the logits program."""

import pytest
import torch
from torch.export import Dim
from transformers import LlamaConfig

from mlx_delegate.pipelines.llm import export as llm_export
from mlx_delegate.pipelines.llm.generate import Generator
from mlx_delegate.pipelines.llm.sampling import Sampler, sample_next
from mlx_delegate.models import loading
from mlx_delegate.testing import delegate_summary, hf_greedy, lower

VOCAB, DRAWS = 24, 4000


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value of `counts` against `probs` (both over the same support)."""
    expected = probs.double() / probs.double().sum() * counts.sum()
    stat = ((counts.double() - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((len(counts) - 1) / 2.0), stat / 2))  # chi2 sf


class SamplerModule(torch.nn.Module):
    def forward(self, logits, temperature, top_k, top_p, u):
        return sample_next(logits, temperature, top_k, top_p, u)


def settings(t: float, k: int, p: float, u: torch.Tensor, logits: torch.Tensor) -> list[torch.Tensor]:
    return [logits.expand(len(u), -1).contiguous(), torch.tensor([t]), torch.tensor([k]), torch.tensor([p]), u]


@pytest.fixture(scope="module")
def lowered_sampler():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(VOCAB, generator=g) * 2
    example = settings(1.0, 0, 1.0, torch.rand(3, generator=g), logits)
    batch = Dim("batch", min=1, max=DRAWS)
    low = lower(SamplerModule(), tuple(example), dynamic_shapes=({0: batch}, None, None, None, {0: batch}))
    assert low.summary == (1, [])  # sort, softmax, masks, cumsum and the draw all in the delegate
    return low.method(), logits


@pytest.mark.parametrize("t,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 8, 0.6), (2.0, 1, 1.0)])
def test_sampler_distribution_matches_torch(lowered_sampler, t, k, p):
    method, logits = lowered_sampler
    u = torch.rand(DRAWS, generator=torch.Generator().manual_seed(1))
    args = settings(t, k, p, u, logits)
    drawn = method.execute(args)[0]
    expected = Sampler(t, p, 0, top_k=k).probs(logits)
    counts = torch.bincount(drawn, minlength=VOCAB).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "drew a token outside the top-k / top-p set"
    # The same draws through the eager sampler pick the same tokens (a boundary may round differently).
    assert (drawn == SamplerModule()(*args)).double().mean() > 0.99
    if support.sum() == 1:
        return
    assert chi_square_pvalue(counts[support], expected[support]) > 1e-3
    # The test has the power to tell a neighbouring setting apart.
    other = Sampler(t * 1.5, p, 0, top_k=k).probs(logits)[support]
    assert chi_square_pvalue(counts[support], other) < 1e-3


def test_sampler_greedy_is_argmax(lowered_sampler):
    method, _ = lowered_sampler
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(2))
    out = method.execute([logits, torch.tensor([0.0]), torch.tensor([3]), torch.tensor([0.5]), torch.rand(64)])[0]
    assert torch.equal(out, logits.argmax(-1))


def test_sampler_settings_are_checked():
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(ValueError, match="need temperature >= 0"):
            Sampler(**bad)


MAX_SEQ_LEN = 48
PROMPT = [5, 17, 99, 3, 42, 7]


@pytest.fixture(scope="module")
def llama_programs():
    """(HF model, logits, greedy and sampling programs) for one tiny random Llama."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=MAX_SEQ_LEN)
    model = loading.from_config(config, max_seq_len=MAX_SEQ_LEN, seed=0).model
    torch.manual_seed(0)
    hf = loading.hf_class(config)(config).eval()
    programs = []
    for sampler in (None, "greedy", "sample"):
        edge = llm_export.lower(llm_export.export_model(model, sampler=sampler),
                                constant_methods=llm_export.metadata(model))
        assert delegate_summary(edge) == (1, [])
        programs.append(edge.to_executorch().buffer)
    return hf, *programs


def test_greedy_on_device_equals_host_argmax(llama_programs, runtime_path):
    hf, logits_pte, greedy_pte, sample_pte = llama_programs
    host = list(Generator(logits_pte, eos_token_ids=[]).generate_ids(PROMPT, 32))
    assert host == hf_greedy(hf, PROMPT, 32)
    for pte in (greedy_pte, sample_pte):  # temperature 0 through the full sampler too
        gen = Generator(pte, eos_token_ids=[])
        assert gen.greedy_on_device != gen.samples_on_device
        # The CLI warms up first: it runs on token programs too, and leaves nothing behind.
        assert gen.warm_up(len(PROMPT) + 3) > 0 and gen.pos == 0
        assert list(gen.generate_ids(PROMPT, 32)) == host
        with pytest.raises(ValueError, match="chooses the token on device"):
            gen.step([1])


def test_greedy_program_refuses_sampling(llama_programs):
    gen = Generator(llama_programs[2], eos_token_ids=[])
    with pytest.raises(ValueError, match="returns the argmax token"):
        next(gen.generate_ids(PROMPT, 4, Sampler(temperature=1.0)))


def test_sampling_in_the_program_is_seeded(llama_programs):
    sample_pte = llama_programs[3]
    gen = Generator(sample_pte, eos_token_ids=[])

    def run(seed: int, **kw) -> list[int]:
        gen.reset()
        return list(gen.generate_ids(PROMPT, 24, Sampler(seed=seed, **kw)))

    first = run(3, temperature=1.5)
    assert first == run(3, temperature=1.5) and first != run(4, temperature=1.5)
    assert all(0 <= t < 128 for t in first)
    gen.reset()
    greedy = list(gen.generate_ids(PROMPT, 24))
    assert run(5, temperature=1.5, top_k=1) == greedy  # top-k 1 leaves only the argmax
