"""train_logit_free.py's options: the shared groups, the black-box teacher (one endpoint, or several from a
file), the method's (chunks, continuations, similarity, prior, anchor), the student's sampling and the rollout
server; the rules between them; what a resume may change."""
from __future__ import annotations

import argparse
import os

from common.errors import ArgumentParser, refuse, refuse_first
from trainer.config.flags import (SHARED_RESUMABLE, add_common_args, add_frozen_model_args, default_student,
                                  validate_common_args)
from trainer.logit_free.agreement import SIMILARITIES
from trainer.logit_free.audit import CHUNK_WEIGHTS
from trainer.rollouts.servers import SERVER_RESUMABLE, add_server_args, validate_server_args
from trainer.rollouts.source import add_sampling_args, validate_sampling_args
from trainer.teachers.black_box import (add_black_box_teacher_args, black_box_specs, check_teacher_wait,
                                        validate_black_box_teacher_args)
from trainer.teachers.specs import add_teachers_args, validate_teachers_args

# the black-box teachers have no --replicate_teacher to change; the reference and the evaluation teacher do
RESUMABLE = SHARED_RESUMABLE | SERVER_RESUMABLE | {"replicate_teacher"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="Logit-free on-policy distillation of a Qwen3 student from a black-box teacher")
    add_common_args(parser, save_weight="logit_free")
    add_black_box_teacher_args(parser)
    add_teachers_args(parser, black_box=True)
    add_method_args(parser)
    add_sampling_args(parser)
    add_server_args(parser, teacher=False)
    args = parser.parse_args(argv)
    default_student(args, "kd", "python trainer/train_sft.py && python trainer/train_distillation.py")  # as OPD's
    validate_common_args(args)
    validate_sampling_args(args)
    validate_logit_free_args(args)
    validate_server_args(args, samples=True, teacher=False)
    validate_teachers_args(args, black_box_specs(args))
    return args


def add_method_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logit-free distillation (docs/logit_free.md)")
    g.add_argument("--audit_chunks", type=int, default=10, help="M: chunks audited per completion, at most")
    g.add_argument("--chunk_len", type=int, default=50, help="C: tokens per chunk")
    g.add_argument("--continuations", type=int, default=10, help="N: teacher continuations per chunk")
    g.add_argument("--similarity", default="levenshtein", choices=SIMILARITIES,
                   help="phi: 1 - character Levenshtein distance / the longer length, ROUGE-1 F, or exact equality "
                        "(no partial credit: one wrong digit is a wrong answer)")
    g.add_argument("--alpha", type=float, default=1.0,
                   help="the prior's weight in pi_hat = (k + alpha pi_bar) / (N + alpha)")
    g.add_argument("--chunk_weight", default="posterior", choices=CHUNK_WEIGHTS,
                   help="an audited chunk's weight: pi_hat (posterior), pi_hat - pi_bar (advantage: pushed down where "
                        "the teacher agrees less than the student expected) or pi_hat - the micro-batch's mean "
                        "(centred); docs/logit_free.md's ablation")
    g.add_argument("--anchor_beta", type=float, default=0.1,
                   help="beta: weight of KL(p_ref || p_student) on the unaudited positions (0: no anchor)")
    g.add_argument("--reference_path", default=None,
                   help="the anchor's frozen model (default: the student's starting model)")
    add_frozen_model_args(g, "the reference, --eval_teacher_path")


def validate_logit_free_args(args: argparse.Namespace) -> None:
    a = args
    validate_black_box_teacher_args(args)
    refuse_first([
        (a.audit_chunks < 1 or a.chunk_len < 1 or a.continuations < 1,
         f"--audit_chunks, --chunk_len and --continuations must be >= 1, got {a.audit_chunks}, {a.chunk_len}, "
         f"{a.continuations}"),
        (a.alpha <= 0, f"--alpha must be > 0, got {a.alpha}"),
        (a.anchor_beta < 0, f"--anchor_beta must be >= 0, got {a.anchor_beta}"),
        (a.chunk_len > a.max_new_tokens,
         f"--chunk_len {a.chunk_len} is longer than --max_new_tokens {a.max_new_tokens}: no completion could be "
         f"audited"),
    ])
    for flag in ("reference_path", "eval_teacher_path"):
        path = getattr(args, flag)
        if path and not os.path.exists(path):
            refuse(f"--{flag} {path} does not exist")
    check_teacher_wait(args)
