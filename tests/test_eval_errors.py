# python -m pytest tests/test_eval_errors.py
"""eval/eval_math.py and eval/chat.py under the project's failure convention (common/errors.py): a user error is one
line `error: ...` with exit code 2 and no traceback; Ctrl-D ends chat.py with 0, Ctrl-C with 130."""
import os
import signal
import subprocess
import sys
from argparse import Namespace

import pytest
import torch

from common.errors import EXIT_INTERRUPTED, EXIT_USAGE, TRACEBACK_ENV, UserError
from support import ROOT, TINY_CONFIG
from eval import chat, eval_math
from model import Qwen3Config, create_model, save_pretrained

SCRIPTS = ["eval_math.py", "chat.py"]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("eval_errors") / "model")
    save_pretrained(create_model(Qwen3Config.from_dict(TINY_CONFIG), seed=0), folder)
    return folder


def script_command(script: str, *argv: str) -> list[str]:
    return [sys.executable, os.path.join(ROOT, "eval", script), *argv]


def script_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop(TRACEBACK_ENV, None)
    return env


def run_script(script: str, *argv: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(script_command(script, *argv), capture_output=True, text=True, timeout=180, cwd=ROOT,
                          env=script_env(), **kwargs)


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("error:"), result.stderr
    assert fragment in result.stderr


# ---------------------------------------------------------------------------------------------- the scripts run

@pytest.mark.parametrize("script", SCRIPTS)
def test_missing_model_folder_is_one_line(script, tmp_path):
    missing = str(tmp_path / "checkpoints" / "sfft")
    assert_one_line_error(run_script(script, "--model_path", missing), f"--model_path {missing} does not exist")


@no_cuda
@pytest.mark.parametrize("script", SCRIPTS)
def test_cuda_without_cuda_is_one_line(script, model_dir):
    assert_one_line_error(run_script(script, "--model_path", model_dir, "--device", "cuda"),
                          "no CUDA device is visible: pass --device cpu")


@pytest.mark.parametrize("stdin", ["empty", pytest.param("closed", marks=pytest.mark.slow)])
def test_chat_ends_quietly_at_end_of_input(stdin, model_dir):
    """Ctrl-D on a terminal, an empty pipe, or no stdin at all (`<&-`: Python then sets sys.stdin to None)."""
    close_stdin = (lambda: os.close(0)) if stdin == "closed" else None
    result = run_script("chat.py", "--model_path", model_dir, "--device", "cpu", stdin=subprocess.DEVNULL,
                        preexec_fn=close_stdin)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and "Traceback" not in result.stderr


@pytest.mark.slow
def test_chat_ctrl_c_exits_130_without_traceback(model_dir):
    process = subprocess.Popen(script_command("chat.py", "--model_path", model_dir, "--device", "cpu",
                                              "--temperature", "0", "--max_new_tokens", "1"),
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=ROOT, env=script_env())
    try:
        process.stdin.write("What is 2 + 3?\n")
        process.stdin.flush()
        process.stdout.readline()  # a reply came back: the script is past its imports, inside run_script
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] == "interrupted"


# ---------------------------------------------------------------------------------------- validation in process

def model_args(model_path: str, device: str = "cpu") -> Namespace:
    return Namespace(model_path=model_path, device=device, dtype=None)


@pytest.mark.parametrize("device", ["gpu", "mps", "cuda:x"])
def test_unknown_device_refused(device, model_dir):
    with pytest.raises(UserError, match=f"--device {device} is not a device"):
        eval_math.validate_model_args(model_args(model_dir, device))


@no_cuda
def test_cuda_refused_by_both_parsers(model_dir):
    for parse_args in (eval_math.parse_args, chat.parse_args):
        with pytest.raises(UserError, match="--device cuda:1 but no CUDA device is visible"):
            parse_args(["--model_path", model_dir, "--device", "cuda:1"])


def test_folder_that_is_not_a_model_refused(model_dir, tmp_path):
    with pytest.raises(UserError, match="has no config.json"):
        eval_math.validate_model_args(model_args(str(tmp_path)))
    (tmp_path / "config.json").write_text(open(os.path.join(model_dir, "config.json")).read())
    eval_math.validate_model_args(model_args(str(tmp_path)))  # it looks like a model folder...
    with pytest.raises(UserError, match="tokenizer.json"):
        eval_math.load_for_inference(str(tmp_path), "cpu", None)  # ...but its files are missing


def test_unwritable_output_refused_before_loading_the_model(model_dir, tmp_path, monkeypatch):
    def load_for_inference(*args):
        raise AssertionError("the model was loaded before the output folder was checked")

    monkeypatch.setattr(eval_math, "load_for_inference", load_for_inference)
    data = tmp_path / "problems.jsonl"
    data.write_text('{"question": "What is 1 + 1?", "ground_truth": "2"}\n')
    blocker = tmp_path / "results"
    blocker.write_text("a file where the output folder should be")
    with pytest.raises(UserError, match=f"the output folder {blocker} is not writable"):
        eval_math.main(["--model_path", model_dir, "--data_path", str(data), "--device", "cpu",
                        "--out", str(blocker / "out.jsonl")])

