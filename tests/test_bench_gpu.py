# python -m pytest tests/test_bench_gpu.py
"""benchmarks/bench_gpu.py, the one-command GPU check, kept from rotting: its --device cpu --tiny mode runs every
code path it runs on a GPU (the three loops in each precision and mode, a resume, the bf16/fp32 comparison, the
throughput steps, the OPD split, generate against transformers) on tiny shapes; without CUDA the GPU mode says so and
exits 0."""
import json
import os
import subprocess
import sys

import pytest
import torch

from loop_helpers import env_one_thread
from support import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_gpu.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the GPU mode would run in full")
def test_without_cuda_it_says_so_and_exits_0():
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "no CUDA device" in result.stdout, result.stdout + result.stderr


@pytest.mark.slow
def test_the_tiny_cpu_mode_runs_every_path(tmp_path):
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--out", str(out), "--workdir",
                             str(tmp_path / "work")], capture_output=True, text=True, timeout=600,
                            env=env_one_thread())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {(r["loop"], r["variant"]) for r in report["smoke"] if r["ok"]}
    assert len(runs) == len(report["smoke"]) == 13  # 3 loops x 4 variants + the resume
    assert report["smoke"][1]["steps"] == 4  # the resumed run logged steps 1-4, two of them after the resume
    assert report["bf16_vs_fp32"]["ok"]
    assert report["throughput"]["sft"]["tokens_per_s"] > 0 and report["throughput"]["kd"]["tokens_per_s"] > 0
    assert set(report["opd"]["phases_ms"]) >= {"generation", "teacher forward", "backward"}
    assert "| smoke run |" in result.stdout and "OPD step" in result.stdout
