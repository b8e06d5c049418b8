"""The run's teachers behind one object (docs/teachers.md). The loop opens them at start-up in one call, and asks
them, per micro-batch, for the scores of its sequences -- each row scored by its own teacher -- and for the loss of
the student's hidden states against those scores:

    teachers = open_teachers(args, specs, tokenizer, dataset, device, training=..., evaluation=...)
    scores = teachers.score(batch, input_ids, attention_mask, labels, run.teacher_autocast)   # no gradients
    loss_sum, num_tokens = teachers.loss(scores, student_hidden, head, targets, chunk_size, vocab, run.metrics)
    teachers.reshard()                 # after the backward: a sharded teacher's gathered head is freed

What a teacher gives (trainer/teachers/parts.py's `teacher_scores`): a local teacher's hidden states at the
completion positions (its full distribution, or its top-K cut from its logits), a served teacher's log-probabilities
of the sampled tokens or of its top-K with the tail's mass. Routing per row, sharding (trainer/teachers/frozen.py),
serving (trainer/rollouts/servers.py) and the chat-template check (trainer/teachers/template_check.py) live
behind it; held-out evaluation reads the same teachers (`for_evaluation`).

A run with one teacher (--teacher_path / --teacher_url) is a set of one, named "teacher": the loops have one way of
scoring, and a single teacher's numbers are those of the loops before there were several. A run with none (RL
without --opd_coef) is an empty set: it scores nothing.
"""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch

from serving.engine import CompletionServer
from trainer.losses.divergences import Divergence, DivergenceSums, divergence_sums, evaluation_divergence
from trainer.losses.policy_gradient import token_logprobs
from trainer.rollouts.servers import open_server
from trainer.skeleton.distributed import print0
from trainer.skeleton.sharding import reshard_root
from trainer.teachers.frozen import load_frozen, same_vocabulary
from trainer.teachers.parts import Part, add_part_metrics, part_scores, split_by_teacher
from trainer.teachers.specs import SINGLE, Routing, TeacherSpec, accepted_differences, routing
from trainer.teachers.template_check import check_template


@dataclass
class Teacher:
    """A loaded teacher: a frozen local model or a connected server, never both; `divergence` what the loop's loss
    computes against it (trainer/losses/divergences.py), `evaluation` what held-out evaluation reports."""
    name: str
    model: torch.nn.Module | None
    server: CompletionServer | None
    topk: int
    divergence: Divergence | None = None
    evaluation: Divergence | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor | None:
        return None if self.model is None else self.model.lm_head.weight


@dataclass(frozen=True)
class EvalTeacher:
    """A teacher as the evaluation reads it: its name, the divergence it reports (trainer/losses/divergences.py's
    evaluation_divergence) and a local `model` or a `server`."""
    name: str
    divergence: Divergence
    model: torch.nn.Module | None = None
    server: object | None = None


class Teachers:
    """The run's loaded teachers, in the file's order, and the routing of rows to them."""

    def __init__(self, members: list[Teacher], routes: Routing):
        self.members, self.routes = members, routes

    @property
    def several(self) -> bool:
        return len(self.members) > 1

    @property
    def served(self) -> bool:
        """Whether a server is asked (its failure is one the ranks must fail together on: Run.fail_together)."""
        return any(teacher.server is not None for teacher in self.members)

    @property
    def local(self) -> list[torch.nn.Module]:
        return [teacher.model for teacher in self.members if teacher.model is not None]

    def route(self, batch: dict) -> torch.Tensor:
        """(B,) the index of each row's teacher: the collator's `teacher_index` (RoutedCollator), else from the
        rows."""
        return batch["teacher_index"] if "teacher_index" in batch else self.routes.route(batch["rows"])

    def score(self, batch: dict, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
              autocast) -> list[Part]:
        """What each teacher gives for its own rows of the micro-batch, without gradients: the micro-batch split by
        teacher (every teacher in order, one with no rows too), each part's `scores` set. `autocast`: a local
        teacher's forward context (Run.teacher_autocast)."""
        if not self.members:
            return []
        parts = split_by_teacher(self, self.route(batch), labels)
        for part in parts:
            part.scores = part_scores(part, part.teacher.divergence, autocast, input_ids, attention_mask, labels)
        return parts

    def loss(self, parts: list[Part], student_hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor,
             chunk_size: int, vocab_size: int, metrics,
             rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The student's hidden states at the completion positions and their labels (completion_hidden) against
        each teacher's scores: per teacher the summed per-token loss of its rows (its `divergence`), summed over
        the teachers -> (loss sum, tokens). Each divergence's per-token numbers (CE and KD; the top-K tail mass; the
        sampled-token KL estimate) and, with several teachers, each one's loss join the window's `metrics`, on
        every micro-batch (zeros where a teacher has no rows: the ranks add the same names). `rows`: each completion
        position's row (completion_rows), for a divergence that weights a token by its place in its row."""
        loss_sum = num_tokens = 0
        for part in parts:
            divergence = part.teacher.divergence
            if part.empty:
                sums = DivergenceSums(0, 0, 0, dict.fromkeys(divergence.extra_names(), 0))
            else:
                sums = divergence_sums(divergence, part.select(student_hidden), head, part.select(targets),
                                       part.scores, part.teacher.lm_head_weight, chunk_size, vocab_size,
                                       None if rows is None else part.select(rows))
            for name, value in sums.extras.items():
                metrics.token_mean(name, value)
            add_part_metrics(metrics, self, part, sums.value, sums.tokens)  # sampled_kl: its estimate
            loss_sum, num_tokens = loss_sum + sums.loss, num_tokens + sums.tokens
        return loss_sum, num_tokens

    def token_logprobs(self, parts: list[Part], targets: torch.Tensor, out: torch.Tensor, temperature: float,
                       chunk_size: int, vocab_size: int, autocast, metrics) -> None:
        """Each completion token's log-probability under its row's teacher at `temperature`, written into `out`
        (N,) (a served teacher's are at temperature 1: the config refuses another); each teacher's rows and tokens
        join the window's `metrics` (several teachers). For the RL loop's OPD term, scored with
        Divergence("sampled_kl")."""
        for part in parts:
            scores = part.scores
            if scores is not None and part.teacher.model is not None:
                with autocast():
                    scores = token_logprobs(scores, part.teacher.lm_head_weight, part.select(targets), chunk_size,
                                            vocab_size, temperature)
            if scores is not None:
                out[part.index] = scores.to(out.dtype)
            add_part_metrics(metrics, self, part, None, 0 if scores is None else scores.numel())

    def after_step(self) -> None:
        """After each optimizer step: nothing for a frozen or served teacher (a self-teacher's EMA follows the
        weights: trainer/teachers/self_teacher.py)."""

    def reshard(self) -> None:
        """Each sharded teacher's gathered head freed, after the backward that read it
        (trainer/skeleton/sharding.py)."""
        for model in self.local:
            reshard_root(model)

    def close(self) -> None:
        for teacher in self.members:
            if teacher.server is not None:
                teacher.server.close()

    def for_evaluation(self) -> dict:
        """HeldoutEvaluator's `teachers` and `teacher_of`: each teacher with the divergence it reports (its
        `evaluation`); with several, a held-out row's teacher from its column (a row without one: no divergence)."""
        return {"teachers": [EvalTeacher(t.name, t.evaluation, t.model, t.server) for t in self.members],
                "teacher_of": self.routes.teacher_of if self.several else None}

    def shown(self) -> tuple[str, ...]:
        """The console's per-teacher numbers: each one's loss (several teachers only)."""
        return tuple(f"teacher/{t.name}/loss" for t in self.members) if self.several else ()


