"""The README's demo, run literally: its commands one after the other, then its table ("What the demo reaches").

    python benchmarks/demo.py              # runs COMMANDS below in the repository root, then prints the table
    python benchmarks/demo.py --dry_run    # prints the commands only, one per line (`... --dry_run | sh` runs them,
                                           # the logit-free row's teacher server in the background)
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
             the first --eval_rows held-out prompts): the reverse KL to the teacher (KD, OPD, logit-free) at step 0
             and at the end with its change, the share of completions that end with EOS; the logit-free run's teacher
             requests and tokens; then eval_math's EOS share
  wall time  of each command, measured here (training + evaluation; the logit-free row: the teacher server's
             start-up first)
with the date, `nproc`, the CPU and the commit above it. The README's table is this script's output, pasted.

The fifth row, beside OPD's, is the KD student distilled logit-free (trainer/train_logit_free.py) from the SFT model
served as a black box: the demo starts SERVE_TEACHER (serving/vllm_launch.py: vLLM's CPU server of
checkpoints/demo/sft, text only, on 127.0.0.1:8001) as its own background process, waits for it, runs the training
command (OPD's number of steps and --eval_interval; --eval_teacher_path the SFT model, so its held-out reverse KL to
the teacher is logged at step 0 and after), stops the server, and evaluates. The demo's 5M-parameter SFT model
cannot count: asked to continue "1, 2, 3, 4," it writes spaces, so the command passes `--teacher_probe request`
(the probe's requests must be accepted and answered in full; whether the teacher continues rather than restarts is
not checked, and the run says so). Without the vLLM environment (serving/setup_vllm_cpu.sh makes it), or with port
8001 taken, that row is skipped and says so in one line; so it is when the server does not start (its log:
checkpoints/demo/logit_free_teacher_server.log).

The last row is RL with verifiable rewards (trainer/train_rl.py, docs/rl.md) from the SFT model: the KD student
never ends an answer, so all its groups would be wrong together and give no signal. Groups of 4, 8 prompts a step,
OPD's 32 steps; its notes add the reward and pass@4 of the first and last step and the share of groups without
signal over the run.

On this project's 2-core CPU machine the whole demo took 10.3 minutes with nothing else running (2026-12-02: SFT
2.2 min, KD 4.7 min, OPD 2.7 min, each evaluation of 200 problems x 64 new tokens 8-11 s), and 40 minutes with
other jobs on the same cores. The printed table carries the times actually measured.

The training scripts refuse to start over a run of the same name (`--from_resume 1` / `--start_over 1`), and a new
table must not mix an old run's files with new ones: if checkpoints/demo/ already holds a run named random, sft, kd,
opd, logit_free or rl (its folder, resume file, metrics, lock, evaluation, teacher cache: an earlier demo's), the
script refuses with one line, unless `--fresh` is given, which first moves all of those files into
checkpoints/demo/previous-TIME/. Runs of these
names elsewhere (the quick start's checkpoints/sft/) are neither refused nor moved. A run that is still in progress
(its NAME.lock names a live process) is refused either way. A command that fails stops the demo with its exit
code; Ctrl-C reaches the running command too (a training run saves a checkpoint first) and stops the demo (130).
"""
from __future__ import annotations

import argparse
import contextlib
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
from trainer.config.flags import add_common_args  # noqa: E402

# The logit-free row's teacher: the SFT model served by vLLM on this port, as the demo's own background process
TEACHER_PORT = 8001
TEACHER_URL = f"http://127.0.0.1:{TEACHER_PORT}/v1"
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
    # the KD student distilled logit-free from the SFT model served as a black box (SERVE_TEACHER, started by the
    # demo around this command): OPD's steps and --eval_interval, the method's values for 25-64-token completions
    f"python trainer/train_logit_free.py --teacher_url {TEACHER_URL} --teacher_form chat --teacher_probe request "
    f"--chunk_len 8 --audit_chunks 4 --continuations 4 --eval_interval 8 --eval_teacher_path {SAVE_DIR}/sft "
    f"--save_dir {SAVE_DIR}",
    f"python eval/eval_math.py --model_path {SAVE_DIR}/logit_free --max_new_tokens 64",
    # RL with verifiable rewards, from the SFT model (the KD student never ends an answer: every group would be
    # all wrong, no signal): groups of 4, 8 prompts a step, OPD's number of steps, a learning rate 20x below SFT's
    # (at SFT's 2e-3 the first updates wiped out the model's EOS within 16 steps: measured)
    f"python trainer/train_rl.py --num_generations 4 --batch_size 8 --max_steps 32 --learning_rate 1e-4 "
    f"--eval_interval 8 --save_dir {SAVE_DIR}",
    f"python eval/eval_math.py --model_path {SAVE_DIR}/rl --max_new_tokens 64",
]


