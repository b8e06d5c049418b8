"""The divergence a teacher's top-K log-probabilities allow, exactly: over the coarse-grained distribution with one
bucket per token of S (the teacher's top-K at a position plus the sampled token) and one tail bucket for the rest
(docs/serving.md, "Which loss with a served teacher"). By the data-processing inequality it never exceeds the
full-vocabulary divergence and equals it as S covers the mass. It uses the reductions and checks of
trainer/losses/closed_forms.py, the one place loss arithmetic is defined."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from trainer.losses.chunked import chunked_loss, count_tokens
from trainer.losses.closed_forms import _check_args, _loss_mask, _non_negative, _reduce

TAIL_FLOOR = 1e-6  # the least teacher tail mass: fp32 log-probabilities cannot resolve 1 - sum over S any finer


def _log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(a)) for a <= 0 without cancellation (Maechler 2012): log(-expm1(a)) near 0, log1p(-exp(a))
    below -log 2. a == 0 gives -inf."""
    a = a.clamp_max(0.0)
    return torch.where(a > -math.log(2.0), torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def _masked_kl(logp: torch.Tensor, logq: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """sum over the valid buckets of p (log p - log q). The invalid buckets are replaced by 0 before any arithmetic,
    so an -inf there can put neither a NaN in the value nor one in the gradient."""
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    logp, logq = torch.where(valid, logp, zero), torch.where(valid, logq, zero)
    return torch.where(valid, logp.exp() * (logp - logq), zero).sum(-1)


def topk_divergence(student_logits: torch.Tensor, support_ids: torch.Tensor, teacher_logprobs: torch.Tensor,
                    labels: torch.Tensor | None = None, beta: float = 1.0, temperature: float = 1.0,
                    reduction: str = "sum", return_tail: bool = False):
    """Generalized JSD between the coarse-grained student and teacher distributions: the buckets are the tokens of
    the support S, one each, and one tail bucket holding every other token of the vocabulary.

    student_logits (..., V): V is the vocabulary both are normalised over (the tokenizer's). support_ids (..., M):
    the token ids of S at each position (a served teacher's top-K plus the sampled token); an id < 0 or >= V, or one
    repeated in its row, is not a bucket (so the sampled token can simply be appended, and a padding row of a
    served head falls into the tail). teacher_logprobs (..., M): the teacher's log-probabilities of those ids, at
    `temperature`, normalised over its whole head (ignored where the id is not a bucket).

    Teacher buckets: p_T(s) for s in S and the tail 1 - sum_S p_T, computed as log1p(-exp(logsumexp)) in float64
    and floored at TAIL_FLOOR (fp32 log-probabilities cannot resolve a smaller tail; without the floor a tail
    rounding to 0 would make the reverse KL infinite). Student buckets: p_S(s) for s in S, and the tail as the
    logsumexp of the student's logits outside S (exact, no cancellation), both from one softmax over the chunk's
    logits; gradients reach the student through both. When S holds the whole vocabulary there is no tail bucket.
    Over the buckets: beta=0 forward KL(p_T || p_S), beta=1 reverse KL(p_S || p_T), between the generalized JSD
    with m = (1-beta) p_S + beta p_T, as `generalized_jsd_loss`. By the data-processing inequality the result
    never exceeds `generalized_jsd_loss` on the full distributions in exact arithmetic, and equals it when S covers
    all the mass (the floor aside). With fp32 log-probabilities (a server's, or topk_support's) a small teacher
    tail is a difference of nearly equal numbers, known to a few percent: where the student puts most of its mass
    there, the tail's term can exceed the full divergence (measured on the demo's pair: top-64 at 1.001 of the exact
    mean, 0.4% at the worst position; docs/serving.md). Same reductions as generalized_jsd_loss; with return_tail
    also the teacher's tail mass per token (reduced alike).
    """
    _check_args(reduction, temperature, beta)
    if support_ids.shape != teacher_logprobs.shape or support_ids.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(f"support ids {tuple(support_ids.shape)} and teacher log-probs "
                         f"{tuple(teacher_logprobs.shape)} must both be student logits' leading shape "
                         f"{tuple(student_logits.shape[:-1])} + (M,)")
    vocab = student_logits.shape[-1]
    mask = _loss_mask(labels, student_logits.shape[:-1], student_logits.device)
    # the buckets: valid ids, each once (sorted, so that a repeat sits next to its first occurrence)
    ids, order = support_ids.long().sort(dim=-1)
    teacher = teacher_logprobs.detach().gather(-1, order)
    valid = (ids >= 0) & (ids < vocab)
    valid[..., 1:] &= ids[..., 1:] != ids[..., :-1]
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    full = valid.sum(-1) == vocab  # S is the whole vocabulary: no tail bucket

    # student: log p_S on S and on the tail, from the chunk's logits (one normalisation)
    z = student_logits.float()
    if temperature != 1.0:
        z = z / temperature
    log_z = torch.logsumexp(z, dim=-1, keepdim=True)
    in_support = torch.zeros(z.shape, dtype=torch.int32, device=z.device).scatter_add_(
        -1, ids, valid.to(torch.int32)) > 0
    rest = torch.where(in_support | full.unsqueeze(-1), torch.full((), -math.inf, device=z.device), z)
    rest = torch.where(full.unsqueeze(-1), torch.zeros((), device=z.device), rest)  # keeps logsumexp's grad finite
    student_tail = torch.logsumexp(rest, dim=-1, keepdim=True) - log_z
    student_s = z.gather(-1, ids) - log_z

    # teacher: its log-probs on S, the tail from their total
    teacher_s = teacher.float()
    teacher_mass = torch.logsumexp(torch.where(valid, teacher.double(), torch.full((), -math.inf,
                                                                                     dtype=torch.float64,
                                                                                     device=z.device)),
                                   dim=-1, keepdim=True)
    teacher_tail = _log1mexp(teacher_mass).clamp_min(math.log(TAIL_FLOOR)).float()

    tail_valid = ~full.unsqueeze(-1)
    logp_s = torch.cat([student_s, student_tail], dim=-1)
    logp_t = torch.cat([teacher_s, teacher_tail], dim=-1)
    buckets = torch.cat([valid, tail_valid], dim=-1)
    if beta == 0.0:
        per_token = _masked_kl(logp_t, logp_s, buckets)
    elif beta == 1.0:
        per_token = _masked_kl(logp_s, logp_t, buckets)
    else:
        zero = torch.zeros((), device=z.device)
        log_m = torch.logaddexp(torch.where(buckets, logp_s, zero) + math.log(1.0 - beta),
                                torch.where(buckets, logp_t, zero) + math.log(beta))
        per_token = beta * _masked_kl(logp_t, log_m, buckets) + (1.0 - beta) * _masked_kl(logp_s, log_m, buckets)
    loss = _reduce(_non_negative(per_token), mask, reduction)
    if not return_tail:
        return loss
    tail_mass = torch.where(full, torch.zeros((), device=z.device), teacher_tail.squeeze(-1).exp())
    return loss, _reduce(tail_mass, mask, reduction)


def topk_support(teacher_logits: torch.Tensor, labels: torch.Tensor, k: int,
                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """What a served teacher returns with `prompt_logprobs: k`, from a local teacher's logits (..., V): the ids of
    its top-k tokens and of the label, (..., k+1), and its log-probabilities of them at `temperature`, over V
    (`topk_divergence` drops the label's column where it is already in the top-k, or is IGNORE_INDEX)."""
    logits = teacher_logits.detach()
    logits = logits if logits.dtype == torch.float64 else logits.float()  # float64 stays float64 (the tests')
    logp = F.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    top = logp.topk(min(k, logp.shape[-1]), dim=-1)
    label = labels.clamp_min(0).unsqueeze(-1)
    ids = torch.cat([top.indices, torch.where(labels.unsqueeze(-1) < 0, -1, label)], dim=-1)
    return ids, torch.cat([top.values, logp.gather(-1, label)], dim=-1)


def chunked_topk_divergence(student_hidden: torch.Tensor, student_weight: torch.Tensor, labels: torch.Tensor,
                            k: int, teacher_hidden: torch.Tensor | None = None,
                            teacher_weight: torch.Tensor | None = None,
                            teacher_support: tuple[torch.Tensor, torch.Tensor] | None = None, beta: float = 1.0,
                            temperature: float = 1.0, chunk_size: int = 512, vocab_size: int | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`topk_divergence` (reduction "sum") from hidden states, chunked like `chunked_generalized_jsd_loss` (the
    student's lm_head once per chunk, no (N, V) tensor beyond a chunk). The support and the teacher's
    log-probabilities come either from a server, teacher_support = (ids (N, M), log-probs (N, M)), or from a local
    teacher, teacher_hidden / teacher_weight, whose chunk's logits give its top-k plus the label (`topk_support`):
    the same function on the same numbers. Returns (loss_sum, num_tokens, teacher_tail_mass_sum)."""
    _check_args("sum", temperature, beta)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if (teacher_support is None) == (teacher_hidden is None):
        raise ValueError("pass teacher_support (a served teacher's top-k) or teacher_hidden and teacher_weight")

    def loss_fn(logits, teacher_values, chunk_labels):
        if teacher_support is None:
            ids, logprobs = topk_support(teacher_values, chunk_labels, k, temperature)
        else:
            ids, logprobs = teacher_values
        loss, tail = topk_divergence(logits, ids, logprobs, chunk_labels, beta, temperature, "sum", return_tail=True)
        return loss, count_tokens(chunk_labels, logits), tail
    return chunked_loss(loss_fn, student_hidden, student_weight, labels, teacher_hidden, teacher_weight,
                        chunk_size=chunk_size, vocab_size=vocab_size, teacher_values=teacher_support)
