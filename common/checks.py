"""Start-up checks every script shares, so that a model folder or a device that cannot work is refused with the
same words everywhere (the training loops, eval_math.py, chat.py), before anything loads."""
from __future__ import annotations

import os

import torch

from common.errors import refuse


def check_model_dir(path: str, flag: str) -> None:
    """An HF model folder: it exists and has a config.json."""
    if not os.path.exists(path):
        refuse(f"{flag} {path} does not exist: pass a model folder (config.json, model.safetensors, tokenizer "
               f"files), e.g. checkpoints/sft")
    if not os.path.isfile(os.path.join(path, "config.json")):
        refuse(f"{flag} {path} is not a model folder: it has no config.json")


def check_device(name: str) -> None:
    """cpu, cuda or cuda:N, and the CUDA device must be visible."""
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        refuse(f"--device {name} is not a device these scripts run on: pass cpu, cuda or cuda:N")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type == "cuda" and visible == 0:
        refuse(f"--device {name} but no CUDA device is visible: pass --device cpu")
    if device.type == "cuda" and (device.index or 0) >= visible:
        refuse(f"--device {name} but only {visible} CUDA device(s) are visible: pass cuda:0 ... cuda:{visible - 1}")
