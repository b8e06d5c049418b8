# Run: python -m pytest tests/test_sampling.py
"""The sampler's distribution is exact: model.generate's batched inverse-CDF draw gives each token the probability
of the tempered (top-k, top-p) softmax -- by enumeration over a fine grid of uniforms (deterministic), down to a
token of probability 1e-10, and by a chi-square test of many draws, each row from its own seeded generator."""
import pytest
import torch

from model.generate import draw_uniforms, inverse_cdf_sample, sample_next_token

pytestmark = pytest.mark.usefixtures("one_thread")


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The target distribution of one row, computed independently in float64 and token by token: the tempered
    softmax, cut to the top_k most likely tokens, renormalised, then cut to the smallest prefix holding top_p."""
    probs = (logits.double() / temperature).softmax(dim=-1)
    order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))[:top_k or None]
    kept_mass = sum(float(probs[i]) for i in order)
    keep, mass = [], 0.0
    for i in order:
        if mass > top_p:
            break
        keep.append(i)
        mass += float(probs[i]) / kept_mass
    kept = torch.zeros_like(probs)
    kept[keep] = probs[keep]
    return kept / kept.sum()


def grid_frequencies(probs: torch.Tensor, block: int, points: int) -> torch.Tensor:
    """How often each token is drawn when the uniform sweeps the grid (j + 1/2) / points: exactly its probability,
    within the grid's resolution."""
    uniforms = (torch.arange(points, dtype=torch.float64) + 0.5) / points
    tokens = inverse_cdf_sample(probs.expand(points, -1).contiguous(), uniforms, block=block)
    return torch.bincount(tokens, minlength=probs.shape[-1]).double() / points


@pytest.mark.parametrize("block", [1, 3, 7, 16, 1024])  # one block per token, ragged last blocks, one block
def test_enumeration_gives_each_token_its_probability(block):
    gen = torch.Generator().manual_seed(0)
    logits = 2.0 * torch.randn(13, generator=gen)
    logits[[2, 9]] = float("-inf")  # zero-probability tokens inside blocks and at block edges
    probs = logits.softmax(dim=-1)[None]
    points = 1 << 16
    freq = grid_frequencies(probs, block, points)
    assert (freq - probs[0].double()).abs().max() <= 2.0 / points
    assert freq[[2, 9]].sum() == 0


def test_a_tiny_probability_token_owns_exactly_its_interval():
    """A float32 CDF over the row would round 0.5 + 2**-33 to 0.5: the middle token would never be drawn."""
    eps = 2.0 ** -33  # ~1.2e-10, and 0.5, eps and 0.5 are exact in float32 (the row sums to 1 + eps)
    probs = torch.tensor([[0.5, eps, 0.5, 0.0]])
    start, end = 0.5 / (1 + eps), (0.5 + eps) / (1 + eps)  # token 1's interval of uniforms
    for u, token in ((start - 0.1 * eps, 0), (start + 0.1 * eps, 1), (end - 0.1 * eps, 1), (end + 0.1 * eps, 2),
                     (1.0 - 2.0 ** -53, 2), (0.0, 0)):
        assert int(inverse_cdf_sample(probs, torch.tensor([u], dtype=torch.float64))) == token, u


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit over the tokens of positive probability (its p-value from the
    regularised upper incomplete gamma function; scipy is no dependency)."""
    support = expected_probs > 0
    expected = expected_probs[support] * counts.sum()
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2.0))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 5, 1.0), (1.0, 0, 0.9),
                                                     (1.3, 6, 0.8)])
def test_many_seeded_draws_follow_the_tempered_softmax(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(1)
    V, draws = 12, 20000
    logits = torch.randn(V, generator=gen)
    # each row from its own generator, as the OPD rollout does: one uniform per (row, step)
    uniforms = draw_uniforms([torch.Generator().manual_seed(10_000 + r) for r in range(draws)], draws, 1,
                             torch.device("cpu"))[:, 0]
    tokens = sample_next_token(logits.expand(draws, V), True, temperature, top_k, top_p, uniforms)
    expected = reference_probs(logits, temperature, top_k, top_p)
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[expected == 0].sum() == 0, "a token outside the top-k / top-p support was drawn"
    assert chi_square_p_value(counts, expected) > 1e-3


@pytest.mark.slow  # long for the fast tier: the whole suite runs it
def test_large_vocabulary_near_uniform_row_is_unbiased():
    """Qwen3's 151,936 tokens, nearly flat (a random model's row): the first and the last thousand tokens get
    their share. A float32 CDF would bias the tail by up to ~1% per token (its partial sums near 1 round to 6e-8)."""
    V, points = 151_936, 1 << 20
    logits = 0.01 * torch.randn(V, generator=torch.Generator().manual_seed(2))
    probs = logits.softmax(dim=-1)[None]
    uniforms = (torch.arange(points, dtype=torch.float64) + 0.5) / points
    tokens = torch.cat([inverse_cdf_sample(probs.expand(len(chunk), -1), chunk)
                        for chunk in uniforms.split(1 << 14)])
    freq = torch.bincount(tokens, minlength=V).double() / points
    for part in (slice(0, 1000), slice(V - 1000, V)):
        assert float(freq[part].sum()) == pytest.approx(float(probs[0, part].double().sum()), abs=2e-6)
