"""Bias and variance of a served teacher's signals: the per-token reverse KL(student || teacher) of the top-K
estimate (`trainer.losses.topk_divergence.topk_divergence`: top-K + sampled token + tail bucket) for K = 1, 4, 16, 64
and of the sampled-token estimate (log p_S(y) - log p_T(y)), against the exact full-vocabulary value on the same
samples; with --serve 1 also what a vLLM teacher server sends and how long it takes per request.

    python benchmarks/bench_topk.py                       # checkpoints/sft (teacher), checkpoints/kd (student)
    python benchmarks/bench_topk.py --teacher DIR --student DIR --serve 1
    python benchmarks/bench_topk.py --random 1            # tiny random models (model/configs), no checkpoints
    python benchmarks/bench_topk.py --random 1 --rows 2 --max_new_tokens 8 --json topk.json   # a quick look

The student samples --rows demo OPD prompts x --max_new_tokens at temperature 1 (on-policy, per-row seeds); every
completion position is one sample of each estimate. Columns: the mean over positions and its ratio to the exact
mean (the bias of what the loss averages), the standard deviation across positions of the estimate and of its
error (estimate - exact), and the teacher's mean mass outside S. With --serve 1 a teacher server (fp32, started on
the teacher's folder with --max-logprobs 64) scores the same rows with prompt_logprobs K: the response bytes per
scored position and the median time per request (one row per request, sent one at a time).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402
from common.errors import ArgumentParser, UserError, run_script  # noqa: E402
from common.seeds import derived_seed  # noqa: E402
from dataset.collators import build_sequences  # noqa: E402
from model import generate, load_pretrained, load_tokenizer  # noqa: E402
from trainer.losses.chunked import completion_hidden  # noqa: E402
from trainer.losses.closed_forms import generalized_jsd_loss  # noqa: E402
from trainer.losses.topk_divergence import topk_divergence, topk_support  # noqa: E402

KS = (1, 4, 16, 64)


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--teacher", default=os.path.join(ROOT, "checkpoints", "sft"))
    p.add_argument("--student", default=os.path.join(ROOT, "checkpoints", "kd"))
    p.add_argument("--random", type=int, default=0, choices=[0, 1],
                   help="1: random tiny models (qwen3-tiny teacher, qwen3-tiny-student), not checkpoints")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve", type=int, default=0, choices=[0, 1], help="1: also measure a vLLM teacher server")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (0: torch's default)")
    harness.add_json_arg(p)
    return p.parse_args(argv)


def models(args, folder: str):
    if args.random:  # written as folders: a --serve 1 server starts from the teacher's
        args.student, args.teacher = harness.save_random_models(folder, seed=1)
        what = "random tiny models (qwen3-tiny teacher, qwen3-tiny-student)"
    else:
        for path in (args.teacher, args.student):
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise UserError(f"no model at {path}: train the demo (README) or pass --random 1")
        what = f"teacher {os.path.relpath(args.teacher)}, student {os.path.relpath(args.student)}"
    return load_pretrained(args.teacher).eval(), load_pretrained(args.student).eval(), what


@torch.no_grad()
def samples(args, tokenizer, student):
    batch = harness.prompt_batch(tokenizer, harness.demo_rows("opd_prompts", range(args.rows)), max_prompt_length=128)
    seeds = [derived_seed(args.seed, 0, row["row_index"]) for row in batch["rows"]]
    out = generate(student, batch["prompt_ids"], batch["prompt_attention_mask"], args.max_new_tokens, do_sample=True,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                   vocab_size=len(tokenizer), generator=[torch.Generator().manual_seed(s) for s in seeds])
    return build_sequences(batch["prompt_ids"], batch["prompt_attention_mask"], out.completion_ids,
                           out.completion_mask)


@torch.no_grad()
def estimates(tokenizer, teacher, student, input_ids, attention_mask, labels) -> dict[str, torch.Tensor]:
    vocab = len(tokenizer)
    s_hidden, targets = completion_hidden(student, input_ids, attention_mask, labels)
    t_hidden, _ = completion_hidden(teacher, input_ids, attention_mask, labels)
    out: dict[str, list] = {"exact": [], "sampled token": [], **{f"top-{k}": [] for k in KS},
                            **{f"tail-{k}": [] for k in KS}}
    for start in range(0, targets.numel(), 256):  # chunks: no (N, V) tensor
        s_logits = s_hidden[start:start + 256] @ student.lm_head.weight[:vocab].T
        t_logits = t_hidden[start:start + 256] @ teacher.lm_head.weight[:vocab].T
        y = targets[start:start + 256]
        out["exact"].append(generalized_jsd_loss(s_logits, t_logits, None, 1.0, reduction="none"))
        logp_s, logp_t = s_logits.log_softmax(-1), t_logits.log_softmax(-1)
        out["sampled token"].append((logp_s.gather(-1, y[:, None]) - logp_t.gather(-1, y[:, None])).squeeze(-1))
        for k in KS:
            value, tail = topk_divergence(s_logits, *topk_support(t_logits, y, k), None, 1.0, reduction="none",
                                          return_tail=True)
            out[f"top-{k}"].append(value)
            out[f"tail-{k}"].append(tail)
    return {name: torch.cat(parts).double() for name, parts in out.items()}


def serve(args, folder: str, input_ids, attention_mask, labels) -> dict[str, tuple[float, float]]:
    """K -> (response bytes per scored position, median ms per request) from a teacher server."""
    import httpx

    from serving.vllm_launch import start_vllm, stop_vllm, vllm_command, vllm_python, wait_ready
    log = os.path.join(folder, "teacher_server.log")
    process = start_vllm(vllm_command(vllm_python(), args.teacher, "teacher", args.port, max_logprobs=max(KS)), log)
    print(f"waiting for the teacher server (log {log})", flush=True)
    results = {}
    try:
        wait_ready(process, args.port, log)
        rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids, attention_mask)]
        with httpx.Client(timeout=600) as client:
            for k in (0, *KS):
                sizes, times, positions = 0, [], 0
                for row in rows:
                    payload = {"model": "teacher", "prompt": row, "max_tokens": 1, "temperature": 0.0,
                               "prompt_logprobs": k, "return_token_ids": True, "skip_special_tokens": False}
                    begin = time.perf_counter()
                    response = client.post(f"http://127.0.0.1:{args.port}/v1/completions", json=payload)
                    times.append((time.perf_counter() - begin) * 1000)
                    response.raise_for_status()
                    sizes += len(response.content)
                    positions += len(row) - 1
                results[k] = (sizes / positions, statistics.median(times[1:] or times))
    finally:
        stop_vllm(process)
    return results


def main(argv=None) -> dict:
    args = parse_args(argv)
    harness.set_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_topk_") as folder:
        tokenizer = load_tokenizer(None if args.random else args.teacher)
        teacher, student, what = models(args, folder)
        input_ids, attention_mask, labels = samples(args, tokenizer, student)
        values = estimates(tokenizer, teacher, student, input_ids, attention_mask, labels)
        served = serve(args, folder, input_ids, attention_mask, labels) if args.serve else {}
    exact = values["exact"]
    print(f"{harness.machine()}\n{what}; {args.rows} prompts x {args.max_new_tokens} new tokens sampled by the "
          f"student at temperature 1: {exact.numel()} positions; exact per-token reverse KL mean {exact.mean():.4f}, "
          f"std {exact.std():.4f}\n")
    rows = []
    for name, k in (("exact (full vocabulary, local teacher)", None), ("sampled token", 0),
                    *((f"top-{k} + sampled + tail", k) for k in KS)):
        value = exact if k is None else values["sampled token" if k == 0 else f"top-{k}"]
        rows.append({"estimate": name, "k": k, "mean": value.mean().item(),
                     "mean_over_exact": (value.mean() / exact.mean()).item(), "std": value.std().item(),
                     "error_std": (value - exact).std().item(),
                     "teacher_mass_outside": values[f"tail-{k}"].mean().item() if k else None,
                     "bytes_per_position": served[k][0] if k in served else None,
                     "server_ms_per_request": served[k][1] if k in served else None})
    print(harness.table(["estimate of KL(p_S || p_T) per token", "mean", "mean / exact", "std across positions",
                         "std of (estimate - exact)", "teacher mass outside S", "bytes / position",
                         "server ms / request"],
                        [[r["estimate"], f"{r['mean']:.4f}", f"{r['mean_over_exact']:.3f}", f"{r['std']:.4f}",
                          f"{r['error_std']:.4f}", cell(r["teacher_mass_outside"], ".4f"),
                          cell(r["bytes_per_position"], ".0f"), cell(r["server_ms_per_request"], ".0f")]
                         for r in rows]))
    results = {"positions": exact.numel(), "estimates": rows}
    harness.write_json(args.json, results)
    return results


def cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    run_script(main)
