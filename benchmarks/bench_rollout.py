"""OPD with inference servers: the built-in engine against a vLLM server for rollouts, and the local teacher
against a served one, same weights, same machine, one run.

    python benchmarks/bench_rollout.py        # starts two vLLM CPU servers itself (serving/setup_vllm_cpu.sh first)
    python benchmarks/bench_rollout.py --rollout_url http://127.0.0.1:8000/v1 --teacher_url http://127.0.0.1:8001/v1
                                              # servers already running (serving/vllm_launch.py), e.g. on GPUs
    python benchmarks/bench_rollout.py --device cuda --dtype bfloat16 --batch_size 64 --max_new_tokens 512
    python benchmarks/bench_rollout.py --engines built-in,compiled    # no server: the built-in engine's side only

Two measurements:
  rollout   trainer.rollouts.source.sample_completions itself (the loop's rollout) on --batch_size demo prompts,
            sampled at temperature 1 with the loop's per-row seeds, by the built-in engine with the eager decode step,
            with the compiled one (--decode compiled's; it compiles in the warm-up) and by the server, alternating so
            that a slower moment of a shared machine hits all three: generated tokens (through each row's first
            EOS) per second, the median of --repeats after one warm-up each. The server holds the student's
            weights (pushed and verified first). After each served rollout the benchmark waits 2 s: a vLLM CPU
            server keeps a core busy for about a second after it answers, which slowed whichever engine ran next
            by up to 2.8x on 2 cores. --rollouts_only stops here.
  OPD step  trainer/train_opd.py for --steps optimizer steps in each layout (rollouts built-in or served; teacher
            local or served: --loss sampled_kl for the layouts that compare teachers, and --loss jsd
            --teacher_topk 16 with the served teacher's top-K; served rollouts with --max_staleness 0 and 1), same
            flags otherwise; the median over the steps after the first of ms/step and of its phases from
            metrics.jsonl: gen (rollouts; with --max_staleness 1 only what is left to wait for when the step
            trains), drain (the rollouts in flight finishing before the next push), sync (write the weights, the
            server loads them, prefix cache reset), verify (the probe's log-probs), teacher (its forward, or its
            log-probs from the server), train (student forward + backward); the optimizer step and logging are the
            rest of ms/step. Then the overlap's speed-up here, and what the serial phases give for a layout where
            the server and the trainer have their own devices.
--engines chooses what runs: built-in (the eager decode step), compiled, server (vLLM servers: the served rollouts
and the served teacher). Without server only the OPD layouts that need none run.
Models: --config (default model/configs/qwen3-tiny.json: hidden 128, 4 layers, the real vocabulary) with random
weights for the student and, with another seed, the teacher; the servers start from these folders.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402
from common.errors import ArgumentParser, RuntimeFailure, refuse, run_script  # noqa: E402
from dataset.collators import IGNORE_INDEX  # noqa: E402
from model import DTYPES, Decoder, load_pretrained, load_tokenizer  # noqa: E402
from model.precision import resolve_precision  # noqa: E402
from serving.engine import CompletionServer, probe_token_ids  # noqa: E402
from serving.vllm_launch import start_vllm, stop_vllm, vllm_command, vllm_python, wait_ready  # noqa: E402
from serving.weight_sync import WeightSync  # noqa: E402
from trainer.rollouts.source import sample_completions, served_sampler, served_sequences  # noqa: E402

ENGINES = ("built-in", "compiled", "server")
SERVER_TAIL_S = 2.0  # the pause after each served rollout (see rollout_rates)
OPD = os.path.join(ROOT, "trainer", "train_opd.py")


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--config", default=harness.TEACHER_CONFIG)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="the trainer's precision and the server's --dtype")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="rollouts per engine (after one warm-up each)")
    p.add_argument("--steps", type=int, default=6, help="OPD steps per layout (the first is not counted)")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: what runs (see above)")
    p.add_argument("--rollouts_only", action="store_true", help="the rollout table only, no OPD layouts")
    p.add_argument("--rollout_url", default=None, help="a running server of the student, served as `student` "
                                                       "(default: start one)")
    p.add_argument("--teacher_url", default=None, help="a running server of the teacher, served as `teacher` "
                                                       "(default: start one)")
    p.add_argument("--teacher_topk", type=int, default=16, help="K of the layout with the served teacher's top-K")
    p.add_argument("--port", type=int, default=8731, help="of the first server this benchmark starts (+1: the second)")
    p.add_argument("--workdir", default=None, help="where the models and runs go (default: a temporary folder)")
    harness.add_json_arg(p)
    args = p.parse_args(argv)
    args.engines = [name.strip() for name in args.engines.split(",") if name.strip()]
    if not args.engines or set(args.engines) - set(ENGINES):
        refuse(f"--engines {','.join(args.engines)}: choose from {','.join(ENGINES)}")
    if min(args.repeats, args.batch_size, args.max_new_tokens) < 1 or args.steps < 2:
        refuse("--repeats, --batch_size and --max_new_tokens must be >= 1, --steps >= 2 (the first is not counted)")
    return args


def rollout_rates(args, student_dir: str, server: CompletionServer | None) -> dict[str, float]:
    """Generated tokens per second of the loop's own rollout, per engine (median of --repeats after one warm-up
    round); the engines take turns."""
    tokenizer = load_tokenizer(None)
    student = load_pretrained(student_dir, dtype=torch.float32, device=args.device)
    autocast = resolve_precision(args.device, args.dtype).autocast
    if server is not None:
        sync = WeightSync(server, os.path.join(os.path.dirname(student_dir), "sync", "model.safetensors"),
                          probe_token_ids(tokenizer), DTYPES[args.dtype])
        sync.push(student, 0)
        sync.verify(student, autocast)
    batch = harness.prompt_batch(tokenizer, harness.demo_rows("opd_prompts", range(args.batch_size)))
    loop_args = SimpleNamespace(seed=0, max_new_tokens=args.max_new_tokens, gen_temperature=1.0, top_k=0, top_p=1.0)
    decoders = {"built-in": None, "compiled": Decoder(compiled=True)}
    rates: dict[str, list[float]] = {engine: [] for engine in args.engines}
    for repeat in range(args.repeats + 1):
        for engine in rates:
            start = time.perf_counter()
            if engine == "server":
                completions = served_sampler(server, loop_args, tokenizer, student.config.vocab_size)(batch, repeat)
                _, _, labels = served_sequences(batch, completions, tokenizer, args.device)
            else:
                _, _, labels = sample_completions(student, loop_args, tokenizer, batch, repeat, args.device, autocast,
                                                  decoders[engine])
            harness.synchronize(args.device)
            seconds = time.perf_counter() - start
            if repeat:  # the first round warms them up (and compiles)
                rates[engine].append(int((labels != IGNORE_INDEX).sum()) / seconds)
            if engine == "server":  # on a shared CPU: it keeps a core busy for about a second after it answers,
                time.sleep(SERVER_TAIL_S)  # which would slow whichever engine ran next
    return {engine: statistics.median(values) for engine, values in rates.items()}


LAYOUTS = (  # (name, rollouts on the server, teacher on the server, loss, --max_staleness; "jsd_topk": --loss jsd
    # --teacher_topk)
    ("built-in rollouts, local teacher (jsd)", False, False, "jsd", 0),
    ("served rollouts, local teacher (jsd)", True, False, "jsd", 0),
    ("served rollouts, local teacher (jsd), --max_staleness 1", True, False, "jsd", 1),
    ("built-in rollouts, local teacher", False, False, "sampled_kl", 0),
    ("built-in rollouts, served teacher", False, True, "sampled_kl", 0),
    ("served rollouts, served teacher", True, True, "sampled_kl", 0),
    ("built-in rollouts, served teacher top-K", False, True, "jsd_topk", 0),
)
PHASES = ("gen_s", "drain_s", "sync_s", "verify_s", "teacher_s", "train_s")


def opd_steps(args, student_dir: str, teacher_dir: str, rollout_url: str | None, teacher_url: str | None, loss: str,
              staleness: int, folder: str, name: str) -> dict:
    """trainer/train_opd.py for --steps steps; medians over the steps after the first (ms)."""
    command = [sys.executable, OPD, "--model_path", student_dir, "--save_dir", folder, "--save_weight", name,
               "--device", args.device, "--dtype", args.dtype, "--batch_size", str(args.batch_size),
               "--max_new_tokens", str(args.max_new_tokens), "--max_length", str(256 + args.max_new_tokens),
               "--max_steps", str(args.steps), "--log_interval", "1", "--save_interval", str(10 ** 6),
               "--start_over", "1", "--loss", "jsd" if loss == "jsd_topk" else loss]
    if loss == "jsd_topk":  # the teacher's top-K per position (a server's default --max-logprobs 20 allows 16)
        command += ["--teacher_topk", str(args.teacher_topk)]
    command += ["--teacher_url", teacher_url] if teacher_url else ["--teacher_path", teacher_dir]
    if rollout_url:
        command += ["--rollout_url", rollout_url, "--rollout_model", "student", "--max_staleness", str(staleness)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeFailure(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return step_medians(os.path.join(folder, f"{name}_metrics.jsonl"))


def step_medians(metrics_path: str) -> dict:
    """Medians over the logged steps after the first: ms/step, each phase in ms, and the rest of the step (the
    optimizer step, logging) taken per step before the median."""
    with open(metrics_path) as f:
        steps = [json.loads(line) for line in f][1:]
    medians = {key: statistics.median(m.get(key, 0.0) for m in steps) * 1000.0 for key in PHASES}
    medians["step_ms"] = statistics.median(m["step_ms"] for m in steps)
    medians["rest_ms"] = statistics.median(m["step_ms"] - 1000.0 * sum(m.get(key, 0.0) for key in PHASES)
                                           for m in steps)
    return medians


def overlap_arithmetic(serial: dict) -> float:
    """A serial step's time over an overlapped one's when the server and the trainer do not share hardware: the
    rollouts of the next step run during this step's teacher, training and rest; the sync and the verification
    stay serial (the server cannot sample while it loads weights)."""
    fixed = serial["sync_s"] + serial["verify_s"]
    trainer = serial["teacher_s"] + serial["train_s"] + serial["rest_ms"]
    return (fixed + serial["gen_s"] + trainer) / (fixed + max(serial["gen_s"], trainer))


def print_tables(args, results: dict) -> None:
    rates = results["rollout_tokens_per_s"]
    served = rates.get("server")
    print(f"\n{args.batch_size} prompts x {args.max_new_tokens} new tokens, {args.device} {args.dtype}, "
          f"{os.path.basename(args.config)}\n")
    print(harness.table(["rollout engine (the loop's sample_completions)", f"generated tokens/s, median of "
                         f"{args.repeats}", "/ server"],
                        [[engine, f"{rate:.0f}", f"{rate / served:.2f}x" if served else "-"]
                         for engine, rate in rates.items()]))
    if not results["layouts"]:
        return
    print(f"\nOPD layouts, ms (median of steps 2-{args.steps}); the layouts without (jsd) or top-K use "
          f"--loss sampled_kl, all the eager decode step\n")
    print(harness.table(["OPD layout", "ms/step", "rollouts", "drain", "weight sync", "verification", "teacher",
                         "student fwd+bwd", "rest"],
                        [[name, f"{m['step_ms']:.0f}", *(f"{m[key]:.0f}" if m[key] else "-" for key in PHASES),
                          f"{m['rest_ms']:.0f}"] for name, m in results["layouts"].items()]))
    if "overlap" in results:
        overlap = results["overlap"]
        print(f"\n--max_staleness 1: {overlap['measured']:.2f}x the steps per second of 0 here (server and trainer "
              f"share these {os.cpu_count()} cores). With each on its own devices, from the serial phases: "
              f"{overlap['separate_devices']:.2f}x")


@contextlib.contextmanager
def servers(args, student_dir: str, teacher_dir: str, folder: str):
    """-> {"student": URL, "teacher": URL}: the servers --rollout_url / --teacher_url name, the others started here
    (and stopped however the block ends); {} without "server" in --engines."""
    urls, started = {}, []
    wanted = [] if "server" not in args.engines else [("student", student_dir, args.rollout_url)] + (
        [] if args.rollouts_only else [("teacher", teacher_dir, args.teacher_url)])
    try:
        for offset, (name, model_dir, url) in enumerate(wanted):
            if url is None:
                python = vllm_python()
                if python is None:
                    raise RuntimeFailure("no vLLM environment: run serving/setup_vllm_cpu.sh, pass the servers' "
                                         "URLs, or leave server out of --engines")
                port, log = args.port + offset, os.path.join(folder, f"{name}_server.log")
                print(f"starting a vLLM server for the {name} on port {port} (log: {log})", flush=True)
                started.append((start_vllm(vllm_command(python, model_dir, name, port, args.dtype), log), port, log))
                url = f"http://127.0.0.1:{port}/v1"
            urls[name] = url
        if started:
            print("waiting for the servers (2-5 minutes on 2 CPU cores)", flush=True)
        for process, port, log in started:
            wait_ready(process, port, log)
        yield urls
    finally:
        for process, _, _ in started:
            stop_vllm(process)


def measure(args, folder: str) -> dict:
    student_dir, teacher_dir = harness.save_random_models(folder, args.config, args.config)
    with servers(args, student_dir, teacher_dir, folder) as urls:
        server = CompletionServer(urls["student"], "student", what="rollout server") if urls else None
        results = {"rollout_tokens_per_s": rollout_rates(args, student_dir, server), "layouts": {}}
        for i, (name, served_rollouts, served_teacher, loss, staleness) in enumerate(LAYOUTS):
            if args.rollouts_only or ((served_rollouts or served_teacher) and not urls):
                continue
            results["layouts"][name] = opd_steps(args, student_dir, teacher_dir,
                                                 urls["student"] if served_rollouts else None,
                                                 urls["teacher"] if served_teacher else None, loss, staleness,
                                                 folder, f"layout{i}")
    serial, overlapped = (results["layouts"].get(LAYOUTS[i][0]) for i in (1, 2))
    if serial and overlapped:
        results["overlap"] = {"measured": serial["step_ms"] / overlapped["step_ms"],
                              "separate_devices": overlap_arithmetic(serial)}
    return results


def main(argv=None) -> dict:
    args = parse_args(argv)
    print(harness.machine(), flush=True)
    with contextlib.ExitStack() as stack:
        folder = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_rollout_"))
        results = measure(args, folder)
    print_tables(args, results)
    harness.write_json(args.json, results)
    return results


if __name__ == "__main__":
    run_script(main)
