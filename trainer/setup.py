"""Script set-up shared by the three training loops: flags and their validation, the distributed start, and
loading of models, teacher and data. Called once, top to bottom, before the loop; the loop's mechanics are in
trainer_utils.py.

Order matters and each script keeps it: flags -> distributed start (each rank picks its device) -> data, read and
validated before any model is built -> models, built directly on the rank's device.
"""
from __future__ import annotations

import argparse
import atexit
import ctypes
import datetime
import math
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.checks import check_device, check_model_dir
from common.errors import refuse
from common.files import check_writable
from dataset.collators import SFTCollator, validate_rows
from dataset.make_demo_data import ensure_demo_data
from dataset.sources import RowDataset
from model import Qwen3Config, create_model, load_pretrained, load_tokenizer
from model.precision import DTYPE_CHOICES, resolve_precision
from model.tokenizer import QwenTokenizer
from trainer.sharding import shard, sharded_random_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_CONFIG = os.path.join(ROOT, "model", "configs", "qwen3-tiny.json")
# A rank waits in a collective while another works alone; past --dist_timeout the process group fails every rank
# (NCCL's watchdog kills them, gloo raises), before the failure protocol can save or say anything. The default
# covers the longest legitimate waits: a batch of server requests at the default --rollout_timeout with all their
# retries (3340 s, server_wait_seconds) and rank 0 writing an 8B model's checkpoint (~131 GB: ~1310 s at the
# speed below); both are checked at start-up against the value given.
DEFAULT_DIST_TIMEOUT = 3600.0
SAVE_WRITE_BYTES_PER_S = 100e6  # a conservative sustained write speed: a network file system's, a busy disk's


# ----------------------------------------------------------------------------------------------------------------
# arguments

def add_common_args(parser: argparse.ArgumentParser, save_weight: str) -> None:
    """The flags every loop shares (README.md, "Flags shared by the three loops"); each script adds its own algorithm's flags."""
    g = parser.add_argument_group("model")
    g.add_argument("--model_path", default=None, help="HF folder to start from (config.json + safetensors)")
    g.add_argument("--model_config", default=None,
                   help=f"config.json to start from random weights (default without --model_path: "
                        f"{os.path.relpath(DEFAULT_MODEL_CONFIG, ROOT)})")
    g.add_argument("--tokenizer_path", default=None,
                   help="folder with tokenizer.json (default: --model_path, else the packaged Qwen3 tokenizer)")
    g = parser.add_argument_group("data")
    g.add_argument("--data_path", default=None, help="parquet or jsonl (default: the built-in demo data)")
    g.add_argument("--max_length", type=int, default=512, help="prompt + completion tokens per row")
    g.add_argument("--max_prompt_length", type=int, default=256, help="prompt budget (keeps the prompt's end)")
    g.add_argument("--enable_thinking", type=int, default=0, choices=[0, 1], help="Qwen3 chat-template switch")
    g.add_argument("--num_workers", type=int, default=0, help="DataLoader workers")
    g = parser.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=1)
    g.add_argument("--batch_size", type=int, default=16, help="rows per micro-batch per device")
    g.add_argument("--accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--learning_rate", type=float, default=2e-3,
                   help="peak learning rate (AdamW); the default suits the tiny demo models, Qwen3-0.6B wants ~1e-5")
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--warmup_ratio", type=float, default=0.0, help="share of optimizer steps of linear warm-up")
    g.add_argument("--grad_clip", type=float, default=1.0, help="max global grad norm (0 = no clipping)")
    g.add_argument("--max_steps", type=int, default=0, help="stop after this many optimizer steps (0 = all)")
    g.add_argument("--seed", type=int, default=42)
    g.add_argument("--loss_chunk_size", type=int, default=512,
                   help="positions projected through the lm_head at a time (full logits never exist)")
    g = parser.add_argument_group("held-out evaluation (greedy completions: accuracy; with a teacher: reverse KL)")
    g.add_argument("--eval_interval", type=int, default=0, help="optimizer steps between evaluations (0 = off)")
    g.add_argument("--eval_data_path", default=None, help="held-out prompts with ground truth (default: demo eval)")
    g.add_argument("--eval_rows", type=int, default=64, help="held-out prompts per evaluation (a fixed set)")
    g.add_argument("--eval_max_new_tokens", type=int, default=64, help="completion budget of the evaluation")
    g = parser.add_argument_group("system")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="autocast dtype over fp32 master weights, on any device (float16 adds a GradScaler); auto: "
                        "bfloat16 on CUDA, float32 (no autocast) elsewhere (model/precision.py)")
    g.add_argument("--use_compile", type=int, default=0, choices=[0, 1],
                   help="1: torch.compile each decoder layer (training); OPD also compiles the student's decode "
                        "step (CUDA graphs on CUDA), which keeps its KV cache allocated between rollouts")
    g.add_argument("--gradient_checkpointing", type=int, default=0, choices=[0, 1],
                   help="1: recompute each decoder layer's activations in the backward (less memory, one more forward)")
    g.add_argument("--fsdp", type=int, default=0, choices=[0, 1],
                   help="1: shard parameters, gradients and optimizer state over the ranks (FSDP2) and write "
                        "sharded checkpoints that any world size resumes (docs/architecture.md)")
    g.add_argument("--dist_timeout", type=float, default=DEFAULT_DIST_TIMEOUT,
                   help=f"seconds a rank may wait in a collective for the others before the run fails (NCCL's "
                        f"watchdog, gloo's timeout); the default {DEFAULT_DIST_TIMEOUT:.0f} covers the longest "
                        f"legitimate wait: a batch of server requests at --rollout_timeout 600 with all retries "
                        f"(3340 s) or rank 0 writing an 8B model's checkpoint at {SAVE_WRITE_BYTES_PER_S / 1e6:.0f} "
                        f"MB/s (~1310 s); a longer possible wait is refused at start-up")
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save_dir", default=os.path.join(ROOT, "checkpoints"))
    g.add_argument("--save_weight", default=save_weight, help="run name: SAVE_DIR/NAME/, NAME_resume.pt, ...")
    g.add_argument("--save_interval", type=int, default=100, help="optimizer steps between saves")
    g.add_argument("--from_resume", type=int, default=0, choices=[0, 1],
                   help="1: continue from SAVE_DIR/NAME_resume.pt if it exists")
    g.add_argument("--resume_changes", default="",
                   help="with --from_resume 1: comma-separated flags that may differ from the checkpoint's although "
                        "they change what the run computes, e.g. max_steps to train on past the planned end (the "
                        "cosine schedule is then recomputed over the new length); others are refused")
    g.add_argument("--start_over", type=int, default=0, choices=[0, 1],
                   help="1: move an existing run of this name aside (SAVE_DIR/NAME.replaced-TIME/) and start anew")
    g = parser.add_argument_group("logging")
    g.add_argument("--log_interval", type=int, default=10, help="optimizer steps between log lines")
    g.add_argument("--use_swanlab", type=int, default=0, choices=[0, 1])
    g.add_argument("--swanlab_project", default="qwen3-distill")
    g.add_argument("--swanlab_mode", default="local", choices=["cloud", "local", "offline", "disabled"],
                   help="offline/local need no account; cloud needs `swanlab login`")


