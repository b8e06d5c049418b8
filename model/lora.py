"""LoRA adapters on a Qwen3 model, in plain PyTorch: W x + (alpha / r) B A dropout(x) on each chosen projection, the
base weight untouched, B zero at the start (a fresh adapter changes nothing).

The projections are HF's -- q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj -- also where this model
fuses their GEMMs (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`: model/checkpoint_io.py's `fused_blocks`): a
fused projection carries one adapter per HF block, with its own dropout draw, its delta filling that block's rows of
the output, so an adapter is PEFT's adapter on the HF module of the same name (`peft_state`, `peft_config`). Each
adapted linear keeps its `weight` under its own name (checkpoints and HF exports read it as before); the adapters
are parameters named `<projection>.lora_A.<hf name>` / `lora_B.<hf name>`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from common.files import atomic_directory
from model.qwen3 import Qwen3ForCausalLM

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Linear):
    """A linear layer whose output rows are HF blocks [(name, rows), ...]; the blocks named in `adapted` carry an
    adapter of rank r. `enabled` False: the base layer alone."""

    def __init__(self, base: nn.Linear, blocks: list[tuple[str, int]], adapted: list[str], rank: int, alpha: float,
                 dropout: float):
        super().__init__(base.in_features, base.out_features, bias=False, device="meta")
        self.weight = base.weight  # the same Parameter: its name, its storage and its freezing are the base's
        self.blocks, self.scaling, self.enabled = blocks, alpha / rank, True
        self.dropout = nn.Dropout(dropout)
        device = base.weight.device  # the meta device too (a model sharded before it is filled): `init_adapters`
        self.lora_A = nn.ParameterDict({name: nn.Parameter(torch.empty(rank, self.in_features, device=device))
                                        for name in adapted})
        self.lora_B = nn.ParameterDict({name: nn.Parameter(torch.empty(rows, rank, device=device))
                                        for name, rows in blocks if name in adapted})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if not self.enabled:
            return out
        start = 0
        for name, rows in self.blocks:
            if name in self.lora_A:  # a dropout draw per adapter, as PEFT's per HF module
                delta = F.linear(F.linear(self.dropout(x), self.lora_A[name]), self.lora_B[name]) * self.scaling
                out[..., start:start + rows].add_(delta)  # `out` is fresh and saved by no backward: in place is safe
            start += rows
        return out

    def sharing_adapters(self, base: nn.Linear) -> LoRALinear:
        """A layer on `base` with this one's blocks, scaling and adapters -- the same Parameters, in modules of its
        own -- and no dropout: a frozen low-precision twin's (model/generate.py), holding its own base weight."""
        layer = LoRALinear(base, self.blocks, [], rank=1, alpha=self.scaling, dropout=0.0)
        layer.lora_A, layer.lora_B = nn.ParameterDict(self.lora_A), nn.ParameterDict(self.lora_B)
        layer.enabled = self.enabled
        return layer


