"""Data pipeline throughput on a DAPO-Math-17K-shaped file (target: >= 2,000 rows/s for loading and collating).

    python benchmarks/bench_data.py
    python benchmarks/bench_data.py --rows 17000 --batch_size 64
    python benchmarks/bench_data.py --rows 500 --num_workers 0 --json data.json   # a quick look

Builds a parquet of synthetic DAPO rows in a temporary folder (prompt stored as a list of structs, reward_model and
extra_info as structs, prompt text about as long as DAPO's), loads it with RowDataset, then collates every row with
SFTCollator (each row given a synthetic assistant solution, as a teacher would write) and with PromptCollator.
"load + SFT collate" is the headline number (target >= 2,000 rows/s): both phases, end to end.
"tokenizer alone" is the floor: encode_batch on the text the SFT collator encodes, nothing else. CPU seconds are
shown beside wall seconds: on a shared machine wall time measures the neighbours as much as this code.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from benchmarks import harness  # noqa: E402
from common.errors import ArgumentParser, run_script  # noqa: E402
from dataset.collators import PromptCollator, SFTCollator  # noqa: E402
from dataset.sources import RowDataset  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402

TARGET_ROWS_PER_S = 2000  # load + SFT collation
# DAPO-Math-17K wraps every problem in this instruction.
DAPO_HEAD = ("Solve the following math problem step by step. The last line of your response should be of the form "
             "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'
WORDS = ("let", "the", "triangle", "integer", "sum", "of", "$x^2 + y^2$", "find", "prime", "with", "area", "circle",
         "radius", "$\\frac{m}{n}$", "where", "positive", "such", "that", "is", "divisible", "by", "$7$", "and")


def dapo_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        problem = " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 90)))
        rows.append({"data_source": "math_dapo",
                     "prompt": [{"content": DAPO_HEAD + problem + DAPO_TAIL, "role": "user"}],
                     "ability": "MATH",
                     "reward_model": {"ground_truth": str(rng.randint(1, 999)), "style": "rule-lighteval/MATH_v2"},
                     "extra_info": {"index": f"{i:08x}-synthetic"}})
    return rows


def with_solution(row: dict) -> dict:
    solution = ("We compute step by step. " * 12) + f"Answer: {row['ground_truth']}"
    return {**row, "messages": row["messages"] + [{"role": "assistant", "content": solution}]}


class Timed:
    """`with Timed() as t:` -> t.seconds (wall) and t.cpu_seconds (this process) of the block."""

    def __enter__(self):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        self.cpu_seconds = time.process_time() - self.cpu_start


def phase(name: str, rows: int, seconds: float, cpu_seconds: float, tokens: int | None = None) -> dict:
    return {"phase": name, "rows": rows, "seconds": seconds, "cpu_seconds": cpu_seconds,
            "rows_per_s": rows / seconds, "tokens_per_s": tokens / seconds if tokens is not None else None}


def measure(args: argparse.Namespace) -> list[dict]:
    tokenizer = load_tokenizer(None)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dapo.parquet")
        pq.write_table(pa.Table.from_pylist(dapo_rows(args.rows)), path)
        with Timed() as load:
            dataset = RowDataset(path)
    phases = [phase("load (RowDataset)", len(dataset), load.seconds, load.cpu_seconds)]
    rows = [dataset[i] for i in range(len(dataset))]
    batches = [rows[i:i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
    sft_batches = [[with_solution(r) for r in batch] for batch in batches]
    sft = SFTCollator(tokenizer, args.max_length, args.max_prompt_length, enable_thinking=True)
    prompt = PromptCollator(tokenizer, args.max_prompt_length, enable_thinking=True)
    # The floor: the tokenizer alone on the text the SFT collator encodes (the full conversation, once per row).
    texts = [sft.render(row["messages"])[1] for batch in sft_batches for row in batch]
    with Timed() as floor:
        tokens = sum(len(ids) for i in range(0, len(texts), args.batch_size)
                     for ids in tokenizer.encode_batch(texts[i:i + args.batch_size]))
    phases.append(phase("tokenizer alone (SFT)", len(rows), floor.seconds, floor.cpu_seconds, tokens))
    for name, collate, data, mask in (("collate SFTCollator", sft, sft_batches, "attention_mask"),
                                      ("collate PromptCollator", prompt, batches, "prompt_attention_mask")):
        with Timed() as collating:
            tokens = sum(int(collate(batch)[mask].sum()) for batch in data)
        phases.append(phase(name, len(rows), collating.seconds, collating.cpu_seconds, tokens))
    # The headline number: the file loaded and every row collated for SFT, end to end (target >= 2,000 rows/s).
    sft_phase = phases[2]
    phases.append(phase("load + SFT collate", len(rows), load.seconds + sft_phase["seconds"],
                        load.cpu_seconds + sft_phase["cpu_seconds"]))
    # The training path: the DataLoader collates in --num_workers processes while the model trains.
    loader = DataLoader([row for batch in sft_batches for row in batch], batch_size=args.batch_size, collate_fn=sft,
                        num_workers=args.num_workers)
    with Timed() as loading:
        count = sum(len(batch["input_ids"]) for batch in loader)
    phases.append(phase(f"DataLoader SFT, {args.num_workers} workers", count, loading.seconds, loading.cpu_seconds))
    return phases


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=17000, help="rows in the synthetic DAPO file")
    parser.add_argument("--batch_size", type=int, default=64, help="rows per collator call")
    parser.add_argument("--max_length", type=int, default=2048)
    parser.add_argument("--max_prompt_length", type=int, default=1024)
    parser.add_argument("--num_workers", type=int, default=2, help="DataLoader workers (the --num_workers flag)")
    harness.add_json_arg(parser)
    args = parser.parse_args(argv)
    print(harness.machine(), flush=True)
    phases = measure(args)
    print(harness.table(["phase", "rows/s", "tokens/s", "rows", "wall s", "CPU s"], [
        [p["phase"], f"{p['rows_per_s']:.0f}", "-" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:.0f}",
         p["rows"], f"{p['seconds']:.2f}", f"{p['cpu_seconds']:.2f}"] for p in phases]))
    results = {"phases": phases, "target_rows_per_s": TARGET_ROWS_PER_S}
    harness.write_json(args.json, results)
    return results


if __name__ == "__main__":
    run_script(main)
