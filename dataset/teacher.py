"""Teacher-written SFT data: a client for an OpenAI-compatible `/v1/chat/completions` endpoint, plus its cache.

    cache = AnswerCache("sft.parquet.cache.jsonl")
    with TeacherClient("http://127.0.0.1:8000/v1", "Qwen3-4B", params=SamplingParams(temperature=0.6),
                       cache=cache, concurrency=8) as client:
        results = client.run(list_of_message_lists)     # TeacherAnswer or TeacherError per prompt, in order

- Concurrency is `concurrency` worker threads over one `httpx.Client` (thread-safe, one connection pool): the work
  is I/O bound, threads keep tracebacks simple, and their number bounds the requests in flight.
- Retries with exponential backoff + jitter on 429 / 408 / 5xx / timeouts / connection errors / malformed bodies,
  honouring `Retry-After`. 401/403/404 stop the whole run (wrong key, URL or model: retrying cannot help), and so
  does a connection failure that outlives its retries before the server ever answered (not up, wrong host or port);
  other 4xx fail that prompt only.
- Before the first request, one probe (`check_reachable`: GET {base_url}/models, a few seconds at most) refuses a
  wrong host or port, or a server that is not up, at once with `TeacherUnreachable`, instead of after the retries.
- The API key is read from an environment variable whose *name* is a parameter. It lives in the request headers
  only; it is never printed, logged, cached or shown in `repr`, and error texts are scrubbed of it.
- The cache is JSONL keyed by sha256 of canonical JSON of (model, messages, sampling parameters) -- never Python's
  `hash()`, which is salted per process. Each answer is appended, flushed and fsynced as it arrives, so a kill
  loses only the requests in flight and a rerun sends only what is missing. A damaged line is skipped with a
  warning and its prompt asked again.
"""
from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import re
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import httpx

Messages = list[dict[str, str]]

RETRYABLE_STATUSES = {408, 429}        # plus every 5xx
FATAL_STATUSES = {401, 403, 404}       # the configuration is wrong: stop everything, do not burn the other prompts


# ---------------------------------------------------------------------------------------------------------------------
# sampling parameters, answers, errors, stats

@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters sent with every request; they are part of the cache key."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)   # e.g. {"top_k": 20} for vLLM; merged into the payload

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n={self.n}: only n=1 is supported (one answer per prompt; ask again with another seed)")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1 (or None for the server's default)")
        reserved = {"model", "messages", "stream"} & set(self.extra)
        if reserved:
            raise ValueError(f"extra must not set {sorted(reserved)}")

    def to_payload(self) -> dict[str, Any]:
        payload: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "n": self.n}
        if self.max_tokens is not None:
            payload["max_tokens"] = self.max_tokens
        if self.seed is not None:
            payload["seed"] = self.seed
        payload.update(self.extra)
        return payload


@dataclass(frozen=True)
class TeacherAnswer:
    """The teacher's answer to prompt `index`: `content` without the thinking, which is kept in `reasoning`."""
    index: int
    key: str
    content: str
    reasoning: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    cached: bool

    @classmethod
    def from_record(cls, record: dict[str, Any], index: int, cached: bool) -> "TeacherAnswer":
        return cls(index=index, key=record["key"], content=record["content"], reasoning=record.get("reasoning", ""),
                   finish_reason=record.get("finish_reason"), usage=record.get("usage"), cached=cached)


class TeacherError(RuntimeError):
    """A prompt the teacher could not answer; the message names the prompt, the last status and the reason."""

    def __init__(self, index: int, attempts: int, status: int | None, reason: str, detail: str, fatal: bool = False):
        self.index, self.attempts, self.status, self.reason, self.detail, self.fatal = (
            index, attempts, status, reason, detail, fatal)
        last = f"HTTP {status}" if status is not None else reason
        super().__init__(f"prompt {index}: no answer after {attempts} attempt(s); last: {last} ({detail})")


class TeacherUnreachable(ConnectionError):
    """The probe before the first request found nothing at the URL: refused, unknown host, no route, or no answer
    to the connection in time. The message names the URL."""