def open_teachers(args: argparse.Namespace, specs: list[TeacherSpec], tokenizer, dataset, device: str,
                  training: Callable[[Teacher], Divergence], evaluation: Callable[[Teacher], Divergence],
                  check_templates: bool = True) -> Teachers:
    """The run's teachers, before the student is built: every row of `dataset` routed to one of them (the first that
    is not is refused), the served ones connected (one that is down is refused now), each local one's vocabulary
    compared with the student's tokenizer and every teacher's chat template checked against the student's on the
    first rows' prompts (`check_template`); then each local one loaded (trainer/teachers/frozen.py: frozen dtype,
    sharded with --fsdp 1), and several said on the console. `training(teacher)` and `evaluation(teacher)`: the
    divergence the loop's loss computes against it and the one held-out evaluation reports. `check_templates`:
    False for a teacher that scores only the student's own held-out completions (no prompt of ours is rendered
    for it)."""
    routes = routing(args, specs)
    routes.check(dataset)
    servers = {spec.name: connect_served_teacher(args, spec, tokenizer) for spec in specs if spec.url}
    for spec in specs:
        own = None if spec.url else same_vocabulary(spec.path, tokenizer, role_of(spec))
        if check_templates and spec.name not in accepted_differences(args):
            check_template(args, spec.name, role_of(spec), spec.path or spec.url, servers.get(spec.name), own,
                           tokenizer, dataset)
    members = []
    for spec in specs:
        model = None if spec.url else load_frozen(args, spec.path, tokenizer, device, role_of(spec))
        teacher = Teacher(spec.name, model, servers.get(spec.name), spec.topk)
        teacher.divergence, teacher.evaluation = training(teacher), evaluation(teacher)
        members.append(teacher)
    teachers = Teachers(members, routes)
    say_teachers(teachers)
    return teachers


def open_evaluation_teacher(args: argparse.Namespace, path: str | None, tokenizer, dataset, device: str) -> Teachers:
    """A local teacher that only held-out evaluation reads, opened as `open_teachers` opens one but without the
    chat-template check, as before there was one object (the logit-free loop's --eval_teacher_path: the reverse KL
    its table reports; that loop has no --accept_template_difference); none without `path`."""
    return open_teachers(args, [TeacherSpec(SINGLE, path=path)] if path else [], tokenizer, dataset, device,
                         training=lambda t: None, evaluation=lambda t: evaluation_divergence(1.0, local_teacher=True),
                         check_templates=False)


def role_of(spec: TeacherSpec) -> str:
    """How messages name a teacher: "teacher" alone, or "teacher 'math'" among several."""
    return "teacher" if spec.name == SINGLE else f"teacher {spec.name!r}"


def connect_served_teacher(args: argparse.Namespace, spec: TeacherSpec, tokenizer) -> CompletionServer:
    """A served teacher, checked at once: up, its model, context, tokenizer and top-K (trainer/rollouts/servers.py)."""
    what = "teacher server" if spec.name == SINGLE else f"teacher server {spec.name!r}"
    return open_server(args, spec.url, spec.model, spec.api_key_env, what, tokenizer, spec.topk)


def say_teachers(teachers: Teachers) -> None:
    """One start-up line for several teachers: who they are and how rows find them."""
    if teachers.several:
        where = ", ".join(f"{t.name} ({'served' if t.server else 'local'})" for t in teachers.members)
        default = f", else {teachers.routes.default}" if teachers.routes.default else ""
        print0(f"teachers: {where}; each row's from its {teachers.routes.column!r} column{default}")
