# python -m pytest tests/test_teacher.py
"""Teacher client, cache and CLI against a real HTTP server on 127.0.0.1 (no mocked transport).

The fake teacher answers "ANSWER[<prompt>]" and misbehaves on purpose, per prompt and per attempt, following a plan:
429 + Retry-After, 500, a response stalled past the client's read timeout, a dropped connection, malformed JSON.
It also answers the client's reachability probe (GET /v1/models), with a chosen status and delay.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.errors import run_script
from common.http import RequestError, ServerUnreachable
from dataset.teacher import AnswerCache, SamplingParams, TeacherAnswer, TeacherClient, cache_key, split_thinking

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI = os.path.join(ROOT, "dataset", "teacher_generate.py")
KEY_ENV = "TEACHER_TEST_API_KEY"
KEY = "sk-test-Zq9xDISTINCTIVEkey-31415"
STALL_S = 1.5          # the server's stall; the clients' read timeout is 0.5 s


def answer_for(prompt: str) -> str:
    return f"ANSWER[{prompt}]"


# ---------------------------------------------------------------------------------------------------------------------
# the fake teacher

class _ServerKeepingClientDisconnects(ThreadingHTTPServer):
    """A client that gave up (the stall's read timeout, a killed CLI) makes the handler's late write fail: expected
    here, so it is kept in `disconnects` instead of printed as a traceback into the test output. Anything else is
    still reported by the base class."""

    def __init__(self, *args):
        super().__init__(*args)
        self.disconnects: list[BaseException] = []

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):
            self.disconnects.append(error)
        else:
            super().handle_error(request, client_address)


class FakeTeacher:
    """ThreadingHTTPServer on port 0. `plan[prompt]` lists the action for each successive attempt (then "ok")."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.plan: dict[str, list[str]] = {}
        self.log: list[tuple[float, str, str]] = []     # (arrival time, prompt, action)
        self.probes: list[str] = []                     # paths of GET requests (the reachability probe)
        self.probe_status, self.probe_delay = 200, 0.0
        self.bodies: list[dict] = []
        self.attempts: Counter = Counter()
        self.lock = threading.Lock()
        self.server = _ServerKeepingClientDisconnects(("127.0.0.1", 0), self._handler_class())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def prompts_sent(self, since: int = 0) -> list[str]:
        with self.lock:
            return [prompt for _, prompt, _ in self.log[since:]]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _next_action(self, body: dict, authorization: str | None) -> tuple[str, str]:
        prompt = body["messages"][-1]["content"]
        with self.lock:
            n = self.attempts[prompt]
            self.attempts[prompt] += 1
            steps = self.plan.get(prompt, [])
            action = steps[n] if n < len(steps) else "ok"
            if authorization != f"Bearer {KEY}":
                action = "401"
            self.log.append((time.monotonic(), prompt, action))
            self.bodies.append(body)
        return prompt, action

    def _handler_class(self):
        teacher = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"       # keep-alive, as real servers do: exercises connection reuse

            def log_message(self, format, *args):   # the default prints every request to stderr
                return

            def do_GET(self):
                with teacher.lock:
                    teacher.probes.append(self.path)
                time.sleep(teacher.probe_delay)
                try:
                    self._send(teacher.probe_status, {"object": "list", "data": [{"id": "fake-teacher"}]})
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True       # the probe gave up on a slow server; that is the point

            def do_POST(self):
                length = int(self.headers["Content-Length"])
                raw = self.rfile.read(length)
                if len(raw) < length:
                    # the client closed while sending (a fatal 401 closes it with a request in flight): no answer
                    self.server.disconnects.append(ConnectionAbortedError(f"body cut at {len(raw)}/{length} bytes"))
                    self.close_connection = True
                    return
                body = json.loads(raw)
                prompt, action = teacher._next_action(body, self.headers.get("Authorization"))
                try:
                    self._act(prompt, action)
                except (BrokenPipeError, ConnectionResetError):
                    # the client gave up (read timeout) before the stalled answer came; that is the point
                    self.close_connection = True

            def _act(self, prompt: str, action: str):
                if action == "drop":                 # close the socket without any response
                    self.close_connection = True
                    return
                if action == "stall":
                    time.sleep(STALL_S)
                elif action == "ok":
                    time.sleep(teacher.delay)
                if action in ("429", "500", "400", "401"):
                    headers = {"Retry-After": "1"} if action == "429" else {}
                    return self._send(int(action), {"error": {"message": f"fake {action}"}}, headers)
                if action == "badjson":
                    return self._send_raw(200, b'{"choices": [{"message": {"content": "ANSW')
                message = {"role": "assistant", "content": answer_for(prompt)}
                finish = "stop"
                if action == "think":
                    message["content"] = f"<think>\nponder {prompt}\n</think>\n\n{answer_for(prompt)}"
                elif action == "reasoning":
                    message["reasoning_content"] = f"ponder {prompt}"
                elif action == "length":          # cut off by max_tokens in the middle of the answer
                    message["content"], finish = f"<think>\nponder\n</think>\n\nANSWER[{prompt[:3]}", "length"
                elif action == "unclosed":        # cut off while still thinking: no answer at all
                    message["content"], finish = f"<think>\nponder {prompt} forever", "length"
                self._send(200, {"id": "x", "object": "chat.completion",
                                 "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                                 "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}})

            def _send(self, status: int, obj: dict, headers: dict | None = None):
                self._send_raw(status, json.dumps(obj).encode(), headers)

            def _send_raw(self, status: int, data: bytes, headers: dict | None = None):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

        return Handler


