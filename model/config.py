"""Qwen3Config: the fields of an HF `config.json` our model implements, in both layouts found in the wild.

transformers-4 (the published Qwen3-0.6B / 4B configs): top-level `rope_theta`, `rope_scaling: null`, `torch_dtype`.
transformers-5: `rope_parameters: {rope_theta, rope_type}`, `dtype`.
Anything we do not implement (rope scaling, sliding window, attention bias, another activation) is refused with a
message that names the field, instead of silently computing something else.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass
class Qwen3Config:
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    bos_token_id: int = 151643
    eos_token_id: int = 151645
    torch_dtype: str = "bfloat16"

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "Qwen3Config":
        _refuse_unsupported(d, source)
        values = {k: d[k] for k in cls.__dataclass_fields__ if k in d and d[k] is not None}
        rope_parameters = d.get("rope_parameters")
        if rope_parameters and "rope_theta" in rope_parameters:
            values["rope_theta"] = rope_parameters["rope_theta"]
        if "dtype" in d and d["dtype"] is not None:
            values["torch_dtype"] = d["dtype"]
        if "head_dim" not in d or d["head_dim"] is None:
            values["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if isinstance(values.get("eos_token_id"), list):
            values["eos_token_id"] = values["eos_token_id"][0]
        return cls(**values)

    @classmethod
    def from_json(cls, path: str) -> "Qwen3Config":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f), source=path)

    def to_hf_dict(self) -> dict:
        """The transformers-4 layout of the published Qwen3 configs (transformers 5 reads it as well)."""
        d = asdict(self)
        d.pop("initializer_range")
        d.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                 attention_bias=False, attention_dropout=0.0, rope_scaling=None, use_cache=True,
                 use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers,
                 initializer_range=self.initializer_range)
        return d


def _refuse_unsupported(d: dict, source: str) -> None:
    def refuse(field: str, why: str):
        raise ValueError(f"{source}: {field}={d.get(field)!r} is not supported ({why})")

    if d.get("model_type", "qwen3") != "qwen3":
        refuse("model_type", "only qwen3 is implemented")
    if d.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "Qwen3 uses silu (SwiGLU)")
    if d.get("attention_bias", False):
        refuse("attention_bias", "Qwen3 projections have no bias")
    if d.get("use_sliding_window", False):
        refuse("use_sliding_window", "sliding-window attention is not implemented")
    rope_scaling = d.get("rope_scaling")
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default"):
        refuse("rope_scaling", "only plain RoPE is implemented")
    rope_parameters = d.get("rope_parameters")
    if rope_parameters and rope_parameters.get("rope_type", "default") != "default":
        refuse("rope_parameters", "only plain RoPE (rope_type 'default') is implemented")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if field not in d:
            raise ValueError(f"{source}: required field {field} is missing")
    if "rope_theta" not in d and not (rope_parameters and "rope_theta" in rope_parameters):
        raise ValueError(f"{source}: neither rope_theta nor rope_parameters.rope_theta is given")
