# python -m pytest tests/test_loop_shape.py
"""Each loop's `train()` reads as its algorithm (docs/architecture.md, "The loop"): no flag is checked there (each
loop's config, trainer/config/LOOP.py, does that at start-up), the teachers are asked once per micro-batch through
their one object, and what follows a step -- log, save, evaluate, stop -- is one call of the run. And no block of
code is written twice across the loop files: what they share lives in one place."""
import ast
import itertools
import os

import pytest

from support import ROOT

LOOPS = ("train_sft", "train_distillation", "train_opd", "train_rl", "train_logit_free", "train_ppo",
         "train_pretrain", "train_dpo")
WHITE_BOX = ("train_distillation", "train_opd", "train_rl")  # the loops with teachers' scores (RL: its OPD term)


def train_function(loop: str) -> ast.FunctionDef:
    with open(os.path.join(ROOT, "trainer", f"{loop}.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "train")


def calls(function: ast.FunctionDef) -> list[str]:
    """Every call in `function` as it is written: `name` or `object.name` (one level of attribute)."""
    names = []
    for node in ast.walk(function):
        if isinstance(node, ast.Call):
            target = node.func
            if isinstance(target, ast.Name):
                names.append(target.id)
            elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                names.append(f"{target.value.id}.{target.attr}")
    return names


def attributes_read(function: ast.FunctionDef) -> set[str]:
    return {f"{node.value.id}.{node.attr}" for node in ast.walk(function)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)}


@pytest.mark.parametrize("loop", LOOPS)
def test_train_checks_no_flag_and_ends_each_step_in_one_call(loop):
    function = train_function(loop)
    called = calls(function)
    refused = [name for name in called if name in ("refuse", "refuse_first", "parse_args")
               or name.split(".")[-1].startswith("validate_")]
    assert not refused, f"{loop}.train() checks flags: {refused} (the config's parse_args does)"
    assert called.count("run.end_step") == 1
    tail = {"run.log", "run.save", "run.save_due", "run.log_eval", "evaluator.due", "evaluator.evaluate"}
    assert not tail & set(called), f"{loop}.train() spells out the step's tail: {sorted(tail & set(called))}"
    assert not {"run.done", "run.stop_signal"} & attributes_read(function)
    assert called.count("run.finish") == 1 and called.count("run.optimizer_step") == 1


@pytest.mark.parametrize("loop", WHITE_BOX)
def test_the_teachers_are_one_object_asked_once_per_micro_batch(loop):
    called = calls(train_function(loop))
    assert called.count("open_teachers") == 1 and called.count("teachers.score") == 1
    protocol = {"split_by_teacher", "part_scores", "add_part_metrics", "load_teachers", "check_teachers", "routing",
                "say_teachers", "load_frozen", "teacher_scores"}
    assert not protocol & set(called), sorted(protocol & set(called))


def test_the_logit_free_loop_asks_its_black_box_teachers_in_one_call():
    called = calls(train_function("train_logit_free"))
    assert called.count("connect_teachers") == 1 and called.count("teachers.continue_batch") == 1
    assert "routing" not in called and "load_frozen" not in called


def code_lines(loop: str) -> list[str]:
    """A loop file's lines of code, whitespace-normalised: no blank lines, comments, docstring or imports (nor the
    line before them that puts the repository on sys.path)."""
    path = os.path.join(ROOT, "trainer", f"{loop}.py")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    tree = ast.parse(source)
    skip = set()
    for node in ast.walk(tree):
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(
            node.value.value, str)
        if isinstance(node, (ast.Import, ast.ImportFrom)) or docstring:
            skip.update(range(node.lineno, node.end_lineno + 1))
    lines = []
    for number, line in enumerate(source.splitlines(), start=1):
        text = line.split("  #")[0].strip()
        if number not in skip and text and not text.startswith(("#", "sys.path.insert(")):
            lines.append(" ".join(text.split()))
    return lines


BLOCK = 6


@pytest.mark.parametrize("one, other", list(itertools.combinations(LOOPS, 2)))
def test_no_block_of_code_is_written_twice_across_the_loops(one, other):
    def blocks(loop):
        lines = code_lines(loop)
        return {tuple(lines[i:i + BLOCK]) for i in range(len(lines) - BLOCK + 1)}
    shared = blocks(one) & blocks(other)
    assert not shared, f"{one}.py and {other}.py share {len(shared)} block(s) of {BLOCK} lines, e.g. {min(shared)}"
