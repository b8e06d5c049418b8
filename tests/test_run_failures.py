# python -m pytest tests/test_run_failures.py
"""Nothing lost, nothing silent, in the training skeleton: kills during checkpoint writes, SIGTERM / SIGUSR1 / Ctrl-C,
a full disk, a read-only --save_dir, a second run with the same name, a run started over a run by accident, and every
user error a single line with exit code 2 and no traceback."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from common.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, Stopped, UserError, run_script
from support import ROOT, write_chat_jsonl
from loop_helpers import (assert_one_line_error, env_one_thread, loop_args, metrics, script_exit, torchrun_command,
                          without_timing)
from trainer.train_opd import main as train_opd
from trainer.train_sft import main as train_sft

# in-process runs use one thread, as the subprocesses do (OMP_NUM_THREADS=1), so that they can be compared bit for bit
pytestmark = pytest.mark.usefixtures("one_thread")

SFT = os.path.join(ROOT, "trainer", "train_sft.py")
DRIVER = os.path.join(ROOT, "tests", "kill_driver.py")


def sft_args(config, data, save_dir, **flags) -> list[str]:
    return loop_args(config, data, save_dir, **{"batch": 4, "save_interval": 2, **flags})


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env_one_thread(), capture_output=True, text=True, timeout=400, **kwargs)


def listing(folder) -> list[str]:
    return sorted(os.listdir(folder))


def resume_state(path) -> dict:
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    return {k: checkpoint[k] for k in ("model", "optimizer", "epoch", "step", "samples_in_epoch", "rng")}


def assert_same_run(reference, other) -> None:
    """Same HF folder bytes, same resume state, same metrics (timings aside), nothing else in the folder."""
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        assert (reference / "run" / name).read_bytes() == (other / "run" / name).read_bytes(), name
    a, b = resume_state(reference / "run_resume.pt"), resume_state(other / "run_resume.pt")
    assert a["step"] == b["step"] and a["epoch"] == b["epoch"] and a["samples_in_epoch"] == b["samples_in_epoch"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    for k, state in a["optimizer"]["state"].items():
        assert all(torch.equal(v, b["optimizer"]["state"][k][n]) for n, v in state.items())
    assert without_timing(metrics(reference)) == without_timing(metrics(other))
    assert listing(reference) == listing(other), "temporaries or a lock left behind"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_chat_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", 20)


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    from support import TINY_CONFIG
    path = tmp_path_factory.mktemp("config") / "tiny.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return str(path)


@pytest.fixture(scope="module")
def reference(config, data, tmp_path_factory):
    """An uninterrupted run: 20 rows / batch 4 = 5 steps, saves after steps 2, 4 and 5."""
    save_dir = tmp_path_factory.mktemp("reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocesses run (OMP_NUM_THREADS=1): the same sums, bit for bit
    try:
        train_sft(sft_args(config, data, save_dir))
    finally:
        torch.set_num_threads(threads)
    return save_dir


@pytest.mark.slow
@pytest.mark.parametrize("what, at", [("export", 3), ("resume", 2)])
def test_kill_during_a_checkpoint_write_then_resume_completes_exactly(config, data, reference, tmp_path, capsys,
                                                                     what, at):
    # export 3: the final export (step 5), after the resume file of step 4; resume 2: the resume file of step 4
    killed = run([sys.executable, DRIVER, SFT, what, str(at), *sft_args(config, data, tmp_path)])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert any(".tmp-" in name for name in listing(tmp_path)), "the kill left no half-written temporary"
    train_sft(sft_args(config, data, tmp_path, from_resume=1))
    out = capsys.readouterr().out
    assert "removed" in out and "taking over" in out
    assert_same_run(reference, tmp_path)


def start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(command, env=env_one_thread(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait_for(path, process: subprocess.Popen) -> None:
    deadline = time.time() + 300
    while not os.path.exists(path):
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.01)


@pytest.mark.slow
def test_sigterm_saves_the_current_step_exits_75_and_the_resumed_run_is_bit_identical(config, data, reference,
                                                                                      tmp_path):
    process = start([sys.executable, SFT, *sft_args(config, data, tmp_path, save_interval=100, log_interval=100)])
    wait_for(tmp_path / "run_metrics.jsonl", process)  # training has begun
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == EXIT_PREEMPTED, stderr[-3000:]
    assert "Traceback" not in stderr
    step = torch.load(tmp_path / "run_resume.pt", weights_only=False)["step"]
    assert 1 <= step < 5, "the run finished before the signal could stop it"
    assert f"stopped by SIGTERM after step {step}" in stderr and "--from_resume 1" in stderr
    # the notice names no step it could get wrong (one that comes after the step's stop flags were reduced is
    # acted on a step later): the stop line names the step saved
    assert "SIGTERM: finishing the step in progress, then saving and stopping" in stdout
    # the step the signal ends on is logged, in metrics.jsonl and on the console, off --log_interval's beat
    assert [m["step"] for m in metrics(tmp_path)][-1] == step and f"step {step}/" in stdout
    train_sft(sft_args(config, data, tmp_path, save_interval=100, from_resume=1))
    assert (reference / "run" / "model.safetensors").read_bytes() == (tmp_path / "run" / "model.safetensors").read_bytes()


def signal_when_training_has_begun(metrics_path, signum: int) -> threading.Thread:
    """Send `signum` to this process once the run has logged its first step (the handler runs in the main thread)."""
    def wait_and_signal():
        deadline = time.time() + 120
        while not os.path.exists(metrics_path) or not open(metrics_path).read().strip():
            assert time.time() < deadline
            time.sleep(0.01)
        os.kill(os.getpid(), signum)
    thread = threading.Thread(target=wait_and_signal, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGUSR1, EXIT_PREEMPTED), (signal.SIGINT, EXIT_INTERRUPTED)])
def test_sigusr1_and_ctrl_c_save_the_current_step_and_the_resumed_run_is_bit_identical(config, data, reference,
                                                                                      tmp_path, signum, code):
    thread = signal_when_training_has_begun(tmp_path / "run_metrics.jsonl", signum)
    with pytest.raises(Stopped) as stopped:
        train_sft(sft_args(config, data, tmp_path, save_interval=100))
    thread.join()
    step = torch.load(tmp_path / "run_resume.pt", weights_only=False)["step"]
    assert 1 <= step < 5, "the run finished before the signal could stop it"
    assert stopped.value.exit_code == code
    assert f"stopped by {signal.Signals(signum).name} after step {step}" in str(stopped.value)
    train_sft(sft_args(config, data, tmp_path, save_interval=100, from_resume=1))
    assert (reference / "run" / "model.safetensors").read_bytes() == (tmp_path / "run" / "model.safetensors").read_bytes()


def test_a_notice_during_start_up_is_held_until_the_first_step_is_saved(config, data, tmp_path, monkeypatch):
    """SIGTERM while the model is being built (before the loop's handler exists) neither kills the process nor is
    lost: the run trains its first step, saves it and stops with 75; afterwards SIGTERM's handler is the one the
    process had before."""
    import trainer.train_sft as sft_script
    before = signal.getsignal(signal.SIGTERM)
    damaged = tmp_path / "damaged.jsonl"  # first a run refused after its start (a bad row), before any handler
    damaged.write_text("{not json\n")
    with pytest.raises(UserError):
        train_sft(sft_args(config, str(damaged), tmp_path / "refused"))
    assert signal.getsignal(signal.SIGTERM) is before  # a refused run gives the process its handler back

    def build_student_under_a_notice(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return build_student(*args, **kwargs)
    build_student = sft_script.build_student
    monkeypatch.setattr(sft_script, "build_student", build_student_under_a_notice)
    with pytest.raises(Stopped) as stopped:
        train_sft(sft_args(config, data, tmp_path, save_interval=100))
    assert stopped.value.exit_code == EXIT_PREEMPTED and "stopped by SIGTERM after step 1" in str(stopped.value)
    assert torch.load(tmp_path / "run_resume.pt", weights_only=False)["step"] == 1
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.serial
@pytest.mark.slow
def test_sigterm_stops_a_two_process_run_on_the_same_step_and_it_resumes_bit_identically(config, data, tmp_path):
    args = lambda save_dir, **flags: sft_args(config, data, save_dir, batch=2, save_interval=100, **flags)
    full = run(torchrun_command(SFT, args(tmp_path / "full")))
    assert full.returncode == 0, full.stderr[-3000:]
    process = start(torchrun_command(SFT, args(tmp_path / "stopped")))
    wait_for(tmp_path / "stopped" / "run_metrics.jsonl", process)
    process.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers (each in a session of its own)
    _, stderr = process.communicate(timeout=300)
    assert stderr.count("stopped by SIGTERM") == 1, stderr[-3000:]  # rank 0 says it once; no worker traceback
    assert "trainer/" not in stderr, stderr[-3000:]
    # every worker exits 75; torchrun itself then reports the signal it got in its own way: a traceback and exit 1,
    # or (seen once in a whole-suite run) that traceback and an abort, its interpreter's exit racing a thread of its
    # own ("terminate called without an active exception")
    assert process.returncode in (1, -signal.SIGABRT) and "SignalException" in stderr, stderr[-3000:]
    assert torch.load(tmp_path / "stopped" / "run_resume.pt", weights_only=False)["step"] < 5
    resumed = run(torchrun_command(SFT, args(tmp_path / "stopped", from_resume=1)))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    full_w, resumed_w = load_file(tmp_path / "full" / "run" / "model.safetensors"), \
        load_file(tmp_path / "stopped" / "run" / "model.safetensors")
    assert all(torch.equal(full_w[k], resumed_w[k]) for k in full_w)


@pytest.fixture
def small_disk(tmp_path):
    """A 320 MiB file system of its own (tmpfs), so a full disk is real. Needs root and mount rights."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320m", "tmpfs", str(mount_point)],
                      capture_output=True).returncode != 0:
        pytest.skip("needs permission to mount a tmpfs (run as root in a container that allows mounts)")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


