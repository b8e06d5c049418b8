"""Built-in demo data: two-digit addition in DAPO-Math-17K's schema, with a worked solution a tiny model can learn.

    python dataset/make_demo_data.py                 # writes dataset/demo/*.parquet if missing or out of date
    python dataset/make_demo_data.py --force         # rewrite them
    python dataset/make_demo_data.py --out_dir /tmp/demo

Every row has DAPO's columns:
    data_source  "demo_arithmetic"
    prompt       [{"role": "user", "content": "What is 47 + 38? Put the final answer in \\boxed{}."}]
                 (sft_train adds {"role": "assistant", "content": "7+8=15, 4+3+1=8. \\boxed{85}"})
    ability      "math"
    reward_model {"style": "rule", "ground_truth": "85"}
    extra_info   {"index": i, "split": "sft_train" | "opd_prompts" | "eval" | "val"}

The solution is column addition, ones first: the ones digits and their sum, the tens digits plus the carry, the boxed
sum. Every step is one fact of the single-digit table, so a problem never seen in training is solved from facts seen
thousands of times; the compact form (no spaces) keeps it at 29-32 tokens with the template's
`<think>\n\n</think>\n\n` and `<|im_end|>\n`, because the 151,936-row head costs most of a tiny model's time per
labelled token.

Files (disjoint problems: a problem is an unordered operand pair {a, b}, so no split holds a + b and another b + a):
    sft_train.parquet    3,000 rows with the worked solution
    opd_prompts.parquet    512 prompt-only rows, for on-policy distillation and RL
    eval.parquet           200 prompt-only held-out rows
    val.parquet            200 prompt-only rows for choosing learning rates (benchmarks/demo.py --sweep), so that
                           the eval problems choose nothing
The pool (a, b in 10..99) is shuffled with a fixed seed, so the files are the same on every machine. A file written
by an earlier version of this script (its schema metadata carries VERSION) is rewritten on first use.
"""
from __future__ import annotations

import os
import random
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from common.errors import ArgumentParser, run_script  # noqa: E402
from common.files import atomic_write, check_writable  # noqa: E402

DEFAULT_OUT_DIR = os.path.join(ROOT, "dataset", "demo")
SEED = 1234
VERSION = "2"  # 1: addition and subtraction with "First a + tens = x, then ..."; 2: column addition, pair-disjoint
# taken from the shuffled pool in this order; the pool holds 4,095 unordered pairs
SPLIT_SIZES = {"eval": 200, "opd_prompts": 512, "sft_train": 3000, "val": 200}
QUESTION = "What is {a} + {b}? Put the final answer in \\boxed{{}}."


def problem_pool() -> list[tuple[int, int]]:
    """Every unordered operand pair (a <= b) the demo can ask, in a fixed order."""
    return [(a, b) for a in range(10, 100) for b in range(a, 100)]


def solve(a: int, b: int) -> tuple[int, str]:
    """-> (a + b, worked solution): the ones column, the tens column with its carry, the boxed sum."""
    ones = a % 10 + b % 10
    carry = "+1" if ones >= 10 else ""
    tens = a // 10 + b // 10 + ones // 10
    return a + b, f"{a % 10}+{b % 10}={ones}, {a // 10}+{b // 10}{carry}={tens}. \\boxed{{{a + b}}}"


def make_row(index: int, split: str, a: int, b: int, with_solution: bool) -> dict:
    answer, solution = solve(a, b)
    prompt = [{"role": "user", "content": QUESTION.format(a=a, b=b)}]
    if with_solution:
        prompt.append({"role": "assistant", "content": solution})
    return {
        "data_source": "demo_arithmetic",
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"index": index, "split": split},
    }


def build_splits(seed: int = SEED) -> dict[str, list[dict]]:
    """The three splits as lists of rows; disjoint because each takes its own slice of one shuffled pool (each pair
    asked in a random order of its operands)."""
    rng = random.Random(seed)
    pool = problem_pool()
    rng.shuffle(pool)
    splits, start = {}, 0
    for split, size in SPLIT_SIZES.items():
        pairs = pool[start:start + size]
        start += size
        splits[split] = [make_row(i, split, *((a, b) if rng.random() < 0.5 else (b, a)), split == "sft_train")
                         for i, (a, b) in enumerate(pairs)]
    return splits


def up_to_date(path: str) -> bool:
    """Whether the file exists and was written by this version of the script."""
    if not os.path.isfile(path):
        return False
    metadata = pq.read_schema(path).metadata or {}
    return metadata.get(b"demo_version") == VERSION.encode()


def ensure_demo_data(out_dir: str = DEFAULT_OUT_DIR, force: bool = False) -> dict[str, str]:
    """Write the demo parquet files if any is missing or out of date (or if force); -> {split: path}."""
    paths = {split: os.path.join(out_dir, f"{split}.parquet") for split in SPLIT_SIZES}
    if force or not all(up_to_date(p) for p in paths.values()):
        stale = any(os.path.isfile(p) for p in paths.values())
        why = "--force" if force else "written by an earlier version" if stale else "first use"
        # stdout, like the loops' log lines: stderr is for the one-line errors
        print(f"writing the demo data to {out_dir} ({why})", flush=True)
        check_writable(out_dir, "the demo data folder")
        for split, rows in build_splits().items():
            # Atomic: a crash never leaves a half-written file, and ranks racing here write identical bytes.
            with atomic_write(paths[split]) as f:
                table = pa.Table.from_pylist(rows)
                pq.write_table(table.replace_schema_metadata({"demo_version": VERSION}), f)
    return paths


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR, help="folder for the three parquet files")
    parser.add_argument("--force", action="store_true", help="rewrite the files even if they exist")
    args = parser.parse_args()
    for split, path in ensure_demo_data(args.out_dir, force=args.force).items():
        print(f"{split:12s} {pq.read_metadata(path).num_rows:6d} rows  {path}")


if __name__ == "__main__":
    run_script(main)
