"""The shared skeleton of the three training loops: the mechanics, one call away from the algorithm.

What lives here: the common flags, the cosine LR, DDP set-up, seeds, mixed precision, the data stream (a
world-size-invariant sampler, grouped into accumulation windows, resumable), exact loss normalisation over the
window and all ranks, gradient clipping, logging (console, metrics.jsonl, swanlab), atomic resume checkpoints and the
HF export. What does not: collation, generation, forward passes and losses -- those are the algorithm, and each
script spells them out.

The normalisation invariant (docs/architecture.md): an optimizer step's gradient is the gradient of
    (sum of token losses over the whole accumulation window and all ranks) / (number of loss tokens in it).
Every micro-step backwards its *summed* loss; at the end of the window the token count is all-reduced and the
gradients are scaled once, before clipping. A mean per micro-batch divided by accumulation_steps would weight a
short completion's tokens more than a long one's, and a short tail window would be divided by too much.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import hashlib
import json
import math
import os
import random
import signal
import socket
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from common.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, RuntimeFailure, Stopped, UserError, refuse
from common.files import (atomic_write, check_free_space, check_writable, raise_disk_error,
                          remove_stale_temporaries)
from dataset.collators import SFTCollator, validate_rows
from dataset.make_demo_data import ensure_demo_data
from dataset.sources import RowDataset
from model import DTYPES, Qwen3Config, create_model, load_pretrained, load_tokenizer, save_pretrained
from model.tokenizer import QwenTokenizer
from trainer.sampler import EpochSampler, SkipBatchSampler, batches_to_skip

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_CONFIG = os.path.join(ROOT, "model", "configs", "qwen3-tiny.json")
CHECKPOINT_FORMAT = 1


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
    g.add_argument("--dtype", default="bfloat16", choices=list(DTYPES),
                   help="autocast dtype on CUDA (fp16 adds a GradScaler); CPU always trains in fp32")
    g.add_argument("--use_compile", type=int, default=0, choices=[0, 1])
    g.add_argument("--gradient_checkpointing", type=int, default=0, choices=[0, 1])
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save_dir", default=os.path.join(ROOT, "checkpoints"))
    g.add_argument("--save_weight", default=save_weight, help="run name: SAVE_DIR/NAME/, NAME_resume.pt, ...")
    g.add_argument("--save_interval", type=int, default=100, help="optimizer steps between saves")
    g.add_argument("--from_resume", type=int, default=0, choices=[0, 1],
                   help="1: continue from SAVE_DIR/NAME_resume.pt if it exists")
    g.add_argument("--start_over", type=int, default=0, choices=[0, 1],
                   help="1: move an existing run of this name aside (SAVE_DIR/NAME.replaced-TIME/) and start anew")
    g = parser.add_argument_group("logging")
    g.add_argument("--log_interval", type=int, default=10, help="optimizer steps between log lines")
    g.add_argument("--use_swanlab", type=int, default=0, choices=[0, 1])
    g.add_argument("--swanlab_project", default="qwen3-distill")
    g.add_argument("--swanlab_mode", default="offline", choices=["cloud", "local", "offline", "disabled"],
                   help="offline/local need no account; cloud needs `swanlab login`")


def validate_common_args(args: argparse.Namespace) -> None:
    """Refuse impossible combinations at start-up, saying what to change (never deep inside the loop)."""
    if args.model_path and args.model_config:
        refuse("give either --model_path (pretrained weights) or --model_config (random init), not both")
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
    if args.max_steps < 0 or args.grad_clip < 0:
        refuse("--max_steps and --grad_clip must be >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        refuse("--device cuda but no CUDA device is visible: pass --device cpu")
    for flag in ("model_path", "model_config", "data_path", "eval_data_path", "tokenizer_path"):
        path = getattr(args, flag)
        if path and not os.path.exists(path):
            refuse(f"--{flag} {path} does not exist")
    if args.from_resume and args.start_over:
        refuse("--from_resume 1 continues the run, --start_over 1 sets it aside and starts anew: pass one of them")
    check_writable(args.save_dir, "--save_dir")


# ----------------------------------------------------------------------------------------------------------------
# schedule, seeds, distributed, precision

def get_lr(step: int, total_steps: int, lr: float, warmup_steps: int = 0) -> float:
    """Linear warm-up, then cosine from lr down to 10% of lr, indexed by optimizer step (0-based)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def derived_seed(*parts: int) -> int:
    """A seed that is a pure function of its parts (e.g. seed, epoch, step, micro-batch, rank). Python's hash() is
    salted per process, so it cannot serve: a resumed run must draw exactly what the killed one would have."""
    digest = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def setup_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


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


