# python -m pytest tests/test_rollout_overlap.py
"""OPD with --max_staleness 1 on a real vLLM CPU server: the server samples step s+1 while the trainer trains step
s. The overlap must change when the work happens, never what is computed: it equals the serial reference (the same
rollouts sampled in the loop's own thread, `--overlap 0`) bit for bit, a SIGKILL at any instant resumes to the
uninterrupted run, a server that dies mid-rollout stops the run with its last step saved, and 2 ranks train as one
process does."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from loop_helpers import (assert_bit_identical_runs, assert_one_line_error, env_one_thread, loop_args, max_weight_diff,
                          metrics, run_command, script_exit, torchrun_command, weights)
from support import ROOT, SERVED_CONFIG, write_chat_jsonl
from trainer.train_opd import main as train_opd
from vllm_servers import TcpProxy, dies_before_call

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
OPD = os.path.join(ROOT, "trainer", "train_opd.py")
DRIVER = os.path.join(ROOT, "tests", "kill_driver.py")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("overlap")
    config = folder / "served_config.json"
    config.write_text(json.dumps(SERVED_CONFIG))
    return {"config": str(config), "data": write_chat_jsonl(folder / "chat.jsonl", 16)}


def staleness_args(files, servers, save_dir, url=None, batch=4, accumulation=1, **flags) -> list[str]:
    """16 rows, 4 per step: 6 steps cross an epoch boundary (the rollouts of epoch 2's first step are sampled
    during epoch 1's last), a checkpoint every 2 steps."""
    flags = {"max_staleness": 1, "max_steps": 6, **flags}
    return loop_args(files["config"], files["data"], save_dir, batch=batch, accumulation=accumulation,
                     teacher_path=servers.teacher_dir, max_length=80, max_new_tokens=24,
                     epochs=2, save_interval=2, rollout_url=url or servers.rollout.url, **flags)


@pytest.fixture(scope="module")
def reference(vllm_servers, files, tmp_path_factory):
    """The uninterrupted --max_staleness 1 run, overlapped."""
    folder = tmp_path_factory.mktemp("reference")
    train_opd(staleness_args(files, vllm_servers, folder))
    return folder


def test_overlapped_rollouts_equal_the_serial_delayed_reference(reference, vllm_servers, files, tmp_path):
    train_opd(staleness_args(files, vllm_servers, tmp_path, overlap=0))
    assert_bit_identical_runs(reference, tmp_path)
    rows = metrics(reference)
    # steps 1 and 2 sample from the initial weights, every later step from the weights one step older
    assert [m["staleness"] for m in rows] == [0, 1, 1, 1, 1, 1]
    assert all("wait_s" in m and "server_idle_s" in m for m in rows)
    # a push before every step's rollouts but the last step's (nothing after it to sample), each within fp32's 1e-4
    assert [m.get("sync_logprob_diff", -1.0) < 1e-4 for m in rows] == [True] * 6
    assert ["sync_logprob_diff" in m for m in rows] == [True] * 5 + [False]
    # and it is not the on-policy run: the delay changes the samples from step 2 on
    train_opd(staleness_args(files, vllm_servers, tmp_path / "on_policy", max_staleness=0))
    on_policy = metrics(tmp_path / "on_policy")
    assert [m["staleness"] for m in on_policy] == [0] * 6
    assert [m["loss"] for m in on_policy][1:] != [m["loss"] for m in rows][1:]


def test_staleness_is_logged_per_optimizer_step_under_accumulation(vllm_servers, files, tmp_path):
    """With 2 micro-batches a step, the lag is still the steps between the weights trained and those sampled
    from (it was summed over the window once: 2 for rollouts one step stale)."""
    train_opd(staleness_args(files, vllm_servers, tmp_path, batch=2, accumulation=2, max_steps=3))
    assert [m["staleness"] for m in metrics(tmp_path)] == [0, 1, 1]


# rollout 5: as step 5's rollouts are requested (while step 4 trains, after the checkpoint of step 2); backward 4:
# training step 4, the rollouts of step 5 in flight; export 2: writing the checkpoint of step 4
@pytest.mark.parametrize("what, at", [("rollout", 5), ("backward", 4), ("export", 2)])
def test_a_sigkill_at_any_instant_resumes_to_the_uninterrupted_run(reference, vllm_servers, files, tmp_path, what,
                                                                   at):
    args = staleness_args(files, vllm_servers, tmp_path)
    killed = subprocess.run([sys.executable, DRIVER, OPD, what, str(at), *args], env=env_one_thread(),
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = torch.load(tmp_path / "run_resume.pt", weights_only=False)
    assert saved["step"] == 2
    # the rollouts of step 3, sampled from the weights of step 2 (1-based: after step 1), kept as token ids
    assert list(saved["rollouts"]) == [2] and saved["rollouts"][2]["version"] == 1
    assert len(saved["rollouts"][2]["rows"]) == 4
    train_opd(staleness_args(files, vllm_servers, tmp_path, from_resume=1))
    assert_bit_identical_runs(reference, tmp_path)


def test_a_server_that_dies_mid_rollout_stops_the_run_with_its_last_step_saved(vllm_servers, files, tmp_path,
                                                                              capsys, monkeypatch):
    proxy = TcpProxy(vllm_servers.rollout.port)
    dies_before_call(monkeypatch, "sample_tokens", proxy, 4)  # step 4's rollouts, in flight while step 3 trains
    code, stderr = script_exit(train_opd, staleness_args(files, vllm_servers, tmp_path, url=proxy.url), capsys)
    assert_one_line_error(code, stderr, 1, "rollout server", "failed", "step 3", "--from_resume 1")
    saved = torch.load(tmp_path / "run_resume.pt", weights_only=False)
    assert saved["step"] == 3 and saved["rollouts"] == {}  # the rollouts of step 4 were never sampled
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3]
    monkeypatch.undo()
    proxy.up()
    train_opd(staleness_args(files, vllm_servers, tmp_path, url=proxy.url, from_resume=1))
    proxy.down()
    out = capsys.readouterr().out
    assert "the rollouts of step 4, from the weights of step 2, were lost" in out and "weights of step 3 instead" in out
    rows = metrics(tmp_path)
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6] and rows[3]["staleness"] == 0  # said, and sampled fresher


@pytest.mark.serial
def test_two_ranks_sample_and_train_as_one_does(reference, vllm_servers, files, tmp_path):
    """Each rank's background thread samples its own rows; rank 0 alone pushes, after every rank's rollouts of the
    older weights are done."""
    run_command(torchrun_command(OPD, staleness_args(files, vllm_servers, tmp_path, batch=2)))
    a, b = metrics(reference), metrics(tmp_path)
    assert [m["completion_len"] for m in a] == [m["completion_len"] for m in b]
    assert [m["loss"] for m in a] == pytest.approx([m["loss"] for m in b], rel=1e-5)
    assert max_weight_diff(weights(reference), weights(tmp_path)) < 1e-5
