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
     chunks of C tokens from the highest entropy at a chunk's first token down (trainer/logit_free/audit.py), none starting
     inside a thinking block (after a `<think>` with no `</think>`: a teacher cannot be asked to continue there)
  3. the teacher continues prompt + y[:anchor] N times per chunk (temperature 1, at most ceil(1.5 C) tokens), all
     of the micro-batch's chunks in flight at once; k = sum of the similarities of the student's chunk text and each
     continuation cut to its length; pi_hat = (k + alpha * pi_bar) / (N + alpha), pi_bar = exp(mean log p_S(y_t))
  4. loss = - sum over chunks of pi_hat * sum_{t in chunk} log p_S(y_t) + beta * sum over the other positions of
     KL(p_ref || p_S), p_ref the frozen starting model; summed over tokens, the skeleton divides by the window's
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

from common.errors import ArgumentParser, refuse, refuse_first, run_script
from model import Decoder
from trainer.logit_free.agreement import SIMILARITIES, agreement
from trainer.logit_free.audit import (anchor_labels, anchors_outside_thinking, chunked_audit_loss, completion_lengths,
                           plan_audits, position_stats, position_weights, posterior_weight)
from trainer.teachers.black_box import (add_teacher_args, audit_requests, black_box_specs, check_teacher_wait,
                                       connect_teachers, validate_teacher_args)
from trainer.losses.chunked import completion_hidden
from trainer.skeleton.console import PhaseClock
from trainer.skeleton.distributed import init_distributed_mode
from trainer.losses.divergences import Divergence, divergence_sums, evaluation_divergence
from trainer.config.flags import add_common_args, validate_common_args
from trainer.teachers.frozen import frozen_hidden, load_frozen, load_reference
from trainer.skeleton.guard import stop_signals_noted
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.teachers.teacher_set import EvalTeacher
from trainer.skeleton.loading import build_model, load_prompt_data
from trainer.rollouts.source import Rollouts, add_sampling_args, validate_sampling_args
from trainer.skeleton.run import Run
from trainer.rollouts.servers import add_server_args, connect_server, say_servers, validate_server_args
from trainer.teachers.teacher_set import SINGLE, TeacherSpec, add_teachers_args, routing, validate_teachers_args
from trainer.skeleton.sharding import reshard_root

ANCHOR = Divergence("jsd", beta=0.0)  # KL(p_ref || p_S): the generalized JSD's forward-KL end, p_ref as "teacher"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="Logit-free on-policy distillation of a Qwen3 student from a black-box teacher")
    add_common_args(parser, save_weight="logit_free")
    add_teacher_args(parser)
    add_teachers_args(parser, black_box=True)
    add_method_args(parser)
    add_sampling_args(parser)
    add_server_args(parser, teacher=False)
    args = parser.parse_args(argv)
    if not args.model_path and not args.model_config:
        args.model_path = os.path.join(args.save_dir, "kd")  # the KD quick-start's student, as OPD's
        if not os.path.isfile(os.path.join(args.model_path, "config.json")):
            refuse(f"no student at {args.model_path}: run `python trainer/train_sft.py && python "
                   f"trainer/train_distillation.py` first, or pass --model_path / --model_config")
    validate_common_args(args)
    validate_sampling_args(args)
    validate_logit_free_args(args)
    validate_server_args(args, samples=True, teacher=False)
    validate_teachers_args(args, teacher_specs(args))
    return args


def teacher_specs(args: argparse.Namespace) -> list[TeacherSpec]:
    """--teachers' endpoints, or --teacher_url's, named "teacher"."""
    return black_box_specs(args) if args.teachers else [TeacherSpec(SINGLE, url=args.teacher_url)]


def add_method_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("logit-free distillation (docs/logit_free.md)")
    g.add_argument("--audit_chunks", type=int, default=10, help="M: chunks audited per completion, at most")
    g.add_argument("--chunk_len", type=int, default=50, help="C: tokens per chunk")
    g.add_argument("--continuations", type=int, default=10, help="N: teacher continuations per chunk")
    g.add_argument("--similarity", default="levenshtein", choices=SIMILARITIES,
                   help="phi: 1 - character Levenshtein distance / the longer length, or ROUGE-1 F")
    g.add_argument("--alpha", type=float, default=1.0,
                   help="the prior's weight in pi_hat = (k + alpha pi_bar) / (N + alpha)")
    g.add_argument("--anchor_beta", type=float, default=0.1,
                   help="beta: weight of KL(p_ref || p_student) on the unaudited positions (0: no anchor)")
    g.add_argument("--reference_path", default=None,
                   help="the anchor's frozen model (default: the student's starting model)")
    g.add_argument("--teacher_dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the frozen models' weights (the reference, --eval_teacher_path); auto as the KD teacher's")
    g.add_argument("--replicate_teacher", type=int, default=0, choices=[0, 1],
                   help="with --fsdp 1: 1 keeps whole frozen models on every rank instead of sharding them")


