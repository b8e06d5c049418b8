"""Data pipeline throughput on a DAPO-Math-17K-shaped file (target: >= 2,000 rows/s for loading and collating).

    python benchmarks/bench_data.py
    python benchmarks/bench_data.py --rows 17000 --batch_size 64

Builds a parquet of synthetic DAPO rows in a temporary folder (prompt stored as a list of structs, reward_model and
extra_info as structs, prompt text about as long as DAPO's), loads it with RowDataset, then collates every row with
SFTCollator (each row given a synthetic assistant solution, as a teacher would write) and with PromptCollator.
"load + SFT collate" is the headline number (target >= 2,000 rows/s): both phases, end to end.
"tokenizer alone" is the floor: encode_batch on the two texts per row the SFT collator encodes, nothing else.
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

from dataset.collators import PromptCollator, SFTCollator  # noqa: E402
from dataset.sources import RowDataset  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402

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


def rate(n: int, seconds: float, cpu_seconds: float) -> str:
    # CPU seconds too: on a shared machine wall time measures the neighbours as much as this code.
    return f"{n / seconds:7.0f} rows/s  ({n} rows in {seconds:.2f} s wall, {cpu_seconds:.2f} s CPU)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=17000, help="rows in the synthetic DAPO file")
    parser.add_argument("--batch_size", type=int, default=64, help="rows per collator call")
    parser.add_argument("--max_length", type=int, default=2048)
    parser.add_argument("--max_prompt_length", type=int, default=1024)
    parser.add_argument("--num_workers", type=int, default=2, help="DataLoader workers (the --num_workers flag)")
    args = parser.parse_args()

    tokenizer = load_tokenizer(None)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "dapo.parquet")
        pq.write_table(pa.Table.from_pylist(dapo_rows(args.rows)), path)
        start, cpu_start = time.perf_counter(), time.process_time()
        dataset = RowDataset(path)
        load_seconds, load_cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        print(f"load (RowDataset)      {rate(len(dataset), load_seconds, load_cpu_seconds)}")

    rows = [dataset[i] for i in range(len(dataset))]
    batches = [rows[i:i + args.batch_size] for i in range(0, len(rows), args.batch_size)]
    sft_batches = [[with_solution(r) for r in batch] for batch in batches]
    sft = SFTCollator(tokenizer, args.max_length, args.max_prompt_length, enable_thinking=True)
    prompt = PromptCollator(tokenizer, args.max_prompt_length, enable_thinking=True)
    # The floor: the tokenizer alone on the text the SFT collator encodes (the full conversation, once per row).
    texts = [sft.render(row["messages"])[1] for batch in sft_batches for row in batch]
    start, cpu_start = time.perf_counter(), time.process_time()
    tokens = sum(len(ids) for i in range(0, len(texts), args.batch_size)
                 for ids in tokenizer.encode_batch(texts[i:i + args.batch_size]))
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    print(f"tokenizer alone (SFT)  {rate(len(rows), seconds, cpu_seconds)}  {tokens / seconds:9.0f} tokens/s")
    for name, collate, data in (("SFTCollator", sft, sft_batches), ("PromptCollator", prompt, batches)):
        start, cpu_start = time.perf_counter(), time.process_time()
        tokens = sum(int(collate(batch)[("attention_mask" if name == "SFTCollator" else "prompt_attention_mask")]
                         .sum()) for batch in data)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        print(f"collate {name:14s} {rate(len(rows), seconds, cpu_seconds)}  {tokens / seconds:9.0f} tokens/s")
        if name == "SFTCollator":
            sft_seconds, sft_cpu_seconds = seconds, cpu_seconds
    # The headline number: the file loaded and every row collated for SFT, end to end (target >= 2,000 rows/s).
    print(f"load + SFT collate     {rate(len(rows), load_seconds + sft_seconds, load_cpu_seconds + sft_cpu_seconds)}")
    # The training path: the DataLoader collates in --num_workers processes while the model trains.
    sft_rows = [row for batch in sft_batches for row in batch]
    loader = DataLoader(sft_rows, batch_size=args.batch_size, collate_fn=sft, num_workers=args.num_workers)
    start = time.perf_counter()
    count = sum(len(batch["input_ids"]) for batch in loader)
    print(f"DataLoader SFT, {args.num_workers} workers {count / (time.perf_counter() - start):7.0f} rows/s")


if __name__ == "__main__":
    main()
