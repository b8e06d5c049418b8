# python -m pytest tests/test_data.py
"""Row sources, SFT / prompt collators and the demo data, with the real Qwen3 tokenizer."""
import copy
import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dataset.collators import IGNORE_INDEX, PromptCollator, SFTCollator, split_conversation
from dataset.make_demo_data import VERSION, build_splits, ensure_demo_data, numbers_of, question, solve
from dataset.sources import DataError, RowDataset
from model.tokenizer import default_tokenizer_dir, load_tokenizer

THINK = "<think>\n\n</think>\n\n"
HEADER = "<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def chat(question: str, answer: str | None = None) -> dict:
    messages = [{"role": "user", "content": question}]
    if answer is not None:
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return str(path)


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def completion_ids(batch: dict, i: int) -> list[int]:
    return batch["input_ids"][i][batch["labels"][i] != IGNORE_INDEX].tolist()


def prompt_ids(batch: dict, i: int) -> list[int]:
    real = (batch["attention_mask"][i] == 1) & (batch["labels"][i] == IGNORE_INDEX)
    return batch["input_ids"][i][real].tolist()


# ---------------------------------------------------------------- SFT collator


def test_labels_mask_prompt_and_padding_and_right_padding(tok):
    rows = [chat("What is 2 + 3?", "5"), chat("Explain addition of two-digit numbers in detail, please.",
                                             "Add the tens, then the ones, then carry. " * 3)]
    batch = SFTCollator(tok, max_length=256, max_prompt_length=128)(rows)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == mask.shape == labels.shape and ids.dtype == labels.dtype == torch.long
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    for i, row in enumerate(rows):
        n_real = int(mask[i].sum())
        assert mask[i, :n_real].eq(1).all() and mask[i, n_real:].eq(0).all(), "padding must be on the right"
        assert ids[i, n_real:].eq(tok.pad_token_id).all()
        prompt_text = tok.apply_chat_template(row["messages"][:1], add_generation_prompt=True)
        n_prompt = len(tok.encode(prompt_text))
        # -100 exactly on prompt + padding, labels == input_ids on every completion position.
        assert labels[i, :n_prompt].eq(IGNORE_INDEX).all() and labels[i, n_real:].eq(IGNORE_INDEX).all()
        assert torch.equal(labels[i, n_prompt:n_real], ids[i, n_prompt:n_real])
        assert labels[i, n_prompt:n_real].ne(IGNORE_INDEX).all()
    assert int((mask[0] == 0).sum()) > 0, "the short row should be padded"


def test_uses_concatenated_tokenisation(tok):
    # Tokenising pieces separately differs from tokenising their concatenation ...
    assert tok.encode("\n") + tok.encode("\n") != tok.encode("\n\n")
    # ... so the collator tokenises the full conversation text once.
    row = chat("Say two blank lines.", "\n\nok\n\nbye")
    full = tok.apply_chat_template(row["messages"])
    batch = SFTCollator(tok, max_length=512, max_prompt_length=256)([row])
    assert batch["input_ids"][0].tolist() == tok.encode(full)


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_boundary_and_completion_equals_template_remainder(tok, enable_thinking):
    row = chat("What is 47 + 38?", "First 47 + 30 = 77, then 77 + 8 = 85. \\boxed{85}")
    batch = SFTCollator(tok, max_length=512, max_prompt_length=256, enable_thinking=enable_thinking)([row])
    prompt_text = tok.apply_chat_template(row["messages"][:1], add_generation_prompt=True,
                                          enable_thinking=enable_thinking)
    full_text = tok.apply_chat_template(row["messages"], enable_thinking=enable_thinking)
    completion = tok.decode(completion_ids(batch, 0))
    prompt = tok.decode(prompt_ids(batch, 0))
    assert prompt == prompt_text and completion == full_text[len(prompt_text):]
    if enable_thinking:  # the empty think block is part of what the model learns to write
        assert completion.startswith(THINK + "First") and prompt.endswith(HEADER)
    else:  # the template puts it into the prompt; the completion is the answer alone
        assert prompt.endswith(HEADER + THINK) and completion.startswith("First") and "<think>" not in completion
    assert completion.endswith("<|im_end|>\n")


