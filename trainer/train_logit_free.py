"""Logit-free on-policy distillation: the student samples, a black-box teacher (text only: any model family, any
OpenAI-compatible endpoint, proprietary APIs included) continues the student's answer where the student was least
sure, and the student's chunks are weighted by how well the teacher's continuations agree with them.

    python serving/vllm_launch.py --model checkpoints/sft --name teacher --port 8001 -- --no-enable-chunked-prefill &
    python trainer/train_logit_free.py --teacher_url http://127.0.0.1:8001/v1 --teacher_probe request \
        --chunk_len 8 --audit_chunks 4 --continuations 4      # CPU demo: the KD student, the SFT model served
    python trainer/train_logit_free.py --model_path Qwen3-0.6B --data_path dapo.parquet --device cuda \
        --teacher_url https://api.example.com/v1 --teacher_model big-model --teacher_api_key_env API_KEY \
        --teacher_form chat --teacher_options '{}' --max_new_tokens 1024 --max_length 1536
    ... --teacher_form completions --teacher_tokenizer_path /models/Qwen3-32B   # vLLM's /v1/completions
    ... --from_resume 1                                   # the teacher's answers are cached: none is asked twice
    ... --teachers teachers.json --default_teacher general  # several endpoints, each row's from its `teacher` column

Per micro-batch (docs/logit_free.md: the method, its equations and which parts are the paper's):
  1. the student samples y ~ pi_student(.|x) (built-in engine or --rollout_url, as OPD's), labels on y
  2. the audit: the student's exact entropy at every completion position (no grad); up to M non-overlapping
     chunks of C tokens from the highest entropy at a chunk's first token down (trainer/logit_free/audit.py), none
     starting inside a thinking block (after a `<think>` with no `</think>`: a teacher cannot be asked to continue
     there)
  3. the teacher continues prompt + y[:anchor] N times per chunk (temperature 1, at most ceil(1.5 C) tokens), all
     of the micro-batch's chunks in flight at once; k = sum of the similarities of the student's chunk text and each
     continuation cut to its length; pi_hat = (k + alpha * pi_bar) / (N + alpha), pi_bar = exp(mean log p_S(y_t))
  4. loss = - sum over chunks of w * sum_{t in chunk} log p_S(y_t) + beta * sum over the other positions of
     KL(p_ref || p_S), p_ref the frozen starting model, w = pi_hat (--chunk_weight posterior), pi_hat - pi_bar
     (advantage) or pi_hat - the micro-batch's mean (centred); summed over tokens, the skeleton divides by the window's
     completion tokens over all ranks (so accumulation and world size are exact), clips and steps.
Every teacher request carries a seed from (seed, epoch, step, row, chunk) and every answer goes into a crash-proof
cache (SAVE_DIR/NAME_teacher_cache.rank*.jsonl): a resumed run asks only what the killed one had not received.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from common.errors import run_script
from dataset.collators import IGNORE_INDEX
from eval.grader import grade_batch
from trainer.config import logit_free as config
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.logit_free.agreement import agreement
from trainer.logit_free.audit import (anchor_labels, anchors_outside_thinking, audit_stats, chunk_weights,
                                      chunked_audit_loss, completion_lengths, plan_audits, position_weights,
                                      posterior_weight)
from trainer.losses.chunked import completion_hidden
from trainer.losses.divergences import Divergence, divergence_sums
from trainer.rollouts.servers import connect_server, say_servers
from trainer.rollouts.source import Rollouts
from trainer.skeleton import (PhaseClock, Run, build_student, init_distributed_mode, load_prompt_data,
                              train_noting_stop_signals)
from trainer.skeleton.sharding import reshard_root
from trainer.teachers.black_box import audit_requests, connect_teachers
from trainer.teachers.frozen import frozen_hidden, load_reference
from trainer.teachers.teacher_set import open_evaluation_teacher

THIRDS = ("early", "middle", "late")  # pi_hat_right/_wrong by the third of the answer a chunk starts in
ANCHOR = Divergence("jsd", beta=0.0)  # KL(p_ref || p_S): the generalized JSD's forward-KL end, p_ref as "teacher"


def add_audit_stats(metrics, entropy: torch.Tensor, audited: torch.Tensor, pi_hats: list[float],
                    ks: list[float], args: argparse.Namespace, usage) -> None:
    """pi_hat and phi per chunk, the audited share of completion tokens and their entropy beside all tokens', the
    teacher's requests (sent, and answered from the cache), tokens and estimated cost (of the requests sent)."""
    metrics.ratio("pi_hat", sum(pi_hats), len(pi_hats))
    metrics.ratio("phi", sum(ks), len(ks) * args.continuations)
    metrics.ratio("audited_share", audited.sum(), audited.numel())
    metrics.ratio("entropy_audited", (entropy * audited).sum(), audited.sum())
    metrics.ratio("entropy", entropy.sum(), entropy.numel())
    metrics.total("teacher_requests", usage.requests)  # sent; the cache answered teacher_cached
    metrics.total("teacher_cached", usage.cached)
    metrics.total("teacher_tokens", usage.prompt_tokens + usage.completion_tokens)
    if args.teacher_price_in or args.teacher_price_out:
        metrics.total("teacher_cost", usage.cost(args.teacher_price_in, args.teacher_price_out))