# The logit-free row's teacher server, run in the background (in its own process group) from before that row's
# training command until it ends. serving/vllm_launch.py runs it in the vLLM environment's Python. Without chunked
# prefill: vLLM 0.32's CPU engine dies on a seeded request whose prefill is split over steps ("CPU Generator does not
# use offset"), and every teacher request of the loop carries a seed (32 in flight split the prefill; measured).
SERVE_TEACHER = (f"python serving/vllm_launch.py --model {SAVE_DIR}/sft --name teacher --port {TEACHER_PORT} "
                 f"-- --no-enable-chunked-prefill")
ENABLE_VLLM = "serving/setup_vllm_cpu.sh makes one; then `python benchmarks/demo.py --fresh`"


@dataclass(frozen=True)
class Row:
    name: str                 # run name: SAVE_DIR/NAME/, NAME_metrics.jsonl, NAME_eval_eval.summary.json
    label: str                # the table's model column (the parameter count is added from the saved weights)
    commands: tuple[str, ...]
    trained: bool = True      # a training run: it writes NAME_metrics.jsonl
    server: str | None = None  # a teacher server the demo runs in the background around the training command


ROWS = (
    Row("random", "random init (qwen3-tiny)", tuple(COMMANDS[0:2]), trained=False),
    Row("sft", "SFT quick start (the teacher, qwen3-tiny)", tuple(COMMANDS[2:4])),
    Row("kd", "KD student (qwen3-tiny-student)", tuple(COMMANDS[4:6])),
    Row("opd", "OPD of the KD student", tuple(COMMANDS[6:8])),
    Row("logit_free", "logit-free OPD of the KD student (the SFT teacher served as a black box)",
        tuple(COMMANDS[8:10]), server=SERVE_TEACHER),
    Row("rl", "RL with verifiable rewards of the SFT model (GRPO, groups of 4)", tuple(COMMANDS[10:12])),
)
assert [c for row in ROWS for c in row.commands] == COMMANDS, "every command belongs to one row, in order"

EVAL_STEM = "eval"         # eval_math's default data is dataset/demo/eval.parquet: NAME_eval_eval.summary.json


# ---------------------------------------------------------------------------------------------- the guard

def run_files(save_dir: str, name: str) -> list[str]:
    """What a run or evaluation named `name` leaves in save_dir: its folder, resume file, metrics, lock, folders set
    aside by --start_over, eval_math's outputs and half-written temporaries; a logit-free run's teacher cache (a new
    run would take the old answers from it) and the log of the demo's teacher server. Other names (opd2, sft_big)
    are not touched."""
    patterns = [name, f"{name}_resume.pt", f"{name}_metrics.jsonl", f"{name}.lock", f"{name}.replaced-*",
                f"{name}_eval_*", f".{name}.tmp-*", f".{name}_resume.pt.tmp-*", f".{name}_eval_*.tmp-*",
                f"{name}_teacher_cache.rank*.jsonl", f"{name}_teacher_server.log"]  # the logit-free row's
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


# ---------------------------------------------------------------------------------------- the served teacher

