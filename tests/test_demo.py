# python -m pytest tests/test_demo.py
"""benchmarks/demo.py without training anything: its folder of its own (checkpoints/demo/: the quick start's runs are
left alone), its guard and --fresh, --dry_run, the reading of metrics.jsonl and eval summaries, and the table, on a
temporary repository root whose commands are run by a fake runner that writes what the real commands write (small
files of the same shapes)."""
import contextlib
import json
import os
import shlex
import socket
import struct
import subprocess
import sys

import pytest

from benchmarks import demo
from common.errors import UserError, run_script
from eval.grader import wilson_interval
from support import ROOT

ServedTeacher = demo.ServedTeacher  # the real one: main()'s default is faked for every test (no_real_server)

# seconds the fake runner reports for each command, in COMMANDS order
SECONDS = [3.2, 41.0, 630.0, 12.0, 810.0, 55.0, 408.0, 14.0, 522.0, 13.0, 610.0, 12.5]
CORRECT = {"random": 0, "sft": 5, "kd": 0, "opd": 2, "logit_free": 3, "rl": 6}
METRICS = {
    "sft": [{"step": 0, "eval/accuracy": 0.0, "eval/completion_len": 64.0, "eval/eos_share": 0.0},
            {"step": 1, "epoch": 0, "loss": 11.8512, "lr": 0.002},
            {"step": 10, "epoch": 0, "loss": 5.0, "lr": 0.002},
            {"step": 100, "epoch": 0, "loss": 0.8801, "lr": 0.0},
            {"step": 100, "eval/accuracy": 0.03, "eval/completion_len": 38.0, "eval/eos_share": 1.0}],
    "kd": [{"step": 0, "eval/accuracy": 0.0, "eval/eos_share": 0.0, "eval/reverse_kl": 1.5},
           {"step": 1, "epoch": 0, "loss": 11.2, "ce": 11.85, "kd": 10.6},
           {"step": 100, "epoch": 0, "loss": 1.28, "ce": 1.82, "kd": 0.75},
           {"step": 100, "eval/accuracy": 0.0, "eval/eos_share": 0.0, "eval/reverse_kl": 0.992}],
    "opd": [{"step": 0, "eval/accuracy": 0.0, "eval/eos_share": 0.0, "eval/reverse_kl": 0.992},
            {"step": 1, "epoch": 0, "loss": 0.95, "eos_share": 0.1},
            {"step": 8, "eval/accuracy": 0.0, "eval/eos_share": 0.5, "eval/reverse_kl": 0.8},
            {"step": 32, "epoch": 0, "loss": 0.45, "eos_share": 1.0},
            {"step": 32, "eval/accuracy": 0.0, "eval/eos_share": 1.0, "eval/reverse_kl": 0.516}],
    "logit_free": [{"step": 0, "eval/accuracy": 0.0, "eval/eos_share": 0.0, "eval/reverse_kl": 0.992},
                   {"step": 1, "epoch": 0, "loss": 0.31, "pi_hat": 0.4, "teacher_requests": 60, "teacher_cached": 0,
                    "teacher_tokens": 9000},
                   {"step": 8, "eval/accuracy": 0.0, "eval/eos_share": 0.25, "eval/reverse_kl": 0.9},
                   {"step": 32, "epoch": 0, "loss": 0.22, "pi_hat": 0.5, "teacher_requests": 52, "teacher_cached": 0,
                    "teacher_tokens": 7800},
                   {"step": 32, "eval/accuracy": 0.0, "eval/eos_share": 0.75, "eval/reverse_kl": 0.711}],
    "rl": [{"step": 0, "eval/accuracy": 0.02, "eval/eos_share": 1.0},
           {"step": 1, "epoch": 1, "loss": 0.01, "reward": 0.031, "pass@4": 0.125, "zero_variance_share": 0.875},
           {"step": 32, "epoch": 1, "loss": -0.02, "reward": 0.0625, "pass@4": 0.25, "zero_variance_share": 0.625},
           {"step": 32, "eval/accuracy": 0.03, "eval/eos_share": 1.0}],
}
SCRIPT_RUN = {"trainer/train_sft.py": "sft", "trainer/train_distillation.py": "kd", "trainer/train_opd.py": "opd",
              "trainer/train_logit_free.py": "logit_free", "trainer/train_rl.py": "rl"}

