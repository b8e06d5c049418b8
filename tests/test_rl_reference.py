# python -m pytest tests/test_rl_reference.py
"""trainer/losses/policy_gradient.py against TRL 1.16.0's GRPO (trl/trainer/grpo_trainer.py, class GRPOTrainer).

Pinned: TRL's formulas, written out below as small plain-torch functions from its source (not imported, and not
built from ours), on the same random tensors as ours:
    advantages  _generate_and_score_completions, multi_objective_aggregation="sum_then_normalize":
                A = r - mean_group(r), divided by (std_group(r) + 1e-4) with scale_rewards="group" (ours: grpo) and
                not divided with "none" (ours: drgrpo); std from trl.trainer.utils.nanstd, with Bessel's
                correction; one generation per group: std = 0, so A = 0
    loss        _compute_loss, importance_sampling_level="token": coef_1 = exp(logp - old_logp),
                coef_2 = clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high), l = -min(coef_1 A, coef_2 A)
                + beta * (exp(ref - logp) - (ref - logp) - 1); old_logp = logp.detach() when generation and
                optimisation are aligned (old_per_token_logps None)
    aggregation loss_type="dapo": sum(l * mask) / num_items_in_batch (the completion tokens; one process, one
                micro-batch per generation); loss_type="dr_grpo": sum(l * mask) / (rows * max_completion_length)
    clipping    the logged clip_ratio/region_mean: (coef_1 < 1 - eps_low and A < 0) or (coef_1 > 1 + eps_high and
                A > 0)
(grpo_trainer.py 1.16.0: the advantages at lines 2761-2788, _compute_loss at 3020-3184, its clip metrics 3272-3277.)
TRL 1.16 multiplies the KL term by coef_1 by default (GRPOConfig.use_bias_correction_kl=True, DeepSeek-V3.2); ours
does not, which is TRL with use_bias_correction_kl=False: the comparisons of ours use False, and the reference has
the flag so that the TRL test below checks the reference against real TRL both ways.

The last test runs TRL's own code (tests/trl_grpo_probe.py) in a separate venv, when there is one, on the same
tensors and compares its advantages, losses, gradients and metrics with ours.
"""
from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from trainer.losses.policy_gradient import (ADVANTAGE, OLD_LOGP, REF_LOGP, TEACHER_LOGP, group_advantages, k3,
                                     policy_loss)

pytestmark = pytest.mark.usefixtures("one_thread")

TRL_PYTHON = Path.home() / ".cache/distill/trl-venv/bin/python"
TRL_VENV_HELP = ("python -m venv --system-site-packages ~/.cache/distill/trl-venv && "
                 "~/.cache/distill/trl-venv/bin/pip install trl==1.16.0")
PROBE = Path(__file__).with_name("trl_grpo_probe.py")

GROUP, EPS_LOW, EPS_HIGH, BETA, TEMPERATURE, MAX_LEN = 4, 0.2, 0.28, 0.04, 0.7, 10
KIND_TO_TRL = {"grpo": ("group", "dapo"), "drgrpo": ("none", "dr_grpo")}  # ours -> (scale_rewards, loss_type)


# ----------------------------------------------------------------------------- TRL 1.16.0's formulas, pinned

def trl_advantages(rewards: torch.Tensor, group_size: int, scale_rewards: str) -> torch.Tensor:
    """_generate_and_score_completions: group mean, nanstd (Bessel: sum of squares / (G - 1)), + 1e-4."""
    grouped = rewards.double().view(-1, group_size)
    mean = grouped.sum(1, keepdim=True) / group_size
    if group_size > 1:
        std = (((grouped - mean) ** 2).sum(1, keepdim=True) / (group_size - 1)).sqrt()
    else:  # TRL: "could occur in eval when num_generations_eval=1"
        std = torch.zeros_like(mean)
    advantages = grouped - mean
    if scale_rewards == "group":
        advantages = advantages / (std + 1e-4)
    return advantages.reshape(-1)