class ServedTeacher:
    """The logit-free row's black-box teacher: the demo's SFT model served by vLLM (SERVE_TEACHER, the vLLM
    environment's server behind serving/vllm_launch.py) on 127.0.0.1:TEACHER_PORT, a subprocess of the demo in its
    own process group, stopped when the row's training ends (or fails, or Ctrl-C)."""

    def unavailable(self) -> str | None:
        """Why the row cannot run here (one line, with how to enable it), or None."""
        from serving.vllm_launch import DEFAULT_VENV, vllm_python
        if vllm_python() is None:
            return f"no vLLM environment at {DEFAULT_VENV}: {ENABLE_VLLM}"
        if port_in_use(TEACHER_PORT):
            return (f"port {TEACHER_PORT} (the demo's teacher server) is in use: stop what listens there, then "
                    f"`python benchmarks/demo.py --fresh`")
        return None

    @contextlib.contextmanager
    def serving(self, command: str, cwd: str, log_path: str):
        """The server started (its output into log_path) and ready; stopped however the block ends. ServerFailed
        when it exits or is not ready in 15 minutes."""
        from serving.vllm_launch import stop_vllm, wait_ready
        with open(log_path, "w", encoding="utf-8") as log:
            process = subprocess.Popen(command_argv(command), cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        try:
            try:
                wait_ready(process, TEACHER_PORT, log_path)
            except RuntimeError as error:
                raise ServerFailed(f"{str(error).splitlines()[0].rstrip(':')}; its log: {log_path}") from None
            yield
        finally:
            stop_vllm(process)


class ServerFailed(RuntimeFailure):
    """The teacher server exited or was not ready in time: its row is not run (the note says where its log is)."""


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((host, port)) == 0


def server_log(row: Row) -> str:
    return f"{SAVE_DIR}/{row.name}_teacher_server.log"


def wait_for_teacher(timeout: float = 900.0) -> None:
    """For the --dry_run script: wait until the teacher server answers GET /health; exit 1 after `timeout`."""
    import httpx
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{TEACHER_PORT}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    sys.exit(f"error: no teacher server on port {TEACHER_PORT} after {timeout:.0f} s")


def script_lines() -> list[str]:
    """What --dry_run prints: COMMANDS, one per line, and around a served row's training command its server
    started in the background, waited for and stopped (POSIX sh)."""
    lines = []
    for row in ROWS:
        if row.server is None:
            lines += row.commands
            continue
        train, *rest = row.commands
        lines += [f"{row.server} > {server_log(row)} 2>&1 & TEACHER_PID=$!",
                  "python -c \"from benchmarks.demo import wait_for_teacher; wait_for_teacher()\"",
                  train, "kill $TEACHER_PID", *rest]
    return lines


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
class RowRun:
    """What running a row gave: the seconds of each command that ran, in order; a served row's teacher start-up
    seconds; and, when its commands did not run, why (one line)."""
    seconds: list[float]
    serve_seconds: float | None = None
    skipped: str | None = None


@dataclass
class RowResult:
    row: Row
    summary: dict | None      # None: the row was skipped
    seconds: list[float]
    steps: list[dict]
    evals: list[dict]
    parameters: int | None
    serve_seconds: float | None = None
    skipped: str | None = None


def collect(save_dir: str, rows: Sequence[Row], runs: Sequence[RowRun]) -> list[RowResult]:
    """Each row's evaluation summary, training metrics and parameter count (none for a skipped row); `runs`: one
    per row, in order."""
    results = []
    for row, run in zip(rows, runs, strict=True):
        if run.skipped is not None:
            results.append(RowResult(row, None, run.seconds, [], [], None, run.serve_seconds, run.skipped))
            continue
        summary = read_json(os.path.join(save_dir, f"{row.name}_eval_{EVAL_STEM}.summary.json"), row.commands[-1])
        steps, evals = (read_metrics(os.path.join(save_dir, f"{row.name}_metrics.jsonl"), row.commands[0])
                        if row.trained else ([], []))
        results.append(RowResult(row, summary, run.seconds, steps, evals,
                                 count_parameters(os.path.join(save_dir, row.name)), run.serve_seconds))
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
    if result.steps and "teacher_requests" in result.steps[0]:  # a black-box teacher: what it was asked
        requests = sum(m.get("teacher_requests", 0) for m in result.steps)
        tokens = sum(m.get("teacher_tokens", 0) for m in result.steps)
        parts.append(f"{requests:,.0f} teacher requests ({tokens:,.0f} tokens)")
    if result.steps and "reward" in result.steps[0]:  # RL: the rewards of its groups
        group = next(k for k in result.steps[0] if k.startswith("pass@") and k != "pass@1")
        first, last = result.steps[0], result.steps[-1]
        silent = sum(m["zero_variance_share"] for m in result.steps) / len(result.steps)
        parts.append(f"reward {first['reward']:.3f} -> {last['reward']:.3f}, {group} {first[group]:.0%} -> "
                     f"{last[group]:.0%}, groups without signal {silent:.0%} of all")
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


def commands_cell(row: Row) -> str:
    commands = " then ".join(f"`{command}`" for command in row.commands)
    if row.server is None:
        return commands
    return f"`{row.server}` in the background, then " + commands.replace(" then ", " (server stopped) then ", 1)


def wall_time(result: RowResult) -> str:
    parts = [f"{format_seconds(result.serve_seconds)} to serve the teacher"] if result.serve_seconds is not None \
        else []
    parts += [format_seconds(s) for s in result.seconds]
    return " + ".join(parts) or "-"


def table(results: Sequence[RowResult]) -> str:
    lines = ["| model | commands | accuracy | notes | wall time |", "|---|---|---|---|---|"]
    for result in results:
        accuracy = "-" if result.summary is None else format_accuracy(result.summary)
        note = result.skipped if result.skipped is not None else notes(result)
        lines.append("| " + " | ".join(cell(text) for text in (model_label(result), commands_cell(result.row),
                                                                   accuracy, note, wall_time(result))) + " |")
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
    results = [r for r in results if r.summary is not None]  # a skipped row evaluated nothing
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
                        help=f"move an earlier demo's runs ({'/'.join(row.name for row in ROWS)} in {SAVE_DIR}/) "
                             f"into {SAVE_DIR}/previous-TIME/ first")
    return parser.parse_args(argv)


