# python -m pytest tests/test_skew_divergences.py
"""DistiLLM's skew divergences through the fused linear-loss driver (trainer/losses/fused_divergences.py), against
float64 definitions written here: value and gradients (to the hidden states and the head, so to the logits), 1e-6
relative from float64 inputs; a = 0 is the KL exactly; in KD, the skew divergence in place of the KL term."""
import pytest
import torch

from trainer.losses.fused_divergences import chunked_generalized_jsd_loss, fused_kd_loss, fused_skew_loss

V, H, N = 13, 5, 10


def skew_definition(logits, teacher_logits, kind, a, temperature):
    """Per position: skew_kl KL(p || a p + (1 - a) q), skew_rkl KL(q || (1 - a) p + a q); p the teacher's, q the
    student's, both softmax(logits / T)."""
    q = torch.softmax(logits / temperature, -1)
    p = torch.softmax(teacher_logits / temperature, -1)
    if kind == "skew_kl":
        return (p * (p.log() - (a * p + (1 - a) * q).log())).sum(-1)
    return (q * (q.log() - ((1 - a) * p + a * q).log())).sum(-1)


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64),
            torch.randn(N, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64),
            torch.tensor([1, 4, -100, 0, 7, 7, -100, 12, 3, 2]))


@pytest.mark.parametrize("kind", ["skew_kl", "skew_rkl"])
@pytest.mark.parametrize("skew, temperature", [(0.1, 1.0), (0.5, 2.0), (0.0, 1.0)])
def test_the_fused_skew_divergence_equals_its_definition_in_float64(kind, skew, temperature):
    hidden, weight, teacher_hidden, teacher_weight, labels = inputs()
    keep = labels != -100
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    expected = skew_definition(h @ w.T, teacher_hidden @ teacher_weight.T, kind, skew, temperature)[keep].sum()
    expected.backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, tokens = fused_skew_loss(h2, w2, teacher_hidden, teacher_weight, labels, kind, skew, temperature,
                                   chunk_size=4, vocab_size=V)
    loss.backward()
    assert int(tokens) == int(keep.sum())
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(h2.grad, h.grad, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(w2.grad, w.grad, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("kind, beta", [("skew_kl", 0.0), ("skew_rkl", 1.0)])
def test_at_skew_zero_they_are_the_forward_and_the_reverse_kl(kind, beta):
    """a = 0: skew_kl is KL(teacher || student) and skew_rkl KL(student || teacher), the JSD's ends."""
    hidden, weight, teacher_hidden, teacher_weight, labels = inputs(seed=1)
    skew, _ = fused_skew_loss(hidden, weight, teacher_hidden, teacher_weight, labels, kind, 0.0, chunk_size=4,
                              vocab_size=V)
    kl, _ = chunked_generalized_jsd_loss(hidden, weight, teacher_hidden, teacher_weight, labels, beta=beta,
                                         chunk_size=4, vocab_size=V)
    torch.testing.assert_close(skew, kl, rtol=1e-12, atol=0)


@pytest.mark.parametrize("kind", ["skew_kl", "skew_rkl"])
def test_kd_with_a_skew_divergence_equals_its_definition(kind):
    """alpha CE + (1 - alpha) T^2 D, D the skew divergence at T: value, its two parts and the gradients."""
    hidden, weight, teacher_hidden, teacher_weight, labels = inputs(seed=2)
    keep, alpha, temperature = labels != -100, 0.3, 2.0
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logits = h @ w.T
    ce = torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum")
    d = skew_definition(logits, teacher_hidden @ teacher_weight.T, kind, 0.1, temperature)[keep].sum()
    expected = alpha * ce + (1 - alpha) * temperature ** 2 * d
    expected.backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, tokens, ce_sum, kd_sum = fused_kd_loss(h2, w2, teacher_hidden, teacher_weight, labels, alpha, temperature,
                                                 chunk_size=4, vocab_size=V, divergence=kind, skew=0.1)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(ce_sum, ce.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(kd_sum, temperature ** 2 * d.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close(h2.grad, h.grad, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(w2.grad, w.grad, rtol=1e-6, atol=1e-12)
