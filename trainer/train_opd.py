"""On-policy distillation (OPD): the student samples, a same-tokenizer teacher scores every token.

    python trainer/train_sft.py && python trainer/train_distillation.py && python trainer/train_opd.py
                                   # CPU demo: the KD student (checkpoints/kd) learns on-policy from checkpoints/sft
    python trainer/train_opd.py --model_path Qwen3-0.6B --teacher_path Qwen3-4B --data_path dapo.parquet \
        --device cuda --batch_size 8 --accumulation_steps 4 --max_new_tokens 1024 --max_length 1536
    torchrun --nproc_per_node 4 trainer/train_opd.py --model_path Qwen3-0.6B --teacher_path Qwen3-4B ...
    ... --from_resume 1
    ... --rollout_url http://127.0.0.1:8000/v1     # sample on a vLLM server (docs/serving.md)
    ... --rollout_url ... --max_staleness 1         # the server samples step s+1 while the trainer trains step s
    ... --loss sampled_kl --teacher_url http://127.0.0.1:8001/v1   # the teacher's log-probs from a server
    ... --teacher_topk 16 --teacher_url http://127.0.0.1:8001/v1    # its top-16 per position (--loss jsd)
    ... --teachers teachers.json --default_teacher math   # each row from the teacher its `teacher` column names

Per micro-batch, the paper's eq. 2:
  1. with probability lmbda the step is on-policy (one draw per optimizer step, so the same whatever the split into
     ranks and micro-batches): the student samples y ~ pi_student(.|x) (KV cache, eval mode,
     no grad; or on the rollout server, which holds the student's weights: pushed and verified before the step's
     first rollout every --sync_interval steps; with --max_staleness S the server samples step s from the weights
     of step s-S, in the background, trainer/rollouts/queue.py); otherwise the dataset's own completions are used
     (lmbda=0 is plain KD on the data)
  2. the sequence x + y gets labels on y only, through the first EOS
  3. the teacher scores every position without gradients (a teacher on a server: the sampled tokens only, or its
     top-K per position; several teachers: each its own rows), the student with gradients
  4. loss per token = generalized JSD over the full vocabulary (beta=1: reverse KL(student || teacher)), computed
     chunk by chunk from hidden states; with --teacher_topk K over the teacher's top-K, the sampled token and one
     tail bucket (a lower bound of it, exact as S covers the mass); or --loss sampled_kl, the policy-gradient form
     that needs only the teacher's log-probability of the sampled tokens
The skeleton normalises by the window's loss tokens over all ranks, clips and steps. Each row samples with its own
seed (seed, epoch, row), so a resumed run samples exactly what the killed one would have, and 2 ranks x accumulation
2 sample what 1 rank x accumulation 4 does.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from common.errors import ArgumentParser, refuse, refuse_first, run_script
from common.seeds import derived_seed
from dataset.collators import IGNORE_INDEX
from model import Decoder
from trainer.skeleton.console import PhaseClock
from trainer.losses.divergences import DivergenceSums, divergence_sums, evaluation_divergence, training_divergence
from trainer.skeleton.distributed import init_distributed_mode
from trainer.config.flags import add_common_args, add_teacher_args, resolve_teacher_path, validate_common_args
from trainer.skeleton.guard import stop_signals_noted
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.skeleton.loading import build_model, load_prompt_data
from trainer.losses.chunked import completion_hidden
from trainer.rollouts.source import Rollouts, add_sampling_args, validate_sampling_args
from trainer.skeleton.run import Run
from trainer.rollouts.servers import add_server_args, check_server_wait, connect_server, say_servers, validate_server_args
from trainer.teachers.parts import add_part_metrics, part_scores, split_by_teacher
from trainer.teachers.teacher_set import (add_teachers_args, check_teachers, load_teachers, routing, say_teachers,
                              served_teacher_rules, teacher_specs, validate_teachers_args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="On-policy distillation of a Qwen3 student from a Qwen3 teacher")
    add_common_args(parser, save_weight="opd")
    add_teacher_args(parser)
    add_teachers_args(parser)
    g = parser.add_argument_group("on-policy distillation")
    g.add_argument("--loss", default="jsd", choices=["jsd", "sampled_kl"],
                   help="jsd: generalized JSD over the full vocabulary (beta=1: reverse KL); sampled_kl: "
                        "policy-gradient reverse KL from the sampled tokens' log-probabilities only")
    g.add_argument("--beta", type=float, default=1.0, help="0: forward KL, 1: reverse KL, between: generalized JSD")
    g.add_argument("--teacher_topk", type=int, default=0,
                   help="K > 0 with --loss jsd: the divergence over the teacher's top-K tokens, the sampled token "
                        "and one tail bucket per position (what a --teacher_url server returns; with --teacher_path "
                        "the same from its logits); 0: the full vocabulary (local teacher only)")
    g.add_argument("--lmbda", type=float, default=1.0, help="probability that an optimizer step is on-policy")
    add_sampling_args(parser)
    add_server_args(parser)
    args = parser.parse_args(argv)
    if not args.model_path and not args.model_config:
        args.model_path = os.path.join(args.save_dir, "kd")  # the KD quick-start's student
        if not os.path.isfile(os.path.join(args.model_path, "config.json")):
            refuse(f"no student at {args.model_path}: run `python trainer/train_sft.py && python "
                   f"trainer/train_distillation.py` first, or pass --model_path / --model_config")
    validate_common_args(args)
    if not args.teacher_url and not args.teachers:
        resolve_teacher_path(args)
    validate_sampling_args(args)
    validate_opd_args(args)
    validate_server_args(args, samples=args.lmbda > 0)
    specs = teacher_specs(args)
    validate_teachers_args(args, specs)
    if args.teachers:
        refuse_first(served_teacher_rules(specs, args.loss, args.temperature))
        check_server_wait(args, next((spec.url for spec in specs if spec.url), None))
    return args


def validate_opd_args(args: argparse.Namespace) -> None:
    a, sampled_kl = args, args.loss == "sampled_kl"
    # log p_S(y) - log p_T(y) averages to KL(p_S || p_T) only when y is drawn from p_S itself: the loss's
    # temperature-scaled, untruncated student distribution, on-policy at every step
    unbiased = a.gen_temperature == a.temperature and a.top_k == 0 and a.top_p == 1.0
    refuse_first([
        (not 0.0 <= a.lmbda <= 1.0, f"--lmbda must be in [0, 1], got {a.lmbda}"),
        (not 0.0 <= a.beta <= 1.0, f"--beta must be in [0, 1], got {a.beta}"),
        (a.teacher_topk < 0, f"--teacher_topk must be >= 0, got {a.teacher_topk}"),
        (sampled_kl and a.teacher_topk > 0,
         "--teacher_topk is for --loss jsd (the top-K divergence); --loss sampled_kl needs the sampled tokens' "
         "log-probabilities only"),
        (sampled_kl and a.lmbda < 1.0, "--loss sampled_kl is a policy gradient on the student's own samples: it "
                                       "needs --lmbda 1 (--loss jsd mixes in the dataset's completions)"),
        (sampled_kl and not unbiased,
         f"--loss sampled_kl needs samples from the student at --temperature {a.temperature}: --gen_temperature "
         f"{a.temperature} --top_k 0 --top_p 1 (got --gen_temperature {a.gen_temperature} --top_k {a.top_k} "
         f"--top_p {a.top_p}: a biased estimate); --loss jsd samples any way"),
        (sampled_kl and a.max_staleness,
         f"--loss sampled_kl needs samples from the current student: with --max_staleness {a.max_staleness} they "
         f"come from weights {a.max_staleness} step(s) older (a biased estimate); use --loss jsd"),
        (sampled_kl and a.rollout_url and a.sync_interval > 1,
         f"--loss sampled_kl needs samples from the current student: with --sync_interval {a.sync_interval} the "
         f"server samples from older weights (a biased estimate); use --sync_interval 1 or --loss jsd"),
    ])


def on_policy_draw(args: argparse.Namespace, epoch: int, step: int) -> bool:
    """Step 1's coin: with probability lmbda the optimizer step is on-policy. One draw per step, seeded by (seed,
    epoch, step) alone: every rank and micro-batch of the step agrees, so the global batch's rows are trained the
    same way at any world size x accumulation (a draw per micro-batch would change with the split)."""
    generator = torch.Generator().manual_seed(derived_seed(args.seed, epoch, step))
    return torch.rand(1, generator=generator).item() < args.lmbda


def distill_loss(run: Run, args: argparse.Namespace, teachers, divergences: dict, parts: list, scores: list,
                 vocab_size: int, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4: the student's hidden states at the completion positions, and per teacher the summed per-token loss
    of its rows against its `scores` (trainer/losses/divergences.py); their per-token numbers (the teacher's tail mass of
    top-K, the sampled-token KL estimate) join the window's metrics, on every micro-batch (zeros where a teacher has
    no rows: the ranks add the same names)."""
    student_hidden, targets = completion_hidden(run.model, input_ids, attention_mask, labels)
    loss_sum = num_tokens = 0
    for part, given in zip(parts, scores):
        divergence = divergences[part.teacher.name]
        if part.empty:
            sums = DivergenceSums(0, 0, 0, dict.fromkeys(divergence.extra_names(), 0))
        else:
            sums = divergence_sums(divergence, part.select(student_hidden), run.raw_model.lm_head.weight,
                                   part.select(targets), given, part.teacher.lm_head_weight,
                                   args.loss_chunk_size, vocab_size)
        for name, value in sums.extras.items():
            run.metrics.token_mean(name, value)
        add_part_metrics(run.metrics, teachers, part, sums.value, sums.tokens)  # sampled_kl: its estimate
        loss_sum, num_tokens = loss_sum + sums.loss, num_tokens + sums.tokens
    return loss_sum, num_tokens


