# python -m pytest -q -n 0 tests/test_tool_template.py
"""Rows with tools: the `tools` column and tool messages rendered by our chat template path (QwenTokenizer, the
collators, rows read by RowDataset) into the very tokens transformers' AutoTokenizer.apply_chat_template(messages,
tools=...) gives with Qwen3's bundled template, and malformed tools / tool_calls refused at start-up naming the file
and the row. transformers is imported here only."""
import copy
import json

import pytest

from dataset.collators import PairCollator, PromptCollator, SFTCollator, in_rollout_order, split_conversation
from dataset.sources import DataError, PairDataset, RowDataset
from dataset.tool_conversation import conversation_ids
from serving.engine import CompletionServer
from stub_server import Stub
from trainer.teachers.template_check import local_rendering, server_rendering

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city (°C).",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "a + b",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]


def call(name: str, arguments) -> dict:
    return {"id": f"call_{name}", "type": "function", "function": {"name": name, "arguments": arguments}}


USER = {"role": "user", "content": "Weather in Paris and Zürich, and 2 + 3?"}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
CALL_ONLY = {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris"})]}
RESULT = {"role": "tool", "content": '{"temp": 18, "sky": "clear"}'}

# name -> messages; each ends with an assistant turn (the SFT target), so the prompt is every message before it
CONVERSATIONS = {
    "tools unused": [USER, {"role": "assistant", "content": "I cannot look that up."}],
    "one call": [SYSTEM, USER, CALL_ONLY],
    "one call, text before it": [USER, {"role": "assistant", "content": "Let me check.",
                                        "tool_calls": [call("get_weather", {"city": "Paris"})]}],
    "sequential calls with results": [
        SYSTEM, USER, CALL_ONLY, RESULT,
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Zürich"})]},
        {"role": "tool", "content": '{"temp": 12, "sky": "rain"}'},
        {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 2, "b": 3})]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "Paris 18 °C clear, Zürich 12 °C rain; 2 + 3 = 5."}],
    "parallel calls": [
        USER, {"role": "assistant", "content": "", "tool_calls": [call("get_weather", {"city": "Paris"}),
                                                                  call("get_weather", {"city": "Zürich"})]},
        RESULT, {"role": "tool", "content": '{"temp": 12, "sky": "rain"}'},
        {"role": "assistant", "content": "Paris 18 °C, Zürich 12 °C."}],
    "arguments as JSON text": [
        USER, {"role": "assistant", "content": "",
               "tool_calls": [call("add", '{"a": 2,  "b": 3}'), call("get_weather", {"city": "Paris"})]},
        {"role": "tool", "content": "5"}, RESULT, {"role": "assistant", "content": "5, and 18 °C in Paris."}],
    "reasoning before a call": [
        USER, {"role": "assistant", "content": "<think>\nI need the weather.\n</think>\n\n",
               "tool_calls": [call("get_weather", {"city": "Paris"})]},
        RESULT, {"role": "assistant", "content": "<think>\nIt is clear.\n</think>\n\n18 °C and clear."}],
    "malformed call as plain content": [
        USER, {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n'
                                              '</tool_call>'},
        {"role": "user", "content": "That call was cut short."},
        {"role": "assistant", "content": '<tool_call>\n{"name": get_weather}\n</tool_call>'}],
}


def hf_ids(hf_qwen, messages: list[dict], **options) -> list[int]:
    text = hf_qwen.apply_chat_template(messages, tools=TOOLS, tokenize=False, **options)
    return hf_qwen.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_tokenizer_renders_tools_as_transformers_does(qwen, hf_qwen, name, add_generation_prompt, enable_thinking):
    messages = CONVERSATIONS[name]
    options = {"add_generation_prompt": add_generation_prompt, "enable_thinking": enable_thinking}
    for end in range(1, len(messages) + 1):   # every prefix: a rollout renders the conversation so far
        ours = qwen.apply_chat_template(messages[:end], tools=TOOLS, tokenize=True, **options)
        assert ours == hf_ids(hf_qwen, messages[:end], **options), (name, end)


