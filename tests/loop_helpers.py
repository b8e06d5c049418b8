"""Helpers shared by the training-loop tests: flags, outputs, subprocess runs and kills."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from common.errors import run_script
from common.files import process_start_time
from support import ROOT


# lr 1e-4: Adam's first steps move a weight by about lr * g / (|g| + eps), which for a gradient near eps amplifies
# float summation-order noise; at 1e-4 that noise stays below 1e-6 while a wrong normalisation (a window mean of
# micro-batch means) moves weights by ~1e-4. The pre-clip grad norm is compared as well: it sees the gradient itself.
def loop_args(config, data, save_dir, name="run", batch=2, accumulation=1, **extra) -> list[str]:
    # --device cpu: on a GPU host the default would be cuda, and these tests prove the CPU numerics
    args = {"device": "cpu", "model_config": config, "data_path": data, "save_dir": str(save_dir), "save_weight": name,
            "batch_size": batch, "accumulation_steps": accumulation, "max_length": 96, "max_prompt_length": 32,
            "learning_rate": 1e-4, "log_interval": 1, "seed": 7, **extra}
    return [item for key, value in args.items() if value is not None for item in (f"--{key}", str(value))]


# wall-clock numbers, which differ from run to run: throughput, and the seconds and shares of the OPD step's phases
PHASES = ("gen", "teacher", "train", "sync", "verify", "drain", "entropy", "reference", "reward", "old_logp", "critic")
TIMING = {"tokens_per_s", "step_ms", "wait_s", "server_idle_s", *(f"{phase}_s" for phase in PHASES),
          *(f"{phase}_share" for phase in PHASES)}


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def weights(save_dir, name="run") -> dict[str, torch.Tensor]:
    """The export's weights; a LoRA student's adapters too (NAME_adapter/, PEFT's format), prefixed "adapter:", and
    PPO's critic (NAME_critic/), prefixed "critic:"."""
    found = load_file(os.path.join(str(save_dir), name, "model.safetensors"))
    for kind, folder, file in (("adapter", f"{name}_adapter", "adapter_model.safetensors"),
                               ("critic", f"{name}_critic", "model.safetensors")):
        path = os.path.join(str(save_dir), folder, file)
        if os.path.exists(path):
            found.update({f"{kind}:{k}": v for k, v in load_file(path).items()})
    return found


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def metrics(save_dir, name="run") -> list[dict]:
    with open(os.path.join(str(save_dir), f"{name}_metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def env_one_thread() -> dict:
    # one intra-op thread per process: reproducible sums and no oversubscription of the 2-core machine
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def torchrun_command(script: str, args: list[str], nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", script, *args]


def run_command(command: list[str]) -> None:
    result = subprocess.run(command, env=env_one_thread(), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]


def kill_after_first_checkpoint(command: list[str], resume_path: str) -> None:
    """Start a run and SIGKILL its whole process group as soon as a resume checkpoint appears; return when none of
    its processes runs any more."""
    process = subprocess.Popen(command, env=env_one_thread(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
    deadline = time.time() + 300
    while not os.path.exists(resume_path):
        assert process.poll() is None, f"run ended before its first checkpoint: {process.stderr.read()[-3000:]}"
        assert time.time() < deadline, "no checkpoint within 300 s"
        time.sleep(0.01)
    workers = descendants(process.pid)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    wait_until_gone(process.pid, workers)


def wait_until_gone(group: int, workers: dict[int, str], timeout: float = 60.0) -> None:
    """Until no process of process group `group`, and none of `workers` (PID: start time), runs any more (zombies
    do not run). Waiting for the group's leader is not enough: torchrun starts each worker in a session of its own,
    and a worker killed by its launcher's death (PR_SET_PDEATHSIG) may still be tearing down, holding the run's
    lock, when the test's resume starts (seen in CI)."""
    deadline = time.time() + timeout
    while group_running(group) or any(process_start_time(pid) == start for pid, start in workers.items()):
        assert time.time() < deadline, f"process group {group} or its workers still run {timeout:.0f} s after SIGKILL"
        time.sleep(0.02)


def process_stats() -> list[list[str]]:
    """Every process's /proc/PID/stat fields after the command name: [state, ppid, pgrp, ...], with the PID first."""
    stats = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat, encoding="utf-8") as f:
                stats.append([stat.split("/")[2], *f.read().rsplit(")", 1)[1].split()])
        except (OSError, IndexError):
            continue  # ended while we looked
    return stats


def group_running(group: int) -> bool:
    return any(int(fields[3]) == group and fields[1] not in ("Z", "X") for fields in process_stats())


def descendants(pid: int) -> dict[int, str]:
    """The running processes below `pid` (children, their children, ...): PID -> start time (as
    common.files.process_start_time reads it: the stat line's 22nd field)."""
    stats = process_stats()
    children: dict[int, list[list[str]]] = {}
    for fields in stats:
        children.setdefault(int(fields[2]), []).append(fields)
    found, todo = {}, list(children.get(pid, []))
    while todo:
        fields = todo.pop()
        if fields[1] not in ("Z", "X"):
            found[int(fields[0])] = fields[20]
        todo.extend(children.get(int(fields[0]), []))
    return found


def checkpoint_step(resume_path) -> int:
    return torch.load(resume_path, map_location="cpu", weights_only=False)["step"]


def assert_one_line_error(code: int, stderr: str, expected_code: int, *names: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert code == expected_code, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def script_exit(main, argv: list[str], capsys) -> tuple[int, str]:
    """Run a loop's main under the scripts' failure convention, in-process: -> (exit code, stderr)."""
    with pytest.raises(SystemExit) as info:
        run_script(lambda: main(argv))
    return info.value.code, capsys.readouterr().err


def first_step_samples(student, tokenizer, rows: list[dict], seed: int, max_new_tokens: int = 8,
                       max_prompt_length: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What an OPD run's first step samples from `rows` (loop_args' prompt budget, each row's seed (seed, epoch 0,
    row)), independently of the loop: -> input_ids, attention_mask, labels on the completions."""
    from common.seeds import derived_seed
    from dataset.collators import PromptCollator, build_sequences
    from model import generate
    prompts = PromptCollator(tokenizer, max_prompt_length, enable_thinking=False)(rows)
    generators = [torch.Generator().manual_seed(derived_seed(seed, 0, row["row_index"])) for row in rows]
    out = generate(student, prompts["prompt_ids"], prompts["prompt_attention_mask"], max_new_tokens,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, generator=generators,
                   vocab_size=len(tokenizer))
    return build_sequences(prompts["prompt_ids"], prompts["prompt_attention_mask"], out.completion_ids,
                           out.completion_mask)


def assert_bit_identical_runs(reference, other) -> None:
    """The same weights bit for bit and every step logged once with the same numbers (timings aside)."""
    a, b = weights(reference), weights(other)
    assert all(torch.equal(a[k], b[k]) for k in a), "weights are not bit-identical"
    assert without_timing(metrics(reference)) == without_timing(metrics(other)), "every step once, same numbers"
