"""Where a logit-free distillation step spends its time, and how much of it is the black-box teacher's audit.

    python benchmarks/bench_logit_free.py --stub        # the fast tests' stub teacher in this process (answers at once)
    python serving/vllm_launch.py --model checkpoints/demo/sft --name teacher --port 8001 \
        -- --no-enable-chunked-prefill &                # a served teacher (docs/benchmarks.md: why the flag)
    python benchmarks/bench_logit_free.py --teacher_url http://127.0.0.1:8001/v1 --model_path checkpoints/demo/kd \
        --teacher_probe request                       # the demo SFT model cannot count (docs/benchmarks.md)
    python benchmarks/bench_logit_free.py --teacher_url https://api.example.com/v1 --teacher_model big-model \
        --teacher_api_key_env API_KEY --teacher_options '{}'          # any OpenAI-compatible endpoint
    python benchmarks/bench_logit_free.py --stub --steps 6 --threads 1 --json logit_free.json

It starts nothing itself: the teacher is --teacher_url (a served model, e.g. serving/vllm_launch.py's), or, with
--stub, tests/stub_server.py's black_box_teacher (the fast tests' deterministic text-only teacher: it continues the
start-up probe and answers every other request at once with short phrases; loaded from that file, so there is one
stub) on 127.0.0.1 in this process. The stub measures what the loop itself spends on an audit (planning, HTTP, the
crash-proof cache's fsync per answer, agreement); a served teacher adds its generation. A teacher the loop refuses
(its start-up probe: continue "1, 2, 3, 4," with 5) stops the benchmark with the loop's one-line refusal.

The measurement is the real loop: trainer/train_logit_free.py's main() runs --steps optimizer steps (in this
process) into a new folder RUN in --workdir (default: a temporary folder), so its teacher cache is empty and every
request is sent; the loop's console output goes to RUN/loop.log, and its RUN/bench_metrics.jsonl is read back. Per
step the loop's PhaseClock records
  rollouts    gen_s: the student samples its completions (the built-in engine)
  entropy     entropy_s: the student's exact entropy at every completion position (no grad), the audit's schedule
  teacher     teacher_s: the teacher's continuations of every audited chunk of the micro-batch, all in flight at once
  reference   reference_s: the frozen reference's forward (the anchor's p_ref)
  loss/bwd    train_s: the student's forward, the audit loss + the anchor, backward
and the step's wall time step_ms; "rest" is step_ms minus the phases (optimizer step, logging). Each is the median
over the steps after the first (the first warms up); a phase's share is its median over the sum of the phases'
medians (so they add up to 1, as the loop's own *_share do per step), and the audit's share of the step is
teacher_s over step_ms (medians). Teacher requests and tokens per step are the loop's teacher_requests (sent; each
asks n = --continuations continuations) and teacher_tokens (prompt + completion, as the endpoint reports them).
Student: --model_path, or random weights from --model_config (default: the OPD demo's student shape); random weights
sample EOS almost never, so every completion is --max_new_tokens long and gets --audit_chunks audits. Prompts: the
demo's opd_prompts (or --data_path). The method's defaults are the CPU demo's (--chunk_len 8 --audit_chunks 4
--continuations 4).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402
from common.errors import ArgumentParser, UserError, refuse, run_script  # noqa: E402
from dataset.continuations import FORMS  # noqa: E402

# the loop's phases (PhaseClock names) in step order, and how the table names them
PHASES = {"gen": "rollouts (student sampling)", "entropy": "entropy (the audit's schedule)",
          "teacher": "teacher audit (continuations)", "reference": "reference forward (anchor)",
          "train": "loss + backward"}
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)
    g = p.add_argument_group("the teacher (one of)")
    g.add_argument("--teacher_url", default=None, help="an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8001/v1")
    g.add_argument("--stub", action="store_true", help="tests/stub_server.py's stub teacher, in this process")
    g.add_argument("--teacher_model", default="teacher", help="the model name the endpoint serves")
    g.add_argument("--teacher_form", default="chat", choices=FORMS, help="as the loop's")
    g.add_argument("--teacher_tokenizer_path", default=None, help="as the loop's (--teacher_form completions)")
    g.add_argument("--teacher_options", default=None, help="as the loop's (JSON merged into every request)")
    g.add_argument("--teacher_api_key_env", default=None, help="as the loop's")
    g.add_argument("--teacher_probe", default="count", choices=["count", "request"],
                   help="as the loop's (request: for a teacher too small to count, the CPU demo's)")
    g = p.add_argument_group("the student and the data")
    g.add_argument("--model_path", default=None, help="HF folder of the student (default: random weights)")
    g.add_argument("--model_config", default=harness.STUDENT_CONFIG,
                   help="config.json of a random-weight student (ignored with --model_path)")
    g.add_argument("--data_path", default=None, help="prompts (default: the demo's opd_prompts)")
    g.add_argument("--batch_size", type=int, default=8)
    g.add_argument("--max_new_tokens", type=int, default=64)
    g = p.add_argument_group("the method (the loop's flags; defaults: the CPU demo's)")
    g.add_argument("--chunk_len", type=int, default=8)
    g.add_argument("--audit_chunks", type=int, default=4)
    g.add_argument("--continuations", type=int, default=4)
    g = p.add_argument_group("the run")
    g.add_argument("--steps", type=int, default=4, help="optimizer steps (the first is not counted)")
    harness.add_device_args(g)
    g.add_argument("--workdir", default=None, help="where the run goes (default: a temporary folder, removed)")
    harness.add_json_arg(p)
    args = p.parse_args(argv)
    if bool(args.stub) == bool(args.teacher_url):
        refuse("give the teacher: --teacher_url URL (a served model, e.g. serving/vllm_launch.py's) or --stub "
               "(the tests' stub teacher in this process), one of them")
    if args.steps < 2 or args.batch_size < 1:
        refuse(f"--steps must be >= 2 (the first is not counted) and --batch_size >= 1, got {args.steps} and "
               f"{args.batch_size}")
    return args


# ----------------------------------------------------------------------------------------------------------------
# the stub teacher: the fast tests' own (tests/stub_server.py), loaded from its file (tests/ is no package)

def load_stub_server():
    """tests/stub_server.py as a module (Stub, black_box_teacher)."""
    spec = importlib.util.spec_from_file_location("stub_server", os.path.join(ROOT, "tests", "stub_server.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def without_proxies():
    """The environment without proxy variables for the block: the stub on 127.0.0.1 is reached directly."""
    saved = {name: os.environ.pop(name) for name in PROXY_VARIABLES if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def teacher_endpoint(args):
    """-> (base URL, what it is): --teacher_url as given, or the stub started here (and stopped after the block)."""
    if not args.stub:
        yield args.teacher_url, f"{args.teacher_model} at {args.teacher_url} ({args.teacher_form} form)"
        return
    stub_server = load_stub_server()
    with without_proxies():
        server = stub_server.Stub(stub_server.black_box_teacher)
        try:
            yield server.url, f"the stub teacher (tests/stub_server.py) at {server.url}"
        finally:
            server.close()


# ----------------------------------------------------------------------------------------------------------------
# the run

def loop_argv(args, url: str, save_dir: str) -> list[str]:
    """trainer/train_logit_free.py's flags: the benchmark's, no evaluation, no save before the end."""
    flags = {"device": args.device, "dtype": args.dtype, "save_dir": save_dir, "save_weight": "bench",
             "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens, "max_steps": args.steps,
             "log_interval": 1, "save_interval": 10 ** 6, "chunk_len": args.chunk_len,
             "audit_chunks": args.audit_chunks, "continuations": args.continuations, "teacher_url": url,
             "teacher_model": args.teacher_model, "teacher_form": args.teacher_form,
             "teacher_tokenizer_path": args.teacher_tokenizer_path, "teacher_options": args.teacher_options,
             "teacher_api_key_env": args.teacher_api_key_env, "teacher_probe": args.teacher_probe,
             "data_path": args.data_path}
    flags.update({"model_path": args.model_path} if args.model_path else {"model_config": args.model_config})
    return [item for key, value in flags.items() if value is not None for item in (f"--{key}", str(value))]


def run_loop(argv: list[str], log_path: str) -> None:
    """train_logit_free.main(argv) in this process, its console output into log_path. A refusal (a flag, a teacher
    that fails the start-up probe) goes on as the loop's one line; on any other failure the log's tail goes to
    stderr first."""
    from trainer import train_logit_free
    with open(log_path, "w", encoding="utf-8") as log:
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                train_logit_free.main(argv)
        except UserError:
            raise
        except BaseException:
            log.flush()
            with open(log_path, encoding="utf-8", errors="replace") as f:
                tail = f.readlines()[-20:]
            print(f"the loop stopped (its output: {log_path}):\n{''.join(tail)}", file=sys.stderr, flush=True)
            raise


def step_medians(metrics_path: str) -> dict:
    """Medians over the logged steps after the first: each phase's seconds, the step's, the rest; the shares of the
    sum of the phases' medians; the audit's share of the step; teacher requests / tokens per step."""
    with open(metrics_path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps = [m for m in records if "loss" in m][1:]
    if not steps:
        raise RuntimeError(f"{metrics_path} holds no step after the first")
    phases = {phase: statistics.median(m.get(f"{phase}_s", 0.0) for m in steps) for phase in PHASES}
    total = sum(phases.values())
    step_s = statistics.median(m["step_ms"] / 1000.0 for m in steps)
    return {
        "steps_measured": len(steps),
        "phases_s": phases,
        "shares": {phase: seconds / total for phase, seconds in phases.items()},
        "step_s": step_s,
        "rest_s": statistics.median(m["step_ms"] / 1000.0 - sum(m.get(f"{p}_s", 0.0) for p in PHASES)
                                    for m in steps),
        "teacher_share_of_step": phases["teacher"] / step_s,
        "loop_teacher_share": statistics.median(m["teacher_share"] for m in steps),  # the loop's own, per step
        "teacher_requests_per_step": statistics.median(m["teacher_requests"] for m in steps),
        "teacher_cached_per_step": statistics.median(m.get("teacher_cached", 0) for m in steps),
        "teacher_tokens_per_step": statistics.median(m["teacher_tokens"] for m in steps),
        "completion_len": statistics.median(m["completion_len"] for m in steps),
        "audited_share": statistics.median(m["audited_share"] for m in steps),
    }


def measure(args, folder: str) -> dict:
    student = args.model_path or f"random weights from {os.path.relpath(args.model_config, ROOT)}"
    with teacher_endpoint(args) as (url, teacher):
        print(f"logit-free step on {args.device}, {torch.get_num_threads()} threads, load average "
              f"{os.getloadavg()[0]:.1f}: teacher {teacher}; student {student}; "
              f"batch {args.batch_size} prompts x max_new_tokens {args.max_new_tokens}; audits: up to "
              f"{args.audit_chunks} chunks of {args.chunk_len} tokens per completion, {args.continuations} "
              f"continuations each; {args.steps} steps (the first not counted)", flush=True)
        save_dir = tempfile.mkdtemp(prefix="run-", dir=folder)  # new: no earlier run, no cached answer
        run_loop(loop_argv(args, url, save_dir), os.path.join(save_dir, "loop.log"))
    results = step_medians(os.path.join(save_dir, "bench_metrics.jsonl"))
    results.update(teacher="stub" if args.stub else args.teacher_url, teacher_model=args.teacher_model,
                   teacher_form=args.teacher_form, student=args.model_path or args.model_config,
                   batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, chunk_len=args.chunk_len,
                   audit_chunks=args.audit_chunks, continuations=args.continuations, steps=args.steps,
                   threads=torch.get_num_threads())
    return results


def print_table(results: dict) -> None:
    steps = results["steps_measured"]
    print(f"\nmedians of steps 2-{steps + 1}; share: of the phases' sum\n")
    rows = [[name, f"{results['phases_s'][phase] * 1000:.0f}", f"{results['shares'][phase]:.1%}"]
            for phase, name in PHASES.items()]
    rows.append(["rest (optimizer step, logging)", f"{results['rest_s'] * 1000:.0f}", "-"])
    rows.append(["step", f"{results['step_s'] * 1000:.0f}", "-"])
    print(harness.table(["phase", "ms", "share"], rows))
    print(f"\nthe teacher's audit: {results['teacher_share_of_step']:.1%} of the step "
          f"({results['shares']['teacher']:.1%} of the phases); {results['teacher_requests_per_step']:g} requests "
          f"per step (x {results['continuations']} continuations; {results['teacher_cached_per_step']:g} from the "
          f"cache), {results['teacher_tokens_per_step']:g} teacher tokens per step; completions "
          f"{results['completion_len']:.1f} tokens, {results['audited_share']:.0%} of their tokens audited")


def main(argv=None) -> dict:
    args = parse_args(argv)
    harness.set_threads(args.threads)
    print(harness.machine(), flush=True)
    with contextlib.ExitStack() as stack:
        folder = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_logit_free_"))
        if args.workdir:
            os.makedirs(folder, exist_ok=True)
        results = measure(args, folder)
    print_table(results)
    harness.write_json(args.json, results)
    return results


if __name__ == "__main__":
    run_script(main)
