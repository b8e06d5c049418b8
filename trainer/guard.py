"""Stop signals from the first line of a training script's main to its last: what happens on SIGTERM, SIGUSR1 and
Ctrl-C before the loop's own handler exists, and which handlers the process has again afterwards.

    with stop_signals_noted():      # in each script's main, around everything it does
        ...                         # start-up: a preemption notice is only noted
        run = Run(...)              # trainer_utils.StopRequest takes the noted signal over: the run trains its
        ...                         # current step, saves it and exits 75
    # here, however main ended (done, refused, failed): the handlers the process had before main

A rank still loading when a notice arrives would otherwise die of it while another rank, already training, fails
in its next collective with a traceback. Entered before the process group exists, so every rank has it before any
rank can begin training.
"""
from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

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


def take_noted_stop_signal() -> int:
    """For the loop's handler when it takes over: the signal noted so far (0: none), forgotten here."""
    noted, _noted["signal"] = _noted["signal"], 0
    return noted