def write_weights(folder, shapes):
    """A model folder whose model.safetensors has a header with these shapes (count_parameters reads the header)."""
    os.makedirs(folder, exist_ok=True)
    header = json.dumps({"__metadata__": {"format": "pt"},
                         **{f"w{i}": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}
                            for i, shape in enumerate(shapes)}}).encode()
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)


def write_summary(path, correct, rows=200, max_new_tokens=64):
    low, high = wilson_interval(correct, rows)
    summary = {"rows": rows, "n_samples": 1, "samples": rows, "correct": correct, "accuracy": correct / rows,
               "accuracy_ci95": [low, high], "mean_completion_tokens": 41.2 if correct else 64.0,
               "eos_share": 1.0 if correct else 0.0, "reasons": {}, "seconds": 12.3,
               "args": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary, f)


class FakeRunner:
    """Writes, for each demo command, what the real one writes into ROOT/checkpoints/demo, and reports SECONDS."""

    def __init__(self, teacher=None):
        self.calls, self.teacher = [], teacher

    def __call__(self, command, cwd):
        self.calls.append((command, cwd))
        if self.teacher is not None:  # the served teacher is up exactly while the logit-free loop trains
            assert self.teacher.serving_now == ("train_logit_free.py" in command), command
        argv = shlex.split(command)
        save_dir = os.path.join(cwd, demo.SAVE_DIR)
        if argv[1] == "-c":  # the random init
            write_weights(os.path.join(save_dir, "random"), [[2_000_000, 10], [128]])
        elif argv[1] == "eval/eval_math.py":
            model_path = argv[argv.index("--model_path") + 1]
            assert os.path.dirname(model_path) == demo.SAVE_DIR
            name = os.path.basename(model_path)
            write_summary(os.path.join(save_dir, f"{name}_eval_eval.summary.json"), CORRECT[name])
        else:
            assert argv[argv.index("--save_dir") + 1] == demo.SAVE_DIR
            name = SCRIPT_RUN[argv[1]]
            write_weights(os.path.join(save_dir, name), [[980_000, 10]])
            with open(os.path.join(save_dir, f"{name}_metrics.jsonl"), "w", encoding="utf-8") as f:
                f.writelines(json.dumps(record) + "\n" for record in METRICS[name])
            open(os.path.join(save_dir, f"{name}_resume.pt"), "wb").close()
        return SECONDS[len(self.calls) - 1]


class FakeTeacher:
    """demo.ServedTeacher's three parts, recorded in `events`: whether it can run (`unavailable`: the note, or None),
    the server's start and stop (`fails`: its start raises ServerFailed)."""

    def __init__(self, unavailable=None, fails=False):
        self.note, self.fails = unavailable, fails
        self.events, self.serving_now = [], False

    def unavailable(self):
        self.events.append("checked")
        return self.note

    @contextlib.contextmanager
    def serving(self, command, cwd, log_path):
        self.events.append(("start", command, os.path.relpath(log_path, cwd)))
        if self.fails:
            raise demo.ServerFailed(f"the vLLM server exited (1); its log: {log_path}")
        self.serving_now = True
        try:
            yield
        finally:
            self.serving_now = False
            self.events.append("stop")


@pytest.fixture(autouse=True)
def no_real_server(monkeypatch):
    """No test here starts vLLM: main()'s default teacher is a FakeTeacher that serves."""
    monkeypatch.setattr(demo, "ServedTeacher", FakeTeacher)


def never(command, cwd):
    raise AssertionError(f"no command should run, got {command}")


@pytest.fixture
def root(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / ".gitkeep").touch()
    return tmp_path


