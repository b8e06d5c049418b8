# python -m pytest tests/test_topk_divergence.py
"""The coarse-grained divergence of a top-K teacher (trainer/losses/topk_divergence.py) by enumeration on a small
vocabulary: it is the generalized JSD of the (K+2)-bucket distributions, never more than the full-vocabulary
divergence, equal to it when S is everything, with autograd's gradients of a dense float64 reference; chunked it is
the unchunked sum, a local teacher's top-K gives what the same numbers from a server give, and its chunk
allocates no (C, V) tensor."""
import math

import pytest
import torch

from support import Allocations, reference_divergence
from trainer.losses.closed_forms import generalized_jsd_loss
from trainer.losses.topk_divergence import (TAIL_FLOOR, chunked_topk_divergence, topk_chunk_loss, topk_divergence,
                                            topk_support)

BETAS = (0.0, 0.3, 0.5, 1.0)
V = 10


def ref_coarse(student_logits, teacher_logits, supports, beta, temperature=1.0):
    """Per position: the buckets S (sorted) and the rest, built by enumerating the vocabulary."""
    q_full = (student_logits.double() / temperature).softmax(-1)
    p_full = (teacher_logits.double() / temperature).softmax(-1)
    values = []
    for n, support in enumerate(supports):
        s = sorted(support)
        rest = [v for v in range(q_full.shape[-1]) if v not in support]
        q = torch.cat([q_full[n, s], q_full[n, rest].sum().reshape(1)]) if rest else q_full[n, s]
        p = torch.cat([p_full[n, s], p_full[n, rest].sum().reshape(1)]) if rest else p_full[n, s]
        values.append(reference_divergence(p, q, beta))
    return torch.stack(values)


def case(seed, n=6, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V, generator=g) * scale, torch.randn(n, V, generator=g) * scale,
            torch.randint(0, V, (n,), generator=g))


