"""Held-out evaluation during training: greedy completions of a fixed prompt set, their math accuracy, and (for
distillation) the student's per-token reverse KL to the teacher on those completions. The same numbers at every
evaluation step, on the same prompts, so runs can be compared."""
from __future__ import annotations

import contextlib

import torch

from dataset.collators import PromptCollator, build_sequences
from dataset.make_demo_data import ensure_demo_data
from dataset.sources import RowDataset
from eval.grader import grade_batch
from model import generate
from trainer.losses import chunked_generalized_jsd_loss
from trainer.trainer_utils import completion_hidden


@torch.no_grad()
def evaluate_heldout(student, tokenizer, batches: list[dict], max_new_tokens: int, teacher=None,
                     autocast=contextlib.nullcontext, chunk_size: int = 512) -> dict[str, float]:
    """`batches`: PromptCollator outputs (on the right device). Returns accuracy, mean completion length, EOS share
    and, with a teacher, the token-weighted mean reverse KL(student || teacher) over the greedy completions."""
    was_training = student.training
    student.eval()
    correct = rows = generated = ended = 0
    kl_sum, kl_tokens = 0.0, 0
    for batch in batches:
        with autocast():
            out = generate(student, batch["prompt_ids"], batch["prompt_attention_mask"], max_new_tokens,
                           do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           vocab_size=len(tokenizer))
        texts = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
                 for ids, mask in zip(out.completion_ids, out.completion_mask)]
        truths = [row.get("ground_truth") for row in batch["rows"]]
        if all(truth is not None for truth in truths):
            correct += sum(result.correct for result in grade_batch(texts, [str(t) for t in truths]))
        rows += len(texts)
        generated += int(out.completion_mask.sum())
        ended += int((out.completion_ids == tokenizer.eos_token_id).any(dim=1).sum())
        if teacher is not None:
            input_ids, attention_mask, labels = build_sequences(batch["prompt_ids"], batch["prompt_attention_mask"],
                                                                out.completion_ids, out.completion_mask)
            with autocast():
                kl, tokens = reverse_kl_sum(student, teacher, input_ids, attention_mask, labels, len(tokenizer),
                                            chunk_size)
            kl_sum, kl_tokens = kl_sum + kl, kl_tokens + tokens
    student.train(was_training)
    metrics = {"eval/accuracy": correct / max(rows, 1), "eval/completion_len": generated / max(rows, 1),
               "eval/eos_share": ended / max(rows, 1)}
    if teacher is not None:
        metrics["eval/reverse_kl"] = kl_sum / max(kl_tokens, 1)
    return metrics


def reverse_kl_sum(student, teacher, input_ids, attention_mask, labels, vocab_size: int,
                   chunk_size: int) -> tuple[float, int]:
    student_hidden, targets = completion_hidden(student, input_ids, attention_mask, labels)
    teacher_hidden, _ = completion_hidden(teacher, input_ids, attention_mask, labels)
    kl, tokens = chunked_generalized_jsd_loss(student_hidden, student.lm_head.weight, teacher_hidden,
                                              teacher.lm_head.weight, targets, beta=1.0, chunk_size=chunk_size,
                                              vocab_size=vocab_size)
    return float(kl), int(tokens)


class HeldoutEvaluator:
    """`--eval_interval` for a training loop: a fixed prompt set (the first --eval_rows rows of --eval_data_path,
    default the demo eval set), evaluated on rank 0 before training, every --eval_interval optimizer steps and at
    the last step."""

    def __init__(self, args, tokenizer, run, teacher=None):
        self.args, self.tokenizer, self.run, self.teacher = args, tokenizer, run, teacher
        self.batches = self.load_batches() if args.eval_interval and run.dist.is_main else []
        # a resumed run's checkpoint step was already evaluated (if due) by the run that wrote it
        self.evaluated_step = run.state.step if run.state.step > 0 else -1

    def load_batches(self) -> list[dict]:
        args = self.args
        dataset = RowDataset(args.eval_data_path or ensure_demo_data()["eval"])
        rows = [dataset[i] for i in range(min(args.eval_rows, len(dataset)))]
        collator = PromptCollator(self.tokenizer, args.max_prompt_length, bool(args.enable_thinking))
        batches = []
        for start in range(0, len(rows), args.batch_size):
            batch = collator(rows[start:start + args.batch_size])
            batches.append({**batch, "prompt_ids": batch["prompt_ids"].to(self.run.device),
                            "prompt_attention_mask": batch["prompt_attention_mask"].to(self.run.device)})
        return batches

    def maybe_evaluate(self) -> None:
        step, interval = self.run.state.step, self.args.eval_interval
        if not self.batches or step == self.evaluated_step or not (step % interval == 0 or self.run.done):
            return
        self.evaluated_step = step
        self.run.log_eval(evaluate_heldout(self.run.raw_model, self.tokenizer, self.batches,
                                           self.args.eval_max_new_tokens, self.teacher, self.run.autocast,
                                           self.args.loss_chunk_size))
