"""Runs inside the vLLM server, not in the trainer: the worker extension that loads the student's new weights.

Start the server with it (the repository root on PYTHONPATH; dev mode serves /collective_rpc and
/reset_prefix_cache):

    VLLM_SERVER_DEV_MODE=1 PYTHONPATH=/path/to/this/repo python -m vllm.entrypoints.openai.api_server \
        --model checkpoints/kd --served-model-name student \
        --worker-extension-cls serving.vllm_worker.WeightSyncWorker ...

The trainer writes `model.safetensors` (HF names) where the server can read it and calls, through
POST /collective_rpc, `load_weights_file(path)` on every worker. That loads the tensors with vLLM's own in-place
reload (its weight loaders shard and fuse them, and each reloaded layer is processed again for its kernels), then
repacks the language-model head: with tied embeddings the head shares the embedding's weight but vLLM's CPU
backend keeps a packed copy of it for its GEMM, which the reload does not redo (measured with vLLM 0.32 on CPU:
the new layers with the old head). The trainer then resets the prefix cache and verifies the served
log-probabilities against its own, so a sync that missed anything stops the run instead of training on it.

It imports only torch, safetensors and vLLM (whatever the server's environment has): nothing of the trainer's.
"""
from __future__ import annotations

import time


class WeightSyncWorker:
    """Mixed into vLLM's worker class by `--worker-extension-cls`: `self` is the worker. The worker's
    end of a weight sync; the trainer's end is serving/weight_sync.py's `WeightSync`."""

    def load_weights_file(self, path: str) -> dict:
        from safetensors.torch import load_file

        started = time.perf_counter()
        weights = load_file(path, device="cpu")
        self.model_runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        repacked = self._repack_lm_head()
        return {"tensors": len(weights), "lm_head_repacked": repacked,
                "seconds": round(time.perf_counter() - started, 3)}

    def _repack_lm_head(self) -> bool:
        """Redo the head's post-load processing (its packed CPU GEMM weight); a no-op where there is none."""
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if method is None or not hasattr(method, "process_weights_after_loading"):
            return False
        method.process_weights_after_loading(head)
        return True
