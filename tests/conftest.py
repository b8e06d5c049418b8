"""Shared pytest fixtures.  Run everything with:  python -m pytest"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import json  # noqa: E402

import pytest  # noqa: E402

TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is as fast, and OpenMP's spin-waiting makes 2 threads up to 100x slower
    when other processes compete for the cores (seen on a loaded 2-core box). Restored after the module."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_config_path(tmp_path):
    """A tiny Qwen3 config with the real 151,936-row vocabulary (hidden 64, 2 layers)."""
    path = tmp_path / "tiny_config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return str(path)


def write_chat_jsonl(path, num_rows: int, seed: int = 0) -> str:
    """Chat rows whose completions have very different lengths (2 to ~60 words), so that a mean per micro-batch
    and the exact token-weighted mean over a window differ a lot."""
    import random
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(num_rows):
            words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "seven", "plus"])
                             for _ in range(rng.choice([1, 2, 40, 60])))
            row = {"messages": [{"role": "user", "content": f"Question {i}: say something."},
                                {"role": "assistant", "content": f"{words} \\boxed{{{i}}}"}]}
            f.write(json.dumps(row) + "\n")
    return str(path)


@pytest.fixture
def chat_jsonl(tmp_path):
    return write_chat_jsonl(tmp_path / "chat.jsonl", 20)