@pytest.fixture
def no_proxy(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def teacher(monkeypatch, no_proxy):
    monkeypatch.setenv(KEY_ENV, KEY)
    server = FakeTeacher()
    yield server
    server.close()


def make_client(teacher: FakeTeacher, cache: AnswerCache | None = None, **kw) -> TeacherClient:
    options = dict(api_key_env=KEY_ENV, cache=cache, concurrency=4, connect_timeout=0.5, read_timeout=0.5,
                   max_retries=3, backoff_base=0.01, params=SamplingParams(temperature=0.6, max_tokens=64))
    options.update(kw)
    return TeacherClient(teacher.url, "fake-teacher", **options)


def chats(prompts: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": p}] for p in prompts]


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens: the port is closed again when the socket is."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


# ---------------------------------------------------------------------------------------------------------------------
# units

def test_split_thinking():
    assert split_thinking("<think>\nhmm\n</think>\n\n42") == ("42", "hmm")
    assert split_thinking("hmm\n</think>\n\n42") == ("42", "hmm")                  # <think> opened by the template
    assert split_thinking("42", "hmm") == ("42", "hmm")                            # reasoning_content
    assert split_thinking("<think>\nran out of tokens") == ("", "ran out of tokens")
    assert split_thinking("plain answer", None) == ("plain answer", "")
    assert split_thinking(None, "only thoughts") == ("", "only thoughts")


def test_cache_key_is_sha256_and_stable_across_processes():
    messages = [{"role": "user", "content": "1+1?"}]
    params = SamplingParams(temperature=0.6, seed=3).to_payload()
    here = cache_key("m", messages, params)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from dataset.teacher import cache_key, SamplingParams; "
            "print(cache_key('m', [{'content': '1+1?', 'role': 'user'}], "
            "SamplingParams(seed=3, temperature=0.6).to_payload()))")
    there = subprocess.run([sys.executable, "-c", code, ROOT], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "12345"}).stdout.strip()
    assert here == there and len(here) == 64
    assert cache_key("m", messages, SamplingParams(temperature=0.7, seed=3).to_payload()) != here
    assert cache_key("other", messages, params) != here