def supports_of(ids):
    return [{int(i) for i in row if 0 <= int(i) < V} for row in ids]


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_equals_the_definition_and_its_gradient(beta, k, temperature):
    student, teacher, labels = case(k)
    ids, logprobs = topk_support(teacher, labels, k, temperature)
    x = student.clone().requires_grad_()
    ours = topk_divergence(x, ids, logprobs, labels, beta, temperature, reduction="none")
    ours.sum().backward()
    y = student.double().requires_grad_()
    ref = ref_coarse(y, teacher, supports_of(ids), beta, temperature)
    ref.sum().backward()
    assert torch.allclose(ours.double(), ref.detach(), atol=2e-6, rtol=1e-5)
    assert torch.allclose(x.grad.double(), y.grad, atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("beta", BETAS)
def test_never_exceeds_the_full_divergence_and_equals_it_when_s_is_everything(beta):
    for seed in range(5):
        student, teacher, labels = case(100 + seed, n=16, scale=3.0)
        full = generalized_jsd_loss(student, teacher, labels, beta, reduction="none")
        previous = torch.zeros_like(full)
        for k in range(1, V + 1):
            # float64 teacher log-probs: with fp32 ones 1 - sum_S p_T carries ~1e-7 of rounding, and a tail of
            # 1e-3 is then only known to 1e-4 relative (the reverse KL to about as much)
            coarse, tail = topk_divergence(student, *topk_support(teacher.double(), labels, k), labels, beta,
                                           reduction="none", return_tail=True)
            # the DPI is for true tails: where the teacher's is floored (scale 3: at k >= 8) it does not apply
            exact = (tail > 2 * TAIL_FLOOR) | (k == V)
            slack = 1e-6 * (1 + full)  # fp32 rounding of values up to ~10
            assert (coarse <= full + slack)[exact].all()
            if beta in (0.0, 1.0):  # a finer partition (S grows with k) gives a larger KL (the DPI, nested)
                assert (coarse >= previous - slack)[exact].all()
            previous = coarse
        assert torch.allclose(coarse, full, atol=2e-6, rtol=1e-6)  # k = V: S is the whole vocabulary, no tail bucket


def test_s_is_everything_has_finite_gradients():
    student, teacher, labels = case(7)
    x = student.clone().requires_grad_()
    ids, logprobs = topk_support(teacher, labels, V)
    loss = topk_divergence(x, ids, logprobs, labels, 1.0)
    loss.backward()
    ref = x.detach().clone().requires_grad_()
    generalized_jsd_loss(ref, teacher, labels, 1.0, reduction="sum").backward()
    assert torch.isfinite(x.grad).all() and torch.allclose(x.grad, ref.grad, atol=1e-5)


def test_served_shapes_duplicates_padding_rows_and_ignored_positions():
    """What a server sends: the sampled token inside the top-K or beside it, an id of a padding row (>= V: its mass
    is in the tail), -1 padding; labels -100 count nothing."""
    student, teacher, labels = case(3, n=4)
    logp = teacher.log_softmax(-1)
    top = logp.topk(3, dim=-1).indices
    ids = torch.cat([top, labels[:, None], torch.full((4, 1), -1)], dim=-1)
    ids[1, 3] = top[1, 0]          # the sampled token is the argmax: a repeat
    ids[2, 4] = V + 5              # a padding row of the served head
    padded_logp = torch.cat([logp, torch.full((4, 10), -30.0)], dim=-1)
    logprobs = padded_logp.gather(-1, ids.clamp_min(0))
    masked = labels.clone()
    masked[3] = -100
    ours = topk_divergence(student, ids, logprobs, masked, 1.0, reduction="none")
    ref = ref_coarse(student, teacher, supports_of(ids), 1.0)
    assert ours[3] == 0
    assert torch.allclose(ours[:3].double(), ref[:3], atol=2e-6)
    shuffled = ids.flip(-1), logprobs.flip(-1)  # the order of S does not matter
    assert torch.allclose(topk_divergence(student, *shuffled, masked, 1.0, reduction="none"), ours, atol=1e-6)


def test_a_tail_near_zero_is_floored_and_finite():
    """A peaked teacher whose top-1 rounds to all the mass: its tail 1 - p would be 0 (reverse KL infinite); it is
    floored at TAIL_FLOOR. A tail of 1e-4 is computed to fp32 precision by log1p(-exp(logsumexp))."""
    student = torch.zeros(2, V, requires_grad=True)
    for tail in (1e-4, 0.0):
        logprobs = torch.tensor([[math.log1p(-tail)], [math.log1p(-tail)]], dtype=torch.float32)
        ids = torch.tensor([[0], [0]])
        _, tail_sum = topk_divergence(student, ids, logprobs, None, 1.0, reduction="sum", return_tail=True)
        assert tail_sum.item() / 2 == pytest.approx(max(tail, TAIL_FLOOR), rel=1e-3)
    loss = topk_divergence(student, ids, logprobs, None, 1.0)
    loss.backward()
    q_tail = 0.9  # the uniform student: 9 of 10 tokens in the tail
    expected = 0.1 * math.log(0.1 / 1.0) + q_tail * math.log(q_tail / TAIL_FLOOR)
    assert loss.item() / 2 == pytest.approx(expected, rel=1e-4)
    assert torch.isfinite(student.grad).all()


@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_chunked_local_and_served_numbers_agree_with_the_unchunked(beta):
    g = torch.Generator().manual_seed(0)
    n, h, vocab_pad, vocab = 37, 8, 70, 64
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(vocab_pad, h, generator=g)
    t_hidden, t_weight = torch.randn(n, h, generator=g), torch.randn(vocab_pad, h, generator=g) * 2
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[::5] = -100
    k = 4
    teacher_logits = t_hidden @ t_weight[:vocab].T
    support = topk_support(teacher_logits, labels, k)
    w1 = weight.clone().requires_grad_()
    dense = topk_divergence(hidden @ w1[:vocab].T, *support, labels, beta, return_tail=True)
    dense[0].backward()
    results = []
    for heads in (dict(teacher_hidden=t_hidden, teacher_weight=t_weight), dict(teacher_support=support)):
        w = weight.clone().requires_grad_()
        loss, tokens, tail = chunked_topk_divergence(hidden, w, labels, k, beta=beta, chunk_size=8,
                                                     vocab_size=vocab, **heads)
        loss.backward()
        assert int(tokens) == int((labels != -100).sum())
        assert loss.item() == pytest.approx(dense[0].item(), rel=1e-5)
        assert tail.item() == pytest.approx(dense[1].item(), rel=1e-5)
        assert torch.allclose(w.grad, w1.grad, atol=1e-5)
        results.append((loss.item(), w.grad))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-7)  # an fp32 sum of ~110: a ulp is 7.6e-6