def trl_logps(logits: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    """The policy's log-probability of each sampled token at the sampling temperature (TRL's fused LM head)."""
    z = logits / temperature
    return z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - z.logsumexp(-1)


def trl_per_token_loss(logp: torch.Tensor, old_logp: torch.Tensor | None, ref_logp: torch.Tensor,
                       advantages: torch.Tensor, beta: float, bias_correction_kl: bool = False) -> torch.Tensor:
    """_compute_loss for loss_type dapo / dr_grpo at token level; advantages (B,), the rest (B, T)."""
    old_logp = logp.detach() if old_logp is None else old_logp
    coef_1 = torch.exp(logp - old_logp)
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    a = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    if bias_correction_kl:
        kl = kl * coef_1
    return per_token + beta * kl


def trl_aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    masked = (per_token * mask).sum()
    if loss_type == "dapo":  # num_items_in_batch / num_processes * accumulation / steps_per_generation, all 1 here
        return masked / mask.sum().clamp(min=1)
    return masked / (per_token.size(0) * MAX_LEN)  # dr_grpo


def trl_clipped(coef_1: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> tuple[int, int]:
    """The tokens TRL logs as clipped below (A < 0) and above (A > 0)."""
    a = advantages.unsqueeze(1)
    low = (coef_1 < 1 - EPS_LOW) & (a < 0) & mask
    high = (coef_1 > 1 + EPS_HIGH) & (a > 0) & mask
    return int(low.sum()), int(high.sum())


# ----------------------------------------------------------------------------- the shared random batch

@dataclass
class Batch:
    rewards: torch.Tensor    # (B,), groups of GROUP consecutive rows
    lengths: list[int]       # each completion's tokens; the rest of its T positions is padding
    labels: torch.Tensor     # (B, T) sampled tokens, valid ids everywhere (TRL pads them)
    mask: torch.Tensor       # (B, T) bool, from lengths
    logits: torch.Tensor     # (B, T, V) float32
    old_logp: torch.Tensor   # (B, T): the behaviour policy's, logp +- noise so that both clips happen
    ref_logp: torch.Tensor   # (B, T): the reference's, logp +- noise


def make_batch(seed: int = 0, rows: int = 16, width: int = 7, vocab: int = 50) -> Batch:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.cat([torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.full((GROUP,), 0.5),  # binary; zero variance
                         torch.randn(GROUP, generator=g), torch.tensor([1.0, 0.0, 0.0, 0.0])])
    assert rewards.numel() == rows
    lengths = [width] + torch.randint(1, width + 1, (rows - 1,), generator=g).tolist()
    mask = torch.arange(width) < torch.tensor(lengths).unsqueeze(1)
    labels = torch.randint(0, vocab, (rows, width), generator=g)
    logits = 2 * torch.randn(rows, width, vocab, generator=g)
    logp = trl_logps(logits.double(), labels, TEMPERATURE).float()
    old_logp = logp + 0.5 * torch.randn(rows, width, generator=g)
    ref_logp = logp + 0.3 * torch.randn(rows, width, generator=g)
    return Batch(rewards, lengths, labels, mask, logits, old_logp, ref_logp)


@pytest.fixture(scope="module")
def batch() -> Batch:
    return make_batch()


# ----------------------------------------------------------------------------- ours, on the same batch

def our_values(b: Batch, advantages: torch.Tensor, on_policy: bool) -> torch.Tensor:
    """policy_loss's (B * T, 4) values: each row's advantage on its tokens, old (NaN on-policy), ref, no teacher."""
    rows, width = b.labels.shape
    values = torch.zeros(rows * width, 4)
    values[:, ADVANTAGE] = advantages.float().repeat_interleave(width)
    values[:, OLD_LOGP] = float("nan") if on_policy else b.old_logp.reshape(-1)
    values[:, REF_LOGP] = b.ref_logp.reshape(-1)
    values[:, TEACHER_LOGP] = float("nan")  # unread without opd_coef
    return values


def our_sums(b: Batch, advantages: torch.Tensor, logits: torch.Tensor, *, on_policy: bool = False,
             beta: float = BETA) -> tuple[torch.Tensor, ...]:
    labels = b.labels.masked_fill(~b.mask, -100).reshape(-1)
    return policy_loss(logits.reshape(-1, logits.shape[-1]), our_values(b, advantages, on_policy), labels,
                       temperature=TEMPERATURE, clip_low=EPS_LOW, clip_high=EPS_HIGH, kl_coef=beta)


def our_loss(b: Batch, kind: str, logits: torch.Tensor, on_policy: bool = False) -> torch.Tensor:
    """The loop's normalisation: tokens (grpo, TRL's dapo) or rows x max_new_tokens (drgrpo, TRL's dr_grpo)."""
    loss, tokens = our_sums(b, group_advantages(b.rewards, GROUP, kind), logits, on_policy=on_policy)[:2]
    return loss / (b.labels.shape[0] * MAX_LEN if kind == "drgrpo" else tokens)


def reference_loss(b: Batch, kind: str, logits: torch.Tensor, on_policy: bool = False,
                   bias_correction_kl: bool = False) -> torch.Tensor:
    scale_rewards, loss_type = KIND_TO_TRL[kind]
    logp = trl_logps(logits, b.labels, TEMPERATURE)
    advantages = trl_advantages(b.rewards, GROUP, scale_rewards)
    old = None if on_policy else b.old_logp.double()
    per_token = trl_per_token_loss(logp, old, b.ref_logp.double(), advantages, BETA, bias_correction_kl)
    return trl_aggregate(per_token, b.mask, loss_type)


# ----------------------------------------------------------------------------- (a) advantages

@pytest.mark.parametrize("kind", ["grpo", "drgrpo"])
def test_group_advantages_match_trl(batch, kind):
    ours = group_advantages(batch.rewards, GROUP, kind)
    trl = trl_advantages(batch.rewards, GROUP, KIND_TO_TRL[kind][0])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), trl, rtol=1e-6, atol=1e-6)
    zero_variance = ours.view(-1, GROUP)[1]  # four equal rewards: exactly 0, no 0/0
    assert torch.equal(zero_variance, torch.zeros(GROUP))
    assert torch.isfinite(ours).all()


