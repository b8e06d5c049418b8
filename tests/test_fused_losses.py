# python -m pytest tests/test_fused_losses.py
"""The fused linear-loss driver's other closed forms -- classic KD (trainer/losses/fused_divergences.py), the
sampled-token reverse KL (same file), the top-K divergence with a local or a served teacher
(trainer/losses/topk_divergence.py) and the RL clipped policy-gradient loss (trainer/losses/policy_gradient.py) --
against their definitions on dense logits in float64 autograd (fp32 inputs: 1e-5; float64 inputs, which the driver
computes in float64: 1e-10), against the checkpointed path with trainer/losses/closed_forms.py's functions (and
`policy_loss`) under CPU bf16 autocast, and with garbage at masked positions.
The cross entropy's own tests: tests/test_fused_linear.py; the generalized JSD's: tests/test_fused_divergences.py."""
import pytest
import torch

from trainer.losses.chunked import chunked_loss
from trainer.losses.closed_forms import (distillation_loss, sampled_token_kl_from_logprobs, sampled_token_kl_loss,
                                         sft_loss)
from trainer.losses.fused_divergences import fused_kd_loss, fused_sampled_kl_loss
from trainer.losses.fused_linear import fused_cross_entropy
from trainer.losses.topk_divergence import chunked_topk_divergence, topk_divergence, topk_support
from trainer.losses.policy_gradient import (ADVANTAGE, OLD_LOGP, REF_LOGP, TEACHER_LOGP, fused_policy_loss,
                                            policy_loss)

VOCAB = 50


def case(seed: int, n: int = 37, hidden: int = 16, pad: int = 6):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(VOCAB + pad, hidden, generator=g) * 0.5
    th = torch.randn(n, hidden + 4, generator=g)
    tw = torch.randn(VOCAB + pad, hidden + 4, generator=g) * 0.5
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = -100
    values = torch.randn(n, 4, generator=g)
    values[:, OLD_LOGP] = -3.0 + 0.5 * torch.randn(n, generator=g)
    values[:, REF_LOGP] = -3.0 + 0.3 * torch.randn(n, generator=g)
    values[:, TEACHER_LOGP] = -3.0 + 0.3 * torch.randn(n, generator=g)
    return dict(h=h, w=w, th=th, tw=tw, labels=labels, values=values)


# each loss: the fused call and its closed form on dense logits, both -> (loss, *logged sums)
def kd_fused(c, h, w, alpha, temperature, chunk_size=8):
    loss, _, ce, kd = fused_kd_loss(h, w, c["th"], c["tw"], c["labels"], alpha, temperature, chunk_size, VOCAB)
    return loss, ce, kd


def kd_dense(c, logits, teacher_logits, alpha, temperature):
    """The definition in the logits' dtype: alpha CE + (1 - alpha) T^2 KL(q_T || p_T) per labelled position."""
    keep, labels = c["labels"] != -100, c["labels"].clamp_min(0)
    ce = -torch.log_softmax(logits, -1).gather(1, labels[:, None]).squeeze(1)
    log_p, log_q = torch.log_softmax(logits / temperature, -1), torch.log_softmax(teacher_logits / temperature, -1)
    kd = temperature ** 2 * (log_q.exp() * (log_q - log_p)).sum(-1)
    ce, kd = ce[keep].sum(), kd[keep].sum()
    return alpha * ce + (1 - alpha) * kd, ce, kd


def kd_closed_form(labels, logits, teacher_logits, alpha, temperature):
    ce, _ = sft_loss(logits, labels)
    return alpha * ce + (1 - alpha) * distillation_loss(logits, teacher_logits, labels, temperature, reduction="sum")


def sampled_fused(c, h, w, local, temperature, chunk_size=8):
    teacher = dict(teacher_hidden=c["th"], teacher_weight=c["tw"]) if local else \
        dict(teacher_logprobs=c["values"][:, TEACHER_LOGP])
    loss, _, kl = fused_sampled_kl_loss(h, w, c["labels"], **teacher, temperature=temperature,
                                        chunk_size=chunk_size, vocab_size=VOCAB)
    return loss, kl


