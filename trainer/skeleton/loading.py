"""Loading what a loop trains: the student (from an HF folder or a config and a seed, sharded with --fsdp 1), the
tokenizer, and the rows -- every row rendered and checked before any model is built, so a bad row stops the run
at start-up, not hours in. The frozen models a loss reads (a teacher, a reference) load in
trainer/teachers/frozen.py."""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from common.errors import refuse
from dataset.collators import PairCollator, PromptCollator, SFTCollator, validate_rows
from dataset.make_demo_data import ensure_demo_data, ensure_demo_pairs
from dataset.sources import PairDataset, RowDataset
from model import Qwen3Config, Qwen3ForCausalLM, load_pretrained, load_tokenizer
from model.lora import add_lora, init_adapters
from model.precision import frozen_dtype, resolve_precision
from model.tokenizer import QwenTokenizer
from trainer.skeleton.distributed import is_main_process, print0
from trainer.skeleton.sharding import random_model, shard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
DEFAULT_MODEL_CONFIG = os.path.join(ROOT, "model", "configs", "qwen3-tiny.json")


def build_model(args: argparse.Namespace, device: str, path: str | None = None,
                config_path: str | None = None, seed: int | None = None,
                lora: dict | None = None, model_class: type[Qwen3ForCausalLM] = Qwen3ForCausalLM,
                body_only: bool = False) -> torch.nn.Module:
    """fp32 weights (the master copy; autocast lowers the matmuls) from an HF folder or a config + seed. With
    --fsdp 1 on several ranks the model comes sharded, each rank having built and filled only its own shards.
    `lora` (add_lora's settings): LoRA adapters on the frozen base, which is then held in a frozen model's dtype
    (model/precision.py's `frozen_dtype`: the autocast dtype -- bf16 on CUDA: half the bytes, and the matmuls take
    it as it is --, but under fp16 bf16 or fp32, as a teacher's); added before sharding, so FSDP shards them too.
    `model_class`, `body_only`: PPO's critic (model/value.py), its body from a causal LM's folder
    (checkpoint_io.load_pretrained)."""
    sharded = sharding_ranks(args)
    precision = resolve_precision(device, args.dtype)
    frozen = frozen_dtype(precision.device_type, precision.compute)
    dtype, seed = frozen if lora else precision.master, args.seed if seed is None else seed

    def adapt_and_shard(model: torch.nn.Module) -> None:
        if lora:
            add_lora(model, **lora, seed=None)  # on the meta device: filled once the base is (`init_adapters`)
        if sharded:
            shard(model, precision.device_type, precision.compute)

    if path:
        print0(f"loading {path} on {device}" + (" (each rank its shards)" if sharded else ""))
        model = load_pretrained(path, dtype=dtype, device=device, shard=adapt_and_shard, model_class=model_class,
                                body_only=body_only)
    else:
        config_path = config_path or DEFAULT_MODEL_CONFIG
        print0(f"random weights from {os.path.relpath(config_path)} on {device}")
        model = random_model(Qwen3Config.from_json(config_path), seed, device, adapt_and_shard, dtype, model_class)
    if lora:
        init_adapters(model, seed)
    return model


def build_student(args: argparse.Namespace, device: str, tokenizer: QwenTokenizer) -> torch.nn.Module:
    """The student: --model_path's weights, or --model_config's random init (`build_model`), with an embedding row
    for every token of the tokenizer; with --lora_rank, LoRA adapters on its frozen base."""
    student = build_model(args, device, path=args.model_path, config_path=args.model_config, lora=lora_settings(args))
    check_embedding(student, tokenizer, "student")
    return student


def lora_settings(args: argparse.Namespace) -> dict | None:
    """--lora_* as add_lora's keywords (model/lora.py); None without --lora_rank."""
    if not args.lora_rank:
        return None
    return {"rank": args.lora_rank, "alpha": args.lora_alpha, "dropout": args.lora_dropout,
            "targets": tuple(args.lora_targets.split(","))}


def check_embedding(model: torch.nn.Module, tokenizer: QwenTokenizer, role: str) -> None:
    """Token-level losses read every token's row of the embedding and the lm_head: a model with fewer rows than the
    tokenizer has tokens is refused at start-up."""
    if model.config.vocab_size < len(tokenizer):
        refuse(f"the {role}'s embedding has {model.config.vocab_size} rows, fewer than the tokenizer's "
               f"{len(tokenizer)} tokens")


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
    collator = sft_collator(args, tokenizer)
    check_rows(dataset, collator, need_completion=True)
    return tokenizer_dir, tokenizer, dataset, collator


def load_prompt_data(args: argparse.Namespace, default_rows: str,
                     need_completion: bool) -> tuple[str | None, QwenTokenizer, RowDataset, PromptCollator]:
    """-> (tokenizer folder, tokenizer, prompt rows, prompt collator): what an on-policy loop samples from. The rows
    come from --data_path, else the demo's `default_rows` set; `need_completion`: some steps also train on the rows'
    own completions (they are checked as SFT renders them)."""
    tokenizer_dir = args.tokenizer_path or args.model_path
    tokenizer = load_tokenizer(tokenizer_dir)
    dataset = RowDataset(args.data_path or ensure_demo_data()[default_rows])
    collator = PromptCollator(tokenizer, args.max_prompt_length, bool(args.enable_thinking))
    check_rows(dataset, sft_collator(args, tokenizer) if need_completion else collator, need_completion)
    return tokenizer_dir, tokenizer, dataset, collator


def load_pair_data(args: argparse.Namespace) -> tuple[str | None, QwenTokenizer, PairDataset, PairCollator,
                                                     list[dict]]:
    """-> (tokenizer folder, tokenizer, preference pairs, pair collator, held-out pairs): what DPO trains on. The
    pairs come from --data_path, else the demo's synthetic pairs (dataset/make_demo_data.py, written on first use);
    the held-out ones, with --eval_interval, are the first --eval_rows of --eval_data_path, else of the demo's
    held-out pairs. Every pair of both files is rendered and checked now, before any model is built."""
    tokenizer_dir = args.tokenizer_path or args.model_path
    tokenizer = load_tokenizer(tokenizer_dir)
    dataset = PairDataset(args.data_path or ensure_demo_pairs()["train"])
    collator = PairCollator(sft_collator(args, tokenizer))
    check_rows(dataset, collator, need_completion=False)
    print0(f"preference pairs in the {dataset.schema} schema")
    held_out = []
    if args.eval_interval:
        eval_pairs = PairDataset(args.eval_data_path or ensure_demo_pairs()["eval"])
        check_rows(eval_pairs, collator, need_completion=False)
        held_out = [eval_pairs[i] for i in range(min(args.eval_rows, len(eval_pairs)))]
    return tokenizer_dir, tokenizer, dataset, collator, held_out


def sft_collator(args: argparse.Namespace, tokenizer: QwenTokenizer) -> SFTCollator:
    """Rows with completions, rendered by the chat template, labels on the completion only."""
    return SFTCollator(tokenizer, args.max_length, args.max_prompt_length, bool(args.enable_thinking))


def check_rows(dataset: RowDataset, collator, need_completion: bool) -> None:
    """Every row rendered as the collator will, before any model is built: a bad row stops the run now, not hours
    in (every rank checks; they all reach the same verdict, so none is left waiting)."""
    print0(f"checking {len(dataset):,} rows of {os.path.relpath(dataset.path)}")
    validate_rows(dataset, collator, need_completion=need_completion, progress=is_main_process())
