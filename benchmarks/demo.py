"""The comparison this project exists for: from one student, every method at an equal budget, on a task the demo's
models can learn, each row held out with its interval and a paired test against the starting student.

    python benchmarks/demo.py                  # the teacher and the student (reused once trained), then the table
    python benchmarks/demo.py --dry_run        # prints the commands only, one per line
    python benchmarks/demo.py --fresh          # first moves an earlier table's runs into checkpoints/demo/previous-*/
    python benchmarks/demo.py --retrain        # ... and the teacher's and the student's too
    python benchmarks/demo.py --sweep 5e-4,1e-3,2e-3   # each method at each learning rate, seed 1, graded on val
    python benchmarks/demo.py --ablation       # logit-free OPD with each --chunk_weight beside white-box OPD
    python benchmarks/demo.py --scale tiny     # the code path in a few minutes (tests/test_demo.py)
    python benchmarks/demo.py --task running_sum --methods sft_data,kd,opd,lf_rule,rl   # the long-answer task
    python benchmarks/demo.py --task running_sum --resume ...   # go on with a table stopped between parts

The task (dataset/make_demo_data.py): two-digit addition written as column addition, "7+8=15, 4+3+1=8. \\boxed{85}",
held-out problems sharing no operand pair with any training row. Every command runs as a subprocess in the repository
root, exactly as printed (its leading `python` is this interpreter), writing into checkpoints/demo/:

  teacher   SFT of SCALE.model_config on the 3,000 worked solutions (SCALE.teacher_steps, its learning curve on the
            val problems, exported at each of SCALE.snapshots), resumed with --from_resume 1: a later table finds it
            finished and goes on at once; the commit it started at is kept in checkpoints/demo/teacher_commit.json
  student   the first of those exports whose accuracy on the 200 val problems is in SCALE.student_band (25-45%):
            every method's starting point, chosen by accuracy and not by step, since the curve is steep there
            and a fixed step lands tens of points apart from one commit to the next
  then for each method and seed, SCALE.budget_steps optimizer steps of 16 student sequences each (16 rows of SFT or
  KD data, 16 sampled answers, or 4 prompts x 4 answers for RL), at the method's learning rate (METHODS):
  sft_data  SFT on the teacher's own sampled answers to the 512 OPD prompts (dataset/teacher_generate.py from the
            teacher served by vLLM: the baseline the OPD papers compare against)
  kd        classic KD (CE + T^2 KL) on the worked solutions, the teacher's logits
  opd       white-box on-policy distillation (reverse KL over the full vocabulary)
  opd_lora  the same with a LoRA student (--lora_rank 16: the base frozen, only the adapters trained); its base is
            held in the runs' --dtype (under bfloat16 another model than the student): its step 0 (--export_steps
            0) is graded too, and its rows are tested against that
  lf_vllm   logit-free OPD, the teacher served by vLLM as a black box (text only)
  lf_rule   logit-free OPD from benchmarks/rule_teacher.py: a rule-based solver behind an OpenAI-compatible endpoint,
            a stand-in for an API better than any local model
  rl        GRPO with the math-verify reward, groups of 4
The OPD variants (VARIANTS: self-distillation, speculative KD, skew reverse KL, PowerOPD, IW-OPD and their
sampled-token base, each one flag on OPD's command at OPD's learning rate) are rows of their own by name, outside the
default table: `--methods opd,opd_self,opd_skd,...`; each is also tested against OPD's row of the same seed. So are
RL's (rl_epochs: 2 update epochs x 2 minibatches; rl_cispo: the same with CISPO; ppo: PPO with a critic, one
answer per prompt), tested against RL's row. And DPO (`--methods dpo`): offline, on pairs of the student's own
answers to the OPD prompts, graded (dataset/make_dpo_pairs.py, made once per student before its rows).
Each run but the variants' is also exported at SCALE.curve's steps (8 and 16 on the CPU) and graded there: its curve, in demo.json,
which benchmarks/demo_curves.py draws against steps, FLOPs and teacher tokens, with the paired tests at equal steps
and equal FLOPs. Each model is graded by eval/eval_math.py on the 200 held-out problems (greedy, 64 new tokens); the
table adds the 95% Wilson interval, McNemar's exact test against the model it started from on the same problems
(benchmarks/demo_stats.py), the held-out reverse KL to the teacher on the model's own answers, the EOS share, the
teacher's requests and tokens, the student tokens trained on, the wall time, and for RL the share of groups with
signal. It prints the table in Markdown with the machine line and writes it as JSON (checkpoints/demo/demo.json).
An evaluation is reused from an earlier table only where its summary names this commit, with no local change, and
the same flags: a grading made by other code is made again.

The rows that need vLLM (sft_data, lf_vllm) are skipped, each with one line saying how to enable them, where no vLLM
environment exists (serving/setup_vllm_cpu.sh) or port 8001 is taken (lf_rule's teacher runs in this process, on port
8002). The learning rates in METHODS were chosen by `--sweep` at this budget: each method at each rate, seed 1, graded
on the 200 `val` problems (never the eval ones).

--task running_sum (dataset/make_demo_data.py's long-answer task: a running sum of named numbers, 57-101-token
answers) writes into checkpoints/demo_running_sum/ and differs where that regime asks (SCALES["running_sum"]): the
student is a smaller model (qwen3-tiny.json: 4 layers against the teacher's 8) trained by its own SFT, the first of
its exports at 10-50% on val; every method runs 64 steps, exported and graded at 8, 16 and 32 as well (its curve,
in demo.json; benchmarks/demo_curves.py draws it against steps, FLOPs and teacher tokens); the student and every
final model are also graded on 8 samples per problem at temperature 1 (avg@8, pass@8); 128 new tokens everywhere.

--task products (dataset/make_demo_data.py's tool task: a three-digit number times a two-digit one; each training
problem solved once with the calculator, once by hand) writes into checkpoints/demo_products/: the teacher and a
smaller student (its own SFT, the first export at 20-60% on val with the calculator) learn both kinds of solution;
the calculator's arm (TOOL_METHODS: `--methods rl,rl_tools,opd,opd_tools`) is RL and OPD on multi-turn rollouts
whose calls the calculator answers (--tools calculator, the prompts' SPLIT_tools twins that show it), graded with it
and tested against the student graded with it and against the same method without it (the same problems in the
same order); the methods without it are tested against the student graded by hand (its row NAME_by_hand; the
teacher's by hand is teacher_by_hand, each tested against the same model with the calculator). The
training runs take --max_length 320 --max_prompt_length 224 (the calculator's schema makes a prompt 212 tokens), 96
new tokens everywhere. A row graded with tools has no reverse KL: its record holds the model's own turns without
the results between them.

A run of these names already in the task's folder is refused (one line) unless --fresh moves it aside or --resume
goes on with it (every training command resumes, --from_resume 1; an evaluation made by the same code with the
same flags is reused); a run in progress (its lock names a live process) is refused either way. A command that fails stops the demo with its exit
code; Ctrl-C reaches the running command too (a training run saves first) and stops the demo (130).
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.harness import machine  # noqa: E402
from common.errors import ArgumentParser, RuntimeFailure, UserError, run_script  # noqa: E402
from common.version import code_commit, same_code  # noqa: E402
from dataset.make_demo_data import SPLIT_SIZES, TOOLS_SUFFIX, ensure_demo_data  # noqa: E402

TEACHER_PORT = 8001  # the teacher served by vLLM, a background process of the demo
TEACHER_URL = f"http://127.0.0.1:{TEACHER_PORT}/v1"


@dataclass(frozen=True)
class DemoTask:
    """What the demo is about: its data (dataset/make_demo_data.py's task), where its runs go, its answers' budget."""
    name: str
    data_dir: str          # the task's four parquet files
    save_dir: str          # every run, evaluation and table of the task
    eval_new_tokens: int   # every evaluation's and rollout's completion budget
    # the loops' data flags: the addition's files are every loop's default data, so its commands name none
    explicit_data: bool = True
    length_flags: str = ""  # the training runs' sequence budgets where the defaults are too short (" --max_length N")
    # the tool the task's tool arm calls (--tools): the student is chosen and graded with it, on the prompt files'
    # SPLIT_tools twins, and the methods without it are tested against the student graded without it
    tools: str = ""


ADDITION = DemoTask("addition", "dataset/demo", "checkpoints/demo", 64, explicit_data=False)  # answers: 20-25 tokens
RUNNING_SUM = DemoTask("running_sum", "dataset/demo/running_sum", "checkpoints/demo_running_sum", 128)  # 57-101
# a three-digit number times a two-digit one, with the calculator or by hand: a prompt with the calculator's schema
# is 212 tokens, a calculator conversation ~70 after it, a hand-worked answer 50-60
PRODUCTS = DemoTask("products", "dataset/demo/products", "checkpoints/demo_products", 96,
                    length_flags=" --max_length 320 --max_prompt_length 224", tools="calculator")


@dataclass(frozen=True)
class Scale:
    """How big the demo is: the models, the teacher's and the student's training, every method's budget."""
    model_config: str
    teacher_steps: int    # optimizer steps of 16 rows
    snapshots: tuple[int, ...]  # the student's candidates (--export_steps of the run it comes from)
    budget_steps: int     # optimizer steps of every method, 16 student sequences each
    seeds: tuple[int, ...]
    task: DemoTask = ADDITION
    device: str = "cpu"
    dtype: str = "bfloat16"
    eval_rows: int = 0    # eval_math --max_rows (0: all 200)
    teacher_eval_interval: int = 0  # the teacher's learning curve on the val problems: --eval_interval (0: none)
    # the student: the first export whose accuracy on the val problems is in this band. Chosen by accuracy, not by
    # step: the curve is steep there (12.5% at one step, 35.9% 100 steps later, measured), so a fixed step lands
    # tens of points apart from one commit's rounding to the next's
    student_band: tuple[float, float] = (0.25, 0.45)
    # a student smaller than the teacher: this config trained by its own SFT for student_steps, exported at each of
    # `snapshots`; None: the student is one of the teacher's own exports (the same capacity)
    student_config: str | None = None
    student_steps: int = 0
    curve: tuple[int, ...] = ()  # every method's run also exported (--export_steps) and graded at these steps
    # the student's and every method's final model also graded on this many samples per problem at temperature 1
    # (avg@N and pass@N, what the OPD papers report; 0: greedy only)
    sampled: int = 0


SCALES = {"addition": {
    # 2 CPU cores, in fp32: a CPU without bf16 instructions (this project's AMD EPYC, AVX2) computes a bf16 GEMM
    # ~50x slower than an fp32 one (the teacher's step: 31-38 s against 0.75 s, measured); --dtype bfloat16 where
    # the CPU has them (AVX-512 BF16, AMX)
    # every method's curve at 8, 16 and 32 steps (greedy only: its 22-token answers leave sampling little to show
    # beside the long task's avg@8 / pass@8, and the CPU table's hour would grow by a third)
    "cpu": Scale("model/configs/qwen3-demo.json", teacher_steps=800, snapshots=tuple(range(300, 725, 25)),
                 budget_steps=32, seeds=(1, 2), dtype="float32", teacher_eval_interval=50, curve=(8, 16)),
    # the code path: a few steps of the smallest model, 8 problems
    "tiny": Scale("model/configs/qwen3-tiny-student.json", teacher_steps=4, snapshots=(2,), budget_steps=2,
                  seeds=(1,), dtype="float32", eval_rows=8, student_band=(0.0, 1.0)),
    # one CUDA GPU: the same table, a wider model trained longer
    "cuda": Scale("model/configs/qwen3-demo.json", teacher_steps=2000, snapshots=tuple(range(300, 1250, 50)),
                  budget_steps=64, seeds=(1, 2), device="cuda", teacher_eval_interval=250, curve=(8, 16, 32),
                  sampled=8),
}, "running_sum": {
    # the teacher: the addition's 8-layer model; the student: 4 layers and a narrower MLP (qwen3-tiny.json), trained
    # by its own SFT on the same worked solutions until its val accuracy is in the band; every method's curve at
    # 8, 16, 32 and 64 steps
    # (the teacher's val accuracy, measured: 2% at step 200, 8.5% at 500 and 37.5% at 600 of a 600-step run)
    "cpu": Scale("model/configs/qwen3-demo.json", teacher_steps=1200, snapshots=tuple(range(200, 625, 50)),
                 budget_steps=64, seeds=(1, 2), task=RUNNING_SUM, dtype="float32", teacher_eval_interval=200,
                 student_band=(0.10, 0.50), student_config="model/configs/qwen3-tiny.json", student_steps=600,
                 curve=(8, 16, 32), sampled=8),
    "tiny": Scale("model/configs/qwen3-tiny-student.json", teacher_steps=4, snapshots=(2,), budget_steps=4,
                  seeds=(1,), task=RUNNING_SUM, dtype="float32", eval_rows=8, student_band=(0.0, 1.0),
                  student_config="model/configs/qwen3-tiny-student.json", student_steps=2, curve=(2,), sampled=2),
}, "products": {
    # the teacher: the addition's 8-layer model on both kinds of worked solution (each problem with the calculator
    # and by hand); the student: 4 layers, its own SFT, the first export at 20-60% on val with the calculator, so
    # that the tool arm has room; 32 steps a method
    "cpu": Scale("model/configs/qwen3-demo.json", teacher_steps=800, snapshots=tuple(range(50, 425, 25)),
                 budget_steps=32, seeds=(1, 2), task=PRODUCTS, dtype="float32", teacher_eval_interval=200,
                 student_band=(0.20, 0.60), student_config="model/configs/qwen3-tiny.json", student_steps=400),
    "tiny": Scale("model/configs/qwen3-tiny-student.json", teacher_steps=4, snapshots=(2,), budget_steps=2,
                  seeds=(1,), task=PRODUCTS, dtype="float32", eval_rows=8, student_band=(0.0, 1.0),
                  student_config="model/configs/qwen3-tiny-student.json", student_steps=2),
}}


@dataclass(frozen=True)
class Method:
    name: str            # run names NAME_sSEED
    label: str
    script: str
    flags: str           # the method's own flags ({teacher}: the teacher's folder, {url}: its endpoint)
    learning_rate: float
    needs: str | None = None   # "vllm": the teacher served by vLLM; "rule": the rule-based teacher
    # the task's split its loop trains on (its --data_path where the task names its data; None: its flags name it,
    # the teacher's answers to the opd_prompts)
    data: str | None = "opd_prompts"
    rows_per_step: int = 16  # rows of its data an optimizer step takes (RL: 4 prompts, 4 answers each)
    # its runs may start from another model than the student (a LoRA student's base is held in bf16 under --dtype
    # bfloat16): each exports its start (--export_steps 0), the first seed's graded as the baseline the method's rows
    # are tested against
    own_start: bool = False
    # a variant of another method (its name): each row also tested against that method's row of the same seed
    variant_of: str | None = None
    # multi-turn with the task's tool (--tools): its prompts and gradings the files' SPLIT_tools twins
    tools: bool = False


# The learning rates: `--sweep` at this budget, graded on the val problems (the student: 41.5%), seed 1 (docs and the
# README say what each rate gave); sft_data takes KD's (both are cross entropy on 16 rows of answers), lf_vllm
# lf_rule's (the same loss); opd_lora's sweep was LoRA's rule, 10x OPD's, and its neighbours. Logit-free OPD
# compares a chunk exactly (`--similarity exact`: one wrong digit is a wrong chunk; Levenshtein gives "8=14" 3/4 of
# "8=15") with the advantage weight, the loop's default (docs/logit_free.md).
LOGIT_FREE = "--similarity exact --chunk_len 4 --audit_chunks 4 --continuations 4"
METHODS = (
    Method("sft_data", "SFT on the teacher's sampled answers", "trainer/train_sft.py",
           "--data_path {teacher_data}", 3e-4, needs="vllm", data=None),
    Method("kd", "KD (CE + KL to the teacher's logits)", "trainer/train_distillation.py",
           "--teacher_path {teacher}", 3e-4, data="sft_train"),
    Method("opd", "white-box OPD (reverse KL)", "trainer/train_opd.py", "--teacher_path {teacher}", 3e-4),
    Method("opd_lora", "white-box OPD, a LoRA student (rank 16)", "trainer/train_opd.py",
           "--teacher_path {teacher} --lora_rank 16", 3e-3, own_start=True),
    Method("lf_vllm", "logit-free OPD, the teacher served as a black box", "trainer/train_logit_free.py",
           "--teacher_url {url} --teacher_form chat --teacher_probe request " + LOGIT_FREE, 1e-4, needs="vllm"),
    Method("lf_rule", "logit-free OPD, the rule-based black-box teacher", "trainer/train_logit_free.py",
           "--teacher_url {url} " + LOGIT_FREE, 1e-4, needs="rule"),
    Method("rl", "RL (GRPO, groups of 4, math-verify reward)", "trainer/train_rl.py",
           "--num_generations 4 --batch_size 4", 3e-5, rows_per_step=4),
)
# DPO, offline: pairs of the student's own answers to the OPD prompts (8 sampled at temperature 1 per prompt, graded:
# a right one chosen, a wrong one rejected; dataset/make_dpo_pairs.py, made once per student), 16 pairs a step,
# sigmoid DPO at beta 0.1 (TRL's default); --epochs 4 so that 32 steps never run out of pairs (a prompt whose 8
# answers agree gives none); not in the default table (`--methods dpo`). Its rate: `--sweep` on val (the student
# 32.0%): 1e-6 40.5%, 3e-6 46.5%, 1e-5 40.5%, 3e-5 3.5%, 1e-4 0.0%, 3e-4 1.5% -- from 3e-5 on the chosen answers'
# likelihood falls with the rejected ones' and the greedy answers break
DPO = Method("dpo", "DPO on the student's own graded answers (sigmoid, beta 0.1)", "trainer/train_dpo.py",
             "--data_path {student_pairs} --epochs 4", 3e-6, data=None)


# The OPD signals the field compares (docs/training.md), each one flag on white-box OPD, at OPD's learning rate (the
# variants' `--sweep 1e-4,1e-3` found it best or level for each: the README), each row also tested against OPD's of
# the same seed; not in the default table (`--methods opd,opd_self,...` adds them)
OPD_TEACHER = "--teacher_path {teacher}"
VARIANTS = (
    Method("opd_self", "self-distillation (the live student shown the answer)", "trainer/train_opd.py",
           "--self_teacher live", 3e-4, variant_of="opd"),
    Method("opd_skd", "speculative KD (top-25)", "trainer/train_opd.py", f"{OPD_TEACHER} --skd_topk 25", 3e-4,
           variant_of="opd"),
    Method("opd_skew", "skew reverse KL (a = 0.1)", "trainer/train_opd.py", f"{OPD_TEACHER} --loss skew_rkl", 3e-4,
           variant_of="opd"),
    Method("opd_power", "PowerOPD (sampled-token, a = 5)", "trainer/train_opd.py",
           f"{OPD_TEACHER} --loss sampled_kl --opd_reward power", 3e-4, variant_of="opd"),
    Method("opd_iw", "IW-OPD (sampled-token, g = 0.5)", "trainer/train_opd.py",
           f"{OPD_TEACHER} --loss sampled_kl --position_weight iw", 3e-4, variant_of="opd"),
    Method("opd_sampled", "sampled-token OPD (PowerOPD's and IW-OPD's base)", "trainer/train_opd.py",
           f"{OPD_TEACHER} --loss sampled_kl", 3e-4, variant_of="opd"),
    # RL beyond one on-policy update: each rollout batch trained in 2 epochs of 2 minibatches (4 updates a step,
    # the ratio and the clip live from the second), with PPO's clipped surrogate or CISPO's clipped weight (tinker's
    # default band for it, [0, 4]: no lower bound, as its paper); at RL's rate, tested against RL's row
    Method("rl_epochs", "RL, 2 update epochs x 2 minibatches (clipped surrogate)", "trainer/train_rl.py",
           "--num_generations 4 --batch_size 4 --update_epochs 2 --num_minibatches 2", 3e-5, rows_per_step=4,
           variant_of="rl"),
    Method("rl_cispo", "RL, 2 update epochs x 2 minibatches (CISPO)", "trainer/train_rl.py",
           "--num_generations 4 --batch_size 4 --update_epochs 2 --num_minibatches 2 --policy_loss cispo "
           "--clip_eps 1 --clip_eps_high 3", 3e-5, rows_per_step=4, variant_of="rl"),
    # PPO with a critic: one answer per prompt (16 a step, as RL's 4 x 4), GAE's advantages from the critic's values,
    # the same 2 x 2 updates; the critic's zero head must learn within the budget: its rate is 1e-4
    Method("ppo", "PPO with a critic (GAE, 2 update epochs x 2 minibatches)", "trainer/train_ppo.py",
           "--batch_size 16 --update_epochs 2 --num_minibatches 2 --critic_learning_rate 1e-4", 3e-5,
           variant_of="rl"),
)


# The tool task's arm with the calculator (--task products): RL and OPD on multi-turn rollouts whose calls the
# calculator answers, graded with it, each row tested against the student graded with it and against the same
# method's row without the tool (same seed, the same problems in the same order); at RL's and OPD's learning rates
# (not swept on this task)
TOOL_METHODS = (
    Method("rl_tools", "RL with the calculator (multi-turn, GRPO, groups of 4)", "trainer/train_rl.py",
           "--num_generations 4 --batch_size 4 --tools calculator", 3e-5, data="opd_prompts" + TOOLS_SUFFIX,
           rows_per_step=4, variant_of="rl", tools=True),
    Method("opd_tools", "white-box OPD with the calculator (multi-turn, reverse KL)", "trainer/train_opd.py",
           f"{OPD_TEACHER} --tools calculator", 3e-4, data="opd_prompts" + TOOLS_SUFFIX, variant_of="opd",
           tools=True),
)


@dataclass(frozen=True)
class Row:
    name: str                    # in the task's save_dir: NAME/, NAME_metrics.jsonl, NAME_eval_eval.jsonl
    label: str
    commands: tuple[str, ...]    # training (absent for an evaluated-only row), its curve's evaluations, its own
    method: Method | None = None
    seed: int | None = None
    learning_rate: float | None = None
    student: bool = False        # the starting student: every method's row is tested against it
    baseline: str | None = None  # the row a paired test compares this one with (None: the starting student)


def common_flags(scale: Scale) -> str:
    return f"--device {scale.device} --dtype {scale.dtype} --save_dir {scale.task.save_dir}"


def evaluation(name: str, scale: Scale, data: str = "eval", tools: bool = False) -> str:
    """eval_math.py's command grading `name` on the task's `data` split; `tools`: with the task's tool (--tools), on
    the split's twin whose prompts show it."""
    task = scale.task
    rows = f" --max_rows {scale.eval_rows}" if scale.eval_rows else ""
    data += TOOLS_SUFFIX if tools else ""
    where = f" --data_path {task.data_dir}/{data}.parquet" if data != "eval" or task.explicit_data else ""
    calls = f" --tools {task.tools}" if tools else ""
    return (f"python eval/eval_math.py --model_path {task.save_dir}/{name} --max_new_tokens {task.eval_new_tokens} "
            f"--device {scale.device}{where}{rows}{calls}")


def sampled_evaluation(name: str, scale: Scale) -> list[str]:
    """The final model graded on SCALE.sampled samples per problem at temperature 1 (none when 0), into its own
    files (NAME_eval_sampledN.jsonl): what summary_path reads stays the greedy grading."""
    if not scale.sampled:
        return []
    out = f"{scale.task.save_dir}/{name}_eval_sampled{scale.sampled}.jsonl"
    return [f"{evaluation(name, scale)} --n_samples {scale.sampled} --temperature 1.0 --out {out}"]


def sft_command(scale: Scale, model_config: str, steps: int, name: str, exports: Sequence[int],
                eval_interval: int = 0) -> str:
    """SFT from random weights on the task's worked solutions, resumed where an earlier demo left it."""
    task = scale.task
    epochs = math.ceil(steps * 16 / 3000)  # enough passes over the 3,000 rows for the steps
    data = (f" --data_path {task.data_dir}/sft_train.parquet --eval_max_new_tokens {task.eval_new_tokens}"
            if task.explicit_data else "")
    curve = f" --eval_interval {eval_interval} --eval_data_path {task.data_dir}/val.parquet" if eval_interval else ""
    snapshots = f" --export_steps {','.join(map(str, exports))}" if exports else ""
    return (f"python trainer/train_sft.py --model_config {model_config} {common_flags(scale)}{data}{task.length_flags} "
            f"--epochs {epochs} --max_steps {steps}{snapshots}{curve} --save_weight {name} --from_resume 1")


def teacher_row(scale: Scale) -> Row:
    """The teacher: SFT of SCALE.model_config, its learning curve on the val problems (--eval_interval); exported
    at each of SCALE.snapshots where those are the candidates for the student."""
    exports = () if scale.student_config else scale.snapshots
    train = sft_command(scale, scale.model_config, scale.teacher_steps, "teacher", exports,
                        scale.teacher_eval_interval)
    if scale.task.tools:  # graded by hand too, in a row of its own (by_hand_row)
        return Row("teacher", f"teacher (SFT), with the {scale.task.tools}",
                   (train, evaluation("teacher", scale, tools=True)))
    return Row("teacher", "teacher (SFT)", (train, evaluation("teacher", scale)))


STUDENT_SFT = "student_sft"  # a smaller student's own SFT (SCALE.student_config): its exports are the candidates


def student_sft_row(scale: Scale) -> Row:
    """A student smaller than the teacher: SFT of SCALE.student_config on the same worked solutions, exported at
    each of SCALE.snapshots (the candidates for the student)."""
    train = sft_command(scale, scale.student_config, scale.student_steps, STUDENT_SFT, scale.snapshots)
    return Row(STUDENT_SFT, "the student's own SFT", (train,))


def snapshot_row(scale: Scale, step: int) -> Row:
    """One of the candidates' exports graded on the val problems."""
    name = student_name(scale, step)
    return Row(name, f"{source_label(scale)} at step {step}", (evaluation(name, scale, "val", bool(scale.task.tools)),))


def student_row(scale: Scale, step: int) -> Row:
    low, high = scale.student_band
    name = student_name(scale, step)
    tools = f", with the {scale.task.tools}" if scale.task.tools else ""
    return Row(name, f"starting student ({source_label(scale)} at step {step}, the first export at {low:.0%}-"
                     f"{high:.0%} on val{tools})",
               (*sampled_evaluation(name, scale), evaluation(name, scale, tools=bool(scale.task.tools))), student=True)


def by_hand_row(scale: Scale, model: str, label: str) -> Row:
    """A tool task's teacher or student graded without the tool (the prompts without it), tested against the same
    model with it; the student's is the baseline of the methods that do not call the tool."""
    return Row(f"{model}_by_hand", f"{label}, without the {scale.task.tools}", (evaluation(model, scale),),
               baseline=model)


def source_label(scale: Scale) -> str:
    if scale.student_config is None:
        return "the teacher's SFT"
    return f"the student's own SFT ({os.path.basename(scale.student_config)})"


def student_name(scale: Scale, step: int | str) -> str:
    """The student's folder in the task's save_dir: the export at `step` of the teacher's run or of the smaller
    student's own SFT ("N" before it is chosen: --dry_run)."""
    return f"{STUDENT_SFT if scale.student_config else 'teacher'}_step{step}"


def data_flags(method: Method, task: DemoTask) -> str:
    """The task's data for the method's loop, and the rollouts' budget where the loop samples (none for the addition:
    its files and budget are every loop's defaults)."""
    if not task.explicit_data or method.data is None:
        return ""
    budget = f" --max_new_tokens {task.eval_new_tokens}" if method.data.startswith("opd_prompts") else ""
    return f" --data_path {task.data_dir}/{method.data}.parquet{budget}{task.length_flags}"


def method_row(method: Method, seed: int, scale: Scale, student: str, learning_rate: float | None = None,
               name: str | None = None, data: str = "eval", curve: Sequence[int] = (), sampled: bool = True) -> Row:
    """One run of `method` from `student` and its grading on `data`; with a `curve`, the run's exports at those steps
    (--export_steps) graded before it; with `sampled`, the scale's sampled grading too (on the eval problems)."""
    task = scale.task
    rate = method.learning_rate if learning_rate is None else learning_rate
    name = name or f"{method.name}_s{seed}"
    flags = method.flags.format(teacher=f"{task.save_dir}/teacher", teacher_data=teacher_data(task),
                                student_pairs=student_pairs(task, student),
                                url=RULE_URL if method.needs == "rule" else TEACHER_URL)
    exports = ([0] if method.own_start else []) + list(curve)
    snapshots = f" --export_steps {','.join(map(str, exports))}" if exports else ""
    # a run stops at the end of its data: the budget's rows take this many passes (the 512 prompts: 32 steps a pass)
    split = (method.data or "opd_prompts").removesuffix(TOOLS_SUFFIX)
    epochs = math.ceil(scale.budget_steps * method.rows_per_step / SPLIT_SIZES[split])
    snapshots += f" --epochs {epochs}" if epochs > 1 else ""
    train = (f"python {method.script} --model_path {task.save_dir}/{student} {flags}{data_flags(method, task)} "
             f"--max_steps {scale.budget_steps} --learning_rate {rate:g} --seed {seed} {common_flags(scale)} "
             f"--save_weight {name}{snapshots} --from_resume 1")
    graded = [evaluation(f"{name}_step{step}", scale, data, method.tools) for step in curve]
    samples = sampled_evaluation(name, scale) if data == "eval" and sampled else []
    return Row(name, method.label, (train, *graded, *samples, evaluation(name, scale, data, method.tools)), method,
               seed, rate)


def table_rows(scale: Scale, student: str, methods: Sequence[Method] = METHODS) -> list[Row]:
    """Each method's rows, one per seed; after a method with its own start, that start graded (its baseline)."""
    # a tool task: the methods without the tool are tested against the student graded without it
    by_hand = by_hand_row(scale, student, "starting student") if scale.task.tools else None
    rows = [by_hand_row(scale, "teacher", "teacher (SFT)"), by_hand] if by_hand else []
    for method in methods:
        start = start_row(method, scale) if method.own_start else None
        # the OPD variants are compared by their greedy accuracy against OPD's: no curve, no sampled grading (on the
        # long task those took as long as the variants' training)
        variant = method in VARIANTS
        baseline = start.name if start else by_hand.name if by_hand and not method.tools else None
        rows += [replace(method_row(method, seed, scale, student, curve=() if variant else scale.curve,
                                    sampled=not variant), baseline=baseline)
                 for seed in scale.seeds]
        rows += [start] if start else []
    return rows


def start_row(method: Method, scale: Scale) -> Row:
    """What a method with its own start trains from: its first seed's --export_steps 0, graded (tested against
    the student: what the start alone changes)."""
    name = f"{method.name}_s{scale.seeds[0]}_step0"
    return Row(name, f"{method.label} at step 0 (its start: the student, its base held in {scale.dtype})",
               (evaluation(name, scale),))


def ablation_rows(scale: Scale, student: str) -> list[Row]:
    """Logit-free OPD from the vLLM-served teacher with each chunk weight, and white-box OPD beside them, the first
    seed: docs/logit_free.md's ablation."""
    from trainer.logit_free.audit import CHUNK_WEIGHTS
    served = next(m for m in METHODS if m.name == "lf_vllm")
    rows = []
    for weight in CHUNK_WEIGHTS:
        method = Method(served.name, f"{served.label}, --chunk_weight {weight}", served.script,
                        f"{served.flags} --chunk_weight {weight}", served.learning_rate, served.needs)
        rows.append(method_row(method, scale.seeds[0], scale, student, name=f"ablation_{weight}_s{scale.seeds[0]}"))
    opd = next(m for m in METHODS if m.name == "opd")
    return rows + [method_row(opd, scale.seeds[0], scale, student, name=f"ablation_opd_s{scale.seeds[0]}")]


def sweep_rows(scale: Scale, student: str, rates: Sequence[float], methods: Sequence[Method] = METHODS) -> list[Row]:
    """Each method at each learning rate, the first seed, graded on the val problems."""
    return [method_row(method, scale.seeds[0], scale, student, rate, f"sweep_{method.name}_lr{rate:g}", data="val")
            for method in methods for rate in rates]


def teacher_data(task: DemoTask) -> str:
    """The sft_data rows' training data: the served teacher's answers to the OPD prompts."""
    return f"{task.save_dir}/teacher_answers.parquet"


def teacher_generate(task: DemoTask) -> str:
    return (f"python dataset/teacher_generate.py --data_path {task.data_dir}/opd_prompts.parquet "
            f"--out {teacher_data(task)} --base_url {TEACHER_URL} --model teacher --temperature 1.0 "
            f"--max_tokens {task.eval_new_tokens} --seed 0 "
            "--extra '{\"chat_template_kwargs\": {\"enable_thinking\": false}}'")


def student_pairs(task: DemoTask, student: str) -> str:
    """DPO's rows' training data: pairs of the student's own graded answers (named by the student)."""
    return f"{task.save_dir}/{student}_dpo_pairs.parquet"


def make_pairs(scale: Scale, row: Row) -> str:
    """The pairs a DPO row trains on, from the model it starts from (its --model_path; the file its --data_path)."""
    named = named_flags(row.commands[0])
    prompts = f" --data_path {scale.task.data_dir}/opd_prompts.parquet" if scale.task.explicit_data else ""
    return (f"python dataset/make_dpo_pairs.py --model_path {named['--model_path']}{prompts} --n_samples 8 "
            f"--temperature 1.0 --seed 0 --max_new_tokens {scale.task.eval_new_tokens} --device {scale.device} "
            f"--no_progress --out {named['--data_path']}")


def serve_teacher(task: DemoTask) -> str:
    # vLLM's CPU engine dies on a seeded request whose prefill is split over steps ("CPU Generator does not use
    # offset"): every teacher request carries a seed, hence no chunked prefill (measured)
    return (f"python serving/vllm_launch.py --model {task.save_dir}/teacher --name teacher --port {TEACHER_PORT} "
            f"-- --no-enable-chunked-prefill")


RULE_PORT = 8002
RULE_URL = f"http://127.0.0.1:{RULE_PORT}/v1"
ENABLE_VLLM = "serving/setup_vllm_cpu.sh makes one"


# ---------------------------------------------------------------------------------------------- the guard

def run_files(save_dir: str, name: str) -> list[str]:
    """What a run or evaluation named `name` leaves in save_dir: its folder, resume file, metrics, lock, folders set
    aside by --start_over, eval_math's outputs, half-written temporaries, a logit-free run's teacher cache, the
    exports of --export_steps."""
    patterns = [name, f"{name}_resume.pt", f"{name}_metrics.jsonl", f"{name}.lock", f"{name}.replaced-*",
                f"{name}_eval_*", f".{name}.tmp-*", f".{name}_resume.pt.tmp-*", f".{name}_eval_*.tmp-*",
                f"{name}_teacher_cache.rank*.jsonl", f"{name}_step[0-9]*", f"{name}_critic", f".{name}_critic.tmp-*"]
    found = set()
    for pattern in patterns:
        found.update(glob.glob(os.path.join(glob.escape(save_dir), pattern)))
    return sorted(found)


def table_files(save_dir: str) -> list[str]:
    """The files a table writes besides its runs: the teacher's answers (and their cache), the server's log, the
    JSON."""
    names = ["teacher_answers.parquet", "teacher_answers.parquet.cache.jsonl", "teacher_server.log", "demo.json"]
    return [p for p in (os.path.join(save_dir, n) for n in names) if os.path.exists(p)]


def existing_runs(save_dir: str, names: Sequence[str]) -> dict[str, list[str]]:
    """{run name: its files} for the names that have any."""
    found = {name: run_files(save_dir, name) for name in names}
    return {name: files for name, files in found.items() if files}


def check_no_live_run(save_dir: str, names: Sequence[str]) -> None:
    """Refuse while one of these runs is in progress: its lock names a live process here, or a process on another
    host (whose state cannot be known from here)."""
    for name in names:
        lock = os.path.join(save_dir, f"{name}.lock")
        try:
            with open(lock, encoding="utf-8") as f:
                holder = json.load(f)
        except (OSError, ValueError):
            continue  # no lock, or a half-written one: nobody holds it
        pid, host = holder.get("pid"), holder.get("host")
        if host != socket.gethostname():
            raise UserError(f"{lock}: a run named {name} is held by PID {pid} on host {host}; wait for it, or "
                            f"delete the lock if that run is gone")
        if isinstance(pid, int) and pid_alive(pid):
            raise UserError(f"{lock}: a run named {name} is in progress (PID {pid}); wait for it or stop it "
                            f"(kill {pid}) before running the demo")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def move_aside(save_dir: str, paths: Sequence[str]) -> str:
    """Move every path into save_dir/previous-TIME/ (a new folder); -> that folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    folder, n = os.path.join(save_dir, f"previous-{stamp}"), 1
    while os.path.exists(folder):
        n += 1
        folder = os.path.join(save_dir, f"previous-{stamp}-{n}")
    os.makedirs(folder)
    for path in paths:
        os.replace(path, os.path.join(folder, os.path.basename(path)))
    return folder


def describe(paths: Sequence[str], save_dir: str) -> str:
    names = [os.path.relpath(p, save_dir) for p in paths]
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return f"{len(names)} file(s) of an earlier demo ({shown})"


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
    process = subprocess.Popen(command_argv(command), cwd=cwd, env={**os.environ, "OPENAI_API_KEY": "EMPTY"})
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


# ---------------------------------------------------------------------------------------------- the teachers

class ServerFailed(RuntimeFailure):
    """A teacher server exited or was not ready in time: its rows are not run (the note says where its log is)."""


class ServedTeacher:
    """The task's teacher served by vLLM (serve_teacher: the vLLM environment's server behind serving/vllm_launch.py)
    on 127.0.0.1:TEACHER_PORT, a subprocess of the demo in its own process group, stopped when its rows end."""

    def __init__(self, task: DemoTask):
        self.task = task

    def unavailable(self) -> str | None:
        """Why it cannot be served here (one line, with how to enable it), or None."""
        from serving.vllm_launch import DEFAULT_VENV, vllm_python
        if vllm_python() is None:
            return f"no vLLM environment at {DEFAULT_VENV}: {ENABLE_VLLM}"
        if port_in_use(TEACHER_PORT):
            return f"port {TEACHER_PORT} (the demo's teacher server) is in use: stop what listens there"
        return None

    @contextlib.contextmanager
    def serving(self, cwd: str) -> Iterator[None]:
        """The server started (its output into the task's save_dir/teacher_server.log) and ready; stopped however
        the block ends. ServerFailed when it exits or is not ready in 15 minutes."""
        from serving.vllm_launch import stop_vllm, wait_ready
        log_path = os.path.join(cwd, self.task.save_dir, "teacher_server.log")
        with open(log_path, "w", encoding="utf-8") as log:
            process = subprocess.Popen(command_argv(serve_teacher(self.task)), cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        try:
            try:
                wait_ready(process, TEACHER_PORT, log_path)
            except RuntimeError as error:
                raise ServerFailed(f"{str(error).splitlines()[0].rstrip(':')}; its log: {log_path}") from None
            yield
        finally:
            stop_vllm(process)


class RuleTeacher:
    """benchmarks/rule_teacher.py's server in this process, on 127.0.0.1:RULE_PORT, while its rows run."""

    def unavailable(self) -> str | None:
        if port_in_use(RULE_PORT):
            return f"port {RULE_PORT} (the demo's rule-based teacher) is in use: stop what listens there"
        return None

    @contextlib.contextmanager
    def serving(self, cwd: str) -> Iterator[None]:
        from benchmarks.rule_teacher import RuleTeacher as RuleServer
        with RuleServer(RULE_PORT):
            yield


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as probe:
        probe.settimeout(1.0)
        return probe.connect_ex((host, port)) == 0


# ------------------------------------------------------------------------------------------------ running rows

@dataclass
class RowRun:
    """What running a row gave: the seconds of each command that ran; why it did not run (one line), or that it
    was reused from an earlier table."""
    seconds: list[float] = field(default_factory=list)
    skipped: str | None = None
    reused: bool = False


def say(text: str) -> None:
    print(f"\n[demo] {text}", flush=True)


def run_row(row: Row, root: str, runner: Callable[[str, str], float]) -> RowRun:
    """The row's commands in order; an evaluation that an earlier table made with the same flags and the same code
    (its summary's `args` and `commit`: is_current) is reused, a grading from other code made again."""
    seconds, reused = [], False
    for command in row.commands:
        summary = eval_output(root, command, ".summary.json") if is_evaluation(command) else None
        if summary and is_current(summary, command):
            say(f"{row.name}: an earlier evaluation is reused ({os.path.relpath(summary, root)}: the same code "
                f"and flags)")
            reused = True
            continue
        say(command)
        seconds.append(runner(command, root))
        say(f"done in {format_seconds(seconds[-1])}")
    return RowRun(seconds, reused=reused)


def is_evaluation(command: str) -> bool:
    return shlex.split(command)[1] == "eval/eval_math.py"


def run_teacher(row: Row, root: str, runner: Callable[[str, str], float]) -> RowRun:
    """The teacher: its training resumes (--from_resume 1: an earlier table's finished run says so and stops at
    once, a killed one continues), the commit it started at recorded (TEACHER_COMMIT), then its evaluation."""
    record_teacher_commit(os.path.join(root, named_flags(row.commands[0])["--save_dir"]))
    return run_row(row, root, runner)


GRADING_UNUSED = (":(exclude)benchmarks", ":(exclude)trainer")  # git pathspecs of what a grading never runs


def is_current(path: str, command: str) -> bool:
    """Whether the summary at `path` is what `command` (an eval_math command) would write now: made by this commit
    with no local change, or by an earlier one from which only docs, tests, benchmarks/ and trainer/ changed
    (common/version.py's same_code), every flag the command names at the command's value (the others at the
    defaults of the same code)."""
    try:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return False
    made_with = summary.get("args") or {}
    # eval/eval_math.py imports nothing from benchmarks/ (this script's own) nor trainer/ (the loops): a change there
    # grades nothing anew (tests/test_demo.py checks the imports)
    return (same_code(str(summary.get("commit")), code_commit(), unused=GRADING_UNUSED)
            and all(str(made_with.get(flag[2:])) == value for flag, value in named_flags(command).items()))


def named_flags(command: str) -> dict[str, str]:
    """{--flag: its value} of a command line (a flag without a value aside)."""
    argv = shlex.split(command)
    return {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}


TEACHER_COMMIT = "teacher_commit.json"  # in the save_dir: the commit the teacher's training started at


def record_teacher_commit(save_dir: str) -> None:
    """Before the teacher's training: a teacher not yet started gets this commit on record; one an older demo left
    without a record is marked unrecorded (the table then says so)."""
    path = os.path.join(save_dir, TEACHER_COMMIT)
    if os.path.exists(path):
        return
    started = bool(run_files(save_dir, "teacher"))
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"commit": "unrecorded (trained by an earlier demo)" if started else code_commit()}, f)