def sampled_dense(c, logits, teacher_logits, local, temperature):
    """The definition in the logits' dtype: k log p_T(y), k = log p_T(y) - log q_T(y) held constant."""
    keep, labels = c["labels"] != -100, c["labels"].clamp_min(0)[:, None]
    logp = torch.log_softmax(logits / temperature, -1).gather(1, labels).squeeze(1)
    teacher = torch.log_softmax(teacher_logits.to(logits.dtype) / temperature, -1).gather(1, labels).squeeze(1) \
        if local else c["values"][:, TEACHER_LOGP].to(logits.dtype)
    k = (logp - teacher).detach()
    return (k * logp)[keep].sum(), k[keep].sum()


def topk_fused(c, h, w, local, beta, temperature, chunk_size=8):
    teacher = dict(teacher_hidden=c["th"], teacher_weight=c["tw"]) if local else dict(teacher_support=c["support"])
    loss, _, tail = chunked_topk_divergence(h, w, c["labels"], 4, beta=beta, temperature=temperature,
                                            chunk_size=chunk_size, vocab_size=VOCAB, **teacher)
    return loss, tail


def topk_dense(c, logits, teacher_logits, local, beta, temperature):
    """topk_divergence itself on dense logits (it computes in float64 for float64 logits): the support of a local
    teacher from its logits, a served one's as given."""
    support = topk_support(teacher_logits, c["labels"], 4, temperature) if local else c["support"]
    return topk_divergence(logits, *support, c["labels"], beta, temperature, "sum", return_tail=True)


POLICY = dict(temperature=0.9, clip_low=0.2, clip_high=0.28, kl_coef=0.05, opd_coef=0.5)


def policy_fused(c, h, w, values, chunk_size=8):
    sums = fused_policy_loss(h, w, c["labels"], values, chunk_size, VOCAB, **POLICY)
    return sums.loss, sums.clipped, sums.kl, sums.entropy, sums.opd


def policy_dense(c, logits, values):
    loss, _, clipped, kl, entropy, opd, *_ = policy_loss(logits, values, c["labels"], **POLICY)
    return loss, clipped, kl, entropy, opd


def dense_and_fused(name, c, **settings):
    """(fused, reference): each a function of (h, w) -> the loss and its logged sums."""
    teacher_logits = c["th"].double() @ c["tw"][:VOCAB].double().T
    if name == "kd":
        return (lambda h, w: kd_fused(c, h, w, **settings),
                lambda h, w: kd_dense(c, h @ w[:VOCAB].T, teacher_logits, **settings))
    if name == "topk":
        c["support"] = topk_support(teacher_logits, c["labels"], 4, settings["temperature"])  # a server's
        return (lambda h, w: topk_fused(c, h, w, **settings),
                lambda h, w: topk_dense(c, h @ w[:VOCAB].T, teacher_logits.to(h.dtype), **settings))
    if name == "sampled_kl":
        return (lambda h, w: sampled_fused(c, h, w, **settings),
                lambda h, w: sampled_dense(c, h @ w[:VOCAB].T, teacher_logits, **settings))
    values = c["values"].clone()
    if settings["on_policy"]:
        values[:, OLD_LOGP] = float("nan")
    return (lambda h, w: policy_fused(c, h, w, values), lambda h, w: policy_dense(c, h @ w[:VOCAB].T, values.double()))


CASES = [("kd", dict(alpha=0.3, temperature=1.0)), ("kd", dict(alpha=0.3, temperature=2.0)),
         ("kd", dict(alpha=0.0, temperature=1.5)), ("sampled_kl", dict(local=True, temperature=1.0)),
         ("sampled_kl", dict(local=False, temperature=1.3)), ("topk", dict(local=True, beta=1.0, temperature=1.0)),
         ("topk", dict(local=False, beta=0.5, temperature=1.5)), ("policy", dict(on_policy=True)),
         ("policy", dict(on_policy=False))]
