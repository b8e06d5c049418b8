"""The divergences between the student and a teacher on the same completions: one dispatcher that training and
held-out evaluation both call, so what they compute cannot drift apart.

Four kinds, by what the teacher gives:
    jsd         generalized JSD over the full vocabulary at `beta` (1: reverse KL(student || teacher)): a local
                teacher's logits (trainer/losses/closed_forms.py)
    topk        the same over the teacher's top-K, the sampled token and one tail bucket per position: a served
                teacher's top-K log-probabilities, or a local teacher's logits cut the same way
                (trainer/losses/topk_divergence.py; a lower bound of jsd, exact as the top-K covers the mass)
    sampled_kl  the policy-gradient form of reverse KL: the teacher's log-probability of each sampled token only;
                its loss is a surrogate whose gradient is the reverse KL's, its value the one-sample estimate
    kd          classic KD on fixed data: alpha * cross entropy against the data + (1 - alpha) * T^2
                KL(teacher || student) over the full vocabulary, a local teacher's logits (or T^2 times a skew
                divergence: `kd_divergence`)
    skew_kl     DistiLLM's skew KL, KL(p_T || a p_T + (1 - a) p_S), and skew reverse KL, KL(p_S || (1 - a) p_T +
    skew_rkl    a p_S), over the full vocabulary, a local teacher's logits (a = `skew`; 0: the forward / reverse KL)

Evaluation's choice, stated once (`evaluation_divergence`): the exact full-vocabulary divergence wherever a local
teacher allows it, whatever training uses; with a served teacher, what training computes.

Every function returns sums over the completion tokens and their number: the skeleton normalises by the tokens of
the whole window and all ranks (docs/architecture.md). `labels` select the positions that count: a loss over a
subset of positions is the same call with the others' labels set to IGNORE_INDEX.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainer.losses.fused_divergences import (chunked_generalized_jsd_loss, fused_kd_loss, fused_sampled_kl_loss,
                                              fused_skew_loss)
from trainer.losses.topk_divergence import chunked_topk_divergence

KINDS = ("jsd", "topk", "sampled_kl", "kd", "skew_kl", "skew_rkl")


@dataclass(frozen=True)
class Divergence:
    kind: str                 # one of KINDS
    beta: float = 1.0         # jsd / topk: 0 forward KL, 1 reverse KL, between: generalized JSD
    temperature: float = 1.0  # the softmax temperature of both distributions
    topk: int = 0             # topk: K
    alpha: float = 0.0        # kd: the weight of the cross entropy against the data
    # sampled_kl's variants (trainer/losses/token_signals.py): the per-token reward, PowerOPD's exponent, IW-OPD's
    # position weight and its gain
    reward: str = "log_ratio"
    power_alpha: float = 5.0
    position_weight: str = "none"
    iw_gamma: float = 0.5
    skew: float = 0.1         # skew_kl / skew_rkl, and kd with a skew kd_divergence: DistiLLM's a
    kd_divergence: str = "kl"  # kd: kl, skew_kl or skew_rkl

    def extra_names(self) -> tuple[str, ...]:
        """The per-token numbers `divergence_sums` logs beside the loss (DivergenceSums.extras)."""
        return {"topk": ("teacher_tail_mass",), "sampled_kl": ("reverse_kl_estimate",),
                "kd": ("ce", "kd")}.get(self.kind, ())

    def metric_name(self) -> str:
        """How its value is logged: reverse_kl / jsd_beta<b>, with _top<K> for topk; reverse_kl_estimate."""
        if self.kind == "sampled_kl":
            return "reverse_kl_estimate"
        if self.kind in ("skew_kl", "skew_rkl"):
            return f"{self.kind}{self.skew:g}"
        name = "reverse_kl" if self.beta == 1.0 else f"jsd_beta{self.beta:g}"
        return f"{name}_top{self.topk}" if self.kind == "topk" else name


@dataclass
class DivergenceSums:
    loss: torch.Tensor         # what training backwards (summed over the tokens)
    tokens: torch.Tensor       # the completion tokens it covers
    value: torch.Tensor        # the divergence it measures, summed (sampled_kl: the estimate, not the surrogate)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # summed per-token numbers worth logging


def training_divergence(loss: str, beta: float, temperature: float, teacher_topk: int,
                        signal: dict | None = None, skew: float = 0.1) -> Divergence:
    """The OPD loop's flags (--loss, --beta, --temperature, --teacher_topk; with sampled_kl `signal`, the variant
    flags' values by Divergence's field names; --skew) -> what it trains with."""
    if loss == "sampled_kl":
        return Divergence("sampled_kl", temperature=temperature, **(signal or {}))
    if loss in ("skew_kl", "skew_rkl"):
        return Divergence(loss, temperature=temperature, skew=skew)
    if teacher_topk:
        return Divergence("topk", beta, temperature, teacher_topk)
    return Divergence("jsd", beta, temperature)


def evaluation_divergence(beta: float, local_teacher: bool, teacher_topk: int = 0) -> Divergence:
    """What held-out evaluation reports, at temperature 1: with a local teacher the exact full-vocabulary divergence
    at `beta` (top-K is a bound and the sampled-token loss an estimate: a local teacher gives the real number);
    with a served teacher the top-K divergence at `beta` (--teacher_topk K), else the sampled-token estimate."""
    if local_teacher:
        return Divergence("jsd", beta)
    if teacher_topk:
        return Divergence("topk", beta, topk=teacher_topk)
    return Divergence("sampled_kl")


def divergence_sums(divergence: Divergence, student_hidden: torch.Tensor, student_weight: torch.Tensor,
                    labels: torch.Tensor, scores, teacher_weight: torch.Tensor | None, chunk_size: int,
                    vocab_size: int, rows: torch.Tensor | None = None) -> DivergenceSums:
    """The student's final hidden states at the completion positions and their labels (trainer/losses/chunked.py's
    completion_hidden) against the teacher's `scores` (trainer/teachers/parts.py's `teacher_scores`; `teacher_weight`
    its lm_head for a local teacher, None for a served one) -> the sums, chunk by chunk through the lm_heads (no (N, V)
    logits). `rows`: each position's row (completion_rows), which IW-OPD's position weights need."""
    common = dict(student_weight=student_weight, labels=labels, chunk_size=chunk_size, vocab_size=vocab_size)
    local = teacher_weight is not None
    teacher = dict(teacher_hidden=scores, teacher_weight=teacher_weight) if local else {}
    if divergence.kind == "topk":
        support = teacher if local else dict(teacher_support=scores)
        loss, tokens, tail = chunked_topk_divergence(student_hidden, k=divergence.topk, beta=divergence.beta,
                                                     temperature=divergence.temperature, **common, **support)
        return DivergenceSums(loss, tokens, loss, {"teacher_tail_mass": tail})  # the mass outside the support
    if divergence.kind == "jsd":
        loss, tokens = chunked_generalized_jsd_loss(student_hidden, beta=divergence.beta,
                                                    temperature=divergence.temperature, **common, **teacher)

        return DivergenceSums(loss, tokens, loss)
    if divergence.kind == "kd":  # classic KD on the data: alpha CE + (1 - alpha) T^2 KL(teacher || student)
        loss, tokens, ce, kd = fused_kd_loss(student_hidden, alpha=divergence.alpha,
                                             temperature=divergence.temperature, **common, **teacher,
                                             divergence=divergence.kd_divergence, skew=divergence.skew)
        return DivergenceSums(loss, tokens, loss, {"ce": ce, "kd": kd})
    if divergence.kind in ("skew_kl", "skew_rkl"):
        loss, tokens = fused_skew_loss(student_hidden, kind=divergence.kind, skew=divergence.skew,
                                       temperature=divergence.temperature, **common, **teacher)
        return DivergenceSums(loss, tokens, loss)

    weighted = divergence.position_weight == "iw"
    surrogate, tokens, kl = fused_sampled_kl_loss(student_hidden, temperature=divergence.temperature, **common,
                                                  **teacher, **({} if local else dict(teacher_logprobs=scores)),
                                                  reward=divergence.reward, alpha=divergence.power_alpha,
                                                  rows=rows if weighted else None, gamma=divergence.iw_gamma)
    return DivergenceSums(surrogate, tokens, kl, {"reverse_kl_estimate": kl})
