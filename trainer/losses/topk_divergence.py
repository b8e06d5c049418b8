"""The divergence a teacher's top-K log-probabilities allow, exactly: over the coarse-grained distribution with one
bucket per token of S (the teacher's top-K at a position plus the sampled token) and one tail bucket for the rest
(docs/serving.md, "Which loss with a served teacher"). By the data-processing inequality it never exceeds the
full-vocabulary divergence and equals it as S covers the mass. It uses the reductions and checks of
trainer/losses/closed_forms.py, the one place loss arithmetic is defined."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dataset.collators import IGNORE_INDEX
from trainer.losses.chunked import checked_vocab_size
from trainer.losses.fused_divergences import _log_softmax_
from trainer.losses.fused_linear import ChunkLoss, fused_linear_loss
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


def _buckets(support_ids: torch.Tensor, teacher_logprobs: torch.Tensor, vocab: int):
    """The buckets of S: its ids sorted (a repeat next to its first occurrence), the teacher's log-probabilities in
    that order, which ids are buckets (in the vocabulary, each once; the others set to 0 and masked), and the rows
    whose S is the whole vocabulary (no tail bucket)."""
    ids, order = support_ids.long().sort(dim=-1)
    teacher = teacher_logprobs.detach().gather(-1, order)
    valid = (ids >= 0) & (ids < vocab)
    valid[..., 1:] &= ids[..., 1:] != ids[..., :-1]
    ids = torch.where(valid, ids, torch.zeros_like(ids))
    return ids, teacher, valid, valid.sum(-1) == vocab


def _teacher_buckets(teacher: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype):
    """The teacher's bucket log-probabilities (..., M + 1): its log-probs on S, then the tail from their total,
    floored at TAIL_FLOOR; and the tail alone (..., 1)."""
    mass = torch.logsumexp(torch.where(valid, teacher.double(), torch.full((), -math.inf, dtype=torch.float64,
                                                                           device=teacher.device)),
                           dim=-1, keepdim=True)
    tail = _log1mexp(mass).clamp_min(math.log(TAIL_FLOOR)).to(dtype)
    return torch.cat([teacher.to(dtype), tail], dim=-1), tail


def _bucket_divergence(logp_s: torch.Tensor, logp_t: torch.Tensor, buckets: torch.Tensor,
                       beta: float) -> torch.Tensor:
    """The generalized JSD at `beta` over the valid buckets, per position (as generalized_jsd_loss over tokens)."""
    if beta == 0.0:
        return _masked_kl(logp_t, logp_s, buckets)
    if beta == 1.0:
        return _masked_kl(logp_s, logp_t, buckets)
    zero = torch.zeros((), dtype=logp_s.dtype, device=logp_s.device)
    log_m = torch.logaddexp(torch.where(buckets, logp_s, zero) + math.log(1.0 - beta),
                            torch.where(buckets, logp_t, zero) + math.log(beta))
    return beta * _masked_kl(logp_t, log_m, buckets) + (1.0 - beta) * _masked_kl(logp_s, log_m, buckets)


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
    ids, teacher, valid, full = _buckets(support_ids, teacher_logprobs, vocab)

    # student: log p_S on S and on the tail, from the chunk's logits (one normalisation)
    z = student_logits if student_logits.dtype == torch.float64 else student_logits.float()  # float64 stays (tests)
    if temperature != 1.0:
        z = z / temperature
    log_z = torch.logsumexp(z, dim=-1, keepdim=True)
    in_support = torch.zeros(z.shape, dtype=torch.int32, device=z.device).scatter_add_(
        -1, ids, valid.to(torch.int32)) > 0
    rest = torch.where(in_support | full.unsqueeze(-1), torch.full((), -math.inf, dtype=z.dtype, device=z.device), z)
    # a zero row keeps logsumexp's gradient finite
    rest = torch.where(full.unsqueeze(-1), torch.zeros((), dtype=z.dtype, device=z.device), rest)
    student_tail = torch.logsumexp(rest, dim=-1, keepdim=True) - log_z
    student_s = z.gather(-1, ids) - log_z

    logp_t, teacher_tail = _teacher_buckets(teacher, valid, z.dtype)
    logp_s = torch.cat([student_s, student_tail], dim=-1)
    buckets = torch.cat([valid, ~full.unsqueeze(-1)], dim=-1)
    loss = _reduce(_non_negative(_bucket_divergence(logp_s, logp_t, buckets, beta)), mask, reduction)
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
    return _top_k_and_label(F.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1), labels, k)


def _top_k_and_label(logp: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_support` from the teacher's log-probabilities `logp` (..., V)."""
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

    vocab_size = checked_vocab_size(student_weight, teacher_weight, chunk_size, vocab_size)
    chunk = topk_chunk_loss(k, beta, temperature, local=teacher_support is None)
    loss, tokens, (tail,) = fused_linear_loss(chunk, student_hidden, student_weight, labels, vocab_size, chunk_size,
                                              teacher_hidden, teacher_weight, values=teacher_support)
    return loss, tokens, tail


