"""What guards a run: one run per name (`RunLock`), and stop signals from the first line of a training script's
main to its last -- what happens on SIGTERM, SIGUSR1 and Ctrl-C before the loop's own handler exists
(`stop_signals_noted`), once it does (`StopRequest`: finish the step, save, stop), and which handlers the process
has again afterwards. Imports nothing of the loops.

    train_noting_stop_signals(train, args)   # each script's main: stop_signals_noted() around train(args)
        ...                         # start-up: a preemption notice is only noted
        run = Run(...)              # its StopRequest takes the noted signal over: the run trains its
        ...                         # current step, saves it and exits 75
    # here, however main ended (done, refused, failed): the handlers the process had before main

A rank still loading when a notice arrives would otherwise die of it while another rank, already training, fails
in its next collective with a traceback. Entered before the process group exists, so every rank has it before any
rank can begin training.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import signal
import socket
from collections.abc import Callable, Iterator

from common.errors import EXIT_INTERRUPTED, Stopped, UserError
from common.files import process_start_time
from trainer.skeleton.distributed import print0

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_noted = {"signal": 0}  # what the handler below writes: a signal handler can only reach module state


def _note(signum: int, frame) -> None:
    _noted["signal"] = _noted["signal"] or signum


@contextlib.contextmanager
def stop_signals_noted() -> Iterator[None]:
    """Note SIGTERM / SIGUSR1 from here on (the first one counts); on leaving, restore the process's handlers of
    those and of SIGINT (which the loop's handler takes too) and forget what was noted."""
    previous = {signum: signal.getsignal(signum) for signum in (*PREEMPTION_SIGNALS, signal.SIGINT)}
    _noted["signal"] = 0
    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, _note)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _noted["signal"] = 0


def train_noting_stop_signals(train: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    """A loop's `train(args)` with SIGTERM / SIGUSR1 noted from its first line on (the step is finished and saved);
    at the end (done, refused or failed) the process's own handlers are back."""
    with stop_signals_noted():
        train(args)


def take_noted_stop_signal() -> int:
    """For the loop's handler when it takes over: the signal noted so far (0: none), forgotten here."""
    noted, _noted["signal"] = _noted["signal"], 0
    return noted


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

    def read_holder(self) -> dict:
        """The lock file's record ({} when there is none, or it was half-written by a process killed taking it)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def refusal(self, holder: dict) -> str | None:
        """Why the lock cannot be taken: a live run of this name on this host, or one on another host (a shared
        file system, never guessed about); None when it is free or stale."""
        pid = holder.get("pid")
        if holder and holder.get("host") != self.me["host"]:
            return (f"{self.path}: a run of this name is held by PID {pid} on host {holder.get('host')}; wait for "
                    f"it or stop it, use another --save_weight, or delete the lock file if that run is gone")
        start = process_start_time(pid) if isinstance(pid, int) else None
        if start is not None and start == holder.get("start") and pid != os.getpid():
            return (f"{self.path}: a run of this name is in progress (PID {pid} on this host); wait for it or stop "
                    f"it (kill {pid}), or use another --save_weight")
        return None

    def refusal_now(self) -> str | None:
        """At start-up, before anything slow: why a run of this name cannot start now (None: it can)."""
        return self.refusal(self.read_holder())

    def take_over_if_stale(self) -> None:
        holder = self.read_holder()
        message = self.refusal(holder)
        if message:
            raise UserError(message)
        pid = holder.get("pid")
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

    def __init__(self, step: Callable[[], int], last_checkpoint: Callable[[], str]):
        self.step, self.last_checkpoint, self.signal = step, last_checkpoint, 0
        self.previous = {signum: signal.signal(signum, self.handle) for signum in self.SIGNALS}
        # a notice that arrived while the script was starting (trainer/skeleton/guard.py, stop_signals_noted) counts
        # from here
        noted = take_noted_stop_signal()
        if noted:
            self.handle(noted, None)

    def handle(self, signum: int, frame) -> None:
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            self.restore()
            raise Stopped(f"interrupted at step {self.step()}: {self.last_checkpoint()}; continue with "
                          f"the same command and --from_resume 1", EXIT_INTERRUPTED)
        if self.signal:
            return
        self.signal = signum
        # no step number: a signal that arrives after this step's stop flags were reduced is acted on one step
        # later, on every rank alike; the stop line names the step that was saved
        print0(f"\n{signal.Signals(signum).name}: finishing the step in progress, then saving and stopping"
               + (" (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""))

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}