def test_long_solution_keeps_prompt_and_ends_at_max_length(tok):
    row = chat("What is 1 + 1? Explain at great length.", "very " * 10_000)
    prompt_text = tok.apply_chat_template(row["messages"][:1], add_generation_prompt=True)
    batch = SFTCollator(tok, max_length=300, max_prompt_length=100)([row])
    assert batch["input_ids"].shape == (1, 300)
    assert batch["attention_mask"].all()
    assert tok.decode(prompt_ids(batch, 0)) == prompt_text
    assert len(completion_ids(batch, 0)) == 300 - len(tok.encode(prompt_text))


def test_long_prompt_keeps_its_end(tok):
    row = chat("blah " * 500 + "What is 2 + 2?", "4")
    collator = SFTCollator(tok, max_length=128, max_prompt_length=64)
    batch = collator([row])
    prompt = tok.decode(prompt_ids(batch, 0))
    assert len(prompt_ids(batch, 0)) == 64
    assert prompt.endswith("What is 2 + 2?<|im_end|>\n" + HEADER)
    # The completion is untouched by the prompt's truncation.
    full_text = tok.apply_chat_template(row["messages"])
    prompt_text = tok.apply_chat_template(row["messages"][:1], add_generation_prompt=True)
    assert tok.decode(completion_ids(batch, 0)) == full_text[len(prompt_text):]


def test_prompt_only_rows_and_batch_without_loss_tokens(tok):
    collator = SFTCollator(tok, max_length=128, max_prompt_length=64)
    batch = collator([chat("Hi"), chat("What is 3 + 4?")])
    assert batch["labels"].eq(IGNORE_INDEX).all()
    assert batch["attention_mask"].sum() > 0
    mixed = collator([chat("Hi"), chat("What is 3 + 4?", "7")])
    assert mixed["labels"][0].eq(IGNORE_INDEX).all() and mixed["labels"][1].ne(IGNORE_INDEX).any()


def test_multi_turn_trains_on_last_assistant_turn_only(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "ignored trailing turn"}]
    prompt, full = split_conversation(messages)
    assert prompt == messages[:4] and full == messages[:5]
    batch = SFTCollator(tok, max_length=256, max_prompt_length=128)([{"messages": messages}])
    assert tok.decode(completion_ids(batch, 0)) == THINK + "4<|im_end|>\n"