def teacher_commit(save_dir: str) -> str:
    try:
        with open(os.path.join(save_dir, TEACHER_COMMIT), encoding="utf-8") as f:
            return json.load(f)["commit"]
    except (OSError, ValueError, KeyError):
        return "unrecorded"


def choose_student(scale: Scale, root: str, runner: Callable[[str, str], float]) -> tuple[Row, dict[int, float]]:
    """The first of the candidates' exports whose accuracy on the val problems is in SCALE.student_band, each graded
    in turn (run_row: an earlier grading reused); with none in the band, the one nearest its middle. -> (the student's row, {step:
    val accuracy} of the exports graded)."""
    low, high = scale.student_band
    graded = {}
    for step in scale.snapshots:
        row = snapshot_row(scale, step)
        run_row(row, root, runner)
        graded[step] = read_json(summary_path(root, row), row.commands[-1])["accuracy"]
        if low <= graded[step] <= high:
            break
    else:
        step = min(graded, key=lambda s: abs(graded[s] - (low + high) / 2))
        say(f"no export of {source_label(scale)} is at {low:.0%}-{high:.0%} on val: the nearest, step {step}, is the "
            f"student")
    say(f"the student: {source_label(scale)} at step {step}, {graded[step]:.1%} on the val problems")
    return student_row(scale, step), graded


