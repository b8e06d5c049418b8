# python -m pytest tests/test_token_signals.py
"""The sampled-token OPD signal's variants (trainer/losses/token_signals.py) against float64 definitions written here:
PowerOPD's bounded reward and its a -> 0 limit, IW-OPD's position weights (a plain loop over each row), and the
fused losses that carry them, OPD's sampled-token loss and RL's OPD term (value and gradients, 1e-6 relative from
float64 inputs), whose weights are the same whether the rows come in one micro-batch or split between several."""
import pytest
import torch

from trainer.losses.chunked import completion_rows
from trainer.losses.fused_divergences import fused_sampled_kl_loss
from trainer.losses.policy_gradient import ADVANTAGE, OLD_LOGP, TEACHER_LOGP, fused_policy_loss, policy_loss
from trainer.losses.token_signals import position_weights, token_reward

V, H = 11, 6


def iw_by_loop(rewards: list[float], gamma: float) -> list[float]:
    """IW-OPD's w_t for one row, by its definition: 1 + g (1 - sum_{s<t} |r_s| / sum_s |r_s|)."""
    total = sum(abs(r) for r in rewards)
    return [1 + gamma * (1 - (sum(abs(r) for r in rewards[:t]) / total if total else 0.0))
            for t in range(len(rewards))]


def definition(hidden, weight, teacher_hidden, teacher_weight, labels, reward, alpha, rows, gamma, temperature):
    """The surrogate sum_t stopgrad(-w_t r_t) log p_S(y_t) in float64 autograd, its weights by the plain loop."""
    logp = torch.log_softmax(hidden @ weight.T / temperature, -1).gather(1, labels[:, None]).squeeze(1)
    logq = torch.log_softmax(teacher_hidden @ teacher_weight.T / temperature, -1).gather(1, labels[:, None]).squeeze(1)
    p, q = logp.detach().exp(), logq.exp()
    r = logq - logp.detach() if reward == "log_ratio" else q ** alpha - p ** alpha
    w = torch.ones_like(r)
    if rows is not None:
        for row in rows.unique():
            at = rows == row
            w[at] = torch.tensor(iw_by_loop(r[at].tolist(), gamma), dtype=w.dtype)
    return (-(w * r) * logp).sum(), (logp.detach() - logq).sum()


def inputs(n: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64),
            torch.randn(n, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64),
            torch.randint(0, V, (n,), generator=g))


