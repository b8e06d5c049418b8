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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from common.seeds import derived_seed
from model.generate import generate_ids

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


# a turn as the sampler returns it: its token ids (through its EOS, or cut at the budget) and, from a server, the
# log-probability each was drawn with
Turn = tuple[list[int], list[float] | None]


@dataclass
class Conversation:
    """One row's multi-turn rollout after its prompt: the turns and tool results in order (`ids`), 1 on the tokens
    the policy sampled (`sampled`), their sampling log-probabilities (`logprobs`: a server's, else None), and the
    assistant turns taken (`turns`)."""
    ids: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    turns: int = 0


def roll_out(num_rows: int, sample_turn: Callable[[int, list[int], list[list[int]]], list[Turn]],
             respond: Callable[[list[int]], list[int] | None], max_new_tokens: int, max_turns: int,
             eos_token_id: int) -> list[Conversation]:
    """Multi-turn rollouts of `num_rows` rows: turn t samples every row still going on at once,
    `sample_turn(t, rows, conversations)` -> each row's turn (`conversations[i]`: row rows[i]'s tokens after its
    prompt so far, the engine continues from them token for token). A turn that ends with EOS and calls tools gets
    `respond(turn_ids)` appended and the row goes on; a row ends at a turn without calls, a turn without EOS, at
    `max_turns` turns, or when its next results would leave no token of `max_new_tokens` (tokens after the prompt,
    sampled and results together) to its next turn. A turn longer than the row's budget left is cut to it (a
    sampler may stop it there: every row going on has a token left)."""
    conversations = [Conversation() for _ in range(num_rows)]
    going = list(range(num_rows))
    for turn in range(max_turns):
        if not going:
            break
        turns = sample_turn(turn, going, [conversations[r].ids for r in going])
        still = []
        for row, (ids, logprobs) in zip(going, turns):
            conversation = conversations[row]
            left = max_new_tokens - len(conversation.ids)
            ids = ids[:left]
            conversation.ids += ids
            conversation.sampled += [1] * len(ids)
            if logprobs is not None:
                conversation.logprobs = (conversation.logprobs or []) + list(logprobs[:len(ids)])
            conversation.turns += 1
            ended = not ids or ids[-1] != eos_token_id or turn + 1 == max_turns
            results = None if ended else respond(ids)
            if results is None or len(results) >= left - len(ids):
                continue
            conversation.ids += results
            conversation.sampled += [0] * len(results)
            still.append(row)
        going = still
    return conversations


def turn_seed(row_seed: int, turn: int) -> int:
    """Turn `turn`'s seed of a row whose single-turn seed is `row_seed`: the first turn samples as one turn does, so
    a conversation that ends after one turn is the single-turn rollout."""
    return row_seed if turn == 0 else derived_seed(row_seed, turn)


def engine_turns(model, prompts: Sequence[list[int]], seeds: Sequence[int] | None, max_new_tokens: int,
                 pad_token_id: int, **options) -> Callable[[int, list[int], list[list[int]]], list[Turn]]:
    """roll_out's sampler in the built-in engine: turn t of rows `rows` is one `generate_ids` batch over each row's
    prompt and conversation so far (prefilled: the cache is not kept from turn to turn), row r sampling with a
    generator seeded turn_seed(seeds[r], t) (`seeds` None: greedy). `options`: generate's sampling options."""
    device = getattr(model, "module", model).lm_head.weight.device

    def sample_turn(turn: int, rows: list[int], conversations: list[list[int]]) -> list[Turn]:
        generators = None if seeds is None else [torch.Generator(device).manual_seed(turn_seed(seeds[r], turn))
                                                 for r in rows]
        turns = generate_ids(model, [list(prompts[r]) + c for r, c in zip(rows, conversations)], max_new_tokens,
                             pad_token_id, generator=generators, **options)
        return [(ids, None) for ids in turns]
    return sample_turn


def served_turns(server, prompts: Sequence[list[int]], seeds: Sequence[int] | None, max_new_tokens: int,
                 **sampling) -> Callable[[int, list[int], list[list[int]]], list[Turn]]:
    """roll_out's sampler on a completion server (serving.engine.CompletionServer, e.g. vLLM): turn t of rows `rows`
    is one request per row whose prompt is the row's prompt and conversation so far as token ids -- the server
    continues exactly the tokens sampled and appended, it never re-renders text (the template is not append-only:
    the module's docstring) -- for at most the row's budget left, seeded turn_seed(seeds[r], t) as engine_turns'
    generators are (`seeds` None: greedy, `sampling` with do_sample False). Each turn comes back with the
    log-probability the server drew each token with. `sampling`: the server's sample_rows settings."""
    def sample_turn(turn: int, rows: list[int], conversations: list[list[int]]) -> list[Turn]:
        # greedy: a seed draws nothing, any will do
        turn_seeds = [0] * len(rows) if seeds is None else [turn_seed(seeds[r], turn) for r in rows]
        return server.sample_rows([list(prompts[r]) + c for r, c in zip(rows, conversations)],
                                  [max_new_tokens - len(c) for c in conversations], seeds=turn_seeds, **sampling)
    return sample_turn