@pytest.fixture
def demo_dir(root):
    """checkpoints/demo/, where the demo's commands write (an earlier demo's runs go here)."""
    folder = root / demo.SAVE_DIR
    folder.mkdir()
    return folder


def table_rows(output):
    return [line for line in output.splitlines() if line.startswith("| ") and not line.startswith("| model")]


# --------------------------------------------------------------------------------------------- the commands

def test_commands_are_the_readme_demo_in_table_order():
    """The README's quick-start commands, each run written into checkpoints/demo/ (the loops' other defaults, the
    teacher and the student, follow --save_dir)."""
    assert demo.SAVE_DIR == "checkpoints/demo"
    assert [row.name for row in demo.ROWS] == ["random", "sft", "kd", "opd", "logit_free", "rl"]
    assert [c for row in demo.ROWS for c in row.commands] == demo.COMMANDS
    for row in demo.ROWS:
        *train, evaluate = row.commands
        assert evaluate == f"python eval/eval_math.py --model_path checkpoints/demo/{row.name} --max_new_tokens 64"
        for command in train:
            argv = shlex.split(command)
            assert argv[0] == "python"
            if argv[1] != "-c":
                assert argv[-2:] == ["--save_dir", "checkpoints/demo"] and "--model_path" not in argv
                assert os.path.isfile(os.path.join(ROOT, argv[1])) and SCRIPT_RUN[argv[1]] == row.name
    assert "'checkpoints/demo/random'" in demo.COMMANDS[0] and "seed=42" in demo.COMMANDS[0]
    assert demo.command_argv(demo.COMMANDS[2]) == [sys.executable, "trainer/train_sft.py", "--eval_interval", "50",
                                                   "--save_dir", "checkpoints/demo"]
    assert [row.name for row in demo.ROWS if row.server] == ["logit_free"]


def flags(command):
    argv = shlex.split(command)
    return dict(zip(argv[2::2], argv[3::2]))


def test_the_logit_free_row_distils_the_kd_student_from_the_served_sft_model():
    """The SFT model served by vLLM under the name the loop asks for, on the port of --teacher_url; the chat form;
    the method's values for the demo's 25-64-token completions; OPD's steps (neither sets a flag that changes the
    step count: both take the same default prompts and batch) and --eval_interval; the SFT model for the held-out
    reverse KL."""
    opd, logit_free = demo.ROWS[3], demo.ROWS[4]
    train, evaluate = logit_free.commands
    assert shlex.split(train)[:2] == ["python", "trainer/train_logit_free.py"]
    server = shlex.split(logit_free.server)
    assert server[:2] == ["python", "serving/vllm_launch.py"] and os.path.isfile(os.path.join(ROOT, server[1]))
    served = dict(zip(server[2:8:2], server[3:8:2]))
    assert served == {"--model": "checkpoints/demo/sft", "--name": "teacher", "--port": str(demo.TEACHER_PORT)}
    assert server[8:] == ["--", "--no-enable-chunked-prefill"]  # vLLM's CPU engine and seeded requests
    lf, opd_flags = flags(train), flags(opd.commands[0])
    assert lf["--teacher_url"] == demo.TEACHER_URL == f"http://127.0.0.1:{served['--port']}/v1"
    assert lf.get("--teacher_model", "teacher") == served["--name"]  # the loop's default name
    assert (lf["--teacher_form"], lf["--chunk_len"], lf["--audit_chunks"], lf["--continuations"]) == \
        ("chat", "8", "4", "4")
    assert lf["--eval_interval"] == opd_flags["--eval_interval"] == "8"
    assert lf["--eval_teacher_path"] == served["--model"]
    for flag in ("--max_steps", "--batch_size", "--accumulation_steps", "--epochs", "--data_path", "--model_path"):
        assert flag not in lf and flag not in opd_flags
    assert evaluate == "python eval/eval_math.py --model_path checkpoints/demo/logit_free --max_new_tokens 64"


