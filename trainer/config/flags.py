"""The flags every training loop shares, and the rules that refuse impossible combinations at start-up.

Each script builds its parser from `add_common_args` (and `add_teacher_args` when it has a teacher), adds its own
algorithm's flags, and calls `validate_common_args` before anything slow: a bad flag, a missing path or a run name
already in use is one line and exit code 2, before the data is read or a model is built (docs/training.md).
"""
from __future__ import annotations

import argparse
import os

import torch

from common.checks import check_device, check_model_dir
from common.errors import refuse
from common.files import check_writable
from model.generate import DECODE_CHOICES, default_decode
from model.lora import TARGETS as LORA_TARGETS
from model.precision import DTYPE_CHOICES, resolve_precision
from model.qwen3 import COMPILE_CHOICES, default_compile
from trainer.skeleton.distributed import DEFAULT_DIST_TIMEOUT, SAVE_WRITE_BYTES_PER_S
from trainer.skeleton.loading import DEFAULT_MODEL_CONFIG, ROOT
from trainer.skeleton.resume_checks import check_run_name, resume_change_names


# Flags that may differ on resume: they change how the run is executed or logged, not what it computes. Any other
# change (its length -- --max_steps, --epochs --, the schedule, the data) is refused unless --resume_changes names it.
# Each loop's config (trainer/config/LOOP.py) adds its own groups' to these: its RESUMABLE.
SHARED_RESUMABLE = frozenset({
    "from_resume", "device", "num_workers", "log_interval", "save_interval", "export_steps", "use_swanlab",
    "swanlab_mode", "swanlab_project", "batch_size", "accumulation_steps", "use_compile", "decode",
    "gradient_checkpointing", "packing", "eval_interval", "eval_rows", "eval_data_path", "eval_max_new_tokens",
    "save_dir", "start_over", "dist_timeout", "resume_changes"})
FULL_LEARNING_RATE = 2e-3  # --learning_rate's default: tuned on the demo's tiny models
# LoRA's best learning rate is about 10x full fine-tuning's ("LoRA without regret", Thinking Machines 2025: rank-
# independent at alpha 32, all layers adapted): --learning_rate's default with --lora_rank
LORA_LR_FACTOR = 10
# where the frozen models live, and a start-up check: not what the run computes
TEACHER_RESUMABLE = frozenset({"replicate_teacher", "accept_template_difference"})


def step_list(text: str) -> tuple[int, ...]:
    """--export_steps: "0,400,450" -> (0, 400, 450); each a step >= 0 (0: before the first step)."""
    try:
        steps = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated optimizer steps, got {text!r}") from None
    if any(step < 0 for step in steps):
        raise argparse.ArgumentTypeError(f"steps must be >= 0, got {text!r}")
    return steps


def rate_or_auto(text: str) -> float | str:
    """--learning_rate: a number, or "auto" (resolved by validate_common_args)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or auto, got {text!r}") from None


def add_common_args(parser: argparse.ArgumentParser, save_weight: str) -> None:
    """The flags every loop shares (docs/training.md, "Flags shared by the loops"), group by group; each
    script adds its own algorithm's flags."""
    add_model_and_data_args(parser)
    add_lora_args(parser)
    add_optimisation_and_evaluation_args(parser)
    add_system_args(parser)
    add_checkpoint_and_logging_args(parser, save_weight)


def add_model_and_data_args(parser: argparse.ArgumentParser) -> None:
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


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA student (model/lora.py; docs/training.md, \"LoRA students\")")
    g.add_argument("--lora_rank", type=int, default=0,
                   help="rank of the adapters; 0: full fine-tuning. With a rank the base is frozen (in the autocast "
                        "dtype: bf16 on CUDA), only the fp32 adapters train")
    g.add_argument("--lora_alpha", type=float, default=32.0, help="the adapters' scale is alpha / rank")
    g.add_argument("--lora_dropout", type=float, default=0.0, help="dropout on the adapters' input")
    g.add_argument("--lora_targets", default=",".join(LORA_TARGETS),
                   help="comma-separated HF projections that get an adapter (default: all of attention and MLP)")


