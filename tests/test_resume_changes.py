# python -m pytest tests/test_resume_changes.py
"""A resume that would change what the run computes is refused unless asked for; a finished run resumed as it was
says so and exits 0; each rank saves and restores only its own CUDA device's RNG state."""
import random

import numpy as np
import pytest
import torch

import trainer.skeleton.checkpoint as checkpoint
from common.errors import run_script
from loop_helpers import loop_args, metrics
from trainer.skeleton.distributed import DistInfo
from trainer.train_sft import main as train_sft
from trainer.skeleton.optimizer_step import get_lr


def sft_args(config, data, save_dir, **flags) -> list[str]:
    return loop_args(config, data, save_dir, **{"batch": 4, "learning_rate": 1e-3, **flags})


def exit_code(argv: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as stopped:
        run_script(lambda: train_sft(argv))
    out, err = capsys.readouterr()
    return stopped.value.code, out, err


def test_a_changed_max_steps_is_refused_naming_the_flag_and_how_to_accept_it(tiny_config_path, chat_jsonl,
                                                                             tmp_path, capsys, one_thread):
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=2))
    before = (tmp_path / "run_resume.pt").read_bytes()
    capsys.readouterr()
    code, _, err = exit_code(sft_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=4, from_resume=1), capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "--max_steps 2 -> 4" in lines[0] and "--resume_changes max_steps" in lines[0]
    assert (tmp_path / "run_resume.pt").read_bytes() == before


def test_an_accepted_max_steps_trains_on_with_the_schedule_over_the_new_length(tiny_config_path, chat_jsonl,
                                                                               tmp_path, capsys, one_thread):
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=2))
    capsys.readouterr()
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=4, from_resume=1,
                       resume_changes="max_steps"))
    assert "resuming with changed settings" in capsys.readouterr().out
    logged = metrics(tmp_path)
    assert [m["step"] for m in logged] == [1, 2, 3, 4]
    assert logged[2]["lr"] == pytest.approx(get_lr(2, 4, 1e-3))  # step 3 of a 4-step cosine, not of a 2-step one


def test_a_finished_run_resumed_without_change_says_already_finished(tiny_config_path, chat_jsonl, tmp_path,
                                                                     capsys, one_thread):
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=2))
    before = metrics(tmp_path)
    capsys.readouterr()
    code, out, _ = exit_code(sft_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=2, from_resume=1), capsys)
    assert code in (0, None) and "already finished" in out and "--resume_changes max_steps" in out
    assert metrics(tmp_path) == before


def test_resume_changes_must_name_flags_of_the_script(tiny_config_path, chat_jsonl, tmp_path, capsys):
    code, _, err = exit_code(sft_args(tiny_config_path, chat_jsonl, tmp_path, resume_changes="max_stepz"), capsys)
    assert code == 2 and "max_stepz" in err and len(err.strip().splitlines()) == 1


def test_each_rank_saves_and_restores_only_its_own_cuda_device(monkeypatch):
    """A CPU proxy of CUDA's RNG API: the rank on cuda:1 of a node reads and writes device 1's state only, so a
    resume on a node with fewer visible GPUs cannot index a device that is not there."""
    touched = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": touched.append(("get", device)) or
                        torch.tensor([1], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": touched.append(("set", device)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("read every device's state"))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("wrote every device's state"))
    info = DistInfo(rank=0, local_rank=1, world_size=1, device="cuda:1")
    states = checkpoint.collect_rng_states(info)
    expected = (random.random(), np.random.rand(), torch.rand(1))
    checkpoint.restore_rng_states(states, 1, info, seed=0, step=0)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected  # the CPU generators round-trip too
    assert touched == [("get", "cuda:1"), ("set", "cuda:1")]


def test_a_resumed_runs_lines_count_epochs_from_one_and_the_whole_runs_time(tiny_config_path, chat_jsonl, tmp_path,
                                                                           capsys, one_thread):
    """The lines a person reads after a resume: --max_steps 0 reads as "no limit", the done line's time is the
    whole run's (the resumed process's part said beside it), and a finished run is not "epoch 2 of 1"."""
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=2))  # 20 rows / batch 4: 5 steps an epoch
    first = torch.load(tmp_path / "run_resume.pt", weights_only=False)["elapsed_s"]
    assert first > 0
    capsys.readouterr()
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=0, from_resume=1,
                       resume_changes="max_steps"))
    out = capsys.readouterr().out
    assert "--max_steps 2 -> 0 (no limit)" in out and "epoch 1 of 1, 8 samples into it" in out, out
    done = next(line for line in out.splitlines() if line.startswith("done: 5 steps in"))
    assert "in this process, from step 2" in done, done
    assert torch.load(tmp_path / "run_resume.pt", weights_only=False)["elapsed_s"] > first
    assert [m["epoch"] for m in metrics(tmp_path)] == [1] * 5  # counted from 1, as everywhere a person reads them
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=0, from_resume=1))
    out = capsys.readouterr().out
    assert "step 5, all 1 epoch(s) done" in out and "epoch 2 of 1" not in out, out
