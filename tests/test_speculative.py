# python -m pytest tests/test_speculative.py
"""Speculative KD in the built-in decode engine (model/generate.py's Speculative): with K = the vocabulary the
rollouts are plain sampling's bit for bit (no proposal is ever outside the teacher's top-K, and the teacher's draws
come after the student's); with K = 1 a kept token is the teacher's argmax and every replaced token is the
teacher's own sample, recomputed here by a full forward of the teacher on the prefix; rows that stop early leave
both caches alike."""
import pytest
import torch

from model import Qwen3Config, create_model
from model.generate import Decoder, Sampling, Speculative, generate, pick_token

VOCAB, PAD, NEW = 300, 299, 12

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair():
    """A student and a teacher of different depths, float64 (a recomputed draw is never a rounding apart)."""
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    student = create_model(Qwen3Config(num_hidden_layers=1, **config), seed=1, dtype=torch.float64).eval()
    teacher = create_model(Qwen3Config(num_hidden_layers=2, **config), seed=2, dtype=torch.float64).eval()
    return student, teacher


def prompts():
    ids = torch.tensor([[PAD, PAD, 5, 17, 42], [7, 8, 9, 10, 11], [PAD, PAD, PAD, PAD, 3]])
    return ids, (ids != PAD).long()


def seeds():
    return [torch.Generator().manual_seed(s) for s in (11, 12, 13)]


def rollout(student, teacher=None, topk=0, eos=None, decoder=None, top_k=0):
    ids, mask = prompts()
    with torch.no_grad():
        return generate(student, ids, mask, NEW, generator=seeds(), pad_token_id=PAD, vocab_size=VOCAB - 1,
                        eos_token_id=eos, speculative=Speculative(teacher, topk) if teacher is not None else None,
                        decoder=decoder, top_k=top_k)


@pytest.mark.parametrize("stops", [False, True])
def test_with_k_the_vocabulary_the_rollouts_are_plain_samplings(pair, stops):
    """Also where rows stop at EOS (a token plain sampling draws in row 0), the batch narrowing in both engines."""
    student, teacher = pair
    eos = int(rollout(student).completion_ids[0, 3]) if stops else None
    plain = rollout(student, eos=eos)
    assert bool((plain.completion_mask.sum(1) < NEW).any()) == stops
    speculative = rollout(student, teacher, topk=VOCAB, eos=eos)
    assert torch.equal(speculative.completion_ids, plain.completion_ids)
    assert torch.equal(speculative.completion_mask, plain.completion_mask)
    assert not bool(speculative.replaced.any())


def test_with_k_one_kept_tokens_are_the_teachers_argmax_and_replaced_ones_its_samples(pair):
    student, teacher = pair
    out = rollout(student, teacher, topk=1)
    ids, mask = prompts()
    teacher_uniforms = [(g.manual_seed(s), torch.rand(NEW, generator=g, dtype=torch.float64),
                         torch.rand(NEW, generator=g, dtype=torch.float64))[2]
                        for g, s in zip(seeds(), (11, 12, 13))]  # after the student's draws, as generate draws them
    sampling = Sampling(True, 1.0, 0, 1.0, VOCAB - 1)
    replaced = 0
    for row in range(3):
        for t in range(int(out.completion_mask[row].sum())):
            prefix = torch.cat([ids[row], out.completion_ids[row, :t]])[None]
            with torch.no_grad():
                logits = teacher(prefix, attention_mask=torch.cat([mask[row], torch.ones(t, dtype=torch.long)])[None]
                                 ).logits[:, -1].clone()
            token = int(out.completion_ids[row, t])
            if bool(out.replaced[row, t]):
                replaced += 1
                assert token == int(pick_token(logits.clone(), sampling, teacher_uniforms[row][t:t + 1]))
            else:
                assert token == int(logits[0, :VOCAB - 1].argmax())
    assert 0 < replaced < int(out.completion_mask.sum())  # both cases occur


def test_greedy_is_refused(pair):
    student, teacher = pair
    ids, mask = prompts()
    with pytest.raises(ValueError, match="samples"):
        generate(student, ids, mask, 4, do_sample=False, speculative=Speculative(teacher, 1))


