"""--fsdp 1: parameters, gradients and optimizer state sharded over the ranks (PyTorch's FSDP2, `fully_shard`), and
resume checkpoints written shard by shard with `torch.distributed.checkpoint` (DCP), which any world size can read.

With DDP every rank holds the fp32 master weights, their gradients and AdamW's two moments: 16 bytes per parameter.
Sharded, each of W ranks holds 16/W bytes per parameter, plus what is gathered. Each decoder layer is its own FSDP
unit (all-gathered just before its forward and backward, freed after), and so is each RMSNorm (gathered in its
stored dtype: see `shard`); the root unit holds the embedding and the head, which stay gathered from the root's
forward to the end of its backward -- the chunked losses use `lm_head.weight` outside the forward, and so get the
gathered weight, whose gradient FSDP reduce-scatters like any other. So at its peak, the backward's end, a rank
also holds the root's gradient whole in the reduce-scatter's buffers: for a model whose embedding is most of it,
more than the 16/W (docs/architecture.md, "Sharded training: what a rank holds", has the formula, measured).
A teacher's root would never be freed (no backward): the loops call `reshard_root` once its head is used.

No process ever holds a whole model: a sharded model is built on the meta device, sharded, then each rank fills its
own shards -- from the safetensors rows it owns (`load_pretrained(..., shard=...)`) or from the seeded random
initialisation, drawn one tensor at a time (`sharded_random_model`); the HF export and the weights pushed to a
rollout server are written by rank 0 tensor by tensor, each tensor's rows sent to it rank by rank
(`model.checkpoint_io.write_safetensors`).

What stays as with DDP: the loss of a micro-step is a sum, gradients are averaged over ranks, and the optimizer step
scales them once by world_size * constant / tokens -- on the local shards, which is the same arithmetic -- then clips
by the global norm (a DTensor reduction over the shards). Gradients are reduce-scattered after every micro-batch's
backward and accumulated as fp32 shards, so a rank never holds a whole gradient across a window (FSDP2's no-sync
mode would keep every layer's unsharded fp32 gradient until the window's last backward: 4 bytes per parameter).

A shard folder written before q/k/v and gate/up were fused holds those weights and their AdamW moments under HF's
names; it loads into the fused parameters, each rank reading only its rows of them (`FusingLoadPlanner`).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
import glob
import os
import secrets
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.experimental import implicit_replication

from common.errors import UserError
from common.files import fsync_directory, temporary_name
from model import Qwen3Config, Qwen3ForCausalLM
from model.checkpoint_io import HFBlock, hf_layout, local_rows
from model.qwen3 import RMSNorm


TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)  # strict: DCP's load already names a missing key


def shard(model: Qwen3ForCausalLM, device_type: str, compute_dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    """fully_shard each RMSNorm, each decoder layer, then the root (in place; the module's class becomes
    FSDP<class>), over a mesh of all ranks on `device_type` (the run's: "cuda" or "cpu"); works on a model on the
    meta device (then `to_empty` and fill it). The mesh is explicit because fully_shard without one takes the
    machine's accelerator type: `--device cpu` on a GPU host would shard over a CUDA mesh and a gloo group.

    Precision as DDP under autocast: the decoder layers' weights are gathered in `compute_dtype` (what autocast
    casts them to for the matmuls) and their gradients reduced in fp32; the norms, the embedding and the head are
    gathered in their stored dtype (a student's fp32), so the embedding's output, the residual stream and the norms
    stay fp32 as DDP's do -- with the layers' policy they would all run in bf16."""
    # cast_forward_inputs=False: FSDP would cast a layer's inputs (the residual stream, RoPE's cos/sin) to bf16;
    # autocast already lowers what the matmuls take, as under DDP
    lowered = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for module in model.modules():
        if isinstance(module, RMSNorm):
            fully_shard(module, mesh=mesh)  # its own unit: the default policy keeps its stored dtype
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=lowered)
    fully_shard(model, mesh=mesh)  # embedding + head: stored dtype (tied, they are one weight)
    return model


def sharded_random_model(config: Qwen3Config, seed: int, device: str,
                         compute_dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    """The seeded random model `create_model(config, seed)` gives, sharded, each rank holding only its shards
    (`random_model`)."""
    return random_model(config, seed, device, lambda model: shard(model, torch.device(device).type, compute_dtype))


def random_model(config: Qwen3Config, seed: int, device: str, prepare: Callable[[Qwen3ForCausalLM], None],
                 dtype: torch.dtype = torch.float32,
                 model_class: type[Qwen3ForCausalLM] = Qwen3ForCausalLM) -> Qwen3ForCausalLM:
    """The seeded random model `create_model(config, seed)` gives, in `dtype`: built on the meta device, `prepare`d
    there (sharded -- each rank then holds only its shards --, LoRA adapters added: trainer/skeleton/loading.py),
    then initialised in create_model's order -- each tensor drawn whole in fp32 on the CPU (so the numbers are the
    same), one at a time, and only this rank's rows kept (DTensor's implicit replication: a plain tensor copied
    into a sharded one is sliced)."""
    with torch.device("meta"):
        model = model_class(config).to(dtype)
    prepare(model)
    model.to_empty(device=device)  # recomputes RoPE's buffer on `device`
    model.tie_weights()  # to_empty gives an unsharded tied head its own storage: the embedding's again
    with torch.no_grad(), implicit_replication():
        model.init_weights(seed)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def reshard_root(model: torch.nn.Module) -> None:
    """Free a sharded model's gathered root unit (its embedding and head) when no backward will: FSDP2 reshards a
    root only at the end of its backward, so after a forward without one -- the frozen teacher's, every micro-batch
    -- the root would stay gathered for good. Call it after the last use of the head: a teacher's is in the
    student's loss, recomputed chunk by chunk in the student's backward, so after that backward. Not recursive:
    the decoder layers and norms reshard after their own forwards."""
    if is_sharded(model):
        model.reshard()


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The model's trained weights (a LoRA student's adapters: its frozen base is loaded from its source) and the
    optimizer's state, each rank its own shards (what DCP writes and reads)."""
    trained = {name for name, p in model.named_parameters() if p.requires_grad}  # a tied head: its embedding's name
    weights = {name: value for name, value in get_model_state_dict(model, options=TRAINED).items() if name in trained}
    return {"model": weights, "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_shards(prefix: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                is_main: bool, part: str = "") -> str:
    """All ranks: the model's and optimizer's shards into a new folder PREFIX.shards-PARTSTEP-TOKEN (`part`: a model
    trained beside the run's, "critic-"), complete or absent
    (written as a temporary beside it, renamed into place by rank 0 once every rank's files are written) -> its
    path. It is not the commit point: the resume file that names it is (Run.save writes that afterwards)."""
    state = sharded_state(model, optimizer)
    names = [None, None]
    if is_main:
        final = f"{prefix}.shards-{part}{step:08d}-{secrets.token_hex(4)}"
        names = [final, temporary_name(final)]
        os.mkdir(names[1])
    if dist.is_initialized():
        dist.broadcast_object_list(names, src=0)
    final, tmp = names
    try:
        with single_process_quietly():
            dcp.save(state, checkpoint_id=tmp)  # DCP's file writer fsyncs each file
        if dist.is_initialized():
            dist.barrier()                   # every rank's shards are on disk
    except BaseException:
        if is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if is_main:
        os.replace(tmp, final)
        fsync_directory(os.path.dirname(os.path.abspath(final)))
    return final


@contextlib.contextmanager
def single_process_quietly():
    """DCP warns on every call without a process group that it assumes one process: --fsdp 1 run as one process
    (e.g. resuming a sharded run on one GPU) means exactly that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def remove_other_shards(prefix: str, keep: set[str]) -> list[str]:
    """Rank 0: shard folders of PREFIX other than those in `keep` (the ones the resume file names): older
    checkpoints, and ones a killed run wrote but never committed. -> what was removed."""
    removed, kept = [], {os.path.abspath(folder) for folder in keep}
    for folder in glob.glob(f"{glob.escape(prefix)}.shards-*"):
        if os.path.abspath(folder) not in kept:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def load_shards(folder: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """All ranks: the model's and optimizer's state from `folder`, resharded to this run's world size (a folder
    written before q/k/v and gate/up were fused too: `FusingLoadPlanner`)."""
    state = sharded_state(model, optimizer)  # the layout to fill (the optimizer's moments created at zero)
    planner = FusingLoadPlanner(hf_layout(dict(model.named_parameters()), model.config))
    with single_process_quietly():
        dcp.load(state, checkpoint_id=folder, planner=planner)
    planner.check_steps(folder)
    set_model_state_dict(model, state["model"], options=TRAINED)
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


class FusingLoadPlanner(DefaultLoadPlanner):
    """DCP's own planner for a folder of this layout. A folder written before q/k/v and gate/up were fused holds a
    fused parameter's weight and AdamW moments as its HF tensors (`layout`: model/checkpoint_io.py, hf_layout):
    each rank reads, of each, only the rows its shard of the fused parameter holds (`local_rows`), straight into
    that shard -- DCP reads any row range of a saved tensor, whatever ranks wrote it -- so no rank holds more than
    its shards. The fused parameter's step count is its blocks' (`check_steps`: they must agree); the optimizer's
    parameter names stay this run's."""

    def __init__(self, layout: dict[str, HFBlock]):
        super().__init__()
        self.layout = layout
        self.targets: dict[str, torch.Tensor] = {}        # a saved (unfused) key -> the local rows it fills
        self.steps: dict[str, list[torch.Tensor]] = {}    # a fused parameter's step key -> its blocks' steps

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        missing = [key for key in self.state_dict if key not in saved]
        if not missing:
            return super().create_local_plan()
        # the saved params lists name the unfused parameters: this run's names stay
        present = {key: value for key, value in self.state_dict.items()
                   if key in saved and self.mappings[key][-1] != "params"}
        requests = create_default_local_load_plan(present, self.metadata).items
        for key in missing:
            requests += self.block_reads(key)
        return LoadPlan(requests)

    def block_reads(self, key: str) -> list[ReadItem]:
        """The reads that fill `key` -- a fused parameter's weight or optimizer state, as this run holds it -- from
        the saved tensors of its blocks."""
        path = self.mappings[key]  # ("model", FQN) or ("optimizer", "state", FQN, "exp_avg" | "step" | ...)
        fqn, target = path[1] if path[0] == "model" else path[2], self.state_dict[key]
        saved, requests = self.metadata.state_dict_metadata, []
        blocks = {hf_name: block for hf_name, block in self.layout.items() if block.parameter == fqn}
        old_keys = {hf_name: ".".join(str(hf_name if part == fqn else part) for part in path)  # DCP's flat keys
                    for hf_name in blocks}
        if not blocks or any(old_key not in saved for old_key in old_keys.values()):
            raise RuntimeError(f"Missing key in checkpoint state_dict: {key}.")  # as DCP says it
        for hf_name, block in blocks.items():
            old_key = old_keys[hf_name]
            if target.dim() == 0:  # AdamW's step, the same in every block: the first one's, the others compared
                into = target if key not in self.steps else torch.empty_like(target)
                self.steps.setdefault(key, []).append(into)
                offsets = torch.Size([])
            else:
                into, start = local_rows(target, block.rows)
                if not into.numel():
                    continue  # this rank holds none of this block
                offsets = torch.Size([start] + [0] * (into.dim() - 1))
            self.targets[old_key] = into
            requests += create_read_items_for_chunk_list(old_key, saved[old_key],
                                                         [ChunkStorageMetadata(offsets=offsets, sizes=into.shape)])
        return requests

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self.targets.get(read_item.dest_index.fqn)
        if target is None:
            return super().resolve_tensor(read_item)
        return self.transform_tensor(read_item, target)

    def check_steps(self, folder: str) -> None:
        """After the load: each fused parameter's blocks were saved at the same step count (AdamW steps all its
        parameters together); a file where they differ is damaged."""
        for key, steps in self.steps.items():
            if any(not torch.equal(step, steps[0]) for step in steps[1:]):
                raise UserError(f"{folder}: {key} differs between its unfused blocks ({[float(s) for s in steps]}), "
                                f"which no run writes: the folder is damaged; restore it from a backup, or pass "
                                f"--start_over 1 (without --from_resume) to set it aside and start anew")
