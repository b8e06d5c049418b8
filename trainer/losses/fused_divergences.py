"""The generalized JSD of trainer/losses/closed_forms.py from final hidden states, its gradient computed with the loss:
OPD's training phase near the machine's bound (benchmarks/bench_opd.py prints the roofline).

The generic chunked path (trainer/losses/chunked.py's `chunked_loss`) checkpoints each chunk of positions: its
backward recomputes both lm_head projections and every elementwise step of the loss, and autograd keeps each step's
inputs -- two GEMMs more per chunk than the three a projection's forward and backward need, and some fifteen passes
over the chunk's (C, V) logits. This divergence's gradient with respect to the student's logits z has a closed form
(p = softmax(z / T), q the teacher's, both over the tokenizer's vocabulary):

    beta = 1, KL(p || q):      dL/dz = p (d - KL) / T,             d = log p - log q
    beta = 0, KL(q || p):      dL/dz = (p - q) / T
    0 < beta < 1:              dL/dz = p (g - sum_v p_v g_v) / T,  g = (1 - beta)(log p - log m),
                               m = (1 - beta) p + beta q, L = beta KL(q || m) + (1 - beta) KL(p || m)

(DistiLLM's skew KL and skew reverse KL: `_skew_divergence_and_grad`), so each chunk computes both projections, the
per-token losses and the gradients with respect to the student's hidden states and lm_head at once, and the backward only scales them by the loss's incoming gradient: per chunk three
GEMMs of the student's head (the projection, then dL/dh = G W and dL/dW += G^T h) and one of the teacher's, and
for reverse KL two exponentials per logit (the two log-softmaxes; p is exp(log p)). The values equal the autograd
path's to float rounding (tests/test_fused_divergences.py: against float64 autograd, and under bf16 autocast against
the checkpointed path; tests/test_skew_divergences.py).

Precision, masking and the driver's work per chunk: trainer/losses/fused_linear.py, whose ChunkLoss this is. The
per-token divergence is clamped at 0 with its gradient unchanged (closed_forms._non_negative).
"""
from __future__ import annotations

import math

import torch

from dataset.collators import IGNORE_INDEX
from trainer.losses.chunked import checked_vocab_size
from trainer.losses.closed_forms import _check_args
from trainer.losses.fused_linear import ChunkLoss, add_at_labels, fused_linear_loss
from trainer.losses.policy_gradient import opd_position_weights, token_logprobs
from trainer.losses.token_signals import token_reward

SKEWS, SKEW = ("skew_kl", "skew_rkl"), 0.1  # DistiLLM's skew divergences (arXiv 2402.03898) and its a


def _log_softmax_(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature != 1.0:
        logits.div_(temperature)
    return torch.log_softmax(logits, dim=-1, out=logits)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[c, v] b[c, v] per row, without a (C, V) temporary (a batched matrix product)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0])


