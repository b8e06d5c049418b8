"""Step 4 of the RL loops (trainer/train_rl.py, trainer/train_ppo.py): a rollout batch trained in --update_epochs
passes over --num_minibatches minibatches (trainer/rl/minibatches.py), an optimizer update each -- the step's last
one is the loop's own `run.optimizer_step()` --, PPO's critic updated beside the policy; and what both loops read of
the weights that sampled (log pi_old) and log of each trained part."""
from __future__ import annotations

import argparse

import torch

from trainer.losses.chunked import completion_hidden, completion_rows
from trainer.losses.policy_gradient import PolicySums, fused_policy_loss, token_logprobs
from trainer.rl.minibatches import Rollout, minibatches
from trainer.skeleton.run import Run
from trainer.skeleton.sharding import reshard_root
from trainer.skeleton.window_metrics import all_reduce_sum


def behaviour_logprobs(run: Run, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                       temperature: float, chunk: int, vocab: int) -> torch.Tensor:
    """log pi_old of each sampled token (completion_hidden's order) at `temperature`, from the weights that sampled
    them, before the step's first update: the ratio's denominator for every later minibatch."""
    with torch.no_grad(), run.autocast():
        hidden, targets = completion_hidden(run.model, input_ids, attention_mask, labels)
        logp = token_logprobs(hidden, run.head, targets, chunk, vocab, temperature)
    reshard_root(run.raw_model)  # no backward follows this forward: a sharded student's root is freed here
    return logp


def train_rollout_batch(run: Run, rollout_batch: list[Rollout], args: argparse.Namespace, vocab: int, clock,
                        settings: dict, critic=None) -> None:
    """E passes over M minibatches of `rollout_batch`, an update after each but the last (the caller's
    `run.optimizer_step()` makes that one; with `critic`, PPO's, its last update is the caller's too). --target_kl
    ends the passes after the minibatch whose approximate KL, over all ranks, passes it."""
    updates = args.update_epochs * args.num_minibatches
    batches = minibatches(rollout_batch, args.update_epochs, args.num_minibatches, args.num_generations)
    for update, minibatch in enumerate(batches):
        kl = torch.zeros(2, device=run.device)  # the minibatch's approximate KL summed, and its tokens
        for j, part in enumerate(minibatch):
            with clock("train"), run.micro_step(j, len(minibatch)):  # DDP syncs on the minibatch's last
                sums = policy_backward(run, part, args, vocab, settings)
            if critic is not None:
                with clock("critic"), critic.micro_step(j, len(minibatch)):
                    critic.backward(part, run.metrics)
            add_policy_stats(run.metrics, sums, args, settings, first=update == 0)
            kl += torch.stack([sums.approx_kl, sums.tokens.to(kl.dtype)]).detach()
        if update == updates - 1 or (args.target_kl and kl_passed(kl, args.target_kl, run)):
            return
        with clock("train"):
            run.update()  # exact normalisation over the minibatch and all ranks, clip, AdamW
            if critic is not None:
                critic.update()


def policy_backward(run: Run, part: Rollout, args: argparse.Namespace, vocab: int, settings: dict) -> PolicySums:
    """One part of a minibatch: the student's forward to hidden states, the policy loss through the head in
    chunks (its IW-OPD weights, its rollout-correction weights), backwarded, divided by its tokens (drgrpo: rows x
    --max_new_tokens) at the update."""
    with run.autocast():
        hidden, targets = completion_hidden(run.model, part.input_ids, part.attention_mask, part.labels)
        rows = completion_rows(part.labels) if args.position_weight == "iw" else None  # IW-OPD's weights
        sums = fused_policy_loss(hidden, run.head, targets, part.values, args.loss_chunk_size, vocab, rows=rows,
                                 is_weights=part.is_weights, **settings)
    divisor = len(part.labels) * args.max_new_tokens if args.advantage == "drgrpo" else sums.tokens
    run.backward(sums.loss, divisor)
    return sums


def add_policy_stats(metrics, sums: PolicySums, args: argparse.Namespace, settings: dict, first: bool) -> None:
    """A trained part's clip fraction, entropy, the loss's KL and OPD estimates; with several updates per step the
    ratio and the approximate KL to pi_old (`first`: the step's first minibatch, whose ratio is 1 up to rounding:
    the check that sampling and training compute the same log-probabilities)."""
    metrics.ratio("clip_fraction", sums.clipped, sums.tokens)
    metrics.ratio("entropy", sums.entropy, sums.tokens)
    if settings.get("kl_coef"):
        metrics.ratio("kl", sums.kl, sums.tokens)
    if settings.get("opd_coef"):
        metrics.ratio("reverse_kl_estimate", sums.opd, sums.tokens)
    if args.update_epochs * args.num_minibatches > 1:
        metrics.ratio("approx_kl", sums.approx_kl, sums.tokens)
        if first:
            metrics.ratio("first_ratio", sums.ratio, sums.tokens)


def kl_passed(kl: torch.Tensor, target_kl: float, run: Run) -> bool:
    """Whether a minibatch's approximate KL (`kl`: its sum and tokens on this rank) over all ranks passed
    --target_kl: decided from the all-reduced value, so every rank stops at the same update (a rank stopping alone
    would wait forever in DDP's next all-reduce)."""
    total, count = all_reduce_sum(kl.double(), run.dist).tolist()
    return total / max(count, 1.0) > target_kl
