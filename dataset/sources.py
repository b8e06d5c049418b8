"""Row sources: a .parquet or .jsonl file -> a map-style Dataset of chat rows.

`RowDataset(path)[i]` is a dict with

- `messages`: a list of `{"role", "content"}` turns (other non-null keys of a turn, such as `reasoning_content`,
  are kept, because Qwen3's chat template reads them);
- every other column of the row, unchanged (DAPO's `data_source`, `ability`, `reward_model`, `extra_info` ...),
  except the column(s) that were turned into `messages`, which are dropped (they are in `messages` now);
- `ground_truth`: DAPO's `reward_model["ground_truth"]`, lifted to the top level when the row has it (a top-level
  `ground_truth` column, if present, wins and is left alone).

Where `messages` comes from, first match wins (a column whose value is null in a row counts as absent in that row):

1. `messages`       a chat list, as is.
2. `conversations`  minimind's SFT files: a chat list, as is.
3. `prompt`         DAPO: despite its name, a chat list `[{user}]` or `[{user}, {assistant}]`.
4. `question`       plain text, wrapped as one user turn. The assistant turn, if any, is the first non-null of
                    `response`, `solution`, `answer` (in that order: a worked solution is what SFT should imitate,
                    and in MATH-style data `answer` is often only the final number). The other two stay as metadata.

A chat list may be stored as a string (some exports stringify it): it is parsed as JSON first, then as a Python
literal (`ast.literal_eval`, never `eval`), because both spellings occur in the wild.

Rows are validated once, when the dataset is built, so a broken row stops the run at start-up instead of at step
5,000. A row that cannot be understood raises `DataError` naming the file, the row number (0-based; jsonl also gives
the 1-based line), the column and the reason: unparseable string, not a list, a turn that is not a dict or lacks
role/content, an unknown role, non-string or empty content, no user turn, an assistant turn before any user turn, or
none of the columns above. Valid roles are system, user, assistant and tool (the roles Qwen3's template renders).
A `tools` column (OpenAI function-tool schemas, or their JSON text) is checked by `normalize_tools`, an assistant
turn's `tool_calls` by `_check_tool_calls` (OpenAI's form); an assistant turn with calls may have empty or null
content (null becomes ""). docs/data.md "Tools and tool messages".
A file that cannot be read is a `DataError` as well: missing, a folder, not UTF-8 (jsonl; the line is named), a
line that is not JSON, a damaged parquet file. `DataError` is a `common.errors.UserError`: scripts print it as one
line and exit with code 2. Whether the collator can render every row is checked by `dataset.collators.validate_rows`.

Speed: parquet columns are read with pyarrow's `to_pylist` once and every row is normalised when the dataset is
built; `__getitem__` is a list lookup plus a shallow copy (17,000 DAPO rows load in well under a second).
The chat template is NOT applied here: that happens in the collator, so `enable_thinking` is decided in one place.

`PairDataset(path)`: preference pairs (trainer/train_dpo.py), read by the same readers. Its schema is decided by the
file's first row and every row must have it (`PAIR_SCHEMAS`, docs/training.md "DPO"):

    conversational  TRL's: `prompt` a chat list, `chosen` and `rejected` each a list of one assistant turn
    standard        TRL's standard form: `prompt`, `chosen` and `rejected` plain strings, rendered as one user turn
                    and one assistant turn (TRL tokenises such text without a template; here every row goes through
                    the chat template, as SFT's `question` rows do)
    implicit        TRL's implicit prompt, minimind's DPO files: `chosen` and `rejected` each a whole conversation
                    ending with an assistant turn; the prompt is the turns before it, which must be the same in both
Each pair row is {"prompt": messages, "chosen": [assistant turn], "rejected": [assistant turn], "ground_truth" when
the row has one (as above), the other columns}.
"""
from __future__ import annotations

import ast
import json
import os
from typing import Any

from torch.utils.data import Dataset

from common.errors import UserError

VALID_ROLES = ("system", "user", "assistant", "tool")
PAIR_SCHEMAS = ("conversational", "standard", "implicit")
CHAT_COLUMNS = ("messages", "conversations", "prompt")
ASSISTANT_COLUMNS = ("response", "solution", "answer")


class DataError(UserError, ValueError):
    """A data file or row that cannot be used. The message names the file, the row and the column where they apply."""


class _RowError(Exception):
    """Raised inside row parsing; `RowDataset` adds the file and row number and re-raises it as DataError."""

    def __init__(self, column: str | None, reason: str):
        super().__init__(reason)
        self.column = column
        self.reason = reason


