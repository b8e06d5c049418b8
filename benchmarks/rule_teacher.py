"""A rule-based black-box teacher for the demo: an OpenAI-compatible endpoint that continues any partial answer to a
demo question ("What is 47 + 38? ...", or a running sum "Let a=47, b=3, c=8. What is a+b+c? ...") with the
correct worked solution, in the demo's format (dataset/make_demo_data.py's `solve`: "7+8=15, 4+3+1=8. \\boxed{85}";
"a+b=47+3=50, 50+c=50+8=58. \\boxed{58}"). It stands in for a proprietary API better
than any local model, as the black-box teacher of logit-free OPD (trainer/train_logit_free.py --teacher_url).

    python benchmarks/rule_teacher.py --port 8002     # serves until Ctrl-C / SIGTERM; prints its URL when ready
    python trainer/train_logit_free.py --teacher_url http://127.0.0.1:8002/v1 \\
        --chunk_len 8 --audit_chunks 4 --continuations 4 --eval_interval 8
    ... --teacher_form completions --teacher_tokenizer_path DIR     # DIR: a folder with Qwen3's tokenizer files

    with RuleTeacher() as teacher:                    # in this process, on 127.0.0.1, a free port, in a thread
        ... teacher.url ...                           # http://127.0.0.1:PORT/v1
        teacher.posts                                 # every POST with a JSON body: (path, body), in order

The loop's defaults work: `--teacher_form chat` (the partial as a final assistant message; vLLM's
continue_final_message / add_generation_prompt keys are accepted and not needed, so `--teacher_options '{}'` works
too), or `--teacher_form completions` (the Qwen3 chat template's rendering of the conversation; the partial is what
follows the last `<|im_start|>assistant\\n`); `n` is honoured (no --teacher_split_n needed); and the default
`--teacher_probe count` is the mode to use: the start-up probe asks to continue "1, 2, 3, 4," in answer to "Count
from 1 to 20, ...", and the teacher knows counting as its second kind of question (`correct_solution`), so the probe
checks it as it checks any teacher (`request` works too). Any --teacher_model is answered (the name is echoed).
It has no weights: the loop's --eval_teacher_path (the held-out reverse KL to a local copy of the teacher) does not
apply. Any partial, right or wrong, is continued in the demo's format: `continue_solution` says how.

What it answers (`RuleTeacher.answer`):
  POST /v1/chat/completions, /v1/completions   the continuation of the partial (`continue_solution`), n identical
        choices (the solver is deterministic: `seed` and `temperature` are accepted and ignored), cut to the
        request's max_tokens tokens of the real Qwen3 tokenizer (finish_reason "length"; else "stop", where the
        solution ends); `usage`: the prompt's tokens (chat: the conversation rendered through Qwen3's template, as
        a Qwen3 server counts it) and n times the continuation's. A question it cannot parse, a chat conversation
        the template cannot continue, or a malformed request: HTTP 400 with an OpenAI-style error body.
  GET /v1/models    the model list the client's start-up GET needs; GET /health: 200 (benchmarks/demo.py's wait).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from common.errors import ArgumentParser, UserError, run_script  # noqa: E402
from common.http import send_json  # noqa: E402
from dataset.make_demo_data import numbers_of, solve  # noqa: E402
from model.tokenizer import QwenTokenizer, load_tokenizer  # noqa: E402

COUNTING = re.compile(r"Count from (\d+) to (\d+)")   # the client's start-up probe (dataset/continuations.py)
THINKING = re.compile(r"^\s*<think>.*?</think>", re.DOTALL)
SEPARATOR = re.compile(r"(?<=, )|(?<=\. )")           # split after ", " and ". ", each kept with its segment
USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.DOTALL)
ASSISTANT_HEADER = "<|im_start|>assistant\n"
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"


class BadRequest(ValueError):
    """A request the teacher refuses with HTTP 400."""


# ---------------------------------------------------------------------------------------------------- the solver

def correct_solution(question: str) -> str:
    """The whole correct answer to `question`: a demo sum ("What is 47 + 38? ...", "Let a=47, b=3, c=8. What is
    a+b+c? ...") -> `solve`'s worked solution; the start-up probe's counting ("Count from 1 to 20, ...") -> "1, 2,
    ..., 20". BadRequest otherwise."""
    numbers = numbers_of(question)
    if numbers:
        return solve(*numbers)[1]
    counting = COUNTING.search(question)
    if counting:
        return ", ".join(str(i) for i in range(int(counting.group(1)), int(counting.group(2)) + 1))
    raise BadRequest(f"the rule teacher cannot parse the question {question[:100]!r}: it answers the demo's 'What is "
                     f"A + B?' and 'Let a=A, b=B, .... What is a+b+...?', and 'Count from A to B' (the client's "
                     f"start-up probe)")


def answer_text(partial: str) -> str:
    """The answer part of a partial assistant text: a leading thinking block (`<think>...</think>`, as the chat
    form's partial has with --enable_thinking 1 and the completions form's rendered prompt always has) and the
    whitespace before the answer dropped (Qwen3's template drops the answer's leading newlines)."""
    return THINKING.sub("", partial, count=1).lstrip()


def segments(text: str) -> list[str]:
    """`text` cut after each ", " and ". ", each separator kept at the end of its segment: the demo's solution is
    [ones step + ", ", tens step + ". ", boxed answer], a running sum's [step + ", ", ..., last step + ". ", boxed
    answer]."""
    return SEPARATOR.split(text)


def shape(text: str) -> str:
    """The format of `text`: every digit the same character (a wrong digit keeps the format, a missing carry not)."""
    return re.sub(r"\d", "0", text)


def continue_solution(question: str, partial: str) -> str:
    """The correct continuation of `partial` (assistant text: a leading thinking block and whitespace are not part
    of the answer, `answer_text`) in the demo's format, ending where the solution ends.

    The answer so far is aligned with the correct solution segment by segment (`segments`: ones step, tens step,
    boxed answer, each with the separator after it): the partial is in segment i, i = the number of separators
    (", " or ". ") it has written, and has written `current` of it (its text after the last separator).
      - `current` has the format of the correct segment's start (`shape`: the same characters, digits aside): the
        correct segment from that offset on, then the segments after it. A prefix of the solution is so continued
        to the exact solution; a wrong digit is kept and the rest is correct ("7+8=14" -> ", 4+3+1=8. \\boxed{85}";
        "..., 5" -> "+3+1=8. \\boxed{85}"; "... \\boxed{84" -> "}").
      - otherwise the offset means nothing (a carry written where none is, "2+2+1=", or missing, "4+3=", a
        three-digit box for a two-digit sum, any other text): the segment is abandoned where it stands, and the
        continuation is its separator (less a first character the partial already ends with) and the correct
        segments after it ("4+3=" -> ". \\boxed{85}"); after the last segment, nothing.
      - more separators than the solution has: nothing (the solution is over)."""
    correct = segments(correct_solution(question))
    written = segments(answer_text(partial))
    index, current = len(written) - 1, written[-1]
    if index >= len(correct):
        return ""
    segment, after = correct[index], "".join(correct[index + 1:])
    if shape(segment).startswith(shape(current)):
        return segment[len(current):] + after
    separator = segment[-2:] if segment.endswith((", ", ". ")) else ""
    if separator and current.endswith(separator[0]):
        separator = separator[1:]
    return separator + after


# ---------------------------------------------------------------------------------------------------- requests

def chat_question_and_partial(body: dict[str, Any]) -> tuple[str, str]:
    """The chat form: the last user message is the question, a final assistant message the partial (none: "")."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        raise BadRequest("'messages' must be a non-empty list of {\"role\": ..., \"content\": text}")
    users = [m["content"] for m in messages if m.get("role") == "user"]
    if not users:
        raise BadRequest("the conversation has no user message")
    return users[-1], messages[-1]["content"] if messages[-1].get("role") == "assistant" else ""


def completions_question_and_partial(body: dict[str, Any]) -> tuple[str, str]:
    """The completions form (a ChatML rendering, Qwen3's): the partial follows the last `<|im_start|>assistant\\n`,
    the question is the last user turn before it."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be text: the conversation rendered through the chat template")
    head, found, partial = prompt.rpartition(ASSISTANT_HEADER)
    users = USER_TURN.findall(head)
    if not found or not users:
        raise BadRequest("the prompt has no user turn followed by an assistant turn to continue "
                         "(<|im_start|>user ... <|im_start|>assistant): render it with Qwen3's chat template")
    return users[-1], partial


def sampling(body: dict[str, Any]) -> tuple[int, int | None]:
    """-> (n, max_tokens) of a request."""
    n, max_tokens = body.get("n", 1), body.get("max_tokens")
    if type(n) is not int or n < 1:
        raise BadRequest(f"'n' must be an integer >= 1, got {n!r}")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise BadRequest(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    return n, max_tokens


def error_body(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def choices(path: str, text: str, finish_reason: str, n: int) -> list[dict[str, Any]]:
    if path == CHAT_PATH:
        return [{"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
                for i in range(n)]
    return [{"index": i, "text": text, "logprobs": None, "finish_reason": finish_reason} for i in range(n)]


# ---------------------------------------------------------------------------------------------------- the server

class _QuietServer(ThreadingHTTPServer):
    """A client closing its kept-alive connection is no error here; anything else is still reported."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class RuleTeacher:
    """The rule teacher on `host`:`port` (0: a free one), served by a daemon thread from construction until
    `close()`; `url` is its base URL (.../v1) and `posts` every POST received with a JSON body, as (path, body), in
    order. OSError when the port cannot be bound."""

    def __init__(self, port: int = 0, host: str = "127.0.0.1", model: str = "teacher"):
        self.model, self.posts, self.lock = model, [], threading.Lock()
        self.tokenizer: QwenTokenizer = load_tokenizer(None)   # the real Qwen3 tokenizer: max_tokens and usage
        self.server = _QuietServer((host, port), self._handler())
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://{host}:{self.server.server_address[1]}/v1"

    def __enter__(self) -> "RuleTeacher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def answer(self, path: str, body: Any) -> tuple[int, dict[str, Any]]:
        """One POST -> (HTTP status, JSON body)."""
        if path not in (CHAT_PATH, COMPLETIONS_PATH):
            return 404, error_body(f"no endpoint {path}: POST {CHAT_PATH} or {COMPLETIONS_PATH}", "not_found_error")
        try:
            if not isinstance(body, dict):
                raise BadRequest("the body must be a JSON object")
            parse = chat_question_and_partial if path == CHAT_PATH else completions_question_and_partial
            question, partial = parse(body)
            n, max_tokens = sampling(body)
            text, finish_reason = self.truncate(continue_solution(question, partial), max_tokens)
            prompt_tokens = self.prompt_tokens(path, body)
        except ValueError as e:   # BadRequest, or a conversation the chat template cannot continue
            return 400, error_body(str(e), "invalid_request_error")
        completion_tokens = n * len(self.tokenizer.encode(text))
        kind = "chat.completion" if path == CHAT_PATH else "text_completion"
        return 200, {"id": "rule-teacher", "object": kind, "model": body.get("model", self.model),
                     "choices": choices(path, text, finish_reason, n),
                     "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                               "total_tokens": prompt_tokens + completion_tokens}}

    def truncate(self, text: str, max_tokens: int | None) -> tuple[str, str]:
        """-> (the first `max_tokens` tokens of `text`, "length"), or (`text`, "stop") when it fits."""
        ids = self.tokenizer.encode(text)
        if max_tokens is None or len(ids) <= max_tokens:
            return text, "stop"
        return self.tokenizer.decode(ids[:max_tokens]), "length"

    def prompt_tokens(self, path: str, body: dict[str, Any]) -> int:
        """The prompt's tokens: a completions prompt as sent; a chat conversation as Qwen3's template renders it
        (a final assistant message continued; ValueError where the template cannot, as a Qwen3 server refuses)."""
        if path == COMPLETIONS_PATH:
            return len(self.tokenizer.encode(body["prompt"]))
        messages = body["messages"]
        continued = messages[-1].get("role") == "assistant"
        return len(self.tokenizer.apply_chat_template(messages, tokenize=True, continue_final_message=continued,
                                                      add_generation_prompt=not continued))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        teacher = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                return

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": teacher.model, "object": "model",
                                                                 "owned_by": "rule_teacher"}]})
                elif self.path == "/health":
                    self._send(200, {})
                else:
                    self._send(404, error_body(f"no endpoint {self.path}: GET /v1/models or /health",
                                               "not_found_error"))

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    body = json.loads(raw)
                except ValueError:
                    self._send(400, error_body("the body is not JSON", "invalid_request_error"))
                    return
                with teacher.lock:
                    teacher.posts.append((self.path, body))
                self._send(*teacher.answer(self.path, body))

            def _send(self, status: int, obj: dict[str, Any]) -> None:
                send_json(self, status, obj)

        return Handler


# ---------------------------------------------------------------------------------------------------- the script

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, default=8002, help="the port to listen on (0: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    p.add_argument("--model", default="teacher", help="the model name GET /v1/models lists (the loop's "
                                                      "--teacher_model default)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        teacher = RuleTeacher(args.port, args.host, args.model)
    except OSError as e:
        raise UserError(f"cannot listen on {args.host}:{args.port} ({e.strerror}): choose another --port") from None
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    print(f"rule teacher ready on {teacher.url} (model {args.model!r}); Ctrl-C or SIGTERM stops it", flush=True)
    stop.wait()
    teacher.close()


if __name__ == "__main__":
    run_script(main)
