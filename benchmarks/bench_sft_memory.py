"""Peak memory of one SFT training step (forward + loss + backward): our chunked loss vs the full-logits baseline.

    python benchmarks/bench_sft_memory.py                      # CPU: 4 x 1,024 tokens (512 completion), 151,936 vocab
    python benchmarks/bench_sft_memory.py --device cuda        # one GPU, bf16 autocast, torch.cuda.max_memory_allocated
    python benchmarks/bench_sft_memory.py --variants chunked,sliced,full   # also: completion positions, unchunked
    python benchmarks/bench_sft_memory.py --model_config Qwen3-0.6B/config.json --device cuda   # a real model's shape
    python benchmarks/bench_sft_memory.py --seq_len 256 --completion_len 128 --repeats 1       # a quick look
    python benchmarks/bench_sft_memory.py --threads 1          # steadier times on a shared CPU (memory is the same)

Target: the extra memory of our step is <= 40% of the baseline's. Variants, same model, same batch:
  chunked  ours, as train_sft.py does it: final hidden states -> completion_hidden (only the positions that predict
           a label) -> chunked_sft_loss (lm_head chunk by chunk, recomputed in backward). No (B, T, V) tensor exists.
           (train_sft.py also passes vocab_size=len(tokenizer); that row slice is a view, the same memory. Here all
           variants use the whole lm_head, so their losses must agree.)
  full     the baseline: model(...).logits (B, T, V) -> shift -> cross entropy. The labels are shifted rather than
           the logits (as transformers' ForCausalLMLoss does), so no shifted copy of the logits is made, and no Python
           reference keeps the logits past the loss (cross entropy saves only its log-softmax): the kindest
           full-logits baseline.
  sliced   (optional) completion_hidden, then the completion positions' logits all at once: shows what the
           slice alone saves and what chunking adds.
The batch is laid out as SFTCollator makes it: left padded (row r has r * --pad_step padding tokens at the front,
all inside the prompt), labels -100 on the first seq_len - completion_len positions of every row and on padding.
The default model (hidden 256, 2 layers, tied 151,936-row embedding) is small so that, as for Qwen3-0.6B at real
lengths, the logits dominate; its size is a flag.

Memory: each variant runs in its own fresh 'spawn' process (approach and helpers of bench_losses.py). On CPU: peak RSS
minus the RSS once model, batch and a tiny warm-up step exist; the peak is reset (/proc/self/clear_refs) right
before the measured step where the kernel allows, so set-up transients cannot mask it. On CUDA: max_memory_allocated
minus memory_allocated after set-up. Either way the number includes the weight gradients (V x H for the tied
embedding), the same in every variant. Time: the median of --repeats steps (gradients reset between them); the
variants' processes take turns step by step, so a load change on a shared machine hits all of them alike.
"""
import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_losses import current_rss_bytes, peak_rss_bytes  # noqa: E402
from dataset.collators import IGNORE_INDEX  # noqa: E402
from model import Qwen3Config, create_model  # noqa: E402
from trainer.losses import chunked_sft_loss, completion_hidden, sft_loss  # noqa: E402
from model.precision import DTYPE_CHOICES, resolve_precision  # noqa: E402

GIB = 1024 ** 3
VARIANTS = ("chunked", "sliced", "full")


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (ru_maxrss follows it) to the current RSS; False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ----------------------------------------------------------------------------------------------------------------
# the three ways to compute one step's summed loss

def chunked_step(model, batch, args):
    hidden, targets = completion_hidden(model, batch["input_ids"], batch["attention_mask"], batch["labels"])
    return chunked_sft_loss(hidden, model.lm_head.weight, targets, chunk_size=args.loss_chunk_size)


def sliced_step(model, batch, args):
    hidden, targets = completion_hidden(model, batch["input_ids"], batch["attention_mask"], batch["labels"])
    return sft_loss(model.lm_head(hidden), targets)


def full_step(model, batch, args):
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits  # (B, T, V)
    # position t predicts labels[t + 1]: shift the labels (pad the last position with -100), not the logits
    shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
    return sft_loss(logits, shifted)


STEPS = {"chunked": chunked_step, "sliced": sliced_step, "full": full_step}


# ----------------------------------------------------------------------------------------------------------------
# inputs

