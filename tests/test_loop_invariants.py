# python -m pytest tests/test_loop_invariants.py
"""The skeleton's invariants, held by every training loop (SFT, KD, OPD, RL, PPO; KD and OPD also with two
teachers, rows routed by a column, and skew divergences; OPD's sampled-token form with PowerOPD's reward and IW-OPD's
weights; OPD with speculative KD's rollouts; OPD with the student's own EMA as its teacher; RL with update epochs
over minibatches and CISPO; SFT, RL and PPO with a LoRA student -- PPO's critic with adapters too --, RL's OPD term
with those variants; DPO on preference pairs, its reference live or precomputed; RL and OPD on multi-turn rollouts
with a calculator) on a tiny Qwen3 (real 151,936 vocabulary, CPU, fp32): accumulation is exact (also for a short
tail window), DDP with 2 ranks equals one process, --packing 1 equals the padded batch, a run killed with SIGKILL right after a checkpoint and resumed ends bit-identical to one never
interrupted, and resuming across a world-size change that keeps the global batch reaches the same weights.

Each loop's invariants are compared with one run (`reference`, made once per loop and module): one process, batch 2
x accumulation 4 on 20 rows -- windows of 8, 8 and a short tail of 4 rows --, a checkpoint after every step, its
weights after step 1 exported. A loop's tests run on one pytest-xdist worker (their group), so it is made once."""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from support import ROOT, TINY_CONFIG, tool_agent_model, write_chat_jsonl, write_pairs_jsonl, write_text_corpus
from loop_helpers import (checkpoint_step, kill_after_first_checkpoint, loop_args, max_weight_diff, metrics,
                          run_command, torchrun_command, weights, without_timing)
from model import Qwen3Config, create_model, save_pretrained
from trainer.train_distillation import main as train_distillation
from trainer.train_dpo import main as train_dpo
from trainer.train_opd import main as train_opd
from trainer.train_pretrain import main as train_pretrain
from trainer.train_sft import main as train_sft
from rl_length_reward import main as train_rl_varied
from ppo_length_reward import main as train_ppo_varied

# 2-process torchrun runs and full loops: the whole suite, not the fast tier. One thread in-process, as the
# subprocesses have (OMP_NUM_THREADS=1): the in-process and subprocess runs then sum in the same order.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