def test_full_text_matches_transformers(tok):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir())
    rows = [chat("What is 47 + 38? Put the final answer in \\boxed{}.", "First 47 + 30 = 77. \\boxed{85}"),
            {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "héllo"},
                          {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhi"}]}]
    for enable_thinking in (True, False):
        collator = SFTCollator(tok, max_length=512, max_prompt_length=256, enable_thinking=enable_thinking)
        batch = collator(rows if enable_thinking else rows[:1])
        for i, row in enumerate(rows if enable_thinking else rows[:1]):
            expected = reference.apply_chat_template(row["messages"], tokenize=False, enable_thinking=enable_thinking)
            real = batch["attention_mask"][i] == 1
            assert tok.decode(batch["input_ids"][i][real]) == expected
            assert batch["input_ids"][i][real].tolist() == reference(expected, add_special_tokens=False)["input_ids"]


def test_reasoning_without_thinking_is_a_clear_error(tok):
    # Qwen3's prompt under enable_thinking=False ends with an empty think block; a completion with real reasoning
    # cannot follow it, so the collator refuses instead of training on a misplaced boundary.
    row = chat("hi", "<think>\nhmm\n</think>\n\nhello")
    with pytest.raises(ValueError, match="enable_thinking=False"):
        SFTCollator(tok, max_length=128, max_prompt_length=64, enable_thinking=False)([row])
    batch = SFTCollator(tok, max_length=128, max_prompt_length=64, enable_thinking=True)([row])
    assert tok.decode(completion_ids(batch, 0)) == "<think>\nhmm\n</think>\n\nhello<|im_end|>\n"


def test_token_across_the_prompt_end_is_a_clear_error(tok):
    # A template whose generation prompt ends inside a word ("Hel" + "lo" tokenises as one token "Hello"): there is
    # no token boundary where the prompt ends, so the collator refuses instead of guessing one.
    odd = copy.copy(tok)
    odd.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}Hel{% endif %}")
    with pytest.raises(ValueError, match="across the end of the prompt"):
        SFTCollator(odd, max_length=64, max_prompt_length=32)([chat("Say: ", "Hello")])


def test_collator_rejects_impossible_budgets(tok):
    with pytest.raises(ValueError, match="max_prompt_length"):
        SFTCollator(tok, max_length=64, max_prompt_length=64)


# ---------------------------------------------------------------- prompt collator


def test_prompt_collator_left_pads_and_passes_metadata(tok):
    rows = [{**chat("What is 2 + 3?", "5"), "ground_truth": "5", "extra_info": {"index": 7}},
            {**chat("A much longer question about adding 12 and 30, please?"), "ground_truth": "42"}]
    out = PromptCollator(tok, max_prompt_length=64, enable_thinking=False)(rows)
    assert out["rows"] is rows and out["rows"][0]["extra_info"] == {"index": 7}
    mask = out["prompt_attention_mask"]
    assert mask[0, 0] == 0 and mask[1].all(), "shorter prompt is left padded"
    first = tok.decode(out["prompt_ids"][0][mask[0] == 1])
    assert first == tok.apply_chat_template(rows[0]["messages"][:1], add_generation_prompt=True,
                                            enable_thinking=False)
    assert first.endswith(HEADER + THINK) and "5<|im_end|>" not in first
    short = PromptCollator(tok, max_prompt_length=8)(rows)
    assert short["prompt_ids"].shape[1] == 8 and tok.decode(short["prompt_ids"][1]).endswith(HEADER)


# ---------------------------------------------------------------- sources


DAPO_ROW = {"data_source": "math_dapo", "prompt": [{"content": "What is 1+1?", "role": "user"}], "ability": "MATH",
            "reward_model": {"ground_truth": "2", "style": "rule"}, "extra_info": {"index": "a1"}}


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_dapo_rows_parquet_and_jsonl(tmp_path, fmt):
    rows = [DAPO_ROW, {**DAPO_ROW, "prompt": DAPO_ROW["prompt"] + [{"content": "2", "role": "assistant"}]}]
    writer = write_parquet if fmt == "parquet" else write_jsonl
    ds = RowDataset(writer(tmp_path / f"d.{fmt}", rows))
    assert len(ds) == 2
    assert ds[0]["messages"] == [{"role": "user", "content": "What is 1+1?"}]
    assert ds[1]["messages"][-1] == {"role": "assistant", "content": "2"}
    assert ds[0]["ground_truth"] == "2" and ds[0]["reward_model"] == DAPO_ROW["reward_model"]
    assert ds[0]["extra_info"] == {"index": "a1"} and ds[0]["data_source"] == "math_dapo"
    assert "prompt" not in ds[0]
    ds[0]["messages"] = None  # a consumer's change must not reach the dataset
    assert ds[0]["messages"]


def test_stringified_prompt_json_and_python_literal(tmp_path):
    turns = [{"role": "user", "content": "What's 2+2?"}, {"role": "assistant", "content": "4"}]
    rows = [{**DAPO_ROW, "prompt": json.dumps(turns)}, {**DAPO_ROW, "prompt": repr(turns)}]
    ds = RowDataset(write_parquet(tmp_path / "s.parquet", rows))
    assert ds[0]["messages"] == turns and ds[1]["messages"] == turns


def test_question_conversations_and_messages_columns(tmp_path):
    ds = RowDataset(write_jsonl(tmp_path / "q.jsonl", [
        {"question": "1+1?", "solution": "It is 2.", "answer": "2"},
        {"question": "2+2?"},
        {"conversations": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "id": 3},
    ]))
    assert ds[0]["messages"][1] == {"role": "assistant", "content": "It is 2."} and ds[0]["answer"] == "2"
    assert ds[1]["messages"] == [{"role": "user", "content": "2+2?"}]
    assert ds[2]["messages"][1]["content"] == "hello"
    assert ds[3]["id"] == 3 and ds[3]["messages"][0]["role"] == "system"


BAD_ROWS = {
    "unparseable": ({"prompt": "[{'role': 'user', 'content': 'hi'"}, "unparseable string"),
    "not a list": ({"prompt": {"role": "user", "content": "hi"}}, "not a list"),
    "no role": ({"prompt": [{"content": "hi"}]}, "no role"),
    "no content": ({"prompt": [{"role": "user"}]}, "no content"),
    "unknown role": ({"prompt": [{"role": "human", "content": "hi"}]}, "unknown role"),
    "empty content": ({"prompt": [{"role": "user", "content": "  "}]}, "empty content"),
    "no user": ({"prompt": [{"role": "system", "content": "s"}]}, "no user turn"),
    "assistant first": ({"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]},
                        "assistant turn before any user turn"),
    "no known column": ({"text": "hello"}, "none of the columns"),
}


@pytest.mark.parametrize("kind", sorted(BAD_ROWS))
def test_bad_rows_name_file_row_and_reason(tmp_path, kind):
    bad, reason = BAD_ROWS[kind]
    path = write_jsonl(tmp_path / "bad.jsonl", [DAPO_ROW, DAPO_ROW, bad])
    with pytest.raises(DataError, match=reason) as info:
        RowDataset(path)
    assert path in str(info.value) and "row 2 (line 3)" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bad_parquet_row_names_file_row_and_column(tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", [{"prompt": '[{"role": "user", "content": "ok"}]'},
                                                    {"prompt": "not a chat"}])
    with pytest.raises(DataError, match=r"row 1: column 'prompt': unparseable string") as info:
        RowDataset(path)
    assert path in str(info.value)


def test_invalid_jsonl_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(DAPO_ROW) + "\n{oops\n")
    with pytest.raises(DataError, match=r"row 1 \(line 2\): invalid JSON"):
        RowDataset(str(path))