def model_config(args) -> Qwen3Config:
    if args.model_config:
        return Qwen3Config.from_json(args.model_config)
    return Qwen3Config(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                       intermediate_size=args.intermediate_size or 3 * args.hidden_size,
                       num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads,
                       num_key_value_heads=args.num_kv_heads, head_dim=args.hidden_size // args.num_heads,
                       max_position_embeddings=max(4096, args.seq_len), tie_word_embeddings=True)


def make_batch(args, vocab_size: int, device) -> dict:
    """Left-padded rows of seq_len tokens: padding, prompt, then completion_len completion tokens (the labels)."""
    g = torch.Generator().manual_seed(0)
    B, T, C = args.batch_size, args.seq_len, args.completion_len
    input_ids = torch.randint(0, min(vocab_size, 151643), (B, T), generator=g)  # real tokens, below the specials
    attention_mask = torch.ones(B, T, dtype=torch.long)
    labels = input_ids.clone()
    labels[:, :T - C] = IGNORE_INDEX
    for r in range(B):
        pad = min(r * args.pad_step, T - C - 1)
        input_ids[r, :pad] = min(151643, vocab_size - 1)  # Qwen3's pad token <|endoftext|> (or the last id)
        attention_mask[r, :pad] = 0
    return {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device),
            "labels": labels.to(device)}


# ----------------------------------------------------------------------------------------------------------------
# one variant per worker process: set up once, then steps on request (the parent alternates the variants)

_worker: dict = {}


def setup_worker(name: str, args: argparse.Namespace) -> None:
    """Pool initializer. An exception here would make the Pool restart the worker forever: keep it for the first
    task to raise instead."""
    try:
        _setup_worker(name, args)
    except Exception:  # not swallowed: kept and re-raised by the first task (see _worker_state)
        _worker["error"] = traceback.format_exc()


def _worker_state() -> dict:
    if "error" in _worker:
        raise RuntimeError(f"set-up of the benchmark process failed:\n{_worker['error']}")
    return _worker


def _setup_worker(name: str, args: argparse.Namespace) -> None:
    """Model, batch, a toy warm-up step, then the memory baseline and a reset peak."""
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    config = model_config(args)
    model = create_model(config, seed=0, device=device).train()
    model.gradient_checkpointing = bool(args.gradient_checkpointing)
    batch = make_batch(args, config.vocab_size, device)
    # Warm up on a toy slice (kernels, thread pool, autograd engine: a few hundred MB unrelated to the loss).
    tiny = {k: v[:1, -16:] for k, v in batch.items()}
    with resolve_precision(args.device, args.dtype).autocast():
        STEPS[name](model, tiny, args)[0].backward()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline, peak_was_reset = torch.cuda.memory_allocated(), True
    else:
        baseline, peak_was_reset = current_rss_bytes(), reset_peak_rss()
    _worker.update(name=name, args=args, device=device, model=model, batch=batch, baseline=baseline,
                   peak_was_reset=peak_was_reset)


def timed_step() -> dict:
    """One training step (gradients reset first, as optimizer.zero_grad(set_to_none=True) would): seconds."""
    w = _worker_state()
    model, args = w["model"], w["args"]
    model.zero_grad(set_to_none=True)

    def now():
        if w["device"].type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()
    start = now()
    with resolve_precision(args.device, args.dtype).autocast():
        loss_sum, num_tokens = STEPS[w["name"]](model, w["batch"], args)
    middle = now()
    loss_sum.backward()
    end = now()
    w["loss"], w["tokens"] = loss_sum.item(), num_tokens.item()
    return {"forward": middle - start, "backward": end - middle}


def report() -> dict:
    w = _worker_state()
    peak = torch.cuda.max_memory_allocated() if w["device"].type == "cuda" else peak_rss_bytes()
    return {"extra_bytes": peak - w["baseline"], "baseline_bytes": w["baseline"],
            "loss": w["loss"] / max(w["tokens"], 1), "tokens": w["tokens"],
            "grad_norm": w["model"].lm_head.weight.grad.float().norm().item(),
            "peak_was_reset": w["peak_was_reset"], "parameters": w["model"].num_parameters()}


