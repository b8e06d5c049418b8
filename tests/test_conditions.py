# python -m pytest tests/test_conditions.py
"""benchmarks/conditions.py's measures against a direct computation: the argmax agreement and the student's mass in
the teacher's top k from the full logits of two tiny models' plain forwards, the first wrong step and the step
profile by hand, and the script end to end (a model as its own teacher agrees with itself everywhere)."""
import json

import pytest
import torch

from benchmarks import conditions
from common.errors import FlagError
from dataset.collators import IGNORE_INDEX, build_sequences
from dataset.make_demo_data import question
from model import Qwen3Config, create_model, save_pretrained

VOCAB = 151669  # the tokenizer's; the head's 151,936 rows include padding


@pytest.fixture
def models(tiny_config_path):
    config = Qwen3Config.from_json(tiny_config_path)
    return create_model(config, seed=0).eval(), create_model(config, seed=1).eval()


def test_token_sums_equal_the_full_logits_of_a_plain_forward(models, one_thread):
    student, teacher = models
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, VOCAB, (3, 5), generator=generator)
    prompt_mask = torch.ones(3, 5, dtype=torch.long)
    prompt_mask[1, :2] = 0  # left padded
    completion_ids = torch.randint(0, VOCAB, (3, 6), generator=generator)
    completion_mask = torch.ones(3, 6, dtype=torch.long)
    completion_mask[2, 3:] = 0  # ended early
    sequences = build_sequences(prompt_ids, prompt_mask, completion_ids, completion_mask)
    got = conditions.token_sums(student, teacher, sequences, VOCAB, chunk_tokens=5)
    input_ids, _, labels = sequences
    predicts = labels[:, 1:] != IGNORE_INDEX  # position t predicts labels[t + 1]
    with torch.no_grad():
        student_logits = student(input_ids).logits[:, :-1][predicts][:, :VOCAB]
        teacher_logits = teacher(input_ids).logits[:, :-1][predicts][:, :VOCAB]
    assert got["tokens"] == int(completion_mask.sum()) == len(student_logits)
    assert got["agree"] == float((student_logits.argmax(-1) == teacher_logits.argmax(-1)).sum())
    probabilities = student_logits.softmax(-1)
    for k in conditions.TOP_KS:
        top = teacher_logits.topk(k, dim=-1).indices
        direct = sum(float(probabilities[i, top[i]].sum()) for i in range(len(top)))
        assert got[f"mass@{k}"] == pytest.approx(direct, rel=1e-5)
    itself = conditions.token_sums(student, student, sequences, VOCAB)
    assert itself["agree"] == itself["tokens"]
    assert itself["mass@1"] == pytest.approx(float(probabilities.max(-1).values.sum()), rel=1e-5)


@pytest.mark.parametrize("numbers, answer, expected", [
    ((47, 38), "7+8=15, 4+3+1=8. \\boxed{85}", None),
    ((47, 38), "7+8=14, 4+3+1=8. \\boxed{85}", 0),
    ((47, 38), "7+8=15, 4+3+1=8. \\boxed{84}", 2),
    ((47, 38), "7+8=15, 4+3+1=8.", 2),
    ((37, 8, 5, 9), "a+b=37+8=45, 45+c=45+5=50, 50+d=50+9=59. \\boxed{59}", None),
    ((37, 8, 5, 9), "a+b=37+8=45, 45+c=45+5=51, 51+d=51+9=60. \\boxed{60}", 1),
    ((37, 8, 5, 9), "a+b=37+8=45, 45+c=45+6=51, 51+d=51+9=60. \\boxed{60}", 1),
    ((37, 8, 5, 9), "a+b=37+8=45, 45+c=45+5=50, 50+d=50+9=58. \\boxed{59}", 2),
    ((37, 8, 5, 9), "a+b=37+8=45, 45+c=45+5=50", 2),
    ((37, 8, 5, 9), "The answer is 59", 0),
])
def test_the_first_wrong_step_of_an_answer(numbers, answer, expected):
    assert conditions.first_wrong_step(question(numbers), answer) == expected


def test_the_step_profile_by_hand():
    profile = conditions.step_profile([None, 0, 2, 2, None], steps=4)
    assert profile["first_wrong"] == [0.2, 0.0, 0.4, 0.0]
    assert profile["right_through"] == [0.8, 0.8, 0.4, 0.4]


