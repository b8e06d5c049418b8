# python -m pytest tests/test_bench_gpu.py
"""benchmarks/bench_gpu.py, the one-command GPU check, kept from rotting: its plan for the H200 shapes fits the lent
machine's disk, keeps no save it does not need and puts the throughput measurements before all smoke runs but the
bf16 ones; a small --budget_s skips phases with a note and still leaves a valid JSON; a phase past its limit is
stopped, its row saying so, and the next phases run; its --device cpu --tiny mode runs every code path it runs on a
GPU (the three loops in each precision and mode, a resume, the bf16/fp32 comparison, the throughput steps, the OPD
split, generation against its roofline, the decode steps' syncs and picks, generate against transformers, with a
vLLM environment the weight-sync figures) on tiny shapes; its working folder is gone afterwards; without CUDA the
GPU mode says so and exits 0. The phases' arithmetic and bookkeeping on their own: the math-kernel fall-back of bf16 vs
fp32, the sync counter, the roofline multiple, the fitted length of generate vs transformers, the targets."""
import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import bench_gpu, roofline
from model import create_model, generate
from loop_helpers import env_one_thread
from support import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "bench_gpu.py")
BUDGET_S = bench_gpu.parse_args([]).budget_s  # the default


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the GPU mode would run in full")
def test_without_cuda_it_says_so_and_exits_0():
    result = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "no CUDA device" in result.stdout, result.stdout + result.stderr


