# python -m pytest tests/test_audit.py
"""Logit-free OPD's pieces (trainer/logit_free/audit.py): the peak-entropy scheduler against a reference written
differently, the student's entropy and log-probabilities against dense float64, the agreement and its weight against
closed forms, the loss, its gradient and the KL anchor against dense autograd, the Monte Carlo estimator against its
expectation, and the white-box reverse-KL signal the bounded weight replaces."""
import contextlib
import math
import random
from types import SimpleNamespace

import pytest
import torch

from dataset.collators import IGNORE_INDEX
from trainer.logit_free.agreement import TEXT_CAP, agreement, similarity
from model import Qwen3Config, create_model
from model.lora import add_lora, lora_layers
from support import TINY_CONFIG
from trainer.logit_free.audit import (CHUNK_LEN, MAX_CHUNKS, Chunk, anchor_labels, anchors_outside_thinking,
                                      audit_loss_sum, audit_stats, choose_chunks, chunk_weights, chunked_audit_loss,
                                      completion_lengths, plan_audits, position_stats, position_weights,
                                      posterior_weight)
from trainer.losses.chunked import completion_hidden
from trainer.losses.closed_forms import sampled_token_kl_loss


# ----------------------------------------------------------------------------- the scheduler

def reference_chunks(entropy, chunk_len, max_chunks, allowed=None):
    """The same rule written differently: repeatedly scan every start from the last to the first and keep the first
    one of strictly highest entropy among those allowed whose chunk fits in the completion and in the gaps left so
    far (scanning backwards with a strict > is what sends ties to the later start)."""
    n = len(entropy)
    free = [True] * n
    allowed = allowed or [True] * n
    anchors = []
    while len(anchors) < max_chunks:
        best = None
        for s in range(n - chunk_len, -1, -1):
            if allowed[s] and all(free[s:s + chunk_len]) and (best is None or entropy[s] > entropy[best]):
                best = s
        if best is None:
            break
        anchors.append(best)
        free[best:best + chunk_len] = [False] * chunk_len
    return sorted(anchors)


def test_defaults_are_the_methods():
    assert (MAX_CHUNKS, CHUNK_LEN, TEXT_CAP) == (10, 50, 4000)


def test_scheduler_hand_worked():
    #          0    1    2    3    4    5    6    7    8    9
    entropy = [0.1, 0.9, 0.2, 0.9, 0.3, 0.5, 0.0, 0.5, 0.8, 0.4]
    # C = 3: the starts are 0..7 (8 and 9 would run past the 10 tokens). Ranked by entropy, the later first on ties:
    # 3 (0.9), 1 (0.9), 7 (0.5), 5 (0.5), 4 (0.3), 2 (0.2), 0 (0.1), 6 (0.0). 3 takes [3, 6); 1 overlaps it;
    # 7 takes [7, 10); 5, 4 and 2 overlap; 0 takes [0, 3); 6 overlaps.
    assert choose_chunks(entropy, 3, 10) == [0, 3, 7]
    assert choose_chunks(entropy, 3, 2) == [3, 7]
    assert choose_chunks(entropy, 3, 1) == [3]          # the tie at 0.9 goes to the later position
    assert choose_chunks(entropy, 10, 5) == [0]         # = C: exactly one chunk, the whole completion
    assert choose_chunks(entropy, 11, 5) == []          # < C: no audit
    assert choose_chunks([], 1, 5) == []
    assert choose_chunks(entropy, 3, 0) == []
    assert choose_chunks(torch.tensor(entropy), 3, 10) == [0, 3, 7]   # a tensor row works the same
    assert choose_chunks([0.5] * 7, 2, 10) == [1, 3, 5]  # all tied: from the end down
    with pytest.raises(ValueError, match="NaN"):
        choose_chunks([0.1, float("nan")], 1, 1)
    with pytest.raises(ValueError):
        choose_chunks(entropy, 0, 1)