# ---------------------------------------------------------------- demo data


def operand_pairs(rows) -> set[frozenset]:
    return {frozenset(map(int, re.findall(r"\d+", row["prompt"][0]["content"]))) for row in rows}


def test_demo_data_disjoint_deterministic_and_loadable(tmp_path, tok, capsys):
    splits = build_splits()
    assert splits == build_splits(), "demo data must not depend on anything but the fixed seed"
    pairs = {name: operand_pairs(rows) for name, rows in splits.items()}
    assert {name: len(p) for name, p in pairs.items()} == {name: len(r) for name, r in splits.items()}
    names = list(pairs)
    for i, first in enumerate(names):  # no operand pair in two files, in either order
        for second in names[i + 1:]:
            assert not pairs[first] & pairs[second], (first, second)

    paths = ensure_demo_data(str(tmp_path))
    assert set(paths) == {"sft_train", "opd_prompts", "eval", "val"}
    assert capsys.readouterr().out == f"writing the demo data to {tmp_path} (first use)\n", "first use is not silent"
    assert sorted(os.listdir(tmp_path)) == ["eval.parquet", "opd_prompts.parquet", "sft_train.parquet",
                                            "val.parquet"]
    mtime = os.path.getmtime(paths["eval"])
    assert ensure_demo_data(str(tmp_path)) == paths and os.path.getmtime(paths["eval"]) == mtime
    assert capsys.readouterr().out == ""
    sft, opd, held_out = (RowDataset(paths[k]) for k in ("sft_train", "opd_prompts", "eval"))
    assert len(sft) == 3000 and len(opd) == 512 and len(held_out) == 200
    row = sft[0]
    assert row["messages"][0]["content"].endswith("Put the final answer in \\boxed{}.")
    assert row["messages"][1]["content"].endswith(f"\\boxed{{{row['ground_truth']}}}")
    assert row["ability"] == "math" and row["reward_model"]["style"] == "rule"
    assert all(len(r["messages"]) == 1 for r in (opd[0], held_out[0]))
    batch = SFTCollator(tok, max_length=128, max_prompt_length=64)([sft[i] for i in range(64)])
    completion_lengths = (batch["labels"] != IGNORE_INDEX).sum(1)
    assert 20 <= int(completion_lengths.min()) and int(completion_lengths.max()) <= 32


