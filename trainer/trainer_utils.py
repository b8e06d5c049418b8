"""The shared skeleton of the three training loops: the mechanics, one call away from the algorithm.

What lives here: the cosine LR, mixed precision, the data stream (a world-size-invariant sampler grouped into
accumulation windows, resumable), exact loss normalisation over the window and all ranks, gradient clipping, the
window's metrics (one all-reduce), logging (console, metrics.jsonl, swanlab), the run lock, graceful stops, atomic
resume checkpoints and the HF export. What does not: flags and loading (trainer/setup.py), collation, generation,
forward passes and losses -- those are the algorithm, and each script spells them out, together with what happens at
the end of every step (optimizer step, log, save when due, evaluate when due, stop when done).

The normalisation invariant (docs/architecture.md): an optimizer step's gradient is the gradient of
    (sum of token losses over the whole accumulation window and all ranks) / (number of loss tokens in it).
Every micro-step backwards its *summed* loss; at the end of the window the token count is all-reduced and the
gradients are scaled once, before clipping. A mean per micro-batch divided by accumulation_steps would weight a
short completion's tokens more than a long one's, and a short tail window would be divided by too much.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import glob
import json
import math
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm import tqdm

from common.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, RuntimeFailure, Stopped, UserError
from common.files import (atomic_write, check_free_space, process_start_time, raise_disk_error,
                          remove_stale_temporaries)
from common.seeds import derived_seed, seed_everything
from model import DTYPES, save_pretrained
from trainer.sampler import EpochSampler, SkipBatchSampler, batches_to_skip
from trainer.guard import take_noted_stop_signal
from trainer.setup import DistInfo, check_run_name, check_save_time, print0, resume_change_names
from trainer.sharding import full_weights, is_sharded, load_shards, remove_other_shards, save_shards, shard
from trainer.tracking import init_tracker, trained_dtype

CHECKPOINT_FORMAT = 1


# ----------------------------------------------------------------------------------------------------------------
# schedule, precision, collectives

def get_lr(step: int, total_steps: int, lr: float, warmup_steps: int = 0) -> float:
    """Linear warm-up, then cosine from lr down to 10% of lr, indexed by optimizer step (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def autocast_context(device: str, dtype_name: str):
    """bf16/fp16 autocast on CUDA; on CPU we train in plain fp32 (CPU autocast is slow and rarely what you want)."""
    dtype = trained_dtype(device, dtype_name)
    return contextlib.nullcontext() if dtype == "float32" else torch.autocast("cuda", dtype=DTYPES[dtype])


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


# ----------------------------------------------------------------------------------------------------------------
# the run: data stream, exact accumulation, optimizer step, logging, checkpoints

@dataclass
class RunState:
    epoch: int = 0
    step: int = 0                    # optimizer steps done
    samples_in_epoch: int = 0        # global samples consumed in the current epoch (a multiple of the global batch)
    swanlab_run_id: str | None = None


class WindowMetrics:
    """The numbers of one accumulation window, summed over its micro-batches and reduced over all ranks in one
    all-reduce at the optimizer step. Each name says how it is reduced:

        token_mean(name, sum)     a sum over loss tokens, logged per loss token of the whole window (loss, ce, kd)
        ratio(name, num, den)     sum of numerators / sum of denominators (eos_share = rows ended / rows)
        total(name, value)        a plain sum (tokens, generated_tokens)
        rank_mean(name, value)    the mean over ranks of a per-rank number (seconds spent in a phase)

    Every rank must add the same names (they travel in one tensor, in sorted order)."""

    def __init__(self, device: str):
        self.device = device
        self.kinds: dict[str, str] = {}
        self.sums: dict[str, list[torch.Tensor]] = {}

    def _add(self, kind: str, name: str, *values) -> None:
        if self.kinds.setdefault(name, kind) != kind:
            raise ValueError(f"metric {name!r} is a {self.kinds[name]}, not a {kind}")
        tensors = [torch.as_tensor(v).detach().to(self.device, torch.float64) for v in values]
        self.sums[name] = [old + new for old, new in zip(self.sums[name], tensors)] if name in self.sums else tensors

    def token_mean(self, name: str, value) -> None:
        self._add("token_mean", name, value)

    def ratio(self, name: str, numerator, denominator) -> None:
        self._add("ratio", name, numerator, denominator)

    def total(self, name: str, value) -> None:
        self._add("total", name, value)

    def rank_mean(self, name: str, value) -> None:
        self._add("rank_mean", name, value)

    def reduce(self, info: DistInfo, extra: float = 0.0) -> tuple[dict[str, float], float]:
        """-> (name -> value, the all-ranks sum of `extra`), and start the next window empty. `extra` rides along
        in the same all-reduce (the stop flag: one collective per step, not two)."""
        names = sorted(self.sums)
        flat = [t for name in names for t in self.sums[name]]
        reduced = all_reduce_sum(torch.stack([*flat, torch.tensor(extra, dtype=torch.float64, device=self.device)]),
                                 info).tolist()
        sums, position = {}, 0
        for name in names:
            width = len(self.sums[name])
            sums[name], position = reduced[position:position + width], position + width
        tokens = max(sums.get("tokens", [0.0])[0], 1.0)
        divisor = {"token_mean": lambda _: tokens, "ratio": lambda s: max(s[1], 1e-12), "total": lambda _: 1.0,
                   "rank_mean": lambda _: info.world_size}
        values = {name: sums[name][0] / divisor[self.kinds[name]](sums[name]) for name in names}
        self.kinds, self.sums = {}, {}
        return values, reduced[-1]


class Run:
    """The mechanics of one training run. A script calls, in this order:

        run = Run(args, dist_info, model, dataset, collate_fn, tokenizer_dir)   # lock, DDP, optimizer, resume
        for epoch, window in run.windows():          # from where the run stands to the end of the last epoch
            for i, batch in enumerate(window):
                with run.micro_step(i, len(window)):  run.backward(loss_sum, num_tokens)
            metrics = run.optimizer_step()
            run.log(metrics)
            if run.save_due(): run.save()
            ... evaluate when due ...
            if run.done or run.stop_signal: break
        run.finish()                                 # after a stop signal: exits 75 / 130 with how to continue

    `run.metrics` takes the loop's own numbers for the window (see WindowMetrics)."""

    def __init__(self, args: argparse.Namespace, info: DistInfo, model: torch.nn.Module, dataset, collate_fn,
                 tokenizer_dir: str | None):
        self.args, self.dist, self.device = args, info, info.device
        # ranks must not draw the same random numbers (dropout, sampling); the data order does not depend on these
        # generators at all, it is a function of (seed, epoch) in EpochSampler
        seed_everything(derived_seed(args.seed, info.rank))
        self.tokenizer_dir = tokenizer_dir
        self.dataset, self.collate_fn = dataset, collate_fn
        self.raw_model = model
        self.raw_model.gradient_checkpointing = bool(args.gradient_checkpointing)
        # --fsdp 1: sharded over the ranks (trainer/sharding.py); checkpoints are written shard by shard either way,
        # so that a sharded run can resume on one process and the other way round
        self.sharded = bool(args.fsdp)
        if self.sharded and info.enabled:
            shard(self.raw_model, self.device, args.dtype)
        if args.use_compile:
            self.raw_model.compile_layers()  # per layer: DDP / FSDP communication overlaps the backward
        self.model = self.raw_model
        if info.enabled and not self.sharded:
            self.model = DistributedDataParallel(self.model, device_ids=[info.local_rank]
                                                 if self.device.startswith("cuda") else None)
        self.optimizer = torch.optim.AdamW(self.raw_model.parameters(), lr=args.learning_rate,
                                           weight_decay=args.weight_decay, betas=(0.9, 0.95))
        use_fp16 = self.device.startswith("cuda") and args.dtype == "float16"
        self.scaler = torch.amp.GradScaler("cuda", enabled=use_fp16)
        # Micro-step losses are sums; dividing them by a fixed constant keeps fp16 gradients in range. The constant
        # is undone exactly when the window's gradients are scaled by constant * world_size / global_tokens.
        self.loss_divisor = float(args.batch_size * args.max_length)

        self.global_batch = args.batch_size * args.accumulation_steps * info.world_size
        self.steps_per_epoch = math.ceil(self.micro_batches_per_epoch() / args.accumulation_steps)
        self.total_steps = args.epochs * self.steps_per_epoch
        if args.max_steps:
            self.total_steps = min(self.total_steps, args.max_steps)
        self.warmup_steps = int(args.warmup_ratio * self.total_steps)
        if info.enabled:  # refused before anything is written: rank 0 saves alone while the others wait
            check_save_time(self.rank0_save_bytes(), args.dist_timeout)

        self.out_prefix = os.path.join(args.save_dir, args.save_weight)
        self.resume_path = f"{self.out_prefix}_resume.pt"
        self.metrics_path = f"{self.out_prefix}_metrics.jsonl"
        self.lock = RunLock(f"{self.out_prefix}.lock") if info.is_main else None
        self.prepare_save_dir()
        self.state = RunState()
        if args.from_resume:
            try:
                self.resume()
            except BaseException:
                if self.lock:
                    self.lock.release()  # a refused resume leaves the folder as it found it
                raise
        self.tracker = init_tracker(args, self.state, info.is_main,
                                    effective={"device": info.device, "world_size": info.world_size,
                                               "dtype": trained_dtype(info.device, args.dtype),
                                               "data_path": os.path.abspath(dataset.path)})
        self.metrics_file = open_metrics(self.metrics_path, self.state.step) if info.is_main else None
        self.metrics = WindowMetrics(self.device)
        self.saved_step = self.state.step if args.from_resume and os.path.exists(self.resume_path) else None
        self.finished_before = self.saved_step is not None and self.done  # a finished run resumed as it was
        self.stop_request = StopRequest(self)
        self.stop_signal = 0
        self.timer = StepTimer()
        print0(f"{info.world_size} rank(s) x batch {args.batch_size} x accumulation {args.accumulation_steps} = "
               f"{self.global_batch} rows/step | {len(dataset)} rows | {self.total_steps} steps | "
               f"{self.raw_model.num_parameters() / 1e6:.1f}M params | {self.device}")
        self.progress = Progress(self.total_steps, self.state.step, enabled=info.is_main)

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.state.step

    @property
    def done(self) -> bool:
        """All epochs, or --max_steps, done."""
        return self.state.step >= self.total_steps

    # -- data ---------------------------------------------------------------------------------------------------

    def micro_batches_per_epoch(self) -> int:
        per_rank = len(self.dataset) // self.dist.world_size
        return math.ceil(per_rank / self.args.batch_size)

    def windows(self):
        """Yield (epoch, window) from where the run stands to the end of its last epoch: a window is a list of up to
        accumulation_steps collated micro-batches (an epoch's last, shorter window is a step of its own). A resumed
        run starts in its checkpoint's epoch, after the samples it had consumed; one that is already complete
        yields nothing. Ends early only when the loop breaks (--max_steps, a stop signal)."""
        first_epoch = self.args.epochs if self.done else self.state.epoch
        for epoch in range(first_epoch, self.args.epochs):
            skip = 0
            if epoch == self.state.epoch:
                skip = batches_to_skip(self.state.samples_in_epoch, self.dist.world_size, self.args.batch_size)
            else:
                self.state.epoch, self.state.samples_in_epoch = epoch, 0
            sampler = EpochSampler(len(self.dataset), self.args.seed, epoch, self.dist.rank, self.dist.world_size)
            batches = SkipBatchSampler(sampler, self.args.batch_size, skip)
            loader = DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collate_fn,
                                num_workers=self.args.num_workers)
            window = []
            for batch in loader:
                window.append(batch)
                if len(window) == self.args.accumulation_steps:
                    yield epoch, window
                    window = []
            if window:
                yield epoch, window

    def micro_step(self, index: int, window_size: int):
        """Context for one micro-batch's forward *and* backward: DDP syncs gradients only on the window's last, and
        FSDP reduce-scatters them only then."""
        if is_sharded(self.raw_model):
            self.raw_model.set_requires_gradient_sync(index == window_size - 1)
        elif self.dist.enabled and index < window_size - 1:
            return self.model.no_sync()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def fail_together(self, can_fail: bool = True):
        """Around work that can fail on one rank (a server that died or answers wrong): one all-reduce afterwards
        tells every rank whether all succeeded. If any failed, every rank saves the last completed step (when it is
        not saved yet) and stops with the error: no rank trains on a partial batch, none waits forever in a
        collective, and nothing done is lost. `can_fail=False` (no server involved): no all-reduce at all."""
        if not can_fail:
            yield
            return
        error = None
        try:
            yield
        except RuntimeFailure as failure:
            error = failure
        failed = all_reduce_sum(torch.tensor([float(error is not None)], device=self.device), self.dist).item()
        if not failed:
            return
        reason = str(error).rstrip(".") if error else "another rank failed (its message is above)"
        if self.state.step == 0:
            raise RuntimeFailure(f"{reason}; nothing was trained yet: run the same command again")
        if self.saved_step != self.state.step:
            self.save()
        where = (f"checkpoint {self.resume_path} (step {self.state.step}); continue with the same command and "
                 f"--from_resume 1")
        raise RuntimeFailure(f"{reason}; {where}")

    def autocast(self):
        """Context for the forward passes only (backward under autocast is not recommended by PyTorch)."""
        return autocast_context(self.device, self.args.dtype)

    def backward(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor | int) -> None:
        """Backward a micro-batch's *summed* loss; its sum and token count join the window's metrics (no device
        sync: they are reduced at the optimizer step)."""
        self.scaler.scale(loss_sum / self.loss_divisor).backward()
        self.metrics.token_mean("loss", loss_sum)
        self.metrics.total("tokens", num_tokens)

    def optimizer_step(self) -> dict:
        """Exact normalisation over the window and all ranks, clip, step. Returns the window's metrics."""
        args, state = self.args, self.state
        values, stop = self.metrics.reduce(self.dist, float(self.stop_request.signal))
        # a signal that reached only some ranks stops all of them after this same step
        self.stop_signal = self.stop_request.signal or (signal.SIGTERM if stop else 0)
        global_tokens = values["tokens"]
        lr = get_lr(state.step, self.total_steps, args.learning_rate, self.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaler.unscale_(self.optimizer)
        # DDP averaged the gradients over ranks; the micro-steps divided by loss_divisor: undo both, divide by tokens.
        scale = self.loss_divisor * self.dist.world_size / max(global_tokens, 1.0)
        # one foreach call (a few fused kernels) instead of a kernel per parameter; sharded gradients are scaled
        # shard by shard: the same arithmetic
        torch._foreach_mul_([p.grad for p in self.raw_model.parameters() if p.grad is not None], scale)
        max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # sharded: the global norm
        if not math.isfinite(grad_norm) and not self.scaler.is_enabled():
            raise RuntimeFailure(f"step {state.step + 1}: non-finite gradient norm ({grad_norm}); stopping "
                                 f"before it reaches the weights. Lower --learning_rate or check the data.")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

        state.step += 1
        state.samples_in_epoch += self.global_batch  # nominal for a short tail window: the epoch ends there
        elapsed = self.timer.tick(global_tokens)
        # epochs counted from 1 wherever a person reads them: metrics.jsonl, the tracker, the console
        return {"step": state.step, "epoch": state.epoch + 1, "loss": values.pop("loss"), "lr": lr,
                "grad_norm": grad_norm, "tokens": int(values.pop("tokens")),
                "tokens_per_s": self.timer.tokens_per_s(), "step_ms": elapsed * 1000.0, **values}

    # -- logging --------------------------------------------------------------------------------------------------

    def log(self, metrics: dict, show: tuple[str, ...] = ()) -> None:
        """Rank 0: every step, the full metrics to metrics.jsonl and the tracker (its charts get every point) and
        the progress bar; every --log_interval steps, the first, the last and the one a stop signal ends on, one
        console line of at most 120 characters (with the loop's own numbers named in `show`, as many as fit)."""
        step = self.state.step
        if not self.dist.is_main:
            return
        self.metrics_file.write(json.dumps(metrics) + "\n")
        self.metrics_file.flush()
        self.tracker.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
        eta = self.timer.eta(step, self.total_steps)
        self.progress.update(step, metrics, eta)
        if not (step % self.args.log_interval == 0 or step == 1 or self.done or self.stop_signal):
            return
        self.progress.write(console_line(metrics, self.args.epochs, self.total_steps, eta, show))

    def log_eval(self, metrics: dict) -> None:
        """An evaluation's numbers, at the current step, logged by rank 0 (with --fsdp 1 every rank evaluates)."""
        if not self.dist.is_main:
            return
        record = {"step": self.state.step, **metrics}
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        self.tracker.log(metrics, step=self.state.step)
        self.progress.write(f"eval at step {self.state.step} | "
                            + " ".join(format_metric(k.removeprefix("eval/"), v) for k, v in metrics.items()))
        self.timer.last = time.perf_counter()  # evaluation time is not training time: keep it out of ms/step

    def save_due(self) -> bool:
        """Every --save_interval steps, at the last step, and after a stop signal."""
        return self.state.step % self.args.save_interval == 0 or self.done or bool(self.stop_signal)

    def gathered_weights(self) -> dict[str, torch.Tensor] | None:
        """Every rank calls this: with --fsdp 1 the whole weights, gathered to rank 0 (None elsewhere); without,
        None (the model holds them whole)."""
        return full_weights(self.raw_model) if is_sharded(self.raw_model) else None

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def save(self) -> None:
        """The HF folder, then the resume checkpoint (every rank's RNG gathered to rank 0), written by rank 0.

        The resume file is the commit point: it is written last, so whenever it says step N the export of step N is
        complete, and a run killed during an export resumes from the previous checkpoint and exports again."""
        rng = collect_rng_states(self.dist)
        # every rank checks (one filesystem): a refusal on rank 0 alone would leave the others in a collective
        check_free_space(self.args.save_dir, self.expected_save_bytes(), f"the checkpoint of step {self.state.step}")
        weights = self.gathered_weights()  # with --fsdp 1 a collective, as is writing the shards
        shards = None
        if self.sharded:
            shards = save_shards(self.out_prefix + "_resume", self.state.step, self.raw_model, self.optimizer,
                                 self.dist.is_main)
        if self.dist.is_main:
            checkpoint = {
                "format": CHECKPOINT_FORMAT,
                "model": None if shards else {k: v.detach().float().cpu()
                                              for k, v in self.raw_model.state_dict().items()},
                "optimizer": None if shards else self.optimizer.state_dict(),
                "shards": os.path.basename(shards) if shards else None,  # model + optimizer, in that folder
                "model_config": self.raw_model.config.to_hf_dict(),
                "scaler": self.scaler.state_dict(),
                "epoch": self.state.epoch, "step": self.state.step,
                "samples_in_epoch": self.state.samples_in_epoch, "global_batch": self.global_batch,
                "world_size": self.dist.world_size, "swanlab_run_id": self.state.swanlab_run_id,
                "args": vars(self.args), "rng": rng,
            }
            try:
                save_pretrained(self.raw_model, self.out_prefix, tokenizer_dir=self.tokenizer_dir, state=weights)
                with atomic_write(self.resume_path) as f:
                    torch.save(checkpoint, f)
                if shards:
                    remove_other_shards(self.out_prefix + "_resume", keep=shards)
            except (OSError, RuntimeError) as error:
                # torch.save reports a failed write as RuntimeError("unexpected pos ...") raised while handling it
                cause = error if isinstance(error, OSError) else error.__context__
                if not isinstance(cause, OSError):
                    raise
                raise_disk_error(cause, f"the checkpoint of step {self.state.step} to {self.args.save_dir} (the "
                                        f"previous checkpoint is intact)")
        self.saved_step = self.state.step
        if self.dist.enabled:
            dist.barrier()

    def expected_save_bytes(self) -> int:
        """Resume file (fp32 weights and AdamW's two moments) plus the HF export, both held beside the old ones."""
        weights = sum(p.numel() for p in self.raw_model.parameters())
        export = sum(p.numel() * p.element_size() for p in self.raw_model.parameters())
        return 3 * 4 * weights + export

    def rank0_save_bytes(self) -> int:
        """What rank 0 writes alone while the other ranks wait at the save's barrier: the resume file and the HF
        export; with --fsdp 1 the export only (every rank writes its own shards, the resume file holds no weights)."""
        if not self.sharded:
            return self.expected_save_bytes()
        return sum(p.numel() * p.element_size() for p in self.raw_model.parameters())

    def prepare_save_dir(self) -> None:
        """Rank 0, before anything is written: take the run lock, refuse to start over a run by accident (or set it
        aside when asked), and remove what killed runs of this name left half-written."""
        if not self.dist.is_main:
            return
        os.makedirs(self.args.save_dir, exist_ok=True)  # first created here: a run refused before leaves no folder
        self.lock.acquire()
        try:
            check_run_name(self.args)  # again, under the lock: another run may have saved since start-up
        except UserError:
            self.lock.release()
            raise
        if os.path.exists(self.resume_path) and not self.args.from_resume:
            aside = f"{self.out_prefix}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
            os.makedirs(aside)
            for path in (self.out_prefix, self.resume_path, self.metrics_path, *self.shard_folders()):
                if os.path.exists(path):
                    os.replace(path, os.path.join(aside, os.path.basename(path)))
            print0(f"--start_over 1: the previous run's files are in {aside}/")
        for path in (self.out_prefix, self.resume_path, self.metrics_path, *self.shard_folders()):
            for stale in remove_stale_temporaries(path):
                print0(f"removed {stale}, left half-written by a run that was killed")
        committed = self.committed_shards() if self.shard_folders() else False
        if committed is not False:
            for stale in remove_other_shards(self.out_prefix + "_resume", keep=committed):
                print0(f"removed {stale}, written by a run that was killed before it committed them")

    def shard_folders(self) -> list[str]:
        """The folders of sharded checkpoints of this run name (NAME_resume.shards-STEP-TOKEN)."""
        return glob.glob(f"{glob.escape(self.out_prefix)}_resume.shards-*")

    def committed_shards(self) -> str | None | bool:
        """The shard folder the resume file names; None when there is no resume file (nothing is committed);
        False when it cannot be read -- then no shard folder is touched, and resuming reports the damage."""
        if not os.path.exists(self.resume_path):
            return None
        try:
            checkpoint = torch.load(self.resume_path, map_location="cpu", weights_only=False)
        except Exception as error:  # torch raises several types for a damaged file: reported, not swallowed
            print0(f"{self.resume_path} cannot be read ({type(error).__name__}); its shard folders are left alone")
            return False
        shards = checkpoint.get("shards") if isinstance(checkpoint, dict) else None
        return os.path.join(self.args.save_dir, shards) if shards else None

    def resume(self) -> None:
        if not os.path.exists(self.resume_path):
            print0(f"--from_resume 1: no checkpoint at {self.resume_path}, starting from scratch")
            return
        checkpoint = load_checkpoint(self.resume_path, self.args, self.global_batch, self.raw_model)
        if checkpoint.get("shards"):  # every rank reads its part, resharded to this world size
            load_shards(os.path.join(self.args.save_dir, checkpoint["shards"]), self.raw_model, self.optimizer)
        else:
            self.raw_model.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scaler.load_state_dict(checkpoint["scaler"])
        self.state = RunState(checkpoint["epoch"], checkpoint["step"], checkpoint["samples_in_epoch"],
                              checkpoint["swanlab_run_id"])
        if self.state.samples_in_epoch >= (len(self.dataset) // self.dist.world_size) * self.dist.world_size:
            self.state.epoch, self.state.samples_in_epoch = self.state.epoch + 1, 0
        restore_rng_states(checkpoint["rng"], checkpoint["world_size"], self.dist, self.args.seed, self.state.step)
        ranks = checkpoint["world_size"]
        print0(f"resumed from {self.resume_path}: step {self.state.step}, epoch {self.state.epoch + 1} of "
               f"{self.args.epochs}, {self.state.samples_in_epoch} samples into it (saved by {ranks} "
               f"rank{'s' if ranks > 1 else ''})")

    def finish(self) -> None:
        """Close the logs and the lock. A run stopped by a signal before its end says how to continue and exits
        (75 for SIGTERM / SIGUSR1, 130 for Ctrl-C) with its checkpoint written."""
        self.close()
        if self.finished_before:
            print0(f"already finished: {self.resume_path} is at step {self.state.step} of {self.total_steps}, nothing "
                   f"to train. To train longer, raise --max_steps or --epochs and pass --resume_changes max_steps "
                   f"(or epochs): the learning-rate schedule is then recomputed over the new length")
            return
        if self.stop_signal and not self.done:
            raise Stopped(f"stopped by {signal.Signals(self.stop_signal).name} after step {self.state.step}: "
                          f"checkpoint {self.resume_path}; continue with the same command and --from_resume 1",
                          EXIT_INTERRUPTED if self.stop_signal == signal.SIGINT else EXIT_PREEMPTED)
        print0(f"done: {self.state.step} steps in {format_seconds(self.timer.elapsed())}"
               + (f", peak CUDA memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
                  if self.device.startswith("cuda") else "") + f" -> {self.out_prefix}/")

    def close(self) -> None:
        """Flush the logs, give back the lock, the signal handlers and the process group."""
        self.progress.close()
        self.stop_request.restore()
        self.tracker.finish()
        if self.metrics_file:
            self.metrics_file.close()
        if self.lock:
            self.lock.release()
        if self.dist.enabled:
            dist.barrier()
            dist.destroy_process_group()

    def last_checkpoint(self) -> str:
        if self.saved_step is None:
            return "no checkpoint yet"
        return f"last checkpoint {self.resume_path} (step {self.saved_step})"


def open_metrics(path: str, resumed_step: int):
    """metrics.jsonl for appending. A resumed run keeps the lines up to its checkpoint's step and drops those the
    killed run logged after it (they are logged again), so every step appears once. A fresh run starts it anew."""
    kept = []
    if resumed_step and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resumed_step]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(kept)
    return open(path, "a", encoding="utf-8")


# Flags that may differ on resume: they change how the run is executed or logged, not what it computes. Any other
# change (its length -- --max_steps, --epochs --, the schedule, the data) is refused unless --resume_changes names it.
RESUMABLE_CHANGES = {"from_resume", "device", "num_workers", "log_interval", "save_interval", "use_swanlab",
                     "swanlab_mode", "swanlab_project", "batch_size", "accumulation_steps", "use_compile",
                     "gradient_checkpointing", "eval_interval", "eval_rows", "eval_data_path",
                     "eval_max_new_tokens", "save_dir", "start_over", "replicate_teacher", "dist_timeout",
                     "resume_changes"}



def load_checkpoint(path: str, args: argparse.Namespace, global_batch: int, model: torch.nn.Module) -> dict:
    """Read a resume checkpoint and check it belongs to this run; a damaged or foreign one is a clear error."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # torch raises several types for a truncated or corrupt zip; all mean the same
        raise UserError(f"{path} is damaged and cannot be read ({type(error).__name__}: {str(error)[:120]}). Restore "
                        f"it from a backup, or pass --start_over 1 (without --from_resume) to set it aside and start "
                        f"anew") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"{path} is not a resume checkpoint of this project (format "
                        f"{checkpoint.get('format') if isinstance(checkpoint, dict) else type(checkpoint).__name__})")
    if checkpoint["model_config"] != model.config.to_hf_dict():
        raise UserError(f"{path} was written for another model configuration; resume with the same "
                        f"--model_path/--model_config, or use another --save_weight")
    saved, accepted = checkpoint["args"], resume_change_names(args)
    changed = {k: (saved.get(k), v) for k, v in vars(args).items()
               if k not in RESUMABLE_CHANGES and k in saved and saved[k] != v}
    refused = {k: change for k, change in changed.items() if k not in accepted}
    if refused:
        details = ", ".join(f"--{k} {old!r} -> {new!r}" for k, (old, new) in refused.items())
        raise UserError(f"{path} was written with other settings ({details}), which would change what the run "
                        f"computes (its length, learning-rate schedule or data): resume with the original flags, "
                        f"accept the change with --resume_changes {','.join(refused)}, or use another --save_weight")
    if changed:
        details = ", ".join(f"--{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        print0(f"resuming with changed settings, as --resume_changes accepts: {details}")
    if checkpoint["global_batch"] != global_batch:
        raise UserError(f"{path}: global batch was {checkpoint['global_batch']} (world x batch x accumulation), "
                        f"now {global_batch}; keep the global batch to continue the same sample stream")
    return checkpoint


def collect_rng_states(info: DistInfo) -> list[dict] | None:
    """Every rank's RNG states, gathered to rank 0. CUDA: only the rank's own device (a resume on a node with
    fewer visible GPUs must still find each rank's state, and no rank draws on another's device)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state(info.device) if info.device.startswith("cuda") else None}
    if not info.enabled:
        return [state]
    gathered = [None] * info.world_size if info.is_main else None
    dist.gather_object(state, gathered, dst=0)
    return gathered


