"""train_sft.py's options: the shared groups alone (SFT has no flags of its own), and what a resume may change."""
from __future__ import annotations

import argparse

from common.errors import ArgumentParser
from trainer.config.flags import SHARED_RESUMABLE, add_common_args, validate_common_args

RESUMABLE = SHARED_RESUMABLE  # what a resume may change: only the shared groups' flags (trainer/config/flags.py)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="SFT of a Qwen3 model on chat data (masked cross entropy)")
    add_common_args(parser, save_weight="sft")
    args = parser.parse_args(argv)
    validate_common_args(args)
    return args