# ----------------------------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # batch
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=1024, help="tokens per row, prompt + completion")
    parser.add_argument("--completion_len", type=int, default=512, help="completion (label) tokens per row")
    parser.add_argument("--pad_step", type=int, default=64, help="row r starts with r * pad_step padding tokens")
    # model (ignored with --model_config)
    parser.add_argument("--model_config", default=None, help="an HF config.json to take the model's shape from")
    parser.add_argument("--vocab_size", type=int, default=151936)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--intermediate_size", type=int, default=0, help="0: 3 x hidden_size")
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--num_kv_heads", type=int, default=2)
    parser.add_argument("--gradient_checkpointing", type=int, default=0, choices=[0, 1])
    # loss
    parser.add_argument("--loss_chunk_size", type=int, default=512, help="positions per lm_head chunk (ours)")
    # run
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                        help="as the trainers' --dtype (auto: bf16 autocast on CUDA, fp32 elsewhere)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0 = torch's default); 1 gives steadier times on a shared machine")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per variant (median reported)")
    parser.add_argument("--variants", default="chunked,full", help=f"comma-separated subset of {','.join(VARIANTS)}")
    args = parser.parse_args()
    variants = args.variants.split(",")
    if any(v not in VARIANTS for v in variants):
        parser.error(f"--variants must be a comma-separated subset of {','.join(VARIANTS)}, got {args.variants}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda asked but CUDA is not available; use --device cpu")
    if not 0 < args.completion_len < args.seq_len:
        parser.error(f"need 0 < --completion_len ({args.completion_len}) < --seq_len ({args.seq_len})")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    config = model_config(args)
    B, T, V = args.batch_size, args.seq_len, config.vocab_size
    dtype = resolve_precision(args.device, args.dtype).name
    print(f"SFT step (forward + loss + backward), batch {B} x {T} tokens ({args.completion_len} completion, "
          f"{B * args.completion_len} loss tokens), vocab {V}, hidden {config.hidden_size}, "
          f"{config.num_hidden_layers} layers, {args.device} {dtype}, "
          f"{args.threads or torch.get_num_threads()} threads; "
          f"one fp32 (B, T, V) tensor = {B * T * V * 4 / GIB:.2f} GiB", flush=True)
    # One fresh 'spawn' process per variant, so each peak is its own; they are set up together, then step in turn
    # (chunked, full, chunked, full, ...) so that a load change on a shared machine hits every variant alike.
    ctx = mp.get_context("spawn")
    pools = {name: ctx.Pool(1, initializer=setup_worker, initargs=(name, args)) for name in variants}
    try:
        times = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name in variants:
                times[name].append(pools[name].apply(timed_step))
        results = {name: pools[name].apply(report) for name in variants}
    finally:
        for pool in pools.values():
            pool.close()
            pool.join()
    for name, r in results.items():
        r["seconds"] = statistics.median(t["forward"] + t["backward"] for t in times[name])
        forward = statistics.median(t["forward"] for t in times[name])
        backward = statistics.median(t["backward"] for t in times[name])
        steps = " / ".join(f"{t['forward'] + t['backward']:.1f}" for t in times[name])
        note = "" if r["peak_was_reset"] else " (peak not resettable here: includes set-up transients)"
        print(f"{name:>8}: peak extra memory {r['extra_bytes'] / GIB:6.2f} GiB   step {r['seconds']:6.2f} s "
              f"(forward + loss {forward:.2f}, backward {backward:.2f}; median of {steps})   "
              f"loss {r['loss']:.6f} over {r['tokens']} tokens   |grad lm_head| {r['grad_norm']:.6g}{note}", flush=True)
    print(f"model: {results[variants[0]]['parameters'] / 1e6:.1f}M parameters; memory once model + batch exist: "
          f"{results[variants[0]]['baseline_bytes'] / GIB:.2f} GiB ({'allocated' if args.device != 'cpu' else 'RSS'})")
    losses = [r["loss"] for r in results.values()]
    if max(losses) - min(losses) > 1e-4 * max(abs(x) for x in losses):
        print(f"WARNING: the variants' losses differ ({losses}); they should compute the same cross entropy")
    if "chunked" in results and "full" in results:
        ours, full = results["chunked"], results["full"]
        ratio = ours["extra_bytes"] / full["extra_bytes"]
        verdict = "meets" if ratio <= 0.40 else "misses"
        time_ratio = ours["seconds"] / full["seconds"]
        print(f"chunked / full memory: {ratio:.1%} ({verdict} the <= 40% target); time ratio {time_ratio:.2f}x")


if __name__ == "__main__":
    main()
