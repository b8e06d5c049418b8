"""Built-in demo data in DAPO-Math-17K's schema: three arithmetic tasks, one of them solved with a calculator tool.

Two have worked solutions a tiny model can learn (addition, running_sum); the third (products) it can do with the
calculator and mostly not by hand.

    python dataset/make_demo_data.py                 # writes dataset/demo/*.parquet if missing or out of date
    python dataset/make_demo_data.py --task running_sum   # the long-answer task: dataset/demo/running_sum/
    python dataset/make_demo_data.py --task products      # the tool task: dataset/demo/products/
    python dataset/make_demo_data.py --force         # rewrite them
    python dataset/make_demo_data.py --out_dir /tmp/demo

Every row has DAPO's columns:
    data_source  "demo_arithmetic" (addition), "demo_running_sum" or "demo_products"
    prompt       [{"role": "user", "content": "What is 47 + 38? Put the final answer in \\boxed{}."}] (addition)
                 (sft_train adds {"role": "assistant", "content": "7+8=15, 4+3+1=8. \\boxed{85}"})
    ability      "math"
    reward_model {"style": "rule", "ground_truth": "85"}
    extra_info   {"index": i, "split": "sft_train" | "opd_prompts" | "eval" | "val"}
and the products task's rows also `tools`: the calculator's schema list as JSON text, or null.

addition (the default, every loop's data without --data_path): two-digit addition as column addition, ones first:
the ones digits and their sum, the tens digits plus the carry, the boxed sum. Every step is one fact of the
single-digit table, so a problem never seen in training is solved from facts seen thousands of times; the compact
form (no spaces) keeps it at 29-32 tokens with the template's `<think>\n\n</think>\n\n` and `<|im_end|>\n`,
because the 151,936-row head costs most of a tiny model's time per labelled token. A problem is an unordered operand
pair {a, b}: no split holds a + b and another b + a. The pool (a, b in 10..99, 4,095 pairs) is shuffled with a
fixed seed.

running_sum (benchmarks/demo.py --task running_sum): a two-digit number and 4 to 6 digits 1..9, each named, added
left to right with every running total written: "Let a=47, b=3, c=8, d=5. What is a+b+c+d? ..." -> "a+b=47+3=50,
50+c=50+8=58, 58+d=58+5=63. \\boxed{63}", 57 to 101 answer tokens (median 70). Each step names its number and writes
its value, so the value is found by name (counting positions in the question is what a small model fails at,
measured: docs/data.md), then adds it to the previous step's total, so one wrong total makes every later one and the
box wrong: the regime of long generations where a student's early mistake decides the rest. A problem is its first
number and the multiset of its digits: no split holds a reordering of another's.

products (docs/data.md, "The tool task"; not in benchmarks/demo.py yet, it waits for multi-turn rollouts): a
three-digit number times a two-digit one, "What is 123 * 45? ...", which a tiny model mostly cannot multiply unaided
and can with the calculator (tools/calculator.py). One data set trains both arms, with tools and without: each
training problem twice, first with the calculator -- the `tools` column [CALCULATOR.schema()], a turn calling it on
"123 * 45", its answer "5535" as the tool message, "123 * 45 = 5535. \\boxed{5535}" -- then by hand, multiplied by
the two digits of b and added: "123*5=615, 123*40=4920, 615+4920=5535. \\boxed{5535}" (`by_hand`). Both ways for
every problem, not half and half: the two rows differ only in the tools column and the solution, so the tools column
alone says whether to call, and each arm has all 3,000 problems. The tool messages are the calculator's function
called here (run_tool_call's answer without its fork per call; tests/test_products_data.py checks they agree). A
problem is the ordered pair (a, b) of 81,000, drawn without replacement.

Files per task (disjoint problems), the same on every machine:
    sft_train.parquet    3,000 rows with the worked solution (products: 6,000, each problem with the calculator,
                         then by hand)
    opd_prompts.parquet    512 prompt-only rows, for on-policy distillation and RL
    eval.parquet           200 prompt-only held-out rows
    val.parquet            200 prompt-only rows for choosing learning rates (benchmarks/demo.py --sweep), so that
                           the eval problems choose nothing
    products also SPLIT_tools.parquet for each of the three prompt files: the same problems with the calculator's
    schema in the `tools` column (`file_names`)
A file written by an earlier version of this script (its schema metadata carries the task's version) is rewritten
on first use.

The same problems as raw text, continued pretraining's demo corpus (trainer/train_pretrain.py; `ensure_demo_corpus`),
one document a problem -- its question, a newline, its worked solution -- in a `text` column:
    corpus_train.parquet   sft_train's 3,000 problems
    corpus_val.parquet     val's 200 problems: the held-out text of the perplexity evaluation
"""
from __future__ import annotations

