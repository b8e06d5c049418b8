"""One HTTP client for OpenAI-compatible inference servers (vLLM, SGLang, hosted APIs): the teacher-data client
(dataset/teacher.py), the rollout engine and the remote teacher (serving/) all post through it.

    client = ApiClient("http://127.0.0.1:8000/v1", concurrency=8)
    client.check_reachable()                         # one GET {base}/models: a wrong URL is refused in seconds
    body = client.post("/completions", payload)      # retries, backoff, timeouts; RequestError after the last try
    for index, outcome in client.run_concurrently(tasks): ...   # at most `concurrency` requests in flight

- Retries with exponential backoff + jitter on 429 / 408 / 5xx / timeouts / connection errors / malformed bodies,
  honouring `Retry-After`. 401/403/404 are fatal (wrong key, URL or model: retrying cannot help), and so is a
  connection failure that outlives its retries before the server ever answered (not up, wrong host or port).
- The API key is read from an environment variable whose *name* is a parameter. It lives in the request headers
  only; it is never printed, logged or shown in `repr`, and error texts are scrubbed of it.
- Concurrency is daemon worker threads over one `httpx.Client` (thread-safe, one connection pool): the work is I/O
  bound, and on Ctrl-C or a fatal error nobody waits for requests in flight.
"""
from __future__ import annotations

import json
import os
import queue
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence, TypeVar

import httpx

RETRYABLE_STATUSES = {408, 429}        # plus every 5xx
FATAL_STATUSES = {401, 403, 404}       # the configuration is wrong: stop everything, do not burn the other requests

T = TypeVar("T")


class RequestError(RuntimeError):
    """A request the server could not answer; the message names the request, the last status and the reason.
    `fatal` errors (wrong key, URL or model; a server never reached) mean no other request can succeed either."""

    def __init__(self, index: int, attempts: int, status: int | None, reason: str, detail: str, fatal: bool = False,
                 what: str = "request"):
        self.index, self.attempts, self.status, self.reason, self.detail, self.fatal = (
            index, attempts, status, reason, detail, fatal)
        self.what = what
        last = f"HTTP {status}" if status is not None else reason
        super().__init__(f"{what} {index}: no answer after {attempts} attempt(s); last: {last} ({detail})")

    def for_index(self, index: int) -> "RequestError":
        """The same failure, reported for another request (identical requests are sent once)."""
        if index == self.index:
            return self
        return type(self)(index, self.attempts, self.status, self.reason, self.detail, self.fatal, self.what)


class ServerUnreachable(ConnectionError):
    """The probe found nothing at the URL: refused, unknown host, no route, or no answer to the connection in time.
    The message names the URL."""


class RequestStats:
    """Thread-safe counters. `sent` counts requests (attempts; not the probe); `answered` / `failed` / `cached` are
    for the caller to count; `retries` counts retries by reason (http_429, http_5xx codes, timeout, connection,
    malformed_json)."""

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


@dataclass
class _Failure:
    reason: str                  # stats key
    status: int | None
    detail: str
    retryable: bool
    retry_after: float | None = None


def api_base_url(base_url: str) -> str:
    """The API root ending in /v1. Accepts `http://host:8000`, `http://host:8000/v1` (the OpenAI SDK convention) or
    a full endpoint (`.../v1/chat/completions`, `.../v1/completions`)."""
    url = base_url.rstrip("/")
    for endpoint in ("/chat/completions", "/completions"):
        url = url.removesuffix(endpoint)
    return url if url.endswith("/v1") else url + "/v1"


