# Run: python -m pytest -m slow tests/test_cpu_recipe.py
"""The whole product under CUDA's recipe on the CPU (`--device cpu --dtype bfloat16`: fp32 master weights under
torch.autocast("cpu", bf16), the teacher and the KV cache in bf16; `--dtype float16`: the same in fp16 with the
CPU GradScaler and a bf16 teacher; docs/precision.md). Each piece runs end to end, two optimizer steps on tiny
models, and must finish with finite losses, gradient norms and weights, fp32 master weights, the dtype recorded
in its checkpoint and, under fp16, the scaler's state saved and no step skipped:

  * SFT, KD and OPD with built-in rollouts, in bf16 and fp16, with the held-out evaluation (--eval_interval);
    the local teacher has activations past fp16's range (65,504; real Qwen3s have such), which its bf16 weights
    hold but an fp16 forward turns into inf and NaN -- so an fp16 run whose teacher computed under the student's
    fp16 autocast fails here
  * OPD with --use_compile 1 --decode compiled (the compiled layers and decode step under autocast)
  * KD and OPD with two teachers (--teachers), rows routed by a column, in bf16 and fp16
  * logit-free OPD against a stub black-box teacher, in bf16 and fp16, with the held-out reverse KL to a local
    copy of the teacher
  * RL with verifiable rewards (a stand-in reward that varies), its k3 KL to the start and the OPD term from that
    teacher, in bf16 and fp16
  * OPD on real vLLM servers: served rollouts (--rollout_url, the bf16 weight sync verified), --max_staleness 1,
    a served top-K teacher (--teacher_url --teacher_topk)
  * eval_math.py and chat.py with bf16 and fp16 weights
  * DDP on gloo (KD and OPD in bf16, SFT in fp16) and FSDP on gloo (SFT with --use_compile 1, KD with
    --gradient_checkpointing 1, its sharded teacher and the lockstep held-out evaluation), two ranks each
  * a SIGKILL in the middle of a bf16 OPD run, resumed: bit-identical to the uninterrupted run, as in fp32
    (tests/test_loop_invariants.py), held-out evaluations included
(--fsdp 1 with --dtype float16 is refused: tests/test_precision.py.)

What it costs on the 2-core machine with other jobs running (load 3-4): 5:00 with a cold inductor cache, of which
the two vLLM servers' start-up is 1.4 min (shared with the other server modules in a full run) and the two
compiled runs 1.6 min; the 18 other runs take 3 to 18 s each. Under a load of 13 the servers took 3 min and the
compiled OPD run 2.5 min: budget 9 minutes there. Without a vLLM environment the served cases skip (under CI,
where `CI` is set, they fail)."""
import io
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from eval import chat, eval_math
from loop_helpers import (env_one_thread, loop_args, metrics, run_command, torchrun_command, weights,
                          without_timing)
from model import Qwen3Config, create_model, save_pretrained
from support import ROOT, SERVED_CONFIG, TINY_CONFIG, write_chat_jsonl
from stub_server import Stub, black_box_teacher
from test_eval import PROBLEMS, write_parquet
from trainer.train_distillation import main as train_distillation
from trainer.train_logit_free import main as train_logit_free
from trainer.train_opd import main as train_opd
from trainer.train_sft import main as train_sft
from rl_length_reward import main as train_rl_varied

# in-process runs with one thread, as the subprocesses have (OMP_NUM_THREADS=1): the resume test compares a run in
# this process with one killed in a subprocess, bit for bit
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

DRIVER = os.path.join(ROOT, "tests", "kill_driver.py")
LOOPS = {"sft": (train_sft, os.path.join(ROOT, "trainer", "train_sft.py")),
         "kd": (train_distillation, os.path.join(ROOT, "trainer", "train_distillation.py")),
         "opd": (train_opd, os.path.join(ROOT, "trainer", "train_opd.py"))}
