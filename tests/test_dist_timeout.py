# python -m pytest tests/test_dist_timeout.py
"""--dist_timeout: the process group's timeout (NCCL's watchdog, gloo's timeout), and no rank waiting longer than it
on a legitimate rank-0-only phase. The held-out evaluation is split over the ranks (their sums all-reduced: the
numbers of one process), a server request that could outlast the timeout and a checkpoint that rank 0 could not
write within it are refused at start-up with one line."""
import argparse
import contextlib
import math
import os
import subprocess
import time

import pytest
import torch.distributed as dist

from common.errors import UserError, run_script
from loop_helpers import (assert_one_line_error, env_one_thread, loop_args, metrics, run_command, script_exit,
                          torchrun_command)
from model import Qwen3Config, create_model, load_tokenizer, save_pretrained
from support import ROOT, write_chat_jsonl
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.rollouts.servers import server_wait_seconds
from trainer.skeleton.distributed import DistInfo, check_save_time, leave_process_group
from trainer.skeleton.loading import build_model
from trainer.train_distillation import main as train_distillation
from trainer.train_opd import main as train_opd
from trainer.config.sft import parse_args as sft_args

pytestmark = pytest.mark.usefixtures("one_thread")
SFT = os.path.join(ROOT, "trainer", "train_sft.py")
KD = os.path.join(ROOT, "trainer", "train_distillation.py")
EVAL_METRICS = ("eval/accuracy", "eval/completion_len", "eval/eos_share", "eval/reverse_kl")


def run_two_ranks(tmp_path, body: str) -> subprocess.CompletedProcess:
    """`body` as a script under torchrun with two gloo ranks (sys, time, types and torch.distributed as dist
    imported, the repository on the path)."""
    script = tmp_path / "ranks.py"
    script.write_text(f"import sys, time, types\nsys.path.insert(0, {ROOT!r})\nimport torch.distributed as dist\n"
                      + body)
    return subprocess.run(torchrun_command(str(script), []), env=env_one_thread(), capture_output=True, text=True,
                          timeout=120)


def step_zero_eval(save_dir) -> dict:
    record = next(m for m in metrics(save_dir) if m["step"] == 0)
    return {k: v for k, v in record.items() if k.startswith("eval/")}


@pytest.mark.serial
@pytest.mark.slow
def test_a_timeout_shorter_than_rank_0_alone_fails_the_run(tmp_path):
    """The timeout reaches gloo: a rank waiting longer than --dist_timeout in a collective while rank 0 works alone
    (what the held-out evaluation did) fails the run -- the failure the split evaluation avoids."""
    result = run_two_ranks(tmp_path, "from trainer.skeleton.distributed import init_distributed_mode\n"
                                     "info = init_distributed_mode('cpu', 2.0)\n"
                                     "if info.is_main:\n"
                                     "    time.sleep(8)\n"
                                     "dist.barrier()\n")
    assert result.returncode != 0
    assert "Timed out waiting 2000ms" in result.stderr, result.stderr[-3000:]  # the 2 s reached gloo


@pytest.mark.serial
@pytest.mark.slow
def test_two_ranks_evaluate_more_work_than_their_10_s_timeout(tiny_config_path, chat_jsonl, tmp_path):
    """Held-out prompts x 320 greedy tokens, as many as make about 20 s for one process on this machine (timed on
    one batch first: a fixed count was 60 s on one machine and 15 s on another), more than --dist_timeout 10, so
    rank 0 evaluating alone would fail the run (the test above). Split over 2 ranks, the run exits 0 and logs the
    numbers of one process: a rank waits only for the other's share to end, not for the whole evaluation."""
    def setup(rows: int):
        eval_data = write_chat_jsonl(tmp_path / f"eval{rows}.jsonl", rows, seed=3)
        argv = loop_args(tiny_config_path, chat_jsonl, tmp_path / "two", batch=4, max_steps=1, eval_interval=1,
                         eval_data_path=eval_data, eval_rows=rows, eval_max_new_tokens=320, dist_timeout=10)
        return argv, HeldoutEvaluator(sft_args(argv), load_tokenizer(None), DistInfo(), 0)

    def evaluated(evaluator, model) -> tuple[dict, float]:
        start = time.perf_counter()
        return evaluator.evaluate(0, model, contextlib.nullcontext), time.perf_counter() - start
    argv, evaluator = setup(4)
    model = build_model(sft_args(argv), "cpu", config_path=sft_args(argv).model_config)  # the script's, at step 0
    _, batch_seconds = evaluated(evaluator, model)
    argv, evaluator = setup(4 * min(40, max(4, math.ceil(20 / batch_seconds))))
    one, alone = evaluated(evaluator, model)
    assert alone > 10, f"one process evaluated in {alone:.0f} s: too little work to show the timeout"
    started = time.perf_counter()
    run_command(torchrun_command(SFT, argv))
    print(f"one process evaluates in {alone:.0f} s; the 2-rank run with two evaluations took "
          f"{time.perf_counter() - started:.0f} s")
    two = step_zero_eval(tmp_path / "two")
    assert two.keys() == one.keys() and all(abs(two[k] - one[k]) <= 1e-6 for k in one), (one, two)
    assert two["eval/completion_len"] == 320  # every prompt was decoded to the budget: the work was done


