"""Losses for SFT, on-policy distillation (generalized JSD / reverse KL) and white-box KD.

Two layers:

* Pure tensor functions on logits: `sft_loss`, `generalized_jsd_loss`, `distillation_loss`.
  Logits and labels are already aligned (position t predicts labels[t]); labels == IGNORE_INDEX (-100) is masked and
  labels=None means every position counts. Callers whose lm_head is padded beyond the tokenizer's vocabulary
  (Qwen3: 151,936 rows) must slice `logits[..., :vocab_size]` themselves, or the padded columns take
  probability mass and change every result.
* `chunked_loss` and its wrappers compute the same sums from final hidden states, projecting through the
  lm_head a chunk of positions at a time and recomputing each chunk in backward, so the (N, V) logits never
  exist in full. The wrappers return sums plus token counts: the training skeleton divides by the token count
  of the whole accumulation window and all ranks (docs/architecture.md, "Invariant 1: exact token normalisation").

Under autocast the chunk's logits matmul runs in the autocast dtype (the lm_head weight cast once per loss,
`autocast_once`); from the logits on, every loss is computed and accumulated in fp32, and the teacher is always a
constant.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dataset.collators import IGNORE_INDEX

REDUCTIONS = ("per_token_mean", "sum", "none")

LossOutput = torch.Tensor | tuple[torch.Tensor, ...]


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


# ----------------------------------------------------------------------------- chunked from hidden states

def _chunk_loss(loss_fn: Callable[..., LossOutput], hidden: torch.Tensor, weight: torch.Tensor,
                low_weight: torch.Tensor | None, labels: torch.Tensor | None, teacher_hidden: torch.Tensor | None,
                teacher_weight: torch.Tensor | None, teacher_values: torch.Tensor | None) -> LossOutput:
    # The teacher is projected in here, not outside: checkpoint keeps its inputs alive until backward, and
    # (chunk, V) teacher logits passed in as inputs would accumulate to the full (N, V) we are avoiding.
    # Recomputing them in backward costs one extra teacher matmul per chunk.
    teacher_logits = teacher_values
    if teacher_hidden is not None:
        with torch.no_grad():
            teacher_logits = teacher_hidden @ teacher_weight.T
    return loss_fn(hidden @ _weight_in_use(weight, low_weight).T, teacher_logits, labels)


class _LowPrecisionUse(torch.autograd.Function):
    """Forward: the weight's copy already cast to the autocast dtype. Backward: the chunk's gradient cast back to the
    weight's own dtype here, so that the chunks' gradients add up in fp32 on the weight, not in bf16 on the copy."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
        ctx.dtype = weight.dtype
        return low

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


def autocast_once(weight: torch.Tensor) -> torch.Tensor | None:
    """The lm_head weight's copy in the autocast dtype, cast once per loss instead of once per chunk matmul (None
    without autocast: fp32, CPU).

    Autocast caches the casts of leaf tensors only; `weight[:vocab_size]` is a view, so every chunk's
    `hidden @ weight.T` would cast the whole (V, H) weight again -- in the forward, in the checkpoint's recompute
    and in the backward (benchmarks/bench_losses.py counts them). Each chunk uses this copy through
    `_LowPrecisionUse`, whose gradient goes to the fp32 weight: a plain `weight.to(bf16)` shared by the chunks would
    sum their gradients in bf16 (0.7% off on a test head of 8 chunks)."""
    device_type = weight.device.type
    if not torch.is_autocast_enabled(device_type):
        return None
    return weight.detach().to(torch.get_autocast_dtype(device_type))


def _weight_in_use(weight: torch.Tensor, low: torch.Tensor | None) -> torch.Tensor:
    return weight if low is None else _LowPrecisionUse.apply(weight, low)


def _add(total: LossOutput | None, part: LossOutput) -> LossOutput:
    if total is None:
        return part
    if isinstance(part, tuple):
        return tuple(a + b for a, b in zip(total, part))
    return total + part