@pytest.mark.parametrize("kind", ["grpo", "drgrpo"])
def test_group_advantages_one_generation_are_zero(kind):
    rewards = torch.tensor([0.3, 1.0, -2.0])
    ours = group_advantages(rewards, 1, kind)
    assert torch.equal(ours, torch.zeros(3))
    assert torch.equal(trl_advantages(rewards, 1, KIND_TO_TRL[kind][0]), torch.zeros(3, dtype=torch.float64))


def test_grpo_advantages_use_bessel(batch):
    """The data tell Bessel's std from the biased one by far more than the tolerance above: (a) pins the correction."""
    grouped = batch.rewards.view(-1, GROUP)
    biased = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, unbiased=False, keepdim=True) + 1e-4)
    assert not torch.allclose(group_advantages(batch.rewards, GROUP, "grpo"), biased.reshape(-1), atol=1e-3)


# ----------------------------------------------------------------------------- (b) the clipped per-token loss, (c) k3

@pytest.mark.parametrize("beta", [0.0, BETA])
def test_per_token_clipped_loss_matches_trl(batch, beta):
    """Token by token: ours (one-token calls) against TRL's -min(coef_1 A, clamp(coef_1) A) + beta k3, with
    asymmetric eps and a random behaviour policy, so that both clips happen; and the clip counts."""
    advantages = group_advantages(batch.rewards, GROUP, "grpo")
    logp = trl_logps(batch.logits.double(), batch.labels, TEMPERATURE)
    coef_1 = torch.exp(logp - batch.old_logp.double())
    low, high = trl_clipped(coef_1, advantages.double(), batch.mask)
    assert low > 0 and high > 0, "the data must clip on both sides"
    reference = trl_per_token_loss(logp, batch.old_logp.double(), batch.ref_logp.double(), advantages.double(), beta)
    rows, width = batch.labels.shape
    values = our_values(batch, advantages, on_policy=False)
    labels = batch.labels.masked_fill(~batch.mask, -100).reshape(-1)
    logits = batch.logits.reshape(rows * width, -1)
    ours = torch.stack([policy_loss(logits[i:i + 1], values[i:i + 1], labels[i:i + 1], temperature=TEMPERATURE,
                                    clip_low=EPS_LOW, clip_high=EPS_HIGH, kl_coef=beta)[0]
                        for i in range(rows * width)]).view(rows, width)
    torch.testing.assert_close(ours.double(), reference * batch.mask, rtol=1e-5, atol=1e-6)
    clipped = our_sums(batch, advantages, batch.logits, beta=beta)[2]
    assert int(clipped) == low + high