def fill(folder, leave_bytes: int) -> None:
    import shutil
    free = shutil.disk_usage(folder).free
    with open(os.path.join(folder, "filler"), "wb") as f:
        f.truncate(0)
        f.write(b"\0" * max(0, free - leave_bytes))


def test_full_disk_is_refused_before_the_save_and_the_previous_checkpoint_stays(config, data, small_disk, capsys):
    # a checkpoint of this model needs ~160 MiB (fp32 weights + AdamW moments + export): the first one fits
    train_sft(sft_args(config, data, small_disk, max_steps=1))
    before = (small_disk / "run_resume.pt").read_bytes()
    fill(small_disk, 40 * 2**20)
    code, stderr = script_exit(train_sft, sft_args(config, data, small_disk, max_steps=2, from_resume=1, resume_changes="max_steps"), capsys)
    assert_one_line_error(code, stderr, 1, "not enough free space", str(small_disk), "intact")
    assert (small_disk / "run_resume.pt").read_bytes() == before
    assert not [name for name in listing(small_disk) if ".tmp-" in name]


@pytest.mark.slow
def test_disk_filling_up_during_the_write_keeps_the_previous_checkpoint(config, data, small_disk, capsys, monkeypatch):
    train_sft(sft_args(config, data, small_disk, max_steps=1))
    before = (small_disk / "run_resume.pt").read_bytes()
    fill(small_disk, 60 * 2**20)  # the export (~40 MiB) fits, the resume file (~120 MiB) does not
    monkeypatch.setattr("trainer.skeleton.checkpoint.check_free_space", lambda *args: None)  # another writer filled it
    code, stderr = script_exit(train_sft, sft_args(config, data, small_disk, max_steps=2, from_resume=1, resume_changes="max_steps"), capsys)
    assert_one_line_error(code, stderr, 1, "no space left", "intact")
    assert (small_disk / "run_resume.pt").read_bytes() == before
    assert not [name for name in listing(small_disk) if ".tmp-" in name]


