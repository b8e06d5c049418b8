# python -m pytest tests/test_fused_linear.py
"""trainer/losses/fused_linear.py: the fused linear-loss driver with the cross entropy's closed form (its JSD is
tests/test_fused_divergences.py's) -- value and gradients against the definition in float64 dense autograd, against the
checkpointed path under CPU bf16 autocast, masked positions, the incoming gradient, and no_grad."""
import pytest
import torch
import torch.nn.functional as F

import trainer.losses.fused_linear as fused_linear
from benchmarks.bench_losses import CountWeightCasts
from support import Allocations
from trainer.losses.chunked import chunked_sft_loss
from trainer.losses.fused_linear import fused_cross_entropy


def case(seed: int, n: int = 37, hidden: int = 16, vocab: int = 50, pad: int = 6):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab + pad, hidden, generator=g) * 0.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = -100
    return h, w, labels


def reference(h, w, labels, vocab):
    """The definition, dense, in float64 autograd -> (loss sum, dL/dh, dL/dw)."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    loss = F.cross_entropy(h64 @ w64[:vocab].T, labels, ignore_index=-100, reduction="sum")
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


def fused(h, w, labels, **kwargs):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, tokens = fused_cross_entropy(h, w, labels, **kwargs)
    loss.backward()
    return loss.detach(), tokens, h.grad, w.grad


@pytest.mark.parametrize("chunk_size", [8, 1024])
def test_loss_and_gradients_equal_the_definition_in_float64(chunk_size):
    h, w, labels = case(0)
    loss, tokens, grad_h, grad_w = fused(h, w, labels, chunk_size=chunk_size, vocab_size=50)
    ref_loss, ref_h, ref_w = reference(h, w, labels, 50)
    assert tokens.item() == int((labels != -100).sum())
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=0)
    for grad, ref in ((grad_h, ref_h), (grad_w, ref_w)):
        torch.testing.assert_close(grad.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(grad_w[50:], torch.zeros_like(grad_w[50:]))  # the embedding's padding rows


def test_a_masked_position_contributes_nothing_whatever_its_logits():
    h, w, labels = case(1)
    masked = (labels == -100).nonzero().flatten()
    h_bad = h.clone()
    h_bad[masked[0]] = 1e30  # logits of +-inf: a NaN log-softmax row
    h_bad[masked[1]] = 1e4   # a one-hot softmax
    loss, _, grad_h, grad_w = fused(h_bad, w, labels, chunk_size=8, vocab_size=50)
    ref_loss, _, ref_h, ref_w = fused(h, w, labels, chunk_size=8, vocab_size=50)
    assert torch.equal(loss, ref_loss)
    assert torch.equal(grad_h[masked], torch.zeros_like(grad_h[masked]))
    keep = labels != -100
    assert torch.equal(grad_h[keep], ref_h[keep])
    torch.testing.assert_close(grad_w, ref_w, rtol=1e-6, atol=1e-7)


def test_the_incoming_gradient_scales_and_no_grad_computes_only_the_loss():
    h, w, labels = case(2)
    _, _, grad_h, grad_w = fused(h, w, labels, chunk_size=8, vocab_size=50)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _ = fused_cross_entropy(hh, ww, labels, chunk_size=8, vocab_size=50)
    (loss / 7.0).backward()
    torch.testing.assert_close(hh.grad, grad_h / 7.0)
    torch.testing.assert_close(ww.grad, grad_w / 7.0)
    with torch.no_grad():
        loss_ng, _ = fused_cross_entropy(hh, ww, labels, chunk_size=8, vocab_size=50)
    assert not loss_ng.requires_grad and torch.equal(loss_ng, loss.detach())


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_only_a_loss_autograd_will_differentiate_computes_gradients(monkeypatch, grad):
    """A held-out evaluation passes the student's head, a Parameter, under no_grad: each chunk then runs its
    projection and closed form alone -- no dL/dh or dL/dW GEMMs, no (N, H) or (V, H) gradient allocated."""
    calls = []
    backward_chunk = fused_linear._backward_chunk
    monkeypatch.setattr(fused_linear, "_backward_chunk", lambda *args: calls.append(1) or backward_chunk(*args))
    h, w, labels = case(3, n=40)
    h, w = torch.nn.Parameter(h), torch.nn.Parameter(w)
    with torch.set_grad_enabled(grad), Allocations() as allocated:
        fused_cross_entropy(h, w, labels, chunk_size=8, vocab_size=50)
    assert len(calls) == (5 if grad else 0)  # one per chunk of 8
    assert (tuple(h.shape) in allocated.shapes, tuple(w.shape) in allocated.shapes) == (grad, grad)


def test_it_is_the_checkpointed_paths_loss_in_fp32_and_under_bf16_autocast():
    """The loops' previous path (chunked_sft_loss, checkpointed chunks): the same sum and gradients in fp32 to
    rounding; under CPU bf16 autocast the head cast once per call, the head's gradient summed in fp32, and the same
    numbers to bf16's rounding of G (cast for the gradient's matmuls on both paths)."""
    torch.manual_seed(0)
    n, v, hdim = 128, 1000, 32
    h, w = torch.randn(n, hdim) * 0.5, torch.randn(v, hdim) * 0.05
    labels = torch.randint(0, v - 1, (n,))
    labels[::5] = -100
    for autocast in (False, True):
        results = {}
        for name, fn in (("fused", fused_cross_entropy), ("checkpointed", chunked_sft_loss)):
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            with CountWeightCasts((v - 1) * hdim) as counter:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss, tokens = fn(hh, ww, labels, chunk_size=16, vocab_size=v - 1)
                loss.backward()
            assert ww.grad.dtype == torch.float32 and loss.dtype == torch.float32
            results[name] = counter.count, loss.detach(), tokens, hh.grad, ww.grad
        (casts, loss, tokens, grad_h, grad_w), (_, ref_loss, ref_tokens, ref_h, ref_w) = results.values()
        assert casts == (1 if autocast else 0) and torch.equal(tokens, ref_tokens)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        for a, b in ((grad_h, ref_h), (grad_w, ref_w)):
            assert ((a - b).norm() / b.norm()).item() < (1e-3 if autocast else 1e-6)
