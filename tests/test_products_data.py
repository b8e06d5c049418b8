# python -m pytest -q -n 0 tests/test_products_data.py
"""The products demo task (dataset/make_demo_data.py --task products): a three-digit number times a two-digit one,
each training problem once with the calculator and once by hand. Its problems are disjoint across the splits and the
same on every call; every conversation with the calculator renders in rollout order and its tool result is what
run_tool_call answers for the call the turn renders (the calculator's own schema in the `tools` column); every
hand-worked step is right and the grader takes both answers; the files load and pass the start-up check."""
import json
import os
import re

import pytest

from dataset.collators import PromptCollator, SFTCollator, validate_rows
from dataset.make_demo_data import (SPLIT_SIZES, TASKS, build_splits, by_hand, ensure_demo_data, file_names,
                                    numbers_of, split_problems)
from dataset.sources import RowDataset
from dataset.tool_conversation import ToolResponder, conversation_ids, tool_calls_in
from eval.grader import grade_batch
from tools.calculator import CALCULATOR
from tools.calls import run_tool_call
from tools.registry import ToolRegistry

PRODUCT = re.compile(r"^What is (\d+) \* (\d+)\? Put the final answer in \\boxed\{\}\.$")
HAND = re.compile(r"^(\d+)\*(\d)=(\d+), (\d+)\*(\d+)=(\d+), (\d+)\+(\d+)=(\d+)\. \\boxed\{(\d+)\}$")


@pytest.fixture(scope="module")
def files() -> dict[str, list[dict]]:
    return build_splits("products")


def problem(row: dict) -> tuple[int, int]:
    a, b = PRODUCT.match(row["prompt"][0]["content"]).groups()
    return int(a), int(b)


def test_the_files_hold_disjoint_problems_the_same_on_every_call(files):
    """Each prompt split twice (without tools, and SPLIT_tools with the calculator: the same problems in the same
    order), sft_train each of its problems twice in a row (with the calculator, then by hand); no problem in two
    splits; a in 100..999, b in 10..99; the ground truth the product."""
    assert files == build_splits("products")
    assert sorted(files) == sorted(file_names("products")) and len(files) == 7
    problems = {split: [problem(row) for row in files[split]] for split in SPLIT_SIZES}
    assert problems["sft_train"][0::2] == problems["sft_train"][1::2] == split_problems("products")["sft_train"]
    assert [bool(row["tools"]) for row in files["sft_train"][:4]] == [True, False, True, False]
    distinct = {split: set(p) for split, p in problems.items()}
    assert {split: len(p) for split, p in distinct.items()} == SPLIT_SIZES
    splits = list(distinct)
    for i, first in enumerate(splits):
        for second in splits[i + 1:]:
            assert not distinct[first] & distinct[second], (first, second)
    for split in SPLIT_SIZES:
        if split == "sft_train":
            continue
        plain, with_tools = files[split], files[f"{split}_tools"]
        assert [problem(row) for row in with_tools] == problems[split]
        assert all(row["tools"] is None and len(row["prompt"]) == 1 for row in plain)
        assert all({**row, "tools": None} == other for row, other in zip(with_tools, plain))
    for rows in files.values():
        for row in rows:
            a, b = problem(row)
            assert 100 <= a <= 999 and 10 <= b <= 99
            assert row["reward_model"]["ground_truth"] == str(a * b) and row["data_source"] == "demo_products"
            assert numbers_of(row["prompt"][0]["content"]) is None  # never read as a sum (the rule teacher's)


def test_the_tools_column_is_the_calculators_own_schema(files):
    tool_rows = [row for rows in files.values() for row in rows if row["tools"] is not None]
    assert len(tool_rows) == 3000 + 512 + 200 + 200
    assert all(json.loads(row["tools"]) == [CALCULATOR.schema()] for row in tool_rows)


def test_every_calculator_conversation_calls_on_the_question_and_reads_back_the_calculators_answer(files):
    """The call's expression is the question's, the tool message what the calculator answers (the product), the
    last turn writes it and boxes it."""
    for row in files["sft_train"][0::2]:
        a, b = problem(row)
        user, call, result, answer = row["prompt"]
        assert call["content"] == "" and call["tool_calls"] == [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}}]
        assert result == {"role": "tool", "content": CALCULATOR.function({"expression": f"{a} * {b}"})}
        assert result["content"] == str(a * b)
        assert answer == {"role": "assistant", "content": f"{a} * {b} = {a * b}. \\boxed{{{a * b}}}"}


