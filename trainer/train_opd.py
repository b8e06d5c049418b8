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
    ... --self_teacher ema --privileged_template "{question} The answer is {ground_truth}."   # self-distillation

Per micro-batch, the paper's eq. 2:
  1. with probability lmbda the step is on-policy (one draw per optimizer step, so the same whatever the split into
     ranks and micro-batches): the student samples y ~ pi_student(.|x) (KV cache, eval mode,
     no grad; with --skd_topk K speculative KD: a token outside the teacher's top-K is the teacher's sample; or on
     the rollout server, which holds the student's weights: pushed and verified before the step's
     first rollout every --sync_interval steps; with --max_staleness S the server samples step s from the weights
     of step s-S, in the background, trainer/rollouts/queue.py); otherwise the dataset's own completions are used
     (lmbda=0 is plain KD on the data)
  2. the sequence x + y gets labels on y only, through the first EOS
  3. the teacher scores every position without gradients (a teacher on a server: the sampled tokens only, or its
     top-K per position; several teachers: each its own rows), the student with gradients
  4. loss per token = generalized JSD over the full vocabulary (beta=1: reverse KL(student || teacher)), computed
     chunk by chunk from hidden states; with --teacher_topk K over the teacher's top-K, the sampled token and one
     tail bucket (a lower bound of it, exact as S covers the mass); or --loss sampled_kl, the policy-gradient form
     that needs only the teacher's log-probability of the sampled tokens (PowerOPD's reward, IW-OPD's weights:
     --opd_reward, --position_weight); or --loss skew_kl / skew_rkl, DistiLLM's skew divergences
With --self_teacher start|ema|live the teacher is the student itself (its start, an EMA, or its live weights) and
scores each completion after the row's privileged prompt (--privileged_template), not the student's.
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

from common.errors import run_script
from common.seeds import derived_seed
from model.generate import Speculative
from dataset.collators import IGNORE_INDEX
from trainer.config import opd as config
from trainer.config.opd_signal import opd_signal
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.losses.chunked import completion_hidden, completion_rows
from trainer.losses.divergences import evaluation_divergence, training_divergence
from trainer.rollouts.servers import connect_server, say_servers
from trainer.rollouts.source import Rollouts
from trainer.rollouts.tool_turns import tool_responder
from trainer.skeleton import (PhaseClock, Run, build_student, init_distributed_mode, load_prompt_data,
                              train_noting_stop_signals)
from trainer.teachers.specs import teacher_specs
from trainer.teachers.self_teacher import check_privileged_prompts, open_self_teachers
from trainer.teachers.teacher_set import open_teachers


