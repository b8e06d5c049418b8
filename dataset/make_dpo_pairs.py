r"""Preference pairs from a model's own graded samples: the data of a DPO loop.

    python dataset/make_dpo_pairs.py --model_path checkpoints/demo/teacher_step425 --n_samples 8 \
        --out dataset/demo/dpo_pairs.parquet                                  # the demo's OPD prompts, on CPU
    python dataset/make_dpo_pairs.py --model_path Qwen3-0.6B --data_path dapo-math-17k.parquet --device cuda \
        --batch_size 64 --n_samples 8 --max_new_tokens 2048 --out dpo_pairs.parquet

For each prompt row (default: the demo's `opd_prompts.parquet`; --data_path: any file dataset/sources.py reads whose
rows have a ground truth), --n_samples answers are sampled and graded by eval/eval_math.py's evaluate_math (math-verify
against the row's ground truth). Its seeds are per (--seed, row, sample): the answers are those of
`eval/eval_math.py --n_samples N --temperature T --seed S` with the same flags, whatever --batch_size.

A prompt with at least one right and one wrong answer gives one pair: chosen = its right answer of the lowest sample
index, rejected = its wrong answer of the lowest sample index (deterministic, and no preference between answers the
grader cannot tell apart). A prompt whose answers are all right or all wrong gives none. One line sums it up (the
demo's student, `--max_rows 64`, docs/data.md):

    prompts 64 | pairs 38 | all right 0 | all wrong 26 | sample accuracy 0.162 (83/512) | 176.9 s

Output (.parquet, or .jsonl by --out's extension), one row per pair, in TRL's conversational preference schema:
    prompt            [{"role", "content"}, ...]: the row's messages before its last assistant turn (what was sampled
                      from; a prompt-only row's messages as they are)
    chosen            [{"role": "assistant", "content": the right answer}]
    rejected          [{"role": "assistant", "content": the wrong answer}]
    ground_truth      str
    chosen_sample, rejected_sample   the answers' sample indices (0 .. n_samples - 1)
    row_index         the prompt's row in the input file
written atomically. A bad flag or file (a missing --data_path, rows without a ground truth, an unwritable --out)
is one `error:` line and exit code 2, before the model loads, and nothing is written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from common.errors import ArgumentParser, UserError, refuse, run_script  # noqa: E402
from common.files import atomic_write, check_writable  # noqa: E402
from dataset.collators import split_conversation  # noqa: E402
from dataset.make_demo_data import ensure_demo_data  # noqa: E402
from dataset.sources import RowDataset  # noqa: E402
from eval.eval_math import (add_model_args, add_prompt_args, check_ground_truth, evaluate_math,  # noqa: E402
                            load_for_inference, validate_model_args, validate_sampling_args)
from model import Decoder  # noqa: E402
from model.generate import DECODE_CHOICES, default_decode  # noqa: E402


# ------------------------------------------------------------------------------------------------------- pairing

def pick_pair(verdicts: Sequence[bool]) -> tuple[int, int] | None:
    """One prompt's verdicts (sample s right or not) -> (chosen, rejected) sample indices: the lowest right one and
    the lowest wrong one; None when all are right or all wrong."""
    right = [s for s, correct in enumerate(verdicts) if correct]
    wrong = [s for s, correct in enumerate(verdicts) if not correct]
    return (right[0], wrong[0]) if right and wrong else None


def prompt_messages(row: dict) -> list[dict]:
    """The turns the answers continue, as {role, content} only: TRL's schema, and one struct type in parquet (a
    turn's other keys, such as reasoning_content, would be null columns in every other turn)."""
    return [{"role": turn["role"], "content": turn["content"]} for turn in split_conversation(row["messages"])[0]]


def build_pairs(rows: Sequence[dict], records: Sequence[dict], n_samples: int) -> tuple[list[dict], dict[str, int]]:
    """rows (RowDataset rows) and evaluate_math's records for them (n_samples per row, row by row, sample by
    sample) -> (one pair per row with mixed verdicts, counts of prompts / pairs / all right / all wrong)."""
    if len(records) != len(rows) * n_samples:
        raise ValueError(f"{len(records)} records for {len(rows)} rows x {n_samples} samples")
    pairs, counts = [], {"prompts": len(rows), "pairs": 0, "all right": 0, "all wrong": 0}
    for i, row in enumerate(rows):
        samples = records[i * n_samples:(i + 1) * n_samples]
        picked = pick_pair([r["correct"] for r in samples])
        if picked is None:
            counts["all right" if samples[0]["correct"] else "all wrong"] += 1
            continue
        chosen, rejected = picked
        pairs.append({"prompt": prompt_messages(row),
                      "chosen": [{"role": "assistant", "content": samples[chosen]["completion"]}],
                      "rejected": [{"role": "assistant", "content": samples[rejected]["completion"]}],
                      "ground_truth": samples[0]["ground_truth"], "chosen_sample": chosen,
                      "rejected_sample": rejected, "row_index": samples[0]["index"]})
    counts["pairs"] = len(pairs)
    return pairs, counts


