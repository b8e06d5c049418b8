# python -m pytest tests/test_cuda.py        (the CPU cases; python -m pytest -m cuda tests/test_cuda.py on a GPU)
"""The CUDA paths of the product, each test run on CUDA (marked `cuda`: `python -m pytest -m cuda`; skipped without
a CUDA device) and on the CPU, in the normal tier, with the CPU's twin of each CUDA mechanism -- CPU autocast in
bf16, fp16 with torch.amp.GradScaler("cpu"), torch.compile through inductor's C++ kernels -- so that a test's logic
runs in every CI run and cannot rot while no GPU runs it: bf16 autocast numerics, the KV cache in the autocast dtype,
the compiled decode step computing the eager tokens (on CUDA replayed as CUDA graphs, which only CUDA can show),
each loop training in bf16 and in fp16 with a GradScaler (tests/test_cpu_recipe.py, its `device` parameter).
`benchmarks/bench_gpu.py` exercises the rest (compile, gradient checkpointing, throughput) in one command."""
import importlib

import pytest
import torch

from model import Decoder, Qwen3Config, create_model, generate

# `import model.generate as ...` would give the function model/__init__.py exports under the module's name
generate_module = importlib.import_module("model.generate")


@pytest.fixture(params=[pytest.param("cuda", marks=pytest.mark.cuda), "cpu"])
def device(request) -> str:
    return request.param


@pytest.fixture
def tiny_model(tiny_config_path, device):
    return create_model(Qwen3Config.from_json(tiny_config_path), seed=0, device=device)


def test_bf16_autocast_log_probs_stay_close_to_fp32(tiny_model, device, one_thread):
    ids = torch.randint(0, 151669, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        fp32 = tiny_model(ids).logits.float().log_softmax(-1)
        with torch.autocast(device, dtype=torch.bfloat16):
            bf16 = tiny_model(ids).logits.float().log_softmax(-1)
    # bf16 keeps 8 mantissa bits: log-probs of ~12 nats move by a few hundredths on random weights
    assert (fp32 - bf16).abs().max().item() < 0.1


def test_generate_keeps_its_cache_in_the_autocast_dtype(tiny_model, device, monkeypatch, one_thread):
    """The cache is built by Decoder.cache, through model/generate.py's own KVCache name: a recording stand-in there
    sees every cache a rollout makes."""
    dtypes = []
    original = generate_module.KVCache

    def recording(config, batch_size, max_length, dtype, device):
        dtypes.append(dtype)
        return original(config, batch_size, max_length, dtype, device)

    monkeypatch.setattr(generate_module, "KVCache", recording)
    ids = torch.randint(0, 151669, (2, 8)).to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        out = generate(tiny_model, ids, None, 4, do_sample=False)
    assert dtypes == [torch.bfloat16] and out.completion_ids.shape == (2, 4)


def test_the_compiled_decode_step_replays_cuda_graphs_and_samples_the_eager_tokens(tiny_model, device, one_thread):
    """--decode compiled's step (torch.compile "reduce-overhead"): fp32 greedy and per-row seeded top-4 samples with
    rows stopping at EOS (the width narrows) equal the eager step's tokens, over two rollouts; on CUDA inductor
    skipped no CUDA graph (a mutated cache that is not static would make it skip, with the reason in its log; on a
    CPU there are none to replay); then a bf16 autocast rollout runs through it too."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    skips = counters["inductor"]["cudagraph_skips"]
    ids = torch.randint(0, 151669, (4, 12), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    decoder = Decoder(compiled=True)
    free = generate(tiny_model, ids, mask, 24, generator=[torch.Generator(device).manual_seed(s) for s in range(4)],
                    top_k=4)
    eos = [int(free.completion_ids[0, 3]), int(free.completion_ids[1, 5])]

    def both(**kwargs):
        def rollout(step_decoder):
            generators = [torch.Generator(device).manual_seed(s) for s in range(4)]
            return generate(tiny_model, ids, mask, 24, generator=generators, decoder=step_decoder,
                            **kwargs).completion_ids
        return rollout(None), rollout(decoder)
    # top_k 4: 4 CDF boundaries for a rounding difference of the fused kernels to flip a draw at, not 151,669
    for kwargs in (dict(do_sample=False), dict(eos_token_id=eos, top_k=4), dict(eos_token_id=eos, top_k=4)):
        eager, compiled = both(**kwargs)
        assert torch.equal(compiled, eager), kwargs
    if device == "cuda":
        assert counters["inductor"]["cudagraph_skips"] == skips, "inductor ran the decode step without CUDA graphs"
    with torch.autocast(device, dtype=torch.bfloat16):
        out = generate(tiny_model, ids, mask, 8, do_sample=False, decoder=decoder)
    assert out.completion_ids.shape == (4, 8)
