# python -m pytest tests/test_packing.py
"""--packing: the packed forward (model/qwen3.py: Packing -- projections, norms, RoPE and MLPs on the rows' real
tokens only, attention on the padded layout) against the padded forward of the same right-padded rows: the same
hidden states at every real position and the same gradients, in fp32, under CPU bf16 autocast, with gradient
checkpointing and with compiled layers; and `completion_hidden` through it: the same positions, order and labels.
The loops with --packing 1 against --packing 0: tests/test_loop_invariants.py, tests/test_fsdp.py,
tests/test_train_logit_free.py."""
import pytest
import torch

from support import TINY_CONFIG
from model import Qwen3Config, create_model
from model.qwen3 import Packing
from trainer.losses.chunked import completion_hidden

PAD = 151643


def rows(seed: int = 0):
    """Three right-padded rows of 20 columns: whole, 12 real tokens, 5 real tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (3, 20), generator=g)
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, 12:], mask[2, 5:] = 0, 0
    return ids.masked_fill(mask == 0, PAD), mask


def forward_and_grads(model, ids, packing=None):
    """The real positions' hidden states (N, H), row by row, and every parameter's gradient of their sum of
    squares."""
    model.zero_grad()
    hidden = model(ids, return_hidden=True, packing=packing).hidden_states
    if packing is None:
        hidden = hidden.reshape(-1, hidden.shape[-1])[Packing.of(mask_of(ids)).index]
    hidden.float().square().sum().backward()
    return hidden.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def mask_of(ids: torch.Tensor) -> torch.Tensor:
    return (ids != PAD).long()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("how", ["fp32", "bf16 autocast", "checkpointed"])
def test_the_packed_forward_is_the_padded_forward_at_the_real_positions(how, one_thread):
    model = create_model(Qwen3Config.from_dict(TINY_CONFIG), seed=0).train()
    model.gradient_checkpointing = how == "checkpointed"
    ids, mask = rows()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "bf16 autocast")
    with autocast:
        padded, padded_grads = forward_and_grads(model, ids)
        packed, packed_grads = forward_and_grads(model, ids, Packing.of(mask))
    assert packed.shape == (int(mask.sum()), TINY_CONFIG["hidden_size"])
    tolerance = 1e-2 if how == "bf16 autocast" else 1e-5  # bf16: other GEMM shapes round otherwise
    assert relative_error(packed, padded) < tolerance
    for name, grad in padded_grads.items():
        assert relative_error(packed_grads[name], grad) < tolerance, name


def test_compiled_layers_take_the_packed_forward(compile_calls, one_thread):
    model = create_model(Qwen3Config.from_dict(TINY_CONFIG), seed=0).train()
    ids, mask = rows()
    reference, _ = forward_and_grads(model, ids, Packing.of(mask))
    model.compile_layers()
    for seed in (0, 1):  # two batches of other sizes through the same compiled layers
        ids, mask = rows(seed)
        packed, _ = forward_and_grads(model, ids, Packing.of(mask))
        if seed == 0:
            torch.testing.assert_close(packed, reference)
    assert len(compile_calls) == TINY_CONFIG["num_hidden_layers"]


def test_completion_hidden_packed_keeps_the_positions_order_and_labels(one_thread):
    model = create_model(Qwen3Config.from_dict(TINY_CONFIG), seed=0).eval()
    ids, mask = rows()
    labels = torch.full_like(ids, -100)
    labels[0, 8:20], labels[1, 6:12] = ids[0, 8:20], ids[1, 6:12]  # row 2: no label at all
    with torch.no_grad():
        hidden, targets = completion_hidden(model, ids, mask, labels)
        model.pack_rows = True
        packed_hidden, packed_targets = completion_hidden(model, ids, mask, labels)
    assert torch.equal(packed_targets, targets) and len(targets) == 12 + 6
    assert relative_error(packed_hidden, hidden) < 1e-6


def test_a_packing_of_rows_without_padding_is_the_identity_layout():
    ids, mask = rows()
    packing = Packing.of(torch.ones_like(mask))
    assert torch.equal(packing.index, torch.arange(60)) and torch.equal(packing.positions(), torch.arange(60) % 20)
    x = torch.randn(60, 2, 4)
    assert torch.equal(packing.unpad(packing.pad(x).transpose(1, 2)), x)