LOOPS = {
    "sft": (train_sft, os.path.join(ROOT, "trainer", "train_sft.py")),
    "kd": (train_distillation, os.path.join(ROOT, "trainer", "train_distillation.py")),
    "opd": (train_opd, os.path.join(ROOT, "trainer", "train_opd.py")),
    # the sampled-token form with PowerOPD's reward and IW-OPD's weights (whole rows per micro-batch, any split)
    "opd_signal": (train_opd, os.path.join(ROOT, "trainer", "train_opd.py")),
    # speculative KD: the teacher decodes beside the student and replaces its proposals outside its top-K
    "opd_skd": (train_opd, os.path.join(ROOT, "trainer", "train_opd.py")),
    # self-distillation: the student's EMA, shown the row's answer in its prompt, is the teacher (the EMA resumed)
    "opd_self": (train_opd, os.path.join(ROOT, "trainer", "train_opd.py")),
    # RL with tests/rl_length_reward.py's stand-in reward (a random model never answers right: no group would differ)
    "rl": (train_rl_varied, os.path.join(ROOT, "tests", "rl_length_reward.py")),
    # RL's rollout batch trained in 2 epochs of 2 minibatches (log pi_old recorded, the ratio live), CISPO's loss:
    # minibatches of whole groups that micro-batches and ranks cut differently
    "rl_epochs": (train_rl_varied, os.path.join(ROOT, "tests", "rl_length_reward.py")),
    # PPO: the critic trained beside the policy, its state in the policy's resume file (its export compared too)
    "ppo": (train_ppo_varied, os.path.join(ROOT, "tests", "ppo_length_reward.py")),
    # two teachers (--teachers), rows routed by their `teacher` column: micro-batches that mix them, and ones where
    # a rank has no row for one of them
    "kd_teachers": (train_distillation, os.path.join(ROOT, "trainer", "train_distillation.py")),
    "opd_teachers": (train_opd, os.path.join(ROOT, "trainer", "train_opd.py")),
    # LoRA students (the base frozen, the adapters alone trained and resumed): SFT, and RL, whose KL reference is
    # then the student's own base with its adapters switched off
    "sft_lora": (train_sft, os.path.join(ROOT, "trainer", "train_sft.py")),
    "rl_lora": (train_rl_varied, os.path.join(ROOT, "tests", "rl_length_reward.py")),
    # PPO with adapters on both models: the critic's frozen body the student's own tensors, its adapters and head
    # trained and resumed beside the student's adapters
    "ppo_lora": (train_ppo_varied, os.path.join(ROOT, "tests", "ppo_length_reward.py")),
    # continued pretraining: a streamed corpus packed into the reference's 20 rows (documents split across rows), its
    # position in the resume file
    "pretrain": (train_pretrain, os.path.join(ROOT, "trainer", "train_pretrain.py")),
    # DPO on preference pairs (a pair's two answers in one micro-batch, the loss a mean over the window's pairs):
    # with the full student's reference live and the RPO term; and with a LoRA student, IPO and the reference's
    # numbers precomputed (the base with its adapters off), kept in the resume file and read back on a resume
    "dpo": (train_dpo, os.path.join(ROOT, "trainer", "train_dpo.py")),
    "dpo_lora": (train_dpo, os.path.join(ROOT, "trainer", "train_dpo.py")),
    # multi-turn rollouts with the calculator (tests/support.py's agent model: short turns, about half of them
    # calling): conversations of different lengths and turns in one micro-batch, labels on the student's tokens only
    "rl_tools": (train_rl_varied, os.path.join(ROOT, "tests", "rl_length_reward.py")),
    "opd_tools": (train_opd, os.path.join(ROOT, "trainer", "train_opd.py")),
}
# what each loop needs beyond the common flags; OPD samples 8 tokens per prompt with per-row seeds, so its samples
# (and with them its weights) do not depend on accumulation, world size or an interruption; with lmbda 0.5 (seed 7)
# its steps are on-, off-, on-, on-, off-, off-policy: the per-step coin must not depend on those either
LOOP_FLAGS = {"sft": {}, "pretrain": {}, "kd": {"alpha": 0.3, "temperature": 2.0},
              "opd": {"max_new_tokens": 8, "beta": 0.5, "lmbda": 0.5},
              # groups of 3 with per-(row, generation) seeds; the KL to the start and the OPD term read both frozen
              # models; asymmetric clipping (on-policy: rho = 1, so it never clips)
              "rl": {"max_new_tokens": 8, "num_generations": 3, "kl_coef": 0.1, "opd_coef": 0.5,
                     "clip_eps_high": 0.28}}
# several teachers with DistiLLM's skew divergences in place of the KL / the JSD (the routing and the divergence are
# independent: one loop each covers both)
LOOP_FLAGS["kd_teachers"] = {**LOOP_FLAGS["kd"], "divergence": "skew_kl"}
LOOP_FLAGS["opd_teachers"] = {"max_new_tokens": 8, "lmbda": 0.5, "loss": "skew_rkl"}
SIGNAL = {"opd_reward": "power", "position_weight": "iw"}
LOOP_FLAGS["opd_signal"] = {"max_new_tokens": 8, "loss": "sampled_kl", **SIGNAL}
LOOP_FLAGS["opd_skd"] = {"max_new_tokens": 8, "skd_topk": 2048}  # random models: about half the proposals replaced
LOOP_FLAGS["opd_self"] = {"max_new_tokens": 8, "self_teacher": "ema", "ema_decay": 0.5, "max_prompt_length": 64,
                          "privileged_template": "{question} The answer: {ground_truth}."}