def test_demo_data_from_an_earlier_version_is_rewritten(tmp_path, capsys):
    paths = ensure_demo_data(str(tmp_path))
    table = pq.read_table(paths["eval"])
    pq.write_table(table.replace_schema_metadata({"demo_version": "1"}), paths["eval"])
    capsys.readouterr()
    ensure_demo_data(str(tmp_path))
    assert capsys.readouterr().out == f"writing the demo data to {tmp_path} (written by an earlier version)\n"
    assert pq.read_schema(paths["eval"]).metadata[b"demo_version"] == VERSION.encode()


def test_demo_solutions_add_by_columns_and_a_shortcut_scores_nothing():
    """Every solution's steps are right and its box holds the sum; copying an operand, or writing one answer for
    every problem (the format alone), solves under 10% of the held-out problems."""
    assert solve(47, 38) == (85, "7+8=15, 4+3+1=8. \\boxed{85}")
    assert solve(23, 45) == (68, "3+5=8, 2+4=6. \\boxed{68}")
    assert solve(99, 99) == (198, "9+9=18, 9+9+1=19. \\boxed{198}")
    held_out = build_splits()["eval"]
    truths = [row["reward_model"]["ground_truth"] for row in held_out]
    operands = [re.findall(r"\d+", row["prompt"][0]["content"]) for row in held_out]
    for which in (0, 1):
        assert sum(o[which] == t for o, t in zip(operands, truths)) / len(truths) < 0.1
    assert max(truths.count(t) for t in set(truths)) / len(truths) < 0.1
    for row in build_splits()["sft_train"][:200]:
        a, b = map(int, re.findall(r"\d+", row["prompt"][0]["content"]))
        assert row["prompt"][1]["content"] == solve(a, b)[1]


# ---------------------------------------------------------------- the long-answer demo task


def running_sum_problems(rows) -> list[tuple[int, ...]]:
    """Each row's problem as the generator makes them distinct: the first number and the multiset of the digits."""
    numbers = [numbers_of(row["prompt"][0]["content"]) for row in rows]
    return [(n[0],) + tuple(sorted(n[1:])) for n in numbers]


