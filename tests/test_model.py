# Run: python -m pytest tests/test_model.py
"""Our Qwen3 against transformers' Qwen3ForCausalLM, on tiny random checkpoints written by transformers itself.

Covers both config layouts (transformers 5 `rope_parameters`, transformers 4 top-level `rope_theta`), tied and
untied embeddings, 2 and 4 query heads per KV head, sharded checkpoints, a tied file that also carries
`lm_head.weight`, left padding, hidden-state output, save/load round trips through transformers, strict key and
config checking, bf16 loading, gradient checkpointing and torch.compile.
"""
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from model import Qwen3Config, create_model, load_pretrained, save_pretrained
from model.qwen3 import positions_from_mask

VOCAB = 1000
TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")


def hf_tiny_checkpoint(path, tie=True, groups=2, layout="v5", sharded=False, lm_head_in_file=False,
                       vocab_size=VOCAB, seed=0):
    """Save a random transformers Qwen3 to `path` and return it (fp32, eval mode).

    Weights are drawn by us (std 0.1, norm weights around 1) rather than by HF's init: the larger scale makes the
    logits far from uniform, so a wrong head layout, RoPE or norm shows up as a large difference.
    """
    num_kv = 2
    cfg = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=num_kv * groups, num_key_value_heads=num_kv, head_dim=16,  # 8 heads x 16 != 64 hidden
        max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,  # not our default: must be read
        tie_word_embeddings=tie, bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path, max_shard_size="20KB" if sharded else "50GB")
    if sharded:
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
        assert not os.path.isfile(os.path.join(path, "model.safetensors"))
    if layout == "v4":
        rewrite_config_v4(path)
    if lm_head_in_file:
        assert tie and not sharded
        file = os.path.join(path, "model.safetensors")
        tensors = load_file(file)
        assert "lm_head.weight" not in tensors
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        save_file(tensors, file, metadata={"format": "pt"})
    return model


def rewrite_config_v4(path):
    """Turn transformers 5's config.json into the transformers-4 layout of the published Qwen3 configs."""
    file = os.path.join(path, "config.json")
    with open(file) as f:
        d = json.load(f)
    rope = d.pop("rope_parameters")
    d.pop("dtype", None)
    d.update(rope_theta=rope["rope_theta"], rope_scaling=None, torch_dtype="float32")
    with open(file, "w") as f:
        json.dump(d, f, indent=2)


def left_padded_batch(lengths, total, vocab=VOCAB, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(lengths), total), generator=gen)
    mask = torch.zeros(len(lengths), total, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, total - n:] = 1
        ids[row, :total - n] = 0  # pad id: must not matter
    return ids, mask


def hf_logits(hf_model, ids, mask):
    # HF's plain forward (unlike its generate) does not derive positions from the mask: without position_ids a
    # left-padded row would start its RoPE at the number of pads. Pass the positions our model derives.
    with torch.no_grad():
        return hf_model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask)).logits


CASES = {  # name: (tie, groups, layout, sharded, lm_head_in_file)
    "tied-g2-v5": (True, 2, "v5", False, False),
    "untied-g4-v4": (False, 4, "v4", False, False),
    "tied-g4-v5-sharded": (True, 4, "v5", True, False),
    "untied-g2-v4-sharded": (False, 2, "v4", True, False),
    "tied-g2-v4-lm_head_in_file": (True, 2, "v4", False, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_left_padded(tmp_path, case):
    tie, groups, layout, sharded, lm_head_in_file = CASES[case]
    hf = hf_tiny_checkpoint(tmp_path, tie, groups, layout, sharded, lm_head_in_file)
    ours = load_pretrained(str(tmp_path)).eval()
    assert ours.config.rope_theta == 10000.0 and ours.config.tie_word_embeddings == tie
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tie

    lengths = [12, 7, 1, 12]
    ids, mask = left_padded_batch(lengths, 12)
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask).logits
        ref = hf_logits(hf, ids, mask)
        real = mask.bool()
        assert torch.isfinite(logits).all()
        assert (logits[real] - ref[real]).abs().max() < TOL
        # a padded row equals the row alone (no mask, no padding)
        for row, n in enumerate(lengths):
            alone = ours(ids[row:row + 1, 12 - n:]).logits[0]
            assert (logits[row, 12 - n:] - alone).abs().max() < TOL
        # unpadded, no mask: the plain causal path
        full = ours(ids[:1]).logits
        assert (full - hf(input_ids=ids[:1]).logits).abs().max() < TOL


def test_hidden_states_and_logits_to_keep(tmp_path):
    hf_tiny_checkpoint(tmp_path, tie=False)
    ours = load_pretrained(str(tmp_path)).eval()
    ids, mask = left_padded_batch([10, 6], 10)
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask).logits
        out = ours(ids, attention_mask=mask, return_hidden=True)
        assert out.logits is None and out.hidden_states.shape == (2, 10, 64)
        assert torch.allclose(ours.lm_head(out.hidden_states), logits, atol=1e-6)
        for k in (1, 3):
            kept = ours(ids, attention_mask=mask, logits_to_keep=k).logits
            assert kept.shape == (2, k, VOCAB)
            assert torch.allclose(kept, logits[:, -k:], atol=1e-6)


