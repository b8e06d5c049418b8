# python -m pytest tests/test_lora.py
"""model/lora.py: LoRA adapters on the tiny Qwen3 -- a fresh adapter changes nothing, the base alone comes back with
the adapters switched off, only the adapters train, the merged model computes what the adapted one does -- and
against references nobody here wrote: transformers loading the merged export, and PEFT loading the adapter (PEFT's
format and names) onto the transformers-loaded base, give the adapted model's logits (peft: a test dependency)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from support import TINY_CONFIG
from model import Qwen3Config, create_model, save_pretrained
from model.lora import (TARGETS, LoRALinear, adapters_disabled, add_lora, lora_layers, merge, peft_config,
                        peft_state)


def tiny(seed: int = 0):
    return create_model(Qwen3Config.from_dict(TINY_CONFIG), seed=seed).eval()


def ids() -> torch.Tensor:
    return torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))


def trained_adapters(model) -> None:
    """Adapters as training leaves them: B no longer zero."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(model):
            for b in layer.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.02)


def test_a_fresh_adapter_changes_nothing_and_only_the_adapters_train():
    base, model = tiny(), tiny()
    params = add_lora(model, rank=4, alpha=8.0)
    with torch.no_grad():
        assert torch.equal(model(ids()).logits, base(ids()).logits)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in name for name in trainable) and len(params) == len(trainable)
    per_layer = 2 * len(TARGETS)  # an A and a B per HF projection, also inside the fused qkv and gate/up GEMMs
    assert len(trainable) == per_layer * TINY_CONFIG["num_hidden_layers"]
    assert "model.layers.0.self_attn.qkv_proj.weight" in dict(model.named_parameters())  # the base keeps its names


def test_switched_off_the_adapters_leave_the_base_and_merged_they_compute_the_same():
    base, model = tiny(), tiny()
    add_lora(model, rank=4, alpha=8.0, targets=("q_proj", "v_proj", "up_proj", "down_proj"))
    trained_adapters(model)
    with torch.no_grad():
        adapted = model(ids()).logits
        assert not torch.equal(adapted, base(ids()).logits)
        with adapters_disabled(model):
            assert torch.equal(model(ids()).logits, base(ids()).logits)
        merge(model)
        assert not lora_layers(model)
        torch.testing.assert_close(model(ids()).logits, adapted, rtol=1e-5, atol=1e-5)


def test_adapters_disabled_nests_and_restores_what_it_found():
    model = tiny()
    add_lora(model, rank=4, alpha=8.0)
    layers = lora_layers(model)
    with adapters_disabled(model):
        with adapters_disabled(model):
            pass
        assert not any(layer.enabled for layer in layers)  # the outer block still runs the base
    assert all(layer.enabled for layer in layers)
    layers[0].enabled = False  # switched off before the block: left off after it
    with adapters_disabled(model):
        pass
    assert [layer.enabled for layer in layers] == [False] + [True] * (len(layers) - 1)


def test_each_adapted_projection_draws_its_own_dropout_mask():
    """PEFT's q_proj, k_proj and v_proj each apply their own dropout to x before their lora_A: the adapters of a
    fused qkv_proj each draw their own mask too. With a zero base and A = B = I (scaling 1), each block's output is
    dropout(x) itself: x = 1 shows its mask, kept entries 1 / (1 - p) = 2."""
    base = torch.nn.Linear(4, 12, bias=False)
    torch.nn.init.zeros_(base.weight)
    names = ["q_proj", "k_proj", "v_proj"]
    layer = LoRALinear(base, [(name, 4) for name in names], names, rank=4, alpha=4.0, dropout=0.5)
    with torch.no_grad():
        for name in names:
            layer.lora_A[name].copy_(torch.eye(4))
            layer.lora_B[name].copy_(torch.eye(4))
        torch.manual_seed(0)
        q, k, v = layer(torch.ones(64, 4)).split(4, dim=-1)
    assert all(set(block.unique().tolist()) == {0.0, 2.0} for block in (q, k, v))
    assert not torch.equal(q, k) and not torch.equal(k, v) and not torch.equal(q, v)


def test_merge_is_the_exports_fp32_merge(tmp_path):
    """A bf16 base plus an fp32 delta is not a bf16 number: `merge` folds the adapters as the HF export writes them,
    in fp32, bit for bit (one merge)."""
    model = tiny().to(torch.bfloat16)
    add_lora(model, rank=4, alpha=8.0)
    trained_adapters(model)
    save_pretrained(model, str(tmp_path))
    exported = load_file(str(tmp_path / "model.safetensors"))
    merge(model)
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}"
        for fused, hf_names in ((layer.self_attn.qkv_proj, ["q_proj", "k_proj", "v_proj"]),
                                (layer.self_attn.o_proj, ["o_proj"]),
                                (layer.mlp.gate_up_proj, ["gate_proj", "up_proj"]),
                                (layer.mlp.down_proj, ["down_proj"])):
            part = "self_attn" if hf_names[0] in ("q_proj", "o_proj") else "mlp"
            hf = torch.cat([exported[f"{prefix}.{part}.{name}.weight"] for name in hf_names])
            assert fused.weight.dtype == torch.float32 and torch.equal(fused.weight, hf)


def test_transformers_and_peft_compute_what_the_adapted_model_computes(tmp_path):
    peft = pytest.importorskip("peft", reason="peft is a test dependency: python -m pip install -r requirements.txt")
    import transformers
    base_dir, adapter_dir, merged_dir = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    model = tiny()
    save_pretrained(model, str(base_dir))
    add_lora(model, rank=4, alpha=8.0)
    trained_adapters(model)
    with torch.no_grad():
        adapted = model(ids()).logits
    adapter_dir.mkdir()
    (adapter_dir / "adapter_config.json").write_text(json.dumps(peft_config(model, str(base_dir))))
    save_file(peft_state(model), str(adapter_dir / "adapter_model.safetensors"))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf_base, str(adapter_dir)).eval()(ids()).logits
    torch.testing.assert_close(theirs, adapted, rtol=1e-5, atol=1e-5)
    merge(model)
    save_pretrained(model, str(merged_dir))
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf_merged(ids()).logits, adapted, rtol=1e-5, atol=1e-5)


def test_unknown_targets_are_refused():
    with pytest.raises(ValueError, match="LoRA targets"):
        add_lora(tiny(), targets=("qkv_proj",))
