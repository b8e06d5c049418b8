"""RL with verifiable rewards, the math: group-relative advantages and the clipped policy-gradient loss per token.

For a prompt x the student samples a group of G completions y_1..y_G and each gets a reward r_i (trainer/rl/rewards.py).

    advantage   grpo:    A_i = (r_i - mean(r)) / (std(r) + 1e-4)     std with Bessel's correction (G - 1), as TRL's
                drgrpo:  A_i =  r_i - mean(r)                         no std: its 1/std up-weights easy and hard
                                                                      prompts (Dr. GRPO, arXiv 2503.20783)
    ratio       rho_t = exp(log pi(y_t) - log pi_old(y_t))           pi_old: the weights that sampled (behaviour)
    per token   clip:   l_t = - min(rho_t A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) A_t) + kl_coef * k3_t
                cispo:  l_t = - sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t) + kl_coef * k3_t
                        (MiniMax-M1, arXiv 2506.13585: the importance weight clipped and detached, so no token's
                        gradient is dropped; its paper sets no lower bound, eps_low = 1, and tunes eps_high)
    approx KL   (rho_t - 1) - log rho_t per token: its mean over pi_old's samples estimates KL(pi_old || pi)
                (--target_kl's measure)
    k3          k3_t = exp(log p_ref(y_t) - log pi(y_t)) - (log p_ref(y_t) - log pi(y_t)) - 1   (>= 0; its mean
                over samples from pi is KL(pi || p_ref); Schulman's k3, GRPO's (DeepSeekMath) and TRL's with
                use_bias_correction_kl=False -- TRL 1.16's default multiplies it by rho, which on-policy keeps its
                value and adds k3 grad log pi to its gradient; tests/test_rl_reference.py)
    OPD term    A_t = A_i - opd_coef * (log pi(y_t) - log p_T(y_t))  (detached: the sampled-token reverse KL to a
                teacher as a dense per-token advantage); its variants A_t = A_i + opd_coef * w_t * r_t with PowerOPD's
                reward r_t and IW-OPD's position weight w_t (trainer/losses/token_signals.py; vanilla: w_t = 1,
                r_t = log p_T(y_t) - log pi(y_t))

A group with one reward has A_i = 0 for every member (no signal, no 0/0: the std's epsilon). On-policy (the rollouts
sampled by the weights being trained) pi_old is pi itself, detached: rho_t = 1, and the gradient of l_t is
-A_t grad log pi(y_t), the plain policy gradient. log pi is at the sampling temperature, as TRL's.

These functions return sums over the completion tokens; the loop hands them to the skeleton, which divides by the
window's completion tokens over all ranks (DAPO's token-level aggregation; TRL's `loss_type="dapo"`), or with
drgrpo by rows x --max_new_tokens (Dr. GRPO's constant), both exact under accumulation and any world size.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dataset.collators import IGNORE_INDEX
from trainer.losses.fused_linear import ChunkLoss, add_at_labels, fused_linear_loss
from trainer.losses.token_signals import position_weights, token_reward

ADVANTAGES = ("grpo", "drgrpo")
POLICY_LOSSES = ("clip", "cispo")
STD_EPSILON = 1e-4  # TRL's: (r - mean) / (std + 1e-4)

# the columns of the per-token values the loss reads (policy_values)
ADVANTAGE, OLD_LOGP, REF_LOGP, TEACHER_LOGP = range(4)


def group_advantages(rewards: torch.Tensor, group_size: int, kind: str = "grpo") -> torch.Tensor:
    """rewards (B * G,) in groups of G consecutive rows -> each row's advantage (B * G,), float32. `kind` grpo or
    drgrpo (module docstring); G = 1 gives 0 everywhere."""
    if kind not in ADVANTAGES:
        raise ValueError(f"advantage kind {kind!r}: use one of {ADVANTAGES}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards.shape)} are not groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if kind == "grpo" and group_size > 1:
        centred = centred / (grouped.std(dim=1, keepdim=True) + STD_EPSILON)
    return centred.reshape(-1)


def k3(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || p_ref) per sampled token: exp(d) - d - 1, d = log p_ref - log pi."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


@dataclass
class PolicySums:
    loss: torch.Tensor      # sum of l_t (what training backwards)
    tokens: torch.Tensor    # completion tokens
    clipped: torch.Tensor   # tokens where the clipped term was the one taken (its gradient is 0)
    kl: torch.Tensor        # sum of k3_t (0 without a reference)
    entropy: torch.Tensor   # sum of the full-vocabulary entropy of pi at each position
    opd: torch.Tensor       # sum of log pi(y_t) - log p_T(y_t) (0 without a teacher)
    ratio: torch.Tensor     # sum of rho_t
    approx_kl: torch.Tensor  # sum of (rho_t - 1) - log rho_t

    def __add__(self, other: "PolicySums") -> "PolicySums":
        return PolicySums(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[torch.Tensor, ...]:
        return self.loss, self.tokens, self.clipped, self.kl, self.entropy, self.opd, self.ratio, self.approx_kl


def policy_loss(student_logits: torch.Tensor, values: torch.Tensor, labels: torch.Tensor, *, temperature: float = 1.0,
                clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0, opd_coef: float = 0.0,
                opd_reward: str = "log_ratio", power_alpha: float = 5.0,
                opd_weights: torch.Tensor | None = None, kind: str = "clip",
                is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The per-token loss (module docstring; `kind` clip or cispo) summed over labels != -100, from the student's
    logits (n, V) at the completion positions and `values` (n, 4): each token's group advantage, log pi_old (NaN:
    on-policy, pi itself detached), log p_ref and log p_T (read only with kl_coef / opd_coef); the OPD term's reward
    (`opd_reward`, `power_alpha`) and position weights (n,) (None: 1); the rollout correction's importance weights
    (n,) on the policy term (None: 1; trainer/losses/rollout_correction.py) -> PolicySums' fields as a tuple: the
    reference `fused_policy_loss` is tested against."""
    mask = labels != IGNORE_INDEX
    low = student_logits.dtype in (torch.float16, torch.bfloat16)  # upcast: the loss runs in fp32 (fp64 stays)
    logp_all = torch.log_softmax((student_logits.float() if low else student_logits) / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    values = values.to(logp.dtype)
    old = torch.where(torch.isnan(values[:, OLD_LOGP]), logp.detach(), values[:, OLD_LOGP])
    advantage = values[:, ADVANTAGE]
    opd = (logp.detach() - values[:, TEACHER_LOGP]) if opd_coef else torch.zeros_like(logp)
    if opd_coef:
        weight = 1.0 if opd_weights is None else opd_weights.to(logp.dtype)
        advantage = advantage + opd_coef * weight * token_reward(logp.detach(), values[:, TEACHER_LOGP], opd_reward,
                                                                 power_alpha)
    ratio = torch.exp(logp - old)
    weight = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    if kind == "cispo":
        per_token = -weight.detach() * advantage * logp
        took_clip = (weight != ratio).detach()
    else:
        unclipped, clipped = ratio * advantage, weight * advantage
        per_token = -torch.minimum(unclipped, clipped)
        took_clip = (clipped < unclipped).detach()
    if is_weights is not None:
        per_token = is_weights.to(logp.dtype) * per_token
    kl = k3(values[:, REF_LOGP], logp) if kl_coef else torch.zeros_like(logp)
    if kl_coef:
        per_token = per_token + kl_coef * kl
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        approx_kl = ratio - 1 - (logp - old)
    zero = torch.zeros((), device=logp.device)
    return (torch.where(mask, per_token, zero).sum(), mask.sum(), (took_clip & mask).sum(),
            torch.where(mask, kl, zero).sum().detach(), torch.where(mask, entropy, zero).sum(),
            torch.where(mask, opd, zero).sum(), torch.where(mask, ratio, zero).sum().detach(),
            torch.where(mask, approx_kl, zero).sum())


def _policy_chunk(student: torch.Tensor, _teacher, spares: list[torch.Tensor], labels: torch.Tensor,
                  values: tuple[torch.Tensor, torch.Tensor], temperature: float, clip_low: float, clip_high: float,
                  kl_coef: float, opd_coef: float, opd_reward: str, power_alpha: float, kind: str):
    """`policy_loss` on one chunk in closed form: per token l_t, the extras and dl/dz = c (onehot(y) - p_T) / T
    (the driver's grad_scale is 1 / T), with c = dl/dlog pi(y). clip: c follows autograd's rules for the
    reference's `-minimum(unclipped, clipped)`: the smaller term takes the gradient, a tie gives each half; the
    clipped term's ratio passes it only inside [1 - eps_low, 1 + eps_high] (clamp's, bounds included). cispo: c is
    minus the detached clipped weight times A; both times the rollout correction's weight. `values`: (the (n, 4)
    columns, the OPD term's position weights, the correction's weights)."""
    values, opd_weights, is_weights = values
    keep = labels != IGNORE_INDEX
    log_p = torch.log_softmax(student.div_(temperature) if temperature != 1.0 else student, dim=-1, out=student)
    logp = log_p.gather(1, labels.clamp_min(0)[:, None]).squeeze(1)
    values = values.to(logp.dtype)
    old = torch.where(torch.isnan(values[:, OLD_LOGP]), logp, values[:, OLD_LOGP])
    opd = logp - values[:, TEACHER_LOGP] if opd_coef else torch.zeros_like(logp)
    advantage = values[:, ADVANTAGE]
    if opd_coef:
        reward = token_reward(logp, values[:, TEACHER_LOGP], opd_reward, power_alpha)
        advantage = advantage + opd_coef * opd_weights.to(logp.dtype) * reward
    ratio = torch.exp(logp - old)
    weight = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    if kind == "cispo":
        per_token, c, took_clip = -weight * advantage * logp, -weight * advantage, weight != ratio
    else:
        unclipped, clipped = ratio * advantage, weight * advantage
        per_token, took_clip = -torch.minimum(unclipped, clipped), clipped < unclipped
        inside = (ratio >= 1 - clip_low) & (ratio <= 1 + clip_high)
        share = torch.where(unclipped == clipped, 0.5, (unclipped < clipped).float())  # the unclipped term's
        c = -advantage * ratio * (share + (1.0 - share) * inside)
    is_weights = is_weights.to(logp.dtype)
    per_token, c = is_weights * per_token, is_weights * c
    kl = torch.zeros_like(logp)
    if kl_coef:
        kl = k3(values[:, REF_LOGP], logp)
        per_token = per_token + kl_coef * kl
        c = c + kl_coef * (1.0 - torch.exp(values[:, REF_LOGP] - logp))  # d k3 / d log pi
    c = torch.where(keep, c, 0.0)  # a masked row's values may be anything: its G finite (zero)
    p = torch.exp(log_p, out=spares[0])
    entropy = -torch.bmm(p.unsqueeze(1), log_p.unsqueeze(2)).view(-1)
    g = add_at_labels(p.mul_(-c[:, None]), labels, c)
    return per_token, g, (took_clip.float(), kl, entropy, opd, ratio, ratio - 1 - (logp - old))


def fused_policy_loss(student_hidden: torch.Tensor, student_weight: torch.Tensor, labels: torch.Tensor,
                      values: torch.Tensor, chunk_size: int, vocab_size: int, temperature: float = 1.0,
                      clip_low: float = 0.2, clip_high: float = 0.2, kl_coef: float = 0.0, opd_coef: float = 0.0,
                      opd_reward: str = "log_ratio", power_alpha: float = 5.0, rows: torch.Tensor | None = None,
                      iw_gamma: float = 0.5, kind: str = "clip", is_weights: torch.Tensor | None = None
                      ) -> PolicySums:
    """`policy_loss` from the final hidden states at the completion positions, a chunk of positions at a time
    through the lm_head with its gradient in closed form (trainer/losses/fused_linear.py): the (n, V) logits never
    exist in full and no chunk is computed twice. `values` (n, 4), the OPD term's reward, `kind` and `is_weights`
    as `policy_loss` reads them; `rows` (n,), each position's row: the OPD term weighted by IW-OPD's position
    weights with `iw_gamma` (`opd_position_weights`; None: weight 1)."""
    if kind not in POLICY_LOSSES:
        raise ValueError(f"policy loss {kind!r}: use one of {POLICY_LOSSES}")
    chunk = ChunkLoss(functools.partial(_policy_chunk, temperature=temperature, clip_low=clip_low,
                                        clip_high=clip_high, kl_coef=kl_coef, opd_coef=opd_coef,
                                        opd_reward=opd_reward, power_alpha=power_alpha, kind=kind),
                      spares=1, grad_scale=1.0 / temperature,
                      extra_names=("clipped", "kl", "entropy", "opd", "ratio", "approx_kl"))
    weights = values.new_ones(values.shape[0])
    if rows is not None and opd_coef:  # IW-OPD: each token's weight from its whole row's rewards
        weights = opd_position_weights(student_hidden, student_weight, labels, values[:, TEACHER_LOGP], rows,
                                       chunk_size, vocab_size, temperature, opd_reward, power_alpha, iw_gamma)
    is_weights = values.new_ones(values.shape[0]) if is_weights is None else is_weights
    loss, tokens, extras = fused_linear_loss(chunk, student_hidden, student_weight, labels, vocab_size, chunk_size,
                                             values=(values, weights, is_weights))
    return PolicySums(loss, tokens, *extras)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                   vocab_size: int, temperature: float = 1.0) -> torch.Tensor:
    """A frozen model's log-probability of each label (n,), chunk by chunk, no gradient: the reference's for k3,
    a local teacher's for the OPD term."""
    parts = []
    with torch.no_grad():
        for start in range(0, hidden.shape[0], chunk_size):
            logits = hidden[start:start + chunk_size] @ weight[:vocab_size].T
            low = logits.dtype in (torch.float16, torch.bfloat16)  # upcast: fp32 (fp64 stays)
            logp = torch.log_softmax((logits.float() if low else logits) / temperature, dim=-1)
            parts.append(logp.gather(-1, labels[start:start + chunk_size].clamp_min(0).unsqueeze(-1)).squeeze(-1))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


def opd_position_weights(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, teacher_logp: torch.Tensor,
                         rows: torch.Tensor, chunk_size: int, vocab_size: int, temperature: float, reward: str,
                         alpha: float, gamma: float) -> torch.Tensor:
    """IW-OPD's weight of each completion position (token_signals.position_weights) from a first pass over every
    position without gradients -- the student's head once more -- since a weight needs its whole row's rewards
    before the loss's chunks, which cut rows, run. `teacher_logp` (n,): the teacher's log-probability of each label."""
    student_logp = token_logprobs(hidden, weight, labels, chunk_size, vocab_size, temperature)
    return position_weights(token_reward(student_logp, teacher_logp.to(student_logp.dtype), reward, alpha), rows, gamma)