@pytest.mark.parametrize("tie,vocab", [(True, 151936), (False, VOCAB)])  # one case at Qwen3's real vocabulary
def test_save_pretrained_loads_in_transformers(tmp_path, tie, vocab):
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1,
                         rope_theta=10000.0, tie_word_embeddings=tie)
    ours = create_model(config, seed=1).eval()
    out = tmp_path / "export"
    save_pretrained(ours, str(out))
    names = set(os.listdir(out))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names, names
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert hf.config.tie_word_embeddings == tie
    if tie:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    ids, mask = left_padded_batch([9, 4], 9, vocab=vocab)
    with torch.no_grad():
        logits = ours(ids, attention_mask=mask).logits
    ref = hf_logits(hf, ids, mask)
    assert (logits[mask.bool()] - ref[mask.bool()]).abs().max() < TOL
    # and our own loader reads our own output back exactly
    again = load_pretrained(str(out)).eval()
    with torch.no_grad():
        assert torch.equal(again(ids, attention_mask=mask).logits, logits)


@pytest.mark.parametrize("tie", [True, False])
def test_our_export_is_hf_layout_and_loads_as_the_folder_transformers_writes(tmp_path, tie):
    """Our fused q/k/v and gate/up are written as HF's tensors: our export holds exactly the keys and shapes of the
    folder transformers writes of the same model (q_proj, k_proj, v_proj, gate_proj, up_proj apart), tensor for
    tensor equal; load_pretrained of either gives our weights bit for bit, each fused parameter the concatenation
    of transformers' q, k, v (gate, up) in that order."""
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, initializer_range=0.1,
                         tie_word_embeddings=tie)
    ours = create_model(config, seed=3)
    save_pretrained(ours, str(tmp_path / "ours"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32)
    hf.save_pretrained(str(tmp_path / "theirs"))
    written, theirs = (load_file(tmp_path / name / "model.safetensors") for name in ("ours", "theirs"))
    if tie:
        theirs.pop("lm_head.weight", None)  # a tied copy, if an exporter writes one, is not a tensor of its own
    assert sorted(written) == sorted(theirs)
    assert written["model.layers.1.self_attn.k_proj.weight"].shape == (16, 64)
    assert written["model.layers.1.mlp.up_proj.weight"].shape == (96, 64)
    assert all(torch.equal(written[name], theirs[name]) for name in theirs)
    layer = hf.model.layers[1]
    for folder in ("ours", "theirs"):
        loaded = load_pretrained(str(tmp_path / folder))
        assert list(loaded.state_dict()) == list(ours.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), ours.state_dict().values()))
        fused = loaded.model.layers[1]
        assert torch.equal(fused.self_attn.qkv_proj.weight, torch.cat(
            [layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]))
        assert torch.equal(fused.mlp.gate_up_proj.weight,
                           torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight]))


def test_save_pretrained_atomic_overwrite(tmp_path, monkeypatch):
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    out = tmp_path / "ckpt"
    save_pretrained(create_model(config, seed=0), str(out))
    (out / "stale.txt").write_text("from an older save")
    second = create_model(config, seed=1)
    save_pretrained(second, str(out))
    assert not (out / "stale.txt").exists()  # the folder was replaced, not merged into
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary or .old folder left behind
    assert torch.equal(load_pretrained(str(out)).model.embed_tokens.weight, second.model.embed_tokens.weight)

    # a save that dies half way leaves the previous folder intact (and no temporary folder behind)
    import model.checkpoint_io as checkpoint_io

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_io, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(create_model(config, seed=2), str(out))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert torch.equal(load_pretrained(str(out)).model.embed_tokens.weight, second.model.embed_tokens.weight)


