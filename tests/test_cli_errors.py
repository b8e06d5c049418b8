# python -m pytest tests/test_cli_errors.py
"""A flag argparse itself rejects (unknown, missing, mistyped) is one `error: argument ...` line with exit
code 2 in every script, as any other refused flag is -- not the whole usage text; and under torchrun a refused flag
is said once, not once per rank."""
import json
import os
import subprocess

import pytest

from support import ROOT
from loop_helpers import assert_one_line_error, env_one_thread, script_exit, torchrun_command
from benchmarks.demo import main as demo
from dataset.teacher_generate import main as teacher_generate
from eval.chat import main as chat
from eval.eval_math import main as eval_math
from trainer.train_distillation import main as train_distillation
from trainer.train_dpo import main as train_dpo
from trainer.train_logit_free import main as train_logit_free
from trainer.train_opd import main as train_opd
from trainer.train_ppo import main as train_ppo
from trainer.train_pretrain import main as train_pretrain
from trainer.train_rl import main as train_rl
from trainer.train_sft import main as train_sft

# each script's main and the flags it requires (argparse names missing ones before unknown ones)
SCRIPTS = {"train_sft": (train_sft, []), "train_distillation": (train_distillation, []), "train_opd": (train_opd, []),
           "train_logit_free": (train_logit_free, []), "train_rl": (train_rl, []), "train_ppo": (train_ppo, []),
           "train_pretrain": (train_pretrain, []),
           "train_dpo": (train_dpo, []),
           "eval_math": (eval_math, ["--model_path", "m"]), "chat": (chat, ["--model_path", "m"]),
           "teacher_generate": (teacher_generate, ["--data_path", "d", "--out", "o", "--base_url", "u", "--model", "m"]),
           "demo": (demo, [])}


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unknown_flag_is_one_line(script, capsys):
    main, required = SCRIPTS[script]
    code, stderr = script_exit(main, [*required, "--no_such_flag", "1"], capsys)
    assert_one_line_error(code, stderr, 2, "--no_such_flag", "--help")


@pytest.mark.parametrize("argv, names", [
    (["--batch_size", "two"], ["--batch_size", "'two'"]),
    (["--dtype", "float8"], ["--dtype", "'float8'", "float32"]),
])
def test_a_mistyped_value_is_one_line(argv, names, capsys):
    code, stderr = script_exit(train_sft, argv, capsys)
    assert_one_line_error(code, stderr, 2, *names)


