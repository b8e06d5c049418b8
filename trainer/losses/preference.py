"""DPO's losses on preference pairs (trainer/train_dpo.py), in TRL 1.16.0's conventions (trl/trainer/dpo_trainer.py,
DPOTrainer._compute_loss; tests/test_dpo.py pins them against its code).

Pair i: a prompt x, a chosen answer y_w and a rejected one y_l. S_w, S_l: the policy's log-probabilities of the
answers, summed over their tokens; R_w, R_l: the frozen reference's; n_w, n_l: their token counts.

    log-ratios   h_w = S_w - R_w,   h_l = S_l - R_l
    rewards      beta h_w, beta h_l (the implicit rewards), their margin beta (h_w - h_l), the pair counted right
                 when beta h_w > beta h_l (TRL's rewards/accuracies: strictly greater)
    sigmoid      l = -log sigmoid(beta (h_w - h_l))                     DPO (Rafailov et al., 2023); TRL's default
    ipo          l = (h_w / n_w - h_l / n_l - 1 / (2 beta))^2           IPO (Azar et al., 2023, eq. 17) on the
                                                                        log-ratios averaged over each answer's
                                                                        tokens, as TRL 1.16 computes it
    rpo term     + alpha (-S_w / n_w)                                   the chosen answer's NLL per token (RPO, Pang
                                                                        et al., 2024, eq. 2: length-normalised)

The loss of a window is the mean of l over its pairs on all ranks: the loop backwards the sum over a micro-batch's
pairs and the skeleton divides by the window's pair count, so accumulation and world size change nothing. TRL 1.16
has no rpo_alpha; its RPO is loss_type=["sigmoid", "sft"] with loss_weights [1, alpha], whose "sft" term is the
mean NLL over the micro-batch's chosen *tokens*: the same as ours when a micro-batch holds one pair or its chosen
answers have one length, otherwise a token-weighted mean that no per-pair normalisation can reproduce exactly
under accumulation. Ours is the RPO paper's per-answer mean, averaged over pairs.

The gradient, without the B x T x V logits. The loss is a function of the answers' sums S, so
dL/dz_t = c_r (onehot(y_t) - p_t) at every position t of answer r, with c_r = dL/dS_r. Two passes over the
completion positions through the lm_head: the first, without gradients, gives S (trainer/losses/policy_gradient.py's
`token_logprobs`), from which the pair losses and c come in float64; the second is the fused driver
(trainer/losses/fused_linear.py) on sum_t c_r(t) log p(y_t), whose gradient is the loss's. One projection more than
SFT's fused cross entropy -- IW-OPD's weights take the same extra pass. TRL computes the same in one pass with its
fused lm_head kernel keeping each position's log-probability for autograd.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dataset.collators import IGNORE_INDEX
from trainer.losses.fused_linear import ChunkLoss, add_at_labels, fused_linear_loss
from trainer.losses.policy_gradient import token_logprobs

PAIR_LOSSES = ("sigmoid", "ipo")
CHOSEN, REJECTED = 0, 1  # the columns of the (P, 2) per-pair tensors


def pair_losses(policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor, loss_type: str = "sigmoid",
                beta: float = 0.1, rpo_alpha: float = 0.0) -> torch.Tensor:
    """Each pair's loss (P,) from the policy's and the reference's summed log-probabilities of its answers (P, 2:
    chosen, rejected) and the answers' token counts (P, 2); differentiable in `policy`. See the module docstring."""
    ratios = policy - reference
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * (ratios[:, CHOSEN] - ratios[:, REJECTED]))
    elif loss_type == "ipo":
        averaged = ratios / counts.clamp_min(1)
        losses = (averaged[:, CHOSEN] - averaged[:, REJECTED] - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"pair loss {loss_type!r}: use one of {PAIR_LOSSES}")
    if rpo_alpha:
        losses = losses - rpo_alpha * policy[:, CHOSEN] / counts[:, CHOSEN].clamp_min(1)
    return losses


