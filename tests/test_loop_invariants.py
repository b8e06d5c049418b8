# python -m pytest tests/test_loop_invariants.py
"""The skeleton's invariants, held by every training loop (SFT, KD, OPD, RL; KD and OPD also with two teachers,
rows routed by a column; SFT and RL with a LoRA student) on a tiny Qwen3 (real 151,936 vocabulary, CPU, fp32):
accumulation is exact (also for a short tail window), DDP with 2 ranks equals one process, --packing 1 equals the
padded batch, a run killed with SIGKILL right after a checkpoint and resumed ends bit-identical to one never
interrupted, and resuming across a world-size change that keeps the global batch reaches the same weights."""
import json
import os
import sys

import pytest
import torch

from support import ROOT
from loop_helpers import (checkpoint_step, kill_after_first_checkpoint, loop_args, max_weight_diff, metrics,
                          run_command, torchrun_command, weights, without_timing)
from model import Qwen3Config, create_model, save_pretrained
from trainer.train_distillation import main as train_distillation
from trainer.train_opd import main as train_opd
from trainer.train_sft import main as train_sft
from rl_length_reward import main as train_rl_varied

# 2-process torchrun runs and full loops: the whole suite, not the fast tier. One thread in-process, as the
# subprocesses have (OMP_NUM_THREADS=1): the in-process and subprocess runs then sum in the same order.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

LOOPS = {
    "sft": (train_sft, os.path.join(ROOT, "trainer", "train_sft.py")),
    "kd": (train_distillation, os.path.join(ROOT, "trainer", "train_distillation.py")),
    "opd": (train_opd, os.path.join(ROOT, "trainer", "train_opd.py")),
    # RL with tests/rl_length_reward.py's stand-in reward (a random model never answers right: no group would differ)
    "rl": (train_rl_varied, os.path.join(ROOT, "tests", "rl_length_reward.py")),
    # two teachers (--teachers), rows routed by their `teacher` column: micro-batches that mix them, and ones where
    # a rank has no row for one of them
    "kd_teachers": (train_distillation, os.path.join(ROOT, "trainer", "train_distillation.py")),
    "opd_teachers": (train_opd, os.path.join(ROOT, "trainer", "train_opd.py")),
    # LoRA students (the base frozen, the adapters alone trained and resumed): SFT, and RL, whose KL reference is
    # then the student's own base with its adapters switched off
    "sft_lora": (train_sft, os.path.join(ROOT, "trainer", "train_sft.py")),
    "rl_lora": (train_rl_varied, os.path.join(ROOT, "tests", "rl_length_reward.py")),
}
# what each loop needs beyond the common flags; OPD samples 8 tokens per prompt with per-row seeds, so its samples
# (and with them its weights) do not depend on accumulation, world size or an interruption; with lmbda 0.5 (seed 7)
# its steps are on-, off-, on-, on-, off-, off-policy: the per-step coin must not depend on those either
LOOP_FLAGS = {"sft": {}, "kd": {"alpha": 0.3, "temperature": 2.0},
              "opd": {"max_new_tokens": 8, "beta": 0.5, "lmbda": 0.5},
              # groups of 3 with per-(row, generation) seeds; the KL to the start and the OPD term read both frozen
              # models; asymmetric clipping (on-policy: rho = 1, so it never clips)
              "rl": {"max_new_tokens": 8, "num_generations": 3, "kl_coef": 0.1, "opd_coef": 0.5,
                     "clip_eps_high": 0.28}}
