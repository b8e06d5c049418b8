"""The console: the live progress bar, the per-step log line, and the clocks behind their numbers (wall time per
step, loss tokens/s, the ETA, seconds per phase of an OPD step). Imports nothing of the loops."""
from __future__ import annotations

import contextlib
import os
import sys
import time

import torch
from tqdm import tqdm

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


_shown: list["Progress"] = []  # the progress bar on screen, if any: lines printed meanwhile go through it


def say(line: str) -> None:
    """Print a line; while a progress bar is up, above it (a plain print would land in the bar's own line)."""
    if _shown:
        _shown[-1].write(line)
    else:
        print(line, flush=True)


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
        if self.bar is not None:
            _shown.append(self)

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
            _shown.remove(self)


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
    if name.startswith("teacher/"):  # teacher/math/loss -> math loss
        name = " ".join(name.split("/")[1:])
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

    def add_to(self, metrics) -> None:
        """PHASE_s (seconds, the mean over ranks) and PHASE_share (of all phases' time, over all ranks), added to a
        trainer.skeleton.window_metrics.WindowMetrics."""
        total = sum(self.seconds.values())
        for phase, seconds in self.seconds.items():
            metrics.rank_mean(f"{phase}_s", seconds)
            metrics.ratio(f"{phase}_share", seconds, total)


def format_seconds(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