def test_sampling_params_validation():
    assert SamplingParams(n=2).n == 2                         # n samples in one request: continuations
    with pytest.raises(ValueError, match="n=0"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="n=2: the SFT-data client takes one answer per prompt"):
        TeacherClient("http://127.0.0.1:9/v1", "m", api_key_env=None, params=SamplingParams(n=2))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    payload = SamplingParams(temperature=0.6, max_tokens=10, seed=1, extra={"top_k": 20}).to_payload()
    assert payload == {"temperature": 0.6, "top_p": 1.0, "n": 1, "max_tokens": 10, "seed": 1, "top_k": 20}


def test_missing_key_env_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TEACHER_TEST_UNSET_KEY", raising=False)
    with pytest.raises(ValueError, match="TEACHER_TEST_UNSET_KEY is not set"):
        TeacherClient("http://127.0.0.1:9/v1", "m", api_key_env="TEACHER_TEST_UNSET_KEY")


# ---------------------------------------------------------------------------------------------------------------------
# the client against the fake teacher

def test_every_fault_is_retried_and_every_prompt_answered_once(teacher, tmp_path):
    prompts = [f"problem {i}" for i in range(10)]
    teacher.plan = {prompts[0]: ["429"], prompts[1]: ["500", "500"], prompts[2]: ["stall"], prompts[3]: ["drop"],
                    prompts[4]: ["badjson"], prompts[5]: ["think"], prompts[6]: ["reasoning"]}
    cache = AnswerCache(str(tmp_path / "cache.jsonl"))
    with make_client(teacher, cache) as client:
        assert KEY not in repr(client) and KEY_ENV in repr(client)
        results = client.run(chats(prompts))
    cache.close()

    assert [r.content for r in results] == [answer_for(p) for p in prompts]
    assert all(isinstance(r, TeacherAnswer) and not r.cached for r in results)
    assert results[5].reasoning == f"ponder {prompts[5]}" and results[6].reasoning == f"ponder {prompts[6]}"
    assert results[0].usage["total_tokens"] == 12 and results[0].finish_reason == "stop"
    stats = client.stats.snapshot()
    assert stats["retries"] == {"http_429": 1, "http_500": 2, "timeout": 1, "connection": 1, "malformed_json": 1}
    assert stats["sent"] == 10 + 6 and stats["answered"] == 10 and stats["failed"] == 0
    assert teacher.bodies[0]["temperature"] == 0.6 and teacher.bodies[0]["max_tokens"] == 64
    # Retry-After: 1 was honoured (our own backoff would have waited ~10 ms)
    t429 = [t for t, p, _ in teacher.log if p == prompts[0]]
    assert t429[1] - t429[0] >= 0.95

    lines = (tmp_path / "cache.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert sorted(r["messages"][0]["content"] for r in records) == sorted(prompts)     # each exactly once
    assert {"key", "model", "params", "messages", "content", "reasoning", "finish_reason", "usage",
            "created"} <= set(records[0])
    assert "<think>" not in "".join(r["content"] for r in records)
    assert KEY not in "".join(lines)

    # a rerun over the complete cache sends nothing
    sent_before = len(teacher.log)
    with make_client(teacher, AnswerCache(str(tmp_path / "cache.jsonl"))) as client:
        again = client.run(chats(prompts))
    assert len(teacher.log) == sent_before
    assert [r.content for r in again] == [r.content for r in results] and all(r.cached for r in again)
    assert client.stats.snapshot()["cached"] == 10 and client.stats.snapshot()["sent"] == 0


def test_exhausted_retries_give_a_clear_error_and_nothing_cached(teacher, tmp_path):
    prompts = ["always 500", "bad request", "fine"]
    teacher.plan = {"always 500": ["500"] * 10, "bad request": ["400"]}
    cache = AnswerCache(str(tmp_path / "cache.jsonl"))
    with make_client(teacher, cache, max_retries=2) as client:
        results = client.run(chats(prompts))
    cache.close()
    err, bad, ok = results
    assert isinstance(err, RequestError) and err.index == 0 and err.status == 500 and err.attempts == 3
    assert "prompt 0" in str(err) and "HTTP 500" in str(err) and "3 attempt" in str(err) and KEY not in str(err)
    assert isinstance(bad, RequestError) and bad.status == 400 and bad.attempts == 1     # 4xx: no retry
    assert ok.content == answer_for("fine")
    assert client.stats.snapshot()["failed"] == 2 and client.stats.snapshot()["retries"] == {"http_500": 2}
    assert [json.loads(x)["content"] for x in (tmp_path / "cache.jsonl").read_text().splitlines()] == [ok.content]


def test_wrong_key_stops_the_run(teacher, monkeypatch):
    monkeypatch.setenv("TEACHER_TEST_WRONG_KEY", "sk-wrong")
    with make_client(teacher, api_key_env="TEACHER_TEST_WRONG_KEY", concurrency=2) as client:
        with pytest.raises(RequestError, match="HTTP 401") as info:
            client.run(chats([f"p{i}" for i in range(20)]))
    assert info.value.fatal and "sk-wrong" not in str(info.value)
    # the first two in flight, maybe a few more submitted before the first 401 returns (6 on a loaded 2-core
    # machine); never all 20
    assert len(teacher.log) <= 8


def test_a_server_that_is_not_up_is_refused_by_one_probe(no_proxy):
    # Connection refused: a wrong URL or a server not started. One probe says so before any request is sent,
    # instead of each prompt's retries (22-24 s and 42 connection attempts with the CLI's defaults before the probe).
    url = closed_port_url()
    client = TeacherClient(url, "m", api_key_env=None, concurrency=2)       # default timeouts and retries
    started = time.monotonic()
    with client, pytest.raises(ServerUnreachable, match="is the server up") as info:
        client.run(chats([f"p{i}" for i in range(50)]))
    assert time.monotonic() - started < 1.0
    assert url in str(info.value) and "Connection refused" in str(info.value)
    assert client.stats.snapshot()["sent"] == 0


@pytest.mark.parametrize("status, delay", [(404, 0.0), (200, 1.0)], ids=["no-models-endpoint", "slow"])
def test_the_probe_passes_any_answer_and_a_slow_server(teacher, status, delay):
    # A server without /models, or one too busy to answer the probe within its timeout, is reachable: not refused.
    teacher.probe_status, teacher.probe_delay = status, delay
    with make_client(teacher, probe_timeout=0.3) as client:
        first = client.run(chats(["a"]))
        second = client.run(chats(["b"]))
    assert first[0].content == answer_for("a") and second[0].content == answer_for("b")
    assert teacher.probes == ["/v1/models"]          # once per client, before its first request


def test_a_server_that_never_answers_a_request_stops_the_run(teacher):
    # The probe got through but every request's connection is dropped before any answer: after the first prompt's
    # retries the run stops instead of retrying each of the 50 prompts in turn.
    prompts = [f"p{i}" for i in range(50)]
    teacher.plan = {p: ["drop"] * 10 for p in prompts}
    with make_client(teacher, concurrency=2, max_retries=2) as client:
        with pytest.raises(RequestError, match="never answered: is the server up") as info:
            client.run(chats(prompts))
    assert info.value.fatal and info.value.reason == "connection" and info.value.attempts == 3
    assert client.stats.snapshot()["sent"] <= 2 * 3 + 2     # the first prompts' attempts, never all 50 x 3


def test_a_dropped_connection_after_the_server_answered_fails_one_prompt_only(teacher):
    # Once the server has answered, connection failures are the prompt's own: reported in its slot, run goes on.
    prompts = ["first", "always drops", "last"]
    teacher.plan = {"always drops": ["drop"] * 10}
    with make_client(teacher, concurrency=1, max_retries=1) as client:
        results = client.run(chats(prompts))
    first, dropped, last = results
    assert first.content == answer_for("first") and last.content == answer_for("last")
    assert isinstance(dropped, RequestError) and dropped.reason == "connection" and not dropped.fatal


def test_damaged_last_cache_line_is_cut_off_before_the_next_append(tmp_path):
    path = tmp_path / "cache.jsonl"
    good = [json.dumps({"key": f"k{i}", "content": f"c{i}"}) for i in range(2)]
    path.write_text(good[0] + "\n" + good[1] + "\n" + '{"key": "k2", "cont')      # a crash mid-write
    with pytest.warns(RuntimeWarning, match=r"cache.jsonl:3: ignoring a damaged last line"):
        cache = AnswerCache(str(path))
    assert len(cache) == 2 and "k1" in cache and cache.get("k0")["content"] == "c0"
    cache.put({"key": "k3", "content": "c3"})        # cuts the damaged tail off before appending
    cache.close()
    assert [json.loads(x)["key"] for x in path.read_text().splitlines()] == ["k0", "k1", "k3"]


def test_damaged_middle_cache_line_is_skipped_and_the_cache_stays_usable(tmp_path):
    path = tmp_path / "cache.jsonl"
    good = [json.dumps({"key": f"k{i}", "content": f"c{i}"}) for i in range(3)]
    path.write_text(good[0] + "\n" + "garbage{\n" + good[1] + "\n" + '{"key": "k9"}\n' + good[2])  # no final \n
    with pytest.warns(RuntimeWarning, match=r"cache.jsonl: lines 2, 4: skipping 2 damaged cache line\(s\)"):
        cache = AnswerCache(str(path))
    assert len(cache) == 3 and "k2" in cache and "k9" not in cache      # k9 has no content: its prompt is re-asked
    cache.put({"key": "k9", "content": "c9"})
    cache.put({"key": "k4", "content": "c4"})
    cache.close()

    lines = path.read_text().splitlines()
    assert lines[1] == "garbage{" and lines[3] == '{"key": "k9"}'        # left in place, not silently destroyed
    assert [json.loads(x)["key"] for i, x in enumerate(lines) if i not in (1, 3)] == ["k0", "k1", "k2", "k9", "k4"]
    with pytest.warns(RuntimeWarning, match=r"cache.jsonl: lines 2, 4: skipping"):
        again = AnswerCache(str(path))
    assert len(again) == 5 and again.get("k9")["content"] == "c9"

    path.write_text("\n".join(["garbage{", "more garbage", good[0][:9]]))      # someone else's file
    with pytest.warns(RuntimeWarning, match="damaged last line"):
        with pytest.raises(ValueError, match=r"cache.jsonl: lines 1, 2: not an answer cache"):
            AnswerCache(str(path))   # appending answers to it would damage it


# ---------------------------------------------------------------------------------------------------------------------
# the CLI, as a subprocess

def dapo_rows(prompts: list[str]) -> list[dict]:
    return [{"data_source": "math_dapo", "prompt": [{"content": p, "role": "user"}], "ability": "MATH",
             "reward_model": {"ground_truth": str(i), "style": "rule-lean"},
             "extra_info": {"index": f"id-{i}"}} for i, p in enumerate(prompts)]


def cli_args(teacher: FakeTeacher, data: str, out: str, *extra: str) -> list[str]:
    return ["--data_path", data, "--out", out, "--base_url", teacher.url, "--model", "fake",
            "--api_key_env", KEY_ENV, "--timeout", "2", "--connect_timeout", "1", "--backoff", "0.01",
            "--temperature", "0.6", "--max_tokens", "64", *extra]


def run_cli(capsys, teacher: FakeTeacher, data: str, out: str, *extra: str) -> tuple[int, str, str]:
    """The CLI's main() in this process (importing torch via dataset.sources once, not per run), under run_script as
    the script runs it: (exit code, stdout, stderr)."""
    from dataset.teacher_generate import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_script(lambda: main(cli_args(teacher, data, out, *extra)))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def start_cli_process(teacher: FakeTeacher, data: str, out: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, CLI, *cli_args(teacher, data, out, *extra)],
                            env={**os.environ, KEY_ENV: KEY}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def assert_no_key(*texts: str) -> None:
    for text in texts:
        assert KEY not in text


def test_cli_dapo_parquet_failures_left_out_then_filled(teacher, tmp_path, capsys):
    prompts = [f"What is {i} + {i}?" for i in range(6)]
    data, out = str(tmp_path / "prompts.parquet"), str(tmp_path / "sft.parquet")
    pq.write_table(pa.Table.from_pylist(dapo_rows(prompts)), data)
    teacher.plan = {prompts[2]: ["500"] * 10, prompts[3]: ["length"], prompts[4]: ["think"], prompts[5]: ["unclosed"]}

    rc, stdout, stderr = run_cli(capsys, teacher, data, out, "--max_retries", "1")
    assert rc == 0, stderr
    for line in ("left out (error): [2]", "left out (truncated): [3]", "left out (empty): [5]"):
        assert line in stderr
    assert "prompt 2: no answer after 2 attempt(s); last: HTTP 500" in stderr
    rows = pq.read_table(out).to_pylist()
    assert [r["prompt"][0]["content"] for r in rows] == [prompts[i] for i in (0, 1, 4)]
    for r in rows:
        user = r["prompt"][0]["content"]
        assert r["prompt"] == [{"content": user, "role": "user"},
                               {"content": answer_for(user), "role": "assistant"}]
        i = prompts.index(user)
        assert r["data_source"] == "math_dapo" and r["ability"] == "MATH"
        assert r["reward_model"] == {"ground_truth": str(i), "style": "rule-lean"}
        assert r["extra_info"] == {"index": f"id-{i}"}
    assert set(rows[0]) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    cache_text = (tmp_path / "sft.parquet.cache.jsonl").read_text()
    assert_no_key(stdout, stderr, cache_text, open(out, "rb").read().decode("latin-1"))
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]

    # the teacher recovers: a rerun sends the failed prompt only (truncated / empty answers are cached, not re-asked)
    teacher.plan = {}
    mark = len(teacher.log)
    rc, _, stderr2 = run_cli(capsys, teacher, data, out, "--max_retries", "1")
    assert rc == 0, stderr2
    assert teacher.prompts_sent(mark) == [prompts[2]]
    assert len(pq.read_table(out)) == 4

    # and over a complete cache: zero requests, same output
    mark = len(teacher.log)
    rc, _, stderr3 = run_cli(capsys, teacher, data, out, "--strict", "1")
    assert teacher.prompts_sent(mark) == []
    assert rc == 1 and "left out (truncated): [3]" in stderr3      # --strict
    assert_no_key(stderr2, stderr3)