@pytest.mark.slow
def test_random_init_command_runs_as_written(tmp_path):
    """The one-liner's code, with only its output folder changed, saves a loadable model (no training)."""
    code = shlex.split(demo.COMMANDS[0])[2].replace("'checkpoints/demo/random'", repr(str(tmp_path / "random")))
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
    assert os.path.isfile(tmp_path / "random" / "config.json")
    assert 151936 * 128 < demo.count_parameters(str(tmp_path / "random")) < 21e6  # tied embedding counted once


# -------------------------------------------------------------------------------------------------- --dry_run

def test_dry_run_prints_the_commands_only(root, capsys):
    assert demo.main(["--dry_run"], root=str(root), runner=never, teacher=FakeTeacher()) == 0
    out, err = capsys.readouterr()
    assert out == "\n".join(demo.script_lines()) + "\n" and err == ""
    lines = out.splitlines()
    assert [line for line in lines if line in demo.COMMANDS] == demo.COMMANDS
    # the shell form (`| sh`): the teacher served in the background around the logit-free training command only
    train = demo.ROWS[4].commands[0]
    at = lines.index(train)
    assert lines[at - 2] == (f"{demo.SERVE_TEACHER} > checkpoints/demo/logit_free_teacher_server.log 2>&1 & "
                             f"TEACHER_PID=$!")
    assert "wait_for_teacher()" in lines[at - 1] and lines[at + 1] == "kill $TEACHER_PID"
    assert len(lines) == len(demo.COMMANDS) + 3


def test_dry_run_with_earlier_runs_notes_them_and_moves_nothing(demo_dir, capsys):
    (demo_dir / "sft_resume.pt").touch()
    assert demo.main(["--dry_run", "--fresh"], root=str(demo_dir.parent.parent), runner=never) == 0
    out, err = capsys.readouterr()
    assert out == "\n".join(demo.script_lines()) + "\n"
    assert "sft_resume.pt" in err and "--fresh would move" in err
    assert os.listdir(demo_dir) == ["sft_resume.pt"]


# ------------------------------------------------------------------------------------------ the guard, --fresh