def add_optimisation_and_evaluation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=1, help="passes over the training rows")
    g.add_argument("--batch_size", type=int, default=16, help="rows per micro-batch per device")
    g.add_argument("--accumulation_steps", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--learning_rate", type=rate_or_auto, default="auto",
                   help=f"peak learning rate (AdamW); auto: {FULL_LEARNING_RATE:g}, {LORA_LR_FACTOR}x that with "
                        f"--lora_rank. auto suits the tiny demo models; Qwen3-0.6B wants ~1e-5 (LoRA ~1e-4)")
    g.add_argument("--weight_decay", type=float, default=0.0, help="AdamW's decoupled weight decay")
    g.add_argument("--warmup_ratio", type=float, default=0.0, help="share of optimizer steps of linear warm-up")
    g.add_argument("--grad_clip", type=float, default=1.0, help="max global grad norm (0 = no clipping)")
    g.add_argument("--max_steps", type=int, default=0, help="stop after this many optimizer steps (0 = all)")
    g.add_argument("--seed", type=int, default=42,
                   help="the model's random init, the data order (seed, epoch) and each row's samples")
    g.add_argument("--loss_chunk_size", type=int, default=512,
                   help="positions projected through the lm_head at a time (full logits never exist)")
    g = parser.add_argument_group("held-out evaluation (greedy completions: accuracy; with a teacher: reverse KL)")
    g.add_argument("--eval_interval", type=int, default=0, help="optimizer steps between evaluations (0 = off)")
    g.add_argument("--eval_data_path", default=None, help="held-out prompts with ground truth (default: demo eval)")
    g.add_argument("--eval_rows", type=int, default=64, help="held-out prompts per evaluation (a fixed set)")
    g.add_argument("--eval_max_new_tokens", type=int, default=64, help="completion budget of the evaluation")


def add_system_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("system")
    g.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="autocast dtype over fp32 master weights, on any device (float16 adds a GradScaler); auto: "
                        "bfloat16 on CUDA, float32 (no autocast) elsewhere (model/precision.py)")
    g.add_argument("--use_compile", default="auto", choices=COMPILE_CHOICES,
                   help="1: torch.compile each decoder layer for training (compiled on the first steps); auto: 1 on "
                        "CUDA, 0 elsewhere (docs/training.md)")
    g.add_argument("--decode", default="auto", choices=DECODE_CHOICES,
                   help="the built-in engine's decode step (rollouts, held-out evaluation): compiled = torch.compile "
                        "mode reduce-overhead, on CUDA one CUDA-graph replay per token (compiled once per width, "
                        "its cache kept allocated between rollouts); auto: compiled on CUDA, eager elsewhere and "
                        "with --fsdp 1 (docs/generation.md)")
    g.add_argument("--gradient_checkpointing", type=int, default=0, choices=[0, 1],
                   help="1: recompute each decoder layer's activations in the backward (less memory, one more forward)")
    g.add_argument("--packing", type=int, default=0, choices=[0, 1],
                   help="1: the student's training forward on each row's real tokens only: projections, norms and "
                        "MLPs skip the padding, attention stays per row (docs/training.md)")
    g.add_argument("--fsdp", type=int, default=0, choices=[0, 1],
                   help="1: shard parameters, gradients and optimizer state over the ranks (FSDP2) and write "
                        "sharded checkpoints that any world size resumes (docs/architecture.md)")
    g.add_argument("--dist_timeout", type=float, default=DEFAULT_DIST_TIMEOUT,
                   help=f"seconds a rank may wait in a collective for the others before the run fails (NCCL's "
                        f"watchdog, gloo's timeout); the default {DEFAULT_DIST_TIMEOUT:.0f} covers the longest "
                        f"legitimate wait: a batch of server requests at --rollout_timeout 600 with all retries "
                        f"(3340 s) or rank 0 writing an 8B model's checkpoint at {SAVE_WRITE_BYTES_PER_S / 1e6:.0f} "
                        f"MB/s (~1310 s); a longer possible wait is refused at start-up")