def test_read_only_save_dir_is_refused_at_start_up(config, data, small_disk, capsys):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    code, stderr = script_exit(train_sft, sft_args(config, data, small_disk / "out"), capsys)
    assert_one_line_error(code, stderr, 2, "--save_dir", str(small_disk / "out"), "not writable")


@pytest.mark.slow
def test_a_second_run_with_the_same_name_is_refused_and_a_dead_ones_lock_is_taken_over(config, data, tmp_path,
                                                                                       capsys):
    process = start([sys.executable, SFT, *sft_args(config, data, tmp_path)])
    try:
        wait_for(tmp_path / "run.lock", process)
        code, stderr = script_exit(train_sft, sft_args(config, data, tmp_path, from_resume=1), capsys)
        assert_one_line_error(code, stderr, 2, str(tmp_path / "run.lock"), f"PID {process.pid}", "in progress")
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert (tmp_path / "run.lock").exists(), "a killed run leaves its lock"
    train_sft(sft_args(config, data, tmp_path, from_resume=1, max_steps=1, resume_changes="max_steps"))
    assert "taking over" in capsys.readouterr().out
    assert not (tmp_path / "run.lock").exists()


@pytest.mark.slow
def test_an_existing_run_is_never_restarted_by_accident(config, data, tmp_path, capsys):
    train_sft(sft_args(config, data, tmp_path, max_steps=2))
    before = {name: (tmp_path / name).read_bytes() for name in ("run_resume.pt", "run_metrics.jsonl")}
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        run_script(lambda: train_sft(sft_args(config, data, tmp_path, max_steps=2)))
    out, stderr = capsys.readouterr()
    assert_one_line_error(refused.value.code, stderr, 2, str(tmp_path / "run_resume.pt"), "--from_resume 1",
                          "--start_over 1")
    assert "checking" not in out and "random weights" not in out  # refused before the rows and the model
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    train_sft(sft_args(config, data, tmp_path, max_steps=1, start_over=1))
    aside = [name for name in listing(tmp_path) if name.startswith("run.replaced-")]
    assert len(aside) == 1 and listing(tmp_path / aside[0]) == ["run", "run_metrics.jsonl", "run_resume.pt"]
    assert (tmp_path / aside[0] / "run_metrics.jsonl").read_bytes() == before["run_metrics.jsonl"]
    assert len(metrics(tmp_path)) == 1


