"""HF safetensors folders in and out: `load_pretrained` and `save_pretrained`.

Reads single-file and sharded checkpoints (`model.safetensors.index.json`), both config layouts, tied embeddings
with or without `lm_head.weight` in the file, and writes either layout (files of at most 5 GB, as transformers
does). The files keep HF's names and shapes: our fused parameters (model/qwen3.py: q, k and v as one `qkv_proj`,
gate and up as one `gate_up_proj`) are read from and written as their HF tensors, each a block of their rows
(`fused_blocks`, `hf_layout`: the one place that maps the two layouts). An FSDP2-sharded model is read shard by
shard (each rank its own rows). Every file is written tensor by tensor -- a header computed from the shapes, then
each tensor's bytes, a sharded tensor's rank by rank, sent to rank 0 -- so writing holds at most one tensor beyond
the model, and with a sharded model one rank's rows of one tensor: no process ever holds a file's tensors at once,
or a sharded model whole. Key checking is strict: a missing or unexpected tensor is an error that names it (its HF
name). Every failure to load (no such folder, a missing, empty, truncated or damaged file, weights that do not
match the config) is a `ModelFileError` that names the file and what to do. Saving goes to a temporary folder that
is renamed into place (`common.files.atomic_directory`), so a crash never leaves half a model, and the files get
ordinary permissions (as umask allows).
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator, NamedTuple

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from common.files import atomic_directory
from model.config import ModelFileError, Qwen3Config, read_json
from model.lora import LoRALinear, factors, is_adapter
from model.qwen3 import Qwen3ForCausalLM, unwrap
from model.tokenizer import load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}  # their names in the header
REDOWNLOAD = "re-export or re-download the model"
MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size, "5GB"


def fused_blocks(config: Qwen3Config) -> dict[str, list[tuple[str, int]]]:
    """Our fused parameters (their names within a decoder layer) -> the HF tensors that are their row blocks, with
    the rows of each, in row order (model/qwen3.py: Attention.qkv_proj, MLP.gate_up_proj)."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {"self_attn.qkv_proj.weight": [("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", kv),
                                          ("self_attn.v_proj.weight", kv)],
            "mlp.gate_up_proj.weight": [("mlp.gate_proj.weight", config.intermediate_size),
                                        ("mlp.up_proj.weight", config.intermediate_size)]}


class HFBlock(NamedTuple):
    """Where an HF tensor is among our parameters: rows `rows` of `parameter` (all of them unless it is fused)."""
    parameter: str
    rows: range


def hf_layout(parameters: dict[str, torch.Tensor], config: Qwen3Config) -> dict[str, HFBlock]:
    """HF name -> where that tensor is, for our `parameters` (name -> tensor, any device, sharded or not): in their
    order, each fused one expanded into its blocks -- which is HF's own order, and our parameters' order before the
    fusion (resume files written then: trainer/skeleton/checkpoint.py)."""
    fused = fused_blocks(config)
    layout = {}
    for name, tensor in parameters.items():
        inner = next((inner for inner in fused if name.endswith("." + inner)), None)
        if inner is None:
            layout[name] = HFBlock(name, range(tensor.shape[0]))
            continue
        prefix, start = name.removesuffix(inner), 0  # "model.layers.N."
        for hf_name, rows in fused[inner]:
            layout[prefix + hf_name] = HFBlock(name, range(start, start + rows))
            start += rows
    return layout


@dataclass(frozen=True)
class RowBlock:
    """An HF tensor of a model: rows `rows` of one of its parameters, `tensor` -- the model's own (a DTensor when
    sharded), nothing copied -- all of them unless the parameter is fused. `adapter`: (LoRA layer, HF block name)
    when a LoRA adapter is on it: the tensor is then written merged, W + scaling B A, in at least fp32."""
    tensor: torch.Tensor
    rows: range
    adapter: tuple | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), *self.tensor.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        # a merged weight is computed in fp32: a bf16 base plus an fp32 delta is not a bf16 number
        return torch.promote_types(self.tensor.dtype, torch.float32) if self.adapter else self.tensor.dtype

    def numel(self) -> int:
        return math.prod(self.shape)


def fuse(tensors: dict[str, torch.Tensor], layout: dict[str, HFBlock]) -> dict[str, torch.Tensor]:
    """Whole tensors under HF names -> under ours, in our order: each fused parameter's blocks concatenated in row
    order (what was saved in HF's layout: a resume file's weights from before the fusion, an HF file read whole)."""
    parts: dict[str, list[torch.Tensor]] = {}
    for name, block in layout.items():
        parts.setdefault(block.parameter, []).append(tensors[name])
    return {name: torch.cat(blocks) if len(blocks) > 1 else blocks[0] for name, blocks in parts.items()}


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