def test_scheduler_matches_reference_on_random_entropies():
    rng = random.Random(0)
    cases = 0
    for trial in range(600):
        chunk_len = rng.choice([1, 2, 3, 5, 8])
        max_chunks = rng.choice([0, 1, 2, 3, 10])
        n = rng.choice([0, chunk_len - 1, chunk_len, chunk_len + 1, rng.randint(1, 80)])
        n = max(n, 0)
        # few distinct values: ties everywhere (half the trials), else continuous values
        if trial % 2:
            entropy = [float(rng.randint(0, 3)) for _ in range(n)]
        else:
            entropy = [rng.random() for _ in range(n)]
        got = choose_chunks(entropy, chunk_len, max_chunks)
        assert got == reference_chunks(entropy, chunk_len, max_chunks), (entropy, chunk_len, max_chunks)
        # the properties, stated directly
        assert got == sorted(got) and len(got) <= max_chunks
        assert all(0 <= s and s + chunk_len <= n for s in got)                  # within the completion
        assert all(b - a >= chunk_len for a, b in zip(got, got[1:]))           # no overlap
        if n < chunk_len:
            assert got == []
        if len(got) < max_chunks:  # stopped early only because no chunk fits anywhere else
            covered = {t for s in got for t in range(s, s + chunk_len)}
            assert not any(all(t not in covered for t in range(s, s + chunk_len)) for s in range(n - chunk_len + 1))
        cases += bool(got)
    assert cases > 250   # most trials choose something: the comparison is not vacuous


def test_scheduler_skips_anchors_that_are_not_allowed():
    rng = random.Random(1)
    for _ in range(300):
        n, chunk_len, max_chunks = rng.randint(0, 40), rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 4, 10])
        entropy = [float(rng.randint(0, 3)) for _ in range(n)]
        allowed = [rng.random() < 0.6 for _ in range(n)]
        got = choose_chunks(entropy, chunk_len, max_chunks, allowed)
        assert got == reference_chunks(entropy, chunk_len, max_chunks, allowed)
        assert all(allowed[s] for s in got)


THINK, END_THINK = 151667, 151668


def test_no_anchor_inside_a_thinking_block():
    """An anchor's partial is the completion before it: from the token after a <think> up to its </think> the
    partial ends inside thinking (a stray <think> mid-answer: to the end). The planner takes only allowed anchors."""
    a, b = 11, 12
    rows = [[a, THINK, b, b, END_THINK, a, a], [a, a, THINK, a, a]]
    targets = torch.tensor([t for row in rows for t in row])
    allowed = anchors_outside_thinking(targets, [7, 5], THINK, END_THINK)
    assert allowed.tolist() == [True, True, False, False, False, True, True,   # inside: after <think> .. </think>
                                True, True, True, False, False]                 # a stray <think>: to the end
    assert anchors_outside_thinking(targets, [7, 5], None, None).all()
    entropy = torch.arange(12, dtype=torch.float32)   # the latest positions rank highest
    chunks = plan_audits(entropy, torch.zeros(12), [7, 5], 1, 2, allowed)
    assert [(c.row, c.anchor) for c in chunks] == [(0, 5), (0, 6), (1, 1), (1, 2)]


# ----------------------------------------------------------------------------- the student's numbers

def head_case(seed, n=37, hidden=16, vocab=50, pad=7):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab + pad, hidden, generator=g) * 0.5
    w[vocab:] = 100.0 * torch.randn(pad, hidden, generator=g)  # padding rows that would dominate any softmax
    labels = torch.randint(0, vocab, (n,), generator=g)
    return h, w, labels


@pytest.mark.parametrize("gen_temperature", [1.0, 0.7, 1.3])
@pytest.mark.parametrize("chunk_size", [8, 1024])
def test_position_stats_match_dense_float64(gen_temperature, chunk_size):
    h, w, labels = head_case(1)
    entropy, logprob = position_stats(h, w, labels, 50, gen_temperature, chunk_size)   # 37 = 4 x 8 + 5
    logits = h.double() @ w[:50].double().T
    want_entropy = torch.distributions.Categorical(logits=logits / gen_temperature).entropy()
    want_logprob = torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)
    assert entropy.dtype == logprob.dtype == torch.float32 and entropy.shape == logprob.shape == (37,)
    torch.testing.assert_close(entropy.double(), want_entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logprob.double(), want_logprob, rtol=1e-5, atol=1e-5)
    # no gradient, even from inputs that want one
    e, lp = position_stats(h.clone().requires_grad_(), w.clone().requires_grad_(), labels, 50, gen_temperature)
    assert not e.requires_grad and not lp.requires_grad


