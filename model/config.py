"""Qwen3Config: the fields of an HF `config.json` our model implements, in both layouts found in the wild.

transformers-4 (the published Qwen3-0.6B / 4B configs): top-level `rope_theta`, `rope_scaling: null`, `torch_dtype`.
transformers-5: `rope_parameters: {rope_theta, rope_type}`, `dtype`.
Anything we do not implement (rope scaling, sliding window, attention bias, another activation) is refused with a
message that names the field, instead of silently computing something else.

What `from_dict` / `from_json` do with a key that config.json leaves out (the point: a folder that
`transformers.AutoModelForCausalLM.from_pretrained` loads gives the same model here, never a silently different one):
- Required, refused with a `ConfigError` naming the field: hidden_size, intermediate_size, num_hidden_layers,
  num_attention_heads. transformers would fill in the sizes of a Qwen-7B-like model (4096, 22016, 32, 32) that no
  Qwen3 has, so a config without them is a mistake, and naming the field beats a tensor-shape error later.
- Defaulted exactly as transformers' Qwen3Config (4.51 and 5.x agree), see `TRANSFORMERS_DEFAULTS`: vocab_size
  151936, num_key_value_heads 32, head_dim 128 (not hidden_size / num_attention_heads), max_position_embeddings
  32768, rms_norm_eps 1e-6, rope_theta 10000.0, tie_word_embeddings False, initializer_range 0.02,
  bos_token_id / eos_token_id / torch_dtype None. The dataclass's own defaults (Qwen3-0.6B's published values, for
  configs built in Python) are never used for a config.json.
- num_key_value_heads omitted while 32 does not divide num_attention_heads: refused naming the field (transformers
  would build k/v projections no checkpoint of that model can have).
- null: accepted where transformers gives it a meaning (num_key_value_heads: = num_attention_heads; bos_token_id,
  eos_token_id, torch_dtype / dtype: none; rope_scaling / rope_parameters: plain RoPE), refused for any other field
  (transformers 5 refuses it too).
- rope_theta both top-level and in rope_parameters, with different values: refused (transformers 4 reads the first,
  transformers 5 the second).
- model_type omitted: read as qwen3 (this is a Qwen3 loader, like transformers' Qwen3Config.from_pretrained).
A file that is missing or not JSON is a `ModelFileError`; a bad field in a readable file is a `ConfigError`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from common.errors import UserError

REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# transformers' Qwen3Config.__init__ defaults, for keys a config.json omits (rope_theta: when rope_parameters has none)
TRANSFORMERS_DEFAULTS = {
    "vocab_size": 151936, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "initializer_range": 0.02,
    "bos_token_id": None, "eos_token_id": None, "torch_dtype": None,
}
# null means something in transformers for these (num_key_value_heads: = num_attention_heads); refused elsewhere
NULLABLE = ("bos_token_id", "eos_token_id", "torch_dtype", "num_key_value_heads")
# what each field must hold; the other fields are sizes (positive integers)
KINDS = {"rms_norm_eps": "float", "rope_theta": "float", "initializer_range": "float", "tie_word_embeddings": "bool",
         "bos_token_id": "token_id", "eos_token_id": "token_ids", "torch_dtype": "str", "dtype": "str"}
KIND_NAMES = {"size": "a positive integer", "float": "a positive number", "bool": "true or false",
              "token_id": "a token id (an integer >= 0)", "token_ids": "a token id or a list of token ids",
              "str": "a string"}
FIX = "correct config.json, or re-export / re-download the model"


class ModelFileError(UserError, ValueError):
    """A file of a model or tokenizer folder that is missing, damaged or does not match the rest: one line, exit 2."""


class ConfigError(ModelFileError):
    """A config field that is missing, malformed, or describes something we do not implement."""


def read_json(path: str, fix: str) -> dict:
    """The JSON object in `path`; otherwise a ModelFileError naming the file (and where the JSON breaks) and `fix`."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise ModelFileError(f"{path} does not exist: {fix}") from None
    except json.JSONDecodeError as error:
        raise ModelFileError(f"{path} is not valid JSON (line {error.lineno} column {error.colno}): {error.msg}; "
                             f"{fix}") from None
    except UnicodeDecodeError as error:
        raise ModelFileError(f"{path} is not UTF-8 text (byte {error.start}): {fix}") from None
    if not isinstance(value, dict):
        raise ModelFileError(f"{path} holds a JSON {type(value).__name__}, not an object: {fix}")
    return value


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
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151645
    torch_dtype: str | None = "bfloat16"

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "Qwen3Config":
        """A config.json's fields; omitted keys as transformers fills them (see the module docstring)."""
        _refuse_unsupported(d, source)
        values = {field: _value(d, field, source) for field in cls.__dataclass_fields__}
        values["rope_theta"] = _rope_theta(d, source)
        if d.get("dtype") is not None:  # transformers 5's name for torch_dtype
            values["torch_dtype"] = _value(d, "dtype", source)
        if isinstance(values["eos_token_id"], list):
            values["eos_token_id"] = values["eos_token_id"][0] if values["eos_token_id"] else None
        if values["num_key_value_heads"] is None:  # transformers' meaning of null: one KV head per query head
            values["num_key_value_heads"] = values["num_attention_heads"]
        elif "num_key_value_heads" not in d and values["num_attention_heads"] % values["num_key_value_heads"]:
            raise ConfigError(f"{source}: num_key_value_heads is missing and transformers' default (32) does not "
                              f"divide num_attention_heads={values['num_attention_heads']}: add num_key_value_heads")
        try:
            return cls(**values)
        except ConfigError as error:
            raise ConfigError(f"{source}: {error}") from None

    @classmethod
    def from_json(cls, path: str) -> "Qwen3Config":
        return cls.from_dict(read_json(path, FIX), source=path)

    def to_hf_dict(self) -> dict:
        """The transformers-4 layout of the published Qwen3 configs (transformers 5 reads it as well)."""
        d = asdict(self)
        d.pop("initializer_range")
        d.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu",
                 attention_bias=False, attention_dropout=0.0, rope_scaling=None, use_cache=True,
                 use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers,
                 initializer_range=self.initializer_range)
        return d


