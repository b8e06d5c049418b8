"""Continuations of a student's partial answer by a black-box teacher: the client of logit-free on-policy distillation.

The teacher is any OpenAI-compatible text endpoint (any model family, proprietary APIs included); only text goes
in and out. For a chunk of a student's completion, the teacher continues `prompt + completion[:anchor]` n times:

    cache = ContinuationCache(f"{save_dir}/{name}_teacher_cache", rank=rank)      # every rank's file read
    client = ContinuationClient(url, "Qwen3-32B", form="completions", tokenizer_dir="/models/Qwen3-32B",
                                params=SamplingParams(temperature=1.0, n=4), cache=cache, concurrency=32)
    client.check_continuation()                   # at start-up: refuses an endpoint that starts a new reply instead
    batch = client.continue_batch([ContinuationRequest(messages, partial, max_tokens=ceil(1.5 * C), seed=s), ...])
    batch.texts[i]                                # request i's n continuation texts; batch.usage: requests, tokens

Two request forms, because servers differ in how a partial answer can be handed over:
- `completions`: POST /v1/completions with `prompt` = the conversation rendered through the *teacher's* own chat
  template (a tokenizer folder given by the caller) with the final assistant message continued
  (`QwenTokenizer.apply_chat_template(..., continue_final_message=True)`, as transformers renders it). vLLM, SGLang
  and most self-hosted servers. The rendered text is sent as is: a template that writes a BOS token meets a server
  that adds its own (vLLM's completions endpoint does, unless the request options say "add_special_tokens": false).
- `chat`: POST /v1/chat/completions with the prompt's messages + {"role": "assistant", "content": partial}, plus the
  request options that make the server continue that message instead of answering it: vLLM's
  {"continue_final_message": true, "add_generation_prompt": false} by default; APIs that prefill a final assistant
  message without being asked take `options={}`. A chat API that can do neither is out of scope. With vLLM, run the
  teacher without --reasoning-parser: a continuation split into reasoning and content is refused (the split loses
  the text's exact form).
`check_continuation()` sends one short request (continue "1, 2, 3, 4," at temperature 0) and refuses, in one line,
an endpoint whose answer restarts instead of going on with 5.

At the boundary. The partial is decoded student text; the teacher re-tokenises it with its own tokenizer (or the
server does), so a word the anchor cuts mid-token may be split into other tokens than the student's (" wor" + "ld"
rather than " world"): the teacher continues a prefix that reads the same but is tokenised otherwise, and its first
tokens may be a little less likely than they would after the student's own token boundary. Text, not tokens, is
what the loop compares. Qwen3's thinking block: Qwen3's template renders a final assistant message as
`<think>\\n{reasoning}\\n</think>\\n\\n{answer}`, whatever enable_thinking says. So with enable_thinking 0, where the
student's prompt ends with an empty `<think>\\n\\n</think>\\n\\n` and the partial is answer text, the teacher's
rendering adds the same empty block: the teacher's prefix is the student's, character for character. With
enable_thinking 1, a partial that contains the student's whole `<think>...</think>` block (an anchor in the answer)
is rendered back as written when its spacing is the template's own (`<think>\\n...\\n</think>\\n\\n`; other spacing is
refused by the rendering, and by vLLM's chat endpoint likewise). A partial whose `<think>` is still open (an anchor
inside the thinking) is refused (`ContinuationRequest`): the template would put an empty thinking block in front of
it, and the teacher would read the student's thoughts as an answer. The template also drops newlines at the start of
the answer (`content.lstrip('\\n')`).

The cache: one JSONL file per rank, `{stem}.rank{R}.jsonl`; every rank reads all files of that stem at start (so a
resume at another world size finds every answer), and appends to its own file only, flushed and fsynced per answer:
a kill loses only the requests in flight. Keys: sha256 of canonical JSON of the endpoint (base URL), model, form,
request options, prefix (messages + partial for `chat`, the rendered prompt for `completions`), the sampling
parameters and the seed.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Sequence

from common.errors import RuntimeFailure, UserError
from common.http import ApiClient, RequestError, ServerUnreachable, one_line
from dataset.teacher import AnswerCache, Messages, SamplingParams, canonical_json

FORMS = ("chat", "completions")
# the request keys that make each form continue the final message: vLLM's; a prefill-style chat API takes {}
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "chat": {"continue_final_message": True, "add_generation_prompt": False},
    "completions": {},
}
RESERVED = {"model", "messages", "prompt", "n", "seed", "max_tokens", "temperature", "top_p", "stream"}

PROBE_MESSAGES: Messages = [{"role": "user", "content": "Count from 1 to 20, separated by commas. Write only the "
                                                        "numbers."}]
PROBE_PARTIAL = "1, 2, 3, 4,"
PROBE_NEXT = 5                        # the first number of a continuation of PROBE_PARTIAL
PROBE_TOKENS = 8


# ---------------------------------------------------------------------------------------------------------------------
# requests, answers, usage

@dataclass(frozen=True)
class ContinuationRequest:
    """Continue `partial` (the student's completion up to the anchor, decoded) as the assistant's answer to
    `messages` (the prompt: system / user / earlier turns, not ending with an assistant message).

    `max_tokens` and `seed` override the client's sampling parameters for this request (the caller derives the seed
    from (seed, epoch, step, row, chunk); with n > 1, vLLM seeds the i-th sample seed + i). `name` says which
    request it is in errors ("step 12 row 3 chunk 1"). A partial with an open `<think>` is refused (module
    docstring: the template would close an empty thinking block in front of it)."""
    messages: Messages
    partial: str
    max_tokens: int | None = None
    seed: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.partial, str):
            raise TypeError(f"partial must be text, got {type(self.partial).__name__}")
        if not self.messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                        for m in self.messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
        if self.messages[-1]["role"] == "assistant":
            raise ValueError("messages end with an assistant message: pass its text as `partial` instead")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if ends_inside_thinking(self.partial):
            raise ValueError(f"{self.name or 'a continuation request'}: the partial ends inside the student's thinking (an open <think>): a "
                             f"final assistant message is rendered after an empty thinking block of its own, so the "
                             f"teacher would read these thoughts as an answer. Choose anchors after </think>, or "
                             f"sample the student with enable_thinking 0")

    def label(self, index: int) -> str:
        """How errors name it: its `name`, or its place in the batch."""
        return self.name or f"request {index} of the batch"


@dataclass
class ContinuationUsage:
    """One `continue_batch` call: `requests` sent (cache misses; identical requests in a batch are sent once and
    the others counted in `cached`), `cached` answered from the cache, `http_requests` HTTP requests made (retries
    included; n per request with `split_n`), and the tokens the server reported in `usage` (0 where it reports
    none). Cached answers cost nothing and count no tokens."""
    requests: int = 0
    cached: int = 0
    http_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def cost(self, input_per_million: float, output_per_million: float) -> float:
        """An estimate in the prices' currency, from prices per million prompt and completion tokens."""
        return (self.prompt_tokens * input_per_million + self.completion_tokens * output_per_million) / 1e6

    def __add__(self, other: "ContinuationUsage") -> "ContinuationUsage":
        return ContinuationUsage(*(getattr(self, f) + getattr(other, f) for f in self.__dataclass_fields__))


