"""One pure on-policy distillation step, ours against TRL's GKDTrainer, on the same tiny models and settings.

    python benchmarks/bench_trl.py                   # 2 threads, 1 warm-up + 4 timed steps per run
    python benchmarks/bench_trl.py --threads 1 --steps 6

TRL is never a dependency: its side runs in a separate interpreter (--trl_python, default
~/.cache/distill/trl-venv/bin/python, a venv made with --system-site-packages so that it shares this environment's
torch and transformers). Without one that can import trl.experimental.gkd this prints how to make it and exits 0.

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

CONFIGS = os.path.join(ROOT, "model", "configs")
DEFAULT_TRL_PYTHON = os.path.expanduser("~/.cache/distill/trl-venv/bin/python")
VENV_NOTE = ("TRL not importable by {python}; to compare against it, make the venv (TRL never becomes a dependency): "
             "python -m venv --system-site-packages ~/.cache/distill/trl-venv && "
             "~/.cache/distill/trl-venv/bin/pip install trl==1.16.0")
POOL_ROWS = 64  # the demo prompts cycled through, batch_size at a time


# ----------------------------------------------------------------------------------------------------------------
# shared by both sides

def pool_rows(batch_size: int, step: int) -> list[dict]:
    """Step `step`'s rows of the first POOL_ROWS demo opd_prompts: rows step*B .. step*B + B - 1 (mod POOL_ROWS)."""
    from dataset.make_demo_data import ensure_demo_data
    from dataset.sources import RowDataset
    dataset = RowDataset(ensure_demo_data()["opd_prompts"])
    return [dataset[(step * batch_size + i) % POOL_ROWS] for i in range(batch_size)]


def collate_prompts(tokenizer, rows: list[dict], max_prompt_length: int) -> dict:
    """Our PromptCollator (chat template, enable_thinking 0): prompt_ids, prompt_attention_mask, left padded."""
    from dataset.collators import PromptCollator
    return PromptCollator(tokenizer, max_prompt_length, enable_thinking=False)(rows)


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

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


# ----------------------------------------------------------------------------------------------------------------
# our side: benchmarks/bench_opd.opd_step

def run_ours(args: argparse.Namespace) -> RunResult:
    from benchmarks import bench_opd
    from model import load_tokenizer
    opd_args = bench_opd.parse_args([
        "--student_path", args.student_path, "--teacher_path", args.teacher_path, "--batch_size", str(args.batch_size),
        "--max_new_tokens", str(args.max_new_tokens), "--beta", "1", "--temperature", "1", "--gen_temperature", "1",
        "--learning_rate", str(args.learning_rate), "--max_prompt_length", str(args.max_prompt_length),
        "--enable_thinking", "0", "--seed", str(args.seed), "--device", "cpu"])
    torch.manual_seed(args.seed)
    tokenizer = load_tokenizer(args.student_path)
    student, teacher = bench_opd.load_models(opd_args)
    optimizer = torch.optim.AdamW(student.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.01)
    result = RunResult("ours", [], [], [], [], torch.get_num_threads())
    for step in range(args.warmup + args.steps):
        batch = collate_prompts(tokenizer, pool_rows(args.batch_size, step), args.max_prompt_length)
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
        batch = collate_prompts(self.tokenizer, rows, self.max_prompt_length)
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
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.01, max_grad_norm=1.0,
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


def save_models(args: argparse.Namespace, folder: str) -> tuple[str, str]:
    """Random-weight student and teacher, written once as HF folders by our save_pretrained."""
    from model import Qwen3Config, create_model, save_pretrained
    paths = []
    for name, config, seed in (("student", args.student_config, args.seed), ("teacher", args.teacher_config,
                                                                                args.seed + 1)):
        model = create_model(Qwen3Config.from_json(config), seed=seed)
        path = os.path.join(folder, name)
        save_pretrained(model, path)
        paths.append(path)
    return paths[0], paths[1]


def child_command(python: str, side: str, args: argparse.Namespace, result_path: str) -> list[str]:
    return [python, os.path.abspath(__file__), "--side", side, "--result", result_path,
            "--student_path", args.student_path, "--teacher_path", args.teacher_path,
            "--threads", str(args.threads), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch_size", str(args.batch_size), "--max_new_tokens", str(args.max_new_tokens),
            "--max_prompt_length", str(args.max_prompt_length), "--learning_rate", str(args.learning_rate),
            "--seed", str(args.seed)]