def _check_keys(path: str, expected: dict[str, RowBlock], shapes: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """Every HF tensor the config implies (`expected`: the model's `hf_weights`) is in the checkpoint with its shape,
    and nothing else."""
    missing, unexpected = sorted(expected.keys() - shapes.keys()), sorted(shapes.keys() - expected.keys())
    if missing or unexpected:
        raise ModelFileError(f"{path}: checkpoint does not match the config: missing tensors {missing[:10]}"
                             f"{' ...' if len(missing) > 10 else ''}, unexpected tensors {unexpected[:10]}"
                             f"{' ...' if len(unexpected) > 10 else ''}")
    for key, (_, shape) in shapes.items():
        if shape != expected[key].shape:
            raise ModelFileError(f"{path}: tensor {key} has shape {shape}, the config implies {expected[key].shape}")


def local_rows(parameter: torch.Tensor, rows: range) -> tuple[torch.Tensor, int]:
    """Of rows `rows` of a parameter (or of a moment shaped and sharded like it), those this process holds, as a
    view of its storage -- a sharded parameter's shard (FSDP2 shards dim 0, `DTensor.to_local()` is its storage) or
    a whole one -- and the index of the first of them within `rows`. A rank that holds none of them gets 0 rows."""
    if isinstance(parameter, DTensor):
        _, offset = compute_local_shape_and_global_offset(parameter.shape, parameter.device_mesh,
                                                          parameter.placements)
        local, first = parameter.to_local(), offset[0] if offset else 0
        held = range(first, first + local.shape[0])
    else:
        local, held = parameter.data, range(parameter.shape[0])
    start, stop = max(rows.start, held.start), min(rows.stop, held.stop)
    return local[start - held.start:max(start, stop) - held.start], start - rows.start


def _rank_rows(rows: int, world: int) -> list[range]:
    """Each rank's rows of a tensor of `rows` rows sharded over `world` ranks: FSDP2 splits dim 0 as torch.chunk
    does, in pieces of ceil(rows / world) rows, the last ranks holding fewer or none."""
    size = -(-rows // world)
    return [range(min(rank * size, rows), min((rank + 1) * size, rows)) for rank in range(world)]


def load_pretrained(path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    shard: Callable[[Qwen3ForCausalLM], None] | None = None,
                    model_class: type[Qwen3ForCausalLM] = Qwen3ForCausalLM, body_only: bool = False
                    ) -> Qwen3ForCausalLM:
    """Load an HF Qwen3 folder (config.json + safetensors) into our Qwen3ForCausalLM in `dtype` on `device`.

    The model is built on the meta device and filled tensor by tensor, each cast as it is read: the peak is the
    model plus one tensor. A fused parameter is filled from its HF tensors (q, k, v; gate, up), each into its block of
    rows (`hf_layout`). `shard` (trainer/skeleton/sharding.py's fully_shard, applied in place on the meta model)
    makes each process read only the rows of each tensor its shards hold: no process ever holds the whole model.
    A missing folder or file, a damaged file, or weights that do not match the config raise a ModelFileError
    (a UserError and a ValueError) naming the file and what to do -- before any weight is read.

    `model_class`: Qwen3's causal LM, or model/value.py's critic, whose head the file names `score.weight`;
    `body_only`: the file's head is not read (a critic's body from a causal LM): the model's head is left as
    `to_empty` left it, for the caller to fill."""
    _check_folder(path)
    config = Qwen3Config.from_json(os.path.join(path, "config.json"))
    shapes = _read_shapes(_weight_files(path))
    if config.tie_word_embeddings or body_only:
        shapes.pop("lm_head.weight", None)  # some exporters write the tied copy; the embedding is the authority
    with torch.device("meta"):
        model = model_class(config).to(dtype)
    expected = hf_weights(model)
    if body_only:
        expected.pop(model.HF_HEAD, None)
    _check_keys(path, expected, shapes)
    if shard is not None:
        shard(model)
    model.to_empty(device=device)  # recomputes RoPE's buffer on `device` (RotaryEmbedding._apply)
    model.tie_weights()
    # a tied head is the embedding: named once; LoRA adapters (added by `shard`) are not in the file
    parameters = {name: p for name, p in model.named_parameters() if not is_adapter(name)}
    by_file: dict[str, dict[str, tuple[torch.Tensor, int]]] = {}
    for name, block in hf_layout(parameters, config).items():
        if name == "lm_head.weight" and body_only:
            continue
        hf_name = model.HF_HEAD if name == "lm_head.weight" else name
        by_file.setdefault(shapes[hf_name][0], {})[hf_name] = local_rows(parameters[block.parameter], block.rows)
    with torch.no_grad():
        for file, targets in by_file.items():
            _read_rows(file, targets)
    return model


def _generation_config(config: Qwen3Config, pad_token_id: int | None) -> dict:
    return {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
            "pad_token_id": pad_token_id if pad_token_id is not None else config.bos_token_id}


def hf_weights(model: Qwen3ForCausalLM) -> dict[str, RowBlock]:
    """The weights under their HF names and in HF's shapes and order, without the tied head (safetensors refuses
    shared storage; HF re-ties on load): each the rows of one of the model's own tensors, nothing copied -- a
    sharded model's DTensors, with the whole tensors' shapes; a fused parameter as its HF tensors (`hf_layout`).
    (A sharded model's state_dict also frees a root left gathered by a forward without backward: FSDP2's hook.)"""
    model = unwrap(model)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items() if not is_adapter(name)}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return {(model.HF_HEAD if name == "lm_head.weight" else name):
            RowBlock(state[block.parameter], block.rows, _adapter(model, name, block.parameter))
            for name, block in hf_layout(state, model.config).items()}


def _adapter(model: Qwen3ForCausalLM, hf_name: str, parameter: str) -> tuple | None:
    """(LoRA layer, HF block name) when a LoRA adapter is on this HF tensor and switched on (model/lora.py: the
    export is what the model computes), else None."""
    layer = model.get_submodule(parameter.rsplit(".", 1)[0]) if parameter.endswith(".weight") else None
    block = hf_name.rsplit(".", 2)[-2]  # model.layers.N.self_attn.q_proj.weight -> q_proj
    adapted = isinstance(layer, LoRALinear) and layer.enabled and block in layer.lora_A
    return (layer, block) if adapted else None


def _nbytes(block: RowBlock, dtype: torch.dtype | None) -> int:
    """Bytes of the whole HF tensor (of a DTensor's global shape) in `dtype` (default: its own)."""
    return block.numel() * (dtype or block.dtype).itemsize


def _safetensors_header(state: dict[str, RowBlock], dtype: torch.dtype | None) -> bytes:
    """The head of a safetensors file holding `state`'s tensors in its order, in `dtype` (default: their own),
    computed from the shapes alone, before any tensor's bytes arrive: the JSON's length (little-endian u64), then the
    JSON (each tensor's dtype, shape and byte range in the data that follows), padded with spaces to a multiple of
    8 bytes as the safetensors library pads it."""
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, block in state.items():
        end = offset + _nbytes(block, dtype)
        entries[name] = {"dtype": SAFETENSORS_DTYPES[dtype or block.dtype], "shape": list(block.shape),
                         "data_offsets": [offset, end]}
        offset = end
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header


def write_safetensors(file: BinaryIO | None, state: dict[str, RowBlock], dtype: torch.dtype | None) -> None:
    """`state`'s tensors (`hf_weights`) as one safetensors file, written into `file` by rank 0 and streamed: the
    header first, then each tensor's bytes as they come, cast to `dtype` (default: its own). A sharded tensor comes
    rank by rank (`_rows_in_order`), so beyond its shards no process holds more than one rank's rows of one tensor.
    Every rank calls this, in step: the others pass no file and send their rows (a plain tensor is rank 0's
    alone)."""
    if file is not None:
        file.write(_safetensors_header(state, dtype))
    for block in state.values():
        for rows in _rows_in_order(block):
            if file is not None:
                rows = rows.to("cpu", dtype or rows.dtype).contiguous()
                file.write(rows.view(-1).view(torch.uint8).numpy())  # the tensor's own bytes: no copy


def _rows_in_order(block: RowBlock) -> Iterator[torch.Tensor]:
    """An HF tensor's rows in order, as rank 0 writes them: of a plain parameter at once; of a sharded one (FSDP2
    splits dim 0 over the ranks as torch.chunk does, the last ranks holding fewer rows or none) rank 0's own rows
    of it, then each other rank's, which it sends to rank 0 when rank 0 is ready for them -- of a fused parameter
    only the rows of this block, so no rank gathers the parameter; a rank other than 0 yields nothing."""
    tensor, merged = block.tensor, _merge(block)
    if not isinstance(tensor, DTensor):
        yield merged(tensor[block.rows.start:block.rows.stop], 0)
        return
    group, (local, start) = tensor.device_mesh.get_group(), local_rows(tensor, block.rows)
    if dist.get_rank(group) != 0:
        if local.numel():
            dist.send(local.contiguous(), group_dst=0, group=group)
        return
    yield merged(local, start)
    for source, held in enumerate(_rank_rows(tensor.shape[0], dist.get_world_size(group))[1:], 1):
        first = max(block.rows.start, held.start)
        count = min(block.rows.stop, held.stop) - first  # its rows of the block
        if count > 0:
            rows = torch.empty((count, *tensor.shape[1:]), dtype=local.dtype, device=local.device)
            dist.recv(rows, group_src=source, group=group)
            yield merged(rows, first - block.rows.start)


def _merge(block: RowBlock) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """rows, index of the first within the block -> the rows as written: with a LoRA adapter on the block, merged
    (W + scaling B A, in fp32 at least) -- its factors, small, are gathered whole first (every rank, in step)."""
    if block.adapter is None:
        return lambda rows, first: rows
    scaled_b, a = factors(*block.adapter)
    return lambda rows, first: rows.to(block.dtype) + (scaled_b[first:first + rows.shape[0]] @ a).to(rows.device)


def _export_files(state: dict[str, RowBlock], dtype: torch.dtype | None, max_bytes: int) -> list[list[str]]:
    """The tensors' names in state-dict order (a decoder layer's together), cut into files of at most `max_bytes`
    each (a larger tensor alone in its own)."""
    files, size = [[]], 0
    for name, block in state.items():
        nbytes = _nbytes(block, dtype)
        if files[-1] and size + nbytes > max_bytes:
            files, size = files + [[]], 0
        files[-1].append(name)
        size += nbytes
    return files


def save_file(tensors: dict[str, RowBlock], path: str, dtype: torch.dtype | None) -> None:
    """Rank 0: one file of the export, streamed (`write_safetensors`)."""
    with open(path, "wb") as f:
        write_safetensors(f, tensors, dtype)


def _file_name(number: int, count: int) -> str:
    """transformers' names: one file is model.safetensors, several model-0000N-of-0000M.safetensors + an index."""
    return "model.safetensors" if count == 1 else f"model-{number:05d}-of-{count:05d}.safetensors"


def save_pretrained(model: Qwen3ForCausalLM, out_dir: str, tokenizer_dir: str | None = None,
                    dtype: torch.dtype | None = None, write: bool = True,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write an HF folder that `AutoModelForCausalLM.from_pretrained(out_dir)` loads with identical logits.

    Weights keep the model's dtype unless `dtype` is given; files of at most `max_shard_bytes`, in the layout
    transformers and vLLM read (several: model-0000N-of-0000M.safetensors + model.safetensors.index.json). Streamed
    tensor by tensor (`write_safetensors`): beyond the model, at most one tensor is in host memory at a time (none
    when it is already on the CPU in `dtype`), and for a sharded model (FSDP2) one rank's rows of one tensor, sent
    to rank 0: every rank calls this, and only rank 0, with `write`, writes. The tokenizer files are copied from
    `tokenizer_dir` (default: the real Qwen3 tokenizer). Atomic: written beside `out_dir`, then renamed into place.
    """
    model = unwrap(model)
    config = model.config
    state = hf_weights(model)
    files = _export_files(state, dtype, max_shard_bytes)
    if not write:
        for names in files:
            write_safetensors(None, {name: state[name] for name in names}, dtype)
        return
    hf_config = model.hf_config()
    hf_config["torch_dtype"] = str(dtype or next(iter(state.values())).dtype).removeprefix("torch.")
    tokenizer = load_tokenizer(tokenizer_dir)

    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    with atomic_directory(out_dir) as tmp_dir:
        for number, names in enumerate(files, 1):
            save_file({name: state[name] for name in names}, os.path.join(tmp_dir, _file_name(number, len(files))),
                      dtype)
        if len(files) > 1:
            weight_map = {name: _file_name(number, len(files)) for number, names in enumerate(files, 1)
                          for name in names}
            total = sum(_nbytes(block, dtype) for block in state.values())
            with open(os.path.join(tmp_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(tmp_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(hf_config, f, indent=2)
        with open(os.path.join(tmp_dir, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(_generation_config(config, tokenizer.pad_token_id), f, indent=2)
        tokenizer.save_pretrained(tmp_dir)