def test_the_plan_prints_without_a_gpu_and_exits_0():
    result = subprocess.run([sys.executable, SCRIPT, "--plan"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"full shapes, budget {BUDGET_S:.0f} s" in result.stdout
    assert "peak" in result.stdout and "smoke compile" in result.stdout


def test_the_h200_plan_fits_the_disk_and_keeps_only_the_save_a_resume_reads():
    plan = bench_gpu.make_plan("full", BUDGET_S, compiled_steps=True)
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
    names = [p["name"] for p in bench_gpu.make_plan("full", BUDGET_S, compiled_steps=True)["phases"]]
    assert names[:2] == ["smoke models", "smoke bf16"]
    throughput = [names.index(name) for name in ("SFT step", "KD step", "OPD split")]
    other_smoke = [names.index(name) for name in bench_gpu.SMOKE_VARIANTS if name != "smoke bf16"]
    assert len(other_smoke) == 3  # fp16, gradient checkpointing, compile
    assert throughput == sorted(throughput) and max(throughput) < min(other_smoke)
    measured = [names.index(name) for name in ("generation", "decode compiled", "bf16 vs fp32",
                                               "generate vs transformers")]
    assert max(measured) < min(other_smoke)


def test_the_h200_plan_fits_every_measurement_in_the_default_budget():
    """The estimates fit every measurement in the default budget (the last smoke runs may not fit), each limit past
    its estimate; generate vs transformers (past its 83 s limit at 32 x 512 on the first GPU run) now has room for its
    fitted calls."""
    plan = bench_gpu.make_plan("full", BUDGET_S, compiled_steps=True)
    rows = {p["name"]: p for p in plan["phases"]}
    assert plan["expected_s"] <= BUDGET_S
    for name in ("smoke bf16", "SFT step", "KD step", "OPD split", "generation", "decode compiled", "bf16 vs fp32",
                 "generate vs transformers"):
        assert rows[name]["fits"], name
    assert all(p["limit_s"] >= p["estimate_s"] for p in plan["phases"])
    transformers = rows["generate vs transformers"]
    assert bench_gpu.GENERATE_TIMED_S["full"] < transformers["estimate_s"] < transformers["limit_s"] / 2 + 1


def test_the_opd_smoke_runs_choose_their_decode_step():
    """--use_compile compiles the training layers only: the compile phase's OPD run asks for the compiled decode step,
    fp16 and checkpointing for the eager one; smoke bf16 keeps the default (auto), and no SFT or KD run gets the
    flag. The estimates count a compiled decode step where one runs (auto: on CUDA, the full shapes)."""
    runs = {(run.loop, phase): run for phase in bench_gpu.SMOKE_VARIANTS
            for group in bench_gpu.smoke_groups(phase) for run in group}
    decode = {phase: run.flags[run.flags.index("--decode") + 1] if "--decode" in run.flags else "auto"
              for (loop, phase), run in runs.items() if loop == "opd"}
    assert decode == {"smoke bf16": "auto", "smoke fp16": "eager", "smoke checkpointing": "eager",
                      "smoke compile": "compiled"}
    assert not [key for key, run in runs.items() if key[0] != "opd" and "--decode" in run.flags]
    opd_bf16 = runs[("opd", "smoke bf16")]
    assert bench_gpu.compiles_decode(opd_bf16, "full") and not bench_gpu.compiles_decode(opd_bf16, "tiny")
    assert bench_gpu.compiles_decode(runs[("opd", "smoke compile")], "tiny")
    sft_bf16 = runs[("sft", "smoke bf16")]
    extra = bench_gpu.run_estimate(opd_bf16, "full", 0) - bench_gpu.run_estimate(sft_bf16, "full", 0)
    assert extra == bench_gpu.COST_S["full"]["decode compile"]


def test_the_step_phases_compile_the_layers_as_the_loops_do_and_the_smoke_runs_keep_them_eager():
    """--use_compile auto resolves as the loops' (compiled on CUDA); the step phases' estimates then count the
    compile (cold for the SFT step, whose graphs the KD step reuses). The smoke runs but smoke compile's pass
    --use_compile 0 (no compile in the early smoke bf16 phase), smoke compile 1, whose first run pays a cold one."""
    assert bench_gpu.parse_args(["--device", "cuda"]).use_compile == 1
    assert bench_gpu.parse_args(["--device", "cpu"]).use_compile == 0
    assert bench_gpu.parse_args(["--device", "cuda", "--use_compile", "0"]).use_compile == 0
    costs = bench_gpu.COST_S["full"]
    phases = {compiled: {p.name: p.estimate_s for p in bench_gpu.build_phases("full", compiled)}
              for compiled in (False, True)}
    assert phases[True]["SFT step"] - phases[False]["SFT step"] == costs["cold compile"]
    assert phases[True]["KD step"] - phases[False]["KD step"] == costs["compile"]
    compiled = {phase: [bench_gpu.compiles_layers(run, "full") for group in bench_gpu.smoke_groups(phase)
                        for run in group] for phase in bench_gpu.SMOKE_VARIANTS}
    assert compiled == {"smoke bf16": [False] * 4, "smoke fp16": [False] * 3, "smoke checkpointing": [False] * 3,
                        "smoke compile": [True] * 3}
    runs = [run for group in bench_gpu.smoke_groups("smoke compile") for run in group]
    assert phases[True]["smoke compile"] == pytest.approx(
        sum(bench_gpu.run_estimate(run, "full", bench_gpu.disk_sizes("full")["run save"]) for run in runs)
        + costs["cold compile"])
    sft = bench_gpu.SmokeRun("sft", "sft", "default", [], 2)  # no --use_compile: auto, compiled where CUDA runs
    assert bench_gpu.compiles_layers(sft, "full") and not bench_gpu.compiles_layers(sft, "tiny")


@pytest.mark.slow  # long for the fast tier: the whole suite runs it
def test_the_step_phase_with_compiled_layers_times_its_first_step_and_gives_the_eager_layers_back(
        tmp_path, tiny_student, compile_calls, one_thread):
    """The SFT step with --use_compile 1: the layers compiled with torch.compile's defaults (inductor; here dynamo's
    eager backend stands in, inductor's code generation takes a minute on this machine), the first step timed on
    its own and reported, the table saying so; after the phase each layer has its eager forward back (the later
    phases run the model as before)."""
    kit = tiny_kit(tmp_path, tiny_student)
    kit.args.use_compile = 1
    status, note = bench_gpu.step_throughput(kit, "sft")
    assert status == "ok" and "compiled layers, first step" in note
    assert compile_calls == [{}] * tiny_student.config.num_hidden_layers
    sft = kit.report["throughput"]["sft"]
    assert sft["compiled_layers"] and sft["first_step_s"] > 0 and sft["tokens_per_s"] > 0
    assert all(layer.compiled_block is None for layer in tiny_student.model.layers)
    assert "| SFT | compiled |" in bench_gpu.report_table({**kit.report, "seconds": 1.0})


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


def tiny_kit(tmp_path, student=None) -> bench_gpu.Kit:
    args = argparse.Namespace(device="cpu", shape="tiny", budget_s=100.0, out=str(tmp_path / "report.json"),
                              phase_limit_s={}, use_compile=0, peak_tflops=None)
    report = {"device_name": "cpu", "torch": torch.__version__, "shape": "tiny", "budget_s": 100.0, "phases": [],
              "smoke": [], "throughput": {}}
    kit = bench_gpu.Kit(args, str(tmp_path), report, time.perf_counter())
    kit.full_models = (student, None)
    return kit


@pytest.fixture
def tiny_student():
    return create_model(bench_gpu.model_config(bench_gpu.SHAPES["tiny"][0]), seed=0)


def test_bf16_vs_fp32_runs_a_dtype_no_fused_kernel_takes_on_the_math_kernel_and_says_so(tmp_path, tiny_student,
                                                                                       one_thread):
    """On CUDA flash and cuDNN refuse fp32 and the memory-efficient kernel a grouped-query attention: "No available
    kernel". The CPU's SDPA with only the memory-efficient kernel allowed (which it lacks) refuses every form the
    same way, so the phase falls back for both dtypes -- with the same losses as without any restriction -- and
    with the CPU's flash kernel allowed it needs no fall-back."""
    kit = tiny_kit(tmp_path, tiny_student)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        status, note = bench_gpu.bf16_agrees_with_fp32(kit)
    fallen_back = kit.report["bf16_vs_fp32"]
    assert status == "ok" and fallen_back["math_kernel"] == ["bfloat16", "float32"]
    assert "bfloat16 and float32 on the math kernel" in note
    assert "on the math kernel" in bench_gpu.report_table({**kit.report, "seconds": 1.0})
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        status, note = bench_gpu.bf16_agrees_with_fp32(kit)
    assert status == "ok" and kit.report["bf16_vs_fp32"]["math_kernel"] == [] and "math" not in note
    assert fallen_back["float32"] == pytest.approx(kit.report["bf16_vs_fp32"]["float32"], rel=1e-5)


def test_only_a_missing_kernel_falls_back_to_the_math_kernel():
    def fails():
        raise RuntimeError("CUDA out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        bench_gpu.on_fused_kernels_or_math(fails)
    calls = []

    def no_kernel_unless_math():
        calls.append(torch.backends.cuda.math_sdp_enabled())
        if not calls[-1]:
            raise RuntimeError("No available kernel. Aborting execution.")
        return 1.0
    with bench_gpu.fused_attention("cuda"):
        assert bench_gpu.on_fused_kernels_or_math(no_kernel_unless_math) == (1.0, True)
    assert calls == [False, True]


def test_the_sync_counter_tells_the_decode_steps_syncs_from_the_rest_of_the_rollout(tiny_student, monkeypatch,
                                                                                    one_thread):
    """What torch.cuda.set_sync_debug_mode("warn") raises on CUDA, raised here by hand: one sync in every decode step
    (a patched step) and one outside them (a STOP_CHECK-like read); another warning is not a sync. The counter
    sees 4 steps' syncs inside (5 new tokens: 4 decode steps after the prefill's token) and 5 in the rollout, names
    the line they came from, and stops counting when its block ends."""
    generate_module = importlib.import_module("model.generate")
    original = generate_module.decode_step

    def syncing_step(*args, **kwargs):
        warnings.warn(bench_gpu.SYNC_WARNING)
        warnings.warn("not a sync")
        return original(*args, **kwargs)
    monkeypatch.setattr(generate_module, "decode_step", syncing_step)
    decoder = bench_gpu.SyncCountingDecoder()
    ids = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    with bench_gpu.sync_warnings("cpu", decoder) as syncs:
        warnings.warn(bench_gpu.SYNC_WARNING)
        generate(tiny_student.eval(), ids, None, 5, do_sample=False, decoder=decoder)
    assert syncs["rollout"] == 5 and syncs["in_steps"] == 4
    assert list(syncs["sites"]) == [f"tests/test_bench_gpu.py:{syncing_step.__code__.co_firstlineno + 1}"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        generate(tiny_student, ids, None, 5, do_sample=False, decoder=decoder)  # outside the block: not counted
    assert decoder.in_steps == 4 and decoder.caught is None


def test_picks_against_the_forward_are_the_argmax_for_the_models_own_greedy_tokens(tiny_student, one_thread):
    batch = {"prompt_ids": torch.randint(0, 1000, (3, 6), generator=torch.Generator().manual_seed(0)),
             "prompt_attention_mask": torch.ones(3, 6, dtype=torch.long)}
    batch["prompt_attention_mask"][1, :2] = 0  # left padded
    model = tiny_student.eval()
    completion = generate(model, batch["prompt_ids"], batch["prompt_attention_mask"], 8, do_sample=False).completion_ids
    picks = bench_gpu.picks_against_forward(model, batch, completion, "cpu", rows_at_once=2)
    assert picks["argmax_share"] > 0.9 and 0 <= picks["mean_shortfall"] <= picks["max_shortfall"] < 0.05
    drawn = torch.randint(0, 151669, completion.shape, generator=torch.Generator().manual_seed(1))  # not its picks
    others = bench_gpu.picks_against_forward(model, batch, drawn, "cpu")
    assert others["argmax_share"] < 0.2 and others["max_shortfall"] > 0.05


def test_the_generation_roofline_multiple_is_seconds_over_the_bound(tiny_student):
    """The bound by hand: bandwidth-bound, the weights read by the prefill and by every step, and the KV cache held
    so far; compute-bound, 2 FLOPs per layer parameter per prompt token and per row and step the layers and the
    head."""
    config = tiny_student.config
    rows, prompt_tokens, steps, width = 4, 40, 16, 2
    layers = roofline.layer_parameters(config)
    weights = (layers + bench_gpu.VOCAB * config.hidden_size) * width
    kv_per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * width
    cache = rows * (prompt_tokens / rows + steps / 2) * kv_per_token
    memory = roofline.Rates(gemm=1e30, exp=1e30, bandwidth=1e9, source="test")
    got = bench_gpu.generation_roofline(config, rows, prompt_tokens, steps, 2.0, memory, width)
    assert got["bound_s"] == pytest.approx((weights + steps * (weights + cache)) / 1e9)
    assert got["multiple"] == pytest.approx(2.0 / got["bound_s"])
    compute = roofline.Rates(gemm=1e12, exp=1e30, bandwidth=1e30, source="test")
    flops = 2 * layers * prompt_tokens + steps * rows * 2 * (layers + config.hidden_size * bench_gpu.VOCAB)
    assert bench_gpu.generation_roofline(config, rows, prompt_tokens, steps, 1.0, compute,
                                         width)["bound_s"] == pytest.approx(flops / 1e12)


def test_model_flops_count_every_attention_pair_and_the_head_on_labelled_positions():
    """torchtitan's count by hand for Qwen3-0.6B at the kit's SFT workload (2,048 tokens, labels on the last 1,024:
    1,024 positions per row whose next token is a label, the positions the loss projects), against sequence_flops:
    6 x layer parameters x T + 6 x H x V x labelled + 12 x L x heads x head_dim x T^2; the causal count takes
    T (T + 1) / 2 pairs instead of T^2."""
    config = bench_gpu.model_config(bench_gpu.SHAPES["full"][0])
    T, labelled, V = 2048, 1024, 151669
    layers = roofline.layer_parameters(config)
    attention_pairs = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    hand = 6 * layers * T + 6 * config.hidden_size * V * labelled + attention_pairs * T * T
    assert roofline.sequence_flops(config, T, labelled, V, causal=False) == pytest.approx(hand, rel=1e-12)
    causal = hand - attention_pairs * (T * T - T * (T + 1) / 2)
    assert roofline.sequence_flops(config, T, labelled, V, causal=True) == pytest.approx(causal, rel=1e-12)
    forward = roofline.sequence_flops(config, T, labelled, V, causal=False, backward=False)
    assert forward == pytest.approx(hand / 3, rel=1e-12)
    # the kit's old count put the head on all 2,048 positions: the honest one is smaller by the unlabelled half
    old = (6 * (layers + config.hidden_size * config.vocab_size) + attention_pairs * T) * T
    assert 0.09 < (old - hand) / old < 0.1  # 6 H V x 1,024 positions: 9.4% of the step


def test_a_steps_flops_take_the_labelled_positions_from_the_labels(tiny_student):
    ids, labels = torch.zeros(2, 10, dtype=torch.long), torch.full((2, 10), -100)
    labels[:, 6:] = 1  # positions 5..8 have a next-token label: 4 per row
    config = tiny_student.config
    model, computed = bench_gpu.step_flops(config, None, ids, labels)
    assert model == pytest.approx(2 * roofline.sequence_flops(config, 10, 4, bench_gpu.VOCAB, causal=False))
    assert computed < model
    kd, _ = bench_gpu.step_flops(config, config, ids, labels)
    assert kd == pytest.approx(model * 4 / 3)  # the teacher's forward: a third of forward + backward


@pytest.mark.parametrize("per_token, expected", [(0.05, 400), (0.0001, 512), (10.0, 16), (0.039, 512), (0.0, 512)])
def test_generate_vs_transformers_takes_the_most_tokens_that_fit(per_token, expected):
    new_tokens = bench_gpu.fitted_new_tokens(per_token, 20.0, 512, 16)
    assert new_tokens == expected and new_tokens % 16 == 0
    assert new_tokens == 16 or new_tokens * per_token <= 20.0


def test_the_table_says_whether_the_targets_are_met():
    """Full shapes: generation at 32 x 512 against >= 10,000 tokens/s and <= 5x its roofline, the OPD step against
    2.5 s; other sizes and the tiny shapes have no target."""
    def size(rows, new_tokens, rate, multiple):
        return {"rows": rows, "new_tokens": new_tokens, "seconds": rows * new_tokens / rate, "tokens_per_s": rate,
                "bound_s": rows * new_tokens / rate / multiple, "multiple": multiple}
    report = {"device_name": "H200", "torch": "x", "shape": "full", "budget_s": 420.0, "seconds": 1.0, "phases": [],
              "smoke": [], "throughput": {},
              "opd": {"phases_ms": {"generation": 1500.0, "backward": 1200.0}, "generation_tokens_per_s": 10_000.0},
              "generation": {"decode": "compiled", "rates": {}, "sizes": {
                  "32 x 512": size(32, 512, 12_000.0, 4.0), "256 x 256": size(256, 256, 50_000.0, 2.0)}}}
    table = bench_gpu.report_table(report)
    assert ">= 10,000 tokens/s and <= 5x: met" in table and "| 256 x 256 | 50,000 |" in table
    assert "step 2.70 s (target <= 2.5 s: MISSED)" in table
    report["generation"]["sizes"]["32 x 512"] = size(32, 512, 12_000.0, 6.0)
    assert "<= 5x: MISSED" in bench_gpu.report_table(report)
    tiny = bench_gpu.report_table({**report, "shape": "tiny"})
    assert "met" not in tiny and "MISSED" not in tiny


def test_on_cuda_attention_may_take_only_the_fused_kernels():
    with bench_gpu.fused_attention("cuda"):
        assert not torch.backends.cuda.math_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.math_sdp_enabled()


def test_a_small_budget_skips_phases_with_a_note_and_leaves_a_valid_json(tmp_path):
    out, temporary = tmp_path / "report.json", tmp_path / "tmp"
    temporary.mkdir()
    # room for the first phase only
    budget = bench_gpu.make_plan("tiny", 0.0, compiled_steps=False)["phases"][0]["estimate_s"] + 1.0
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
    sft, kd = report["throughput"]["sft"], report["throughput"]["kd"]
    assert sft["computed_flops_per_token"] < sft["flops_per_token"] < kd["flops_per_token"]  # causal; + teacher
    assert kd["memory_gib"]["teacher"] > 0 and sft["memory_gib"]["optimizer"] == 2 * sft["memory_gib"]["weights"]
    assert set(report["opd"]["phases_ms"]) >= {"generation", "teacher forward", "backward"}
    assert report["opd"]["roofline"]["phases"]["training"]["multiple"] > 0  # on a GPU: 1 / the phase's MFU
    assert report["generate_vs_transformers"]["ours"] > 0 and report["generate_vs_transformers"]["new_tokens"] == 16
    sizes = report["generation"]["sizes"]
    assert report["generation"]["decode"] == "eager" and list(sizes) == ["4 x 16", "16 x 16"]
    assert all(s["tokens_per_s"] > 0 and s["multiple"] > 0 for s in sizes.values())
    decode = report["decode"]
    assert {name: s["in_steps"] for name, s in decode["syncs"].items()} == {"eager": 0, "compiled": 0}  # no CUDA
    assert all(p["argmax_share"] > 0.9 for p in decode["picks_against_forward"].values())
    assert report["bf16_vs_fp32"]["math_kernel"] == []  # on a CPU every kernel is allowed
    assert "| smoke run |" in result.stdout and "OPD step" in result.stdout
    assert not work.exists()  # the models and every run's folder removed at the end


@pytest.mark.vllm
@pytest.mark.slow
def test_phases_past_their_limits_are_stopped_and_the_weight_sync_phase_records_the_criterions_figures(tmp_path):
    """One tiny CPU run (the phases the other tiny run proves stopped at once, to keep it short):
    - smoke models stopped while it writes (the smoke runs that need it skip), the step phases, the OPD split and
      generation while they compute, decode compiled while it compiles, generate vs transformers at its limit: their
      rows say so, the phases after each still run, the exit code is 1 and the folder is removed;
    - with --vllm_python, a bf16 vLLM CPU server of the tiny student: the pushed weights are served (the correct
      sync passes the criterion), a missed AdamW step moves the probe more, both recorded next to the tolerance."""
    from serving.vllm_launch import vllm_python
    from vllm_servers import require_vllm
    require_vllm()
    out, work = tmp_path / "report.json", tmp_path / "work"
    stopped = ("smoke models=0.01", "SFT step=0.01", "KD step=0.01", "OPD split=0.01", "generation=0.01",
               "decode compiled=0.5", "generate vs transformers=0.01")
    limits = [flag for limit in (*stopped, "weight sync=1200")  # a loaded 2-core machine starts vLLM in 2-15 minutes
              for flag in ("--phase_limit_s", limit)]
    result = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", "--tiny", "--budget_s", "3000", *limits,
                             "--vllm_python", vllm_python(), "--out", str(out), "--workdir", str(work)],
                            capture_output=True, text=True, timeout=1500, env=env_one_thread())
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]  # a phase overran: exit 1
    report = json.loads(out.read_text())
    status = {p["name"]: p["status"] for p in report["phases"]}
    assert status == {"smoke models": "timeout", "smoke bf16": "skipped", "full models": "ok", "SFT step": "timeout",
                      "KD step": "timeout", "OPD split": "timeout", "generation": "timeout", "bf16 vs fp32": "ok",
                      "smoke fp16": "skipped", "smoke checkpointing": "skipped", "smoke compile": "skipped",
                      "weight sync": "ok", "decode compiled": "timeout", "generate vs transformers": "timeout"}, \
        result.stdout[-3000:] + result.stderr[-3000:]
    rows = {p["name"]: p for p in report["phases"]}
    assert "limit of 0.01 s" in rows["smoke models"]["note"] and rows["decode compiled"]["limit_s"] == 0.5
    assert rows["smoke compile"]["note"] == "needs smoke models, which did not finish ok"
    table = (tmp_path / "report.md").read_text()
    assert "| smoke models | timeout |" in table and "bf16 weight sync" in table
    sync = report["weight_sync"]
    assert sync["tolerance"] == {"mean": 4e-3, "max": 5e-2}
    assert sync["correct_sync"]["passes"] and 0 < sync["correct_sync"]["mean"] < sync["missed_step"]["mean"]
    assert not work.exists()
