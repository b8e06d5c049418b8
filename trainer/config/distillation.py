"""train_distillation.py's options: the shared groups, the teacher (one, or several from a file) and --alpha; what
a resume may change."""
from __future__ import annotations

import argparse
import os

from common.errors import ArgumentParser, refuse
from trainer.config.flags import (SHARED_RESUMABLE, ROOT, TEACHER_RESUMABLE, add_common_args, add_teacher_args,
                                  resolve_teacher_path, validate_common_args)
from trainer.teachers.specs import add_teachers_args, teacher_specs, validate_teachers_args

DEFAULT_STUDENT_CONFIG = os.path.join(ROOT, "model", "configs", "qwen3-tiny-student.json")

RESUMABLE = SHARED_RESUMABLE | TEACHER_RESUMABLE


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="White-box KD of a Qwen3 student from a same-tokenizer teacher")
    add_common_args(parser, save_weight="kd")
    add_teacher_args(parser)
    add_teachers_args(parser)
    parser.add_argument("--alpha", type=float, default=0.5, help="weight of the cross entropy (1 - alpha: KD)")
    args = parser.parse_args(argv)
    if not args.model_path and not args.model_config:
        args.model_config = DEFAULT_STUDENT_CONFIG
    validate_common_args(args)
    if not args.teachers:
        resolve_teacher_path(args)
    validate_teachers_args(args, teacher_specs(args), served=False)
    if not 0.0 <= args.alpha <= 1.0:
        refuse(f"--alpha must be in [0, 1], got {args.alpha}")
    return args