def test_the_template_shows_tools_calls_and_results_where_qwen3_puts_them(qwen):
    text = qwen.apply_chat_template(CONVERSATIONS["parallel calls"], tools=TOOLS)
    assert text.startswith("<|im_start|>system\n# Tools\n") and '"description": "e.g. Zürich"' in text
    assert text.count("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": ") == 2
    assert "<|im_start|>user\n<tool_response>\n" in text and text.count("<tool_response>") == 2
    assert qwen.apply_chat_template([USER], tools=None) == qwen.apply_chat_template([USER], tools=[]) \
        == qwen.apply_chat_template([USER])


def test_qwen3_does_not_render_a_conversation_as_an_extension_of_its_prefix(qwen):
    """docs/data.md: a call-only turn after the last user query has an empty think block only while it is last."""
    messages = CONVERSATIONS["sequential calls with results"]
    shorter, longer = (qwen.apply_chat_template(messages[:end], tools=TOOLS) for end in (3, 4))
    assert shorter.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", "
                            "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n")
    assert not longer.startswith(shorter)
    assert "<|im_start|>assistant\n<tool_call>" in longer


@pytest.fixture(scope="module")
def tool_rows(tmp_path_factory):
    """The conversations as a jsonl file's rows, the way data carries them: `tools` as a list in some rows and as
    its JSON text in others, a call-only assistant turn's content null (OpenAI's spelling)."""
    rows = []
    for k, messages in enumerate(CONVERSATIONS.values()):
        turns = [{**m, "content": None} if m.get("tool_calls") and not m["content"] else m for m in messages]
        rows.append({"messages": turns, "tools": json.dumps(TOOLS) if k % 2 else TOOLS})
    path = tmp_path_factory.mktemp("tools") / "tools.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return RowDataset(str(path))


@pytest.mark.parametrize("enable_thinking", [True, False])
def test_collators_render_rows_with_tools_as_transformers_does(qwen, hf_qwen, tool_rows, enable_thinking):
    sft = SFTCollator(qwen, max_length=4096, max_prompt_length=2048, enable_thinking=enable_thinking)
    prompts = PromptCollator(qwen, max_prompt_length=2048, enable_thinking=enable_thinking)
    for index, (name, messages) in enumerate(CONVERSATIONS.items()):
        row = tool_rows[index]
        assert row["tools"] == TOOLS, name
        prompt_messages, full_messages = split_conversation(messages)
        theirs_prompt = hf_ids(hf_qwen, prompt_messages, add_generation_prompt=True, enable_thinking=enable_thinking)
        theirs_full = hf_ids(hf_qwen, full_messages, enable_thinking=enable_thinking)
        assert qwen.encode(prompts.render(row["messages"], row["tools"])) == theirs_prompt, name
        if not enable_thinking and name == "reasoning before a call":
            continue   # <think> in the target under enable_thinking=False: no prompt/completion boundary (as today)
        (ids, boundary), = sft.encode([row])
        assert ids == theirs_full and ids[:boundary] == theirs_prompt, name
        batch = sft([row])
        # a conversation with tool results is trained in rollout order (tests/test_tool_sft.py), any other as rendered
        expected = conversation_ids(qwen, full_messages, TOOLS, enable_thinking)[0] if in_rollout_order(messages) \
            else theirs_full
        assert batch["input_ids"][0].tolist() == expected, name


def test_a_row_without_tools_renders_as_before(qwen, tmp_path):
    messages = [USER, {"role": "assistant", "content": "Sunny."}]
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"messages": messages, "tools": None}) + "\n", encoding="utf-8")
    row = RowDataset(str(path))[0]
    assert "tools" not in row or row["tools"] is None
    sft = SFTCollator(qwen, max_length=512, max_prompt_length=256)
    assert sft.render(row["messages"], row.get("tools")) == (
        qwen.apply_chat_template(messages[:1], add_generation_prompt=True), qwen.apply_chat_template(messages))


