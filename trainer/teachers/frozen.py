"""The slot of a frozen model that a loss reads: the teacher of KD and OPD today; a KL anchor or an RL loop's
reference model next. Loaded once, in the precision rule's frozen-model dtype (model/precision.py: it never needs
an fp32 master copy), evaluation mode, no gradients; sharded with --fsdp 1 unless --replicate_teacher 1; its
vocabulary checked against the student's, since token-level losses compare distributions id by id."""
from __future__ import annotations

import argparse
import os

import torch

from common.errors import refuse
from model import Qwen3Config, create_model, load_pretrained, load_tokenizer
from model.lora import adapter_count, adapters_disabled
from model.precision import resolve_precision
from trainer.losses.chunked import completion_hidden
from trainer.skeleton.distributed import print0
from trainer.skeleton.loading import check_embedding, sharding_ranks
from trainer.skeleton.sharding import shard


def load_frozen(args: argparse.Namespace, path: str, tokenizer, device: str, role: str = "teacher") -> torch.nn.Module:
    """The frozen model at `path` (`role` names it in messages), in evaluation mode without gradients.

    Token-level losses compare distributions position by position, so student and frozen model must mean the same
    thing by every id: their tokenizers' vocabularies are compared and a difference is refused at start-up.
    """
    same_vocabulary(path, tokenizer, role)
    frozen = read_frozen(args, path, device, role)
    check_embedding(frozen, tokenizer, role)
    frozen.eval().requires_grad_(False)
    return frozen


def same_vocabulary(path: str, tokenizer, role: str = "teacher"):
    """The tokenizer of the model at `path` (its folder's files, else the packaged Qwen3 ones), refused unless its
    vocabulary is the student's `tokenizer`'s."""
    own_tokenizer = load_tokenizer(path if os.path.isfile(os.path.join(path, "tokenizer.json")) else None)
    if not own_tokenizer.same_vocabulary(tokenizer):
        refuse(f"the {role}'s tokenizer ({own_tokenizer.folder}) differs from the student's ({tokenizer.folder}); "
               f"token-level distillation needs the same vocabulary")
    return own_tokenizer


def read_frozen(args: argparse.Namespace, path: str, device: str, role: str = "teacher") -> torch.nn.Module:
    """The weights at `path` straight in the frozen dtype (model/precision.py: the autocast dtype, bf16 under fp16,
    or --teacher_dtype). With --fsdp 1 on several ranks sharded, each rank reading only its own rows (its shards
    are gathered layer by layer for the forward), unless --replicate_teacher 1: then whole on every rank."""
    precision = resolve_precision(device, args.dtype, args.teacher_dtype)
    dtype = precision.teacher
    sharded = sharding_ranks(args) and not args.replicate_teacher
    print0(f"loading the {role} {path} on {device}" + (" (each rank its shards)" if sharded else ""))
    return load_pretrained(path, dtype=dtype, device=device,
                           shard=(lambda m: shard(m, precision.device_type, dtype)) if sharded else None)


class BaseOf:
    """A LoRA student's frozen base as a reference model: its forward is the student's with the adapters switched off
    (model/lora.py) and without gradients; its head is the student's (frozen). The student's own module, not a copy:
    no weight is held twice."""

    def __init__(self, student: torch.nn.Module):
        self.student, self.lm_head, self.config = student, student.lm_head, student.config

    def __call__(self, *args, **kwargs):
        with torch.no_grad(), adapters_disabled(self.student):
            return self.student(*args, **kwargs)

    @property
    def pack_rows(self) -> bool:  # completion_hidden's packed forward, as the student runs it
        return self.student.pack_rows


@torch.no_grad()
def frozen_hidden(model: torch.nn.Module, autocast, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  labels: torch.Tensor) -> torch.Tensor:
    """A frozen model's final hidden states at the completion positions (its lm_head is applied chunk by chunk
    inside the loss). `autocast`: its own forward context (Run.teacher_autocast), outside the student's: under fp16
    the student's autocast would lower a bf16 model's matmuls to fp16 (model/precision.py)."""
    with autocast():
        return completion_hidden(model, input_ids, attention_mask, labels)[0]


def load_reference(args: argparse.Namespace, tokenizer, device: str, student: torch.nn.Module) -> torch.nn.Module:
    """The frozen model a KL anchor holds the student to: --reference_path, else the student's own starting point
    (`load_start`)."""
    return load_start(args, tokenizer, device, student, args.reference_path)


def load_start(args: argparse.Namespace, tokenizer, device: str, student: torch.nn.Module, path: str | None,
               role: str = "reference") -> torch.nn.Module:
    """The model at `path`, frozen, else the student's own starting point -- a LoRA student's own base, its adapters
    switched off (`BaseOf`: no second copy); its --model_path; or with --model_config the same random init (the
    config and --seed), built again and frozen. `role` names it in messages."""
    if adapter_count(student) and not path:
        print0(f"the {role}: the LoRA student's own base, its adapters switched off (no second copy)")
        return BaseOf(student)
    path = path or args.model_path
    if path:
        return load_frozen(args, path, tokenizer, device, role=role)
    print0(f"the {role}: the student's random init again ({os.path.relpath(args.model_config)}, seed {args.seed})")
    precision = resolve_precision(device, args.dtype, args.teacher_dtype)
    start = create_model(Qwen3Config.from_json(args.model_config), seed=args.seed, device=device)
    return start.to(precision.teacher).eval().requires_grad_(False)