import json
import os
import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from common.errors import ArgumentParser, run_script  # noqa: E402
from common.files import atomic_write, check_writable  # noqa: E402
# the products task's tool: its own schema and answers, never a copy (the one import of tools/ in dataset/,
# tests/test_layering.py's MODULES_ABOVE_THEIR_LAYER)
from tools.calculator import CALCULATOR  # noqa: E402

DEFAULT_OUT_DIR = os.path.join(ROOT, "dataset", "demo")
SEED = 1234
# taken from each task's shuffled problems in this order
SPLIT_SIZES = {"eval": 200, "opd_prompts": 512, "sft_train": 3000, "val": 200}
QUESTION = "What is {}? Put the final answer in \\boxed{{}}."
SUM = re.compile(r"What is (\d+(?: \+ \d+)+)\?")


LABELS = "abcdefgh"  # a running sum's numbers are named, so that a step finds its number by name (see below)
LABELLED = re.compile(r"Let ((?:[a-h]=\d+, )*[a-h]=\d+)\. What is")


def question(numbers: tuple[int, ...]) -> str:
    """Two numbers: "What is 47 + 38? ..."; more: named, "Let a=47, b=3, c=8. What is a+b+c? ..."."""
    if len(numbers) == 2:
        return QUESTION.format(" + ".join(map(str, numbers)))
    names = LABELS[:len(numbers)]
    values = ", ".join(f"{name}={number}" for name, number in zip(names, numbers))
    return f"Let {values}. " + QUESTION.format("+".join(names))


def numbers_of(text: str) -> tuple[int, ...] | None:
    """The numbers of the demo sum in `text` (either sum task's form, in order), or None if it holds none (a products
    question is not a sum)."""
    named = LABELLED.search(text)
    if named:
        return tuple(int(pair.split("=")[1]) for pair in named.group(1).split(", "))
    terms = SUM.search(text)
    return tuple(map(int, terms.group(1).split(" + "))) if terms else None


def solve(*numbers: int) -> tuple[int, str]:
    """-> (the sum, worked solution): two numbers by columns (the ones, the tens with the carry), more as a running
    sum, each step naming its number, writing its value and the new total ("a+b=47+3=50, 50+c=50+8=58")."""
    if len(numbers) == 2:
        a, b = numbers
        ones = a % 10 + b % 10
        carry = "+1" if ones >= 10 else ""
        tens = a // 10 + b // 10 + ones // 10
        return a + b, f"{a % 10}+{b % 10}={ones}, {a // 10}+{b // 10}{carry}={tens}. \\boxed{{{a + b}}}"
    total = numbers[0] + numbers[1]
    steps = [f"a+b={numbers[0]}+{numbers[1]}={total}"]
    for name, number in zip(LABELS[2:], numbers[2:]):
        steps.append(f"{total}+{name}={total}+{number}={total + number}")
        total += number
    return total, ", ".join(steps) + f". \\boxed{{{total}}}"


def product_question(numbers: tuple[int, ...]) -> str:
    """The products question, "What is 123 * 45? Put the final answer in \\boxed{}.", its expression written as the
    calculator takes it."""
    return QUESTION.format(" * ".join(map(str, numbers)))


def by_hand(a: int, b: int) -> tuple[int, str]:
    """-> (a * b, long multiplication by the two digits of b): "123*5=615, 123*40=4920, 615+4920=5535.
    \\boxed{5535}", the product by b's ones digit, by its tens digit times ten, and their sum."""
    ones, tens = b % 10, b - b % 10
    return a * b, f"{a}*{ones}={a * ones}, {a}*{tens}={a * tens}, {a * ones}+{a * tens}={a * b}. \\boxed{{{a * b}}}"


