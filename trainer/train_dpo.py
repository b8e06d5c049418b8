"""DPO on preference pairs: the student learns to prefer each pair's chosen answer over its rejected one, relative
to a frozen reference (sigmoid DPO, IPO, optionally RPO's NLL on the chosen answer; TRL 1.16's conventions).

    python trainer/train_dpo.py                    # CPU demo: a tiny random Qwen3 on the built-in synthetic pairs
    python trainer/train_dpo.py --model_path checkpoints/demo/teacher_step425 --data_path dataset/demo/dpo_pairs.parquet
                                                   # pairs of the demo student's own graded samples
                                                   # (dataset/make_dpo_pairs.py)
    python trainer/train_dpo.py --model_path Qwen3-0.6B --data_path pairs.parquet --device cuda --batch_size 8 \
        --accumulation_steps 4 --max_length 2048 --max_prompt_length 1024 --learning_rate 5e-7 --precompute_ref 1
    torchrun --nproc_per_node 4 trainer/train_dpo.py --model_path Qwen3-0.6B --data_path pairs.parquet ...
    ... --lora_rank 16                             # the reference: the LoRA student's own base, no second copy
    ... --from_resume 1                            # after a preemption: continue exactly

Per micro-batch of P pairs (a pair never split: its chosen and rejected answers are in the same micro-batch):
  1. collate the 2P conversations prompt + answer as SFT renders them (chat template, prompt/completion boundary,
     right padding), the P chosen first, then the P rejected: one forward of the student serves both answers (as
     TRL's concatenated forward), so a sharded student gathers its weights once per micro-batch, not twice
  2. the reference's summed log-probabilities of the 2P answers: a frozen forward, or the table --precompute_ref 1
     computed before training (trainer/teachers/pair_reference.py)
  3. the student's forward to hidden states; each answer's summed log-probability through the lm_head chunk by chunk
     (never the full logits), the pair losses in float64 and their gradient through a second chunked pass
     (trainer/losses/preference.py); summed over the pairs
The skeleton divides the window's gradient by its pairs on all ranks: the loss is the mean over the window's pairs.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.errors import run_script
from trainer.config import dpo as config
from trainer.evaluation.preference import PairEvaluator
from trainer.losses.chunked import completion_hidden, completion_rows
from trainer.losses.preference import fused_pair_loss
from trainer.skeleton import Run, build_student, init_distributed_mode, load_pair_data, train_noting_stop_signals
from trainer.teachers.pair_reference import PairReference

SHOWN = ("pair_accuracy", "reward_margin")  # on the console line beside the loss


def main(argv: list[str] | None = None) -> None:
    train_noting_stop_signals(train, config.parse_args(argv))  # a stop signal from here on: the step ends, saved


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)  # first: each rank builds its models on its own device
    tokenizer_dir, tokenizer, dataset, collator, held_out = load_pair_data(args)
    student = build_student(args, info.device, tokenizer)
    run = Run(args, info, student, dataset, collator, tokenizer_dir, config.RESUMABLE)
    evaluator = PairEvaluator(args, tokenizer, info, run.step, held_out, collator)  # each rank its share
    # the frozen reference, or its numbers precomputed (then read back from a resume file, the model freed)
    reference = PairReference(args, tokenizer, run, student, {"train": [dataset[i] for i in range(len(dataset))],
                                                              "eval": held_out}, collator)
    evaluator.use_reference(reference)
    loss = dict(loss_type=args.loss_type, beta=args.beta, rpo_alpha=args.rpo_alpha)

    run.evaluate_when_due(evaluator)  # step 0: the baseline later evaluations compare against
    for epoch, window in run.windows():
        for i, batch in enumerate(window):
            batch = {k: v.to(run.device) for k, v in batch.items()}  # 1. 2P answers, chosen first
            reference_logps = reference.logps(batch, "train")  # 2. (P, 2), no gradient
            with run.micro_step(i, len(window)):  # DDP: gradients sync on the window's last micro-batch
                with run.autocast():  # 3. the student's answers, the pair losses summed
                    hidden, targets = completion_hidden(run.model, batch["input_ids"], batch["attention_mask"],
                                                        batch["labels"])
                    pairs = fused_pair_loss(hidden, run.head, targets, completion_rows(batch["labels"]),
                                            reference_logps, args.loss_chunk_size, len(tokenizer), **loss)
                run.backward(pairs.loss, pairs.pairs)  # divided by the window's pairs on all ranks
            pairs.add_to(run.metrics)  # rewards, margin, pair accuracy, log-probabilities: means per pair
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        if run.end_step(metrics, SHOWN, evaluator):  # log; save, evaluate when due
            break  # --epochs / --max_steps reached, or SIGTERM / SIGUSR1 / Ctrl-C
    run.finish()


if __name__ == "__main__":
    run_script(main)
