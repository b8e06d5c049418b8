# python -m pytest tests/test_policy_gradient.py
"""trainer/losses/policy_gradient.py against closed forms: a hand-computed group's advantages (grpo and drgrpo, a group
with one reward, a group of one), the per-token loss on hand-picked ratios that clip on both sides, the k3 estimator
against its definition (and its mean against the exact KL), the OPD term, and the chunked loss's value and gradient
against autograd of a dense reference written from the formulas. TRL's own formulas are pinned in
tests/test_rl_reference.py."""
import math

import pytest
import torch

from trainer.losses.policy_gradient import (ADVANTAGE, OLD_LOGP, REF_LOGP, TEACHER_LOGP, fused_policy_loss,
                                     group_advantages, k3, policy_loss, token_logprobs)


def test_a_hand_computed_group():
    # group 1: rewards 1, 0, 0, 1 -> mean 0.5, Bessel std sqrt(1/3); group 2: 0, 0, 0, 0 -> no signal
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    std = math.sqrt(((0.5 ** 2) * 4) / 3)
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4)
    grpo = group_advantages(rewards, 4, "grpo")
    assert torch.allclose(grpo[:4], expected, atol=1e-6) and torch.equal(grpo[4:], torch.zeros(4))
    drgrpo = group_advantages(rewards, 4, "drgrpo")
    assert torch.equal(drgrpo, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    assert torch.equal(group_advantages(torch.tensor([1.0, 0.0, 3.0]), 1, "grpo"), torch.zeros(3))  # G = 1
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


def test_k3_is_its_definition_and_its_mean_is_the_kl():
    logp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.5, -1.0, -0.5])
    d = ref - logp
    assert torch.allclose(k3(ref, logp), torch.exp(d) - d - 1) and k3(ref, logp)[2] == 0 and bool((k3(ref, logp) >= 0).all())
    # E_{y ~ pi}[k3] = KL(pi || ref) exactly, over a whole small vocabulary
    torch.manual_seed(0)
    pi, p_ref = torch.log_softmax(torch.randn(7), 0), torch.log_softmax(torch.randn(7), 0)
    exact = (pi.exp() * (pi - p_ref)).sum()
    assert float((pi.exp() * k3(p_ref, pi)).sum()) == pytest.approx(float(exact), rel=1e-5)


def one_position_logits(logp_of_label: float, label: int = 0, vocab: int = 4) -> torch.Tensor:
    """Logits whose log-softmax gives `label` exactly log-probability logp_of_label (the rest shared equally)."""
    rest = math.log((1 - math.exp(logp_of_label)) / (vocab - 1))
    logits = torch.full((vocab,), rest, dtype=torch.float64)
    logits[label] = logp_of_label
    return logits


def test_the_clipped_loss_on_hand_picked_ratios():
    """Four tokens, eps_low 0.2, eps_high 0.28: rho = 1.5 with A = +1 (clipped above: 1.28), rho = 0.5 with A = -1
    (clipped below: -0.8 -> loss 0.8), rho = 1.1 with A = +2 (inside: 2.2), rho = 0.5 with A = +1 (below the clip
    but A > 0: the unclipped 0.5 is the smaller, so not clipped)."""
    logp = torch.log(torch.tensor([0.3, 0.2, 0.4, 0.1], dtype=torch.float64))
    rho = torch.tensor([1.5, 0.5, 1.1, 0.5], dtype=torch.float64)
    advantage = torch.tensor([1.0, -1.0, 2.0, 1.0], dtype=torch.float64)
    logits = torch.stack([one_position_logits(float(v)) for v in logp]).requires_grad_()
    values = torch.zeros(4, 4, dtype=torch.float64)
    values[:, ADVANTAGE], values[:, OLD_LOGP] = advantage, logp - torch.log(rho)
    loss, tokens, clipped, kl, *_ = policy_loss(logits, values, torch.zeros(4, dtype=torch.long),
                                                  clip_low=0.2, clip_high=0.28)
    per_token = torch.tensor([-1.28, 0.8, -2.2, -0.5], dtype=torch.float64)
    assert float(loss.detach()) == pytest.approx(float(per_token.sum()), abs=1e-5)
    assert int(tokens) == 4 and int(clipped) == 2 and float(kl) == 0.0
    loss.backward()
    # d loss / d log pi(y): 0 where clipped, - rho * A elsewhere
    dlogp = torch.tensor([0.0, 0.0, -1.1 * 2.0, -0.5 * 1.0], dtype=torch.float64)
    p = torch.softmax(logits.detach(), -1)
    onehot = torch.nn.functional.one_hot(torch.zeros(4, dtype=torch.long), 4).double()
    assert torch.allclose(logits.grad, dlogp[:, None] * (onehot - p), atol=1e-5)


