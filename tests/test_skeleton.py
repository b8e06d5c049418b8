# python -m pytest tests/test_skeleton.py
"""The skeleton's own contracts, apart from the loops' equivalences (test_loop_invariants.py): the last step is
logged, each rank builds its model on its own device, the window's metrics reduce as their kind says, and the
optimizer's step is AdamW's closed form."""
import argparse
import os
import subprocess
import sys

import pytest
import torch

from support import ROOT
from loop_helpers import env_one_thread, loop_args, metrics
from trainer.skeleton.distributed import DistInfo
from trainer.train_sft import main as train_sft
from trainer.skeleton.console import PhaseClock
from trainer.skeleton.optimizer_step import make_optimizer
from trainer.skeleton.window_metrics import WindowMetrics


def test_the_last_step_of_a_max_steps_run_is_logged(tiny_config_path, chat_jsonl, tmp_path, capsys):
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, batch=2, max_steps=3, log_interval=2))
    assert [m["step"] for m in metrics(tmp_path)] == [1, 2, 3]
    assert "step 3/3 100%" in capsys.readouterr().out


@pytest.mark.serial
@pytest.mark.slow
def test_each_rank_builds_its_model_on_its_own_device(tiny_config_path):
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
               os.path.join(ROOT, "tests", "device_probe.py"), tiny_config_path, device]
    result = subprocess.run(command, env=env_one_thread(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(line for line in result.stdout.splitlines() if line.startswith("rank "))
    expected = [f"cuda:{rank}" if device == "cuda" else "cpu" for rank in (0, 1)]
    assert lines == [f"rank {r} local_rank {r} device {d} weights {d}" for r, d in zip((0, 1), expected)]


def test_window_metrics_reduce_by_kind():
    window = WindowMetrics("cpu")
    for loss, tokens, ended, rows, seconds in ((6.0, 3, 1, 2, 0.5), (4.0, 2, 2, 2, 1.5)):  # two micro-batches
        window.token_mean("loss", torch.tensor(loss))
        window.total("tokens", tokens)
        window.ratio("eos_share", ended, rows)
        window.rank_mean("gen_s", seconds)
        window.maximum("gap_max", seconds / 3)
    values, extra = window.reduce(DistInfo(), extra=3.0)
    assert values == {"loss": 2.0, "tokens": 5.0, "eos_share": 0.75, "gen_s": 2.0, "gap_max": 0.5} and extra == 3.0
    assert window.sums == {} and window.kinds == {}  # the next window starts empty
    window.total("tokens", 1)
    with pytest.raises(ValueError, match="tokens"):
        window.ratio("tokens", 1, 2)


def _reduce_on_two_ranks(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    window = WindowMetrics("cpu")
    window.total("tokens", 1 + rank)
    window.maximum("gap_max", [0.9, 0.2][rank])
    window.maximum("gap_max", [0.1, 0.4][rank])  # a second micro-batch: the largest of the rank's stays
    values, _ = window.reduce(DistInfo(rank=rank, local_rank=rank, world_size=2))
    torch.save(values, f"{out}.{rank}")
    dist.destroy_process_group()


def test_window_maxima_are_the_largest_over_micro_batches_and_ranks(tmp_path):
    """A maximum (the rollout correction's sampler gap) is reduced by MAX over ranks, beside the sums' all-reduce:
    every rank logs the largest of all."""
    import torch.multiprocessing as mp
    mp.spawn(_reduce_on_two_ranks, args=(str(tmp_path / "init"), str(tmp_path / "values")), nprocs=2)
    for rank in (0, 1):
        assert torch.load(tmp_path / f"values.{rank}") == {"tokens": 3.0, "gap_max": pytest.approx(0.9)}


def test_a_components_numbers_merged_into_the_window_reduce_as_if_added_there():
    """The rollouts keep their numbers in a window of their own, which the loop adds to the run's at the step: the
    same values as adding each number to the run's window directly, and the component's window starts empty."""
    direct, run_window, component = WindowMetrics("cpu"), WindowMetrics("cpu"), WindowMetrics("cpu")
    for window in (direct, run_window):
        window.token_mean("loss", torch.tensor(6.0))
        window.total("tokens", 3)
    for window in (direct, component):
        window.ratio("staleness", 1, 1)
        window.ratio("staleness", 0, 1)
        window.total("sync_logprob_diff", 0.25)
        window.ratio("teacher/a/loss", 0, 0, when_empty=False)
    run_window.merge(component)
    assert run_window.reduce(DistInfo()) == direct.reduce(DistInfo())
    assert component.sums == {} and component.kinds == {} and not component.undefined_when_empty
    run_window.total("staleness", 1)
    component.ratio("staleness", 1, 1)
    with pytest.raises(ValueError, match="staleness"):  # a name keeps its kind across the merge
        run_window.merge(component)


def test_phase_clock_adds_seconds_and_shares():
    clock = PhaseClock("cpu")
    clock.seconds = {"gen": 3.0, "train": 1.0}
    window = WindowMetrics("cpu")
    window.total("tokens", 1)
    clock.add_to(window)
    values, _ = window.reduce(DistInfo())
    assert values["gen_s"] == 3.0 and values["gen_share"] == 0.75 and values["train_share"] == 0.25


@pytest.mark.slow
def test_console_lines_of_all_three_loops_fit_120_characters(tiny_config_path, chat_jsonl, tmp_path, capsys):
    from model import Qwen3Config, create_model, save_pretrained
    from trainer.train_distillation import main as train_distillation
    from trainer.train_opd import main as train_opd
    save_pretrained(create_model(Qwen3Config.from_json(tiny_config_path), seed=1), str(tmp_path / "teacher"))
    teacher = {"teacher_path": str(tmp_path / "teacher")}
    common = dict(batch=4, max_steps=2, eval_interval=1, eval_rows=4, eval_max_new_tokens=4)
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path / "sft", **common))
    train_distillation(loop_args(tiny_config_path, chat_jsonl, tmp_path / "kd", **common, **teacher))
    train_opd(loop_args(tiny_config_path, chat_jsonl, tmp_path / "opd", **common, **teacher, max_new_tokens=8))
    lines = capsys.readouterr().out.splitlines()
    assert sum(line.startswith("step ") for line in lines) == 6 and sum("eval at step" in line for line in lines) == 9
    assert any(" | ce " in line for line in lines) and any(" | gen " in line for line in lines)
    too_long = [line for line in lines if len(line) > 120 and not line.startswith(("checking ", "loading ", "random "))]
    assert not too_long, too_long


@pytest.mark.parametrize("tty, ci, shown", [(True, "", True), (True, "true", False), (False, "", False)])
def test_a_progress_bar_only_on_a_terminal_outside_ci(monkeypatch, tty, ci, shown):
    from trainer.skeleton.console import Progress
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    monkeypatch.setenv("CI", ci)
    progress = Progress(10, 0, enabled=True)
    assert (progress.bar is not None) == shown
    progress.close()


def test_lines_printed_while_the_bar_is_up_go_above_it(monkeypatch, capsys):
    """print0 (a server's start-up line, a weight push, a skipped fp16 step) writes through the bar while one is
    up, not into its line; once it is closed, plainly."""
    from trainer.skeleton.console import Progress
    from trainer.skeleton.distributed import print0
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    monkeypatch.setenv("CI", "")
    progress, written = Progress(10, 0, enabled=True), []
    monkeypatch.setattr(progress.bar, "write", lambda line: written.append(line))
    print0("weights of step", 3, "pushed")
    progress.close()
    print0("done")
    assert written == ["weights of step 3 pushed"] and capsys.readouterr().out == "done\n"


def test_kds_line_keeps_ce_and_kd_at_full_width_numbers():
    from trainer.skeleton.console import console_line
    metrics = {"step": 100, "epoch": 1, "loss": 11.2345, "lr": 2.0e-3, "grad_norm": 12.34, "tokens_per_s": 12345.0,
               "step_ms": 12345.0, "ce": 11.8512, "kd": 10.6021}
    line = console_line(metrics, epochs=1, total_steps=100, eta="10:03:24", show=("ce", "kd"))
    assert len(line) <= 120 and line.endswith("| ce 11.85 kd 10.6"), line


def test_every_step_reaches_the_tracker_and_metrics_and_the_bar_shows_the_lines_eta(tiny_config_path, chat_jsonl,
                                                                                  tmp_path, monkeypatch, one_thread):
    import trainer.skeleton.console as console
    import trainer.skeleton.run_log as run_log
    etas = []
    monkeypatch.setattr(console.Progress, "update", lambda self, step, metrics, eta: etas.append(eta))
    logged = []
    real_init_tracker = run_log.init_tracker

    def recording_tracker(*args, **kwargs):
        tracker = real_init_tracker(*args, **kwargs)
        log = tracker.log
        tracker.log = lambda values, step: (logged.append(step), log(values, step=step))
        return tracker
    monkeypatch.setattr(run_log, "init_tracker", recording_tracker)
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=4, log_interval=10))
    assert logged == [1, 2, 3, 4] and [m["step"] for m in metrics(tmp_path)] == [1, 2, 3, 4]
    assert len(etas) == 4 and etas[0] == "?"  # one ETA: the bar gets the log line's


def test_the_optimizer_is_fused_adamw_and_its_steps_are_the_closed_form():
    """Loshchilov & Hutter's AdamW, bias-corrected, decoupled weight decay, betas (0.9, 0.95), eps 1e-8: two steps
    of the loops' optimizer against the formula in float64."""
    torch.manual_seed(0)
    model = torch.nn.Linear(7, 5)
    optimizer = make_optimizer(model, argparse.Namespace(learning_rate=1e-2, weight_decay=0.1))
    assert optimizer.defaults["fused"] is True
    lr, wd, (b1, b2), eps = 1e-2, 0.1, (0.9, 0.95), 1e-8
    expected = {name: p.detach().double().clone() for name, p in model.named_parameters()}
    moments = {name: (torch.zeros_like(p), torch.zeros_like(p)) for name, p in expected.items()}
    for step in (1, 2):
        grads = {name: torch.randn(p.shape) for name, p in model.named_parameters()}
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
            g = grads[name].double()
            m, v = moments[name]
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            update = (m / (1 - b1 ** step)) / ((v / (1 - b2 ** step)).sqrt() + eps)
            expected[name] = expected[name] * (1 - lr * wd) - lr * update
        optimizer.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach().double(), expected[name], rtol=1e-6, atol=1e-7)