class TeacherStats:
    """Thread-safe counters. `sent` counts chat-completion requests (attempts; not the probe); `answered` / `failed`
    count prompts settled by this run; `cached` counts prompts served from the cache; `retries` counts retries by
    reason (http_429, http_5xx codes, timeout, connection, malformed_json)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = self.answered = self.failed = self.cached = 0
        self.retries: Counter[str] = Counter()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + amount)

    def add_retry(self, reason: str) -> None:
        with self._lock:
            self.retries[reason] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"sent": self.sent, "answered": self.answered, "failed": self.failed, "cached": self.cached,
                    "retries": dict(self.retries)}


# ---------------------------------------------------------------------------------------------------------------------
# thinking, cache keys

_THINK_TAG = re.compile(r"</?think>")


def split_thinking(content: str | None, reasoning_content: str | None = None) -> tuple[str, str]:
    """(answer, reasoning) from a chat message. Reasoning servers either return `reasoning_content` separately or
    inline `<think>...</think>` in `content`; Qwen3's template may also open `<think>` in the prompt, so only the
    closing tag appears. A `<think>` never closed (out of tokens while thinking) leaves no answer at all."""
    content = content or ""
    thoughts = [reasoning_content.strip()] if reasoning_content and reasoning_content.strip() else []
    if "</think>" in content:
        head, _, answer = content.rpartition("</think>")
        thoughts.append(_THINK_TAG.sub("", head).strip())
    elif content.lstrip().startswith("<think>"):
        thoughts.append(_THINK_TAG.sub("", content).strip())
        answer = ""
    else:
        answer = content
    return answer.strip(), "\n\n".join(t for t in thoughts if t)


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def cache_key(model: str, messages: Messages, params: dict[str, Any]) -> str:
    """sha256 of canonical JSON: stable across processes and machines (Python's hash() is salted per process)."""
    blob = canonical_json({"model": model, "messages": messages, "params": params})
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------------------------------
# the cache

class AnswerCache:
    """Append-only JSONL of teacher answers, one record per line, keyed by `cache_key`.

    A damaged *last* line is what a crash mid-write leaves: it is ignored with a warning and cut off before the next
    append (otherwise the next record would be glued onto it and corrupt a good line). A damaged line elsewhere
    (a disk error, two runs writing one cache at once) is skipped with a warning naming it and left in place: its
    prompt is simply asked again, and the records appended after it are whole lines. A file in which no line is a
    record is not a cache and is refused (appending answers to it would damage someone else's file). Loading never
    modifies the file (dry runs stay pure).
    """

    REQUIRED = ("key", "content")

    def __init__(self, path: str):
        self.path = path
        self._records: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._file = None
        self._truncate_at: int | None = None     # byte offset where a damaged last line starts
        self._needs_newline = False              # last record complete but its newline never made it to disk
        if os.path.exists(path):
            self._load()

    def _load(self) -> None:
        with open(self.path, "rb") as f:
            lines = f.read().split(b"\n")
        last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)   # may be torn by a crash
        damaged: list[tuple[int, str]] = []      # (line number, reason) of damaged lines before the last one
        offset = 0
        for i, line in enumerate(lines):
            start, offset = offset, offset + len(line) + 1
            if not line.strip():
                continue
            try:
                record = self._parse(line)
            except ValueError as e:
                if i == last:
                    warnings.warn(f"{self.path}:{i + 1}: ignoring a damaged last line ({len(line)} bytes, {e}); "
                                  f"probably a crash mid-write. It will be cut off before the next append.",
                                  RuntimeWarning, stacklevel=3)
                    self._truncate_at = start
                else:
                    damaged.append((i + 1, str(e)))
                continue
            # a key seen twice (two runs racing on one cache) keeps its first answer
            self._records.setdefault(record["key"], record)
            self._needs_newline = i == len(lines) - 1      # no b"\n" after it
        if self._truncate_at is not None:
            self._needs_newline = False
        if damaged:
            self._report_damaged(damaged)

    def _report_damaged(self, damaged: list[tuple[int, str]]) -> None:
        numbers = ", ".join(str(n) for n, _ in damaged[:10]) + (", ..." if len(damaged) > 10 else "")
        where = f"{self.path}:{damaged[0][0]}" if len(damaged) == 1 else f"{self.path}: lines {numbers}"
        if not self._records:
            raise ValueError(f"{where}: not an answer cache (no line is a cache record; first problem: "
                             f"{damaged[0][1]}); use a new cache file name or delete this file")
        warnings.warn(f"{where}: skipping {len(damaged)} damaged cache line(s) ({damaged[0][1]}); their prompts "
                      f"are asked again. Delete the line(s) to silence this warning.", RuntimeWarning, stacklevel=4)

    def _parse(self, line: bytes) -> dict[str, Any]:
        record = json.loads(line.decode("utf-8"))          # UnicodeDecodeError / JSONDecodeError are ValueErrors
        if not isinstance(record, dict):
            raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
        for name in self.REQUIRED:
            if not isinstance(record.get(name), str):
                raise ValueError(f"field {name!r} missing or not a string")
        return record

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: str) -> bool:
        return key in self._records

    def get(self, key: str) -> dict[str, Any] | None:
        return self._records.get(key)

    def put(self, record: dict[str, Any]) -> None:
        """Append one record and make it durable before returning (flush + fsync)."""
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self._lock:
            if self._file is None:
                self._open_for_append()
            self._file.write(line.encode("utf-8"))         # one write: a kill leaves at most this line partial
            self._file.flush()
            os.fsync(self._file.fileno())
            self._records.setdefault(record["key"], record)

    def _open_for_append(self) -> None:
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        if self._truncate_at is not None:
            with open(self.path, "r+b") as f:
                f.truncate(self._truncate_at)
            self._truncate_at = None
        self._file = open(self.path, "ab")
        if self._needs_newline:
            self._file.write(b"\n")
            self._needs_newline = False

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