# the held-out evaluation at steps 0 and 2: 2 prompts, 4 greedy tokens
EVAL = dict(eval_interval=2, eval_rows=2, eval_max_new_tokens=4)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny student's config, 8 chat rows (2 rows a step: 4 steps an epoch) and the teacher: a tiny Qwen3 whose
    first MLP's input norm is 3000 -- its MLP's activations reach ~1e6, finite in bf16, inf in fp16."""
    folder = tmp_path_factory.mktemp("cpu_recipe")
    config = folder / "tiny.json"
    config.write_text(json.dumps(TINY_CONFIG))
    served_config = folder / "served.json"
    served_config.write_text(json.dumps(SERVED_CONFIG))
    teacher = create_model(Qwen3Config.from_dict(TINY_CONFIG), seed=123)
    with torch.no_grad():
        teacher.model.layers[0].post_attention_layernorm.weight.fill_(3000.0)
    save_pretrained(teacher, str(folder / "teacher"))
    return {"config": str(config), "served_config": str(served_config), "teacher": str(folder / "teacher"),
            "data": write_chat_jsonl(folder / "chat.jsonl", 8)}


def recipe_args(files, loop: str, save_dir, dtype: str, **flags) -> list[str]:
    """Two steps of 2 rows under `dtype`, with what each loop needs beyond the common flags."""
    extra = {"sft": {}, "kd": {"teacher_path": files["teacher"]},
             "opd": {"teacher_path": files["teacher"], "max_new_tokens": 8},
             "logit_free": {"max_new_tokens": 8, "chunk_len": 3, "audit_chunks": 2, "continuations": 2,
                            "eval_teacher_path": files["teacher"]},
             "rl": {"max_new_tokens": 8, "num_generations": 2, "kl_coef": 0.1, "opd_coef": 0.5,
                    "teacher_path": files["teacher"]}}[loop]
    return loop_args(files["config"], files["data"], save_dir, batch=2, max_steps=2, dtype=dtype,
                     **{**extra, **flags})


def assert_trained(save_dir, dtype: str, evaluated: bool = True) -> list[dict]:
    """Two steps with finite losses and gradient norms (fp16: the scaler on, no step skipped), the held-out
    evaluations of steps 0 and 2 finite, the exported weights finite, the checkpoint's dtype the recipe's, its
    master weights fp32 and (fp16) its GradScaler state. -> the steps' metrics."""
    rows = metrics(save_dir)
    steps = [m for m in rows if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in steps), steps
    assert [m.get("skipped_steps") for m in steps] == ([0, 0] if dtype == "float16" else [None, None])
    evals = [m for m in rows if "eval/accuracy" in m]
    assert [m["step"] for m in evals] == ([0, 2] if evaluated else [])
    assert all(math.isfinite(value) for m in evals for value in m.values()), evals
    assert all(bool(torch.isfinite(w).all()) for w in weights(save_dir).values())
    checkpoint = torch.load(os.path.join(str(save_dir), "run_resume.pt"), map_location="cpu", weights_only=False)
    assert checkpoint["dtype"] == dtype and checkpoint["step"] == 2
    if checkpoint["optimizer"] is not None:  # (--fsdp 1: in the shard folder) AdamW's moments have the masters' dtype
        moments = [v for state in checkpoint["optimizer"]["state"].values() for k, v in state.items() if k != "step"]
        assert moments and {v.dtype for v in moments} == {torch.float32}
    assert bool(checkpoint["scaler"]) == (dtype == "float16")  # the GradScaler's state, for a resume; bf16: none
    return steps


# --------------------------------------------------------------------------------------------- one process

@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.cuda), "cpu"])
@pytest.mark.parametrize("loop, dtype", [("sft", "bfloat16"), ("sft", "float16"), ("kd", "bfloat16"),
                                         ("kd", "float16"), ("opd", "bfloat16"), ("opd", "float16")])
def test_each_loop_trains_and_evaluates_under_the_recipe(files, tmp_path, loop, dtype, device):
    """On the CPU, and on CUDA where there is one (`python -m pytest -m cuda`): the same checks on both devices."""
    main, _ = LOOPS[loop]
    main(recipe_args(files, loop, tmp_path, dtype, device=device, **EVAL))
    steps = assert_trained(tmp_path, dtype)
    if loop != "sft":  # the teacher's divergence, on the data (KD) or the student's samples (OPD), and held out:
        # two random tiny models, near-uniform over the vocabulary, are ~0.03 apart
        assert all(0.0 <= m["kd" if loop == "kd" else "loss"] < 1.0 for m in steps), steps
        assert all(0.0 <= m["eval/reverse_kl"] < 1.0 for m in metrics(tmp_path) if "eval/accuracy" in m)


@pytest.mark.parametrize("loop, dtype", [("kd", "bfloat16"), ("kd", "float16"), ("opd", "bfloat16"),
                                         ("opd", "float16")])
