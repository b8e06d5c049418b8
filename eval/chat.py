"""Talk to a checkpoint through its chat template, with the reply streamed token by token.

    python eval/chat.py --model_path checkpoints/sft --prompt "What is 47 + 38?"      # one shot
    python eval/chat.py --model_path Qwen3-0.6B --device cuda --enable_thinking 1     # interactive
    printf 'What is 2+3?\\nAnd times 4?\\n' | python eval/chat.py --model_path checkpoints/sft

Interactive mode reads one user message per line until EOF or a command. Commands (case does not matter):
    /help    the commands (also a line that is just `help`)
    /reset   clear the conversation, answered with "conversation cleared (N turns)"; the --system message stays
    /exit    quit with exit code 0 (also `/quit`, a line that is just `exit` or `quit`, and EOF: Ctrl-D)
Any other line starting with "/" is an unknown command: it is said so and not sent to the model (start a message
with "//" to send one that begins with "/"). The same commands work on piped input; their one-line answers go to
stderr, so stdout holds exactly the replies, each followed by a newline (`/help`'s list is the one longer answer).

On a terminal (stdin a TTY) there is more: a banner with the model and the commands, the "> " prompt, and line
editing through the standard `readline` module (arrow keys, Ctrl-A/E, Ctrl-R search, Tab completes a command), with
a history kept in --history_file (default ~/.cache/qwen3-distill/chat_history, or under $XDG_CACHE_HOME; its last
1000 lines, the file readable by its owner only; `--history_file ''` keeps the history for the session only). The
prompt and the echo of what is typed never go to a redirected stdout (`python eval/chat.py ... | tee replies.txt`
still edits lines, on stderr's terminal).
Keys: Ctrl-C during a reply stops that reply and returns to the prompt (the part shown stays in the conversation;
/reset drops it); Ctrl-C at the prompt quits on a new line with exit code 130 (the project's Ctrl-C convention);
Ctrl-D at the prompt quits on a new line with exit code 0. On piped input, Ctrl-C (SIGINT) stops at once with 130.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from common.errors import ArgumentParser, refuse, run_script  # noqa: E402
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
                                  torch.rand(1, generator=generator, dtype=torch.float64, device=device))
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
          generator: torch.Generator | None, stoppable: bool = False) -> str:
    """Render the conversation, stream the assistant's answer to stdout, append it to `history`. With `stoppable`
    (a terminal), Ctrl-C ends the reply where it is: what was shown becomes the assistant's turn."""
    prompt = tokenizer.apply_chat_template(history, add_generation_prompt=True,
                                           enable_thinking=bool(args.enable_thinking))
    shown: list[str] = []

    def write(piece: str) -> None:
        shown.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        answer = stream_reply(model, tokenizer, tokenizer.encode(prompt), args.max_new_tokens, args.temperature,
                              args.top_p, generator, write)
        write("\n")
    except KeyboardInterrupt:
        if not stoppable:
            raise
        answer = "".join(shown).removesuffix("\n")
        sys.stdout.write("\n")
        sys.stdout.flush()
        notify("reply stopped (what was shown stays in the conversation; /reset clears it)")
    history.append({"role": "assistant", "content": answer})
    return answer


# ------------------------------------------------------------------------------------------------------ commands

HELP = """commands:
  /help    this list (also: help)
  /reset   clear the conversation (the --system message stays)
  /exit    quit (also: /quit, exit, quit, Ctrl-D)
  //text   send a message that begins with "/"
keys: Ctrl-C stops a reply (at the prompt it quits, exit code 130); arrow keys edit and recall lines"""
COMMANDS = ("/help", "/reset", "/exit")
BARE_WORDS = {"help": "/help", "exit": "/exit", "quit": "/exit"}


