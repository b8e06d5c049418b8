"""One pure on-policy distillation step, ours against TRL's GKDTrainer, on the same tiny models and settings.

    python benchmarks/bench_trl.py                   # 2 threads, 1 warm-up + 4 timed steps per run
    python benchmarks/bench_trl.py --threads 1 --steps 6

TRL is never a dependency: its side runs in a separate interpreter (--trl_python, default
~/.cache/distill/trl-venv/bin/python, a venv made with --system-site-packages so that it shares this environment's
torch and transformers). Without one that can import trl.experimental.gkd only our side runs (one run), and the
note says how to make the venv.

The workload, identical on both sides:
  models     qwen3-tiny-student.json (student) and qwen3-tiny.json (teacher), random weights made once per invocation
             and written with our save_pretrained as HF folders; ours loads them with load_pretrained, TRL with
             AutoModelForCausalLM.from_pretrained; fp32 on the CPU
  prompts    the first 64 demo opd_prompts, chat template, enable_thinking 0, rendered and tokenised by our
             PromptCollator on both sides (the same left-padded ids); step k takes rows 8k..8k+7 (mod 64)
  step       sample 64 tokens per row from the student (temperature 1, no top-k/p, stop at EOS), teacher forward,
             full-vocabulary reverse KL (ours: generalized JSD beta 1; TRL: lmbda 1, beta 1, temperature 1), backward,
             clip to norm 1, AdamW (lr 1e-5, betas 0.9/0.95, weight decay 0.01), constant learning rate
How each side is timed:
  ours  benchmarks/bench_opd.opd_step (train_opd.sample_completions, completion_hidden, the chunked JSD loss,
        backward, optimizer), wall clock around the call; generation is its PhaseClock "generation" phase
  TRL   trainer.train() for warm-up + steps optimizer steps (train_sampling_strategy "sequential"), each step timed
        from the on_step_begin to the on_step_end callback: GKDTrainer.training_step (generate, student and teacher
        forward, loss, backward) + clipping + optimizer + scheduler + zero_grad; the collation happens before
        on_step_begin (as ours is outside opd_step). Generation: student.generate wrapped with a timer. bf16 and
        gradient checkpointing off; no eval, saving or logging (logging_strategy "no", report_to "none").
Each side runs in its own subprocess, in the order ours, TRL, TRL, ours (load drifts cancel to first order); each run
does 1 warm-up step then --steps timed ones. Printed: each run's medians, then per side the median over its two runs'
steps, and TRL / ours. Meant for a shared, loaded CPU box: read the ratios, not the absolute times.
Approximate by construction: TRL samples and scores all 151,936 vocabulary rows, ours the tokenizer's 151,669; TRL's
weight decay skips norms; the sampled tokens differ (different generators), but random weights almost never sample
EOS, so every row generates 64 tokens on both sides (the decode widths are printed).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402
from common.errors import ArgumentParser, refuse, run_script  # noqa: E402

DEFAULT_TRL_PYTHON = os.path.expanduser("~/.cache/distill/trl-venv/bin/python")
VENV_NOTE = ("TRL not importable by {python}; to compare against it, make the venv (TRL never becomes a dependency): "
             "python -m venv --system-site-packages ~/.cache/distill/trl-venv && "
             "~/.cache/distill/trl-venv/bin/pip install trl==1.16.0")
POOL_ROWS = 64  # the demo prompts cycled through, batch_size at a time


# ----------------------------------------------------------------------------------------------------------------
# shared by both sides

def pool_rows(batch_size: int, step: int) -> list[dict]:
    """Step `step`'s rows of the first POOL_ROWS demo opd_prompts: rows step*B .. step*B + B - 1 (mod POOL_ROWS)."""
    return harness.demo_rows("opd_prompts", [(step * batch_size + i) % POOL_ROWS for i in range(batch_size)])


def set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)


@dataclass
class RunResult:
    side: str
    step_ms: list[float]
    generation_ms: list[float]
    decode_widths: list[int]
    losses: list[float]  # per completion token, as each side computes it
    threads: int


