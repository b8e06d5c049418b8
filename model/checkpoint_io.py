"""HF safetensors folders in and out: `load_pretrained` and `save_pretrained`.

Reads single-file and sharded checkpoints (`model.safetensors.index.json`), both config layouts, tied embeddings
with or without `lm_head.weight` in the file. Key checking is strict: a missing or unexpected tensor is an error
that names it. Every failure to load (no such folder, a missing, empty, truncated or damaged file, weights that do
not match the config) is a `ModelFileError` that names the file and what to do. Saving goes to a temporary folder
that is renamed into place (`common.files.atomic_directory`), so a crash never leaves half a model, and the files
get ordinary permissions (as umask allows).
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from common.files import atomic_directory
from model.config import ModelFileError, Qwen3Config, read_json
from model.qwen3 import Qwen3ForCausalLM
from model.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REDOWNLOAD = "re-export or re-download the model"


def _weight_files(path: str) -> list[str]:
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return [single]
    if not os.path.isfile(index):
        raise ModelFileError(f"{path} has neither model.safetensors nor model.safetensors.index.json: {REDOWNLOAD}")
    weight_map = read_json(index, REDOWNLOAD).get("weight_map")
    if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
        raise ModelFileError(f"{index} has no weight_map (tensor name -> shard file): {REDOWNLOAD}")
    files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    for file in files:
        if not os.path.isfile(file):
            raise ModelFileError(f"{file} is listed in {index} but missing (an incomplete download or copy): "
                                 f"{REDOWNLOAD}")
    return files


def _read_tensors(files: list[str], device: str | torch.device) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device=str(device)) as f:
                for key in f.keys():
                    tensors[key] = f.get_tensor(key)
        except SafetensorError as error:
            raise ModelFileError(_damage_message(file, error)) from None
    return tensors


def _damage_message(file: str, error: SafetensorError) -> str:
    """What is wrong with a safetensors file that its library refuses, and what to do."""
    if os.path.getsize(file) == 0:
        return f"{file} is empty (0 bytes: a copy or download that never finished): {REDOWNLOAD}"
    with open(file, "rb") as f:
        if f.read(23) == b"version https://git-lfs":  # cloned without git-lfs: a pointer file, not the weights
            return f"{file} is a Git LFS pointer, not the weights: run `git lfs pull` in its repository"
    return f"{file} is damaged or truncated ({error}): {REDOWNLOAD}"


def _check_folder(path: str) -> None:
    if not os.path.isdir(path):
        problem = "does not exist" if not os.path.exists(path) else "is not a folder"
        raise ModelFileError(f"model folder {path} {problem}: check the path (a model folder holds config.json and "
                             f"model.safetensors)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelFileError(f"{path} has no config.json, so it is not a Hugging Face model folder or an incomplete "
                             f"copy of one: {REDOWNLOAD}")


def _check_keys(path: str, model: Qwen3ForCausalLM, tensors: dict[str, torch.Tensor], tied: bool) -> None:
    """Every tensor the config implies is in the checkpoint with its shape, and nothing else."""
    state = model.state_dict()
    expected = {k for k in state if not (tied and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - tensors.keys()), sorted(tensors.keys() - expected)
    if missing or unexpected:
        raise ModelFileError(f"{path}: checkpoint does not match the config: missing tensors {missing[:10]}"
                             f"{' ...' if len(missing) > 10 else ''}, unexpected tensors {unexpected[:10]}"
                             f"{' ...' if len(unexpected) > 10 else ''}")
    for key, tensor in tensors.items():
        if tensor.shape != state[key].shape:
            raise ModelFileError(f"{path}: tensor {key} has shape {tuple(tensor.shape)}, the config implies "
                                 f"{tuple(state[key].shape)}")


def load_pretrained(path: str, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> Qwen3ForCausalLM:
    """Load an HF Qwen3 folder (config.json + safetensors) into our Qwen3ForCausalLM, cast to `dtype`.

    A missing folder or file, a damaged file, or weights that do not match the config raise a ModelFileError
    (a UserError and a ValueError) naming the file and what to do."""
    _check_folder(path)
    config = Qwen3Config.from_json(os.path.join(path, "config.json"))
    tensors = _read_tensors(_weight_files(path), device)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some exporters write the tied copy; the embedding is the authority
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    _check_keys(path, model, tensors, config.tie_word_embeddings)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=False, assign=True)
    model.tie_weights()
    model.reset_rope()
    return model.to(device)


def _generation_config(config: Qwen3Config, pad_token_id: int | None) -> dict:
    return {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
            "pad_token_id": pad_token_id if pad_token_id is not None else config.bos_token_id}


def hf_state_dict(model: Qwen3ForCausalLM, dtype: torch.dtype | None = None,
                  state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The weights under their HF names, on the CPU, in `dtype` (default: the model's), without the tied head.
    `state` gives them when the model's own are sharded (its gathered state dict)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    model = getattr(model, "module", model)     # DDP wrapper
    state = model.state_dict() if state is None else state
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in state.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; HF re-ties on load
    return state


def save_pretrained(model: Qwen3ForCausalLM, out_dir: str, tokenizer_dir: str | None = None,
                    dtype: torch.dtype | None = None, state: dict[str, torch.Tensor] | None = None) -> None:
    """Write an HF folder that `AutoModelForCausalLM.from_pretrained(out_dir)` loads with identical logits.

    Weights keep the model's dtype unless `dtype` is given. `state` gives them when the model's own are sharded
    (the gathered state dict). The tokenizer files are copied from `tokenizer_dir` (default: the real Qwen3
    tokenizer). Atomic: written beside `out_dir`, then renamed into place.
    """
    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    model = getattr(model, "module", model)     # DDP wrapper
    config = model.config
    state = hf_state_dict(model, dtype, state)
    hf_config = config.to_hf_dict()
    hf_config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    tokenizer = load_tokenizer(tokenizer_dir)

    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    with atomic_directory(out_dir) as tmp_dir:
        save_file(state, os.path.join(tmp_dir, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_config, f, indent=2)
        with open(os.path.join(tmp_dir, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(_generation_config(config, tokenizer.pad_token_id), f, indent=2)
        tokenizer.save_pretrained(tmp_dir)