def test_position_stats_are_fp32_under_autocast_and_refuse_bad_inputs():
    h, w, labels = head_case(2)
    want = position_stats(h, w, labels, 50, 1.0, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = position_stats(h, w, labels, 50, 1.0, 8)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    e, lp = position_stats(h[:0], w, labels[:0], 50, 1.0)
    assert e.shape == lp.shape == (0,)
    with pytest.raises(ValueError, match="token ids"):
        position_stats(h, w, labels.masked_fill(labels == labels[0], IGNORE_INDEX), 50, 1.0)
    with pytest.raises(ValueError, match="exceeds"):
        position_stats(h, w, labels, 58, 1.0)
    with pytest.raises(ValueError, match="gen_temperature"):
        position_stats(h, w, labels, 50, 0.0)


class PositionModel(torch.nn.Module):
    """A stand-in for the model: the hidden state at (row b, column t) is (b, t), so the rows completion_hidden
    returns say where they came from."""

    def forward(self, input_ids, return_hidden=True):
        b, t = input_ids.shape
        rows = torch.arange(b, dtype=torch.float32)[:, None].expand(b, t)
        cols = torch.arange(t, dtype=torch.float32)[None, :].expand(b, t)
        return SimpleNamespace(hidden_states=torch.stack([rows, cols], dim=-1))


def test_plan_and_weights_follow_completion_hiddens_order():
    """Rows of different prompt and completion lengths, right padded as build_sequences lays them out: the flattened
    weights put each chunk's pi_hat exactly at the positions completion_hidden returns for that chunk's tokens."""
    prompts, completions = [3, 5, 2, 4], [12, 3, 9, 0]
    width = max(p + c for p, c in zip(prompts, completions)) + 2
    labels = torch.full((4, width), IGNORE_INDEX)
    input_ids = torch.zeros((4, width), dtype=torch.long)
    attention_mask = torch.zeros((4, width), dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        attention_mask[b, :p + c] = 1
        labels[b, p:p + c] = torch.arange(c) + 1
    hidden, targets = completion_hidden(PositionModel(), input_ids, attention_mask, labels)
    lengths = completion_lengths(labels)
    assert lengths == completions and hidden.shape[0] == sum(completions)
    where = [(int(r), int(col) + 1 - prompts[int(r)]) for r, col in hidden.tolist()]  # (row, completion offset)

    g = torch.Generator().manual_seed(3)
    entropy = torch.randint(0, 4, (hidden.shape[0],), generator=g).float()   # ties on purpose
    logprob = -torch.rand(hidden.shape[0], generator=g) * 3
    chunks = plan_audits(entropy, logprob, lengths, chunk_len=4, max_chunks=2)
    assert [c.row for c in chunks] == sorted(c.row for c in chunks)
    offsets = [0, 12, 15, 24]
    for b in range(4):
        row_entropy = entropy[offsets[b]:offsets[b] + lengths[b]].tolist()
        assert [c.anchor for c in chunks if c.row == b] == choose_chunks(row_entropy, 4, 2)
    assert {c.row for c in chunks} == {0, 2}  # row 1 (3 tokens) and row 3 (none) are shorter than a chunk
    for c in chunks:
        start = offsets[c.row] + c.anchor
        assert c.pi_bar == pytest.approx(math.exp(float(logprob[start:start + 4].double().mean())), rel=1e-12)

    pi_hats = [0.1 * (i + 1) for i in range(len(chunks))]
    weights, audited = position_weights(lengths, chunks, pi_hats)
    assert weights.shape == audited.shape == (sum(completions),) and weights.dtype == torch.float32
    for i, (b, offset) in enumerate(where):
        covering = [p for c, p in zip(chunks, pi_hats) if c.row == b and c.anchor <= offset < c.anchor + c.length]
        assert bool(audited[i]) == bool(covering)
        assert float(weights[i]) == pytest.approx(covering[0] if covering else 0.0)
    assert int(audited.sum()) == 4 * len(chunks)
    # the anchor's labels: the same targets, audited positions ignored
    masked = anchor_labels(targets, audited)
    assert torch.equal(masked[~audited], targets[~audited]) and bool((masked[audited] == IGNORE_INDEX).all())
    # a label in column 0 is never a target (no position predicts it): the lengths leave it out too
    labels[3, :3] = 7
    attention_mask[3, :3] = 1
    hidden, _ = completion_hidden(PositionModel(), input_ids, attention_mask, labels)
    rows = hidden[:, 0].long()
    assert completion_lengths(labels) == [int((rows == b).sum()) for b in range(4)] == [12, 3, 9, 2]


def test_position_weights_refuse_chunks_that_do_not_fit():
    with pytest.raises(ValueError, match="outside"):
        position_weights([5, 3], [Chunk(1, 1, 3, 0.5)], [0.5])
    with pytest.raises(ValueError, match="overlaps"):
        position_weights([9], [Chunk(0, 0, 3, 0.5), Chunk(0, 2, 3, 0.5)], [0.5, 0.5])
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        position_weights([9], [Chunk(0, 0, 3, 0.5)], [1.5])
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        position_weights([9], [Chunk(0, 0, 3, 0.5)], [-1.5])
    with pytest.raises(ValueError, match="rows"):
        position_weights([9], [Chunk(1, 0, 3, 0.5)], [0.5])
    weights, audited = position_weights([4, 0, 2], [], [])
    assert weights.shape == (6,) and not bool(audited.any()) and float(weights.abs().sum()) == 0.0


def lora_student(dropout: float) -> torch.nn.Module:
    """A tiny LoRA student whose adapters have trained (B not zero), in train mode, as the loop holds it."""
    model = create_model(Qwen3Config.from_dict({**TINY_CONFIG, "vocab_size": 1000}), seed=0)
    add_lora(model, rank=4, alpha=8.0, dropout=dropout)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model):
            for b in layer.lora_B.values():
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    return model.train()


def test_the_audits_numbers_are_the_sampling_policys_without_lora_dropout():
    """The entropy and pi_bar describe the policy the completion was sampled from (in evaluation mode): the audit's
    forward runs without LoRA's dropout, inside the loop's train mode too, which it leaves as it found it."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 1000, (2, 24), generator=g)
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.masked_fill(torch.arange(24) < 6, IGNORE_INDEX)
    dropped, plain = lora_student(0.5), lora_student(0.0)
    torch.manual_seed(0)
    with torch.no_grad():
        assert not torch.equal(dropped(input_ids).logits, plain(input_ids).logits)  # the dropout is live in train
    numbers = [audit_stats(model, contextlib.nullcontext, input_ids, attention_mask, labels, 1000, 0.7, 16)
               for model in (dropped, plain)]
    assert dropped.training and plain.training
    for a, b in zip(*numbers):
        assert torch.equal(a, b)
    lengths = completion_lengths(labels)
    assert plan_audits(*numbers[0][1:], lengths, 4, 3) == plan_audits(*numbers[1][1:], lengths, 4, 3)


# ----------------------------------------------------------------------------- agreement and the weight

def levenshtein_dp(a, b):
    """The textbook dynamic programme, for an independent check of the library's distance."""
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def test_similarity_closed_forms():
    assert similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert similarity("", "") == 1.0
    assert similarity("abc", "") == 0.0 and similarity("", "abc") == 0.0
    assert similarity("same", "same") == 1.0
    assert similarity("ab", "ba") == pytest.approx(0.0)   # two substitutions over 2 characters
    # only the first TEXT_CAP characters count
    assert similarity("x" * TEXT_CAP + "abc", "x" * TEXT_CAP + "zzzzzz") == 1.0
    assert similarity("x" * TEXT_CAP, "x" * (TEXT_CAP - 1) + "y") == pytest.approx(1 - 1 / TEXT_CAP)
    # ROUGE-1 F with counts: "a a b" / "a b b" overlap min(2,1) + min(1,2) = 2 of 3 + 3 tokens
    assert similarity("a a b", "a b b", "rouge1") == pytest.approx(2 * 2 / 6)
    assert similarity("the cat sat", "the  cat\nsat", "rouge1") == 1.0   # whitespace tokens
    assert similarity("the cat", "dog", "rouge1") == 0.0
    assert similarity("", "   ", "rouge1") == 1.0 and similarity("a", "", "rouge1") == 0.0
    # exact: no partial credit for one wrong digit, which Levenshtein gives 3/4
    assert similarity("8=15", "8=14", "exact") == 0.0 and similarity("8=15", "8=14") == pytest.approx(0.75)
    assert similarity("8=15", "8=15", "exact") == 1.0 and similarity("", "", "exact") == 1.0
    with pytest.raises(ValueError, match="levenshtein"):
        similarity("a", "b", "bleu")
    rng = random.Random(4)
    for _ in range(300):
        a = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 12)))
        b = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 12)))
        want = 1.0 if not (a or b) else 1 - levenshtein_dp(a, b) / max(len(a), len(b))
        assert similarity(a, b) == pytest.approx(want, abs=1e-12)
        assert similarity(a, b) == similarity(b, a) and 0.0 <= similarity(a, b, "rouge1") <= 1.0