@pytest.mark.serial
@pytest.mark.slow
def test_two_ranks_gather_the_evaluation_of_one_process(tiny_config_path, chat_jsonl, tmp_path):
    """10 prompts in batches of 4: rank 0 evaluates 2 batches, rank 1 one (shares need not be equal); the token-
    weighted reverse KL and the per-row numbers equal one process's."""
    teacher_dir = str(tmp_path / "teacher")
    save_pretrained(create_model(Qwen3Config.from_json(tiny_config_path), seed=123), teacher_dir)
    flags = dict(teacher_path=teacher_dir, max_steps=1, eval_interval=1, eval_rows=10, eval_max_new_tokens=12,
                 eval_data_path=write_chat_jsonl(tmp_path / "eval.jsonl", 10, seed=5))
    train_distillation(loop_args(tiny_config_path, chat_jsonl, tmp_path / "one", batch=4, accumulation=2, **flags))
    run_command(torchrun_command(KD, loop_args(tiny_config_path, chat_jsonl, tmp_path / "two", batch=4, **flags)))
    one, two = step_zero_eval(tmp_path / "one"), step_zero_eval(tmp_path / "two")
    assert sorted(one) == sorted(EVAL_METRICS) and two.keys() == one.keys()
    assert all(abs(two[k] - one[k]) <= 1e-6 for k in one), (one, two)
    assert one["eval/reverse_kl"] > 0


@pytest.mark.parametrize("fsdp", [0, 1])
def test_each_rank_takes_every_other_batch_of_one_process(fsdp, tiny_config_path, tmp_path):
    data = write_chat_jsonl(tmp_path / "eval.jsonl", 10)
    args = sft_args(loop_args(tiny_config_path, data, tmp_path, batch=4, eval_interval=1, eval_data_path=data,
                              eval_rows=10, fsdp=fsdp))
    shares = [[[row["row_index"] for row in batch["rows"]]
               for batch in HeldoutEvaluator(args, load_tokenizer(None), DistInfo(rank, rank, 2), 0).batches]
              for rank in (0, 1)]
    everything = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # a sharded model needs every rank in every forward: all ranks evaluate everything, in step
    assert shares == ([everything, everything] if fsdp else [[everything[0], everything[2]], [everything[1]]])


