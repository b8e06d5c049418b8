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


def start_server(folder: str, model_dir: str, name: str, dtype: str) -> VllmServer:
    """One more server, ready (for the tests that need another --dtype; the caller stops it)."""
    port, log = free_port(), os.path.join(folder, f"{name}_{dtype}_server.log")
    server = VllmServer(port, start_vllm(vllm_command(vllm_python(), model_dir, name, port, dtype), log))
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
