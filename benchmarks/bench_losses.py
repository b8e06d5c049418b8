"""Peak memory and time of our chunked losses against full logits, forward + backward: the OPD/KD divergence and
one SFT training step.

    python benchmarks/bench_losses.py                  # JSD: 4,096 positions x 151,936 vocabulary x hidden 1,024
    python benchmarks/bench_losses.py --loss ce        # cross entropy: 4,096 positions x 151,936 x hidden 1,024
    python benchmarks/bench_losses.py --loss kd        # KD (alpha 0.5): 4,096 positions x 151,936 x hidden 1,024
    python benchmarks/bench_losses.py --loss rl        # the RL loss (k3 + OPD term): the same shape
    python benchmarks/bench_losses.py --loss sft       # SFT step: 4 x 1,024 tokens (512 completion), 151,936 vocab
    python benchmarks/bench_losses.py --loss sft --model_config model/configs/qwen3-demo.json --batch_size 16 \
        --seq_len 512 --completion_len 256 --pad_step 16              # the demo's SFT step (train_sft's defaults)
    python benchmarks/bench_losses.py --device cuda    # on a GPU (torch.cuda.max_memory_allocated)
    python benchmarks/bench_losses.py --positions 512 --vocab 32000      # a quick look
    python benchmarks/bench_losses.py --casts --hidden 256               # lm_head casts under bf16 autocast

--loss jsd (target: chunked <= 25% of full): generalized JSD (beta 1: OPD's reverse KL) between random student and
  teacher hidden states (N, H) and lm_heads (V, H). full: both logits (N, V) at once, then the loss; checkpointed:
  the generic trainer.losses.chunked.chunked_loss with the JSD as its loss, the lm_heads applied chunk by chunk and
  recomputed in the backward (how OPD computed it before trainer/losses/fused_divergences.py); chunked: what
  training runs, trainer.losses.fused_divergences.chunked_generalized_jsd_loss, chunk by chunk with the gradient
  computed in the same pass.
--loss ce (target: chunked <= 25% of full): the cross entropy of random hidden states (N, H) and lm_head (V, H)
  against random labels. full: the (N, V) logits at once; checkpointed: chunked_sft_loss, the generic checkpointed
  path; chunked: what training runs, trainer.losses.fused_linear.fused_cross_entropy (closed-form gradient).
--loss kd / --loss rl (target: chunked <= 25% of full): classic KD (alpha CE + (1 - alpha) KL(teacher || student))
  and the RL clipped policy-gradient loss (on-policy, k3 to a reference and the OPD term on) on the same inputs
  (the RL loss with per-token values: advantages +-1, reference and teacher log-probabilities). full: the (N, V)
  logits at once and trainer/losses/closed_forms.py's (policy_gradient.policy_loss's) function; checkpointed:
  the same function through chunked_loss; chunked: what training runs, fused_kd_loss / fused_policy_loss.
--loss sft (target: chunked <= 40% of full): one SFT step of a small model (hidden 256, 2 layers, the tied
  151,936-row embedding: as for Qwen3-0.6B at real lengths, the logits dominate) on a batch laid out as SFTCollator
  makes it: right padded (row r has r x --pad_step pads at the end, its prompt that much shorter), labels -100 on
  the prompt and the pads. chunked: as train_sft.py, completion_hidden (only the positions that predict a label)
  then fused_cross_entropy; checkpointed: the same with chunked_sft_loss (the loop's path before); full: the same
  forward's logits (B, T, V), labels shifted (not the logits: no shifted copy, as transformers' ForCausalLMLoss),
  cross entropy -- the kindest full-logits baseline.
--casts: the generic chunked path (the JSD through chunked_loss, as SFT, KD and the top-K loss use it) under CPU
  bf16 autocast, counting the full-size (V, H) casts of the lm_head weights (aten._to_copy, through a dispatch mode)
  and timing it, once with the weights cast once per loss (`trainer.losses.chunked.autocast_once`, today) and once
  with autocast casting them at every chunk's matmul (before).

Each variant runs in a fresh 'spawn' process (glibc's mmap threshold fixed: harness.FIXED_MMAP_THRESHOLD): inputs
(and model) built, a warm-up on a toy slice (kernels, thread pool, autograd engine: memory unrelated to the loss),
then the baseline (resident bytes; on CUDA the allocated ones) with the peak reset, then --repeats measured steps.
Memory is the peak above that baseline: what the loss and its backward add, inputs excluded, the lm_head's gradient
(V x H) included in every variant. Time: the median step.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import trainer.losses.chunked as chunked_losses  # noqa: E402
from benchmarks import harness  # noqa: E402
from common.checks import check_device  # noqa: E402
from common.errors import ArgumentParser, refuse, run_script  # noqa: E402
from dataset.collators import IGNORE_INDEX  # noqa: E402
from model import Qwen3Config, create_model  # noqa: E402
from model.precision import resolve_precision  # noqa: E402
from trainer.losses.chunked import chunked_sft_loss, completion_hidden  # noqa: E402
from trainer.losses.fused_divergences import chunked_generalized_jsd_loss, fused_kd_loss  # noqa: E402
from trainer.losses.fused_linear import fused_cross_entropy  # noqa: E402
from trainer.losses.closed_forms import distillation_loss, generalized_jsd_loss, sft_loss  # noqa: E402
from trainer.losses.policy_gradient import (ADVANTAGE, OLD_LOGP, REF_LOGP, TEACHER_LOGP,  # noqa: E402
                                            fused_policy_loss, policy_loss)

TARGETS = {"jsd": 0.25, "ce": 0.25, "kd": 0.25, "rl": 0.25, "sft": 0.40}  # chunked / full memory
# Qwen3-0.6B's; for the SFT step a small model whose logits dominate
DEFAULT_HIDDEN = {"jsd": 1024, "ce": 1024, "kd": 1024, "rl": 1024, "sft": 256}
PAD_ID = 151643  # Qwen3's <|endoftext|>, its pad token


# ------------------------------------------------------------------------------------------------ the inputs

def jsd_inputs(args: argparse.Namespace, device: torch.device) -> dict:
    torch.manual_seed(0)
    n, v, h = args.positions, args.vocab, args.hidden
    return {"h": (torch.randn(n, h, device=device) * 0.5).requires_grad_(),
            "w": (torch.randn(v, h, device=device) * 0.05).requires_grad_(),
            "th": torch.randn(n, h, device=device) * 0.5, "tw": torch.randn(v, h, device=device) * 0.05,
            "labels": torch.randint(0, v, (n,), device=device), "values": rl_values(n, device)}


def rl_values(n: int, device: torch.device) -> torch.Tensor:
    """Per-token values of an on-policy RL step (trainer/losses/policy_gradient.py's columns): advantages of +-1,
    log pi_old NaN (on-policy), reference and teacher log-probabilities near the random student's (log 1/V, about
    -11.9 for Qwen3's vocabulary)."""
    values = torch.empty(n, 4, device=device)
    values[:, ADVANTAGE] = torch.randint(0, 2, (n,), device=device).float() * 2 - 1
    values[:, OLD_LOGP] = float("nan")
    values[:, REF_LOGP] = -11.9 + 0.3 * torch.randn(n, device=device)
    values[:, TEACHER_LOGP] = -11.9 + 0.3 * torch.randn(n, device=device)
    return values


def sft_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    if args.model_config:
        return create_model(Qwen3Config.from_json(args.model_config), seed=0, device=device).train()
    config = Qwen3Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                         num_hidden_layers=args.num_layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=args.hidden // 4, max_position_embeddings=max(4096, args.seq_len),
                         tie_word_embeddings=True)
    return create_model(config, seed=0, device=device).train()


