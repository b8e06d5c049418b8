# python -m pytest tests/test_rollout_correction.py
"""trainer/losses/rollout_correction.py on hand-made log-probabilities: TIS's truncated token weights, MIS's
sequence ratio with its mask, IcePop's two-sided band; a rollout's masked tokens leave its labels, values and
weights (trainer/rl/minibatches.py's Rollout.corrected); the policy loss with the weights against a float64
definition is in tests/test_policy_gradient.py."""
import math

import pytest
import torch

from dataset.collators import IGNORE_INDEX
from trainer.losses.rollout_correction import correction_weights
from trainer.rl.minibatches import Rollout

# two answers: row 0 of three tokens, row 1 of two; log rho = log pi_old - log mu per token
LOG_RHO = [math.log(3.0), math.log(0.9), math.log(0.4), math.log(1.2), math.log(6.0)]
ROWS = torch.tensor([0, 0, 0, 1, 1])


def weights(kind, **limits):
    old = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5])
    sampler = old - torch.tensor(LOG_RHO)
    return correction_weights(old, sampler, ROWS, kind, **limits)


def test_tis_truncates_each_tokens_ratio_at_the_cap():
    w, keep = weights("tis")
    assert w.tolist() == pytest.approx([2.0, 0.9, 0.4, 1.2, 2.0], rel=1e-6) and bool(keep.all())
    assert weights("tis", cap=4.0)[0].tolist() == pytest.approx([3.0, 0.9, 0.4, 1.2, 4.0], rel=1e-6)


def test_mis_weighs_every_token_by_its_answers_ratio_and_masks_answers_above_the_cap():
    """Row 0: 3 x 0.9 x 0.4 = 1.08, kept; row 1: 1.2 x 6 = 7.2 > 2, masked whole."""
    w, keep = weights("mis")
    assert w.tolist() == pytest.approx([1.08, 1.08, 1.08, 0.0, 0.0], rel=1e-6)
    assert keep.tolist() == [True, True, True, False, False]
    assert weights("mis", cap=8.0)[0].tolist() == pytest.approx([1.08] * 3 + [7.2] * 2, rel=1e-6)


def test_icepop_keeps_the_ratio_inside_its_band_and_masks_outside():
    w, keep = weights("icepop")
    assert keep.tolist() == [True, True, False, True, False]  # 0.4 < 0.5 and 6 > 5 are out
    assert w.tolist() == pytest.approx([3.0, 0.9, 0.0, 1.2, 0.0], rel=1e-6)
    assert weights("icepop", low=0.3, high=7.0)[1].all()


def test_equal_log_probabilities_give_weights_of_one():
    old = torch.tensor([-1.0, -2.0, -0.5])
    for kind in ("tis", "mis", "icepop"):
        w, keep = correction_weights(old, old.clone(), torch.tensor([0, 0, 1]), kind)
        assert torch.equal(w, torch.ones(3)) and bool(keep.all()), kind


def test_a_corrected_rollout_drops_its_masked_tokens_from_labels_values_and_weights():
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 5, 6, 7], [IGNORE_INDEX, IGNORE_INDEX, 8, 9, IGNORE_INDEX]])
    values = torch.arange(5, dtype=torch.float32)[:, None].expand(5, 4).clone()  # token k's values: k
    rollout = Rollout(torch.zeros_like(labels), torch.ones_like(labels), labels, values)
    w, keep = weights("icepop")  # tokens 2 (row 0's last) and 4 (row 1's last) out
    out = rollout.corrected(w, keep)
    assert out.labels.tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 5, 6, IGNORE_INDEX],
                                   [IGNORE_INDEX, IGNORE_INDEX, 8, IGNORE_INDEX, IGNORE_INDEX]]
    assert out.values[:, 0].tolist() == [0.0, 1.0, 3.0]
    assert out.is_weights.tolist() == pytest.approx([3.0, 0.9, 1.2], rel=1e-6)
    assert torch.equal(rollout.labels, labels), "the rollout itself is left as it was"
    row = out.rows(1, 2)  # a minibatch's slice keeps each row's tokens' values and weights
    assert row.values[:, 0].tolist() == [3.0] and row.is_weights.tolist() == pytest.approx([1.2], rel=1e-6)