def run_commands(commands: Sequence[str], first: int, root: str, runner: Callable[[str, str], float]) -> list[float]:
    """Run `commands` (COMMANDS[first - 1:], numbered from `first`) one after the other; -> their seconds."""
    seconds = []
    for i, command in enumerate(commands, first):
        print(f"\n[demo {i}/{len(COMMANDS)}] {command}", flush=True)
        seconds.append(runner(command, root))
        print(f"[demo {i}/{len(COMMANDS)}] done in {format_seconds(seconds[-1])}", flush=True)
    return seconds


def run_served_row(row: Row, first: int, root: str, runner: Callable[[str, str], float],
                   teacher: ServedTeacher) -> RowRun:
    """A row whose training command needs row.server: skipped (one line, how to enable it) where the teacher
    cannot be served; else the server started, the training command run, the server stopped, then the
    evaluation."""
    where = f"[demo {first}-{first + len(row.commands) - 1}/{len(COMMANDS)}]"
    note = teacher.unavailable()
    if note is not None:
        print(f"\n{where} skipped, the {row.name} row: {note}", flush=True)
        return RowRun([], skipped=f"skipped: {note}")
    log = os.path.join(root, server_log(row))
    print(f"\n{where} {row.server} (in the background, its output in {server_log(row)}; 2-5 minutes to start on 2 "
          f"CPU cores)", flush=True)
    start = time.perf_counter()
    try:
        with teacher.serving(row.server, root, log):
            serve_seconds = time.perf_counter() - start
            print(f"{where} the teacher is served after {format_seconds(serve_seconds)}", flush=True)
            seconds = run_commands(row.commands[:1], first, root, runner)
    except ServerFailed as error:
        note = f"skipped: the teacher server did not start: {error}"
        print(f"{where} {note}", flush=True)
        return RowRun([], skipped=note)
    print(f"{where} the teacher server is stopped", flush=True)
    return RowRun(seconds + run_commands(row.commands[1:], first + 1, root, runner), serve_seconds)


def main(argv: list[str] | None = None, root: str = ROOT, runner: Callable[[str, str], float] = run_command,
         teacher: ServedTeacher | None = None) -> int:
    """`root` (the folder the commands run in), `runner` (command, cwd -> seconds) and `teacher` (the served
    teacher's start and stop) are for the tests."""
    args = parse_args(argv)
    save_dir = os.path.join(root, SAVE_DIR)
    existing = existing_runs(save_dir)
    if args.dry_run:
        print("\n".join(script_lines()), flush=True)
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
    teacher = teacher or ServedTeacher()
    start, runs, first = time.perf_counter(), [], 1
    for row in ROWS:
        runs.append(run_served_row(row, first, root, runner, teacher) if row.server is not None
                    else RowRun(run_commands(row.commands, first, root, runner)))
        first += len(row.commands)
    results = collect(save_dir, ROWS, runs)
    print("\n" + report(results, time.perf_counter() - start), flush=True)
    return 0


if __name__ == "__main__":
    run_script(main)