def test_cli_jsonl_string_prompts_dry_run_and_limit(teacher, tmp_path, capsys):
    prompts = [f"Solve x + {i} = 0" for i in range(4)]
    data, out = tmp_path / "prompts.jsonl", str(tmp_path / "sft.jsonl")
    with open(data, "w") as f:
        for row in dapo_rows(prompts):
            # some exports stringify the chat list; and an existing assistant turn is not part of the request
            row["prompt"] = json.dumps(row["prompt"] + [{"role": "assistant", "content": "old answer"}])
            f.write(json.dumps(row) + "\n")

    rc, _, err = run_cli(capsys, teacher, str(data), out, "--dry_run", "--limit", "3")
    assert rc == 0, err
    assert "3 prompts (3 distinct), 0 cached" in err and "3 request(s) to send" in err
    assert teacher.log == [] and not os.path.exists(out)

    rc, _, err = run_cli(capsys, teacher, str(data), out, "--limit", "3")
    assert rc == 0, err
    assert sorted(teacher.prompts_sent()) == sorted(prompts[:3])
    assert all(b["messages"] == [{"role": "user", "content": b["messages"][0]["content"]}] for b in teacher.bodies)
    rows = [json.loads(line) for line in open(out)]
    assert [r["prompt"] for r in rows] == [[{"role": "user", "content": p},
                                            {"role": "assistant", "content": answer_for(p)}] for p in prompts[:3]]
    assert rows[0]["reward_model"]["ground_truth"] == "0" and "messages" not in rows[0]

    rc, _, err = run_cli(capsys, teacher, str(data), out, "--dry_run")
    assert "4 prompts (4 distinct), 3 cached" in err and "1 request(s) to send" in err
    assert len(teacher.log) == 3


