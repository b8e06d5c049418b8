"""Verifiable rewards for the RL loop, and the groups they are compared within.

    collator = GroupCollator(prompt_collator, G)     # each prompt row G times, consecutively: one group
    rewards = reward_of(texts, truths, "math", format_weight=0.1)

A reward is math-verify's verdict against the row's ground truth (eval/grader.py: the last \\boxed{} after the
thinking, equivalence by sympy), 1.0 or 0.0, plus `format_weight` when the completion has a final boxed answer at
all (whatever its value): the signal a student that never boxes needs before any group can differ. `none`: 0 for
every completion (the OPD term alone teaches).
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from common.errors import refuse
from dataset.collators import IGNORE_INDEX
from eval.grader import grade_batch, last_boxed, final_text
from trainer.skeleton import load_prompt_data

REWARDS = ("math", "none")


class GroupCollator:
    """A PromptCollator's batch with each row repeated G times, consecutively (the rows' dicts gain `generation`
    0..G-1, which seeds their samples apart): the data stream cuts ranks and micro-batches from prompts, so a group
    is never split across them."""

    def __init__(self, collator, group_size: int):
        self.collator, self.group_size = collator, group_size

    def __call__(self, rows: list[dict]) -> dict:
        batch = self.collator(rows)
        g = self.group_size
        return {"prompt_ids": batch["prompt_ids"].repeat_interleave(g, dim=0),
                "prompt_attention_mask": batch["prompt_attention_mask"].repeat_interleave(g, dim=0),
                "rows": [{**row, "generation": i} for row in batch["rows"] for i in range(g)]}


def check_ground_truths(dataset, path: str) -> None:
    """Every row has a ground truth (a `ground_truth` column or DAPO's reward_model.ground_truth), or the run is
    refused at start-up naming the first row without one."""
    for index in range(len(dataset)):
        if dataset[index].get("ground_truth") in (None, ""):
            refuse(f"{path} row {index} has no ground truth (a `ground_truth` column, or DAPO's "
                   f"reward_model.ground_truth): --reward math needs one in every row; --reward none trains "
                   f"without rewards")


def reward_of(texts: Sequence[str], truths: Sequence[str | None], kind: str,
              format_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (rewards (n,) float32, correct (n,) bool) for the decoded completions."""
    if kind == "none":
        zeros = torch.zeros(len(texts))
        return zeros, zeros.bool()
    correct = torch.tensor([result.correct for result in grade_batch(texts, [str(t) for t in truths])],
                           dtype=torch.bool)
    rewards = correct.float()
    if format_weight:
        boxed = torch.tensor([_has_final_box(text) for text in texts], dtype=torch.float32)
        rewards = rewards + format_weight * boxed
    return rewards, correct


def _has_final_box(text: str) -> bool:
    answer = final_text(text)
    return answer is not None and last_boxed(answer) is not None


def load_graded_prompts(args) -> tuple:
    """The RL loops' prompts (load_prompt_data's four), every row's ground truth checked at start-up with --reward
    math."""
    loaded = load_prompt_data(args, "opd_prompts", need_completion=False)
    if args.reward == "math":
        check_ground_truths(loaded[2], os.path.relpath(loaded[2].path))
    return loaded


def graded_samples(rollouts, tokenizer, batch: dict, step: int, epoch: int, args, clock) -> tuple:
    """Steps 1-2 of an RL micro-batch: the rows' samples (trainer/rollouts/source.py) and their rewards ->
    input_ids, attention_mask, labels, rewards and whether each answer is right."""
    input_ids, attention_mask, labels = rollouts.sequences(batch, step, epoch, True, clock)
    with clock("reward"):
        rewards, correct = sampled_rewards(tokenizer, batch, input_ids, labels, args.reward, args.format_reward)
    return input_ids, attention_mask, labels, rewards, correct


def sampled_rewards(tokenizer, batch: dict, input_ids: torch.Tensor, labels: torch.Tensor, reward: str,
                    format_reward: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The rewards of a micro-batch's completions (decoded without special tokens, as eval_math.py grades them) ->
    (rewards, correct), one per row."""
    completion = labels != IGNORE_INDEX
    texts = [tokenizer.decode(input_ids[i][completion[i]].tolist(), skip_special_tokens=True)
             for i in range(input_ids.shape[0])]
    return reward_of(texts, [row.get("ground_truth") for row in batch["rows"]], reward, format_reward)


def add_group_stats(metrics, rewards: torch.Tensor, correct: torch.Tensor, labels: torch.Tensor, input_ids, eos: int,
                    group_size: int) -> None:
    """Reward mean and std (over the window's completions), pass@1, completion length and EOS share; with groups
    (G > 1) pass@G and the share of groups with no reward variance (no signal)."""
    groups = rewards.view(-1, group_size)
    rows = rewards.numel()
    metrics.ratio("reward", rewards.sum(), rows)
    metrics.ratio("reward_sq", (rewards ** 2).sum(), rows)  # -> reward_std at the step (the window's)
    metrics.ratio("pass@1", correct.sum(), rows)
    if group_size > 1:
        metrics.ratio(f"pass@{group_size}", correct.view(-1, group_size).any(dim=1).sum(), groups.shape[0])
        metrics.ratio("zero_variance_share", (groups == groups[:, :1]).all(dim=1).sum(), groups.shape[0])
    completion = labels != IGNORE_INDEX
    metrics.ratio("completion_len", completion.sum(), rows)
    metrics.ratio("eos_share", ((input_ids == eos) & completion).any(dim=1).sum(), rows)


def reward_std(metrics: dict) -> None:
    """The window's reward standard deviation from its mean and mean square (replaces reward_sq)."""
    mean_sq = metrics.pop("reward_sq")
    metrics["reward_std"] = max(mean_sq - metrics["reward"] ** 2, 0.0) ** 0.5
