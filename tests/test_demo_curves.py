# python -m pytest tests/test_demo_curves.py
"""benchmarks/demo_curves.py: the FLOPs and teacher tokens of each method's step against their definitions, the
comparisons at equal steps and at equal FLOPs on gradings written by hand, and the whole script on a small table."""
import json
import os
import shutil

import pytest

from benchmarks import demo_curves
from benchmarks.demo_curves import ROWS, comparisons, curves, nearest_in_flops, step_flops
from benchmarks.roofline import sequence_flops
from model import Qwen3Config

STUDENT = Qwen3Config.from_json("model/configs/qwen3-tiny.json")
TEACHER = Qwen3Config.from_json("model/configs/qwen3-demo.json")


def test_each_method_s_step_spends_its_phases():
    """Training (forward + backward) for everyone, the student's generation for the on-policy methods, the teacher's
    forward for KD, OPD and SFT on the teacher's answers: 16 sequences of p prompt and T / 16 answer tokens."""
    tokens, prompt = 1280.0, 56.0
    length, answer = prompt + tokens / ROWS, tokens / ROWS
    train = sequence_flops(STUDENT, length, answer, STUDENT.vocab_size, causal=True, backward=True)
    generate = sequence_flops(STUDENT, length, answer, STUDENT.vocab_size, causal=True, backward=False)
    score = sequence_flops(TEACHER, length, answer, TEACHER.vocab_size, causal=True, backward=False)
    assert train == pytest.approx(3 * generate)
    expected = {"sft_data": train + score, "kd": train + score, "opd": generate + score + train,
                "opd_lora": generate + score + train, "lf_rule": generate + train, "lf_vllm": generate + train,
                "rl": generate + train}
    for method, flops in expected.items():
        assert step_flops(method, tokens, prompt, STUDENT, TEACHER) == pytest.approx(ROWS * flops), method


def write_gradings(path, correct):
    with open(path, "w", encoding="utf-8") as f:
        for i, right in enumerate(correct):
            f.write(json.dumps({"index": i, "correct": right}) + "\n")


def table(root):
    """Two runs (KD and OPD, seed 1) graded at steps 8 and 64 on 6 problems, OPD's steps twice as many tokens."""
    rows = [{"name": "teacher", "method": None, "accuracy": 1.0, "curve": []},
            {"name": "student", "method": None, "accuracy": 0.0, "curve": []}]
    right = {("kd", 8): [1, 0, 0, 0, 0, 0], ("kd", 64): [1, 1, 1, 0, 0, 0],
             ("opd", 8): [0, 1, 1, 1, 0, 0], ("opd", 64): [1, 1, 1, 1, 1, 0]}
    for method, per_step in (("kd", 100), ("opd", 200)):
        curve = []
        for step in (8, 64):
            path = f"{method}_step{step}.jsonl"
            write_gradings(root / path, [bool(x) for x in right[method, step]])
            curve.append({"step": step, "accuracy": sum(right[method, step]) / 6, "gradings": path,
                          "tokens": per_step * step, "teacher_tokens": 0.0})
        rows.append({"name": f"{method}_s1", "label": method, "method": method, "seed": 1, "accuracy": None,
                     "curve": curve})
    return {"header": "### `python benchmarks/demo.py --task running_sum`: here", "rows": rows}


def test_comparisons_at_equal_steps_and_at_equal_flops(tmp_path):
    runs = curves(table(tmp_path), 50.0, STUDENT, TEACHER)
    kd, opd = runs
    assert [p["flops"] for p in kd["points"]] == pytest.approx(
        [step * step_flops("kd", 100, 50.0, STUDENT, TEACHER) for step in (8, 64)])
    assert [p["teacher_tokens"] for p in kd["points"]] == [ROWS * 50 * 8 + 800, ROWS * 50 * 64 + 6400]
    assert [p["teacher_tokens"] for p in opd["points"]] == [ROWS * 50 * 8 + 1600, ROWS * 50 * 64 + 12800]
    rows = comparisons(runs, str(tmp_path))
    assert {(r["basis"], r["step"], r["baseline_step"]) for r in rows} == {
        ("steps", 8, 8), ("steps", 64, 64), ("FLOPs", 8, 8), ("FLOPs", 64, 64)}
    at_8 = next(r for r in rows if r["basis"] == "steps" and r["step"] == 8)
    assert (at_8["only_method"], at_8["only_baseline"]) == (3, 1)  # problems 1-3 against problem 0
    # an OPD step costs more than a KD step: at KD's FLOPs of 64 steps, OPD's nearest point in ratio
    assert nearest_in_flops(opd["points"], kd["points"][1]["flops"])["step"] == 64
    assert nearest_in_flops(kd["points"], opd["points"][0]["flops"] * 4)["step"] == 64


def test_the_script_draws_the_figure_and_prints_the_comparisons(tmp_path, tiny_config_path, capsys):
    save_dir = tmp_path / "checkpoints" / "demo_running_sum"
    save_dir.mkdir(parents=True)
    (save_dir / "demo.json").write_text(json.dumps(table(tmp_path)))
    for name in ("teacher", "student"):
        (save_dir / name).mkdir()
        shutil.copy(tiny_config_path, save_dir / name / "config.json")
    out = tmp_path / "curves.png"
    result = demo_curves.main(["--task", "running_sum", "--out", str(out)], root=str(tmp_path))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(out) > 10_000
    assert len(result["comparisons"]) == 4
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "| opd | kd | 1 | steps | 8," in printed