def on_policy_draw(seed: int, lmbda: float, epoch: int, step: int) -> bool:
    """Step 1's coin: with probability lmbda the optimizer step is on-policy. One draw per step, seeded by (seed,
    epoch, step) alone: every rank and micro-batch of the step agrees, so the global batch's rows are trained the
    same way at any world size x accumulation (a draw per micro-batch would change with the split)."""
    generator = torch.Generator().manual_seed(derived_seed(seed, epoch, step))
    return torch.rand(1, generator=generator).item() < lmbda


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
    train_noting_stop_signals(train, config.parse_args(argv))  # a stop signal from here on: the step ends, saved


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)  # first: each rank builds its models on its own device
    # with lmbda < 1 some micro-batches distil the dataset's own completions: then every row needs one
    tokenizer_dir, tokenizer, dataset, collator = load_prompt_data(args, "opd_prompts", args.lmbda < 1.0)
    distilling_self = args.self_teacher != "none"  # self-distillation: the student, shown privileged context
    if distilling_self:
        check_privileged_prompts(dataset, collator, args.privileged_template, args.max_prompt_length)
    server = connect_server(args, "rollout")  # servers that are down are refused before any model loads
    training = lambda t: training_divergence(args.loss, args.beta, args.temperature, t.topk, opd_signal(args),
                                             args.skew)
    # rows routed, teacher servers connected, vocabularies and chat templates checked, local teachers loaded
    teachers = open_teachers(args, [] if distilling_self else teacher_specs(args), tokenizer, dataset, info.device,
                             training, evaluation=lambda t: evaluation_divergence(args.beta, t.model is not None,
                                                                                  t.topk))
    student = build_student(args, info.device, tokenizer)
    run = Run(args, info, student, dataset, collator, tokenizer_dir, config.RESUMABLE)
    if distilling_self:  # the teacher is the student: built (and with an EMA, resumed) with the run
        teachers = open_self_teachers(args, run, tokenizer, training)
    # every save keeps the rollouts sampled ahead; step 1's coin decides which steps sample
    speculative = Speculative(teachers.local[0], args.skd_topk) if args.skd_topk else None  # speculative KD
    rollouts = Rollouts(run, tokenizer, server, lambda e, s: on_policy_draw(args.seed, args.lmbda, e, s), speculative,
                        tool_responder(args, tokenizer))  # --tools: multi-turn, the student's calls answered
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step, rollouts.decoder,  # each rank its share
                                 **teachers.for_evaluation())
    say_servers(args, args.teacher_topk)
    vocab, chunk = len(tokenizer), args.loss_chunk_size

    run.evaluate_when_due(evaluator, teachers.served)  # step 0: the baseline later evaluations compare against
    for epoch, window, coming in run.windows_ahead(args.max_staleness):
        clock = PhaseClock(run.device)
        on_policy = on_policy_draw(args.seed, args.lmbda, epoch, run.step)  # step 1's coin, for the whole step
        rollouts.before_step(run.step, epoch, window, coming, clock)  # served: drain, push + verify, sample ahead
        for i, batch in enumerate(window):
            # steps 1-2: the student's samples (or the data's completions), labels on the completion only
            input_ids, attention_mask, labels = rollouts.sequences(batch, run.step, epoch, on_policy, clock)
            with clock("teacher"), run.fail_together(teachers.served):  # step 3: each row's teacher scores it
                scores = teachers.score(batch, input_ids, attention_mask, labels, run.teacher_autocast)
            with clock("train"), run.micro_step(i, len(window)):  # step 4; DDP syncs on the window's last
                with run.autocast():
                    hidden, targets = completion_hidden(run.model, input_ids, attention_mask, labels)
                    # the divergence per token to each row's teacher, summed (IW-OPD's weights: by place in the row)
                    rows = completion_rows(labels) if args.position_weight == "iw" else None
                    loss_sum, num_tokens = teachers.loss(scores, hidden, run.head, targets, chunk, vocab, run.metrics,
                                                         rows)
                run.backward(loss_sum, num_tokens)
            teachers.reshard()  # a sharded teacher's head, gathered for its forward, is read until here
            add_rollout_stats(run.metrics, input_ids, labels, tokenizer.eos_token_id, on_policy)
        clock.add_to(run.metrics)  # gen_s / train_s and their shares, reduced over ranks with the rest
        rollouts.add_to(run.metrics)  # served: seconds waited for rollouts, the server's idle time
        metrics = run.optimizer_step()  # exact normalisation over the window and all ranks, clip, AdamW
        teachers.after_step()  # a self-teacher's EMA follows the new weights
        # several teachers: theirs first; turns and tool_result_share with --tools only, early: the console line
        # keeps what fits in its width
        shown = teachers.shown() + ("gen_share", "turns", "tool_result_share", "eos_share", "completion_len",
                                    "reverse_kl_estimate", "wait_s", "sync_logprob_diff", "skd_replaced_share")
        # log; save (the rollouts sampled ahead too) and evaluate when due; done or stopped: the end
        if run.end_step(metrics, shown, evaluator, rollouts.before_save, teachers.served):
            break
    run.finish(rollouts.close, teachers.close)


if __name__ == "__main__":
    run_script(main)
