"""A micro-batch split by teacher (docs/teachers.md): which rows and completion positions each teacher of the run
scores, what it gives for them, and its numbers in the window's metrics. With one teacher its part is the whole
micro-batch, selected without a copy: the numbers of a single-teacher run are those of the loops before."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dataset.collators import IGNORE_INDEX
from trainer.losses.divergences import Divergence
from trainer.skeleton.sharding import is_sharded
from trainer.teachers.frozen import frozen_hidden

if TYPE_CHECKING:  # the teacher set builds its parts: a type only here
    from trainer.teachers.teacher_set import Teacher, Teachers


def teacher_scores(divergence: Divergence, teacher: torch.nn.Module | None, teacher_server, autocast,
                   input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
    """What the teacher gives for these completions, without gradients: a local teacher's final hidden states at
    the completion positions (its lm_head is applied chunk by chunk inside the loss, where topk takes its top-K);
    a served teacher's log-probabilities of the sampled tokens (N,), or with topk the ids of its top-K and the
    sampled token and its log-probabilities of them, ((N, K+1), (N, K+1)). `autocast`: the local teacher's own
    forward context (Run.teacher_autocast)."""
    if teacher_server is None:
        return frozen_hidden(teacher, autocast, input_ids, attention_mask, labels)
    targets = labels != IGNORE_INDEX  # a completion's tokens, or a conversation's own between its tool results
    if divergence.kind == "topk":
        return teacher_server.completion_topk_logprobs(input_ids, attention_mask, targets, divergence.topk)
    return teacher_server.completion_logprobs(input_ids, attention_mask, targets)


@dataclass
class Part:
    """The rows of a micro-batch one teacher scores: `rows` their indices (ascending), `positions` a bool mask over
    the micro-batch's completion positions (completion_hidden's order: row by row). `whole`: every row is this
    teacher's (no selection needed; `positions` None)."""
    teacher: Teacher
    rows: torch.Tensor
    positions: torch.Tensor | None
    whole: bool
    scores: object = None  # what the teacher gave for these rows (`teacher_scores`; None: no rows here)

    @property
    def empty(self) -> bool:
        return self.rows.numel() == 0

    @property
    def index(self) -> torch.Tensor | slice:
        """Indexes this teacher's completion positions (N, ...), to read or to write."""
        return slice(None) if self.whole else self.positions

    def select(self, tensor: torch.Tensor) -> torch.Tensor:
        """Per completion position (N, ...) -> this teacher's positions."""
        return tensor[self.index]

    def sequences(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per row (B, T) -> this teacher's rows."""
        return tensors if self.whole else tuple(t[self.rows] for t in tensors)


def split_by_teacher(teachers: Teachers, route: torch.Tensor, labels: torch.Tensor) -> list[Part]:
    """A micro-batch's rows per teacher, every teacher in order (one with no rows here too: a sharded teacher
    still runs its forward, see `part_scores`). One teacher: the whole micro-batch, found without a look at the
    tensors (on CUDA a nonzero would wait for the device every micro-batch)."""
    if not teachers.several:
        return [Part(teachers.members[0], torch.arange(labels.shape[0]), None, whole=True)]
    route = route.to(labels.device)
    position_rows = (labels[:, 1:] != IGNORE_INDEX).nonzero()[:, 0]  # completion_hidden's positions, row by row
    parts = []
    for i, teacher in enumerate(teachers.members):
        mine = route == i
        parts.append(Part(teacher, mine.nonzero()[:, 0], mine[position_rows], whole=bool(mine.all())))
    return parts


def part_scores(part: Part, divergence, autocast, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor):
    """What `part`'s teacher gives for its rows (`teacher_scores`), None when it has none
    here. A sharded teacher with no rows still runs a forward (of the first row, thrown away): its layers'
    all-gathers are collectives every rank must join, whatever rows it has."""
    model = part.teacher.model
    if part.empty:
        if model is not None and is_sharded(model):
            frozen_hidden(model, autocast, input_ids[:1], attention_mask[:1], labels[:1])
        return None
    return teacher_scores(divergence, model, part.teacher.server, autocast,
                          *part.sequences(input_ids, attention_mask, labels))


def add_part_metrics(metrics, teachers: Teachers, part: Part, loss_sum, tokens) -> None:
    """Several teachers: teacher/NAME/loss (the loop's loss summed over its rows' tokens, `loss_sum`, per token;
    None: the loop has no per-teacher loss), teacher/NAME/rows and /tokens; every teacher on every micro-batch (ranks
    must add the same names), zeros where it has no rows (a step where it has none logs no loss for it)."""
    if not teachers.several:
        return
    name = f"teacher/{part.teacher.name}"
    if loss_sum is not None:
        metrics.ratio(f"{name}/loss", loss_sum, tokens, when_empty=False)
    metrics.total(f"{name}/rows", part.rows.numel())
    metrics.total(f"{name}/tokens", tokens)