def test_exported_files_get_ordinary_permissions(config, data, tmp_path):
    old = os.umask(0o022)
    try:
        train_sft(sft_args(config, data, tmp_path, max_steps=1))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "run").st_mode & 0o777 == 0o755
    for name in ("run/model.safetensors", "run/config.json", "run/tokenizer.json", "run_resume.pt",
                 "run_metrics.jsonl"):
        assert os.stat(tmp_path / name).st_mode & 0o777 == 0o644, name


@pytest.mark.parametrize("flags, names", [
    ({"max_prompt_length": 200}, ["--max_prompt_length", "--max_length"]),
    ({"batch": 0}, ["--batch_size"]),
    ({"data_path": "/nonexistent/rows.jsonl"}, ["--data_path", "/nonexistent/rows.jsonl"]),
])
def test_bad_flags_are_one_line(config, data, tmp_path, capsys, flags, names):
    args = sft_args(config, data, tmp_path)
    if "data_path" in flags:
        args = sft_args(config, flags.pop("data_path"), tmp_path)
    code, stderr = script_exit(train_sft, sft_args(config, data, tmp_path, **flags) if flags else args, capsys)
    assert_one_line_error(code, stderr, 2, *names)
    assert listing(tmp_path) == []


@pytest.mark.parametrize("damage", [pytest.param("zero_bytes", marks=pytest.mark.slow), "truncated",
                                    pytest.param("learning_rate", marks=pytest.mark.slow)])
