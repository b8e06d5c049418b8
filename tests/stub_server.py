"""A stub OpenAI-compatible HTTP server for tests: a thread on 127.0.0.1, answering each POST with what a test's
function says, and keeping every request it received."""
from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from common.http import send_json


class _QuietServer(ThreadingHTTPServer):
    """A client closing its kept-alive connection is no error here; anything else is still reported."""

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class Stub:
    """ThreadingHTTPServer on 127.0.0.1, port 0: `respond(path, body) -> (status, JSON object)`; every POST's
    (path, body) is kept in `posts`."""

    def __init__(self, respond):
        self.respond, self.posts, self.lock = respond, [], threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                return

            def do_GET(self):
                self._send(200, {"object": "list", "data": [{"id": "teacher"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub.lock:
                    stub.posts.append((self.path, body))
                self._send(*stub.respond(self.path, body))

            def _send(self, status, obj):
                send_json(self, status, obj)

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def choices_body(path: str, texts: list[str], usage: dict | None = None) -> dict:
    if path.endswith("/chat/completions"):
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": "length"}
                   for i, t in enumerate(texts)]
    else:
        choices = [{"index": i, "text": t, "finish_reason": "length"} for i, t in enumerate(texts)]
    return {"id": "x", "choices": choices[::-1], **({"usage": usage} if usage else {})}   # any order: by index


# what the stub black-box teacher continues with: a few short texts, some like the demo's answers
PHRASES = (" 12 + 7 = 19", " The answer is", " so we add", " 1", " \\boxed{19}", " first,", " 3 * 4")


def black_box_teacher(path: str, body: dict) -> tuple[int, dict]:
    """A deterministic text-only teacher: the start-up probe ("1, 2, 3, 4,") is continued with " 5, 6, 7, 8";
    any other request gets n of PHRASES picked by (its seed, the choice), so a repeated request gets the same
    answer, as a seeded vLLM request does. Usage: 20 prompt tokens, 4 per choice."""
    partial = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
    n = body.get("n", 1)
    if partial.rstrip().endswith("1, 2, 3, 4,"):
        texts = [" 5, 6, 7, 8"] * n
    else:
        texts = [PHRASES[(int(body["seed"]) * 31 + i * 7) % len(PHRASES)] for i in range(n)]
    return 200, choices_body(path, texts, {"prompt_tokens": 20, "completion_tokens": 4 * n})
