"""The critic of PPO: Qwen3's body with a scalar head, V(s_t) at every position from the final hidden state.

It is a Qwen3ForCausalLM whose head has one row (and is never tied to the embedding), so everything that runs a
Qwen3ForCausalLM -- the sharding, LoRA adapters, the chunked forward to hidden states -- runs it unchanged. Exported
as transformers' Qwen3ForTokenClassification with one label and no bias (`score.weight`, the head): transformers
loads it whole (tests/test_value_model.py compares its per-token values with ours).
"""
from __future__ import annotations

import os
from dataclasses import replace

import torch
from torch import nn

from model.config import FIX, Qwen3Config, read_json
from model.qwen3 import Qwen3ForCausalLM, Qwen3Model


class Qwen3ValueModel(Qwen3ForCausalLM):
    HF_HEAD = "score.weight"  # transformers' token-classification head
    TRAINED_WHOLE = ("lm_head",)  # a LoRA critic's head is new: trained whole beside the adapters

    def __init__(self, config: Qwen3Config):
        nn.Module.__init__(self)
        self.config = replace(config, tie_word_embeddings=False)
        self.model = Qwen3Model(self.config)
        self.lm_head = nn.Linear(config.hidden_size, 1, bias=False)  # the value head
        self.gradient_checkpointing = False
        self.pack_rows = False

    def init_weights(self, seed: int | None = None) -> None:
        """The body drawn as a causal LM's, the head zero: V = 0 everywhere (and a one-row head sharded over more
        ranks than it has rows takes no copy of a whole tensor). A random student's critic copies the student's
        body instead (a tied student's embedding is its head's draw: trainer/rl/critic.py)."""
        self.draw_weights(self.model.modules(), seed)
        with torch.no_grad():
            self.lm_head.weight.zero_()

    def hf_config(self) -> dict:
        """config.json of the export: Qwen3's, as transformers' Qwen3ForTokenClassification with one label."""
        return {**self.config.to_hf_dict(), "architectures": ["Qwen3ForTokenClassification"], "num_labels": 1,
                "token_classification_bias": False, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}


def is_value_export(path: str) -> bool:
    """`path`'s config.json says transformers' Qwen3ForTokenClassification: a critic's export (its head
    `score.weight`), not a causal LM."""
    config = read_json(os.path.join(path, "config.json"), FIX)
    return "Qwen3ForTokenClassification" in (config.get("architectures") or [])
