# python -m pytest tests/test_benchmarks.py
"""Every benchmark script run at a tiny size, in this process (its main(argv)), its --json read back: the rows it
measured are there, positive and finite, and what must hold whatever the machine holds (chunked losses equal the
full ones and take less memory, greedy generate equals transformers', the phases add up to the step).
Elsewhere: bench_gpu.py in test_bench_gpu.py, bench_fsdp.py in test_fsdp.py / test_fsdp_loading.py, fsdp_estimate.py
in test_fsdp_estimate.py, demo.py in test_demo.py."""
import json
import math

import pytest

from benchmarks import (bench_activations, bench_data, bench_logit_free, bench_losses, bench_model, bench_opd,
                        bench_rollout, bench_sync, bench_tool_turns, bench_topk, bench_trl, harness, roofline)
from common.errors import FlagError, UserError

pytestmark = pytest.mark.usefixtures("one_thread")  # the scripts' --threads 1 is torch's global setting


def positive(*values: float) -> bool:
    return all(math.isfinite(value) and value > 0 for value in values)


def measured(main, argv: list[str], tmp_path) -> dict:
    """main(argv + --json), and the JSON it wrote (which must be what it returned, with the machine line)."""
    path = tmp_path / "results.json"
    returned = main([*argv, "--json", str(path)])
    written = json.loads(path.read_text())
    assert " nproc " in written.pop("machine")  # the date, nproc, the CPU and the commit
    assert written == json.loads(json.dumps(returned))
    return written


# -------------------------------------------------------------------------------------------- bench_activations

TINY_LAYER = ["--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv_heads", "2", "--head_dim", "16",
              "--tokens", "64"]


def test_saved_bytes_count_each_storage_once_and_whole():
    """exp saves its output y (B x T x 64, fp32); sin of a half-width view of y saves that view: y's storage, counted
    once and whole. The product with a weight's row saves sin's output (B x T x 32) and the row (a parameter's
    storage: not counted); the product with cos saves cos (not counted either)."""
    args = bench_activations.parse_args(TINY_LAYER)
    config = bench_activations.layer_config(args)
    layer = bench_activations.decoder_layer(config)
    rope = bench_activations.RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(x, cos, sin, mask):
        y = x.exp()
        return y[..., :32].sin() * layer.mlp.down_proj.weight[0, :32] * cos[..., :1]
    saved = bench_activations.saved_for_backward(forward, layer, rope, 2, 8, 64)
    assert saved.bytes_by_dtype == {"float32": 2 * 8 * (64 + 32) * 4} and saved.storages == 2


@pytest.mark.parametrize("batch", ["1", "2"])
def test_the_compiled_layer_saves_less_than_the_eager_one_whose_bytes_are_the_arithmetic(batch, tmp_path):
    """Eager: the bytes per token eager_bytes_per_token derives by hand (3,504 at this shape), and fixed bytes (not
    growing with the tokens) exactly the bf16 copies of the four GEMMs' weights. Compiled with inductor's partition
    (aot_eager_decomp_partition: the same saved tensors, no code generation): fewer bytes per token, more than 0."""
    results = measured(bench_activations.main, [*TINY_LAYER, "--batch", batch, "--backend",
                                                "aot_eager_decomp_partition"], tmp_path)
    eager, compiled = results["eager"], results["compiled"]
    assert eager["bytes_per_token"] == results["eager_by_hand"] == 3504
    H, Q, K, I = 64, 4 * 16, 2 * 16, 128
    assert eager["fixed_bytes"] == 2 * (H * (Q + 2 * K) + Q * H + 3 * H * I)
    assert 0 < compiled["bytes_per_token"] < eager["bytes_per_token"]
    assert results["compiled_over_eager"] == compiled["bytes_per_token"] / eager["bytes_per_token"]


# ------------------------------------------------------------------------------------------------- bench_losses

