"""The flags of self-distillation (OPSD, SDFT: the student is its own teacher, shown privileged context in its
prompt; trainer/teachers/self_teacher.py) and their rules."""
from __future__ import annotations

import argparse

SELF_TEACHERS = ("none", "start", "ema", "live")
# OPSD's teacher prompt, read from its abstract and figure (the problem, a reference solution, then "solve it with your
# own approach"); this project's rows carry a final answer (`ground_truth`) more often than a worked solution: a row
# with one names its column instead, e.g. "{question}\n\nReference solution:\n{solution}\n\n..."
PRIVILEGED_TEMPLATE = ("{question}\n\nHere is a reference answer: {ground_truth}. After understanding it, solve the "
                       "problem with your own approach.")
EMA_DECAY = 0.99


def add_self_distillation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("self-distillation (the student is its own teacher, given privileged context)")
    g.add_argument("--self_teacher", default="none", choices=SELF_TEACHERS,
                   help="start: the student as it started (a LoRA student: its base, adapters off); ema: an "
                        "exponential moving average of its weights; live: its current weights, no gradient; the "
                        "teacher scores the student's completion after --privileged_template's prompt (none: a "
                        "--teacher_path / --teacher_url teacher)")
    g.add_argument("--privileged_template", default=PRIVILEGED_TEMPLATE,
                   help="the teacher's user turn, a Python format string over the row's columns ({ground_truth}, "
                        "{solution}, {reward_model[ground_truth]}, ...) and {question}, the student's last user "
                        "turn; literal braces doubled ({{ }})")
    g.add_argument("--ema_decay", type=float, default=EMA_DECAY,
                   help="--self_teacher ema: the average's decay d, after every optimizer step ema = d ema + (1 - d) "
                        "weights")


def self_distillation_rules(args: argparse.Namespace) -> list[tuple[bool, str]]:
    a, on = args, args.self_teacher != "none"
    return [
        (on and (a.teacher_url or a.teachers or a.teacher_path),
         f"--self_teacher {a.self_teacher}: the student is the teacher; drop --teacher_path / --teacher_url / "
         f"--teachers"),
        (on and a.skd_topk, "--skd_topk: speculative KD's teacher decodes beside the student; with --self_teacher "
                            "the teacher's prompt differs from the student's: drop one of them"),
        (a.self_teacher == "ema" and a.fsdp,
         "--self_teacher ema keeps the average beside whole weights on every rank: with --fsdp 1 use --self_teacher "
         "start or live"),
        (on and a.temperature <= 0, f"--temperature must be > 0, got {a.temperature}"),
        (not 0.0 < a.ema_decay < 1.0, f"--ema_decay must be in (0, 1), got {a.ema_decay}"),
        (a.ema_decay != EMA_DECAY and a.self_teacher != "ema",
         f"--ema_decay is the EMA teacher's: add --self_teacher ema (got --self_teacher {a.self_teacher})"),
        (a.privileged_template != PRIVILEGED_TEMPLATE and not on,
         "--privileged_template is the self-teacher's prompt: add --self_teacher start, ema or live"),
    ]
