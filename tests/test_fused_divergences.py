# python -m pytest tests/test_fused_divergences.py
"""trainer/losses/fused_divergences.py: the generalized JSD whose gradient is computed with the loss, against the definition in
float64 autograd, against the generic checkpointed path under CPU bf16 autocast, and its edge cases (masked
positions with non-finite logits, the incoming gradient, no_grad, buffers reused between calls, no (C, V) tensor
allocated in a chunk's closed form)."""
import pytest
import torch

from benchmarks.bench_losses import CountWeightCasts
from support import Allocations, reference_divergence
from trainer.losses.chunked import chunked_loss
import trainer.losses.fused_linear as fused_linear
from trainer.losses.fused_divergences import chunked_generalized_jsd_loss, jsd_chunk_loss
from trainer.losses.closed_forms import generalized_jsd_loss


def case(seed: int, n: int = 37, hidden: int = 16, vocab: int = 50, pad: int = 6):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab + pad, hidden, generator=g) * 0.5
    th = torch.randn(n, hidden + 4, generator=g)
    tw = torch.randn(vocab + pad, hidden + 4, generator=g) * 0.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = -100
    return h, w, th, tw, labels


def reference(h, w, th, tw, labels, beta, temperature, vocab):
    """The definition in probability space, float64 autograd -> (loss sum, dL/dh, dL/dw)."""
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    p = torch.softmax(h64 @ w64[:vocab].T / temperature, dim=-1)
    q = torch.softmax(th.double() @ tw[:vocab].double().T / temperature, dim=-1)
    keep = labels != -100
    loss = reference_divergence(q[keep], p[keep], beta).sum()
    loss.backward()
    return loss.detach(), h64.grad, w64.grad


def fused(h, w, th, tw, labels, **kwargs):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, tokens = chunked_generalized_jsd_loss(h, w, th, tw, labels, **kwargs)
    loss.backward()
    return loss.detach(), tokens, h.grad, w.grad


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 1.7])
@pytest.mark.parametrize("chunk_size", [8, 1024])
def test_loss_and_gradients_equal_the_definitions_in_float64(beta, temperature, chunk_size):
    h, w, th, tw, labels = case(0)
    loss, tokens, grad_h, grad_w = fused(h, w, th, tw, labels, beta=beta, temperature=temperature,
                                         chunk_size=chunk_size, vocab_size=50)
    ref_loss, ref_h, ref_w = reference(h, w, th, tw, labels, beta, temperature, 50)
    assert tokens.item() == int((labels != -100).sum())
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_h.double(), ref_h, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_w.double(), ref_w, rtol=1e-4, atol=1e-6)
    assert torch.equal(grad_w[50:], torch.zeros_like(grad_w[50:]))  # the embedding's padding rows


def test_a_masked_position_contributes_nothing_whatever_its_logits():
    h, w, th, tw, labels = case(1)
    masked = (labels == -100).nonzero().flatten()
    th_bad = th.clone()
    th_bad[masked[0]] = float("nan")   # a NaN teacher row
    h_bad = h.clone()
    h_bad[masked[1]] = 1e4             # a student row whose softmax is one-hot
    loss, _, grad_h, grad_w = fused(h_bad, w, th_bad, tw, labels, beta=1.0, chunk_size=8, vocab_size=50)
    ref_loss, _, ref_h, ref_w = fused(h, w, th, tw, labels, beta=1.0, chunk_size=8, vocab_size=50)
    assert torch.equal(loss, ref_loss)
    assert torch.equal(grad_h[masked], torch.zeros_like(grad_h[masked]))
    keep = labels != -100
    torch.testing.assert_close(grad_h[keep], ref_h[keep], rtol=0, atol=0)
    torch.testing.assert_close(grad_w, ref_w, rtol=1e-6, atol=1e-7)


def test_the_incoming_gradient_scales_and_no_grad_computes_only_the_loss():
    h, w, th, tw, labels = case(2)
    _, _, grad_h, grad_w = fused(h, w, th, tw, labels, beta=1.0, chunk_size=8, vocab_size=50)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, _ = chunked_generalized_jsd_loss(hh, ww, th, tw, labels, beta=1.0, chunk_size=8, vocab_size=50)
    (loss / 7.0).backward()
    torch.testing.assert_close(hh.grad, grad_h / 7.0)
    torch.testing.assert_close(ww.grad, grad_w / 7.0)
    with torch.no_grad():
        loss_ng, _ = chunked_generalized_jsd_loss(hh, ww, th, tw, labels, beta=1.0, chunk_size=8, vocab_size=50)
    assert not loss_ng.requires_grad and torch.equal(loss_ng, loss.detach())
    # the backward hands its gradients over: a second one is an error, not a silently wrong gradient
    loss, _ = chunked_generalized_jsd_loss(hh, ww, th, tw, labels, beta=1.0, chunk_size=8, vocab_size=50)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot run twice"):
        loss.backward()


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_a_chunks_closed_form_allocates_no_chunk_sized_tensor(beta):
    """Every (C, V) step of the divergence is written into the chunk's logits or the driver's spare buffers: between
    the two KLs, log m, p and q too."""
    c, v = 6, 40
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(c, v, generator=g), torch.randn(c, v, generator=g)
    chunk = jsd_chunk_loss(beta, 1.7)
    spares = [torch.empty(c, v) for _ in range(chunk.spares)]
    with Allocations() as allocated:
        chunk.fn(student, teacher, spares, None, None)
    assert (c, v) not in allocated.shapes