def run_child(python: str, side: str, args: argparse.Namespace, folder: str, number: int) -> RunResult:
    result_path = os.path.join(folder, f"run{number}.json")
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(child_command(python, side, args, result_path), capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"run {number} ({side}) failed with exit status {done.returncode}")
    with open(result_path, encoding="utf-8") as f:
        return RunResult(**json.load(f))


def median_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def print_run(number: int, run: RunResult) -> None:
    gen, step = median_or_nan(run.generation_ms), median_or_nan(run.step_ms)
    print(f"  run {number}  {run.side:<5} step {step:9.1f} ms   generation {gen:9.1f} ms   rest {step - gen:9.1f} ms   "
          f"(steps: {', '.join(f'{v:.0f}' for v in run.step_ms)}; decode widths {sorted(set(run.decode_widths))}; "
          f"loss/token {median_or_nan(run.losses):.3f})")


def print_summary(runs: list[RunResult]) -> None:
    pooled = {}
    for side in ("ours", "trl"):
        mine = [run for run in runs if run.side == side]
        step = median_or_nan([v for run in mine for v in run.step_ms])
        gen = median_or_nan([v for run in mine for v in run.generation_ms])
        pooled[side] = {"step": step, "generation": gen, "rest": step - gen}
    print(f"\n{'median over both runs':<30} {'ours ms':>10} {'TRL ms':>10} {'TRL / ours':>11}")
    for key, name in (("step", "whole step"), ("generation", "generation (sampling)"),
                      ("rest", "rest (teacher, loss, bwd, opt)")):
        ours, trl = pooled["ours"][key], pooled["trl"][key]
        print(f"{name:<30} {ours:10.1f} {trl:10.1f} {trl / ours:10.2f}x")
    pairs = [(runs[1], runs[0]), (runs[2], runs[3])]  # each TRL run against the ours run beside it
    print("adjacent pairs, TRL / ours (whole step, generation): " + "; ".join(
        f"{median_or_nan(t.step_ms) / median_or_nan(o.step_ms):.2f}x, "
        f"{median_or_nan(t.generation_ms) / median_or_nan(o.generation_ms):.2f}x" for t, o in pairs))
    print("(a ratio above 1: TRL's step takes longer. Shared, loaded 2-core machine: absolute times drift with the "
          "load, the interleaved ratios are what to read.)")


def drive(args: argparse.Namespace) -> None:
    if not trl_importable(args.trl_python):
        print(VENV_NOTE.format(python=args.trl_python))
        return
    set_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as folder:
        args.student_path, args.teacher_path = save_models(args, folder)
        print(f"OPD step, ours vs TRL {trl_version(args.trl_python)} GKDTrainer: fp32 CPU, {args.threads} threads, "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; batch {args.batch_size} x "
              f"{args.max_new_tokens} sampled tokens, full-vocabulary reverse KL; {args.warmup} warm-up + "
              f"{args.steps} timed steps per run, runs in order ours, TRL, TRL, ours", flush=True)
        runs = []
        for number, side in enumerate(("ours", "trl", "trl", "ours"), 1):
            python = sys.executable if side == "ours" else args.trl_python
            runs.append(run_child(python, side, args, folder, number))
            print_run(number, runs[-1])
            sys.stdout.flush()
    print_summary(runs)


def trl_version(python: str) -> str:
    probe = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    return probe.stdout.strip()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in every run")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first, per run")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--max_prompt_length", type=int, default=256)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--student_config", default=os.path.join(CONFIGS, "qwen3-tiny-student.json"))
    parser.add_argument("--teacher_config", default=os.path.join(CONFIGS, "qwen3-tiny.json"))
    parser.add_argument("--trl_python", default=DEFAULT_TRL_PYTHON, help="an interpreter that imports trl")
    # internal: one side in this process
    parser.add_argument("--side", choices=["ours", "trl"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--student_path", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--teacher_path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.threads, args.steps, args.batch_size, args.max_new_tokens) < 1 or args.warmup < 0:
        parser.error("--threads, --steps, --batch_size, --max_new_tokens must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.side is None:
        drive(args)
        return
    set_threads(args.threads)
    result = run_ours(args) if args.side == "ours" else run_trl(args)
    with open(args.result, "w", encoding="utf-8") as f:
        f.write(result.to_json())


if __name__ == "__main__":
    main()
