# python -m pytest tests/test_demo.py
"""benchmarks/demo.py: its commands, its guard and --fresh / --retrain, the teachers served around their rows, the
reading of what the commands write and the table and JSON, on a temporary repository root whose commands are run by a
fake runner that writes what the real commands write (small files of the same shapes); then the whole demo for real
at its tiny scale (slow), and benchmarks/demo_stats.py's reverse KL against a float64 computation."""
import contextlib
import json
import os
import runpy
import shlex
import socket
import subprocess
import sys
import time

import pytest
import torch

from benchmarks import demo
from benchmarks.demo_stats import batch_reverse_kl, paired_test, reverse_kl_to_teacher
from common.errors import FlagError, UserError
from eval.grader import wilson_interval
from support import ROOT

SCRIPTS = {"trainer/train_sft.py", "trainer/train_distillation.py", "trainer/train_opd.py", "trainer/train_rl.py",
           "trainer/train_logit_free.py", "trainer/train_ppo.py", "trainer/train_dpo.py"}


def flags(command):
    argv = shlex.split(command)
    return {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}


def correct_of(name):
    """How many of the 10 fake problems a row solves: the student 3, the teacher 9, the methods 4-8."""
    if name.startswith(("teacher_step", "student_sft_step")):
        return 3
    if name == "teacher":
        return 9
    return 4 + sum(map(ord, name)) % 5


class FakeRunner:
    """Writes, for each demo command, what the real one writes into ROOT/checkpoints/demo, and reports 10 s."""

    def __init__(self, teachers=None, correct=correct_of):
        self.calls, self.teachers, self.correct = [], teachers or {}, correct

    def __call__(self, command, cwd):
        self.calls.append(command)
        argv = shlex.split(command)
        named = flags(command)
        if argv[1] == "eval/eval_math.py":
            name = os.path.basename(named["--model_path"])
            stem = os.path.basename(named.get("--data_path", "eval.parquet")).split(".")[0]
            out = named["--out"][:-len(".jsonl")] if "--out" in named else f"{named['--model_path']}_eval_{stem}"
            write_gradings(os.path.join(cwd, out), self.correct(name),
                           {flag[2:]: value for flag, value in named.items()}, samples=int(named.get("--n_samples", 1)))
        elif argv[1] == "dataset/make_dpo_pairs.py":
            assert os.path.isdir(os.path.join(cwd, named["--model_path"])), command  # the student exists by now
            open(os.path.join(cwd, named["--out"]), "wb").close()
        elif argv[1] == "dataset/teacher_generate.py":
            assert self.teachers["vllm"].serving_now
            open(os.path.join(cwd, named["--out"]), "wb").close()
        else:
            assert argv[1] in SCRIPTS and named["--save_dir"] in (demo.ADDITION.save_dir, demo.RUNNING_SUM.save_dir)
            save_dir = os.path.join(cwd, named["--save_dir"])
            name = named["--save_weight"]
            if "train_logit_free.py" in command:  # its teacher is served exactly while it trains
                url = named["--teacher_url"]
                kind = "rule" if url == demo.RULE_URL else "vllm"
                assert self.teachers[kind].serving_now, command
            exports = [f"{name}_step{step}" for step in named.get("--export_steps", "").split(",") if step]
            for folder in [name, *exports]:
                os.makedirs(os.path.join(save_dir, folder), exist_ok=True)
                open(os.path.join(save_dir, folder, "config.json"), "w").close()
            with open(os.path.join(save_dir, f"{name}_metrics.jsonl"), "w", encoding="utf-8") as f:
                for record in fake_metrics(argv[1], int(named.get("--max_steps", 2))):
                    f.write(json.dumps(record) + "\n")
        return 10.0


def fake_metrics(script, steps):
    """Two logged steps, the first and the run's last."""
    first, last = {"step": 1, "loss": 2.0, "tokens": 400}, {"step": steps, "loss": 1.0, "tokens": 420}
    if script == "trainer/train_rl.py":
        first.update(reward=0.25, zero_variance_share=0.75)
        last.update(reward=0.5, zero_variance_share=0.25)
    if script == "trainer/train_ppo.py":
        first.update(reward=0.25, value_loss=0.5)
        last.update(reward=0.5, value_loss=0.125)
    if script == "trainer/train_logit_free.py":
        first.update(pi_hat=0.4, teacher_requests=64, teacher_tokens=2000)
        last.update(pi_hat=0.6, teacher_requests=60, teacher_tokens=1900)
    return [{"step": 0, "eval/accuracy": 0.1}, first, last]


