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

so each chunk computes both projections, the per-token losses and the gradients with respect to the student's hidden
states and lm_head at once, and the backward only scales them by the loss's incoming gradient: per chunk three
GEMMs of the student's head (the projection, then dL/dh = G W and dL/dW += G^T h) and one of the teacher's, and
for reverse KL two exponentials per logit (the two log-softmaxes; p is exp(log p)). The values equal the autograd
path's to float rounding (tests/test_fused_jsd.py: against float64 autograd, and under bf16 autocast against the
checkpointed path).

Precision as `chunked_loss`: under autocast each projection runs in the autocast dtype with each head cast once per
call, the chunk's gradient G is cast to it for dL/dh and dL/dW, and dL/dW is summed over chunks in the weight's own
dtype; everything from the logits on is fp32. The per-token loss is clamped at 0 with its gradient unchanged
(losses._non_negative), and positions labelled IGNORE_INDEX contribute neither loss nor gradient. Under fp16
autocast G is cast unscaled (a GradScaler's factor reaches it after the two GEMMs, in fp32): an entry below fp16's
smallest subnormal becomes 0, where the checkpointed path, scaling before the cast, keeps it but overflows sooner;
both give the definition's gradient to fp16's rounding (tests/test_fused_jsd.py).
"""
from __future__ import annotations

import math
import threading

import torch

from dataset.collators import IGNORE_INDEX
from trainer.losses.chunked import checked_vocab_size
from trainer.losses.closed_forms import _check_args

# On a CPU the chunk's fp32 (C, V) buffers are kept from call to call: a fresh tensor of that size (above glibc
# malloc's mmap threshold, at most 32 MB) is mapped anew at every allocation and page-faulted on first touch: on a
# 2-core AMD EPYC, the (512, 151669) projection of bench_opd's step took 219 ms into a fresh tensor and 104 ms into a
# kept one, and the loss uses two such buffers. A GPU's caching allocator keeps its blocks anyway: plain allocations.
_workspace = threading.local()


def _buffers(count: int, rows: int, cols: int, device: torch.device) -> list[torch.Tensor]:
    """`count` fp32 (rows, cols) tensors whose contents are garbage (every caller writes before it reads)."""
    size = rows * cols
    if device.type != "cpu":
        return [torch.empty(rows, cols, device=device) for _ in range(count)]
    held = getattr(_workspace, "buffers", [])
    if len(held) < count or held[0].numel() < size:
        _workspace.buffers = held = []  # the old ones go before the new ones are allocated
        _workspace.buffers = held = [torch.empty(size) for _ in range(count)]
    return [buffer[:size].view(rows, cols) for buffer in held[:count]]


def _log_softmax_(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature != 1.0:
        logits.div_(temperature)
    return torch.log_softmax(logits, dim=-1, out=logits)


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum_v a[c, v] b[c, v] per row, without a (C, V) temporary (a batched matrix product)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0])


def _divergence_and_grad(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float,
                         spare: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row divergence (C,) and T x its gradient with respect to the student's logits (C, V), from the chunk's
    fp32 logits `student` and `teacher`, which it overwrites (the gradient is returned in one of them); `spare` a
    third (C, V) buffer (needed for beta < 1)."""
    log_p = _log_softmax_(student, temperature)
    log_q = _log_softmax_(teacher, temperature)
    if beta == 1.0:
        d = torch.sub(log_p, log_q, out=log_q)
        p = log_p.exp_()
        p_d = d.mul_(p)
        kl = p_d.sum(dim=-1)
        return kl, p_d.addcmul_(p, kl[:, None], value=-1.0)  # p (d - KL)
    if beta == 0.0:
        q = torch.exp(log_q, out=spare)
        d = torch.sub(log_q, log_p, out=log_q)
        kl = _row_dot(q, d)
        return kl, log_p.exp_().sub_(q)
    log_m = torch.logaddexp(log_p + math.log(1.0 - beta), log_q + math.log(beta))
    p, q = log_p.exp(), torch.exp(log_q, out=spare)
    g = torch.sub(log_p, log_m, out=log_p)                      # log p - log m
    kl_p, kl_q = _row_dot(p, g), _row_dot(q, log_q.sub_(log_m))
    per_row = beta * kl_q + (1.0 - beta) * kl_p
    return per_row, g.sub_(kl_p[:, None]).mul_(p).mul_(1.0 - beta)


class _FusedJSD(torch.autograd.Function):
    """Forward: (loss_sum, num_tokens), with dL/dh and dL/dW computed on the way. Backward: those, scaled."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, labels, beta, temperature, chunk_size,
                vocab_size):
        device = hidden.device
        low = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        mask = torch.ones(len(hidden), dtype=torch.bool, device=device) if labels is None else labels != IGNORE_INDEX
        grads = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grads = torch.zeros_like(hidden), torch.zeros_like(weight, memory_format=torch.contiguous_format)
        with torch.autocast(device.type, enabled=False):  # the casts below are autocast's, made once
            heads = [w[:vocab_size] if low is None else w[:vocab_size].to(low) for w in (weight, teacher_weight)]
            loss = _chunks(hidden, teacher_hidden, heads, mask, beta, temperature, chunk_size, grads)
        # kept on ctx, not saved: they are neither inputs nor outputs, and the backward hands them over (scaled in
        # place, no copy of the head's gradient), so the graph holds them only until its backward
        ctx.grads = grads or (None, None)
        tokens = mask.sum()
        ctx.mark_non_differentiable(tokens)
        return loss, tokens

    @staticmethod
    def backward(ctx, grad_loss, _grad_tokens):
        if ctx.grads is None:
            raise RuntimeError("the fused JSD's gradients were handed over by its first backward: it cannot run twice "
                               "(retain_graph=True)")
        grads, ctx.grads = ctx.grads, None
        grad_h, grad_w = (None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads)
        return grad_h, grad_w, None, None, None, None, None, None, None


def _chunks(hidden: torch.Tensor, teacher_hidden: torch.Tensor, heads: list[torch.Tensor], mask: torch.Tensor,
            beta: float, temperature: float, chunk_size: int,
            grads: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The summed divergence over `chunk_size` positions at a time; with `grads` (dL/dh, dL/dW, zeros), also adds
    each chunk's gradients into them."""
    n, vocab_size = len(hidden), len(heads[0])
    buffers = _buffers(2 if beta == 1.0 else 3, max(min(chunk_size, n), 1), vocab_size, hidden.device)
    masked = not bool(mask.all())  # one check per call (a device sync), not one per chunk
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, n, chunk_size):
        rows = slice(start, start + chunk_size)
        h, keep = hidden[rows], mask[rows]
        student, teacher, *spare = (buffer[:len(h)] for buffer in buffers)
        _project(h, heads[0], student)
        _project(teacher_hidden[rows], heads[1], teacher)
        per_row, g = _divergence_and_grad(student, teacher, beta, temperature, spare[0] if spare else None)
        loss += torch.where(keep, per_row.clamp_min(0), 0.0).sum()  # clamped value, unclamped gradient
        if grads is not None:
            if masked:  # whatever a masked position's logits were, its gradient is exactly 0
                g.masked_fill_(~keep[:, None], 0.0)
            _backward_chunk(g, h, heads[0], 1.0 / temperature, grads[0][rows], grads[1][:vocab_size])
    return loss


def _project(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out = hidden @ weight.T in fp32, computed in the weight's dtype (the autocast dtype under autocast)."""
    if hidden.dtype == out.dtype and weight.dtype == out.dtype:
        torch.mm(hidden, weight.T, out=out)
    else:
        out.copy_(torch.mm(hidden.to(weight.dtype), weight.T))


def _backward_chunk(g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, scale: float, grad_h: torch.Tensor,
                    grad_w: torch.Tensor) -> None:
    """grad_h = scale G W, grad_w += scale G^T h (G in the projection's dtype; grad_w summed in its own)."""
    if h.dtype == g.dtype and w.dtype == g.dtype and grad_h.dtype == g.dtype:
        torch.mm(g, w, out=grad_h).mul_(scale)
        grad_w.addmm_(g.T, h, alpha=scale)
        return
    g = g.to(w.dtype)
    grad_h.copy_(torch.mm(g, w).mul_(scale))
    grad_w.add_(torch.mm(g.T, h.to(w.dtype)).mul_(scale))


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
    return _FusedJSD.apply(student_hidden, student_weight, teacher_hidden.detach(), teacher_weight.detach(),
                           labels, float(beta), float(temperature), int(chunk_size), int(vocab_size))