def spy_on_compiled_steps(decoder: Decoder, monkeypatch) -> list:
    """Per compiled call: (width, the addresses it writes -- both caches' and the state's --, whether each is
    marked static)."""
    calls, step = [], decoder.compiled_step

    def spy(model, state, cache, sampling, speculative):
        written = [cache.keys[0], speculative.cache.keys[0], speculative.cache.values[-1], *state.tensors()]
        calls.append((len(state.rows), tuple(t.data_ptr() for t in written),
                      all(hasattr(t, "_dynamo_static_input_type") for t in written)))
        return step(model, state, cache, sampling, speculative)
    monkeypatch.setattr(decoder, "compiled_step", spy)
    return calls


@pytest.mark.slow
def test_the_compiled_step_decodes_the_eager_steps_tokens_and_replacements(pair, monkeypatch):
    """--decode compiled with --skd_topk: the teacher decodes inside the compiled step (inductor here; a CUDA graph
    on a GPU), its cache a second storage the decoder holds. Sampled rollouts with K = 2 (tokens kept and
    replaced), two rows stopping so that both caches narrow: the eager step's tokens, masks and replacements
    exactly (float64: a draw is never a rounding apart); a second rollout compiles nothing new, and every call
    writes both caches and the state at the same addresses, marked static."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()  # a fresh compile cache: no graph another test left
    student, teacher = pair
    free = rollout(student, teacher, topk=2)
    eos = [int(free.completion_ids[0, 2]), int(free.completion_ids[1, 3])]  # rows 0 and 1 stop by step 3
    eager = rollout(student, teacher, topk=2, eos=eos)
    decoder = Decoder(compiled=True)
    calls = spy_on_compiled_steps(decoder, monkeypatch)
    for again in (False, True):
        graphs = counters["stats"]["unique_graphs"]
        compiled = rollout(student, teacher, topk=2, eos=eos, decoder=decoder)
        assert torch.equal(compiled.completion_ids, eager.completion_ids)
        assert torch.equal(compiled.completion_mask, eager.completion_mask)
        assert torch.equal(compiled.replaced, eager.replaced)
        if again:
            assert counters["stats"]["unique_graphs"] == graphs, "a new rollout of a compiled width compiled again"
    assert 0 < int(eager.replaced.sum()) < int(eager.completion_mask.sum())  # both cases occur
    assert {w for w, _, _ in calls} == {3, 1} and all(marked for _, _, marked in calls)
    assert len({addresses for _, addresses, _ in calls}) == 1, "a cache or the state moved: a CUDA graph records again"


@pytest.mark.slow
def test_the_compiled_step_under_autocast_runs_a_bf16_twin_of_the_teacher_too():
    """Under bf16 autocast the compiled step runs low-precision twins of both models (a compiled graph would cast
    every fp32 weight at every token): the teacher's twin holds bf16 copies of its linear weights, refreshed in
    place from rollout to rollout, and the tokens and replacements are eager autocast's (top-k 4 sampling: few CDF
    boundaries for inductor's different rounding to cross, as in test_generate's compiled test)."""
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    student = create_model(Qwen3Config(num_hidden_layers=1, **config), seed=1).eval()
    teacher = create_model(Qwen3Config(num_hidden_layers=2, **config), seed=2).eval()
    decoder = Decoder(compiled=True)
    for rollout_index in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager = rollout(student, teacher, topk=2, top_k=4)
            compiled = rollout(student, teacher, topk=2, top_k=4, decoder=decoder)
        assert torch.equal(compiled.completion_ids, eager.completion_ids)
        assert torch.equal(compiled.replaced, eager.replaced)
        twin, of = decoder.twins["teacher"]
        assert of() is teacher and decoder.twins["model"][1]() is student
        if rollout_index == 0:
            addresses = [p.data_ptr() for p in twin.parameters()]
        assert [p.data_ptr() for p in twin.parameters()] == addresses
        assert all(torch.equal(a.weight, b.weight.to(torch.bfloat16)) for a, b in zip(twin.modules(), teacher.modules())
                   if isinstance(b, torch.nn.Linear))