def _divergence_and_grad(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float,
                         spares: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row divergence (C,) and T x its gradient with respect to the student's logits (C, V), from the chunk's
    fp32 logits `student` and `teacher`, which it overwrites (the gradient is returned in one of them); `spares`
    more (C, V) buffers: none for beta = 1, one for beta = 0, two between."""
    log_p = _log_softmax_(student, temperature)
    log_q = _log_softmax_(teacher, temperature)
    if beta == 1.0:
        d = torch.sub(log_p, log_q, out=log_q)
        p = log_p.exp_()
        p_d = d.mul_(p)
        kl = p_d.sum(dim=-1)
        return kl, p_d.addcmul_(p, kl[:, None], value=-1.0)  # p (d - KL)
    if beta == 0.0:
        q = torch.exp(log_q, out=spares[0])
        d = torch.sub(log_q, log_p, out=log_q)
        kl = _row_dot(q, d)
        return kl, log_p.exp_().sub_(q)
    log_m = torch.logaddexp(torch.add(log_p, math.log(1.0 - beta), out=spares[0]),
                            torch.add(log_q, math.log(beta), out=spares[1]), out=spares[0])
    p = torch.exp(log_p, out=spares[1])
    g = torch.sub(log_p, log_m, out=log_p)                      # log p - log m
    d_q = torch.sub(log_q, log_m, out=log_m)                    # log q - log m
    q = log_q.exp_()
    kl_p, kl_q = _row_dot(p, g), _row_dot(q, d_q)
    per_row = beta * kl_q + (1.0 - beta) * kl_p
    return per_row, g.sub_(kl_p[:, None]).mul_(p).mul_(1.0 - beta)


def _skew_divergence_and_grad(student: torch.Tensor, teacher: torch.Tensor, kind: str, skew: float,
                              temperature: float, spares: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """DistiLLM's skew divergences per row (C,) and T x their gradient with respect to the student's logits (C, V),
    with p the teacher's distribution, q the student's and a = `skew`:

        skew_kl   KL(p || m),   m = a p + (1 - a) q     dL/dz = (1 - a) q (S - p / m) / T,   S = sum_v p_v q_v / m_v
        skew_rkl  KL(q || m'),  m' = (1 - a) p + a q    dL/dz = q (g - sum_v q_v g_v) / T,   g = log q - log m' - a q / m'

    (a = 0: the forward and the reverse KL exactly). Overwrites `student` and `teacher`; two `spares`."""
    log_q = _log_softmax_(student, temperature)
    log_p = _log_softmax_(teacher, temperature)
    w_p, w_q = (skew, 1.0 - skew) if kind == "skew_kl" else (1.0 - skew, skew)
    log_m = torch.logaddexp(torch.add(log_p, math.log(w_p) if w_p else -math.inf, out=spares[0]),
                            torch.add(log_q, math.log(w_q) if w_q else -math.inf, out=spares[1]), out=spares[0])
    if kind == "skew_kl":
        p = torch.exp(log_p, out=spares[1])
        d = torch.sub(log_p, log_m, out=log_p)             # log p - log m
        per_row = _row_dot(p, d)
        p_over_m = d.exp_()
        q = log_q.exp_()
        total = _row_dot(q, p_over_m)                      # S
        return per_row, p_over_m.neg_().add_(total[:, None]).mul_(q).mul_(1.0 - skew)
    q = torch.exp(log_q, out=spares[1])
    d = torch.sub(log_q, log_m, out=log_p)                 # log q - log m'
    per_row = _row_dot(q, d)
    g = d.sub_(torch.exp(d, out=student), alpha=skew)      # log q - log m' - a q / m'
    return per_row, g.sub_(_row_dot(q, g)[:, None]).mul_(q)


def skew_chunk_loss(kind: str, skew: float, temperature: float) -> ChunkLoss:
    """A skew divergence (`_skew_divergence_and_grad`) as the driver's closed form, clamped at 0 as the JSD is."""
    def fn(student, teacher, spares, _labels, _values):
        per_row, g = _skew_divergence_and_grad(student, teacher, kind, skew, temperature, spares)
        return per_row.clamp_min(0), g, ()
    return ChunkLoss(fn, spares=2, grad_scale=1.0 / temperature)


def jsd_chunk_loss(beta: float, temperature: float) -> ChunkLoss:
    """The generalized JSD as the driver's closed form: per-row divergence (clamped at 0, gradient unclamped) and
    T x its gradient, which the driver scales by 1 / T after the GEMMs."""
    def fn(student, teacher, spares, _labels, _values):
        per_row, g = _divergence_and_grad(student, teacher, beta, temperature, spares)
        return per_row.clamp_min(0), g, ()
    return ChunkLoss(fn, spares=0 if beta == 1.0 else 1 if beta == 0.0 else 2, grad_scale=1.0 / temperature)


def kd_chunk_loss(alpha: float, temperature: float, divergence: str = "kl", skew: float = 0.1) -> ChunkLoss:
    """Classic KD as the driver's closed form: per position alpha CE + (1 - alpha) T^2 KL(q_T || p_T) (the generalized
    JSD at beta = 0, p_T = softmax(z / T), q_T the teacher's), the extras ("ce", "kd") and the gradient

        dL/dz = alpha (p - onehot(label)) + (1 - alpha) T (p_T - q_T),   p = softmax(z)

    With alpha = 1 its G is the cross entropy's bit for bit (the KD term adds an exact 0). `divergence` skew_kl or
    skew_rkl: DistiLLM's skew divergence at `skew` in place of the KL (`_skew_divergence_and_grad`)."""
    if divergence != "kl":
        return _skew_kd_chunk_loss(alpha, temperature, divergence, skew)

    def fn(student, teacher, spares, labels, _values):
        high = spares[1] if temperature != 1.0 else None
        if high is not None:  # z / T for the KL, before the cross entropy overwrites z
            _log_softmax_(high.copy_(student), temperature)
        log_p = torch.log_softmax(student, dim=-1, out=student)
        ce = log_p.gather(1, labels.clamp_min(0)[:, None]).squeeze(1).neg_()
        log_p_t = log_p if high is None else high
        log_q_t = _log_softmax_(teacher, temperature)
        q_t = torch.exp(log_q_t, out=spares[0])
        kl = _row_dot(q_t, log_q_t.sub_(log_p_t))  # KL(q_T || p_T)
        g = log_p.exp_()                           # p
        if high is None:  # T = 1: alpha (p - onehot) + (1 - alpha)(p - q) = p - (1 - alpha) q - alpha onehot
            g.sub_(q_t, alpha=1.0 - alpha)
        else:
            p_minus_q = high.exp_().sub_(q_t)
            g.mul_(alpha).add_(p_minus_q, alpha=(1.0 - alpha) * temperature)
        kd = kl.clamp_min(0).mul_(temperature ** 2)  # clamped as closed_forms._non_negative, gradient unclamped
        return alpha * ce + (1.0 - alpha) * kd, add_at_labels(g, labels, -alpha), (ce, kd)
    return ChunkLoss(fn, spares=1 if temperature == 1.0 else 2, extra_names=("ce", "kd"))


def _skew_kd_chunk_loss(alpha: float, temperature: float, divergence: str, skew: float) -> ChunkLoss:
    """KD with a skew divergence D: alpha CE + (1 - alpha) T^2 D, its gradient alpha (p - onehot) + (1 - alpha) T G_D
    (G_D: T x D's gradient, `_skew_divergence_and_grad`)."""
    def fn(student, teacher, spares, labels, _values):
        scaled = spares[0].copy_(student)  # z, for D at T, before the cross entropy overwrites it
        log_p = torch.log_softmax(student, dim=-1, out=student)
        ce = log_p.gather(1, labels.clamp_min(0)[:, None]).squeeze(1).neg_()
        d, g_d = _skew_divergence_and_grad(scaled, teacher, divergence, skew, temperature, spares[1:])
        g = log_p.exp_().mul_(alpha).add_(g_d, alpha=(1.0 - alpha) * temperature)
        kd = d.clamp_min(0).mul_(temperature ** 2)
        return alpha * ce + (1.0 - alpha) * kd, add_at_labels(g, labels, -alpha), (ce, kd)
    return ChunkLoss(fn, spares=3, extra_names=("ce", "kd"))


def sampled_token_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) in the logits' buffer; returns each row's log-probability of its label (C,)."""
    log_p = _log_softmax_(logits, temperature)
    return log_p.gather(1, labels.clamp_min(0)[:, None]).squeeze(1)


def sampled_kl_chunk_loss(temperature: float, local_teacher: bool, reward: str = "log_ratio",
                          alpha: float = 5.0) -> ChunkLoss:
    """The sampled-token reverse KL (closed_forms.sampled_token_kl_loss) and its variants (trainer/losses/
    token_signals.py) as the driver's closed form: with k = -w r held constant (r the token's reward, w its position
    weight; vanilla: k = log p_T(y) - log q_T(y)), the surrogate k log p_T(y) per position, its gradient
    k (onehot(y) - p_T) / T, and the extra ("reverse_kl_estimate") log p_T(y) - log q_T(y) whatever the reward.
    `values` per position: (the teacher's log q_T(y), served; ignored for a local teacher, whose logits give it; w)."""
    def fn(student, teacher, _spares, labels, values):
        served, weight = values
        logp = sampled_token_log_probs(student, labels, temperature)
        teacher_logp = sampled_token_log_probs(teacher, labels, temperature) if local_teacher else served.to(logp.dtype)
        keep = labels != IGNORE_INDEX  # a masked row: finite G
        k = torch.where(keep, -weight.to(logp.dtype) * token_reward(logp, teacher_logp, reward, alpha), 0.0)
        g = student.exp_().mul_(-k[:, None])  # -k p_T
        return k * logp, add_at_labels(g, labels, k), (torch.where(keep, logp - teacher_logp, 0.0),)
    return ChunkLoss(fn, grad_scale=1.0 / temperature, extra_names=("reverse_kl_estimate",))


def chunked_generalized_jsd_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                                 teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
                                 labels: torch.Tensor | None, beta: float = 0.5, temperature: float = 1.0,
                                 chunk_size: int = 512,
                                 vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`generalized_jsd_loss` (reduction "sum") from hidden states (N, H) / (N, H_t) and lm_head weights
    (V_pad, H) / (V_pad_t, H_t), `chunk_size` positions at a time, over the first `vocab_size` rows of both heads.
    Returns (loss_sum, num_tokens); gradients reach the student's hidden states and head, never the teacher."""
    _check_args("sum", temperature, beta)
    vocab_size = checked_vocab_size(student_weight, teacher_weight, chunk_size, vocab_size)
    loss_sum, tokens, _ = fused_linear_loss(jsd_chunk_loss(float(beta), float(temperature)), student_hidden,
                                            student_weight, labels, vocab_size, chunk_size, teacher_hidden,
                                            teacher_weight)
    return loss_sum, tokens


def fused_kd_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                  teacher_weight: torch.Tensor, labels: torch.Tensor, alpha: float, temperature: float = 1.0,
                  chunk_size: int = 512, vocab_size: int | None = None, divergence: str = "kl",
                  skew: float = 0.1) -> tuple[torch.Tensor, ...]:
    """Classic KD's sums (trainer/losses/divergences.py, kind "kd") from hidden states and lm_heads as
    `chunked_generalized_jsd_loss` takes them: (loss_sum, num_tokens, ce_sum, kd_sum), loss = alpha ce + (1 - alpha)
    kd, kd = T^2 KL(teacher || student) (closed_forms.distillation_loss), or T^2 times a skew divergence
    (`divergence` skew_kl / skew_rkl at `skew`)."""
    _check_args("sum", temperature)
    vocab_size = checked_vocab_size(student_weight, teacher_weight, chunk_size, vocab_size)
    chunk = kd_chunk_loss(float(alpha), float(temperature), divergence, float(skew))
    loss_sum, tokens, (ce, kd) = fused_linear_loss(chunk, student_hidden, student_weight, labels, vocab_size,
                                                   chunk_size, teacher_hidden, teacher_weight)
    return loss_sum, tokens, ce, kd


