"""`completion_hidden`, the forward that keeps only the positions that predict a label; and the generic checkpointed
path: any loss of trainer/losses/closed_forms.py from final hidden states, projected through the lm_head a chunk of
positions at a time and recomputed in the backward, so the (N, V) logits never exist in full. The loops train with
the fused driver instead (trainer/losses/fused_linear.py: every training loss has a closed-form gradient, computed
with the loss, which shares `checked_vocab_size`); `chunked_loss` is the reference it is tested and benchmarked
against (tests/test_fused_losses.py, benchmarks/bench_losses.py's "checkpointed" variant), autograd on the closed
forms themselves.

The wrappers return sums plus token counts: the training skeleton divides by the token count of the whole
accumulation window and all ranks (docs/architecture.md, "Invariant 1: exact token normalisation"). Under autocast
the chunk's logits matmul runs in the autocast dtype (the lm_head weight cast once per loss, `autocast_once`); from
the logits on, every loss is computed and accumulated in fp32, and the teacher is always a constant.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from dataset.collators import IGNORE_INDEX
from model.qwen3 import Packing, unwrap
from trainer.losses.closed_forms import sft_loss

LossOutput = torch.Tensor | tuple[torch.Tensor, ...]


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
    if (teacher_hidden is None) != (teacher_weight is None):
        raise ValueError("pass both teacher_hidden and teacher_weight, or neither")
    vocab_size = checked_vocab_size(student_weight, teacher_weight, chunk_size, vocab_size)
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
                None if teacher_values is None else value_rows(teacher_values, start, end))
        part = checkpoint(_chunk_loss, *args, use_reentrant=False) if needs_graph else _chunk_loss(*args)
        total = _add(total, part)
    return total


def checked_vocab_size(student_weight: torch.Tensor, teacher_weight: torch.Tensor | None, chunk_size: int,
                       vocab_size: int | None) -> int:
    """The vocabulary both heads project onto (default: the student head's rows, which the teacher's must match),
    after checking it and the chunk size; ValueError otherwise."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if vocab_size is None:
        if teacher_weight is not None and teacher_weight.shape[0] != student_weight.shape[0]:
            raise ValueError(f"student lm_head has {student_weight.shape[0]} rows, teacher's "
                             f"{teacher_weight.shape[0]}; pass vocab_size (the tokenizer's) so both project "
                             "onto the same vocabulary")
        vocab_size = student_weight.shape[0]
    for w in (student_weight, teacher_weight):
        if w is not None and w.shape[0] < vocab_size:
            raise ValueError(f"vocab_size {vocab_size} exceeds the lm_head's {w.shape[0]} rows")
    return vocab_size


def value_rows(values: torch.Tensor | tuple[torch.Tensor, ...], start: int, end: int):
    """Rows start:end of a teacher-values tensor or of each tensor of a tuple, detached (the teacher is a constant)."""
    if isinstance(values, tuple):
        return tuple(v[start:end].detach() for v in values)
    return values[start:end].detach()


def count_tokens(labels: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
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
    if getattr(unwrap(model), "pack_rows", False):
        return packed_completion_hidden(model, input_ids, attention_mask, labels)
    has_label = (labels[:, 1:] != IGNORE_INDEX).any(dim=0)
    start = int(has_label.nonzero()[0]) + 1 if bool(has_label.any()) else labels.shape[1] - 1
    hidden = model(input_ids, return_hidden=True).hidden_states
    hidden, targets = hidden[:, start - 1:-1], labels[:, start:]
    keep = targets != IGNORE_INDEX
    return hidden[keep], targets[keep]


def document_hidden(model: torch.nn.Module, input_ids: torch.Tensor, documents: torch.Tensor,
                    labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_hidden` for rows of packed documents (dataset/packed_documents.py, continued pretraining): the
    forward with `documents` (each token attends to its own document only, positions restart at each), then the
    positions whose next token is a label -- every token of a document but its first, and its EOS."""
    hidden = model(input_ids, return_hidden=True, documents=documents).hidden_states
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    return hidden[:, :-1][keep], targets[keep]


def completion_rows(labels: torch.Tensor) -> torch.Tensor:
    """Each position `completion_hidden` returns, its row: (N,), row by row as it orders them (padded or packed)."""
    return (labels[:, 1:] != IGNORE_INDEX).nonzero()[:, 0]


def packed_completion_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                             labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`completion_hidden` through the packed forward (model/qwen3.py: Packing): the rows' real tokens only, the
    pads' share of the work spared outside the attention (--packing 1). The same positions in the same order (row
    by row), the same labels; the hidden states equal the padded forward's to the GEMMs' rounding."""
    packing = Packing.of(attention_mask)
    hidden = model(input_ids, return_hidden=True, packing=packing).hidden_states  # (N, H), row by row
    targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)
    predicting = targets.reshape(-1)[packing.index] != IGNORE_INDEX  # a real token whose next one is a label
    return hidden[predicting], targets.reshape(-1)[packing.index][predicting]
