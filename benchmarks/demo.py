"""The README's demo, run literally: its commands one after the other, then its table ("What the demo reaches").

    python benchmarks/demo.py              # runs COMMANDS below in the repository root, then prints the table
    python benchmarks/demo.py --dry_run    # prints the commands only, one per line (`... --dry_run | sh` runs them)
    python benchmarks/demo.py --fresh      # first moves an earlier demo's runs into checkpoints/demo/previous-TIME/

Each command of COMMANDS runs as a subprocess in the repository root, exactly as written (its leading `python` is the
interpreter running this script, so a venv need not be activated), with its output passing through, and is timed.
They are the README's quick-start commands with their runs in a folder of their own, checkpoints/demo/ (--save_dir,
and the model folders below it), so the demo never touches a run of the quick start itself (checkpoints/sft/...).
When all have finished, the table is printed in Markdown, every number read back from what the commands wrote:
  accuracy   eval/eval_math.py's summary beside each model, checkpoints/demo/NAME_eval_eval.summary.json: held-out
             accuracy on the 200 demo eval problems, its 95% Wilson interval and the count
  notes      the training run's checkpoints/demo/NAME_metrics.jsonl: optimizer steps, the first and the last logged loss
             (KD: also its CE and KD parts), and the in-training evaluations (--eval_interval; greedy completions of
             the first --eval_rows held-out prompts): the reverse KL to the teacher (KD and OPD) at step 0 and at the
             end with its change, the share of completions that end with EOS; then eval_math's EOS share
  wall time  of each command, measured here (training + evaluation)
with the date, `nproc`, the CPU and the commit above it. The README's table is this script's output, pasted.

On this project's 2-core CPU machine the whole demo took 10.3 minutes with nothing else running (2026-12-02: SFT
2.2 min, KD 4.7 min, OPD 2.7 min, each evaluation of 200 problems x 64 new tokens 8-11 s), and 40 minutes with
other jobs on the same cores. The printed table carries the times actually measured.

The training scripts refuse to start over a run of the same name (`--from_resume 1` / `--start_over 1`), and a new
table must not mix an old run's files with new ones: if checkpoints/demo/ already holds a run named random, sft, kd
or opd (its folder, resume file, metrics, lock or evaluation: an earlier demo's), the script refuses with one line,
unless `--fresh` is given, which first moves all of those files into checkpoints/demo/previous-TIME/. Runs of these
names elsewhere (the quick start's checkpoints/sft/) are neither refused nor moved. A run that is still in progress
(its NAME.lock names a live process) is refused either way. A command that fails stops the demo with its exit
code; Ctrl-C reaches the running command too (a training run saves a checkpoint first) and stops the demo (130).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.harness import machine  # noqa: E402
from common.errors import ArgumentParser, RuntimeFailure, UserError, run_script  # noqa: E402
from trainer.flags import add_common_args  # noqa: E402

# Where the commands write: a folder of the demo's own, so that the quick start's checkpoints/sft/ (the README's
# first command) and the demo never meet. The training scripts' --save_dir; the model folders lie below it.
SAVE_DIR = "checkpoints/demo"
# The demo, in the order the table shows it: the README's quick-start commands, their runs in SAVE_DIR.
COMMANDS = [
    "python -c \"from model import Qwen3Config, create_model, save_pretrained; save_pretrained(create_model("
    f"Qwen3Config.from_json('model/configs/qwen3-tiny.json'), seed=42), '{SAVE_DIR}/random')\"",
    f"python eval/eval_math.py --model_path {SAVE_DIR}/random --max_new_tokens 64",
    f"python trainer/train_sft.py --eval_interval 50 --save_dir {SAVE_DIR}",
    f"python eval/eval_math.py --model_path {SAVE_DIR}/sft --max_new_tokens 64",
    f"python trainer/train_distillation.py --eval_interval 50 --save_dir {SAVE_DIR}",
    f"python eval/eval_math.py --model_path {SAVE_DIR}/kd --max_new_tokens 64",
    f"python trainer/train_opd.py --eval_interval 8 --save_dir {SAVE_DIR}",
    f"python eval/eval_math.py --model_path {SAVE_DIR}/opd --max_new_tokens 64",
]


@dataclass(frozen=True)
class Row:
    name: str                 # run name: SAVE_DIR/NAME/, NAME_metrics.jsonl, NAME_eval_eval.summary.json
    label: str                # the table's model column (the parameter count is added from the saved weights)
    commands: tuple[str, ...]
    trained: bool = True      # a training run: it writes NAME_metrics.jsonl


ROWS = (
    Row("random", "random init (qwen3-tiny)", tuple(COMMANDS[0:2]), trained=False),
    Row("sft", "SFT quick start (the teacher, qwen3-tiny)", tuple(COMMANDS[2:4])),
    Row("kd", "KD student (qwen3-tiny-student)", tuple(COMMANDS[4:6])),
    Row("opd", "OPD of the KD student", tuple(COMMANDS[6:8])),
)
assert [c for row in ROWS for c in row.commands] == COMMANDS, "every command belongs to one row, in order"

EVAL_STEM = "eval"         # eval_math's default data is dataset/demo/eval.parquet: NAME_eval_eval.summary.json


# ---------------------------------------------------------------------------------------------- the guard

def run_files(save_dir: str, name: str) -> list[str]:
    """What a run or evaluation named `name` leaves in save_dir: its folder, resume file, metrics, lock, folders set
    aside by --start_over, eval_math's outputs and half-written temporaries. Other names (opd2, sft_big) are not
    touched."""
    patterns = [name, f"{name}_resume.pt", f"{name}_metrics.jsonl", f"{name}.lock", f"{name}.replaced-*",
                f"{name}_eval_*", f".{name}.tmp-*", f".{name}_resume.pt.tmp-*", f".{name}_eval_*.tmp-*"]
    found = set()
    for pattern in patterns:
        found.update(glob.glob(os.path.join(glob.escape(save_dir), pattern)))
    return sorted(found)


def existing_runs(save_dir: str) -> dict[str, list[str]]:
    """{run name: its files} for the demo's run names that have any."""
    found = {row.name: run_files(save_dir, row.name) for row in ROWS}
    return {name: files for name, files in found.items() if files}