def start_slow_cli_until_cached(teacher, tmp_path, prompts: list[str], answers: int):
    """teacher_generate.py on `prompts` against a slow teacher, returned once `answers` answers are cached:
    -> (process, data path, out path, cache path)."""
    teacher.delay = 0.1
    data, out = str(tmp_path / "prompts.parquet"), str(tmp_path / "sft.parquet")
    cache_path = tmp_path / "sft.parquet.cache.jsonl"
    pq.write_table(pa.Table.from_pylist(dapo_rows(prompts)), data)
    proc = start_cli_process(teacher, data, out, "--concurrency", "2")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (cache_path.exists()
                                               and cache_path.read_text().count("\n") >= answers):
        time.sleep(0.02)
    return proc, data, out, cache_path


@pytest.mark.slow
def test_cli_sigkill_then_rerun_loses_and_repeats_nothing(teacher, tmp_path):
    prompts = [f"Problem #{i}: compute {i} * 3" for i in range(40)]
    proc, data, out, cache_path = start_slow_cli_until_cached(teacher, tmp_path, prompts, answers=12)
    proc.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    assert not os.path.exists(out)
    time.sleep(0.3)          # let anything the killed process had on the wire reach the server log first

    # a kill can land mid-write; whatever complete lines the cache holds are what must never be asked again
    cached = set()
    lines = cache_path.read_text().splitlines()
    for n, line in enumerate(lines):
        try:
            cached.add(json.loads(line)["messages"][0]["content"])
        except ValueError:
            assert n == len(lines) - 1, f"cache line {n + 1} damaged, not the last one"
    assert 12 <= len(cached) < 40

    mark = len(teacher.log)
    rerun = subprocess.run(proc.args, env={**os.environ, KEY_ENV: KEY}, capture_output=True, text=True, timeout=60)
    assert rerun.returncode == 0, rerun.stderr
    resent = teacher.prompts_sent(mark)
    assert len(resent) == len(set(resent)), "a prompt was asked twice in the rerun"
    assert not set(resent) & cached, "the rerun asked for prompts already in the cache"
    assert set(resent) | cached == set(prompts)
    rows = pq.read_table(out).to_pylist()
    assert [r["prompt"][0]["content"] for r in rows] == prompts
    assert all(r["prompt"][1]["content"] == answer_for(r["prompt"][0]["content"]) for r in rows)
    keys = [json.loads(line)["key"] for line in cache_path.read_text().splitlines()]
    assert len(keys) == len(set(keys)) == 40
    assert_no_key(stderr, rerun.stdout, rerun.stderr, cache_path.read_text(), repr(teacher.log))