def test_agreement_cuts_each_continuation_to_the_students_length():
    student = "x = 42."
    continuations = ["x = 42. Then we add 3 to both sides", "x = 41", "", "x = 42."]
    # cut to 7 characters: identical (1), "x = 41" (one substitution + one insertion: 1 - 2/7), empty (0), identical (1)
    assert agreement(student, continuations) == pytest.approx(1 + (1 - 2 / 7) + 0 + 1)
    assert agreement(student, []) == 0.0
    assert agreement("", ["anything"]) == 1.0   # cut to 0 characters: two empty strings
    assert agreement("a b", ["a b c d", "b"], "rouge1") == pytest.approx(1 + 2 * 1 / 3)


def test_posterior_weight_closed_form_bounds_and_monotonicity():
    assert posterior_weight(3.0, 4, 0.5) == pytest.approx((3 + 0.5) / 5)
    assert posterior_weight(2.5, 8, 0.2, alpha=3.0) == pytest.approx((2.5 + 0.6) / 11)
    assert posterior_weight(0.0, 0, 0.37) == pytest.approx(0.37)          # no samples: the prior mean
    assert posterior_weight(7.0, 10_000, 0.9) == pytest.approx(7 / 10_000, abs=1e-4)  # many: the sample mean
    for n in (1, 4, 16):
        for pi_bar in (0.0, 1e-9, 0.3, 1.0):
            ks = [n * i / 20 for i in range(21)]
            ws = [posterior_weight(k, n, pi_bar) for k in ks]
            assert all(0.0 <= w <= 1.0 for w in ws)
            assert all(b > a for a, b in zip(ws, ws[1:]))                # strictly increasing in k
            assert ws[0] == pytest.approx(pi_bar / (n + 1)) and ws[-1] == pytest.approx((n + pi_bar) / (n + 1))
    for bad in ((-0.1, 4, 0.5), (4.5, 4, 0.5), (1.0, 4, 1.5), (1.0, -1, 0.5)):
        with pytest.raises(ValueError):
            posterior_weight(*bad)
    with pytest.raises(ValueError, match="alpha"):
        posterior_weight(1.0, 4, 0.5, alpha=0.0)


