"""HF safetensors folders in and out: `load_pretrained` and `save_pretrained`.

Reads single-file and sharded checkpoints (`model.safetensors.index.json`), both config layouts, tied embeddings
with or without `lm_head.weight` in the file, and writes either layout (files of at most 5 GB, as transformers
does); an FSDP2-sharded model is read shard by shard (each rank its own rows) and written gathered tensor by
tensor, never whole in one process. Key checking is strict: a missing or unexpected tensor is an error
that names it. Every failure to load (no such folder, a missing, empty, truncated or damaged file, weights that do
not match the config) is a `ModelFileError` that names the file and what to do. Saving goes to a temporary folder
that is renamed into place (`common.files.atomic_directory`), so a crash never leaves half a model, and the files
get ordinary permissions (as umask allows).
"""
from __future__ import annotations

import json
import os
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from common.files import atomic_directory
from model.config import ModelFileError, Qwen3Config, read_json
from model.qwen3 import Qwen3ForCausalLM, unwrap
from model.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
REDOWNLOAD = "re-export or re-download the model"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"


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


def _read_shapes(files: list[str]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor name -> (its file, its shape), from the files' headers only: nothing is read yet."""
    shapes = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    shapes[key] = (file, tuple(f.get_slice(key).get_shape()))
        except SafetensorError as error:
            raise ModelFileError(_damage_message(file, error)) from None
    return shapes


def _read_rows(file: str, targets: dict[str, tuple[torch.Tensor, int]]) -> None:
    """Fill each target from the rows of its tensor in `file` that it holds: name -> (tensor to fill, first row).
    One slice at a time, cast as it lands: no more than one tensor's worth is ever read beyond the targets."""
    try:
        with safe_open(file, framework="pt") as f:
            for key, (target, start) in targets.items():
                if target.numel():  # a rank past the last row of a short tensor holds none of it
                    target.copy_(f.get_slice(key)[start:start + target.shape[0]])
    except SafetensorError as error:
        raise ModelFileError(_damage_message(file, error)) from None


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


def _check_keys(path: str, model: Qwen3ForCausalLM, shapes: dict[str, tuple[str, tuple[int, ...]]],
                tied: bool) -> None:
    """Every tensor the config implies is in the checkpoint with its shape, and nothing else."""
    state = model.state_dict()
    expected = {k for k in state if not (tied and k == "lm_head.weight")}
    missing, unexpected = sorted(expected - shapes.keys()), sorted(shapes.keys() - expected)
    if missing or unexpected:
        raise ModelFileError(f"{path}: checkpoint does not match the config: missing tensors {missing[:10]}"
                             f"{' ...' if len(missing) > 10 else ''}, unexpected tensors {unexpected[:10]}"
                             f"{' ...' if len(unexpected) > 10 else ''}")
    for key, (_, shape) in shapes.items():
        if shape != tuple(state[key].shape):
            raise ModelFileError(f"{path}: tensor {key} has shape {shape}, the config implies "
                                 f"{tuple(state[key].shape)}")


def _local_rows(parameter: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The part of a parameter this process holds and the first row of it: a sharded parameter's (FSDP2 shards dim
    0, `DTensor.to_local()` is its storage) or a whole one's."""
    if not isinstance(parameter, DTensor):
        return parameter.data, 0
    _, offset = compute_local_shape_and_global_offset(parameter.shape, parameter.device_mesh, parameter.placements)
    return parameter.to_local(), offset[0] if offset else 0


def load_pretrained(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    shard: Callable[[Qwen3ForCausalLM], None] | None = None) -> Qwen3ForCausalLM:
    """Load an HF Qwen3 folder (config.json + safetensors) into our Qwen3ForCausalLM in `dtype` on `device`.

    The model is built on the meta device and filled tensor by tensor, each cast as it is read: the peak is the
    model plus one tensor. `shard` (trainer/sharding.py's fully_shard, applied in place on the meta model) makes
    each process read only the rows of each tensor its shards hold: no process ever holds the whole model.
    A missing folder or file, a damaged file, or weights that do not match the config raise a ModelFileError
    (a UserError and a ValueError) naming the file and what to do -- before any weight is read."""
    _check_folder(path)
    config = Qwen3Config.from_json(os.path.join(path, "config.json"))
    shapes = _read_shapes(_weight_files(path))
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # some exporters write the tied copy; the embedding is the authority
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config).to(dtype)
    _check_keys(path, model, shapes, config.tie_word_embeddings)
    if shard is not None:
        shard(model)
    model.to_empty(device=device)  # recomputes RoPE's buffer on `device` (RotaryEmbedding._apply)
    model.tie_weights()
    by_file: dict[str, dict[str, tuple[torch.Tensor, int]]] = {}
    for name, parameter in model.named_parameters():  # a tied head is the embedding: named once
        by_file.setdefault(shapes[name][0], {})[name] = _local_rows(parameter)
    with torch.no_grad():
        for file, targets in by_file.items():
            _read_rows(file, targets)
    return model


