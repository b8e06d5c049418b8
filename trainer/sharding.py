"""--fsdp 1: parameters, gradients and optimizer state sharded over the ranks (PyTorch's FSDP2, `fully_shard`), and
resume checkpoints written shard by shard with `torch.distributed.checkpoint` (DCP), which any world size can read.

With DDP every rank holds the fp32 master weights, their gradients and AdamW's two moments: 16 bytes per parameter.
Sharded, each of W ranks holds 16/W bytes per parameter (plus, transiently, the unsharded parameters of the layer
being computed). Each decoder layer is its own FSDP unit (all-gathered just before its forward and backward, freed
after); the root unit holds the embedding, the final norm and the head, which stay gathered from the root's forward
to the end of its backward -- the chunked losses use `lm_head.weight` outside the forward, and so get the gathered
weight, whose gradient FSDP reduce-scatters like any other.

What stays as with DDP: the loss of a micro-step is a sum, gradients are averaged over ranks, and the optimizer step
scales them once by world_size * constant / tokens -- on the local shards, which is the same arithmetic -- then clips
by the global norm (a DTensor reduction over the shards). Gradient accumulation skips the reduce-scatter on every
micro-batch but the window's last (`set_requires_gradient_sync`).
"""
from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from common.files import fsync_directory, temporary_name
from model import DTYPES



def shard(model: torch.nn.Module, device: str, dtype_name: str) -> torch.nn.Module:
    """fully_shard each decoder layer, then the root (in place; the module's class becomes FSDP<class>). On CUDA the
    layers compute in `dtype_name` (bf16: the parameters are gathered in bf16) and gradients are reduced in fp32;
    the sharded master weights stay fp32."""
    policy = MixedPrecisionPolicy()
    if device.startswith("cuda") and dtype_name != "float32":
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[dtype_name], reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every rank calls this (it gathers the shards); rank 0 gets the whole state dict on the CPU, the others {}."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def sharded_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The model's and the optimizer's state, each rank its own shards (what DCP writes and reads)."""
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def save_shards(prefix: str, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                is_main: bool) -> str:
    """All ranks: the model's and optimizer's shards into a new folder PREFIX.shards-STEP-TOKEN, complete or absent
    (written as a temporary beside it, renamed into place by rank 0 once every rank's files are written) -> its
    path. It is not the commit point: the resume file that names it is (Run.save writes that afterwards)."""
    state = sharded_state(model, optimizer)
    names = [None, None]
    if is_main:
        final = f"{prefix}.shards-{step:08d}-{secrets.token_hex(4)}"
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


def remove_other_shards(prefix: str, keep: str | None) -> list[str]:
    """Rank 0: shard folders of PREFIX other than `keep` (the one the resume file names): older checkpoints, and
    one a killed run wrote but never committed. -> what was removed."""
    removed = []
    for folder in glob.glob(f"{glob.escape(prefix)}.shards-*"):
        if keep is None or os.path.abspath(folder) != os.path.abspath(keep):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def load_shards(folder: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """All ranks: the model's and optimizer's state from `folder`, resharded to this run's world size."""
    state = sharded_state(model, optimizer)  # the layout to fill (the optimizer's moments created at zero)
    with single_process_quietly():
        dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])


def per_rank_training_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards only)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t
    params = [local(p) for p in model.parameters()]
    return {"parameters": sum(p.numel() * p.element_size() for p in params),
            "gradients": sum(local(p.grad).numel() * local(p.grad).element_size()
                             for p in model.parameters() if p.grad is not None),
            "optimizer": sum(local(v).numel() * local(v).element_size() for s in optimizer.state.values()
                             for v in s.values() if isinstance(v, torch.Tensor))}