def sft_batch(args: argparse.Namespace, device: torch.device) -> dict:
    """Right-padded rows of --seq_len columns, as SFTCollator lays them out: row r is a prompt of seq_len -
    completion_len - r x pad_step tokens, completion_len completion tokens (its labels), then r x pad_step pads."""
    generator = torch.Generator().manual_seed(0)
    rows, length, completion = args.batch_size, args.seq_len, args.completion_len
    pad_id = min(PAD_ID, args.vocab - 1)
    ids = torch.randint(0, pad_id, (rows, length), generator=generator)  # real tokens, below the specials
    mask = torch.ones(rows, length, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for r in range(rows):
        end = length - min(r * args.pad_step, length - completion - 1)  # at least one prompt token
        labels[r, end - completion:end] = ids[r, end - completion:end]
        ids[r, end:], mask[r, end:] = pad_id, 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


def inputs(loss: str, args: argparse.Namespace, device: torch.device) -> tuple[dict, dict]:
    """-> (the measured inputs, a toy slice of them for the warm-up)."""
    if loss in ("jsd", "ce", "kd", "rl"):  # the cross entropy and the RL loss leave the teacher alone
        full = jsd_inputs(args, device)
        toy = {**{key: full[key][:8] for key in ("h", "w", "th", "tw", "values")}, "labels": full["labels"][:8] % 8}
        return full, toy
    batch = sft_batch(args, device)
    full = {"model": sft_model(args, device), **batch}
    return full, {"model": full["model"], **{key: value[:1, -16:] for key, value in batch.items()}}


# ------------------------------------------------------------------------------------ the four ways to a loss

def jsd_full(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        teacher_logits = x["th"] @ x["tw"].T
    loss = generalized_jsd_loss(x["h"] @ x["w"].T, teacher_logits, x["labels"], beta=args.beta,
                                reduction="sum")
    return loss, torch.tensor(len(x["labels"]))


def jsd_chunked(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    return chunked_generalized_jsd_loss(x["h"], x["w"], x["th"], x["tw"], x["labels"], beta=args.beta,
                                        chunk_size=min(args.chunk_size, len(x["labels"])))


def jsd_checkpointed(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    def loss_fn(logits, teacher_logits, labels):
        return generalized_jsd_loss(logits, teacher_logits, labels, beta=args.beta, reduction="sum")
    loss = chunked_losses.chunked_loss(loss_fn, x["h"], x["w"], x["labels"], x["th"], x["tw"],
                                       chunk_size=min(args.chunk_size, len(x["labels"])))
    return loss, torch.tensor(len(x["labels"]))


def ce_full(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    return sft_loss(x["h"] @ x["w"].T, x["labels"])


def ce_checkpointed(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    return chunked_sft_loss(x["h"], x["w"], x["labels"], chunk_size=min(args.chunk_size, len(x["labels"])))


def ce_chunked(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_cross_entropy(x["h"], x["w"], x["labels"], chunk_size=min(args.chunk_size, len(x["labels"])))


def kd_full(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        teacher_logits = x["th"] @ x["tw"].T
    return kd_closed_form(x["h"] @ x["w"].T, teacher_logits, x["labels"], args.alpha), torch.tensor(len(x["labels"]))


def kd_checkpointed(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    loss = chunked_losses.chunked_loss(lambda s, t, y: kd_closed_form(s, t, y, args.alpha), x["h"], x["w"],
                                       x["labels"], x["th"], x["tw"], chunk_size=min(args.chunk_size, len(x["h"])))
    return loss, torch.tensor(len(x["labels"]))


def kd_chunked(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    loss, tokens, _, _ = fused_kd_loss(x["h"], x["w"], x["th"], x["tw"], x["labels"], args.alpha,
                                       chunk_size=min(args.chunk_size, len(x["h"])))
    return loss, tokens


def kd_closed_form(logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                   alpha: float) -> torch.Tensor:
    """KD at temperature 1 from trainer/losses/closed_forms.py: alpha CE + (1 - alpha) KL(teacher || student)."""
    kd = distillation_loss(logits, teacher_logits, labels, reduction="sum")
    return alpha * sft_loss(logits, labels)[0] + (1.0 - alpha) * kd


RL_SETTINGS = dict(kl_coef=0.05, opd_coef=0.5)  # every term of the loss: k3 to a reference, the OPD advantage


def rl_full(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    return policy_loss(x["h"] @ x["w"].T, x["values"], x["labels"], **RL_SETTINGS)[:2]


def rl_checkpointed(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    return chunked_losses.chunked_loss(lambda s, v, y: policy_loss(s, v, y, **RL_SETTINGS)[:2], x["h"], x["w"],
                                       x["labels"], chunk_size=min(args.chunk_size, len(x["h"])),
                                       teacher_values=x["values"])


def rl_chunked(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    sums = fused_policy_loss(x["h"], x["w"], x["labels"], x["values"], min(args.chunk_size, len(x["h"])),
                             len(x["w"]), **RL_SETTINGS)
    return sums.loss, sums.tokens


def sft_full(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    logits = x["model"](x["input_ids"]).logits  # (B, T, V); the same forward as completion_hidden's
    # position t predicts labels[t + 1]: shift the labels (the last position gets -100), not the logits
    return sft_loss(logits, F.pad(x["labels"][:, 1:], (0, 1), value=IGNORE_INDEX))


def sft_checkpointed(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, targets = completion_hidden(x["model"], x["input_ids"], x["attention_mask"], x["labels"])
    return chunked_sft_loss(hidden, x["model"].lm_head.weight, targets, chunk_size=args.chunk_size)


def sft_chunked(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    hidden, targets = completion_hidden(x["model"], x["input_ids"], x["attention_mask"], x["labels"])
    return fused_cross_entropy(hidden, x["model"].lm_head.weight, targets, chunk_size=args.chunk_size)


def sft_packed(x: dict, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked` with --packing 1: the rows' real tokens only outside the attention (model/qwen3.py: Packing)."""
    x["model"].pack_rows = True
    return sft_chunked(x, args)


STEPS = {("jsd", "full"): jsd_full, ("jsd", "checkpointed"): jsd_checkpointed, ("jsd", "chunked"): jsd_chunked,
         ("ce", "full"): ce_full, ("ce", "checkpointed"): ce_checkpointed, ("ce", "chunked"): ce_chunked,
         ("kd", "full"): kd_full, ("kd", "checkpointed"): kd_checkpointed, ("kd", "chunked"): kd_chunked,
         ("rl", "full"): rl_full, ("rl", "checkpointed"): rl_checkpointed, ("rl", "chunked"): rl_chunked,
         ("sft", "full"): sft_full, ("sft", "checkpointed"): sft_checkpointed, ("sft", "chunked"): sft_chunked,
         ("sft", "packed"): sft_packed}


def weights(x: dict) -> list[torch.Tensor]:
    """The tensors whose gradients a step makes (zeroed between steps)."""
    return list(x["model"].parameters()) if "model" in x else [x["h"], x["w"]]


def run_variant(loss: str, variant: str, args: argparse.Namespace) -> dict:
    """In a fresh process: the inputs, a warm-up on the toy slice, then the baseline and --repeats measured steps."""
    harness.set_threads(args.threads)
    device = torch.device(args.device)
    step, autocast = STEPS[loss, variant], resolve_precision(args.device, args.dtype).autocast
    full, toy = inputs(loss, args, device)
    with autocast():
        step(toy, args)[0].backward()
    seconds = []
    for tensor in weights(full):
        tensor.grad = None
    baseline, peak_was_reset = harness.memory_baseline(device)
    for _ in range(args.repeats):
        for tensor in weights(full):
            tensor.grad = None  # as optimizer.zero_grad(set_to_none=True)
        harness.synchronize(device)
        start = time.perf_counter()
        with autocast():
            loss_sum, tokens = step(full, args)
        loss_sum.backward()
        harness.synchronize(device)
        seconds.append(time.perf_counter() - start)
    lm_head = full["model"].lm_head.weight if "model" in full else full["w"]
    return {"variant": variant, "extra_bytes": harness.peak_bytes(device) - baseline, "baseline_bytes": baseline,
            "peak_was_reset": peak_was_reset, "seconds": statistics.median(seconds),
            "loss_per_token": loss_sum.item() / max(int(tokens), 1), "tokens": int(tokens),
            "lm_head_grad_norm": lm_head.grad.float().norm().item()}


def measure(args: argparse.Namespace) -> dict:
    """Full logits, the checkpointed path, then chunked (what training runs), each in a fresh process of its own (its
    peak is its own) -> the results."""
    context = mp.get_context("spawn")
    variants = {}
    for variant in ("full", "checkpointed", "chunked") + (("packed",) if args.loss == "sft" else ()):
        with harness.environment(harness.FIXED_MMAP_THRESHOLD), context.Pool(1) as pool:
            variants[variant] = pool.apply(run_variant, (args.loss, variant, args))
    full, chunked = variants["full"], variants["chunked"]
    results = {"variants": variants, "memory_ratio": chunked["extra_bytes"] / full["extra_bytes"],
               "time_ratio": chunked["seconds"] / full["seconds"], "target": TARGETS[args.loss],
               "loss_difference": abs(chunked["loss_per_token"] - full["loss_per_token"])}
    # the fused loss against the generic checkpointed path it replaced: time (> 1: fused faster) and memory
    results["checkpointed_time_ratio"] = variants["checkpointed"]["seconds"] / chunked["seconds"]
    results["memory_vs_checkpointed"] = chunked["extra_bytes"] / variants["checkpointed"]["extra_bytes"]
    if "packed" in variants:  # the same step on the rows' real tokens only: > 1, packing is faster
        results["packed_speedup"] = chunked["seconds"] / variants["packed"]["seconds"]
        results["padding_share"] = 1.0 - args_real_tokens(args) / (args.batch_size * args.seq_len)
    return results


def args_real_tokens(args: argparse.Namespace) -> int:
    """The real tokens of `sft_batch`'s rows (row r: r x pad_step pads, at least completion + 1 real tokens)."""
    return sum(args.seq_len - min(r * args.pad_step, args.seq_len - args.completion_len - 1)
               for r in range(args.batch_size))


def describe(args: argparse.Namespace) -> str:
    precision = resolve_precision(args.device, args.dtype).name
    if args.loss == "ce":
        return (f"cross entropy, {args.positions} positions x {args.vocab} vocabulary, hidden {args.hidden}, chunk "
                f"{args.chunk_size}, {args.device} {precision}; one (N, V) fp32 tensor = "
                f"{args.positions * args.vocab * 4 / harness.GIB:.2f} GiB")
    if args.loss in ("kd", "rl"):
        what = f"KD alpha {args.alpha}" if args.loss == "kd" else f"RL policy loss {RL_SETTINGS}, on-policy"
        return (f"{what}, {args.positions} positions x {args.vocab} vocabulary, hidden {args.hidden}, chunk "
                f"{args.chunk_size}, {args.device} {precision}; one (N, V) fp32 tensor = "
                f"{args.positions * args.vocab * 4 / harness.GIB:.2f} GiB")
    if args.loss == "jsd":
        return (f"generalized JSD beta {args.beta}, {args.positions} positions x {args.vocab} vocabulary, hidden "
                f"{args.hidden}, chunk {args.chunk_size}, {args.device} {precision}; one (N, V) fp32 tensor = "
                f"{args.positions * args.vocab * 4 / harness.GIB:.2f} GiB")
    loss_tokens = args.batch_size * args.completion_len
    model = f"model {args.model_config}" if args.model_config else f"hidden {args.hidden}, {args.num_layers} layers"
    return (f"SFT step, batch {args.batch_size} x {args.seq_len} tokens ({args.completion_len} completion, "
            f"{loss_tokens} loss tokens; right padded, {args.pad_step} more pads a row), vocabulary {args.vocab}, "
            f"{model}, chunk {args.chunk_size}, {args.device} {precision}; "
            f"one fp32 (B, T, V) tensor = {args.batch_size * args.seq_len * args.vocab * 4 / harness.GIB:.2f} GiB")


def print_results(results: dict) -> None:
    rows = []
    for name, r in results["variants"].items():
        note = "" if r["peak_was_reset"] else " (peak not resettable here: includes set-up)"
        rows.append([name, f"{r['extra_bytes'] / harness.GIB:.2f}{note}", f"{r['seconds']:.2f}",
                     f"{r['loss_per_token']:.6f}", f"{r['lm_head_grad_norm']:.6g}"])
    print(harness.table(["variant", "peak extra memory, GiB", "step s", "loss per token", "lm_head grad norm"],
                        rows))
    verdict = "meets" if results["memory_ratio"] <= results["target"] else "misses"
    print(f"chunked / full memory: {results['memory_ratio']:.1%} ({verdict} the <= {results['target']:.0%} target); "
          f"time ratio {results['time_ratio']:.2f}x; loss difference {results['loss_difference']:.2e}")
    print(f"checkpointed / chunked time: {results['checkpointed_time_ratio']:.2f}x, chunked / checkpointed memory "
          f"{results['memory_vs_checkpointed']:.2f} (the gradient computed with the loss: losses/fused_linear.py)")
    if "packed_speedup" in results:
        print(f"packed (--packing 1) / chunked useful tokens per second: {results['packed_speedup']:.2f}x, "
              f"{results['padding_share']:.1%} of the batch's tokens padding")


# ----------------------------------------------------------------------------------------------------- --casts

class CountWeightCasts(TorchDispatchMode):
    """Counts dtype conversions (aten._to_copy) whose output has `numel` elements: the (V, H) weight casts."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.count = numel, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and out.numel() == self.numel:
            self.count += 1
        return out


def count_casts(args: argparse.Namespace, cast_once: bool) -> dict:
    """Full-size lm_head casts and seconds of one chunked forward + backward under CPU bf16 autocast."""
    x = jsd_inputs(args, torch.device("cpu"))
    original = chunked_losses.autocast_once
    chunked_losses.autocast_once = original if cast_once else (lambda weight: None)
    try:
        start = time.perf_counter()
        with CountWeightCasts((args.vocab - 1) * args.hidden) as counter:  # vocab_size v - 1: the sliced view,
            with torch.autocast("cpu", dtype=torch.bfloat16):                # as in training
                loss = chunked_losses.chunked_loss(
                    lambda s, t, y: generalized_jsd_loss(s, t, y, beta=args.beta, reduction="sum"), x["h"], x["w"],
                    x["labels"], x["th"], x["tw"], chunk_size=args.chunk_size, vocab_size=args.vocab - 1)
            loss.backward()
        return {"casts": counter.count, "seconds": time.perf_counter() - start}
    finally:
        chunked_losses.autocast_once = original


def measure_casts(args: argparse.Namespace) -> dict:
    chunks = -(-args.positions // args.chunk_size)
    print(f"chunked JSD under CPU bf16 autocast: {args.positions} positions in {chunks} chunks x {args.vocab} "
          f"vocabulary, hidden {args.hidden}; student and teacher lm_head both fp32", flush=True)
    results = {"per chunk (before)": count_casts(args, False), "once per loss": count_casts(args, True)}
    print(harness.table(["weights cast", "full-size casts", "seconds"],
                        [[name, r["casts"], f"{r['seconds']:.2f}"] for name, r in results.items()]))
    before, after = results.values()
    print(f"time ratio before / after {before['seconds'] / after['seconds']:.2f}x")
    return {"casts": results}


# ----------------------------------------------------------------------------------------------------------- CLI

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--loss", choices=["jsd", "ce", "kd", "rl", "sft"], default="jsd",
                        help="what is measured (see above)")
    parser.add_argument("--casts", action="store_true", help="count and time the lm_head casts under bf16 autocast")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size V")
    parser.add_argument("--hidden", type=int, default=None, help="hidden size (default: 1024 jsd, 256 sft)")
    parser.add_argument("--chunk_size", type=int, default=512, help="positions per lm_head chunk (ours)")
    g = parser.add_argument_group("--loss jsd")
    g.add_argument("--positions", type=int, default=4096, help="loss positions N")
    g.add_argument("--beta", type=float, default=1.0, help="generalized JSD beta (1 = reverse KL, OPD)")
    g.add_argument("--alpha", type=float, default=0.5, help="--loss kd: the cross entropy's weight")
    g = parser.add_argument_group("--loss sft")
    g.add_argument("--batch_size", type=int, default=4)
    g.add_argument("--seq_len", type=int, default=1024, help="tokens per row, prompt + completion + pads")
    g.add_argument("--completion_len", type=int, default=512, help="completion (label) tokens per row")
    g.add_argument("--pad_step", type=int, default=64, help="row r ends with r x pad_step pads")
    g.add_argument("--num_layers", type=int, default=2)
    g.add_argument("--model_config", default=None,
                   help="the model from a config.json instead (--hidden, --num_layers and --vocab unused), e.g. the "
                        "demo's model/configs/qwen3-demo.json")
    g = parser.add_argument_group("run")
    harness.add_device_args(g)
    g.add_argument("--repeats", type=int, default=1, help="measured steps per variant (the median time)")
    harness.add_json_arg(parser)
    args = parser.parse_args(argv)
    args.hidden = args.hidden or DEFAULT_HIDDEN[args.loss]
    check_device(args.device)
    if args.loss == "sft" and not 0 < args.completion_len < args.seq_len:
        refuse(f"need 0 < --completion_len ({args.completion_len}) < --seq_len ({args.seq_len})")
    if min(args.repeats, args.chunk_size, args.positions, args.batch_size) < 1:
        refuse("--repeats, --chunk_size, --positions and --batch_size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    print(harness.machine(), flush=True)
    if args.casts:
        results = measure_casts(args)
    else:
        print(describe(args), flush=True)
        results = {"loss": args.loss, **measure(args)}
        print_results(results)
    harness.write_json(args.json, results)
    return results


if __name__ == "__main__":
    run_script(main)