# ----------------------------------------------------------------------------- the loss

def weights_case(n, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = [n - 20, 0, 20]
    entropy = torch.rand(n, generator=g)
    chunks = plan_audits(entropy, -torch.rand(n, generator=g), lengths, chunk_len=4, max_chunks=3)
    pi_hats = torch.rand(len(chunks), generator=g).tolist()
    return position_weights(lengths, chunks, pi_hats)


@pytest.mark.parametrize("chunk_size", [5, 1024])
def test_audit_loss_and_gradient_match_dense_float64_autograd(chunk_size):
    h, w, labels = head_case(5)
    weights, audited = weights_case(h.shape[0], 5)
    assert 0 < int(audited.sum()) < h.shape[0]

    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = chunked_audit_loss(hh, ww, labels, weights, chunk_size=chunk_size, vocab_size=50)
    loss.backward()

    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    log_p = torch.log_softmax(h64 @ w64[:50].T, -1).gather(-1, labels[:, None]).squeeze(-1)
    want = -(weights.double() * log_p).sum()
    want.backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hh.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ww.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)
    assert torch.equal(hh.grad[~audited], torch.zeros_like(hh.grad[~audited]))   # unaudited: no signal here
    assert torch.equal(ww.grad[50:], torch.zeros_like(ww.grad[50:]))             # the padding rows: none

    # the plain form on log-probabilities: the same number; weights are constants; weight-0 positions are inert
    lp = log_p.detach().float().requires_grad_()
    plain = audit_loss_sum(lp, weights.clone().requires_grad_())
    plain.backward()
    torch.testing.assert_close(plain.double(), want.detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(lp.grad, -weights)
    garbage = lp.detach().masked_fill(~audited, float("-inf"))
    assert float(audit_loss_sum(garbage, weights)) == pytest.approx(float(plain.detach()))
    # nothing audited: 0 with a usable graph
    hh.grad = None
    empty = chunked_audit_loss(hh, ww, labels, torch.zeros(h.shape[0]), vocab_size=50)
    empty.backward()
    assert float(empty.detach()) == 0.0 and (hh.grad is None or float(hh.grad.abs().sum()) == 0.0)


def test_anchor_is_forward_kl_to_the_reference_on_unaudited_positions():
    """The existing divergences call (forward KL: Divergence("jsd", beta=0.0), the reference model in the teacher's
    slot) on `anchor_labels` equals sum over the unaudited t of sum_v p_ref log(p_ref / p_S), densely in float64; and
    the whole loss -sum pi_hat log p_S + beta * anchor has the dense reference's gradient."""
    from trainer.losses.divergences import Divergence, divergence_sums
    h, w, labels = head_case(6)
    g = torch.Generator().manual_seed(6)
    ref_h = torch.randn(h.shape[0], 20, generator=g)          # the reference may be wider: its own hidden size
    ref_w = torch.randn(57, 20, generator=g) * 0.5
    weights, audited = weights_case(h.shape[0], 6)
    kl_coef = 0.1

    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    sums = divergence_sums(Divergence("jsd", beta=0.0), hh, ww, anchor_labels(labels, audited), ref_h, ref_w,
                           chunk_size=8, vocab_size=50)
    total = chunked_audit_loss(hh, ww, labels, weights, chunk_size=8, vocab_size=50) + kl_coef * sums.loss
    total.backward()

    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    log_q = torch.log_softmax(h64 @ w64[:50].T, -1)
    log_p_ref = torch.log_softmax(ref_h.double() @ ref_w[:50].double().T, -1)
    kl = (log_p_ref.exp() * (log_p_ref - log_q)).sum(-1)
    want_anchor = kl[~audited].sum()
    want_total = -(weights.double() * log_q.gather(-1, labels[:, None]).squeeze(-1)).sum() + kl_coef * want_anchor
    want_total.backward()

    assert int(sums.tokens) == int((~audited).sum())   # the anchor's own count; the loop normalises by all N
    torch.testing.assert_close(sums.loss.detach().double(), want_anchor.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hh.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(ww.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------- the estimator

def test_monte_carlo_agreement_converges_to_the_expected_similarity():
    """A stub teacher draws its N continuations i.i.d. from a known distribution over four strings (seeded per
    call). k / N averaged over S seeds must lie within 4 standard errors of E[phi] = sum_j p_j phi(student, c_j cut),
    the standard error sqrt(Var[phi] / (N S)) computed from the same known distribution; pi_hat, linear in k, must lie
    within 4 of its own standard errors of (N E[phi] + alpha pi_bar) / (N + alpha)."""
    student = "so the answer is 42"
    strings = ["so the answer is 42, since 6 * 7 = 42", "so the answer is 24", "we first note that", ""]
    probs = [0.5, 0.2, 0.2, 0.1]

    def teacher(n, seed):
        return random.Random(seed).choices(strings, weights=probs, k=n)

    for kind in ("levenshtein", "rouge1"):
        phis = [similarity(student, s[:len(student)], kind) for s in strings]
        mean = sum(p * f for p, f in zip(probs, phis))
        var = sum(p * (f - mean) ** 2 for p, f in zip(probs, phis))
        assert var > 0.01   # the continuations disagree: the test is not vacuous
        n, seeds, pi_bar = 8, 3000, 0.35
        ks = [agreement(student, teacher(n, seed), kind) for seed in range(seeds)]
        assert all(0.0 <= k <= n for k in ks)
        se = math.sqrt(var / (n * seeds))
        assert se < 0.005
        assert abs(sum(k / n for k in ks) / seeds - mean) <= 4 * se
        pi_hats = [posterior_weight(k, n, pi_bar) for k in ks]
        expected = (n * mean + pi_bar) / (n + 1)
        assert abs(sum(pi_hats) / seeds - expected) <= 4 * se * n / (n + 1)
        assert all(0.0 <= p <= 1.0 for p in pi_hats)


# ----------------------------------------------------------------------------- what the method replaces

def test_white_box_log_ratio_is_unbounded_where_the_bounded_weight_is_not():
    """The contrast the method starts from. White-box OPD's per-token signal is the sampled-token reverse-KL estimate
    log p_S(y) - log p_T(y) (`sampled_token_kl_loss`), which multiplies grad log p_S(y) in its surrogate: with the
    student fixed at p_S(y) = 0.3, as the teacher's probability of y falls from 1e-1 to 1e-6 it grows by ln 10 a
    decade, without bound, and so does the surrogate's gradient. The logit-free weight pi_hat multiplies the same
    grad log p_S(y) but lies in [0, 1] for every agreement k in [0, N] and every prior pi_bar, so the audit loss's
    gradient norm stays at most sqrt(2) (||onehot - p|| <= sqrt(2)) whatever the teacher does."""
    vocab, p_y = 10, 0.3
    student = torch.zeros(1, vocab)
    student[0, 0] = math.log(p_y * (vocab - 1) / (1 - p_y))   # p_S(y = 0) = 0.3, the rest uniform
    label = torch.tensor([0])
    signals, surrogate_norms, audit_norms = [], [], []
    n = 8
    for q in (1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6):
        teacher = torch.full((1, vocab), (1 - q) / (vocab - 1)).log()
        teacher[0, 0] = math.log(q)
        s = student.clone().requires_grad_()
        surrogate, estimate = sampled_token_kl_loss(s, teacher, label)
        surrogate.backward()
        signals.append(float(estimate))
        surrogate_norms.append(float(s.grad.norm()))
        # a teacher that reproduces the chunk about q of the time: every k from 0 to N, any prior
        for k in range(n + 1):
            for pi_bar in (0.0, p_y, 1.0):
                pi_hat = posterior_weight(float(k), n, pi_bar)
                assert 0.0 <= pi_hat <= 1.0
                s = student.clone().requires_grad_()
                audit_loss_sum(torch.log_softmax(s, -1)[:, 0], torch.tensor([pi_hat])).backward()
                audit_norms.append(float(s.grad.norm()))
    assert signals[0] == pytest.approx(math.log(p_y / 1e-1), rel=1e-5)
    assert all(b - a == pytest.approx(math.log(10), rel=1e-4) for a, b in zip(signals, signals[1:]))
    assert signals[-1] > 12                                   # ln(0.3 / 1e-6) = 12.6
    assert all(b > a for a, b in zip(surrogate_norms, surrogate_norms[1:]))
    assert surrogate_norms[-1] > 5 * surrogate_norms[0] and surrogate_norms[-1] > math.sqrt(2)
    assert max(audit_norms) <= math.sqrt(2)


def test_chunk_weights_posterior_advantage_and_centred():
    chunks = [Chunk(0, 0, 3, 0.25), Chunk(0, 4, 3, 0.5), Chunk(1, 0, 3, 0.9)]
    pi_hats = [0.75, 0.5, 0.15]
    assert chunk_weights(pi_hats, chunks, "posterior") == pi_hats
    assert chunk_weights(pi_hats, chunks, "advantage") == pytest.approx([0.5, 0.0, -0.75])
    assert chunk_weights(pi_hats, chunks, "centred") == pytest.approx([0.75 - 1.4 / 3, 0.5 - 1.4 / 3, 0.15 - 1.4 / 3])
    assert chunk_weights([], [], "centred") == []
    with pytest.raises(ValueError, match="not one of"):
        chunk_weights(pi_hats, chunks, "median")


def test_a_negative_chunk_weight_pushes_its_tokens_down():
    """The loss's gradient with the advantage weight: a chunk of weight w < 0 lowers its tokens' log-probability by
    a gradient step, one of weight w > 0 raises them; -sum w log p in closed form."""
    torch.manual_seed(0)
    logits = torch.randn(6, 11, requires_grad=True)
    labels = torch.tensor([1, 2, 3, 4, 5, 6])
    weights, _ = position_weights([6], [Chunk(0, 0, 3, 0.4), Chunk(0, 3, 3, 0.4)], [0.5, -0.5])
    log_p = torch.log_softmax(logits, -1).gather(1, labels[:, None])[:, 0]
    loss = audit_loss_sum(log_p, weights)
    assert float(loss) == pytest.approx(float(-(weights * log_p).sum()))
    loss.backward()
    with torch.no_grad():
        after = torch.log_softmax(logits - 0.1 * logits.grad, -1).gather(1, labels[:, None])[:, 0]
    assert bool((after[:3] > log_p[:3]).all()) and bool((after[3:] < log_p[3:]).all())