# ----------------------------------------------------------------------------------------------------------------
# our side: benchmarks/bench_opd.opd_step

def run_ours(args: argparse.Namespace) -> RunResult:
    from benchmarks import bench_opd
    from model import load_tokenizer
    from trainer.skeleton.optimizer_step import make_optimizer
    opd_args = bench_opd.parse_args([
        "--student_path", args.student_path, "--teacher_path", args.teacher_path, "--batch_size", str(args.batch_size),
        "--max_new_tokens", str(args.max_new_tokens), "--beta", "1", "--temperature", "1", "--gen_temperature", "1",
        "--learning_rate", str(args.learning_rate), "--max_prompt_length", str(args.max_prompt_length),
        "--enable_thinking", "0", "--seed", str(args.seed), "--device", "cpu"])
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.student_path)
    student, teacher = bench_opd.load_models(opd_args)
    optimizer = make_optimizer(student, argparse.Namespace(learning_rate=args.learning_rate, weight_decay=0.01))
    result = RunResult("ours", [], [], [], [], torch.get_num_threads())
    for step in range(args.warmup + args.steps):
        batch = harness.prompt_batch(tokenizer, pool_rows(args.batch_size, step), "cpu", args.max_prompt_length)
        start = time.perf_counter()
        phase_ms, stats = bench_opd.opd_step(opd_args, student, teacher, optimizer, tokenizer, batch, step)
        step_ms = (time.perf_counter() - start) * 1000.0
        if step >= args.warmup:
            result.step_ms.append(step_ms)
            result.generation_ms.append(phase_ms["generation"])
            result.decode_widths.append(stats["decode_steps"])
            result.losses.append(stats["loss"])
    return result


# ----------------------------------------------------------------------------------------------------------------
# TRL's side: GKDTrainer.train(), timed per optimizer step by a callback

class TimedGenerate:
    """Wraps a model's generate: the wall time of each call, and how many tokens it appended."""

    def __init__(self, generate):
        self.generate, self.ms, self.widths = generate, [], []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.generate(*args, **kwargs)
        self.ms.append((time.perf_counter() - start) * 1000.0)
        self.widths.append(out.sequences.shape[1] - kwargs["input_ids"].shape[1])
        return out


class RecordedLoss:
    """Wraps a trainer's compute_loss (an instance attribute: training_step looks it up on self): keeps each loss."""

    def __init__(self, compute_loss):
        self.compute_loss, self.values = compute_loss, []

    def __call__(self, *args, **kwargs):
        loss = self.compute_loss(*args, **kwargs)
        self.values.append(loss.item())  # ours reads its loss with .item() inside the step too
        return loss


class PromptBatches:
    """TRL's data_collator: our prompt ids under the keys GKDTrainer reads (prompts, prompt_attention_mask; input_ids
    and attention_mask, which on-policy generation replaces). No labels: GKD builds them from the sample, and
    without them Trainer passes num_items_in_batch=None, so the loss is the mean over completion tokens, as ours."""

    def __init__(self, tokenizer, max_prompt_length: int):
        self.tokenizer, self.max_prompt_length = tokenizer, max_prompt_length

    def __call__(self, rows: list[dict]) -> dict:
        batch = harness.prompt_batch(self.tokenizer, rows, "cpu", self.max_prompt_length)
        ids, mask = batch["prompt_ids"], batch["prompt_attention_mask"]
        return {"prompts": ids, "prompt_attention_mask": mask, "input_ids": ids.clone(), "attention_mask": mask.clone()}


