"""What a run reports, on rank 0: every step's metrics to SAVE_DIR/NAME_metrics.jsonl and the tracker (swanlab), the
progress bar, and a console line every --log_interval steps; evaluations the same way. The clock behind ms/step,
tokens/s and the ETA is here too (trainer/skeleton/console.py's StepTimer)."""
from __future__ import annotations

import argparse
import json
import os
import time

from trainer.skeleton.console import Progress, StepTimer, console_line, format_metric
from trainer.skeleton.distributed import DistInfo
from trainer.skeleton.run_state import RunState
from trainer.skeleton.tracking import init_tracker


class RunLog:
    def __init__(self, args: argparse.Namespace, info: DistInfo, state: RunState, metrics_path: str,
                 total_steps: int, effective: dict):
        """`effective`: the settings as the run resolved them (device, world size, dtype, data path), which the
        tracker records instead of the flags' spelling."""
        self.args, self.is_main, self.total_steps = args, info.is_main, total_steps
        self.tracker = init_tracker(args, state, info.is_main, effective=effective)
        self.metrics_file = open_metrics(metrics_path, state.step) if info.is_main else None
        self.progress = Progress(total_steps, state.step, enabled=info.is_main)
        self.timer = StepTimer()

    def step(self, metrics: dict, done: bool, stopping: bool, show: tuple[str, ...] = ()) -> None:
        """Every step, the full metrics to metrics.jsonl and the tracker (its charts get every point) and the
        progress bar; every --log_interval steps, the first, the last and the one a stop signal ends on, one console
        line of at most 120 characters (with the loop's own numbers named in `show`, as many as fit)."""
        if not self.is_main:
            return
        step = metrics["step"]
        self.write_record(metrics)
        self.tracker.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
        eta = self.timer.eta(step, self.total_steps)
        self.progress.update(step, metrics, eta)
        if step % self.args.log_interval == 0 or step == 1 or done or stopping:
            self.progress.write(console_line(metrics, self.args.epochs, self.total_steps, eta, show))

    def evaluation(self, step: int, metrics: dict) -> None:
        """An evaluation's numbers at `step` (with --fsdp 1 every rank evaluates; rank 0 logs)."""
        if not self.is_main:
            return
        self.write_record({"step": step, **metrics})
        self.tracker.log(metrics, step=step)
        self.progress.write(f"eval at step {step} | "
                            + " ".join(format_metric(k.removeprefix("eval/"), v) for k, v in metrics.items()))
        self.timer.last = time.perf_counter()  # evaluation time is not training time: keep it out of ms/step

    def write_record(self, record: dict) -> None:
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()

    def close(self) -> None:
        self.progress.close()
        self.tracker.finish()
        if self.metrics_file:
            self.metrics_file.close()


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