def restore_rng_states(states: list[dict], saved_world_size: int, info: DistInfo, seed: int, step: int) -> None:
    """Each rank takes back its own RNG state. After a world-size change there is no rank-to-rank mapping, so
    every rank re-seeds from (seed, rank, step) instead: reproducible, though not the uninterrupted stream."""
    if saved_world_size != info.world_size:
        seed_everything(derived_seed(seed, info.rank, step))
        return
    state = states[info.rank]
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and info.device.startswith("cuda"):
        torch.cuda.set_rng_state(state["cuda"], info.device)


# ----------------------------------------------------------------------------------------------------------------
# one run per name, and a graceful stop on a signal

class RunLock:
    """`SAVE_DIR/NAME.lock` (host, PID): a second run with the same name is refused, naming the holder. A lock left
    by a process that no longer runs on this host is taken over with a message; one from another host (a shared
    file system) is never guessed about."""

    def __init__(self, path: str):
        self.path, self.held = path, False
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start_time(os.getpid())}

    def acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                self.take_over_if_stale()
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.me, f)
            self.held = True
            atexit.register(self.release)  # a run that fails on an exception gives it back too; SIGKILL cannot
            return
        raise UserError(f"cannot take the run lock {self.path}: it keeps reappearing (another run is starting?)")

    def take_over_if_stale(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                holder = json.load(f)
        except (OSError, ValueError):
            holder = {}  # half-written by a process killed while taking it: nobody holds it
        same_host = holder.get("host") == self.me["host"]
        pid = holder.get("pid")
        start = process_start_time(pid) if isinstance(pid, int) else None
        alive = start is not None and start == holder.get("start")
        if holder and not same_host:
            raise UserError(f"{self.path}: a run of this name is held by PID {pid} on host {holder.get('host')}; "
                            f"wait for it or stop it, use another --save_weight, or delete the lock file if that "
                            f"run is gone")
        if alive and pid != os.getpid():
            raise UserError(f"{self.path}: a run of this name is in progress (PID {pid} on this host); wait for it "
                            f"or stop it (kill {pid}), or use another --save_weight")
        if holder and pid != os.getpid():
            print0(f"taking over {self.path}: its run (PID {pid}) is no longer running")
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)

    def release(self) -> None:
        if self.held:
            self.held = False
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)