def fused_skew_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                    teacher_weight: torch.Tensor, labels: torch.Tensor | None, kind: str, skew: float = 0.1,
                    temperature: float = 1.0, chunk_size: int = 512,
                    vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A skew divergence (skew_kl / skew_rkl, `_skew_divergence_and_grad`) summed over the completion positions from
    hidden states and lm_heads as `chunked_generalized_jsd_loss` takes them: (loss_sum, num_tokens)."""
    _check_args("sum", temperature)
    if not 0.0 <= skew < 1.0:
        raise ValueError(f"skew must be in [0, 1), got {skew}")
    vocab_size = checked_vocab_size(student_weight, teacher_weight, chunk_size, vocab_size)
    loss_sum, tokens, _ = fused_linear_loss(skew_chunk_loss(kind, float(skew), float(temperature)), student_hidden,
                                            student_weight, labels, vocab_size, chunk_size, teacher_hidden,
                                            teacher_weight)
    return loss_sum, tokens


def fused_sampled_kl_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor, labels: torch.Tensor,
                          teacher_hidden: torch.Tensor | None = None, teacher_weight: torch.Tensor | None = None,
                          teacher_logprobs: torch.Tensor | None = None, temperature: float = 1.0,
                          chunk_size: int = 512, vocab_size: int | None = None, reward: str = "log_ratio",
                          alpha: float = 5.0, rows: torch.Tensor | None = None,
                          gamma: float = 0.5) -> tuple[torch.Tensor, ...]:
    """The sampled-token reverse KL's sums from hidden states and the student's lm_head, the teacher's either as
    hidden states and lm_head (local) or as `teacher_logprobs` of the labels (served): (surrogate_sum, num_tokens,
    kl_estimate_sum). `reward` and `alpha`: the per-token reward (token_signals.token_reward); `rows` (N,), each
    position's row: IW-OPD's position weights with `gamma` (None: weight 1), from a first pass over every position
    without gradients (the student's head once more, and a local teacher's), since a weight needs its whole row."""
    _check_args("sum", temperature)
    local = teacher_hidden is not None
    vocab_size = checked_vocab_size(student_weight, teacher_weight, chunk_size, vocab_size)
    served = labels.new_zeros(labels.shape, dtype=torch.float32) if local else teacher_logprobs
    weight = torch.ones_like(served, dtype=torch.float32)
    if rows is not None:
        teacher_logp = (token_logprobs(teacher_hidden, teacher_weight, labels, chunk_size, vocab_size, temperature)
                        if local else teacher_logprobs)
        weight = opd_position_weights(student_hidden, student_weight, labels, teacher_logp, rows, chunk_size,
                                      vocab_size, temperature, reward, alpha, gamma)
    chunk = sampled_kl_chunk_loss(float(temperature), local, reward, float(alpha))
    surrogate, tokens, (kl,) = fused_linear_loss(chunk, student_hidden, student_weight, labels, vocab_size,
                                                 chunk_size, teacher_hidden, teacher_weight, values=(served, weight))
    return surrogate, tokens, kl
