# python -m pytest tests/test_bench_gpu.py
"""benchmarks/bench_gpu.py, the one-command GPU check, kept from rotting: its plan for the H200 shapes fits the lent
machine's disk, keeps no save it does not need and puts the throughput measurements before all smoke runs but the
bf16 ones; a small --budget_s skips phases with a note and still leaves a valid JSON; a phase past its limit is
stopped, its row saying so, and the next phases run; its --device cpu --tiny mode runs every code path it runs on a
GPU (the three loops in each precision and mode, a resume, the bf16/fp32 comparison, the throughput steps, the OPD
split, generate against transformers, with a vLLM environment the weight-sync figures) on tiny shapes; its working
folder is gone afterwards; without CUDA the GPU mode says so and exits 0."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time

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
    assert all(p["estimate_s"] >= 0 and p["limit_s"] >= 60 for p in plan["phases"])


def test_the_plan_measures_throughput_before_every_smoke_run_but_the_bf16_ones():
    names = [p["name"] for p in bench_gpu.make_plan("full", 420.0)["phases"]]
    assert names[:2] == ["smoke models", "smoke bf16"]
    throughput = [names.index(name) for name in ("SFT step", "KD step", "OPD split")]
    other_smoke = [names.index(name) for name in bench_gpu.SMOKE_VARIANTS if name != "smoke bf16"]
    assert len(other_smoke) == 3  # fp16, gradient checkpointing, compile
    assert throughput == sorted(throughput) and max(throughput) < min(other_smoke)


def test_a_phase_past_its_limit_is_stopped_its_row_says_so_and_the_next_runs(tmp_path):
    def swallows_errors(kit):
        try:
            time.sleep(30)
        except Exception:  # what a loop or torch may do on the way: the overrun is not an Exception
            return "ok", "the overrun was swallowed"

    args = argparse.Namespace(device="cpu", budget_s=100.0, out=str(tmp_path / "report.json"),
                              phase_limit_s={"sleeps": 0.2})
    report = {"device_name": "cpu", "torch": torch.__version__, "shape": "tiny", "budget_s": 100.0, "phases": [],
              "smoke": [], "throughput": {}}
    kit = bench_gpu.Kit(args, str(tmp_path), report, time.perf_counter())
    handler = signal.getsignal(signal.SIGALRM)
    bench_gpu.run_phases(kit, [bench_gpu.Phase("sleeps", 1.0, swallows_errors),
                               bench_gpu.Phase("next", 1.0, lambda kit: ("ok", "ran"))])
    sleeps, after = report["phases"]
    assert sleeps["status"] == "timeout" and "limit of 0.2 s" in sleeps["note"] and sleeps["seconds"] < 10
    assert after["status"] == "ok" and after["limit_s"] == 60  # the default: max(2 x estimate, 60 s)
    assert signal.getsignal(signal.SIGALRM) is handler and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert "| sleeps | timeout | 1 | 0.2 | 0 |" in (tmp_path / "report.md").read_text()


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
    # a budget and limits no loaded 2-core machine runs out of: every phase must run here
    result = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--budget_s", "3000",
                             "--phase_limit_s", "1500", "--out", str(out), "--workdir", str(work)],
                            capture_output=True, text=True, timeout=900, env=env_one_thread())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {p["name"]: p["status"] for p in report["phases"] if p["status"] != "ok"} == {"weight sync": "skipped"}
    runs = {(r["loop"], r["variant"]) for r in report["smoke"] if r["ok"]}
    assert len(runs) == len(report["smoke"]) == 13  # 3 loops x 4 variants + the resume
    assert report["smoke"][1]["steps"] == 4  # the resumed run logged steps 1-4, two of them after the resume
    assert report["bf16_vs_fp32"]["ok"]
    assert report["throughput"]["sft"]["tokens_per_s"] > 0 and report["throughput"]["kd"]["tokens_per_s"] > 0
    assert set(report["opd"]["phases_ms"]) >= {"generation", "teacher forward", "backward"}
    assert report["opd"]["roofline"]["phases"]["training"]["multiple"] > 0  # on a GPU: 1 / the phase's MFU
    assert report["generate_vs_transformers"]["ours"] > 0
    assert "| smoke run |" in result.stdout and "OPD step" in result.stdout
    assert not work.exists()  # the models and every run's folder removed at the end


@pytest.mark.slow
def test_the_tiny_cpu_mode_stops_a_phase_at_its_limit_and_runs_the_next(tmp_path):
    """smoke models stopped while it writes (the smoke runs that need it skip), decode compiled stopped while it
    compiles: their rows say so, the phases after each still run, and the folder is removed."""
    out, work = tmp_path / "report.json", tmp_path / "work"
    result = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--budget_s", "3000",
                             "--phase_limit_s", "smoke models=0.01", "--phase_limit_s", "decode compiled=0.5", "--out",
                             str(out), "--workdir", str(work)], capture_output=True, text=True, timeout=900,
                            env=env_one_thread())
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]  # a phase overran: exit 1
    report = json.loads(out.read_text())
    status = {p["name"]: p["status"] for p in report["phases"]}
    assert status == {"smoke models": "timeout", "smoke bf16": "skipped", "full models": "ok", "SFT step": "ok",
                      "KD step": "ok", "OPD split": "ok", "bf16 vs fp32": "ok", "smoke fp16": "skipped",
                      "smoke checkpointing": "skipped", "smoke compile": "skipped", "weight sync": "skipped",
                      "decode compiled": "timeout", "generate vs transformers": "ok"}
    rows = {p["name"]: p for p in report["phases"]}
    assert "limit of 0.01 s" in rows["smoke models"]["note"] and rows["decode compiled"]["limit_s"] == 0.5
    assert rows["smoke compile"]["note"] == "needs smoke models, which did not finish ok"
    assert "| smoke models | timeout |" in (tmp_path / "report.md").read_text()
    assert not work.exists()


@pytest.mark.slow
def test_the_weight_sync_phase_records_the_criterions_figures(tmp_path):
    """On the CPU with --vllm_python (a bf16 vLLM CPU server of the tiny student): the pushed weights are served
    (the correct sync passes the criterion), a missed AdamW step moves the probe more, both recorded next to the
    tolerance. The smoke, decode and generate phases are stopped at once (their limits) to keep it short."""
    from serving.vllm_launch import vllm_python
    from vllm_servers import require_vllm
    require_vllm()
    out, work = tmp_path / "report.json", tmp_path / "work"
    limits = [flag for limit in ("smoke models=0.01", "decode compiled=0.01", "generate vs transformers=0.01",
                                 "weight sync=1200")  # a loaded 2-core machine starts vLLM in 2-15 minutes
              for flag in ("--phase_limit_s", limit)]
    result = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--budget_s", "3000", *limits,
                             "--vllm_python", vllm_python(), "--out", str(out), "--workdir", str(work)],
                            capture_output=True, text=True, timeout=1500, env=env_one_thread())
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {p["name"]: p for p in report["phases"]}
    assert rows["weight sync"]["status"] == "ok", result.stdout[-3000:] + result.stderr[-3000:]
    sync = report["weight_sync"]
    assert sync["tolerance"] == {"mean": 4e-3, "max": 5e-2}
    assert sync["correct_sync"]["passes"] and 0 < sync["correct_sync"]["mean"] < sync["missed_step"]["mean"]
    assert "bf16 weight sync" in (tmp_path / "report.md").read_text()
    assert not work.exists()
