"""The optimizer and its step: AdamW over the fp32 master weights, the learning-rate schedule, and the end of an
accumulation window -- exact normalisation, clipping, fp16's scaler, a refusal to apply a non-finite update.

The normalisation invariant (docs/architecture.md): an optimizer step's gradient is the gradient of
    (sum of token losses over the whole accumulation window and all ranks) / (number of loss tokens in it).
Every micro-step backwards its *summed* loss (divided by a fixed constant, `loss_divisor`); at the end of the window
the gradients are scaled once by constant * world_size / global_tokens, before clipping. A mean per micro-batch
divided by accumulation_steps would weight a short completion's tokens more than a long one's, and a short tail
window would be divided by too much.
"""
from __future__ import annotations

import argparse
import math

import torch

from common.errors import RuntimeFailure


def get_lr(step: int, total_steps: int, lr: float, warmup_steps: int = 0) -> float:
    """Linear warm-up, then cosine from lr down to 10% of lr, indexed by optimizer step (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW with the fused implementation (one kernel over all parameters, no temporaries; CPU and CUDA alike):
    torch's default is a loop over the parameters on the CPU, a foreach over them on CUDA. Same arithmetic to
    rounding; on a 2-core AMD EPYC the OPD demo's optimizer phase went from 48 to 15 ms (docs/benchmarks.md).
    Only the parameters that train: a LoRA student's adapters (its base is frozen: no moments, no step)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                             weight_decay=args.weight_decay, betas=(0.9, 0.95), fused=True)


def loss_divisor(args: argparse.Namespace) -> float:
    """Micro-step losses are sums; dividing them by a fixed constant keeps fp16 gradients in range. The constant
    is undone exactly when the window's gradients are scaled by constant * world_size / global_tokens."""
    return float(args.batch_size * args.max_length)


def window_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                lr: float, scale: float, grad_clip: float, loss: float, step: int) -> tuple[float, bool]:
    """The window's gradients times `scale`, clipped to `grad_clip` (0: no clipping), one AdamW step at `lr`
    through the scaler -> (the global gradient norm, whether fp16's scaler skipped the step). A non-finite `loss`
    (the window's mean), or a non-finite norm without a scaler, stops the run before it reaches the weights."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    scaler.unscale_(optimizer)
    # one foreach call (a few fused kernels) instead of a kernel per parameter; sharded gradients are scaled
    # shard by shard: the same arithmetic
    torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], scale)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # sharded: the global norm
    # a non-finite loss is the data's or the model's, never fp16's range (the loss is summed in fp32): it stops
    # the run under a scaler too, which would otherwise skip every step from here on
    if not math.isfinite(loss) or (not math.isfinite(grad_norm) and not scaler.is_enabled()):
        raise RuntimeFailure(f"step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); stopping "
                             f"before it reaches the weights. Lower --learning_rate or check the data.")
    # fp16: GradScaler skips the step exactly when an unscaled gradient is inf or NaN, i.e. the norm is
    skipped = scaler.is_enabled() and not math.isfinite(grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped
