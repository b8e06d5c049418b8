# python -m pytest tests/test_bench_gpu.py
"""benchmarks/bench_gpu.py, the one-command GPU check, kept from rotting: its plan for the H200 shapes fits the lent
machine's disk and keeps no save it does not need; a small --budget_s skips phases with a note and still leaves a
valid JSON; its --device cpu --tiny mode runs every code path it runs on a GPU (the three loops in each precision and
mode, a resume, the bf16/fp32 comparison, the throughput steps, the OPD split, generate against transformers) on tiny
shapes; its working folder is gone afterwards; without CUDA the GPU mode says so and exits 0."""
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import bench_gpu
from loop_helpers import env_one_thread
from support import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_gpu.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the GPU mode would run in full")
def test_without_cuda_it_says_so_and_exits_0():
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "no CUDA device" in result.stdout, result.stdout + result.stderr


def test_the_plan_prints_without_a_gpu_and_exits_0():
    result = subprocess.run([sys.executable, SCRIPT, "--plan"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "full shapes, budget 420 s" in result.stdout and "peak" in result.stdout and "smoke compile" in result.stdout


def test_the_h200_plan_fits_the_disk_and_keeps_only_the_save_a_resume_reads():
    plan = bench_gpu.make_plan("full", 420.0)
    assert plan["disk_bytes"]["peak"] <= 20 * 2**30
    # the smoke student: the 0.6B width and vocabulary, 2 layers; a save is 12 + 4 bytes per parameter + tokenizer
    width, vocab, q, kv, mlp = 1024, 151936, 16 * 128, 8 * 128, 3072
    layer = width * q + 2 * width * kv + q * width + 3 * width * mlp + 2 * width + 2 * 128
    parameters = vocab * width + bench_gpu.SMOKE_LAYERS * layer + width
    assert plan["disk_bytes"]["run save"] == 16 * parameters + bench_gpu.tokenizer_bytes()
    runs = plan["runs"]
    assert len(runs) == 13
    for index, run in enumerate(runs):
        if run["save_kept_for"] is not None:  # kept only for the very next run, which resumes from it
            assert runs[index + 1]["resumes"] and runs[index + 1]["name"] == run["name"]
            assert runs[index + 1]["variant"] == run["save_kept_for"]
        assert run["folder_bytes"] <= 2 * run["save_bytes"]
    assert [r["variant"] for r in runs if r["save_kept_for"]] == ["bf16"]
    names = [p["name"] for p in plan["phases"]]
    assert names[:5] == ["smoke models", "smoke bf16", "smoke fp16", "smoke checkpointing", "smoke compile"]
    assert names.index("SFT step") < names.index("KD step") < names.index("OPD split")
    assert all(p["estimate_s"] >= 0 for p in plan["phases"])


def test_on_cuda_attention_may_take_only_the_fused_kernels():
    with bench_gpu.fused_attention("cuda"):
        assert not torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.math_sdp_enabled()


def test_a_small_budget_skips_phases_with_a_note_and_leaves_a_valid_json(tmp_path):
    out, temporary = tmp_path / "report.json", tmp_path / "tmp"
    temporary.mkdir()
    budget = bench_gpu.make_plan("tiny", 0.0)["phases"][0]["estimate_s"] + 1.0  # room for the first phase only
    result = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--budget_s", str(budget), "--out",
                             str(out)], capture_output=True, text=True, timeout=300,
                            env={**env_one_thread(), "TMPDIR": str(temporary)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    phases = {p["name"]: p for p in report["phases"]}
    assert list(phases) == [p["name"] for p in report["plan"]["phases"]]  # every phase has its row
    assert phases["smoke models"]["status"] == "ok"  # the first fits: it starts at 0 s
    assert phases["smoke bf16"]["status"] == "skipped" and "budget" in phases["smoke bf16"]["note"]
    assert all(p["status"] in ("ok", "skipped") and (p["status"] == "ok" or p["note"]) for p in phases.values())
    assert "| phase | status |" in (tmp_path / "report.md").read_text()
    assert "smoke bf16" in result.stderr  # the progress lines
    assert not [name for name in os.listdir(temporary) if name.startswith("bench_gpu_")]  # its folder is gone


@pytest.mark.slow
def test_the_tiny_cpu_mode_runs_every_path(tmp_path):
    out, work = tmp_path / "report.json", tmp_path / "work"
    # a budget no loaded 2-core machine runs out of: every phase must run here
    result = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--budget_s", "3000", "--out",
                             str(out), "--workdir", str(work)], capture_output=True, text=True, timeout=900,
                            env=env_one_thread())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {p["name"]: p["status"] for p in report["phases"] if p["status"] != "ok"} == {"weight sync": "skipped"}
    runs = {(r["loop"], r["variant"]) for r in report["smoke"] if r["ok"]}
    assert len(runs) == len(report["smoke"]) == 13  # 3 loops x 4 variants + the resume
    assert report["smoke"][1]["steps"] == 4  # the resumed run logged steps 1-4, two of them after the resume
    assert report["bf16_vs_fp32"]["ok"]
    assert report["throughput"]["sft"]["tokens_per_s"] > 0 and report["throughput"]["kd"]["tokens_per_s"] > 0
    assert set(report["opd"]["phases_ms"]) >= {"generation", "teacher forward", "backward"}
    assert report["generate_vs_transformers"]["ours"] > 0
    assert "| smoke run |" in result.stdout and "OPD step" in result.stdout
    assert not work.exists()  # the models and every run's folder removed at the end