def check_url(url: str, what: str) -> None:
    """A ValueError for a URL httpx could not even try (no scheme, no host), rather than a connection error."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ValueError(f"{what} URL {url!r}: {e}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{what} URL {url!r} must look like http://HOST:PORT/v1")


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


class ApiClient:
    """Posts JSON to one OpenAI-compatible server with bounded concurrency, timeouts and retries.

    `what` names the server in messages ("teacher", "rollout server"); `request_name` names one request ("prompt",
    "row")."""

    def __init__(self, base_url: str, *, api_key_env: str | None = "OPENAI_API_KEY", concurrency: int = 8,
                 connect_timeout: float = 10.0, read_timeout: float = 600.0, max_retries: int = 5,
                 backoff_base: float = 1.0, backoff_max: float = 60.0, max_retry_after: float = 300.0,
                 probe_timeout: float = 3.0, what: str = "server", request_name: str = "request"):
        if concurrency < 1 or max_retries < 0 or min(connect_timeout, read_timeout, probe_timeout) <= 0:
            raise ValueError(f"need concurrency >= 1, max_retries >= 0 and positive timeouts; got concurrency="
                             f"{concurrency}, max_retries={max_retries}, timeouts={connect_timeout}/{read_timeout}/"
                             f"{probe_timeout}")
        self.base_url, self.api_key_env, self.what, self.request_name = base_url, api_key_env, what, request_name
        self.api_url = api_base_url(base_url)
        check_url(self.api_url, what)
        self.server_url = self.api_url.removesuffix("/v1")   # where vLLM's /health and dev endpoints live
        self.connect_timeout, self.probe_timeout = connect_timeout, probe_timeout
        self._probed = False
        self.concurrency, self.max_retries = concurrency, max_retries
        self.backoff_base, self.backoff_max, self.max_retry_after = backoff_base, backoff_max, max_retry_after
        self.stats = RequestStats()
        # Set by the first HTTP response of any status. Until then a connection failure that outlives its retries
        # means a wrong URL or a server that is not up: it stops the run instead of failing every request in turn.
        self._reached = threading.Event()
        self._rng = random.Random()
        self._api_key = self._read_key(api_key_env)
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        # the read timeout bounds the wait for each chunk of the answer, so it must cover the whole generation time
        # when the server sends nothing until it is done (non-streaming)
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

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def scrub(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text

    # -- the probe ------------------------------------------------------------------------------------------------

    def check_reachable(self) -> None:
        """One GET {base}/models; ServerUnreachable when nothing answers the connection.

        Only the connection is judged, within `probe_timeout` (or the connect timeout, when shorter): a refusal, an
        unknown host, no route or no answer to the connection means a wrong URL or a server that is not up. A
        response of any status passes (some servers have no /models, some want another key there), and so does a
        slow server: a read timeout means something accepted the connection, and the requests' own timeouts and
        retries take it from there. The body is never read."""
        timeout = httpx.Timeout(self.probe_timeout, connect=min(self.connect_timeout, self.probe_timeout))
        try:
            with self._http.stream("GET", self.api_url + "/models", timeout=timeout):
                pass
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError, httpx.UnsupportedProtocol) as e:
            raise ServerUnreachable(f"the {self.what} at {self.base_url} cannot be reached ({type(e).__name__}: "
                                    f"{self.scrub(one_line(str(e)))}): is the server up and the URL right?"
                                    ) from None
        except httpx.TransportError:
            pass                 # connected, then slow, closed or garbled: reachable; the requests handle the rest
        self._probed = True

    def get_json(self, path: str, timeout: float | None = None) -> Any:
        """One GET of {api_url}{path} (or of the server root for a path outside /v1, such as /health), no retries:
        for metadata. RequestError on any failure."""
        return self._once("GET", path, None, timeout)

    def post_once(self, path: str, payload: dict[str, Any], timeout: float | None = None) -> Any:
        """One POST, no retries: for control endpoints where a retry could apply an action twice."""
        return self._once("POST", path, payload, timeout)

    def _once(self, method: str, path: str, payload: dict[str, Any] | None, timeout: float | None) -> Any:
        outcome = self._attempt(method, self._url(path), payload, lambda body: body, timeout)
        if isinstance(outcome, _Failure):
            raise RequestError(0, 1, outcome.status, outcome.reason, self.scrub(outcome.detail),
                               fatal=True, what=f"{method} {path}")
        return outcome

    def _url(self, path: str) -> str:
        """The OpenAI API (`/completions`, `/chat/completions`, `/models`) lives under /v1; vLLM's own endpoints
        (`/health`, `/tokenize`, `/collective_rpc`, ...) at the server root."""
        return (self.api_url if path.startswith(("/completions", "/chat/", "/models")) else self.server_url) + path

    # -- one request, with retries --------------------------------------------------------------------------------

    def post(self, path: str, payload: dict[str, Any], parse: Callable[[Any], T] = lambda body: body,
             index: int = 0) -> T:
        """POST `payload` to {api_url}{path} until an answer `parse` accepts (it raises ValueError on a malformed
        body, which is retried). Raises RequestError after the last retry, or at once for a fatal status."""
        url = self._url(path)
        for attempt in range(self.max_retries + 1):
            self.stats.add("sent")
            outcome = self._attempt("POST", url, payload, parse)
            if not isinstance(outcome, _Failure):
                return outcome
            last_try = attempt == self.max_retries
            if not outcome.retryable or last_try:
                unreachable = outcome.reason == "connection" and not self._reached.is_set()
                detail = self.scrub(outcome.detail)
                if unreachable:
                    detail = f"the {self.what} at {url} never answered: is the server up and the URL right? {detail}"
                raise RequestError(index, attempt + 1, outcome.status, outcome.reason, detail,
                                   fatal=outcome.status in FATAL_STATUSES or unreachable, what=self.request_name)
            self.stats.add_retry(outcome.reason)
            time.sleep(self._delay(attempt, outcome.retry_after))
        raise AssertionError("unreachable: the loop returns or raises")

    def _attempt(self, method: str, url: str, payload: dict[str, Any] | None, parse: Callable[[Any], T],
                 timeout: float | None = None) -> T | _Failure:
        try:
            response = self._http.request(method, url, json=payload,
                                          **({"timeout": timeout} if timeout is not None else {}))
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
            return parse(response.json() if response.content else None)
        except ValueError as e:              # JSONDecodeError is a ValueError; so are the parsers' shape checks
            return _Failure("malformed_json", status, f"malformed body ({e}): {response.text[:200]!r}", True)

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            # the server knows its own queue better than our backoff does; the cap guards against absurd values
            return min(retry_after, self.max_retry_after)
        ceiling = min(self.backoff_max, self.backoff_base * 2 ** attempt)
        # "equal jitter": at least half the backoff, so clients that failed together do not retry together
        return ceiling / 2 + self._rng.uniform(0, ceiling / 2)

    # -- many requests --------------------------------------------------------------------------------------------

    def run_concurrently(self, tasks: Sequence[Callable[[], T]]) -> Iterator[tuple[int, T | RequestError]]:
        """Run `tasks` (each posts through this client) on at most `concurrency` daemon threads; yield (index,
        result or RequestError) as each settles. A fatal RequestError, or any other exception (a bug), is raised
        and the rest are abandoned.

        Daemon threads, not a ThreadPoolExecutor: on Ctrl-C or a fatal error we must not wait for requests in flight
        (a read timeout can be many minutes, and closing a socket does not wake a thread blocked on it)."""
        todo: queue.Queue[int] = queue.Queue()
        for index in range(len(tasks)):
            todo.put(index)
        done: queue.Queue[tuple[int, Any]] = queue.Queue()
        stop = threading.Event()

        def worker() -> None:
            while not stop.is_set():
                try:
                    index = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    done.put((index, tasks[index]()))
                except BaseException as e:   # a RequestError, or a bug: the caller decides
                    done.put((index, e))
                    if not isinstance(e, RequestError):
                        return

        for _ in range(min(self.concurrency, len(tasks))):
            threading.Thread(target=worker, name=self.what, daemon=True).start()
        try:
            for _ in range(len(tasks)):
                index, outcome = done.get()
                if isinstance(outcome, BaseException) and (not isinstance(outcome, RequestError) or outcome.fatal):
                    raise outcome
                yield index, outcome
        finally:
            stop.set()                       # workers finish the request in hand and take no more


def send_json(handler, status: int, obj: dict) -> None:
    """The answer of a small OpenAI-compatible server written with http.server (the demo's rule-based teacher, the
    tests' stub): `obj` as a JSON body with its status, on a kept-alive connection (Content-Length set)."""
    data = json.dumps(obj).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