def _parse_chat_string(text: str, column: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as json_error:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as literal_error:
            raise _RowError(column, f"unparseable string (not JSON: {json_error}; not a Python literal: "
                                    f"{literal_error}); a plain-text question belongs in a `question` column. "
                                    f"Starts with: {text[:80]!r}") from None


def _validate_turns(turns: Any, column: str) -> list[dict]:
    """Check a chat list and return normalised copies of its turns (null keys dropped)."""
    if isinstance(turns, str):
        turns = _parse_chat_string(turns, column)
    if not isinstance(turns, list):
        raise _RowError(column, f"not a list of turns but {type(turns).__name__}")
    if not turns:
        raise _RowError(column, "empty list of turns (no user turn)")
    messages, seen_user = [], False
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise _RowError(column, f"turn {k} is a {type(turn).__name__}, not a dict with role and content")
        role, content = turn.get("role"), turn.get("content")
        if turn.get("tool_calls") is not None:
            _check_tool_calls(turn["tool_calls"], column, k, role)
        calls = bool(turn.get("tool_calls"))
        if calls and content is None:
            # OpenAI writes a call-only turn's content as null; Qwen3's template needs text (under transformers too)
            content = ""
            turn = {**turn, "content": content}
        if role is None or content is None:
            raise _RowError(column, f"turn {k} has no {'role' if role is None else 'content'} (keys: {sorted(turn)})")
        if role not in VALID_ROLES:
            raise _RowError(column, f"turn {k} has unknown role {role!r} (expected one of {VALID_ROLES})")
        if not isinstance(content, str):
            raise _RowError(column, f"turn {k} ({role}) content is a {type(content).__name__}, not a string")
        if not content.strip() and not calls:
            raise _RowError(column, f"turn {k} ({role}) has empty content")
        if role == "assistant" and not seen_user:
            raise _RowError(column, f"turn {k} is an assistant turn before any user turn")
        seen_user = seen_user or role == "user"
        # Parquet structs give None for keys another row had; drop them so the template sees only real keys.
        messages.append({key: value for key, value in turn.items() if value is not None})
    if not seen_user:
        raise _RowError(column, "no user turn")
    return messages


def _check_tool_calls(calls: Any, column: str, k: int, role: Any) -> None:
    """An assistant turn's `tool_calls` in OpenAI's form: [{"type": "function", "function": {"name": ...,
    "arguments": {...} or the JSON text of an object}}, ...] ("type" may be left out; "id" and other keys are kept)."""
    where = f"turn {k} ({role}) tool_calls"
    if role != "assistant":
        raise _RowError(column, f"turn {k} ({role}) has tool_calls: only an assistant turn calls tools")
    if not isinstance(calls, list):
        raise _RowError(column, f"{where} is a {type(calls).__name__}, not a list")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise _RowError(column, f"{where}[{j}] is not OpenAI's {{\"type\": \"function\", \"function\": "
                                    f"{{\"name\", \"arguments\"}}}}: {str(call)[:80]}")
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name:
            raise _RowError(column, f"{where}[{j}] has no function name")
        if isinstance(arguments, str):
            arguments = _json_object(arguments)
        if not isinstance(arguments, dict):
            raise _RowError(column, f"{where}[{j}] ({name}): arguments are neither an object nor the JSON text of "
                                    f"one: {repr(function.get('arguments'))[:80]}")


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def normalize_tools(tools: Any) -> list[dict]:
    """A row's `tools` column (a list, or its JSON text) -> the list of OpenAI function-tool schemas
    [{"type": "function", "function": {"name", "description", "parameters"}}, ...]: what the chat template lists."""
    if isinstance(tools, str):
        tools = _json_object(tools)
        if tools is None:
            raise _RowError("tools", "a string that is not JSON: give a list of function-tool schemas")
    if not isinstance(tools, list):
        raise _RowError("tools", f"not a list of function-tool schemas but {type(tools).__name__}")
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type") != "function":
            raise _RowError("tools", f"entry {j} is not OpenAI's {{\"type\": \"function\", \"function\": {{\"name\", "
                                     f"\"description\", \"parameters\"}}}}: {str(tool)[:80]}")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise _RowError("tools", f"entry {j} has no function name")
        for key, kind in (("description", str), ("parameters", dict)):
            if function.get(key) is not None and not isinstance(function[key], kind):
                raise _RowError("tools", f"entry {j} ({function['name']}): {key} is a "
                                         f"{type(function[key]).__name__}, not a {kind.__name__}")
    return tools


def _question_messages(row: dict) -> tuple[list[dict], list[str]]:
    """`question` (+ the first non-null of response/solution/answer) -> messages, and the columns consumed."""
    question = row["question"]
    if not isinstance(question, str):
        raise _RowError("question", f"not a string but {type(question).__name__}")
    turns, consumed = [{"role": "user", "content": question}], ["question"]
    for column in ASSISTANT_COLUMNS:
        if row.get(column) is not None:
            if not isinstance(row[column], str):
                raise _RowError(column, f"not a string but {type(row[column]).__name__}")
            turns.append({"role": "assistant", "content": row[column]})
            consumed.append(column)
            break
    return _validate_turns(turns, "+".join(consumed)), consumed


def normalize_row(row: dict) -> dict:
    """One raw row (a dict of columns) -> a row with `messages` (and `ground_truth` when DAPO has one)."""
    for column in CHAT_COLUMNS:
        if row.get(column) is not None:
            messages, consumed = _validate_turns(row[column], column), [column]
            break
    else:
        if row.get("question") is None:
            raise _RowError(None, f"none of the columns {', '.join(CHAT_COLUMNS + ('question',))} has a value "
                                  f"(the row has: {', '.join(sorted(row)) or 'no columns'}): rename the column that "
                                  f"holds the chat list or the question")
        messages, consumed = _question_messages(row)
    out = {key: value for key, value in row.items() if key not in consumed}
    out["messages"] = messages
    if row.get("tools") is not None:
        out["tools"] = normalize_tools(row["tools"])
    reward_model = row.get("reward_model")
    if "ground_truth" not in out and isinstance(reward_model, dict) and "ground_truth" in reward_model:
        out["ground_truth"] = reward_model["ground_truth"]
    return out


def _read_parquet(path: str) -> list[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
        # Column-wise to_pylist is one C++ pass per column; zipping the lists is cheaper than table.to_pylist().
        columns = {name: table.column(name).to_pylist() for name in table.column_names}
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({' '.join(str(e).split())}): the file is damaged, cut short or "
                        f"not parquet; export or download it again") from None
    names = list(columns)
    return [(f"row {i}", dict(zip(names, values))) for i, values in enumerate(zip(*columns.values()))]


def decode_line(raw_line: bytes, path: str, line_no: int) -> str:
    try:
        return raw_line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: line {line_no}: not UTF-8 (byte {e.start + 1} of the line is "
                        f"{raw_line[e.start:e.start + 1]!r}): convert the file to UTF-8") from None


def _read_jsonl(path: str) -> list[tuple[str, dict]]:
    rows = []
    try:
        with open(path, "rb") as f:
            # Lines are decoded one by one (not by a text-mode file) so that bad bytes are reported with their line.
            for line_no, raw_line in enumerate(f, start=1):
                line = decode_line(raw_line, path, line_no)
                if not line.strip():
                    continue
                where = f"row {len(rows)} (line {line_no})"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: {where}: invalid JSON: {e}") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}: {where}: a JSON {type(row).__name__}, expected an object of columns")
                rows.append((where, row))
    except OSError as e:
        raise DataError(f"{path}: cannot read the file ({e.strerror}): check that you may read it") from None
    return rows