def init_distributed_mode(device: str) -> DistInfo:
    """Join the process group torchrun describes in the environment (nccl on CUDA, gloo on CPU)."""
    if "RANK" not in os.environ:
        return DistInfo(device=device)
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    die_with_launcher()
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo")
    return DistInfo(rank, local_rank, world_size, device)


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


def autocast_context(device: str, dtype_name: str):
    """bf16/fp16 autocast on CUDA; on CPU we train in plain fp32 (CPU autocast is slow and rarely what you want)."""
    if device.startswith("cuda") and dtype_name != "float32":
        return torch.autocast("cuda", dtype=DTYPES[dtype_name])
    return contextlib.nullcontext()


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def print0(*args, **kwargs) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


# ----------------------------------------------------------------------------------------------------------------
# models

def build_model(args: argparse.Namespace, device: str, path: str | None = None,
                config_path: str | None = None, seed: int | None = None) -> torch.nn.Module:
    """fp32 weights (the master copy; autocast lowers the matmuls) from an HF folder or a config + seed."""
    if path:
        return load_pretrained(path, dtype=torch.float32, device=device)
    config = Qwen3Config.from_json(config_path or DEFAULT_MODEL_CONFIG)
    return create_model(config, seed=args.seed if seed is None else seed, device=device)


def load_sft_data(args: argparse.Namespace) -> tuple[str | None, QwenTokenizer, RowDataset, SFTCollator]:
    """-> (tokenizer folder, tokenizer, chat rows with solutions, SFT collator): what SFT and white-box KD train on.
    The tokenizer comes from --tokenizer_path, else the model folder, else the real Qwen3 files; the rows from
    --data_path, else the demo training set (generated on first use)."""
    tokenizer_dir = args.tokenizer_path or args.model_path
    tokenizer = load_tokenizer(tokenizer_dir)
    dataset = RowDataset(args.data_path or ensure_demo_data()["sft_train"])
    collator = SFTCollator(tokenizer, args.max_length, args.max_prompt_length, bool(args.enable_thinking))
    # every row rendered as the collator will, before the model is built: a bad row stops the run now, not hours in
    validate_rows(dataset, collator, need_completion=True, progress=int(os.environ.get("RANK", 0)) == 0)
    return tokenizer_dir, tokenizer, dataset, collator


def add_teacher_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("teacher")
    g.add_argument("--teacher_path", default=None,
                   help="HF folder of the teacher (same tokenizer); default: SAVE_DIR/sft, the SFT quick-start's output")
    g.add_argument("--temperature", type=float, default=1.0, help="softmax temperature of the distillation loss")


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
    """The teacher, frozen, in eval mode; in the autocast dtype on CUDA (it never needs an fp32 master copy).

    Token-level distillation compares distributions position by position, so student and teacher must mean the same
    thing by every id: their tokenizers' vocabularies are compared and a difference is refused at start-up.
    """
    teacher_tokenizer_dir = args.teacher_path if os.path.isfile(os.path.join(args.teacher_path, "tokenizer.json")) \
        else None
    teacher_tokenizer = load_tokenizer(teacher_tokenizer_dir)
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        refuse(f"the teacher's tokenizer ({teacher_tokenizer.folder}) differs from the student's "
               f"({tokenizer.folder}); token-level distillation needs the same vocabulary")
    dtype = DTYPES[args.dtype] if device.startswith("cuda") else torch.float32
    teacher = load_pretrained(args.teacher_path, dtype=dtype, device=device)
    for name, model in (("student", student), ("teacher", teacher)):
        if model.config.vocab_size < len(tokenizer):
            refuse(f"the {name}'s embedding has {model.config.vocab_size} rows, fewer than the tokenizer's "
                   f"{len(tokenizer)} tokens")
    teacher.eval().requires_grad_(False)
    return teacher


