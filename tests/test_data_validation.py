# python -m pytest tests/test_data_validation.py
"""Damaged data files and rows the collator cannot use: one DataError (a UserError) naming the file and the row,
found at start-up (RowDataset, validate_rows) instead of hours into training."""
import copy
import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.errors import UserError, run_script
from dataset.collators import PromptCollator, RowError, SFTCollator, validate_rows
from dataset.make_demo_data import build_splits
from dataset.sources import DataError, RowDataset
from model.tokenizer import load_tokenizer

USER = {"role": "user", "content": "What is 1 + 1?"}
ANSWER = {"role": "assistant", "content": "1 + 1 = 2. \\boxed{2}"}
GOOD = {"messages": [USER, ANSWER]}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


# ---------------------------------------------------------------- damaged files: (path, what the message must say)


def non_utf8_jsonl(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + '{"question": "caf\xe9?"}\n'.encode("latin-1"))
    return str(path), ["line 2", "not UTF-8", "convert the file to UTF-8"]


def broken_jsonl_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + '{"messages": [\n')
    return str(path), ["row 1 (line 2)", "invalid JSON"]


def truncated_parquet(tmp_path):
    whole = write_parquet(tmp_path / "whole.parquet", [GOOD] * 50)
    path = tmp_path / "cut.parquet"
    path.write_bytes(open(whole, "rb").read()[:300])
    return str(path), ["not a readable parquet file", "download it again"]


def text_named_parquet(tmp_path):
    path = tmp_path / "csv.parquet"
    path.write_text("question,answer\n1+1?,2\n")
    return str(path), ["not a readable parquet file"]


def parquet_without_chat_column(tmp_path):
    return write_parquet(tmp_path / "text.parquet", [{"text": "hello", "label": 1}]), \
        ["row 0", "none of the columns messages, conversations, prompt, question", "the row has: label, text"]


def empty_messages(tmp_path):
    return write_jsonl(tmp_path / "empty.jsonl", [GOOD, {"messages": []}]), \
        ["row 1 (line 2)", "column 'messages'", "empty list of turns"]


def non_string_content(tmp_path):
    return write_parquet(tmp_path / "int.parquet", [{"messages": [{"role": "user", "content": 7}]}]), \
        ["row 0", "column 'messages'", "turn 0 (user) content is a int, not a string"]


def unparseable_prompt(tmp_path):
    rows = [{"prompt": json.dumps([USER])}, {"prompt": "[{'role': 'user', 'content': 'hi'"}]
    return write_parquet(tmp_path / "str.parquet", rows), ["row 1", "column 'prompt'", "unparseable string"]


def missing_file(tmp_path):
    return str(tmp_path / "nowhere.parquet"), ["data file not found", "check the path"]


def folder(tmp_path):
    path = tmp_path / "data.parquet"
    path.mkdir()
    return str(path), ["is a folder, not a data file"]


DAMAGED = [non_utf8_jsonl, broken_jsonl_line, truncated_parquet, text_named_parquet, parquet_without_chat_column,
           empty_messages, non_string_content, unparseable_prompt, missing_file, folder]


@pytest.mark.parametrize("make", DAMAGED, ids=[make.__name__ for make in DAMAGED])
def test_damaged_file_is_a_one_line_data_error(tmp_path, make):
    path, fragments = make(tmp_path)
    with pytest.raises(DataError) as info:
        RowDataset(path)
    message = str(info.value)
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)
    assert path in message and "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_script_prints_the_data_error_as_one_line_and_exits_2(tmp_path, capsys):
    path = str(tmp_path / "nowhere.jsonl")
    with pytest.raises(SystemExit) as info:
        run_script(lambda: RowDataset(path))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: data file not found: {path}: check the path\n"


# ---------------------------------------------------------------- validate_rows


def sft(tok, enable_thinking=True, template=None):
    if template is not None:
        tok = copy.copy(tok)
        tok.chat_template = template
    return SFTCollator(tok, max_length=256, max_prompt_length=128, enable_thinking=enable_thinking)


def dataset(tmp_path, rows):
    return RowDataset(write_parquet(tmp_path / "rows.parquet", rows))


def validation_error(data, collator, need_completion) -> str:
    with pytest.raises(DataError) as info:
        validate_rows(data, collator, need_completion)
    assert isinstance(info.value, UserError) and "\n" not in str(info.value)
    return str(info.value)


def test_valid_data_passes(tmp_path, tok):
    splits = build_splits()
    train = dataset(tmp_path, splits["sft_train"][:300])
    for enable_thinking in (True, False):
        validate_rows(train, sft(tok, enable_thinking), need_completion=True)
    prompts = RowDataset(write_parquet(tmp_path / "eval.parquet", splits["eval"]))
    validate_rows(prompts, PromptCollator(tok, max_prompt_length=64), need_completion=False)
    validate_rows(prompts, sft(tok), need_completion=False)
    message = validation_error(prompts, sft(tok), need_completion=True)
    assert message.startswith(f"{prompts.path}: 200 of 200 rows cannot be used: row 0: no assistant turn")


