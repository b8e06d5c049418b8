"""Talk to a checkpoint through its chat template, with the reply streamed token by token.

    python eval/chat.py --model_path checkpoints/sft --prompt "What is 47 + 38?"      # one shot
    python eval/chat.py --model_path Qwen3-0.6B --device cuda --enable_thinking 1     # interactive
    printf 'What is 2+3?\\nAnd times 4?\\n' | python eval/chat.py --model_path checkpoints/sft

Interactive mode reads one user message per line from stdin until EOF (Ctrl-D, exit code 0) or `exit`; `/reset`
clears the conversation. Ctrl-C stops at once (exit code 130), also in the middle of a reply.
Replies go to stdout, each followed by a newline, and nothing else does (the "> " prompt goes to stderr, and only
on a terminal), so piped output is exactly the replies.

Why not model/generate.py's `generate`: it returns only when every row is done, and a chat wants each token as it
comes. The loop here is the single-row special case (no padding, so no attention mask): one prefill into a KV
cache, then one token per step, sampled with generate.py's own `sample_next_token`. Each turn re-renders the whole
conversation and prefills it again instead of extending the previous cache: Qwen3's template drops the <think>
part of earlier assistant turns, so the rendered history is not the previous turn's tokens plus the new message.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from common.errors import refuse, run_script  # noqa: E402
from eval.eval_math import add_model_args, load_for_inference, stop_token_ids, validate_model_args  # noqa: E402
from model import KVCache, Qwen3ForCausalLM  # noqa: E402
from model.generate import sample_next_token  # noqa: E402


@torch.no_grad()
def stream_reply(model: Qwen3ForCausalLM, tokenizer, prompt_ids: list[int], max_new_tokens: int,
                 temperature: float, top_p: float, generator: torch.Generator | None,
                 write: Callable[[str], None]) -> str:
    """Generate one reply (until EOS or max_new_tokens), passing each new piece of text to `write`; -> the reply."""
    device = next(model.parameters()).device
    stop_ids = set(stop_token_ids(model, tokenizer))
    cache = KVCache(model.config, 1, len(prompt_ids) + max_new_tokens, next(model.parameters()).dtype, device)
    logits = model(torch.tensor([prompt_ids], device=device), kv_cache=cache, logits_to_keep=1).logits[:, -1]
    ids: list[int] = []
    shown = ""
    for _ in range(max_new_tokens):
        logits[:, len(tokenizer):] = float("-inf")  # the embedding's padding rows are not tokens
        token = sample_next_token(logits, temperature > 0, temperature if temperature > 0 else 1.0, 0, top_p,
                                  generator)
        if int(token) in stop_ids:
            break
        ids.append(int(token))
        shown = show_new_text(tokenizer, ids, shown, write)
        logits = model(token[:, None], kv_cache=cache, logits_to_keep=1).logits[:, -1]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    write(text[len(shown):])  # whatever was held back (a reply cut off inside a multi-byte character)
    return text


def show_new_text(tokenizer, ids: list[int], shown: str, write: Callable[[str], None]) -> str:
    """Decode the whole reply so far and write what is new. A token can end in the middle of a multi-byte character
    (the byte-level BPE splits emoji and CJK); the decoder then ends in U+FFFD, and that text waits for the next
    token rather than printing a replacement character that would never be taken back."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if text.endswith("\ufffd") or not text.startswith(shown):
        return shown
    write(text[len(shown):])
    return text


def reply(model: Qwen3ForCausalLM, tokenizer, history: list[dict], args: argparse.Namespace,
          generator: torch.Generator | None) -> str:
    """Render the conversation, stream the assistant's answer to stdout, append it to `history`."""
    prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True,
                                           enable_thinking=bool(args.enable_thinking))

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    answer = stream_reply(model, tokenizer, tokenizer.encode(prompt), args.max_new_tokens, args.temperature,
                          args.top_p, generator, write)
    write("\n")
    history.append({"role": "assistant", "content": answer})
    return answer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Chat with a Qwen3 checkpoint (streamed replies)")
    add_model_args(parser)
    # conversation
    parser.add_argument("--prompt", default=None, help="one user message, answered once (default: interactive)")
    parser.add_argument("--system", default=None, help="system message")
    parser.add_argument("--enable_thinking", type=int, default=0, choices=[0, 1], help="Qwen3 thinking mode")
    # sampling
    parser.add_argument("--max_new_tokens", type=int, default=512, help="reply budget per turn")
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=0.95, help="nucleus sampling mass")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        refuse(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        refuse(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 < args.top_p <= 1:
        refuse(f"--top_p must be in (0, 1], got {args.top_p}")
    validate_model_args(args)
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """-> the conversation (system, user and assistant turns)."""
    args = parse_args(argv)
    model, tokenizer = load_for_inference(args.model_path, args.device, args.dtype)
    generator = torch.Generator(model.lm_head.weight.device).manual_seed(args.seed)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history = list(system)
    if args.prompt is not None:
        history.append({"role": "user", "content": args.prompt})
        reply(model, tokenizer, history, args, generator)
        return history
    stdin = sys.stdin or io.StringIO()  # Python sets sys.stdin to None when fd 0 is closed (`<&-`): no input
    interactive = stdin.isatty()
    while True:
        if interactive:
            sys.stderr.write("> ")  # stderr: piped stdout holds the replies only
            sys.stderr.flush()
        line = stdin.readline()
        if not line:  # EOF (Ctrl-D); a blank line is "\n"
            if interactive:
                sys.stderr.write("\n")  # end on a new line, not after the "> " prompt
            return history
        message = line.strip()
        if message == "exit":
            return history
        if message == "/reset":
            history = list(system)
        elif message:
            history.append({"role": "user", "content": message})
            reply(model, tokenizer, history, args, generator)


if __name__ == "__main__":
    run_script(main)
