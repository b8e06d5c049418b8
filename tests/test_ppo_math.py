# python -m pytest tests/test_ppo_math.py
"""trainer/losses/ppo.py against plain definitions: GAE against a per-token loop over each row on its own (gamma
and lambda at 0, 1 and between; rows of different lengths), the clipped value loss and its gradient against
autograd of its float64 definition."""
import pytest
import torch

from trainer.losses.ppo import gae, value_loss


def loop_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """One row, written out: delta_t = r_t + gamma V_{t+1} - V_t (V_T = 0), A_t = sum_k (gamma lam)^k delta_{t+k}."""
    T = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < T else 0.0) - values[t] for t in range(T)]
    advantages = [sum((gamma * lam) ** k * deltas[t + k] for k in range(T - t)) for t in range(T)]
    return advantages, [a + v for a, v in zip(advantages, values)]


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.0, 0.5), (0.9, 0.0), (1.0, 0.0)])
def test_gae_equals_a_per_token_loop_over_each_row(gamma, lam):
    torch.manual_seed(0)
    lengths = [5, 1, 3, 7]
    T = max(lengths)
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    rewards = torch.randn(len(lengths), T, dtype=torch.float64)
    values = torch.randn(len(lengths), T, dtype=torch.float64)  # the pads' values: anything, never read
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    for row, n in enumerate(lengths):
        expected, expected_returns = loop_gae(rewards[row, :n].tolist(), values[row, :n].tolist(), gamma, lam)
        assert advantages[row, :n].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert returns[row, :n].tolist() == pytest.approx(expected_returns, rel=1e-12, abs=1e-12)
        assert advantages[row, n:].abs().sum() == 0 and returns[row, n:].abs().sum() == 0


def test_with_lambda_one_and_no_discount_the_advantage_is_the_return_to_go_minus_the_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.2, 0.5, 0.9]], dtype=torch.float64)
    advantages, returns = gae(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    assert advantages[0].tolist() == pytest.approx([0.8, 0.5, 0.1]) and returns[0].tolist() == pytest.approx([1.0] * 3)


def test_the_clipped_value_loss_and_its_gradient_are_its_definitions():
    torch.manual_seed(1)
    values = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    old, returns = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    loss, clipped = value_loss(values, old, returns, mask, clip=0.2)
    keep = mask.bool()
    v, o, r = values[keep], old[keep], returns[keep]
    expected = sum(0.5 * max((vi - ri) ** 2, (oi + max(min(vi - oi, 0.2), -0.2) - ri) ** 2)
                   for vi, oi, ri in zip(v.tolist(), o.tolist(), r.tolist()))
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    definition = (0.5 * torch.maximum((v - r) ** 2, (o + (v - o).clamp(-0.2, 0.2) - r) ** 2)).sum()
    assert torch.allclose(torch.autograd.grad(loss, values)[0],
                          torch.zeros_like(values).index_put((keep.nonzero(as_tuple=True)),
                                                             torch.autograd.grad(definition, v)[0]))
    assert 0 < int(clipped) < int(keep.sum())
