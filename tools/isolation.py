"""One tool call in a forked child process, abandoned at a deadline, its result bounded in length.

Why a child process and not a worker thread: a thread cannot be stopped, so a stuck tool would run on for the rest of
the training run, and one long C-level operation (a huge integer power) holds the GIL, so the caller could not even
notice its own deadline. A child is killed (SIGKILL) at the deadline, whatever it is doing, and takes its memory
with it. Why fork, once per call, and not a pool of spawned workers: a forked child inherits the tool's function, so
a tool may be any callable (a closure, a lambda, a bound method), not only one a fresh interpreter can import; a
fork costs milliseconds (docs/tools.md), against a fresh interpreter's start-up to respawn a pool worker after
every kill.

What that means for a tool: it runs in a copy of the caller's memory, so nothing it changes there comes back (tools
are functions of their arguments and return a string). It must not use CUDA or a lock another thread of the caller
may hold (fork copies only the calling thread); a child that blocks on one anyway is killed at the deadline like any
stuck tool. Linux and macOS only (fork)."""
from __future__ import annotations

import math
import multiprocessing
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection

FORK = multiprocessing.get_context("fork")


def bounded(text: str, max_chars: int, total: int | None = None) -> str:
    """`text` cut to its first `max_chars` characters, with a marker saying how much of `total` (its length unless
    it is already a cut prefix) is shown."""
    total = len(text) if total is None else total
    if total <= max_chars:
        return text
    return f"{text[:max_chars]}\n[cut: {max_chars:,} of {total:,} characters shown]"


def run_in_child(function: Callable[[dict], str], arguments: dict, writer: Connection, max_chars: int,
                 timeout_s: float) -> None:
    """The child's whole life: call the tool, send back (at most max_chars of its text, the text's full length).
    Only the prefix crosses the pipe, so a tool returning megabytes costs the caller nothing."""
    # A deadline of its own, a second past the caller's: a caller killed mid-call (SIGKILL, out of memory) cannot
    # kill its child, which would otherwise run a stuck tool forever. SIG_DFL, since fork copied the caller's handler.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(math.ceil(timeout_s) + 1)
    try:
        result = function(arguments)
        text = result if isinstance(result, str) else f"error: the tool returned {type(result).__name__}, not a string"
    except BaseException as error:  # SystemExit and KeyboardInterrupt too: a tool never stops its caller
        text = f"error: {type(error).__name__}: {error}"
    writer.send((text[:max_chars], len(text)))
    writer.close()


def call_bounded(function: Callable[[dict], str], arguments: dict, timeout_s: float, max_chars: int) -> str:
    """function(arguments) in a forked child: its text bounded by max_chars, or `error: timed out after T s` when
    it has not answered within timeout_s (the child is then killed), or an error text if the child dies silently.
    Never raises for anything the tool does."""
    reader, writer = FORK.Pipe(duplex=False)
    child = FORK.Process(target=run_in_child, args=(function, arguments, writer, max_chars, timeout_s),
                        daemon=True)
    child.start()
    writer.close()  # the child holds the only writer now, so its death reads as end-of-file, not as a wait
    try:
        if not reader.poll(timeout_s):
            return f"error: timed out after {timeout_s:g} s"
        try:
            prefix, total = reader.recv()
        except EOFError:
            child.join()
            return f"error: the tool's process ended with exit code {child.exitcode} before answering"
        return bounded(prefix, max_chars, total)
    finally:
        # killed whether it timed out or answered: a child that has answered has nothing left to do, and one that
        # lingers (a non-daemon thread the tool started keeps it from exiting) must not hold the caller in join()
        child.kill()
        child.join()
        reader.close()
        child.close()
