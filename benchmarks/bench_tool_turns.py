"""What re-prefilling costs a multi-turn rollout: each turn of the built-in engine is one `generate` over the
conversation so far (the KV cache is not kept from turn to turn, docs/tools.md), so a turn pays a prefill of every
token before it. Measured on the products task's rows with the calculator (dataset/make_demo_data.py --task products):

    python benchmarks/bench_tool_turns.py              # qwen3-tiny.json, the products demo's student; 16 rows
    python benchmarks/bench_tool_turns.py --config model/configs/qwen3-demo.json --threads 1

For the first turn's context (the prompt with the calculator's schema) and the second's (that prompt, a call and its
result: a training row's conversation up to its answer) and each turn length N: the seconds of a turn (`generate`:
the prefill and N decode steps, every row decoding all N, no EOS) and of its prefill alone (`generate` with one new
token), medians of paired calls. The prefill's share of the turn bounds what a cache kept across turns could save:
such a cache would still prefill the new results, 20-odd tokens of the second context's ~260.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.harness import CONFIGS, add_json_arg, machine, median_ms, set_threads, table, write_json  # noqa: E402
from common.errors import ArgumentParser, run_script  # noqa: E402
from dataset.make_demo_data import ensure_demo_data  # noqa: E402
from dataset.sources import RowDataset  # noqa: E402
from dataset.tool_conversation import conversation_ids  # noqa: E402
from model import Qwen3Config, create_model, generate, load_tokenizer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=os.path.join(CONFIGS, "qwen3-tiny.json"), help="the student's shape")
    parser.add_argument("--batch", type=int, default=16, help="rows per turn (the demo's 16 rollouts a step)")
    parser.add_argument("--turn_tokens", default="24,48", help="comma-separated turn lengths N")
    parser.add_argument("--repeats", type=int, default=5, help="paired calls per measurement (the median)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    add_json_arg(parser)
    return parser.parse_args(argv)


def contexts(tokenizer, batch: int) -> dict[str, list[list[int]]]:
    """The first turn's context (a prompt with the calculator's schema) and the second's (the prompt, the call and
    its result), of the first `batch` training rows with the calculator."""
    rows = [row for row in RowDataset(ensure_demo_data(task="products")["sft_train"]) if row.get("tools")][:batch]
    first, second = [], []
    for row in rows:
        ids, mask = conversation_ids(tokenizer, row["messages"], row["tools"], enable_thinking=False)
        answer = max(k for k in range(len(mask)) if mask[k] and not mask[k - 1])  # the last turn's first token
        first.append(ids[:mask.index(1)])
        second.append(ids[:answer])
    return {"first turn": first, "second turn": second}


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id rows as generate takes them: left padded, with their attention mask."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    return ids, torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    set_threads(args.threads)
    tokenizer = load_tokenizer(None)
    model = create_model(Qwen3Config.from_json(args.config), seed=0).eval()
    results, table_rows = [], []
    for name, rows in contexts(tokenizer, args.batch).items():
        ids, mask = left_padded(rows, tokenizer.pad_token_id)
        for n in map(int, args.turn_tokens.split(",")):
            # no EOS: every row decodes all n tokens, the turn's whole length
            turn, prefill = median_ms([lambda: generate(model, ids, mask, n, do_sample=False),
                                       lambda: generate(model, ids, mask, 1, do_sample=False)],
                                      repeats=args.repeats)
            results.append({"context": name, "context_tokens": ids.shape[1], "turn_tokens": n, "turn_ms": turn,
                            "prefill_ms": prefill, "prefill_share": prefill / turn})
            table_rows.append([name, ids.shape[1], n, f"{turn:.0f}", f"{prefill:.0f}", f"{prefill / turn:.0%}"])
    print(machine())
    print(f"{os.path.basename(args.config)}, {args.batch} rows, greedy, torch threads {torch.get_num_threads()}")
    print(table(["context", "tokens (widest row)", "turn tokens N", "turn ms", "prefill ms", "prefill share"],
                table_rows))
    write_json(args.json, {"results": results})
    return {"results": results}


if __name__ == "__main__":
    run_script(main)
