# python -m pytest tests/test_train_ppo.py
"""train_ppo.py: the critic's state is in the policy's resume file, so a kill between the critic's export and the
resume file (the commit point) resumes both at the same step, bit for bit; the export is transformers'
token-classification critic, and --critic_path starts a run from it; the CPU twins of bf16 and fp16. The loop's
invariants (accumulation, 2 ranks, SIGKILL, world size) are tests/test_loop_invariants.py's `ppo` and `ppo_lora`;
sharded, tests/test_fsdp.py; the math tests/test_ppo_math.py."""
import os
import signal
import subprocess
import sys

import pytest
import torch

from loop_helpers import assert_bit_identical_runs, env_one_thread, loop_args
from ppo_length_reward import main as train_ppo
from support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
DRIVER = os.path.join(ROOT, "tests", "kill_driver.py")
SCRIPT = os.path.join(ROOT, "tests", "ppo_length_reward.py")


def ppo_args(config, data, save_dir, **flags):
    return loop_args(config, data, save_dir, batch=2, accumulation=4, save_interval=1, max_new_tokens=8,
                     kl_coef=0.1, update_epochs=2, num_minibatches=2, **flags)


def test_a_kill_between_the_critics_export_and_the_commit_resumes_both_at_one_step(tiny_config_path, chat_jsonl,
                                                                                   tmp_path):
    """Each save writes the critic's export, then the policy's, then the resume file. Killed with the third export
    half-written -- step 2's critic, after step 1's two exports and resume file -- the run resumes from step 1,
    policy and critic together, and ends as the uninterrupted run did."""
    train_ppo(ppo_args(tiny_config_path, chat_jsonl, tmp_path / "reference"))
    args = ppo_args(tiny_config_path, chat_jsonl, tmp_path / "killed")
    killed = subprocess.run([sys.executable, DRIVER, SCRIPT, "export", "3", *args], env=env_one_thread(),
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = torch.load(tmp_path / "killed" / "run_resume.pt", weights_only=False)
    assert saved["step"] == 1 and set(saved["kept"]) == {"critic"}
    train_ppo(ppo_args(tiny_config_path, chat_jsonl, tmp_path / "killed", from_resume=1))
    assert_bit_identical_runs(tmp_path / "reference", tmp_path / "killed")
    from safetensors.torch import load_file
    a, b = (load_file(os.path.join(str(tmp_path / name), "run_critic", "model.safetensors"))
            for name in ("reference", "killed"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a) and "score.weight" in a


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_policy_and_critic_train_under_cpu_autocast_and_fp16s_scaler(tiny_config_path, chat_jsonl, tmp_path, dtype):
    """The CPU twins of a GPU's bf16 and fp16 runs: fp32 masters under CPU autocast, fp16 with the GradScaler (the
    critic has its own, saved with it): finite losses and norms for both models, the critic's scaler in the resume
    file, and the run resumes from it."""
    import math
    from loop_helpers import metrics
    train_ppo(ppo_args(tiny_config_path, chat_jsonl, tmp_path, dtype=dtype, max_steps=2))
    rows = metrics(tmp_path)
    assert len(rows) == 2 and all(math.isfinite(m[k]) for m in rows for k in ("loss", "value_loss", "grad_norm",
                                                                              "critic_grad_norm"))
    saved = torch.load(tmp_path / "run_resume.pt", weights_only=False)["kept"]["critic"]
    assert bool(saved["scaler"]) == (dtype == "float16")  # fp16: the critic's loss scale kept
    train_ppo(ppo_args(tiny_config_path, chat_jsonl, tmp_path, dtype=dtype, max_steps=3, from_resume=1,
                       resume_changes="max_steps"))
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3]


def test_a_run_started_from_an_earlier_critic_holds_that_critic(tiny_config_path, chat_jsonl, tmp_path):
    """--critic_path NAME_critic/ (an earlier run's export) in the loop: with the critic's rate at 0 the new run's
    exported critic is the earlier one bit for bit (loaded whole, head included), and it values the rollouts (a
    mean value other than 0) where a fresh critic's zero head gives exactly 0."""
    from safetensors.torch import load_file
    from loop_helpers import metrics
    common = dict(batch=2, accumulation=1, max_new_tokens=8, kl_coef=0.1)
    train_ppo(loop_args(tiny_config_path, chat_jsonl, tmp_path, name="earlier", max_steps=2, **common))
    train_ppo(loop_args(tiny_config_path, chat_jsonl, tmp_path, name="fresh", max_steps=1, **common))
    train_ppo(loop_args(tiny_config_path, chat_jsonl, tmp_path, name="later", max_steps=1, critic_learning_rate=0.0,
                        critic_path=str(tmp_path / "earlier_critic"), **common))
    assert metrics(tmp_path, "fresh")[0]["value"] == 0.0 and metrics(tmp_path, "later")[0]["value"] != 0.0
    exported, kept = (load_file(str(tmp_path / f"{name}_critic" / "model.safetensors"))
                      for name in ("earlier", "later"))
    assert exported.keys() == kept.keys() and all(torch.equal(exported[k], kept[k]) for k in exported)
    assert exported["score.weight"].abs().sum() > 0