def _edit_tensors(path, edit):
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_missing_unexpected_and_misshaped_tensors_are_named(tmp_path):
    hf_tiny_checkpoint(tmp_path / "missing", tie=False)
    _edit_tensors(tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_pretrained(str(tmp_path / "missing"))

    hf_tiny_checkpoint(tmp_path / "unexpected", tie=False)
    _edit_tensors(tmp_path / "unexpected",
                  lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.0\.self_attn\.q_proj\.bias"):
        load_pretrained(str(tmp_path / "unexpected"))

    hf_tiny_checkpoint(tmp_path / "shape", tie=False)
    _edit_tensors(tmp_path / "shape", lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(65,\).*\(64,\)"):
        load_pretrained(str(tmp_path / "shape"))

    hf_tiny_checkpoint(tmp_path / "untied_no_head", tie=False)  # untied config needs lm_head.weight
    _edit_tensors(tmp_path / "untied_no_head", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"missing.*lm_head\.weight"):
        load_pretrained(str(tmp_path / "untied_no_head"))


@pytest.mark.parametrize("field,value", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
    ("use_sliding_window", True),
    ("attention_bias", True),
    ("hidden_act", "gelu"),
])
def test_unsupported_config_fields_are_refused(tmp_path, field, value):
    hf_tiny_checkpoint(tmp_path, layout="v4")
    with open(tmp_path / "config.json") as f:
        d = json.load(f)
    d[field] = value
    with open(tmp_path / "config.json", "w") as f:
        json.dump(d, f)
    with pytest.raises(ValueError, match=field):
        load_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match=field):
        Qwen3Config.from_dict(d)


def test_bf16_load(tmp_path):
    hf_tiny_checkpoint(tmp_path, tie=True)
    fp32 = load_pretrained(str(tmp_path))
    bf16 = load_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert bf16.model.rotary_emb.inv_freq.dtype == torch.float32  # RoPE frequencies stay fp32, as in HF
    for (name, a), (_, b) in zip(fp32.state_dict().items(), bf16.state_dict().items()):
        assert torch.equal(a.to(torch.bfloat16), b), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16).eval()
    ids, mask = left_padded_batch([8, 5], 8)
    with torch.no_grad():
        logits = bf16(ids, attention_mask=mask).logits
    assert logits.dtype == torch.bfloat16
    ref = hf_logits(hf, ids, mask)
    real = mask.bool()
    # same arithmetic in bf16 as HF's: close, though not bit-equal (reduction orders differ)
    assert (logits[real].float() - ref[real].float()).abs().max() < 0.1
    fp32_logits = fp32(ids, attention_mask=mask).logits.detach()
    assert (logits[real].float() - fp32_logits[real]).abs().max() < 0.25


def _loss_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(ids, attention_mask=mask).logits
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gradient_checkpointing_same_loss_and_grads():
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1)
    model = create_model(config, seed=0).train()
    ids, mask = left_padded_batch([16, 9, 3], 16)
    loss, grads = _loss_and_grads(model, ids, mask)
    model.gradient_checkpointing = True
    loss_ckpt, grads_ckpt = _loss_and_grads(model, ids, mask)
    assert torch.allclose(loss, loss_ckpt, atol=1e-6)
    assert grads.keys() == grads_ckpt.keys()
    for name in grads:
        assert torch.isfinite(grads[name]).all(), name  # left-padding rows must not leak NaN into the weights
        assert torch.allclose(grads[name], grads_ckpt[name], atol=1e-6), name


@pytest.mark.parametrize("backend", [
    # aot_eager traces forward and backward through dynamo + AOTAutograd (what can break in our code) in ~5 s;
    # inductor additionally generates C++ kernels, ~1 min on 2 CPU cores: only where there is a GPU or on request.
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(
        not (torch.cuda.is_available() or os.environ.get("RUN_SLOW")),
        reason="inductor compilation takes ~1 min on 2 CPU cores; set RUN_SLOW=1 to run it")),
])
def test_torch_compile_matches_eager(backend):
    torch._dynamo.reset()
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1)
    model = create_model(config, seed=0).train()
    ids, mask = left_padded_batch([12, 5], 12)
    loss, grads = _loss_and_grads(model, ids, mask)
    names = list(model.state_dict())
    model.compile_layers(backend=backend)  # what --use_compile 1 does
    assert list(model.state_dict()) == names  # checkpoints and exports keep their names
    loss_c, grads_c = _loss_and_grads(model, ids, mask)
    assert torch.allclose(loss, loss_c, atol=1e-5)
    for name in grads:
        assert torch.allclose(grads[name], grads_c[name], atol=1e-5), name
