# Run: python -m pytest tests/test_generate.py
"""KV-cache generation: greedy equals transformers' greedy generate on a left-padded batch with per-row EOS,
seeded sampling is reproducible, top-k / top-p limits, vocab_size masking, the cache equals a full recompute, the
eager step over the filled cache positions equals the whole-cache step bit for bit, the lm_head's form follows the
use and the rows, stopped rows leave the batch in power-of-two widths, and the compiled decode step (--decode compiled)
samples exactly the eager step's tokens with one compiled graph per width, writing its cache at fixed, static-marked
addresses."""
import copy
import importlib
import os

import pytest
import torch
import transformers

from model import KVCache, load_pretrained
from model.generate import (Decoder, completion_mask_through_eos, generate, linear_pairs, low_precision_twin,
                            next_token_logits)
from model.lora import add_lora, lora_layers
from support import ROOT

VOCAB = 1000
PAD = 999


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The same random weights in transformers' Qwen3ForCausalLM and ours (loaded from HF's save)."""
    path = tmp_path_factory.mktemp("tiny")
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   rope_theta=10000.0, tie_word_embeddings=True, max_position_embeddings=256)
    hf = transformers.Qwen3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # std 0.1 (not HF's 0.02): peaked logits, so greedy has no near-ties between the two
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen) if "norm" in name
                    else 0.1 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(path)
    return hf, load_pretrained(str(path)).eval()


def prompts(lengths=(9, 4, 6, 1), seed=0):
    total = max(lengths)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, PAD, (len(lengths), total), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, total - n:] = 1
        ids[row, :total - n] = PAD
    return ids, mask


def hf_greedy(hf, ids, mask, max_new_tokens, eos):
    out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                      eos_token_id=eos, pad_token_id=PAD, min_new_tokens=0, top_k=None, top_p=None,
                      temperature=None)
    return out if isinstance(out, torch.Tensor) else out.sequences


def pick_eos(completions):
    """A token greedy actually produces, so that EOS fires for some rows (at different steps) but not for all."""
    B, R = completions.shape
    for t in range(1, R):
        for row in range(B):
            token = int(completions[row, t])
            hits = [(completions[r] == token).any().item() for r in range(B)]
            if not all(hits) and (completions[row, :t] != token).all():
                return token
    pytest.fail("no token fires EOS for only some rows; change the seed")


def test_greedy_equals_transformers_with_per_row_eos(models):
    hf, ours = models
    ids, mask = prompts()
    R = 20
    free = generate(ours, ids, mask, R, do_sample=False, pad_token_id=PAD)
    assert free.completion_ids.shape == (4, R) and bool(free.completion_mask.all())
    assert torch.equal(free.sequences, hf_greedy(hf, ids, mask, R, eos=None))

    eos = pick_eos(free.completion_ids)
    out = generate(ours, ids, mask, R, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    ref = hf_greedy(hf, ids, mask, R, eos=eos)
    assert torch.equal(out.sequences, ref)
    assert torch.equal(out.sequences[:, :ids.shape[1]], ids)

    stopped = 0
    for row in range(4):
        comp, cmask = out.completion_ids[row], out.completion_mask[row]
        hits = (comp == eos).nonzero()
        if len(hits):  # 1 through the first EOS, 0 after; pad after it
            stopped += 1
            first = int(hits[0])
            assert cmask[:first + 1].all() and not cmask[first + 1:].any()
            assert (comp[first + 1:] == PAD).all()
            assert torch.equal(comp[:first + 1], free.completion_ids[row, :first + 1])
        else:
            assert cmask.all()
    assert 0 < stopped < 4


def test_all_rows_finished_stops_early(models):
    _, ours = models
    ids, mask = prompts()
    free = generate(ours, ids, mask, 12, do_sample=False, pad_token_id=PAD)
    # make every row's first token its EOS: generation ends after one step
    out = generate(ours, ids, mask, 12, do_sample=False, eos_token_id=free.completion_ids[:, 0].tolist(),
                   pad_token_id=PAD)
    assert out.completion_ids.shape == (4, 1) and out.completion_mask.all()


def test_completion_mask_through_first_eos():
    eos = torch.tensor([7, 8])
    ids = torch.tensor([[1, 7, 0, 7], [1, 2, 3, 4], [8, 0, 0, 0], [1, 2, 3, 8]])
    expected = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]])
    assert torch.equal(completion_mask_through_eos(ids, eos), expected)


def _sample(model, seed, **kwargs):
    ids, mask = prompts()
    gen = torch.Generator().manual_seed(seed)
    return generate(model, ids, mask, 16, do_sample=True, pad_token_id=PAD, generator=gen, **kwargs).completion_ids


def test_sampling_is_reproducible_with_the_same_generator(models):
    _, ours = models
    a, b, c = _sample(ours, 123), _sample(ours, 123), _sample(ours, 124)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    greedy = generate(ours, *prompts(), 16, do_sample=False, pad_token_id=PAD).completion_ids
    assert not torch.equal(a, greedy)  # it really samples


@pytest.mark.parametrize("kwargs", [dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, top_p=0.5, temperature=3.0)])
def test_top_k_1_and_tiny_top_p_equal_greedy(models, kwargs):
    _, ours = models
    ids, mask = prompts()
    greedy = generate(ours, ids, mask, 16, do_sample=False, pad_token_id=PAD).completion_ids
    assert torch.equal(_sample(ours, 5, **kwargs), greedy)


def test_top_k_and_top_p_restrict_the_support():
    from model.generate import sample_next_token
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(2000, 1)
    uniforms = torch.rand(2000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    top2 = sample_next_token(logits, True, 1.0, 2, 1.0, uniforms)
    assert set(top2.tolist()) == {0, 1}
    # probs ~ [.64, .24, .09, .03, .01]: top_p=0.8 keeps the first two (0.64 < 0.8, 0.88 >= 0.8)
    nucleus = sample_next_token(logits, True, 1.0, 0, 0.8, uniforms)
    assert set(nucleus.tolist()) == {0, 1}


def _per_row(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_a_rows_sample_depends_on_its_seed_alone(models, monkeypatch):
    """Batch-invariant: row r samples the same tokens alone, in another batch order or with other batch-mates,
    also when rows stop at EOS early and leave the decoding batch."""
    _, ours = models
    ids, mask = prompts()
    seeds = [11, 22, 33, 44]
    free = generate(ours, ids, mask, 16, pad_token_id=PAD, generator=_per_row(seeds)).completion_ids
    kept_rows = []  # the decoding batch's size after each time stopped rows left it
    select_rows = KVCache.select_rows
    monkeypatch.setattr(KVCache, "select_rows", lambda cache, index: kept_rows.append(len(index))
                        or select_rows(cache, index))
    for eos in (None, [int(free[0, 2]), int(free[1, 3])]):  # rows 0 and 1 stop by step 3: half the batch
        together = generate(ours, ids, mask, 16, pad_token_id=PAD, eos_token_id=eos, generator=_per_row(seeds))
        alone = [generate(ours, ids[r:r + 1], mask[r:r + 1], 16, pad_token_id=PAD, eos_token_id=eos,
                          generator=_per_row(seeds[r:r + 1])).completion_ids[0] for r in range(4)]
        width = together.completion_ids.shape[1]  # a row alone stops at its own EOS: pad it to the batch's width
        alone = torch.stack([torch.nn.functional.pad(a, (0, width - len(a)), value=PAD) for a in alone])
        assert torch.equal(together.completion_ids, alone)
        order = [2, 0, 3, 1]
        shuffled = generate(ours, ids[order], mask[order], 16, pad_token_id=PAD, eos_token_id=eos,
                            generator=_per_row([seeds[r] for r in order])).completion_ids
        assert torch.equal(shuffled, together.completion_ids[order])
    assert width == 16 and 2 in kept_rows, "rows 2 and 3 should decode on alone after rows 0 and 1 stopped"


def test_a_rows_draws_do_not_depend_on_the_token_budget(models):
    """Step t's uniform is the t-th of the row's generator: a shorter budget samples the longer one's prefix."""
    _, ours = models
    ids, mask = prompts()
    long = generate(ours, ids, mask, 16, pad_token_id=PAD, generator=_per_row([1, 2, 3, 4])).completion_ids
    short = generate(ours, ids, mask, 7, pad_token_id=PAD, generator=_per_row([1, 2, 3, 4])).completion_ids
    assert torch.equal(short, long[:, :7])


