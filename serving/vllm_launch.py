"""Start a vLLM server that the trainer can sync weights into: the one command for users, tests and benchmarks.

    python serving/vllm_launch.py --model checkpoints/kd --name student --port 8000          # CPU, fp32
    python serving/vllm_launch.py --model checkpoints/sft --name teacher --port 8001 --max_logprobs 64  # top-64
    python serving/vllm_launch.py --model /models/Qwen3-0.6B --name student --port 8000 --dtype bfloat16 \
        --python /opt/vllm/bin/python -- --gpu-memory-utilization 0.3                          # extra vLLM flags

It runs, in the vLLM environment's Python (serving/setup_vllm_cpu.sh makes one; --python or DISTILL_VLLM_VENV
points at another):

    VLLM_SERVER_DEV_MODE=1 PYTHONPATH=<this repository> python -m vllm.entrypoints.openai.api_server \
        --model DIR --served-model-name NAME --dtype DTYPE --max-model-len N --host HOST --port PORT \
        --logprobs-mode processed_logprobs --worker-extension-cls serving.vllm_worker.WeightSyncWorker

processed_logprobs: a sampled token's log-probability as it was drawn -- after the temperature, top-k/top-p and the
logit bias that keeps the embedding's padding rows out -- which RL's rollout correction divides by (vLLM's default,
raw_logprobs, is the model's before any of them; prompt log-probabilities, a teacher's scores, are the same in both).
Dev mode serves /collective_rpc and /reset_prefix_cache (the weight sync uses both); the worker extension loads the
pushed weights (serving/vllm_worker.py). On a CPU, VLLM_CPU_KVCACHE_SPACE (GiB of KV cache) defaults to 1 here.
Dev mode also serves endpoints that change the server's state: bind it to 127.0.0.1 or a private network only.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_VENV = os.environ.get("DISTILL_VLLM_VENV", os.path.expanduser("~/.cache/distill/vllm-venv"))
EXTENSION = "serving.vllm_worker.WeightSyncWorker"


def vllm_python(venv: str = DEFAULT_VENV) -> str | None:
    """The vLLM environment's interpreter, or None when there is none."""
    python = os.path.join(venv, "bin", "python")
    return python if os.path.exists(python) else None


# vLLM's own CPU GEMM dispatch on one layer, then the layer's weight changed in place: does its GEMM still compute
# with the old weight (a copy of its own, packed for oneDNN or the AMX kernels)?
PACKED_COPY_PROBE = """
import sys, torch
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
layer = torch.nn.Linear(128, 256, bias=False).to(getattr(torch, sys.argv[1]))
dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
x = torch.randn(4, 128, dtype=layer.weight.dtype)
before = layer.cpu_linear(x, layer.weight, None)
with torch.no_grad():
    layer.weight.add_(1.0)
print(int(torch.equal(before, layer.cpu_linear(x, layer.weight, None))))
"""


def keeps_packed_copy(python: str, dtype: str) -> bool:
    """Whether vLLM's CPU backend computes a `dtype` linear layer from a copy of its weight of its own on this machine
    -- the copy a stock `reload_weights` leaves stale for a tied head (serving/vllm_worker.py repacks it). It
    depends on the CPU: on this project's 2-core AMD EPYC (no AVX-512) fp32 goes to oneDNN, which keeps a packed
    copy, and bf16 falls back to torch's linear on the weight itself. Asked of vLLM's own dispatch (a few seconds)."""
    result = subprocess.run([python, "-c", PACKED_COPY_PROBE, dtype], capture_output=True, text=True, timeout=300,
                            env=vllm_env())
    if result.returncode != 0:
        raise RuntimeError(f"the packed-copy probe failed in {python}: {result.stderr.strip()[-500:]}")
    return result.stdout.strip().splitlines()[-1] == "1"


def vllm_command(python: str, model: str, name: str, port: int, dtype: str = "float32", max_model_len: int = 1024,
                 host: str = "127.0.0.1", extra: list[str] | None = None,
                 max_logprobs: int | None = None) -> list[str]:
    """max_logprobs: vLLM's --max-logprobs, the most log-probabilities per position a request may ask for (vLLM's
    default 20): a teacher server for --teacher_topk K needs K or more."""
    logprobs = ["--max-logprobs", str(max_logprobs)] if max_logprobs is not None else []
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", name,
            "--dtype", dtype, "--max-model-len", str(max_model_len), "--host", host, "--port", str(port),
            *logprobs, "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", EXTENSION, *(extra or [])]


def vllm_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": path,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}


def start_vllm(command: list[str], log_path: str) -> subprocess.Popen:
    """The server in the background, in its own process group (so that stopping it stops its workers)."""
    with open(log_path, "w") as log:
        return subprocess.Popen(command, env=vllm_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_ready(process: subprocess.Popen, port: int, log_path: str, timeout: float = 900.0,
               host: str = "127.0.0.1") -> None:
    """Poll /health until it answers 200 (vLLM on 2 CPU cores: 2-5 minutes); RuntimeError with the log's tail
    when the server exits or the time is up."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited ({process.returncode}):\n{log_tail(log_path)}")
        try:
            if httpx.get(f"http://{host}:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the vLLM server was not ready in {timeout:.0f} s:\n{log_tail(log_path)}")


def log_tail(path: str, lines: int = 30) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def stop_vllm(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Start a vLLM server with the weight-sync extension",
                                     allow_abbrev=False)  # a shortened flag is refused, never taken for another
    parser.add_argument("--model", required=True, help="HF folder to serve (e.g. checkpoints/kd)")
    parser.add_argument("--name", default="student", help="--served-model-name (the trainer's --rollout_model)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--dtype", default="float32", help="the trainer's precision: float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--max_model_len", type=int, default=1024, help=">= the trainer's --max_length")
    parser.add_argument("--max_logprobs", type=int, default=None,
                        help="vLLM's --max-logprobs (its default 20): >= the trainer's --teacher_topk for a teacher")
    parser.add_argument("--python", default=None, help="the vLLM environment's python (default: DISTILL_VLLM_VENV "
                                                       "or ~/.cache/distill/vllm-venv)")
    args, extra = parser.parse_known_args(argv)
    python = args.python or vllm_python()
    if python is None:
        sys.exit(f"error: no vLLM environment at {DEFAULT_VENV}: run serving/setup_vllm_cpu.sh, or pass --python")
    command = vllm_command(python, args.model, args.name, args.port, args.dtype, args.max_model_len, args.host,
                           [e for e in extra if e != "--"], args.max_logprobs)
    print("VLLM_SERVER_DEV_MODE=1 PYTHONPATH=" + ROOT + " " + " ".join(command), flush=True)
    os.execve(python, command, vllm_env())


if __name__ == "__main__":
    main()
