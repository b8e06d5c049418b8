"""What a start and a resume check before they touch anything: the run name is free (no live run holds its lock,
no resume file is overwritten by accident), and a resume file is this project's, for this model, written with
the same flags -- except those that change how the run executes or logs, not what it computes -- and the same
global batch. Each refusal is one line saying what to do."""
from __future__ import annotations

import argparse
import os

import torch

from common.errors import UserError, refuse
from model.precision import resolve_precision
from trainer.skeleton.distributed import print0
from trainer.skeleton.guard import RunLock

CHECKPOINT_FORMAT = 1


def resume_change_names(args: argparse.Namespace) -> set[str]:
    """The flag names --resume_changes lists (comma-separated, with or without the leading --)."""
    return {name.strip().removeprefix("--") for name in args.resume_changes.split(",") if name.strip()}


def load_checkpoint(path: str, args: argparse.Namespace, global_batch: int, model: torch.nn.Module,
                    resumable: set[str], accepted: set[str]) -> dict:
    """Read a resume checkpoint and check it belongs to this run; a damaged or foreign one is a clear error.
    `resumable`: the flags that may differ from the checkpoint's (the loop's config says which: those that change
    how the run executes or logs, not what it computes); `accepted`: those --resume_changes lets differ besides."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # torch raises several types for a truncated or corrupt zip; all mean the same
        raise UserError(f"{path} is damaged and cannot be read ({type(error).__name__}: {str(error)[:120]}). Restore "
                        f"it from a backup, or pass --start_over 1 (without --from_resume) to set it aside and start "
                        f"anew") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise UserError(f"{path} is not a resume checkpoint of this project (format "
                        f"{checkpoint.get('format') if isinstance(checkpoint, dict) else type(checkpoint).__name__})")
    if checkpoint["model_config"] != model.config.to_hf_dict():
        raise UserError(f"{path} was written for another model configuration; resume with the same "
                        f"--model_path/--model_config, or use another --save_weight")
    # --dtype compared as it resolves (auto is bf16 on CUDA, fp32 elsewhere): what the forwards computed in
    saved = {**checkpoint["args"], "dtype": trained_dtype(checkpoint)}
    current = {**vars(args), "dtype": resolve_precision(args.device, args.dtype).name}
    changed = {k: (saved.get(k), v) for k, v in current.items()
               if k not in resumable and k in saved and saved[k] != v}
    refused = {k: change for k, change in changed.items() if k not in accepted}
    if refused:
        details = ", ".join(describe_change(k, old, new) for k, (old, new) in refused.items())
        raise UserError(f"{path} was written with other settings ({details}), which would change what the run "
                        f"computes (its length, learning-rate schedule or data): resume with the original flags, "
                        f"accept the change with --resume_changes {','.join(refused)}, or use another --save_weight")
    if changed:
        details = ", ".join(describe_change(k, old, new) for k, (old, new) in changed.items())
        print0(f"resuming with changed settings, as --resume_changes accepts: {details}")
    if checkpoint["global_batch"] != global_batch:
        raise UserError(f"{path}: global batch was {checkpoint['global_batch']} (world x batch x accumulation), "
                        f"now {global_batch}; keep the global batch to continue the same sample stream")
    return checkpoint


def describe_change(flag: str, old, new) -> str:
    """One changed flag as a person reads it: --max_steps 0 is "no limit" (the run's epochs decide)."""
    def value(v) -> str:
        return f"{v!r} (no limit)" if flag == "max_steps" and v == 0 else repr(v)
    return f"--{flag} {value(old)} -> {value(new)}"


def check_run_name(save_dir: str, name: str, from_resume: int, start_over: int) -> None:
    """At start-up, before the data is checked and the models are built (and again under the run lock): a run of
    this name in progress (it holds SAVE_DIR/NAME.lock) is refused, and so is an existing run's resume file that
    neither --from_resume 1 nor --start_over 1 says what to do with."""
    message = RunLock(os.path.join(save_dir, f"{name}.lock")).refusal_now()
    if message:
        refuse(message)
    resume_path = os.path.join(save_dir, f"{name}_resume.pt")
    if os.path.exists(resume_path) and not from_resume and not start_over:
        refuse(f"{resume_path} holds a run of this name: continue it with --from_resume 1, pass --start_over 1 to "
               f"move its files aside and start anew, or choose another --save_weight")


def trained_dtype(checkpoint: dict) -> str:
    """The dtype a checkpoint's run computed in. Files written before the precision rule was device-independent
    do not record it: then CUDA autocast ran in --dtype and the CPU in fp32 whatever --dtype said."""
    if "dtype" in checkpoint:
        return checkpoint["dtype"]
    args = checkpoint["args"]
    return args["dtype"] if str(args["device"]).startswith("cuda") else "float32"