def add_checkpoint_and_logging_args(parser: argparse.ArgumentParser, save_weight: str) -> None:
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save_dir", default=os.path.join(ROOT, "checkpoints"))
    g.add_argument("--save_weight", default=save_weight, help="run name: SAVE_DIR/NAME/, NAME_resume.pt, ...")
    g.add_argument("--save_interval", type=int, default=100, help="optimizer steps between saves")
    g.add_argument("--export_steps", type=step_list, default=(),
                   help="comma-separated optimizer steps after which the model is also exported as "
                        "SAVE_DIR/NAME_stepSTEP/, a folder later saves leave alone (e.g. an early snapshot to start "
                        "another run from); 0: the model as the run starts it, before the first step")
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


def validate_common_args(args: argparse.Namespace, chat: bool = True) -> None:
    """Refuse impossible combinations at start-up, saying what to change (never deep inside the loop). `chat`: the
    loop's rows are chat rows, a prompt and a completion (not continued pretraining's raw text, whose rows have no
    prompt: --max_prompt_length is not read)."""
    if args.model_path and args.model_config:
        refuse("give either --model_path (pretrained weights) or --model_config (random init), not both")
    if not args.model_path and not args.model_config:  # resolved here, so the logged config names what was used
        args.model_config = DEFAULT_MODEL_CONFIG
    for name in ("epochs", "batch_size", "accumulation_steps", "max_length", "max_prompt_length",
                 "log_interval", "save_interval", "loss_chunk_size"):
        if getattr(args, name) < 1:
            refuse(f"--{name} must be >= 1, got {getattr(args, name)}")
    if chat and args.max_prompt_length >= args.max_length:
        refuse(f"--max_prompt_length ({args.max_prompt_length}) must be smaller than --max_length "
               f"({args.max_length}) so that completion tokens fit")
    if not 0.0 <= args.warmup_ratio < 1.0:
        refuse(f"--warmup_ratio must be in [0, 1), got {args.warmup_ratio}")
    if args.learning_rate == "auto":  # resolved here: the run records, and a resume compares, the rate used
        args.learning_rate = FULL_LEARNING_RATE * (LORA_LR_FACTOR if args.lora_rank else 1)
    if args.learning_rate <= 0:
        refuse(f"--learning_rate must be > 0, got {args.learning_rate}")
    validate_lora_args(args)
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
    args.use_compile = resolve_use_compile(args.use_compile, args.device)
    args.decode = resolve_decode(args.decode, args.device, bool(args.fsdp))
    if args.fsdp and resolve_precision(args.device, args.dtype).scaled:
        refuse("--fsdp 1 with --dtype float16 needs a sharded gradient scaler, which is not implemented: use "
               "--dtype bfloat16")
    unknown = sorted(resume_change_names(args) - vars(args).keys())
    if unknown:
        refuse(f"--resume_changes names no flag of this script: {', '.join(unknown)}")
    if args.from_resume and args.start_over:
        refuse("--from_resume 1 continues the run, --start_over 1 sets it aside and starts anew: pass one of them")
    check_writable(args.save_dir, "--save_dir")
    check_run_name(args.save_dir, args.save_weight, args.from_resume, args.start_over)