# ---------------------------------------------------------------------------------------------------------------------
# planning: which prompts the cache already answers

@dataclass
class RequestPlan:
    keys: list[str]                                      # one per prompt
    groups: dict[str, list[int]]                         # key -> prompt indices (identical prompts are sent once)
    cached_rows: int                                     # prompts answered by the cache
    to_send: list[str]                                   # keys to request, in first-appearance order

    @property
    def rows_to_send(self) -> int:
        return sum(len(self.groups[k]) for k in self.to_send)


def plan_requests(model: str, params: SamplingParams, prompts: Sequence[Messages],
                  cache: AnswerCache | None) -> RequestPlan:
    payload = params.to_payload()
    keys = [cache_key(model, list(m), payload) for m in prompts]
    groups: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    to_send = [k for k in groups if cache is None or k not in cache]
    cached_rows = len(keys) - sum(len(groups[k]) for k in to_send)
    return RequestPlan(keys=keys, groups=groups, cached_rows=cached_rows, to_send=to_send)


# ---------------------------------------------------------------------------------------------------------------------
# the client

@dataclass
class _Failure:
    reason: str                  # stats key
    status: int | None
    detail: str
    retryable: bool
    retry_after: float | None = None


def chat_completions_url(base_url: str) -> str:
    """Accepts `http://host:8000`, `http://host:8000/v1` (the OpenAI SDK convention) or the full endpoint."""
    url = base_url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