def write_gradings(stem, correct, args=None, problems=10, samples=1):
    """`correct` of `problems` right (each of its `samples` samples alike): eval_math's two files."""
    with open(f"{stem}.jsonl", "w", encoding="utf-8") as f:
        for i in range(problems):
            f.write(json.dumps({"index": i, "prompt": "p", "completion": "c", "correct": i < correct,
                                "eos": True}) + "\n")
    low, high = wilson_interval(correct, problems)
    summary = {"rows": problems, "samples": problems, "correct": correct, "accuracy": correct / problems,
               "accuracy_ci95": [low, high], "eos_share": 1.0, "mean_completion_tokens": 22.0, "args": args or {},
               "commit": demo.code_commit(), "n_samples": samples}
    if samples > 1:
        summary.update({f"mean@{samples}": correct / problems, f"mean@{samples}_ci95": [low, high],
                        "pass@k": {str(samples): correct / problems}, "pass@k_ci95": {str(samples): [low, high]}})
    with open(f"{stem}.summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f)


class FakeTeacher:
    """A teacher's two parts (`unavailable`: the note, or None; `serving`, `fails`: its start raises ServerFailed),
    recorded in `events`."""

    def __init__(self, unavailable=None, fails=False):
        self.note, self.fails, self.events, self.serving_now = unavailable, fails, [], False

    def unavailable(self):
        return self.note

    @contextlib.contextmanager
    def serving(self, cwd):
        self.events.append("start")
        if self.fails:
            raise demo.ServerFailed("the vLLM server exited (1); its log: x.log")
        self.serving_now = True
        try:
            yield
        finally:
            self.serving_now = False
            self.events.append("stop")


def fake_statistics(root, row, student):
    return (None if row.name == "teacher" else 0.25), ((3, 1, 0.625) if student else None)


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A repository root of its own, the code at one commit (a test's result does not hang on this checkout's)."""
    (tmp_path / "checkpoints").mkdir()
    monkeypatch.setattr(demo, "code_commit", lambda: "abc1234")
    return tmp_path


def run_demo(root, argv=(), teachers=None, runner=None):
    teachers = teachers or {"vllm": FakeTeacher(), "rule": FakeTeacher()}
    runner = runner or FakeRunner(teachers)
    demo.main(list(argv), root=str(root), runner=runner, teachers=teachers, statistics=fake_statistics)
    return runner, teachers


def table_lines(output):
    return [line for line in output.splitlines() if line.startswith("| ") and not line.startswith("| model")]


# --------------------------------------------------------------------------------------------- the commands

STUDENT = "teacher_step350"


def test_every_method_starts_from_the_student_at_one_budget_and_writes_into_the_demo_folder():
    scale = demo.SCALES["addition"]["cpu"]
    rows = demo.table_rows(scale, STUDENT)
    trained = [r for r in rows if r.method]
    assert [r.name for r in trained] == [f"{m.name}_s{s}" for m in demo.METHODS for s in scale.seeds]
    assert len(scale.seeds) == 2
    for row in trained:
        train, *curve, evaluate = row.commands  # the addition's table: a curve, no sampled grading
        assert [flags(c)["--model_path"] for c in curve] == [f"checkpoints/demo/{row.name}_step{k}" for k in scale.curve]
        assert scale.curve == (8, 16) and not scale.sampled
        named = flags(train)
        assert shlex.split(train)[1] == row.method.script and os.path.isfile(os.path.join(ROOT, row.method.script))
        assert named["--model_path"] == f"checkpoints/demo/{STUDENT}"
        assert named["--save_weight"] == row.name
        assert named["--max_steps"] == str(scale.budget_steps) and named["--seed"] == str(row.seed)
        assert float(named["--learning_rate"]) == row.method.learning_rate
        assert flags(evaluate)["--model_path"] == f"checkpoints/demo/{row.name}"
        assert flags(evaluate)["--max_new_tokens"] == "64" and "--data_path" not in flags(evaluate)
    by_name = {row.name: row for row in rows}
    assert flags(by_name["rl_s1"].commands[0])["--num_generations"] == "4"  # 4 prompts x 4 answers: 16 sequences
    assert flags(by_name["lf_rule_s1"].commands[0])["--teacher_url"] == demo.RULE_URL
    assert flags(by_name["lf_vllm_s1"].commands[0])["--teacher_url"] == demo.TEACHER_URL
    assert flags(by_name["kd_s2"].commands[0])["--teacher_path"] == "checkpoints/demo/teacher"
    assert flags(by_name["sft_data_s1"].commands[0])["--data_path"] == demo.teacher_data(demo.ADDITION)
    assert flags(demo.teacher_generate(demo.ADDITION))["--out"] == demo.teacher_data(demo.ADDITION)


def test_the_long_task_names_its_data_budget_and_folder_and_grades_every_method_on_a_curve():
    """--task running_sum: every command in checkpoints/demo_running_sum/, the task's files named, 128 new tokens
    for the evaluations and the rollouts; the student a smaller model's own SFT export; each method's run exported
    at the curve's steps, each graded before the run's own grading."""
    scale = demo.SCALES["running_sum"]["cpu"]
    task = scale.task
    assert scale.student_config and demo.student_name(scale, 300) == "student_sft_step300"
    teacher, student_sft = demo.teacher_row(scale).commands[0], demo.student_sft_row(scale).commands[0]
    assert flags(teacher)["--data_path"] == flags(student_sft)["--data_path"] == f"{task.data_dir}/sft_train.parquet"
    assert "--export_steps" not in flags(teacher)  # the candidates are the student's own exports
    assert flags(student_sft)["--model_config"] == scale.student_config != scale.model_config
    assert flags(student_sft)["--export_steps"] == ",".join(map(str, scale.snapshots))
    rows = demo.table_rows(scale, "student_sft_step300")
    for row in (r for r in rows if r.method):
        train, *curve, sampled, final = row.commands
        named = flags(train)
        assert named["--save_dir"] == task.save_dir == "checkpoints/demo_running_sum"
        assert named["--from_resume"] == "1" and named["--model_path"] == f"{task.save_dir}/student_sft_step300"
        exports = [int(k) for k in named["--export_steps"].split(",")]
        assert exports == ([0] if row.method.own_start else []) + list(scale.curve)
        assert [flags(c)["--model_path"] for c in curve] == [f"{task.save_dir}/{row.name}_step{k}" for k in scale.curve]
        for command in (*curve, sampled, final):
            assert flags(command)["--data_path"] == f"{task.data_dir}/eval.parquet"
            assert flags(command)["--max_new_tokens"] == "128"
        assert flags(sampled)["--model_path"] == flags(final)["--model_path"] == f"{task.save_dir}/{row.name}"
        assert (flags(sampled)["--n_samples"], flags(sampled)["--temperature"]) == ("8", "1.0")
        assert flags(sampled)["--out"] == f"{task.save_dir}/{row.name}_eval_sampled8.jsonl"
        if row.method.data == "opd_prompts":
            assert named["--data_path"] == f"{task.data_dir}/opd_prompts.parquet" and named["--max_new_tokens"] == "128"
        # 64 steps of 16 of the 512 prompts (or of the teacher's 512 answers) take two passes; RL's 4 prompts one
        assert named.get("--epochs") == (None if row.method.name in ("kd", "rl") else "2"), row.name
    by_name = {r.name: r for r in rows}
    assert flags(by_name["kd_s1"].commands[0])["--data_path"] == f"{task.data_dir}/sft_train.parquet"
    assert flags(by_name["sft_data_s1"].commands[0])["--data_path"] == demo.teacher_data(task)
    generate = flags(demo.teacher_generate(task))
    assert generate["--data_path"] == f"{task.data_dir}/opd_prompts.parquet" and generate["--max_tokens"] == "128"
    with pytest.raises(FlagError, match="--scale cuda: the running_sum task has cpu, tiny"):
        demo.parse_args(["--task", "running_sum", "--scale", "cuda"])


def test_the_long_task_runs_in_its_own_folder_and_leaves_the_addition_s_alone(root):
    runner, _ = run_demo(root, ["--task", "running_sum", "--methods", "kd,opd"])
    assert runner.calls[0] == demo.teacher_row(demo.SCALES["running_sum"]["cpu"]).commands[0]
    assert runner.calls[2] == demo.student_sft_row(demo.SCALES["running_sum"]["cpu"]).commands[0]
    saved = json.load(open(root / demo.RUNNING_SUM.save_dir / "demo.json"))
    assert saved["student_choice"] == {"200": 0.3} and "the student's own SFT" in saved["extra_seconds"]
    assert [r["name"] for r in saved["rows"]][:2] == ["teacher", "student_sft_step200"]
    kd = next(r for r in saved["rows"] if r["name"] == "kd_s1")
    assert kd["sampled"]["n"] == 8 and kd["sampled"]["mean"] == kd["accuracy"]
    assert saved["rows"][1]["sampled"]["n"] == 8  # the starting student's too
    assert [(p["step"], p["tokens"]) for p in kd["curve"]] == [(8, 400), (16, 400), (32, 400), (64, 820)]
    assert kd["curve"][0]["gradings"] == f"{demo.RUNNING_SUM.save_dir}/kd_s1_step8_eval_eval.jsonl"
    assert kd["curve"][-1]["accuracy"] == kd["accuracy"]
    assert os.path.isfile(root / demo.RUNNING_SUM.data_dir / "eval.parquet")
    assert not os.path.exists(root / demo.ADDITION.save_dir)


def test_resume_goes_on_with_an_earlier_part_and_grades_only_what_is_missing(root):
    """A demo stopped between parts: --resume runs every training command again (--from_resume 1: a finished run
    stops at once) and makes only the evaluations it lacks; --resume with --fresh is refused."""
    run_demo(root, ["--methods", "kd,opd"])
    os.remove(root / demo.ADDITION.save_dir / "opd_s2_eval_eval.summary.json")  # stopped before its last grading
    runner, _ = run_demo(root, ["--methods", "kd,opd", "--resume"])
    assert [c for c in runner.calls if "eval_math.py" in c] == [demo.evaluation("opd_s2", demo.SCALES["addition"]["cpu"])]
    trained = [c for c in runner.calls if "eval_math.py" not in c]
    assert len(trained) == 5 and all(flags(c)["--from_resume"] == "1" for c in trained)
    with pytest.raises(FlagError, match="--resume goes on with the runs"):
        demo.parse_args(["--resume", "--fresh"])


def test_a_lora_student_is_tested_against_its_own_start():
    """The LoRA student's base is held in bf16: it starts from another model than the student. Its runs export step
    0, the first seed's graded after them, and both seeds' rows are tested against it."""
    rows = demo.table_rows(demo.SCALES["addition"]["cpu"], STUDENT)
    names = [r.name for r in rows]
    start = rows[names.index("opd_lora_s2") + 1]
    assert start.name == "opd_lora_s1_step0" and start.method is None and not start.student
    assert start.commands == (demo.evaluation("opd_lora_s1_step0", demo.SCALES["addition"]["cpu"]),)
    for name in ("opd_lora_s1", "opd_lora_s2"):
        assert rows[names.index(name)].baseline == start.name
        assert "0" in flags(rows[names.index(name)].commands[0])["--export_steps"].split(",")
    assert all(r.baseline is None for r in rows if not r.name.startswith("opd_lora"))


def test_the_student_is_one_of_the_teachers_own_exports():
    scale = demo.SCALES["addition"]["cpu"]
    t = flags(demo.teacher_row(scale).commands[0])
    assert os.path.isfile(os.path.join(ROOT, t["--model_config"])) and t["--save_weight"] == "teacher"
    assert int(t["--max_steps"]) == scale.teacher_steps and int(t["--epochs"]) * 3000 >= scale.teacher_steps * 16
    assert t["--export_steps"].split(",") == [str(step) for step in scale.snapshots]
    assert t["--eval_data_path"] == "dataset/demo/val.parquet"  # the learning curve chooses nothing on eval
    assert flags(demo.snapshot_row(scale, 350).commands[0])["--data_path"] == "dataset/demo/val.parquet"
    student = demo.student_row(scale, 350)
    assert student.student and student.commands == (demo.evaluation(STUDENT, scale),)


def test_sweep_rows_grade_on_the_val_problems():
    rows = demo.sweep_rows(demo.SCALES["addition"]["cpu"], STUDENT, [1e-3, 3e-3])
    assert len(rows) == 2 * len(demo.METHODS)
    assert all(flags(r.commands[1])["--data_path"] == "dataset/demo/val.parquet" for r in rows)
    assert {r.learning_rate for r in rows} == {1e-3, 3e-3} and rows[0].name == "sweep_sft_data_lr0.001"


def test_dry_run_prints_the_commands_only(root, capsys):
    assert demo.main(["--dry_run"], root=str(root), runner=None) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = demo.table_rows(demo.SCALES["addition"]["cpu"], demo.student_name(demo.SCALES["addition"]["cpu"], "N"))
    assert lines[0].startswith("python trainer/train_sft.py") and lines[2].startswith("# then")
    assert len(lines) == 4 + sum(len(r.commands) for r in rows)
    assert not os.path.exists(root / demo.ADDITION.save_dir)


def test_every_run_takes_the_dtype_flag_or_the_scales(root, capsys):
    """fp32 on a CPU by default (a CPU without bf16 instructions computes a bf16 GEMM tens of times slower), bf16 on
    request, for the teacher and every method alike."""
    for argv, dtype in (([], "float32"), (["--dtype", "bfloat16"], "bfloat16"), (["--scale", "cuda"], "bfloat16")):
        assert demo.main(["--dry_run", *argv], root=str(root), runner=None) == 0
        commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("python trainer/")]
        assert commands and all(f"--dtype {dtype} " in line for line in commands), argv


# ------------------------------------------------------------------------------------------ running the table

def test_the_table_runs_every_row_and_reads_back_what_the_commands_wrote(root, capsys):
    runner, teachers = run_demo(root)
    out = capsys.readouterr().out
    lines = table_lines(out)
    names = ["teacher", "teacher_step300"] + [r.name for r in demo.table_rows(demo.SCALES["addition"]["cpu"], "teacher_step300")]
    assert len(lines) == len(names)
    assert "90.0% [59.6, 98.2] (9/10)" in lines[0] and "30.0%" in lines[1]
    rl = next(line for line in lines if line.startswith("| RL"))
    assert "groups with signal 50% (step 1 25%, last 75%)" in rl and "+3 / -1, p = 0.62" in rl
    lf = next(line for line in lines if "rule-based" in line)
    assert "124 (3,900 tokens)" in lf and "pi_hat 0.40 -> 0.60" in lf
    assert teachers["vllm"].events == ["start", "stop"] and teachers["rule"].events == ["start", "stop"]
    generate = runner.calls.index(demo.teacher_generate(demo.ADDITION))
    assert generate < runner.calls.index(demo.table_rows(demo.SCALES["addition"]["cpu"], "teacher_step300")[0].commands[0])
    saved = json.load(open(root / demo.ADDITION.save_dir / "demo.json"))
    assert [r["name"] for r in saved["rows"]] == names
    assert saved["rows"][2]["versus_start"] == [3, 1, 0.625] and saved["rows"][2]["student_tokens"] == 820
    assert saved["header"].startswith("### `python benchmarks/demo.py`: ") and "nproc" in saved["header"]
    assert saved["teacher_commit"] == "abc1234" and saved["student_choice"] == {"300": 0.3}
    assert "The teacher trained at commit abc1234; the student its first export at 25%-45%" in out


def test_a_second_table_reuses_the_teacher_and_the_student_and_refuses_the_old_runs(root, capsys):
    run_demo(root)
    with pytest.raises(UserError, match="--fresh to move them"):
        run_demo(root)
    runner, _ = run_demo(root, ["--fresh"])
    teacher = next(c for c in runner.calls if "--save_weight teacher" in c)
    assert flags(teacher)["--from_resume"] == "1"  # finished: it says so and stops; killed: it continues
    assert not any("eval_math.py --model_path checkpoints/demo/teacher" in c for c in runner.calls)
    assert "evaluation reused (the same commit and flags)" in capsys.readouterr().out
    moved = [p for p in os.listdir(root / demo.ADDITION.save_dir) if p.startswith("previous-")]
    assert len(moved) == 1 and "kd_s1" in os.listdir(root / demo.ADDITION.save_dir / moved[0])
    runner, _ = run_demo(root, ["--retrain"])
    assert any("--save_weight teacher" in c for c in runner.calls)


def test_a_grading_made_by_other_code_or_flags_is_made_again(root, monkeypatch):
    run_demo(root)
    teacher_eval = demo.teacher_row(demo.SCALES["addition"]["cpu"]).commands[1]
    monkeypatch.setattr(demo, "code_commit", lambda: "def5678")
    runner, _ = run_demo(root, ["--fresh"])
    assert teacher_eval in runner.calls  # graded at abc1234: not reused at def5678
    runner, _ = run_demo(root, ["--fresh"])
    assert teacher_eval not in runner.calls
    summary = root / demo.ADDITION.save_dir / "teacher_eval_eval.summary.json"
    written = json.loads(summary.read_text())
    summary.write_text(json.dumps({**written, "args": {**written["args"], "max_new_tokens": 32}}))  # other flags
    runner, _ = run_demo(root, ["--fresh"])
    assert teacher_eval in runner.calls
    monkeypatch.setattr(demo, "code_commit", lambda: "def5678 with local changes")
    runner, _ = run_demo(root, ["--fresh"])
    assert teacher_eval in runner.calls  # local changes: the code is not known


@pytest.mark.parametrize("accuracies, chosen, graded", [
    ({300: 1, 325: 2, 350: 3, 375: 5}, 350, [300, 325, 350]),  # the first in 25-45%: later exports not graded
    ({300: 1, 325: 2}, 325, None),                             # none in the band: the nearest its middle
])
def test_the_student_is_the_first_export_in_the_accuracy_band(root, accuracies, chosen, graded):
    def correct(name):
        if name.startswith("teacher_step"):
            return accuracies.get(int(name.removeprefix("teacher_step")), 9)
        return correct_of(name)
    teachers = {"vllm": FakeTeacher(), "rule": FakeTeacher()}
    runner, _ = run_demo(root, teachers=teachers, runner=FakeRunner(teachers, correct))
    val = [int(flags(c)["--model_path"].removeprefix("checkpoints/demo/teacher_step")) for c in runner.calls
           if "teacher_step" in c and "val.parquet" in c]
    assert val == (graded or list(demo.SCALES["addition"]["cpu"].snapshots))
    assert all(flags(c)["--model_path"] == f"checkpoints/demo/teacher_step{chosen}" for c in runner.calls
               if "--save_weight" in c and "teacher" not in flags(c)["--save_weight"])


def test_without_vllm_its_rows_are_skipped_with_how_to_enable_it(root, capsys):
    note = "no vLLM environment at /x: serving/setup_vllm_cpu.sh makes one"
    teachers = {"vllm": FakeTeacher(unavailable=note), "rule": FakeTeacher()}
    runner, _ = run_demo(root, teachers=teachers)
    assert demo.teacher_generate(demo.ADDITION) not in runner.calls and teachers["vllm"].events == []
    skipped = [line for line in table_lines(capsys.readouterr().out) if "skipped" in line]
    assert len(skipped) == 4 and all(note in line for line in skipped)


def test_a_teacher_server_that_does_not_start_skips_its_rows(root, capsys):
    teachers = {"vllm": FakeTeacher(fails=True), "rule": FakeTeacher()}
    run_demo(root, teachers=teachers)
    skipped = [line for line in table_lines(capsys.readouterr().out) if "did not start" in line]
    assert len(skipped) == 4


def test_a_run_in_progress_is_refused_even_with_fresh(root):
    folder = root / demo.ADDITION.save_dir
    folder.mkdir()
    (folder / "opd_s1.lock").write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    with pytest.raises(UserError, match="in progress"):
        run_demo(root, ["--fresh"])


def test_a_failed_command_stops_the_demo_and_its_server(root):
    teachers = {"vllm": FakeTeacher(), "rule": FakeTeacher()}

    def runner(command, cwd):
        if "lf_vllm_s1" in command:
            raise demo.CommandFailed("failed", 3)
        return FakeRunner(teachers)(command, cwd)
    with pytest.raises(demo.CommandFailed):
        run_demo(root, teachers=teachers, runner=runner)
    assert teachers["vllm"].events == ["start", "stop"]


def test_a_missing_result_names_the_command_that_writes_it(root):
    def runner(command, cwd):
        return 1.0 if "kd_s1" in command and "eval_math" in command else FakeRunner(teachers)(command, cwd)
    teachers = {"vllm": FakeTeacher(), "rule": FakeTeacher()}
    with pytest.raises(UserError, match="eval_math.py --model_path checkpoints/demo/kd_s1"):
        run_demo(root, teachers=teachers, runner=runner)


def test_the_ablation_runs_each_chunk_weight_from_the_served_teacher_beside_opd(root, capsys):
    runner, teachers = run_demo(root, ["--ablation"])
    trained = [flags(c) for c in runner.calls if flags(c).get("--save_weight", "").startswith("ablation_")]
    weights = [f.get("--chunk_weight") for f in trained]
    assert weights == ["posterior", "advantage", "centred", None]
    assert demo.teacher_generate(demo.ADDITION) not in runner.calls and teachers["vllm"].events == ["start", "stop"]
    saved = json.load(open(root / demo.ADDITION.save_dir / "ablation.json"))
    assert saved["header"].startswith("### `python benchmarks/demo.py --ablation`")
    assert len(table_lines(capsys.readouterr().out)) == 2 + 4


def test_the_sweep_prints_validation_accuracy_per_learning_rate(root, capsys):
    runner, _ = run_demo(root, ["--sweep", "1e-3,2e-3"])
    out = capsys.readouterr().out
    assert "| kd | 0.002 |" in out and not os.path.exists(root / demo.ADDITION.save_dir / "demo.json")
    with pytest.raises(FlagError, match="--sweep takes comma-separated learning rates"):
        demo.parse_args(["--sweep", "fast"])
    runner, _ = run_demo(root, ["--sweep", "1e-3", "--methods", "kd,rl", "--fresh"])
    assert [flags(c)["--save_weight"] for c in runner.calls if "--save_weight" in c and "sweep" in c] == [
        "sweep_kd_lr0.001", "sweep_rl_lr0.001"]
    with pytest.raises(FlagError, match="--methods: sft not among"):
        demo.parse_args(["--methods", "kd,sft"])


def test_run_command_times_a_command_and_stops_on_failure(tmp_path):
    assert demo.run_command("python -c pass", str(tmp_path)) > 0
    with pytest.raises(demo.CommandFailed) as failure:
        demo.run_command("python -c 'import sys; sys.exit(3)'", str(tmp_path))
    assert failure.value.exit_code == 3


# ------------------------------------------------------------------------------------------------ the statistics

def test_reverse_kl_on_a_models_own_answers_equals_a_float64_computation(tmp_path):
    from model import Qwen3Config, create_model, save_pretrained
    from model.tokenizer import load_tokenizer
    config = Qwen3Config.from_json(os.path.join(ROOT, "model/configs/qwen3-tiny-student.json"))
    student, teacher = create_model(config, seed=1), create_model(config, seed=2)
    save_pretrained(student, str(tmp_path / "student"))
    save_pretrained(teacher, str(tmp_path / "teacher"))
    tokenizer = load_tokenizer(None)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 34?"}],
                                           add_generation_prompt=True, enable_thinking=False)
    records = [{"index": 0, "prompt": prompt, "completion": "2+4=6, 1+3=4. \\boxed{46}", "eos": True,
                "correct": True},
               {"index": 1, "prompt": prompt, "completion": "2+4=6", "eos": False, "correct": False}]
    with open(tmp_path / "g.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    measured = reverse_kl_to_teacher(str(tmp_path / "student"), str(tmp_path / "teacher"), str(tmp_path / "g.jsonl"))
    total, count = 0.0, 0
    with torch.no_grad():
        for r in records:  # one row at a time, no padding, float64
            ids = tokenizer.encode(r["prompt"]) + tokenizer.encode(r["completion"]) + (
                [tokenizer.eos_token_id] if r["eos"] else [])
            start = len(tokenizer.encode(r["prompt"]))
            x = torch.tensor([ids])
            p = torch.log_softmax(student(x).logits[0, start - 1:-1, :len(tokenizer)].double(), -1)
            q = torch.log_softmax(teacher(x).logits[0, start - 1:-1, :len(tokenizer)].double(), -1)
            total += float((p.exp() * (p - q)).sum())
            count += len(ids) - start
    assert measured == pytest.approx(total / count, rel=1e-4)
    itself = batch_reverse_kl(student, student, tokenizer, records)
    assert abs(itself[0]) < 1e-3 and itself[1] == count


def test_paired_test_reads_two_gradings_of_the_same_problems(tmp_path):
    write_gradings(str(tmp_path / "a"), 8)
    write_gradings(str(tmp_path / "b"), 3)
    assert paired_test(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")) == (5, 0, 2 / 32)
    write_gradings(str(tmp_path / "c"), 3, problems=9)
    with pytest.raises(ValueError, match="different problems"):
        paired_test(str(tmp_path / "a.jsonl"), str(tmp_path / "c.jsonl"))


# ------------------------------------------------------------------------------------------------ the real thing

def in_this_process(monkeypatch):
    """A runner for demo.main: each command's script run as `__main__` in this process, in the command's folder with
    its arguments and the demo's environment -- what run_command starts, without an interpreter and torch's import
    per command (about 25 commands)."""
    def run(command: str, cwd: str) -> float:
        start, (python, script, *argv) = time.perf_counter(), shlex.split(command)
        assert python == "python", command
        with monkeypatch.context() as patch:
            patch.chdir(cwd)
            patch.setattr(sys, "argv", [script, *argv])
            patch.setenv("OPENAI_API_KEY", "EMPTY")
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as stop:
                assert stop.code in (0, None), f"{command}: exit code {stop.code}"
        return time.perf_counter() - start
    return run


def tiny_table(tmp_path, monkeypatch, argv: list[str], task, rule_teacher) -> dict[str, dict]:
    """The demo run for real with `argv` in a copy of the repository made of links (its checkpoints/ its own), each
    script as `__main__` in this process, the vLLM rows skipped (their teacher faked unavailable) -> demo.json's
    rows by name."""
    for name in os.listdir(ROOT):
        if name not in ("checkpoints", ".git"):
            os.symlink(os.path.join(ROOT, name), tmp_path / name)
    (tmp_path / "checkpoints").mkdir()
    teachers = {"vllm": FakeTeacher(unavailable="vLLM faked unavailable"), "rule": rule_teacher}
    assert demo.main(argv, root=str(tmp_path), runner=in_this_process(monkeypatch), teachers=teachers) == 0
    saved = json.load(open(tmp_path / task.save_dir / "demo.json"))
    return {r["name"]: r for r in saved["rows"]}


# both serve the rule-based teacher on the demo's fixed port (demo.RULE_PORT, in the commands): one worker runs them
@pytest.mark.xdist_group("rule_port")
@pytest.mark.slow
def test_the_demo_runs_at_its_tiny_scale(tmp_path, monkeypatch):
    """Every command for real at --scale tiny (the code path, not the numbers), each script run as `__main__` in
    this process, in a copy of the repository made of links (its checkpoints/ its own); the vLLM rows skipped (their
    teacher faked unavailable: tests/test_serving.py proves the served teacher), the rule-based teacher served for
    real."""
    rows = tiny_table(tmp_path, monkeypatch, ["--scale", "tiny"], demo.ADDITION, demo.RuleTeacher())
    student = f"teacher_step{demo.SCALES['addition']['tiny'].snapshots[0]}"
    assert rows["teacher"]["problems"] == 8 and rows[student]["reverse_kl_to_teacher"] >= 0
    for name in ("kd_s1", "opd_s1", "lf_rule_s1", "rl_s1"):
        assert rows[name]["steps"] == 2 and rows[name]["versus_start"] is not None, name
    assert rows["lf_rule_s1"]["teacher_requests"] > 0
    assert rows["sft_data_s1"]["skipped"].startswith("skipped: ")


# both serve the rule-based teacher on the demo's fixed port (demo.RULE_PORT, in the commands): one worker runs them
@pytest.mark.xdist_group("rule_port")
@pytest.mark.slow
def test_the_long_task_runs_at_its_tiny_scale(tmp_path, monkeypatch):
    """--task running_sum for real at --scale tiny: the smaller student's own SFT, the curve's exports graded, the
    sampled gradings, the rule-based teacher answering the long task's questions."""
    # KD (teacher-forced) and logit-free OPD (rollouts, the rule teacher): the addition's test runs OPD and RL
    argv = ["--task", "running_sum", "--scale", "tiny", "--methods", "kd,lf_rule"]
    rows = tiny_table(tmp_path, monkeypatch, argv, demo.RUNNING_SUM, demo.RuleTeacher())
    scale = demo.SCALES["running_sum"]["tiny"]
    student = demo.student_name(scale, scale.snapshots[0])
    assert rows[student]["sampled"]["n"] == scale.sampled and rows["teacher"]["problems"] == 8
    for name in ("kd_s1", "lf_rule_s1"):
        assert not rows[name].get("skipped"), rows[name]["skipped"]
        assert [p["step"] for p in rows[name]["curve"]] == [*scale.curve, scale.budget_steps], name
        assert rows[name]["sampled"]["n"] == scale.sampled and rows[name]["versus_start"] is not None, name
    assert rows["lf_rule_s1"]["teacher_requests"] > 0


def test_the_opd_variants_are_rows_of_their_own_each_tested_against_opd_of_its_seed(root, capsys):
    """`--methods opd,opd_self,opd_skd`: each variant's run carries its one flag on OPD's command, and its notes hold
    its McNemar test against white-box OPD's row of the same seed, counted from the two rows' gradings."""
    run_demo(root, ["--methods", "opd,opd_self,opd_skd"])
    saved = json.loads((root / demo.ADDITION.save_dir / "demo.json").read_text())
    rows = {r["name"]: r for r in saved["rows"]}
    assert "--self_teacher live" in rows["opd_self_s1"]["commands"][0]
    assert "--teacher_path" not in rows["opd_self_s1"]["commands"][0]
    assert "--skd_topk 25" in rows["opd_skd_s2"]["commands"][0]
    for name in ("opd_self_s1", "opd_self_s2", "opd_skd_s1", "opd_skd_s2"):
        seed = name[-1]
        mine, base = correct_of(name), correct_of(f"opd_s{seed}")
        # the first `correct` of 10 problems right in each: only the better one gains, by the difference
        gained, lost = max(mine - base, 0), max(base - mine, 0)
        assert rows[name]["versus_base"][:2] == [gained, lost], (name, rows[name]["versus_base"])
    assert rows["opd_s1"]["versus_base"] is None
    assert "vs opd seed 1: +" in capsys.readouterr().out
    assert set(demo.parse_args(["--methods", "opd_power,opd_iw,opd_skew,opd_sampled"]).methods) <= set(demo.VARIANTS)


def test_the_opd_variants_are_graded_once_greedy_without_a_curve_or_samples():
    """On the long task a variant's row is its training and its greedy grading only (OPD's row keeps its curve and
    its sampled grading), the training exporting nothing but a start of its own."""
    scale = demo.SCALES["running_sum"]["cpu"]
    opd = next(m for m in demo.METHODS if m.name == "opd")
    rows = {r.name: r for r in demo.table_rows(scale, "student_sft_step350", [opd, *demo.VARIANTS]) if r.method}
    assert len(rows["opd_s1"].commands) == 1 + len(scale.curve) + 2
    for variant in demo.VARIANTS:
        train, final = rows[f"{variant.name}_s1"].commands
        assert flags(train).get("--export_steps") == ("0" if variant.own_start else None), variant.name
        assert "--n_samples" not in flags(final) and flags(final)["--model_path"].endswith(f"{variant.name}_s1")


def test_dpo_trains_on_pairs_of_the_students_own_answers_made_once_before_its_rows(root):
    """`--methods dpo`: the pairs are made from the chosen student (its 8 sampled answers per OPD prompt, graded)
    before the first DPO row, once for both seeds and not again on --resume; each row trains on them from the
    student, 32 steps of 16 pairs, and is tested against the student."""
    runner, _ = run_demo(root, ["--methods", "dpo"])
    pairs = [c for c in runner.calls if "make_dpo_pairs.py" in c]
    student = f"{demo.ADDITION.save_dir}/teacher_step300"  # the fake student: the first export in the band
    assert len(pairs) == 1 and flags(pairs[0])["--model_path"] == student
    assert (flags(pairs[0])["--n_samples"], flags(pairs[0])["--temperature"]) == ("8", "1.0")
    trains = [c for c in runner.calls if "train_dpo.py" in c]
    assert runner.calls.index(pairs[0]) < runner.calls.index(trains[0]) and len(trains) == 2
    for train in trains:
        named = flags(train)
        assert named["--data_path"] == flags(pairs[0])["--out"] and named["--model_path"] == student
        assert named["--max_steps"] == "32" and "--batch_size" not in named  # the default: 16 pairs a step
    rows = {r["name"]: r for r in json.loads((root / demo.ADDITION.save_dir / "demo.json").read_text())["rows"]}
    assert rows["dpo_s1"]["versus_start"] is not None
    runner, _ = run_demo(root, ["--methods", "dpo", "--resume"])
    assert not [c for c in runner.calls if "make_dpo_pairs.py" in c]


def test_the_rl_variants_run_update_epochs_and_are_tested_against_rl_of_their_seed(root):
    """`--methods rl,rl_epochs,rl_cispo`: RL's command with 2 update epochs x 2 minibatches (and CISPO's loss with
    its band), each row tested against RL's of the same seed."""
    run_demo(root, ["--methods", "rl,rl_epochs,rl_cispo"])
    rows = {r["name"]: r for r in json.loads((root / demo.ADDITION.save_dir / "demo.json").read_text())["rows"]}
    epochs, cispo = flags(rows["rl_epochs_s1"]["commands"][0]), flags(rows["rl_cispo_s2"]["commands"][0])
    assert epochs["--update_epochs"] == "2" and epochs["--num_minibatches"] == "2" and "--policy_loss" not in epochs
    assert cispo["--policy_loss"] == "cispo" and (cispo["--clip_eps"], cispo["--clip_eps_high"]) == ("1", "3")
    assert flags(rows["rl_s1"]["commands"][0])["--learning_rate"] == epochs["--learning_rate"]
    for name in ("rl_epochs_s1", "rl_cispo_s2"):
        mine, base = correct_of(name), correct_of(f"rl_s{name[-1]}")
        assert rows[name]["versus_base"][:2] == [max(mine - base, 0), max(base - mine, 0)]


def test_ppo_row_runs_the_critic_loop_at_rls_budget_and_is_tested_against_rl(root, capsys):
    """`--methods rl,ppo`: train_ppo.py with one answer for each of 16 prompts (RL's 4 x 4 sequences a step), RL's
    rate and update epochs, the critic's own rate; its notes say the reward and the critic's loss, not groups."""
    run_demo(root, ["--methods", "rl,ppo"])
    rows = {r["name"]: r for r in json.loads((root / demo.ADDITION.save_dir / "demo.json").read_text())["rows"]}
    ppo, rl = flags(rows["ppo_s2"]["commands"][0]), flags(rows["rl_s2"]["commands"][0])
    assert "trainer/train_ppo.py" in rows["ppo_s2"]["commands"][0] and "--num_generations" not in ppo
    assert int(ppo["--batch_size"]) == int(rl["--batch_size"]) * int(rl["--num_generations"]) == 16
    assert (ppo["--learning_rate"], ppo["--max_steps"]) == (rl["--learning_rate"], rl["--max_steps"])
    assert (ppo["--update_epochs"], ppo["--num_minibatches"], ppo["--critic_learning_rate"]) == ("2", "2", "1e-4")
    mine, base = correct_of("ppo_s2"), correct_of("rl_s2")
    assert rows["ppo_s2"]["versus_base"][:2] == [max(mine - base, 0), max(base - mine, 0)]
    assert rows["ppo_s2"]["groups_with_signal"] is None
    out = capsys.readouterr().out
    assert "reward 0.25 -> 0.50" in out and "the critic's value loss 0.5 -> 0.125" in out


def test_a_grading_runs_no_code_of_the_folders_whose_changes_it_ignores():
    """is_current reuses a grading across commits that changed only benchmarks/ and trainer/: eval/eval_math.py
    must import neither (measured in a fresh interpreter)."""
    probe = ("import json, sys; sys.path.insert(0, '.'); import eval.eval_math; "
             "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    folders = {spec.split(")")[1] for spec in demo.GRADING_UNUSED}
    assert folders == {"benchmarks", "trainer"} and not folders & set(json.loads(loaded.stdout)), loaded.stdout


@pytest.mark.slow
def test_the_tool_task_runs_at_its_tiny_scale(tmp_path, monkeypatch):
    """--task products for real at --scale tiny: the student chosen and graded with the calculator and graded by
    hand too, RL and OPD with the calculator (multi-turn) tested against the student with it and against the same
    method without it, the methods without it against the student by hand."""
    argv = ["--task", "products", "--scale", "tiny", "--methods", "rl,rl_tools,opd,opd_tools"]
    rows = tiny_table(tmp_path, monkeypatch, argv, demo.PRODUCTS, FakeTeacher())
    scale = demo.SCALES["products"]["tiny"]
    student = demo.student_name(scale, scale.snapshots[0])
    for model in (student, "teacher"):  # graded with the calculator, and by hand in a row tested against that
        assert "--tools calculator" in rows[model]["commands"][-1], model
        assert "--tools" not in rows[f"{model}_by_hand"]["commands"][-1], model
        assert rows[f"{model}_by_hand"]["versus_start"] is not None, model
    for name in ("rl_s1", "rl_tools_s1", "opd_s1", "opd_tools_s1"):
        assert not rows[name].get("skipped") and rows[name]["steps"] == scale.budget_steps, name
        assert rows[name]["versus_start"] is not None and rows[name]["problems"] == 8, name
        assert ("--tools calculator" in rows[name]["commands"][0]) == name.endswith("tools_s1"), name
    assert rows["rl_tools_s1"]["versus_base"] is not None and rows["opd_tools_s1"]["versus_base"] is not None