@pytest.mark.serial
@pytest.mark.slow
def test_under_torchrun_a_refused_flag_is_said_once(tmp_path):
    command = torchrun_command(os.path.join(ROOT, "trainer", "train_sft.py"), ["--max_steps", "-3"])
    result = subprocess.run(command, env=env_one_thread(), capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "--max_steps" in errors[0], result.stderr[-3000:]
    assert "train_sft.py\", line" not in result.stderr, result.stderr[-3000:]  # no worker traceback


SHORTENED = {"train_sft": "--learning_rate", "train_distillation": "--learning_rate", "train_opd": "--max_new_tokens",
             "train_logit_free": "--continuations", "train_rl": "--num_generations", "train_ppo": "--critic_learning_rate",
             "train_pretrain": "--learning_rate",
             "train_dpo": "--precompute_ref",
             "eval_math": "--max_rows", "chat": "--temperature", "teacher_generate": "--concurrency",
             "demo": "--fresh"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_shortened_flag_is_refused_not_taken_for_another(script, capsys):
    """argparse would take --learning_rat for the one flag it begins (--learning_rate); every script refuses it
    instead, naming it."""
    main, required = SCRIPTS[script]
    with pytest.raises(SystemExit):
        main(["--help"])
    assert SHORTENED[script] in capsys.readouterr().out  # the flag it would have been taken for exists
    shortened = SHORTENED[script][:-1]
    code, stderr = script_exit(main, [*required, shortened, "1"], capsys)
    assert_one_line_error(code, stderr, 2, shortened)


def test_the_vllm_launcher_passes_a_shortened_flag_on_instead_of_taking_it_for_its_own(monkeypatch):
    """The launcher hands flags it does not know to vLLM (which refuses what it does not know either): --por is
    passed on, never taken for --port."""
    import serving.vllm_launch as launch

    def execve(python, command, env):
        raise SystemExit(command)
    monkeypatch.setattr(launch.os, "execve", execve)
    with pytest.raises(SystemExit) as launched:
        launch.main(["--model", "m", "--por", "1", "--python", "/bin/false"])
    command = launched.value.code
    assert command[command.index("--port") + 1] == "8000" and command[-2:] == ["--por", "1"], command


@pytest.mark.parametrize("script", ["train_sft", "train_distillation", "train_opd", "train_logit_free", "train_rl",
                                    "train_ppo", "train_pretrain", "train_dpo"])
def test_help_gives_every_flag_a_text_and_its_default_once(script, capsys):
    with pytest.raises(SystemExit):
        SCRIPTS[script][0](["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in out and "(default: the built-in demo data) (default" not in out
    for flag in ("--epochs", "--weight_decay", "--seed"):
        described = out.split(f"{flag} {flag.upper().lstrip('-')} ")[1]
        assert not described.startswith("(default"), f"{flag} has no help text: {described[:80]}"


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as stopped:
        train_sft(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert stopped.value.code == 0
    assert "rows per micro-batch per device (default: 16)" in out and "(default: 2e-3)" not in out
    assert "auto: 0.002, 10x that with --lora_rank" in out and "(default: auto)" in out


def test_a_refused_value_names_only_the_flag_that_is_wrong(capsys):
    code, stderr = script_exit(train_sft, ["--grad_clip", "-1"], capsys)
    assert_one_line_error(code, stderr, 2, "--grad_clip must be >= 0, got -1.0")
    assert "--max_steps" not in stderr and "argument error" not in stderr


def test_a_run_refused_at_start_up_leaves_no_save_dir_behind(tmp_path, capsys):
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"messages": [{"role": "user", "content": "no answer to train on"}]}\n')
    save_dir = tmp_path / "new" / "checkpoints"
    code, stderr = script_exit(train_sft, ["--data_path", str(bad_rows), "--save_dir", str(save_dir)], capsys)
    assert_one_line_error(code, stderr, 2, str(bad_rows), "row 0")
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # neither the folder nor its parent was created


def test_a_missing_critic_is_refused_before_any_folder_is_made(tmp_path, capsys):
    """train_ppo.py --critic_path that is no model folder: one line naming the flag, at start-up (no save_dir)."""
    save_dir = tmp_path / "checkpoints"
    code, stderr = script_exit(train_ppo, ["--critic_path", str(tmp_path / "nowhere"), "--save_dir", str(save_dir),
                                           "--model_config", os.path.join(ROOT, "model", "configs", "qwen3-tiny.json")],
                               capsys)
    assert_one_line_error(code, stderr, 2, "--critic_path", "nowhere", "does not exist")
    assert not save_dir.exists()


def pairs_file(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


PAIR = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "chosen": [{"role": "assistant", "content": "5"}],
        "rejected": [{"role": "assistant", "content": "6"}]}


@pytest.mark.parametrize("row, names", [
    ({"prompt": PAIR["prompt"], "chosen": PAIR["chosen"]}, ["row 1", "no 'rejected' column", "prompt"]),
    ({"messages": PAIR["prompt"] + PAIR["chosen"]}, ["row 1", "no 'chosen' and no 'rejected' column"]),
    ({**PAIR, "chosen": PAIR["prompt"] + PAIR["chosen"]}, ["row 1", "column 'chosen'", "exactly one assistant turn"]),
    ({"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "6"}, ["row 1", "standard schema", "conversational"]),
    ({"chosen": PAIR["prompt"] + PAIR["chosen"], "rejected": [{"role": "user", "content": "Other?"}] + PAIR["rejected"]},
     ["row 1", "implicit schema"]),
], ids=["no-rejected", "no-pair", "chosen-not-one-answer", "mixed-schemas", "implicit-mixed"])
def test_a_dpo_row_without_a_pair_is_refused_before_any_folder_is_made(row, names, tmp_path, capsys):
    """train_dpo.py: a row without chosen / rejected, or not in the file's schema (its first row's), is one line
    naming the file, the row and what to change, before the save folder exists."""
    data = pairs_file(tmp_path / "pairs.jsonl", [PAIR, row])
    save_dir = tmp_path / "checkpoints"
    code, stderr = script_exit(train_dpo, ["--data_path", data, "--save_dir", str(save_dir)], capsys)
    assert_one_line_error(code, stderr, 2, data, *names)
    assert not save_dir.exists()


def test_a_dpo_file_that_is_no_pair_file_is_refused_in_one_line(tmp_path, capsys):
    """A damaged file, an implicit pair whose conversations differ before their answers, a held-out file of plain
    chat rows: one line each, naming the file (and the row)."""
    save_dir = tmp_path / "checkpoints"
    damaged = tmp_path / "pairs.parquet"
    damaged.write_bytes(b"PAR1 not really")
    code, stderr = script_exit(train_dpo, ["--data_path", str(damaged), "--save_dir", str(save_dir)], capsys)
    assert_one_line_error(code, stderr, 2, str(damaged), "not a readable parquet file")
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    implicit = pairs_file(tmp_path / "implicit.jsonl", [
        {"chosen": turns, "rejected": [{"role": "user", "content": "Hey"}, turns[1]]}])
    code, stderr = script_exit(train_dpo, ["--data_path", implicit, "--save_dir", str(save_dir)], capsys)
    assert_one_line_error(code, stderr, 2, implicit, "row 0", "must share their prompt")
    chat = pairs_file(tmp_path / "chat.jsonl", [{"messages": turns}])
    code, stderr = script_exit(train_dpo, ["--data_path", pairs_file(tmp_path / "ok.jsonl", [PAIR]),
                                           "--eval_data_path", chat, "--eval_interval", "1", "--save_dir",
                                           str(save_dir)], capsys)
    assert_one_line_error(code, stderr, 2, chat, "row 0", "no 'chosen' and no 'rejected' column")
    code, stderr = script_exit(train_dpo, ["--beta", "0", "--save_dir", str(save_dir)], capsys)
    assert_one_line_error(code, stderr, 2, "--beta must be > 0")
    assert not save_dir.exists()