def _check_path(path: str) -> None:
    if os.path.isdir(path):
        raise DataError(f"{path} is a folder, not a data file: give the .parquet or .jsonl file itself")
    if not os.path.exists(path):
        where = "" if os.path.isabs(path) else f" (looked for {os.path.abspath(path)})"
        raise DataError(f"data file not found: {path}{where}: check the path")


class RowDataset(Dataset):
    """Map-style dataset over a .parquet or .jsonl file of chat rows; see the module docstring for the format."""

    def __init__(self, path: str):
        _check_path(path)
        self.path = path
        if path.endswith(".parquet"):
            raw = _read_parquet(path)
        elif path.endswith(".jsonl"):
            raw = _read_jsonl(path)
        else:
            raise DataError(f"{path}: unsupported file type: convert it to .parquet or .jsonl")
        if not raw:
            raise DataError(f"{path}: the file holds no rows")
        self._rows = [self._normalize(where, row) for where, row in raw]

    def _normalize(self, where: str, row: dict) -> dict:
        try:
            return normalize_row(row)
        except _RowError as e:
            column = "" if e.column is None else f"column {e.column!r}: "
            raise DataError(f"{self.path}: {where}: {column}{e.reason}") from None

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict:
        # A shallow copy, so a consumer that adds keys cannot change the dataset; do not mutate `messages` in place.
        # `row_index` identifies the row for seeds that must not depend on batching (OPD's per-row sampling).
        return {**self._rows[index], "row_index": index}


