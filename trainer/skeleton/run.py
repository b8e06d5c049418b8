"""The run: one training run's mechanics, one call away from the algorithm. A script calls, in this order:

    run = Run(args, dist_info, model, dataset, collate_fn, tokenizer_dir, config.RESUMABLE)  # lock, DDP, resume, logs
    run.evaluate_when_due(evaluator)             # the baseline, before the first step
    for epoch, window in run.windows():          # from where the run stands to the end of the last epoch
        for i, batch in enumerate(window):
            with run.micro_step(i, len(window)):  run.backward(loss_sum, num_tokens)
        metrics = run.optimizer_step()
        if run.end_step(metrics, evaluator=evaluator):  # log; save and evaluate when due; True: done or stopped
            break
    run.finish()                                 # after a stop signal: exits 75 / 130 with how to continue

What the run does is in the files it calls: the data stream (trainer/skeleton/data_stream.py), the optimizer step and
its exact normalisation (trainer/skeleton/optimizer_step.py), checkpoints (trainer/skeleton/checkpoint.py), the run lock
and the stop signals (trainer/skeleton/guard.py), the logs (trainer/skeleton/run_log.py), the window's metrics
(trainer/skeleton/window_metrics.py), the precision rule (model/precision.py). What it does not do: collation,
generation, forward passes and losses -- those are the algorithm, and each script spells them out; what follows each
step (log, save, evaluate, stop) is one call of the run, `end_step`, that the script makes.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from common.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, RuntimeFailure, Stopped
from common.seeds import derived_seed, seed_everything
from model.lora import adapter_count, base_digest
from model.precision import resolve_precision
from trainer.skeleton.checkpoint import Checkpoints, rank0_save_bytes
from trainer.skeleton.console import format_seconds
from trainer.skeleton.data_stream import DataStream
from trainer.skeleton.distributed import DistInfo, check_save_time, print0
from trainer.skeleton.guard import RunLock, StopRequest
from trainer.skeleton.optimizer_step import get_lr, loss_divisor, make_optimizer, window_step
from trainer.skeleton.resume_checks import resume_change_names
from trainer.skeleton.run_log import RunLog
from trainer.skeleton.run_state import RunState
from trainer.skeleton.window_metrics import WindowMetrics, all_reduce_sum


class Run:
    def __init__(self, args: argparse.Namespace, info: DistInfo, model: torch.nn.Module, dataset, collate_fn,
                 tokenizer_dir: str | None, resumable: set[str], companions: tuple[str, ...] = ()):
        """`dataset`: the rows, cut into windows here with `collate_fn` (DataStream); or, with `collate_fn` None, a
        stream that cuts its own (train_pretrain.py's streamed corpus, trainer/skeleton/corpus_stream.py).
        `resumable`: the flags a resume may change without --resume_changes (the loop's config.RESUMABLE);
        `companions`: the models trained beside this one, each exported as NAME_COMPANION/ (PPO's "critic")."""
        self.args, self.dist, self.device = args, info, info.device
        # ranks must not draw the same random numbers (dropout, sampling); the data order does not depend on these
        # generators at all, it is a function of (seed, epoch) in the data stream
        seed_everything(derived_seed(args.seed, info.rank))
        # SFT has no teacher: its --teacher_dtype is the rule's default
        self.precision = resolve_precision(self.device, args.dtype, getattr(args, "teacher_dtype", None))
        # a LoRA student's frozen base, by its digest: every resume file names it, a resume onto another is refused
        self.base_digest = base_digest(model) if adapter_count(model) else None
        self.raw_model, self.model = model, self.wrap(model)  # checkpointing, compile, DDP (FSDP: sharded already)
        self.optimizer, self.scaler = make_optimizer(model, args), self.precision.scaler()  # the trained parameters
        self.checkpoints = Checkpoints(args, info, tokenizer_dir, resumable, resume_change_names(args),
                                       self.base_digest, companions)
        self.resume_path, self.out_prefix = self.checkpoints.resume_path, self.checkpoints.prefix
        self.stream = dataset if collate_fn is None else DataStream(dataset, collate_fn, args, info)
        self.global_batch, self.total_steps, self.warmup_steps = self.schedule()
        self.lock = self.take_run_name()
        self.state = self.start_or_resume()  # the run's state: this run alone moves it
        self.logs = RunLog(args, info, self.state, self.checkpoints.metrics_path, self.total_steps,
                           self.effective_settings())
        self.metrics = WindowMetrics(self.device)  # the window's numbers: the loop's own and the run's
        # the loss and tokens backwarded since the last update, and the tokens of this step's earlier updates
        # (`update`: PPO's minibatches)
        self.pending = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.updated_tokens, self.updates = 0.0, 0
        self.kept_rollouts = lambda: self.state.rollouts  # what a save keeps of the rollouts sampled ahead
        self.kept_states: dict[str, Callable[[], object]] = {}  # what a save keeps of the loop's own state
        self.saved_step = self.state.step if args.from_resume and os.path.exists(self.resume_path) else None
        # wall time of the processes before this one (a resumed run's "done" line counts the whole run)
        self.started_at_step, self.elapsed_before = self.state.step, self.state.elapsed_s
        self.finished_before = self.saved_step is not None and self.done  # a finished run resumed as it was
        self.stop_request, self.stop_signal = StopRequest(lambda: self.state.step, self.last_checkpoint), 0
        self.say_plan()
        if self.state.step == 0 and 0 in args.export_steps:  # the model as the run starts it (a LoRA student: its
            self.checkpoints.export_snapshot(model, 0)         # base as held, the adapters zero)

    # -- start-up -------------------------------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Gradient checkpointing, --packing, --use_compile (each layer: DDP / FSDP communication overlaps the
        backward), and DDP across ranks. With --fsdp 1 the model arrived sharded (loading.build_model): no rank
        holds it whole."""
        model.gradient_checkpointing = bool(self.args.gradient_checkpointing)
        model.pack_rows = bool(self.args.packing)  # completion_hidden's packed forward (trainer/losses/chunked.py)
        if self.args.use_compile:
            model.compile_layers()
        if not self.dist.enabled or self.args.fsdp:
            return model
        return DistributedDataParallel(model, device_ids=[self.dist.local_rank]
                                       if self.device.startswith("cuda") else None)

    def schedule(self) -> tuple[int, int, int]:
        """(global batch, optimizer steps of the run, warm-up steps)."""
        args = self.args
        global_batch = args.batch_size * args.accumulation_steps * self.dist.world_size
        total_steps = self.stream.planned_steps()
        if args.max_steps:
            total_steps = min(total_steps, args.max_steps)
        self.stream.total_steps = total_steps
        return global_batch, total_steps, int(args.warmup_ratio * total_steps)

    def take_run_name(self) -> RunLock | None:
        """Refused before anything is written when rank 0's save could outlast --dist_timeout; then rank 0 takes
        the run lock and prepares the folder (trainer/skeleton/checkpoint.py)."""
        if self.dist.enabled:  # rank 0 saves alone while the others wait
            check_save_time(rank0_save_bytes(self.raw_model, bool(self.args.fsdp), self.checkpoints.export_dtype),
                            self.args.dist_timeout)
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
                                           self.stream.rows)
        except BaseException:
            if self.lock:
                self.lock.release()
            raise

    def effective_settings(self) -> dict:
        """The settings as this run resolved them, for the tracker's config."""
        return {"device": self.device, "world_size": self.dist.world_size, "dtype": self.precision.name,
                "data_path": os.path.abspath(self.stream.path)}

    def say_plan(self) -> None:
        args = self.args
        print0(f"{self.dist.world_size} rank(s) x batch {args.batch_size} x accumulation {args.accumulation_steps} = "
               f"{self.global_batch} rows/step | {rows_of(self.stream)} | {self.total_steps} steps | "
               f"{self.raw_model.num_parameters() / 1e6:.1f}M params | {self.device}")
        if self.base_digest:
            adapters, lora = adapter_count(self.raw_model), self.raw_model.lora
            targets = ",".join(t.removesuffix("_proj") for t in lora["targets"])
            dtype = str(next(self.raw_model.parameters()).dtype).removeprefix("torch.")
            print0(f"LoRA rank {lora['rank']}, alpha {lora['alpha']:g} on {targets}: {adapters / 1e6:.2f}M trained "
                   f"({adapters / self.raw_model.num_parameters():.2%}), base frozen in {dtype}, lr "
                   f"{args.learning_rate:g}")
        if args.use_compile:  # one graph serves every layer; dynamo compiles it again, for any width, at a new one
            print0("decoder layers compiled (--use_compile): the first step compiles them, once more at the first new "
                   "batch width")
        if args.decode == "compiled":
            print0("decode step compiled (--decode): the first rollout or evaluation of each batch width compiles it, "
                   "once per run (on CUDA it is then one CUDA-graph replay per token)")

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.state.step

    @property
    def head(self) -> torch.Tensor:
        """The student's lm_head weight as the forward just run left it: read it after the forward (with --fsdp 1
        the root's gathered weight then; before, and after the backward, only this rank's shard)."""
        return self.raw_model.lm_head.weight

    @property
    def done(self) -> bool:
        """All epochs, or --max_steps, done."""
        return self.state.step >= self.total_steps

    # -- one optimizer step -----------------------------------------------------------------------------------------

    def windows(self):
        """Yield (epoch, window) from where the run stands to the end of its last epoch
        (trainer/skeleton/data_stream.py)."""
        for epoch, window, _ in self.windows_ahead(0):
            yield epoch, window

    def windows_ahead(self, count: int):
        """As `windows`, with the next `count` steps too: (epoch, window, coming) (DataStream.windows_ahead)."""
        state = self.state
        for epoch, window, coming in self.stream.windows_ahead(count, state.step, state.epoch, state.samples_in_epoch):
            if epoch != state.epoch:  # the previous epoch is done: this one starts from its first sample
                state.epoch, state.samples_in_epoch = epoch, 0
            yield epoch, window, coming

    def micro_step(self, index: int, window_size: int):
        """Context for one micro-batch's forward *and* backward: DDP syncs gradients only on the window's last; FSDP
        reduce-scatters them after every backward, so each rank only ever holds its gradient shards
        (trainer/skeleton/sharding.py)."""
        if self.dist.enabled and not self.args.fsdp and index < window_size - 1:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def autocast(self):
        """Context for the student's forward passes only (backward under autocast is not recommended by PyTorch)."""
        return self.precision.autocast()

    def teacher_autocast(self):
        """Context for a frozen model's forwards: in its own dtype (model/precision.py), so that a bf16 teacher of
        an fp16 run is not lowered to fp16 by the student's autocast."""
        return self.precision.teacher_autocast()

    def backward(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor | int) -> None:
        """Backward a micro-batch's *summed* loss; its sum and token count join the window's metrics (no device
        sync: they are reduced at the optimizer step)."""
        self.scaler.scale(loss_sum / loss_divisor(self.args)).backward()
        self.metrics.token_mean("loss", loss_sum)
        self.metrics.total("tokens", num_tokens)
        self.pending += torch.stack([torch.as_tensor(loss_sum).detach().double().to(self.device).reshape(()),
                                     torch.as_tensor(num_tokens, dtype=torch.float64, device=self.device)])

    def update(self) -> float:
        """An optimizer update inside the step, before its last (PPO's minibatches of one rollout batch): the
        gradients backwarded since the previous update, over all ranks, divided by their tokens, clipped, AdamW at
        the step's learning rate (`apply_update`). The step's last update is `optimizer_step`'s. -> the norm."""
        loss_sum, tokens = all_reduce_sum(self.pending.clone(), self.dist).tolist()
        self.updated_tokens += tokens
        return self.apply_update(tokens, loss_sum / max(tokens, 1.0))

    def apply_update(self, global_tokens: float, loss: float) -> float:
        """The pending gradients of `global_tokens` loss tokens (all ranks) whose mean loss is `loss`: exact
        normalisation, clip, AdamW (trainer/skeleton/optimizer_step.py) -> the gradient norm."""
        args, state = self.args, self.state
        lr = get_lr(state.step, self.total_steps, args.learning_rate, self.warmup_steps)
        # DDP averaged the gradients over ranks; the micro-steps divided by loss_divisor: undo both, divide by tokens
        scale = loss_divisor(args) * self.dist.world_size / max(global_tokens, 1.0)
        grad_norm, skipped = window_step(self.raw_model, self.optimizer, self.scaler, lr, scale, args.grad_clip,
                                         loss, state.step + 1)
        if skipped:
            state.skipped_steps += 1
            print0(f"step {state.step + 1}: fp16 gradients overflowed, the update was skipped and the loss scale "
                   f"lowered to {self.scaler.get_scale():g} ({state.skipped_steps} skipped in this run)")
        self.pending.zero_()
        self.updates += 1
        return grad_norm

    def optimizer_step(self) -> dict:
        """Exact normalisation over the window and all ranks, clip, step (trainer/skeleton/optimizer_step.py): the
        step's last update (its earlier ones `update`'s). Returns the window's metrics."""
        args, state = self.args, self.state
        values, stop = self.metrics.reduce(self.dist, float(self.stop_request.signal))
        # a signal that reached only some ranks stops all of them after this same step
        self.stop_signal = self.stop_request.signal or (signal.SIGTERM if stop else 0)
        global_tokens, loss = values.pop("tokens"), values.pop("loss")
        # the window's tokens are whole numbers in float64: what the earlier updates took leaves this one's exactly
        grad_norm = self.apply_update(global_tokens - self.updated_tokens, loss)
        updates, self.updated_tokens, self.updates = self.updates, 0.0, 0
        state.step += 1
        state.samples_in_epoch += self.global_batch  # nominal for a short tail window: the epoch ends there
        elapsed = self.logs.timer.tick(global_tokens)
        # epochs counted from 1 wherever a person reads them: metrics.jsonl, the tracker, the console
        lr = get_lr(state.step - 1, self.total_steps, args.learning_rate, self.warmup_steps)  # the step's rate
        return {"step": state.step, "epoch": state.epoch + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "tokens": int(global_tokens), "tokens_per_s": self.logs.timer.tokens_per_s(),
                "step_ms": elapsed * 1000.0, **({"updates": updates} if updates > 1 else {}),
                **({"skipped_steps": state.skipped_steps} if self.scaler.is_enabled() else {}), **values}

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
        raise RuntimeFailure(f"{reason}; checkpoint {self.resume_path} (step {self.state.step}); continue with the "
                             f"same command and --from_resume 1")

    # -- after the step: log, save, evaluate, stop ----------------------------------------------------------------

    def end_step(self, metrics: dict, show: tuple[str, ...] = (), evaluator=None,
                 before_save: Callable[[], None] | None = None, can_fail: bool = False) -> bool:
        """What follows every optimizer step, in this order: log the step's `metrics` (`show`: the loop's numbers on
        the console line); save when due, `before_save` first (the rollouts sampled ahead finish, to be kept); export
        a snapshot when --export_steps names the step; evaluate when due (`evaluate_when_due`). -> whether the run
        stops here: done, or a stop signal."""
        self.log(metrics, show)
        if self.save_due():
            if before_save is not None:
                before_save()
            self.save()
        if self.state.step in self.args.export_steps:
            self.checkpoints.export_snapshot(self.raw_model, self.state.step)
        self.evaluate_when_due(evaluator, can_fail)
        return self.done or bool(self.stop_signal)

    def evaluate_when_due(self, evaluator, can_fail: bool = False) -> None:
        """The held-out evaluation (trainer/evaluation/heldout.py) when it is due: before training (the baseline the
        later ones compare against), every --eval_interval steps and at the last step. `can_fail`: a teacher server
        is asked, so the ranks fail together (`fail_together`)."""
        if evaluator is None:
            return
        with self.fail_together(can_fail):
            if evaluator.due(self.state.step, self.done):
                self.log_eval(evaluator.evaluate(self.state.step, self.raw_model, self.autocast,
                                                 self.teacher_autocast))

    def log(self, metrics: dict, show: tuple[str, ...] = ()) -> None:
        """Rank 0: the step's metrics to metrics.jsonl, the tracker, the bar and the console
        (trainer/skeleton/run_log.py)."""
        self.logs.step(metrics, self.done, bool(self.stop_signal), show)

    def log_eval(self, metrics: dict) -> None:
        """An evaluation's numbers, at the current step, logged by rank 0 (with --fsdp 1 every rank evaluates)."""
        self.logs.evaluation(self.state.step, metrics)

    def save_due(self) -> bool:
        """Every --save_interval steps, at the last step, and after a stop signal."""
        return self.state.step % self.args.save_interval == 0 or self.done or bool(self.stop_signal)

    def keep_rollouts(self, kept: Callable[[], dict]) -> None:
        """The rollouts sampled ahead for coming steps (`kept()`: a copy of them, trainer/rollouts/source.py) go into
        every save from here on: a resumed run trains on them, from weights it no longer has."""
        self.kept_rollouts = kept

    def keep_state(self, name: str, state: Callable[[], object]) -> None:
        """A loop's own state (`state()`: rank 0's, the same on every rank) goes into every save from here on, under
        `name`; a resume finds it in `self.state.kept[name]` (a self-teacher's EMA)."""
        self.kept_states[name] = state

    def save(self) -> None:
        """Every rank: the export and the resume file of this step (trainer/skeleton/checkpoint.py: the resume file
        is the commit point, written last)."""
        self.state.elapsed_s = self.elapsed_before + self.logs.timer.elapsed()
        self.state.rollouts = self.kept_rollouts()
        self.state.kept = {name: state() for name, state in self.kept_states.items()}
        self.checkpoints.save(self.raw_model, self.optimizer, self.scaler, self.state, self.global_batch)
        self.saved_step = self.state.step

    def finish(self, *close: Callable[[], None]) -> None:
        """`close` the loop's components (the rollouts, the teachers' connections), then the logs and the lock. A
        run stopped by a signal before its end says how to continue and exits (75 for SIGTERM / SIGUSR1, 130 for
        Ctrl-C) with its checkpoint written."""
        for component in close:
            component()
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
        this_process = self.logs.timer.elapsed()
        resumed = (f" ({format_seconds(this_process)} in this process, from step {self.started_at_step})"
                   if self.started_at_step else "")
        print0(f"done: {self.state.step} steps in {format_seconds(self.elapsed_before + this_process)}"
               f"{resumed}" + (f", peak CUDA memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
                               if self.device.startswith("cuda") else "") + f" -> {self.out_prefix}/")

    def close(self) -> None:
        """Flush the logs, give back the lock, the signal handlers and the process group."""
        self.logs.close()
        self.stop_request.restore()
        if self.lock:
            self.lock.release()
        if self.dist.enabled:
            dist.barrier()
            dist.destroy_process_group()

    def last_checkpoint(self) -> str:
        if self.saved_step is None:
            return "no checkpoint yet"
        return f"last checkpoint {self.resume_path} (step {self.saved_step})"


def rows_of(stream) -> str:
    """The plan line's rows: an epoch's, or a corpus's rows not counted (its run is --max_steps long)."""
    return f"{stream.rows} rows" if stream.rows is not None else "rows streamed, not counted"