def test_vocab_size_masks_padded_rows(models):
    _, ours = models
    # a flat distribution (final norm weight 0 -> all logits 0): without masking the 100 padded rows are drawn
    flat = load_like(ours)
    with torch.no_grad():
        flat.model.norm.weight.zero_()
    assert (_sample(flat, 0) >= 900).any()
    assert (_sample(flat, 0, vocab_size=900) < 900).all()
    greedy = generate(flat, *prompts(), 4, do_sample=False, pad_token_id=PAD, vocab_size=900).completion_ids
    assert (greedy < 900).all()


def load_like(model):
    import copy
    return copy.deepcopy(model)


def test_kv_cache_equals_full_recompute(models):
    _, ours = models
    ids, mask = prompts()
    B, P = ids.shape
    seq = generate(ours, ids, mask, 10, do_sample=False, pad_token_id=PAD).sequences
    full_mask = torch.cat([mask, torch.ones(B, 10, dtype=mask.dtype)], dim=1)
    cache = KVCache(ours.config, B, P + 10, torch.float32, "cpu")
    with torch.no_grad():
        cached = ours(ids, attention_mask=mask, kv_cache=cache).logits[:, -1]
        for t in range(10):
            full = ours(seq[:, :P + t], attention_mask=full_mask[:, :P + t]).logits[:, -1]
            assert torch.allclose(cached, full, atol=1e-5), t
            assert torch.equal(cached.argmax(-1), seq[:, P + t])
            cached = ours(seq[:, P + t:P + t + 1], attention_mask=full_mask[:, :P + t + 1], kv_cache=cache).logits[:, -1]
        assert cache.length == P + 10


