# Run: python -m pytest -m slow tests/test_lockstep_generate.py
"""Ranks that decode a sharded model in lockstep (the held-out evaluation under --fsdp 1) stop together: one rank's
rows all stopping first (an argmax that rounding turned to EOS on that rank alone) must not leave the others waiting
in an all-gather it never joins. Two gloo ranks, rank 0 with an EOS, rank 1 without (tests/lockstep_worker.py)."""
import json
import os
import subprocess

import pytest
import torch

from loop_helpers import env_one_thread, torchrun_command
from model import Qwen3Config, create_model, generate
from support import ROOT

pytestmark = pytest.mark.slow
WORKER = os.path.join(ROOT, "tests", "lockstep_worker.py")


def one_process(config_path: str, eos_ids: list[int] | None) -> list[list[int]]:
    model = create_model(Qwen3Config.from_json(config_path), seed=0).eval()
    ids = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    return generate(model, ids, None, 16, do_sample=False, eos_token_id=eos_ids, pad_token_id=0).completion_ids.tolist()


def run_worker(config_path: str, eos_ids: list[int], together: int, out_dir,
               timeout: float) -> subprocess.CompletedProcess:
    os.makedirs(out_dir, exist_ok=True)
    command = torchrun_command(WORKER, [config_path, ",".join(map(str, eos_ids)), str(together), "15", str(out_dir)])
    return subprocess.run(command, env=env_one_thread(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.serial
def test_ranks_stop_decoding_together_and_keep_one_process_completions(tiny_config_path, tmp_path):
    free = one_process(tiny_config_path, None)
    eos_ids = [free[0][2], free[1][4]]  # tokens greedy produces at steps 3 and 5: rank 0's rows both stop early
    done = run_worker(tiny_config_path, eos_ids, 1, tmp_path / "together", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(tmp_path / "together" / "rank0.json") as f:
        stopped = json.load(f)
    assert stopped == one_process(tiny_config_path, eos_ids) and len(stopped[0]) < 16  # as alone, and stopped
    with open(tmp_path / "together" / "rank1.json") as f:
        assert json.load(f) == free


@pytest.mark.serial
def test_without_stopping_together_the_other_rank_waits_for_the_timeout(tiny_config_path, tmp_path):
    """The failure the test above guards against is real: each rank deciding alone hangs rank 1 in an all-gather
    until the group's 15 s timeout fails it."""
    free = one_process(tiny_config_path, None)
    done = run_worker(tiny_config_path, [free[0][2], free[1][4]], 0, tmp_path / "alone", timeout=300)
    assert done.returncode != 0 and not os.path.exists(tmp_path / "alone" / "rank1.json")