LOOP_FLAGS["kd_teachers"], LOOP_FLAGS["opd_teachers"] = LOOP_FLAGS["kd"], LOOP_FLAGS["opd"]
# a LoRA learning rate (the adapters move: B starts at zero), adapters compared besides the merged weights (weights())
LORA = {"lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-3}
LOOP_FLAGS["sft_lora"], LOOP_FLAGS["rl_lora"] = LORA, {**LOOP_FLAGS["rl"], **LORA}


@pytest.fixture
def teacher_dir(tiny_config_path, tmp_path):
    teacher = create_model(Qwen3Config.from_json(tiny_config_path), seed=123)
    save_pretrained(teacher, str(tmp_path / "teacher"))
    return str(tmp_path / "teacher")


@pytest.fixture
def teachers_file(tiny_config_path, teacher_dir, tmp_path):
    """--teachers: the teacher above as "a", another seed as "b"."""
    save_pretrained(create_model(Qwen3Config.from_json(tiny_config_path), seed=321), str(tmp_path / "teacher_b"))
    path = tmp_path / "teachers.json"
    path.write_text(json.dumps({"a": {"path": teacher_dir}, "b": {"path": str(tmp_path / "teacher_b")}}))
    return str(path)


def routed(data: str) -> str:
    """A copy of `data` whose rows name teacher a or b (rows 0, 3, 6, ...: b; so whole micro-batches of a occur)."""
    rows = [json.loads(line) for line in open(data, encoding="utf-8")]
    path = data.removesuffix(".jsonl") + "_routed.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({**row, "teacher": "b" if i % 3 == 0 else "a"}) + "\n" for i, row in enumerate(rows))
    return path


@pytest.fixture(params=list(LOOPS))
def loop(request, tiny_config_path, teacher_dir, teachers_file):
    """(main, script, args-builder) of one training loop, with what that loop needs beyond the common flags."""
    main, script = LOOPS[request.param]
    several = request.param.endswith("_teachers")
    teacher = {"teachers": teachers_file} if several else {"teacher_path": teacher_dir}
    extra = {**LOOP_FLAGS[request.param], **(teacher if not request.param.startswith("sft") else {})}

    def args(data, save_dir, **flags):
        return loop_args(tiny_config_path, routed(data) if several else data, save_dir, **{**extra, **flags})
    return main, script, args


def test_accumulation_equals_one_big_batch(loop, chat_jsonl, tmp_path):
    main, _, args = loop
    main(args(chat_jsonl, tmp_path / "big", batch=8, accumulation=1, max_steps=2))
    main(args(chat_jsonl, tmp_path / "acc", batch=2, accumulation=4, max_steps=2))
    assert max_weight_diff(weights(tmp_path / "big"), weights(tmp_path / "acc")) <= 1e-5
    big, acc = metrics(tmp_path / "big"), metrics(tmp_path / "acc")
    assert [m["tokens"] for m in big] == [m["tokens"] for m in acc]
    assert [m["loss"] for m in big] == pytest.approx([m["loss"] for m in acc], abs=1e-5)
    assert [m["grad_norm"] for m in big] == pytest.approx([m["grad_norm"] for m in acc], rel=1e-5)


@pytest.mark.parametrize("loop", ["sft", "kd"], indirect=True)  # OPD's windows are the same skeleton code
def test_short_tail_window_is_flushed_exactly(loop, chat_jsonl, tmp_path):
    # 20 rows: batch 2 x accumulation 4 gives windows of 4, 4 and 2 micro-batches; batch 8 gives 8, 8 and 4 rows
    main, _, args = loop
    main(args(chat_jsonl, tmp_path / "big", batch=8, accumulation=1))
    main(args(chat_jsonl, tmp_path / "acc", batch=2, accumulation=4))
    assert len(metrics(tmp_path / "acc")) == 3
    assert max_weight_diff(weights(tmp_path / "big"), weights(tmp_path / "acc")) <= 1e-5


def test_ddp_two_ranks_equal_one_process(loop, chat_jsonl, tmp_path):
    main, script, args = loop
    run_command(torchrun_command(script, args(chat_jsonl, tmp_path / "ddp", batch=2, accumulation=2)))
    main(args(chat_jsonl, tmp_path / "one", batch=2, accumulation=4))
    assert max_weight_diff(weights(tmp_path / "ddp"), weights(tmp_path / "one")) <= 1e-5
    assert [m["tokens"] for m in metrics(tmp_path / "ddp")] == [m["tokens"] for m in metrics(tmp_path / "one")]


def test_packing_computes_what_the_padded_batch_computes(loop, chat_jsonl, tmp_path):
    """--packing 1 (the student's training forward on the rows' real tokens only) against the right-padded batch:
    the same loss, gradient norm and weights to rounding. One step: an on-policy loop's next rollouts would sample
    from weights that differ by rounding."""
    main, _, args = loop
    main(args(chat_jsonl, tmp_path / "padded", batch=4, accumulation=2, max_steps=1))
    main(args(chat_jsonl, tmp_path / "packed", batch=4, accumulation=2, max_steps=1, packing=1))
    padded, packed = metrics(tmp_path / "padded"), metrics(tmp_path / "packed")
    assert [m["tokens"] for m in packed] == [m["tokens"] for m in padded]
    assert [m["loss"] for m in packed] == pytest.approx([m["loss"] for m in padded], rel=1e-5, abs=1e-6)
    assert [m["grad_norm"] for m in packed] == pytest.approx([m["grad_norm"] for m in padded], rel=1e-5)
    assert max_weight_diff(weights(tmp_path / "padded"), weights(tmp_path / "packed")) <= 1e-5


def test_sigkill_then_resume_is_bit_identical(loop, long_chat_jsonl, tmp_path):
    main, script, args = loop
    flags = dict(batch=2, accumulation=2, save_interval=2)  # 6 optimizer steps, a checkpoint every 2
    main(args(long_chat_jsonl, tmp_path / "full", **flags))
    killed = tmp_path / "killed"
    kill_after_first_checkpoint([sys.executable, script, *args(long_chat_jsonl, killed, **flags)],
                                str(killed / "run_resume.pt"))
    assert checkpoint_step(killed / "run_resume.pt") < 6, "the run finished before it could be killed"
    main(args(long_chat_jsonl, killed, **flags, from_resume=1))
    full, resumed = weights(tmp_path / "full"), weights(killed)
    assert all(torch.equal(full[k], resumed[k]) for k in full), "resumed weights are not bit-identical"
    assert without_timing(metrics(tmp_path / "full")) == without_timing(metrics(killed)), \
        "every step logged once, same numbers"


@pytest.mark.parametrize("loop", ["sft", "rl", "sft_lora"], indirect=True)  # the data; RL: groups across ranks
def test_resume_across_world_size_change(loop, long_chat_jsonl, tmp_path):
    main, script, args = loop
    # 24 rows, global batch 8: 3 optimizer steps, a checkpoint after each
    two_ranks = args(long_chat_jsonl, tmp_path / "ws", batch=2, accumulation=2, save_interval=1)
    kill_after_first_checkpoint(torchrun_command(script, two_ranks), str(tmp_path / "ws" / "run_resume.pt"))
    assert checkpoint_step(tmp_path / "ws" / "run_resume.pt") < 3, "the run finished before it could be killed"
    main(args(long_chat_jsonl, tmp_path / "ws", batch=2, accumulation=4, save_interval=1, from_resume=1))
    main(args(long_chat_jsonl, tmp_path / "ref", batch=2, accumulation=4, save_interval=1))
    assert max_weight_diff(weights(tmp_path / "ws"), weights(tmp_path / "ref")) <= 1e-5
