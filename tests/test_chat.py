# python -m pytest tests/test_chat.py
"""eval/chat.py as a person uses it: on a pseudo-terminal (banner, commands, readline's line editing and history,
Ctrl-C and Ctrl-D), and its commands on piped input (stdout holds the replies only)."""
import fcntl
import io
import os
import select
import subprocess
import sys
import termios
import time

import pytest

from common.errors import EXIT_INTERRUPTED, TRACEBACK_ENV
from support import ROOT, TINY_CONFIG
from eval import chat
from model import Qwen3Config, create_model, load_tokenizer, save_pretrained

QUESTION = "What is 2 + 3?"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved tiny model with an untied head (a tied random model only repeats the prompt's last token, "\\n")."""
    folder = tmp_path_factory.mktemp("chat")
    model = create_model(Qwen3Config.from_dict({**TINY_CONFIG, "tie_word_embeddings": False}), seed=0).eval()
    save_pretrained(model, str(folder / "model"))
    return {"model": model, "tokenizer": load_tokenizer(str(folder / "model")), "model_dir": str(folder / "model")}


def take_terminal() -> None:
    """In the child, after setsid: the pseudo-terminal on fd 0 becomes its controlling terminal, so that Ctrl-C
    typed there is a SIGINT, as in a shell."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """chat.py with a pseudo-terminal as stdin and stderr (and stdout, unless `stdout_pipe`), read with timeouts."""

    def __init__(self, argv: list[str], home: str, stdout_pipe: bool = False):
        env = {**os.environ, "PYTHONPATH": ROOT, "TERM": "xterm", "HOME": str(home), "OMP_NUM_THREADS": "1"}
        for name in (TRACEBACK_ENV, "XDG_CACHE_HOME", "INPUTRC"):
            env.pop(name, None)
        self.master, slave = os.openpty()
        self.process = subprocess.Popen([sys.executable, os.path.join(ROOT, "eval", "chat.py"), *argv],
                                        stdin=slave, stdout=subprocess.PIPE if stdout_pipe else slave, stderr=slave,
                                        cwd=ROOT, env=env, start_new_session=True, preexec_fn=take_terminal)
        os.close(slave)
        self.output = ""  # everything the terminal showed
        self.seen = 0  # how far expect() has matched
        self.stdout = b""  # the piped stdout, when there is one

    def pump(self, timeout: float) -> bool:
        """Read what is there within `timeout`; -> False once the terminal is closed (the child has exited)."""
        fds = [self.master] + ([self.process.stdout.fileno()] if self.process.stdout else [])
        ready, _, _ = select.select(fds, [], [], timeout)
        for fd in ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: every holder of the terminal's other side is gone
                data = b""
            if fd == self.master:
                if not data:
                    return False
                self.output += data.decode("utf-8", "replace")
            else:
                self.stdout += data
        return True

    def expect(self, text: str, timeout: float = 60) -> str:
        """Wait until `text` shows after the previous match; -> what showed up to and including it."""
        deadline = time.monotonic() + timeout
        while (found := self.output.find(text, self.seen)) < 0:
            if time.monotonic() > deadline or not self.pump(deadline - time.monotonic()):
                raise AssertionError(f"{text!r} did not show; the terminal shows:\n{self.output[self.seen:]!r}")
        start, self.seen = self.seen, found + len(text)
        return self.output[start:self.seen]

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def wait_until_reading(self, timeout: float = 30) -> None:
        """Wait until the child sleeps in readline's select() for a key. CPython's readline looks at signals only
        when that select() is interrupted, so a SIGINT landing between the prompt being drawn and select() being
        entered is noticed only at the next key: a window of microseconds that no typist hits, but a test that
        answers the prompt at once does."""
        path, deadline, sleeping = f"/proc/{self.process.pid}/stat", time.monotonic() + timeout, 0
        while sleeping < 3 and time.monotonic() < deadline:
            try:
                with open(path) as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:  # no /proc (not Linux): a pause does it
                time.sleep(0.5)
                return
            sleeping = sleeping + 1 if state == "S" else 0
            time.sleep(0.02)

    def wait_for_stdout(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.stdout.strip():
            assert time.monotonic() < deadline, "no reply on stdout"
            self.pump(0.05)

    def finish(self, timeout: float = 30) -> int:
        """Read to the end (the terminal closes when the child exits); -> the exit code."""
        deadline = time.monotonic() + timeout
        while self.pump(0.1):
            if time.monotonic() > deadline:
                raise AssertionError(f"still running; the terminal shows:\n{self.output[self.seen:]!r}")
        if self.process.stdout:
            self.stdout += self.process.stdout.read()
        return self.process.wait(timeout=30)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self.process.stdout:
            self.process.stdout.close()
        os.close(self.master)


def greedy_reply(setup, question: str, max_new_tokens: int) -> str:
    tokenizer = setup["tokenizer"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           enable_thinking=False)
    return chat.stream_reply(setup["model"], tokenizer, tokenizer.encode(prompt), max_new_tokens, 0.0, 1.0, None,
                             lambda piece: None)


def test_terminal_session(setup, tmp_path):
    """Banner, /help, a streamed reply, /reset, the up arrow recalling the previous line, an unknown command, Tab,
    then Ctrl-D: exit 0 on a new line, and the lines typed kept in ~/.cache/qwen3-distill/chat_history."""
    expected = greedy_reply(setup, QUESTION, 8)
    assert expected.strip()
    term = Terminal(["--model_path", setup["model_dir"], "--device", "cpu", "--temperature", "0",
                     "--max_new_tokens", "8"], tmp_path)
    try:
        banner = term.expect("> ")
        assert f"chat with {setup['model_dir']} (cpu, float32" in banner
        assert all(command in banner for command in ("/help", "/reset", "/exit", "Ctrl-D"))

        term.send("/help\r")
        listing = term.expect("> ")
        assert all(f"\n  {command}" in listing.replace("\r\n", "\n") for command in ("/help", "/reset", "/exit"))

        term.send(QUESTION + "\r")
        term.expect(QUESTION)  # readline's echo
        term.expect(expected.replace("\n", "\r\n") + "\r\n")  # the reply, on its own line
        term.expect("> ")

        term.send("/reset\r")
        term.expect("conversation cleared (1 turn)\r\n")
        term.expect("> ")
        term.send("\x1b[A")  # up arrow: readline shows the previous line, "/reset", again
        term.expect("/reset")
        term.send("\r")
        term.expect("conversation cleared (0 turns)\r\n")
        term.expect("> ")

        term.send("/nope\r")
        assert "unknown command /nope: nothing was sent to the model" in term.expect("> ")
        term.send("/he\t\r")  # Tab completes the command
        assert "  /reset" in term.expect("> ")

        term.send("\x04")  # Ctrl-D
        assert term.finish() == 0, term.output
    finally:
        term.close()
    assert "^[[A" not in term.output and "Traceback" not in term.output
    assert term.output.endswith("> \r\n")  # Ctrl-D ends the prompt's line: the shell's prompt starts a new one
    history = tmp_path / ".cache" / "qwen3-distill" / "chat_history"
    assert history.read_text().splitlines() == ["/help", QUESTION, "/reset", "/nope", "/help"]
    assert history.stat().st_mode & 0o777 == 0o600


@pytest.mark.slow
def test_ctrl_c_stops_a_reply_and_then_quits(setup, tmp_path):
    """stdout piped (`chat.py | tee`): the prompt, the echo and the messages use stderr's terminal and stdout gets
    the reply only. Ctrl-C in a long reply stops it and returns to the prompt, keeping what was shown as the turn;
    Ctrl-C at the prompt quits with 130, on a new line, the history saved."""
    history = tmp_path / "history"
    term = Terminal(["--model_path", setup["model_dir"], "--device", "cpu", "--max_new_tokens", "1900",
                     "--history_file", str(history)], tmp_path, stdout_pipe=True)
    try:
        term.expect("> ")
        term.send("Tell me a long story.\r")
        term.expect("Tell me a long story.")  # edited and echoed on the terminal although stdout is a pipe
        term.wait_for_stdout()
        term.send("\x03")  # Ctrl-C while the reply streams
        term.expect("reply stopped")
        term.expect("> ")
        term.send("/reset\r")
        term.expect("conversation cleared (1 turn)")  # the stopped reply was a turn
        term.expect("> ")
        term.wait_until_reading()
        term.send("\x03")  # Ctrl-C at the prompt
        assert term.finish() == EXIT_INTERRUPTED, term.output
    finally:
        term.close()
    assert term.output.replace("\r\n", "\n").endswith("> \ninterrupted\n") and "Traceback" not in term.output
    reply = term.stdout.decode()
    assert reply.strip() and reply.endswith("\n") and reply.count("\n") == reply.strip("\n").count("\n") + 1
    assert not any(text in reply for text in ("chat with", "> Tell me", "reply stopped", "conversation cleared"))
    assert history.read_text().splitlines() == ["Tell me a long story.", "/reset"]


def test_commands_on_piped_input(setup, monkeypatch, capsys):
    """Commands are the same off a terminal; their answers go to stderr and are never sent to the model."""
    prompts, replies = [], []
    real_stream_reply = chat.stream_reply

    def spy(model, tokenizer, prompt_ids, *args):
        prompts.append(tokenizer.decode(prompt_ids))
        replies.append(real_stream_reply(model, tokenizer, prompt_ids, *args))
        return replies[-1]

    monkeypatch.setattr(chat, "stream_reply", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO(
        "HELP\n/nope\n/reset now\n//etc/hosts is a file?\n/reset\n" + QUESTION + "\nquit\nnever read\n"))
    history = chat.main(["--model_path", setup["model_dir"], "--device", "cpu", "--max_new_tokens", "3",
                         "--temperature", "0"])
    out, err = capsys.readouterr()
    assert len(prompts) == 2 and "/etc/hosts is a file?" in prompts[0] and "//etc" not in prompts[0]
    assert "/nope" not in "".join(prompts) and "help" not in "".join(prompts).lower()
    assert history == [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": replies[1]}]
    assert out == replies[0] + "\n" + replies[1] + "\n"  # the replies only
    assert "commands:" in err and "unknown command /nope" in err and "/reset takes no arguments" in err
    assert "conversation cleared (1 turn)" in err and "> " not in err and "chat with" not in err


@pytest.mark.parametrize("line, command", [("help", "/help"), ("Exit", "/exit"), ("QUIT", "/exit"),
                                           ("/quit", "/exit"), ("/Reset", "/reset"), ("/foo bar", "/foo"),
                                           ("//foo", None), ("help me", None), ("what is 1/2?", None)])
def test_command_of(line, command):
    assert chat.command_of(line) == command
