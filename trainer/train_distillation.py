"""Classic white-box knowledge distillation on fixed data: alpha * CE + (1 - alpha) * T^2 KL(teacher || student).

    python trainer/train_sft.py && python trainer/train_distillation.py   # CPU demo: a smaller student learns
                                                                           # from the SFT quick-start model
    python trainer/train_distillation.py --model_path Qwen3-0.6B --teacher_path Qwen3-4B --data_path sft.parquet \
        --device cuda --batch_size 4 --accumulation_steps 8 --max_length 2048 --learning_rate 1e-5
    torchrun --nproc_per_node 4 trainer/train_distillation.py --model_path Qwen3-0.6B --teacher_path Qwen3-4B ...
    ... --from_resume 1
    ... --teachers teachers.json --default_teacher math   # each row from the teacher its `teacher` column names

Per micro-batch: collate the fixed conversations (labels on the completion only), run the frozen teacher without
gradients to its hidden states at the completion positions (several teachers: each on its own rows), run the
student with gradients, and sum per token the cross entropy against the data and the temperature-softened forward
KL to the row's teacher, chunk by chunk over the full vocabulary. The skeleton normalises by the window's loss
tokens over all ranks, clips and steps.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from common.errors import ArgumentParser, refuse, run_script
from trainer.skeleton.guard import stop_signals_noted
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.skeleton.distributed import init_distributed_mode
from trainer.losses.divergences import evaluation_divergence
from trainer.config.flags import ROOT, add_common_args, add_teacher_args, resolve_teacher_path, validate_common_args
from trainer.skeleton.loading import build_model, load_sft_data
from trainer.losses.chunked import chunked_loss, completion_hidden
from trainer.losses.closed_forms import distillation_loss, sft_loss
from trainer.skeleton.run import Run
from trainer.teachers.parts import add_part_metrics, part_scores, split_by_teacher
from trainer.teachers.teacher_set import (RoutedCollator, add_teachers_args, check_teachers, load_teachers, routing, say_teachers,
                              teacher_specs, validate_teachers_args)

DEFAULT_STUDENT_CONFIG = os.path.join(ROOT, "model", "configs", "qwen3-tiny-student.json")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="White-box KD of a Qwen3 student from a same-tokenizer teacher")
    add_common_args(parser, save_weight="kd")
    add_teacher_args(parser)
    add_teachers_args(parser)
    parser.add_argument("--alpha", type=float, default=0.5, help="weight of the cross entropy (1 - alpha: KD)")
    args = parser.parse_args(argv)
    if not args.model_path and not args.model_config:
        args.model_config = DEFAULT_STUDENT_CONFIG
    validate_common_args(args)
    if not args.teachers:
        resolve_teacher_path(args)
    validate_teachers_args(args, teacher_specs(args), served=False)
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
    specs = teacher_specs(args)
    routing(args, specs).check(dataset)  # every row's teacher is one of the run's, before any model loads
    servers = check_teachers(args, specs, tokenizer, dataset)  # vocabularies and chat templates
    student = build_model(args, info.device, path=args.model_path, config_path=args.model_config)
    teachers = load_teachers(args, specs, servers, tokenizer, student, info.device)
    run = Run(args, info, student, dataset, RoutedCollator(collator, teachers.routes), tokenizer_dir)
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step,  # each rank its share (--fsdp 1: all)
                                 **teachers.for_evaluation(lambda t: evaluation_divergence(1.0, local_teacher=True)))
    say_teachers(teachers)

    if evaluator.due(run.step, run.done):  # step 0: the baseline later evaluations compare against
        run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, run.teacher_autocast))
    for epoch, window in run.windows():
        for i, batch in enumerate(window):
            batch = {k: v.to(run.device) for k, v in batch.items()}
            parts = split_by_teacher(teachers, batch["teacher_index"], batch["labels"])  # each teacher its rows
            teacher_hidden = [part_scores(part, None, run.teacher_autocast, batch["input_ids"],  # no gradients
                                          batch["attention_mask"], batch["labels"]) for part in parts]
            with run.micro_step(i, len(window)):  # DDP: gradients sync on the window's last micro-batch
                with run.autocast():
                    student_hidden, targets = completion_hidden(run.model, batch["input_ids"],
                                                                batch["attention_mask"], batch["labels"])
                    ce_sum = kd_sum = num_tokens = 0
                    for part, hidden in zip(parts, teacher_hidden):  # the loss of each row against its teacher
                        ce, kd, tokens = (0, 0, 0) if part.empty else chunked_loss(
                            functools.partial(ce_and_kd, temperature=args.temperature), part.select(student_hidden),
                            run.raw_model.lm_head.weight, part.select(targets), hidden, part.teacher.lm_head_weight,
                            chunk_size=args.loss_chunk_size, vocab_size=len(tokenizer))
                        ce_sum, kd_sum, num_tokens = ce_sum + ce, kd_sum + kd, num_tokens + tokens
                        add_part_metrics(run.metrics, teachers, part, args.alpha * ce + (1.0 - args.alpha) * kd,
                                         tokens)
                run.backward(args.alpha * ce_sum + (1.0 - args.alpha) * kd_sum, num_tokens)
                run.metrics.token_mean("ce", ce_sum)
                run.metrics.token_mean("kd", kd_sum)
            teachers.reshard()  # a sharded teacher's head, gathered for its forward, is read until here
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        run.log(metrics, show=("ce", "kd") + teachers.shown())  # console, metrics.jsonl, swanlab
        if run.save_due():              # every --save_interval steps, the last one, and on a stop signal
            run.save()
        if evaluator.due(run.step, run.done):  # every --eval_interval steps and the last one
            run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, run.teacher_autocast))
        if run.done or run.stop_signal:  # --epochs / --max_steps reached, or SIGTERM / SIGUSR1 / Ctrl-C
            break
    run.finish()


if __name__ == "__main__":
    run_script(main)
