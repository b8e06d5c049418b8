"""A conversation with tools as the token sequence a multi-turn rollout produces, and what the rollout appends
after a turn that calls tools.

A rollout never re-renders: Qwen3's chat template is not append-only (a call-only assistant turn loses its empty
`<think>` block once a tool result follows it), so the sequence the student is trained on is the one it sampled,
turn by turn. After the prompt (rendered with the generation prompt) come the assistant's turns as it wrote them,
each through its `<|im_end|>`; after a turn with calls, the results exactly as the template renders tool messages,
followed by the next generation prompt:

    <|im_end|> \\n<|im_start|>user \\n<tool_response>\\n{result 1}\\n</tool_response> ... <|im_end|>\\n
    <|im_start|>assistant\\n [<think>\\n\\n</think>\\n\\n with enable_thinking off]

(`results_text`; tests/test_tool_conversation.py compares it with transformers' rendering of the same messages).
A turn calls tools when it holds `<tool_call>`: each `<tool_call>...</tool_call>` is one call, and an unclosed last
one runs to the turn's end (vLLM's hermes parser reads Qwen3's calls the same way); a malformed call still gets a
result, the tool's error text, as real agents answer it.

`conversation_ids` renders a whole conversation (SFT rows with tool results) in this rollout order, with a mask on
the assistant's own tokens: what a student trained on it sees is what it will see when it rolls out.
"""
from __future__ import annotations

import re
from collections.abc import Callable

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
EMPTY_THINK = "<think>\n\n</think>\n\n"


def tool_calls_in(turn_text: str) -> list[str]:
    """The text of each call in an assistant turn (between `<tool_call>` and `</tool_call>`, or the turn's end),
    stripped; [] for a turn that calls nothing."""
    return [call.strip() for call in TOOL_CALL.findall(turn_text)]


def results_text(results: list[str], enable_thinking: bool) -> str:
    """What follows an assistant turn's `<|im_end|>` once its calls are answered: the results as one user turn of
    `<tool_response>` blocks, then the generation prompt of the next assistant turn."""
    blocks = "".join(f"\n<tool_response>\n{result}\n</tool_response>" for result in results)
    return f"\n<|im_start|>user{blocks}<|im_end|>\n<|im_start|>assistant\n" + ("" if enable_thinking else EMPTY_THINK)


class ToolResponder:
    """What a rollout appends after an assistant turn: `responder(turn_ids)` -> the token ids of the turn's tool
    results and the next generation prompt, or None when the turn calls no tool (the conversation ends there).
    `run_call(call_text) -> result text` answers one call and never raises (tools.calls.run_tool_call)."""

    def __init__(self, tokenizer, run_call: Callable[[str], str], enable_thinking: bool):
        self.tokenizer, self.run_call, self.enable_thinking = tokenizer, run_call, enable_thinking

    def __call__(self, turn_ids: list[int]) -> list[int] | None:
        if turn_ids and turn_ids[-1] == self.tokenizer.eos_token_id:
            turn_ids = turn_ids[:-1]  # the turn's <|im_end|> is not part of an unclosed call
        calls = tool_calls_in(self.tokenizer.decode(turn_ids))
        if not calls:
            return None
        return self.tokenizer.encode(results_text([self.run_call(call) for call in calls], self.enable_thinking))


def conversation_ids(tokenizer, messages: list[dict], tools: list[dict] | None,
                     enable_thinking: bool) -> tuple[list[int], list[int]]:
    """A conversation ending with an assistant turn -> (token ids, 1 on the assistant's own tokens), in the order a
    rollout produces them: the prompt (the messages before the first assistant turn, with the generation prompt),
    then each assistant turn as the template renders it last (its body through `<|im_end|>`), each run of tool
    messages after a turn as `results_text`. The conversation must alternate: assistant turns separated by tool
    results, one user turn before the first (a ValueError says which message breaks it)."""
    first = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or messages[-1]["role"] != "assistant":
        raise ValueError("a conversation to render in rollout order ends with an assistant turn")
    render = lambda msgs, prompt: tokenizer.apply_chat_template(  # noqa: E731
        msgs, add_generation_prompt=prompt, enable_thinking=enable_thinking, tools=tools)
    ids, mask = [], []
    pending: list[str] = []  # tool results since the last assistant turn
    for k in range(first, len(messages)):
        message = messages[k]
        if message["role"] == "tool":
            pending.append(message["content"])
            continue
        if message["role"] != "assistant":
            raise ValueError(f"message {k} is a {message['role']} turn after the first assistant turn: a rollout's "
                             "conversation holds only assistant turns and tool results")
        if k > first and not pending:
            raise ValueError(f"message {k}: an assistant turn that follows no tool result")
        prompt, full = render(messages[:k], True), render(messages[:k + 1], False)
        if not full.startswith(prompt):
            raise ValueError(f"message {k}: the template renders the turns before it differently once it follows")
        body = full[len(prompt):].removesuffix("\n")  # the turn through its <|im_end|>
        context = tokenizer.encode(prompt) if k == first else tokenizer.encode(results_text(pending,
                                                                                           enable_thinking))
        turn = tokenizer.encode(body)
        ids += context + turn
        mask += [0] * len(context) + [1] * len(turn)
        pending = []
    return ids, mask