@dataclass
class ContinuationBatch:
    texts: list[list[str]]            # per request, its n continuations in choice order
    finish_reasons: list[list[str | None]]
    cached: list[bool]                # per request: answered from the cache (or by an identical request)
    usage: ContinuationUsage


# ---------------------------------------------------------------------------------------------------------------------
# cache keys, the cache

def continuation_key(url: str, model: str, form: str, options: dict[str, Any], prefix: dict[str, Any],
                     params: dict[str, Any]) -> str:
    """sha256 of canonical JSON (stable across processes and machines). `prefix` is {"messages": [...]} (the
    prompt's messages + the assistant's partial) for `chat`, {"prompt": text} (the rendered prompt) for
    `completions`; `params` the sampling parameters sent, seed and max_tokens included."""
    blob = canonical_json({"kind": "continuation", "url": url, "model": model, "form": form, "options": options,
                           "prefix": prefix, "params": params})
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class _ContinuationFile(AnswerCache):
    """One rank's file: records {"key", "texts": [str, ...], ...}."""
    REQUIRED = ("key",)

    def _check(self, record: dict[str, Any]) -> None:
        texts = record.get("texts")
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("field 'texts' missing or not a non-empty list of strings")


_RANK_FILE = re.compile(r"\.rank(\d+)\.jsonl$")


