"""Self-distillation (OPSD, arXiv 2601.18734; SDFT, arXiv 2601.19897): the teacher is the student itself, shown
privileged context -- a reference answer or solution from the row's columns -- in its prompt, and it scores the
student's own completion, which was sampled without that context. No second model is trained or served.

    teachers = open_self_teachers(args, run, tokenizer, training=...)   # after the Run: the student is built
    scores = teachers.score(batch, input_ids, attention_mask, labels, run.teacher_autocast)  # privileged prompts
    ...
    metrics = run.optimizer_step(); teachers.after_step()                # ema: the average follows the weights

Which weights teach (--self_teacher):
  start  the student as it started: a LoRA student's own base with its adapters switched off (`BaseOf`, no second
         copy); a full student's --model_path loaded again, frozen (or --model_config's random init again)
  ema    an exponential moving average of the trained parameters (a LoRA student's: its adapters, over the shared
         base), updated after every optimizer step, kept in the resume file; its forward is the student's module
         called with the average in place of those parameters (torch.func.functional_call: no swap to undo)
  live   the current weights, without gradients

The teacher's sequence is the privileged prompt (the row's messages with the last user turn replaced by
--privileged_template, rendered by the same chat template) followed by exactly the student's completion tokens
(build_sequences): its hidden states at the completion positions line up one for one with the student's.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch.func import functional_call

from common.errors import refuse
from dataset.collators import IGNORE_INDEX, PromptCollator, build_sequences, split_conversation
from trainer.losses.divergences import Divergence
from trainer.skeleton.distributed import print0
from trainer.teachers.frozen import load_start
from trainer.teachers.specs import SINGLE, Routing
from trainer.teachers.teacher_set import Teacher, Teachers

EMA_STATE = "self_teacher_ema"  # its name among the resume file's kept states (Run.keep_state)


def privileged_messages(row: dict, template: str) -> list[dict]:
    """The row's prompt messages with the last user turn's content replaced by `template` filled from the row's
    columns and {question} (that turn's own content). KeyError / IndexError / ValueError: the template names what
    the row lacks, or is malformed."""
    prompt = [dict(turn) for turn in split_conversation(row["messages"])[0]]
    last_user = max(i for i, turn in enumerate(prompt) if turn["role"] == "user")
    columns = {key: value for key, value in row.items() if key != "messages"}
    prompt[last_user]["content"] = template.format_map({**columns, "question": prompt[last_user]["content"]})
    return prompt


def check_privileged_prompts(dataset, collator: PromptCollator, template: str, max_prompt_length: int) -> None:
    """Every row's privileged prompt rendered and measured at start-up: a column the template names that a row lacks,
    a malformed template, or a prompt longer than --max_prompt_length (it would lose its first tokens) is one
    line naming the row; so is a row with tool results (the teacher's view keeps the student's labelled tokens only,
    and a conversation's results would fall out of it)."""
    path = getattr(dataset, "path", "the data")
    for index in range(len(dataset)):
        row = dataset[index]
        if any(message["role"] == "tool" for message in row["messages"]):
            refuse(f"row {index} of {path} holds tool results: self-distillation's privileged prompt is built for "
                   f"one answer; use a --teacher_path for conversations with tools")
        try:
            messages = privileged_messages(row, template)
        except (KeyError, IndexError) as error:
            columns = ", ".join(sorted(k for k in row if k not in ("messages", "row_index")))
            refuse(f"--privileged_template names {error}, which row {index} of {path} lacks (its columns: "
                   f"{columns}; {{question}} is its last user turn)")
        except ValueError as error:
            refuse(f"--privileged_template is not a format string ({error}): fields in braces, literal braces "
                   f"doubled")
        length = len(collator.tokenizer.encode(collator.render(messages)))
        if length > max_prompt_length:
            refuse(f"row {index} of {path}: its privileged prompt (--privileged_template) is {length} tokens, over "
                   f"--max_prompt_length {max_prompt_length}: raise --max_prompt_length")


def privileged_sequences(collator: PromptCollator, template: str, rows: list[dict], input_ids: torch.Tensor,
                         labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's view of a micro-batch: each row's privileged prompt followed by the student's completion tokens
    (those labelled in `labels`, in order) -> right-padded input_ids, attention_mask, labels, as build_sequences
    lays out the student's."""
    prompts = collator([{"messages": privileged_messages(row, template)} for row in rows])
    completion = labels != IGNORE_INDEX
    lengths = completion.sum(dim=1)
    width = int(lengths.max()) if lengths.numel() else 0
    completion_mask = torch.arange(width, device=labels.device) < lengths[:, None]
    completion_ids = torch.full((labels.shape[0], width), collator.tokenizer.pad_token_id, dtype=input_ids.dtype,
                                device=input_ids.device)
    completion_ids[completion_mask] = input_ids[completion]  # row by row, in order: the labelled tokens
    device = input_ids.device
    return build_sequences(prompts["prompt_ids"].to(device), prompts["prompt_attention_mask"].to(device),
                           completion_ids, completion_mask.long())


class LiveOf:
    """The student's current weights as a teacher: its forward without gradients, its head detached (read after
    the student's forward: with --fsdp 1 the gathered head)."""

    def __init__(self, student: torch.nn.Module):
        self.student, self.config = student, student.config

    def __call__(self, *args, **kwargs):
        with torch.no_grad():
            return self.student(*args, **kwargs)

    @property
    def lm_head(self) -> SimpleNamespace:
        return SimpleNamespace(weight=self.student.lm_head.weight.detach())

    @property
    def pack_rows(self) -> bool:
        return self.student.pack_rows


class EmaOf:
    """An exponential moving average of the student's trained parameters as a teacher: the student's own module
    called with the average in their place (the frozen ones, a LoRA student's base, are the student's: held once).
    The average starts at the starting weights and is kept in fp32, as the masters are."""

    def __init__(self, student: torch.nn.Module, decay: float):
        self.student, self.config, self.decay = student, student.config, decay
        self.names = [name for name, p in student.named_parameters() if p.requires_grad]  # a tied head: once
        self.trained = [p for p in student.parameters() if p.requires_grad]
        self.average = [p.detach().float().clone() for p in self.trained]

    def __call__(self, *args, **kwargs):
        with torch.no_grad():
            return functional_call(self.student, dict(zip(self.names, self.average)), args, kwargs)

    @property
    def lm_head(self) -> SimpleNamespace:
        head = self.student.lm_head.weight
        averaged = next((a for p, a in zip(self.trained, self.average) if p is head), None)
        return SimpleNamespace(weight=head.detach() if averaged is None else averaged)

    @property
    def pack_rows(self) -> bool:
        return self.student.pack_rows

    @torch.no_grad()
    def update(self) -> None:
        """After an optimizer step: average = decay * average + (1 - decay) * weights."""
        torch._foreach_lerp_(self.average, [p.detach().float() for p in self.trained], 1.0 - self.decay)

    def state(self) -> dict[str, torch.Tensor]:
        return {name: a.cpu() for name, a in zip(self.names, self.average)}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        for name, a in zip(self.names, self.average):
            a.copy_(state[name])


class SelfTeachers(Teachers):
    """The run's one teacher, the student itself (`model`: the view above, or the start), scoring each row's
    completion after its privileged prompt. Held-out evaluation reports no divergence to it (its prompts there would
    be the eval rows' privileged ones, which the student never trains on)."""

    def __init__(self, teacher: Teacher, collator: PromptCollator, template: str, ema: EmaOf | None):
        super().__init__([teacher], Routing([SINGLE], "teacher", None))
        self.collator, self.template, self.ema = collator, template, ema

    def score(self, batch: dict, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
              autocast) -> list:
        return super().score(batch, *privileged_sequences(self.collator, self.template, batch["rows"], input_ids,
                                                          labels), autocast)

    def after_step(self) -> None:
        if self.ema is not None:
            self.ema.update()

    def for_evaluation(self) -> dict:
        return {"teachers": [], "teacher_of": None}


def open_self_teachers(args: argparse.Namespace, run, tokenizer,
                       training: Callable[[Teacher], Divergence]) -> SelfTeachers:
    """The self-teacher of --self_teacher over `run`'s student (built, wrapped, resumed: an EMA resumes from the
    run's kept state); `training(teacher)`: the divergence the loss computes against it."""
    student = run.raw_model
    ema = None
    if args.self_teacher == "start":
        model = load_start(args, tokenizer, run.device, student, None, role="self-teacher")
    elif args.self_teacher == "ema":
        model = ema = EmaOf(student, args.ema_decay)
        if EMA_STATE in run.state.kept:
            ema.load(run.state.kept[EMA_STATE])
        run.keep_state(EMA_STATE, ema.state)
    else:
        model = LiveOf(student)
    print0(f"self-distillation: the teacher is the student ({args.self_teacher}), its prompt "
           f"--privileged_template's")
    teacher = Teacher(SINGLE, model, None, args.teacher_topk)
    teacher.divergence = training(teacher)
    collator = PromptCollator(tokenizer, args.max_prompt_length, bool(args.enable_thinking))
    return SelfTeachers(teacher, collator, args.privileged_template, ema)
