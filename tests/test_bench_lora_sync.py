# python -m pytest tests/test_bench_lora_sync.py
"""benchmarks/bench_lora_sync.py's arithmetic, without vLLM: the bytes per sync it predicts from the shapes are the
bytes the two syncs write (the merged weights as WeightSync writes them, PEFT's adapter folder), tied and untied;
Qwen3-8B's figures; the paired ratio; the rollout size where the two options cost the same; the --max-lora-rank it
asks vLLM for."""
import json
import struct

import pytest
import torch

from support import TINY_CONFIG
from benchmarks.bench_lora_sync import (QWEN3_8B, adapter_sync_bytes, break_even_tokens, merged_sync_bytes,
                                        paired_ratio, served_lora_rank)
from model import Qwen3Config, create_model
from model.checkpoint_io import hf_weights, write_safetensors
from model.lora import TARGETS, add_lora, save_peft_adapter


def data_bytes(path) -> int:
    """A safetensors file's size less its header (the u64 length and the JSON)."""
    with open(path, "rb") as f:
        header = struct.unpack("<Q", f.read(8))[0]
        f.seek(0, 2)
        return f.tell() - 8 - header


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_predicted_bytes_are_what_the_two_syncs_write(tmp_path, tied, dtype):
    config = {**TINY_CONFIG, "tie_word_embeddings": tied}
    model = create_model(Qwen3Config.from_dict(config), seed=0)
    add_lora(model, rank=4, alpha=8.0, targets=TARGETS)
    with open(tmp_path / "model.safetensors", "wb") as f:  # what WeightSync.push writes
        write_safetensors(f, hf_weights(model), dtype)
    assert data_bytes(tmp_path / "model.safetensors") == merged_sync_bytes(config, dtype.itemsize)
    save_peft_adapter(model, str(tmp_path / "adapter"), None)
    assert data_bytes(tmp_path / "adapter" / "adapter_model.safetensors") == adapter_sync_bytes(config, 4)


def test_fewer_targets_fewer_adapter_bytes(tmp_path):
    model = create_model(Qwen3Config.from_dict(TINY_CONFIG), seed=0)
    targets = ("q_proj", "v_proj", "down_proj")
    add_lora(model, rank=8, alpha=16.0, targets=targets)
    save_peft_adapter(model, str(tmp_path / "adapter"), None)
    assert data_bytes(tmp_path / "adapter" / "adapter_model.safetensors") == adapter_sync_bytes(TINY_CONFIG, 8,
                                                                                                targets)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 8


def test_qwen3_8b_at_rank_16():
    # 8,190,735,360 parameters: Qwen3-8B's model card says 8.2B, 6.95B of them not embeddings
    assert merged_sync_bytes(QWEN3_8B, 1) == 8_190_735_360
    assert merged_sync_bytes(QWEN3_8B, 1) - 2 * 151936 * 4096 == 6_946_075_648
    # per layer: A 16 x (6 x 4096 + 12288), B (4096 + 2 x 1024 + 4096 + 2 x 12288 + 4096) x 16, in fp32
    assert adapter_sync_bytes(QWEN3_8B, 16) == 36 * 16 * (6 * 4096 + 12288 + 38912) * 4 == 174_587_904
    assert merged_sync_bytes(QWEN3_8B, 2) // adapter_sync_bytes(QWEN3_8B, 16) == 93


def test_paired_ratio_and_the_rank_vllm_is_asked_for():
    assert paired_ratio([2.0, 9.0, 3.0], [1.0, 3.0, 1.0]) == 3.0  # the median of 2, 3, 3: each round its own pair
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])
    assert [served_lora_rank(r) for r in (1, 4, 16, 17, 300)] == [1, 8, 16, 32, 320]


def test_the_break_even_rollout_size():
    def cost(sync_s: float, tokens_per_s: float, tokens: int) -> float:  # one sync and its rollouts
        return sync_s + tokens / tokens_per_s

    # merged: 1.5 s per sync, 400 tokens/s; adapter: 0.5 s, 80 tokens/s -> 1 s saved, 1/80 - 1/400 = 0.01 s/token
    merged, adapter = (1.5, 400.0), (0.5, 80.0)
    assert break_even_tokens(merged, adapter) == pytest.approx(100.0)
    assert cost(*adapter, 100) == pytest.approx(cost(*merged, 100))
    assert cost(*adapter, 50) < cost(*merged, 50) and cost(*adapter, 200) > cost(*merged, 200)
    assert break_even_tokens((1.5, 400.0), (0.5, 500.0)) is None   # the adapter cheaper at both: at any size
    assert break_even_tokens((0.5, 400.0), (1.5, 80.0)) is None    # the merged one cheaper at both
    assert break_even_tokens((1.0, 400.0), (1.0, 80.0)) is None    # the same sync: the faster sampler wins
