"""train_distillation.py's options: the shared groups, the teacher (one, or several from a file), --alpha and the
KD term's divergence; what a resume may change."""
from __future__ import annotations

import argparse
import os

from common.errors import ArgumentParser, refuse_first
from trainer.config.flags import (SHARED_RESUMABLE, ROOT, TEACHER_RESUMABLE, add_common_args, add_teacher_args,
                                  resolve_teacher_path, validate_common_args)
from trainer.losses.fused_divergences import SKEW, SKEWS
from trainer.teachers.specs import add_teachers_args, teacher_specs, validate_teachers_args

DEFAULT_STUDENT_CONFIG = os.path.join(ROOT, "model", "configs", "qwen3-tiny-student.json")

RESUMABLE = SHARED_RESUMABLE | TEACHER_RESUMABLE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="White-box KD of a Qwen3 student from a same-tokenizer teacher")
    add_common_args(parser, save_weight="kd")
    add_teacher_args(parser)
    add_teachers_args(parser)
    parser.add_argument("--alpha", type=float, default=0.5, help="weight of the cross entropy (1 - alpha: KD)")
    parser.add_argument("--divergence", default="kl", choices=["kl", *SKEWS],
                        help="KD's term: kl, KL(teacher || student); skew_kl / skew_rkl, DistiLLM's skew KL / skew "
                             "reverse KL at --skew")
    parser.add_argument("--skew", type=float, default=SKEW, help="a of --divergence skew_kl / skew_rkl, in [0, 1)")
    args = parser.parse_args(argv)
    if not args.model_path and not args.model_config:
        args.model_config = DEFAULT_STUDENT_CONFIG
    validate_common_args(args)
    if not args.teachers:
        resolve_teacher_path(args)
    validate_teachers_args(args, teacher_specs(args), served=False)
    refuse_first([
        (not 0.0 <= args.alpha <= 1.0, f"--alpha must be in [0, 1], got {args.alpha}"),
        (not 0.0 <= args.skew < 1.0, f"--skew must be in [0, 1), got {args.skew}"),
        (args.skew != SKEW and args.divergence == "kl",
         "--skew is the skew divergences' a: add --divergence skew_kl or skew_rkl"),
    ])
    return args