def notify(line: str) -> None:
    """A message to the user, never a reply: stderr, so that stdout holds the replies only."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def command_of(message: str) -> str | None:
    """The command a (stripped) line is -- "/help", "/reset", "/exit", or an unknown "/word" as typed -- or None
    for a message to the model. A line that is only `help`, `exit` or `quit` is that command too."""
    if message.lower() in BARE_WORDS:
        return BARE_WORDS[message.lower()]
    if not message.startswith("/") or message.startswith("//"):
        return None
    name = message.split()[0].lower()
    return "/exit" if name == "/quit" else name


def run_command(command: str, message: str, history: list[dict], system: list[dict]) -> bool:
    """Carry out a command in place on `history`, answering with its line(s); -> False to quit."""
    if command in COMMANDS and len(message.split()) > 1:
        notify(f"{message.split()[0]} takes no arguments; nothing was sent to the model")
        return True
    if command == "/exit":
        return False
    if command == "/help":
        notify(HELP)
    elif command == "/reset":
        turns = sum(turn["role"] == "user" for turn in history)
        history[:] = system
        notify(f"conversation cleared ({turns} turn{'' if turns == 1 else 's'})")
    else:
        notify(f"unknown command {command}: nothing was sent to the model (/help lists the commands; start with // "
               f"to send a message that begins with /)")
    return True


# ------------------------------------------------------------------------------------------------------ terminal

def default_history_file() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "qwen3-distill", "chat_history")


class Terminal:
    """The interactive side of a chat on a terminal: prompt, line editing and history through `readline`.

    input() uses readline only when stdin and stdout are both the terminal, and readline writes the prompt and the
    echo to stdout. When stdout is redirected, stderr's terminal stands in for fd 1 while a line is read, so the
    prompt never lands among the replies. Without readline (or without a terminal to echo on), the line is read
    as the terminal driver delivers it, with the prompt on stderr."""

    PROMPT = "> "
    HISTORY_LENGTH = 1000

    def __init__(self, history_file: str):
        self.history_file = history_file
        self.echo_fd = 1 if os.isatty(1) else 2 if os.isatty(2) else None
        self.readline = None
        self.loaded = 0  # history lines read from the file: the rest are this session's
        if self.echo_fd is None:
            return
        try:
            import readline
        except ImportError:  # a Python built without it: the terminal driver's own editing (backspace) only
            return
        self.readline = readline
        readline.set_history_length(self.HISTORY_LENGTH)
        readline.set_completer_delims(" \t\n")
        readline.set_completer(self.complete)
        if "libedit" in (readline.__doc__ or ""):  # macOS's readline module
            readline.parse_and_bind("bind ^I rl_complete")
        else:
            readline.parse_and_bind("tab: complete")
        if history_file:
            try:
                os.makedirs(os.path.dirname(history_file) or ".", mode=0o700, exist_ok=True)
                os.close(os.open(history_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
                readline.read_history_file(history_file)
                self.loaded = readline.get_current_history_length()
            except OSError as error:
                notify(f"chat history is kept for this session only: cannot use {history_file} ({error.strerror})")
                self.history_file = ""

    def complete(self, text: str, state: int) -> str | None:
        """Tab at the start of a line completes a command."""
        if self.readline.get_begidx() != 0:
            return None
        matches = [c for c in COMMANDS if c.startswith(text.lower())]
        return matches[state] if state < len(matches) else None

    def read(self) -> str | None:
        """One line as typed (no trailing newline), or None at EOF (Ctrl-D), which ends the prompt's line."""
        try:
            if self.readline is None:
                sys.stderr.write(self.PROMPT)
                sys.stderr.flush()
                line = sys.stdin.readline()
                if not line:
                    raise EOFError
                return line
            with self.echo_on_terminal():
                return input(self.PROMPT)
        except EOFError:
            os.write(2 if self.readline is None else self.echo_fd, b"\n")  # not after the "> " prompt
            return None

    @contextmanager
    def echo_on_terminal(self) -> Iterator[None]:
        if self.echo_fd == 1:
            yield
            return
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(self.echo_fd, 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)

    def close(self) -> None:
        """Add this session's lines to the history file, keeping its last HISTORY_LENGTH (also when Ctrl-C ends
        the chat). Appending, not rewriting, keeps the lines of a chat that ran at the same time."""
        if self.readline is None or not self.history_file:
            return
        try:
            if hasattr(self.readline, "append_history_file"):
                self.readline.append_history_file(self.readline.get_current_history_length() - self.loaded,
                                                  self.history_file)
            else:
                self.readline.write_history_file(self.history_file)
        except OSError as error:
            notify(f"chat history not saved to {self.history_file} ({error.strerror})")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="Chat with a Qwen3 checkpoint (streamed replies)")
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
    # terminal
    parser.add_argument("--history_file", default=None,
                        help="line history of interactive sessions (default: ~/.cache/qwen3-distill/chat_history; "
                             "'' keeps it for the session only)")
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
    if not stdin.isatty():
        return converse(model, tokenizer, history, system, args, generator, read=lambda: stdin.readline() or None)
    terminal = Terminal(default_history_file() if args.history_file is None else args.history_file)
    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    notify(f"chat with {args.model_path} ({args.device}, {dtype}; up to {args.max_new_tokens} new tokens a reply)\n"
           f"/help for the commands, /reset to clear the conversation, /exit or Ctrl-D to quit; Ctrl-C stops a reply")
    try:
        return converse(model, tokenizer, history, system, args, generator, read=terminal.read, stoppable=True)
    finally:
        terminal.close()


def converse(model: Qwen3ForCausalLM, tokenizer, history: list[dict], system: list[dict], args: argparse.Namespace,
             generator: torch.Generator | None, read: Callable[[], str | None], stoppable: bool = False) -> list[dict]:
    """The interactive loop: a line from `read` (None at EOF) is a command or a message answered by the model."""
    while True:
        line = read()
        if line is None:
            return history
        message = line.strip()
        if not message:
            continue
        command = command_of(message)
        if command is not None:
            if not run_command(command, message, history, system):
                return history
            continue
        history.append({"role": "user", "content": message.removeprefix("/")})  # "//x" sends "/x"
        reply(model, tokenizer, history, args, generator, stoppable)


if __name__ == "__main__":
    run_script(main)
