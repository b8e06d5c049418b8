"""train_dpo.py's options: the shared groups, DPO's own (the loss, beta, the RPO term, the reference and whether its
numbers are precomputed), the rules between them, and what a resume may change."""
from __future__ import annotations

import argparse
import os

from common.errors import ArgumentParser, refuse, refuse_first
from trainer.config.flags import (SHARED_RESUMABLE, TEACHER_RESUMABLE, add_common_args, add_frozen_model_args,
                                  validate_common_args)
from trainer.losses.preference import PAIR_LOSSES

# --precompute_ref changes where the reference's numbers come from, not what they are (up to the rounding of other
# batches): a resume may switch it
RESUMABLE = SHARED_RESUMABLE | TEACHER_RESUMABLE | {"precompute_ref"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="DPO of a Qwen3 model on preference pairs (sigmoid or IPO loss, optional RPO "
                                        "term) against a frozen reference")
    add_common_args(parser, save_weight="dpo")
    add_dpo_args(parser)
    args = parser.parse_args(argv)
    validate_common_args(args)
    validate_dpo_args(args)
    return args


def add_dpo_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("DPO (trainer/losses/preference.py; docs/training.md, \"DPO\")")
    g.add_argument("--loss_type", default="sigmoid", choices=PAIR_LOSSES,
                   help="sigmoid: DPO's -log sigmoid(beta (h_w - h_l)), h the policy-to-reference log-ratio of an "
                        "answer; ipo: (h_w / n_w - h_l / n_l - 1 / (2 beta))^2 on per-token averages (TRL's)")
    g.add_argument("--beta", type=float, default=0.1,
                   help="DPO's beta (TRL's default), the implicit rewards' scale; IPO's tau")
    g.add_argument("--rpo_alpha", type=float, default=0.0,
                   help="> 0: adds alpha x the chosen answer's NLL per token, per pair (RPO); 0: off")
    g.add_argument("--reference_path", default=None,
                   help="the frozen reference (default: the student's starting model; a LoRA student's own base)")
    g.add_argument("--precompute_ref", type=int, default=0, choices=[0, 1],
                   help="1: the reference's log-probabilities of every training and held-out pair computed once "
                        "before training (kept in the resume file), the reference then freed; 0: a reference "
                        "forward per micro-batch")
    add_frozen_model_args(g, "reference")


def validate_dpo_args(args: argparse.Namespace) -> None:
    refuse_first([
        (not args.beta > 0, f"--beta must be > 0, got {args.beta}"),
        (args.rpo_alpha < 0, f"--rpo_alpha must be >= 0, got {args.rpo_alpha}"),
    ])
    if args.reference_path and not os.path.isfile(os.path.join(args.reference_path, "config.json")):
        refuse(f"--reference_path {args.reference_path}: no model there (config.json)")
