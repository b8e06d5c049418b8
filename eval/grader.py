"""Grade a model's completion against a DAPO ground truth with math-verify.

    from eval.grader import grade, grade_batch, wilson_interval
    grade(r"<think>...</think> So the answer is \\boxed{\\frac12}.", "0.5")   # GradeResult(True, '\\frac12', 'ok')

What counts as the answer: only the text after the last `</think>` (an unterminated `<think>` means the model never
answered), and there the content of the LAST `\\boxed{}` / `\\fbox{}` (balanced braces). Without any box we fall back
to math-verify's anchored extraction ("the final answer is ...", "Answer: ..."), never to a random number in the prose.
Equivalence is math-verify's (`parse` + `verify`, sympy underneath), not a home-made normaliser.

Timeouts. sympy can hang on a model's answer (e.g. `2^{2^{2^{30}}}`). math-verify's own timeouts use `signal.alarm`:
they only work in the main thread, take whole seconds, and one call's `alarm(0)` cancels any outer timer. And a hang
inside C code (big-integer arithmetic) is not interrupted by a signal at all. So every grade runs in one long-lived
worker subprocess (a fresh interpreter, started on first use and reused):
  - in the worker, one `setitimer` deadline of `timeout_s` covers extraction + parsing + verification (math-verify's
    own timeouts are disabled so they cannot cancel it); a Python-level hang ends there and the worker lives on;
  - in the caller, a hard deadline of `timeout_s + _KILL_GRACE_S`: a worker stuck where no signal reaches it is
    killed and restarted on the next call.
That makes grading safe from any thread (DataLoader workers, a thread pool) and from any hang, for ~0.1 ms of IPC
per sample. A subprocess rather than multiprocessing: `spawn` would re-import the caller's `__main__` (flat scripts
without a main guard would rerun), and `fork` from a process holding CUDA and thread pools is unsafe.
"""
from __future__ import annotations

import logging
import math
import os
import pickle
import random
import re
import select
import signal
import struct
import subprocess
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_KILL_GRACE_S = 2.0        # beyond timeout_s, before a worker that ignores its own deadline is killed
_STARTUP_TIMEOUT_S = 120.0  # importing sympy in a fresh interpreter takes ~1 s; a loaded machine, much more

# A box is parsed on its own, so any priority works; any_match lets the plain-expression parser try if LaTeX fails.
_BOXED_CONFIG = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
# Without a box, only anchored answers ("final answer is", "answer:") count: with try_extract_without_anchor=True
# math-verify would pick the last number of the prose, which turns "no answer" into lucky matches.
_ANCHORED_CONFIG = [LatexExtractionConfig(try_extract_without_anchor=False),
                    ExprExtractionConfig(try_extract_without_anchor=False)]
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


@dataclass
class GradeResult:
    correct: bool
    extracted: str | None  # the final answer as text (None when there was none)
    reason: str            # "ok" (graded; correct or not) / "no answer found" / "timeout" / "error: ..."


# ---------------------------------------------------------------------------------------------------- extraction