def run_needing(teacher, rows: Sequence[Row], root: str, runner: Callable[[str, str], float],
                before: Sequence[str] = ()) -> tuple[dict[str, RowRun], float | None]:
    """Rows that need `teacher` served: each skipped with one line where it cannot be; else the teacher started,
    `before` run (the teacher's answers), the rows run, the teacher stopped. -> ({name: run}, seconds to serve)."""
    if not rows:
        return {}, None
    note = teacher.unavailable()
    if note is not None:
        say(f"skipped, the rows {', '.join(r.name for r in rows)}: {note}")
        return {row.name: RowRun(skipped=f"skipped: {note}") for row in rows}, None
    start = time.perf_counter()
    runs = {}
    try:
        with teacher.serving(root):
            serve_seconds = time.perf_counter() - start
            for command in before:
                say(command)
                runs["before"] = RowRun([runner(command, root)])
            for row in rows:
                runs[row.name] = run_row(row, root, runner)
    except ServerFailed as error:
        say(f"skipped: the teacher server did not start: {error}")
        return {row.name: RowRun(skipped=f"skipped: the teacher server did not start: {error}") for row in rows}, None
    return runs, serve_seconds


def run_all(rows: Sequence[Row], student: Row | None, root: str, runner: Callable[[str, str], float],
            teachers: dict[str, object], scale: Scale) -> tuple[dict[str, RowRun], dict[str, float]]:
    """The student's evaluation (`student`: None for a sweep), then the rows needing the vLLM teacher (after its
    answers for sft_data), those needing the rule-based teacher, the rest (DPO's after its pairs, made once per
    student), and the rows that only grade (a method's own start, after its runs). -> ({name: run}, {what:
    seconds} of the servers' start-ups, the teacher's answers and the DPO pairs)."""
    task = scale.task
    runs, extra = {}, {}
    if student is not None:
        runs[student.name] = run_row(student, root, runner)
    need = {kind: [r for r in rows if r.method and r.method.needs == kind] for kind in ("vllm", "rule")}
    before = [teacher_generate(task)] if any(r.method.name == "sft_data" for r in need["vllm"]) else []
    for kind in ("vllm", "rule"):
        done, serve_seconds = run_needing(teachers[kind], need[kind], root, runner, before if kind == "vllm" else ())
        if "before" in done:
            extra["teacher answers"] = done.pop("before").seconds[0]
        if serve_seconds is not None and kind == "vllm":
            extra["vLLM teacher start-up"] = serve_seconds
        runs.update(done)
    for command in dict.fromkeys(make_pairs(scale, r) for r in rows if r.method and r.method.name == DPO.name):
        if not os.path.exists(os.path.join(root, named_flags(command)["--out"])):  # written whole or not at all
            say(command)
            extra["DPO pairs"] = extra.get("DPO pairs", 0.0) + runner(command, root)
    for row in rows:
        if row.method is not None and row.method.needs is None:
            runs[row.name] = run_row(row, root, runner)
    for row in rows:
        if row.method is None:
            runs[row.name] = run_row(row, root, runner)
    return runs, extra


