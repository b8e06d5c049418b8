"""Mixed precision, decided here and nowhere else, the same way on every device.

    --dtype auto (default)   bfloat16 on CUDA, float32 elsewhere
    --dtype bfloat16         fp32 master weights, forwards under torch.autocast(device, bf16)
    --dtype float16          the same in fp16, plus a GradScaler (the loss scaled up before backward, the gradients
                             unscaled before clipping, a step whose gradients overflowed skipped)
    --dtype float32          no autocast

CUDA and CPU follow one rule: `--device cpu --dtype bfloat16` is CUDA's bf16 recipe on the CPU's own autocast
(`torch.autocast("cpu", ...)`, `torch.amp.GradScaler("cpu")`), so the tests run the code path a GPU runs. What
the rule decides, for a device and the --dtype / --teacher_dtype flags:

  * the master dtype: fp32 always (the optimizer updates fp32 weights; autocast lowers the matmuls only);
  * the compute dtype: autocast's (fp32 means no autocast); FSDP gathers the decoder layers' weights in it;
  * the scaler: enabled for fp16 only;
  * the teacher's dtype: it needs no master copy, so it is loaded in the compute dtype -- except under fp16, where
    a real Qwen3's activations can overflow fp16's range (max 65,504) without the fp32 weights and residual stream
    the student keeps: then bf16 where the device has it, fp32 otherwise (`frozen_dtype`); --teacher_dtype
    overrides; its forwards compute in that dtype too (`teacher_autocast`), not under the student's autocast;
  * a LoRA student's frozen base (and so the reference that is the base with its adapters off): the same
    `frozen_dtype`, without --teacher_dtype (the base is the student's); its adapters are fp32 master weights;
  * generation's KV-cache dtype (`cache_dtype`): the autocast dtype when autocast is on, else the weights'.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from model.checkpoint_io import DTYPES

DTYPE_CHOICES = ["auto", *DTYPES]


@dataclass(frozen=True)
class Precision:
    device_type: str       # "cuda", "cpu", ...: the autocast and GradScaler device
    compute: torch.dtype   # autocast's dtype; float32 = no autocast
    teacher: torch.dtype   # a frozen teacher's weights

    master = torch.float32  # the trained weights, their gradients and the optimizer's moments

    @property
    def name(self) -> str:
        """The dtype the forwards run in, as logged ("bfloat16", "float16", "float32")."""
        return str(self.compute).removeprefix("torch.")

    @property
    def scaled(self) -> bool:
        """fp16 keeps 5 exponent bits: small gradients underflow unless the loss is scaled up first."""
        return self.compute == torch.float16

    def autocast(self):
        """The context of the forward passes (backward runs outside it, as PyTorch recommends)."""
        if self.compute == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute)

    def teacher_autocast(self):
        """The context of a frozen teacher's forwards: it computes in its own dtype, not the student's. Under fp16
        the teacher is bf16 so that its activations keep bf16's range -- inside the run's fp16 autocast its matmuls
        would be lowered to fp16 again (a layer's activations past 65,504 give inf, then NaN). A teacher in the
        forwards' dtype (every run but fp16 or --teacher_dtype) runs under the run's own autocast."""
        if self.teacher == self.compute:
            return self.autocast()
        if self.teacher == torch.float32:
            return torch.autocast(self.device_type, enabled=False)  # also inside the student's autocast
        return torch.autocast(self.device_type, dtype=self.teacher)

    def scaler(self) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(self.device_type, enabled=self.scaled)


def resolve_precision(device: str, dtype_name: str = "auto", teacher_dtype_name: str | None = None) -> Precision:
    """The rule of the module docstring for `device` ("cuda:1", "cpu", ...) and the flags' values."""
    device_type = torch.device(device).type
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device_type == "cuda" else "float32"
    compute = DTYPES[dtype_name]
    if teacher_dtype_name not in (None, "auto"):
        teacher = DTYPES[teacher_dtype_name]
    else:
        teacher = frozen_dtype(device_type, compute)
    return Precision(device_type, compute, teacher)


def frozen_dtype(device_type: str, compute: torch.dtype) -> torch.dtype:
    """The weights' dtype of a frozen model (a teacher without --teacher_dtype, a LoRA student's base) on
    `device_type` for forwards in `compute`: that dtype, but bf16 under fp16 where the device has it, else fp32."""
    if compute == torch.float16:
        return torch.bfloat16 if has_bf16(device_type) else torch.float32
    return compute


def has_bf16(device_type: str) -> bool:
    """bf16 arithmetic on this device: every CPU build of PyTorch has it; CUDA from Ampere on."""
    if device_type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device_type == "cpu"


def cache_dtype(model: torch.nn.Module, device: torch.device) -> torch.dtype:
    """The dtype of generation's KV cache: under autocast the keys and values are computed in the autocast dtype,
    so they are stored so (half the memory of fp32 master weights' dtype, and attention does not re-cast the whole
    cache at every layer and token); without autocast, the weights' dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(model.parameters()).dtype


def inference_dtype(device: str, dtype_name: str | None) -> torch.dtype:
    """The weights' dtype of a model loaded for inference alone (eval_math.py, chat.py: no master copy to keep):
    --dtype, else bfloat16 on CUDA and float32 elsewhere."""
    if dtype_name in (None, "auto"):
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return DTYPES[dtype_name]