def _value(d: dict, field: str, source: str):
    """`d[field]` checked against its kind, or transformers' default when the key is omitted."""
    if field not in d:
        if field in REQUIRED:
            raise ConfigError(f"{source}: required field {field} is missing: add it ({FIX})")
        return TRANSFORMERS_DEFAULTS[field]
    value = d[field]
    if value is None and field in NULLABLE:
        return None
    kind = KINDS.get(field, "size")
    if not _is_kind(value, kind):
        raise ConfigError(f"{source}: {field}={value!r} must be {KIND_NAMES[kind]}: {FIX}")
    return float(value) if kind == "float" else value


def _is_kind(value, kind: str) -> bool:
    integer = isinstance(value, int) and not isinstance(value, bool)
    if kind == "token_ids":  # eos_token_id may list several stop tokens
        return all(_is_kind(v, "token_id") for v in value) if isinstance(value, list) else _is_kind(value, "token_id")
    return {"size": integer and value > 0, "token_id": integer and value >= 0,
            "float": (integer or isinstance(value, float)) and value > 0, "bool": isinstance(value, bool),
            "str": isinstance(value, str)}[kind]


def _rope_theta(d: dict, source: str) -> float:
    """rope_theta from either layout; both given and different is ambiguous (transformers 4 and 5 disagree)."""
    top = _value(d, "rope_theta", source)
    nested = (d.get("rope_parameters") or {}).get("rope_theta")
    if nested is None:
        return top
    nested = _value({"rope_theta": nested}, "rope_theta", f"{source}: rope_parameters")
    if "rope_theta" in d and top != nested:
        raise ConfigError(f"{source}: rope_theta={top} and rope_parameters.rope_theta={nested} differ "
                          f"(transformers 4 reads the first, transformers 5 the second): keep one")
    return nested


def _refuse_unsupported(d: dict, source: str) -> None:
    def refuse(field: str, why: str):
        raise ConfigError(f"{source}: {field}={d.get(field)!r} is not supported ({why})")

    if d.get("model_type", "qwen3") != "qwen3":
        refuse("model_type", "only qwen3 is implemented")
    if d.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "Qwen3 uses silu (SwiGLU)")
    if d.get("attention_bias", False):
        refuse("attention_bias", "Qwen3 projections have no bias")
    if d.get("use_sliding_window", False):
        refuse("use_sliding_window", "sliding-window attention is not implemented")
    for field in ("rope_scaling", "rope_parameters"):
        rope = d.get(field)
        if rope is not None and (not isinstance(rope, dict) or _rope_type(rope, field) != "default"):
            refuse(field, "only plain RoPE (rope_type 'default') is implemented")


def _rope_type(rope: dict, field: str) -> str | None:
    """rope_parameters without a type is plain RoPE (transformers 5); a rope_scaling without one is only plain RoPE
    when it carries nothing else (transformers 4 fails on it otherwise)."""
    kind = rope.get("rope_type", rope.get("type"))
    if kind is None and (field == "rope_parameters" or not set(rope) - {"rope_theta"}):
        return "default"
    return kind
