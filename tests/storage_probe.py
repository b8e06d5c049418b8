"""Run a training script and, at its first optimizer step, count the distinct storages of every module's parameters
and buffers alive in the process (found by the garbage collector, deduplicated by data_ptr): what the weights of
the student and of every frozen model take together, whoever holds them.

    python tests/storage_probe.py OUT.json SCRIPT ARGS...

OUT.json: {"weights_bytes": the distinct storages' bytes, "base_bytes": the student's frozen or trained weights
without LoRA adapters}. Then the script runs on as usual."""
import gc
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from model.lora import is_adapter  # noqa: E402
from trainer.skeleton.run import Run  # noqa: E402

out, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
optimizer_step = Run.optimizer_step


def storages() -> dict[int, int]:
    """data_ptr -> bytes of every storage a live module's parameter or buffer uses."""
    gc.collect()
    found = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Module):
            for tensor in (*obj.parameters(recurse=False), *obj.buffers(recurse=False)):
                storage = tensor.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()
    return found


def probed_step(run: Run) -> dict:
    if run.step == 0:
        base = sum(p.untyped_storage().nbytes() for name, p in run.raw_model.named_parameters() if not is_adapter(name))
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"weights_bytes": sum(storages().values()), "base_bytes": base}, f)
    return optimizer_step(run)


Run.optimizer_step = probed_step
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
