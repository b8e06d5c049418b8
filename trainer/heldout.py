"""Held-out evaluation during training: greedy completions of a fixed prompt set, their math accuracy, and (for
distillation) the student's per-token reverse KL to the teacher on those completions. The same numbers at every
evaluation step, on the same prompts, so runs can be compared."""
from __future__ import annotations

import contextlib

import torch

from common.seeds import derived_seed
from dataset.collators import IGNORE_INDEX, PromptCollator, build_sequences
from dataset.make_demo_data import ensure_demo_data
from dataset.sources import RowDataset
from eval.grader import grade_batch
from model import generate
from trainer.losses import (chunked_generalized_jsd_loss, chunked_loss, completion_hidden,
                            sampled_token_kl_from_logprobs)


@torch.no_grad()
def evaluate_heldout(student, tokenizer, batches: list[dict], max_new_tokens: int, teacher=None,
                     autocast=contextlib.nullcontext, chunk_size: int = 512, beta: float = 1.0,
                     teacher_server=None, seed: int = 0) -> dict[str, float]:
    """`batches`: PromptCollator outputs (on the right device). Returns accuracy, mean completion length, EOS share
    and, with a teacher, the token-weighted mean generalized JSD at `beta` over the greedy completions: beta=1 is
    the reverse KL(student || teacher), logged as eval/reverse_kl; another beta as eval/jsd_beta<beta>. With a
    teacher on a server (which returns log-probabilities of given tokens only), eval/reverse_kl_estimate instead:
    the sampled-token estimate on the student's own samples of the prompts."""
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
                kl, tokens = divergence_sum(student, teacher, input_ids, attention_mask, labels, len(tokenizer),
                                            chunk_size, beta)
            kl_sum, kl_tokens = kl_sum + kl, kl_tokens + tokens
        if teacher_server is not None:
            kl, tokens = sampled_kl_sum(student, teacher_server, tokenizer, batch, max_new_tokens, autocast,
                                        chunk_size, seed)
            kl_sum, kl_tokens = kl_sum + kl, kl_tokens + tokens
    student.train(was_training)
    metrics = {"eval/accuracy": correct / max(rows, 1), "eval/completion_len": generated / max(rows, 1),
               "eval/eos_share": ended / max(rows, 1)}
    if teacher is not None:
        metrics["eval/reverse_kl" if beta == 1.0 else f"eval/jsd_beta{beta:g}"] = kl_sum / max(kl_tokens, 1)
    if teacher_server is not None:
        metrics["eval/reverse_kl_estimate"] = kl_sum / max(kl_tokens, 1)
    return metrics


def sampled_kl_sum(student, teacher_server, tokenizer, batch: dict, max_new_tokens: int, autocast, chunk_size: int,
                   seed: int) -> tuple[float, int]:
    """Sum over the student's sampled tokens y of log p_S(y) - log p_T(y) (a one-sample estimate of the reverse KL
    at each position), and their number. Row r of the held-out set always samples with seed (seed, -1, r): every
    evaluation draws with the same random numbers, so the change between evaluations is the model's."""
    seeds = [derived_seed(seed, -1, row["row_index"]) for row in batch["rows"]]
    device = batch["prompt_ids"].device
    with autocast():
        out = generate(student, batch["prompt_ids"], batch["prompt_attention_mask"], max_new_tokens, do_sample=True,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       generator=[torch.Generator(device).manual_seed(s) for s in seeds], vocab_size=len(tokenizer))
    input_ids, attention_mask, labels = build_sequences(batch["prompt_ids"], batch["prompt_attention_mask"],
                                                        out.completion_ids, out.completion_mask)
    teacher_logprobs = teacher_server.completion_logprobs(input_ids, attention_mask,
                                                          (labels != IGNORE_INDEX).sum(dim=1))
    with autocast():
        hidden, targets = completion_hidden(student, input_ids, attention_mask, labels)
        _, kl = chunked_loss(lambda logits, logprobs, chunk_labels: sampled_token_kl_from_logprobs(
            logits, logprobs, chunk_labels), hidden, student.lm_head.weight, targets, chunk_size=chunk_size,
            vocab_size=len(tokenizer), teacher_values=teacher_logprobs)
    return float(kl), int(targets.numel())


def divergence_sum(student, teacher, input_ids, attention_mask, labels, vocab_size: int, chunk_size: int,
                   beta: float) -> tuple[float, int]:
    student_hidden, targets = completion_hidden(student, input_ids, attention_mask, labels)
    teacher_hidden, _ = completion_hidden(teacher, input_ids, attention_mask, labels)
    kl, tokens = chunked_generalized_jsd_loss(student_hidden, student.lm_head.weight, teacher_hidden,
                                              teacher.lm_head.weight, targets, beta=beta, chunk_size=chunk_size,
                                              vocab_size=vocab_size)
    return float(kl), int(tokens)


class HeldoutEvaluator:
    """`--eval_interval` for a training loop: a fixed prompt set (the first --eval_rows rows of --eval_data_path,
    default the demo eval set), evaluated on rank 0 (every rank with --fsdp 1) before training, every
    --eval_interval optimizer steps and at the last step. Everything it needs comes in as arguments; it knows
    nothing of the run."""

    def __init__(self, args, tokenizer, device: str, is_main: bool, start_step: int):
        self.args, self.tokenizer, self.device = args, tokenizer, device
        # a sharded model (--fsdp 1) needs every rank in each forward: then all ranks evaluate the same prompts in
        # step (greedy: the same completions, the same number of decoding steps) and rank 0 logs
        evaluates = is_main or bool(getattr(args, "fsdp", 0))
        self.batches = self.load_batches() if args.eval_interval and evaluates else []
        # a resumed run's checkpoint step was already evaluated (if due) by the run that wrote it
        self.evaluated_step = start_step if start_step > 0 else -1

    def load_batches(self) -> list[dict]:
        args = self.args
        dataset = RowDataset(args.eval_data_path or ensure_demo_data()["eval"])
        rows = [dataset[i] for i in range(min(args.eval_rows, len(dataset)))]
        collator = PromptCollator(self.tokenizer, args.max_prompt_length, bool(args.enable_thinking))
        batches = []
        for start in range(0, len(rows), args.batch_size):
            batch = collator(rows[start:start + args.batch_size])
            batches.append({**batch, "prompt_ids": batch["prompt_ids"].to(self.device),
                            "prompt_attention_mask": batch["prompt_attention_mask"].to(self.device)})
        return batches

    def due(self, step: int, last: bool) -> bool:
        """On rank 0: before training (step 0), every --eval_interval steps and at the last step, once per step."""
        if not self.batches or step == self.evaluated_step:
            return False
        return step % self.args.eval_interval == 0 or last

    def evaluate(self, step: int, student, autocast, teacher=None, beta: float = 1.0,
                 teacher_server=None) -> dict[str, float]:
        """Greedy completions of the held-out prompts: accuracy, length, EOS share; with a teacher also the
        student's divergence from it on those completions (beta=1: reverse KL; OPD passes its training beta);
        with a teacher on a server, the sampled-token reverse-KL estimate."""
        self.evaluated_step = step
        return evaluate_heldout(student, self.tokenizer, self.batches, self.args.eval_max_new_tokens, teacher,
                                autocast, self.args.loss_chunk_size, beta, teacher_server, self.args.seed)