class ContinuationCache:
    """The continuations of every rank: `{stem}.rank{R}.jsonl` for R = 0, 1, ... all read at start, new answers
    appended to this rank's file only (flushed and fsynced per answer, by `AnswerCache`). A damaged line is skipped
    with a warning and its request asked again; a torn last line of this rank's file is cut off before the next
    append (another rank's is left to that rank). A key in several files keeps the first answer read (this rank's
    file first, then by rank)."""

    def __init__(self, stem: str, rank: int = 0):
        if rank < 0:
            raise ValueError(f"rank={rank} must be >= 0")
        self.stem, self.rank = stem, rank
        self.path = f"{stem}.rank{rank}.jsonl"
        others = []
        for path in glob.glob(f"{glob.escape(stem)}.rank*.jsonl"):
            match = _RANK_FILE.search(path)
            if match and path[:match.start()] == stem and path != self.path:
                others.append((int(match.group(1)), path))
        self._own = _ContinuationFile(self.path)
        self._others = [_ContinuationFile(path, read_only=True) for _, path in sorted(others)]
        self.paths = [self.path] * os.path.exists(self.path) + [f.path for f in self._others]   # files read
        self._records: dict[str, dict[str, Any]] = {}
        for part in (self._own, *self._others):
            for key, record in part._records.items():
                self._records.setdefault(key, record)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: str) -> bool:
        return key in self._records

    def get(self, key: str) -> dict[str, Any] | None:
        return self._records.get(key)

    def put(self, record: dict[str, Any]) -> None:
        self._own.put(record)                 # durable before it counts as cached
        with self._lock:
            self._records.setdefault(record["key"], record)

    def close(self) -> None:
        self._own.close()


# ---------------------------------------------------------------------------------------------------------------------
# the client

@dataclass
class _Prepared:
    """A request as it goes out: the key, the path, the payload without sampling parameters, the params."""
    key: str
    path: str
    body: dict[str, Any]
    params: dict[str, Any]


@dataclass
class _Answer:
    texts: list[str]
    finish_reasons: list[str | None]
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class _Unit:
    """One HTTP request: the whole of a continuation request's n, or one of them (`split_n`)."""
    key: str
    part: int
    payload: dict[str, Any]
    n: int


