"""train_pretrain.py's options: the shared groups (its own reading of the data and evaluation flags), the rules of a
streamed corpus, and what a resume may change."""
from __future__ import annotations

import argparse

from common.errors import ArgumentParser, refuse
from trainer.config.flags import SHARED_RESUMABLE, add_common_args, validate_common_args

RESUMABLE = SHARED_RESUMABLE  # what a resume may change: only the shared groups' flags (trainer/config/flags.py)
# the shared flags a raw-text corpus reads differently from chat rows
TEXT_HELP = {
    "--data_path": "raw text: a .parquet or .jsonl file with a `text` column, or a folder of them, streamed "
                   "(default: the demo corpus, dataset/make_demo_data.py)",
    "--max_length": "tokens per packed row",
    "--eval_data_path": "held-out raw text, as --data_path (default: the demo's held-out corpus)",
    "--eval_rows": "held-out packed rows per evaluation (a fixed set: the corpus's first)",
    "--max_prompt_length": "not read: raw text has no prompt",
    "--enable_thinking": "not read: raw text has no chat template",
    "--eval_max_new_tokens": "not read: the held-out evaluation generates nothing",
    "--epochs": "passes over the corpus (its rows counted by one tokenising pass at start-up); not read with "
                "--max_steps, which sets the run's length itself (the corpus then repeats as often as it takes)",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="Continued pretraining of a Qwen3 model on raw text (next-token loss on "
                                        "every token, documents packed, each attending to itself only)")
    add_common_args(parser, save_weight="pretrain")
    for action in parser._actions:  # argparse keeps no other handle on an added flag's help
        action.help = TEXT_HELP.get(next(iter(action.option_strings), ""), action.help)
    args = parser.parse_args(argv)
    validate_common_args(args, chat=False)
    if args.packing:
        refuse("--packing 1 packs chat rows; a corpus's rows are packed already (documents end to end, each with "
               "its own attention): leave --packing at 0")
    return args
