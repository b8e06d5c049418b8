"""SFT on teacher-written solutions: masked cross entropy on the completion tokens.

    python trainer/train_sft.py                                   # CPU demo: tiny Qwen3, demo data, a few minutes
    python trainer/train_sft.py --model_path Qwen3-0.6B --data_path sft.parquet --device cuda \
        --batch_size 8 --accumulation_steps 4 --max_length 2048 --learning_rate 1e-5
    torchrun --nproc_per_node 4 trainer/train_sft.py --model_path Qwen3-0.6B --data_path sft.parquet ...
    ... --from_resume 1                                           # after a preemption: continue exactly

Per optimizer step: for each micro-batch of the accumulation window, collate (chat template, prompt/completion
boundary, right padding), run the model to its final hidden states, and sum the cross entropy over the completion
tokens chunk by chunk through the lm_head (the full B x T x V logits never exist). The skeleton then divides the
window's gradient by the number of loss tokens of the whole window on all ranks, clips and steps.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.errors import run_script
from trainer.config import sft as config
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.losses.chunked import completion_hidden
from trainer.losses.fused_linear import fused_cross_entropy
from trainer.skeleton import Run, build_student, init_distributed_mode, load_sft_data, train_noting_stop_signals


def main(argv: list[str] | None = None) -> None:
    train_noting_stop_signals(train, config.parse_args(argv))  # a stop signal from here on: the step ends, saved


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)  # first: each rank builds its model on its own device
    tokenizer_dir, tokenizer, dataset, collator = load_sft_data(args)
    model = build_student(args, info.device, tokenizer)
    run = Run(args, info, model, dataset, collator, tokenizer_dir, config.RESUMABLE)
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step)  # each rank its share (--fsdp 1: all)

    run.evaluate_when_due(evaluator)  # step 0: the baseline later evaluations compare against
    for epoch, window in run.windows():
        for i, batch in enumerate(window):
            batch = {k: v.to(run.device) for k, v in batch.items()}
            with run.micro_step(i, len(window)):  # DDP: gradients sync on the window's last micro-batch
                with run.autocast():
                    hidden, targets = completion_hidden(run.model, batch["input_ids"], batch["attention_mask"],
                                                        batch["labels"])
                    loss_sum, num_tokens = fused_cross_entropy(hidden, run.head, targets,
                                                               chunk_size=args.loss_chunk_size,
                                                               vocab_size=len(tokenizer))
                run.backward(loss_sum, num_tokens)
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        if run.end_step(metrics, evaluator=evaluator):  # log; save, evaluate when due
            break  # --epochs / --max_steps reached, or SIGTERM / SIGUSR1 / Ctrl-C
    run.finish()


if __name__ == "__main__":
    run_script(main)