class StopRequest:
    """SIGTERM / SIGUSR1 (a scheduler's preemption notice) and Ctrl-C: note the signal; the run finishes the current
    optimizer step on every rank, saves and stops (`Run.optimizer_step`). A second Ctrl-C stops at once, saying
    where the last checkpoint is."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, run: "Run"):
        self.run, self.signal = run, 0
        self.previous = {signum: signal.signal(signum, self.handle) for signum in self.SIGNALS}
        # a notice that arrived while the script was starting (trainer/guard.stop_signals_noted) counts from here
        noted = take_noted_stop_signal()
        if noted:
            self.handle(noted, None)

    def handle(self, signum: int, frame) -> None:
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            self.restore()
            raise Stopped(f"interrupted at step {self.run.state.step}: {self.run.last_checkpoint()}; continue with "
                          f"the same command and --from_resume 1", EXIT_INTERRUPTED)
        if self.signal:
            return
        self.signal = signum
        print0(f"\n{signal.Signals(signum).name}: finishing step {self.run.state.step + 1}, then saving and stopping"
               + (" (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""))

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}


# ----------------------------------------------------------------------------------------------------------------
# timers

class StepTimer:
    """Wall time per optimizer step, loss tokens/s, and an ETA. The first step (warm-up, compilation) is left out
    of the rates. ms/step leaves evaluations out (log_eval restarts the step clock); the ETA does not: it is the
    wall time per step since the first one, evaluations and saves included, times the steps left."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.steps_timed, self.time_timed, self.tokens_timed, self.ticks = 0, 0.0, 0.0, 0
        self.last_rate = 0.0
        self.first_step_end = None

    def tick(self, tokens: float) -> float:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        self.ticks += 1
        self.last_rate = tokens / max(elapsed, 1e-9)
        if self.ticks == 1:
            self.first_step_end = now
        else:
            self.steps_timed += 1
            self.time_timed += elapsed
            self.tokens_timed += tokens
        return elapsed

    def tokens_per_s(self) -> float:
        return self.tokens_timed / self.time_timed if self.time_timed else self.last_rate

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def eta(self, step: int, total: int) -> str:
        """"?" until a step after the first has been timed: the first one's warm-up would inflate it."""
        if not self.steps_timed:
            return "?"
        per_step = (time.perf_counter() - self.first_step_end) / self.steps_timed
        return format_seconds(per_step * (total - step))