def _generation_config(config: Qwen3Config, pad_token_id: int | None) -> dict:
    return {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
            "pad_token_id": pad_token_id if pad_token_id is not None else config.bos_token_id}


def hf_state_dict(model: Qwen3ForCausalLM, dtype: torch.dtype | None = None,
                  state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The weights under their HF names, on the CPU, in `dtype` (default: the model's), without the tied head.
    `state` gives them when the model's own are sharded (its gathered state dict)."""
    model = unwrap(model)
    state = model.state_dict() if state is None else state
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in state.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; HF re-ties on load
    return state


def _export_files(state: dict[str, torch.Tensor], dtype: torch.dtype | None, max_bytes: int) -> list[list[str]]:
    """The tensors' names in state-dict order (a decoder layer's together), cut into files of at most `max_bytes`
    each (a larger tensor alone in its own)."""
    files, size = [[]], 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * (dtype or tensor.dtype).itemsize
        if files[-1] and size + nbytes > max_bytes:
            files, size = files + [[]], 0
        files[-1].append(name)
        size += nbytes
    return files


def _file_tensors(state: dict[str, torch.Tensor], names: list[str], dtype: torch.dtype | None,
                  keep: bool) -> dict[str, torch.Tensor]:
    """One file's tensors, whole, on the CPU in `dtype` (default: their own) -- when `keep`; a sharded one is
    all-gathered first, a collective every rank takes part in, tensor by tensor in the same order."""
    tensors = {}
    for name in names:
        tensor = state[name].detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        if keep:
            tensors[name] = tensor.to("cpu", dtype or tensor.dtype).contiguous()
    return tensors


def _file_name(number: int, count: int) -> str:
    """transformers' names: one file is model.safetensors, several model-0000N-of-0000M.safetensors + an index."""
    return "model.safetensors" if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"


def save_pretrained(model: Qwen3ForCausalLM, out_dir: str, tokenizer_dir: str | None = None,
                    dtype: torch.dtype | None = None, write: bool = True,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write an HF folder that `AutoModelForCausalLM.from_pretrained(out_dir)` loads with identical logits.

    Weights keep the model's dtype unless `dtype` is given; files of at most `max_shard_bytes`, in the layout
    transformers and vLLM read (several: model-0000N-of-0000M.safetensors + model.safetensors.index.json). Streamed:
    one file's tensors are in host memory at a time. A sharded model (FSDP2) is gathered tensor by tensor, so every
    rank calls this, and only the one with `write` writes. The tokenizer files are copied from `tokenizer_dir`
    (default: the real Qwen3 tokenizer). Atomic: written beside `out_dir`, then renamed into place.
    """
    model = unwrap(model)
    config = model.config
    state = model.state_dict()  # sharded: DTensors, with the whole tensors' shapes
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; HF re-ties on load
    files = _export_files(state, dtype, max_shard_bytes)
    if not write:
        for names in files:
            _file_tensors(state, names, dtype, keep=False)
        return
    hf_config = config.to_hf_dict()
    hf_config["torch_dtype"] = str(dtype or next(iter(state.values())).dtype).removeprefix("torch.")
    tokenizer = load_tokenizer(tokenizer_dir)

    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    with atomic_directory(out_dir) as tmp_dir:
        weight_map, total = {}, 0
        for number, names in enumerate(files, 1):
            tensors = _file_tensors(state, names, dtype, keep=True)
            save_file(tensors, os.path.join(tmp_dir, _file_name(number, len(files))), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, _file_name(number, len(files))))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
            del tensors  # before the next file's are gathered
        if len(files) > 1:
            with open(os.path.join(tmp_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(tmp_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_config, f, indent=2)
        with open(os.path.join(tmp_dir, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(_generation_config(config, tokenizer.pad_token_id), f, indent=2)
        tokenizer.save_pretrained(tmp_dir)