def check_no_live_run(save_dir: str) -> None:
    """Refuse, with or without --fresh, while a demo run is in progress: its lock names a live process here, or a
    process on another host (whose state cannot be known from here)."""
    for row in ROWS:
        lock = os.path.join(save_dir, f"{row.name}.lock")
        try:
            with open(lock, encoding="utf-8") as f:
                holder = json.load(f)
        except (OSError, ValueError):
            continue  # no lock, or a half-written one: nobody holds it
        pid, host = holder.get("pid"), holder.get("host")
        if host != socket.gethostname():
            raise UserError(f"{lock}: a run named {row.name} is held by PID {pid} on host {host}; wait for it, or "
                            f"delete the lock if that run is gone")
        if isinstance(pid, int) and pid_alive(pid):
            raise UserError(f"{lock}: a run named {row.name} is in progress (PID {pid}); wait for it or stop it "
                            f"(kill {pid}) before running the demo")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def move_aside(save_dir: str, existing: dict[str, list[str]]) -> str:
    """Move every file of `existing` into save_dir/previous-TIME/ (a new folder); -> that folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, n = os.path.join(save_dir, f"previous-{stamp}"), 1
    while os.path.exists(folder):
        n += 1
        folder = os.path.join(save_dir, f"previous-{stamp}-{n}")
    os.makedirs(folder)
    for files in existing.values():
        for path in files:
            os.replace(path, os.path.join(folder, os.path.basename(path)))
    return folder


def describe(existing: dict[str, list[str]], save_dir: str) -> str:
    names = [os.path.relpath(p, save_dir) for files in existing.values() for p in files]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return f"{len(names)} file(s) of an earlier demo's runs named {'/'.join(existing)} ({shown})"


# -------------------------------------------------------------------------------------------- running commands

class CommandFailed(RuntimeFailure):
    """A demo command exited with an error: one line, and the demo exits with the command's own code."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def command_argv(command: str) -> list[str]:
    """The command as an argument vector; its leading `python` is this interpreter."""
    argv = shlex.split(command)
    if argv and argv[0] == "python":
        argv[0] = sys.executable
    return argv


def run_command(command: str, cwd: str) -> float:
    """Run one command in `cwd` with its output passing through; -> its wall time in seconds. A failure raises
    CommandFailed. Ctrl-C reaches the command as well (same process group): wait for it to stop (a training run
    saves first; its second Ctrl-C stops at once, a third here kills it), then stop the demo."""
    start = time.perf_counter()
    process = subprocess.Popen(command_argv(command), cwd=cwd)
    interrupts = 0
    while True:
        try:
            code = process.wait()
            break
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts >= 3:
                process.kill()
    if interrupts:
        raise KeyboardInterrupt
    seconds = time.perf_counter() - start
    if code != 0:
        raise CommandFailed(f"`{command}` failed with exit code {code} after {format_seconds(seconds)} (its output "
                            f"is above); the demo stops here", code if 0 < code < 256 else 1)
    return seconds


