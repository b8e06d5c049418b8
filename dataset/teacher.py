"""Teacher-written SFT data: a client for an OpenAI-compatible `/v1/chat/completions` endpoint, plus its cache.

    cache = AnswerCache("sft.parquet.cache.jsonl")
    with TeacherClient("http://127.0.0.1:8000/v1", "Qwen3-4B", params=SamplingParams(temperature=0.6),
                       cache=cache, concurrency=8) as client:
        results = client.run(list_of_message_lists)     # TeacherAnswer or RequestError per prompt, in order

- The HTTP machinery is `common.http.ApiClient` (shared with the rollout engine and the remote teacher): bounded
  concurrency, retries with backoff on 429 / 408 / 5xx / timeouts / connection errors / malformed bodies, fatal
  401/403/404, the API key read from a named environment variable and never shown. Other 4xx fail that prompt only.
- Before the first request, one probe (`check_reachable`: GET {base_url}/models, a few seconds at most) refuses a
  wrong host or port, or a server that is not up, at once with `ServerUnreachable`, instead of after the retries.
- The cache is JSONL keyed by sha256 of canonical JSON of (model, messages, sampling parameters) -- never Python's
  `hash()`, which is salted per process. Each answer is appended, flushed and fsynced as it arrives, so a kill
  loses only the requests in flight and a rerun sends only what is missing. A damaged line is skipped with a
  warning and its prompt asked again.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from common.http import ApiClient, RequestError

Messages = list[dict[str, str]]


# ---------------------------------------------------------------------------------------------------------------------
# sampling parameters, answers

@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters sent with every request; they are part of the cache key. `n` > 1 asks for n samples in
    one request (continuations, dataset/continuations.py); the SFT-data client takes one answer per prompt."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    n: int = 1
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)   # e.g. {"top_k": 20} for vLLM; merged into the payload

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n={self.n} must be >= 1")
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

    def __init__(self, path: str, read_only: bool = False):
        """`read_only`: another writer's file (another rank's), read and never appended to or cut."""
        self.path, self.read_only = path, read_only
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
                    then = ("its writer cuts it off before its next append" if self.read_only
                            else "it will be cut off before the next append")
                    warnings.warn(f"{self.path}:{i + 1}: ignoring a damaged last line ({len(line)} bytes, {e}); "
                                  f"probably a crash mid-write. {then[0].upper()}{then[1:]}.",
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
        self._check(record)
        return record

    def _check(self, record: dict[str, Any]) -> None:
        """More checks of a record's shape, for subclasses: ValueError when it is not one of theirs."""

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: str) -> bool:
        return key in self._records

    def get(self, key: str) -> dict[str, Any] | None:
        return self._records.get(key)

    def put(self, record: dict[str, Any]) -> None:
        """Append one record and make it durable before returning (flush + fsync)."""
        if self.read_only:
            raise ValueError(f"{self.path} is another writer's cache file: read only")
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

class TeacherClient(ApiClient):
    """Chat-completions client with bounded concurrency, retries and an optional `AnswerCache`."""

    def __init__(self, base_url: str, model: str, *, params: SamplingParams | None = None,
                 cache: AnswerCache | None = None, **http: Any):
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"n={params.n}: the SFT-data client takes one answer per prompt (ask again with another "
                             f"seed for more)")
        super().__init__(base_url, what="teacher", request_name="prompt", **http)
        self.model = model
        self.params = params
        self.cache = cache

    def __repr__(self) -> str:
        return (f"TeacherClient(url={self.api_url!r}, model={self.model!r}, api_key_env={self.api_key_env!r}, "
                f"params={self.params!r}, concurrency={self.concurrency}, max_retries={self.max_retries})")

    def complete(self, messages: Messages, index: int = 0) -> TeacherAnswer:
        """Ask the teacher once (with retries); no cache. Raises RequestError after the last retry."""
        payload = {"model": self.model, "messages": list(messages), **self.params.to_payload()}
        key = cache_key(self.model, list(messages), self.params.to_payload())
        message = self.post("/chat/completions", payload, _parse_message, index)
        answer, reasoning = split_thinking(message["content"], message["reasoning_content"])
        return TeacherAnswer(index=index, key=key, content=answer, reasoning=reasoning,
                             finish_reason=message["finish_reason"], usage=message["usage"], cached=False)

    def run(self, prompts: Sequence[Messages],
            on_result: Callable[[TeacherAnswer | RequestError], None] | None = None,
            ) -> list[TeacherAnswer | RequestError]:
        """Answer every prompt, in order: cached answers first, then at most `concurrency` requests in flight.
        Each new answer is in the cache before `on_result` sees it. Before the first request the server is probed
        (`check_reachable`; ServerUnreachable). A fatal error (401/403/404, a server never reached) cancels the rest
        and is raised; every other failure comes back as a RequestError in its slot. Like a kill, requests in
        flight when it stops are not cached and the next run asks them again."""
        plan = plan_requests(self.model, self.params, prompts, self.cache)
        results: list[TeacherAnswer | RequestError | None] = [None] * len(prompts)

        def settle(key: str, outcome: TeacherAnswer | RequestError) -> None:
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
        tasks = [lambda key=key: self._answer_and_cache(plan.groups[key][0], key, prompts) for key in plan.to_send]
        for task_index, outcome in self.run_concurrently(tasks):
            if isinstance(outcome, RequestError):
                self.stats.add("failed")
            settle(plan.to_send[task_index], outcome)
        return results  # type: ignore[return-value]  # every slot is filled: cached, answered or failed

    def _answer_and_cache(self, index: int, key: str, prompts: Sequence[Messages]) -> TeacherAnswer:
        messages = list(prompts[index])
        answer = self.complete(messages, index)
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


def _with_index(outcome: TeacherAnswer | RequestError, index: int) -> TeacherAnswer | RequestError:
    return replace(outcome, index=index) if isinstance(outcome, TeacherAnswer) else outcome.for_index(index)