def test_on_policy_is_the_plain_policy_gradient_and_the_opd_term_the_sampled_kl():
    torch.manual_seed(1)
    logits = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([3, 0, 10, -100, 7, 2])
    values = torch.zeros(6, 4, dtype=torch.float64)
    values[:, ADVANTAGE] = torch.tensor([0.5, 0.5, -1.0, 0.0, 2.0, 2.0], dtype=torch.float64)
    values[:, OLD_LOGP] = float("nan")
    values[:, TEACHER_LOGP] = torch.log_softmax(torch.randn(6, 11, dtype=torch.float64), -1)[
        torch.arange(6), labels.clamp_min(0)]
    loss, tokens, _, _, _, opd, *_ = policy_loss(logits, values, labels, temperature=1.3, opd_coef=0.7)
    logp = torch.log_softmax(logits / 1.3, -1)[torch.arange(6), labels.clamp_min(0)]
    mask = labels != -100
    gap = (logp - values[:, TEACHER_LOGP]).detach()
    surrogate = -((values[:, ADVANTAGE] - 0.7 * gap) * logp)[mask].sum()   # rho = 1: A_t log pi, its gradient
    assert int(tokens) == 5 and float(opd) == pytest.approx(float(gap[mask].sum()), abs=1e-9)
    assert float(loss.detach()) == pytest.approx(float(-(values[:, ADVANTAGE] - 0.7 * gap)[mask].sum()), abs=1e-9)
    grad, = torch.autograd.grad(loss, logits)
    expected, = torch.autograd.grad(surrogate, logits)
    assert torch.allclose(grad, expected, atol=1e-10)


def dense_reference(hidden, weight, labels, values, temperature, eps_low, eps_high, kl_coef, opd_coef, kind="clip",
                    is_weights=None):
    """The loss written from the formulas on full (n, V) logits: PPO's clipped surrogate, or CISPO's detached
    clipped weight times log pi, each times the rollout correction's weight."""
    logp = torch.log_softmax(hidden @ weight.T / temperature, -1).gather(1, labels[:, None]).squeeze(1)
    old = torch.where(values[:, OLD_LOGP].isnan(), logp.detach(), values[:, OLD_LOGP])
    advantage = values[:, ADVANTAGE] - opd_coef * (logp.detach() - values[:, TEACHER_LOGP])
    ratio = (logp - old).exp()
    if kind == "cispo":
        pg = -ratio.clamp(1 - eps_low, 1 + eps_high).detach() * advantage * logp
    else:
        pg = -torch.min(ratio * advantage, ratio.clamp(1 - eps_low, 1 + eps_high) * advantage)
    if is_weights is not None:
        pg = is_weights * pg
    d = values[:, REF_LOGP] - logp
    return (pg + kl_coef * (d.exp() - d - 1)).sum()