# ------------------------------------------------------------------------------------------ reading the results

def summary_path(root: str, row: Row) -> str:
    """Where the row's own evaluation (its last command) writes its summary."""
    return eval_output(root, row.commands[-1], ".summary.json")


def gradings_path(root: str, row: Row) -> str:
    return eval_output(root, row.commands[-1], ".jsonl")


def eval_output(root: str, command: str, suffix: str) -> str:
    """What an eval_math command writes: its --out (.jsonl) or beside the model's folder, MODEL_eval_<data stem>,
    + suffix."""
    named = named_flags(command)
    if "--out" in named:
        return os.path.join(root, named["--out"][:-len(".jsonl")] + suffix)
    stem = os.path.basename(named.get("--data_path", "eval.parquet")).split(".")[0]
    return os.path.join(root, f"{named['--model_path']}_eval_{stem}{suffix}")


def read_json(path: str, written_by: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise UserError(f"{path} does not exist: `{written_by}` writes it") from None
    except ValueError as error:
        raise UserError(f"{path} is not valid JSON ({error}): rerun `{written_by}`") from None


def read_steps(path: str, written_by: str) -> list[dict]:
    """metrics.jsonl -> the per-step records (not the evaluations), in file order."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise UserError(f"{path} does not exist: `{written_by}` writes it") from None
    steps = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise UserError(f"{path} line {number} is not valid JSON ({error}): rerun `{written_by}`") from None
        if "loss" in record:
            steps.append(record)
    if not steps:
        raise UserError(f"{path} holds no logged step: did `{written_by}` finish?")
    return steps


@dataclass
class Result:
    row: Row
    run: RowRun
    summary: dict | None = None
    steps: list[dict] = field(default_factory=list)
    reverse_kl: float | None = None
    versus_start: tuple[int, int, float] | None = None  # (only this row right, only its start right, p)
    curve: list[dict] = field(default_factory=list)  # curve_points
    sampled: dict | None = None  # the final model's grading on SCALE.sampled samples per problem (sampled_summary)
    versus_base: tuple[int, int, float] | None = None  # a variant against its method's row of the same seed


def collect(root: str, rows: Sequence[Row], runs: dict[str, RowRun],
            statistics: Callable[[str, Row, Row | None], tuple[float | None, tuple | None]]) -> list[Result]:
    """Each row's evaluation summary, training steps, reverse KL to the teacher and paired test against its start
    (the student, or the row its `baseline` names; none for the teacher and the student) (`statistics`:
    benchmarks/demo_stats.py's, or the tests' stand-in); skipped rows stay empty."""
    student = next((r for r in rows if r.student), None)
    by_name = {r.name: r for r in rows}
    results = []
    for row in rows:
        run = runs[row.name]
        if run.skipped is not None:
            results.append(Result(row, run))
            continue
        summary = read_json(summary_path(root, row), row.commands[-1])
        steps = read_steps(metrics_path(root, row), row.commands[0]) \
            if row.method else []
        start = None if row.student or row.name == "teacher" else by_name[row.baseline] if row.baseline else student
        reverse_kl, paired = statistics(root, row, start)
        results.append(Result(row, run, summary, steps, reverse_kl, paired, curve_points(root, row, steps),
                              sampled_summary(root, row), versus_base(root, row, by_name, runs)))
    return results


def versus_base(root: str, row: Row, by_name: dict[str, Row], runs: dict[str, RowRun]) -> tuple | None:
    """A variant's paired test against its method's row of the same seed, where that row is in the table."""
    base = by_name.get(f"{row.method.variant_of}_s{row.seed}") if row.method and row.method.variant_of else None
    if base is None or runs[base.name].skipped is not None:
        return None
    from benchmarks.demo_stats import paired_test
    return paired_test(gradings_path(root, row), gradings_path(root, base))


def sampled_summary(root: str, row: Row) -> dict | None:
    """The row's sampled grading (eval_math --n_samples N at temperature 1): {n, mean (avg@N), mean_ci95, pass
    (pass@N), pass_ci95}, the intervals over problems; None without one."""
    command = next((c for c in row.commands if "--n_samples" in named_flags(c)), None)
    if command is None:
        return None
    summary = read_json(eval_output(root, command, ".summary.json"), command)
    n = summary["n_samples"]
    return {"n": n, "mean": summary[f"mean@{n}"], "mean_ci95": summary[f"mean@{n}_ci95"],
            "pass": summary["pass@k"][str(n)], "pass_ci95": summary["pass@k_ci95"][str(n)]}


CUMULATIVE = ("tokens", "generated_tokens", "teacher_tokens", "teacher_requests")  # summed up to a curve's step


def curve_points(root: str, row: Row, steps: Sequence[dict]) -> list[dict]:
    """A method's row graded at each of its steps (its curve's exports, then its end): the step, the accuracy with
    its interval, the gradings' file (relative to the root: the paired tests at equal steps and FLOPs read it) and
    the counts the run logged up to that step, summed (benchmarks/demo_curves.py turns them into FLOPs)."""
    if row.method is None:
        return []
    points = []
    for command in row.commands[1:]:
        if "--n_samples" in named_flags(command):
            continue  # the sampled grading: Result.sampled
        name = os.path.basename(named_flags(command)["--model_path"])
        step = int(name.rsplit("_step", 1)[1]) if name != row.name else steps[-1]["step"]
        summary = read_json(eval_output(root, command, ".summary.json"), command)
        counts = {key: total([m for m in steps if m["step"] <= step], key) for key in CUMULATIVE}
        points.append({"step": step, "accuracy": summary["accuracy"], "accuracy_ci95": summary["accuracy_ci95"],
                       "gradings": os.path.relpath(eval_output(root, command, ".jsonl"), root), **counts})
    return points


def metrics_path(root: str, row: Row) -> str:
    return os.path.join(root, named_flags(row.commands[0])["--save_dir"], f"{row.name}_metrics.jsonl")


def demo_statistics(root: str, row: Row, start: Row | None) -> tuple[float | None, tuple | None]:
    """(the row's held-out reverse KL to the teacher, its paired test against `start` or None)."""
    from benchmarks.demo_stats import paired_test, reverse_kl_to_teacher
    folder = os.path.dirname(gradings_path(root, row))
    named = named_flags(row.commands[-1])
    # graded with tools, a record's completion is the model's own turns without the results between them: not a
    # sequence either model produced, so no KL is measured on it
    is_teacher = os.path.basename(named["--model_path"]) == "teacher"
    reverse_kl = None if is_teacher or "--tools" in named else reverse_kl_to_teacher(
        os.path.join(root, named["--model_path"]), os.path.join(folder, "teacher"), gradings_path(root, row))
    paired = paired_test(gradings_path(root, row), gradings_path(root, start)) if start else None
    return reverse_kl, paired


# ---------------------------------------------------------------------------------------------------- the table

def format_seconds(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def format_accuracy(summary: dict) -> str:
    low, high = summary["accuracy_ci95"]
    return (f"{100 * summary['accuracy']:.1f}% [{100 * low:.1f}, {100 * high:.1f}] "
            f"({summary['correct']}/{summary['samples']})")


def total(steps: Sequence[dict], key: str) -> float:
    return sum(m.get(key, 0) for m in steps)


def versus(paired: tuple[int, int, float] | None) -> str:
    if paired is None:
        return "-"
    gained, lost, p = paired
    return f"+{gained} / -{lost}, p = {p:.2g}"


def teacher_cell(steps: Sequence[dict]) -> str:
    if not steps or "teacher_requests" not in steps[0]:
        return "-"
    return f"{total(steps, 'teacher_requests'):,.0f} ({total(steps, 'teacher_tokens'):,.0f} tokens)"


def mean_of(steps: Sequence[dict], key: str) -> float | None:
    """The mean of a metric over the steps that logged it (a window may log none)."""
    values = [m[key] for m in steps if key in m]
    return sum(values) / len(values) if values else None


def notes(result: Result) -> str:
    steps = result.steps
    if not steps:
        return "evaluation reused (the same commit and flags)" if result.run.reused else ""
    parts = [f"{steps[-1]['step']} steps, loss {steps[0]['loss']:.3g} -> {steps[-1]['loss']:.3g}"]
    if result.versus_base is not None:
        parts.insert(0, f"vs {result.row.method.variant_of} seed {result.row.seed}: {versus(result.versus_base)}")
    if "skd_replaced_share" in steps[0]:
        parts.append(f"tokens replaced by the teacher {steps[0]['skd_replaced_share']:.0%} -> "
                     f"{steps[-1]['skd_replaced_share']:.0%}")
    if "zero_variance_share" in steps[0]:
        signal = 1 - sum(m["zero_variance_share"] for m in steps) / len(steps)
        parts.append(f"groups with signal {signal:.0%} (step 1 {1 - steps[0]['zero_variance_share']:.0%}, last "
                     f"{1 - steps[-1]['zero_variance_share']:.0%}), reward {steps[0]['reward']:.2f} -> "
                     f"{steps[-1]['reward']:.2f}")
    if "reward" in steps[0] and "zero_variance_share" not in steps[0]:  # no groups: PPO's one answer a prompt
        parts.append(f"reward {steps[0]['reward']:.2f} -> {steps[-1]['reward']:.2f}")
    if "value_loss" in steps[0]:
        parts.append(f"the critic's value loss {steps[0]['value_loss']:.3g} -> {steps[-1]['value_loss']:.3g}")
    if "pi_hat" in steps[0]:
        parts.append(f"pi_hat {steps[0]['pi_hat']:.2f} -> {steps[-1]['pi_hat']:.2f}")
        right, wrong = mean_of(steps, "pi_hat_right"), mean_of(steps, "pi_hat_wrong")
        if right is not None and wrong is not None:
            parts.append(f"pi_hat on right / wrong answers {right:.2f} / {wrong:.2f}")
        for kind in ("right", "wrong"):  # by the third of the answer the chunk starts in
            thirds = [mean_of(steps, f"pi_hat_{kind}_{where}") for where in ("early", "middle", "late")]
            if None not in thirds:
                parts.append(f"on {kind} answers' early / middle / late chunks "
                             + " / ".join(f"{t:.2f}" for t in thirds))
    return "; ".join(parts)


def tokens_key(steps: Sequence[dict]) -> str:
    """The metric that counts a run's trained tokens: `tokens`, but DPO's `answer_tokens` (its `tokens` count the
    pairs the skeleton divides by)."""
    return "answer_tokens" if steps and "answer_tokens" in steps[0] else "tokens"


def record(result: Result) -> dict:
    """One row of demo.json."""
    row, summary = result.row, result.summary or {}
    return {"name": row.name, "label": row.label, "method": row.method.name if row.method else None,
            "seed": row.seed, "learning_rate": row.learning_rate, "commands": list(row.commands),
            "skipped": result.run.skipped, "reused": result.run.reused, "seconds": result.run.seconds,
            "accuracy": summary.get("accuracy"), "accuracy_ci95": summary.get("accuracy_ci95"),
            "correct": summary.get("correct"), "problems": summary.get("samples"),
            "eos_share": summary.get("eos_share"), "reverse_kl_to_teacher": result.reverse_kl,
            "versus_start": list(result.versus_start) if result.versus_start else None,
            "steps": len(result.steps), "student_tokens": total(result.steps, tokens_key(result.steps)),
            "teacher_requests": total(result.steps, "teacher_requests"),
            "teacher_tokens": total(result.steps, "teacher_tokens"),
            "groups_with_signal": (1 - sum(m["zero_variance_share"] for m in result.steps) / len(result.steps)
                                   if result.steps and "zero_variance_share" in result.steps[0] else None),
            "gradings": os.path.relpath(gradings_path(".", row), "."), "curve": result.curve,
            "sampled": result.sampled,
            "versus_base": list(result.versus_base) if result.versus_base else None}


def table(results: Sequence[Result]) -> str:
    """One line per row; a column of the sampled gradings where the scale makes them (SCALE.sampled)."""
    sampled = next((r.sampled["n"] for r in results if r.sampled), None)
    header = ("model", "seed", "lr", "held-out accuracy [95%]", "vs its start (McNemar)",
              "reverse KL to the teacher", "EOS", "teacher requests", "student tokens", "wall time", "notes")
    if sampled:
        header = header[:4] + (f"avg@{sampled} / pass@{sampled} at T = 1 [95%]",) + header[4:]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for result in results:
        row, summary = result.row, result.summary
        if summary is None:
            cells = (row.label, str(row.seed or "-")) + ("-",) * (len(header) - 3) + (result.run.skipped,)
        else:
            cells = (row.label, str(row.seed or "-"), f"{row.learning_rate:g}" if row.learning_rate else "-",
                     format_accuracy(summary), versus(result.versus_start),
                     "-" if result.reverse_kl is None else f"{result.reverse_kl:.3f}",
                     f"{summary['eos_share']:.0%}", teacher_cell(result.steps),
                     f"{total(result.steps, tokens_key(result.steps)):,.0f}" if result.steps else "-",
                     " + ".join(format_seconds(s) for s in result.run.seconds) or "-", notes(result))
            if sampled:
                cells = cells[:4] + (format_sampled(result.sampled),) + cells[4:]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def format_sampled(sampled: dict | None) -> str:
    if sampled is None:
        return "-"
    (mean_low, mean_high), (pass_low, pass_high) = sampled["mean_ci95"], sampled["pass_ci95"]
    return (f"{100 * sampled['mean']:.1f}% [{100 * mean_low:.1f}, {100 * mean_high:.1f}] / "
            f"{100 * sampled['pass']:.1f}% [{100 * pass_low:.1f}, {100 * pass_high:.1f}]")


def report(command: str, where: str, scale: Scale, results: Sequence[Result], extra: dict[str, float],
           seconds: float, teacher: str, choice: dict[int, float]) -> str:
    """The Markdown table under its header line; `where`: the machine line taken when the table started (its commit
    is the one the commands ran), `teacher` the commit the teacher's training started at, `choice` the val
    accuracy of each export graded to choose the student."""
    extras = "".join(f", {what} {format_seconds(s)}" for what, s in extra.items())
    graded = ", ".join(f"step {step} {accuracy:.1%}" for step, accuracy in choice.items())
    low, high = scale.student_band
    return (f"### `{command}`: {where}; "
            f"{format_seconds(seconds)} in all{extras}\n\n"
            f"The teacher trained at commit {teacher}; the student its first export at {low:.0%}-{high:.0%} on the "
            f"val problems (graded: {graded}). "
            f"Every method from the same student, {scale.budget_steps} optimizer steps of 16 student sequences; "
            f"accuracy on the held-out problems (greedy, {scale.task.eval_new_tokens} new tokens, math-verify; Wilson 95% "
            f"interval); vs its start: problems only this model solves / only the model it started from solves "
            f"(the starting student; a LoRA row's: the LoRA student at step 0) and McNemar's exact p; reverse KL: "
            f"per answer token, on the model's own greedy answers.\n\n{table(results)}")


def sweep_report(results: Sequence[Result]) -> str:
    lines = ["| method | learning rate | val accuracy [95%] |", "|---|---|---|"]
    for result in results:
        accuracy = result.run.skipped if result.summary is None else format_accuracy(result.summary)
        lines.append(f"| {result.row.method.name} | {result.row.learning_rate:g} | {accuracy} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------- CLI

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="addition", choices=list(SCALES),
                        help="which built-in task (dataset/make_demo_data.py): its data, models and runs' folder")
    parser.add_argument("--scale", default="cpu", choices=sorted({s for scales in SCALES.values() for s in scales}),
                        help="how big (SCALES)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="every run's --dtype (default: the scale's: float32 on a CPU, bfloat16 on CUDA)")
    parser.add_argument("--dry_run", action="store_true", help="print the commands, one per line, and stop")
    parser.add_argument("--fresh", action="store_true",
                        help="move an earlier table's runs in the task's folder (checkpoints/demo/, "
                             "checkpoints/demo_running_sum/) into its previous-TIME/ first")
    parser.add_argument("--retrain", action="store_true", help="--fresh, and the teacher and student too")
    parser.add_argument("--resume", action="store_true",
                        help="go on with the table an earlier run of this command left (stopped or killed): every "
                             "run resumes (--from_resume 1: a finished one stops at once), every evaluation made by "
                             "this commit with the same flags is reused")
    parser.add_argument("--sweep", default=None, help="comma-separated learning rates: each method at each, seed 1, "
                                                      "graded on the val problems, instead of the table")
    parser.add_argument("--ablation", action="store_true",
                        help="instead of the table: logit-free OPD from the served teacher with each --chunk_weight, "
                             "and white-box OPD, each seed (docs/logit_free.md)")
    parser.add_argument("--methods", default=",".join(m.name for m in METHODS),
                        help="comma-separated methods of the table or the sweep (default: METHODS; the OPD "
                             "variants, VARIANTS, by name: " + ",".join(m.name for m in VARIANTS) + "; dpo; and "
                             "with --task products the calculator's arm: " + ",".join(m.name for m in TOOL_METHODS)
                             + ")")
    args = parser.parse_args(argv)
    if args.resume and (args.fresh or args.retrain):
        parser.error("--resume goes on with the runs that --fresh and --retrain move aside: pass one of them")
    names = {m.name: m for m in (*METHODS, *VARIANTS, DPO, *TOOL_METHODS)}
    unknown = [name for name in args.methods.split(",") if name not in names]
    if unknown:
        parser.error(f"--methods: {', '.join(unknown)} not among {', '.join(names)}")
    args.methods = [names[name] for name in args.methods.split(",")]
    task = SCALES[args.task][next(iter(SCALES[args.task]))].task
    calling = [m.name for m in args.methods if m.tools]
    if calling and not task.tools:
        parser.error(f"--methods {','.join(calling)}: the {args.task} task has no tool; use --task products")
    if args.scale not in SCALES[args.task]:
        parser.error(f"--scale {args.scale}: the {args.task} task has {', '.join(SCALES[args.task])}")
    if args.sweep is not None:
        try:
            args.sweep = [float(x) for x in args.sweep.split(",")]
        except ValueError:
            parser.error(f"--sweep takes comma-separated learning rates, got {args.sweep!r}")
    return args


def main(argv: list[str] | None = None, root: str = ROOT, runner: Callable[[str, str], float] = run_command,
         teachers: dict[str, object] | None = None,
         statistics: Callable[[str, Row, Row | None], tuple] = demo_statistics) -> int:
    """`root` (where the commands run), `runner` (command, cwd -> seconds), `teachers` ({"vllm", "rule"}: their
    start and stop) and `statistics` are for the tests."""
    args = parse_args(argv)
    scale = SCALES[args.task][args.scale]
    scale = replace(scale, dtype=args.dtype or scale.dtype)
    teacher = teacher_row(scale)
    if args.dry_run:
        print_plan(args, scale, teacher)
        return 0
    relative = scale.task.save_dir
    save_dir = os.path.join(root, relative)
    rows = planned_rows(args, scale, student_name(scale, "N"))  # their names only, before the student is known
    bases = ["teacher", *([STUDENT_SFT] if scale.student_config else []),
             *(student_name(scale, step) for step in scale.snapshots)]
    check_no_live_run(save_dir, bases + [r.name for r in rows])
    moving = [r.name for r in rows] + (bases if args.retrain else [])
    existing = sorted({p for files in existing_runs(save_dir, moving).values() for p in files}) + \
        (table_files(save_dir) if not (args.sweep or args.ablation) else [])  # the teacher's files hold the student's
    if args.retrain and os.path.exists(os.path.join(save_dir, TEACHER_COMMIT)):
        existing.append(os.path.join(save_dir, TEACHER_COMMIT))
    if args.resume:  # an earlier part's runs go on
        existing = []
    if existing and not (args.fresh or args.retrain):
        raise UserError(f"{relative}/ holds {describe(existing, save_dir)}: pass --resume to go on with them, "
                        f"--fresh to move them into {relative}/previous-TIME/ first, or move them yourself")
    if existing:
        folder = move_aside(save_dir, existing)
        print(f"moved {describe(existing, save_dir)} into {os.path.relpath(folder, root)}/", flush=True)
    os.makedirs(save_dir, exist_ok=True)
    # the commands name the data files (the teacher's --eval_data_path): on a fresh checkout they are written first
    ensure_demo_data(os.path.join(root, scale.task.data_dir), task=scale.task.name)
    start, where = time.perf_counter(), machine()
    runs = {"teacher": run_teacher(teacher, root, runner)}
    extra = {}
    if scale.student_config:  # a smaller student's own SFT, resumed as the teacher's is
        extra["the student's own SFT"] = sum(run_row(student_sft_row(scale), root, runner).seconds)
    student, choice = choose_student(scale, root, runner)
    rows = planned_rows(args, scale, student.name)
    done, served = run_all(rows, None if args.sweep else student, root, runner,
                           teachers or {"vllm": ServedTeacher(scale.task), "rule": RuleTeacher()}, scale)
    runs.update(done)
    extra.update(served)
    if args.sweep:
        print("\n" + sweep_report(collect(root, rows, runs, lambda *_: (None, None))), flush=True)
        return 0
    results = collect(root, [teacher, student] + rows, runs, statistics)
    command = shlex.join(["python", "benchmarks/demo.py", *(sys.argv[1:] if argv is None else argv)])
    text = report(command, where, scale, results, extra, time.perf_counter() - start, teacher_commit(save_dir),
                  choice)
    with open(os.path.join(save_dir, "ablation.json" if args.ablation else "demo.json"), "w", encoding="utf-8") as f:
        json.dump({"header": text.splitlines()[0], "scale": asdict(scale), "extra_seconds": extra,
                   "teacher_commit": teacher_commit(save_dir), "student_choice": choice,
                   "rows": [record(r) for r in results]}, f, indent=1)
    print("\n" + text, flush=True)
    return 0


def planned_rows(args: argparse.Namespace, scale: Scale, student: str) -> list[Row]:
    """The rows of the sweep, the ablation or the table, from `student`."""
    if args.sweep:
        return sweep_rows(scale, student, args.sweep, args.methods)
    return ablation_rows(scale, student) if args.ablation else table_rows(scale, student, args.methods)


def print_plan(args: argparse.Namespace, scale: Scale, teacher: Row) -> None:
    """--dry_run: the commands, one per line; the student's folder (student_name(scale, "N")) is chosen once the
    exports are graded."""
    low, high = scale.student_band
    placeholder = student_name(scale, "N")
    print("\n".join(teacher.commands), flush=True)
    if scale.student_config:
        print("\n".join(student_sft_row(scale).commands), flush=True)
    print(f"# then, export by export until one is at {low:.0%}-{high:.0%}: "
          f"{snapshot_row(scale, scale.snapshots[0]).commands[0]} (step {scale.snapshots[0]}, then the next); "
          f"{placeholder} below is that export", flush=True)
    rows = planned_rows(args, scale, placeholder)
    if not args.sweep:  # the student's own grading on the held-out problems
        rows = [Row(placeholder, "starting student", (*sampled_evaluation(placeholder, scale),
                                                      evaluation(placeholder, scale, tools=bool(scale.task.tools))))
                ] + rows
    for row in rows:
        print("\n".join(row.commands), flush=True)


if __name__ == "__main__":
    run_script(main)
