"""The student's weights into the rollout server, verified: rank 0, every --sync_interval optimizer steps.

    sync = WeightSync(server, "checkpoints/opd_rollout_weights/model.safetensors", probe_ids, dtype=torch.float32)
    sync.push(model, step)       # write the safetensors file, the server loads it, its prefix cache is reset
    sync.verify(model, autocast) # the server's log-probs of a fixed probe == ours, or RuntimeFailure

Mechanism (works on vLLM's CPU build, which has no NCCL or CUDA-IPC weight transfer): the weights are written under
their HF names, tensor by tensor (a sharded one's rows sent to rank 0 rank by rank), to one safetensors file where
the server can read it (the same machine, or a shared filesystem; on GPUs /dev/shm keeps it in memory), then POST
/collective_rpc calls `load_weights_file` of the worker extension `serving.vllm_worker.WeightSyncWorker` on every
worker, then POST /reset_prefix_cache drops keys and values computed with the old weights (a cached prompt would
otherwise be continued from stale activations).

Why verify: a reload can miss a tensor silently (vLLM 0.32's own `reload_weights` leaves the tied head's packed CPU
copy stale), a server can be restarted from the original checkpoint, or serve another dtype. So after every push
the server scores a fixed probe sequence and its per-token log-probabilities must equal the trainer's within a
tolerance set by the dtype; otherwise the run stops before any rollout from those weights is trained on.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from common.errors import RuntimeFailure
from common.files import atomic_write, raise_disk_error, remove_stale_temporaries
from common.http import RequestError, one_line
from model.checkpoint_io import hf_weights, write_safetensors
from model.qwen3 import unwrap
from serving.engine import CompletionServer
from serving.vllm_launch import EXTENSION


@dataclass(frozen=True)
class Tolerance:
    """Bounds on |log p_server - log p_trainer| over the probe's tokens: on their mean and on their largest."""
    mean: float
    max: float


# fp32: both sides differ only in summation order (measured ~1e-6 on the tiny test model): the max alone decides.
# bf16 (the server's weights and residual stream in bf16, the trainer's fp32 master weights under autocast): the
# two round differently at every token, a correct sync by up to 2.5e-3 on average and 1e-2 at the worst token; one
# skipped AdamW step at lr 1e-5 moves the whole probe, by 6.9e-3 on average at 2 layers (5e-2 at 28). So the mean
# decides: 4e-3 is 1.6x above the correct syncs' largest mean and 1.7x below the smallest mean of a sync that must
# fail. The max, 5x above the correct syncs' worst token, catches a few tokens far off (alone, 5e-2 let the 2-layer
# skipped step, 3.4e-2 at most, pass). Measured with benchmarks/bench_sync.py, 2 to 28 layers (docs/serving.md).
# fp16: not measured, the max alone.
TOLERANCE = {torch.float32: Tolerance(mean=1e-4, max=1e-4), torch.bfloat16: Tolerance(mean=4e-3, max=5e-2),
             torch.float16: Tolerance(mean=1e-2, max=1e-2)}