def _projections(model: Qwen3ForCausalLM) -> Iterator[tuple[nn.Module, str, list[tuple[str, int]]]]:
    """(parent module, attribute, HF blocks) of every projection LoRA may adapt."""
    config = model.config
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    for layer in model.model.layers:
        yield layer.self_attn, "qkv_proj", [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
        yield layer.self_attn, "o_proj", [("o_proj", config.hidden_size)]
        yield layer.mlp, "gate_up_proj", [("gate_proj", config.intermediate_size), ("up_proj",
                                                                                     config.intermediate_size)]
        yield layer.mlp, "down_proj", [("down_proj", config.hidden_size)]


def add_lora(model: Qwen3ForCausalLM, rank: int = 16, alpha: float = 32.0, dropout: float = 0.0,
             targets: tuple[str, ...] = TARGETS, seed: int | None = 0) -> list[nn.Parameter]:
    """Adapters on `targets` (HF projection names) of every layer, in place, in fp32; the base frozen (but the
    modules the model names in TRAINED_WHOLE: a critic's new head, model/value.py). Returns the
    adapters' parameters (what an optimizer takes). A fresh adapter's output is the base's exactly (B is zero).
    `seed`: the adapters' initialisation (`init_adapters`); None leaves them unfilled, for a model on the meta
    device that is sharded and filled afterwards."""
    unknown = set(targets) - set(TARGETS)
    if unknown or rank < 1:
        raise ValueError(f"LoRA targets must be among {TARGETS} and the rank >= 1, got {sorted(unknown)}, {rank}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in model.TRAINED_WHOLE:  # a module the model trains whole beside the adapters: fp32, as a master
        getattr(model, name).float().requires_grad_(True)
    for parent, attribute, blocks in _projections(model):
        adapted = [name for name, _ in blocks if name in targets]
        if adapted:
            setattr(parent, attribute, LoRALinear(getattr(parent, attribute), blocks, adapted, rank, alpha, dropout))
    model.lora = {"rank": rank, "alpha": alpha, "dropout": dropout, "targets": list(targets)}
    if seed is not None:
        init_adapters(model, seed)
    return adapter_parameters(model)


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for name, p in model.named_parameters() if is_adapter(name)]


def is_adapter(name: str) -> bool:
    """A parameter or state-dict name of an adapter (`<projection>.lora_A.<hf name>`)."""
    return ".lora_A." in name or ".lora_B." in name


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """PEFT's initialisation: A kaiming-uniform (a = sqrt 5), B zero. Each A is drawn whole on the CPU from one
    generator, in the model's order, then copied in -- into a sharded adapter only its rows (DTensor's implicit
    replication) -- so every world size, sharded or not, starts from the same adapters."""
    generator = torch.Generator().manual_seed(seed)
    with implicit_replication():
        for layer in lora_layers(model):
            for a in layer.lora_A.values():
                drawn = torch.empty(a.shape)
                nn.init.kaiming_uniform_(drawn, a=math.sqrt(5), generator=generator)
                a.copy_(drawn)
            for b in layer.lora_B.values():
                b.zero_()


def base_digest(model: nn.Module) -> str:
    """sha256 of the frozen base: every parameter but the adapters, in name order, its bytes as stored (a sharded
    one gathered tensor by tensor: every rank calls this and gets the same digest). A resume file keeps it, so a
    resume onto another base is refused."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        if is_adapter(name):
            continue
        tensor = whole(p).contiguous().cpu()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model within the block (a LoRA student's own reference: no second copy of the weights); after it,
    each layer's adapters as they were before it (so blocks nest)."""
    layers = lora_layers(model)
    before = [layer.enabled for layer in layers]
    for layer in layers:
        layer.enabled = False
    try:
        yield
    finally:
        for layer, enabled in zip(layers, before):
            layer.enabled = enabled


@torch.no_grad()
def merge(model: nn.Module) -> None:
    """Fold every adapter into its base weight (`merged_weight`) and drop it: the model is then a plain Qwen3 whose
    merged linears are fp32, as the HF export writes them."""
    for parent in list(model.modules()):
        for attribute, child in list(parent.named_children()):
            if isinstance(child, LoRALinear):
                merged = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                merged.weight = nn.Parameter(merged_weight(child), requires_grad=child.weight.requires_grad)
                setattr(parent, attribute, merged)


@torch.no_grad()
def merged_weight(layer: LoRALinear) -> torch.Tensor:
    """W + scaling B A on each adapted block, whole, in fp32 at least (a bf16 base plus an fp32 delta is not a bf16
    number): the export's merge (model/checkpoint_io.py's `_merge`, from the same `factors`), bit for bit."""
    weight = whole(layer.weight)
    weight = weight.to(torch.promote_types(weight.dtype, torch.float32), copy=True)
    start = 0
    for name, rows in layer.blocks:
        if name in layer.lora_A:
            scaled_b, a = factors(layer, name)
            weight[start:start + rows] += scaled_b @ a
        start += rows
    return weight


def peft_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters under PEFT's names (`base_model.model.<HF module>.lora_A.weight`), fp32 on the CPU: what PEFT's
    adapter_model.safetensors holds. A sharded model's adapters are gathered: every rank calls this."""
    state = {}
    for module_name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        parent = module_name.rsplit(".", 1)[0]  # model.layers.<i>.self_attn / .mlp
        for name in module.lora_A:
            prefix = f"base_model.model.{parent}.{name}"
            state[f"{prefix}.lora_A.weight"] = whole(module.lora_A[name]).float().cpu().contiguous()
            state[f"{prefix}.lora_B.weight"] = whole(module.lora_B[name]).float().cpu().contiguous()
    return state


def whole(p: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value, detached (a sharded one all-gathered: a collective)."""
    p = p.detach()
    return p.full_tensor() if isinstance(p, DTensor) else p


def factors(layer: LoRALinear, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(scaling B, A) of the adapter of HF block `name`, whole and fp32: its delta's rows i..j are
    (scaling B)[i:j] @ A (a sharded adapter gathered: every rank calls this)."""
    return whole(layer.lora_B[name]).float() * layer.scaling, whole(layer.lora_A[name]).float()


def peft_config(model: nn.Module, base_model_path: str | None = None) -> dict:
    """PEFT's adapter_config.json for the adapters `add_lora` put on `model`."""
    settings = model.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_path,
            "r": settings["rank"], "lora_alpha": settings["alpha"], "lora_dropout": settings["dropout"],
            "target_modules": sorted(settings["targets"]), "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "use_rslora": False, "use_dora": False, "inference_mode": True}


def save_peft_adapter(model: nn.Module, out_dir: str, base_model_path: str | None, write: bool = True) -> None:
    """The adapters alone as PEFT's folder -- adapter_config.json and adapter_model.safetensors (`peft_state`'s
    names) -- which `PeftModel.from_pretrained(base, out_dir)` loads onto the base. Every rank calls this (a
    sharded model's adapters are gathered); rank 0, with `write`, writes, atomically."""
    state, config = peft_state(model), peft_config(model, base_model_path)
    if not write:
        return
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    with atomic_directory(out_dir) as tmp_dir:
        save_file(state, os.path.join(tmp_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp_dir, "adapter_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)


def adapter_count(model: nn.Module) -> int:
    """Elements of the adapters (0 without LoRA)."""
    return sum(p.numel() for p in adapter_parameters(model))
