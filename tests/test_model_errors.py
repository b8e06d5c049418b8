# Run: python -m pytest tests/test_model_errors.py
"""What config.json may leave out (transformers' defaults, checked against transformers itself), and the one-line
user errors of a model or tokenizer folder that cannot be loaded: each names the culprit file or field."""
import json
import os
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from common.errors import UserError, run_script
from support import TINY_CONFIG
from model import Qwen3Config, create_model, default_tokenizer_dir, load_pretrained, load_tokenizer, save_pretrained
from model.config import REQUIRED, TRANSFORMERS_DEFAULTS, ConfigError, ModelFileError

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = list(Qwen3Config.__dataclass_fields__)
VOCAB = 1000
# 32 query heads (head_dim 16, still tiny): transformers' default of 32 KV heads then divides them
TINY_32_HEADS = {**TINY_CONFIG, "num_attention_heads": 32}


def user_error(kind: type, match: str, call, *args) -> str:
    """Run call(*args), expect a one-line `kind` (a UserError and a ValueError) matching `match`; -> its message."""
    with pytest.raises(kind, match=match) as info:
        call(*args)
    assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)
    return str(info.value)


def transformers_view(d: dict) -> dict:
    """Our fields as transformers' Qwen3Config reads the same dict (either major version)."""
    hf = transformers.Qwen3Config.from_dict(json.loads(json.dumps(d)))  # a copy: transformers edits what it is given
    values = {field: getattr(hf, field, None) for field in FIELDS}
    rope = getattr(hf, "rope_parameters", None) or {}
    values["rope_theta"] = rope.get("rope_theta", getattr(hf, "rope_theta", None))
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
    values["torch_dtype"] = None if dtype is None else str(dtype).removeprefix("torch.")
    return values


def ours_view(d: dict) -> dict:
    config = Qwen3Config.from_dict(d)
    return {field: getattr(config, field) for field in FIELDS}


def without(d: dict, *fields: str) -> dict:
    return {k: v for k, v in d.items() if k not in fields}


def save_tiny(path, tie: bool = True, **overrides) -> torch.nn.Module:
    """Our save_pretrained of a tiny random model (std 0.1: logits far from uniform, so a wrong head shows)."""
    config = Qwen3Config.from_dict({**TINY_CONFIG, "vocab_size": VOCAB, "tie_word_embeddings": tie,
                                    "initializer_range": 0.1, **overrides})
    model = create_model(config, seed=0).eval()
    save_pretrained(model, str(path))
    return model


def edit_config(path, edit) -> None:
    file = os.path.join(path, "config.json")
    with open(file) as f:
        d = json.load(f)
    edit(d)
    with open(file, "w") as f:
        json.dump(d, f, indent=2)


# ---------------------------------------------------------------------------------------------------------------
# omitted config fields: transformers' defaults

@pytest.mark.parametrize("field", [None, *TRANSFORMERS_DEFAULTS])
def test_each_omitted_field_defaults_as_transformers(field):
    d = without(TINY_32_HEADS, field)
    ours = ours_view(d)
    assert ours == transformers_view(d)
    if field is not None:
        assert ours[field] == TRANSFORMERS_DEFAULTS[field]


def test_missing_num_key_value_heads(tiny_config_path):
    # omitted: transformers' 32 (not num_attention_heads); null: num_attention_heads
    d = without(TINY_32_HEADS, "num_key_value_heads")
    assert ours_view(d) == transformers_view(d) and ours_view(d)["num_key_value_heads"] == 32
    d = {**TINY_CONFIG, "num_key_value_heads": None}
    assert ours_view(d) == transformers_view(d) and ours_view(d)["num_key_value_heads"] == 4
    # 32 KV heads cannot serve 4 query heads: a mistake, named
    user_error(ConfigError, "num_key_value_heads is missing", Qwen3Config.from_dict,
               without(TINY_CONFIG, "num_key_value_heads"))


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_field_is_named(field):
    user_error(ConfigError, f"required field {field} is missing", Qwen3Config.from_dict, without(TINY_CONFIG, field))


@pytest.mark.parametrize("field,value", [("hidden_size", "64"), ("num_hidden_layers", 0), ("head_dim", None),
                                         ("tie_word_embeddings", None), ("tie_word_embeddings", "false"),
                                         ("rope_theta", -1.0), ("eos_token_id", "<|im_end|>")])
def test_null_or_mistyped_field_is_named(field, value):
    user_error(ConfigError, re.escape(f"{field}={value!r} must be"), Qwen3Config.from_dict,
               {**TINY_CONFIG, field: value})