# ------------------------------------------------------------------------------------------ reading the results

def read_json(path: str, written_by: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist: `{written_by}` writes it") from None
    except ValueError as error:
        raise UserError(f"{path} is not valid JSON ({error}): rerun `{written_by}`") from None


def read_metrics(path: str, written_by: str) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl -> (per-step records, in-training evaluation records), in file order."""
    steps, evals = [], []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise UserError(f"{path} does not exist: `{written_by}` writes it") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise UserError(f"{path} line {number} is not valid JSON ({error}): rerun `{written_by}`") from None
        if not isinstance(record, dict) or "step" not in record:
            raise UserError(f"{path} line {number} has no step: not a metrics record of this project")
        (steps if "loss" in record else evals).append(record)
    if not steps:
        raise UserError(f"{path} holds no logged step: did `{written_by}` finish?")
    return steps, evals


def count_parameters(folder: str) -> int | None:
    """Parameters stored in folder/model.safetensors (tied embeddings once), from the file's JSON header alone;
    None when the file cannot be read."""
    try:
        with open(os.path.join(folder, "model.safetensors"), "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        total = 0
        for key, tensor in header.items():
            if key != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= dim
                total += count
        return total
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


@dataclass
class RowResult:
    row: Row
    summary: dict
    seconds: list[float]
    steps: list[dict]
    evals: list[dict]
    parameters: int | None


def collect(save_dir: str, rows: Sequence[Row], seconds: Sequence[float]) -> list[RowResult]:
    """Each row's evaluation summary, training metrics and parameter count; `seconds`: one per command, in order."""
    results, i = [], 0
    for row in rows:
        summary = read_json(os.path.join(save_dir, f"{row.name}_eval_{EVAL_STEM}.summary.json"), row.commands[-1])
        steps, evals = (read_metrics(os.path.join(save_dir, f"{row.name}_metrics.jsonl"), row.commands[0])
                        if row.trained else ([], []))
        results.append(RowResult(row, summary, list(seconds[i:i + len(row.commands)]), steps, evals,
                                 count_parameters(os.path.join(save_dir, row.name))))
        i += len(row.commands)
    return results


# ---------------------------------------------------------------------------------------------------- the table

def format_seconds(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def format_accuracy(summary: dict) -> str:
    low, high = summary["accuracy_ci95"]
    return (f"{100 * summary['accuracy']:.1f}% [{100 * low:.1f}, {100 * high:.1f}] "
            f"({summary['correct']}/{summary['samples']})")


def number(x: float) -> str:
    """Two decimals (11.85, 0.88); three significant digits below 0.1, where two decimals would say nothing."""
    return f"{x:.2f}" if abs(x) >= 0.1 or x == 0 else f"{x:.3g}"


def change(first: float, last: float) -> str:
    return f", {100 * (last - first) / first:+.0f}%" if first else ""


def notes(result: RowResult) -> str:
    parts = []
    if result.steps:
        first, last = result.steps[0], result.steps[-1]
        text = f"{last['step']} steps, loss {number(first['loss'])} -> {number(last['loss'])}"
        for key in ("ce", "kd"):
            if key in first and key in last:
                text += f", {key.upper()} {number(first[key])} -> {number(last[key])}"
        parts.append(text)
    kl = [e for e in result.evals if "eval/reverse_kl" in e]
    if len(kl) >= 2:
        first, last = kl[0]["eval/reverse_kl"], kl[-1]["eval/reverse_kl"]
        parts.append(f"held-out reverse KL {first:.3f} (step {kl[0]['step']}) -> {last:.3f} "
                     f"(step {kl[-1]['step']}){change(first, last)}")
    elif kl:
        parts.append(f"held-out reverse KL {kl[0]['eval/reverse_kl']:.3f} (step {kl[0]['step']})")
    eos = [e for e in result.evals if "eval/eos_share" in e]
    if len(eos) >= 2:
        parts.append(f"held-out greedy EOS share {eos[0]['eval/eos_share']:.0%} -> {eos[-1]['eval/eos_share']:.0%}")
    summary = result.summary
    parts.append(f"eval_math: {summary['eos_share']:.0%} of completions end with EOS, mean "
                 f"{summary['mean_completion_tokens']:.0f} tokens")
    return "; ".join(parts)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def model_label(result: RowResult) -> str:
    if result.parameters is None:
        return result.row.label
    label = result.row.label
    count = f"{result.parameters / 1e6:.1f}M parameters"
    return f"{label[:-1]}, {count})" if label.endswith(")") else f"{label} ({count})"


def table(results: Sequence[RowResult]) -> str:
    lines = ["| model | commands | accuracy | notes | wall time |", "|---|---|---|---|---|"]
    for result in results:
        commands = " then ".join(f"`{command}`" for command in result.row.commands)
        wall = " + ".join(format_seconds(s) for s in result.seconds)
        lines.append("| " + " | ".join(cell(text) for text in (model_label(result), commands,
                                                                   format_accuracy(result.summary),
                                                                   notes(result), wall)) + " |")
    return "\n".join(lines)


def heldout_settings(commands: Sequence[str]) -> set[tuple[int, int]]:
    """(--eval_rows, --eval_max_new_tokens) of the training commands, their flags parsed by the loops' own parser."""
    parser = argparse.ArgumentParser(add_help=False)
    add_common_args(parser, save_weight="demo")
    settings = set()
    for command in commands:
        args, _ = parser.parse_known_args(shlex.split(command)[2:])
        settings.add((args.eval_rows, args.eval_max_new_tokens))
    return settings


def intro(results: Sequence[RowResult]) -> str:
    """The sentence above the table: what the accuracy and the notes measure, from the summaries and the flags."""
    evals = {(s["rows"], s["args"].get("max_new_tokens"), s["args"].get("temperature"))
             for s in (r.summary for r in results)}
    if len(evals) == 1:
        rows, new_tokens, temperature = evals.pop()
        how = "greedy" if not temperature else f"temperature {temperature}"
        accuracy = f"Held-out accuracy on the {rows} demo eval problems ({how}, {new_tokens} new tokens"
    else:
        accuracy = "Held-out accuracy on the demo eval problems (settings differ: see each command"
    text = (f"{accuracy}, graded with math-verify; 95% Wilson interval), from each model's "
            f"`{SAVE_DIR}/NAME_eval_{EVAL_STEM}.summary.json`.")
    settings = heldout_settings([c for r in results if r.row.trained for c in r.row.commands[:1]])
    if len(settings) == 1:
        eval_rows, new_tokens = settings.pop()
        text += (f" The held-out reverse KL (to the SFT teacher) and EOS share in the notes are the in-training "
                 f"evaluation's, from `{SAVE_DIR}/NAME_metrics.jsonl`: the student's greedy completions "
                 f"({new_tokens} new tokens) of the first {eval_rows} eval prompts.")
    return text


def report(results: Sequence[RowResult], total_seconds: float) -> str:
    return (f"### What the demo reaches (measured by `python benchmarks/demo.py`: {machine()}; "
            f"{format_seconds(total_seconds)} in all)\n\n{intro(results)}\n\n{table(results)}")


# ----------------------------------------------------------------------------------------------------------- CLI

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--dry_run", action="store_true", help="print the commands, one per line, and stop")
    parser.add_argument("--fresh", action="store_true",
                        help=f"move an earlier demo's runs (random/sft/kd/opd in {SAVE_DIR}/) into "
                             f"{SAVE_DIR}/previous-TIME/ first")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None, root: str = ROOT,
         runner: Callable[[str, str], float] = run_command) -> int:
    """`root` (the folder the commands run in) and `runner` (command, cwd -> seconds) are for the tests."""
    args = parse_args(argv)
    save_dir = os.path.join(root, SAVE_DIR)
    existing = existing_runs(save_dir)
    if args.dry_run:
        print("\n".join(COMMANDS), flush=True)
        if existing:
            what = "--fresh would move them aside first" if args.fresh else "the demo needs --fresh"
            print(f"note: {SAVE_DIR}/ holds {describe(existing, save_dir)}: {what}", file=sys.stderr, flush=True)
        return 0
    check_no_live_run(save_dir)
    if existing and not args.fresh:
        raise UserError(f"{SAVE_DIR}/ holds {describe(existing, save_dir)}: pass --fresh to move them into "
                        f"{SAVE_DIR}/previous-TIME/ first, or move them yourself")
    if existing:
        folder = move_aside(save_dir, existing)
        print(f"--fresh: moved {describe(existing, save_dir)} into {os.path.relpath(folder, root)}/", flush=True)
    start, seconds = time.perf_counter(), []
    for i, command in enumerate(COMMANDS, 1):
        print(f"\n[demo {i}/{len(COMMANDS)}] {command}", flush=True)
        seconds.append(runner(command, root))
        print(f"[demo {i}/{len(COMMANDS)}] done in {format_seconds(seconds[-1])}", flush=True)
    results = collect(save_dir, ROWS, seconds)
    print("\n" + report(results, time.perf_counter() - start), flush=True)
    return 0


if __name__ == "__main__":
    run_script(main)
