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
KL to the row's teacher (or DistiLLM's skew KL / skew reverse KL: --divergence skew_kl / skew_rkl --skew a),
chunk by chunk over the full vocabulary. The skeleton normalises by the window's loss tokens over all ranks, clips
and steps.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.errors import run_script
from trainer.config import distillation as config
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.losses.chunked import completion_hidden
from trainer.losses.divergences import Divergence, evaluation_divergence
from trainer.skeleton import Run, build_student, init_distributed_mode, load_sft_data, train_noting_stop_signals
from trainer.teachers.specs import RoutedCollator, teacher_specs
from trainer.teachers.teacher_set import open_teachers


def main(argv: list[str] | None = None) -> None:
    train_noting_stop_signals(train, config.parse_args(argv))  # a stop signal from here on: the step ends, saved


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)  # first: each rank builds its models on its own device
    tokenizer_dir, tokenizer, dataset, collator = load_sft_data(args)
    # rows routed, vocabularies and chat templates checked, then loaded (several teachers: each row's its own)
    teachers = open_teachers(args, teacher_specs(args), tokenizer, dataset, info.device,
                             training=lambda t: Divergence("kd", temperature=args.temperature, alpha=args.alpha,
                                                           kd_divergence=args.divergence, skew=args.skew),
                             evaluation=lambda t: evaluation_divergence(1.0, local_teacher=True))
    student = build_student(args, info.device, tokenizer)
    run = Run(args, info, student, dataset, RoutedCollator(collator, teachers.routes), tokenizer_dir, config.RESUMABLE)
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step, **teachers.for_evaluation())  # each rank its share
    vocab, chunk = len(tokenizer), args.loss_chunk_size

    run.evaluate_when_due(evaluator)  # step 0: the baseline later evaluations compare against
    for epoch, window in run.windows():
        for i, batch in enumerate(window):
            batch = {k: v.to(run.device) for k, v in batch.items()}
            input_ids, attention_mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
            scores = teachers.score(batch, input_ids, attention_mask, labels, run.teacher_autocast)  # no gradients
            with run.micro_step(i, len(window)):  # DDP: gradients sync on the window's last micro-batch
                with run.autocast():
                    hidden, targets = completion_hidden(run.model, input_ids, attention_mask, labels)
                    # per token: alpha CE against the data + (1 - alpha) T^2 KL(row's teacher || student)
                    loss_sum, num_tokens = teachers.loss(scores, hidden, run.head, targets, chunk, vocab, run.metrics)
                run.backward(loss_sum, num_tokens)
            teachers.reshard()  # a sharded teacher's head, gathered for its forward, is read until here
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        if run.end_step(metrics, ("ce", "kd") + teachers.shown(), evaluator):  # log; save, evaluate when due
            break  # --epochs / --max_steps reached, or SIGTERM / SIGUSR1 / Ctrl-C
    run.finish()


if __name__ == "__main__":
    run_script(main)
