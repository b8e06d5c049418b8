"""Rollouts sampled from older weights, corrected: importance weights between the trainer's log-probability of each
sampled token under the weights being trained (log pi_old: the start of the step) and the sampler's (log mu: the
rollout server's, from the weights it held, at the temperature it drew with).

    rho_t = exp(log pi_old(y_t) - log mu(y_t))
    tis     w_t = min(rho_t, C)                             token-level truncated IS: Yao et al. 2025 ("Your
                                                            efficient RL framework secretly brings you off-policy RL
                                                            training"; slime's --use-tis), C = 2
    mis     w_t = rho_seq 1[rho_seq <= C] for every token   sequence-level masked IS: Liu et al. 2025 ("When speed
            rho_seq = prod over the answer of rho_t         kills stability"; verl's sequence-level IS with its
                                                            rejection), C = 2
    icepop  w_t = rho_t 1[a <= rho_t <= b]                  IcePop's two-sided token mask (the Ling team's Ring-1T
                                                            report, 2025; NeMo-RL's ICE-POP), [a, b] = [0.5, 5]

The weight multiplies the token's policy term (the clipped surrogate or CISPO's, the OPD term inside its advantage);
a token whose weight is 0 by a mask leaves the loss and the tokens it is divided by (slime's and verl's rule: a
masked token counted in the denominator would shrink every other token's gradient).
"""
from __future__ import annotations

import torch

CORRECTIONS = ("none", "tis", "mis", "icepop")


def correction_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, rows: torch.Tensor, kind: str,
                       cap: float = 2.0, low: float = 0.5, high: float = 5.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sampled token (n,): log pi_old, the sampler's log mu and the token's row (a sequence) -> (its weight,
    float32; whether it stays in the loss, bool). `cap`: C of tis and mis; [`low`, `high`]: IcePop's band."""
    if kind not in CORRECTIONS[1:]:
        raise ValueError(f"rollout correction {kind!r}: use one of {CORRECTIONS[1:]}")
    log_ratio = old_logp.double() - sampler_logp.double()
    if kind == "mis":
        per_row = torch.zeros(int(rows.max()) + 1 if len(rows) else 0, dtype=torch.float64, device=rows.device)
        log_ratio = per_row.index_add_(0, rows, log_ratio)[rows]  # each token: its answer's log rho_seq
    rho = log_ratio.exp()
    if kind == "tis":
        return rho.clamp(max=cap).float(), torch.ones_like(rho, dtype=torch.bool)
    keep = rho <= cap if kind == "mis" else (rho >= low) & (rho <= high)
    return torch.where(keep, rho, 0.0).float(), keep