def test_running_sum_data_is_disjoint_deterministic_long_and_in_its_own_folder(tmp_path, tok, capsys):
    """benchmarks/demo.py --task running_sum's data: no split holds another split's problem with its digits
    reordered (nor two of one), the same rows on every call, answers of 57-101 tokens with a median of at least 50
    (the addition's: 22), written to its own folder beside the addition files, which stay as they are."""
    splits = build_splits("running_sum")
    assert splits == build_splits("running_sum")
    problems = {name: running_sum_problems(rows) for name, rows in splits.items()}
    assert all(len(set(p)) == len(p) for p in problems.values())
    names = list(problems)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            assert not set(problems[first]) & set(problems[second]), (first, second)
    assert all(5 <= len(p) <= 7 and 10 <= p[0] <= 99 and 1 <= min(p[1:]) and max(p[1:]) <= 9
               for rows in problems.values() for p in rows)
    lengths = sorted(len(tok.encode(row["prompt"][1]["content"])) for row in splits["sft_train"])
    assert 57 <= lengths[0] and lengths[-1] <= 101 and lengths[len(lengths) // 2] >= 50
    paths = ensure_demo_data(str(tmp_path), task="running_sum")
    assert capsys.readouterr().out == f"writing the demo data to {tmp_path} (first use)\n"
    assert RowDataset(paths["eval"])[0]["data_source"] == "demo_running_sum"
    assert ensure_demo_data(task="running_sum")["eval"] == os.path.join(
        os.path.dirname(ensure_demo_data()["eval"]), "running_sum", "eval.parquet")


def exact_sum_distribution() -> dict[int, float]:
    """P(answer = t) under running_sum_problems' draw: a uniform 10..99 plus 4, 5 or 6 (equally likely) digits
    uniform in 1..9 (its rejection of repeated problems aside)."""
    distribution: dict[int, float] = {}
    for count in (4, 5, 6):
        digits = {0: 1.0}
        for _ in range(count):
            step: dict[int, float] = {}
            for total, p in digits.items():
                for d in range(1, 10):
                    step[total + d] = step.get(total + d, 0.0) + p / 9
            digits = step
        for total, p in digits.items():
            for first in range(10, 100):
                distribution[total + first] = distribution.get(total + first, 0.0) + p / 90 / 3
    return distribution


def test_running_sum_solutions_carry_every_total_and_grade_right_and_shortcuts_score_at_most_2_percent():
    """Every step names its number, writes its value and adds it to the last total; the grader takes every worked
    solution as right; a model that copies a number, stops after k < n - 1 steps (boxes a partial total), repeats
    its last total or writes the training set's most common answer for every problem solves at most 2% of the
    held-out problems, and no single answer is right on more than 1.2% of the problems the generator draws."""
    assert solve(47, 3, 8, 5) == (63, "a+b=47+3=50, 50+c=50+8=58, 58+d=58+5=63. \\boxed{63}")
    assert question((47, 3, 8, 5)) == "Let a=47, b=3, c=8, d=5. What is a+b+c+d? Put the final answer in \\boxed{}."
    assert numbers_of(question((47, 3, 8, 5))) == (47, 3, 8, 5) and numbers_of(question((47, 38))) == (47, 38)
    splits = build_splits("running_sum")
    from eval.grader import grade_batch
    graded = grade_batch([row["prompt"][1]["content"] for row in splits["sft_train"]],
                         [row["reward_model"]["ground_truth"] for row in splits["sft_train"]])
    assert all(g.correct for g in graded)
    held_out = splits["eval"]
    truths = [int(row["reward_model"]["ground_truth"]) for row in held_out]
    numbers = [numbers_of(row["prompt"][0]["content"]) for row in held_out]
    shortcuts = {f"copy number {i}": [n[i] for n in numbers] for i in range(5)}
    shortcuts.update({f"stop after {k} steps": [sum(n[:k + 1]) for n in numbers] for k in range(1, 4)})
    shortcuts["the total before the last"] = [sum(n[:-1]) for n in numbers]
    shortcuts["the last total repeated"] = [int(str(sum(n[:-1]))[-1] + str(sum(n[:-1]))) for n in numbers]
    training = [int(row["reward_model"]["ground_truth"]) for row in splits["sft_train"]]
    shortcuts["the training set's most common answer"] = [max(set(training), key=training.count)] * len(truths)
    for name, answers in shortcuts.items():
        assert sum(a == t for a, t in zip(answers, truths)) / len(truths) <= 0.02, name
    assert max(exact_sum_distribution().values()) <= 0.012
    for row in splits["sft_train"][:500]:
        assert row["prompt"][1]["content"] == solve(*numbers_of(row["prompt"][0]["content"]))[1]