@pytest.mark.parametrize("reward, alpha", [("log_ratio", 5.0), ("power", 5.0), ("power", 0.5)])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("served", [False, True])
def test_the_fused_loss_equals_the_definition_in_float64(reward, alpha, weighted, served):
    """Value, KL estimate and the gradients to the hidden states and the head (so to the logits): a local teacher's
    logits or a served teacher's log-probabilities, three rows of 2, 3 and 4 tokens, chunks of 4 that cut rows."""
    hidden, weight, teacher_hidden, teacher_weight, labels = inputs()
    rows = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2]) if weighted else None
    temperature = 1.5
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    expected, expected_kl = definition(h, w, teacher_hidden, teacher_weight, labels, reward, alpha, rows, 0.5,
                                       temperature)
    expected.backward()
    teacher = (dict(teacher_logprobs=torch.log_softmax(teacher_hidden @ teacher_weight.T / temperature, -1)
                    .gather(1, labels[:, None]).squeeze(1)) if served
               else dict(teacher_hidden=teacher_hidden, teacher_weight=teacher_weight))
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    loss, tokens, kl = fused_sampled_kl_loss(h2, w2, labels, **teacher, temperature=temperature, chunk_size=4,
                                             vocab_size=V, reward=reward, alpha=alpha, rows=rows, gamma=0.5)
    loss.backward()
    assert int(tokens) == 9
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(kl, expected_kl, rtol=1e-6, atol=0)
    torch.testing.assert_close(h2.grad, h.grad, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(w2.grad, w.grad, rtol=1e-6, atol=1e-12)


def test_power_reward_is_bounded_signed_as_the_log_ratio_and_tends_to_it_over_alpha():
    g = torch.Generator().manual_seed(1)
    student, teacher = (torch.log_softmax(torch.randn(50, V, generator=g, dtype=torch.float64) * 4, -1)[:, 0]
                        for _ in range(2))
    log_ratio = token_reward(student, teacher, "log_ratio")
    for alpha in (5.0, 1.0, 0.1):
        power = token_reward(student, teacher, "power", alpha)
        assert bool((power.abs() <= 1).all()) and torch.equal(power.sign(), log_ratio.sign())
    torch.testing.assert_close(token_reward(student, teacher, "power", 1e-8) / 1e-8, log_ratio, rtol=1e-6, atol=0)


def test_position_weights_equal_the_loop_on_every_row():
    """Rows of 1, 4 and 3 tokens and one all-zero row (w = 1 + g throughout), any gamma."""
    rewards = torch.tensor([0.7, -2.0, 0.5, 0.0, 1.5, 0.0, 0.0, 3.0, -1.0, 0.25], dtype=torch.float64)
    rows = torch.tensor([0, 1, 1, 1, 1, 2, 2, 3, 3, 3])
    for gamma in (0.5, 2.0):
        expected = [w for row in range(4) for w in iw_by_loop(rewards[rows == row].tolist(), gamma)]
        torch.testing.assert_close(position_weights(rewards, rows, gamma), torch.tensor(expected, dtype=torch.float64),
                                   rtol=1e-12, atol=0)
    # the positions of some rows only (a teacher's share of a micro-batch): the row numbers need not start at 0
    torch.testing.assert_close(position_weights(rewards[5:], rows[5:], 0.5), position_weights(rewards, rows, 0.5)[5:])


def test_the_weights_do_not_depend_on_how_rows_are_split_into_micro_batches():
    """A micro-batch holds whole rows: the loss of rows {0, 1, 2} in one call equals rows {0, 1} plus row {2}."""
    hidden, weight, teacher_hidden, teacher_weight, labels = inputs()
    rows = torch.tensor([0, 0, 1, 1, 1, 2, 2, 2, 2])
    common = dict(reward="power", alpha=5.0, vocab_size=V, chunk_size=4)

    def loss(index):
        return fused_sampled_kl_loss(hidden[index], weight, labels[index], teacher_hidden=teacher_hidden[index],
                                     teacher_weight=teacher_weight, rows=rows[index] - rows[index][0], **common)[0]
    whole = loss(torch.arange(9))
    torch.testing.assert_close(loss(torch.arange(5)) + loss(torch.arange(5, 9)), whole, rtol=1e-12, atol=0)


def test_completion_rows_follow_the_labels_row_by_row():
    labels = torch.tensor([[-100, -100, 5, 6, -100], [-100, 7, 8, 9, 10], [-100, -100, -100, 4, -100]])
    assert completion_rows(labels).tolist() == [0, 0, 1, 1, 1, 1, 2]


@pytest.mark.parametrize("reward", ["log_ratio", "power"])
def test_the_rl_opd_term_carries_the_variants_as_its_definition_in_float64(reward):
    """RL's OPD term A_t = A_i + c w_t r_t on-policy (rho = 1): the fused policy loss against float64 autograd of
    -sum_t A_t rho_t with the weights by the plain loop, value and gradients."""
    hidden, weight, teacher_hidden, teacher_weight, labels = inputs(seed=3)
    rows = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    teacher_logp = torch.log_softmax(teacher_hidden @ teacher_weight.T, -1).gather(1, labels[:, None]).squeeze(1)
    values = torch.zeros(9, 4, dtype=torch.float64)
    values[:, ADVANTAGE] = torch.tensor([0.5, 0.5, 0.5, 0.5, -1.0, -1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    values[:, OLD_LOGP] = float("nan")
    values[:, TEACHER_LOGP] = teacher_logp
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp = torch.log_softmax(h @ w.T, -1).gather(1, labels[:, None]).squeeze(1)
    r = token_reward(logp.detach(), teacher_logp, reward, 5.0)
    iw = torch.cat([torch.tensor(iw_by_loop(r[rows == k].tolist(), 0.5), dtype=torch.float64) for k in range(3)])
    advantage = values[:, ADVANTAGE] + 0.7 * iw * r
    expected = -(advantage * torch.exp(logp - logp.detach())).sum()
    expected.backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    sums = fused_policy_loss(h2, w2, labels, values, chunk_size=4, vocab_size=V, opd_coef=0.7, opd_reward=reward,
                             rows=rows, iw_gamma=0.5)
    sums.loss.backward()
    torch.testing.assert_close(sums.loss, expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(h2.grad, h.grad, rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(w2.grad, w.grad, rtol=1e-6, atol=1e-12)
    # the reference (autograd on full logits) takes the same weights
    reference = policy_loss(h.detach() @ w.detach().T, values, labels, opd_coef=0.7, opd_reward=reward,
                            opd_weights=iw)
    torch.testing.assert_close(reference[0], expected.detach(), rtol=1e-6, atol=0)
