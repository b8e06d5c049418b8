"""The shared skeleton of the three training loops: the mechanics, one call away from the algorithm.

What lives here (`Run`): the learning rate (`get_lr`, cosine), mixed precision, the data stream (a
world-size-invariant sampler grouped into accumulation windows, resumable), exact loss normalisation over the window
and all ranks, gradient clipping, the window's metrics (one all-reduce), logging (metrics.jsonl, swanlab), stopping
and failing together. Beside it: checkpoints (trainer/checkpoint.py), the run lock and the stop signals
(trainer/guard.py), the console's bar, lines and clocks (trainer/console.py). What does not live here: flags and
loading (trainer/setup.py), collation, generation, forward passes and losses -- those are the algorithm, and each
script spells them out, together with what happens at the end of every step (optimizer step, log, save when due,
evaluate when due, stop when done).

The normalisation invariant (docs/architecture.md): an optimizer step's gradient is the gradient of
    (sum of token losses over the whole accumulation window and all ranks) / (number of loss tokens in it).
Every micro-step backwards its *summed* loss; at the end of the window the token count is all-reduced and the
gradients are scaled once, before clipping. A mean per micro-batch divided by accumulation_steps would weight a
short completion's tokens more than a long one's, and a short tail window would be divided by too much.
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import signal
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from common.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, RuntimeFailure, Stopped
from common.seeds import derived_seed, seed_everything
from model.precision import resolve_precision
from trainer.checkpoint import Checkpoints, RunState, rank0_save_bytes
from trainer.console import Progress, StepTimer, console_line, format_metric, format_seconds
from trainer.guard import RunLock, StopRequest
from trainer.sampler import EpochSampler, SkipBatchSampler, batches_to_skip
from trainer.setup import DistInfo, check_save_time, print0
from trainer.tracking import init_tracker
from trainer.window_metrics import WindowMetrics, all_reduce_sum


# ----------------------------------------------------------------------------------------------------------------
# schedule

def get_lr(step: int, total_steps: int, lr: float, warmup_steps: int = 0) -> float:
    """Linear warm-up, then cosine from lr down to 10% of lr, indexed by optimizer step (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


# ----------------------------------------------------------------------------------------------------------------
# the run: data stream, exact accumulation, optimizer step, logging, checkpoints

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
        self.dataset, self.collate_fn = dataset, collate_fn
        # SFT has no teacher: its --teacher_dtype is the rule's default
        self.precision = resolve_precision(self.device, args.dtype, getattr(args, "teacher_dtype", None))
        self.raw_model, self.model = model, self.wrap(model)  # checkpointing, compile, DDP (FSDP: sharded already)
        self.optimizer, self.scaler = self.make_optimizer()
        self.global_batch, self.total_steps, self.warmup_steps = self.schedule()
        self.checkpoints = Checkpoints(args, info, tokenizer_dir)
        self.resume_path = self.checkpoints.resume_path
        self.out_prefix = self.checkpoints.prefix
        self.lock = self.take_run_name()
        self.state = self.start_or_resume()
        self.tracker, self.metrics_file = self.open_logs()
        self.metrics = WindowMetrics(self.device)
        self.saved_step = self.state.step if args.from_resume and os.path.exists(self.resume_path) else None
        self.finished_before = self.saved_step is not None and self.done  # a finished run resumed as it was
        self.stop_request, self.stop_signal = StopRequest(lambda: self.state.step, self.last_checkpoint), 0
        self.timer = StepTimer()
        print0(f"{info.world_size} rank(s) x batch {args.batch_size} x accumulation {args.accumulation_steps} = "
               f"{self.global_batch} rows/step | {len(dataset)} rows | {self.total_steps} steps | "
               f"{self.raw_model.num_parameters() / 1e6:.1f}M params | {self.device}")
        self.progress = Progress(self.total_steps, self.state.step, enabled=info.is_main)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Gradient checkpointing, --use_compile (each layer: DDP / FSDP communication overlaps the backward), and
        DDP across ranks. With --fsdp 1 the model arrived sharded (setup.build_model): no rank holds it whole."""
        model.gradient_checkpointing = bool(self.args.gradient_checkpointing)
        if self.args.use_compile:
            model.compile_layers()
        if not self.dist.enabled or self.args.fsdp:
            return model
        return DistributedDataParallel(model, device_ids=[self.dist.local_rank]
                                       if self.device.startswith("cuda") else None)

    def make_optimizer(self) -> tuple[torch.optim.Optimizer, torch.amp.GradScaler]:
        """AdamW over the fp32 master weights, and a GradScaler that is active for fp16 only (on any device)."""
        args = self.args
        optimizer = torch.optim.AdamW(self.raw_model.parameters(), lr=args.learning_rate,
                                      weight_decay=args.weight_decay, betas=(0.9, 0.95))
        return optimizer, self.precision.scaler()

    def schedule(self) -> tuple[int, int, int]:
        """(global batch, optimizer steps of the run, warm-up steps)."""
        args = self.args
        global_batch = args.batch_size * args.accumulation_steps * self.dist.world_size
        total_steps = args.epochs * math.ceil(self.micro_batches_per_epoch() / args.accumulation_steps)
        if args.max_steps:
            total_steps = min(total_steps, args.max_steps)
        return global_batch, total_steps, int(args.warmup_ratio * total_steps)

    @property
    def loss_divisor(self) -> float:
        """Micro-step losses are sums; dividing them by a fixed constant keeps fp16 gradients in range. The constant
        is undone exactly when the window's gradients are scaled by constant * world_size / global_tokens."""
        return float(self.args.batch_size * self.args.max_length)

    def take_run_name(self) -> RunLock | None:
        """Refused before anything is written when rank 0's save could outlast --dist_timeout; then rank 0 takes
        the run lock and prepares the folder (trainer/checkpoint.py)."""
        if self.dist.enabled:  # rank 0 saves alone while the others wait
            check_save_time(rank0_save_bytes(self.raw_model, bool(self.args.fsdp)), self.args.dist_timeout)
        lock = RunLock(f"{self.out_prefix}.lock") if self.dist.is_main else None
        self.checkpoints.prepare(lock)
        return lock

    def start_or_resume(self) -> RunState:
        """--from_resume 1: the checkpoint's state (a refused resume gives the lock back and leaves the folder as it
        found it); otherwise step 0."""
        if not self.args.from_resume:
            return RunState()
        try:
            return self.checkpoints.resume(self.raw_model, self.optimizer, self.scaler, self.global_batch,
                                           len(self.dataset))
        except BaseException:
            if self.lock:
                self.lock.release()
            raise

    def open_logs(self):
        """swanlab (rank 0; a resumed run continues its run id) with the run's effective settings, metrics.jsonl."""
        info = self.dist
        tracker = init_tracker(self.args, self.state, info.is_main,
                               effective={"device": info.device, "world_size": info.world_size,
                                          "dtype": self.precision.name,
                                          "data_path": os.path.abspath(self.dataset.path)})
        metrics_file = open_metrics(self.checkpoints.metrics_path, self.state.step) if info.is_main else None
        return tracker, metrics_file

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
        for epoch, window, _ in self.windows_ahead(0):
            yield epoch, window

    def windows_ahead(self, count: int):
        """As `windows`, with the next `count` steps too: (epoch, window, coming), `coming` the (step, epoch,
        window) of the optimizer steps after this one, up to `count` of them and none beyond the run's last
        (OPD's --max_staleness samples them ahead). The run's data position moves only as windows are yielded."""
        stream, step = self._stream(), self.state.step
        coming = list(itertools.islice(stream, count))
        while True:
            coming.extend(itertools.islice(stream, 1))  # one more, while the stream has any
            if not coming:
                return
            epoch, window = coming.pop(0)
            if epoch != self.state.epoch:  # the previous epoch is done: this one starts from its first sample
                self.state.epoch, self.state.samples_in_epoch = epoch, 0
            yield epoch, window, [(step + 1 + i, e, w) for i, (e, w) in enumerate(coming)
                                  if step + 1 + i < self.total_steps]
            step += 1

    def _stream(self):
        """(epoch, window) from the run's data position on, without moving it."""
        first_epoch = self.args.epochs if self.done else self.state.epoch
        for epoch in range(first_epoch, self.args.epochs):
            skip = 0
            if epoch == first_epoch:
                skip = batches_to_skip(self.state.samples_in_epoch, self.dist.world_size, self.args.batch_size)
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
        """Context for one micro-batch's forward *and* backward: DDP syncs gradients only on the window's last; FSDP
        reduce-scatters them after every backward, so each rank only ever holds its gradient shards
        (trainer/sharding.py)."""
        if self.dist.enabled and not self.args.fsdp and index < window_size - 1:
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
        return self.precision.autocast()

    def teacher_autocast(self):
        """Context for a frozen teacher's forwards: in the teacher's own dtype (model/precision.py), so that a bf16
        teacher of an fp16 run is not lowered to fp16 by the student's autocast."""
        return self.precision.teacher_autocast()

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
        # a non-finite loss is the data's or the model's, never fp16's range (the loss is summed in fp32): it stops
        # the run under a scaler too, which would otherwise skip every step from here on
        if not math.isfinite(values["loss"]) or (not math.isfinite(grad_norm) and not self.scaler.is_enabled()):
            raise RuntimeFailure(f"step {state.step + 1}: non-finite loss ({values['loss']}) or gradient norm "
                                 f"({grad_norm}); stopping before it reaches the weights. Lower --learning_rate "
                                 f"or check the data.")
        # fp16: GradScaler skips the step exactly when an unscaled gradient is inf or NaN, i.e. the norm is
        skipped = self.scaler.is_enabled() and not math.isfinite(grad_norm)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if skipped:
            state.skipped_steps += 1
            if self.dist.is_main:
                self.progress.write(f"step {state.step + 1}: fp16 gradients overflowed, the step was skipped and "
                                    f"the loss scale lowered to {self.scaler.get_scale():g} ({state.skipped_steps} "
                                    f"skipped in this run)")

        state.step += 1
        state.samples_in_epoch += self.global_batch  # nominal for a short tail window: the epoch ends there
        elapsed = self.timer.tick(global_tokens)
        # epochs counted from 1 wherever a person reads them: metrics.jsonl, the tracker, the console
        return {"step": state.step, "epoch": state.epoch + 1, "loss": values.pop("loss"), "lr": lr,
                "grad_norm": grad_norm, "tokens": int(values.pop("tokens")),
                "tokens_per_s": self.timer.tokens_per_s(), "step_ms": elapsed * 1000.0,
                **({"skipped_steps": state.skipped_steps} if self.scaler.is_enabled() else {}), **values}

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

    def save(self) -> None:
        """Every rank: the export and the resume file of this step (trainer/checkpoint.py: the resume file is the
        commit point, written last)."""
        self.checkpoints.save(self.raw_model, self.optimizer, self.scaler, self.state, self.global_batch)
        self.saved_step = self.state.step

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
