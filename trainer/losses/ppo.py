"""PPO with a critic, the math: per-token GAE from a reward at the last token, and the clipped value loss.

    per-token reward  r_t = -kl_coef (log pi(y_t) - log p_ref(y_t))  (+ the answer's reward at its last token)
    delta_t           r_t + gamma V(s_{t+1}) - V(s_t)                 (V after the last token: 0)
    advantage         A_t = delta_t + gamma lambda A_{t+1}            (GAE, Schulman et al. 2016)
    return            R_t = A_t + V(s_t)                              (the critic's target)
    value loss        0.5 max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2)   (PPO2's clipped form,
                                                                       as TRL's PPOTrainer and minimind's)

Rows are right padded: a completion's tokens first, then pads (mask 0). Rewards and values are taken as 0 on the
pads, so each row's recursion starts at 0 after its own last token -- one backward loop over the columns serves rows
of every length (TRL's formulation).
"""
from __future__ import annotations

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) per-token rewards, the critic's values V(s_t) and the completion mask (1 on a row's tokens, then 0)
    -> (advantages, returns), (B, T), 0 on the pads."""
    keep = mask.to(values.dtype)
    rewards, values = rewards * keep, values * keep
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        following = values[:, t + 1] if t + 1 < values.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * following - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    advantages = advantages * keep
    return advantages, (advantages + values) * keep


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped value loss summed over the mask's tokens, and the tokens where the clipped term was the larger
    (its gradient the one taken)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    plain, bounded = (values - returns) ** 2, (clipped - returns) ** 2
    keep = mask.bool()
    per_token = 0.5 * torch.maximum(plain, bounded)
    return torch.where(keep, per_token, 0.0).sum(), ((bounded > plain) & keep).sum()


OLD_VALUE, RETURN = 4, 5  # PPO's two columns after the policy loss's four (trainer/losses/policy_gradient.py)


def rows_of(flat: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token numbers in completion_hidden's order (row by row) -> (B, T) right padded, and the mask."""
    counts = (labels[:, 1:] != -100).sum(dim=1)
    T = int(counts.max()) if len(counts) else 0
    mask = torch.arange(T, device=labels.device)[None] < counts[:, None]
    padded = flat.new_zeros(len(counts), T)
    padded[mask] = flat
    return padded, mask


def token_rewards(reward: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor | None, labels: torch.Tensor,
                  kl_coef: float) -> torch.Tensor:
    """Each completion token's reward (completion order): -kl_coef (log pi_old - log p_ref) (k1, TRL's), and at
    each row's last token the answer's reward too."""
    rewards = -kl_coef * (old_logp - ref_logp) if ref_logp is not None else torch.zeros_like(old_logp)
    last = (labels[:, 1:] != -100).sum(dim=1).cumsum(0) - 1
    return rewards.index_add(0, last, reward.to(rewards))