CALCULATOR_TOOLS = json.dumps([CALCULATOR.schema()])  # a row's `tools` column: JSON text, parquet's safe spelling


def calculator_turns(a: int, b: int) -> list[dict]:
    """The worked solution with the calculator: a turn that calls it on "a * b", its answer as the tool message, and
    a turn that writes the product and boxes it."""
    expression = f"{a} * {b}"
    call = {"type": "function", "function": {"name": CALCULATOR.name, "arguments": {"expression": expression}}}
    # the function run_tool_call runs in a forked child, called directly: a fork per row would take a minute and
    # more; tests/test_products_data.py checks, on a sample, that run_tool_call answers the rendered call with it
    result = CALCULATOR.function({"expression": expression})
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": f"{expression} = {result}. \\boxed{{{result}}}"}]


def addition_problems(rng: random.Random) -> list[tuple[int, ...]]:
    """Every unordered operand pair (a <= b, a and b in 10..99) once, shuffled, each in a random operand order."""
    pool = [(a, b) for a in range(10, 100) for b in range(a, 100)]
    rng.shuffle(pool)
    return [(a, b) if rng.random() < 0.5 else (b, a) for a, b in pool[:sum(SPLIT_SIZES.values())]]


def running_sum_problems(rng: random.Random) -> list[tuple[int, ...]]:
    """A two-digit number (10..99) and 4 to 6 digits 1..9, drawn until as many distinct problems (the first number
    and the multiset of the digits) as the splits take."""
    problems, seen = [], set()
    while len(problems) < sum(SPLIT_SIZES.values()):
        numbers = (rng.randint(10, 99),) + tuple(rng.randint(1, 9) for _ in range(rng.randint(4, 6)))
        key = (numbers[0],) + tuple(sorted(numbers[1:]))
        if key not in seen:
            seen.add(key)
            problems.append(numbers)
    return problems


def product_problems(rng: random.Random) -> list[tuple[int, ...]]:
    """Distinct (a, b), a three-digit a (100..999) times a two-digit b (10..99), as many as the splits take, drawn
    without replacement from the 81,000."""
    pool = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
    return rng.sample(pool, sum(SPLIT_SIZES.values()))


@dataclass(frozen=True)
class Task:
    data_source: str
    version: str
    folder: str  # under DEFAULT_OUT_DIR
    problems: Callable[[random.Random], list[tuple[int, ...]]]  # disjoint, in the splits' order
    question: Callable[[tuple[int, ...]], str]
    solve: Callable[..., tuple[int, str]]  # a problem's numbers -> (answer, worked solution)
    tools: bool = False  # each problem also with the calculator (products: module docstring)


TASKS = {
    # 1: addition and subtraction with "First a + tens = x, then ..."; 2: column addition, pair-disjoint
    "addition": Task("demo_arithmetic", "2", "", addition_problems, question, solve),
    "running_sum": Task("demo_running_sum", "2", "running_sum", running_sum_problems, question, solve),
    "products": Task("demo_products", "1", "products", product_problems, product_question, by_hand, tools=True),
}
VERSION = TASKS["addition"].version
TOOLS_SUFFIX = "_tools"  # a prompt split's twin with the calculator: eval_tools.parquet beside eval.parquet


def make_row(index: int, split: str, numbers: tuple[int, ...], with_solution: bool, task: str = "addition",
             tools: bool = False) -> dict:
    """One row in DAPO's schema; `tools`: with the calculator (its schema in the `tools` column, and with_solution
    the calculator's turns instead of the worked solution). A task with tools gives every row the column, null
    where the row has none (one file holds both kinds)."""
    spec = TASKS[task]
    answer, solution = spec.solve(*numbers)
    prompt = [{"role": "user", "content": spec.question(numbers)}]
    if with_solution:
        prompt += calculator_turns(*numbers) if tools else [{"role": "assistant", "content": solution}]
    row = {
        "data_source": spec.data_source,
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"index": index, "split": split},
    }
    if spec.tools:
        row["tools"] = CALCULATOR_TOOLS if tools else None
    return row


