# python -m pytest tests/test_rollout_queue.py
"""The rollout queue of OPD's --max_staleness without a server: which weights sample which step, the same rollouts
with and without the background thread, a failure raised where the loop waits, what a checkpoint keeps, and the
run's lookahead over its windows. The real-server tests are tests/test_rollout_overlap.py."""
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from common.errors import RuntimeFailure
from trainer.skeleton.run_state import RunState, merge_rollouts
from trainer.rollouts.queue import RolloutQueue
from trainer.skeleton.data_stream import DataStream
from trainer.skeleton.run import Run


def windows(steps: int, rows_per_step: int = 2) -> list[tuple[int, int, list[dict]]]:
    """(step, epoch, window) with one micro-batch of `rows_per_step` rows per step."""
    return [(s, 0, [{"rows": [{"row_index": s * rows_per_step + r} for r in range(rows_per_step)]}])
            for s in range(steps)]


class FakeServer:
    """Samples a row as (weights version, row index), slowly: the trainer runs while it works."""

    def __init__(self, fail_at: int | None = None):
        self.version, self.calls, self.fail_at, self.threads = 0, 0, fail_at, set()

    def sample(self, batch: dict, epoch: int) -> list[list[int]]:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.calls == self.fail_at:
            raise RuntimeFailure("the rollout server failed")
        time.sleep(0.01)
        return [[self.version, row["row_index"]] for row in batch["rows"]]


def drive(queue: RolloutQueue, server: FakeServer, steps: int, staleness: int, state: RunState,
          on_policy=lambda epoch, step: True, start: int = 0) -> list[tuple[int, list]]:
    """The OPD loop's use of the queue: (version, completions) per step."""
    stream, out = windows(steps), []
    for step in range(start, steps):
        state.step = step
        jobs = queue.due(step, stream[step:step + staleness + 1], on_policy)
        if jobs:
            queue.wait()
            server.version = step  # the push: the server now holds the weights of `step`
            queue.start(jobs, step)
        if on_policy(0, step):
            completions, version = queue.take(step, stream[step][2][0])
            out.append((version, completions))
    queue.wait()
    return out


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_step_s_samples_from_the_weights_of_step_s_minus_staleness(staleness):
    server = FakeServer()
    out = drive(RolloutQueue(server.sample, {}, staleness), server, 6, staleness, RunState())
    assert [version for version, _ in out] == [max(0, s - staleness) for s in range(6)]
    # every row sampled by the server from exactly those weights
    assert all(row[0] == version for version, rows in out for row in rows)
    assert [[row[1] for row in rows] for _, rows in out] == [[2 * s, 2 * s + 1] for s in range(6)]


def test_overlap_changes_when_the_work_happens_not_what_is_computed():
    results = {}
    for overlap in (True, False):
        server, state = FakeServer(), RunState()
        results[overlap] = drive(RolloutQueue(server.sample, state.rollouts, 1, overlap=overlap), server, 6, 1, state)
        assert server.threads == ({"rollouts"} if overlap else {threading.current_thread().name})
    assert results[True] == results[False]


def test_off_policy_steps_sample_nothing():
    server, state = FakeServer(), RunState()
    on_policy = lambda epoch, step: step % 2 == 0  # noqa: E731
    out = drive(RolloutQueue(server.sample, state.rollouts, 1), server, 6, 1, state, on_policy)
    assert server.calls == 3 and [version for version, _ in out] == [0, 1, 3]


def test_a_failed_rollout_is_raised_where_the_loop_waits_and_nothing_half_done_is_kept():
    server, state = FakeServer(fail_at=3), RunState()
    queue = RolloutQueue(server.sample, state.rollouts, 1)
    with pytest.raises(RuntimeFailure, match="failed"):
        drive(queue, server, 6, 1, state)
    assert 3 not in queue.kept_now()  # the step whose rollouts failed: lost, not half-kept


def test_a_resumed_queue_trains_on_the_kept_rollouts_and_resamples_only_a_lost_step(capsys):
    server, state = FakeServer(), RunState()
    reference = drive(RolloutQueue(server.sample, state.rollouts, 1), server, 6, 1, state)
    # a checkpoint after step 3 (0-based steps 0-2 done) keeps step 3's rollouts, from the weights of step 2
    kept = {3: {"version": 2, "rows": {6: [2, 6], 7: [2, 7]}}}
    server, resumed = FakeServer(), RunState(step=3, rollouts=dict(kept))
    out = drive(RolloutQueue(server.sample, resumed.rollouts, 1), server, 6, 1, resumed, start=3)
    assert out == reference[3:]
    assert server.calls == 2  # steps 4 and 5 only
    # the same checkpoint whose step-3 rollouts were lost with a failed server: sampled again, from newer weights
    server, lost = FakeServer(), RunState(step=3)
    out = drive(RolloutQueue(server.sample, lost.rollouts, 1), server, 6, 1, lost, start=3)
    assert out[0][0] == 3 and out[1:] == reference[4:]
    assert "the rollouts of step 4, from the weights of step 2, were lost" in capsys.readouterr().out


