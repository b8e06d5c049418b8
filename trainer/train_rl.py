"""RL with verifiable rewards (GRPO family): the student samples a group of G answers per prompt, math-verify grades
each against the row's ground truth, and each answer's reward relative to its group is the advantage of every one
of its tokens; optionally OPD's dense signal, a teacher's per-token log-ratio, added to that advantage.

    python trainer/train_rl.py --num_generations 4 --batch_size 8 --max_steps 32 --learning_rate 1e-4 \
        --eval_interval 8          # CPU demo: checkpoints/sft (the only demo model that ends its answers) by RL
    python trainer/train_rl.py --model_path Qwen3-0.6B --data_path dapo-math-17k.parquet --device cuda \
        --batch_size 16 --num_generations 8 --accumulation_steps 4 --max_new_tokens 2048 --max_length 2560 \
        --learning_rate 1e-6 --warmup_ratio 0 --grad_clip 1.0 --clip_eps 0.2 --clip_eps_high 0.28 \
        --advantage drgrpo --kl_coef 0 --rollout_url http://127.0.0.1:8000/v1 --eval_interval 50
                                   # the GPU recipe: DAPO-Math-17K, DAPO's asymmetric clip, no KL, a vLLM server
    ... --opd_coef 1 --teacher_path Qwen3-8B     # + OPD as a dense advantage (or --teacher_url: a served teacher)
    ... --opd_coef 1 --teachers teachers.json    # each row's OPD term from the teacher its `teacher` column names
    ... --from_resume 1

Per micro-batch (its --batch_size prompts, each G times: a group is never split across ranks or micro-batches):
  1. the student samples G completions per prompt (built-in engine or --rollout_url; per-row seeds (seed, epoch,
     row, g)), labels on each completion through its first EOS
  2. rewards: 1 for a completion math-verify finds equal to the ground truth, else 0 (+ --format_reward for a final
     \\boxed{} answer); advantages within each group: grpo (r - mean) / (std + 1e-4), drgrpo r - mean
  3. optional frozen models, no gradients: the reference's log-probabilities of the sampled tokens (--kl_coef), the
     teacher's (--opd_coef: local, or the served teacher's)
     (with --update_epochs or --num_minibatches > 1, or served rollouts: log pi_old, the sampling weights'
     log-probabilities, by a forward before any update; served, the gap to the server's own log-probabilities
     logged, and rollouts from older weights (--max_staleness, --sync_interval) weighted by --rollout_correction:
     trainer/losses/rollout_correction.py)
  4. loss per token = - min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + kl_coef k3(ref, student) (--policy_loss
     cispo: - sg(clip(rho)) A log pi + ...), with A = A_group - opd_coef (log p_S(y_t) - log p_T(y_t)) (or its
     variants: --opd_reward power, PowerOPD's bounded reward; --position_weight iw, IW-OPD's weight by place in the
     answer) and rho = pi / pi_old (trainer/losses/policy_gradient.py); summed, the skeleton divides by the
     minibatch's completion tokens over all ranks (drgrpo: by its rows x --max_new_tokens), clips and updates
The rollout batch (a step's prompts) is trained in --update_epochs E passes over --num_minibatches M minibatches of
whole groups (trainer/rl/minibatches.py), an update each; --target_kl skips the rest once a minibatch's approximate
KL passes it. E = M = 1 (the default): one update per rollout batch, rho = 1 (the rollouts come from the weights being
trained). With --reward none, --opd_coef 1, G = 1 and --kl_coef 0 this is train_opd.py's --loss sampled_kl, step for
step.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from common.errors import run_script
from dataset.collators import IGNORE_INDEX
from trainer.config import rl as config
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.losses.chunked import completion_rows
from trainer.losses.divergences import Divergence, evaluation_divergence
from trainer.losses.policy_gradient import (ADVANTAGE, OLD_LOGP, REF_LOGP, TEACHER_LOGP, group_advantages,
                                            token_logprobs)
from trainer.losses.rollout_correction import correction_weights
from trainer.rl.minibatches import Rollout
from trainer.rl.rewards import GroupCollator, add_group_stats, graded_samples, load_graded_prompts, reward_std
from trainer.rl.updates import behaviour_logprobs, train_rollout_batch
from trainer.rollouts.servers import connect_server, say_servers
from trainer.rollouts.source import Rollouts
from trainer.rollouts.tool_turns import tool_responder
from trainer.skeleton import (PhaseClock, Run, build_student, init_distributed_mode, print0,
                              train_noting_stop_signals)
from trainer.skeleton.sharding import reshard_root
from trainer.teachers.frozen import frozen_hidden, load_reference
from trainer.teachers.parts import Part
from trainer.teachers.specs import teacher_specs
from trainer.teachers.teacher_set import Teachers, open_teachers

SAMPLED_KL = Divergence("sampled_kl")  # what a teacher gives the OPD term: its log-probability of each sampled token


def token_values(advantages: torch.Tensor, labels: torch.Tensor, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor, reference, teachers: Teachers, scores: list[Part], *, temperature: float,
                 chunk: int, vocab: int, autocast, metrics) -> torch.Tensor:
    """Step 3: per completion token (in completion_hidden's order) its group's advantage, log pi_old (NaN: the
    weights being trained), the reference's and the row's teacher's log-probabilities of the sampled token at
    `temperature` (0 when not read; several teachers: each from its own rows' `scores`) -> (n, 4). `autocast`: the
    frozen models' forward context (Run.teacher_autocast); `metrics`: where the teachers count their rows."""
    completion = labels != IGNORE_INDEX
    n = int(completion.sum())
    values = torch.zeros(n, 4, device=labels.device)
    values[:, ADVANTAGE] = advantages.to(labels.device)[:, None].expand_as(labels)[completion]
    values[:, OLD_LOGP] = float("nan")
    targets = labels[completion]
    if reference is not None:
        hidden = frozen_hidden(reference, autocast, input_ids, attention_mask, labels)
        with autocast():
            values[:, REF_LOGP] = token_logprobs(hidden, reference.lm_head.weight, targets, chunk, vocab, temperature)
    teachers.token_logprobs(scores, targets, values[:, TEACHER_LOGP], temperature, chunk, vocab, autocast, metrics)
    return values


def add_sampler_gap(metrics, old_logp: torch.Tensor, sampler_logp: torch.Tensor) -> None:
    """|log pi_old - log mu| over the sampled tokens, mean and max: how far the trainer's log-probabilities are
    from the server's (rounding for on-policy rollouts; the weights' drift for older ones)."""
    gap = (old_logp.double() - sampler_logp.double()).abs()
    metrics.ratio("sampler_logp_gap", gap.sum(), len(gap))
    metrics.maximum("sampler_logp_gap_max", gap.max() if len(gap) else 0.0)


def main(argv: list[str] | None = None) -> None:
    train_noting_stop_signals(train, config.parse_args(argv))  # a stop signal from here on: the step ends, saved


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)  # first: each rank builds its models on its own device
    tokenizer_dir, tokenizer, dataset, collator = load_graded_prompts(args)
    server = connect_server(args, "rollout")  # servers that are down are refused before any model loads
    # the OPD term's teachers (none without --opd_coef): rows routed, servers connected, templates checked, loaded
    teachers = open_teachers(args, teacher_specs(args) if args.opd_coef else [], tokenizer, dataset, info.device,
                             training=lambda t: SAMPLED_KL,
                             evaluation=lambda t: evaluation_divergence(1.0, t.model is not None))
    student = build_student(args, info.device, tokenizer)
    reference = load_reference(args, tokenizer, info.device, student) if args.kl_coef else None
    run = Run(args, info, student, dataset, GroupCollator(collator, args.num_generations), tokenizer_dir,
              config.RESUMABLE)
    # every save keeps the rollouts sampled ahead; --tools: multi-turn, the student's calls answered
    rollouts = Rollouts(run, tokenizer, server, lambda epoch, step: True, responder=tool_responder(args, tokenizer))
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step, rollouts.decoder,  # each rank its share
                                 **teachers.for_evaluation())
    say_servers(args)
    print0(f"groups of {args.num_generations}: each prompt sampled {args.num_generations} times, "
           f"{args.batch_size * args.num_generations} completions per micro-batch; reward {args.reward}"
           + (f" + {args.format_reward:g} for a final boxed answer" if args.format_reward else "")
           + f", advantage {args.advantage}" + (f", KL {args.kl_coef:g}" if args.kl_coef else "")
           + (f", OPD term {args.opd_coef:g}" if args.opd_coef else ""))
    vocab, g = len(tokenizer), args.num_generations
    updates = args.update_epochs * args.num_minibatches  # optimizer updates per step (per rollout batch)
    settings = dict(temperature=args.gen_temperature, clip_low=args.clip_eps, clip_high=args.clip_eps_high,
                    kl_coef=args.kl_coef, opd_coef=args.opd_coef, opd_reward=args.opd_reward,
                    power_alpha=args.power_alpha, iw_gamma=args.iw_gamma, kind=args.policy_loss)

    run.evaluate_when_due(evaluator, teachers.served)  # step 0: the baseline later evaluations compare against
    for epoch, window, coming in run.windows_ahead(args.max_staleness):
        clock = PhaseClock(run.device)
        rollouts.before_step(run.step, epoch, window, coming, clock)  # served: push + verify the weights, then sample
        rollout_batch = []
        for batch in window:
            # 1-2. G samples per prompt, labels on each completion, graded against the ground truth
            input_ids, attention_mask, labels, rewards, correct = graded_samples(rollouts, tokenizer, batch, run.step,
                                                                                 epoch, args, clock)
            advantages = group_advantages(rewards, g, args.advantage)  # compared within the group
            with clock("teacher"), run.fail_together(teachers.served):  # 3. the frozen models
                scores = teachers.score(batch, input_ids, attention_mask, labels, run.teacher_autocast)
                values = token_values(advantages, labels, input_ids, attention_mask, reference, teachers, scores,
                                      temperature=args.gen_temperature, chunk=args.loss_chunk_size, vocab=vocab,
                                      autocast=run.teacher_autocast, metrics=run.metrics)
            reshard_root(reference)  # a sharded frozen model's head, gathered for its forward, is read until here
            teachers.reshard()
            rollout = Rollout(input_ids, attention_mask, labels, values)
            sampled = rollouts.sampler(batch, run.step, labels)  # served: the server's log mu, its weights' step
            if updates > 1 or sampled is not None:  # 3b. log pi_old, before any update moves the weights
                with clock("old_logp"):
                    old_logp = behaviour_logprobs(run, input_ids, attention_mask, labels, args.gen_temperature,
                                                  args.loss_chunk_size, vocab)
                if updates > 1:  # the ratio's denominator (one update: the weights trained, rho = 1 exactly)
                    values[:, OLD_LOGP] = old_logp
            if sampled is not None:
                sampler_logp, version = sampled
                add_sampler_gap(run.metrics, old_logp, sampler_logp)
                if version < run.step and args.rollout_correction != "none":  # 3c. older weights' rollouts
                    rollout = rollout.corrected(*correction_weights(
                        old_logp, sampler_logp, completion_rows(labels), args.rollout_correction, args.is_cap,
                        args.icepop_low, args.icepop_high))
            add_group_stats(run.metrics, rewards, correct, labels, input_ids, tokenizer.eos_token_id, g)
            rollout_batch.append(rollout)
        # 4. the loss: E passes over M minibatches of the rollout batch, an update each (the step's last below)
        train_rollout_batch(run, rollout_batch, args, vocab, clock, settings)
        clock.add_to(run.metrics)  # gen / reward / teacher / train seconds and their shares
        rollouts.add_to(run.metrics)
        metrics = run.optimizer_step()  # the step's last update: exact normalisation over all ranks, clip, AdamW
        reward_std(metrics)
        # turns and tool_result_share with --tools only, early: the console line keeps what fits in its width
        shown = ("reward", f"pass@{g}", "turns", "tool_result_share", "zero_variance_share", "eos_share",
                 "completion_len")
        # log; save (the rollouts sampled ahead too) and evaluate when due; done or stopped: the end
        if run.end_step(metrics, shown, evaluator, rollouts.before_save, teachers.served):
            break
    run.finish(rollouts.close, teachers.close)


if __name__ == "__main__":
    run_script(main)