@pytest.mark.parametrize("temperature", [1.0, 1.7])
def test_a_local_teachers_chunk_allocates_no_chunk_sized_tensor(temperature):
    """The local teacher's top-K comes from its log-softmax written over its chunk's logits (the driver's buffer,
    the closed form's to overwrite), not from a fresh (C, V) tensor."""
    c, v = 6, 40
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(c, v, generator=g), torch.randn(c, v, generator=g)
    labels = torch.randint(0, v, (c,), generator=g)
    chunk = topk_chunk_loss(4, 0.5, temperature, local=True)
    spares = [torch.empty(c, v) for _ in range(chunk.spares)]
    with Allocations() as allocated:
        chunk.fn(student, teacher, spares, labels, None)
    assert (c, v) not in allocated.shapes


def test_bad_arguments_are_refused():
    student, teacher, labels = case(0)
    ids, logprobs = topk_support(teacher, labels, 2)
    with pytest.raises(ValueError, match="support ids"):
        topk_divergence(student, ids[:, :2], logprobs, labels)
    with pytest.raises(ValueError, match="beta"):
        topk_divergence(student, ids, logprobs, labels, beta=1.5)
    with pytest.raises(ValueError, match="teacher_support"):
        chunked_topk_divergence(torch.zeros(3, 4), torch.zeros(V, 4), labels[:3], 2)


def test_opd_with_a_local_top_k_teacher_logs_the_divergence_of_independently_computed_logits(
        tiny_config_path, chat_jsonl, tmp_path):
    """train_opd --teacher_topk 4 --teacher_path: one step's logged loss is topk_divergence of the student's and the
    teacher's logits computed here, at --beta 0.5 --temperature 1.5."""
    from common.seeds import derived_seed
    from dataset.collators import PromptCollator, build_sequences
    from dataset.sources import RowDataset
    from loop_helpers import loop_args, metrics
    from model import Qwen3Config, create_model, generate, load_pretrained, load_tokenizer, save_pretrained
    from trainer.skeleton.data_stream import EpochSampler
    from trainer.train_opd import main as train_opd

    torch.set_num_threads(1)
    teacher_dir = str(tmp_path / "teacher")
    save_pretrained(create_model(Qwen3Config.from_json(tiny_config_path), seed=123), teacher_dir)
    train_opd(loop_args(tiny_config_path, chat_jsonl, tmp_path, teacher_path=teacher_dir, batch=4, max_steps=1,
                        max_new_tokens=8, beta=0.5, temperature=1.5, teacher_topk=4))
    logged = metrics(tmp_path)[0]

    tokenizer = load_tokenizer(None)
    student = create_model(Qwen3Config.from_json(tiny_config_path), seed=7).eval()
    teacher = load_pretrained(teacher_dir).eval()
    dataset = RowDataset(chat_jsonl)
    rows = [dataset[i] for i in list(EpochSampler(len(dataset), seed=7, epoch=0))[:4]]
    prompts = PromptCollator(tokenizer, 32, enable_thinking=False)(rows)
    generators = [torch.Generator().manual_seed(derived_seed(7, 0, row["row_index"])) for row in rows]
    out = generate(student, prompts["prompt_ids"], prompts["prompt_attention_mask"], 8,
                   eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, generator=generators,
                   vocab_size=len(tokenizer))
    input_ids, attention_mask, labels = build_sequences(prompts["prompt_ids"], prompts["prompt_attention_mask"],
                                                        out.completion_ids, out.completion_mask)
    with torch.no_grad():
        s_logits = student(input_ids, attention_mask=attention_mask).logits[:, :-1, :len(tokenizer)]
        t_logits = teacher(input_ids, attention_mask=attention_mask).logits[:, :-1, :len(tokenizer)]
    labels = labels[:, 1:]
    keep = labels != -100
    expected = topk_divergence(s_logits[keep], *topk_support(t_logits[keep], labels[keep], 4, 1.5), labels[keep],
                               0.5, 1.5, reduction="per_token_mean")
    assert logged["tokens"] == int(keep.sum())
    assert logged["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert 0 < logged["teacher_tail_mass"] < 1