def completion_hidden(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states at the positions that predict a label, and those labels: (N, H) and (N,).

    prompt_length is the batch minimum of the completions' start: with left padding one scalar slices the batch,
    and position t predicts labels[t + 1], so hidden[:, p-1:-1] goes with labels[:, p:]. Labels are the authority:
    within the slice only positions whose label is not -100 are kept, so neither prompt nor padding ever reaches
    the lm_head or the loss; the slice is only a speed-up that keeps most prompt positions out of the gather.
    """
    has_label = (labels[:, 1:] != -100).any(dim=0)
    start = int(has_label.nonzero()[0]) + 1 if bool(has_label.any()) else labels.shape[1] - 1
    hidden = model(input_ids, attention_mask=attention_mask, return_hidden=True).hidden_states
    hidden, targets = hidden[:, start - 1:-1], labels[:, start:]
    keep = targets != -100
    return hidden[keep], targets[keep]


# ----------------------------------------------------------------------------------------------------------------
# the run: data stream, exact accumulation, optimizer step, logging, checkpoints

@dataclass
class RunState:
    epoch: int = 0
    step: int = 0                    # optimizer steps done
    samples_in_epoch: int = 0        # global samples consumed in the current epoch (a multiple of the global batch)
    swanlab_run_id: str | None = None


class Run:
    """Holds the mechanics of one training run. A script calls, in order:
    `Run(args, models...)`, then per epoch `run.windows(epoch)`, per micro-batch `run.micro_step(...)` and
    `run.backward(...)`, per window `run.optimizer_step()`, and at the end `run.finish()`."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, dataset, collate_fn, tokenizer_dir: str | None):
        self.args = args
        self.dist = init_distributed_mode(args.device)
        self.device = self.dist.device
        # seed + rank: ranks must not draw the same random numbers (dropout, sampling); the data order does not
        # depend on these RNGs at all, it is a function of (seed, epoch) in EpochSampler.
        setup_seed(args.seed + self.dist.rank)
        self.tokenizer_dir = tokenizer_dir
        self.dataset, self.collate_fn = dataset, collate_fn
        self.raw_model = model.to(self.device)
        self.raw_model.gradient_checkpointing = bool(args.gradient_checkpointing)
        self.model = torch.compile(self.raw_model) if args.use_compile else self.raw_model
        if self.dist.enabled:
            self.model = DistributedDataParallel(self.model, device_ids=[self.dist.local_rank]
                                                 if self.device.startswith("cuda") else None)
        self.optimizer = torch.optim.AdamW(self.raw_model.parameters(), lr=args.learning_rate,
                                           weight_decay=args.weight_decay, betas=(0.9, 0.95))
        use_fp16 = self.device.startswith("cuda") and args.dtype == "float16"
        self.scaler = torch.amp.GradScaler("cuda", enabled=use_fp16)
        # Micro-step losses are sums; dividing them by a fixed constant keeps fp16 gradients in range. The constant
        # is undone exactly when the window's gradients are scaled by constant * world_size / global_tokens.
        self.loss_divisor = float(args.batch_size * args.max_length)

        self.global_batch = args.batch_size * args.accumulation_steps * self.dist.world_size
        self.steps_per_epoch = math.ceil(self.micro_batches_per_epoch() / args.accumulation_steps)
        self.total_steps = args.epochs * self.steps_per_epoch
        if args.max_steps:
            self.total_steps = min(self.total_steps, args.max_steps)
        self.warmup_steps = int(args.warmup_ratio * self.total_steps)

        self.out_prefix = os.path.join(args.save_dir, args.save_weight)
        self.resume_path = f"{self.out_prefix}_resume.pt"
        self.metrics_path = f"{self.out_prefix}_metrics.jsonl"
        self.lock = RunLock(f"{self.out_prefix}.lock") if self.dist.is_main else None
        self.prepare_save_dir()
        self.state = RunState()
        if args.from_resume:
            try:
                self.resume()
            except BaseException:
                if self.lock:
                    self.lock.release()  # a refused resume leaves the folder as it found it
                raise
        self.tracker = init_tracker(args, self.state, self.dist.is_main)
        self.metrics_file = open_metrics(self.metrics_path, self.state.step) if self.dist.is_main else None
        self.window_sums: dict[str, torch.Tensor] = {}
        self.done = self.state.step >= self.total_steps
        self.saved_step = self.state.step if args.from_resume and os.path.exists(self.resume_path) else None
        self.stop_request = StopRequest(self)
        self.timer = StepTimer()
        print0(f"world {self.dist.world_size} x batch {args.batch_size} x accumulation {args.accumulation_steps} = "
               f"global batch {self.global_batch} | {len(dataset)} rows | {self.steps_per_epoch} steps/epoch | "
               f"{self.total_steps} steps | {self.raw_model.num_parameters() / 1e6:.1f}M parameters | {self.device}")

    # -- data ---------------------------------------------------------------------------------------------------

    def micro_batches_per_epoch(self) -> int:
        per_rank = len(self.dataset) // self.dist.world_size
        return math.ceil(per_rank / self.args.batch_size)

    def windows(self, epoch: int):
        """Yield the accumulation windows of an epoch: lists of up to accumulation_steps collated micro-batches
        (a last, shorter window is flushed as a step of its own). A resumed run starts where it stopped."""
        if self.done or epoch < self.state.epoch:
            return
        skip = 0
        if epoch == self.state.epoch:
            skip = batches_to_skip(self.state.samples_in_epoch, self.dist.world_size, self.args.batch_size)
        else:
            self.state.epoch, self.state.samples_in_epoch = epoch, 0
        sampler = EpochSampler(len(self.dataset), self.args.seed, epoch, self.dist.rank, self.dist.world_size)
        batches = SkipBatchSampler(sampler, self.args.batch_size, skip)
        loader = DataLoader(self.dataset, batch_sampler=batches, collate_fn=self.collate_fn,
                            num_workers=self.args.num_workers)
        window = []
        for batch in loader:
            window.append(batch)
            if len(window) == self.args.accumulation_steps:
                yield window
                window = []
                if self.done:
                    return
        if window:
            yield window

    def micro_step(self, index: int, window_size: int):
        """Context for one micro-batch's forward *and* backward: DDP syncs gradients only on the window's last."""
        if self.dist.enabled and index < window_size - 1:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def autocast(self):
        """Context for the forward passes only (backward under autocast is not recommended by PyTorch)."""
        return autocast_context(self.device, self.args.dtype)

    def backward(self, loss_sum: torch.Tensor, num_tokens: torch.Tensor | int, **extra) -> None:
        """Backward a micro-batch's *summed* loss and add its sums to the window's, without a device sync.

        `extra` holds more numbers to log, summed over the window and all ranks:
          name=tensor                -> logged as a mean over the window's loss tokens (e.g. ce=ce_sum)
          name=(numerator, denominator) -> logged as their ratio (e.g. eos_share=(num_eos, num_rows))
          count_name=tensor          -> logged as a total (e.g. count_generated_tokens=...)
        Every rank must pass the same names (they are all-reduced together)."""
        self.scaler.scale(loss_sum / self.loss_divisor).backward()
        sums = {"tokens": num_tokens, "loss": loss_sum}
        for name, value in extra.items():
            if isinstance(value, tuple):
                sums[f"{name}:num"], sums[f"{name}:den"] = value
            else:
                sums[name] = value
        for name, value in sums.items():
            value = torch.as_tensor(value).detach().to(self.device, torch.float64)
            self.window_sums[name] = self.window_sums.get(name, 0.0) + value

    def optimizer_step(self, log_extra: dict | None = None) -> dict:
        """Exact normalisation over the window and all ranks, clip, step, log, checkpoint. Returns the metrics."""
        args, state = self.args, self.state
        totals, stop_signal = self.reduce_window_sums()
        global_tokens = totals["tokens"]
        lr = get_lr(state.step, self.total_steps, args.learning_rate, self.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.scaler.unscale_(self.optimizer)
        # DDP averaged the gradients over ranks; the micro-steps divided by loss_divisor: undo both, divide by tokens.
        scale = self.loss_divisor * self.dist.world_size / max(global_tokens, 1.0)
        grads = [p.grad for p in self.raw_model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, scale)
        max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm))
        if not math.isfinite(grad_norm) and not self.scaler.is_enabled():
            raise RuntimeFailure(f"step {state.step + 1}: non-finite gradient norm ({grad_norm}); stopping "
                                     f"before it reaches the weights. Lower --learning_rate or check the data.")
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)

        state.step += 1
        state.samples_in_epoch += self.global_batch  # nominal for a short tail window: the epoch ends there
        metrics = self.window_metrics(totals, lr, grad_norm)
        metrics.update(log_extra or {})
        self.window_sums = {}
        self.log(metrics)
        self.done = state.step >= self.total_steps
        if state.step % args.save_interval == 0 or self.done or stop_signal:
            self.save()
        if stop_signal and not self.done:
            self.stop(stop_signal)
        return metrics

    def reduce_window_sums(self) -> tuple[dict[str, float], int]:
        """The window's sums over all ranks, and the stop signal any rank received (0: none) -- in one all-reduce,
        so that every rank stops after the same step even when the signal reached only some of them."""
        names = sorted(self.window_sums)
        local = torch.stack([self.window_sums[name] for name in names]
                            + [torch.tensor(float(self.stop_request.signal), dtype=torch.float64, device=self.device)])
        reduced = all_reduce_sum(local, self.dist).tolist()
        stop = self.stop_request.signal or (signal.SIGTERM if reduced[-1] else 0)
        return dict(zip(names, reduced[:-1])), int(stop)

    def window_metrics(self, totals: dict[str, float], lr: float, grad_norm: float) -> dict:
        tokens = totals.pop("tokens")
        elapsed = self.timer.tick(tokens)
        metrics = {"step": self.state.step, "epoch": self.state.epoch, "loss": totals.pop("loss") / max(tokens, 1.0),
                   "lr": lr, "grad_norm": grad_norm, "tokens": int(tokens),
                   "tokens_per_s": self.timer.tokens_per_s(), "step_ms": elapsed * 1000.0}
        for name, total in totals.items():
            if name.startswith("count_"):
                metrics[name.removeprefix("count_")] = total
            elif name.endswith(":num"):
                metrics[name.removesuffix(":num")] = total / max(totals[name.replace(":num", ":den")], 1e-12)
            elif not name.endswith(":den"):
                metrics[name] = total / max(tokens, 1.0)
        return metrics

    # -- logging --------------------------------------------------------------------------------------------------

    def log(self, metrics: dict) -> None:
        step = self.state.step
        if not self.dist.is_main or not (step % self.args.log_interval == 0 or step == 1 or self.done):
            return
        self.metrics_file.write(json.dumps(metrics) + "\n")
        self.metrics_file.flush()
        self.tracker.log({k: v for k, v in metrics.items() if k != "step"}, step=step)
        known = ("step", "epoch", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_ms")
        extra = " ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k not in known and isinstance(v, (int, float)))
        print0(f"epoch {metrics['epoch'] + 1}/{self.args.epochs} | step {step}/{self.total_steps} "
               f"({100.0 * step / self.total_steps:.0f}%) | loss {metrics['loss']:.4f} | lr {metrics['lr']:.2e} | "
               f"grad_norm(pre-clip) {metrics['grad_norm']:.3f} | tokens {metrics['tokens']} | "
               f"tok/s {metrics['tokens_per_s']:.0f} | {metrics['step_ms']:.0f} ms/step | "
               f"elapsed {format_seconds(self.timer.elapsed())} | eta {format_seconds(self.timer.eta(step, self.total_steps))}"
               + (f" | {extra}" if extra else ""))

    def log_eval(self, metrics: dict) -> None:
        """An evaluation's numbers, at the current step (rank 0 calls this; the others never evaluate)."""
        record = {"step": self.state.step, **metrics}
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        self.tracker.log(metrics, step=self.state.step)
        print0(f"eval at step {self.state.step} | " + " | ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        self.timer.last = time.perf_counter()  # evaluation time is not training time: keep it out of ms/step

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def save(self) -> None:
        """The HF folder, then the resume checkpoint (every rank's RNG gathered to rank 0), written by rank 0.

        The resume file is the commit point: it is written last, so whenever it says step N the export of step N is
        complete, and a run killed during an export resumes from the previous checkpoint and exports again."""
        rng = collect_rng_states(self.dist)
        if self.dist.is_main:
            checkpoint = {
                "format": CHECKPOINT_FORMAT,
                "model": {k: v.detach().float().cpu() for k, v in self.raw_model.state_dict().items()},
                "model_config": self.raw_model.config.to_hf_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "epoch": self.state.epoch, "step": self.state.step,
                "samples_in_epoch": self.state.samples_in_epoch, "global_batch": self.global_batch,
                "world_size": self.dist.world_size, "swanlab_run_id": self.state.swanlab_run_id,
                "args": vars(self.args), "rng": rng,
            }
            check_free_space(self.args.save_dir, self.expected_save_bytes(), f"the checkpoint of step {self.state.step}")
            try:
                save_pretrained(self.raw_model, self.out_prefix, tokenizer_dir=self.tokenizer_dir)
                with atomic_write(self.resume_path) as f:
                    torch.save(checkpoint, f)
            except (OSError, RuntimeError) as error:
                # torch.save reports a failed write as RuntimeError("unexpected pos ...") raised while handling it
                cause = error if isinstance(error, OSError) else error.__context__
                if not isinstance(cause, OSError):
                    raise
                raise_disk_error(cause, f"the checkpoint of step {self.state.step} to {self.args.save_dir} (the "
                                        f"previous checkpoint is intact)")
        self.saved_step = self.state.step
        if self.dist.enabled:
            dist.barrier()

    def expected_save_bytes(self) -> int:
        """Resume file (fp32 weights and AdamW's two moments) plus the HF export, both held beside the old ones."""
        weights = sum(p.numel() for p in self.raw_model.parameters())
        export = sum(p.numel() * p.element_size() for p in self.raw_model.parameters())
        return 3 * 4 * weights + export

    def prepare_save_dir(self) -> None:
        """Rank 0, before anything is written: take the run lock, refuse to start over a run by accident (or set it
        aside when asked), and remove what killed runs of this name left half-written."""
        if not self.dist.is_main:
            return
        self.lock.acquire()
        if os.path.exists(self.resume_path) and not self.args.from_resume:
            if not self.args.start_over:
                self.lock.release()
                raise UserError(f"{self.resume_path} holds a run of this name: continue it with --from_resume 1, or "
                                f"pass --start_over 1 to move its files aside and start anew (or another --save_weight)")
            aside = f"{self.out_prefix}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
            os.makedirs(aside)
            for path in (self.out_prefix, self.resume_path, self.metrics_path):
                if os.path.exists(path):
                    os.replace(path, os.path.join(aside, os.path.basename(path)))
            print0(f"--start_over 1: the previous run's files are in {aside}/")
        for path in (self.out_prefix, self.resume_path, self.metrics_path):
            for stale in remove_stale_temporaries(path):
                print0(f"removed {stale}, left half-written by a run that was killed")

    def stop(self, signum: int) -> None:
        """End the run after a stop signal, with the checkpoint of this step written."""
        name = signal.Signals(signum).name
        message = (f"stopped by {name} after step {self.state.step}: checkpoint {self.resume_path}; continue with "
                   f"the same command and --from_resume 1")
        self.close()
        raise Stopped(message, EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED)

    def resume(self) -> None:
        if not os.path.exists(self.resume_path):
            print0(f"--from_resume 1: no checkpoint at {self.resume_path}, starting from scratch")
            return
        checkpoint = load_checkpoint(self.resume_path, self.args, self.global_batch, self.raw_model)
        self.raw_model.load_state_dict(checkpoint["model"])
        self.optimizer.load_state_dict(checkpoint["optimizer"])
        self.scaler.load_state_dict(checkpoint["scaler"])
        self.state = RunState(checkpoint["epoch"], checkpoint["step"], checkpoint["samples_in_epoch"],
                              checkpoint["swanlab_run_id"])
        if self.state.samples_in_epoch >= (len(self.dataset) // self.dist.world_size) * self.dist.world_size:
            self.state.epoch, self.state.samples_in_epoch = self.state.epoch + 1, 0
        restore_rng_states(checkpoint["rng"], checkpoint["world_size"], self.dist, self.args.seed, self.state.step)
        print0(f"resumed from {self.resume_path}: epoch {self.state.epoch + 1}, step {self.state.step}, "
               f"{self.state.samples_in_epoch} samples into the epoch (saved by {checkpoint['world_size']} ranks)")

    def finish(self) -> None:
        self.close()
        print0(f"done: {self.state.step} steps in {format_seconds(self.timer.elapsed())}"
               + (f", peak CUDA memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
                  if self.device.startswith("cuda") else "") + f" -> {self.out_prefix}/")

    def close(self) -> None:
        """Flush the logs, give back the lock, the signal handlers and the process group."""
        self.stop_request.restore()
        self.tracker.finish()
        if self.metrics_file:
            self.metrics_file.close()
        if self.lock:
            self.lock.release()
        if self.dist.enabled:
            dist.barrier()
            dist.destroy_process_group()

    def last_checkpoint(self) -> str:
        if self.saved_step is None:
            return "no checkpoint yet"
        return f"last checkpoint {self.resume_path} (step {self.saved_step})"


def open_metrics(path: str, resumed_step: int):
    """metrics.jsonl for appending. A resumed run keeps the lines up to its checkpoint's step and drops those the
    killed run logged after it (they are logged again), so every step appears once. A fresh run starts it anew."""
    kept = []
    if resumed_step and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resumed_step]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(kept)
    return open(path, "a", encoding="utf-8")


# Flags that may differ on resume: they change how the run is executed or logged, not what it computes.
RESUMABLE_CHANGES = {"from_resume", "device", "num_workers", "log_interval", "save_interval", "use_swanlab",
                     "swanlab_mode", "swanlab_project", "batch_size", "accumulation_steps", "use_compile",
                     "gradient_checkpointing", "max_steps", "eval_interval", "eval_rows", "eval_data_path",
                     "eval_max_new_tokens", "save_dir", "start_over"}


def load_checkpoint(path: str, args: argparse.Namespace, global_batch: int, model: torch.nn.Module) -> dict:
    """Read a resume checkpoint and check it belongs to this run; a damaged or foreign one is a clear error."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # torch raises several types for a truncated or corrupt zip; all mean the same
        raise UserError(f"{path} is damaged and cannot be read ({type(error).__name__}: {str(error)[:120]}). Restore "
                        f"it from a backup, or pass --start_over 1 (without --from_resume) to set it aside and start "
                        f"anew") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"{path} is not a resume checkpoint of this project (format "
                        f"{checkpoint.get('format') if isinstance(checkpoint, dict) else type(checkpoint).__name__})")
    if checkpoint["model_config"] != model.config.to_hf_dict():
        raise UserError(f"{path} was written for another model configuration; resume with the same "
                        f"--model_path/--model_config, or use another --save_weight")
    saved = checkpoint["args"]
    changed = {k: (saved.get(k), v) for k, v in vars(args).items()
               if k not in RESUMABLE_CHANGES and k in saved and saved[k] != v}
    if changed:
        details = ", ".join(f"--{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise UserError(f"{path} was written with other settings ({details}); resume with the original flags "
                        f"or use another --save_weight")
    if checkpoint["global_batch"] != global_batch:
        raise UserError(f"{path}: global batch was {checkpoint['global_batch']} (world x batch x accumulation), "
                        f"now {global_batch}; keep the global batch to continue the same sample stream")
    return checkpoint


def collect_rng_states(info: DistInfo) -> list[dict] | None:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    if not info.enabled:
        return [state]
    gathered = [None] * info.world_size if info.is_main else None
    dist.gather_object(state, gathered, dst=0)
    return gathered


def restore_rng_states(states: list[dict], saved_world_size: int, info: DistInfo, seed: int, step: int) -> None:
    """Each rank takes back its own RNG state. After a world-size change there is no rank-to-rank mapping, so
    every rank re-seeds from (seed, rank, step) instead: reproducible, though not the uninterrupted stream."""
    if saved_world_size != info.world_size:
        setup_seed(seed + info.rank + 1_000_003 * step)
        return
    state = states[info.rank]
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------------------------
# one run per name, and a graceful stop on a signal

def _process_start_time(pid: int) -> str | None:
    """The kernel's start time of a running process (Linux), None when there is none: tells a live lock holder from
    a new process that reuses its PID. A zombie (killed, not yet reaped) does not run."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


class RunLock:
    """`SAVE_DIR/NAME.lock` (host, PID): a second run with the same name is refused, naming the holder. A lock left
    by a process that no longer runs on this host is taken over with a message; one from another host (a shared
    file system) is never guessed about."""

    def __init__(self, path: str):
        self.path, self.held = path, False
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "start": _process_start_time(os.getpid())}

    def acquire(self) -> None:
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
            except FileExistsError:
                self.take_over_if_stale()
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.me, f)
            self.held = True
            atexit.register(self.release)  # a run that fails on an exception gives it back too; SIGKILL cannot
            return
        raise UserError(f"cannot take the run lock {self.path}: it keeps reappearing (another run is starting?)")

    def take_over_if_stale(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                holder = json.load(f)
        except (OSError, ValueError):
            holder = {}  # half-written by a process killed while taking it: nobody holds it
        same_host = holder.get("host") == self.me["host"]
        pid = holder.get("pid")
        alive = isinstance(pid, int) and _process_start_time(pid) is not None \
            and _process_start_time(pid) == holder.get("start")
        if holder and not same_host:
            raise UserError(f"{self.path}: a run of this name is held by PID {pid} on host {holder.get('host')}; "
                            f"wait for it or stop it, use another --save_weight, or delete the lock file if that "
                            f"run is gone")
        if alive and pid != os.getpid():
            raise UserError(f"{self.path}: a run of this name is in progress (PID {pid} on this host); wait for it "
                            f"or stop it (kill {pid}), or use another --save_weight")
        if holder and pid != os.getpid():
            print0(f"taking over {self.path}: its run (PID {pid}) is no longer running")
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.path)

    def release(self) -> None:
        if self.held:
            self.held = False
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)


