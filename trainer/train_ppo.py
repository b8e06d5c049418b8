"""PPO with a critic: the student samples (one answer per prompt by default), math-verify grades it, the reward sits
at its last token with a per-token KL penalty to the reference, a critic (Qwen3's body and a scalar head,
model/value.py) estimates V(s_t), and GAE gives each token its advantage; the policy trains on PPO's clipped
surrogate (or CISPO's), the critic on the clipped value loss, each with its own AdamW, in --update_epochs passes over
--num_minibatches minibatches of the rollout batch (docs/rl.md).

    python trainer/train_ppo.py --batch_size 8 --max_steps 32 --learning_rate 1e-5 --kl_coef 0.05 --eval_interval 8
                                   # CPU demo: checkpoints/sft by PPO
    ... --update_epochs 4 --num_minibatches 4 --rollout_url http://127.0.0.1:8000/v1     # PPO's epochs, served
    ... --from_resume 1            # policy and critic resume together (the critic's state is in the resume file)

Per step: 1-3. each micro-batch sampled, graded, and scored (log pi_old, the reference's log-probabilities, the
critic's values; rewards per token, GAE's advantages and returns), the advantages whitened over the rollout batch;
4. E x M updates of policy and critic (trainer/rl/updates.py), the last one the step's; log, save (the critic's
export, then the policy's, then the resume file: one commit), evaluate.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from common.errors import run_script
from trainer.config import ppo as config
from trainer.evaluation.heldout import HeldoutEvaluator
from trainer.losses.policy_gradient import ADVANTAGE, OLD_LOGP, token_logprobs
from trainer.losses.ppo import OLD_VALUE, RETURN, gae, rows_of, token_rewards
from trainer.rl.critic import Critic
from trainer.rl.minibatches import Rollout
from trainer.rl.rewards import GroupCollator, add_group_stats, graded_samples, load_graded_prompts, reward_std
from trainer.rollouts.servers import connect_server, say_servers
from trainer.rollouts.source import Rollouts
from trainer.skeleton import PhaseClock, Run, build_student, init_distributed_mode, print0, train_noting_stop_signals
from trainer.skeleton.sharding import reshard_root
from trainer.skeleton.window_metrics import all_reduce_sum
from trainer.teachers.frozen import frozen_hidden, load_reference
from trainer.rl.updates import behaviour_logprobs, train_rollout_batch


def whiten(parts: list[Rollout], run: Run) -> None:
    """The advantages of the step's whole rollout batch on all ranks to mean 0 and variance 1 (unbiased, + 1e-8),
    in place: the same numbers however the batch is cut into micro-batches and ranks."""
    advantages = torch.cat([part.values[:, ADVANTAGE] for part in parts]).double()
    n, total, squares = all_reduce_sum(torch.stack([torch.tensor(float(len(advantages)), dtype=torch.float64,
                                                                 device=advantages.device),
                                                    advantages.sum(), (advantages ** 2).sum()]), run.dist).tolist()
    mean = total / max(n, 1.0)
    var = (squares - n * mean ** 2) / max(n - 1.0, 1.0)
    for part in parts:
        part.values[:, ADVANTAGE] = ((part.values[:, ADVANTAGE].double() - mean) / (var + 1e-8) ** 0.5).float()


def main(argv: list[str] | None = None) -> None:
    train_noting_stop_signals(train, config.parse_args(argv))


def train(args: argparse.Namespace) -> None:
    info = init_distributed_mode(args.device, args.dist_timeout)
    server = connect_server(args, "rollout")  # a server that is down is refused first, before the data and models
    tokenizer_dir, tokenizer, dataset, collator = load_graded_prompts(args)
    student = build_student(args, info.device, tokenizer)
    reference = load_reference(args, tokenizer, info.device, student) if args.kl_coef else None
    run = Run(args, info, student, dataset, GroupCollator(collator, args.num_generations), tokenizer_dir,
              config.RESUMABLE, companions=("critic",))
    critic = Critic(run, args, tokenizer)  # its state in every save of the run: one commit with the policy
    rollouts = Rollouts(run, tokenizer, server, lambda epoch, step: True)
    evaluator = HeldoutEvaluator(args, tokenizer, info, run.step, rollouts.decoder)
    say_servers(args)
    print0(f"PPO: {args.num_generations} answer(s) per prompt, reward {args.reward}, GAE gamma {args.gamma:g} "
           f"lambda {args.lam:g}, KL penalty {args.kl_coef:g}, critic lr {args.critic_learning_rate:g}")
    settings = dict(temperature=args.gen_temperature, clip_low=args.clip_eps, clip_high=args.clip_eps_high,
                    kind=args.policy_loss)

    run.evaluate_when_due(evaluator)
    for epoch, window, coming in run.windows_ahead(args.max_staleness):
        clock = PhaseClock(run.device)
        rollouts.before_step(run.step, epoch, window, coming, clock)
        # 1-3. each micro-batch sampled, graded, scored by the critic and the reference, its advantages by GAE
        rollout_batch = [scored_rollout(run, rollouts, critic, reference, tokenizer, batch, epoch, args, clock)
                         for batch in window]
        if args.whiten:
            whiten(rollout_batch, run)
        # 4. E passes over M minibatches: a policy and a critic update each (the step's last below)
        train_rollout_batch(run, rollout_batch, args, len(tokenizer), clock, settings, critic)
        critic_norm = critic.update()
        clock.add_to(run.metrics)
        rollouts.add_to(run.metrics)
        metrics = run.optimizer_step()
        metrics["critic_grad_norm"] = critic_norm
        reward_std(metrics)
        shown = ("reward", "value_loss", "eos_share", "completion_len")
        if run.end_step(metrics, shown, evaluator, lambda: (rollouts.before_save(), critic.export())):
            break
    run.finish(rollouts.close)


def scored_rollout(run: Run, rollouts: Rollouts, critic: Critic, reference, tokenizer, batch: dict, epoch: int,
                   args: argparse.Namespace, clock) -> Rollout:
    """Steps 1-3 of a micro-batch: its samples and rewards; log pi_old of the weights that sampled, the reference's
    log-probabilities (the per-token KL penalty) and the critic's values; each token's reward, GAE advantage and
    return (trainer/losses/ppo.py's columns beside the policy loss's)."""
    vocab = len(tokenizer)
    input_ids, attention_mask, labels, reward, correct = graded_samples(rollouts, tokenizer, batch, run.step, epoch,
                                                                        args, clock)
    with clock("old_logp"):
        old_logp = behaviour_logprobs(run, input_ids, attention_mask, labels, args.gen_temperature,
                                      args.loss_chunk_size, vocab)
        ref_logp = None
        if reference is not None:
            hidden = frozen_hidden(reference, run.teacher_autocast, input_ids, attention_mask, labels)
            with run.teacher_autocast():
                ref_logp = token_logprobs(hidden, reference.lm_head.weight, completion_targets(labels),
                                          args.loss_chunk_size, vocab, args.gen_temperature)
            reshard_root(reference)
        old_values = critic.values(input_ids, attention_mask, labels)
    rewards = token_rewards(reward, old_logp, ref_logp, labels, args.kl_coef)
    padded_rewards, mask = rows_of(rewards, labels)
    advantages, returns = gae(padded_rewards, rows_of(old_values, labels)[0], mask, args.gamma, args.lam)
    values = torch.zeros(len(rewards), 6, device=rewards.device)
    values[:, ADVANTAGE], values[:, OLD_VALUE], values[:, RETURN] = advantages[mask], old_values, returns[mask]
    values[:, OLD_LOGP] = old_logp if args.update_epochs * args.num_minibatches > 1 else float("nan")
    add_group_stats(run.metrics, reward, correct, labels, input_ids, tokenizer.eos_token_id, args.num_generations)
    run.metrics.ratio("value", old_values.sum(), len(old_values))
    if ref_logp is not None:
        run.metrics.ratio("kl", (old_logp - ref_logp).sum(), len(old_logp))
    return Rollout(input_ids, attention_mask, labels, values)


def completion_targets(labels: torch.Tensor) -> torch.Tensor:
    """The labels at completion_hidden's positions, in its order."""
    return labels[:, 1:][labels[:, 1:] != -100]


if __name__ == "__main__":
    run_script(main)
