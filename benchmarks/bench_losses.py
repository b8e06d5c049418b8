"""Peak memory and time of chunked vs unchunked generalized JSD (reverse KL by default), forward + backward.

    python benchmarks/bench_losses.py                      # 4096 positions x 151,936 vocab x hidden 1024, CPU
    python benchmarks/bench_losses.py --device cuda        # same on a GPU (torch.cuda.max_memory_allocated)
    python benchmarks/bench_losses.py --positions 512 --vocab 32000   # a quick look
    python benchmarks/bench_losses.py --casts --hidden 256           # lm_head casts under bf16 autocast

--casts: the chunked loss's forward + backward under CPU bf16 autocast (what CUDA training does), counting the
full-size (V, H) casts of the lm_head weights (aten._to_copy, through a dispatch mode) and timing it, once with the
weights cast once per loss (`trainer.losses.autocast_once`, today) and once with autocast casting them at every
chunk's matmul (before: `autocast_once` giving no copy).

Each variant runs in a fresh 'spawn' process. On CPU, torch's allocations are invisible to tracemalloc, so the
number is the process's peak RSS (ru_maxrss) minus its RSS once the inputs exist; large CPU tensors are mmap'ed
and unmapped on free, so RSS follows live tensors closely. On CUDA it is max_memory_allocated minus the memory
allocated after set-up. Either way: the extra memory the loss and its backward need, inputs excluded
(the lm_head gradient, V x H, is included in both variants).
"""
import argparse
import multiprocessing as mp
import os
import resource
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import trainer.losses as losses  # noqa: E402
from trainer.losses import chunked_generalized_jsd_loss, generalized_jsd_loss  # noqa: E402

GIB = 1024 ** 3


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def unchunked_loss(h, w, th, tw, labels, beta, chunk_size):
    logits = h @ w.T
    with torch.no_grad():
        teacher_logits = th @ tw.T
    return generalized_jsd_loss(logits, teacher_logits, labels, beta=beta, reduction="sum")


def chunked(h, w, th, tw, labels, beta, chunk_size):
    loss, _ = chunked_generalized_jsd_loss(h, w, th, tw, labels, beta=beta, chunk_size=chunk_size)
    return loss


def run_variant(name: str, args: argparse.Namespace) -> dict:
    """Runs in a fresh process: build inputs, measure the baseline, forward + backward, measure the peak."""
    torch.manual_seed(0)
    device = torch.device(args.device)
    n, v, hdim = args.positions, args.vocab, args.hidden
    h = (torch.randn(n, hdim, device=device) * 0.5).requires_grad_()
    w = (torch.randn(v, hdim, device=device) * 0.05).requires_grad_()
    th = torch.randn(n, hdim, device=device) * 0.5
    tw = torch.randn(v, hdim, device=device) * 0.05
    labels = torch.randint(0, v, (n,), device=device)
    fn = unchunked_loss if name == "unchunked" else chunked
    # Warm up on a toy size first: the first backward loads kernels, starts the thread pool and the autograd
    # engine, a few hundred MB of RSS that have nothing to do with the loss.
    tiny = [x[:8, :] for x in (h, w, th, tw)]
    fn(*tiny, labels[:8] % 8, args.beta, 4).backward()
    w.grad = None
    h.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    else:
        baseline = current_rss_bytes()
    start = time.perf_counter()
    loss = fn(h, w, th, tw, labels, args.beta, args.chunk_size)
    loss.backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = peak_rss_bytes()
    seconds = time.perf_counter() - start
    return {"name": name, "extra_bytes": peak - baseline, "seconds": seconds, "loss": loss.item(),
            "grad_w_norm": w.grad.norm().item()}


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


def count_casts(args: argparse.Namespace, cast_once: bool) -> tuple[int, float]:
    """(full-size lm_head casts, seconds) of one chunked forward + backward under CPU bf16 autocast."""
    torch.manual_seed(0)
    n, v, hdim = args.positions, args.vocab, args.hidden
    h = (torch.randn(n, hdim) * 0.5).requires_grad_()
    w = (torch.randn(v, hdim) * 0.05).requires_grad_()
    th, tw = torch.randn(n, hdim) * 0.5, torch.randn(v, hdim) * 0.05
    labels = torch.randint(0, v, (n,))
    original = losses.autocast_once
    losses.autocast_once = original if cast_once else (lambda weight: None)
    try:
        start = time.perf_counter()
        with CountWeightCasts((v - 1) * hdim) as counter:  # vocab_size = v - 1: the sliced view, as in training
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = chunked_generalized_jsd_loss(h, w, th, tw, labels, beta=args.beta,
                                                       chunk_size=args.chunk_size, vocab_size=v - 1)
            loss.backward()
        return counter.count, time.perf_counter() - start
    finally:
        losses.autocast_once = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # problem size (defaults: Qwen3-0.6B's hidden and padded vocabulary)
    parser.add_argument("--positions", type=int, default=4096, help="loss positions N")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size V")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size H of student and teacher")
    # loss
    parser.add_argument("--beta", type=float, default=1.0, help="generalized JSD beta (1 = reverse KL, OPD)")
    parser.add_argument("--chunk_size", type=int, default=512, help="positions per chunk")
    # run
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--variants", default="unchunked,chunked", help="comma-separated subset to run")
    parser.add_argument("--casts", action="store_true", help="count and time the lm_head casts under bf16 autocast")
    args = parser.parse_args()
    if args.casts:
        chunks = -(-args.positions // args.chunk_size)
        print(f"chunked JSD under CPU bf16 autocast: {args.positions} positions in {chunks} chunks x {args.vocab} "
              f"vocab, hidden {args.hidden}; student and teacher lm_head both fp32")
        results = {}
        for name, cast_once in (("per chunk (before)", False), ("once per loss", True)):
            results[name] = count_casts(args, cast_once)
            print(f"{name:>19}: {results[name][0]:3d} full-size weight casts, {results[name][1]:6.2f} s", flush=True)
        before, after = results["per chunk (before)"], results["once per loss"]
        print(f"casts {before[0]} -> {after[0]}; time ratio before / after {before[1] / after[1]:.2f}x")
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda asked but CUDA is not available; use --device cpu")

    print(f"generalized JSD beta={args.beta}, {args.positions} positions x {args.vocab} vocab, hidden "
          f"{args.hidden}, fp32, {args.device}, chunk_size {args.chunk_size}; "
          f"one (N, V) fp32 tensor = {args.positions * args.vocab * 4 / GIB:.2f} GiB")
    ctx = mp.get_context("spawn")
    results = {}
    for name in args.variants.split(","):
        with ctx.Pool(1) as pool:   # a fresh process per variant: its peak RSS is its own
            r = pool.apply(run_variant, (name, args))
        results[name] = r
        print(f"{name:>10}: peak extra memory {r['extra_bytes'] / GIB:6.2f} GiB   time {r['seconds']:7.1f} s   "
              f"loss {r['loss']:.6g}   |grad w| {r['grad_w_norm']:.6g}", flush=True)
    if len(results) == 2:
        ratio = results["chunked"]["extra_bytes"] / results["unchunked"]["extra_bytes"]
        verdict = "meets" if ratio <= 0.25 else "misses"
        print(f"chunked / unchunked memory: {ratio:.1%} ({verdict} the <= 25% target); "
              f"time ratio {results['chunked']['seconds'] / results['unchunked']['seconds']:.2f}x")


if __name__ == "__main__":
    main()
