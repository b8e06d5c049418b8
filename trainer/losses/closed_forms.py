"""Losses for SFT, on-policy distillation (generalized JSD / reverse KL) and white-box KD, as tensor functions on
logits: `sft_loss`, `generalized_jsd_loss`, `distillation_loss`, the sampled-token reverse KL. Logits and labels
are already aligned (position t predicts labels[t]); labels == IGNORE_INDEX (-100) is masked and labels=None means
every position counts. Callers whose lm_head is padded beyond the tokenizer's vocabulary (Qwen3: 151,936 rows) must
slice `logits[..., :vocab_size]` themselves, or the padded columns take probability mass and change every result.
Every loss is computed and accumulated in fp32; the teacher is always a constant. trainer/losses/chunked.py computes
the same sums from final hidden states, a chunk of positions at a time (the (N, V) logits never exist in full).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dataset.collators import IGNORE_INDEX

REDUCTIONS = ("per_token_mean", "sum", "none")


# ----------------------------------------------------------------------------- helpers

def _loss_mask(labels: torch.Tensor | None, token_shape: torch.Size, device: torch.device) -> torch.Tensor:
    """Boolean mask of the positions that count, shape = logits.shape[:-1]."""
    if labels is None:
        return torch.ones(token_shape, dtype=torch.bool, device=device)
    if labels.shape != token_shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits shape[:-1] {tuple(token_shape)}")
    return labels != IGNORE_INDEX


def _reduce(per_token: torch.Tensor, mask: torch.Tensor, reduction: str) -> torch.Tensor:
    # torch.where (not a multiply) so that whatever sits at masked positions, even inf/NaN from garbage logits,
    # cannot leak into the sum; the gradient reaching masked positions is exactly 0.
    per_token = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    # per_token_mean: a batch without loss tokens gives 0 (not 0/0), with the graph still attached.
    return total / mask.sum().clamp_min(1)


def _check_args(reduction: str, temperature: float, beta: float = 0.0) -> None:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()  # upcast bf16/fp16: log_softmax and the KL sums run in fp32
    if temperature != 1.0:
        logits = logits / temperature
    return F.log_softmax(logits, dim=-1)


def _kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """Per-token KL(p || q) = sum_v p_v (log p_v - log q_v) from log-probabilities (logits must be finite)."""
    return (logp.exp() * (logp - logq)).sum(-1)


def _non_negative(per_token: torch.Tensor) -> torch.Tensor:
    # A KL/JSD is >= 0, but for nearly equal distributions the fp32 sum of p*(log p - log q) can round to
    # about -1e-7 (more often with bf16-rounded inputs). Clamp the value, keep the unclamped gradient
    # (straight-through): the clamp only ever moves the value by rounding noise, and a hard clamp would
    # silently zero the (tiny, correct) gradient at exactly those tokens.
    return per_token + (per_token.clamp_min(0) - per_token).detach()


# ----------------------------------------------------------------------------- pure losses

def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross entropy over labels != -100, in fp32.

    Returns (loss_sum, num_tokens), num_tokens an int64 tensor. No loss token -> loss_sum is 0 with the graph
    intact (its gradient is 0, not NaN): the caller divides by the global token count, never by this one alone.
    """
    vocab = logits.shape[-1]
    loss_sum = F.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    num_tokens = (labels != IGNORE_INDEX).sum()
    return loss_sum, num_tokens


def generalized_jsd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                         labels: torch.Tensor | None = None, beta: float = 0.5, temperature: float = 1.0,
                         reduction: str = "per_token_mean") -> torch.Tensor:
    """Generalized Jensen-Shannon divergence between student and teacher, per token over the full vocabulary.

    beta=0: forward KL(p_T || p_S).  beta=1: reverse KL(p_S || p_T) (the OPD loss).
    0<beta<1: with m = (1-beta) p_S + beta p_T, loss = beta KL(p_T || m) + (1-beta) KL(p_S || m).
    The endpoints are special-cased (as in TRL): the mixture formula itself goes to 0 as beta -> 0 or 1, so the
    loss is not continuous in beta at the ends. No T^2 factor here (unlike `distillation_loss`).
    reduction: "per_token_mean" (sum over unmasked tokens / their count, 0 if none), "sum", or "none"
    (per-token tensor of shape logits.shape[:-1], 0 at masked positions).
    """
    _check_args(reduction, temperature, beta)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ; slice both to the tokenizer's vocab_size")
    mask = _loss_mask(labels, student_logits.shape[:-1], student_logits.device)
    logp_s = _log_probs(student_logits, temperature)
    logp_t = _log_probs(teacher_logits.detach(), temperature)  # the teacher is a constant
    if beta == 0.0:
        per_token = _kl(logp_t, logp_s)
    elif beta == 1.0:
        per_token = _kl(logp_s, logp_t)
    else:
        # log m = logsumexp(log(1-beta) + log p_S, log(beta) + log p_T), elementwise: never leaves log space.
        log_m = torch.logaddexp(logp_s + math.log(1.0 - beta), logp_t + math.log(beta))
        per_token = beta * _kl(logp_t, log_m) + (1.0 - beta) * _kl(logp_s, log_m)
    return _reduce(_non_negative(per_token), mask, reduction)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      labels: torch.Tensor | None = None, temperature: float = 1.0,
                      reduction: str = "per_token_mean") -> torch.Tensor:
    """Hinton KD: T^2 * KL(p_T^T || p_S^T) per token (minimind's train_distillation, without its misnamed
    "batchmean"). The T^2 keeps the gradient scale independent of T. Same reductions as generalized_jsd_loss.
    """
    kl = generalized_jsd_loss(student_logits, teacher_logits, labels, beta=0.0,
                              temperature=temperature, reduction=reduction)
    return kl * (temperature ** 2)


def sampled_token_kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                          temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation from the sampled tokens only (a policy-gradient form of reverse KL).

    k_t = log p_S(y_t) - log p_T(y_t) is a one-sample estimate of KL(p_S || p_T) at position t when y_t was drawn
    from the student. Its gradient is E[k_t * grad log p_S(y_t)] (the score-function term; the direct gradient of
    log p_S has zero expectation), so the surrogate loss is sum_t stopgrad(k_t) * log p_S(y_t): each sampled token's
    log-probability is pushed down in proportion to how much more the student likes it than the teacher does.
    Only the teacher's log-probability of the sampled tokens is needed. Valid only for tokens sampled from the
    current student. Returns (surrogate_loss_sum, kl_estimate_sum) over labels != -100.
    """
    _check_args("sum", temperature)
    logp_t = _log_probs(teacher_logits.detach(), temperature).gather(-1, labels.clamp_min(0).unsqueeze(-1))
    return sampled_token_kl_from_logprobs(student_logits, logp_t.squeeze(-1), labels, temperature)


def sampled_token_kl_from_logprobs(student_logits: torch.Tensor, teacher_logprobs: torch.Tensor,
                                   labels: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampled_token_kl_loss` given the teacher's log-probability of each label (shaped like labels) instead of its
    logits: all a teacher on an inference server returns. Returns (surrogate_loss_sum, kl_estimate_sum)."""
    _check_args("sum", temperature)
    mask = _loss_mask(labels, student_logits.shape[:-1], student_logits.device)
    logp_s = _log_probs(student_logits, temperature).gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    kl_estimate = (logp_s - teacher_logprobs.to(logp_s.dtype)).detach()
    return _reduce(kl_estimate * logp_s, mask, "sum"), _reduce(kl_estimate, mask, "sum")
