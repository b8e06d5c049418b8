"""One driver for every loss whose gradient with respect to the logits has a closed form: each chunk of positions
goes through the lm_head once, and the loss and dL/dlogits come out together, so the backward only scales what the
forward already computed.

The generic chunked path (trainer/losses/chunked.py's `chunked_loss`) checkpoints each chunk: its backward
recomputes the chunk's head GEMMs and every elementwise step of the loss, and autograd keeps each step's inputs. Here
a chunk costs three GEMMs of the student's head -- the projection, then dL/dh = G W and dL/dW += G^T h -- and one of
the teacher's where the loss has a teacher, and the (C, V) work of the closed form itself. A `ChunkLoss` is the
closed form: from the chunk's fp32 logits (which it may overwrite) it returns each position's loss and G = dL/dz.
Its users: the cross entropy here (`fused_cross_entropy`), the divergences (trainer/losses/fused_divergences.py:
generalized JSD, KD, the sampled-token KL), the top-K divergence (trainer/losses/topk_divergence.py) and the RL loss
(trainer/losses/policy_gradient.py).

Precision as `chunked_loss`: under autocast each projection runs in the autocast dtype with each head cast once per
call, the chunk's gradient G is cast to it for dL/dh and dL/dW, and dL/dW is summed over chunks in the weight's own
dtype; everything from the logits on is fp32 (float64 for float64 inputs). Positions labelled IGNORE_INDEX
contribute neither loss nor gradient
(their hidden states zeroed before the projection, their per-position numbers excluded with `torch.where`, their
rows of dL/dh zeroed), without a sync to find out whether there are any. Under fp16 autocast G is cast
unscaled (a GradScaler's factor reaches it after the two GEMMs, in fp32): an entry below fp16's smallest subnormal
becomes 0, where the checkpointed path, scaling before the cast, keeps it but overflows sooner.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch
from torch._guards import active_fake_mode

from dataset.collators import IGNORE_INDEX
from trainer.losses.chunked import checked_vocab_size, value_rows

# On a CPU the chunk's fp32 (C, V) buffers are kept from call to call: a fresh tensor of that size (above glibc
# malloc's mmap threshold, at most 32 MB) is mapped anew at every allocation and page-faulted on first touch: on a
# 2-core AMD EPYC, the (512, 151669) projection of bench_opd's step took 219 ms into a fresh tensor and 104 ms into a
# kept one. A GPU's caching allocator keeps its blocks anyway: plain allocations.
_workspace = threading.local()


def release_workspace() -> None:
    """Free this thread's CPU workspace (the next fused loss allocates it again): for a measurement of what a step
    holds as a GPU's would, where the buffers live only within the loss."""
    _workspace.buffers = []


@dataclass(frozen=True)
class ChunkLoss:
    """A loss's closed form on one chunk: `fn(student, teacher, spares, labels, values)` -> (per-position loss (C,),
    G (C, V), extras), from the chunk's fp32 logits `student` and `teacher` (None without a teacher) -- both its to
    overwrite, G may be one of them -- `spares` (C, V) buffers, `labels` (C,) or None and `values` the chunk's rows of
    the per-position numbers the caller passed (or None). `extras` is a tuple of per-position numbers (C,) logged
    beside the loss (their names in `extra_names`), summed by the driver over the positions that count. The driver
    multiplies dL/dh and dL/dW by `grad_scale` after the GEMMs (a temperature's 1 / T). G must be finite wherever the
    logits are: the driver zeroes a masked position's hidden state, not its row of G."""
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]]
    spares: int = 0
    grad_scale: float = 1.0
    extra_names: tuple[str, ...] = ()