@pytest.mark.parametrize("argv", [
    ["--positions", "1024", "--vocab", "32000", "--hidden", "64", "--chunk_size", "128"],
    ["--loss", "ce", "--positions", "1024", "--vocab", "32000", "--hidden", "64", "--chunk_size", "128"],
    ["--loss", "kd", "--positions", "1024", "--vocab", "32000", "--hidden", "64", "--chunk_size", "128"],
    ["--loss", "rl", "--positions", "1024", "--vocab", "32000", "--hidden", "64", "--chunk_size", "128"],
    ["--loss", "sft", "--batch_size", "2", "--seq_len", "256", "--completion_len", "128", "--pad_step", "32",
     "--vocab", "32000", "--hidden", "64", "--chunk_size", "64"],
], ids=["jsd", "ce", "kd", "rl", "sft"])
@pytest.mark.slow  # long for the fast tier: the whole suite runs it
def test_the_chunked_losses_equal_the_full_ones_within_their_memory_target(argv, tmp_path):
    """Each variant in a process of its own; the logits (N x 32,000) dominate, so the chunked loss meets the memory
    target of the full shapes here too (0.14 of the full logits' for the JSD, 0.20 for SFT, measured); the SFT batch
    is right padded, as SFTCollator makes it."""
    results = measured(bench_losses.main, [*argv, "--threads", "1"], tmp_path)
    full, chunked = results["variants"]["full"], results["variants"]["chunked"]
    for variant in (full, chunked):
        assert positive(variant["extra_bytes"], variant["seconds"], variant["loss_per_token"])
        assert variant["peak_was_reset"]
    assert full["tokens"] == chunked["tokens"] == (2 * 128 if results["loss"] == "sft" else 1024)
    assert results["loss_difference"] <= 1e-5 * full["loss_per_token"]
    assert math.isclose(chunked["lm_head_grad_norm"], full["lm_head_grad_norm"], rel_tol=1e-4)
    assert results["memory_ratio"] == chunked["extra_bytes"] / full["extra_bytes"] <= results["target"]
    # the generic checkpointed path, which the fused losses replaced, agrees too
    checkpointed = results["variants"]["checkpointed"]
    assert math.isclose(checkpointed["lm_head_grad_norm"], full["lm_head_grad_norm"], rel_tol=1e-4)
    assert positive(results["checkpointed_time_ratio"], results["memory_vs_checkpointed"])


def test_the_lm_head_is_cast_once_per_loss_not_per_chunk(tmp_path):
    results = measured(bench_losses.main, ["--casts", "--positions", "256", "--vocab", "2000", "--hidden", "32",
                                           "--chunk_size", "64"], tmp_path)
    before, after = results["casts"]["per chunk (before)"], results["casts"]["once per loss"]
    assert after["casts"] < before["casts"] and positive(before["seconds"], after["seconds"])


# -------------------------------------------------------------------------------------------------- bench_model