@dataclass
class PairSums:
    """A micro-batch's pairs, summed: the loss (its gradient the policy's), the pairs, and what is logged per pair --
    the implicit rewards beta h_w and beta h_l, pairs whose chosen reward is the higher, the answers' summed
    log-probabilities (no gradient) and their tokens."""
    loss: torch.Tensor
    pairs: int
    reward_chosen: torch.Tensor
    reward_rejected: torch.Tensor
    correct: torch.Tensor
    logp_chosen: torch.Tensor
    logp_rejected: torch.Tensor
    answer_tokens: torch.Tensor

    def add_to(self, metrics, prefix: str = "") -> None:
        """Each as a mean per pair of the window (all ranks): reward_chosen, reward_rejected, reward_margin,
        pair_accuracy, logp_chosen, logp_rejected; and answer_tokens, the answers' tokens of the window (the
        skeleton's `tokens` count pairs, its divisor)."""
        metrics.total(prefix + "answer_tokens", self.answer_tokens)
        for name, value in (("reward_chosen", self.reward_chosen), ("reward_rejected", self.reward_rejected),
                            ("reward_margin", self.reward_chosen - self.reward_rejected),
                            ("pair_accuracy", self.correct), ("logp_chosen", self.logp_chosen),
                            ("logp_rejected", self.logp_rejected)):
            metrics.ratio(prefix + name, value, self.pairs)


def answer_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor,
                 num_rows: int, chunk_size: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each answer's summed log-probability (float64) and token count, (num_rows,) each, from the final hidden states
    at its completion positions (completion_hidden's (N, H), `rows` (N,) each one's answer), chunk by chunk through
    the lm_head, no gradient. The sum runs position by position in completion_hidden's order (index_add_ in
    float64), so an answer's number depends on its own positions' log-probabilities only."""
    logp = token_logprobs(hidden, weight, labels, chunk_size, vocab_size).double()
    sums = torch.zeros(num_rows, dtype=torch.float64, device=hidden.device).index_add_(0, rows, logp)
    counts = torch.zeros(num_rows, dtype=torch.float64, device=hidden.device).index_add_(
        0, rows, torch.ones_like(logp))
    return sums, counts


def as_pairs(per_answer: torch.Tensor) -> torch.Tensor:
    """(2P,) numbers of the 2P answers, chosen ones first (dataset/collators.py's PairCollator) -> (P, 2)."""
    return per_answer.view(2, -1).T


def _weighted_logprob(logits: torch.Tensor, _teacher, _spares, labels: torch.Tensor, weights: torch.Tensor):
    """c_t log p(y_t) per position and its gradient c_t (onehot(y_t) - p_t), in the logits' buffer."""
    log_p = torch.log_softmax(logits, dim=-1, out=logits)
    c = torch.where(labels != IGNORE_INDEX, weights.to(log_p.dtype), 0.0)  # a masked row's G finite (zero)
    per_row = c * log_p.gather(1, labels.clamp_min(0)[:, None]).squeeze(1)
    return per_row, add_at_labels(log_p.exp_().mul_(-c[:, None]), labels, c), ()


WEIGHTED_LOGPROB = ChunkLoss(_weighted_logprob)


def fused_pair_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor,
                    reference: torch.Tensor, chunk_size: int, vocab_size: int, loss_type: str = "sigmoid",
                    beta: float = 0.1, rpo_alpha: float = 0.0) -> PairSums:
    """The pair losses of a micro-batch of P pairs, summed, from the student's final hidden states at the completion
    positions of its 2P answers (chosen ones first; `rows` (N,) each position's answer) and the reference's summed
    log-probabilities (P, 2), without the full logits (the module docstring's two passes). Under no_grad (a held-out
    evaluation) only the first pass runs."""
    num_pairs = reference.shape[0]
    sums, counts = answer_logps(hidden, weight, labels, rows, 2 * num_pairs, chunk_size, vocab_size)
    policy, counts = as_pairs(sums).clone().requires_grad_(torch.is_grad_enabled()), as_pairs(counts)
    reference = reference.to(policy)
    total = pair_losses(policy, reference, counts, loss_type, beta, rpo_alpha).sum()
    loss = total.detach()
    if torch.is_grad_enabled():
        (grad,) = torch.autograd.grad(total, policy)
        weights = grad.T.reshape(-1)[rows]  # c of each position's answer
        surrogate, _, _ = fused_linear_loss(WEIGHTED_LOGPROB, hidden, weight, labels, vocab_size, chunk_size,
                                            values=weights)
        loss = loss + (surrogate - surrogate.detach())  # the value is the pair losses', the gradient theirs too
    rewards = beta * (policy.detach() - reference)
    return PairSums(loss, num_pairs, rewards[:, CHOSEN].sum(), rewards[:, REJECTED].sum(),
                    (rewards[:, CHOSEN] > rewards[:, REJECTED]).sum(), policy.detach()[:, CHOSEN].sum(),
                    policy.detach()[:, REJECTED].sum(), counts.sum())