def pair_schema(row: dict) -> str:
    """Which of PAIR_SCHEMAS a preference row is written in (PairDataset decides a file's from its first row)."""
    missing = [column for column in ("chosen", "rejected") if row.get(column) is None]
    if missing:
        raise _RowError(None, f"no {' and no '.join(repr(c) for c in missing)} column: a preference pair needs "
                              f"`prompt`, `chosen` and `rejected` (TRL's schema) or whole `chosen` and `rejected` "
                              f"conversations (minimind's; the row has: {', '.join(sorted(row)) or 'no columns'})")
    if row.get("prompt") is None:
        return "implicit"
    return "standard" if isinstance(row["prompt"], str) and isinstance(row["chosen"], str) else "conversational"


def _one_answer(turns: Any, column: str) -> list[dict]:
    """A conversational pair's `chosen` / `rejected`: exactly one assistant turn."""
    if isinstance(turns, str):
        turns = _parse_chat_string(turns, column)
    if not isinstance(turns, list) or len(turns) != 1 or not isinstance(turns[0], dict) \
            or turns[0].get("role") != "assistant":
        raise _RowError(column, "not a list of exactly one assistant turn [{\"role\": \"assistant\", \"content\": "
                                "...}] (TRL's conversational schema)")
    content = turns[0].get("content")
    if not isinstance(content, str) or not content.strip():
        raise _RowError(column, "the assistant turn's content is not a non-empty string")
    return [{key: value for key, value in turns[0].items() if value is not None}]


def normalize_pair(row: dict, schema: str) -> dict:
    """One raw preference row in `schema` -> {"prompt", "chosen", "rejected", ground_truth, the other columns}."""
    if pair_schema(row) != schema:
        raise _RowError(None, f"written in the {pair_schema(row)} schema, but the file's first row is {schema}: one "
                              f"schema per file")
    if schema == "standard":
        for column in ("prompt", "chosen", "rejected"):
            if not isinstance(row[column], str) or not row[column].strip():
                raise _RowError(column, "not a non-empty string (the standard schema: prompt, chosen and rejected "
                                        "are plain text)")
        prompt = [{"role": "user", "content": row["prompt"]}]
        chosen, rejected = ([{"role": "assistant", "content": row[c]}] for c in ("chosen", "rejected"))
    elif schema == "conversational":
        prompt = _validate_turns(row["prompt"], "prompt")
        chosen, rejected = _one_answer(row["chosen"], "chosen"), _one_answer(row["rejected"], "rejected")
    else:
        (prompt, chosen), (other, rejected) = (_split_last_answer(row[c], c) for c in ("chosen", "rejected"))
        if other != prompt:
            raise _RowError("rejected", "its turns before the last assistant turn differ from chosen's: the two "
                                        "conversations must share their prompt")
    out = {key: value for key, value in row.items() if key not in ("prompt", "chosen", "rejected")}
    if row.get("tools") is not None:
        out["tools"] = normalize_tools(row["tools"])
    reward_model = row.get("reward_model")
    if "ground_truth" not in out and isinstance(reward_model, dict) and "ground_truth" in reward_model:
        out["ground_truth"] = reward_model["ground_truth"]
    return {**out, "prompt": prompt, "chosen": chosen, "rejected": rejected}


def _split_last_answer(turns: Any, column: str) -> tuple[list[dict], list[dict]]:
    """An implicit-prompt conversation -> (the turns before its last, [its last, an assistant turn])."""
    messages = _validate_turns(turns, column)
    if messages[-1]["role"] != "assistant":
        raise _RowError(column, "does not end with an assistant turn (the implicit schema: a whole conversation "
                                "whose last assistant turn is the answer)")
    return messages[:-1], messages[-1:]


class PairDataset(RowDataset):
    """Map-style dataset of preference pairs over a .parquet or .jsonl file; see the module docstring."""

    def __init__(self, path: str):
        self.schema = None  # the first row's (`_normalize` decides it)
        super().__init__(path)

    def _normalize(self, where: str, row: dict) -> dict:
        try:
            self.schema = self.schema or pair_schema(row)
            return normalize_pair(row, self.schema)
        except _RowError as e:
            column = "" if e.column is None else f"column {e.column!r}: "
            raise DataError(f"{self.path}: {where}: {column}{e.reason}") from None