def add_separation(metrics, tokenizer, input_ids: torch.Tensor, labels: torch.Tensor, rows: list[dict],
                   chunks, pi_hats: list[float]) -> None:
    """Whether the teacher's agreement separates right answers from wrong ones: pi_hat over the chunks of completions
    graded right (math-verify against the row's ground truth) and over those graded wrong, each also by the third of
    the answer its chunk starts in (pi_hat_wrong_early, ...), and the share graded right; rows without a ground truth
    are left out (a distillation set need not have one)."""
    graded = [i for i, row in enumerate(rows) if row.get("ground_truth") is not None]
    if not graded:
        return
    completion = labels != IGNORE_INDEX
    texts = [tokenizer.decode(input_ids[i][completion[i]].tolist(), skip_special_tokens=True) for i in graded]
    right = {i for i, result in zip(graded, grade_batch(texts, [str(rows[i]["ground_truth"]) for i in graded]))
             if result.correct}
    metrics.ratio("answer_right", len(right), len(graded))
    lengths = completion.sum(dim=1).tolist()
    for name, keep in (("pi_hat_right", lambda row: row in right), ("pi_hat_wrong", lambda row: row not in right)):
        kept = [(chunk, p) for chunk, p in zip(chunks, pi_hats) if chunk.row in graded and keep(chunk.row)]
        metrics.ratio(name, sum(p for _, p in kept), len(kept), when_empty=False)  # no right answer: no value
        for third, where in enumerate(THIRDS):  # where in the answer the chunk starts: a long answer's early errors
            placed = [p for chunk, p in kept if min(3 * chunk.anchor // max(lengths[chunk.row], 1), 2) == third]
            metrics.ratio(f"{name}_{where}", sum(placed), len(placed), when_empty=False)


def main(argv: list[str] | None = None) -> None:
    train_noting_stop_signals(train, config.parse_args(argv))  # a stop signal from here on: the step ends, saved


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)  # first: each rank builds its models on its own device
    tokenizer_dir, tokenizer, dataset, collator = load_prompt_data(args, "opd_prompts", need_completion=False)
    server = connect_server(args, "rollout")  # servers that are down are refused before any model loads
    teachers = connect_teachers(args, info.rank, dataset)  # one, or each of --teachers: every row finds its own
    # held-out evaluation's white-box teacher (--eval_teacher_path): the reverse KL to it, which the table reports
    eval_teachers = open_evaluation_teacher(args, args.eval_teacher_path, tokenizer, dataset, info.device)
    student = build_student(args, info.device, tokenizer)
    reference = load_reference(args, tokenizer, info.device, student)  # the anchor's p_ref, frozen
    run = Run(args, info, student, dataset, collator, tokenizer_dir, config.RESUMABLE)
    rollouts = Rollouts(run, tokenizer, server, lambda epoch, step: True)  # every save keeps the rollouts sampled ahead
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step, rollouts.decoder,  # each rank its share
                                 **eval_teachers.for_evaluation())
    say_servers(args, teacher_topk=None)
    vocab = len(tokenizer)
    thinking_ids = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")

    run.evaluate_when_due(evaluator)  # step 0: the baseline later evaluations compare against
    for epoch, window, coming in run.windows_ahead(args.max_staleness):
        clock = PhaseClock(run.device)
        rollouts.before_step(run.step, epoch, window, coming, clock)  # served: drain, push + verify, sample ahead
        for i, batch in enumerate(window):
            # 1. the student's samples, labels on the completion only
            input_ids, attention_mask, labels = rollouts.sequences(batch, run.step, epoch, True, clock)
            with clock("entropy"):  # 2. the audit: the student's entropy peaks (its forward in evaluation mode)
                targets, entropy, logprob = audit_stats(run.raw_model, run.autocast, input_ids, attention_mask, labels,
                                                        vocab, args.gen_temperature, args.loss_chunk_size)
            lengths = completion_lengths(labels)
            allowed = anchors_outside_thinking(targets.cpu(), lengths, *thinking_ids)  # no anchor inside <think>
            planned = plan_audits(entropy, logprob, lengths, args.chunk_len, args.audit_chunks, allowed)
            chunks, requests, texts = audit_requests(args, tokenizer, batch, labels, planned, epoch, run.step)
            run.metrics.total("audits_skipped", len(planned) - len(chunks))  # partials no template can hand over
            asking = [batch["rows"][chunk.row] for chunk in chunks]  # each chunk's row: its teacher
            with clock("teacher"), run.fail_together():  # 3. the teacher's continuations, all chunks at once
                answers, usages = teachers.continue_batch(requests, asking)
            ks = [agreement(text, continuations, args.similarity) for text, continuations in zip(texts, answers.texts)]
            pi_hats = [posterior_weight(k, args.continuations, chunk.pi_bar, args.alpha)
                       for k, chunk in zip(ks, chunks)]
            teachers.add_to(run.metrics, asking, pi_hats, usages)  # several teachers: each one's numbers
            weights, audited = position_weights(lengths, chunks, chunk_weights(pi_hats, chunks, args.chunk_weight),
                                                device=run.device)
            anchored = anchor_labels(targets, audited)  # the anchor's positions: the unaudited ones
            with clock("reference"):
                reference_hidden = frozen_hidden(reference, run.teacher_autocast, input_ids, attention_mask, labels)
            with clock("train"), run.micro_step(i, len(window)):  # 4. the loss; DDP syncs on the window's last
                with run.autocast():
                    hidden, targets = completion_hidden(run.model, input_ids, attention_mask, labels)
                    audit_sum = chunked_audit_loss(hidden, run.head, targets, weights, args.loss_chunk_size, vocab)
                    anchor = divergence_sums(ANCHOR, hidden, run.head, anchored, reference_hidden,
                                             reference.lm_head.weight, args.loss_chunk_size, vocab)
                run.backward(audit_sum + args.anchor_beta * anchor.loss, targets.numel())  # / all completion tokens
            reshard_root(reference)  # a sharded reference's head, gathered for its forward, is read until here
            run.metrics.ratio("anchor_kl", anchor.value.detach(), anchor.tokens)
            add_audit_stats(run.metrics, entropy, audited, pi_hats, ks, args, answers.usage)
            add_separation(run.metrics, tokenizer, input_ids, labels, batch["rows"], chunks, pi_hats)
            run.metrics.ratio("completion_len", sum(lengths), len(lengths))
        clock.add_to(run.metrics)  # entropy / teacher / reference / train seconds and their shares
        rollouts.add_to(run.metrics)
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        shown = teachers.shown() + ("teacher_share", "pi_hat", "phi", "anchor_kl", "completion_len")
        # log; save (the rollouts sampled ahead too) and evaluate when due; done or stopped: the end
        if run.end_step(metrics, shown, evaluator, rollouts.before_save):
            break
    run.finish(rollouts.close, teachers.close)


if __name__ == "__main__":
    run_script(main)
