"""The critic of PPO: Qwen3's body with a scalar head, V(s_t) at every position from the final hidden state.

It is a Qwen3ForCausalLM whose head has one row (and is never tied to the embedding), so everything that runs a
Qwen3ForCausalLM -- the sharding, LoRA adapters, the chunked forward to hidden states -- runs it unchanged. Exported
as transformers' Qwen3ForTokenClassification with one label and no bias (`score.weight`, the head): transformers
loads it whole (tests/test_value_model.py compares its per-token values with ours).
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from model.config import Qwen3Config
from model.qwen3 import Qwen3ForCausalLM, Qwen3Model

class Qwen3ValueModel(Qwen3ForCausalLM):
    HF_HEAD = "score.weight"  # transformers' token-classification head
    def __init__(self, config: Qwen3Config):
        nn.Module.__init__(self)
        self.config = replace(config, tie_word_embeddings=False)
        self.model = Qwen3Model(self.config)
        self.lm_head = nn.Linear(config.hidden_size, 1, bias=False)  # the value head
        self.gradient_checkpointing = False
        self.pack_rows = False

    def hf_config(self) -> dict:
        """config.json of the export: Qwen3's, as transformers' Qwen3ForTokenClassification with one label."""
        return {**self.config.to_hf_dict(), "architectures": ["Qwen3ForTokenClassification"], "num_labels": 1,
                "token_classification_bias": False, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}


def value_model_from(policy: Qwen3ForCausalLM) -> Qwen3ValueModel:
    """A critic whose body is a copy of `policy`'s and whose head is zero (V = 0 everywhere at the start: the
    critic's first targets are the returns themselves), in the policy's dtype and on its device."""
    weight = policy.lm_head.weight
    with torch.device("meta"):
        critic = Qwen3ValueModel(policy.config)
    critic.to_empty(device=weight.device)
    critic.to(weight.dtype)
    critic.model.load_state_dict(policy.model.state_dict())
    with torch.no_grad():
        critic.lm_head.weight.zero_()
    return critic
