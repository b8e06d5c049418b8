"""The per-token signal of on-policy distillation's sampled-token form, and the variants of it the field compares.

The student samples y; at each completion position t, with p = p_S(y_t) and q = p_T(y_t) (both at the loss's
temperature), the signal is a reward r_t that the loss turns into a policy gradient: the surrogate
stopgrad(-w_t r_t) log p_S(y_t) per token, whose gradient is w_t r_t grad log p_S(y_t) with a minus sign (OPD's
--loss sampled_kl), or an advantage added to the RL loop's (A_t = A_i + opd_coef w_t r_t).

    log_ratio  r_t = log q - log p                    vanilla OPD: -r_t is the one-sample estimate of the reverse
                                                      KL(p_S || p_T) at t (unbounded: a token the teacher rules out
                                                      gives -inf)
    power      r_t = q^a - p^a, in [-1, 1]            PowerOPD (arXiv 2606.17199, a = 5 its default): bounded, with
                                                      the log-ratio's sign at every token; r_t / a -> log q - log p
                                                      as a -> 0, so small a is vanilla OPD scaled by a

The position weight w_t (1 without one):

    iw         w_t = 1 + g (1 - sum_{s<t} |r_s| / sum_s |r_s|)    IW-OPD (arXiv 2606.22600, g = 0.5): the sums over
                                                      the completion tokens of t's own row, so a token weighs more
                                                      the less of its row's total discrepancy lies before it (the
                                                      early tokens, where the student's prefix is still the
                                                      teacher's); a row whose |r| sum is 0 has w = 1 + g throughout.
                                                      A constant (no gradient through it), from the same r_t as the
                                                      loss uses.

A row is whole inside one micro-batch (every loop splits batches by rows), so the sums never cross a micro-batch.
"""
from __future__ import annotations

import torch

REWARDS = ("log_ratio", "power")
POSITION_WEIGHTS = ("none", "iw")


def token_reward(student_logp: torch.Tensor, teacher_logp: torch.Tensor, kind: str = "log_ratio",
                 alpha: float = 5.0) -> torch.Tensor:
    """r_t from the sampled tokens' log-probabilities under the student and the teacher (same shape)."""
    if kind == "log_ratio":
        return teacher_logp - student_logp
    if kind == "power":
        return torch.exp(alpha * teacher_logp) - torch.exp(alpha * student_logp)
    raise ValueError(f"token reward {kind!r}: use one of {REWARDS}")


def position_weights(rewards: torch.Tensor, rows: torch.Tensor, gamma: float = 0.5) -> torch.Tensor:
    """IW-OPD's w_t (module docstring) for flattened completion tokens: `rewards` (N,) and `rows` (N,), each token's
    row index, non-decreasing (the tokens row by row, in order, as completion_hidden returns them) -> (N,), detached."""
    magnitude = rewards.detach().abs()
    if magnitude.numel() == 0:
        return magnitude
    rows = rows.to(magnitude.device)
    # each row's tokens laid out on a grid of (rows, longest row): prefix sums within a row, never across rows
    counts = torch.bincount(rows)
    position = torch.arange(len(rows), device=rows.device) - (torch.cumsum(counts, 0) - counts)[rows]
    grid = magnitude.new_zeros(len(counts), int(counts.max()))
    grid[rows, position] = magnitude
    before = (torch.cumsum(grid, 1) - grid)[rows, position]  # sum_{s<t} |r_s| within t's row
    total = grid.sum(1)[rows]
    share = torch.where(total > 0, before / torch.where(total > 0, total, 1.0), 0.0)
    return 1.0 + gamma * (1.0 - share)
