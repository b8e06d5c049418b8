"""Served rollouts sampled ahead of training: OPD's `--max_staleness S` (docs/serving.md, "Rollouts that overlap").

The rollouts of optimizer step s (0-based) are sampled from the student's weights after step
version(s) = max(0, s - S). With S = 0 that is the current student (strictly on-policy); with S = 1 the weights one
step older, so the server can sample step s's rows while the trainer is still training step s - 1. The rule is
fixed, not "whatever is ready", so what a run computes does not depend on timing: the overlap changes when the work
happens, never what is computed (`overlap=False` does the same work in the loop's own thread: the serial
reference the tests compare against).

    rollouts = RolloutQueue(sample, resumed, staleness=S)   # resumed: what a checkpoint kept ({} at a start)
    for epoch, window, coming in run.windows_ahead(S):
        jobs = rollouts.due(run.step, [(run.step, epoch, window), *coming], is_on_policy)
        if jobs:
            rollouts.wait()         # the server finishes sampling from older weights before it loads new ones
            ... push the weights, verify ...
            rollouts.start(jobs, run.step)   # in a background thread
        for batch in window:
            completions = rollouts.take(run.step, batch)   # waits for them when they are not there yet

What is sampled is kept in the queue, each row's token ids with the log-probabilities the server drew them with
(step -> {"version", "rows": {sample_key: (ids, logprobs)}}; RL's rollout correction divides by them; with --tools a
conversation's ids, NaN on its tool results: trainer/rollouts/tool_turns.py's kept_sample); every checkpoint
saves a copy (`kept_now`, into `RunState.rollouts`, gathered from all ranks): a resumed run trains on exactly the
rollouts the killed one had sampled from weights older than its checkpoint, which it no longer has. Only the server's
requests run in the background thread (plain lists, no tensor work): the trainer's own threads compute
undisturbed.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

from common.errors import RuntimeFailure
from trainer.skeleton.distributed import print0

Window = list[dict]                   # collated micro-batches of one optimizer step
Job = tuple[int, int, Window]         # (step, epoch, window)


class RolloutQueue:
    """`sample(batch, epoch)` -> each row's sample (its completion token ids and their log-probabilities), from
    the weights the server holds now."""

    def __init__(self, sample: Callable[[dict, int], list], resumed: dict[int, dict], staleness: int,
                 overlap: bool = True):
        """`resumed`: the rollouts a resumed run's checkpoint kept (step -> {"version", "rows"}; {} at a start)."""
        self.sample, self.staleness, self.overlap = sample, staleness, overlap
        self.rollouts = dict(resumed)         # step -> {"version", "rows"}: sampled, not yet trained on
        self.sampled = set(resumed)           # steps kept, in flight or sampled by this process
        self.thread: threading.Thread | None = None
        self.kept = threading.Condition()     # notified as each step's rollouts are kept, and when a job ends
        self.running = False
        self.error: BaseException | None = None
        self.idle_since: float | None = None  # when the server's last job ended (None: no job yet)
        self.waited = self.idle = 0.0         # seconds, since the last `add_to()`

    def version(self, step: int) -> int:
        """The optimizer step whose weights sample step `step`'s rollouts."""
        return max(0, step - self.staleness)

    def due(self, step: int, steps: Sequence[Job], on_policy: Callable[[int, int], bool]) -> list[Job]:
        """Of the coming steps (the current one first), the on-policy ones to sample now, from the current weights:
        the step S ahead (at a run's start steps 0 .. S), and any whose rollouts from older weights a stopped run
        lost (its server failed before they were sampled): those are said, and sampled fresher."""
        jobs = []
        for s, epoch, window in steps:
            if not on_policy(epoch, s):
                continue
            if self.version(s) == step:
                jobs.append((s, epoch, window))
            elif s not in self.sampled:
                print0(f"the rollouts of step {s + 1}, from the weights of step {self.version(s)}, were lost when the "
                       f"stopped run's server failed: they are sampled from the weights of step {step} instead")
                jobs.append((s, epoch, window))
        return jobs

    def start(self, jobs: list[Job], step: int) -> None:
        """Sample the jobs' rows from the weights the server now holds (those after optimizer step `step`, their
        version): in a background thread, or here and now without overlap. A failure is raised by the next `wait`
        or `take`."""
        assert self.thread is None, "wait() before a new start(): the server holds one set of weights"
        self.sampled.update(s for s, _, _ in jobs)
        self.running = True
        if self.idle_since is not None:
            self.idle += time.perf_counter() - self.idle_since
        if self.overlap:
            self.thread = threading.Thread(target=self._run, args=(jobs, step), name="rollouts", daemon=True)
            self.thread.start()
        else:
            self._run(jobs, step)

    def _run(self, jobs: list[Job], step: int) -> None:
        try:
            for s, epoch, window in jobs:  # a step's rows are kept once all of them are sampled
                rows = {}
                for batch in window:
                    completions = self.sample(batch, epoch)
                    rows.update({sample_key(row): ids for row, ids in zip(batch["rows"], completions)})
                with self.kept:
                    self.rollouts[s] = {"version": step, "rows": rows}  # a save sees all or none of a step
                    self.kept.notify_all()
        except BaseException as error:  # raised in the loop's thread, where the run's failure protocol is
            self.error = error
        finally:
            self.idle_since = time.perf_counter()
            with self.kept:
                self.running = False
                self.kept.notify_all()

    def wait(self) -> None:
        """Until the job in flight is done; its failure, if any, raised here."""
        start = time.perf_counter()
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        self.waited += time.perf_counter() - start
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def take(self, step: int, batch: dict) -> tuple[list, int]:
        """The samples of `batch`'s rows for step `step` and the step whose weights sampled them;
        waits for them when they are not there yet (not for the rest of the job in flight)."""
        start = time.perf_counter()
        with self.kept:
            self.kept.wait_for(lambda: step in self.rollouts or not self.running)
        self.waited += time.perf_counter() - start
        if step not in self.rollouts:
            self.wait()  # the job ended without them: its failure is raised here
        if step not in self.rollouts:  # nothing in flight and nothing kept: a bug, not a server's failure
            raise RuntimeFailure(f"no rollouts were sampled for step {step + 1}")
        with self.kept:  # trained on: never needed again
            for old in [s for s in self.rollouts if s < step]:
                del self.rollouts[old]
        record = self.rollouts[step]
        return [record["rows"][sample_key(row)] for row in batch["rows"]], record["version"]

    def kept_now(self) -> dict[int, dict]:
        """A copy of the rollouts kept for coming steps, for a checkpoint (a job in flight may be adding a step: it
        is in the copy whole or not at all)."""
        with self.kept:
            return dict(self.rollouts)

    def add_to(self, metrics) -> None:
        """wait_s (seconds the trainer waited for rollouts) and server_idle_s (the server idle between its jobs)
        since the last call, the mean over ranks, added to a trainer.skeleton.window_metrics.WindowMetrics."""
        metrics.rank_mean("wait_s", self.waited)
        metrics.rank_mean("server_idle_s", self.idle)
        self.waited = self.idle = 0.0


def sample_key(row: dict) -> int | tuple[int, int]:
    """Which sample of the run a row is: its row index, and for the g-th member (g > 0) of an RL group (the rows
    of a GroupCollator batch) the pair (row index, g): the G samples of one prompt are kept apart."""
    return (row["row_index"], row["generation"]) if row.get("generation") else row["row_index"]
