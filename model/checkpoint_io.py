"""HF safetensors folders in and out: `load_pretrained` and `save_pretrained`.

Reads single-file and sharded checkpoints (`model.safetensors.index.json`), both config layouts, tied embeddings
with or without `lm_head.weight` in the file. Key checking is strict: a missing or unexpected tensor is an error
that names it. Saving goes to a temporary folder that is renamed into place, so a crash never leaves half a model.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.config import Qwen3Config
from model.qwen3 import Qwen3ForCausalLM
from model.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _weight_files(path: str) -> list[str]:
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")


def _read_tensors(files: list[str], device: str | torch.device) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in files:
        with safe_open(file, framework="pt", device=str(device)) as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def load_pretrained(path: str, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> Qwen3ForCausalLM:
    """Load an HF Qwen3 folder (config.json + safetensors) into our Qwen3ForCausalLM, cast to `dtype`."""
    config = Qwen3Config.from_json(os.path.join(path, "config.json"))
    tensors = _read_tensors(_weight_files(path), device)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exporters write the tied copy; the embedding is the authority
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    expected = {k for k in model.state_dict() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not match the config: missing tensors {missing[:10]}"
                         f"{' ...' if len(missing) > 10 else ''}, unexpected tensors {unexpected[:10]}"
                         f"{' ...' if len(unexpected) > 10 else ''}")
    for key, tensor in tensors.items():
        want = model.state_dict()[key].shape
        if tensor.shape != want:
            raise ValueError(f"{path}: tensor {key} has shape {tuple(tensor.shape)}, the config implies {tuple(want)}")
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    model.tie_weights()
    model.reset_rope()
    return model.to(device)


def _generation_config(config: Qwen3Config, pad_token_id: int | None) -> dict:
    return {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
            "pad_token_id": pad_token_id if pad_token_id is not None else config.bos_token_id}


def save_pretrained(model: Qwen3ForCausalLM, out_dir: str, tokenizer_dir: str | None = None,
                    dtype: torch.dtype | None = None) -> None:
    """Write an HF folder that `AutoModelForCausalLM.from_pretrained(out_dir)` loads with identical logits.

    Weights keep the model's dtype unless `dtype` is given. The tokenizer files are copied from `tokenizer_dir`
    (default: the real Qwen3 tokenizer). Atomic: written beside `out_dir`, then renamed into place.
    """
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    model = getattr(model, "module", model)     # DDP wrapper
    config = model.config
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight")  # safetensors refuses shared storage; HF re-ties on load
    hf_config = config.to_hf_dict()
    hf_config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    tokenizer = load_tokenizer(tokenizer_dir)

    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        save_file(state, os.path.join(tmp_dir, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_config, f, indent=2)
        with open(os.path.join(tmp_dir, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(_generation_config(config, tokenizer.pad_token_id), f, indent=2)
        tokenizer.save_pretrained(tmp_dir)
        _replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)  # a failed save leaves neither half a model nor litter
        raise


def _replace_dir(new_dir: str, target: str) -> None:
    """Move `new_dir` to `target`; an existing target is moved aside first and removed only after the swap."""
    if not os.path.exists(target):
        os.replace(new_dir, target)
        return
    old = f"{new_dir}.old"
    os.replace(target, old)
    os.replace(new_dir, target)
    shutil.rmtree(old)