def test_cispo_on_hand_picked_ratios():
    """The weight is rho clipped to [1 - eps_low, 1 + eps_high] and detached: rho = 1.5 -> 1.28, 0.5 -> 0.8, 1.1
    stays; every token keeps a gradient, - weight * A per unit of log pi (PPO's clip zeroes the first two)."""
    logp = torch.log(torch.tensor([0.3, 0.2, 0.4], dtype=torch.float64))
    rho = torch.tensor([1.5, 0.5, 1.1], dtype=torch.float64)
    advantage = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    logits = torch.stack([one_position_logits(float(v)) for v in logp]).requires_grad_()
    values = torch.zeros(3, 4, dtype=torch.float64)
    values[:, ADVANTAGE], values[:, OLD_LOGP] = advantage, logp - torch.log(rho)
    loss, tokens, clipped, _, _, _, ratio, approx_kl = policy_loss(
        logits, values, torch.zeros(3, dtype=torch.long), clip_low=0.2, clip_high=0.28, kind="cispo")
    weight = torch.tensor([1.28, 0.8, 1.1], dtype=torch.float64)
    assert float(loss.detach()) == pytest.approx(float(-(weight * advantage * logp).sum()), rel=1e-12)
    assert int(tokens) == 3 and int(clipped) == 2
    assert float(ratio) == pytest.approx(3.1, rel=1e-12)
    assert float(approx_kl) == pytest.approx(float((rho - 1 - rho.log()).sum()), rel=1e-12)
    loss.backward()
    p = torch.softmax(logits.detach(), -1)
    onehot = torch.nn.functional.one_hot(torch.zeros(3, dtype=torch.long), 4).double()
    assert torch.allclose(logits.grad, (-weight * advantage)[:, None] * (onehot - p), atol=1e-12)


@pytest.mark.parametrize("corrected", [False, True], ids=["", "is-weighted"])
@pytest.mark.parametrize("kind", ["clip", "cispo"])
@pytest.mark.parametrize("on_policy", [True, False], ids=["on-policy", "off-policy"])
def test_the_chunked_loss_and_gradient_equal_a_dense_reference(on_policy, kind, corrected):
    """Off-policy (log pi_old recorded: the ratio away from 1, the clip binding on some tokens), the fused loss's
    value, gradients and logged sums (the ratio's, the approximate KL's) against float64 definitions; with the
    rollout correction's importance weights on the policy term."""
    torch.manual_seed(2)
    n, h, v = 13, 8, 40
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v + 3, h, dtype=torch.float64, requires_grad=True)  # 3 padding rows: never read
    labels = torch.randint(0, v, (n,))
    values = torch.randn(n, 4, dtype=torch.float64)
    values[:, OLD_LOGP] = float("nan") if on_policy else -3.0 + 0.5 * torch.randn(n, dtype=torch.float64)
    values[:, REF_LOGP] = -3.0 + 0.3 * torch.randn(n, dtype=torch.float64)
    values[:, TEACHER_LOGP] = -3.0 + 0.3 * torch.randn(n, dtype=torch.float64)
    settings = dict(temperature=0.9, clip_low=0.2, clip_high=0.28, kl_coef=0.05, opd_coef=0.5)
    is_weights = torch.rand(n, dtype=torch.float64) * 2 if corrected else None
    sums = fused_policy_loss(hidden, weight, labels, values, chunk_size=4, vocab_size=v, kind=kind,
                             is_weights=is_weights, **settings)
    grads = torch.autograd.grad(sums.loss, (hidden, weight))
    reference = dense_reference(hidden, weight[:v], labels, values, 0.9, 0.2, 0.28, 0.05, 0.5, kind, is_weights)
    expected = torch.autograd.grad(reference, (hidden, weight))
    assert float(sums.loss.detach()) == pytest.approx(float(reference.detach()), rel=1e-10)
    assert all(torch.allclose(a, b, atol=1e-10) for a, b in zip(grads, expected))
    assert int(sums.tokens) == n and float(sums.kl) > 0 and (int(sums.clipped) > 0) != on_policy
    logp = torch.log_softmax(hidden.detach() @ weight[:v].detach().T / 0.9, -1).gather(1, labels[:, None]).squeeze(1)
    log_ratio = torch.zeros(n, dtype=torch.float64) if on_policy else logp - values[:, OLD_LOGP]
    assert float(sums.ratio) == pytest.approx(float(log_ratio.exp().sum()), rel=1e-10)
    assert float(sums.approx_kl) == pytest.approx(float((log_ratio.exp() - 1 - log_ratio).sum()), rel=1e-9, abs=1e-12)


def test_token_logprobs_is_the_log_softmax_of_the_label():
    torch.manual_seed(3)
    hidden, weight, labels = torch.randn(9, 5), torch.randn(12, 5), torch.randint(0, 10, (9,))
    expected = torch.log_softmax(hidden @ weight[:10].T / 2.0, -1).gather(1, labels[:, None]).squeeze(1)
    assert torch.allclose(token_logprobs(hidden, weight, labels, 4, 10, 2.0), expected, atol=1e-6)