def test_k3_matches_trl(batch):
    g = torch.Generator().manual_seed(1)
    ref_logp, logp = -5 * torch.rand(1000, generator=g), -5 * torch.rand(1000, generator=g)
    expected = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    torch.testing.assert_close(k3(ref_logp, logp), expected)
    assert (k3(ref_logp, logp) >= 0).all()
    # the loss's kl sum is sum(k3) over the completion tokens, and beta * it is the loss's KL part
    advantages = group_advantages(batch.rewards, GROUP, "grpo")
    with_kl, without_kl = our_sums(batch, advantages, batch.logits), our_sums(batch, advantages, batch.logits, beta=0)
    logp = trl_logps(batch.logits.double(), batch.labels, TEMPERATURE)
    kl = ((torch.exp(batch.ref_logp - logp) - (batch.ref_logp - logp) - 1) * batch.mask).sum()
    torch.testing.assert_close(with_kl[3].double(), kl, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close((with_kl[0] - without_kl[0]).double(), BETA * kl, rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- (d) aggregation, (e) gradients, (f)

@pytest.mark.parametrize("on_policy", [False, True], ids=["off_policy", "on_policy"])
@pytest.mark.parametrize("kind", ["grpo", "drgrpo"])
def test_loss_and_gradient_match_trl(batch, kind, on_policy):
    """Ours summed then divided as the loop does equals TRL's dapo / dr_grpo loss, and its gradient w.r.t. the logits
    equals autograd through TRL's formula, both float64 (ours keeps fp64; its advantages, as TRL's, are float32:
    1e-8 on a loss summed with cancellations); on-policy: OLD_LOGP NaN = TRL's per_token_logps.detach()."""
    ours_logits = batch.logits.double().requires_grad_(True)
    ours = our_loss(batch, kind, ours_logits, on_policy)
    ours.backward()
    trl_logits = batch.logits.double().requires_grad_(True)
    trl = reference_loss(batch, kind, trl_logits, on_policy)
    trl.backward()
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, trl, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ours_logits.grad, trl_logits.grad, rtol=1e-6, atol=1e-8)
    assert ours_logits.grad.abs().max() > 1e-3  # a gradient that could differ
    padding = ~batch.mask
    assert padding.any() and (ours_logits.grad[padding] == 0).all()


def test_on_policy_value_is_minus_advantage_plus_kl(batch):
    """On-policy the ratio is 1: the value is -A + beta k3 per token, unclipped."""
    advantages = group_advantages(batch.rewards, GROUP, "grpo")
    loss, tokens, clipped, kl = our_sums(batch, advantages, batch.logits, on_policy=True)[:4]
    expected = -(advantages.double().unsqueeze(1) * batch.mask).sum() + BETA * kl.double()
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-5)
    assert int(clipped) == 0 and int(tokens) == sum(batch.lengths)


# ----------------------------------------------------------------------------- TRL's own code, in its venv

def trl_version() -> str | None:
    if not TRL_PYTHON.exists():
        return None
    found = subprocess.run([str(TRL_PYTHON), "-c", "import importlib.metadata as m; print(m.version('trl'))"],
                           capture_output=True, text=True, timeout=60)
    return found.stdout.strip() if found.returncode == 0 else None