def test_rope_theta_in_both_layouts_must_agree():
    d = {**TINY_CONFIG, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    user_error(ConfigError, "rope_theta=1000000.0 and rope_parameters.rope_theta=10000.0 differ",
               Qwen3Config.from_dict, d)
    assert Qwen3Config.from_dict(without(d, "rope_theta")).rope_theta == 10000.0


@pytest.mark.parametrize("rope_scaling", [{"rope_type": "yarn", "factor": 4.0}, {"type": "linear", "factor": 2.0},
                                          {"factor": 4.0}, "yarn"])
def test_unknown_rope_scaling_is_refused(rope_scaling):
    user_error(ConfigError, "rope_scaling", Qwen3Config.from_dict, {**TINY_CONFIG, "rope_scaling": rope_scaling})


def test_missing_tie_word_embeddings_loads_untied_like_transformers(tmp_path):
    save_tiny(tmp_path, tie=False)
    edit_config(tmp_path, lambda d: d.pop("tie_word_embeddings"))
    ours = load_pretrained(str(tmp_path)).eval()
    assert not ours.config.tie_word_embeddings
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.tensor([[1, 17, 256, 999, 42, 7]])
    with torch.no_grad():
        logits, ref = ours(ids).logits, hf(input_ids=ids).logits
    assert torch.allclose(logits, ref, atol=1e-5)
    # the tied reading (our old default) would have been a different model
    assert not torch.allclose(ours.lm_head.weight, ours.model.embed_tokens.weight)


# ---------------------------------------------------------------------------------------------------------------
# missing and damaged files

def test_broken_config_json_names_file_line_and_column(tmp_path):
    save_tiny(tmp_path)
    file = tmp_path / "config.json"
    lines = file.read_text().splitlines()
    lines[3] = lines[3].rstrip(",")  # line 4 loses its comma: JSON breaks at the start of line 5
    file.write_text("\n".join(lines))
    message = user_error(ModelFileError, r"config\.json is not valid JSON \(line 5 column 3\)", load_pretrained,
                         str(tmp_path))
    assert str(file) in message and "re-download" in message
    user_error(ModelFileError, r"is not valid JSON \(line 5", Qwen3Config.from_json, str(file))


def test_missing_config_json(tmp_path):
    save_tiny(tmp_path)
    os.remove(tmp_path / "config.json")
    user_error(ModelFileError, f"{tmp_path} has no config.json", load_pretrained, str(tmp_path))
    user_error(ModelFileError, r"config\.json does not exist", Qwen3Config.from_json, str(tmp_path / "config.json"))


def test_truncated_safetensors(tmp_path):
    save_tiny(tmp_path)
    file = tmp_path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:file.stat().st_size // 2])
    message = user_error(ModelFileError, r"model\.safetensors is damaged or truncated", load_pretrained, str(tmp_path))
    assert str(file) in message and "re-export or re-download" in message


def test_zero_byte_safetensors(tmp_path):
    save_tiny(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    user_error(ModelFileError, r"model\.safetensors is empty \(0 bytes", load_pretrained, str(tmp_path))


def test_git_lfs_pointer_instead_of_weights(tmp_path):
    save_tiny(tmp_path)
    (tmp_path / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n")
    user_error(ModelFileError, "is a Git LFS pointer, not the weights: run `git lfs pull`", load_pretrained,
               str(tmp_path))


def _shard(path) -> None:
    """Split model.safetensors into two shards and an index, the layout of a large published model."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(path, shard), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def test_sharded_checkpoint_missing_shard_and_broken_index(tmp_path):
    model = save_tiny(tmp_path)
    _shard(tmp_path)
    assert torch.equal(load_pretrained(str(tmp_path)).model.norm.weight, model.model.norm.weight)
    index = tmp_path / "model.safetensors.index.json"
    index_text = index.read_text()

    os.rename(tmp_path / "model-00002-of-00002.safetensors", tmp_path / "elsewhere")
    user_error(ModelFileError, r"model-00002-of-00002\.safetensors is listed in .*index\.json but missing",
               load_pretrained, str(tmp_path))
    os.rename(tmp_path / "elsewhere", tmp_path / "model-00002-of-00002.safetensors")

    index.write_text(index_text[:40])
    user_error(ModelFileError, r"model\.safetensors\.index\.json is not valid JSON \(line 1 column", load_pretrained,
               str(tmp_path))
    index.write_text(json.dumps({"metadata": {}}))
    user_error(ModelFileError, r"index\.json has no weight_map", load_pretrained, str(tmp_path))


def test_no_weights_at_all(tmp_path):
    save_tiny(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    user_error(ModelFileError, "neither model.safetensors nor model.safetensors.index.json", load_pretrained,
               str(tmp_path))


def test_missing_tensor_is_a_user_error(tmp_path):
    save_tiny(tmp_path, tie=False)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors.pop("lm_head.weight")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    user_error(ModelFileError, r"missing tensors \['lm_head\.weight'\]", load_pretrained, str(tmp_path))


def test_nonexistent_folder(tmp_path):
    missing = str(tmp_path / "no_such_model")
    user_error(ModelFileError, f"model folder {missing} does not exist", load_pretrained, missing)
    message = user_error(ModelFileError, f"tokenizer folder {missing} does not exist", load_tokenizer, missing)
    assert "tokenizer.json" not in message


def test_tokenizer_folder_without_tokenizer_json(tmp_path):
    user_error(ModelFileError, f"{tmp_path} has no tokenizer.json", load_tokenizer, str(tmp_path))


@pytest.mark.parametrize("name,match", [
    ("tokenizer.json", r"tokenizer\.json cannot be read by the tokenizers library"),
    ("tokenizer_config.json", r"tokenizer_config\.json is not valid JSON \(line \d+ column \d+\)"),
])
def test_damaged_tokenizer_file(tmp_path, name, match):
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(default_tokenizer_dir(), file), tmp_path / file)
    (tmp_path / name).write_text((tmp_path / name).read_text(encoding="utf-8")[:100], encoding="utf-8")
    user_error(ModelFileError, match, load_tokenizer, str(tmp_path))


def test_missing_tokenizer_config_json(tmp_path):
    shutil.copyfile(os.path.join(default_tokenizer_dir(), "tokenizer.json"), tmp_path / "tokenizer.json")
    user_error(ModelFileError, r"tokenizer_config\.json does not exist", load_tokenizer, str(tmp_path))


def test_script_prints_one_line_and_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        run_script(lambda: load_pretrained(str(tmp_path / "nowhere")))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model folder ") and err.count("\n") == 1