@pytest.mark.slow  # long for the fast tier: the whole suite runs it
def test_the_script_measures_a_model_against_itself(tiny_config_path, tmp_path, one_thread, capsys):
    """The student as its own teacher: agreement 1 on both kinds of prefix; the shares and masses are shares; one
    line printed and the JSON written (the running-sum task's first 4 held-out problems, 12 new tokens)."""
    folder = str(tmp_path / "model")
    save_pretrained(create_model(Qwen3Config.from_json(tiny_config_path), seed=0), folder)
    out = tmp_path / "conditions.json"
    results = conditions.main(["--student", folder, "--teacher", folder, "--task", "running_sum", "--rows", "4",
                               "--max_new_tokens", "12", "--json", str(out)])
    assert results["agreement_on_own_samples"] == results["agreement_on_teacher_answers"] == 1.0
    masses = list(results["top_k_mass_on_own_samples"].values())
    assert all(0 < m <= 1 for m in masses) and masses == sorted(masses)
    assert results["greedy_accuracy"] == 0.0 and results["greedy_steps"]["first_wrong"][0] == 1.0  # a random model
    assert len(results["greedy_steps"]["right_through"]) >= 7  # 5-7 numbers: 4-6 steps and the box
    assert json.loads(out.read_text())["rows"] == 4
    assert "agreement with the teacher's argmax: 100.0%" in capsys.readouterr().out


def test_a_demo_table_s_models_are_measured_in_turn(tiny_config_path, tmp_path, one_thread, capsys):
    """--table: the starting student, then each method's first seed (a skipped row left out), against the table's
    teacher, on the table's task; one Markdown line each."""
    config = Qwen3Config.from_json(tiny_config_path)
    for name, seed in (("teacher", 0), ("student_sft_step200", 1), ("kd_s1", 2)):
        save_pretrained(create_model(config, seed=seed), str(tmp_path / name))
    rows = [{"name": "teacher", "method": None, "seed": None, "label": "teacher", "skipped": None},
            {"name": "student_sft_step200", "method": None, "seed": None, "label": "student", "skipped": None},
            {"name": "kd_s1", "method": "kd", "seed": 1, "label": "KD", "skipped": None},
            {"name": "kd_s2", "method": "kd", "seed": 2, "label": "KD", "skipped": None},
            {"name": "rl_s1", "method": "rl", "seed": 1, "label": "RL", "skipped": "skipped: no"}]
    table = tmp_path / "demo.json"
    table.write_text(json.dumps({"scale": {"task": {"name": "running_sum"}}, "rows": rows}))
    results = conditions.main(["--table", str(table), "--rows", "2", "--max_new_tokens", "6"])
    assert results["task"] == "running_sum" and results["teacher"] == str(tmp_path / "teacher")
    assert [m["label"] for m in results["models"]] == ["the student (student_sft_step200)", "KD"]
    alone = conditions.main(["--student", str(tmp_path / "kd_s1"), "--teacher", str(tmp_path / "teacher"),
                             "--task", "running_sum", "--rows", "2", "--max_new_tokens", "6"])
    assert results["models"][1]["agreement_on_own_samples"] == alone["agreement_on_own_samples"]
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(lines) == 3 and lines[2].startswith("| KD | ")
    with pytest.raises(FlagError, match="pass --student and --teacher, or --table"):
        conditions.parse_args(["--student", "x"])


def test_a_table_written_before_the_long_task_is_the_addition_s(tmp_path):
    """Tables from before `--task` existed have no scale.task: theirs is the addition task."""
    rows = [{"name": "teacher", "method": None, "seed": None, "label": "teacher", "skipped": None},
            {"name": "teacher_step400", "method": None, "seed": None, "label": "student", "skipped": None},
            {"name": "opd_s1", "method": "opd", "seed": 1, "label": "OPD", "skipped": None}]
    table = tmp_path / "demo.json"
    table.write_text(json.dumps({"scale": {"model_config": "model/configs/qwen3-demo.json"}, "rows": rows}))
    task, teacher, models = conditions.table_models(str(table))
    assert task == "addition" and teacher == str(tmp_path / "teacher")
    assert models == [("the student (teacher_step400)", str(tmp_path / "teacher_step400")),
                      ("OPD", str(tmp_path / "opd_s1"))]