class Progress:
    """A live progress bar (steps, elapsed, ETA, loss, lr, loss tokens/s) on rank 0 when stderr is a terminal; none
    in CI (the CI environment variable) or when the output is redirected, where the periodic log lines are the
    record. Its ETA is the log line's (StepTimer.eta), not tqdm's own estimate. Lines printed while the bar is up go
    through it, so they do not tear it."""

    def __init__(self, total: int, done: int, enabled: bool):
        show = enabled and sys.stderr.isatty() and not os.environ.get("CI")
        self.bar = tqdm(total=total, initial=done, unit="step", dynamic_ncols=True, disable=not show,
                        file=sys.stderr, bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]"
                        ) if show else None

    def update(self, step: int, metrics: dict, eta: str) -> None:
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(f"eta {eta}, loss {metrics['loss']:.4f} lr {metrics['lr']:.1e} "
                                     f"{metrics['tokens_per_s']:.0f} tok/s", refresh=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def console_line(metrics: dict, epochs: int, total_steps: int, eta: str, show: tuple[str, ...],
                 width: int = 120) -> str:
    """One step's console line: step, loss, lr, grad norm, loss tokens/s, ms per step, ETA, then the loop's own
    numbers named in `show`, as many as fit in `width` (the rest are in metrics.jsonl and the tracker)."""
    step = metrics["step"]
    epoch = f"epoch {metrics['epoch']}/{epochs} " if epochs > 1 else ""
    parts = [f"{epoch}step {step}/{total_steps} {100.0 * step / total_steps:.0f}%", f"loss {metrics['loss']:.4f}",
             f"lr {metrics['lr']:.1e}", f"gnorm {metrics['grad_norm']:.3g}", f"{metrics['tokens_per_s']:.0f} tok/s",
             f"{metrics['step_ms']:.0f} ms", f"eta {eta}"]
    extras = [format_metric(name, metrics[name]) for name in show if name in metrics]
    while extras and len(" | ".join(parts + [" ".join(extras)])) > width:
        extras.pop()
    return " | ".join(parts + ([" ".join(extras)] if extras else []))


def format_metric(name: str, value) -> str:
    """`gen_share 0.58` -> `gen 58%`, `accuracy 0.025` -> `accuracy 2.5%`; other numbers with 4 significant digits."""
    if name.endswith("_share"):
        return f"{name.removesuffix('_share')} {100.0 * value:.0f}%"
    if name == "accuracy":
        return f"accuracy {100.0 * value:.1f}%"
    return f"{name} {value:.4g}" if isinstance(value, float) else f"{name} {value}"


class PhaseClock:
    """Seconds spent per phase of a step (e.g. generation vs training), synchronising CUDA so the split is honest."""

    def __init__(self, device: str):
        self.device, self.seconds = device, {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def add_to(self, metrics: WindowMetrics) -> None:
        """PHASE_s (seconds, the mean over ranks) and PHASE_share (of all phases' time, over all ranks)."""
        total = sum(self.seconds.values())
        for phase, seconds in self.seconds.items():
            metrics.rank_mean(f"{phase}_s", seconds)
            metrics.ratio(f"{phase}_share", seconds, total)


def format_seconds(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