class ContinuationClient(ApiClient):
    """Continuations of partial answers from an OpenAI-compatible endpoint, in the `chat` or `completions` form
    (module docstring), with bounded concurrency, retries (`common.http.ApiClient`) and an optional
    `ContinuationCache`.

    params: temperature, top_p, n, extra (e.g. {"top_k": 20}), and the default max_tokens / seed of a request.
    tokenizer_dir: the teacher's tokenizer folder (tokenizer.json + chat template), required by `completions`.
    options: the form's extra request keys (default DEFAULT_OPTIONS[form]); `template_kwargs`: extra variables of
    the teacher's template for `completions` (Qwen3's rendering of a final assistant message ignores
    enable_thinking). split_n: ask for the n continuations as n requests with n=1 and seeds seed + i (vLLM's rule
    for its i-th sample), for an endpoint without `n`.
    """

    def __init__(self, base_url: str, model: str, *, form: str = "completions", tokenizer_dir: str | None = None,
                 params: SamplingParams | None = None, cache: ContinuationCache | None = None,
                 options: dict[str, Any] | None = None, template_kwargs: dict[str, Any] | None = None,
                 split_n: bool = False, **http: Any):
        if form not in FORMS:
            raise ValueError(f"form={form!r}: use one of {FORMS}")
        self.form, self.model, self.cache, self.split_n = form, model, cache, split_n
        self.params = params or SamplingParams()
        self.options = dict(DEFAULT_OPTIONS[form] if options is None else options)
        clash = RESERVED & (set(self.options) | set(self.params.extra))
        if clash:
            raise ValueError(f"options / params.extra must not set {sorted(clash)}: they are the request's own")
        self.template_kwargs = dict(template_kwargs or {})
        self.tokenizer = None
        if tokenizer_dir is not None:
            from model.tokenizer import load_tokenizer
            self.tokenizer = load_tokenizer(tokenizer_dir)
        if form == "completions" and self.tokenizer is None:
            raise ValueError("form='completions' renders the prompt through the teacher's chat template: pass "
                             "tokenizer_dir, the teacher's tokenizer folder (or use form='chat')")
        super().__init__(base_url, what="teacher", request_name="continuation", **http)

    def __repr__(self) -> str:
        return (f"ContinuationClient(url={self.api_url!r}, model={self.model!r}, form={self.form!r}, "
                f"api_key_env={self.api_key_env!r}, params={self.params!r}, split_n={self.split_n}, "
                f"concurrency={self.concurrency}, max_retries={self.max_retries})")

    # -- building requests ----------------------------------------------------------------------------------------

    def render(self, messages: Messages, partial: str) -> str:
        """The `completions` form's prompt: the conversation through the teacher's template, cut right after the
        partial (ValueError when the template changes the partial so that it cannot be found)."""
        return self.tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": partial}],
                                                  continue_final_message=True, **self.template_kwargs)

    def prepare(self, request: ContinuationRequest, form: str | None = None,
                params: SamplingParams | None = None, options: dict[str, Any] | None = None) -> _Prepared:
        """The request's key and payload (a ValueError from the template for `completions`)."""
        form = form or self.form
        options = self.options if options is None else options
        params = params or self.params
        params = replace(params, max_tokens=request.max_tokens if request.max_tokens is not None else
                         params.max_tokens, seed=request.seed if request.seed is not None else params.seed)
        sampling = params.to_payload()
        key_params = {**sampling, "split_n": True} if self.split_n and params.n > 1 else sampling
        if form == "chat":
            messages = [*request.messages, {"role": "assistant", "content": request.partial}]
            prefix, path, body = {"messages": messages}, "/chat/completions", {"messages": messages}
        else:
            prompt = self.render(list(request.messages), request.partial)
            prefix, path, body = {"prompt": prompt}, "/completions", {"prompt": prompt}
        key = continuation_key(self.api_url, self.model, form, options, prefix, key_params)
        return _Prepared(key, path, {"model": self.model, **body, **options}, sampling)

    def _units(self, prepared: _Prepared) -> list[_Unit]:
        n = prepared.params["n"]
        if not self.split_n or n == 1:
            return [_Unit(prepared.key, 0, {**prepared.body, **prepared.params}, n)]
        seed = prepared.params.get("seed")
        return [_Unit(prepared.key, i, {**prepared.body, **prepared.params, "n": 1,
                                        **({"seed": seed + i} if seed is not None else {})}, 1) for i in range(n)]

    # -- one HTTP request -----------------------------------------------------------------------------------------

    def _ask(self, path: str, unit: _Unit, index: int) -> _Answer:
        parse = _parse_chat if path == "/chat/completions" else _parse_completions
        answer, reasoning = self.post(path, unit.payload, parse, index)
        if reasoning:
            raise RequestError(index, 1, 200, "reasoning_split", f"the server split the continuation into reasoning "
                               f"({reasoning[:60]!r}) and content: start it without a reasoning parser (vLLM: no "
                               f"--reasoning-parser) or use the completions form", what=self.request_name)
        if len(answer.texts) < unit.n:
            raise RequestError(index, 1, 200, "too_few_choices", f"{len(answer.texts)} choice(s) for n={unit.n}: "
                               f"the endpoint may not support n; pass split_n=True", what=self.request_name)
        return answer

    # -- the batch ------------------------------------------------------------------------------------------------

    def continue_batch(self, requests: Sequence[ContinuationRequest]) -> ContinuationBatch:
        """For each request, its n continuation texts, in order: cached answers first, then every other request in
        flight at once, at most `concurrency` HTTP requests at a time. Each new answer is in the cache before this
        returns. RuntimeFailure naming the request when one fails after its retries (or at once for 401/403/404, a
        4xx, a prompt the teacher's template cannot render, fewer choices than n), or when the server cannot be
        reached; answers received before are kept in the cache."""
        usage = ContinuationUsage()
        prepared: list[_Prepared] = []
        for i, request in enumerate(requests):
            try:
                prepared.append(self.prepare(request))
            except ValueError as e:
                raise RuntimeFailure(f"{request.label(i)}: the teacher's chat template cannot continue it "
                                     f"({one_line(str(e))[:300]})") from None
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(prepared):
            groups.setdefault(p.key, []).append(i)
        answers: dict[str, _Answer] = {}
        for key, rows in groups.items():
            record = self.cache.get(key) if self.cache is not None else None
            if record is not None:
                answers[key] = _Answer(list(record["texts"]), list(record.get("finish_reasons") or
                                                                    [None] * len(record["texts"])))
        to_send = [key for key in groups if key not in answers]
        usage.cached = len(requests) - len(to_send)
        usage.requests = len(to_send)
        sent_before = self.stats.snapshot()["sent"]
        if to_send:
            self._send(requests, prepared, groups, to_send, answers, usage)
        usage.http_requests = self.stats.snapshot()["sent"] - sent_before
        n = self.params.n
        texts, reasons, cached = [], [], []
        for i, p in enumerate(prepared):
            answer = answers[p.key]
            if len(answer.texts) != n:
                raise RuntimeFailure(f"{requests[i].label(i)}: the cache holds {len(answer.texts)} continuation(s) "
                                     f"for n={n}: {self.cache.path if self.cache else ''} is damaged")
            texts.append(list(answer.texts))
            reasons.append(list(answer.finish_reasons))
            cached.append(p.key not in to_send or groups[p.key][0] != i)
        return ContinuationBatch(texts, reasons, cached, usage)

    def _send(self, requests: Sequence[ContinuationRequest], prepared: list[_Prepared],
              groups: dict[str, list[int]], to_send: list[str], answers: dict[str, _Answer],
              usage: ContinuationUsage) -> None:
        if not self._probed:
            try:
                self.check_reachable()
            except ServerUnreachable as e:
                raise RuntimeFailure(one_line(str(e))) from None
        units = [unit for key in to_send for unit in self._units(prepared[groups[key][0]])]
        parts: dict[str, dict[int, _Answer]] = {key: {} for key in to_send}
        expected = Counter(u.key for u in units)            # HTTP requests per key

        def label(unit_index: int) -> str:
            first = groups[units[unit_index].key][0]
            return requests[first].label(first)

        tasks = [lambda u=u, i=i: self._ask(prepared[groups[u.key][0]].path, u, i) for i, u in enumerate(units)]
        outcomes = self.run_concurrently(tasks)
        try:
            with contextlib.closing(outcomes):
                for unit_index, outcome in outcomes:
                    if isinstance(outcome, RequestError):
                        self.stats.add("failed")
                        raise RuntimeFailure(self._failed(label(unit_index), outcome))
                    unit = units[unit_index]
                    parts[unit.key][unit.part] = outcome
                    usage.prompt_tokens += outcome.prompt_tokens
                    usage.completion_tokens += outcome.completion_tokens
                    if len(parts[unit.key]) == expected[unit.key]:
                        answers[unit.key] = self._store(unit.key, prepared[groups[unit.key][0]],
                                                        requests[groups[unit.key][0]], parts[unit.key])
        except RequestError as e:           # fatal: wrong key, URL or model; a server never reached
            self.stats.add("failed")
            raise RuntimeFailure(self._failed(label(e.index), e)) from None

    def _failed(self, label: str, error: RequestError) -> str:
        return (f"the teacher at {self.base_url} ({self.form} form) gave no continuation for {label}: "
                f"{one_line(str(error))}")

    def _store(self, key: str, prepared: _Prepared, request: ContinuationRequest,
               parts: dict[int, _Answer]) -> _Answer:
        ordered = [parts[i] for i in sorted(parts)]
        n = prepared.params["n"]             # a server that gives more choices than asked: the first n
        answer = _Answer([t for a in ordered for t in a.texts][:n], [r for a in ordered for r in a.finish_reasons][:n],
                         sum(a.prompt_tokens for a in ordered), sum(a.completion_tokens for a in ordered))
        if self.cache is not None:
            self.cache.put({"key": key, "url": self.api_url, "model": self.model, "form": self.form,
                            "params": prepared.params, "name": request.name, "texts": answer.texts,
                            "finish_reasons": answer.finish_reasons,
                            "usage": {"prompt_tokens": answer.prompt_tokens,
                                      "completion_tokens": answer.completion_tokens},
                            "created": time.time()})
        self.stats.add("answered")
        return answer

    # -- the start-up probe ---------------------------------------------------------------------------------------

    def check_continuation(self, form: str | None = None, check_text: bool = True) -> str:
        """At start-up: one short request (continue PROBE_PARTIAL at temperature 0, n=1, PROBE_TOKENS tokens, no
        cache) whose text must go on with the next number, not start a new reply; with n > 1 (and not split_n) a
        second one, sampled (n=2, one token), that must give 2 choices (greedy n > 1 is refused by vLLM). Returns
        the greedy text; UserError (the endpoint cannot continue, or refuses the request) or RuntimeFailure (not
        reachable, no answer) naming the URL and the form, and what to try. `form` checks the other form (with its
        default options) than the client's. A teacher too weak to count (a tiny or random model) fails the text
        check: `check_text=False` keeps the requests' checks (accepted, rendered, n honoured) and skips that one."""
        form = form or self.form
        options = self.options if form == self.form else DEFAULT_OPTIONS[form]
        other = "the completions form (with the teacher's tokenizer_dir)" if form == "chat" else "the chat form"
        where = f"the teacher at {self.base_url} ({form} form)"
        try:
            self.check_reachable()
            greedy = replace(self.params, temperature=0.0, n=1, seed=None, max_tokens=PROBE_TOKENS)
            text = self._probe(form, greedy, options, where, other).texts[0]
            if check_text and not resumes(text):
                raise UserError(f"{where} does not continue a partial answer: asked to go on from "
                                f"{PROBE_PARTIAL!r}, it answered {text[:80]!r}, not the next number. Try {other} (or, "
                                f"for the chat form, the request options that prefill an assistant message); a chat "
                                f"API without assistant prefill is out of scope")
            if self.params.n > 1 and not self.split_n:
                self._probe(form, replace(self.params, n=2, seed=0, max_tokens=1), options, where, other)
        except ServerUnreachable as e:
            raise RuntimeFailure(one_line(str(e))) from None
        return text

    def _probe(self, form: str, params: SamplingParams, options: dict[str, Any], where: str, other: str) -> _Answer:
        """One probe request, its failures as the probe's one-line errors."""
        try:
            prepared = self.prepare(ContinuationRequest(PROBE_MESSAGES, PROBE_PARTIAL, name="the probe"),
                                    form, params, options)
        except ValueError as e:
            raise UserError(f"{where}: the teacher's chat template cannot continue a final assistant message "
                            f"({one_line(str(e))[:200]}): try {other}") from None
        try:
            return self._ask(prepared.path, _Unit(prepared.key, 0, {**prepared.body, **prepared.params}, params.n), 0)
        except RequestError as e:
            if e.reason == "too_few_choices":
                raise UserError(f"{where} returned fewer choices than n: pass split_n=True (n requests of one "
                                f"continuation each)") from None
            message = f"{where} could not continue a partial answer: {one_line(str(e))}"
            if e.status is not None and 400 <= e.status < 500 and e.status not in (408, 429):
                raise UserError(f"{message}; try {other}, or other request options (a chat API that "
                                f"cannot prefill an assistant message is out of scope)") from None
            raise RuntimeFailure(message) from None