def test_earlier_runs_are_refused_with_one_line(demo_dir, capsys):
    (demo_dir / "sft").mkdir()
    (demo_dir / "kd_metrics.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit) as exit_info:
        run_script(lambda: demo.main([], root=str(demo_dir.parent.parent), runner=never))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: checkpoints/demo/ holds 2 file(s) of an earlier demo's")
    assert "sft/kd" in err and "pass --fresh" in err
    assert sorted(os.listdir(demo_dir)) == ["kd_metrics.jsonl", "sft"]


def test_the_first_demo_after_the_quick_start_runs_and_leaves_its_runs_alone(root, capsys):
    """The README's first command, `python trainer/train_sft.py`, writes checkpoints/sft/ (and a KD and an OPD run
    may follow): the demo then runs as it is, into checkpoints/demo/, and every file of those runs stays as it was.
    A second demo is refused in one line that names --fresh; with --fresh it moves the first demo's runs aside, in
    checkpoints/demo/, and the quick start's runs still stay."""
    checkpoints = root / "checkpoints"
    quick_start = {"sft/model.safetensors": "weights", "sft_resume.pt": "resume", "sft_metrics.jsonl": "{}\n",
                   "kd/config.json": "{}", "opd_metrics.jsonl": "{}\n", "sft_eval_eval.summary.json": "{}"}
    for name, text in quick_start.items():
        (checkpoints / name).parent.mkdir(exist_ok=True)
        (checkpoints / name).write_text(text)

    def unchanged():
        assert all((checkpoints / name).read_text() == text for name, text in quick_start.items())
        assert sorted(os.listdir(checkpoints)) == sorted({".gitkeep", "demo", *(n.split("/")[0] for n in quick_start)})

    runner = FakeRunner()
    assert demo.main([], root=str(root), runner=runner) == 0
    assert [command for command, _ in runner.calls] == demo.COMMANDS
    assert "### What the demo reaches" in capsys.readouterr().out
    unchanged()
    assert (checkpoints / "demo" / "opd_eval_eval.summary.json").is_file()

    with pytest.raises(SystemExit) as exit_info:
        run_script(lambda: demo.main([], root=str(root), runner=never))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "pass --fresh" in err
    assert err.startswith("error: checkpoints/demo/ holds")

    assert demo.main(["--fresh"], root=str(root), runner=FakeRunner()) == 0
    unchanged()
    previous = [name for name in os.listdir(checkpoints / "demo") if name.startswith("previous-")]
    assert len(previous) == 1 and "sft_metrics.jsonl" in os.listdir(checkpoints / "demo" / previous[0])


def test_other_run_names_are_neither_refused_nor_moved(demo_dir, capsys):
    for name in ("opd2", "sft_big", "previous-20260101-000000", "kd2_resume.pt", "opd_2ep_resume.pt"):
        (demo_dir / name).mkdir() if "." not in name else (demo_dir / name).touch()
    assert demo.existing_runs(str(demo_dir)) == {}
    runner = FakeRunner()
    assert demo.main(["--fresh"], root=str(demo_dir.parent.parent), runner=runner) == 0
    assert len(runner.calls) == len(demo.COMMANDS)
    for name in ("opd2", "sft_big", "previous-20260101-000000", "kd2_resume.pt", "opd_2ep_resume.pt"):
        assert (demo_dir / name).exists()
    assert "--fresh: moved" not in capsys.readouterr().out


def test_fresh_moves_every_file_of_the_five_runs_aside(demo_dir, capsys):
    """The logit-free run's teacher cache too: a new run would answer its requests from the old one's."""
    root, checkpoints = demo_dir.parent.parent, demo_dir
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a lock left by a process that is gone
    old = {"random": ["random/", "random_eval_eval.jsonl", "random_eval_eval.summary.json"],
           "sft": ["sft/", "sft_resume.pt", "sft_metrics.jsonl", "sft.replaced-20260101-000000/",
                   "sft_eval_dapo.summary.json", ".sft.tmp-123-abcd/"],
           "kd": ["kd_resume.pt", ".kd_resume.pt.tmp-1-ab"],
           "opd": ["opd/", "opd.lock", "opd_metrics.jsonl"],
           "logit_free": ["logit_free_metrics.jsonl", "logit_free_teacher_cache.rank0.jsonl",
                          "logit_free_teacher_cache.rank1.jsonl", "logit_free_teacher_server.log"]}
    for files in old.values():
        for name in files:
            (checkpoints / name.rstrip("/")).mkdir() if name.endswith("/") else (checkpoints / name).write_text("old")
    (checkpoints / "opd.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid}))
    runner = FakeRunner()
    assert demo.main(["--fresh"], root=str(root), runner=runner) == 0
    out = capsys.readouterr().out
    previous = [name for name in os.listdir(checkpoints) if name.startswith("previous-")]
    assert len(previous) == 1 and f"into checkpoints/demo/{previous[0]}/" in out
    moved = sorted(os.listdir(checkpoints / previous[0]))
    assert moved == sorted(name.rstrip("/") for files in old.values() for name in files)
    # the new runs are what the commands wrote, not the old files
    assert (checkpoints / "sft_metrics.jsonl").read_text().startswith("{")
    assert not (checkpoints / "opd.lock").exists() and not (checkpoints / "sft_eval_dapo.summary.json").exists()
    assert [command for command, _ in runner.calls] == demo.COMMANDS
    assert {cwd for _, cwd in runner.calls} == {str(root)}


def test_a_run_in_progress_is_refused_even_with_fresh(demo_dir):
    (demo_dir / "kd.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
    with pytest.raises(UserError, match=f"in progress \\(PID {os.getpid()}\\)"):
        demo.main(["--fresh"], root=str(demo_dir.parent.parent), runner=never)
    assert os.listdir(demo_dir) == ["kd.lock"]


def test_a_lock_from_another_host_is_refused(demo_dir):
    (demo_dir / "sft.lock").write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(UserError, match="held by PID 1 on host elsewhere"):
        demo.main(["--fresh"], root=str(demo_dir.parent.parent), runner=never)


# ----------------------------------------------------------------------------------------------------- the table

def test_the_table_from_the_files_the_commands_write(root, capsys):
    teacher = FakeTeacher()
    assert demo.main([], root=str(root), runner=FakeRunner(teacher), teacher=teacher) == 0
    out = capsys.readouterr().out
    train = demo.ROWS[4].commands[0]
    log = "checkpoints/demo/logit_free_teacher_server.log"
    assert teacher.events == ["checked", ("start", demo.SERVE_TEACHER, log), "stop"]
    assert "--teacher_probe request" in train      # the SFT teacher cannot count: the probe's requests only
    for i, command in enumerate(demo.COMMANDS, 1):
        assert f"[demo {i}/{len(demo.COMMANDS)}] {command}\n" in out
    report = out[out.index("### What the demo reaches"):]
    heading = report.splitlines()[0]
    assert "nproc " in heading and "commit " in heading and "in all)" in heading
    assert "(greedy, 64 new tokens" in report and "of the first 64 eval prompts" in report
    rows = table_rows(report)
    assert len(rows) == 6
    assert all(row.count(" | ") == 4 for row in rows)  # five cells: no unescaped pipe inside
    random, sft, kd, opd, logit_free, rl = rows
    assert random.startswith("| random init (qwen3-tiny, 20.0M parameters) | `python -c ")
    assert "0.0% [0.0, 1.9] (0/200)" in random and "0% of completions end with EOS, mean 64 tokens" in random
    assert random.endswith("| 3 s + 41 s |")
    assert sft.startswith("| SFT quick start (the teacher, qwen3-tiny, 9.8M parameters) | "
                          "`python trainer/train_sft.py --eval_interval 50 --save_dir checkpoints/demo` then "
                          "`python eval/eval_math.py --model_path checkpoints/demo/sft --max_new_tokens 64` | ")
    assert "| 2.5% [1.1, 5.7] (5/200) |" in sft
    assert "100 steps, loss 11.85 -> 0.88; held-out greedy EOS share 0% -> 100%" in sft
    assert "reverse KL" not in sft and sft.endswith("| 10.5 min + 12 s |")
    assert "100 steps, loss 11.20 -> 1.28, CE 11.85 -> 1.82, KD 10.60 -> 0.75" in kd
    assert "held-out reverse KL 1.500 (step 0) -> 0.992 (step 100), -34%" in kd
    assert kd.endswith("| 13.5 min + 55 s |")
    assert "| 1.0% [0.3, 3.6] (2/200) |" in opd
    assert ("32 steps, loss 0.95 -> 0.45; held-out reverse KL 0.992 (step 0) -> 0.516 (step 32), -48%; "
            "held-out greedy EOS share 0% -> 100%; eval_math: 100% of completions end with EOS, mean 41 tokens") in opd
    assert opd.endswith("| 6.8 min + 14 s |")
    assert logit_free.startswith("| logit-free OPD of the KD student (the SFT teacher served as a black box, 9.8M "
                                 f"parameters) | `{demo.SERVE_TEACHER}` in the background, then `{train}` (server "
                                 "stopped) then `python eval/eval_math.py --model_path checkpoints/demo/logit_free "
                                 "--max_new_tokens 64` | 1.5% [0.5, 4.3] (3/200) | ")
    assert ("32 steps, loss 0.31 -> 0.22; 112 teacher requests (16,800 tokens); held-out reverse KL 0.992 (step 0) "
            "-> 0.711 (step 32), -28%; held-out greedy EOS share 0% -> 75%; eval_math: 100% of completions end with "
            "EOS, mean 41 tokens") in logit_free
    assert logit_free.endswith(" to serve the teacher + 8.7 min + 13 s |")
    assert rl.startswith("| RL with verifiable rewards of the SFT model (GRPO, groups of 4, 9.8M parameters) | "
                         "`python trainer/train_rl.py --num_generations 4 --batch_size 8 --max_steps 32 "
                         "--learning_rate 1e-4 --eval_interval 8 --save_dir checkpoints/demo` then ")
    assert ("| 3.0% [1.4, 6.4] (6/200) | 32 steps, loss 0.01 -> -0.02; reward 0.031 -> 0.062, pass@4 12% -> 25%, "
            "groups without signal 75% of all; held-out greedy EOS share 100% -> 100%") in rl
    assert rl.endswith("| 10.2 min + 12 s |")


def run_demo(root, teacher, capsys):
    """The demo with this teacher -> (the commands run, what it printed, the logit-free table row)."""
    runner = FakeRunner(teacher)
    assert demo.main([], root=str(root), runner=runner, teacher=teacher) == 0
    out = capsys.readouterr().out
    rows = table_rows(out[out.index("### What the demo reaches"):])
    assert len(rows) == 6 and rows[3].startswith("| OPD of the KD student")  # the others as before
    return [command for command, _ in runner.calls], out, rows[4]


def test_without_the_vllm_environment_the_row_is_skipped_with_how_to_enable_it(root, capsys, monkeypatch):
    """The real check: no vLLM environment -> one line naming serving/setup_vllm_cpu.sh; nothing of the row runs
    and the table says so in its row."""
    import serving.vllm_launch
    monkeypatch.setattr(serving.vllm_launch, "vllm_python", lambda venv=None: None)
    note = ServedTeacher().unavailable()
    assert "serving/setup_vllm_cpu.sh" in note and "\n" not in note
    teacher = FakeTeacher(unavailable=note)
    commands, out, row = run_demo(root, teacher, capsys)
    assert commands == demo.COMMANDS[:8] + demo.COMMANDS[10:] and teacher.events == ["checked"]
    skipped = [line for line in out.splitlines() if line.startswith("[demo") and "setup_vllm_cpu.sh" in line]
    assert skipped == [f"[demo 9-10/12] skipped, the logit_free row: {note}"]
    assert row.endswith(f"| - | skipped: {note} | - |")


def test_a_taken_port_skips_the_row(monkeypatch):
    import serving.vllm_launch
    monkeypatch.setattr(serving.vllm_launch, "vllm_python", lambda venv=None: sys.executable)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        monkeypatch.setattr(demo, "TEACHER_PORT", listener.getsockname()[1])
        note = ServedTeacher().unavailable()
    assert f"port {demo.TEACHER_PORT}" in note and "in use" in note
    monkeypatch.setattr(demo, "port_in_use", lambda port: False)
    assert ServedTeacher().unavailable() is None


def test_a_server_that_does_not_start_skips_the_row(root, capsys):
    teacher = FakeTeacher(fails=True)
    commands, out, row = run_demo(root, teacher, capsys)
    assert commands == demo.COMMANDS[:8] + demo.COMMANDS[10:] and "stop" not in teacher.events
    assert "| - | skipped: the teacher server did not start: the vLLM server exited (1); its log: " in row
    assert row.endswith("logit_free_teacher_server.log | - |")


def test_a_failed_logit_free_run_stops_the_demo_and_the_server(root):
    teacher = FakeTeacher()

    class Failing(FakeRunner):
        def __call__(self, command, cwd):
            super().__call__(command, cwd)
            if "train_logit_free.py" in command:
                raise demo.CommandFailed("failed", 3)
            return SECONDS[len(self.calls) - 1]
    with pytest.raises(demo.CommandFailed):
        demo.main([], root=str(root), runner=Failing(teacher), teacher=teacher)
    assert teacher.events[-1] == "stop" and not teacher.serving_now


def test_a_missing_result_names_the_command_that_writes_it(root):
    class Forgetful(FakeRunner):  # the KD evaluation "runs" but writes nothing
        def __call__(self, command, cwd):
            return 1.0 if "checkpoints/demo/kd " in command else super().__call__(command, cwd)

    forgetful = Forgetful()
    with pytest.raises(UserError, match="kd_eval_eval.summary.json does not exist: `python eval/eval_math.py "
                                        "--model_path checkpoints/demo/kd --max_new_tokens 64` writes it"):
        demo.main([], root=str(root), runner=forgetful)


def test_evaluation_settings_that_differ_are_not_summarised(tmp_path):
    results = []
    for row, new_tokens in zip(demo.ROWS[:2], (64, 256)):
        write_summary(tmp_path / f"{row.name}.json", 1, max_new_tokens=new_tokens)
        summary = demo.read_json(str(tmp_path / f"{row.name}.json"), "x")
        results.append(demo.RowResult(row, summary, [1.0] * len(row.commands), [], [], None))
    assert "settings differ: see each command" in demo.intro(results)


# ---------------------------------------------------------------------------------------------------- parsing

def test_read_metrics_splits_steps_from_evaluations(tmp_path):
    path = tmp_path / "opd_metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in METRICS["opd"]) + "\n")
    steps, evals = demo.read_metrics(str(path), "cmd")
    assert [s["step"] for s in steps] == [1, 32] and [e["step"] for e in evals] == [0, 8, 32]


@pytest.mark.parametrize("content, message", [
    ('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n', "line 2 is not valid JSON"),
    ('{"loss": 2.0}\n', "line 1 has no step"),
    ('{"step": 0, "eval/accuracy": 0.0}\n', "holds no logged step: did `cmd` finish"),
])
def test_read_metrics_refuses_a_damaged_file(tmp_path, content, message):
    path = tmp_path / "m.jsonl"
    path.write_text(content)
    with pytest.raises(UserError, match=message):
        demo.read_metrics(str(path), "cmd")
    with pytest.raises(UserError, match="does not exist: `cmd` writes it"):
        demo.read_metrics(str(tmp_path / "none.jsonl"), "cmd")


def test_notes_and_formats():
    row = demo.ROWS[3]
    summary = {"eos_share": 0.5, "mean_completion_tokens": 20.0}
    one_eval = [{"step": 0, "eval/reverse_kl": 0.04, "eval/eos_share": 0.0}]
    steps = [{"step": 1, "loss": 0.0374}, {"step": 2, "loss": 0.0222}]
    assert demo.notes(demo.RowResult(row, summary, [], steps, one_eval, None)) == (
        "2 steps, loss 0.0374 -> 0.0222; held-out reverse KL 0.040 (step 0); eval_math: 50% of completions end "
        "with EOS, mean 20 tokens")
    assert demo.format_seconds(59.4) == "59 s" and demo.format_seconds(630) == "10.5 min"
    assert demo.number(11.8512) == "11.85" and demo.number(0.0) == "0.00" and demo.number(0.03713) == "0.0371"
    assert demo.change(0.0, 1.0) == "" and demo.change(0.992, 0.145) == ", -85%"
    assert demo.cell("a | b") == "a \\| b"


def test_count_parameters_reads_the_safetensors_header(tmp_path):
    write_weights(tmp_path / "m", [[3, 4], [5]])
    assert demo.count_parameters(str(tmp_path / "m")) == 17
    assert demo.count_parameters(str(tmp_path / "none")) is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\x01")
    assert demo.count_parameters(str(tmp_path / "bad")) is None


# ------------------------------------------------------------------------------------------ running commands

def test_run_command_times_a_command_and_stops_on_failure(tmp_path):
    seconds = demo.run_command(f"python -c \"open('ran', 'w').write('{tmp_path.name}')\"", str(tmp_path))
    assert seconds > 0 and (tmp_path / "ran").read_text() == tmp_path.name
    with pytest.raises(demo.CommandFailed, match="`python -c \"import sys; sys.exit\\(3\\)\"` failed with exit "
                                                 "code 3") as error:
        demo.run_command("python -c \"import sys; sys.exit(3)\"", str(tmp_path))
    assert error.value.exit_code == 3