def test_ours_against_transformers_forward_backward_greedy_generate_and_the_cache_forms(tmp_path):
    """Greedy generate and the cache forms on the OPD demo teacher's 4 layers with a 1,024-token vocabulary; the
    cache workload's rollouts cross KEY_BLOCK boundaries (the prompts are 64 tokens)."""
    config = json.loads(open(harness.TEACHER_CONFIG).read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": 1024}))
    results = measured(bench_model.main, [
        "--only", "train,generate,cache", "--hidden_size", "64", "--num_layers", "1", "--intermediate_size", "128",
        "--vocab_size", "1024", "--batch_size", "2", "--seq_len", "16", "--generate_config",
        str(tmp_path / "config.json"), "--num_prompts", "2", "--new_tokens", "4", "--cache_tokens", "4,20",
        "--warmup", "0", "--repeats", "1", "--threads", "1"], tmp_path)
    train, generate = results["rows"]
    assert train["workload"] == "forward+backward 2x16" and generate["identical_tokens"] == 1.0  # fp32 greedy
    for row in (train, generate):
        assert positive(row["ours_ms"], row["transformers_ms"])
        assert row["transformers_over_ours"] == row["transformers_ms"] / row["ours_ms"]
    assert [row["new_tokens"] for row in results["cache"]] == [4, 20, 4, 20]  # two models
    assert all(positive(row["filled_ms"], row["whole_ms"]) for row in results["cache"])
    assert results["decode"] == results["lm_head"] == []


@pytest.mark.slow
def test_sampled_generate_the_compiled_decode_step_and_the_lm_head_forms(tmp_path):
    """Each width compiles (inductor): about 90 s on 2 cores, 15 s with its cache on disk."""
    results = measured(bench_model.main, [
        "--only", "sample,decode,lm_head", "--sample_batches", "2", "--sample_tokens", "4", "--vocab_size", "1024",
        "--sample_model", str(tmp_path / "none"), "--warmup", "0", "--repeats", "1", "--threads", "1"], tmp_path)
    assert [row["workload"] for row in results["rows"]] == ["generate 2 prompts x 4 new (sampled)",
                                                            "  same, compiled decode step"]
    assert all(positive(row["ours_ms"], row["transformers_ms"]) for row in results["rows"])
    assert [(row["layers"], row["rows"]) for row in results["decode"]] == [(2, 2), (4, 2), (28, 2)]
    assert all(positive(row["eager_ms"], row["compiled_ms"]) for row in results["decode"])
    assert all(row["rollouts_to_repay"] is None or row["rollouts_to_repay"] >= 0 for row in results["decode"])
    assert [(row["hidden"], row["rows"], row["use"]) for row in results["lm_head"]] == [
        (hidden, 2, use) for hidden in (64, 128, 512) for use in ("sampled", "greedy")]
    assert all(positive(*(value for key, value in row.items() if key.endswith("_ms"))) for row in results["lm_head"])


# ---------------------------------------------------------------------------------------------- bench_tool_turns

def test_a_turns_prefill_is_measured_beside_the_whole_turn(tmp_path):
    argv = ["--config", harness.STUDENT_CONFIG, "--batch", "2", "--turn_tokens", "4", "--repeats", "1", "--threads", "1"]
    results = measured(bench_tool_turns.main, argv, tmp_path)["results"]
    assert [(r["context"], r["turn_tokens"]) for r in results] == [("first turn", 4), ("second turn", 4)]
    first, second = results
    assert 200 < first["context_tokens"] < second["context_tokens"]  # the calculator's schema; then a call, a result
    assert all(0 < r["prefill_ms"] and 0 < r["prefill_share"] == r["prefill_ms"] / r["turn_ms"] for r in results)


# ---------------------------------------------------------------------------------------------------- bench_opd

def test_an_opd_step_split_into_its_phases(tmp_path):
    results = measured(bench_opd.main, ["--batch_size", "2", "--max_new_tokens", "4", "--steps", "2", "--warmup",
                                        "0", "--breakdown_runs", "1", "--threads", "1"], tmp_path)
    phases = results["phases_ms"]
    assert set(phases) == {"generation", "teacher forward", "student forward", "loss forward", "backward",
                           "optimizer"}
    assert positive(*phases.values(), results["measured_step_ms"], results["generation_tokens_per_s"])
    assert math.isclose(results["step_ms"], sum(phases.values()))
    assert 0 < results["generated_tokens"] <= 2 * 4 and results["decode_steps"] <= 4
    breakdown = results["generation_breakdown"]
    assert positive(breakdown["prefill"], breakdown["decode"], breakdown["step_lm_head"])
    assert math.isclose(breakdown["prefill"] + breakdown["decode"], breakdown["total"])
    roof = results["roofline"]
    assert positive(*(value for key, value in roof["rates"].items() if key != "source"))
    training = roof["phases"]["training"]
    assert math.isclose(training["ms"], phases["student forward"] + phases["loss forward"] + phases["backward"])
    assert math.isclose(training["multiple"], training["ms"] / training["bound_ms"])
    assert set(roof["arithmetic"]["phases"]) == {"generation", "teacher forward", "training", "optimizer", "step"}


def test_the_roofline_counts_the_work_from_the_shapes():
    """The training phase's work by hand for the demo's tiny shapes: 6 FLOPs per student layer parameter per token,
    the four vocabulary projections, c exponentials per logit; the layer parameters as a real model has them."""
    from model import Qwen3Config, create_model
    student, teacher = (Qwen3Config.from_json(path) for path in (harness.STUDENT_CONFIG, harness.TEACHER_CONFIG))
    model = create_model(student)
    layers = sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()
    assert roofline.layer_parameters(student) == layers
    vocab, n, prompt = 151_669, 100, 60
    work = roofline.opd_work(student, teacher, vocab, rows=4, prompt_tokens=prompt, completion_tokens=n,
                             decode_steps=30, exps_per_logit=roofline.exps_per_logit(1.0))
    flops = 6 * layers * (prompt + n) + 2 * n * vocab * 3 * student.hidden_size + 2 * n * vocab * teacher.hidden_size
    assert work["training"].flops == flops and work["training"].exps == 2 * n * vocab
    assert roofline.exps_per_logit(0.0) == 2 and roofline.exps_per_logit(0.5) == 3
    # a GPU's GEMM rate is its peak, found by its name as torch.cuda.get_device_name() gives it
    assert roofline.peak_bf16_tflops("NVIDIA H200") == 989.0 and roofline.peak_bf16_tflops("NVIDIA A100-SXM4-80GB") \
        == 312.0 and roofline.peak_bf16_tflops("NVIDIA L4") is None
    rates = roofline.Rates(gemm=1e11, exp=1e9, bandwidth=1e10, source="test")
    assert work["training"].seconds(rates) == max(flops / 1e11 + 2 * n * vocab / 1e9, work["training"].bytes / 1e10)


def test_our_side_of_the_trl_comparison_runs_without_trl(tmp_path):
    """TRL is never a dependency: without an interpreter that imports it only our run takes place (a subprocess, as
    in the comparison), and the note says how to add TRL's."""
    results = measured(bench_trl.main, ["--steps", "2", "--warmup", "0", "--batch_size", "2", "--max_new_tokens",
                                        "4", "--threads", "1", "--trl_python", str(tmp_path / "no-trl" / "python")],
                       tmp_path)
    (run,) = results["runs"]
    assert run["side"] == "ours" and run["threads"] == 1 and "summary" not in results
    assert len(run["step_ms"]) == len(run["generation_ms"]) == len(run["losses"]) == 2
    assert positive(*run["step_ms"], *run["generation_ms"], *run["losses"])
    assert all(g < s for g, s in zip(run["generation_ms"], run["step_ms"])) and max(run["decode_widths"]) <= 4
    assert "pip install trl" in results["trl_skipped"]


# ------------------------------------------------------------------------------------------- bench_logit_free

def test_a_logit_free_step_split_into_its_phases_against_the_stub_teacher(tmp_path):
    """The real loop for 2 steps against tests/stub_server.py's teacher (in this process): every phase took time, the
    shares add up to 1 and are the loop's own, and the audit asked what a random student's full-length completions
    give: 2 rows x 2 chunks, each answered with 3 continuations (the stub's usage: 20 + 4 per continuation)."""
    results = measured(bench_logit_free.main, [
        "--stub", "--batch_size", "2", "--max_new_tokens", "8", "--chunk_len", "3", "--audit_chunks", "2",
        "--continuations", "3", "--steps", "2", "--threads", "1", "--workdir", str(tmp_path / "work")], tmp_path)
    phases = results["phases_s"]
    assert list(phases) == ["gen", "entropy", "teacher", "reference", "train"] and results["steps_measured"] == 1
    assert positive(*phases.values(), results["step_s"], *results["shares"].values())
    assert math.isclose(sum(results["shares"].values()), 1.0)
    assert math.isclose(results["shares"]["teacher"], results["loop_teacher_share"], rel_tol=1e-3)
    assert 0 < results["teacher_share_of_step"] < 1 and sum(phases.values()) <= results["step_s"]
    assert results["completion_len"] == 8 and results["audited_share"] == 0.75
    assert results["teacher_requests_per_step"] == 4 and results["teacher_cached_per_step"] == 0
    assert results["teacher_tokens_per_step"] == 4 * (20 + 4 * 3)


def test_the_logit_free_bench_stops_at_a_teacher_the_loop_refuses(tmp_path, monkeypatch):
    """A served teacher that starts a new reply instead of continuing: the loop's start-up probe refuses it, and so
    does the benchmark, with the loop's one line (no step is measured)."""
    for name in bench_logit_free.PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    stub_server = bench_logit_free.load_stub_server()
    server = stub_server.Stub(lambda path, body: (200, stub_server.choices_body(path, [" Sure!"] * body["n"])))
    try:
        with pytest.raises(UserError, match="does not continue a partial answer.*it answered ' Sure!'"):
            bench_logit_free.main(["--teacher_url", server.url, "--batch_size", "2", "--max_new_tokens", "8",
                                   "--chunk_len", "3", "--steps", "2", "--workdir", str(tmp_path / "work")])
    finally:
        server.close()
    assert [body["messages"][-1]["content"] for _, body in server.posts] == ["1, 2, 3, 4,"]


@pytest.mark.parametrize("argv", [[], ["--stub", "--teacher_url", "http://127.0.0.1:1/v1"]], ids=["none", "both"])
def test_the_logit_free_bench_needs_one_teacher(argv):
    with pytest.raises(FlagError, match="--teacher_url URL .* or --stub"):
        bench_logit_free.parse_args(argv)


# ------------------------------------------------------------------------------------------------ bench_rollout

def test_the_built_in_rollout_engine_without_a_server(tmp_path):
    results = measured(bench_rollout.main, ["--engines", "built-in", "--rollouts_only", "--config",
                                            harness.STUDENT_CONFIG, "--batch_size", "2", "--max_new_tokens", "4",
                                            "--repeats", "1", "--workdir", str(tmp_path / "work")], tmp_path)
    assert list(results["rollout_tokens_per_s"]) == ["built-in"] and positive(*results["rollout_tokens_per_s"].values())
    assert results["layouts"] == {}


@pytest.mark.slow
def test_the_opd_layouts_that_need_no_server_and_the_compiled_engine(tmp_path):
    """Two train_opd.py runs (subprocesses) and a compiled decode step: 25-60 s."""
    results = measured(bench_rollout.main, ["--engines", "built-in,compiled", "--config", harness.STUDENT_CONFIG,
                                            "--batch_size", "2", "--max_new_tokens", "4", "--repeats", "1", "--steps",
                                            "2", "--workdir", str(tmp_path / "work")], tmp_path)
    assert set(results["rollout_tokens_per_s"]) == {"built-in", "compiled"}
    assert positive(*results["rollout_tokens_per_s"].values())
    assert list(results["layouts"]) == ["built-in rollouts, local teacher (jsd)", "built-in rollouts, local teacher"]
    for layout in results["layouts"].values():
        assert positive(layout["step_ms"], layout["gen_s"], layout["train_s"])
        assert layout["sync_s"] == layout["verify_s"] == 0.0
    assert "overlap" not in results


# --------------------------------------------------------------------------------------------------- bench_topk

def test_the_top_k_estimates_against_the_exact_reverse_kl(tmp_path):
    results = measured(bench_topk.main, ["--random", "1", "--rows", "2", "--max_new_tokens", "8", "--threads", "1"],
                       tmp_path)
    exact, sampled, *top = results["estimates"]
    assert 0 < results["positions"] <= 2 * 8
    assert exact["k"] is None and exact["mean_over_exact"] == 1.0 and positive(exact["mean"])
    assert sampled["k"] == 0 and math.isfinite(sampled["error_std"])
    assert [row["k"] for row in top] == list(bench_topk.KS)
    masses = [row["teacher_mass_outside"] for row in top]
    assert all(0 <= mass <= 1 for mass in masses) and masses == sorted(masses, reverse=True)  # more K, less outside
    assert all(row["bytes_per_position"] is None for row in results["estimates"])  # no server asked for


# --------------------------------------------------------------------------------------------------- bench_data

def test_loading_and_collating_dapo_shaped_rows(tmp_path):
    results = measured(bench_data.main, ["--rows", "200", "--batch_size", "32", "--num_workers", "0"], tmp_path)
    phases = {phase["phase"]: phase for phase in results["phases"]}
    assert list(phases) == ["load (RowDataset)", "tokenizer alone (SFT)", "collate SFTCollator",
                            "collate PromptCollator", "load + SFT collate", "DataLoader SFT, 0 workers"]
    assert all(phase["rows"] == 200 and positive(phase["rows_per_s"], phase["seconds"]) for phase in phases.values())
    assert positive(phases["collate SFTCollator"]["tokens_per_s"])
    headline = phases["load + SFT collate"]
    assert math.isclose(headline["seconds"], phases["load (RowDataset)"]["seconds"]
                        + phases["collate SFTCollator"]["seconds"])


# --------------------------------------------------------------------------------------------------- bench_sync

@pytest.mark.vllm
@pytest.mark.slow
def test_the_bf16_sync_criterion_against_a_served_model(tmp_path):
    """One bf16 vLLM CPU server (about 2-4 minutes), the trainer's forward under bf16 autocast on fp32 master
    weights (as on CUDA): they round differently at every token, yet at 2 layers every correct sync passes the
    tolerance and one skipped AdamW step at lr 1e-5 fails it -- by the mean over the probe's tokens, not by its
    largest difference (the max-only tolerance of before, 0.05, let it pass)."""
    from vllm_servers import free_port, require_vllm
    require_vllm()
    results = measured(bench_sync.main, ["--layers", "2", "--port", str(free_port()), "--workdir",
                                         str(tmp_path / "work")], tmp_path)
    cases = {case["case"]: case for case in results["depths"]["2"]}
    assert all(case["passes"] for case in cases.values() if case["must_pass"])
    assert not cases["stale: 1 step skipped"]["passes"]
    skipped, tolerance = cases["stale: 1 step skipped"], results["tolerance"]
    assert skipped["max"] < tolerance["max"] == 0.05 and skipped["mean"] > tolerance["mean"]
    # the stock reload's head: stale where vLLM computes from a packed copy of it (caught), else refreshed (passes)
    from serving.vllm_launch import keeps_packed_copy, vllm_python
    assert cases["stale head: 10 steps old"]["passes"] != keeps_packed_copy(vllm_python(), "bfloat16")
    assert all(positive(case["mean"], case["max"]) for case in cases.values())
    assert results["margins"]["correct_below"] > 1 and results["margins"]["stale_above"] > 1