def validate_common_args(args: argparse.Namespace) -> None:
    """Refuse impossible combinations at start-up, saying what to change (never deep inside the loop)."""
    if args.model_path and args.model_config:
        refuse("give either --model_path (pretrained weights) or --model_config (random init), not both")
    if not args.model_path and not args.model_config:  # resolved here, so the logged config names what was used
        args.model_config = DEFAULT_MODEL_CONFIG
    for name in ("epochs", "batch_size", "accumulation_steps", "max_length", "max_prompt_length",
                 "log_interval", "save_interval", "loss_chunk_size"):
        if getattr(args, name) < 1:
            refuse(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.max_prompt_length >= args.max_length:
        refuse(f"--max_prompt_length ({args.max_prompt_length}) must be smaller than --max_length "
               f"({args.max_length}) so that completion tokens fit")
    if not 0.0 <= args.warmup_ratio < 1.0:
        refuse(f"--warmup_ratio must be in [0, 1), got {args.warmup_ratio}")
    if args.learning_rate <= 0:
        refuse(f"--learning_rate must be > 0, got {args.learning_rate}")
    if args.eval_interval < 0 or args.eval_rows < 1 or args.eval_max_new_tokens < 1:
        refuse("--eval_interval must be >= 0, --eval_rows and --eval_max_new_tokens >= 1")
    for name in ("max_steps", "grad_clip"):
        if getattr(args, name) < 0:
            refuse(f"--{name} must be >= 0, got {getattr(args, name)}")
    if not args.dist_timeout > 0:
        refuse(f"--dist_timeout must be > 0 seconds, got {args.dist_timeout}")
    check_device(args.device)
    if args.model_path:
        check_model_dir(args.model_path, "--model_path")
    for flag in ("model_path", "model_config", "data_path", "eval_data_path", "tokenizer_path"):
        path = getattr(args, flag)
        if path and not os.path.exists(path):
            refuse(f"--{flag} {path} does not exist")
    if args.fsdp and resolve_precision(args.device, args.dtype).scaled:
        refuse("--fsdp 1 with --dtype float16 needs a sharded gradient scaler, which is not implemented: use "
               "--dtype bfloat16")
    unknown = sorted(resume_change_names(args) - vars(args).keys())
    if unknown:
        refuse(f"--resume_changes names no flag of this script: {', '.join(unknown)}")
    if args.from_resume and args.start_over:
        refuse("--from_resume 1 continues the run, --start_over 1 sets it aside and starts anew: pass one of them")
    check_writable(args.save_dir, "--save_dir")
    check_run_name(args)


def check_run_name(args: argparse.Namespace) -> None:
    """A run of this name already exists and neither --from_resume 1 nor --start_over 1 says what to do with it:
    refused now, before the data is checked and the models are built (and again under the run lock)."""
    resume_path = os.path.join(args.save_dir, f"{args.save_weight}_resume.pt")
    if os.path.exists(resume_path) and not args.from_resume and not args.start_over:
        refuse(f"{resume_path} holds a run of this name: continue it with --from_resume 1, pass --start_over 1 to "
               f"move its files aside and start anew, or choose another --save_weight")


def resume_change_names(args: argparse.Namespace) -> set[str]:
    """The flag names --resume_changes lists (comma-separated, with or without the leading --)."""
    return {name.strip().removeprefix("--") for name in args.resume_changes.split(",") if name.strip()}


# ----------------------------------------------------------------------------------------------------------------
# distributed start

def print0(*args, **kwargs) -> None:
    """print on rank 0 only (all ranks run the same script)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed_mode(device: str, timeout: float = DEFAULT_DIST_TIMEOUT) -> DistInfo:
    """Join the process group torchrun describes in the environment (nccl on CUDA, gloo on CPU). `timeout`
    (--dist_timeout, seconds): how long a collective may wait for the other ranks before the group fails."""
    if "RANK" not in os.environ:
        return DistInfo(device=device)
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    die_with_launcher()
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo",
                            timeout=datetime.timedelta(seconds=timeout))
    atexit.register(leave_process_group)
    return DistInfo(rank, local_rank, world_size, device)


def leave_process_group() -> None:
    """At exit, for a run that stops on an error (a failed server, a refusal after the start): the finished run's
    close() has given the group back already. A process that exits holding a gloo group it has used may abort in
    its teardown ("terminate called without an active exception", exit -6 instead of its own code; a quarter of
    2-rank runs here); gloo's destroy is local, so it is safe while other ranks are gone or still waiting. An NCCL
    group is left to PyTorch's own teardown: destroying its communicators can wait for peers that never come."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


def die_with_launcher() -> None:
    """torchrun starts each worker in a session of its own, so a launcher killed with SIGKILL leaves its workers
    training on, into the folder a rerun will use. On Linux the kernel is asked to kill a worker when its launcher
    dies (PR_SET_PDEATHSIG); a launcher that died before the request was made is noticed by the parent PID."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if parent == 1 or os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def check_save_time(rank0_bytes: int, dist_timeout: float) -> None:
    """For Run, with more than one rank: rank 0 writes `rank0_bytes` of a checkpoint alone while the other ranks
    wait at the save's barrier. Refused at start-up when that could take longer than --dist_timeout at a
    conservative write speed (every rank computes the same, so every rank refuses)."""
    seconds = rank0_bytes / SAVE_WRITE_BYTES_PER_S
    if seconds > dist_timeout:
        refuse(f"--dist_timeout {dist_timeout:g}: rank 0 writes {rank0_bytes / 1e9:.1f} GB of each checkpoint while "
               f"the other ranks wait, up to {seconds:.0f} s at {SAVE_WRITE_BYTES_PER_S / 1e6:.0f} MB/s; raise "
               f"--dist_timeout to {math.ceil(seconds)} or more")


# ----------------------------------------------------------------------------------------------------------------
# models

def build_model(args: argparse.Namespace, device: str, path: str | None = None,
                config_path: str | None = None, seed: int | None = None) -> torch.nn.Module:
    """fp32 weights (the master copy; autocast lowers the matmuls) from an HF folder or a config + seed. With
    --fsdp 1 on several ranks the model comes sharded, each rank having built and filled only its own shards."""
    sharded = sharding_ranks(args)
    precision = resolve_precision(device, args.dtype)
    if path:
        print0(f"loading {path} on {device}" + (" (each rank its shards)" if sharded else ""))
        return load_pretrained(path, dtype=precision.master, device=device,
                               shard=(lambda m: shard(m, precision.device_type, precision.compute)) if sharded else None)
    config_path = config_path or DEFAULT_MODEL_CONFIG
    print0(f"random weights from {os.path.relpath(config_path)} on {device}")
    config, seed = Qwen3Config.from_json(config_path), args.seed if seed is None else seed
    if sharded:
        return sharded_random_model(config, seed, device, precision.compute)
    return create_model(config, seed=seed, device=device)


def sharding_ranks(args: argparse.Namespace) -> bool:
    """--fsdp 1 with more than one rank: models are sharded (one process with --fsdp 1 holds them whole and still
    writes sharded checkpoints)."""
    return bool(args.fsdp) and dist.is_initialized() and dist.get_world_size() > 1


def load_sft_data(args: argparse.Namespace) -> tuple[str | None, QwenTokenizer, RowDataset, SFTCollator]:
    """-> (tokenizer folder, tokenizer, chat rows with solutions, SFT collator): what SFT and white-box KD train on.
    The tokenizer comes from --tokenizer_path, else the model folder, else the real Qwen3 files; the rows from
    --data_path, else the demo training set (generated on first use)."""
    tokenizer_dir = args.tokenizer_path or args.model_path
    tokenizer = load_tokenizer(tokenizer_dir)
    dataset = RowDataset(args.data_path or ensure_demo_data()["sft_train"])
    collator = SFTCollator(tokenizer, args.max_length, args.max_prompt_length, bool(args.enable_thinking))
    check_rows(dataset, collator, need_completion=True)
    return tokenizer_dir, tokenizer, dataset, collator


def check_rows(dataset: RowDataset, collator, need_completion: bool) -> None:
    """Every row rendered as the collator will, before any model is built: a bad row stops the run now, not hours
    in (every rank checks; they all reach the same verdict, so none is left waiting)."""
    print0(f"checking {len(dataset):,} rows of {os.path.relpath(dataset.path)}")
    validate_rows(dataset, collator, need_completion=need_completion, progress=int(os.environ.get("RANK", 0)) == 0)


def add_teacher_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("teacher")
    g.add_argument("--teacher_path", default=None,
                   help="HF folder of the teacher (same tokenizer); default: SAVE_DIR/sft, the SFT quick-start's output")
    g.add_argument("--replicate_teacher", type=int, default=0, choices=[0, 1],
                   help="with --fsdp 1: 1 keeps a whole teacher on every rank (faster when it fits) instead of "
                        "sharding it")
    g.add_argument("--temperature", type=float, default=1.0, help="softmax temperature of the distillation loss")
    g.add_argument("--teacher_dtype", default="auto", choices=DTYPE_CHOICES,
                   help="the teacher's weights; auto: the --dtype autocast computes in, except with float16 "
                        "(a real Qwen3 may overflow fp16): bfloat16 where the device has it, else float32")


def resolve_teacher_path(args: argparse.Namespace) -> None:
    """Default teacher: the SFT quick-start's model. Refused up front when there is none."""
    if args.teacher_path is None:
        args.teacher_path = os.path.join(args.save_dir, "sft")
    if not os.path.isfile(os.path.join(args.teacher_path, "config.json")):
        refuse(f"no teacher model at {args.teacher_path}: run `python trainer/train_sft.py` first (it writes "
               f"checkpoints/sft/), or pass --teacher_path")
    if args.temperature <= 0:
        refuse(f"--temperature must be > 0, got {args.temperature}")


def load_teacher(args: argparse.Namespace, tokenizer, student: torch.nn.Module, device: str) -> torch.nn.Module:
    """The teacher, frozen, in eval mode; in the precision rule's teacher dtype (it never needs an fp32 master copy).

    Token-level distillation compares distributions position by position, so student and teacher must mean the same
    thing by every id: their tokenizers' vocabularies are compared and a difference is refused at start-up.
    """
    teacher_tokenizer_dir = args.teacher_path if os.path.isfile(os.path.join(args.teacher_path, "tokenizer.json")) \
        else None
    teacher_tokenizer = load_tokenizer(teacher_tokenizer_dir)
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        refuse(f"the teacher's tokenizer ({teacher_tokenizer.folder}) differs from the student's "
               f"({tokenizer.folder}); token-level distillation needs the same vocabulary")
    teacher = read_teacher(args, device)
    for name, model in (("student", student), ("teacher", teacher)):
        if model.config.vocab_size < len(tokenizer):
            refuse(f"the {name}'s embedding has {model.config.vocab_size} rows, fewer than the tokenizer's "
                   f"{len(tokenizer)} tokens")
    teacher.eval().requires_grad_(False)
    return teacher


def read_teacher(args: argparse.Namespace, device: str) -> torch.nn.Module:
    """The teacher's weights straight in their dtype (model/precision.py: the autocast dtype, bf16 under fp16, or
    --teacher_dtype). With --fsdp 1 on
    several ranks sharded, each rank reading only its own rows (its shards are gathered layer by layer for the
    forward), unless --replicate_teacher 1: then whole on every rank, read once."""
    precision = resolve_precision(device, args.dtype, args.teacher_dtype)
    dtype = precision.teacher
    sharded = sharding_ranks(args) and not args.replicate_teacher
    print0(f"loading the teacher {args.teacher_path} on {device}" + (" (each rank its shards)" if sharded else ""))
    return load_pretrained(args.teacher_path, dtype=dtype, device=device,
                           shard=(lambda m: shard(m, precision.device_type, dtype)) if sharded else None)