def split_problems(task: str = "addition", seed: int = SEED) -> dict[str, list[tuple[int, ...]]]:
    """Each split's problems; disjoint because each takes its own slice of one list of distinct problems."""
    problems = TASKS[task].problems(random.Random(seed))
    splits, start = {}, 0
    for split, size in SPLIT_SIZES.items():
        splits[split] = problems[start:start + size]
        start += size
    return splits


def file_names(task: str = "addition") -> list[str]:
    """The task's files (without .parquet): a split each, and for a task with tools each prompt split's twin with
    the calculator (SPLIT_tools)."""
    names = list(SPLIT_SIZES)
    if TASKS[task].tools:
        names += [split + TOOLS_SUFFIX for split in SPLIT_SIZES if split != "sft_train"]
    return names


def build_splits(task: str = "addition", seed: int = SEED) -> dict[str, list[dict]]:
    """The task's files as lists of rows, by file name: each split's problems, worked in sft_train and prompt-only
    in the others. A task with tools: sft_train holds each problem twice, with the calculator and then by hand, and
    each prompt split has its twin with the calculator's schema (file_names)."""
    files = {}
    for split, problems in split_problems(task, seed).items():
        train = split == "sft_train"
        if train and TASKS[task].tools:
            files[split] = [make_row(2 * i + k, split, numbers, True, task, tools=k == 0)
                            for i, numbers in enumerate(problems) for k in (0, 1)]
            continue
        files[split] = [make_row(i, split, numbers, train, task) for i, numbers in enumerate(problems)]
        if TASKS[task].tools:
            files[split + TOOLS_SUFFIX] = [make_row(i, split, numbers, False, task, tools=True)
                                           for i, numbers in enumerate(problems)]
    return files


def up_to_date(path: str, task: str = "addition", version: str | None = None) -> bool:
    """Whether the file exists and was written by this version of the script's `task` (`version`: a file of its
    own kind, the demo pairs')."""
    if not os.path.isfile(path):
        return False
    metadata = pq.read_schema(path).metadata or {}
    return metadata.get(b"demo_version") == (version or TASKS[task].version).encode()


def slipped(*numbers: int) -> tuple[int, str]:
    """`solve`'s worked solution with one slip, the steps after it consistent with it -> (its wrong sum, the text).
    Two numbers: the carry forgotten, or without a carry the ones column one too high; more: the first total one too
    high, carried on to the end."""
    if len(numbers) == 2:
        a, b = numbers
        ones = a % 10 + b % 10
        tens = a // 10 + b // 10  # the carry forgotten, or a carry-free ones column one too high
        written, wrong = (ones, 10 * tens + ones % 10) if ones >= 10 else (ones + 1, a + b + 1)
        return wrong, f"{a % 10}+{b % 10}={written}, {a // 10}+{b // 10}={tens}. \\boxed{{{wrong}}}"
    total = numbers[0] + numbers[1] + 1
    steps = [f"a+b={numbers[0]}+{numbers[1]}={total}"]
    for name, number in zip(LABELS[2:], numbers[2:]):
        steps.append(f"{total}+{name}={total}+{number}={total + number}")
        total += number
    return total, ", ".join(steps) + f". \\boxed{{{total}}}"


# The built-in DPO data (trainer/train_dpo.py without --data_path): synthetic pairs, not a model's own samples (those
# take a trained student: dataset/make_dpo_pairs.py). Per prompt of the split: chosen = the worked solution, rejected
# = the same method with one slip (`slipped`), in TRL's conversational preference schema.
PAIR_SPLITS = {"train": "opd_prompts", "eval": "eval"}
PAIRS_VERSION = "pairs-1"


def demo_pairs(split: str, task: str = "addition") -> list[dict]:
    """The demo pairs of `split`'s problems (PAIR_SPLITS: the OPD prompts for training, the eval set held out)."""
    pairs = []
    for row in build_splits(task)[PAIR_SPLITS[split]]:
        numbers = numbers_of(row["prompt"][0]["content"])
        pairs.append({"prompt": row["prompt"], "chosen": [{"role": "assistant", "content": solve(*numbers)[1]}],
                      "rejected": [{"role": "assistant", "content": slipped(*numbers)[1]}],
                      "ground_truth": row["reward_model"]["ground_truth"], "data_source": row["data_source"]})
    return pairs