def _check_url(url: str) -> None:
    """A ValueError for a URL httpx could not even try (no scheme, no host), rather than a connection error."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ValueError(f"teacher URL {url!r}: {e}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"teacher URL {url!r} must look like http://HOST:PORT/v1")


def one_line(text: str) -> str:
    """`text` with its line breaks and runs of spaces as single spaces: error messages are one line."""
    return " ".join(text.split())


def _retry_after_seconds(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None              # an HTTP-date or garbage: fall back to our own backoff rather than guess


class TeacherClient:
    """Chat-completions client with bounded concurrency, retries and an optional `AnswerCache`."""

    def __init__(self, base_url: str, model: str, *, api_key_env: str | None = "OPENAI_API_KEY",
                 params: SamplingParams | None = None, cache: AnswerCache | None = None, concurrency: int = 8,
                 connect_timeout: float = 10.0, read_timeout: float = 600.0, max_retries: int = 5,
                 backoff_base: float = 1.0, backoff_max: float = 60.0, max_retry_after: float = 300.0,
                 probe_timeout: float = 3.0):
        if concurrency < 1 or max_retries < 0 or min(connect_timeout, read_timeout, probe_timeout) <= 0:
            raise ValueError(f"need concurrency >= 1, max_retries >= 0 and positive timeouts; got concurrency="
                             f"{concurrency}, max_retries={max_retries}, timeouts={connect_timeout}/{read_timeout}/"
                             f"{probe_timeout}")
        self.base_url, self.model, self.api_key_env = base_url, model, api_key_env
        self.url = chat_completions_url(base_url)
        _check_url(self.url)
        self.models_url = self.url[:-len("/chat/completions")] + "/models"
        self.connect_timeout, self.probe_timeout = connect_timeout, probe_timeout
        self._probed = False
        self.params = params or SamplingParams()
        self.cache, self.concurrency, self.max_retries = cache, concurrency, max_retries
        self.backoff_base, self.backoff_max, self.max_retry_after = backoff_base, backoff_max, max_retry_after
        self.stats = TeacherStats()
        # Set by the first HTTP response of any status. Until then a connection failure that outlives its retries
        # means a wrong URL or a server that is not up: it stops the run instead of failing every prompt in turn.
        self._reached = threading.Event()
        self._rng = random.Random()
        self._api_key = self._read_key(api_key_env)
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        # the read timeout bounds the wait for each chunk of the answer, so it must cover the teacher's whole
        # generation time when the server sends nothing until it is done (non-streaming)
        self._http = httpx.Client(
            headers=headers, timeout=httpx.Timeout(read_timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency))

    @staticmethod
    def _read_key(api_key_env: str | None) -> str:
        if not api_key_env:
            return ""            # a local server without auth; no Authorization header
        key = os.environ.get(api_key_env)
        if not key:
            raise ValueError(f"environment variable {api_key_env} is not set: export the API key there "
                             f"(any non-empty value for a server without auth)")
        return key

    def __repr__(self) -> str:
        return (f"TeacherClient(url={self.url!r}, model={self.model!r}, api_key_env={self.api_key_env!r}, "
                f"params={self.params!r}, concurrency={self.concurrency}, max_retries={self.max_retries})")

    def __enter__(self) -> "TeacherClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- the probe -----------------------------------------------------------------------------------------------------

    def check_reachable(self) -> None:
        """One GET {base}/models; TeacherUnreachable when nothing answers the connection. Called by `run` before its
        first request; call it earlier to refuse a wrong URL before slow set-up work.

        Only the connection is judged, within `probe_timeout` (or the connect timeout, when shorter): a refusal, an
        unknown host, no route or no answer to the connection means a wrong URL or a server that is not up. A
        response of any status passes (some servers have no /models, some want another key there), and so does a
        slow server: a read timeout means something accepted the connection, and the requests' own timeouts and
        retries take it from there. The body is never read."""
        timeout = httpx.Timeout(self.probe_timeout, connect=min(self.connect_timeout, self.probe_timeout))
        try:
            with self._http.stream("GET", self.models_url, timeout=timeout):
                pass
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError, httpx.UnsupportedProtocol) as e:
            raise TeacherUnreachable(f"the teacher at {self.base_url} cannot be reached ({type(e).__name__}: "
                                     f"{self._scrub(one_line(str(e)))}): is the server up and the URL right?"
                                     ) from None
        except httpx.TransportError:
            pass                 # connected, then slow, closed or garbled: reachable; the requests handle the rest
        self._probed = True

    # -- one prompt ----------------------------------------------------------------------------------------------------

    def complete(self, messages: Messages, index: int = 0) -> TeacherAnswer:
        """Ask the teacher once (with retries); no cache. Raises TeacherError after the last retry."""
        payload = {"model": self.model, "messages": list(messages), **self.params.to_payload()}
        key = cache_key(self.model, list(messages), self.params.to_payload())
        for attempt in range(self.max_retries + 1):
            self.stats.add("sent")
            outcome = self._attempt(payload)
            if isinstance(outcome, dict):
                return self._answer_from(outcome, index, key)
            last_try = attempt == self.max_retries
            if not outcome.retryable or last_try:
                unreachable = outcome.reason == "connection" and not self._reached.is_set()
                detail = self._scrub(outcome.detail)
                if unreachable:
                    detail = f"the teacher at {self.url} never answered: is the server up and the URL right? {detail}"
                raise TeacherError(index, attempt + 1, outcome.status, outcome.reason, detail,
                                   fatal=outcome.status in FATAL_STATUSES or unreachable)
            self.stats.add_retry(outcome.reason)
            time.sleep(self._delay(attempt, outcome.retry_after))
        raise AssertionError("unreachable: the loop returns or raises")

    def _attempt(self, payload: dict[str, Any]) -> dict[str, Any] | _Failure:
        try:
            response = self._http.post(self.url, json=payload)
        except httpx.ConnectTimeout as e:    # no connection at all (a firewall drops the packets): as a refusal
            return _Failure("connection", None, f"{type(e).__name__}: {e}", retryable=True)
        except httpx.TimeoutException as e:
            return _Failure("timeout", None, f"{type(e).__name__}: {e}", retryable=True)
        except httpx.TransportError as e:    # refused, reset, closed without a response, protocol garbage
            return _Failure("connection", None, f"{type(e).__name__}: {e}", retryable=True)
        self._reached.set()
        status = response.status_code
        if status != 200:
            retryable = status in RETRYABLE_STATUSES or status >= 500
            return _Failure(f"http_{status}", status, f"{response.reason_phrase}: {response.text[:300]!r}",
                            retryable, _retry_after_seconds(response))
        try:
            return _parse_message(response.json())
        except ValueError as e:              # JSONDecodeError is a ValueError; so are our shape checks
            return _Failure("malformed_json", status, f"malformed body ({e}): {response.text[:200]!r}", True)

    def _answer_from(self, message: dict[str, Any], index: int, key: str) -> TeacherAnswer:
        answer, reasoning = split_thinking(message["content"], message["reasoning_content"])
        return TeacherAnswer(index=index, key=key, content=answer, reasoning=reasoning,
                             finish_reason=message["finish_reason"], usage=message["usage"], cached=False)

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            # the server knows its own queue better than our backoff does; the cap guards against absurd values
            return min(retry_after, self.max_retry_after)
        ceiling = min(self.backoff_max, self.backoff_base * 2 ** attempt)
        # "equal jitter": at least half the backoff, so clients that failed together do not retry together
        return ceiling / 2 + self._rng.uniform(0, ceiling / 2)

    def _scrub(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text

    # -- many prompts --------------------------------------------------------------------------------------------------

    def run(self, prompts: Sequence[Messages],
            on_result: Callable[[TeacherAnswer | TeacherError], None] | None = None,
            ) -> list[TeacherAnswer | TeacherError]:
        """Answer every prompt, in order: cached answers first, then at most `concurrency` requests in flight.
        Each new answer is in the cache before `on_result` sees it. Before the first request the server is probed
        (`check_reachable`; TeacherUnreachable). A fatal error (401/403/404, a server never reached) cancels the rest
        and is raised; every other failure comes back as a TeacherError in its slot."""
        plan = plan_requests(self.model, self.params, prompts, self.cache)
        results: list[TeacherAnswer | TeacherError | None] = [None] * len(prompts)

        def settle(key: str, outcome: TeacherAnswer | TeacherError) -> None:
            for i in plan.groups[key]:
                results[i] = _with_index(outcome, i)
                if on_result is not None:
                    on_result(results[i])

        to_send = set(plan.to_send)
        for key in plan.groups:
            if key not in to_send:
                self.stats.add("cached", len(plan.groups[key]))
                settle(key, TeacherAnswer.from_record(self.cache.get(key), plan.groups[key][0], cached=True))
        if plan.to_send and not self._probed:
            self.check_reachable()
        self._send_all(prompts, plan, settle)
        return results  # type: ignore[return-value]  # every slot is filled: cached, answered or failed

    def _send_all(self, prompts: Sequence[Messages], plan: RequestPlan,
                  settle: Callable[[str, TeacherAnswer | TeacherError], None]) -> None:
        """`concurrency` daemon worker threads pull keys from a queue; the calling thread settles the outcomes.

        Daemon threads, not a ThreadPoolExecutor: on Ctrl-C or a fatal error we must not wait for requests in flight
        (a read timeout can be many minutes, and closing a socket does not wake a thread blocked on it). Like a
        kill, those requests are simply not cached and the next run asks them again."""
        todo: queue.Queue[str] = queue.Queue()
        for key in plan.to_send:
            todo.put(key)
        done: queue.Queue[tuple[str, TeacherAnswer | TeacherError | BaseException]] = queue.Queue()
        stop = threading.Event()

        def worker() -> None:
            while not stop.is_set():
                try:
                    key = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    done.put((key, self._answer_and_cache(plan.groups[key][0], key, prompts)))
                except BaseException as e:   # a bug, not a teacher failure: hand it to the caller to re-raise
                    done.put((key, e))
                    return

        for _ in range(min(self.concurrency, len(plan.to_send))):
            threading.Thread(target=worker, name="teacher", daemon=True).start()
        try:
            for _ in range(len(plan.to_send)):
                key, outcome = done.get()
                if isinstance(outcome, BaseException) and not isinstance(outcome, TeacherError):
                    raise outcome
                if isinstance(outcome, TeacherError) and outcome.fatal:
                    raise outcome
                settle(key, outcome)
        finally:
            stop.set()                       # workers finish the request in hand and take no more

    def _answer_and_cache(self, index: int, key: str, prompts: Sequence[Messages]) -> TeacherAnswer | TeacherError:
        messages = list(prompts[index])
        try:
            answer = self.complete(messages, index)
        except TeacherError as e:      # a per-prompt outcome, reported by the caller; not swallowed
            self.stats.add("failed")
            return e
        if self.cache is not None:
            self.cache.put({"key": key, "model": self.model, "params": self.params.to_payload(),
                            "messages": messages, "content": answer.content, "reasoning": answer.reasoning,
                            "finish_reason": answer.finish_reason, "usage": answer.usage,
                            "created": time.time()})
        self.stats.add("answered")
        return answer


def _parse_message(body: Any) -> dict[str, Any]:
    """The fields we need from a chat-completions body; ValueError when its shape is wrong."""
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
        raise ValueError("no 'choices' list")
    choice = body["choices"][0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise ValueError("choices[0] has no 'message' object")
    content = message.get("content")
    # vLLM / SGLang / DeepSeek call it reasoning_content; some servers call it reasoning
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if not isinstance(content, (str, type(None))) or not isinstance(reasoning, (str, type(None))):
        raise ValueError("message content / reasoning_content is not a string")
    usage = body.get("usage")
    return {"content": content, "reasoning_content": reasoning, "finish_reason": choice.get("finish_reason"),
            "usage": usage if isinstance(usage, dict) else None}


def _with_index(outcome: TeacherAnswer | TeacherError, index: int) -> TeacherAnswer | TeacherError:
    if isinstance(outcome, TeacherAnswer):
        return replace(outcome, index=index)
    if outcome.index == index:
        return outcome
    return TeacherError(index, outcome.attempts, outcome.status, outcome.reason, outcome.detail, outcome.fatal)

