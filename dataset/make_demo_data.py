"""Built-in demo data: two-digit addition and subtraction in DAPO-Math-17K's schema, small enough for a tiny model.

    python dataset/make_demo_data.py                 # writes dataset/demo/*.parquet if missing
    python dataset/make_demo_data.py --force         # rewrite them
    python dataset/make_demo_data.py --out_dir /tmp/demo

Every row has DAPO's columns:
    data_source  "demo_arithmetic"
    prompt       [{"role": "user", "content": "What is 47 + 38? Put the final answer in \\boxed{}."}]
                 (sft_train adds {"role": "assistant", "content": "First 47 + 30 = 77, then 77 + 8 = 85. \\boxed{85}"})
    ability      "math"
    reward_model {"style": "rule", "ground_truth": "85"}
    extra_info   {"index": i, "split": "sft_train" | "opd_prompts" | "eval"}

Files (disjoint problems; a problem is the triple (a, op, b)):
    sft_train.parquet    1,600 rows with a worked solution (33-41 tokens including the template's
                         `<think>\n\n</think>\n\n` and `<|im_end|>\n`)
    opd_prompts.parquet    512 prompt-only rows, for on-policy distillation
    eval.parquet           200 prompt-only held-out rows
The problem pool (a, b in 10..99; a >= b for subtraction, so answers are never negative) is shuffled with a fixed
seed, so the files are the same on every machine. Solutions are short on purpose: OPD samples them on CPU.
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
# taken from the shuffled pool in this order; sized so that each demo loop runs in a few minutes on 2 CPU cores
SPLIT_SIZES = {"eval": 200, "opd_prompts": 512, "sft_train": 1600}
QUESTION_TEMPLATES = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}.")
INSTRUCTION = " Put the final answer in \\boxed{}."


def problem_pool() -> list[tuple[int, str, int]]:
    """Every (a, op, b) the demo can ask, in a fixed order."""
    additions = [(a, "+", b) for a in range(10, 100) for b in range(10, 100)]
    subtractions = [(a, "-", b) for a in range(10, 100) for b in range(10, a + 1)]
    return additions + subtractions


def solve(a: int, op: str, b: int) -> tuple[int, str]:
    """-> (answer, worked solution): tens first, then ones, then the boxed answer."""
    tens, ones = b - b % 10, b % 10
    step = a + tens if op == "+" else a - tens
    answer = a + b if op == "+" else a - b
    return answer, f"First {a} {op} {tens} = {step}, then {step} {op} {ones} = {answer}. \\boxed{{{answer}}}"


def make_row(index: int, split: str, problem: tuple[int, str, int], template: str, with_solution: bool) -> dict:
    a, op, b = problem
    answer, solution = solve(a, op, b)
    prompt = [{"role": "user", "content": template.format(a=a, op=op, b=b) + INSTRUCTION}]
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
    """The three splits as lists of rows; disjoint because each takes its own slice of one shuffled pool."""
    rng = random.Random(seed)
    pool = problem_pool()
    rng.shuffle(pool)
    splits, start = {}, 0
    for split, size in SPLIT_SIZES.items():
        problems = pool[start:start + size]
        start += size
        splits[split] = [make_row(i, split, p, rng.choice(QUESTION_TEMPLATES), split == "sft_train")
                         for i, p in enumerate(problems)]
    return splits


def ensure_demo_data(out_dir: str = DEFAULT_OUT_DIR, force: bool = False) -> dict[str, str]:
    """Write the demo parquet files if any is missing (or if force); -> {"sft_train"|"opd_prompts"|"eval": path}."""
    paths = {split: os.path.join(out_dir, f"{split}.parquet") for split in SPLIT_SIZES}
    if force or not all(os.path.isfile(p) for p in paths.values()):
        # stdout, like the loops' log lines: stderr is for the one-line errors
        print(f"writing the demo data to {out_dir} ({'--force' if force else 'first use'})", flush=True)
        check_writable(out_dir, "the demo data folder")
        for split, rows in build_splits().items():
            # Atomic: a crash never leaves a half-written file, and ranks racing here write identical bytes.
            with atomic_write(paths[split]) as f:
                pq.write_table(pa.Table.from_pylist(rows), f)
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