class WeightSync:
    """`active` on rank 0 only: the other ranks keep the same schedule (and wait for rank 0 in the loop's
    all-reduce; with --fsdp 1 they send their rows of the weights to rank 0) but never write or ask anything."""

    def __init__(self, server: CompletionServer, path: str, probe_ids: list[int], dtype: torch.dtype,
                 active: bool = True, say: Callable[[str], None] = print):
        """`say`: how a line reaches the console (a trainer's goes above its progress bar)."""
        self.server, self.path, self.probe_ids, self.dtype = server, os.path.abspath(path), probe_ids, dtype
        self.active, self.say = active, say
        self.synced_step: int | None = None
        self.verified = 0  # verifications passed in this run
        if active:
            for stale in remove_stale_temporaries(self.path):
                say(f"removed {stale}, left half-written by a run that was killed")

    def due(self, step: int, interval: int) -> bool:
        """Before the first rollout of a run (fresh or resumed), and once `interval` optimizer steps were taken
        since the last push."""
        return self.synced_step is None or step - self.synced_step >= interval

    def push(self, model: torch.nn.Module, step: int) -> None:
        """Write the weights, have the server load them, reset its prefix cache. Every rank calls this: rank 0
        writes the weights tensor by tensor, and of a sharded model each tensor's rows as they come, its own and
        then each other rank's (`write_safetensors`), so no rank holds them whole; the other ranks send theirs and
        return."""
        self.synced_step = step
        weights = hf_weights(model)
        if not self.active:
            write_safetensors(None, weights, self.dtype)  # its rows, to rank 0 (nothing when unsharded)
            return
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        try:
            with atomic_write(self.path) as f:
                write_safetensors(f, weights, self.dtype)
        except OSError as error:
            raise_disk_error(error, f"the weights for the rollout server to {self.path}")
        try:
            answer = self.server.client.post_once("/collective_rpc", self.load_request())
            self._reset_prefix_cache()
        except RequestError as e:
            raise RuntimeFailure(self._push_failed(e)) from None
        if not isinstance(answer, dict) or not answer.get("results"):
            raise RuntimeFailure(f"the {self.server.what} answered /collective_rpc with {str(answer)[:200]!r}, not "
                                 f"the worker extension's report: start it with --worker-extension-cls {EXTENSION}")

    def remove_file(self) -> None:
        """At the run's end: the weights written for the server (the student's size again on disk), and their
        folder when nothing else is in it."""
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.path))

    def load_request(self) -> dict:
        """POST /collective_rpc's body: the extension's method on every worker, with the file's path."""
        return {"method": "load_weights_file", "args": [self.path]}

    def _reset_prefix_cache(self) -> None:
        # it refuses while blocks are held by requests still running: none are after a complete batch, but a
        # request abandoned by a failed batch may still be finishing
        for _ in range(20):
            if (self.server.client.post_once("/reset_prefix_cache", {}) or {}).get("success", True):
                return
            time.sleep(0.5)
        raise RuntimeFailure(f"the {self.server.what} did not reset its prefix cache (requests still running?)")

    def _push_failed(self, error: RequestError) -> str:
        detail = one_line(str(error))
        if error.status == 404:
            return (f"the {self.server.what} has no /collective_rpc or /reset_prefix_cache ({detail}): start it with "
                    f"VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {EXTENSION} (docs/serving.md)")
        if error.status is not None and error.status >= 500:
            return (f"the {self.server.what} could not load {self.path} ({detail}): is the file readable from the "
                    f"server (same machine or a shared filesystem), was it started with --worker-extension-cls "
                    f"{EXTENSION} and the repository on its PYTHONPATH?")
        return f"weight sync to the {self.server.what} failed: {detail}"

    def verify(self, model: torch.nn.Module, autocast: Callable) -> dict[str, float]:
        """The server's log-probs of the probe against ours -> {"max", "mean"} of |d log p| (zeros where not
        active), or RuntimeFailure. Every rank runs the probe's forward (a sharded model needs them all). The first
        verification of a run is said in one line."""
        if not self.active:
            own_logprobs(model, self.probe_ids, autocast)
            return {"max": 0.0, "mean": 0.0}
        stats = check_served_weights(self.server, model, self.probe_ids, self.dtype, autocast,
                                     f"after the sync of step {self.synced_step}",
                                     f"the server did not load {self.path} (started without --worker-extension-cls "
                                     f"{EXTENSION}, or another file), it serves another model or --dtype, or it was "
                                     f"restarted. Nothing from these weights was trained on.")
        if not self.verified:
            tolerance = TOLERANCE[self.dtype]
            self.say(f"weights of step {self.synced_step} pushed to {self.server.client.base_url} and verified: "
                     f"|d log p| over the probe {stats['max']:.2g} at most, {stats['mean']:.2g} on average "
                     f"(tolerance {tolerance.max:g} / {tolerance.mean:g}); every later push is verified the same "
                     f"way (sync_logprob_diff in the step's line and metrics)")
        self.verified += 1
        return stats


def check_served_weights(server: CompletionServer, model: torch.nn.Module, probe_ids: list[int], dtype: torch.dtype,
                         autocast: Callable, when: str, causes: str) -> float:
    """RuntimeFailure unless the server's log-probabilities of the probe equal `model`'s within the dtype's
    tolerance; -> the largest and the mean difference ({"max", "mean"})."""
    try:
        served = server.prompt_logprobs([probe_ids])[0]
    except RuntimeFailure as e:
        raise RuntimeFailure(f"checking the served weights: {e}") from None
    stats, tolerance = sync_statistics(served, own_logprobs(model, probe_ids, autocast)), TOLERANCE[dtype]
    if not within(stats, tolerance):
        raise RuntimeFailure(
            f"the {server.what} does not serve the trainer's weights: {when} its log-probabilities of a probe "
            f"differ from ours by up to {stats['max']:.3g}, {stats['mean']:.3g} on average (tolerance "
            f"{tolerance.max:g} at most and {tolerance.mean:g} on average for {str(dtype).removeprefix('torch.')}). "
            f"Likely causes: {causes}")
    return stats


def sync_statistics(served: torch.Tensor, own: torch.Tensor) -> dict[str, float]:
    """The largest and the mean |log p_server - log p_ours| over the probe's tokens."""
    difference = (served - own).abs()
    return {"max": difference.max().item(), "mean": difference.mean().item()}


def within(stats: dict[str, float], tolerance: Tolerance) -> bool:
    return stats["max"] <= tolerance.max and stats["mean"] <= tolerance.mean  # NaN fails too


@torch.no_grad()
def own_logprobs(model: torch.nn.Module, token_ids: list[int], autocast: Callable) -> torch.Tensor:
    """log p(token t | tokens < t), t >= 1, over the full head (as a server computes it), fp32, on the CPU."""
    model = unwrap(model)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], device=device)
    with autocast():
        logits = model(ids).logits[0, :-1].float()
    model.train(was_training)
    return logits.log_softmax(dim=-1).gather(1, ids[0, 1:, None]).squeeze(1).cpu()