def ensure_demo_pairs(out_dir: str | None = None, task: str = "addition") -> dict[str, str]:
    """Write the demo pairs (dpo_train.parquet, dpo_eval.parquet beside the demo data) if missing or out of date;
    -> {"train": path, "eval": path}."""
    out_dir = out_dir or os.path.join(DEFAULT_OUT_DIR, TASKS[task].folder)
    paths = {split: os.path.join(out_dir, f"dpo_{split}.parquet") for split in PAIR_SPLITS}
    version = f"{TASKS[task].version}-{PAIRS_VERSION}"
    if not all(up_to_date(p, task, version) for p in paths.values()):
        print(f"writing the demo preference pairs to {out_dir}", flush=True)
        check_writable(out_dir, "the demo data folder")
        for split, path in paths.items():
            with atomic_write(path) as f:  # a crash never leaves half a file; racing ranks write the same bytes
                table = pa.Table.from_pylist(demo_pairs(split, task))
                pq.write_table(table.replace_schema_metadata({"demo_version": version}), f)
    return paths


def ensure_demo_data(out_dir: str | None = None, force: bool = False, task: str = "addition") -> dict[str, str]:
    """Write `task`'s parquet files (into `out_dir`, by default its folder under dataset/demo/) if any is missing or
    out of date (or if force); -> {file name: path} (file_names: a split's name, or its twin's with tools)."""
    out_dir = out_dir or os.path.join(DEFAULT_OUT_DIR, TASKS[task].folder)
    paths = {name: os.path.join(out_dir, f"{name}.parquet") for name in file_names(task)}
    if force or not all(up_to_date(p, task) for p in paths.values()):
        stale = any(os.path.isfile(p) for p in paths.values())
        why = "--force" if force else "written by an earlier version" if stale else "first use"
        # stdout, like the loops' log lines: stderr is for the one-line errors
        print(f"writing the demo data to {out_dir} ({why})", flush=True)
        check_writable(out_dir, "the demo data folder")
        for name, rows in build_splits(task).items():
            # Atomic: a crash never leaves a half-written file, and ranks racing here write identical bytes.
            with atomic_write(paths[name]) as f:
                table = pa.Table.from_pylist(rows)
                pq.write_table(table.replace_schema_metadata({"demo_version": TASKS[task].version}), f)
    return paths


CORPUS_SPLITS = {"corpus_train": "sft_train", "corpus_val": "val"}  # a corpus file -> the split whose problems it holds


def ensure_demo_corpus(task: str = "addition") -> dict[str, str]:
    """Write `task`'s two corpus files (module docstring) into its folder if missing or out of date; -> {name:
    path}."""
    out_dir = os.path.join(DEFAULT_OUT_DIR, TASKS[task].folder)
    paths = {name: os.path.join(out_dir, f"{name}.parquet") for name in CORPUS_SPLITS}
    if not all(up_to_date(p, task) for p in paths.values()):
        print(f"writing the demo corpus to {out_dir}", flush=True)
        check_writable(out_dir, "the demo data folder")
        problems, spec = split_problems(task), TASKS[task]
        for name, split in CORPUS_SPLITS.items():
            texts = [f"{spec.question(numbers)}\n{spec.solve(*numbers)[1]}" for numbers in problems[split]]
            with atomic_write(paths[name]) as f:
                table = pa.Table.from_pylist([{"text": text} for text in texts])
                pq.write_table(table.replace_schema_metadata({"demo_version": TASKS[task].version}), f)
    return paths


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="addition", choices=list(TASKS), help="which task's files")
    parser.add_argument("--out_dir", default=None,
                        help="folder for the parquet files (default: dataset/demo/, a task's own folder under it)")
    parser.add_argument("--force", action="store_true", help="rewrite the files even if they exist")
    args = parser.parse_args()
    paths = ensure_demo_data(args.out_dir, force=args.force, task=args.task)
    width = max(map(len, paths))
    for name, path in paths.items():
        print(f"{name:{width}s} {pq.read_metadata(path).num_rows:6d} rows  {path}")


if __name__ == "__main__":
    run_script(main)