def buffers(count: int, rows: int, cols: int, device: torch.device,
            dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """`count` (rows, cols) tensors whose contents are garbage (every caller writes before it reads)."""
    size = rows * cols
    # fake tensors (benchmarks/fsdp_estimate.py models a GPU) allocate as a GPU does, and are never kept for a real call
    if device.type != "cpu" or dtype != torch.float32 or active_fake_mode() is not None:
        return [torch.empty(rows, cols, device=device, dtype=dtype) for _ in range(count)]
    held = getattr(_workspace, "buffers", [])
    if len(held) < count or held[0].numel() < size:
        _workspace.buffers = held = []  # the old ones go before the new ones are allocated
        _workspace.buffers = held = [torch.empty(size) for _ in range(count)]
    return [buffer[:size].view(rows, cols) for buffer in held[:count]]


class _FusedLinearLoss(torch.autograd.Function):
    """Forward: (loss_sum, num_tokens, extra_sums), with dL/dh and dL/dW computed on the way where `needs_grad`
    (hidden's, weight's) asks for them. Backward: those, scaled."""

    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, labels, values, loss, chunk_size, vocab_size,
                needs_grad):
        device = hidden.device
        low = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        mask = torch.ones(len(hidden), dtype=torch.bool, device=device) if labels is None else labels != IGNORE_INDEX
        grads = None
        if any(needs_grad):  # a frozen head (a LoRA student's): no dL/dW
            grads = torch.zeros_like(hidden), (torch.zeros(weight.shape, dtype=weight.dtype, device=device)
                                               if needs_grad[1] else None)
        with torch.autocast(device.type, enabled=False):  # the casts below are autocast's, made once
            heads = [None if w is None else w[:vocab_size] if low is None else w[:vocab_size].to(low)
                     for w in (weight, teacher_weight)]
            total, extras = _chunks(hidden, teacher_hidden, heads, labels, values, mask, loss, chunk_size, grads)
        # kept on ctx, not saved: they are neither inputs nor outputs, and the backward hands them over (scaled in
        # place, no copy of the head's gradient), so the graph holds them only until its backward
        ctx.grads = grads or (None, None)
        tokens = mask.sum()
        ctx.mark_non_differentiable(tokens, extras)
        return total, tokens, extras

    @staticmethod
    def backward(ctx, grad_loss, _grad_tokens, _grad_extras):
        if ctx.grads is None:
            raise RuntimeError("a fused loss's gradients were handed over by its first backward: it cannot run twice "
                               "(retain_graph=True)")
        grads, ctx.grads = ctx.grads, None
        grad_h, grad_w = (None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads)
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def _chunks(hidden: torch.Tensor, teacher_hidden: torch.Tensor | None, heads: list[torch.Tensor | None],
            labels: torch.Tensor | None, values: torch.Tensor | None, mask: torch.Tensor, loss: ChunkLoss,
            chunk_size: int, grads: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed loss and extras over `chunk_size` positions at a time; with `grads` (dL/dh, dL/dW, zeros), also
    adds each chunk's gradients into them.

    A masked position's hidden states are zeroed before the projections (no sync to find out whether any is masked):
    its logits are then finite whatever it held, its loss and extras are excluded with `torch.where`, its row of dL/dh
    is zeroed and its zero hidden state adds exactly 0 to dL/dW."""
    n, vocab_size = len(hidden), len(heads[0])
    count = 1 + (teacher_hidden is not None) + loss.spares
    dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32  # float64: the tests' exact references
    chunk_buffers = buffers(count, max(min(chunk_size, n), 1), vocab_size, hidden.device, dtype)
    total = torch.zeros((), dtype=dtype, device=hidden.device)
    extras = torch.zeros(len(loss.extra_names), dtype=dtype, device=hidden.device)
    for start in range(0, n, chunk_size):
        rows = slice(start, start + chunk_size)
        keep = mask[rows, None]
        h = torch.where(keep, hidden[rows], 0.0)
        views = [buffer[:len(h)] for buffer in chunk_buffers]
        student = views.pop(0)
        _project(h, heads[0], student)
        teacher = None
        if teacher_hidden is not None:
            teacher = views.pop(0)
            _project(torch.where(keep, teacher_hidden[rows], 0.0), heads[1], teacher)
        per_row, g, chunk_extras = loss.fn(student, teacher, views, None if labels is None else labels[rows],
                                           None if values is None else value_rows(values, start, start + chunk_size))
        total += torch.where(keep[:, 0], per_row, 0.0).sum()
        if chunk_extras:
            extras += torch.where(keep, torch.stack(chunk_extras, dim=1), 0.0).sum(dim=0)
        if grads is not None:
            _backward_chunk(g, h, heads[0], loss.grad_scale, grads[0][rows],
                            None if grads[1] is None else grads[1][:vocab_size])
            grads[0][rows].masked_fill_(~keep, 0.0)
    return total, extras


def _project(hidden: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out = hidden @ weight.T in fp32, computed in the weight's dtype (the autocast dtype under autocast)."""
    if hidden.dtype == out.dtype and weight.dtype == out.dtype:
        torch.mm(hidden, weight.T, out=out)
    else:
        out.copy_(torch.mm(hidden.to(weight.dtype), weight.T))


def _backward_chunk(g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, scale: float, grad_h: torch.Tensor,
                    grad_w: torch.Tensor | None) -> None:
    """grad_h = scale G W, grad_w += scale G^T h (G in the projection's dtype; grad_w summed in its own; None: a
    frozen head)."""
    if h.dtype == g.dtype and w.dtype == g.dtype and grad_h.dtype == g.dtype:
        torch.mm(g, w, out=grad_h).mul_(scale)
        if grad_w is not None:
            grad_w.addmm_(g.T, h, alpha=scale)
        return
    g = g.to(w.dtype)
    grad_h.copy_(torch.mm(g, w)).mul_(scale)  # scaled in grad_h's dtype, not rounded once more in the GEMM's
    if grad_w is not None:
        _add_scaled(grad_w, torch.mm(g.T, h.to(w.dtype)), scale)


# A CPU's add_ of a bf16 tensor into an fp32 one first converts the whole bf16 operand (an fp32 temporary of the
# head's size, (V, H): measured with torch.profiler; a CUDA kernel casts each element as it reads it): blocks of rows
# keep that temporary small on a CPU.
_CPU_ADD_BLOCK = 1 << 22  # elements per block (16 MB of fp32)


def _add_scaled(total: torch.Tensor, part: torch.Tensor, scale: float) -> None:
    """total += scale * part, in total's dtype."""
    if total.device.type != "cpu" or total.dtype == part.dtype:
        total.add_(part, alpha=scale)
        return
    rows = max(1, _CPU_ADD_BLOCK // max(1, part.shape[1]))
    for start in range(0, len(part), rows):
        total[start:start + rows].add_(part[start:start + rows], alpha=scale)


def fused_linear_loss(loss: ChunkLoss, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None,
                      vocab_size: int, chunk_size: int, teacher_hidden: torch.Tensor | None = None,
                      teacher_weight: torch.Tensor | None = None,
                      values: torch.Tensor | tuple[torch.Tensor, ...] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`loss` summed over the positions of `hidden` (N, H) through the first `vocab_size` rows of `weight` (V_pad,
    H) (and of the teacher's head), `chunk_size` positions at a time: (loss_sum, num_tokens, extra_sums), the last
    one number per `loss.extra_names`. `values` (N, ...) per-position numbers the loss reads (a constant), or a
    tuple of such tensors. Gradients reach the student's hidden states and head, never the teacher; under no_grad
    (a held-out evaluation's, whose head is a Parameter) none is computed: each chunk costs its projections and its
    closed form."""
    # decided here: inside the Function, ctx.needs_input_grad is an input's requires_grad even under no_grad
    grad_enabled = torch.is_grad_enabled()
    needs_grad = grad_enabled and hidden.requires_grad, grad_enabled and weight.requires_grad
    return _FusedLinearLoss.apply(hidden, weight, None if teacher_hidden is None else teacher_hidden.detach(),
                                  None if teacher_weight is None else teacher_weight.detach(), labels,
                                  values, loss, int(chunk_size), int(vocab_size), needs_grad)


def add_at_labels(g: torch.Tensor, labels: torch.Tensor, value: float | torch.Tensor) -> torch.Tensor:
    """g[c, labels[c]] += value (a number, or one per row), in place."""
    targets = labels.clamp_min(0)[:, None]
    if not isinstance(value, torch.Tensor):
        return g.scatter_add_(1, targets, torch.full_like(targets, value, dtype=g.dtype))
    return g.scatter_add_(1, targets, value.to(g.dtype)[:, None])


def _cross_entropy(logits: torch.Tensor, _teacher, _spare, labels: torch.Tensor, _values):
    """-log p(label) per position and its gradient p - onehot(label), in the logits' buffer."""
    log_p = torch.log_softmax(logits, dim=-1, out=logits)
    per_row = log_p.gather(1, labels.clamp_min(0)[:, None]).squeeze(1).neg_()  # a masked label: any column
    return per_row, add_at_labels(log_p.exp_(), labels, -1.0), ()


CROSS_ENTROPY = ChunkLoss(_cross_entropy)


def fused_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int = 512,
                        vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """closed_forms.sft_loss (summed cross entropy over labels != IGNORE_INDEX) from hidden states (N, H) and the
    lm_head (V_pad, H): (loss_sum, num_tokens), as chunked_sft_loss returns them, with the gradient in closed form."""
    vocab_size = checked_vocab_size(weight, None, chunk_size, vocab_size)
    loss_sum, tokens, _ = fused_linear_loss(CROSS_ENTROPY, hidden, weight, labels, vocab_size, chunk_size)
    return loss_sum, tokens