IDS = [f"{name}-{'-'.join(f'{k}{v}' for k, v in s.items())}" for name, s in CASES]


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(fn, h, w):
    """fn's outputs detached and the gradients of its loss with respect to h and w."""
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    outputs = fn(h, w)
    outputs[0].backward()
    return [o.detach() for o in outputs], h.grad, w.grad


@pytest.mark.parametrize("name,settings", CASES, ids=IDS)
def test_values_and_gradients_equal_the_closed_forms_in_float64(name, settings):
    c = case(0)
    fused, dense = dense_and_fused(name, c, **settings)
    outputs, grad_h, grad_w = run(fused, c["h"], c["w"])
    ref_outputs, ref_h, ref_w = run(dense, c["h"].double(), c["w"].double())
    for value, ref in zip(outputs, ref_outputs):
        torch.testing.assert_close(value.double(), ref.double(), rtol=1e-5, atol=1e-5)
    for grad, ref in ((grad_h, ref_h), (grad_w, ref_w)):
        assert relative_error(grad, ref) < 1e-5
    assert torch.equal(grad_w[VOCAB:], torch.zeros_like(grad_w[VOCAB:]))  # the embedding's padding rows
    # in float64 the driver computes in float64: the closed form itself, not its rounding, is what is compared
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items() if k != "support"}
    outputs64, grad_h64, grad_w64 = run(dense_and_fused(name, c64, **settings)[0], c64["h"], c64["w"])
    assert outputs64[0].dtype == torch.float64
    torch.testing.assert_close(outputs64[0], ref_outputs[0].double(), rtol=1e-10, atol=1e-10)
    assert relative_error(grad_h64, ref_h) < 1e-10 and relative_error(grad_w64, ref_w) < 1e-10


@pytest.mark.parametrize("name,settings", CASES, ids=IDS)
def test_garbage_at_masked_positions_changes_nothing(name, settings):
    """A masked position's hidden states, teacher hidden states and per-token values may be anything (NaN from a
    served teacher's missing entry, huge activations): its loss, extras and gradients are exactly 0."""
    c = case(1)
    fused, _ = dense_and_fused(name, c, **settings)
    clean = run(fused, c["h"], c["w"])
    masked = (c["labels"] == -100).nonzero().flatten()
    c["h"] = c["h"].clone()
    c["h"][masked[0]] = 1e30
    c["th"][masked[1]] = float("nan")
    c["values"][masked[:3]] = float("nan")
    fused, _ = dense_and_fused(name, c, **settings)
    outputs, grad_h, grad_w = run(fused, c["h"], c["w"])
    for a, b in zip(outputs, clean[0]):
        assert torch.equal(a, b)
    assert torch.equal(grad_h[masked], torch.zeros_like(grad_h[masked]))
    assert torch.equal(grad_h, clean[1]) and torch.equal(grad_w, clean[2])


def test_kd_with_alpha_one_is_the_cross_entropy_bit_for_bit():
    """alpha = 1: the KD term is logged but weighs nothing, and the gradient is SFT's exactly (the loop's
    test_alpha_one_is_sft rests on it)."""
    c = case(2)
    outputs, grad_h, grad_w = run(lambda h, w: kd_fused(c, h, w, 1.0, 2.0), c["h"], c["w"])
    ce, ce_h, ce_w = run(lambda h, w: fused_cross_entropy(h, w, c["labels"], 8, VOCAB)[:1], c["h"], c["w"])
    assert torch.equal(outputs[0], ce[0]) and torch.equal(outputs[1], ce[0]) and outputs[2] > 0
    assert torch.equal(grad_h, ce_h) and torch.equal(grad_w, ce_w)