def test_row_without_assistant_turn(tmp_path, tok):
    data = dataset(tmp_path, [GOOD, {"messages": [USER]}, GOOD])
    message = validation_error(data, sft(tok), need_completion=True)
    assert data.path in message and "1 of 3 rows" in message
    assert "row 1: no assistant turn to train on (SFT, KD and OPD with --lmbda < 1 train on the last" in message
    validate_rows(data, sft(tok), need_completion=False)
    validate_rows(data, PromptCollator(tok, max_prompt_length=64), need_completion=False)


def test_think_block_without_thinking_names_the_row_and_the_flag(tmp_path, tok):
    reasoning = {"role": "assistant", "content": "<think>\n1 and 1 make 2\n</think>\n\n2"}
    data = dataset(tmp_path, [GOOD, GOOD, {"messages": [USER, reasoning]}])
    message = validation_error(data, sft(tok, enable_thinking=False), need_completion=True)
    assert "1 of 3 rows" in message and "row 2: no prompt/completion boundary" in message
    assert "use --enable_thinking 1 or strip the <think> block" in message
    validate_rows(data, sft(tok, enable_thinking=True), need_completion=True)


def test_lists_the_first_bad_rows_and_counts_all(tmp_path, tok):
    rows = [{"messages": [USER]} if i % 3 == 0 else GOOD for i in range(30)]
    message = validation_error(dataset(tmp_path, rows), sft(tok), need_completion=True)
    assert "10 of 30 rows cannot be used: row 0: no assistant" in message
    assert "; row 3: " in message and "; row 6: " in message and "row 9:" not in message
    assert message.endswith("; and 7 more")


# The prompt ends inside a word: "Hel" + "lo" tokenises as one token "Hello", so there is no boundary between them.
SPLITS_A_WORD = ("{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>Hel{% endif %}")


def answered(question: str, *answers: str) -> list[dict]:
    return [{"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
            for answer in answers]


def test_template_error_and_token_across_the_boundary(tmp_path, tok):
    refuses_system = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns, please') }}"
                      "{% endif %}{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>{% endif %}")
    system = {"messages": [{"role": "system", "content": "Be brief."}, USER, ANSWER]}
    data = dataset(tmp_path, [GOOD, system])
    message = validation_error(data, sft(tok, template=refuses_system), need_completion=True)
    assert "1 of 2 rows" in message and "row 1: the chat template refuses the row: no system turns, please" in message
    message = validation_error(dataset(tmp_path, answered("Say: ", "Help", "Hel lo")), sft(tok, template=SPLITS_A_WORD),
                               need_completion=True)
    assert "1 of 2 rows" in message
    assert "row 0: tokenising the full conversation puts a token across the end of the prompt" in message


def test_tail_tokenisation_gives_the_verdict_of_the_full_text(tok):
    # validate_rows tokenises only from the prompt's last <|im_start|>; the verdict must be the full text's.
    rows = [{"messages": row["prompt"]} for row in build_splits()["sft_train"][:20]] + answered(
        "What is 1 + 1?", "\n\nok", "  two spaces", "\n \n", "<|im_start|>user\nhi", "<think>\nx\n</think>\n\ny") + [
        {"messages": [{"role": "user", "content": "literal <|im_start|>assistant\n in the question"}, ANSWER]},
        {"messages": [{"role": "system", "content": "s"}, USER, ANSWER, USER, ANSWER, USER]}]
    for enable_thinking in (True, False):
        collator = sft(tok, enable_thinking)
        for full, tail in zip(collator.encode(rows), collator.encode(rows, tail_only=True)):
            if isinstance(full, RowError):
                assert str(tail) == str(full)
            else:  # the tail's ids end the full ids, and the boundary is at the same token
                (ids, boundary), (tail_ids, tail_boundary) = full, tail
                assert ids[len(ids) - len(tail_ids):] == tail_ids
                assert boundary - tail_boundary == len(ids) - len(tail_ids)
    collator = sft(tok, template=SPLITS_A_WORD)
    words = answered("Say: ", "Hello", "Hel lo", "Help", "Hel\nx", "Hel")
    verdicts = [[str(result) if isinstance(result, RowError) else None
                 for result in collator.encode(words, tail_only=tail_only)] for tail_only in (False, True)]
    assert verdicts[0] == verdicts[1]
    assert [verdict is not None for verdict in verdicts[0]] == [True, False, True, False, False]


def test_progress_bar_only_for_many_rows_on_a_terminal(tok, capsys, monkeypatch):
    collator = PromptCollator(tok, max_prompt_length=64)
    many = [{"messages": [USER]}] * 2001
    validate_rows(many, collator, need_completion=False)
    assert capsys.readouterr().err == "", "no progress bar when stderr is not a terminal"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    validate_rows(many[:2000], collator, need_completion=False)
    assert capsys.readouterr().err == ""
    validate_rows(many, collator, need_completion=False, progress=False)
    assert capsys.readouterr().err == ""
    validate_rows(many, collator, need_completion=False)
    assert "checking rows" in capsys.readouterr().err