class StopRequest:
    """SIGTERM / SIGUSR1 (a scheduler's preemption notice) and Ctrl-C: note the signal; the run finishes the current
    optimizer step on every rank, saves and stops (`Run.optimizer_step`). A second Ctrl-C stops at once, saying
    where the last checkpoint is."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self, run: "Run"):
        self.run, self.signal = run, 0
        self.previous = {signum: signal.signal(signum, self.handle) for signum in self.SIGNALS}

    def handle(self, signum: int, frame) -> None:
        if self.signal == signal.SIGINT and signum == signal.SIGINT:
            self.restore()
            raise Stopped(f"interrupted at step {self.run.state.step}: {self.run.last_checkpoint()}; continue with "
                          f"the same command and --from_resume 1", EXIT_INTERRUPTED)
        if self.signal:
            return
        self.signal = signum
        print0(f"\n{signal.Signals(signum).name}: finishing step {self.run.state.step + 1}, then saving and stopping"
               + (" (Ctrl-C again to stop at once)" if signum == signal.SIGINT else ""))

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}


# ----------------------------------------------------------------------------------------------------------------
# trackers and timers

class NullTracker:
    """Stands in for swanlab when it is off, so the loop has no `if use_swanlab` clutter."""

    def log(self, metrics: dict, step: int) -> None:
        pass

    def finish(self) -> None:
        pass


class SwanlabTracker:
    def __init__(self, run):
        import swanlab
        self.swanlab, self.run = swanlab, run

    def log(self, metrics: dict, step: int) -> None:
        self.swanlab.log(metrics, step=step)

    def finish(self) -> None:
        self.swanlab.finish()


def init_tracker(args: argparse.Namespace, state: RunState, is_main: bool):
    """swanlab on rank 0 with the run's flags as its config; a resumed run continues the same run id."""
    if not (args.use_swanlab and is_main) or args.swanlab_mode == "disabled":
        return NullTracker()
    import swanlab
    mode = {"cloud": "online"}.get(args.swanlab_mode, args.swanlab_mode)
    run = swanlab.init(project=args.swanlab_project, name=args.save_weight, mode=mode, config=vars(args),
                       log_dir=os.path.join(args.save_dir, "swanlog"), id=state.swanlab_run_id,
                       resume="allow" if state.swanlab_run_id else None)
    state.swanlab_run_id = run.id
    return SwanlabTracker(run)