PROBE_CASES = [  # (name, kind, on_policy, TRL's use_bias_correction_kl)
    ("grpo_dapo", "grpo", False, False), ("grpo_dapo_on_policy", "grpo", True, False),
    ("drgrpo_dr_grpo", "drgrpo", False, False), ("drgrpo_dr_grpo_on_policy", "drgrpo", True, False),
    ("grpo_dapo_trl_default_kl", "grpo", False, True), ("grpo_dapo_on_policy_trl_default_kl", "grpo", True, True),
]


def run_probe(b: Batch, tmp_path: Path) -> dict:
    cases = [{"name": name, "scale_rewards": KIND_TO_TRL[kind][0], "loss_type": KIND_TO_TRL[kind][1],
              "on_policy": on_policy, "use_bias_correction_kl": bias}
             for name, kind, on_policy, bias in PROBE_CASES]
    data = {"rewards": b.rewards, "group_size": GROUP, "completion_lengths": b.lengths, "completion_ids": b.labels,
            "logits": b.logits, "old_logp": b.old_logp, "ref_logp": b.ref_logp, "temperature": TEMPERATURE,
            "epsilon": EPS_LOW, "epsilon_high": EPS_HIGH, "beta": BETA, "max_completion_length": MAX_LEN,
            "cases": cases}
    torch.save(data, tmp_path / "in.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([str(TRL_PYTHON), str(PROBE), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return torch.load(tmp_path / "out.pt")


def loss_and_grad(loss_of, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.clone().requires_grad_(True)
    loss = loss_of(leaf)
    loss.backward()
    return loss.detach(), leaf.grad


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.slow
def test_real_trl_matches_ours(batch, tmp_path):
    """TRL 1.16.0's _generate_and_score_completions and _compute_loss (tests/trl_grpo_probe.py), beta > 0 and
    asymmetric clipping, against ours; the TRL-default KL (ratio * k3) against the pinned reference only."""
    version = trl_version()
    if version != "1.16.0":
        pytest.skip(f"needs TRL 1.16.0 in {TRL_PYTHON} (found: {version}); create it with: {TRL_VENV_HELP}")
    results = run_probe(batch, tmp_path)
    tokens = sum(batch.lengths)
    for name, kind, on_policy, bias in PROBE_CASES:
        trl = results[name]
        assert torch.equal(trl["completion_mask"].bool(), batch.mask) and int(trl["num_items_in_batch"]) == tokens
        assert trl["trl_on_policy"], "TRL's aligned path leaves old_per_token_logps None"
        ours_advantages = group_advantages(batch.rewards, GROUP, kind)
        diffs = {"advantages": max_abs(trl["advantages"], ours_advantages)}
        expected = ours = loss_and_grad(lambda logits: our_loss(batch, kind, logits, on_policy), batch.logits)
        if bias:  # ours has no ratio on k3: TRL's default is checked against the reference, ours only reported
            print(name, "ours:", f"loss {max_abs(trl['loss'], ours[0]):.2e}",
                  f"grad {max_abs(trl['grad'], ours[1]):.2e}")
            expected = loss_and_grad(
                lambda logits: reference_loss(batch, kind, logits.double(), on_policy, bias_correction_kl=True),
                batch.logits)
        diffs.update(loss=max_abs(trl["loss"], expected[0]), grad=max_abs(trl["grad"], expected[1]))
        print(name, "reference:" if bias else "ours:", {k: f"{v:.2e}" for k, v in diffs.items()})
        assert diffs["advantages"] < 1e-6 and diffs["loss"] < 1e-6 and diffs["grad"] < 5e-7, (name, diffs)
        sums = our_sums(batch, ours_advantages, batch.logits, on_policy=on_policy)
        assert bias or abs(trl["kl"] - sums[3].item() / tokens) < 1e-5  # TRL logs ratio * k3 with the correction
        assert abs(trl["entropy"] - sums[4].item() / tokens) < 1e-5
        assert round(trl["clip_region"] * tokens) == int(sums[2])
        assert on_policy or (trl["clip_low"] > 0 and trl["clip_high"] > 0)