def add_rollout_stats(metrics, input_ids: torch.Tensor, labels: torch.Tensor, eos_token_id: int,
                      on_policy: bool) -> None:
    """Completion length and EOS share per row, the on-policy share of micro-batches, generated tokens."""
    completion = labels != IGNORE_INDEX
    rows = completion.shape[0]
    metrics.ratio("completion_len", completion.sum(), rows)
    metrics.ratio("eos_share", ((input_ids == eos_token_id) & completion).any(dim=1).sum(), rows)
    metrics.ratio("on_policy_share", int(on_policy), 1)
    metrics.total("generated_tokens", completion.sum() if on_policy else 0)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with stop_signals_noted():  # SIGTERM / SIGUSR1 from here on: the step is finished and saved; at the end
        train(args)            # (done, refused or failed) the process's own handlers are back


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)  # first: each rank builds its models on its own device
    # with lmbda < 1 some micro-batches distil the dataset's own completions: then every row needs one
    tokenizer_dir, tokenizer, dataset, collator = load_prompt_data(args, "opd_prompts", args.lmbda < 1.0)
    specs = teacher_specs(args)
    routing(args, specs).check(dataset)  # every row's teacher is one of the run's
    server = connect_server(args, "rollout")  # servers that are down are refused before any model loads
    servers = check_teachers(args, specs, tokenizer, dataset)  # teacher servers, vocabularies, chat templates
    student = build_model(args, info.device, path=args.model_path, config_path=args.model_config)
    teachers = load_teachers(args, specs, servers, tokenizer, student, info.device)
    run = Run(args, info, student, dataset, collator, tokenizer_dir)
    divergences = {t.name: training_divergence(args.loss, args.beta, args.temperature, t.topk)
                   for t in teachers.members}
    decoder = Decoder(compiled=bool(args.use_compile) and not args.fsdp)  # step 1's decode step (CUDA graphs on CUDA)
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step, decoder,  # each rank its share (--fsdp 1: all)
                                 **teachers.for_evaluation(
                                     lambda t: evaluation_divergence(args.beta, t.model is not None, t.topk)))
    rollouts = Rollouts(args, run, tokenizer, server, decoder, lambda e, s: on_policy_draw(args, e, s))
    say_servers(args, args.teacher_topk)
    say_teachers(teachers)

    with run.fail_together(teachers.served):  # a teacher server failing in the evaluation
        if evaluator.due(run.step, run.done):  # step 0: the baseline later evaluations compare against
            run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, run.teacher_autocast))
    for epoch, window, coming in run.windows_ahead(args.max_staleness):
        clock = PhaseClock(run.device)
        on_policy = on_policy_draw(args, epoch, run.step)  # step 1's coin, for the whole optimizer step
        rollouts.before_step(epoch, window, coming, clock)  # served: drain, push + verify the weights, sample ahead
        for i, batch in enumerate(window):
            # steps 1-2: the student's samples (or the data's completions), labels on the completion only
            input_ids, attention_mask, labels = rollouts.sequences(batch, epoch, on_policy, clock)
            parts = split_by_teacher(teachers, teachers.routes.route(batch["rows"]), labels)  # each teacher its rows
            with clock("teacher"), run.fail_together(teachers.served):  # step 3: the teachers score them
                scores = [part_scores(part, divergences[part.teacher.name], run.teacher_autocast, input_ids,
                                      attention_mask, labels) for part in parts]
            with clock("train"), run.micro_step(i, len(window)):  # step 4; DDP syncs on the window's last
                with run.autocast():
                    loss_sum, num_tokens = distill_loss(run, args, teachers, divergences, parts, scores,
                                                        len(tokenizer), input_ids, attention_mask, labels)
                run.backward(loss_sum, num_tokens)
            teachers.reshard()  # a sharded teacher's head, gathered for its forward, is read until here
            add_rollout_stats(run.metrics, input_ids, labels, tokenizer.eos_token_id, on_policy)
        clock.add_to(run.metrics)  # gen_s / train_s and their shares, reduced over ranks with the rest
        rollouts.add_to(run.metrics)  # served: seconds waited for rollouts, the server's idle time
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        run.log(metrics, show=teachers.shown() + ("gen_share", "eos_share", "completion_len", "reverse_kl_estimate",
                                                  "wait_s", "sync_logprob_diff"))  # several teachers: theirs first
        if run.save_due():              # every --save_interval steps, the last one, and on a stop signal
            rollouts.before_save()      # the rollouts sampled ahead are kept in the checkpoint
            run.save()
        with run.fail_together(teachers.served):
            if evaluator.due(run.step, run.done):  # every --eval_interval steps and the last one
                run.log_eval(evaluator.evaluate(run.step, run.raw_model, run.autocast, run.teacher_autocast))
        if run.done or run.stop_signal:  # --epochs / --max_steps reached, or SIGTERM / SIGUSR1 / Ctrl-C
            break
    rollouts.close()
    run.finish()


if __name__ == "__main__":
    run_script(main)
