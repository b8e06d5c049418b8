"""The bf16 weight-sync tolerance, measured: correct syncs against stale ones on a bf16 vLLM CPU server.

    python benchmarks/bench_sync.py                  # depths 2 4 8 16 28: one bf16 server each, ~4 min per depth
    python benchmarks/bench_sync.py --layers 2 4 --lr 1e-5
    python benchmarks/bench_sync.py --layers 2 --json sync.json     # one depth, the figures as JSON too

For each depth a random model (hidden 128, 2 heads x 64, the real 151,936-row vocabulary, tied head) is served by a
vLLM CPU server with --dtype bfloat16; the trainer's side is our model's forward under torch.autocast("cpu",
bfloat16) on its fp32 master weights, as the trainer computes on CUDA. A step is an AdamW step (the trainer's betas)
at --lr on one SFT batch of the demo data. Each case is the probe's |log p_server - log p_trainer| over its 75
scored tokens, max and mean, against serving/weight_sync.py's bf16 tolerance:
  correct syncs   the initial weights (also scored as eval_math scores a bf16 model: bf16 weights, no autocast), the
                  weights after 1 and after 10 steps, each pushed after the initial ones: must pass
  1 step skipped  the server holds the initial weights, the trainer has taken a step: must fail
  lr/10 skipped   the same for a step at --lr / 10: shown (bf16 may not resolve it)
  stale head      the stepped weights loaded by vLLM's stock reload_weights: new layers, the initial tied head's
                  packed CPU copy (what serving/vllm_worker.py repairs); 1 step old: shown, 10 steps old: must fail
                  where vLLM's bf16 GEMM keeps a packed copy of the weight on this CPU (`keeps_packed_copy`; where
                  it computes from the weight itself, the stock reload is a correct sync: shown)
The table is docs/serving.md's, then the margins of the mean.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402
from common.errors import ArgumentParser, RuntimeFailure, run_script  # noqa: E402
from dataset.collators import IGNORE_INDEX, SFTCollator  # noqa: E402
from model import Qwen3Config, Qwen3ForCausalLM, create_model, load_tokenizer, save_pretrained  # noqa: E402
from serving.engine import CompletionServer, probe_token_ids  # noqa: E402
from serving.vllm_launch import (keeps_packed_copy, start_vllm, stop_vllm, vllm_command, vllm_python,  # noqa: E402
                                 wait_ready)
from serving.weight_sync import TOLERANCE, Tolerance, WeightSync, own_logprobs, sync_statistics, within  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 16, 28])
    p.add_argument("--lr", type=float, default=1e-5, help="of the skipped step (Qwen3-0.6B trains at ~1e-5)")
    p.add_argument("--port", type=int, default=8741)
    p.add_argument("--workdir", default=None, help="where the models and pushed weights go (default: a temporary "
                                                   "folder)")
    harness.add_json_arg(p)
    return p.parse_args(argv)


def random_model(layers: int) -> Qwen3ForCausalLM:
    """The demo student's shape (model/configs/qwen3-tiny-student.json) at hidden 128 with 64-wide heads, which
    vLLM's CPU attention kernels serve; random weights. The norm weights are drawn around 1 too: initialised to
    exactly 1 they would be the one set of weights that bf16 represents exactly, while a model in training has
    fp32 master weights that bf16 rounds everywhere (rounding the norms alone moves the probe by 1.2e-3
    to 1.9e-3 on average)."""
    config = Qwen3Config.from_dict({
        "vocab_size": 151936, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": layers,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "hidden_act": "silu",
        "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645})
    model = create_model(config, seed=layers)
    norms_around_one(model, seed=layers)
    return model


def norms_around_one(model: torch.nn.Module, seed: int) -> None:
    """Every norm weight drawn around 1, in place (see random_model: bf16 represents exactly 1, never a trained
    model's norms, and rounding them is part of what a bf16 sync differs by)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.add_(0.1 * torch.randn(weight.shape, generator=generator).to(weight.device))


def bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def sft_batch(tokenizer, rows: int = 8) -> dict[str, torch.Tensor]:
    return SFTCollator(tokenizer, 128, 64)(harness.demo_rows("sft_train", range(rows)))


def stepped(model: Qwen3ForCausalLM, batch: dict[str, torch.Tensor], lr: float, steps: int = 1) -> Qwen3ForCausalLM:
    """A copy of `model` after `steps` AdamW steps (the trainer's betas) on the batch's SFT loss."""
    new = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(new.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    labels = batch["labels"][:, 1:].flatten()
    for _ in range(steps):
        logits = new(batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels, ignore_index=IGNORE_INDEX).backward()
        optimizer.step()
        optimizer.zero_grad()
    return new


class StockReloadSync(WeightSync):
    """Pushes with vLLM's own reload_weights of the pushed folder, which leaves the tied head's packed CPU copy
    stale."""

    def load_request(self) -> dict:
        return {"method": "reload_weights", "kwargs": {"weights_path": os.path.dirname(self.path)}}


def measure_depth(layers: int, lr: float, probe: list[int], batch: dict, folder: str,
                  port: int) -> list[tuple[str, bool | None, dict[str, float]]]:
    """Every case at one depth, on one bf16 server started for it -> [(case, must it pass (None: a stale sync below
    bf16's resolution, shown, neither), its statistics)]."""
    initial = random_model(layers)
    model_dir = os.path.join(folder, f"layers{layers}")
    save_pretrained(initial, model_dir)
    log = os.path.join(folder, f"layers{layers}_server.log")
    process = start_vllm(vllm_command(vllm_python(), model_dir, "student", port, "bfloat16"), log)
    server = CompletionServer(f"http://127.0.0.1:{port}/v1", "student", what="rollout server")
    path = os.path.join(folder, "sync", "model.safetensors")
    sync, stock = (kind(server, path, probe, torch.bfloat16) for kind in (WeightSync, StockReloadSync))

    def served_after(push: WeightSync, model: Qwen3ForCausalLM) -> torch.Tensor:
        push.push(model, 0)
        return server.prompt_logprobs([probe])[0]

    try:
        wait_ready(process, port, log)
        models = {"initial": initial, "one": stepped(initial, batch, lr), "ten": stepped(initial, batch, lr, 10),
                  "tenth": stepped(initial, batch, lr / 10)}
        ours = {name: own_logprobs(model, probe, bf16_autocast) for name, model in models.items()}
        # eval_math's check: the model loaded in bf16, no autocast
        pure_bf16 = own_logprobs(copy.deepcopy(initial).bfloat16(), probe, contextlib.nullcontext)
        served_initial = served_after(sync, initial)
        cases = [("correct: initial weights", True, served_initial, ours["initial"]),
                 ("correct: bf16 weights, no autocast", True, served_initial, pure_bf16),
                 ("correct: after 1 step", True, served_after(sync, models["one"]), ours["one"]),
                 ("correct: after 10 steps", True, served_after(sync, models["ten"]), ours["ten"]),
                 ("stale: 1 step skipped", False, served_initial, ours["one"]),
                 ("stale: 1 step at lr/10 skipped", None, served_initial, ours["tenth"])]
        packed = keeps_packed_copy(vllm_python(), "bfloat16")  # else the stock reload refreshes the head too
        stale_heads = (("stale head: 1 step old", None, "one"),
                       ("stale head: 10 steps old", False if packed else None, "ten"))
        for name, must_pass, steps in stale_heads:
            served_after(sync, initial)
            cases.append((name, must_pass, served_after(stock, models[steps]), ours[steps]))
        return [(name, must_pass, sync_statistics(served, own)) for name, must_pass, served, own in cases]
    finally:
        server.close()
        stop_vllm(process)


def table_header(cases: list[tuple[str, bool | None, dict[str, float]]]) -> str:
    stale = [name + (" (may pass)" if must_pass is None else "") for name, must_pass, _ in cases if not must_pass]
    correct = sum(bool(must_pass) for _, must_pass, _ in cases)
    return (f"| layers | correct syncs (worst of {correct}) | " + " | ".join(stale) + " |\n"
            + "|---" * (2 + len(stale)) + "|")


def table_row(layers: int, cases: list[tuple[str, bool | None, dict[str, float]]], tolerance: Tolerance) -> str:
    """One depth: the worst of the correct syncs, then each stale case; max / mean, and whether it passes."""
    def cell(stats: dict[str, float]) -> str:
        return f"{stats['max']:.1e} / {stats['mean']:.1e} {'passes' if within(stats, tolerance) else 'fails'}"

    correct = [stats for _, must_pass, stats in cases if must_pass]
    worst = {key: max(stats[key] for stats in correct) for key in ("max", "mean")}
    verdict = "all pass" if all(within(stats, tolerance) for stats in correct) else "NOT ALL PASS"
    stale = [cell(stats) for _, must_pass, stats in cases if not must_pass]
    return f"| {layers} | {worst['max']:.1e} / {worst['mean']:.1e} {verdict} | " + " | ".join(stale) + " |"


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)  # tiny models; the server needs the other core
    if vllm_python() is None:
        raise RuntimeFailure("no vLLM environment: run serving/setup_vllm_cpu.sh first")
    tokenizer = load_tokenizer(None)
    probe, batch = probe_token_ids(tokenizer), sft_batch(tokenizer)
    tolerance = TOLERANCE[torch.bfloat16]
    print(f"{harness.machine()}\n|d log p| over the probe's {len(probe) - 1} tokens, max / mean; bf16 tolerance "
          f"(serving/weight_sync.py): max {tolerance.max:g}, mean {tolerance.mean:g}; steps: AdamW at lr {args.lr:g}\n")
    depths = {}
    with tempfile.TemporaryDirectory() as scratch:
        for index, layers in enumerate(args.layers):
            cases = measure_depth(layers, args.lr, probe, batch, args.workdir or scratch, args.port)
            if index == 0:
                print(table_header(cases))
            print(table_row(layers, cases, tolerance), flush=True)
            depths[layers] = [{"case": name, "must_pass": must_pass, **stats, "passes": within(stats, tolerance)}
                              for name, must_pass, stats in cases]
    means = [(case["mean"], layers, case["must_pass"]) for layers, found in depths.items() for case in found]
    correct, at = max((mean, layers) for mean, layers, must_pass in means if must_pass)
    stale, at_stale = min((mean, layers) for mean, layers, must_pass in means if must_pass is False)
    print(f"\nmargins of the mean: the largest of a correct sync, {correct:.2e} ({at} layers), is "
          f"{tolerance.mean / correct:.1f}x below the tolerance; the smallest of a stale sync that must fail, "
          f"{stale:.2e} ({at_stale} layers), {stale / tolerance.mean:.1f}x above it")
    results = {"tolerance": {"mean": tolerance.mean, "max": tolerance.max}, "depths": depths,
               "margins": {"correct_below": tolerance.mean / correct, "stale_above": stale / tolerance.mean}}
    harness.write_json(args.json, results)
    return results


if __name__ == "__main__":
    run_script(main)
