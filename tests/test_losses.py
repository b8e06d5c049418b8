# python -m pytest tests/test_losses.py
"""Losses against closed forms and float64 references; chunked against unchunked; the OPD instability."""
import math

import numpy as np
import pytest
import torch

from support import reference_divergence
from trainer.losses.chunked import chunked_loss, chunked_sft_loss
from trainer.losses.fused_divergences import chunked_generalized_jsd_loss
from trainer.losses.closed_forms import distillation_loss, generalized_jsd_loss, sampled_token_kl_loss, sft_loss

BETAS = (0.0, 0.5, 1.0)
TEMPERATURES = (1.0, 2.0)
REDUCTIONS = ("per_token_mean", "sum", "none")


# ----------------------------------------------------------------------------- float64 references

def ref_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p * (p.log() - q.log())).sum(-1)


def ref_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.double() / temperature
    e = (z - z.max(-1, keepdim=True).values).exp()
    return e / e.sum(-1, keepdim=True)


def ref_jsd_per_token(student, teacher, beta, temperature):
    """The definition, straight in probability space (no log-space tricks), float64."""
    return reference_divergence(ref_probs(teacher.detach(), temperature), ref_probs(student, temperature), beta)


def ref_reduce(per_token, labels, reduction):
    mask = torch.ones_like(per_token, dtype=torch.bool) if labels is None else labels != -100
    per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    return per_token.sum() / max(int(mask.sum()), 1)