def validate_lora_args(args: argparse.Namespace) -> None:
    """--lora_*: a rank >= 0, alpha > 0, dropout in [0, 1), targets among HF's projections (stored in HF's order)."""
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if args.lora_rank < 0 or not args.lora_alpha > 0 or not 0.0 <= args.lora_dropout < 1.0:
        refuse(f"--lora_rank must be >= 0, --lora_alpha > 0 and --lora_dropout in [0, 1), got {args.lora_rank}, "
               f"{args.lora_alpha}, {args.lora_dropout}")
    if unknown or not targets:
        refuse(f"--lora_targets {args.lora_targets!r}: each must be one of {','.join(LORA_TARGETS)}")
    args.lora_targets = ",".join(t for t in LORA_TARGETS if t in targets)  # one spelling: a resume compares it


def resolve_use_compile(choice: str, device: str) -> int:
    """--use_compile auto -> the model's default for the device (model/qwen3.py: default_compile); "0" and "1" as
    given. Resolved before the run records its flags, as --decode is: a resume compares the values the runs used."""
    if choice == "auto":
        return default_compile(torch.device(device).type)
    return int(choice)


def resolve_decode(choice: str, device: str, sharded: bool) -> str:
    """--decode auto -> generate's default for the device (model/generate.py: default_decode), but eager with
    --fsdp 1, whose lockstep decoding all-gathers every layer's weights inside the step."""
    if choice == "compiled" and sharded:
        refuse("--decode compiled with --fsdp 1: a sharded model all-gathers its layers inside the decode step, "
               "which a CUDA graph cannot capture; use --decode eager (or auto)")
    if choice != "auto":
        return choice
    return "eager" if sharded else default_decode(torch.device(device).type)


def add_teacher_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("teacher")
    g.add_argument("--teacher_path", default=None,
                   help="HF folder of the teacher (same tokenizer); default: SAVE_DIR/sft, the SFT quick-start's "
                        "output")
    g.add_argument("--replicate_teacher", type=int, default=0, choices=[0, 1],
                   help="with --fsdp 1: 1 keeps a whole teacher on every rank (faster when it fits) instead of "
                        "sharding it")
    g.add_argument("--temperature", type=float, default=1.0, help="softmax temperature of the distillation loss")
    g.add_argument("--teacher_dtype", default="auto", choices=DTYPE_CHOICES,
                   help="the teacher's weights; auto: the --dtype autocast computes in, except with float16 "
                        "(a real Qwen3 may overflow fp16): bfloat16 where the device has it, else float32")


def add_frozen_model_args(group, which: str) -> None:
    """The frozen models' dtype and placement, in a loop's own `group`: `which` names its frozen models (the RL
    loop's reference and teacher, the logit-free loop's reference and evaluation teacher)."""
    group.add_argument("--teacher_dtype", default="auto", choices=DTYPE_CHOICES,
                       help=f"the frozen models' weights ({which}); auto as the KD teacher's")
    group.add_argument("--replicate_teacher", type=int, default=0, choices=[0, 1],
                       help="with --fsdp 1: 1 keeps whole frozen models on every rank instead of sharding them")


def default_student(args: argparse.Namespace, run_name: str, command: str) -> None:
    """Without --model_path / --model_config: the student is the demo run `run_name`'s model (SAVE_DIR/RUN_NAME),
    which `command` writes; refused up front when there is none."""
    if args.model_path or args.model_config:
        return
    args.model_path = os.path.join(args.save_dir, run_name)
    if not os.path.isfile(os.path.join(args.model_path, "config.json")):
        refuse(f"no student at {args.model_path}: run `{command}` first, or pass --model_path / --model_config")


def resolve_teacher_path(args: argparse.Namespace) -> None:
    """Default teacher: the SFT quick-start's model. Refused up front when there is none."""
    if args.teacher_path is None:
        args.teacher_path = os.path.join(args.save_dir, "sft")
    if not os.path.isfile(os.path.join(args.teacher_path, "config.json")):
        refuse(f"no teacher model at {args.teacher_path}: run `python trainer/train_sft.py` first (it writes "
               f"checkpoints/sft/), or pass --teacher_path")
    if args.temperature <= 0:
        refuse(f"--temperature must be > 0, got {args.temperature}")