def topk_chunk_loss(k: int, beta: float, temperature: float, local: bool) -> ChunkLoss:
    """`topk_divergence` as the fused driver's closed form. The buckets' log-probabilities are small, (C, M + 1):
    the divergence's gradient with respect to them, a, comes from autograd on them alone; the gradient with respect
    to the student's logits z then has a closed form (p = softmax(z / T), P_tail the student's mass outside S):

        dL/dz_v = (a_v [v in S] + a_tail p_v [v not in S] / P_tail - p_v sum_b a_b) / T

    The student's tail is summed from p outside S (no cancellation against the mass on S, as the reference's
    logsumexp outside S). Extra: the teacher's tail mass ("teacher_tail_mass")."""
    def fn(student, teacher, spares, labels, values):
        if local:  # the teacher's top-k and the label (what a server returns), its log-softmax over its logits
            values = _top_k_and_label(_log_softmax_(teacher, temperature), labels, k)
        ids, teacher_logp, valid, full = _buckets(*values, student.shape[1])
        z = student.div_(temperature) if temperature != 1.0 else student
        top = z.amax(dim=-1, keepdim=True)
        e = torch.sub(z, top, out=spares[0]).exp_()         # exp(z - max): each term to fp32's relative rounding
        total = e.sum(dim=-1, keepdim=True)
        log_z = top + total.log()
        e.scatter_add_(1, ids, torch.where(valid, -e.gather(1, ids), 0.0))  # exp(z_v - max) for v not in S
        outside = e.sum(dim=-1, keepdim=True).clamp_min(_TINY)  # summed directly: no cancellation against S's mass
        student_s = torch.where(valid, z.gather(1, ids) - log_z, 0.0)
        with torch.enable_grad():  # the driver's forward runs without a graph: this small one is its own
            logp_s = torch.cat([student_s, outside.log() - total.log()], dim=-1).requires_grad_()
            logp_t, teacher_tail = _teacher_buckets(teacher_logp, valid, logp_s.dtype)
            buckets = torch.cat([valid, ~full[:, None]], dim=-1)
            per_row = _bucket_divergence(logp_s, logp_t, buckets, beta)
            (a,) = torch.autograd.grad(per_row.sum(), logp_s)
        a = torch.where((labels != IGNORE_INDEX)[:, None], a, 0.0)  # a masked row's values may be anything
        p = torch.sub(z, log_z, out=z).exp_()
        # p_v [v not in S] / P_tail = e_v / outside
        g = p.mul_(-a.sum(dim=-1, keepdim=True)).addcmul_(e, torch.where(full, 0.0, a[:, -1])[:, None] / outside)
        g.scatter_add_(1, ids, torch.where(valid, a[:, :-1], 0.0))
        tail = torch.where(full, 0.0, teacher_tail.squeeze(1).exp())
        return per_row.detach().clamp_min(0), g, (tail,)
    return ChunkLoss(fn, spares=1, grad_scale=1.0 / temperature, extra_names=("teacher_tail_mass",))


_TINY = torch.finfo(torch.float32).tiny  # a tail of no mass at all (S holds every token the student gives any)