def test_buffers_kept_between_calls_change_nothing():
    """The CPU workspace holds the previous call's numbers: a smaller call after a larger one reads none of them."""
    small = case(3)
    first = fused(*small, beta=1.0, chunk_size=8, vocab_size=50)
    fused(*case(4, n=64, vocab=300), beta=0.3, chunk_size=64, vocab_size=300)  # larger buffers, other contents
    again = fused(*small, beta=1.0, chunk_size=8, vocab_size=50)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_under_bf16_autocast_each_head_is_cast_once_and_the_numbers_are_the_checkpointed_paths():
    """CUDA's recipe on the CPU: the projections in bf16 (each (V, H) head cast once per call), the rest fp32, the
    head's gradient summed in fp32 -- the same numbers as the generic checkpointed path under the same autocast."""
    torch.manual_seed(0)
    n, v, hdim = 128, 1000, 32
    h = torch.randn(n, hdim) * 0.5
    w = torch.randn(v, hdim) * 0.05
    th, tw, labels = torch.randn(n, hdim) * 0.5, torch.randn(v, hdim) * 0.05, torch.randint(0, v - 1, (n,))

    def checkpointed(hh, ww, th, tw, labels, **kwargs):
        loss = chunked_loss(lambda s, t, y: generalized_jsd_loss(s, t, y, beta=1.0, reduction="sum"),
                            hh, ww, labels, th, tw, chunk_size=16, vocab_size=v - 1)
        return loss, None
    results = {}
    for name, fn in (("fused", chunked_generalized_jsd_loss), ("checkpointed", checkpointed)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with CountWeightCasts((v - 1) * hdim) as counter:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = fn(hh, ww, th, tw, labels, beta=1.0, chunk_size=16, vocab_size=v - 1)
            loss.backward()
        assert ww.grad.dtype == torch.float32 and loss.dtype == torch.float32
        results[name] = counter.count, loss.detach(), hh.grad, ww.grad
    assert results["fused"][0] == 2  # the student's head and the teacher's, once each
    (_, loss, grad_h, grad_w), (_, ref_loss, ref_h, ref_w) = results["fused"], results["checkpointed"]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    # G is cast to bf16 for the gradient's matmuls on both paths: fp32 rounding differences flip an ulp here and
    # there (2 of 32,000 head elements here), nothing systematic
    for a, b in ((grad_h, ref_h), (grad_w, ref_w)):
        assert ((a - b).norm() / b.norm()).item() < 1e-3


def test_off_the_cpu_the_buffers_are_plain_allocations():
    """CUDA's branch of the workspace, on the meta device (any device but the CPU takes it): fresh tensors of the
    chunk's shape each call, none kept -- a GPU's caching allocator pools them already."""
    kept = getattr(fused_linear._workspace, "buffers", None)
    first = fused_linear.buffers(3, 4, 10, torch.device("meta"))
    second = fused_linear.buffers(3, 4, 10, torch.device("meta"))
    assert [b.shape for b in first] == [torch.Size([4, 10])] * 3 and all(b.is_meta for b in first)
    assert all(a is not b for a, b in zip(first, second))
    assert getattr(fused_linear._workspace, "buffers", None) is kept


def test_under_fp16_autocast_with_a_grad_scaler_the_gradients_are_fp16_exact_and_finite():
    """The fp16 recipe (pre-bf16 GPUs) on the CPU: fp16 projections, `torch.amp.GradScaler("cpu")` at its default
    scale 2^16. G is cast to fp16 unscaled for the gradient's matmuls (the scale reaches it after them, in fp32), so
    an entry below fp16's smallest subnormal (6e-8) becomes 0 where the checkpointed path, which scales before the
    cast, would keep it -- and overflows at 2^16 (this case: inf, a skipped step) where this path does not. Measured
    here: both paths' gradients are the float64 definition's to fp16's rounding of h and W (relative 2e-3)."""
    torch.manual_seed(0)
    n, v, hdim = 64, 4096, 32
    h, w = torch.randn(n, hdim), torch.randn(v, hdim) * 0.5
    th, tw = torch.randn(n, hdim), torch.randn(v, hdim) * 0.5
    labels = torch.randint(0, v, (n,))
    _, ref_h, ref_w = reference(h, w, th, tw, labels, 1.0, 1.0, v)
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    optimizer = torch.optim.SGD([hh, ww], lr=0.0)
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss, _ = chunked_generalized_jsd_loss(hh, ww, th, tw, labels, beta=1.0, chunk_size=16)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 2.0 ** 16, "the scaled gradient overflowed: the step was skipped"
    for grad, ref in ((hh.grad, ref_h), (ww.grad, ref_w)):
        assert ((grad.double() - ref).norm() / ref.norm()).item() < 4e-3
