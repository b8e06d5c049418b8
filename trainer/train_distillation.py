"""Classic white-box knowledge distillation on fixed data: alpha * CE + (1 - alpha) * T^2 KL(teacher || student).

    python trainer/train_sft.py && python trainer/train_distillation.py   # CPU demo: a smaller student learns
                                                                           # from the SFT quick-start model
    python trainer/train_distillation.py --model_path Qwen3-0.6B --teacher_path Qwen3-4B --data_path sft.parquet \
        --device cuda --batch_size 4 --accumulation_steps 8 --max_length 2048 --learning_rate 1e-5
    torchrun --nproc_per_node 4 trainer/train_distillation.py --model_path Qwen3-0.6B --teacher_path Qwen3-4B ...
    ... --from_resume 1

Per micro-batch: collate the fixed conversations (labels on the completion only), run the frozen teacher without
gradients to its hidden states at the completion positions, run the student with gradients, and sum per token the
cross entropy against the data and the temperature-softened forward KL to the teacher, chunk by chunk over the
full vocabulary. The skeleton normalises by the window's loss tokens over all ranks, clips and steps.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from common.errors import ArgumentParser, refuse, run_script
from trainer.guard import stop_signals_noted
from trainer.heldout import HeldoutEvaluator
from trainer.distributed import init_distributed_mode
from trainer.divergences import evaluation_divergence
from trainer.flags import ROOT, add_common_args, add_teacher_args, resolve_teacher_path, validate_common_args
from trainer.frozen import frozen_hidden, load_frozen
from trainer.loading import build_model, load_sft_data
from trainer.chunked_losses import chunked_loss, completion_hidden
from trainer.losses import distillation_loss, sft_loss
from trainer.run import Run
from trainer.sharding import reshard_root

DEFAULT_STUDENT_CONFIG = os.path.join(ROOT, "model", "configs", "qwen3-tiny-student.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="White-box KD of a Qwen3 student from a same-tokenizer teacher")
    add_common_args(parser, save_weight="kd")
    add_teacher_args(parser)
    parser.add_argument("--alpha", type=float, default=0.5, help="weight of the cross entropy (1 - alpha: KD)")
    args = parser.parse_args(argv)
    if not args.model_path and not args.model_config:
        args.model_config = DEFAULT_STUDENT_CONFIG
    validate_common_args(args)
    resolve_teacher_path(args)
    if not 0.0 <= args.alpha <= 1.0:
        refuse(f"--alpha must be in [0, 1], got {args.alpha}")
    return args


def ce_and_kd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
              temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of positions: summed cross entropy against the data, summed T^2 KL(teacher || student), tokens."""
    ce_sum, num_tokens = sft_loss(student_logits, labels)
    kd_sum = distillation_loss(student_logits, teacher_logits, labels, temperature, reduction="sum")
    return ce_sum, kd_sum, num_tokens


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with stop_signals_noted():  # SIGTERM / SIGUSR1 from here on: the step is finished and saved; at the end
        train(args)            # (done, refused or failed) the process's own handlers are back


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)  # first: each rank builds its models on its own device
    tokenizer_dir, tokenizer, dataset, collator = load_sft_data(args)
    student = build_model(args, info.device, path=args.model_path, config_path=args.model_config)
    teacher = load_frozen(args, args.teacher_path, tokenizer, student, info.device)
    run = Run(args, info, student, dataset, collator, tokenizer_dir)
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step,  # each rank its share (--fsdp 1: all)
                                 divergence=evaluation_divergence(1.0, local_teacher=True), teacher=teacher)

    if evaluator.due(run.step, run.done):  # step 0: the baseline later evaluations compare against
        run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, run.teacher_autocast))
    for epoch, window in run.windows():
        for i, batch in enumerate(window):
            batch = {k: v.to(run.device) for k, v in batch.items()}
            teacher_hidden = frozen_hidden(teacher, run.teacher_autocast, batch["input_ids"],  # no gradients
                                           batch["attention_mask"], batch["labels"])
            with run.micro_step(i, len(window)):  # DDP: gradients sync on the window's last micro-batch
                with run.autocast():
                    student_hidden, targets = completion_hidden(run.model, batch["input_ids"],
                                                                batch["attention_mask"], batch["labels"])
                    ce_sum, kd_sum, num_tokens = chunked_loss(
                        functools.partial(ce_and_kd, temperature=args.temperature), student_hidden,
                        run.raw_model.lm_head.weight, targets, teacher_hidden, teacher.lm_head.weight,
                        chunk_size=args.loss_chunk_size, vocab_size=len(tokenizer))
                run.backward(args.alpha * ce_sum + (1.0 - args.alpha) * kd_sum, num_tokens)
                run.metrics.token_mean("ce", ce_sum)
                run.metrics.token_mean("kd", kd_sum)
            reshard_root(teacher)  # a sharded teacher's head, gathered for its forward, is read until here
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        run.log(metrics, show=("ce", "kd"))  # console, metrics.jsonl, swanlab: every --log_interval steps
        if run.save_due():              # every --save_interval steps, the last one, and on a stop signal
            run.save()
        if evaluator.due(run.step, run.done):  # every --eval_interval steps and the last one
            run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, run.teacher_autocast))
        if run.done or run.stop_signal:  # --epochs / --max_steps reached, or SIGTERM / SIGUSR1 / Ctrl-C
            break
    run.finish()


if __name__ == "__main__":
    run_script(main)
