"""First contact with a GPU: every CUDA path of the loops run once, and the numbers users care about, one command
that plans its work, keeps each phase to a time limit and the whole to a wall-clock budget, and leaves what it
measured when it is cut short.

    python benchmarks/bench_gpu.py --plan                 # the plan for one H200 (no GPU needed), then exit 0
    python benchmarks/bench_gpu.py                        # one CUDA GPU: about 9 minutes (--budget_s 550)
    python benchmarks/bench_gpu.py --use_compile 0        # the SFT / KD step phases with eager layers
    python benchmarks/bench_gpu.py --device cpu --tiny    # the same code paths on tiny shapes (a test runs it)
    python benchmarks/bench_gpu.py --out gpu.json         # the JSON (default bench_gpu.json); gpu.md, gpu.log beside
    python benchmarks/bench_gpu.py --phase_limit_s "smoke compile=300"   # one phase's limit (SECONDS: every phase's)

Without a CUDA device (and without --device cpu) it says so and exits 0. Otherwise it prints its plan (the phases in
order with their estimated seconds and limits, the smoke runs, the peak disk), then runs the phases in that order,
which is their priority: a phase whose estimate does not fit in what is left of --budget_s is skipped with a note.
A phase that runs past its limit (--phase_limit_s; by default twice its estimate, at least 60 s) is stopped where
it is (SIGALRM raises PhaseOverrun in it), its row says "timeout", and the next phases run: the kit can end past
--budget_s by at most the last phase's limit. After every phase the JSON (--out) and the table (--out as .md) are
rewritten and a progress line goes to stderr, so a kill leaves what was measured. On CUDA every phase runs with
SDPA restricted to the fused kernels (flash, memory-efficient, cuDNN): an attention only the math kernel can take
is an error in that phase's row, not a low MFU (bf16 vs fp32 alone allows the math kernel where no fused kernel
takes a dtype, and says so). Its working folder (--workdir, a new folder, or a temporary one) is
removed at the end, also after a SIGTERM. It exits 1 when a phase failed, raised or overran its limit. The phases,
in order: the bf16 smoke runs first (cheap, and what a broken bf16 autocast path would crash), then the full-shape
measurements users care about most, then the other smoke runs and the weight sync:
  smoke models   HF folders of random weights with the real width and the real 151,936-row vocabulary of
                 Qwen3-0.6B (the student: hidden 1024, 16 heads of 128, 8 KV heads, MLP 3072, tied) and Qwen3-1.7B
                 (the teacher: hidden 2048, MLP 6144), 2 layers each (--tiny: hidden 64 / 128)
  smoke bf16     the three loops' main() for 2 steps each in bf16, and one SFT resume (2 more steps with
                 --from_resume 1), with eager layers (--use_compile 0: the step phases pay the compile and measure
                 the compiled layers, smoke compile runs them in the loops); each must finish with finite losses
                 (the loops' output: --out as .log). The loops always save a run's last step; each run saves into a
                 folder of its own, removed when it ends (the bf16 SFT run's when its resume has read it), so at
                 most one run's save is on disk at a time (two while the resume writes its own)
  full models    the 28-layer Qwen3-0.6B and Qwen3-1.7B shapes, built on the device (not written to disk)
  SFT / KD step  batch 8 x 2,048 tokens (labels on the last 1,024), bf16 autocast, fp32 master weights and AdamW,
                 the loops' chunked losses, the decoder layers as the loops run them (--use_compile auto: compiled
                 on CUDA, eager on a CPU): the first step on its own (with compiled layers, their compile), then
                 tokens/s (all 16,384 tokens of a step), model FLOPs utilisation and peak memory. MFU = model FLOPs
                 per second / the GPU's peak dense bf16 FLOPs, model FLOPs as torchtitan counts them: 6 x the
                 layers' parameters per token + 12 x layers x heads x head_dim x sequence length per token
                 (attention over every pair, forward and backward), and the head, 6 x hidden x vocabulary, on the
                 labelled positions only (those the loss projects); a KD step adds the teacher's forward (a third
                 of that, its head on the same positions). Beside it the FLOPs the step computes (causal attention:
                 half the pairs) over the peak, and the peak memory split into the fp32 weights, gradients and AdamW
                 moments and a KD teacher's weights (from the shapes) and the rest (activations and the loss chunk:
                 measured peak minus those). The peak is known for H100/H200 (989 TFLOP/s) and A100 (312);
                 otherwise MFU is not shown (--peak_tflops)
  OPD split      one step split into generation (batch 32 x 512 new tokens: tokens/s), teacher forward and student
                 forward + backward + optimizer (benchmarks/bench_opd.py's opd_step: the loop's own rollout; the
                 student's layers eager)
  generation     sampled rollouts, every row its full length, bf16 autocast, with the decode step the loops take by
                 default here (--decode auto: compiled on CUDA, eager on a CPU), at 32 x 512 and 256 x 256 new
                 tokens: tokens/s and the multiple of generation's roofline (benchmarks/roofline.py: the bound of
                 the same work at the GPU's peak bf16 rate and its measured exp and copy rates)
  decode compiled  greedy generation (batch 32 x 256 new tokens, bf16 autocast) with the eager decode step and
                 with the compiled one (--decode compiled: torch.compile "reduce-overhead", one CUDA graph per
                 decoding width): tokens/s of each, the compiled one's first call (compilation and capture), the
                 share of identical tokens, whether inductor skipped the CUDA graphs (it says why in the log); one
                 more rollout of each under torch.cuda.set_sync_debug_mode("warn"), counting the syncs inside the
                 decode steps (the target is none: the host reads the device only every STOP_CHECK steps, outside
                 them) and in the whole rollout; and each rollout's tokens teacher-forced through the eager forward:
                 the share of picks that are its argmax and how far a pick's log-prob falls below the argmax's
  bf16 vs fp32   the first SFT loss of the same row and weights in bf16 autocast and in fp32 agree within 2% (bf16
                 keeps 8 bits of mantissa; a cross entropy of ~12 nats moves by ~0.1 between the two); a dtype
                 whose attention no fused kernel takes (flash and cuDNN refuse fp32) runs with the math kernel
                 allowed, and the row says so
  generate vs transformers   when transformers is installed: its generate and ours on the same bf16 weights and
                 prompts, greedy, same length: a 16-token call of each measures a step, and the timed calls get
                 as many tokens (at most 512) as fit in GENERATE_TIMED_S
  smoke ...      the same runs as smoke bf16 (without the resume) in fp16 (a GradScaler), with
                 --gradient_checkpointing 1 (both with eager layers), with --use_compile 1 (OPD with --decode
                 compiled too; the first compiled run pays a cold compile)
  weight sync    serving/weight_sync.py's bf16 criterion (mean |d log p| over the probe <= 4e-3, max <= 5e-2) was
                 calibrated on the CPU (benchmarks/bench_sync.py); measured here against a bf16 vLLM server on this
                 device, started when one can be (on CUDA: this interpreter imports vllm, or --vllm_python; on the
                 CPU only with --vllm_python), its log beside --out as .vllm.log. The server starts from the full
                 student's weights; the kit then syncs a copy with its norm weights drawn around 1 (as
                 bench_sync.random_model does: bf16 represents exactly 1, never a trained norm) through the loops'
                 own push (WeightSync), and records the figures next to the tolerance: the correct sync's (must
                 pass: the row's status) and those of a sync that missed one AdamW step at lr 1e-5 (shown, caught
                 or not). Without a server: skipped, the note saying how to enable it
The "full" estimates are guesses until a GPU has run the kit: the JSON's seconds per phase are what to put in COST_S.
A phase is stopped between two Python bytecodes: one blocked inside a single C call (a hung CUDA synchronize) is
stopped when that call returns.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import bench_sync, harness, roofline  # noqa: E402
from benchmarks.bench_opd import measured_roofline, opd_step  # noqa: E402
from benchmarks.roofline import peak_bf16_tflops  # noqa: E402
from common.errors import Stopped  # noqa: E402
from model import (Decoder, Qwen3Config, Qwen3ForCausalLM, create_model, default_tokenizer_dir,  # noqa: E402
                   generate, load_pretrained, load_tokenizer, save_pretrained)
from model.qwen3 import COMPILE_CHOICES  # noqa: E402
from serving.engine import CompletionServer, probe_token_ids  # noqa: E402
from serving.vllm_launch import start_vllm, stop_vllm, vllm_command, wait_ready  # noqa: E402
from serving.weight_sync import TOLERANCE, WeightSync, own_logprobs, sync_statistics, within  # noqa: E402
from trainer.config.flags import resolve_use_compile  # noqa: E402
from trainer.losses.chunked import completion_hidden  # noqa: E402
from trainer.losses.fused_divergences import fused_kd_loss  # noqa: E402
from trainer.losses.fused_linear import fused_cross_entropy  # noqa: E402
from trainer.skeleton.optimizer_step import make_optimizer  # noqa: E402
from model.precision import resolve_precision  # noqa: E402

SHAPES = {  # (student, teacher) of the full-model phases; the smoke models keep their width, with SMOKE_LAYERS
    "full": ({"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128},
             {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128}),
    "tiny": ({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32},
             {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32}),
}
SMOKE_LAYERS = 2  # every code path of a deeper model; a save is mostly the 151,936-row embedding anyway
SMOKE_STEPS = 2   # per smoke run; the resume adds as many again
RESUME_FLAGS = ["--from_resume", "1", "--resume_changes", "max_steps"]  # a longer run than the one saved: on purpose
# The smoke runs but smoke compile's keep eager layers (--use_compile 0, not the loops' CUDA default): a compile in
# each would cost the early smoke bf16 phase minutes; the step phases compile the layers (and time it), smoke compile
# runs them in the loops.
SMOKE_VARIANTS = {  # phase -> (variant, the loops' flags); build_phases places them in the kit's order
    "smoke bf16": ("bf16", ["--dtype", "bfloat16", "--use_compile", "0"]),
    "smoke fp16": ("fp16 + GradScaler", ["--dtype", "float16", "--use_compile", "0"]),
    "smoke checkpointing": ("gradient checkpointing", ["--dtype", "bfloat16", "--gradient_checkpointing", "1",
                                                       "--use_compile", "0"]),
    "smoke compile": ("compile", ["--dtype", "bfloat16", "--use_compile", "1"]),
}
# OPD's own flags in a smoke phase: --use_compile compiles the training layers only, the decode step has its own flag.
# smoke bf16 takes its default (auto: the compiled step on CUDA, the eager one on a CPU), what users run; fp16 and
# checkpointing do not change the decode step and run the eager one (on CUDA the only loops that do), compile the
# compiled one (on a CPU too)
SMOKE_OPD_FLAGS = {"smoke fp16": ["--decode", "eager"], "smoke checkpointing": ["--decode", "eager"],
                   "smoke compile": ["--decode", "compiled"]}
WORKLOAD = {  # sft/kd: (batch, sequence, completion); opd, decode, transformers: (batch, new tokens at most);
    # generation: its sizes (batch, new tokens); steps timed after warm-up
    "full": {"sft": (8, 2048, 1024), "opd": (32, 512), "generation": [(32, 512), (256, 256)], "decode": (32, 256),
             "transformers": (32, 512), "steps": 3, "warmup": 1},
    "tiny": {"sft": (2, 128, 64), "opd": (4, 16), "generation": [(4, 16), (16, 16)], "decode": (4, 16),
             "transformers": (4, 16), "steps": 1, "warmup": 0},  # the code paths, not the numbers: one call each
}
# generate vs transformers: a call of each with this many new tokens measures a step of both (and warms them up);
# the timed calls then get the most tokens, a multiple of it up to the workload's, that fit in GENERATE_TIMED_S
# together. At 32 x 512, one warm-up and one timed call of each, the phase ran past its limit of 83 s.
GENERATE_PROBE_TOKENS = 16
GENERATE_TIMED_S = {"full": 20.0, "tiny": 5.0}
# the targets the full shapes are measured against (the table says met or missed): generation at 32 x 512 new tokens
# (tokens/s at least, multiple of its roofline at most), and one OPD step's seconds at most
TARGETS = {"generation": {(32, 512): (10_000.0, 5.0)}, "OPD step s": 2.5}
# Expected seconds. "full": one H200, guesses but for what the first GPU run measured of the decode step (its
# per-phase seconds were not kept): the eager step 706 tokens/s at 32 x 256 greedy (11.6 s a rollout, which the OPD
# split's eager rollouts of 32 x 512 pay twice, and decode compiled three times), the compiled one 8,939 and its first
# call 44 s (the generation phase pays such a compile per width); "tiny": this project's 2-core CPU machine, one
# thread. A smoke run costs "smoke run" (+ "compile" with --use_compile 1, + "decode compile" for an OPD
# run whose decode step is compiled: --decode compiled, or auto on CUDA) + its save at
# DISK_BYTES_PER_S; the first compiled run pays "cold compile" once more (inductor's caches serve the later ones:
# on the CPU, 131 s for the first of the three compiled runs, 12 and 21 s for the others). With compiled layers
# the SFT step pays a "cold compile" too (the 28-layer model's one layer graph, forward and backward, at its own
# shapes); the KD step's student reuses its graphs (same shapes), and is given a warm "compile" for the margin.
# "weight sync": when it starts a vLLM server (a guess on CUDA, its compilation and CUDA graphs included; 2-5
# minutes on 2 CPU cores).
COST_S = {
    "full": {"smoke models": 5.0, "smoke run": 8.0, "compile": 15.0, "cold compile": 60.0, "decode compile": 30.0,
             "full models": 30.0,
             "SFT step": 10.0, "KD step": 15.0, "bf16 vs fp32": 5.0, "OPD split": 60.0, "generation": 90.0,
             "decode compiled": 90.0, "generate vs transformers": 50.0, "weight sync": 120.0},
    "tiny": {"smoke models": 4.0, "smoke run": 10.0, "compile": 5.0, "cold compile": 110.0, "decode compile": 10.0,
             "full models": 2.0,
             "SFT step": 4.0, "KD step": 8.0, "bf16 vs fp32": 1.0, "OPD split": 7.0, "generation": 5.0,
             "decode compiled": 35.0, "generate vs transformers": 12.0, "weight sync": 300.0},
}
DISK_BYTES_PER_S = {"full": 1e9, "tiny": 3e8}  # written and fsynced; the smoke models phase measures it
RESUME_BYTES_PER_PARAM = 12  # fp32 weights and AdamW's two moments
EXPORT_BYTES_PER_PARAM = 4   # the HF export of the fp32 master weights
BF16_TOLERANCE = 0.02
VOCAB = 151669  # the tokenizer's tokens (the embedding has 151,936 rows)
# A phase's default limit: twice its estimate (the estimates are guesses), never under a minute (a slow start-up,
# a loaded machine's import, must not read as an overrun)
LIMIT_FACTOR, LIMIT_FLOOR_S = 2.0, 60.0
SYNC_LR = 1e-5  # the missed step of the weight-sync phase: AdamW at Qwen3-0.6B's learning rate (as bench_sync's)
SYNC_SERVER_FLAGS = {"cuda": ["--gpu-memory-utilization", "0.3"], "cpu": []}  # on CUDA it shares the GPU with us
FUSED_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
EVERY_ATTENTION = [*FUSED_ATTENTION, SDPBackend.MATH]
# what SDPA raises when no enabled kernel takes an attention: on CUDA, on a CPU
NO_KERNEL = ("No available kernel", "No viable backend")
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch.cuda.set_sync_debug_mode("warn")'s message


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (what the test runs)")
    p.add_argument("--plan", action="store_true", help="print the plan and exit (no device needed)")
    p.add_argument("--budget_s", type=float, default=550.0, help="wall-clock seconds; phases that do not fit skip")
    p.add_argument("--phase_limit_s", type=phase_limit, action="append", default=[], metavar="[PHASE=]SECONDS",
                   help="stop a phase that runs longer, its row saying so: SECONDS for every phase, PHASE=SECONDS "
                        "for one (repeatable); default: each phase's, max(2 x its estimate, 60 s)")
    p.add_argument("--out", default="bench_gpu.json", help="the JSON; the table (.md) and the loops' log (.log) beside")
    p.add_argument("--peak_tflops", type=float, default=None, help="the GPU's peak dense bf16 TFLOP/s, for MFU")
    p.add_argument("--use_compile", default="auto", choices=COMPILE_CHOICES,
                   help="the SFT / KD step phases' decoder layers compiled (1) or eager (0); auto: as the loops, 1 on "
                        "CUDA, 0 elsewhere")
    p.add_argument("--workdir", default=None, help="a new folder for models and runs, removed at the end "
                                                   "(default: a temporary one)")
    p.add_argument("--vllm_python", default=None, help="a Python with vLLM, to start the weight-sync phase's server "
                                                       "(default on CUDA: this one, when it imports vllm)")
    args = p.parse_args(argv)
    args.use_compile = resolve_use_compile(args.use_compile, args.device)
    args.phase_limit_s = dict(args.phase_limit_s)  # {phase or None (every phase): seconds}; the last one given wins
    return args


def phase_limit(text: str) -> tuple[str | None, float]:
    """--phase_limit_s's value: SECONDS (every phase) or PHASE=SECONDS (that phase); more than 0 (a timer of 0 is
    none)."""
    name, _, seconds = text.rpartition("=")
    if not float(seconds) > 0:
        raise ValueError(text)  # argparse: "invalid phase_limit value"
    return name.strip() or None, float(seconds)


# ----------------------------------------------------------------------------------------------------------- plan

@dataclass
class SmokeRun:
    name: str            # its --save_weight and its folder
    loop: str
    variant: str
    flags: list[str]
    max_steps: int
    resumes: bool = False  # --from_resume 1: continues the run before it, from that run's save in the same folder


@dataclass
class Phase:
    name: str
    estimate_s: float
    run: Callable[["Kit"], tuple[str, str]]  # -> (status "ok" / "failed" / "skipped", a note for the table)
    needs: str | None = None                 # the phase whose models it uses
    groups: list[list[SmokeRun]] = field(default_factory=list)  # smoke phases: runs sharing one folder each


def model_config(sizes: dict, layers: int | None = None) -> Qwen3Config:
    base = Qwen3Config.from_json(os.path.join(ROOT, "model", "configs", "qwen3-tiny.json")).to_hf_dict()
    sizes = {**sizes, "num_hidden_layers": layers or sizes["num_hidden_layers"]}
    return Qwen3Config.from_dict({**base, **sizes, "tie_word_embeddings": True, "max_position_embeddings": 4096})


def parameter_count(config: Qwen3Config) -> int:
    with torch.device("meta"):  # shapes only: no memory, no GPU
        return Qwen3ForCausalLM(config).num_parameters()


def tokenizer_bytes() -> int:
    """At most what an export copies of the tokenizer (its whole folder)."""
    folder = default_tokenizer_dir()
    return sum(os.path.getsize(os.path.join(folder, name)) for name in os.listdir(folder)
               if os.path.isfile(os.path.join(folder, name)))


def smoke_groups(phase: str) -> list[list[SmokeRun]]:
    variant, flags = SMOKE_VARIANTS[phase]
    groups = []
    for loop in ("sft", "kd", "opd"):
        name = f"{loop}_{variant.split()[0]}"
        loop_flags = flags + (SMOKE_OPD_FLAGS.get(phase, []) if loop == "opd" else [])
        group = [SmokeRun(name, loop, variant, loop_flags, SMOKE_STEPS)]
        if loop == "sft" and phase == "smoke bf16":  # the resume: 2 more steps from the save of step 2
            group.append(SmokeRun(name, loop, "bf16, resumed for 2 more steps", flags, 2 * SMOKE_STEPS, True))
        groups.append(group)
    return groups


def disk_sizes(shape: str) -> dict[str, int]:
    """Bytes on disk, from the shapes: what each part of the kit writes."""
    student, teacher = (model_config(sizes, SMOKE_LAYERS) for sizes in SHAPES[shape])
    smoke_student, smoke_teacher = parameter_count(student), parameter_count(teacher)
    tokenizer = tokenizer_bytes()
    full_student = parameter_count(model_config(SHAPES[shape][0]))
    return {"smoke models": 4 * (smoke_student + smoke_teacher) + 2 * tokenizer,
            "run save": (RESUME_BYTES_PER_PARAM + EXPORT_BYTES_PER_PARAM) * smoke_student + tokenizer,
            "generate folder": 2 * full_student + tokenizer,    # bf16
            "sync folder": 4 * full_student + tokenizer}        # the served folder and the pushed file, bf16


def group_bytes(group: list[SmokeRun], save: int) -> int:
    """A resumed run writes its save beside the one it resumed from before that one is replaced: two at once."""
    return min(len(group), 2) * save


def run_estimate(run: SmokeRun, shape: str, save: int) -> float:
    costs = COST_S[shape]
    return costs["smoke run"] + (costs["compile"] if compiles_layers(run, shape) else 0.0) \
        + (costs["decode compile"] if compiles_decode(run, shape) else 0.0) + save / DISK_BYTES_PER_S[shape]


def flag_value(flags: list[str], flag: str) -> str:
    """The value `flags` give `flag`, or "auto" (the loops' default for --use_compile and --decode)."""
    return flags[flags.index(flag) + 1] if flag in flags else "auto"


def compiles_layers(run: SmokeRun, shape: str) -> bool:
    """Whether the run compiles its decoder layers: --use_compile 1, or auto (its default) on CUDA, where the full
    shapes run."""
    use_compile = flag_value(run.flags, "--use_compile")
    return use_compile == "1" or (use_compile == "auto" and shape == "full")


def compiles_decode(run: SmokeRun, shape: str) -> bool:
    """Whether the run's rollouts compile the decode step: OPD with --decode compiled, or auto (its default) on CUDA,
    where the full shapes run."""
    if run.loop != "opd":
        return False
    decode = flag_value(run.flags, "--decode")
    return decode == "compiled" or (decode == "auto" and shape == "full")


def build_phases(shape: str, compiled_steps: bool, sync_server: bool = False) -> list[Phase]:
    """Every phase in priority order with its estimated seconds: the bf16 smoke runs (cheap, and what a broken bf16
    path crashes), the full-shape measurements (steps, the OPD split, generation, the decode step, bf16 against
    fp32, generate against transformers), the other smoke runs, then the weight sync.
    `compiled_steps`: whether the SFT / KD step phases compile the decoder layers (--use_compile, resolved);
    `sync_server`: whether the weight-sync phase can start a vLLM server (otherwise it only says how to)."""
    costs, sizes, rate = COST_S[shape], disk_sizes(shape), DISK_BYTES_PER_S[shape]
    sft_compile, kd_compile = (costs["cold compile"], costs["compile"]) if compiled_steps else (0.0, 0.0)
    smoke_phases = {name: smoke_phase(name, shape, sizes["run save"]) for name in SMOKE_VARIANTS}
    sync_estimate = costs["weight sync"] + sizes["sync folder"] / rate if sync_server else 0.0
    return [Phase("smoke models", costs["smoke models"] + sizes["smoke models"] / rate, write_smoke_models),
            smoke_phases["smoke bf16"],
            Phase("full models", costs["full models"], build_full_models),
            Phase("SFT step", costs["SFT step"] + sft_compile, lambda kit: step_throughput(kit, "sft"),
                  "full models"),
            Phase("KD step", costs["KD step"] + kd_compile, lambda kit: step_throughput(kit, "kd"), "full models"),
            Phase("OPD split", costs["OPD split"], opd_split, "full models"),
            Phase("generation", costs["generation"], generation, "full models"),
            Phase("decode compiled", costs["decode compiled"], decode_compiled, "full models"),
            Phase("bf16 vs fp32", costs["bf16 vs fp32"], bf16_agrees_with_fp32, "full models"),
            Phase("generate vs transformers", costs["generate vs transformers"] + sizes["generate folder"] / rate,
                  generate_against_transformers, "full models"),
            smoke_phases["smoke fp16"], smoke_phases["smoke checkpointing"], smoke_phases["smoke compile"],
            Phase("weight sync", sync_estimate, weight_sync, "full models")]


def smoke_phase(name: str, shape: str, save: int) -> Phase:
    """A smoke phase: its runs' estimates, and the cold compile for the first compiled one."""
    groups = smoke_groups(name)
    compiles = any(compiles_layers(run, shape) for group in groups for run in group)
    estimate = sum(run_estimate(run, shape, save) for group in groups for run in group) \
        + (COST_S[shape]["cold compile"] if compiles else 0.0)
    return Phase(name, estimate, lambda kit: smoke(kit, groups), "smoke models", groups)


def limit_s(phase: Phase, limits: dict[str | None, float]) -> float:
    """The phase's time limit: --phase_limit_s PHASE=S, else --phase_limit_s S, else max(2 x estimate, 60 s) in
    whole seconds."""
    return limits.get(phase.name, limits.get(None, math.ceil(max(LIMIT_FACTOR * phase.estimate_s, LIMIT_FLOOR_S))))


def make_plan(shape: str, budget_s: float, compiled_steps: bool, limits: dict[str | None, float] | None = None,
              sync_server: bool = False) -> dict:
    """What the kit will do, before it starts: phases with estimates, limits (--phase_limit_s) and expected start,
    smoke runs with their saves, and the peak disk (the smoke models, kept to the end, plus the largest run folder,
    the weight-sync folder or the generate folder, whichever is largest: one of them exists at a time)."""
    phases, sizes = build_phases(shape, compiled_steps, sync_server), disk_sizes(shape)
    rows, clock, fitting = [], 0.0, set()
    for phase in phases:
        fits = clock + phase.estimate_s <= budget_s and (phase.needs is None or phase.needs in fitting)
        rows.append({"name": phase.name, "estimate_s": round(phase.estimate_s, 1),
                     "limit_s": round(limit_s(phase, limits or {}), 2), "expected_start_s": round(clock, 1),
                     "fits": fits})
        if fits:
            clock, fitting = clock + phase.estimate_s, fitting | {phase.name}
    runs = [run for phase in phases for group in phase.groups for run in plan_group(phase.name, group, shape)]
    largest_folder = max(run["folder_bytes"] for run in runs)
    return {"shape": shape, "budget_s": budget_s, "compiled_steps": compiled_steps, "phases": rows,
            "expected_s": round(clock, 1), "runs": runs,
            "disk_bytes": {**sizes, "largest run folder": largest_folder,
                           "peak": sizes["smoke models"] + max(largest_folder, sizes["sync folder"],
                                                               sizes["generate folder"])}}


def plan_group(phase: str, group: list[SmokeRun], shape: str) -> list[dict]:
    """The runs of one folder: each saves its last step; a save is kept only for the run that resumes from it."""
    save = disk_sizes(shape)["run save"]
    return [{"phase": phase, "name": run.name, "loop": run.loop, "variant": run.variant, "max_steps": run.max_steps,
             "resumes": run.resumes, "saves_at_step": run.max_steps, "save_bytes": save,
             "save_kept_for": group[index + 1].variant if index + 1 < len(group) else None,
             "folder_removed_after": group[-1].variant, "folder_bytes": group_bytes(group, save),
             "estimate_s": round(run_estimate(run, shape, save), 1)} for index, run in enumerate(group)]


def print_plan(plan: dict) -> None:
    gib = 2 ** 30
    disk = plan["disk_bytes"]
    print(f"plan ({plan['shape']} shapes, budget {plan['budget_s']:.0f} s): phases in priority order, estimated "
          f"seconds and limits; one that does not fit in what is left of the budget is skipped, one that runs past "
          f"its limit is stopped")
    layers = "compiled (--use_compile 1; the SFT step's first step compiles them)" if plan["compiled_steps"] \
        else "eager (--use_compile 0)"
    print(f"the SFT / KD step phases' decoder layers: {layers}")
    for row in plan["phases"]:
        print(f"  {row['expected_start_s']:6.0f} s  {row['name']:<26} ~{row['estimate_s']:5.0f} s  limit "
              f"{row['limit_s']:5g} s" + ("" if row["fits"] else "  (would be skipped if the estimates hold)"))
    print(f"  {plan['expected_s']:6.0f} s  end")
    print(f"smoke runs ({len(plan['runs'])}), each saving its last step into a folder of its own (the loops always "
          f"save it), {disk['run save'] / gib:.2f} GiB a save (resume {RESUME_BYTES_PER_PARAM} B/param + export "
          f"{EXPORT_BYTES_PER_PARAM} B/param + tokenizer):")
    for run in plan["runs"]:
        kept = f"save kept for: {run['save_kept_for']}" if run["save_kept_for"] else "folder removed after it"
        print(f"  {run['phase']:<20} {run['loop'] + ' ' + run['variant']:<38} {run['max_steps']} steps  ~"
              f"{run['estimate_s']:3.0f} s  folder {run['folder_bytes'] / gib:.2f} GiB  {kept}")
    print(f"disk: smoke models {disk['smoke models'] / gib:.2f} GiB (to the end) + the largest run folder "
          f"{disk['largest run folder'] / gib:.2f} GiB, the weight-sync folder {disk['sync folder'] / gib:.2f} GiB or "
          f"the generate folder {disk['generate folder'] / gib:.2f} GiB (one at a time): peak {disk['peak'] / gib:.2f} "
          f"GiB")


# -------------------------------------------------------------------------------------------------------- running

@dataclass
class Kit:
    args: argparse.Namespace
    folder: str      # the working folder, removed at the end
    report: dict
    started: float
    smoke_models: tuple[str, str] | None = None
    full_models: tuple[torch.nn.Module, torch.nn.Module] | None = None

    def progress(self, message: str) -> None:
        print(f"[bench_gpu {time.perf_counter() - self.started:4.0f} s of {self.args.budget_s:.0f}] {message}",
              file=sys.stderr, flush=True)

    def path(self, suffix: str) -> str:
        """Beside --out: the table (.md), the loops' log (.log)."""
        return os.path.splitext(self.args.out)[0] + suffix


def fused_attention(device: str):
    """On CUDA, SDPA restricted to the fused kernels: an attention only the math kernel takes raises ("No available
    kernel"), so the phase's row says it, instead of a quietly low MFU."""
    return sdpa_kernel(FUSED_ATTENTION) if device.startswith("cuda") else contextlib.nullcontext()


def stop_on_sigterm() -> None:
    """SIGTERM (a time limit running out) stops the kit like Ctrl-C: the phase is noted as interrupted and the
    working folder removed. While a loop runs, the loop's own handler takes it and stops after the step (Stopped);
    each loop's main gives this handler back when it ends (trainer/skeleton/guard.py)."""
    def stop(signum, frame):
        raise Stopped("stopped by SIGTERM", 128 + signum)
    signal.signal(signal.SIGTERM, stop)


class PhaseOverrun(BaseException):
    """Raised in the main thread when a phase runs past its limit (time_limit). A BaseException, as KeyboardInterrupt
    is, so that no `except Exception` on its way (the loops', torch's) takes it for an ordinary failure; and neither
    a KeyboardInterrupt nor a Stopped, which the project's scripts take for a user's stop (common/errors.py's
    run_script, trainer/skeleton/guard.py): only run_loop and run_phases catch it."""


@contextlib.contextmanager
def time_limit(seconds: float):
    """PhaseOverrun in the main thread once `seconds` have passed (SIGALRM: nothing else in this process sets it;
    eval/grader.py's is in its worker process). The timer is one-shot; it is disarmed and the previous handler
    restored however the block ends."""
    def overrun(signum, frame):
        raise PhaseOverrun(f"past its limit of {seconds:g} s")
    previous = signal.signal(signal.SIGALRM, overrun)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        try:
            signal.setitimer(signal.ITIMER_REAL, 0)
        finally:  # reached even when the alarm fires just before the line above: it fires once
            signal.signal(signal.SIGALRM, previous)


def release_after_overrun(kit: Kit) -> None:
    """What a phase stopped mid-way leaves for the next ones, given back: torch.compile's state (dynamo's caches,
    inductor's CUDA-graph trees, maybe half-built), gradients on the full student (a step stopped before its
    zero_grad) and the memory of the phase's tensors (garbage once the exception is gone). Its folders are removed
    by its own finally blocks, its server stopped; the loops give back their signal handlers
    (trainer/skeleton/guard.py); they run without a process group (no RANK in the kit's environment), so none is
    left."""
    torch._dynamo.reset()
    if kit.full_models:
        kit.full_models[0].zero_grad(set_to_none=True)
    gc.collect()
    if kit.args.device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_phases(kit: Kit, phases: list[Phase]) -> None:
    """Each phase in order, within the budget and its limit; its row in the report."""
    done = set()
    for phase in phases:
        elapsed = time.perf_counter() - kit.started
        row = {"name": phase.name, "estimate_s": round(phase.estimate_s, 1), "status": "running"}
        kit.report["phases"].append(row)  # a kill during the phase leaves it "running" in what was written
        if phase.needs and phase.needs not in done:
            row.update(status="skipped", note=f"needs {phase.needs}, which did not finish ok")
        elif elapsed + phase.estimate_s > kit.args.budget_s:
            row.update(status="skipped", note=f"budget: {elapsed:.0f} s elapsed + {phase.estimate_s:.0f} s "
                                              f"estimated > {kit.args.budget_s:.0f} s")
        else:
            limit = limit_s(phase, kit.args.phase_limit_s)
            row["limit_s"] = round(limit, 2)
            kit.progress(f"{phase.name} (estimate {phase.estimate_s:.0f} s, limit {limit:g} s)")
            start = time.perf_counter()
            try:
                with time_limit(limit), fused_attention(kit.args.device):
                    status, note = phase.run(kit)
            except (Stopped, KeyboardInterrupt):
                row.update(status="interrupted", seconds=round(time.perf_counter() - start, 1))
                raise
            except PhaseOverrun:
                status, note = "timeout", f"stopped at its limit of {limit:g} s (--phase_limit_s)"
            except Exception as error:  # a phase that fails is a row of the report, not the end of the kit
                status, note = "error", one_line(error)
            row.update(status=status, seconds=round(time.perf_counter() - start, 1), note=note)
            if status == "timeout":  # here, not in the except block: there the exception still holds its frames
                release_after_overrun(kit)
            done |= {phase.name} if status == "ok" else set()
        kit.progress(f"{phase.name}: {row['status']}" + (f" in {row['seconds']:.0f} s" if "seconds" in row else "")
                     + (f" ({row['note']})" if row.get("note") else ""))
        write_outputs(kit)


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"


def write_outputs(kit: Kit) -> None:
    """The JSON and the table, each replaced whole: a kill at any time leaves the last complete ones."""
    kit.report["seconds"] = round(time.perf_counter() - kit.started, 1)
    for path, text in ((kit.args.out, json.dumps(kit.report, indent=2)), (kit.path(".md"), report_table(kit.report))):
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------------------- smoke

def write_smoke_models(kit: Kit) -> tuple[str, str]:
    """The smoke runs' student and teacher folders; the note says how fast this disk took them (fsync included:
    what every smoke run's save will cost, DISK_BYTES_PER_S in the estimates)."""
    paths, writing = [], 0.0
    for name, sizes, seed in (("student", SHAPES[kit.args.shape][0], 0), ("teacher", SHAPES[kit.args.shape][1], 1)):
        model = create_model(model_config(sizes, SMOKE_LAYERS), seed=seed)
        paths.append(os.path.join(kit.folder, name))
        start = time.perf_counter()
        save_pretrained(model, paths[-1])
        writing += time.perf_counter() - start
    written = sum(os.path.getsize(os.path.join(path, name)) for path in paths for name in os.listdir(path))
    kit.smoke_models = (paths[0], paths[1])
    kit.report["disk_write_bytes_per_s"] = written / writing
    return "ok", f"{written / 2**30:.2f} GiB written at {written / writing / 1e9:.2f} GB/s"


def smoke(kit: Kit, groups: list[list[SmokeRun]]) -> tuple[str, str]:
    """Each loop's main() in this process (imports and CUDA set-up once); each group of runs in a folder of its
    own, removed when the group ends. The loops' console output goes to the log beside --out."""
    from trainer.train_distillation import main as train_distillation
    from trainer.train_opd import main as train_opd
    from trainer.train_sft import main as train_sft
    student, teacher = kit.smoke_models
    loops = {"sft": (train_sft, ["--model_path", student]),
             "kd": (train_distillation, ["--model_path", student, "--teacher_path", teacher]),
             "opd": (train_opd, ["--model_path", student, "--teacher_path", teacher, "--max_new_tokens", "16"])}
    records = []
    for group in groups:
        folder = os.path.join(kit.folder, group[0].name)
        try:
            for run in group:
                main, models = loops[run.loop]
                # --save_interval past the last step: only the last step saves (the loops always save it)
                argv = [*models, *run.flags, "--device", kit.args.device, "--save_dir", folder, "--save_weight",
                        run.name, "--batch_size", "2", "--max_length", "384", "--max_prompt_length", "128",
                        "--log_interval", "1", "--save_interval", str(run.max_steps + 1), "--max_steps",
                        str(run.max_steps), *(RESUME_FLAGS if run.resumes else [])]
                records.append(run_loop(kit, main, argv, folder, run))
                write_outputs(kit)  # the compiled runs are long: what ran before one stays if it is killed
                kit.progress(f"  {run.loop} {run.variant}: {'ok' if records[-1]['ok'] else 'FAILED'} "
                             f"({records[-1]['seconds']:.0f} s)")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    failed = [r for r in records if not r["ok"]]
    return ("failed", f"{len(failed)} of {len(records)} runs failed") if failed else ("ok", f"{len(records)} runs")


def run_loop(kit: Kit, main, argv: list[str], folder: str, run: SmokeRun) -> dict:
    """One loop's run -> its record, in the report from the start: a run the kit stops says so in its row."""
    start = time.perf_counter()
    record = {"loop": run.loop, "variant": run.variant, "ok": False}
    kit.report["smoke"].append(record)
    try:
        with open(kit.path(".log"), "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            print(f"\n=== {run.loop} {run.variant}: {' '.join(argv)}", flush=True)
            main(argv)
    except BaseException as error:  # a failed run is a row of the report, not the end of the check
        record.update(error=one_line(error), seconds=time.perf_counter() - start)
        if isinstance(error, (Stopped, KeyboardInterrupt, PhaseOverrun)):  # the kit's own stops end the phase
            raise
        return record
    with open(os.path.join(folder, f"{run.name}_metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    record.update(ok=all(math.isfinite(x) for x in losses), last_loss=losses[-1], steps=len(losses),
                  seconds=time.perf_counter() - start)
    return record


# ---------------------------------------------------------------------------------------------- the full shapes

def build_full_models(kit: Kit) -> tuple[str, str]:
    """Student (fp32 master weights) and teacher (bf16 on CUDA) of the full shapes, on the device, for every later
    phase; nothing written to disk."""
    device = kit.args.device
    student_sizes, teacher_sizes = SHAPES[kit.args.shape]
    student = create_model(model_config(student_sizes), seed=0, device=device).train()
    teacher = create_model(model_config(teacher_sizes), seed=1, dtype=teacher_dtype(device),
                           device=device).eval().requires_grad_(False)
    kit.full_models = (student, teacher)
    return "ok", f"{student.num_parameters() / 1e6:,.0f}M + {teacher.num_parameters() / 1e6:,.0f}M parameters"


def teacher_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def sft_batch(shape: str, device: str, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random real-vocabulary tokens, labels on the last `completion` positions of each row."""
    batch, length, completion = WORKLOAD[shape]["sft"]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (rows or batch, length), generator=generator).to(device)
    labels = ids.clone()
    labels[:, :length - completion] = -100
    return ids, labels


def timed_steps(shape: str, device: str, step, steps: int | None = None) -> float:
    """Seconds per call of `step`, after the workload's warm-up."""
    workload = WORKLOAD[shape]
    return harness.seconds_per_call(step, device, workload["warmup"], steps or workload["steps"])


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


@contextlib.contextmanager
def compiled_layers(model: Qwen3ForCausalLM, compiled: bool):
    """The loops' --use_compile for one phase: each decoder layer compiled in place (compile_layers), then given its
    eager forward back, so that the later phases run what they ran before. Dynamo keeps the graphs: the next phase
    that compiles the same layers at the same shapes (the KD step after the SFT step) reuses them."""
    if compiled:
        model.compile_layers()
    try:
        yield
    finally:
        for layer in model.model.layers:
            layer.compiled_block = None


def step_throughput(kit: Kit, loss: str) -> tuple[str, str]:
    """An SFT or KD step at the workload's shape, with the decoder layers compiled or not (--use_compile): the first
    step's seconds on their own (the compile's, with compiled layers), then tokens/s, MFU, peak memory (its AdamW
    state included)."""
    device, shape = kit.args.device, kit.args.shape
    student, teacher = kit.full_models
    optimizer = make_optimizer(student, SimpleNamespace(learning_rate=1e-5, weight_decay=0.0))  # the loops' AdamW
    ids, labels = sft_batch(shape, device)
    mask = torch.ones_like(ids)

    def step():
        if loss == "kd":
            with torch.no_grad(), resolve_precision(device, "bfloat16").autocast():
                teacher_hidden, _ = completion_hidden(teacher, ids, mask, labels)
        with resolve_precision(device, "bfloat16").autocast():
            hidden, targets = completion_hidden(student, ids, mask, labels)
            if loss == "kd":  # the loops' fused losses, train_distillation.py's default --alpha
                loss_sum, tokens, _, _ = fused_kd_loss(hidden, student.lm_head.weight, teacher_hidden,
                                                       teacher.lm_head.weight, targets, alpha=0.5, vocab_size=VOCAB)
            else:
                loss_sum, tokens = fused_cross_entropy(hidden, student.lm_head.weight, targets, vocab_size=VOCAB)
        (loss_sum / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model_flops, computed_flops = step_flops(student.config, teacher.config if loss == "kd" else None, ids, labels)
    static = static_memory(student, teacher if loss == "kd" else None)
    compiled = bool(kit.args.use_compile)
    with compiled_layers(student, compiled):
        first_s = timed_call(device, step)
        reset_peak(device)
        seconds = timed_steps(shape, device, step)
    tokens_per_s = ids.numel() / seconds
    peak_tflops = gpu_peak_tflops(kit.args)
    peak = peak_gib(device)
    kit.report["throughput"][loss] = {
        "compiled_layers": compiled, "first_step_s": first_s,
        "tokens_per_s": tokens_per_s, "step_s": seconds, "flops_per_token": model_flops / ids.numel(),
        "computed_flops_per_token": computed_flops / ids.numel(),
        "mfu": model_flops / seconds / (peak_tflops * 1e12) if peak_tflops else None,
        "computed_mfu": computed_flops / seconds / (peak_tflops * 1e12) if peak_tflops else None,
        "peak_memory_gib": peak, "memory_gib": {**static, "activations and loss": peak - sum(static.values())
                                                if peak is not None else None}}
    layers = f"compiled layers, first step {first_s:.1f} s (their compile)" if compiled else "eager layers"
    return "ok", f"{tokens_per_s:,.0f} tokens/s; {layers}"


def step_flops(student, teacher, ids: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """One training step's model FLOPs as torchtitan counts them (6 N + 12 L H d T per token, attention over every
    pair), with the head on the labelled positions only -- what the loss projects -- and the FLOPs the step actually
    computes (causal attention: half the pairs). KD adds the teacher's forward over the batch, its head on the same
    positions."""
    rows, length = ids.shape
    labelled = int((labels[:, 1:] != -100).sum()) / rows  # the positions whose next token is a label, per row
    counts = []
    for causal in (False, True):
        flops = roofline.sequence_flops(student, length, labelled, VOCAB, causal)
        if teacher is not None:
            flops += roofline.sequence_flops(teacher, length, labelled, VOCAB, causal, backward=False)
        counts.append(rows * flops)
    return counts[0], counts[1]


def static_memory(student, teacher) -> dict[str, float]:
    """GiB the step holds before any activation, from the shapes: the fp32 master weights, their gradients and
    AdamW's two moments (4 + 4 + 8 bytes per parameter), and a KD teacher's weights in its own dtype."""
    parameters = student.num_parameters()
    memory = {"weights": 4 * parameters / 2**30, "gradients": 4 * parameters / 2**30,
              "optimizer": 8 * parameters / 2**30}
    if teacher is not None:
        memory["teacher"] = sum(p.numel() * p.element_size() for p in teacher.parameters()) / 2**30
    return memory


def bf16_agrees_with_fp32(kit: Kit) -> tuple[str, str]:
    """The first SFT loss of one row in bf16 autocast and in fp32, same weights. The phase runs on the fused kernels
    (run_phases); a dtype whose attention none of them takes (on CUDA flash and cuDNN refuse fp32, and the
    memory-efficient kernel refuses a grouped-query form) runs again with the math kernel allowed, and the row
    names it: the comparison is of the numerics, which a missing kernel must not hide."""
    student = kit.full_models[0]
    device = kit.args.device
    ids, labels = sft_batch(kit.args.shape, device, 1)

    def first_loss(dtype: str) -> float:
        with torch.no_grad(), resolve_precision(device, dtype).autocast():
            hidden, targets = completion_hidden(student, ids, torch.ones_like(ids), labels)
            loss_sum, tokens = fused_cross_entropy(hidden, student.lm_head.weight, targets, vocab_size=VOCAB)
        return float(loss_sum) / int(tokens)

    losses, math_kernel = {}, []
    for dtype in ("bfloat16", "float32"):
        losses[dtype], needed_math = on_fused_kernels_or_math(lambda: first_loss(dtype))
        math_kernel += [dtype] if needed_math else []
    relative = abs(losses["bfloat16"] - losses["float32"]) / abs(losses["float32"])
    ok = relative <= BF16_TOLERANCE
    kit.report["bf16_vs_fp32"] = {**losses, "relative_difference": relative, "tolerance": BF16_TOLERANCE, "ok": ok,
                                  "math_kernel": math_kernel}
    unfused = f"; {' and '.join(math_kernel)} on the math kernel (no fused kernel took its attention)" \
        if math_kernel else ""
    return ("ok" if ok else "failed"), f"relative difference {relative:.2e}{unfused}"


def on_fused_kernels_or_math(compute: Callable[[], float]) -> tuple[float, bool]:
    """compute() with the attention kernels the phase allows; when SDPA finds none for an attention, compute() again
    with the math kernel allowed too -> (its result, whether it needed the math kernel)."""
    try:
        return compute(), False
    except RuntimeError as error:
        if not any(message in str(error) for message in NO_KERNEL):
            raise
    with sdpa_kernel(EVERY_ATTENTION):
        return compute(), True


def opd_prompts(tokenizer, batch_size: int, device: str) -> dict:
    return harness.prompt_batch(tokenizer, harness.demo_rows("opd_prompts", range(batch_size)), device)


def opd_split(kit: Kit) -> tuple[str, str]:
    """One OPD step by phase (bench_opd.opd_step), after the workload's warm-up."""
    device = kit.args.device
    batch_size, new_tokens = WORKLOAD[kit.args.shape]["opd"]
    opts = SimpleNamespace(device=device, dtype="bfloat16", decode="auto", seed=0, max_new_tokens=new_tokens,
                           gen_temperature=1.0, top_k=0, top_p=1.0, beta=1.0, temperature=1.0, loss_chunk_size=512,
                           batch_size=batch_size)
    student, teacher = kit.full_models
    optimizer = make_optimizer(student, SimpleNamespace(learning_rate=1e-6, weight_decay=0.0))
    tokenizer = load_tokenizer(None)
    batch = opd_prompts(tokenizer, batch_size, device)
    for _ in range(WORKLOAD[kit.args.shape]["warmup"]):
        opd_step(opts, student, teacher, optimizer, tokenizer, batch, 0)
    reset_peak(device)
    phases, stats = opd_step(opts, student, teacher, optimizer, tokenizer, batch, 1)
    rate = stats["generated_tokens"] / (phases["generation"] / 1000.0)
    # each phase against its roofline from the GPU's peak (benchmarks/roofline.py): its multiple is 1 / its MFU
    _, roof = measured_roofline(opts, student.config, teacher.config, len(tokenizer), {**stats, "phases_ms": phases})
    kit.report["opd"] = {"phases_ms": phases, "generated_tokens": stats["generated_tokens"],
                         "generation_tokens_per_s": rate, "peak_memory_gib": peak_gib(device), "roofline": roof}
    multiples = ", ".join(f"{phase} {p['multiple']:.1f}x" for phase, p in roof["phases"].items())
    return "ok", f"generation {rate:,.0f} tokens/s; x roofline: {multiples}"


def generation(kit: Kit) -> tuple[str, str]:
    """Sampled rollouts of the student's current weights in bf16 autocast, every row its full length (no EOS), with
    the decode step the loops take by default on this device (--decode auto: compiled on CUDA, eager on a CPU), at
    each of the workload's sizes after one rollout of warm-up (the compiled step's capture): tokens/s and the
    multiple of generation's roofline for the same work."""
    device, shape = kit.args.device, kit.args.shape
    student = kit.full_models[0].eval()
    tokenizer = load_tokenizer(None)
    fresh_compile_state()
    decoder = Decoder(compiled=device.startswith("cuda"))
    rates = device_rates(kit)
    weight_bytes = resolve_precision(device, "bfloat16").compute.itemsize
    sizes = {}
    try:
        for batch_size, new_tokens in WORKLOAD[shape]["generation"]:
            batch = opd_prompts(tokenizer, batch_size, device)
            ids, mask = batch["prompt_ids"], batch["prompt_attention_mask"]

            def rollout():
                with resolve_precision(device, "bfloat16").autocast():
                    generate(student, ids, mask, new_tokens, generator=torch.Generator(device).manual_seed(0),
                             vocab_size=VOCAB, decoder=decoder)
            seconds = timed_steps(shape, device, rollout, 1)
            roof = generation_roofline(student.config, batch_size, int(mask.sum()), new_tokens, seconds, rates,
                                       weight_bytes)
            sizes[f"{batch_size} x {new_tokens}"] = {"rows": batch_size, "new_tokens": new_tokens, "seconds": seconds,
                                                     "tokens_per_s": batch_size * new_tokens / seconds, **roof}
            kit.report["generation"] = {"decode": "compiled" if decoder.compiled else "eager", "rates": vars(rates),
                                        "sizes": sizes}  # each size as it is measured: a stop keeps the first
    finally:  # however the phase ends (stopped at its limit too), the student is left in training mode
        student.train()
    return "ok", "; ".join(f"{name}: {g['tokens_per_s']:,.0f} tokens/s, {g['multiple']:.1f}x roofline"
                           for name, g in sizes.items())


def fresh_compile_state() -> None:
    """Dynamo forgets the graphs it compiled before: it keeps them per function for the whole process and compiles
    no 9th (its recompile limit, past which the step runs eagerly), and every compiled decode step of the kit counts
    against decode_step's (the smoke OPD runs' on CUDA too). Inductor's cache on disk still spares recompilation."""
    torch._dynamo.reset()


def device_rates(kit: Kit) -> roofline.Rates:
    """The rates of the roofline: those the OPD split measured, or measured now (a few seconds)."""
    measured = kit.report.get("opd", {}).get("roofline", {}).get("rates")
    if measured:
        return roofline.Rates(**measured)
    return roofline.measure_rates(kit.args.device, resolve_precision(kit.args.device, "bfloat16").compute, VOCAB)


def generation_roofline(config: Qwen3Config, rows: int, prompt_tokens: int, new_tokens: int, seconds: float,
                        rates: roofline.Rates, weight_bytes: int) -> dict:
    """A rollout of `rows` rows and `new_tokens` steps (`prompt_tokens` real prompt tokens in all) that took
    `seconds`, against its roofline (roofline.opd_work's generation: the prefill, then per step the layers and the
    head for every row, the sampling softmax, the weights and the KV cache read) -> the bound and the multiple."""
    work = roofline.opd_work(config, config, VOCAB, rows, prompt_tokens, rows * new_tokens, new_tokens,
                             roofline.exps_per_logit(1.0), weight_bytes=weight_bytes)["generation"]
    bound = work.seconds(rates)
    return {"bound_s": bound, "multiple": seconds / bound}


def decode_compiled(kit: Kit) -> tuple[str, str]:
    """Greedy, every row `new_tokens` long (no EOS), the student's current weights in bf16 autocast: tokens/s of
    the eager decode step and of the compiled one after one call of warm-up each (the compiled one's first call,
    compilation and CUDA-graph capture, timed on its own), the share of identical tokens (bf16 near-ties may
    differ), and inductor's count of skipped CUDA graphs (0: every step replayed one). Then one more rollout of each
    under torch.cuda.set_sync_debug_mode("warn"): the syncs inside its decode steps (the target is none; the row
    fails otherwise) and in the whole rollout (the prefill's, the STOP_CHECK reads, the end's). And each rollout's
    tokens teacher-forced through the eager forward (`picks_against_forward`): a compiled step that computed
    something else than the model would pick tokens far below the forward's argmax."""
    from torch._dynamo.utils import counters
    device, shape = kit.args.device, kit.args.shape
    batch_size, new_tokens = WORKLOAD[shape]["decode"]
    student = kit.full_models[0].eval()
    batch = opd_prompts(load_tokenizer(None), batch_size, device)
    fresh_compile_state()
    decoders = {"eager": SyncCountingDecoder(), "compiled": SyncCountingDecoder(compiled=True)}
    skips_before = counters["inductor"]["cudagraph_skips"]
    outputs = {}

    def run(name: str):
        with resolve_precision(device, "bfloat16").autocast():
            outputs[name] = generate(student, batch["prompt_ids"], batch["prompt_attention_mask"], new_tokens,
                                     do_sample=False, decoder=decoders[name]).completion_ids
    try:
        start = time.perf_counter()
        run("compiled")
        harness.synchronize(device)
        first_s = time.perf_counter() - start
        seconds = {name: timed_steps(shape, device, lambda: run(name), 1) for name in ("eager", "compiled")}
        syncs = {}
        for name in ("eager", "compiled"):
            with sync_warnings(device, decoders[name]) as syncs[name]:
                run(name)
        picks = {name: picks_against_forward(student, batch, outputs[name], device) for name in outputs}
    finally:  # however the phase ends (stopped at its limit too), the student is left in training mode
        student.train()
    tokens = batch_size * new_tokens
    rates = {name: tokens / s for name, s in seconds.items()}
    same = (outputs["eager"] == outputs["compiled"]).float().mean().item()
    skips = counters["inductor"]["cudagraph_skips"] - skips_before
    kit.report["decode"] = {"tokens_per_s": rates, "compiled_over_eager": rates["compiled"] / rates["eager"],
                            "first_compiled_call_s": first_s, "identical_tokens": same, "cudagraph_skips": skips,
                            "syncs": syncs, "picks_against_forward": picks}
    in_steps = sum(s["in_steps"] for s in syncs.values())
    seen = (f"syncs inside decode steps: eager {syncs['eager']['in_steps']}, compiled "
            f"{syncs['compiled']['in_steps']} (rollout {syncs['eager']['rollout']} / {syncs['compiled']['rollout']})"
            if device.startswith("cuda") else "syncs: not on CUDA")
    return ("ok" if in_steps == 0 else "failed"), (
        f"compiled {rates['compiled']:,.0f} vs eager {rates['eager']:,.0f} tokens/s "
        f"({rates['compiled'] / rates['eager']:.2f}x), first call {first_s:.0f} s; {seen}; compiled picks the "
        f"forward's argmax {picks['compiled']['argmax_share']:.1%} (max shortfall "
        f"{picks['compiled']['max_shortfall']:.2g} nats; eager's {picks['eager']['argmax_share']:.1%}, "
        f"{picks['eager']['max_shortfall']:.2g})")


class SyncCountingDecoder(Decoder):
    """A Decoder that tells which of a rollout's sync warnings its decode steps raised: inside `sync_warnings`,
    `in_steps` counts them and `sites` names the lines they came from (elsewhere it is the Decoder it extends)."""

    def __init__(self, compiled: bool = False):
        super().__init__(compiled)
        self.caught: list | None = None  # sync_warnings' record while it watches
        self.in_steps, self.sites = 0, {}

    def __call__(self, *args, **kwargs):
        before = len(self.caught) if self.caught is not None else 0
        result = super().__call__(*args, **kwargs)
        if self.caught is not None:
            for warning in self.caught[before:]:
                if SYNC_WARNING in str(warning.message):
                    self.in_steps += 1
                    site = f"{os.path.relpath(warning.filename, ROOT)}:{warning.lineno}"
                    self.sites[site] = self.sites.get(site, 0) + 1
        return result


@contextlib.contextmanager
def sync_warnings(device: str, decoder: SyncCountingDecoder):
    """The block with every device sync raising a warning (torch.cuda.set_sync_debug_mode("warn"): a host read of a
    CUDA tensor, a blocking copy...) -> a dict filled when it ends: "rollout", all the block's syncs; "in_steps",
    those `decoder`'s decode steps raised; "sites", where those came from. On a CPU there is no device to wait for
    and no mode to set: what the block warns is counted as it is (the CPU tests warn on purpose)."""
    cuda = device.startswith("cuda")
    counts: dict = {}
    previous = torch.cuda.get_sync_debug_mode() if cuda else 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # each sync, not the first per line
        decoder.caught, decoder.in_steps, decoder.sites = caught, 0, {}
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(previous)
            decoder.caught = None
    counts.update(rollout=sum(SYNC_WARNING in str(w.message) for w in caught), in_steps=decoder.in_steps,
                  sites=decoder.sites)


@torch.no_grad()
def picks_against_forward(model: Qwen3ForCausalLM, batch: dict, completion_ids: torch.Tensor, device: str,
                          rows_at_once: int = 8) -> dict:
    """The prompts and a greedy rollout's tokens through the model's eager forward in bf16 autocast (teacher
    forcing): at each completion position, whether the token the rollout picked is the forward's argmax, and its
    shortfall, log p(argmax) - log p(pick) in nats (0 when it is the argmax; a bf16 near-tie otherwise). A few rows
    at a time: a chunk's fp32 logits are rows x tokens x 151,936 x 4 bytes."""
    ids = torch.cat([batch["prompt_ids"], completion_ids], dim=1)
    mask = torch.cat([batch["prompt_attention_mask"], torch.ones_like(completion_ids)], dim=1)
    prompt = batch["prompt_ids"].shape[1]
    shortfalls = []
    for rows in range(0, len(ids), rows_at_once):
        chunk = slice(rows, rows + rows_at_once)
        with resolve_precision(device, "bfloat16").autocast():
            hidden = model(ids[chunk], attention_mask=mask[chunk], return_hidden=True).hidden_states
            logits = model.lm_head(hidden[:, prompt - 1:-1])
        log_probs = logits.float().log_softmax(dim=-1)
        picked = log_probs.gather(-1, completion_ids[chunk, :, None]).squeeze(-1)
        shortfalls.append(log_probs.max(dim=-1).values - picked)
    shortfall = torch.cat(shortfalls)
    return {"argmax_share": (shortfall == 0).float().mean().item(), "max_shortfall": shortfall.max().item(),
            "mean_shortfall": shortfall.mean().item()}


def generate_against_transformers(kit: Kit) -> tuple[str, str]:
    """Greedy, every row exactly as long (no EOS), bf16 on CUDA, the student's current weights: a call of each with
    GENERATE_PROBE_TOKENS new tokens (their warm-up) measures a step of both, then one timed call of each with the
    most tokens that fit in GENERATE_TIMED_S (`fitted_new_tokens`): tokens/s of each and transformers' seconds over
    ours. The folder both load from is removed after."""
    try:
        import transformers  # benchmarks only; the project never imports it
    except ImportError:
        return "skipped", "transformers is not installed"
    device, shape = kit.args.device, kit.args.shape
    batch_size, most_tokens = WORKLOAD[shape]["transformers"]
    dtype = teacher_dtype(device)
    folder = os.path.join(kit.folder, "generate")
    try:
        save_pretrained(kit.full_models[0], folder, dtype=dtype)
        ours = load_pretrained(folder, dtype=dtype, device=device).eval()
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    batch = opd_prompts(load_tokenizer(None), batch_size, device)
    ids, mask = batch["prompt_ids"], batch["prompt_attention_mask"]

    def run_ours(new_tokens: int):  # the eager decode step: neither side compiles
        generate(ours, ids, mask, new_tokens, do_sample=False)

    def run_theirs(new_tokens: int):
        with torch.no_grad():
            theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=0)
    runs = {"ours": run_ours, "transformers": run_theirs}
    probe = min(GENERATE_PROBE_TOKENS, most_tokens)
    probe_s = sum(timed_call(device, lambda: run(probe)) for run in runs.values())
    new_tokens = fitted_new_tokens(probe_s / probe, GENERATE_TIMED_S[shape], most_tokens, probe)
    seconds = {name: timed_call(device, lambda: run(new_tokens)) for name, run in runs.items()}
    ratio = seconds["transformers"] / seconds["ours"]
    kit.report["generate_vs_transformers"] = {
        **seconds, "transformers_over_ours": ratio, "rows": batch_size, "new_tokens": new_tokens,
        "tokens_per_s": {name: batch_size * new_tokens / s for name, s in seconds.items()},
        "transformers_version": transformers.__version__}
    return "ok", f"transformers / ours {ratio:.2f}x ({batch_size} x {new_tokens} tokens)"


def timed_call(device: str, call: Callable[[], object]) -> float:
    """Seconds of one call, the device's queue drained before and after."""
    harness.synchronize(device)
    start = time.perf_counter()
    call()
    harness.synchronize(device)
    return time.perf_counter() - start


def fitted_new_tokens(seconds_per_token: float, seconds: float, most: int, step: int) -> int:
    """The most new tokens, a multiple of `step` between `step` and `most`, whose calls take at most `seconds` at
    `seconds_per_token` (a token of every call: measured with the prefill and a first call's costs in it, so the
    calls take less)."""
    fitting = int(seconds / seconds_per_token) // step * step if seconds_per_token > 0 else most
    return max(step, min(most, fitting))


def sync_python(args: argparse.Namespace) -> str | None:
    """The Python the weight-sync phase starts vLLM with: --vllm_python; without it, on CUDA, this one when it has
    vllm (find_spec: without importing it). No other is looked for: the environment serving/setup_vllm_cpu.sh makes
    is a CPU build, and on the CPU benchmarks/bench_sync.py has measured the criterion."""
    if args.vllm_python or not args.device.startswith("cuda"):
        return args.vllm_python
    return sys.executable if importlib.util.find_spec("vllm") else None


def weight_sync(kit: Kit) -> tuple[str, str]:
    """serving/weight_sync.py's bf16 criterion on this device: a bf16 vLLM server starts from the full student's
    weights, a copy with its norms drawn around 1 is pushed into it (WeightSync.push, the loops' own), and |d log p|
    over the probe, max and mean, is recorded next to the tolerance: against that copy under bf16 autocast (the
    correct sync, which must pass: the row's status) and against the copy after one more AdamW step (a missed step,
    shown caught or not: it moved bench_sync.py's models by 6.9e-3 on average at 2 layers, 5e-2 at 28, and the
    tiny shapes' by less than the tolerance). Without a vLLM to start: skipped, saying how to enable it."""
    python = sync_python(kit.args)
    if python is None:
        if kit.args.device.startswith("cuda"):
            note = "needs vLLM in this Python environment, or --vllm_python (a Python with vLLM)"
        else:
            note = ("on the CPU only with --vllm_python (a Python with vLLM; benchmarks/bench_sync.py measured the "
                    "criterion on CPU servers)")
        kit.report["weight_sync"] = {"skipped": note}
        return "skipped", note
    device = kit.args.device
    tokenizer = load_tokenizer(None)
    probe = probe_token_ids(tokenizer)
    folder = os.path.join(kit.folder, "sync")
    model = copy.deepcopy(kit.full_models[0])
    try:
        save_pretrained(model, os.path.join(folder, "served"), dtype=torch.bfloat16)
        bench_sync.norms_around_one(model, seed=0)  # and so the pushed weights differ from those the server starts with
        served = served_after_push(kit, python, folder, model, probe)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    batch = {key: value.to(device) for key, value in bench_sync.sft_batch(tokenizer).items()}
    missed = bench_sync.stepped(model, batch, SYNC_LR)
    autocast = resolve_precision(device, "bfloat16").autocast
    stats = {"correct_sync": sync_statistics(served, own_logprobs(model, probe, autocast)),
             "missed_step": sync_statistics(served, own_logprobs(missed, probe, autocast))}
    tolerance = TOLERANCE[torch.bfloat16]
    for case in stats.values():
        case["passes"] = within(case, tolerance)
    kit.report["weight_sync"] = {"server": f"vLLM, bf16, on {device}", "probe_tokens": len(probe) - 1,
                                 "tolerance": {"mean": tolerance.mean, "max": tolerance.max}, **stats}
    correct, missed_step = stats["correct_sync"], stats["missed_step"]
    return ("ok" if correct["passes"] else "failed"), (
        f"|d log p| mean / max: correct sync {correct['mean']:.1e} / {correct['max']:.1e} "
        f"{'passes' if correct['passes'] else 'FAILS'}, 1 step missed {missed_step['mean']:.1e} / "
        f"{missed_step['max']:.1e} {'NOT caught' if missed_step['passes'] else 'caught'} (tolerance "
        f"{tolerance.mean:g} / {tolerance.max:g})")


def served_after_push(kit: Kit, python: str, folder: str, model: torch.nn.Module, probe: list[int]) -> torch.Tensor:
    """A bf16 vLLM server started from `folder`/served, `model` pushed into it (WeightSync.push, the loops' own) ->
    the server's log-probs of the probe. The server's log goes beside --out (.vllm.log); it is stopped however this
    ends."""
    device = kit.args.device
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the server takes its share (SYNC_SERVER_FLAGS) of what is free on the GPU
    port, log = free_port(), kit.path(".vllm.log")
    process, server = None, None
    try:
        process = start_vllm(vllm_command(python, os.path.join(folder, "served"), "student", port, "bfloat16",
                                          extra=SYNC_SERVER_FLAGS[torch.device(device).type]), log)
        wait_ready(process, port, log)
        server = CompletionServer(f"http://127.0.0.1:{port}/v1", "student", what="weight-sync server")
        WeightSync(server, os.path.join(folder, "push", "model.safetensors"), probe, torch.bfloat16).push(model, 0)
        return server.prompt_logprobs([probe])[0]
    finally:
        if server is not None:
            server.close()
        if process is not None:
            stop_vllm(process)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------------------------------------- report

def gpu_peak_tflops(args) -> float | None:
    if args.peak_tflops or not args.device.startswith("cuda"):
        return args.peak_tflops
    name = torch.cuda.get_device_name()
    return peak_bf16_tflops(name)


def report_table(report: dict) -> str:
    """The report as markdown: the phases, then what each measured (only what ran)."""
    lines = [f"{report['device_name']} | torch {report['torch']} | shapes {report['shape']} | budget "
             f"{report['budget_s']:.0f} s | {report['seconds']:.0f} s so far", "",
             "| phase | status | estimate s | limit s | seconds | note |", "|---|---|---|---|---|---|"]
    for p in report["phases"]:
        limit = f"{p['limit_s']:g}" if "limit_s" in p else "-"
        seconds = f"{p['seconds']:.0f}" if "seconds" in p else "-"
        lines.append(f"| {p['name']} | {p['status']} | {p['estimate_s']:.0f} | {limit} | {seconds} | "
                     f"{p.get('note', '')} |")
    if report["smoke"]:
        lines += ["", "| smoke run | ok | last loss | seconds |", "|---|---|---|---|"]
        for r in report["smoke"]:
            ok = "yes" if r["ok"] else "NO: " + r.get("error", "non-finite loss")
            lines.append(f"| {r['loop']} {r['variant']} | {ok} | {r.get('last_loss', float('nan')):.4f} | "
                         f"{r['seconds']:.0f} |")
    if report["throughput"]:
        batch, length, _ = WORKLOAD[report["shape"]]["sft"]
        lines += ["", f"| step ({batch} x {length} tokens, bf16 autocast) | layers | first step s | tokens/s | "
                      f"MFU (model FLOPs) | computed FLOPs / peak | peak memory GiB | of which weights / gradients / "
                      f"AdamW / teacher / activations and loss |", "|---|---|---|---|---|---|---|---|"]
        for name, t in report["throughput"].items():
            mfu, computed = (f"{100 * t[key]:.1f}%" if t[key] is not None else "-" for key in ("mfu", "computed_mfu"))
            memory = f"{t['peak_memory_gib']:.1f}" if t["peak_memory_gib"] is not None else "-"
            parts = " / ".join(f"{t['memory_gib'].get(part):.1f}" if t["memory_gib"].get(part) is not None else "-"
                               for part in ("weights", "gradients", "optimizer", "teacher", "activations and loss"))
            layers = "compiled" if t["compiled_layers"] else "eager"
            lines.append(f"| {name.upper()} | {layers} | {t['first_step_s']:.1f} | {t['tokens_per_s']:,.0f} | {mfu} | "
                         f"{computed} | {memory} | {parts} |")
    if "bf16_vs_fp32" in report:
        b = report["bf16_vs_fp32"]
        unfused = f"; {' and '.join(b['math_kernel'])} on the math kernel (no fused kernel)" if b["math_kernel"] else ""
        lines += ["", f"bf16 vs fp32 first SFT loss: {b['bfloat16']:.4f} vs {b['float32']:.4f}, relative difference "
                      f"{b['relative_difference']:.2e} (tolerance {b['tolerance']}): {'ok' if b['ok'] else 'NOT OK'}"
                      f"{unfused}"]
    if "opd" in report:
        o = report["opd"]
        batch, new_tokens = WORKLOAD[report["shape"]]["opd"]
        lines += ["", f"OPD step ({batch} prompts x {new_tokens} new tokens): " + ", ".join(
            f"{phase} {ms:.0f} ms" for phase, ms in o["phases_ms"].items())
            + f"; generation {o['generation_tokens_per_s']:,.0f} tokens/s" + opd_target(report)]
    if "generation" in report:
        g = report["generation"]
        lines += ["", f"| generation ({g['decode']} decode step, sampled, bf16) | tokens/s | seconds | roofline s | "
                      f"x roofline | target |", "|---|---|---|---|---|---|"]
        for name, size in g["sizes"].items():
            lines.append(f"| {name} | {size['tokens_per_s']:,.0f} | {size['seconds']:.2f} | {size['bound_s']:.3f} | "
                         f"{size['multiple']:.1f}x | {generation_target(report, size)} |")
    if "decode" in report:
        d = report["decode"]
        batch, new_tokens = WORKLOAD[report["shape"]]["decode"]
        rates = d["tokens_per_s"]
        lines += ["", f"greedy decode ({batch} x {new_tokens} tokens, bf16): compiled {rates['compiled']:,.0f} "
                      f"tokens/s, eager {rates['eager']:,.0f} ({d['compiled_over_eager']:.2f}x); first compiled call "
                      f"{d['first_compiled_call_s']:.1f} s; identical tokens {d['identical_tokens']:.1%}; CUDA graphs "
                      f"skipped {d['cudagraph_skips']}"]
        for name in ("eager", "compiled"):
            syncs, picks = d["syncs"][name], d["picks_against_forward"][name]
            sites = ", ".join(f"{site} x{n}" for site, n in syncs["sites"].items())
            lines.append(f"- {name} step: syncs inside the decode steps {syncs['in_steps']}"
                         f"{' (' + sites + ')' if sites else ''}, in the whole rollout {syncs['rollout']}; its "
                         f"tokens teacher-forced through the eager forward: the argmax at {picks['argmax_share']:.1%} "
                         f"of positions, shortfall max {picks['max_shortfall']:.3g} / mean "
                         f"{picks['mean_shortfall']:.2g} nats")
    if "correct_sync" in report.get("weight_sync", {}):
        w = report["weight_sync"]
        cells = {case: f"{w[case]['mean']:.2e} / {w[case]['max']:.2e} ({'passes' if w[case]['passes'] else 'fails'})"
                 for case in ("correct_sync", "missed_step")}  # the correct one must pass, the missed one should fail
        lines += ["", f"bf16 weight sync ({w['server']}; |d log p| over {w['probe_tokens']} probe tokens, mean / max; "
                      f"tolerance {w['tolerance']['mean']:g} / {w['tolerance']['max']:g}): correct sync "
                      f"{cells['correct_sync']}, one AdamW step missed {cells['missed_step']}"]
    if "generate_vs_transformers" in report:
        g = report["generate_vs_transformers"]
        lines += ["", f"greedy generate, same weights, {g['rows']} x {g['new_tokens']} tokens: ours {g['ours']:.2f} s "
                      f"({g['tokens_per_s']['ours']:,.0f} tokens/s), transformers {g['transformers']:.2f} s "
                      f"({g['tokens_per_s']['transformers']:,.0f} tokens/s): {g['transformers_over_ours']:.2f}x"]
    return "\n".join(lines) + "\n"


def generation_target(report: dict, size: dict) -> str:
    """The generation target of this size (TARGETS, full shapes only), met or missed, or "-"."""
    target = TARGETS["generation"].get((size["rows"], size["new_tokens"])) if report["shape"] == "full" else None
    if target is None:
        return "-"
    rate, multiple = target
    met = size["tokens_per_s"] >= rate and size["multiple"] <= multiple
    return f">= {rate:,.0f} tokens/s and <= {multiple:g}x: {'met' if met else 'MISSED'}"


def opd_target(report: dict) -> str:
    """The OPD step's seconds against TARGETS (full shapes only)."""
    if report["shape"] != "full":
        return ""
    seconds, target = sum(report["opd"]["phases_ms"].values()) / 1000.0, TARGETS["OPD step s"]
    return f"; step {seconds:.2f} s (target <= {target:g} s: {'met' if seconds <= target else 'MISSED'})"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.shape = "tiny" if args.tiny else "full"
    sync_server = sync_python(args) is not None
    phases = build_phases(args.shape, bool(args.use_compile), sync_server)
    unknown = set(args.phase_limit_s) - {None} - {phase.name for phase in phases}
    if unknown:
        print(f"error: --phase_limit_s: no phase {', '.join(sorted(unknown))} (the phases: "
              f"{', '.join(phase.name for phase in phases)})", file=sys.stderr)
        return 2
    plan = make_plan(args.shape, args.budget_s, bool(args.use_compile), args.phase_limit_s, sync_server)
    if args.plan:
        print_plan(plan)
        return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure (python benchmarks/bench_gpu.py --device cpu --tiny runs the "
              "same code paths on tiny shapes; --plan prints the plan)")
        return 0
    if args.workdir and os.path.exists(args.workdir):  # the kit removes its folder: never one it did not create
        print(f"error: --workdir {args.workdir} exists: give a new folder (it is removed at the end)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    print_plan(plan)
    report = {"machine": harness.machine(), "device": args.device, "shape": args.shape, "torch": torch.__version__,
              "budget_s": args.budget_s, "plan": plan, "phases": [], "smoke": [], "throughput": {},
              "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    folder = args.workdir or tempfile.mkdtemp(prefix="bench_gpu_")
    os.makedirs(folder, exist_ok=True)
    kit = Kit(args, folder, report, started)
    with open(kit.path(".log"), "w") as log:  # the smoke runs append to it
        log.write(f"the training loops' output, run by run ({args.shape} shapes on {args.device})\n")
    stop_on_sigterm()
    try:
        run_phases(kit, phases)
    except (Stopped, KeyboardInterrupt) as error:
        kit.progress(f"interrupted ({one_line(error)}): {args.out} holds what was measured")
        return error.exit_code if isinstance(error, Stopped) else 130
    finally:
        shutil.rmtree(kit.folder, ignore_errors=True)
        write_outputs(kit)
    print("\n" + report_table(report))
    print(f"{report['seconds']:.0f} s in all; wrote {args.out} and {kit.path('.md')}")
    return 1 if any(p["status"] in ("failed", "error", "timeout") for p in report["phases"]) else 0


if __name__ == "__main__":
    sys.exit(main())
