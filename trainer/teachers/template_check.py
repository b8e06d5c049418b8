"""The start-up check that a teacher sees what the student sees (docs/teachers.md): its own chat template -- its
folder's, or its server's through vLLM's /tokenize -- must render the first rows' prompts into the student's token
ids. A teacher shown another rendering (a changed default system prompt, another generation prompt) scores every
token in a context it was never trained on, and nothing else in a run would say so."""
from __future__ import annotations

import argparse

from common.errors import RuntimeFailure, UserError
from common.http import RequestError
from dataset.collators import PromptCollator, split_conversation
from serving.engine import CompletionServer

TEMPLATE_ROWS = 4   # rows whose prompts each teacher's template must render as the student's


def check_template(args: argparse.Namespace, name: str, role: str, source: str, server: CompletionServer | None,
                   own_tokenizer, tokenizer, dataset) -> None:
    """The teacher `name` (`role`: how messages call it; `source`: its folder or URL) -- its own chat template (its
    folder's, in `own_tokenizer`, or its `server`'s through /tokenize)
    renders the first TEMPLATE_ROWS rows' prompts into the student's token ids; otherwise the run is refused naming
    the teacher, the row and the first token that differs (a teacher shown another rendering scores tokens in a
    context it was never trained on)."""
    rows = [dataset[i] for i in range(min(TEMPLATE_ROWS, len(dataset)))]
    ours = PromptCollator(tokenizer, args.max_prompt_length, bool(args.enable_thinking))
    theirs_render = (server_rendering(server, bool(args.enable_thinking)) if server is not None else
                     local_rendering(own_tokenizer, args.max_prompt_length, bool(args.enable_thinking)))
    for row in rows:
        student_ids = tokenizer.encode(ours.render(row["messages"], row.get("tools")))
        teacher_ids = theirs_render(row["messages"], row.get("tools"))
        if teacher_ids == student_ids:
            continue
        at = next((i for i, (a, b) in enumerate(zip(student_ids, teacher_ids)) if a != b),
                  min(len(student_ids), len(teacher_ids)))
        theirs, mine = token_text(tokenizer, teacher_ids, at), token_text(tokenizer, student_ids, at)
        raise UserError(f"the {role} ({source}) renders row {row['row_index']}'s prompt "
                        f"differently from the student's chat template: token {at} is {theirs} there, {mine} in the "
                        f"student's; the teacher would score "
                        f"a context it never sees. Fix its chat template, or pass --accept_template_difference "
                        f"{name} to train anyway")


def token_text(tokenizer, ids: list[int], at: int) -> str:
    return f"{tokenizer.decode([ids[at]])!r} (id {ids[at]})" if at < len(ids) else "the end of the prompt"


def local_rendering(tokenizer, max_prompt_length: int, enable_thinking: bool):
    """A local teacher's own template: its folder's tokenizer files (the packaged Qwen3 ones when it has none:
    trainer/teachers/frozen.py's same_vocabulary)."""
    collator = PromptCollator(tokenizer, max_prompt_length, enable_thinking)
    return lambda messages, tools: tokenizer.encode(collator.render(messages, tools))


def server_rendering(server: CompletionServer, enable_thinking: bool):
    """A served teacher's template: the ids its /tokenize endpoint gives for the prompt's messages with the
    generation prompt and the row's tools (vLLM renders them with the chat template it serves)."""
    def render(messages: list[dict], tools: list[dict] | None) -> list[int]:
        payload = {"model": server.model, "messages": split_conversation(messages)[0], "add_generation_prompt": True,
                   "add_special_tokens": False, "chat_template_kwargs": {"enable_thinking": enable_thinking}}
        if tools:
            payload["tools"] = tools   # a row without tools sends the request it always sent
        try:
            tokens = server.client.post_once("/tokenize", payload).get("tokens")
        except (RequestError, AttributeError) as e:
            raise RuntimeFailure(f"the {server.what} did not render a chat prompt through /tokenize as vLLM does "
                                 f"({e}): cannot check its chat template (--accept_template_difference skips the "
                                 f"check)") from None
        return list(tokens)
    return render
