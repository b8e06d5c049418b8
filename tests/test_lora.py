# python -m pytest tests/test_lora.py
"""model/lora.py: LoRA adapters on the tiny Qwen3 -- a fresh adapter changes nothing, the base alone comes back with
the adapters switched off, only the adapters train, the merged model computes what the adapted one does -- and
against references nobody here wrote: transformers loading the merged export, and PEFT loading the adapter (PEFT's
format and names) onto the transformers-loaded base, give the adapted model's logits (peft: a test dependency)."""
import json

import pytest
import torch
from safetensors.torch import save_file

from support import TINY_CONFIG
from model import Qwen3Config, create_model, save_pretrained
from model.lora import TARGETS, adapters_disabled, add_lora, lora_layers, merge, peft_config, peft_state


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