def test_a_checkpoint_keeps_the_steps_every_rank_has_and_not_those_trained_on():
    rank0 = {2: {"version": 1, "rows": {0: [5]}}, 3: {"version": 2, "rows": {1: [6]}}, 4: {"version": 3, "rows": {}}}
    rank1 = {2: {"version": 1, "rows": {2: [7]}}, 3: {"version": 2, "rows": {3: [8]}}}
    merged = merge_rollouts([rank0, rank1], from_step=3)
    assert merged == {3: {"version": 2, "rows": {1: [6], 3: [8]}}}  # step 2 trained on; step 4 lost by rank 1


def lookahead_run(steps_per_epoch: int, epochs: int, total_steps: int, state: RunState):
    """A run (its state, and its data stream's `windows_ahead` over a stand-in for the loader) of `epochs` epochs of
    `steps_per_epoch` one-window steps, `total_steps` long."""
    def stream(step, current_epoch, samples_in_epoch):
        for epoch in range(current_epoch, epochs):
            for s in range(steps_per_epoch):
                yield epoch, [f"e{epoch}w{s}"]
    data = SimpleNamespace(total_steps=total_steps, _stream=stream)
    data.windows_ahead = lambda *position: DataStream.windows_ahead(data, *position)
    return SimpleNamespace(state=state, stream=data)


@pytest.mark.parametrize("count", [0, 1, 3])
def test_windows_ahead_yields_the_same_windows_and_moves_the_data_position_only_as_they_are_yielded(count):
    # 2 epochs of 3 steps, the run stopped by --max_steps 5: nothing beyond step 5 is ever announced
    state = RunState()
    run = lookahead_run(3, 2, 5, state)
    seen = []
    for epoch, window, coming in Run.windows_ahead(run, count):
        assert state.epoch == epoch  # the epoch of the window being trained, not of the ones ahead
        seen.append(window[0])
        state.step += 1  # the run's optimizer step
        assert [s for s, _, _ in coming] == [s for s in range(len(seen), len(seen) + count) if s < 5]
        assert [w[0] for _, _, w in coming] == [f"e{s // 3}w{s % 3}" for s, _, _ in coming]
        if len(seen) == 5:
            break
    assert seen == ["e0w0", "e0w1", "e0w2", "e1w0", "e1w1"]


def test_kept_rollouts_cost_about_5_bytes_per_token_in_the_resume_file(tmp_path):
    # one step of 256 rows x 1,024 tokens of the real vocabulary's highest ids (the widest in the pickle)
    kept = {7: {"version": 6, "rows": {row: [151_668 - t for t in range(1024)] for row in range(256)}}}
    torch.save({"rollouts": kept}, tmp_path / "resume.pt")
    assert os.path.getsize(tmp_path / "resume.pt") <= 5 * 256 * 1024 + 64 * 1024  # + per-row and file overhead


@pytest.mark.parametrize("flags, names", [
    ({"max_staleness": -1}, ["--max_staleness must be >= 0"]),
    ({"max_staleness": 1}, ["--max_staleness", "add --rollout_url"]),
    ({"max_staleness": 1, "rollout_url": "http://127.0.0.1:1/v1", "sync_interval": 2},
     ["--max_staleness 1 with --sync_interval 2"]),
    ({"max_staleness": 1, "rollout_url": "http://127.0.0.1:1/v1", "loss": "sampled_kl"},
     ["--loss sampled_kl", "--max_staleness 1", "biased"]),
])
def test_staleness_flags_that_cannot_work_are_refused_in_one_line(tiny_config_path, chat_jsonl, tmp_path, capsys,
                                                                  flags, names):
    from loop_helpers import assert_one_line_error, loop_args, script_exit
    from model import Qwen3Config, create_model, save_pretrained
    from trainer.train_opd import main as train_opd
    save_pretrained(create_model(Qwen3Config.from_json(tiny_config_path)), str(tmp_path / "teacher"))
    code, stderr = script_exit(train_opd, loop_args(tiny_config_path, chat_jsonl, tmp_path / "out",
                                                    teacher_path=tmp_path / "teacher", **flags), capsys)
    assert_one_line_error(code, stderr, 2, *names)
    assert not os.path.exists(tmp_path / "out")


def test_a_steps_kept_rollouts_take_about_13_bytes_per_token_in_the_resume_file():
    """docs/serving.md's figure: the kept rollouts of one step of 256 rows x 1,024 tokens -- token ids and the
    server's log-probabilities, as the queue keeps them -- serialised as the resume file holds them: 3.4 MB."""
    import io
    import random
    rng = random.Random(0)
    rows = {row: ([rng.randrange(151_669) for _ in range(1024)], [-5 * rng.random() for _ in range(1024)])
            for row in range(256)}
    buffer = io.BytesIO()
    torch.save({2: {"version": 1, "rows": rows}}, buffer)
    per_token = len(buffer.getvalue()) / (256 * 1024)
    assert 12 < per_token < 14, per_token