# a LoRA learning rate (the adapters move: B starts at zero), adapters compared besides the merged weights (weights());
# RL's OPD term with the sampled-token signal's variants
LORA = {"lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3}
LOOP_FLAGS["sft_lora"], LOOP_FLAGS["rl_lora"] = LORA, {**LOOP_FLAGS["rl"], **LORA, **SIGNAL}
LOOP_FLAGS["ppo"] = {"max_new_tokens": 8, "kl_coef": 0.1, "update_epochs": 2, "num_minibatches": 2}
LOOP_FLAGS["ppo_lora"] = {**LOOP_FLAGS["ppo"], **LORA}
LOOP_FLAGS["rl_epochs"] = {**LOOP_FLAGS["rl"], "update_epochs": 2, "num_minibatches": 2, "policy_loss": "cispo"}
LOOP_FLAGS["dpo"] = {"rpo_alpha": 0.5}
LOOP_FLAGS["dpo_lora"] = {**LORA, "loss_type": "ipo", "precompute_ref": 1}
TOOLS = {"tools": "calculator", "max_turns": 3, "max_new_tokens": 64}  # the agent model, with its own --model_path
LOOP_FLAGS["rl_tools"] = {**LOOP_FLAGS["rl"], **TOOLS}
LOOP_FLAGS["opd_tools"] = TOOLS  # reverse KL: the JSD of the peaked agent and a random teacher is ln 2, flat


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """The tiny config, the chat data (20 rows), the raw-text corpus (20 packed rows of loop_args' 96 tokens), the
    teacher (seed 123) and --teachers' file (the teacher as "a", another seed as "b") every loop of this module
    reads."""
    folder = tmp_path_factory.mktemp("loop_files")
    config = folder / "tiny_config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    for name, seed in (("teacher", 123), ("teacher_b", 321)):
        save_pretrained(create_model(Qwen3Config.from_json(str(config)), seed=seed), str(folder / name))
    save_pretrained(tool_agent_model(), str(folder / "agent"))
    teachers = folder / "teachers.json"
    teachers.write_text(json.dumps({"a": {"path": str(folder / "teacher")}, "b": {"path": str(folder / "teacher_b")}}))
    return {"config": str(config), "data": write_chat_jsonl(folder / "chat.jsonl", 20),
            "corpus": write_text_corpus(folder / "corpus.jsonl", rows=20, row_length=96),
            "pairs": write_pairs_jsonl(folder / "pairs.jsonl", 20), "teacher": str(folder / "teacher"),
            "agent": str(folder / "agent"),
            "teachers": str(teachers)}


def routed(data: str) -> str:
    """A copy of `data` whose rows name teacher a or b (rows 0, 3, 6, ...: b; so whole micro-batches of a occur)."""
    rows = [json.loads(line) for line in open(data, encoding="utf-8")]
    path = data.removesuffix(".jsonl") + "_routed.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({**row, "teacher": "b" if i % 3 == 0 else "a"}) + "\n" for i, row in enumerate(rows))
    return path


def loops(*names: str) -> list:
    """Loop parameters, each in the xdist group of its loop: its tests share one worker, and with it the reference."""
    return [pytest.param(name, marks=pytest.mark.xdist_group(f"loop_{name}")) for name in names or LOOPS]


@pytest.fixture(scope="module", params=loops())
def loop(request, files):
    """(main, script, args-builder(save_dir, **flags)) of one training loop, on the chat data, with what that loop
    needs beyond the common flags."""
    main, script = LOOPS[request.param]
    several = request.param.endswith("_teachers")
    teacher = {"teachers": files["teachers"]} if several else {"teacher_path": files["teacher"]}
    # none, or itself (DPO's reference: the student's start)
    own_teacher = (request.param.startswith(("sft", "dpo", "pretrain"))
                   or request.param in ("opd_self", "ppo", "ppo_lora"))
    extra = {**LOOP_FLAGS[request.param], **(teacher if not own_teacher else {})}
    if request.param.endswith("_tools"):  # the agent model is the student (loop_args' --model_config dropped)
        extra.update(model_path=files["agent"], model_config=None)
    data = (routed(files["data"]) if several else files["pairs"] if request.param.startswith("dpo")
            else files["corpus"] if request.param == "pretrain" else files["data"])

    def args(save_dir, **flags):
        return loop_args(files["config"], data, save_dir, **{**extra, **flags})
    return main, script, args


# the reference's flags: 20 rows, global batch 8 -> 3 optimizer steps (the last a short tail window of 4 rows)
REFERENCE = dict(batch=2, accumulation=4, save_interval=1, export_steps="1")
STEPS = 3


@pytest.fixture(scope="module")
def reference(loop, one_thread, tmp_path_factory):
    """The folder of the loop's uninterrupted one-process run with REFERENCE's flags (`run`, its export after step
    1 `run_step1`)."""
    main, _, args = loop
    folder = tmp_path_factory.mktemp("reference")
    main(args(folder, **REFERENCE))
    assert len(metrics(folder)) == STEPS
    return folder


def exported(save_dir, name: str) -> dict[str, torch.Tensor]:
    """An export's (merged) weights: what a LoRA run's step export holds too."""
    return load_file(os.path.join(str(save_dir), name, "model.safetensors"))


def test_accumulation_equals_one_big_batch(loop, reference, tmp_path):
    """Batch 8 x accumulation 1 against the reference's 2 x 4: the same weights after every window, the 4-row tail
    window included (flushed exactly: not divided as a full one), the same tokens, losses and gradient norms."""
    main, _, args = loop
    main(args(tmp_path / "big", batch=8, accumulation=1))
    assert max_weight_diff(weights(tmp_path / "big"), weights(reference)) <= 1e-5
    big, acc = metrics(tmp_path / "big"), metrics(reference)
    assert len(big) == STEPS and [m["tokens"] for m in big] == [m["tokens"] for m in acc]
    assert [m["loss"] for m in big] == pytest.approx([m["loss"] for m in acc], abs=1e-5)
    assert [m["grad_norm"] for m in big] == pytest.approx([m["grad_norm"] for m in acc], rel=1e-5)


@pytest.mark.serial
def test_ddp_two_ranks_equal_one_process(loop, reference, tmp_path):
    _, script, args = loop
    run_command(torchrun_command(script, args(tmp_path / "ddp", batch=2, accumulation=2)))
    assert max_weight_diff(weights(tmp_path / "ddp"), weights(reference)) <= 1e-5
    assert [m["tokens"] for m in metrics(tmp_path / "ddp")] == [m["tokens"] for m in metrics(reference)]


def test_packing_computes_what_the_padded_batch_computes(loop, reference, tmp_path, request):
    """--packing 1 (the student's training forward on the rows' real tokens only) against the right-padded batch
    (the reference's first step): the same loss, gradient norm and weights to rounding. One step: an on-policy
    loop's next rollouts would sample from weights that differ by rounding."""
    if request.node.callspec.params["loop"] == "pretrain":
        pytest.skip("a corpus's rows are packed already (documents end to end): train_pretrain.py refuses --packing")
    main, _, args = loop
    main(args(tmp_path / "packed", **REFERENCE, max_steps=1, packing=1))
    padded, packed = metrics(reference)[:1], metrics(tmp_path / "packed")
    assert [m["tokens"] for m in packed] == [m["tokens"] for m in padded]
    assert [m["loss"] for m in packed] == pytest.approx([m["loss"] for m in padded], rel=1e-5, abs=1e-6)
    assert [m["grad_norm"] for m in packed] == pytest.approx([m["grad_norm"] for m in padded], rel=1e-5)
    assert max_weight_diff(exported(reference, "run_step1"), exported(tmp_path / "packed", "run")) <= 1e-5


def test_sigkill_then_resume_is_bit_identical(loop, reference, tmp_path):
    """The reference's command killed as soon as its first checkpoint (step 1 of 3) exists, then resumed: the
    reference's weights bit for bit, every step logged once with the same numbers."""
    main, script, args = loop
    killed = tmp_path / "killed"
    kill_after_first_checkpoint([sys.executable, script, *args(killed, **REFERENCE)], str(killed / "run_resume.pt"))
    assert checkpoint_step(killed / "run_resume.pt") < STEPS, "the run finished before it could be killed"
    main(args(killed, **REFERENCE, from_resume=1))
    full, resumed = weights(reference), weights(killed)
    assert all(torch.equal(full[k], resumed[k]) for k in full), "resumed weights are not bit-identical"
    assert without_timing(metrics(reference)) == without_timing(metrics(killed)), "every step logged once, same numbers"


@pytest.mark.serial
@pytest.mark.parametrize("loop", loops("sft", "rl", "sft_lora", "rl_epochs", "ppo", "dpo_lora", "pretrain"),
                         indirect=True)  # groups, minibatches, DPO's precomputed reference, a corpus
def test_resume_across_world_size_change(loop, reference, tmp_path):
    """Two ranks x batch 2 x accumulation 2 killed after their first checkpoint, resumed by one process with the
    reference's batch 2 x accumulation 4 (the same global batch): the reference's weights."""
    main, script, args = loop
    two_ranks = args(tmp_path / "ws", batch=2, accumulation=2, save_interval=1)
    kill_after_first_checkpoint(torchrun_command(script, two_ranks), str(tmp_path / "ws" / "run_resume.pt"))
    assert checkpoint_step(tmp_path / "ws" / "run_resume.pt") < STEPS, "the run finished before it could be killed"
    main(args(tmp_path / "ws", batch=2, accumulation=4, save_interval=1, from_resume=1))
    assert max_weight_diff(weights(tmp_path / "ws"), weights(reference)) <= 1e-5