def step_timer_callback(step_ms: list[float]):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time from on_step_begin to on_step_end: training_step + clip + optimizer + scheduler + zero_grad."""

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step_ms.append((time.perf_counter() - self.start) * 1000.0)
    return StepTimer()


def gkd_config(args: argparse.Namespace, output_dir: str):
    from trl.experimental.gkd import GKDConfig
    return GKDConfig(
        output_dir=output_dir, max_steps=args.warmup + args.steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1, learning_rate=args.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
        optim="adamw_torch_fused", adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.01, max_grad_norm=1.0,
        lmbda=1.0, beta=1.0, temperature=1.0, max_new_tokens=args.max_new_tokens, seq_kd=False,
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, seed=args.seed,
        train_sampling_strategy="sequential", dataloader_num_workers=0, dataloader_pin_memory=False,
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True)


def run_trl(args: argparse.Namespace) -> RunResult:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDTrainer
    from model import load_tokenizer
    student = AutoModelForCausalLM.from_pretrained(args.student_path, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher_path, dtype=torch.float32)
    timed_generate = TimedGenerate(student.generate)
    student.generate = timed_generate  # GKD calls model.generate on the (unwrapped, same) student
    rows = [{"messages": row["messages"]} for row in pool_rows(POOL_ROWS, 0)]
    step_ms: list[float] = []
    with tempfile.TemporaryDirectory() as output_dir:
        trainer = GKDTrainer(
            model=student, teacher_model=teacher, args=gkd_config(args, output_dir),
            data_collator=PromptBatches(load_tokenizer(args.student_path), args.max_prompt_length),
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=AutoTokenizer.from_pretrained(args.student_path), callbacks=[step_timer_callback(step_ms)])
        losses = RecordedLoss(trainer.compute_loss)
        trainer.compute_loss = losses
        trainer.train()
    warm = args.warmup
    return RunResult("trl", step_ms[warm:], timed_generate.ms[warm:], timed_generate.widths[warm:],
                     losses.values[warm:], torch.get_num_threads())


# ----------------------------------------------------------------------------------------------------------------
# the driver: models once, then ours, TRL, TRL, ours in subprocesses

def trl_importable(python: str) -> bool:
    if not os.path.isfile(python):
        return False
    probe = subprocess.run([python, "-c", "import trl.experimental.gkd"], capture_output=True, text=True)
    return probe.returncode == 0


def child_command(python: str, side: str, args: argparse.Namespace, result_path: str) -> list[str]:
    return [python, os.path.abspath(__file__), "--side", side, "--result", result_path,
            "--student_path", args.student_path, "--teacher_path", args.teacher_path,
            "--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch_size", str(args.batch_size), "--max_new_tokens", str(args.max_new_tokens),
            "--max_prompt_length", str(args.max_prompt_length), "--learning_rate", str(args.learning_rate),
            "--seed", str(args.seed)]


def run_child(python: str, side: str, args: argparse.Namespace, folder: str, number: int) -> RunResult:
    result_path = os.path.join(folder, f"run{number}.json")
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(child_command(python, side, args, result_path), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"run {number} ({side}) failed with exit status {done.returncode}")
    with open(result_path, encoding="utf-8") as f:
        return RunResult(**json.load(f))


def median_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def run_row(number: int, run: RunResult) -> list[str]:
    gen, step = median_or_nan(run.generation_ms), median_or_nan(run.step_ms)
    return [str(number), run.side, f"{step:.1f}", f"{gen:.1f}", f"{step - gen:.1f}",
            ", ".join(f"{v:.0f}" for v in run.step_ms), str(sorted(set(run.decode_widths))),
            f"{median_or_nan(run.losses):.3f}"]


def summary(runs: list[RunResult]) -> dict:
    """Per side the median over its runs' steps (whole step, generation, the rest), TRL / ours, and each TRL run
    against the ours run beside it (runs 2/1 and 3/4)."""
    pooled = {}
    for side in ("ours", "trl"):
        mine = [run for run in runs if run.side == side]
        step = median_or_nan([v for run in mine for v in run.step_ms])
        gen = median_or_nan([v for run in mine for v in run.generation_ms])
        pooled[side] = {"step": step, "generation": gen, "rest": step - gen}
    ratios = {key: pooled["trl"][key] / pooled["ours"][key] for key in ("step", "generation", "rest")}
    pairs = [{"step": median_or_nan(t.step_ms) / median_or_nan(o.step_ms),
              "generation": median_or_nan(t.generation_ms) / median_or_nan(o.generation_ms)}
             for t, o in ((runs[1], runs[0]), (runs[2], runs[3]))]
    return {"ms": pooled, "trl_over_ours": ratios, "adjacent_pairs": pairs}


def print_summary(result: dict) -> None:
    names = {"step": "whole step", "generation": "generation (sampling)", "rest": "rest (teacher, loss, bwd, opt)"}
    print("\n" + harness.table(["median over both runs", "ours ms", "TRL ms", "TRL / ours"], [
        [name, f"{result['ms']['ours'][key]:.1f}", f"{result['ms']['trl'][key]:.1f}",
         f"{result['trl_over_ours'][key]:.2f}x"] for key, name in names.items()]))
    print("adjacent pairs, TRL / ours (whole step, generation): " + "; ".join(
        f"{pair['step']:.2f}x, {pair['generation']:.2f}x" for pair in result["adjacent_pairs"]))
    print("(a ratio above 1: TRL's step takes longer. Shared, loaded 2-core machine: absolute times drift with the "
          "load, the interleaved ratios are what to read.)")


def drive(args: argparse.Namespace) -> dict:
    """Models once, then the runs in subprocesses: ours, TRL, TRL, ours; ours alone when TRL cannot be imported."""
    with_trl = trl_importable(args.trl_python)
    sides = ("ours", "trl", "trl", "ours") if with_trl else ("ours",)
    against = f"ours vs TRL {trl_version(args.trl_python)} GKDTrainer" if with_trl else "ours only (no TRL)"
    print(f"{harness.machine()}\nOPD step, {against}: fp32 CPU, {args.threads} threads, load average "
          f"{os.getloadavg()[0]:.1f}; batch {args.batch_size} x {args.max_new_tokens} sampled tokens, "
          f"full-vocabulary reverse KL; {args.warmup} warm-up + {args.steps} timed steps per run, runs in order "
          f"{', '.join(sides)}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as folder:
        args.student_path, args.teacher_path = harness.save_random_models(folder, args.student_config,
                                                                          args.teacher_config, args.seed)
        for number, side in enumerate(sides, 1):
            runs.append(run_child(sys.executable if side == "ours" else args.trl_python, side, args, folder, number))
    print("\n" + harness.table(["run", "side", "step ms", "generation ms", "rest ms", "steps ms", "decode widths",
                                "loss / token"], [run_row(number, run) for number, run in enumerate(runs, 1)]))
    result = {"runs": [dataclasses.asdict(run) for run in runs]}
    if with_trl:
        result["summary"] = summary(runs)
        print_summary(result["summary"])
    else:
        result["trl_skipped"] = VENV_NOTE.format(python=args.trl_python)
        print(result["trl_skipped"])
    return result


def trl_version(python: str) -> str:
    probe = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    return probe.stdout.strip()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every run")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first, per run")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--max_prompt_length", type=int, default=256)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--student_config", default=harness.STUDENT_CONFIG)
    parser.add_argument("--teacher_config", default=harness.TEACHER_CONFIG)
    parser.add_argument("--trl_python", default=DEFAULT_TRL_PYTHON, help="an interpreter that imports trl")
    harness.add_json_arg(parser)
    # internal: one side in this process
    parser.add_argument("--side", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--student_path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--teacher_path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.threads, args.steps, args.batch_size, args.max_new_tokens) < 1 or args.warmup < 0:
        refuse("--threads, --steps, --batch_size, --max_new_tokens must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.side is None:
        result = drive(args)
        harness.write_json(args.json, result)
        return result
    set_threads(args.threads)
    result = run_ours(args) if args.side == "ours" else run_trl(args)
    with open(args.result, "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(result), f)
    return {}


if __name__ == "__main__":
    run_script(main)