def format_counts(counts: dict[str, int], summary: dict) -> str:
    return (" | ".join(f"{name} {value}" for name, value in counts.items())
            + f" | sample accuracy {summary['accuracy']:.3f} ({summary['correct']}/{summary['samples']})"
            + f" | {summary['seconds']:.1f} s")


def write_pairs(pairs: list[dict], path: str) -> None:
    with atomic_write(path) as f:
        if path.endswith(".jsonl"):
            f.write("".join(json.dumps(pair, ensure_ascii=False) + "\n" for pair in pairs).encode("utf-8"))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.Table.from_pylist(pairs), f)


# ----------------------------------------------------------------------------------------------------------- CLI

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__)
    add_model_args(parser)
    add_prompt_args(parser, ".parquet/.jsonl with a ground truth per row (default: the demo's OPD prompts)")
    # sampling
    parser.add_argument("--n_samples", type=int, default=8, help="answers sampled per prompt (>= 2)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=0, help="seeds the per-(row, sample) sampling generators")
    parser.add_argument("--batch_size", type=int, default=32, help="sequences per generate call")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="answer budget per sample")
    parser.add_argument("--decode", default="auto", choices=DECODE_CHOICES,
                        help="the decode step (eval_math.py's --decode): auto = compiled on CUDA, eager elsewhere")
    # grading and output
    parser.add_argument("--grade_timeout", type=float, default=5.0, help="seconds per graded sample")
    parser.add_argument("--out", required=True, help="the pairs: .parquet or .jsonl (the extension picks the format)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    validate_args(args)
    return args


def validate_args(args: argparse.Namespace) -> None:
    if args.n_samples < 2:
        refuse(f"--n_samples must be >= 2 (a pair needs a right and a wrong answer), got {args.n_samples}")
    validate_sampling_args(args)
    if not args.out.endswith((".parquet", ".jsonl")):
        refuse(f"--out {args.out}: the extension must be .parquet or .jsonl (it picks the format)")
    if os.path.isdir(args.out):
        refuse(f"--out {args.out} is a folder: give a file name")
    if args.data_path and os.path.abspath(args.data_path) == os.path.abspath(args.out):
        refuse(f"--out {args.out} is --data_path: the pairs would overwrite the prompts")
    if args.decode == "auto":
        args.decode = default_decode(torch.device(args.device).type)
    validate_model_args(args)


def load_rows(data_path: str, max_rows: int) -> list[dict]:
    dataset = RowDataset(data_path)  # a missing or damaged file: a DataError naming it
    rows = [dataset[i] for i in range(len(dataset) if max_rows == 0 else min(max_rows, len(dataset)))]
    try:
        check_ground_truth(rows)
    except ValueError as e:
        raise UserError(f"--data_path {data_path}: {e}") from None
    return rows


def main(argv: list[str] | None = None) -> dict[str, int]:
    args = parse_args(argv)
    check_writable(os.path.dirname(os.path.abspath(args.out)), "--out's folder")  # not after an hour of sampling
    data_path = args.data_path or ensure_demo_data()["opd_prompts"]
    rows = load_rows(data_path, args.max_rows)  # before the model loads: a bad file fails in a second
    torch.manual_seed(args.seed)
    model, tokenizer = load_for_inference(args.model_path, args.device, args.dtype)
    summary, records = evaluate_math(model, tokenizer, rows, batch_size=args.batch_size,
                                     max_new_tokens=args.max_new_tokens, max_prompt_length=args.max_prompt_length,
                                     enable_thinking=bool(args.enable_thinking), n_samples=args.n_samples,
                                     temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                     grade_timeout=args.grade_timeout, progress=not args.no_progress,
                                     decoder=Decoder(compiled=args.decode == "compiled"))
    pairs, counts = build_pairs(rows, records, args.n_samples)
    write_pairs(pairs, args.out)
    print(format_counts(counts, summary))
    print(f"wrote {len(pairs)} pairs to {args.out}")
    return counts


if __name__ == "__main__":
    run_script(main)