def chunked_loss(loss_fn: Callable[..., LossOutput], student_hidden: torch.Tensor, student_weight: torch.Tensor,
                 labels: torch.Tensor | None, teacher_hidden: torch.Tensor | None = None,
                 teacher_weight: torch.Tensor | None = None, chunk_size: int = 512,
                 vocab_size: int | None = None, teacher_values: torch.Tensor | None = None) -> LossOutput:
    """Sum of loss_fn over chunks of positions, without materialising the (N, V) logits.

    student_hidden (N, H): only the positions that matter (e.g. completion positions); student_weight (V_pad, H):
    the lm_head weight; labels (N,) or None; teacher_hidden (N, H_t) / teacher_weight (V_pad_t, H_t) optional.
    Each chunk computes logits = hidden @ weight[:vocab_size].T (rows beyond vocab_size are the embedding's
    padding and must not take probability mass) and calls
    loss_fn(student_logits, teacher_logits_or_None, labels_or_None) -> scalar sum or tuple of scalar sums.
    teacher_values (N, ...) optional: per-position teacher numbers handed to loss_fn in place of teacher logits
    (a remote teacher's log-probabilities of the labels), or a tuple of such tensors (its top-K ids and their
    log-probabilities), sliced alike.
    Each chunk is checkpointed, so backward recomputes one chunk at a time; the teacher never gets gradients.
    Returns the summed result, with the structure loss_fn returns.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if (teacher_hidden is None) != (teacher_weight is None):
        raise ValueError("pass both teacher_hidden and teacher_weight, or neither")
    if vocab_size is None:
        if teacher_weight is not None and teacher_weight.shape[0] != student_weight.shape[0]:
            raise ValueError(f"student lm_head has {student_weight.shape[0]} rows, teacher's "
                             f"{teacher_weight.shape[0]}; pass vocab_size (the tokenizer's) so both project "
                             "onto the same vocabulary")
        vocab_size = student_weight.shape[0]
    for w in (student_weight, teacher_weight):
        if w is not None and w.shape[0] < vocab_size:
            raise ValueError(f"vocab_size {vocab_size} exceeds the lm_head's {w.shape[0]} rows")
    weight = student_weight[:vocab_size]
    low_weight = autocast_once(weight)
    t_weight = teacher_weight[:vocab_size].detach() if teacher_weight is not None else None
    t_low = autocast_once(t_weight) if t_weight is not None else None
    t_weight = t_low if t_low is not None else t_weight  # a constant: its one cast serves every chunk
    t_hidden = teacher_hidden.detach() if teacher_hidden is not None else None

    # checkpoint only when a graph is being built; under no_grad (evaluation) it would only add overhead
    needs_graph = torch.is_grad_enabled() and (student_hidden.requires_grad or weight.requires_grad)
    num_positions = student_hidden.shape[0]
    total: LossOutput | None = None
    # at least one (possibly empty) chunk, so an empty batch still returns loss_fn's structure of zeros
    for start in range(0, max(num_positions, 1), chunk_size):
        end = start + chunk_size
        args = (loss_fn, student_hidden[start:end], weight, low_weight,
                None if labels is None else labels[start:end],
                None if t_hidden is None else t_hidden[start:end], t_weight,
                None if teacher_values is None else _rows(teacher_values, start, end))
        part = checkpoint(_chunk_loss, *args, use_reentrant=False) if needs_graph else _chunk_loss(*args)
        total = _add(total, part)
    return total


def _rows(values: torch.Tensor | tuple[torch.Tensor, ...], start: int, end: int):
    """Rows start:end of a teacher-values tensor or of each tensor of a tuple, detached (the teacher is a constant)."""
    if isinstance(values, tuple):
        return tuple(v[start:end].detach() for v in values)
    return values[start:end].detach()


def _count(labels: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    if labels is None:
        return torch.tensor(logits.shape[0], dtype=torch.int64, device=logits.device)
    return (labels != IGNORE_INDEX).sum()


def chunked_sft_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 512,
                     vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sft_loss` from hidden states (N, H) and lm_head weight (V_pad, H), chunked.

    Returns (loss_sum, num_tokens).
    """
    def loss_fn(logits, _teacher_logits, chunk_labels):
        return sft_loss(logits, chunk_labels)
    return chunked_loss(loss_fn, hidden, weight, labels, chunk_size=chunk_size, vocab_size=vocab_size)


def chunked_generalized_jsd_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                                 teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
                                 labels: torch.Tensor | None, beta: float = 0.5, temperature: float = 1.0,
                                 chunk_size: int = 512,
                                 vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`generalized_jsd_loss` (reduction="sum") from hidden states, chunked. Returns (loss_sum, num_tokens)."""
    _check_args("sum", temperature, beta)

    def loss_fn(logits, teacher_logits, chunk_labels):
        loss = generalized_jsd_loss(logits, teacher_logits, chunk_labels, beta=beta,
                                    temperature=temperature, reduction="sum")
        return loss, _count(chunk_labels, logits)
    return chunked_loss(loss_fn, student_hidden, student_weight, labels, teacher_hidden, teacher_weight,
                        chunk_size=chunk_size, vocab_size=vocab_size)


def completion_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states at the positions that predict a label, and those labels: (N, H) and (N,).

    The rows must be right padded (SFTCollator, build_sequences): the forward is then plain causal attention without
    a mask -- the fused form (docs/architecture.md, "Attention kernels") -- with the same numbers as a masked forward
    of the same rows, since a real token never attends the pads after it. `attention_mask` is checked, not used.
    `start` is the first column holding any label; position t predicts labels[t + 1], so hidden[:, start-1:-1] goes
    with labels[:, start:]. Labels are the authority: within the slice only positions whose label is not
    IGNORE_INDEX are kept, so neither prompt nor padding ever reaches the lm_head or the loss; the slice is only a
    speed-up that keeps the shortest prompt's positions out of the gather.
    """
    if bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
        raise ValueError("completion_hidden needs right-padded rows (real tokens first, padding after them): "
                         "collate with SFTCollator or build_sequences")
    has_label = (labels[:, 1:] != IGNORE_INDEX).any(dim=0)
    start = int(has_label.nonzero()[0]) + 1 if bool(has_label.any()) else labels.shape[1] - 1
    hidden = model(input_ids, return_hidden=True).hidden_states
    hidden, targets = hidden[:, start - 1:-1], labels[:, start:]
    keep = targets != IGNORE_INDEX
    return hidden[keep], targets[keep]