def test_two_teachers_train_and_evaluate_under_the_recipe(files, tmp_path, loop, dtype):
    """--teachers: the teacher above ("a", past fp16's range) and another ("b"), rows routed by their column (the
    held-out rows name none: --default_teacher a), each scoring its own rows in its bf16 weights."""
    b = create_model(Qwen3Config.from_dict(TINY_CONFIG), seed=321)
    save_pretrained(b, str(tmp_path / "b"))
    teachers = tmp_path / "teachers.json"
    teachers.write_text(json.dumps({"a": {"path": files["teacher"]}, "b": {"path": str(tmp_path / "b")}}))
    rows = [json.loads(line) for line in open(files["data"])]
    data = tmp_path / "routed.jsonl"
    data.write_text("".join(json.dumps({**row, "teacher": "ab"[i % 2]}) + "\n" for i, row in enumerate(rows)))
    main, _ = LOOPS[loop]
    args = recipe_args(files, loop, tmp_path / "run", dtype, teachers=str(teachers), default_teacher="a", **EVAL)
    args[args.index("--teacher_path"):args.index("--teacher_path") + 2] = []
    args[args.index("--data_path") + 1] = str(data)
    main(args)
    steps = assert_trained(tmp_path / "run", dtype)
    rows = [sum(m[f"teacher/{name}/rows"] for m in steps) for name in "ab"]
    assert sum(rows) == 4 and min(rows) >= 1, steps
    assert all(math.isfinite(m[f"teacher/{name}/loss"]) for m in steps for name in "ab"
               if m[f"teacher/{name}/rows"]), steps
    assert all(0.0 <= m["eval/a/reverse_kl"] < 1.0 and "eval/b/reverse_kl" not in m
               for m in metrics(tmp_path / "run") if "eval/accuracy" in m)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_logit_free_trains_and_evaluates_under_the_recipe(files, tmp_path, dtype, monkeypatch):
    """The logit-free loop against a stub black-box teacher (tests/stub_server.py): the audit's entropy pass, the
    reference (the student's bf16 / fp16-run starting model) and the held-out reverse KL to a local copy of the
    teacher -- whose activations pass fp16's range -- under the recipe."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    teacher = Stub(black_box_teacher)
    try:
        train_logit_free(recipe_args(files, "logit_free", tmp_path, dtype, teacher_url=teacher.url, **EVAL))
    finally:
        teacher.close()
    steps = assert_trained(tmp_path, dtype)
    assert all(0.0 <= m["pi_hat"] <= 1.0 and math.isfinite(m["anchor_kl"]) for m in steps), steps
    assert all(0.0 <= m["eval/reverse_kl"] < 1.0 for m in metrics(tmp_path) if "eval/accuracy" in m)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rl_trains_and_evaluates_under_the_recipe(files, tmp_path, dtype):
    """The RL loop (tests/rl_length_reward.py's stand-in reward: groups that differ) with its k3 KL to the start and
    the OPD term from the teacher whose activations pass fp16's range, and the held-out reverse KL to it."""
    train_rl_varied(recipe_args(files, "rl", tmp_path, dtype, **EVAL))
    steps = assert_trained(tmp_path, dtype)
    assert all(math.isfinite(m["kl"]) and math.isfinite(m["reverse_kl_estimate"]) for m in steps), steps
    assert any(m["zero_variance_share"] < 1 for m in steps), "no group had a signal"
    assert all(0.0 <= m["eval/reverse_kl"] < 1.0 for m in metrics(tmp_path) if "eval/accuracy" in m)


def test_opd_with_compile_trains_under_the_recipe(files, tmp_path):
    """--use_compile 1 --decode compiled: the decoder layers compiled for training, the decode step of the
    rollouts and of the held-out evaluation compiled, all under bf16 autocast (its KV cache in bf16)."""
    train_opd(recipe_args(files, "opd", tmp_path, "bfloat16", use_compile=1, decode="compiled", **EVAL))
    steps = assert_trained(tmp_path, "bfloat16")
    assert [m["generated_tokens"] for m in steps] == [16, 16]  # 2 rows x 8 sampled tokens (no EOS this early)


def test_a_killed_bf16_run_resumes_bit_identically(files, tmp_path):
    """OPD in bf16, killed by SIGKILL in step 2's backward (step 1 checkpointed), resumed: the weights and every
    logged number (timings aside) those of the uninterrupted run -- the sampling, the teacher and the held-out
    evaluations at steps 0, 1 and 2 included."""
    def args(save_dir, **flags):
        return recipe_args(files, "opd", save_dir, "bfloat16", save_interval=1, eval_interval=1, eval_rows=2,
                           eval_max_new_tokens=4, **flags)
    train_opd(args(tmp_path / "full"))
    killed = subprocess.run([sys.executable, DRIVER, LOOPS["opd"][1], "backward", "2", *args(tmp_path / "killed")],
                            env=env_one_thread(), capture_output=True, text=True, timeout=400)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = torch.load(tmp_path / "killed" / "run_resume.pt", map_location="cpu", weights_only=False)
    assert saved["step"] == 1 and saved["dtype"] == "bfloat16"
    train_opd(args(tmp_path / "killed", from_resume=1))
    full, resumed = weights(tmp_path / "full"), weights(tmp_path / "killed")
    assert all(torch.equal(full[k], resumed[k]) for k in full), "resumed weights are not bit-identical"
    assert without_timing(metrics(tmp_path / "full")) == without_timing(metrics(tmp_path / "killed"))
    assert [m["step"] for m in metrics(tmp_path / "full") if "eval/accuracy" in m] == [0, 1, 2]


# --------------------------------------------------------------------------------------------- real vLLM servers

def served_flags(servers, case: str) -> dict:
    return {"rollout_url": dict(rollout_url=servers.rollout.url, teacher_path=servers.teacher_dir),
            "max_staleness": dict(rollout_url=servers.rollout.url, teacher_path=servers.teacher_dir,
                                  max_staleness=1),
            "teacher_url_topk": dict(teacher_url=servers.teacher.url, teacher_topk=4)}[case]


@pytest.mark.parametrize("case", ["rollout_url", "max_staleness", "teacher_url_topk"])
def test_opd_on_servers_trains_under_the_recipe(vllm_servers, files, tmp_path, case):
    """The servers' tiny Qwen3 (head_dim 32, what vLLM's CPU kernels take). Served rollouts: the student's weights
    pushed in bf16 and verified against the server within bf16's tolerance before the step's rollouts; with
    --max_staleness 1 step 2's rollouts are sampled in the background while step 1 trains, from the weights step 1
    trains. A served top-K teacher: its top-4 divergence trained and evaluated held out."""
    train_opd(loop_args(files["served_config"], files["data"], tmp_path, batch=2, max_steps=2, dtype="bfloat16",
                        max_length=64, max_new_tokens=8, **EVAL, **served_flags(vllm_servers, case)))
    steps = assert_trained(tmp_path, "bfloat16")
    evals = [m for m in metrics(tmp_path) if "eval/accuracy" in m]
    if case == "rollout_url":  # a push before each step's rollouts, the mean under bf16's 4e-3
        assert [m["staleness"] for m in steps] == [0, 0]
        assert all(m["sync_logprob_mean"] < 4e-3 and m["sync_logprob_diff"] < 5e-2 for m in steps), steps
    elif case == "max_staleness":  # one push: steps 1 and 2 both sample the initial weights (step 2's rollouts, a
        # step stale, while step 1 trains); none at the last step, with nothing after it to sample
        assert [m["staleness"] for m in steps] == [0, 1]
        assert steps[0]["sync_logprob_mean"] < 4e-3 and "sync_logprob_diff" not in steps[1]
    else:
        assert all(0.0 <= m["teacher_tail_mass"] <= 1.0 for m in steps), steps
        assert all("eval/reverse_kl_top4" in m for m in evals), evals


# --------------------------------------------------------------------------------------------- eval_math, chat

@pytest.fixture(scope="module")
def inference_model(tmp_path_factory):
    """A saved tiny model with an untied head (greedy text then depends on the prompt) and test_eval's problems."""
    folder = tmp_path_factory.mktemp("inference")
    model = create_model(Qwen3Config.from_dict({**TINY_CONFIG, "tie_word_embeddings": False}), seed=0)
    save_pretrained(model, str(folder / "model"))
    return {"model_dir": str(folder / "model"), "data": write_parquet(folder / "problems.parquet", PROBLEMS)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_eval_math_completes_and_grades_in_the_recipes_dtype(inference_model, tmp_path, monkeypatch, dtype):
    dtypes = []
    complete_batch = eval_math.complete_batch

    def spy(model, *args, **kwargs):
        dtypes.append(next(model.parameters()).dtype)
        return complete_batch(model, *args, **kwargs)
    monkeypatch.setattr(eval_math, "complete_batch", spy)
    out = tmp_path / "results.jsonl"
    summary = eval_math.main(["--model_path", inference_model["model_dir"], "--data_path", inference_model["data"],
                              "--batch_size", "2", "--max_new_tokens", "6", "--out", str(out), "--device", "cpu",
                              "--dtype", dtype, "--no_progress"])
    assert set(dtypes) == {getattr(torch, dtype)}
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(len(PROBLEMS)))
    assert all("completion" in r for r in records) and 0 < summary["mean_completion_tokens"] <= 6


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_chat_answers_two_turns_in_the_recipes_dtype(inference_model, monkeypatch, capsys, dtype):
    """Piped input, sampled replies (temperature 0.7): the KV cache in the weights' dtype, one token at a time."""
    dtypes = []
    stream_reply = chat.stream_reply

    def spy(model, *args):
        dtypes.append(next(model.parameters()).dtype)
        return stream_reply(model, *args)
    monkeypatch.setattr(chat, "stream_reply", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2 + 3?\nAnd times 4?\nexit\n"))
    history = chat.main(["--model_path", inference_model["model_dir"], "--max_new_tokens", "6", "--device", "cpu",
                         "--dtype", dtype, "--seed", "3"])
    assert dtypes == [getattr(torch, dtype)] * 2
    assert [turn["role"] for turn in history] == ["user", "assistant", "user", "assistant"]
    assert capsys.readouterr().out == history[1]["content"] + "\n" + history[3]["content"] + "\n"


# --------------------------------------------------------------------------------------------- two ranks on gloo

@pytest.mark.serial
@pytest.mark.parametrize("loop, dtype", [("kd", "bfloat16"), ("opd", "bfloat16"), ("sft", "float16")])
def test_ddp_trains_and_evaluates_under_the_recipe(files, tmp_path, loop, dtype):
    """Two ranks, each its share of the held-out prompts (all-reduced); fp16: each rank's GradScaler, the same
    decision on both (the all-reduced gradients)."""
    run_command(torchrun_command(LOOPS[loop][1], recipe_args(files, loop, tmp_path, dtype, **EVAL)))
    assert_trained(tmp_path, dtype)


@pytest.mark.serial
@pytest.mark.parametrize("dtype, fsdp", [("bfloat16", 1), ("float16", 0)], ids=["bf16-fsdp", "fp16"])
def test_a_lora_student_trains_and_evaluates_under_the_recipe(files, tmp_path, dtype, fsdp):
    """KD with a LoRA student: its base held as a frozen teacher is (bf16 -- gathered as it is stored on 2 sharded
    ranks --, also under fp16 with the GradScaler), its fp32 adapters alone trained, resumed and in AdamW."""
    args = recipe_args(files, "kd", tmp_path, dtype, lora_rank=4, fsdp=fsdp, **EVAL)
    if fsdp:
        run_command(torchrun_command(LOOPS["kd"][1], args))
    else:
        LOOPS["kd"][0](args)
    assert_trained(tmp_path, dtype)
    checkpoint = torch.load(tmp_path / "run_resume.pt", map_location="cpu", weights_only=False)
    assert checkpoint["base_sha256"] and (fsdp or all(".lora_" in name for name in checkpoint["model"]))


@pytest.mark.parametrize("loop, flags", [("sft", {"use_compile": 1}), ("kd", {"gradient_checkpointing": 1})],
                         ids=["sft-use_compile", "kd-gradient_checkpointing"])
@pytest.mark.serial
def test_fsdp_trains_under_the_recipe(files, tmp_path, loop, flags):
    """--fsdp 1 in bf16: the decoder layers gathered in bf16; compiled layers (SFT), or checkpointed layers with the
    teacher sharded and the held-out evaluation decoded by both ranks in lockstep (KD)."""
    evaluation = EVAL if loop == "kd" else {}
    run_command(torchrun_command(LOOPS[loop][1], recipe_args(files, loop, tmp_path, "bfloat16", fsdp=1, **flags,
                                                             **evaluation)))
    assert_trained(tmp_path, "bfloat16", evaluated=bool(evaluation))