def final_text(completion: str) -> str | None:
    """The part of a completion that may hold the answer: after the last `</think>`; None inside an open `<think>`."""
    tail = completion.rsplit("</think>", 1)[-1]
    # An open <think> after the last </think> (or with none at all) means generation stopped while thinking:
    # whatever is boxed there is a draft, not an answer.
    return None if "<think>" in tail else tail


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}`; None if there is none, or if it is cut off (unbalanced)."""
    opens = list(_BOX_OPEN.finditer(text))
    if not opens:
        return None
    start = opens[-1].end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{" and text[i - 1] != "\\":
            depth += 1
        elif text[i] == "}" and text[i - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
    # A truncated last box is no answer; an earlier box would be an answer the model went on to revise.
    return None


def _anchored_answer(text: str, parsing_timeout: int | None) -> list:
    """math-verify's extraction of an anchored answer: [sympy expr (if it parsed), matched text] or []."""
    return parse(text, _ANCHORED_CONFIG, fallback_mode="first_match", extraction_mode="any_match",
                 parsing_timeout=parsing_timeout, raise_on_error=True)


def _text_of(parsed: list) -> str | None:
    # With fallback_mode="first_match" math-verify appends the matched string after the parsed value(s).
    strings = [p for p in parsed if isinstance(p, str)]
    return strings[-1] if strings else None


def extract_answer(completion: str) -> str | None:
    """The final answer as text: the last balanced box after the thinking, else an anchored "answer is ..." match.

    The box path is pure string work. The fallback runs math-verify's parser in this process, with its signal-based
    timeout in the main thread and none elsewhere (it cannot work there); `grade` never calls this, it uses the worker.
    """
    text = final_text(completion)
    if text is None:
        return None
    if _BOX_OPEN.search(text):
        return last_boxed(text) or None  # an empty box is no answer
    in_main = threading.current_thread() is threading.main_thread()
    return _text_of(_anchored_answer(text, parsing_timeout=5 if in_main else None))


# ---------------------------------------------------------------------------------------------------- grading

def _parse_ground_truth(ground_truth: str) -> list:
    # DAPO's ground truths are bare ("34", "\frac{1}{2}", "(1,2)"); a box makes math-verify treat them as one answer.
    text = ground_truth if ("\\boxed" in ground_truth or "$" in ground_truth) else f"\\boxed{{{ground_truth}}}"
    return parse(text, _BOXED_CONFIG, parsing_timeout=None, raise_on_error=True)


def _grade_unguarded(completion: str, ground_truth: str) -> GradeResult:
    """Extraction, parsing and comparison, with math-verify's own timeouts off (the caller holds the deadline)."""
    gold = _parse_ground_truth(ground_truth)
    if not gold:
        return GradeResult(False, None, f"error: ground truth not parseable: {ground_truth!r}")
    text = final_text(completion)
    if text is None:
        return GradeResult(False, None, "no answer found")
    if _BOX_OPEN.search(text):
        extracted = last_boxed(text)
        pred = parse(f"\\boxed{{{extracted}}}", _BOXED_CONFIG, parsing_timeout=None, raise_on_error=True) \
            if extracted else []
    else:
        pred = _anchored_answer(text, parsing_timeout=None)
        extracted = _text_of(pred)
    if not pred:
        return GradeResult(False, extracted or None, "no answer found")
    # Order matters: verify(gold, target). strict=True keeps variables distinct (x+1 is not y+1).
    correct = verify(gold, pred, timeout_seconds=None, raise_on_error=True)
    return GradeResult(bool(correct), extracted, "ok")


def _on_alarm(signum: int, frame: Any) -> None:
    # math-verify's own timeout exception: a BaseException, so its `except Exception` handlers let it through.
    raise TimeoutException("grading deadline passed")


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise TimeoutException after `seconds` (main thread only: signals are delivered there alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _box_or_none(completion: str) -> str | None:
    text = final_text(completion)
    return last_boxed(text) if text is not None else None


def _grade_in_process(completion: str, ground_truth: str, timeout_s: float) -> GradeResult:
    """What the worker runs per sample: never raises, every failure becomes a reason."""
    try:
        with _deadline(timeout_s):
            return _grade_unguarded(completion, ground_truth)
    except TimeoutException:
        return GradeResult(False, _box_or_none(completion), "timeout")
    except Exception as e:  # math-verify / sympy failures on odd input: reported per sample, the batch goes on
        return GradeResult(False, _box_or_none(completion), f"error: {type(e).__name__}: {e}")


# ---------------------------------------------------------------------------------------------------- the worker

def _send(stream: Any, obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_exact(stream: Any, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            return None  # the other side closed
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv(stream: Any) -> Any:
    header = _read_exact(stream, 8)
    if header is None:
        raise EOFError("pipe closed")
    payload = _read_exact(stream, struct.unpack("<Q", header)[0])
    if payload is None:
        raise EOFError("pipe closed mid-message")
    return pickle.loads(payload)


def _worker_main() -> None:
    """Loop of the grading subprocess: receive (function, args), send back its result, until stdin closes."""
    # math-verify warns once that its timeouts are off and "you must provide the logic yourself": we do (_deadline).
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(lambda record: not record.getMessage().startswith("Timeout is disabled"))
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print() in sympy or latex2sympy must not corrupt the protocol stream
    protocol_in = sys.stdin.buffer
    _send(protocol_out, "ready")
    while True:
        try:
            fn, args = _recv(protocol_in)
        except EOFError:
            return  # the parent closed the pipe or exited
        try:
            result = fn(*args)
        except Exception as e:  # a bug in fn: report it to the caller instead of dying silently
            result = GradeResult(False, None, f"error: {type(e).__name__}: {e}")
        _send(protocol_out, result)


class _WorkerTimeout(Exception):
    pass


class _GradingWorker:
    """One subprocess, one request at a time (a lock makes it safe to share between threads)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _start(self) -> None:
        # The child must import what the parent can (eval.grader, and whatever module a pickled function lives in).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT] + [p for p in sys.path if p]))
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from eval.grader import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, cwd=_ROOT, env=env)
        if not self._wait_readable(_STARTUP_TIMEOUT_S) or _recv(self._proc.stdout) != "ready":
            self.kill()
            raise RuntimeError(f"grading worker did not start within {_STARTUP_TIMEOUT_S:.0f} s")

    def _wait_readable(self, seconds: float) -> bool:
        ready, _, _ = select.select([self._proc.stdout], [], [], seconds)
        return bool(ready)

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def call(self, fn: Callable[..., Any], args: tuple, wait_s: float) -> Any:
        """fn(*args) in the worker; _WorkerTimeout (and a fresh worker next time) if no answer within wait_s."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                _send(self._proc.stdin, (fn, args))
                if not self._wait_readable(wait_s):
                    self.kill()
                    raise _WorkerTimeout()
                return _recv(self._proc.stdout)
            except (OSError, EOFError) as e:
                code = self._proc.poll() if self._proc is not None else None
                self.kill()
                raise RuntimeError(f"grading worker died (exit code {code}): {e}") from e


_WORKER = _GradingWorker()


def grade(completion: str, ground_truth: str, timeout_s: float = 5.0) -> GradeResult:
    """Grade one completion. Never raises on bad input: the reason says what went wrong."""
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    try:
        return _WORKER.call(_grade_in_process, (completion, ground_truth, timeout_s), timeout_s + _KILL_GRACE_S)
    except _WorkerTimeout:
        return GradeResult(False, _box_or_none(completion), "timeout")
    except Exception as e:  # worker start-up / death / unpicklable input: one sample's error, not the whole eval's
        return GradeResult(False, None, f"error: {type(e).__name__}: {e}")


def grade_batch(completions: Sequence[str], ground_truths: Sequence[str],
                timeout_s: float = 5.0) -> list[GradeResult]:
    """grade() over pairs, in order. Sequential: one worker is enough next to a model that owns the CPU cores."""
    if len(completions) != len(ground_truths):
        raise ValueError(f"{len(completions)} completions but {len(ground_truths)} ground truths")
    return [grade(c, g, timeout_s) for c, g in zip(completions, ground_truths)]


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for k successes in n trials (z=1.96: 95%). Sane at k=0 and k=n, unlike p +- z*se."""
    if n <= 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n > 0, got k={k}, n={n}")
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def problem_interval(values: Sequence[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of per-problem values (a problem's share of correct samples,
    its pass@k estimate): the problems resampled, not the samples, since samples of one problem are not independent
    trials (Wilson's interval over every sample is too narrow when problems differ in difficulty). Seeded: the same
    values give the same interval."""
    if not values:
        raise ValueError("need at least one problem")
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choices(values, k=n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def mcnemar_exact(first: Sequence[bool], second: Sequence[bool]) -> tuple[int, int, float]:
    """McNemar's exact test of two models graded on the same problems, in the same order: -> (problems only the first
    solved, problems only the second solved, two-sided p-value). Only the discordant problems count; under the null
    hypothesis (equal accuracy) each is the first's with probability 1/2, so the p-value is the two-sided binomial
    tail: min(1, 2 * P(X <= min(b, c))) for X ~ Binomial(b + c, 1/2); 1.0 when no problem is discordant."""
    if len(first) != len(second):
        raise ValueError(f"the two gradings cover {len(first)} and {len(second)} problems: they must be the same ones")
    only_first = sum(1 for a, b in zip(first, second) if a and not b)
    only_second = sum(1 for a, b in zip(first, second) if b and not a)
    n = only_first + only_second
    tail = sum(math.comb(n, i) for i in range(min(only_first, only_second) + 1)) / 2 ** n
    return only_first, only_second, min(1.0, 2 * tail)