def checkpointed(name, c, settings, h, w):
    """The same loss through the generic checkpointed path (chunked_loss) with trainer/losses/closed_forms.py's
    functions (fp32 from the logits on): the loops' path before the driver took it over."""
    labels, values = c["labels"], c["values"]
    if name == "kd":
        return chunked_loss(lambda s, t, y: kd_closed_form(y, s, t, **settings), h, w, labels, c["th"], c["tw"],
                            chunk_size=8, vocab_size=VOCAB)
    if name == "topk":
        def loss_fn(s, t, y):
            ids, logprobs = topk_support(t, y, 4, settings["temperature"]) if settings["local"] else t
            return topk_divergence(s, ids, logprobs, y, settings["beta"], settings["temperature"], "sum")
        teacher = dict(teacher_hidden=c["th"], teacher_weight=c["tw"]) if settings["local"] else \
            dict(teacher_values=c["support"])
        return chunked_loss(loss_fn, h, w, labels, chunk_size=8, vocab_size=VOCAB, **teacher)
    if name == "sampled_kl":
        if settings["local"]:
            return chunked_loss(lambda s, t, y: sampled_token_kl_loss(s, t, y, settings["temperature"])[0], h, w,
                                labels, c["th"], c["tw"], chunk_size=8, vocab_size=VOCAB)
        return chunked_loss(lambda s, t, y: sampled_token_kl_from_logprobs(s, t, y, settings["temperature"])[0], h,
                            w, labels, chunk_size=8, vocab_size=VOCAB, teacher_values=values[:, TEACHER_LOGP])
    values = values.clone()
    if settings["on_policy"]:
        values[:, OLD_LOGP] = float("nan")
    return chunked_loss(lambda s, v, y: policy_loss(s, v, y, **POLICY)[0], h, w, labels, chunk_size=8,
                        vocab_size=VOCAB, teacher_values=values)


@pytest.mark.parametrize("name,settings", CASES, ids=IDS)
def test_under_bf16_autocast_the_numbers_are_the_checkpointed_paths(name, settings):
    """CUDA's recipe on the CPU (bf16 projections, fp32 from the logits on, the head's gradient summed in fp32): the
    same loss as the checkpointed path to fp32 rounding. The gradients: both paths cast G to bf16 for the gradient's
    matmuls and dL/dh comes out of a bf16 GEMM (2^-9 relative per element), so neither is within 1e-3 of float64
    everywhere; the fused one is about as close to float64 as the checkpointed one (within 1.5x: the two round
    different fp32 numbers to bf16, 1,024 elements here), and the two differ by bf16 ulps."""
    c = case(3, n=64)
    fused, dense = dense_and_fused(name, c, **settings)
    _, ref_h, ref_w = run(dense, c["h"].double(), c["w"].double())
    results = []
    for fn in (fused, lambda h, w: (checkpointed(name, c, settings, h, w),)):
        h, w = c["h"].clone().requires_grad_(), c["w"].clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn(h, w)[0]
        loss.backward()
        assert loss.dtype == torch.float32 and w.grad.dtype == torch.float32
        results.append((loss.detach(), h.grad, w.grad))
    (loss, grad_h, grad_w), (ref_loss, checkpointed_h, checkpointed_w) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    for grad, other, ref in ((grad_h, checkpointed_h, ref_h), (grad_w, checkpointed_w, ref_w)):
        assert relative_error(grad, other) < 5e-3
        assert relative_error(grad, ref) < 1.5 * relative_error(other, ref) + 1e-4


def test_the_policy_loss_logs_what_the_reference_logs():
    c = case(4)
    values = c["values"].clone()
    values[:, ADVANTAGE] = torch.linspace(-2, 2, len(values))
    sums = fused_policy_loss(c["h"], c["w"], c["labels"], values, 8, VOCAB, **POLICY)
    ref = policy_loss(c["h"] @ c["w"][:VOCAB].T, values, c["labels"], **POLICY)
    assert int(sums.tokens) == int(ref[1]) and float(sums.clipped) == float(ref[2]) > 0
    for value, expected in zip((sums.kl, sums.entropy, sums.opd), ref[3:]):
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-5)