def test_preference_pairs_render_with_their_tools(qwen, hf_qwen, tmp_path):
    prompt = CONVERSATIONS["parallel calls"][:-1]
    chosen, rejected = CONVERSATIONS["parallel calls"][-1:], [{"role": "assistant", "content": "No idea."}]
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected,
                                "tools": json.dumps(TOOLS)}) + "\n", encoding="utf-8")
    pairs = PairDataset(str(path))
    batch = PairCollator(SFTCollator(qwen, max_length=4096, max_prompt_length=2048))([pairs[0]])
    assert batch["input_ids"][0].tolist() == hf_ids(hf_qwen, prompt + chosen)
    assert batch["input_ids"][1][batch["attention_mask"][1] == 1].tolist() == hf_ids(hf_qwen, prompt + rejected)
    path.write_text(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected, "tools": {}}) + "\n",
                    encoding="utf-8")
    with pytest.raises(DataError, match="row 0 .*column 'tools': not a list"):
        PairDataset(str(path))


def test_the_teachers_template_check_renders_the_rows_tools(qwen, hf_qwen):
    """A teacher is shown the prompt with the row's tools: a local one renders them, a served one is sent them."""
    messages = CONVERSATIONS["sequential calls with results"]
    prompt = split_conversation(messages)[0]
    expected = hf_ids(hf_qwen, prompt, add_generation_prompt=True, enable_thinking=True)
    assert local_rendering(qwen, 2048, True)(messages, TOOLS) == expected
    stub = Stub(lambda path, body: (200, {"tokens": expected}))
    server = CompletionServer(stub.url, "teacher", what="teacher server")
    try:
        assert server_rendering(server, True)(messages, TOOLS) == expected
        assert server_rendering(server, True)(messages, None) == expected
    finally:
        server.close()
        stub.close()
    (path, with_tools), (_, without) = stub.posts
    assert path.endswith("/tokenize") and with_tools["tools"] == TOOLS and with_tools["messages"] == prompt
    assert "tools" not in without


BAD_ROWS = {
    "tools a number": ({"tools": 3}, ["column 'tools'", "not a list"]),
    "tools unparsable text": ({"tools": "[{'type': 'function'"}, ["column 'tools'", "not JSON"]),
    "tool without type": ({"tools": [{"function": WEATHER["function"]}]}, ["column 'tools'", "entry 0"]),
    "tool a bare function": ({"tools": [TOOLS[0], WEATHER["function"]]}, ["column 'tools'", "entry 1"]),
    "tool without name": ({"tools": [{"type": "function", "function": {"description": "x"}}]},
                          ["column 'tools'", "entry 0 has no function name"]),
    "tool parameters text": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
                             ["column 'tools'", "entry 0 (f): parameters is a str"]),
    "call without function": ({"calls": [{"name": "add", "arguments": {"a": 1}}]},
                              ["column 'messages'", "turn 1 (assistant) tool_calls[0] is not OpenAI's"]),
    "calls not a list": ({"calls": call("add", {})}, ["turn 1 (assistant) tool_calls is a dict"]),
    "call of another type": ({"calls": [{**call("add", {}), "type": "code"}]}, ["tool_calls[0] is not OpenAI's"]),
    "call without name": ({"calls": [{"type": "function", "function": {"arguments": {}}}]},
                          ["tool_calls[0] has no function name"]),
    "arguments unparsable": ({"calls": [call("add", '{"a": 1,\n')]}, ["tool_calls[0] (add): arguments"]),
    "arguments a list": ({"calls": [call("add", "[1, 2]")]}, ["tool_calls[0] (add): arguments"]),
    "calls on a user turn": ({"user_calls": [call("add", {})]}, ["turn 0 (user) has tool_calls"]),
}


@pytest.mark.parametrize("name", list(BAD_ROWS))
def test_malformed_tools_and_calls_are_refused_naming_file_and_row(tmp_path, name):
    change, expected = BAD_ROWS[name]
    good = {"messages": [USER, {"role": "assistant", "content": "Sunny."}]}
    bad = copy.deepcopy(good)
    if "tools" in change:
        bad["tools"] = change["tools"]
    if "calls" in change:
        bad["messages"][1]["tool_calls"] = change["calls"]
    if "user_calls" in change:
        bad["messages"][0]["tool_calls"] = change["user_calls"]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n", encoding="utf-8")
    with pytest.raises(DataError) as refused:
        RowDataset(str(path))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path}: row 1 (line 2): ")
    for part in expected:
        assert part in message, (part, message)
