# python -m pytest -q -n 0 tests/test_tool_conversation.py
"""A conversation with tools in rollout order (dataset/tool_conversation.py): what a rollout appends after a turn
with calls equals what transformers' Qwen3 template renders for those tool messages and the next generation prompt;
each assistant turn is the template's own rendering of it; the pieces tokenised apart are the whole text tokenised
by transformers; the mask holds exactly the assistant's tokens. transformers is imported here only (hf_qwen)."""
import pytest

from dataset.tool_conversation import ToolResponder, conversation_ids, results_text, tool_calls_in
from test_tool_template import CONVERSATIONS, TOOLS
from tools.calculator import CALCULATOR
from tools.calls import run_tool_call
from tools.registry import ToolRegistry

# the conversations a rollout can produce: one user turn, then assistant turns separated by tool results
ROLLOUT_ORDER = ["tools unused", "one call", "one call, text before it", "sequential calls with results",
                 "parallel calls", "arguments as JSON text", "reasoning before a call"]


def hf_text(hf_qwen, messages, **options) -> str:
    return hf_qwen.apply_chat_template(messages, tools=TOOLS, tokenize=False, **options)


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("name", ROLLOUT_ORDER)
def test_results_follow_the_turn_as_the_template_renders_them(hf_qwen, name, thinking):
    messages = CONVERSATIONS[name]
    for k, message in enumerate(messages):
        if message["role"] != "tool" or messages[k + 1]["role"] == "tool":
            continue
        start = max(j for j in range(k) if messages[j]["role"] == "assistant")
        results = [m["content"] for m in messages[start + 1:k + 1]]
        rendered = hf_text(hf_qwen, messages[:k + 1], add_generation_prompt=True, enable_thinking=thinking)
        assert rendered.endswith("<|im_end|>" + results_text(results, thinking))


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("name", ROLLOUT_ORDER)
def test_conversation_ids_are_the_rollout_order_of_the_template_pieces(qwen, hf_qwen, name, thinking):
    messages = CONVERSATIONS[name]
    if name == "reasoning before a call" and not thinking:  # the SFT collator refuses it too: the prompt then
        with pytest.raises(ValueError, match="differently"):  # ends with an empty think block, the turn has one
            conversation_ids(qwen, messages, TOOLS, thinking)
        return
    ids, mask = conversation_ids(qwen, messages, TOOLS, thinking)
    first = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
    text = hf_text(hf_qwen, messages[:first], add_generation_prompt=True, enable_thinking=thinking)
    bodies, pending = [], []
    for k in range(first, len(messages)):
        if messages[k]["role"] == "tool":
            pending.append(messages[k]["content"])
            continue
        if pending:
            text += results_text(pending, thinking)
            pending = []
        prompt = hf_text(hf_qwen, messages[:k], add_generation_prompt=True, enable_thinking=thinking)
        body = hf_text(hf_qwen, messages[:k + 1], enable_thinking=thinking)[len(prompt):]
        assert body.endswith("<|im_end|>\n")
        bodies.append(body[:-1])
        text += body[:-1]
    assert ids == hf_qwen.encode(text, add_special_tokens=False)
    assert len(mask) == len(ids)
    assert hf_qwen.decode([t for t, m in zip(ids, mask) if m]) == "".join(bodies)
    # every assistant token is trained, nothing of the prompt or the results is
    assert sum(mask) == sum(len(hf_qwen.encode(b, add_special_tokens=False)) for b in bodies)


def test_conversation_ids_refuse_what_a_rollout_cannot_produce(qwen):
    with pytest.raises(ValueError, match="after the first assistant turn"):
        conversation_ids(qwen, CONVERSATIONS["malformed call as plain content"], TOOLS, False)
    with pytest.raises(ValueError, match="ends with an assistant turn"):
        conversation_ids(qwen, CONVERSATIONS["one call"][:2], TOOLS, False)
    user, assistant = CONVERSATIONS["tools unused"]
    with pytest.raises(ValueError, match="follows no tool result"):
        conversation_ids(qwen, [user, assistant, assistant], TOOLS, False)


def test_tool_calls_are_read_as_the_hermes_parser_reads_them():
    assert tool_calls_in("The answer is 5.") == []
    assert tool_calls_in('<tool_call>\n{"name": "a"}\n</tool_call>') == ['{"name": "a"}']
    assert tool_calls_in('x<tool_call>{"n": 1}</tool_call>\n<tool_call>\n{"n": 2}\n</tool_call>') == \
        ['{"n": 1}', '{"n": 2}']
    assert tool_calls_in('<tool_call>{"n": 1}</tool_call><tool_call>{"name": "cut') == ['{"n": 1}', '{"name": "cut']


def test_the_responder_answers_every_call_of_a_turn_and_ends_a_turn_without_calls(qwen):
    registry = ToolRegistry([CALCULATOR])
    responder = ToolResponder(qwen, lambda text: run_tool_call(registry, text), enable_thinking=False)
    turn = qwen.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 45"}}\n</tool_call>\n'
                       '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 +"}}\n</tool_call>'
                       '<tool_call>\nnot json<|im_end|>')
    appended = qwen.decode(responder(turn))
    results = [run_tool_call(registry, c) for c in
               ['{"name": "calculator", "arguments": {"expression": "123 * 45"}}',
                '{"name": "calculator", "arguments": {"expression": "1 +"}}', "not json"]]
    assert results[0] == "5535" and all(r.startswith("error:") for r in results[1:])
    assert appended == results_text(results, False)
    assert responder(qwen.encode("123 * 45 = 5535.<|im_end|>")) is None