def random_case(seed, shape=(3, 7), vocab=1000, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(*shape, vocab, generator=g) * scale
    teacher = torch.randn(*shape, vocab, generator=g) * scale
    labels = torch.randint(0, vocab, shape, generator=g)
    labels[torch.rand(shape, generator=g) < 0.3] = -100
    return student, teacher, labels


# ----------------------------------------------------------------------------- closed forms

def test_hand_worked_v5():
    # logits = log of exact probabilities, so softmax gives them back
    p_s = [0.1, 0.2, 0.3, 0.2, 0.2]
    p_t = [0.4, 0.1, 0.1, 0.2, 0.2]
    s, t = torch.tensor([p_s]).log(), torch.tensor([p_t]).log()
    # forward KL(p_T||p_S) = 0.4 ln 4 + 0.1 ln 0.5 + 0.1 ln(1/3) + 0 + 0
    forward = 0.4 * math.log(4) + 0.1 * math.log(0.5) + 0.1 * math.log(1 / 3)
    assert forward == pytest.approx(0.3753418, abs=1e-6)
    reverse = sum(a * math.log(a / b) for a, b in zip(p_s, p_t))  # 0.1 ln .25 + 0.2 ln 2 + 0.3 ln 3
    m = [0.5 * a + 0.5 * b for a, b in zip(p_s, p_t)]
    jsd = (0.5 * sum(b * math.log(b / c) for b, c in zip(p_t, m))
           + 0.5 * sum(a * math.log(a / c) for a, c in zip(p_s, m)))
    assert generalized_jsd_loss(s, t, beta=0.0).item() == pytest.approx(forward, abs=1e-6)
    assert generalized_jsd_loss(s, t, beta=1.0).item() == pytest.approx(reverse, abs=1e-6)
    assert generalized_jsd_loss(s, t, beta=0.5).item() == pytest.approx(jsd, abs=1e-6)

    # temperature 2: p^(1/2) renormalised; KD multiplies the KL by T^2
    def soften(p):
        r = np.sqrt(np.array(p, dtype=np.float64))
        return r / r.sum()
    ps2, pt2 = soften(p_s), soften(p_t)
    forward_t2 = float(np.sum(pt2 * np.log(pt2 / ps2)))
    assert generalized_jsd_loss(s, t, beta=0.0, temperature=2.0).item() == pytest.approx(forward_t2, abs=1e-6)
    assert distillation_loss(s, t, temperature=2.0).item() == pytest.approx(4 * forward_t2, abs=1e-6)

    # cross entropy of label 2 is -ln 0.3
    loss_sum, n = sft_loss(s, torch.tensor([2]))
    assert loss_sum.item() == pytest.approx(-math.log(0.3), abs=1e-6) and n.item() == 1 and n.dtype == torch.int64


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_jsd_matches_float64_reference(beta, temperature, reduction):
    student, teacher, labels = random_case(0)
    got = generalized_jsd_loss(student, teacher, labels, beta=beta, temperature=temperature, reduction=reduction)
    want = ref_reduce(ref_jsd_per_token(student, teacher, beta, temperature), labels, reduction)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", TEMPERATURES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_distillation_matches_float64_reference(temperature, reduction):
    student, teacher, labels = random_case(1)
    got = distillation_loss(student, teacher, labels, temperature=temperature, reduction=reduction)
    want = temperature ** 2 * ref_reduce(ref_jsd_per_token(student, teacher, 0.0, temperature), labels, reduction)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_labels_none_counts_every_position():
    student, teacher, _ = random_case(2)
    got = generalized_jsd_loss(student, teacher, None, beta=0.5)
    want = ref_jsd_per_token(student, teacher, 0.5, 1.0).mean()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_sft_matches_float64_reference():
    student, _, labels = random_case(3)
    loss_sum, n = sft_loss(student, labels)
    mask = labels != -100
    logp = ref_probs(student, 1.0).log()
    want = -logp[mask].gather(-1, labels[mask][:, None]).sum()
    torch.testing.assert_close(loss_sum.double(), want, rtol=1e-6, atol=1e-4)
    assert n.item() == int(mask.sum())


def test_no_loss_tokens_gives_zero_and_finite_grads():
    logits = torch.randn(2, 4, 11, requires_grad=True)
    labels = torch.full((2, 4), -100)
    loss_sum, n = sft_loss(logits, labels)
    loss_sum.backward()
    assert loss_sum.item() == 0.0 and n.item() == 0
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    for beta in BETAS:
        logits.grad = None
        loss = generalized_jsd_loss(logits, torch.randn(2, 4, 11), labels, beta=beta)
        loss.backward()
        assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_invalid_arguments_are_errors():
    s = torch.randn(2, 5)
    with pytest.raises(ValueError, match="reduction"):
        generalized_jsd_loss(s, s, reduction="batchmean")
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd_loss(s, s, beta=1.5)
    with pytest.raises(ValueError, match="temperature"):
        distillation_loss(s, s, temperature=0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        generalized_jsd_loss(s, torch.randn(2, 6))


# ----------------------------------------------------------------------------- direction: mode seeking vs covering

def test_reverse_kl_is_mode_seeking_forward_kl_is_mass_covering():
    broad = torch.tensor([[0.495, 0.495, 0.01]])   # mass on two modes
    peaked = torch.tensor([[0.98, 0.01, 0.01]])   # mass on one
    # Student broad, teacher peaked: reverse KL(p_S||p_T) pays 0.495*ln(0.495/0.01) for the student's mass on a
    # mode the teacher lacks (about 1.6 nats); forward KL(p_T||p_S) only ~0.98*ln(0.98/0.495) (about 0.64).
    # Reverse KL punishes covering extra modes: it is mode-seeking.
    rev = generalized_jsd_loss(broad.log(), peaked.log(), beta=1.0).item()
    fwd = generalized_jsd_loss(broad.log(), peaked.log(), beta=0.0).item()
    assert rev > 2 * fwd
    assert rev == pytest.approx(ref_kl(broad.double(), peaked.double()).item(), rel=1e-5)
    # Student peaked, teacher broad: now forward KL pays for the teacher mode the student misses: mass-covering.
    rev = generalized_jsd_loss(peaked.log(), broad.log(), beta=1.0).item()
    fwd = generalized_jsd_loss(peaked.log(), broad.log(), beta=0.0).item()
    assert fwd > 2 * rev


# ----------------------------------------------------------------------------- gradients and masking

@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_gradient_matches_float64_autograd(beta, temperature):
    student, teacher, labels = random_case(4, shape=(2, 5), vocab=300)
    s32 = student.clone().requires_grad_()
    generalized_jsd_loss(s32, teacher, labels, beta=beta, temperature=temperature).backward()
    s64 = student.double().requires_grad_()
    ref_reduce(ref_jsd_per_token(s64, teacher.double(), beta, temperature), labels, "per_token_mean").backward()
    torch.testing.assert_close(s32.grad.double(), s64.grad, rtol=1e-4, atol=1e-7)


def test_distillation_and_sft_gradients_match_float64_autograd():
    student, teacher, labels = random_case(5, shape=(2, 5), vocab=300)
    s32 = student.clone().requires_grad_()
    distillation_loss(s32, teacher, labels, temperature=2.0).backward()
    s64 = student.double().requires_grad_()
    (4 * ref_reduce(ref_jsd_per_token(s64, teacher.double(), 0.0, 2.0), labels, "per_token_mean")).backward()
    torch.testing.assert_close(s32.grad.double(), s64.grad, rtol=1e-4, atol=1e-7)

    s32.grad = None
    sft_loss(s32, labels)[0].backward()
    s64.grad = None
    mask = labels != -100
    (-ref_probs(s64, 1.0).log()[mask].gather(-1, labels[mask][:, None]).sum()).backward()
    torch.testing.assert_close(s32.grad.double(), s64.grad, rtol=1e-4, atol=1e-7)


def test_teacher_gets_no_gradient():
    student, teacher, labels = random_case(6, vocab=50)
    student.requires_grad_()
    teacher.requires_grad_()
    for beta in BETAS:
        generalized_jsd_loss(student, teacher, labels, beta=beta).backward()
    distillation_loss(student, teacher, labels, temperature=2.0).backward()
    assert teacher.grad is None and student.grad is not None


@pytest.mark.parametrize("loss_name", ["sft", "jsd0", "jsd0.5", "jsd1", "kd"])
def test_masked_positions_contribute_nothing(loss_name):
    student, teacher, labels = random_case(7, vocab=64)
    masked = labels == -100
    assert masked.any()

    def run(s, t):
        s = s.clone().requires_grad_()
        if loss_name == "sft":
            loss = sft_loss(s, labels)[0]
        elif loss_name == "kd":
            loss = distillation_loss(s, t, labels, temperature=2.0)
        else:
            loss = generalized_jsd_loss(s, t, labels, beta=float(loss_name[3:]))
        loss.backward()
        return loss.detach(), s.grad

    loss_a, grad_a = run(student, teacher)
    garbage_s, garbage_t = student.clone(), teacher.clone()
    garbage_s[masked] = torch.randn_like(garbage_s[masked]) * 50
    garbage_t[masked] = torch.randn_like(garbage_t[masked]) * 50
    loss_b, grad_b = run(garbage_s, garbage_t)
    assert torch.equal(loss_a, loss_b)
    assert torch.equal(grad_a, grad_b)
    assert torch.equal(grad_a[masked], torch.zeros_like(grad_a[masked]))


# ----------------------------------------------------------------------------- low precision

@pytest.mark.parametrize("beta", BETAS)
def test_bf16_inputs_are_finite_non_negative_and_close(beta):
    student, teacher, labels = random_case(8, vocab=1000)
    got = generalized_jsd_loss(student.bfloat16(), teacher.bfloat16(), labels, beta=beta, reduction="none")
    want = generalized_jsd_loss(student, teacher, labels, beta=beta, reduction="none")
    assert got.dtype == torch.float32 and torch.isfinite(got).all() and (got >= 0).all()
    # bf16 keeps ~3 significant digits of logits of size ~3: errors of ~1e-2 in log-probs
    torch.testing.assert_close(got, want, rtol=0.05, atol=0.02)
    # identical distributions: the exact answer is 0; rounding must not push it below
    same = generalized_jsd_loss(student.bfloat16(), student.bfloat16(), None, beta=beta, reduction="none")
    assert (same >= 0).all() and same.max().item() < 1e-5
    kd = distillation_loss(student.bfloat16(), teacher.bfloat16(), labels, temperature=2.0)
    assert torch.isfinite(kd) and kd.item() >= 0


def test_clamp_keeps_gradient_of_nearly_equal_distributions():
    # nearly equal distributions: the value may be clamped at 0, but the gradient must still point home
    z = torch.randn(4, 32)
    s = (z + 1e-4 * torch.randn(4, 32)).requires_grad_()
    generalized_jsd_loss(s, z, beta=1.0, reduction="sum").backward()
    s64 = s.detach().double().requires_grad_()
    ref_jsd_per_token(s64, z.double(), 1.0, 1.0).sum().backward()
    assert (s.grad.double() * s64.grad).sum() > 0


# ----------------------------------------------------------------------------- the OPD instability

def test_reverse_kl_gradient_grows_without_bound_as_teacher_prob_of_sampled_token_vanishes():
    # Student fixed: p_S(y) = 0.3 on the sampled token y, the rest uniform over 9 tokens. The teacher puts q on
    # y and (1-q)/9 elsewhere. d/dz_S of reverse KL = p_S * (log p_S - log p_T - KL); its y component is about
    # p_S(y) (1 - p_S(y)) ln(1/q): unbounded as q -> 0. The forward KL's is p_S - p_T, whose 2-norm is at most
    # its 1-norm, at most 2.
    vocab, p_y = 10, 0.3
    student = torch.zeros(1, vocab)
    student[0, 0] = math.log(p_y * (vocab - 1) / (1 - p_y))
    rev_norms, fwd_norms = [], []
    for q in (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6):
        p_t = torch.full((1, vocab), (1 - q) / (vocab - 1))
        p_t[0, 0] = q
        for beta, norms in ((1.0, rev_norms), (0.0, fwd_norms)):
            s = student.clone().requires_grad_()
            generalized_jsd_loss(s, p_t.log(), beta=beta).backward()
            norms.append(s.grad.norm().item())
    assert all(b > a for a, b in zip(rev_norms, rev_norms[1:])), rev_norms
    assert rev_norms[-1] > 5 * rev_norms[0]
    assert rev_norms[-1] > 2  # past anything the forward KL can reach
    # asymptotically linear in ln(1/q): each decade adds about p(1-p) ln 10 (times the norm's share of y)
    steps = np.diff(rev_norms)
    assert steps[-1] == pytest.approx(steps[-2], rel=0.05)
    assert max(fwd_norms) <= 2.0


# ----------------------------------------------------------------------------- chunked from hidden states

def hidden_case(seed, n=37, hidden=16, vocab=50, pad=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=dtype)
    w = torch.randn(vocab + pad, hidden, generator=g, dtype=dtype) * 0.5
    th = torch.randn(n, hidden + 4, generator=g, dtype=dtype)   # teacher may be wider
    tw = torch.randn(vocab + pad, hidden + 4, generator=g, dtype=dtype) * 0.5
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.3] = -100
    return h, w, th, tw, labels


def unchunked(kind, h, w, th, tw, labels, vocab):
    logits = h @ w[:vocab].T
    t_logits = th @ tw[:vocab].T
    n = (labels != -100).sum()
    if kind == "sft":
        return sft_loss(logits, labels)
    if kind == "kd":
        return distillation_loss(logits, t_logits, labels, temperature=2.0, reduction="sum"), n
    return generalized_jsd_loss(logits, t_logits, labels, beta=float(kind[3:]), reduction="sum"), n


def chunked(kind, h, w, th, tw, labels, chunk_size, vocab_size=None):
    if kind == "sft":
        return chunked_sft_loss(h, w, labels, chunk_size=chunk_size, vocab_size=vocab_size)
    if kind == "kd":  # as train_distillation.py does it: chunked_loss over a closure
        def kd(logits, t_logits, chunk_labels):
            count = logits.shape[0] if chunk_labels is None else (chunk_labels != -100).sum()
            return distillation_loss(logits, t_logits, chunk_labels, temperature=2.0, reduction="sum"), count
        return chunked_loss(kd, h, w, labels, th, tw, chunk_size=chunk_size, vocab_size=vocab_size)
    return chunked_generalized_jsd_loss(h, w, th, tw, labels, beta=float(kind[3:]), chunk_size=chunk_size,
                                        vocab_size=vocab_size)


def loss_and_grads(fn, h, w, th, tw, *args, **kwargs):
    h, w, th, tw = (x.clone().requires_grad_() for x in (h, w, th, tw))
    loss, n = fn(h, w, th, tw, *args, **kwargs)
    loss.backward()
    assert th.grad is None and tw.grad is None  # the teacher is a constant
    return loss.detach(), n, h.grad, w.grad


KINDS = ["sft", "jsd0.0", "jsd0.5", "jsd1.0", "kd"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_size", [8, 10, 1024])
def test_chunked_matches_unchunked(kind, chunk_size):
    h, w, th, tw, labels = hidden_case(10)
    ref = loss_and_grads(lambda *a: unchunked(kind, *a, labels, 50), h, w, th, tw)
    got = loss_and_grads(lambda *a: chunked(kind, *a, labels, chunk_size), h, w, th, tw)
    assert got[1].item() == ref[1].item() == int((labels != -100).sum())
    for i in (0, 2, 3):   # loss, grad w.r.t. hidden, grad w.r.t. weight
        torch.testing.assert_close(got[i], ref[i], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_vocabulary_does_not_change_chunked_results(kind):
    h, w, th, tw, labels = hidden_case(11, pad=13)
    w[50:] = 100.0 * torch.randn(13, w.shape[1])   # garbage rows that would dominate any softmax
    tw[50:] = -100.0 * torch.randn(13, tw.shape[1])
    ref = loss_and_grads(lambda *a: chunked(kind, *a, labels, 8), h, w[:50], th, tw[:50])
    got = loss_and_grads(lambda *a: chunked(kind, *a, labels, 8, vocab_size=50), h, w, th, tw)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[2], ref[2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[3][:50], ref[3], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3][50:], torch.zeros_like(got[3][50:]))


def test_chunked_generic_helper_structure_and_edge_cases():
    h, w, th, tw, labels = hidden_case(12)
    # a single tensor comes back as a single tensor
    out = chunked_loss(lambda s, t, y: generalized_jsd_loss(s, t, y, beta=1.0, reduction="sum"),
                       h, w, labels, th, tw, chunk_size=7)
    assert isinstance(out, torch.Tensor) and out.dim() == 0
    # an empty batch gives zeros in loss_fn's structure, with a usable graph
    hh = h[:0].clone().requires_grad_()
    loss, n = chunked_sft_loss(hh, w, labels[:0], chunk_size=8)
    loss.backward()
    assert loss.item() == 0.0 and n.item() == 0
    # a batch of only masked positions: zero and no NaN
    hh = h.clone().requires_grad_()
    loss, n = chunked_generalized_jsd_loss(hh, w, th, tw, torch.full_like(labels, -100), beta=1.0, chunk_size=8)
    loss.backward()
    assert loss.item() == 0.0 and n.item() == 0 and torch.equal(hh.grad, torch.zeros_like(hh.grad))
    # no_grad evaluation takes the plain path and agrees
    with torch.no_grad():
        loss_ng, _ = chunked_sft_loss(h, w, labels, chunk_size=8)
    torch.testing.assert_close(loss_ng, sft_loss(h @ w.T, labels)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="vocab_size"):
        chunked_generalized_jsd_loss(h, w, th, tw[:40], labels)
    with pytest.raises(ValueError, match="exceeds"):
        chunked_sft_loss(h, w, labels, vocab_size=51)


def test_chunked_bf16_close_to_fp32():
    h, w, th, tw, labels = hidden_case(13)
    loss32, _ = chunked_generalized_jsd_loss(h, w, th, tw, labels, beta=1.0, chunk_size=8)
    loss16, _ = chunked_generalized_jsd_loss(h.bfloat16(), w.bfloat16(), th.bfloat16(), tw.bfloat16(), labels,
                                             beta=1.0, chunk_size=8)
    assert loss16.dtype == torch.float32 and torch.isfinite(loss16) and loss16.item() >= 0
    torch.testing.assert_close(loss16, loss32, rtol=0.05, atol=0.05)


# ----------------------------------------------------------------------------- OPD's sampled-token form

@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_sampled_token_kl_is_an_unbiased_reverse_kl_gradient(temperature):
    """E_{y ~ p_S}[grad of the surrogate at y] equals the gradient of the full-vocabulary reverse KL, exactly:
    enumerate every token y of a V=7 vocabulary, weight its surrogate gradient by p_S(y), and sum."""
    torch.manual_seed(0)
    student = torch.randn(3, 7, dtype=torch.float64)
    teacher = torch.randn(3, 7, dtype=torch.float64)
    expected_grad = torch.zeros_like(student)
    expected_kl = torch.zeros(())
    p_student = ref_probs(student, temperature)
    for y in range(7):
        logits = student.clone().requires_grad_(True)
        labels = torch.full((3,), y)
        surrogate, kl_estimate = sampled_token_kl_loss(logits, teacher, labels, temperature=temperature)
        surrogate.backward()
        # each row's surrogate depends only on that row's logits: weight row r's gradient by p_S(y | row r)
        expected_grad += p_student[:, y:y + 1] * logits.grad
        expected_kl = expected_kl + (p_student[:, y] * (torch.log(p_student[:, y])
                                                        - torch.log(ref_probs(teacher, temperature)[:, y]))).sum()
        assert kl_estimate.item() == pytest.approx(float((torch.log(p_student[:, y])
                                                          - torch.log(ref_probs(teacher, temperature)[:, y])).sum()),
                                                    rel=1e-4, abs=1e-6)  # the loss computes in fp32
    logits = student.clone().requires_grad_(True)
    reverse_kl = generalized_jsd_loss(logits, teacher, beta=1.0, temperature=temperature, reduction="sum")
    reverse_kl.backward()
    assert torch.allclose(expected_grad, logits.grad, atol=1e-6)
    assert float(reverse_kl.detach()) == pytest.approx(float(expected_kl), rel=1e-5)


def test_sampled_token_kl_ignores_masked_positions():
    student, teacher = torch.randn(4, 9), torch.randn(4, 9)
    labels = torch.tensor([1, -100, 3, -100])
    full, _ = sampled_token_kl_loss(student, teacher, labels)
    kept, _ = sampled_token_kl_loss(student[[0, 2]], teacher[[0, 2]], labels[[0, 2]])
    assert float(full) == pytest.approx(float(kept))


def test_under_bf16_autocast_the_lm_heads_are_cast_once_per_loss_with_the_same_numbers():
    """The CUDA training path's cast, on CPU bf16 autocast: 8 chunks of student and teacher cast each (V, H) weight
    once (the view `weight[:vocab_size]` would otherwise be cast at every chunk's matmul, recompute and backward),
    and the loss and the head's gradient equal the per-chunk casts'. The generic chunked path (SFT, KD, top-K,
    the sampled-token and policy losses), here with the JSD as its loss; trainer/losses/fused_divergences.py casts once by
    construction (tests/test_fused_divergences.py)."""
    import trainer.losses.chunked as chunked_losses
    from benchmarks.bench_losses import CountWeightCasts
    torch.manual_seed(0)
    n, v, hdim = 128, 1000, 32
    h = (torch.randn(n, hdim) * 0.5).requires_grad_()
    w = (torch.randn(v, hdim) * 0.05).requires_grad_()
    th, tw, labels = torch.randn(n, hdim) * 0.5, torch.randn(v, hdim) * 0.05, torch.randint(0, v - 1, (n,))
    results = {}
    for name, cast in (("once", chunked_losses.autocast_once), ("per chunk", lambda weight: None)):
        original, chunked_losses.autocast_once = chunked_losses.autocast_once, cast
        try:
            w.grad = None
            with CountWeightCasts((v - 1) * hdim) as counter:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = chunked_loss(lambda s, t, y: generalized_jsd_loss(s, t, y, beta=1.0, reduction="sum"),
                                        h, w, labels, th, tw, chunk_size=16, vocab_size=v - 1)
                loss.backward()
        finally:
            chunked_losses.autocast_once = original
        results[name] = counter.count, loss.detach(), w.grad.clone()
    chunks = n // 16  # once: one cast of each head, then one of each chunk's head gradient back to fp32
    assert results["once"][0] <= 2 + chunks and results["per chunk"][0] >= 4 * chunks
    assert torch.equal(results["once"][1], results["per chunk"][1])
    a, b = results["once"][2], results["per chunk"][2]
    assert torch.allclose(a, b, rtol=0, atol=1e-6)