@pytest.mark.parametrize("thinking", [False, True])
def test_the_calculators_answer_is_what_a_rollout_gets_for_the_call_the_turn_renders(qwen, files, thinking):
    """conversation_ids renders each conversation in rollout order; the call text in its first turn, run by
    run_tool_call, answers the tool message's content, and the rollout's responder appends exactly the results and
    generation prompt the rendering holds (on a sample: each call forks a process)."""
    registry = ToolRegistry([CALCULATOR])
    responder = ToolResponder(qwen, lambda text: run_tool_call(registry, text), enable_thinking=thinking)
    for row in files["sft_train"][0:120:2]:
        messages = row["prompt"]
        ids, mask = conversation_ids(qwen, messages, json.loads(row["tools"]), thinking)
        first = mask.index(1)
        end = first + mask[first:].index(0)  # the first turn, through its <|im_end|>
        calls = tool_calls_in(qwen.decode(ids[first:end - 1]))
        assert [run_tool_call(registry, call) for call in calls] == [messages[2]["content"]]
        appended = responder(ids[first:end])
        assert ids[end:end + len(appended)] == appended and mask[end:end + len(appended)] == [0] * len(appended)
        assert responder(ids[end + len(appended):]) is None  # the answer calls nothing: the rollout ends


def test_hand_worked_solutions_multiply_by_the_digits_of_b_and_every_answer_grades_right(files):
    """a*(ones of b), a*(tens of b, with its zero), their sum, the box: every step right; the grader takes the
    boxed answers of both kinds of rows."""
    assert by_hand(123, 45) == (5535, "123*5=615, 123*40=4920, 615+4920=5535. \\boxed{5535}")
    assert by_hand(250, 30) == (7500, "250*0=0, 250*30=7500, 0+7500=7500. \\boxed{7500}")
    for row in files["sft_train"][1::2]:
        a, b = problem(row)
        steps = HAND.match(row["prompt"][1]["content"]).groups()
        a1, ones, p1, a2, tens, p2, s1, s2, total, boxed = map(int, steps)
        assert (a1, ones, a2, tens) == (a, b % 10, a, b - b % 10)
        assert (p1, p2) == (a * ones, a * tens) and (s1, s2) == (p1, p2) and total == boxed == p1 + p2 == a * b
    answers = [row["prompt"][-1]["content"] for row in files["sft_train"][:400]]
    truths = [row["reward_model"]["ground_truth"] for row in files["sft_train"][:400]]
    assert all(graded.correct for graded in grade_batch(answers, truths))
    truths = [row["reward_model"]["ground_truth"] for row in files["eval"]]
    assert max(truths.count(t) for t in set(truths)) <= 2  # no answer is right by chance on the held-out problems


@pytest.mark.parametrize("thinking", [False, True])
def test_the_written_files_load_and_every_row_passes_the_start_up_check(qwen, tmp_path, capsys, thinking):
    """Seven files in the task's folder, written once; the tools column read back as the schema list, the calls'
    arguments as objects; every training row (both kinds) collated by SFT, every prompt row by the prompt collator's
    start-up check. Tool rows are 281-284 tokens (prompt 212 with thinking off); the rest under 90."""
    paths = ensure_demo_data(str(tmp_path), task="products")
    assert capsys.readouterr().out.startswith(f"writing the demo data to {tmp_path}")
    assert sorted(os.listdir(tmp_path)) == sorted(f"{name}.parquet" for name in file_names("products"))
    assert ensure_demo_data(str(tmp_path), task="products") == paths and capsys.readouterr().out == ""
    train = RowDataset(paths["sft_train"])
    assert len(train) == 6000 and train[0]["tools"] == [CALCULATOR.schema()] and train[1].get("tools") is None
    a, b = problem({"prompt": train[0]["messages"]})
    assert train[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"expression": f"{a} * {b}"}
    collator = SFTCollator(qwen, max_length=288, max_prompt_length=216, enable_thinking=thinking)
    validate_rows(train, collator, need_completion=True)
    batch = collator([train[i] for i in range(8)])
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    assert all(281 <= n <= 284 for n in lengths[0::2]) and all(n < 90 for n in lengths[1::2])
    prompts = PromptCollator(qwen, max_prompt_length=216, enable_thinking=thinking)
    for name in file_names("products"):
        if name != "sft_train":
            validate_rows(RowDataset(paths[name]), prompts, need_completion=False)
    assert RowDataset(paths["eval_tools"])[0]["tools"] == [CALCULATOR.schema()]
    assert RowDataset(paths["eval"])[0].get("tools") is None
    assert TASKS["products"].folder == "products"
