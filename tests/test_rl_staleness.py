# python -m pytest tests/test_rl_staleness.py
"""RL from rollouts sampled by a real vLLM CPU server from older weights (--max_staleness 1), corrected by the
importance weights of trainer/losses/rollout_correction.py against the log-probabilities the server drew with. The
overlap changes when the work happens, never what is computed: it equals the serial reference (`--overlap 0`) bit for
bit; a SIGKILL while the next step's rollouts are requested resumes to the uninterrupted run bit for bit (the kept
rollouts carry their log-probabilities); on-policy (--max_staleness 0) a correction flag changes nothing, bit for bit;
the server's log-probabilities are those it drew with (processed_logprobs: at the sampling temperature, the padding
rows biased out) -- the trainer's agree to fp32 rounding on-policy -- and stale rollouts are weighted."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import trainer.train_rl as train_rl
from loop_helpers import assert_bit_identical_runs, env_one_thread, loop_args, metrics
from support import ROOT, SERVED_CONFIG, write_chat_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
RL = os.path.join(ROOT, "tests", "rl_length_reward.py")
DRIVER = os.path.join(ROOT, "tests", "kill_driver.py")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rl_staleness")
    config = folder / "served_config.json"
    config.write_text(json.dumps(SERVED_CONFIG))
    return {"config": str(config), "data": write_chat_jsonl(folder / "chat.jsonl", 16)}


def rl_args(files, servers, save_dir, **flags) -> list[str]:
    """16 prompts, 2 per step in groups of 3 (a random model's answers vary in length, which the stand-in reward
    grades), a checkpoint every 2 steps; temperature 0.8, so that the server's log-probabilities are the sampled
    distribution's only if it returns them processed."""
    flags = {"max_staleness": 1, "max_steps": 4, "rollout_correction": "tis", **flags}
    return loop_args(None, files["data"], save_dir, batch=2, model_path=servers.student_dir, max_length=80,
                     max_new_tokens=16, num_generations=3, gen_temperature=0.8, learning_rate=1e-3,
                     save_interval=2, rollout_url=servers.rollout.url, **flags)


def train(args: list[str]) -> None:
    from rl_length_reward import main
    main(args)


@pytest.fixture(scope="module")
def reference(vllm_servers, files, tmp_path_factory):
    """The uninterrupted --max_staleness 1 run with TIS, overlapped."""
    folder = tmp_path_factory.mktemp("reference")
    train(rl_args(files, vllm_servers, folder))
    return folder


def test_overlapped_stale_rollouts_equal_the_serial_reference(reference, vllm_servers, files, tmp_path):
    train(rl_args(files, vllm_servers, tmp_path, overlap=0))
    assert_bit_identical_runs(reference, tmp_path)
    rows = metrics(reference)
    assert [m["staleness"] for m in rows] == [0, 1, 1, 1]
    # step 1 samples the weights being trained: the two engines agree to rounding; later steps drifted a step
    assert rows[0]["sampler_logp_gap_max"] < 1e-3
    assert all(m["sampler_logp_gap"] > 10 * rows[0]["sampler_logp_gap"] for m in rows[1:]), rows


def test_a_sigkill_while_the_next_rollouts_are_requested_resumes_bit_for_bit(reference, vllm_servers, files,
                                                                               tmp_path):
    """Killed as step 4's rollouts are requested (while step 3 trains, after the checkpoint of step 2): the resume
    file keeps step 3's rollouts, sampled from step 2's weights, with their log-probabilities."""
    args = rl_args(files, vllm_servers, tmp_path)
    killed = subprocess.run([sys.executable, DRIVER, RL, "rollout", "4", *args], env=env_one_thread(),
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = torch.load(tmp_path / "run_resume.pt", weights_only=False)
    assert saved["step"] == 2 and list(saved["rollouts"]) == [2] and saved["rollouts"][2]["version"] == 1
    ids, logprobs = next(iter(saved["rollouts"][2]["rows"].values()))
    assert len(ids) == len(logprobs) and all(x <= 0 for x in logprobs)
    train(rl_args(files, vllm_servers, tmp_path, from_resume=1))
    assert_bit_identical_runs(reference, tmp_path)


def test_on_policy_a_correction_changes_nothing_and_stale_rollouts_are_weighted(vllm_servers, files, tmp_path,
                                                                                 monkeypatch):
    """--max_staleness 0: every step samples the weights it trains, the weights are 1 by definition, so each
    correction flag's run is the uncorrected one bit for bit. --max_staleness 1: the correction is computed from
    step 2 on, on the trainer's and the server's log-probabilities of exactly the tokens trained."""
    for correction in ("none", "mis"):
        train(rl_args(files, vllm_servers, tmp_path / correction, max_staleness=0, max_steps=2,
                      rollout_correction=correction))
    assert_bit_identical_runs(tmp_path / "none", tmp_path / "mis")
    assert [m["staleness"] for m in metrics(tmp_path / "none")] == [0, 0]
    seen = []
    weights_of = train_rl.correction_weights

    def spy(old, sampler, rows, kind, *limits):
        seen.append((kind, len(old), len(sampler), int(rows.max()) + 1))
        return weights_of(old, sampler, rows, kind, *limits)
    monkeypatch.setattr(train_rl, "correction_weights", spy)
    train(rl_args(files, vllm_servers, tmp_path / "icepop", max_steps=3, rollout_correction="icepop", overlap=0))
    assert [kind for kind, *_ in seen] == ["icepop", "icepop"]  # steps 2 and 3, not step 1
    assert all(n == m and rows == 6 for _, n, m, rows in seen)  # one log mu per trained token, 2 prompts x 3