def test_a_damaged_or_foreign_resume_file_is_one_line(config, data, tmp_path, capsys, damage):
    train_sft(sft_args(config, data, tmp_path, max_steps=1))
    resume = tmp_path / "run_resume.pt"
    content = resume.read_bytes()
    if damage != "learning_rate":
        resume.write_bytes(b"" if damage == "zero_bytes" else content[:len(content) // 3])
    flags = {"learning_rate": 0.5} if damage == "learning_rate" else {}
    before = {name: (tmp_path / name).read_bytes() for name in ("run_resume.pt", "run_metrics.jsonl")}
    code, stderr = script_exit(train_sft, sft_args(config, data, tmp_path, from_resume=1, **flags), capsys)
    assert_one_line_error(code, stderr, 2, str(resume), "learning_rate" if damage == "learning_rate" else "damaged")
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert not (tmp_path / "run.lock").exists()


@pytest.mark.parametrize("flags", [{"gen_temperature": 0.7}, {"top_k": 20}, {"top_p": 0.9}])
def test_sampled_kl_with_a_biasing_sampler_is_refused(config, data, tmp_path, capsys, flags):
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text("{}")  # never read: the flags are refused first
    code, stderr = script_exit(train_opd, sft_args(config, data, tmp_path / "out", loss="sampled_kl",
                                                   teacher_path=teacher, max_new_tokens=8, **flags), capsys)
    assert_one_line_error(code, stderr, 2, "--loss sampled_kl", "biased", f"--{next(iter(flags))}")


@pytest.mark.parametrize("loop", ["sft", "kd"])
@pytest.mark.parametrize("rows, names", [
    ([{"messages": [{"role": "user", "content": "Only a question."}]}], ["row 1", "no assistant turn"]),
    ([{"messages": [{"role": "user", "content": "Think?"},
                    {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nYes."}]}],
     ["row 1", "--enable_thinking 1"]),
])
def test_rows_the_loop_cannot_train_on_are_refused_at_start_up(config, tmp_path, capsys, loop, rows, names):
    from trainer.train_distillation import main as train_distillation
    data = tmp_path / "rows.jsonl"
    good = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]}
    data.write_text("".join(json.dumps(row) + "\n" for row in [good, *rows, good]))
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text("{}")  # never read: the data is refused before any model is loaded
    main, extra = (train_sft, {}) if loop == "sft" else (train_distillation, {"teacher_path": teacher})
    code, stderr = script_exit(main, sft_args(config, str(data), tmp_path / "out", **extra), capsys)
    assert_one_line_error(code, stderr, 2, str(data), *names)
    assert not (tmp_path / "out").exists()  # not even an empty --save_dir is left behind


def test_a_run_holding_the_name_is_refused_before_the_data_and_the_models(config, data, tmp_path, capsys,
                                                                          monkeypatch):
    """A live run's lock is refused at start-up, with the flags: nothing is read, built or written first."""
    import socket

    import trainer.train_sft as sft_script
    from common.files import process_start_time
    holder = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": holder.pid,
                                                       "start": process_start_time(holder.pid)}))

        def too_late(*args, **kwargs):
            raise AssertionError("the data was read before the run name was checked")
        monkeypatch.setattr(sft_script, "load_sft_data", too_late)
        before = listing(tmp_path)
        code, stderr = script_exit(train_sft, sft_args(config, data, tmp_path), capsys)
        assert_one_line_error(code, stderr, 2, str(tmp_path / "run.lock"), f"PID {holder.pid}", "in progress")
        assert listing(tmp_path) == before
    finally:
        holder.kill()
        holder.wait()