@pytest.mark.serial
@pytest.mark.slow
def test_a_rank_whose_share_fails_fails_every_rank_after_the_all_reduce(tmp_path):
    """A teacher server failing on rank 1 only: rank 1 still joins the evaluation's all-reduce, then both ranks
    raise RuntimeFailure (into the loop's fail_together) instead of rank 0 waiting or mixing up collectives."""
    result = run_two_ranks(tmp_path, "from common.errors import RuntimeFailure\n"
                                     "from trainer.evaluation.heldout import HeldoutEvaluator\n"
                                     "from trainer.skeleton.distributed import init_distributed_mode\n"
                                     "info = init_distributed_mode('cpu', 60.0)\n"
                                     "evaluator = HeldoutEvaluator(types.SimpleNamespace(eval_interval=0, fsdp=0, decode='eager'), "
                                     "None, info, 0)\n"
                                     "def work():\n"
                                     "    if info.rank == 1:\n"
                                     "        raise RuntimeFailure('teacher server: no answer')\n"
                                     "    return dict(correct=0, rows=4, generated=8, ended=0)\n"
                                     "try:\n"
                                     "    evaluator.all_ranks_sums(work)\n"
                                     "except RuntimeFailure as error:\n"
                                     "    print(f'rank {info.rank}: {error}', flush=True)\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 1: teacher server: no answer" in result.stdout, result.stdout
    assert "rank 0: the held-out evaluation failed on another rank" in result.stdout, result.stdout


@pytest.mark.serial
@pytest.mark.slow
def test_a_rank_that_exits_on_an_error_gives_back_its_process_group(tmp_path):
    """A run failing after its collectives (fail_together raising) exits through run_script without the loop's
    close(); the exit handler init_distributed_mode registers gives the group back, or gloo's teardown may abort
    the process (exit -6 instead of the run's code: 5 of 20 runs of the test above, before)."""
    result = run_two_ranks(tmp_path, "import atexit, torch\n"
                                     "from trainer.skeleton.distributed import init_distributed_mode\n"
                                     "init_distributed_mode('cpu', 60.0)\n"
                                     "dist.all_reduce(torch.ones(1))\n"
                                     "atexit._run_exitfuncs()\n"
                                     "print(f'group held after the exit handlers: {dist.is_initialized()}', flush=True)\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("group held after the exit handlers: False") == 2, result.stdout


def test_the_exit_handler_leaves_a_group_that_is_not_gloo_to_pytorch():
    """The NCCL side of leave_process_group, on a CPU: a group of another backend (PyTorch's "fake" one, standing in
    for NCCL, whose destroy can wait for peers that never come) is left as it is; a gloo one is given back."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    held = {}
    for backend, store, world_size in (("fake", FakeStore(), 2), ("gloo", dist.HashStore(), 1)):
        dist.init_process_group(backend, store=store, rank=0, world_size=world_size)
        try:
            leave_process_group()
            held[backend] = dist.is_initialized()
        finally:  # nothing left for the next test in this process
            if dist.is_initialized():
                dist.destroy_process_group()
    assert held == {"fake": True, "gloo": False}


def test_a_server_wait_longer_than_the_timeout_is_refused(tiny_config_path, chat_jsonl, tmp_path, capsys,
                                                         monkeypatch):
    """The teacher on a server, default --rollout_timeout 600: 4 attempts of up to 610 s (with the connect), up to
    300 s apart (Retry-After) = 3340 s, refused under --dist_timeout 1800 before anything connects."""
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: parse_args refuses before any process group exists
    argv = loop_args(tiny_config_path, chat_jsonl, tmp_path, teacher_url="http://127.0.0.1:9/v1", loss="sampled_kl",
                     dist_timeout=1800)
    code, stderr = script_exit(train_opd, argv, capsys)
    assert_one_line_error(code, stderr, 2, "--rollout_timeout 600", "--dist_timeout 1800", "3340 s")
    monkeypatch.setenv("WORLD_SIZE", "1")  # one process: no collective to outlast
    with pytest.raises(SystemExit):  # gets past the flags, to the unreachable server
        run_script(lambda: train_opd(argv))
    assert "cannot be reached" in capsys.readouterr().err


def test_the_default_timeout_covers_the_default_server_wait_and_an_8b_checkpoint(tmp_path):
    args = sft_args(["--save_dir", str(tmp_path)])  # the defaults, away from a demo run's checkpoints/
    opd_defaults = argparse.Namespace(rollout_timeout=600.0, batch_size=args.batch_size, rollout_concurrency=64)
    assert server_wait_seconds(opd_defaults) == 3340 <= args.dist_timeout
    check_save_time(16 * 8_200_000_000, args.dist_timeout)  # Qwen3-8B: fp32 weights, AdamW moments, the export


def test_a_checkpoint_rank_0_cannot_write_within_the_timeout_is_refused():
    with pytest.raises(UserError, match=r"--dist_timeout 600: rank 0 writes 131.2 GB .* raise --dist_timeout to 1312"):
        check_save_time(16 * 8_200_000_000, 600)


def test_a_timeout_that_is_not_positive_is_refused(tiny_config_path, chat_jsonl, tmp_path):
    with pytest.raises(UserError, match="--dist_timeout must be > 0"):
        sft_args(loop_args(tiny_config_path, chat_jsonl, tmp_path, dist_timeout=0))