def ends_inside_thinking(partial: str) -> bool:
    """Whether a partial answer ends inside a thinking block (a `<think>` with no `</think>` after it): such a
    partial cannot be continued as a final assistant message (module docstring)."""
    return partial.rfind("<think>") > partial.rfind("</think>")


def resumes(text: str) -> bool:
    """Whether a continuation of PROBE_PARTIAL goes on with the next number: its first number is PROBE_NEXT (a new
    reply restarts at 1, or says something first)."""
    match = re.search(r"\d+", text)
    return match is not None and int(match.group()) == PROBE_NEXT and not text[:match.start()].strip(" ,\n")


# ---------------------------------------------------------------------------------------------------------------------
# responses

def _choices(body: Any) -> list[dict[str, Any]]:
    if not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]:
        raise ValueError("no 'choices' list")
    choices = body["choices"]
    if not all(isinstance(c, dict) for c in choices):
        raise ValueError("a choice is not an object")
    return sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c.get("index"), int) else 0)


def _usage(body: dict[str, Any], answer: _Answer) -> _Answer:
    usage = body.get("usage")
    if isinstance(usage, dict):
        for name in ("prompt_tokens", "completion_tokens"):
            value = usage.get(name)
            if isinstance(value, int) and value >= 0:
                setattr(answer, name, value)
    return answer


def _parse_completions(body: Any) -> tuple[_Answer, str]:
    choices = _choices(body)
    if not all(isinstance(c.get("text"), str) for c in choices):
        raise ValueError("a choice has no 'text' string")
    return _usage(body, _Answer([c["text"] for c in choices], [c.get("finish_reason") for c in choices])), ""


def _parse_chat(body: Any) -> tuple[_Answer, str]:
    texts, reasons, reasoning = [], [], ""
    for choice in _choices(body):
        message = choice.get("message")
        if not isinstance(message, dict):
            raise ValueError("a choice has no 'message' object")
        content = message.get("content")
        thought = message.get("reasoning_content") or message.get("reasoning")
        if not isinstance(content, (str, type(None))) or not isinstance(thought, (str, type(None))):
            raise ValueError("message content / reasoning_content is not a string")
        texts.append(content or "")
        reasons.append(choice.get("finish_reason"))
        reasoning = reasoning or (thought or "")
    return _usage(body, _Answer(texts, reasons)), reasoning


__all__ = ["ContinuationBatch", "ContinuationCache", "ContinuationClient", "ContinuationRequest",
           "ContinuationUsage", "DEFAULT_OPTIONS", "FORMS", "continuation_key", "resumes"]