def validate_logit_free_args(args: argparse.Namespace) -> None:
    a = args
    validate_teacher_args(args)
    refuse_first([
        (a.audit_chunks < 1 or a.chunk_len < 1 or a.continuations < 1,
         f"--audit_chunks, --chunk_len and --continuations must be >= 1, got {a.audit_chunks}, {a.chunk_len}, "
         f"{a.continuations}"),
        (a.alpha <= 0, f"--alpha must be > 0, got {a.alpha}"),
        (a.anchor_beta < 0, f"--anchor_beta must be >= 0, got {a.anchor_beta}"),
        (a.chunk_len > a.max_new_tokens,
         f"--chunk_len {a.chunk_len} is longer than --max_new_tokens {a.max_new_tokens}: no completion could be "
         f"audited"),
    ])
    for flag in ("reference_path", "eval_teacher_path"):
        path = getattr(args, flag)
        if path and not os.path.exists(path):
            refuse(f"--{flag} {path} does not exist")
    check_teacher_wait(args)


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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with stop_signals_noted():  # SIGTERM / SIGUSR1 from here on: the step is finished and saved; at the end
        train(args)            # (done, refused or failed) the process's own handlers are back


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)  # first: each rank builds its models on its own device
    tokenizer_dir, tokenizer, dataset, collator = load_prompt_data(args, "opd_prompts", need_completion=False)
    server = connect_server(args, "rollout")  # servers that are down are refused before any model loads
    routes = routing(args, teacher_specs(args))
    routes.check(dataset)  # every row's teacher is one of the run's
    teachers = connect_teachers(args, info.rank, routes)  # one, or each of --teachers
    student = build_model(args, info.device, path=args.model_path, config_path=args.model_config)
    reference = load_reference(args, tokenizer, student, info.device)  # the anchor's p_ref, frozen
    eval_teacher = None if not args.eval_teacher_path else load_frozen(args, args.eval_teacher_path, tokenizer,
                                                                        student, info.device)
    run = Run(args, info, student, dataset, collator, tokenizer_dir)
    decoder = Decoder(compiled=bool(args.use_compile) and not args.fsdp)  # step 1's decode step
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step, decoder,  # each rank its share (--fsdp 1: all)
                                 [] if eval_teacher is None else
                                 [EvalTeacher("teacher", evaluation_divergence(1.0, local_teacher=True), eval_teacher)])
    rollouts = Rollouts(args, run, tokenizer, server, decoder, lambda epoch, step: True)
    say_servers(args, teacher_topk=None)
    head, vocab = run.raw_model.lm_head.weight, len(tokenizer)
    thinking_ids = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")

    if evaluator.due(run.step, run.done):  # step 0: the baseline later evaluations compare against
        run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, run.teacher_autocast))
    for epoch, window, coming in run.windows_ahead(args.max_staleness):
        clock = PhaseClock(run.device)
        rollouts.before_step(epoch, window, coming, clock)  # served: drain, push + verify the weights, sample ahead
        for i, batch in enumerate(window):
            # 1. the student's samples, labels on the completion only
            input_ids, attention_mask, labels = rollouts.sequences(batch, epoch, True, clock)
            with clock("entropy"), torch.no_grad(), run.autocast():  # 2. the audit: the student's entropy peaks
                hidden, targets = completion_hidden(run.raw_model, input_ids, attention_mask, labels)
                entropy, logprob = position_stats(hidden, head, targets, vocab, args.gen_temperature,
                                                  args.loss_chunk_size)
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
            weights, audited = position_weights(lengths, chunks, pi_hats, device=run.device)
            anchored = anchor_labels(targets, audited)  # the anchor's positions: the unaudited ones
            with clock("reference"):
                reference_hidden = frozen_hidden(reference, run.teacher_autocast, input_ids, attention_mask, labels)
            with clock("train"), run.micro_step(i, len(window)):  # 4. the loss; DDP syncs on the window's last
                with run.autocast():
                    hidden, targets = completion_hidden(run.model, input_ids, attention_mask, labels)
                    audit_sum = chunked_audit_loss(hidden, head, targets, weights, args.loss_chunk_size, vocab)
                    anchor = divergence_sums(ANCHOR, hidden, head, anchored, reference_hidden,
                                             reference.lm_head.weight, args.loss_chunk_size, vocab)
                run.backward(audit_sum + args.anchor_beta * anchor.loss, targets.numel())  # / all completion tokens
            reshard_root(reference)  # a sharded reference's head, gathered for its forward, is read until here
            run.metrics.ratio("anchor_kl", anchor.value.detach(), anchor.tokens)
            add_audit_stats(run.metrics, entropy, audited, pi_hats, ks, args, answers.usage)
            run.metrics.ratio("completion_len", sum(lengths), len(lengths))
        clock.add_to(run.metrics)  # entropy / teacher / reference / train seconds and their shares
        rollouts.add_to(run.metrics)
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        run.log(metrics, show=teachers.shown() + ("teacher_share", "pi_hat", "phi", "anchor_kl", "completion_len"))
        if run.save_due():              # every --save_interval steps, the last one, and on a stop signal
            rollouts.before_save()
            run.save()
        if evaluator.due(run.step, run.done):  # every --eval_interval steps and the last one
            run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, run.teacher_autocast))
        if run.done or run.stop_signal:  # --epochs / --max_steps reached, or SIGTERM / SIGUSR1 / Ctrl-C
            break
    rollouts.close()
    teachers.close()
    run.finish()


if __name__ == "__main__":
    run_script(main)