def test_cli_damaged_middle_cache_line_reasks_its_prompt(teacher, tmp_path, capsys):
    prompts = [f"Compute {i} - 1" for i in range(4)]
    data, out = str(tmp_path / "prompts.parquet"), str(tmp_path / "sft.parquet")
    cache_path = tmp_path / "sft.parquet.cache.jsonl"
    pq.write_table(pa.Table.from_pylist(dapo_rows(prompts)), data)
    assert run_cli(capsys, teacher, data, out, "--concurrency", "1")[0] == 0
    lines = cache_path.read_text().splitlines()
    lost = json.loads(lines[1])["messages"][0]["content"]
    lines[1] = lines[1][:40] + "\x00garbled"         # a disk error in the middle of the file
    cache_path.write_text("\n".join(lines) + "\n")

    mark = len(teacher.log)
    rc, _, err = run_cli(capsys, teacher, data, out)
    assert rc == 0, err
    assert f"teacher: warning: {cache_path}:2: skipping 1 damaged cache line(s)" in err
    assert teacher.prompts_sent(mark) == [lost]
    assert [r["prompt"][1]["content"] for r in pq.read_table(out).to_pylist()] == [answer_for(p) for p in prompts]


def test_cli_damaged_data_file_is_one_line(teacher, tmp_path, capsys):
    data, out = tmp_path / "prompts.parquet", str(tmp_path / "sft.parquet")
    data.write_bytes(b"PAR1 this is not parquet")
    rc, _, err = run_cli(capsys, teacher, str(data), out)
    assert rc == 2 and err.startswith(f"error: --data_path {data}") and err.count("\n") == 1, err
    assert teacher.log == [] and not os.path.exists(out)