class StepTimer:
    """Wall time per optimizer step and tokens/s; the first step (warm-up, compilation) is left out of rates."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.steps_timed, self.time_timed, self.tokens_timed, self.ticks = 0, 0.0, 0.0, 0
        self.last_rate = self.last_step_s = 0.0

    def tick(self, tokens: float) -> float:
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        self.ticks += 1
        self.last_step_s = elapsed
        self.last_rate = tokens / max(elapsed, 1e-9)
        if self.ticks > 1:
            self.steps_timed += 1
            self.time_timed += elapsed
            self.tokens_timed += tokens
        return elapsed

    def tokens_per_s(self) -> float:
        return self.tokens_timed / self.time_timed if self.time_timed else self.last_rate

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def eta(self, step: int, total: int) -> float:
        per_step = self.time_timed / self.steps_timed if self.steps_timed else self.last_step_s
        return per_step * (total - step)


class PhaseClock:
    """Seconds spent per phase of a step (e.g. generation vs training), synchronising CUDA so the split is honest."""

    def __init__(self, device: str):
        self.device, self.seconds = device, {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def summary(self) -> dict[str, float]:
        total = sum(self.seconds.values())
        return {**{f"{phase}_s": s for phase, s in self.seconds.items()},
                **{f"{phase}_share": s / max(total, 1e-9) for phase, s in self.seconds.items()}}


def format_seconds(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
