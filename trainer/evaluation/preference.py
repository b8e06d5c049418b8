"""DPO's held-out evaluation: the pair loss, the implicit rewards and the pair accuracy on the first --eval_rows
pairs of --eval_data_path (default: the demo's held-out pairs), and, where every one of those pairs has a ground
truth, the math accuracy of the student's greedy answers to their prompts (HeldoutEvaluator's). Due when
HeldoutEvaluator's evaluation is: before training, every --eval_interval steps and at the last step.

The pairs are cut into batches of --batch_size in file order, rank r taking batches r, r + W, ... and the sums
all-reduced (with --fsdp 1 every rank evaluates every batch, as HeldoutEvaluator does): one process's numbers."""
from __future__ import annotations

import contextlib

import torch

from dataset.collators import PairCollator
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.losses.chunked import completion_hidden, completion_rows
from trainer.losses.preference import fused_pair_loss
from trainer.skeleton.distributed import DistInfo
from trainer.skeleton.sharding import reshard_root
from trainer.skeleton.window_metrics import all_reduce_sum

PAIR_SUMS = ("loss", "pairs", "reward_chosen", "reward_rejected", "correct")


class PairEvaluator(HeldoutEvaluator):
    def __init__(self, args, tokenizer, info: DistInfo, start_step: int, pairs: list[dict], collator: PairCollator):
        """`pairs`: the held-out pairs (PairDataset rows, checked); `collator`: the training pairs' collator. The
        reference's numbers come later (`use_reference`), once it is known whether they are precomputed."""
        self.pairs, self.collator, self.reference = pairs, collator, None
        self.has_truth = all(pair.get("ground_truth") is not None for pair in pairs)
        super().__init__(args, tokenizer, info, start_step)
        self.pair_starts = self.batch_starts(len(pairs)) if args.eval_interval else []

    def use_reference(self, reference) -> None:
        """`reference`: the run's PairReference, whose "eval" numbers are these pairs'."""
        self.reference = reference

    def held_out_rows(self) -> list[dict]:
        """The prompts whose greedy answers are graded: the pairs', when they all have a ground truth (else none)."""
        if not self.has_truth:
            return []
        return [{"messages": pair["prompt"], "ground_truth": pair["ground_truth"], "row_index": pair["row_index"]}
                for pair in self.pairs]

    def evaluate(self, step: int, student, autocast, teacher_autocast=contextlib.nullcontext) -> dict[str, float]:
        """The pairs' mean loss, rewards and accuracy (eval/pair_loss, eval/reward_chosen, eval/reward_rejected,
        eval/reward_margin, eval/pair_accuracy); with ground truths the math accuracy too. Every rank returns the
        same numbers."""
        metrics = super().evaluate(step, student, autocast, teacher_autocast) if self.has_truth else {}
        self.evaluated_step = step
        sums = torch.zeros(len(PAIR_SUMS), dtype=torch.float64, device=self.info.device)
        was_training = student.training
        student.eval()
        args = self.args
        for start in self.pair_starts:
            batch = {k: v.to(self.info.device)
                     for k, v in self.collator(self.pairs[start:start + args.batch_size]).items()}
            reference = self.reference.logps(batch, "eval")
            with torch.no_grad(), autocast():
                hidden, targets = completion_hidden(student, batch["input_ids"], batch["attention_mask"],
                                                    batch["labels"])
                pair = fused_pair_loss(hidden, student.lm_head.weight, targets, completion_rows(batch["labels"]),
                                       reference, args.loss_chunk_size, len(self.tokenizer), args.loss_type,
                                       args.beta, args.rpo_alpha)
            sums += torch.stack([pair.loss, torch.tensor(float(pair.pairs), device=sums.device),
                                 pair.reward_chosen, pair.reward_rejected, pair.correct.double()]).to(sums)
        reshard_root(student)  # no backward follows these forwards
        student.train(was_training)
        if self.info.enabled and not self.lockstep:
            sums = all_reduce_sum(sums, self.info)
        total = dict(zip(PAIR_SUMS, sums.tolist()))
        pairs = max(total["pairs"], 1.0)
        chosen, rejected = total["reward_chosen"] / pairs, total["reward_rejected"] / pairs
        return {**metrics, "eval/pair_loss": total["loss"] / pairs, "eval/pair_accuracy": total["correct"] / pairs,
                "eval/reward_chosen": chosen, "eval/reward_rejected": rejected, "eval/reward_margin": chosen - rejected}