# every refusal before the first request: (extra CLI arguments or replacements, exit code, what the line says)
START_UP_FAILURES = {
    "missing-data-file": ({"--data_path": "{tmp}/nothing.parquet"}, 2, "--data_path {tmp}/nothing.parquet: no such"),
    "missing-flag": ({"--model": None}, 2, "the following arguments are required: --model"),
    "bad-flag": ({"--concurrency": "0"}, 2, "--concurrency must be >= 1"),
    "bad-sampling": ({"--temperature": "-1"}, 2, "temperature=-1.0 must be >= 0"),
    "unset-key": ({"--api_key_env": "TEACHER_TEST_UNSET_KEY"}, 2, "TEACHER_TEST_UNSET_KEY is not set"),
    "url-without-scheme": ({"--base_url": "127.0.0.1:8000/v1"}, 2, "must look like http://HOST:PORT/v1"),
    # a folder that cannot be made: its parent is a regular file (permission bits would not stop root)
    "unwritable-out": ({"--out": "{tmp}/a_file/sft.parquet"}, 2, "the --out folder {tmp}/a_file is not writable"),
    "unwritable-cache": ({"--cache": "{tmp}/a_file/c.jsonl"}, 2, "the --cache folder {tmp}/a_file is not writable"),
}


@pytest.mark.parametrize("case", list(START_UP_FAILURES))
def test_cli_start_up_failure_is_one_line_and_sends_nothing(teacher, tmp_path, case):
    changes, code, says = START_UP_FAILURES[case]
    data, out = str(tmp_path / "prompts.parquet"), str(tmp_path / "sft.parquet")
    pq.write_table(pa.Table.from_pylist(dapo_rows(["1 + 1?"])), data)
    (tmp_path / "a_file").write_text("a regular file")
    args = cli_args(teacher, data, out)
    for flag, value in changes.items():
        i = args.index(flag) if flag in args else len(args)
        args[i:i + 2] = [] if value is None else [flag, value.format(tmp=tmp_path)]
    env = {k: v for k, v in os.environ.items() if k != "TEACHER_TEST_UNSET_KEY"}
    proc = subprocess.run([sys.executable, CLI, *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert says.format(tmp=tmp_path) in proc.stderr and "Traceback" not in proc.stderr
    assert teacher.log == [] and teacher.probes == []      # no request, not even the probe: no paid answer lost
    assert not os.path.exists(out)


def test_cli_unreachable_server_is_refused_in_seconds_with_default_flags(no_proxy, tmp_path):
    url = closed_port_url()
    data, out = str(tmp_path / "prompts.parquet"), str(tmp_path / "sft.parquet")
    pq.write_table(pa.Table.from_pylist(dapo_rows([f"q{i}" for i in range(20)])), data)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, CLI, "--data_path", data, "--out", out, "--base_url", url, "--model", "m",
                           "--api_key_env", KEY_ENV], env={**os.environ, KEY_ENV: KEY}, capture_output=True,
                          text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith(f"error: the teacher at {url} cannot be reached"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert elapsed < 5.0, f"{elapsed:.1f} s to refuse an unreachable server"
    assert not os.path.exists(out)


@pytest.mark.slow
def test_cli_ctrl_c_says_the_answers_are_cached(teacher, tmp_path):
    proc, _, out, cache_path = start_slow_cli_until_cached(teacher, tmp_path, [f"Problem #{i}" for i in range(40)],
                                                           answers=4)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted: the ") and f"answers so far are in {cache_path}" in last, stderr
    assert "run the same command again to continue" in last and "Traceback" not in stderr
    assert not os.path.exists(out)