def test_the_eager_step_over_the_filled_positions_is_the_whole_cache_step_bit_for_bit(models, monkeypatch):
    """The eager decode step attends over the cache's filled positions rounded up to KEY_BLOCK; attending over the
    whole cache instead (as the compiled step does; its length a multiple of KEY_BLOCK too) gives the same logits at
    every step, bit for bit, so the same seeded samples and greedy tokens: rows narrowing at EOS, a rollout crossing
    several blocks."""
    _, ours = models
    module = importlib.import_module("model.generate")  # the module: `model.generate` is the function
    ids, mask = prompts()  # 9 positions: the rollout's steps see 10..49 of the cache's 64
    seeds = [3, 4, 5, 6]
    free = generate(ours, ids, mask, 40, pad_token_id=PAD, generator=_per_row(seeds)).completion_ids
    eos = [int(free[0, 5]), int(free[1, 20])]
    lengths = []  # per eager step that attends over less than the whole cache, how many positions
    prefix = KVCache.prefix
    monkeypatch.setattr(KVCache, "prefix", lambda cache, length: lengths.append(length) or prefix(cache, length))

    def run(key_block: int, kwargs: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits = []
        pick = module.pick_token
        monkeypatch.setattr(module, "KEY_BLOCK", key_block)
        monkeypatch.setattr(module, "pick_token", lambda step_logits, *rest: logits.append(step_logits.clone())
                            or pick(step_logits, *rest))
        out = generate(ours, ids, mask, 40, pad_token_id=PAD, **kwargs).completion_ids
        monkeypatch.setattr(module, "pick_token", pick)
        return out, logits

    sampled = lambda: dict(generator=_per_row(seeds), eos_token_id=eos)  # noqa: E731
    block = module.KEY_BLOCK
    for kwargs in (sampled, lambda: dict(do_sample=False)):
        lengths.clear()
        filled, filled_logits = run(block, kwargs())
        assert lengths == [-(-n // block) * block for n in range(10, 10 + len(lengths))]
        assert len(lengths) == 39 and lengths[-1] == 48 and len(filled_logits) == 40  # prefill + 39 steps
        whole, whole_logits = run(64, kwargs())
        assert len(lengths) == 39, "attending over the whole cache takes no view"
        assert torch.equal(filled, whole) and len(whole_logits) == 40
        assert all(torch.equal(a, b) for a, b in zip(filled_logits, whole_logits))
    assert (filled[1:] != PAD).any()


def test_the_lm_head_form_follows_the_use_and_the_rows(models):
    """On a CPU, up to 8 rows, greedy reads its argmax off the weight-stationary (W @ h.T).T, a transposed view (the
    argmax of F.linear's logits); sampling at this width, and greedy with more rows, get F.linear's logits bit for
    bit (a sampled token's logits must not change)."""
    _, ours = models
    hidden = torch.randn(9, ours.config.hidden_size, generator=torch.Generator().manual_seed(0))
    linear = torch.nn.functional.linear(hidden, ours.lm_head.weight)
    greedy = next_token_logits(ours, hidden[:8], greedy=True)
    assert not greedy.is_contiguous() and torch.equal(greedy.argmax(dim=-1), linear[:8].argmax(dim=-1))
    assert torch.allclose(greedy, linear[:8], atol=1e-5)
    assert torch.equal(next_token_logits(ours, hidden[:8]), linear[:8])
    assert torch.equal(next_token_logits(ours, hidden, greedy=True), linear)


def test_stopped_rows_leave_in_power_of_two_widths_and_the_rest_sample_as_alone(models, monkeypatch):
    """Six rows, three stopping early: the batch narrows to 4 (one stopped row decoding on, its tokens never kept),
    then 2, 1; every row's tokens are the ones it samples alone."""
    _, ours = models
    ids, mask = prompts(lengths=(9, 4, 6, 1, 7, 3))
    seeds = [5, 6, 7, 8, 9, 10]
    free = generate(ours, ids, mask, 16, pad_token_id=PAD, generator=_per_row(seeds)).completion_ids
    eos = [int(free[0, 1]), int(free[2, 2]), int(free[4, 3])]
    widths = []
    select_rows = KVCache.select_rows
    monkeypatch.setattr(KVCache, "select_rows", lambda cache, index: widths.append(len(index))
                        or select_rows(cache, index))
    together = generate(ours, ids, mask, 16, pad_token_id=PAD, eos_token_id=eos, generator=_per_row(seeds))
    assert widths and all(w & (w - 1) == 0 for w in widths) and widths == sorted(widths, reverse=True), widths
    for r in range(6):
        alone = generate(ours, ids[r:r + 1], mask[r:r + 1], 16, pad_token_id=PAD, eos_token_id=eos,
                         generator=_per_row(seeds[r:r + 1])).completion_ids[0]
        width = together.completion_ids.shape[1]
        assert torch.equal(together.completion_ids[r], torch.nn.functional.pad(alone, (0, width - len(alone)),
                                                                                value=PAD)), r


def test_the_compiled_decode_step_samples_the_eager_steps_tokens(models, monkeypatch):
    """torch.compile (inductor) of the decode step, as --decode compiled runs it: per-row seeded samples with rows
    leaving at EOS, greedy, then a rollout of other prompt lengths: the eager step's tokens exactly; that last
    rollout compiles nothing new (one graph serves every step and rollout of a width); and every call writes the
    cache at the same addresses, marked static -- what lets a CUDA graph replay the step instead of skipping it."""
    _, ours = models
    torch._dynamo.reset()  # a fresh compile cache: no graph another test left
    from torch._dynamo.utils import counters
    decoder = Decoder(compiled=True)
    calls = []  # per compiled call: (width, the addresses it writes, whether each is marked static)
    step = decoder.compiled_step
    monkeypatch.setattr(decoder, "compiled_step", lambda model, state, cache, sampling, speculative: calls.append(
        (len(state.rows), tuple(t.data_ptr() for t in [cache.keys[0], *state.tensors()]),
         all(hasattr(t, "_dynamo_static_input_type") for t in [cache.keys[0], *state.tensors()])))
        or step(model, state, cache, sampling, speculative))
    ids, mask = prompts()
    seeds = [11, 22, 33, 44]
    free = generate(ours, ids, mask, 16, pad_token_id=PAD, generator=_per_row(seeds), top_k=4).completion_ids
    eos = [int(free[0, 2]), int(free[1, 3])]  # rows 0 and 1 stop by step 3: widths 4 then 2
    # top_k 4: a real draw, with 4 CDF boundaries for a rounding difference to flip instead of 1,000 (how often
    # that happens is not what this test is about; bench_model.py prints the share of identical tokens)
    sampled = lambda: dict(generator=_per_row(seeds), eos_token_id=eos, top_k=4)  # noqa: E731
    for kwargs in (sampled, lambda: dict(do_sample=False)):
        eager = generate(ours, ids, mask, 16, pad_token_id=PAD, **kwargs()).completion_ids
        compiled = generate(ours, ids, mask, 16, pad_token_id=PAD, decoder=decoder, **kwargs()).completion_ids
        assert torch.equal(compiled, eager)
    graphs = counters["stats"]["unique_graphs"]
    other_ids, other_mask = prompts(lengths=(3, 7, 2, 5), seed=1)
    eager = generate(ours, other_ids, other_mask, 12, pad_token_id=PAD, generator=_per_row(seeds),
                     top_k=4).completion_ids
    compiled = generate(ours, other_ids, other_mask, 12, pad_token_id=PAD, generator=_per_row(seeds), top_k=4,
                        decoder=decoder).completion_ids
    assert torch.equal(compiled, eager)
    assert counters["stats"]["unique_graphs"] == graphs, "a new rollout of a compiled width compiled again"
    assert {w for w, _, _ in calls} == {4, 2} and all(marked for _, _, marked in calls)
    assert len({addresses for _, addresses, _ in calls}) == 1, "the cache or the state moved: a CUDA graph records again"


def test_the_compiled_decoders_cache_for_qwen3_0_6b_is_what_the_docs_say():
    """The storage --decode compiled keeps allocated between rollouts, from the real shapes on the meta device:
    Qwen3-0.6B (28 layers, 8 KV heads of 128) at 8 rows x 1,536 positions in bf16 is 1.31 GiB."""
    from model import Qwen3Config
    tiny = Qwen3Config.from_json(os.path.join(ROOT, "model", "configs", "qwen3-tiny.json")).to_hf_dict()
    config = Qwen3Config.from_dict({**tiny, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                                    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128})
    cache = Decoder(compiled=True).cache(config, 8, 1536, torch.bfloat16, torch.device("meta"))
    total = sum(buffer.nbytes for buffer in cache.keys + cache.values)
    assert total == 28 * 8 * 8 * 1536 * 128 * 2 * 2  # layers x rows x KV heads x length x head_dim x (K, V) x bytes
    assert f"{total / 2**30:.2f} GiB" == "1.31 GiB"


def test_a_lora_models_low_precision_twin_pairs_its_modules_by_name(models):
    """A LoRA layer's adapters and dropout are modules of their own, so pairing the twin's modules with the model's
    by position in modules() shifts every pair after the first LoRA layer: the twin pairs them by qualified name,
    holds bf16 copies of the base weights, keeps the adapters (the model's own parameters) and computes what the LoRA
    model computes under autocast."""
    model = copy.deepcopy(models[1])
    add_lora(model, rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model):
            for b in layer.lora_B.values():
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    twin = low_precision_twin(model, torch.bfloat16)
    pairs = linear_pairs(twin, model)
    assert len(pairs) == 4 * 2 + 1  # qkv, o, gate/up, down per layer, and the head
    assert all(torch.equal(a.weight, b.weight.to(torch.bfloat16)) for a, b in pairs)
    assert twin.model.layers[1].self_attn.q_norm.weight is model.model.layers[1].self_attn.q_norm.weight
    ids, mask = prompts()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(twin(ids, mask).logits, model(ids, mask).logits)
