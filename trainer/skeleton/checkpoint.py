"""Where a run's checkpoints are written and how they are read back: the HF export, the resume file (the commit
point), the sharded checkpoint folders of --fsdp 1 and the RNG states of every rank (what a resume checks first:
trainer/skeleton/resume_checks.py).

For --save_dir SAVE_DIR --save_weight NAME:
    SAVE_DIR/NAME/                          the HF export (transformers and vLLM load it)
    SAVE_DIR/NAME_resume.pt                 the resume file: written last, so when it says step N the export of step N
                                            is complete (a kill during an export resumes from the step before)
    SAVE_DIR/NAME_resume.shards-STEP-ID/    --fsdp 1: model and optimizer shards (DCP), named by the resume file
    SAVE_DIR/NAME_COMPANION/                the export of a model trained beside the run's (PPO's critic), and its
    SAVE_DIR/NAME_resume.shards-COMPANION-STEP-ID/   shards, named by the resume file's kept state of the loop
Every file is written beside its target and renamed into place (common/files.py). Resume files written before
q/k/v and gate/up were fused (their weights and AdamW state under HF's names and numbering) still resume: they are
converted as they load (`fused_resume_state`; a shard folder: sharding.load_shards).
"""
from __future__ import annotations

import argparse
import glob
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from common.errors import UserError
from common.files import atomic_write, check_free_space, raise_disk_error, remove_stale_temporaries
from common.seeds import derived_seed, seed_everything
from model import save_pretrained
from model.checkpoint_io import HFBlock, fuse, hf_layout
from model.lora import adapter_count, is_adapter, save_peft_adapter
from model.precision import resolve_precision
from trainer.skeleton.distributed import DistInfo, print0
from trainer.skeleton.resume_checks import CHECKPOINT_FORMAT, check_run_name, load_checkpoint
from trainer.skeleton.run_state import RunState, merge_rollouts
from trainer.skeleton.sharding import is_sharded, load_shards, remove_other_shards, save_shards

class UnreadableResumeFile(Exception):
    """The resume file exists but cannot be read (resuming reports it as damaged)."""


class WriteRecorder:
    """A file object's writes, passed through; the OSError of a failed write is kept, errno and all (torch.save
    reports such a failure as a RuntimeError of its own, whose message is no way to tell a full disk)."""

    def __init__(self, file):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def __getattr__(self, name: str):
        return getattr(self.file, name)  # flush, tell, ...: the file's own


class Checkpoints:
    """One run name's checkpoints (see the module docstring). Every rank holds one; rank 0 writes the files."""

    def __init__(self, args: argparse.Namespace, info: DistInfo, tokenizer_dir: str | None,
                 resumable: set[str], accepted_changes: set[str], base_digest: str | None = None,
                 companions: tuple[str, ...] = ()):
        """`resumable`: the flags a resume may change (the loop's config); `accepted_changes`: those --resume_changes
        lets differ from the checkpoint's besides; `base_digest`: a LoRA student's frozen base (model/lora.py);
        `companions`: the models a loop trains beside the run's, exported as NAME_COMPANION/ (PPO's "critic")."""
        self.args, self.dist, self.tokenizer_dir, self.companions = args, info, tokenizer_dir, companions
        self.resumable, self.accepted_changes, self.base_digest = resumable, accepted_changes, base_digest
        self.prefix = os.path.join(args.save_dir, args.save_weight)
        self.resume_path = f"{self.prefix}_resume.pt"
        self.metrics_path = f"{self.prefix}_metrics.jsonl"
        # a LoRA student's export: the merged model in fp32 (a bf16 base plus fp32 adapters is not a bf16 number),
        # and beside it the adapter alone, in PEFT's format
        self.export_dtype = torch.float32 if base_digest else None

    # -- start-up -------------------------------------------------------------------------------------------------

    def prepare(self, lock) -> None:
        """Rank 0, before anything is written: take the run lock, refuse to start over a run by accident (or set it
        aside when asked), and remove what killed runs of this name left half-written."""
        if not self.dist.is_main:
            return
        os.makedirs(self.args.save_dir, exist_ok=True)  # first created here: a run refused before leaves no folder
        lock.acquire()
        try:
            # again, under the lock: another run may have saved since start-up
            check_run_name(self.args.save_dir, self.args.save_weight, self.args.from_resume, self.args.start_over)
        except UserError:
            lock.release()
            raise
        if os.path.exists(self.resume_path) and not self.args.from_resume:
            self.set_aside()
        for path in self.run_files():
            for stale in remove_stale_temporaries(path):
                print0(f"removed {stale}, left half-written by a run that was killed")
        self.remove_uncommitted_shards()

    def set_aside(self) -> None:
        """--start_over 1: the previous run's files into SAVE_DIR/NAME.replaced-TIME/."""
        aside = f"{self.prefix}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
        os.makedirs(aside)
        for path in self.run_files():
            if os.path.exists(path):
                os.replace(path, os.path.join(aside, os.path.basename(path)))
        print0(f"--start_over 1: the previous run's files are in {aside}/")

    def remove_uncommitted_shards(self) -> None:
        """Shard folders the resume file does not name were written by a run killed before it committed them."""
        if not self.shard_folders():
            return
        try:
            committed = self.committed_shards()
        except UnreadableResumeFile as error:
            print0(f"{error}; its shard folders are left alone")
            return
        for stale in remove_other_shards(self.prefix + "_resume", keep=committed):
            print0(f"removed {stale}, written by a run that was killed before it committed them")

    def run_files(self) -> list[str]:
        """Every file and folder of this run name."""
        return [self.prefix, f"{self.prefix}_adapter", *(f"{self.prefix}_{name}" for name in self.companions),
                self.resume_path, self.metrics_path, *self.shard_folders(), *self.snapshots()]

    def shard_folders(self) -> list[str]:
        """The folders of sharded checkpoints of this run name (NAME_resume.shards-STEP-TOKEN)."""
        return glob.glob(f"{glob.escape(self.prefix)}_resume.shards-*")

    def snapshots(self) -> list[str]:
        """The exports of --export_steps: NAME_stepSTEP for each step asked now (where a killed run's temporaries may
        lie) and each one an earlier run of this name wrote."""
        asked = [f"{self.prefix}_step{step}" for step in self.args.export_steps]
        return sorted(set(asked) | set(glob.glob(f"{glob.escape(self.prefix)}_step[0-9]*")))

    def committed_shards(self) -> set[str]:
        """The shard folders the resume file names (none: no resume file, or an unsharded one).
        UnreadableResumeFile when the resume file cannot be read."""
        if not os.path.exists(self.resume_path):
            return set()
        try:
            checkpoint = torch.load(self.resume_path, map_location="cpu", weights_only=False)
        except Exception as error:  # torch raises several types for a damaged file: reported, not swallowed
            raise UnreadableResumeFile(f"{self.resume_path} cannot be read ({type(error).__name__})") from None
        return self.named_shards(checkpoint) if isinstance(checkpoint, dict) else set()

    def named_shards(self, checkpoint: dict) -> set[str]:
        """The shard folders a resume record names: the run's model's, and any a loop's kept state names (PPO's
        critic's)."""
        kept = [state for state in (checkpoint.get("kept") or {}).values() if isinstance(state, dict)]
        names = [checkpoint.get("shards"), *(state.get("shards") for state in kept)]
        return {os.path.join(self.args.save_dir, name) for name in names if name}

    # -- writing --------------------------------------------------------------------------------------------------

    def save(self, model: torch.nn.Module, optimizer, scaler, state: RunState, global_batch: int) -> None:
        """Every rank: the HF folder, then the resume checkpoint (every rank's RNG gathered to rank 0), written by
        rank 0 (with --fsdp 1 each rank writes its shards, and sends its rows of each tensor of the export to rank 0,
        tensor by tensor). The resume file is written last: it is the commit point."""
        rng = collect_rng_states(self.dist)
        rollouts = collect_rollouts(state, self.dist)
        # every rank checks (one filesystem): a refusal on rank 0 alone would leave the others in a collective
        check_free_space(self.args.save_dir, expected_save_bytes(model, self.export_dtype),
                         f"the checkpoint of step {state.step}")
        shards = None
        if self.args.fsdp:
            shards = save_shards(self.prefix + "_resume", state.step, model, optimizer, self.dist.is_main)
        if self.dist.is_main:
            checkpoint = self.resume_record(model, optimizer, scaler, state, global_batch, rng, shards, rollouts)
            self.write(model, checkpoint, shards, state.step)
        elif is_sharded(model):  # the export comes tensor by tensor, each rank's rows in turn: every rank sends
            self.export(model, self.prefix, write=False)
        if self.dist.enabled:
            dist.barrier()

    def export_snapshot(self, model: torch.nn.Module, step: int) -> None:
        """Every rank (an FSDP export gathers each tensor): the HF folder of this step as SAVE_DIR/NAME_stepSTEP/
        (--export_steps), beside the run's own folder, which later saves replace. A run resumed from before this
        step writes it again, the same weights."""
        path = f"{self.prefix}_step{step}"
        check_free_space(self.args.save_dir, expected_save_bytes(model, self.export_dtype),
                         f"the export of step {step}")
        if self.dist.is_main:
            try:
                self.export(model, path)
            except OSError as error:
                raise_disk_error(error, f"the export of step {step} to {path}")
            print0(f"exported step {step} to {path}/ (--export_steps)")
        elif is_sharded(model):
            self.export(model, path, write=False)
        if self.dist.enabled:
            dist.barrier()

    def export(self, model: torch.nn.Module, path: str, write: bool = True) -> None:
        """The HF folder `path` (a LoRA student's merged), and a LoRA student's adapter alone as `path`_adapter/
        (PEFT's format). Every rank of a sharded model calls this; rank 0, with `write`, writes."""
        save_pretrained(model, path, tokenizer_dir=self.tokenizer_dir, dtype=self.export_dtype, write=write)
        if self.base_digest:
            save_peft_adapter(model, f"{path}_adapter", self.args.model_path, write=write)

    def resume_record(self, model: torch.nn.Module, optimizer, scaler, state: RunState, global_batch: int,
                      rng: list[dict], shards: str | None, rollouts: dict[int, dict]) -> dict:
        """What the resume file holds (docs/architecture.md, "Invariant 3")."""
        return {
            "format": CHECKPOINT_FORMAT,
            "model": None if shards else {k: v.detach().float().cpu() for k, v in model.state_dict().items()
                                          if not self.base_digest or is_adapter(k)},  # LoRA: the adapters alone
            "base_sha256": self.base_digest,
            "optimizer": None if shards else optimizer.state_dict(),
            "shards": os.path.basename(shards) if shards else None,  # model + optimizer, in that folder
            "model_config": model.config.to_hf_dict(),
            "scaler": scaler.state_dict(),
            "epoch": state.epoch, "step": state.step, "samples_in_epoch": state.samples_in_epoch,
            "global_batch": global_batch, "world_size": self.dist.world_size,
            "swanlab_run_id": state.swanlab_run_id, "skipped_steps": state.skipped_steps, "elapsed_s": state.elapsed_s,
            "args": vars(self.args),
            "dtype": resolve_precision(self.dist.device, self.args.dtype).name, "rng": rng,
            "rollouts": rollouts, "kept": state.kept,
        }

    def write(self, model: torch.nn.Module, checkpoint: dict, shards: str | None, step: int) -> None:
        """Rank 0: the export, then the resume file; a full disk or a read-only folder is one line."""
        what = f"the checkpoint of step {step} to {self.args.save_dir} (the previous checkpoint is intact)"
        try:
            self.export(model, self.prefix)
            with atomic_write(self.resume_path) as f:
                recorder = WriteRecorder(f)
                try:
                    torch.save(checkpoint, recorder)
                except RuntimeError:
                    if recorder.error is None:
                        raise
                    raise recorder.error from None  # the write's own OSError, with its errno
            if self.shard_folders():  # this save's, and older or uncommitted ones
                remove_other_shards(self.prefix + "_resume", keep=self.named_shards(checkpoint))
        except OSError as error:
            raise_disk_error(error, what)

    # -- reading --------------------------------------------------------------------------------------------------

    def resume(self, model: torch.nn.Module, optimizer, scaler, global_batch: int,
               dataset_size: int | None) -> RunState:
        """Every rank: the state the resume file describes, loaded into model, optimizer and scaler, RNGs restored;
        a fresh RunState (said in one line) when there is no resume file. `dataset_size`: an epoch's rows (None: a
        streamed corpus not counted, whose stream names each window's epoch)."""
        if not os.path.exists(self.resume_path):
            print0(f"--from_resume 1: no checkpoint at {self.resume_path}, starting from scratch")
            return RunState()
        checkpoint = load_checkpoint(self.resume_path, self.args, global_batch, model, self.resumable,
                                     self.accepted_changes)
        check_base(checkpoint, self.base_digest, self.resume_path)
        if checkpoint.get("shards"):  # every rank reads its part, resharded to this world size
            load_shards(os.path.join(self.args.save_dir, checkpoint["shards"]), model, optimizer)
        else:
            weights, moments = fused_resume_state(checkpoint, model, self.resume_path)
            load_trained_state(model, weights)
            optimizer.load_state_dict(moments)
        scaler.load_state_dict(checkpoint["scaler"])
        state = RunState(checkpoint["epoch"], checkpoint["step"], checkpoint["samples_in_epoch"],
                         checkpoint["swanlab_run_id"], checkpoint.get("skipped_steps", 0),
                         checkpoint.get("elapsed_s", 0.0), checkpoint.get("rollouts") or {},
                         checkpoint.get("kept") or {})
        if dataset_size is not None and state.samples_in_epoch >= (dataset_size // self.dist.world_size) * \
                self.dist.world_size:
            state.epoch, state.samples_in_epoch = state.epoch + 1, 0
        restore_rng_states(checkpoint["rng"], checkpoint["world_size"], self.dist, self.args.seed, state.step)
        ranks = checkpoint["world_size"]
        where = (f"epoch {state.epoch + 1} of {self.args.epochs}, {state.samples_in_epoch} samples into it"
                 if state.epoch < self.args.epochs else f"all {self.args.epochs} epoch(s) done")
        print0(f"resumed from {self.resume_path}: step {state.step}, {where} (saved by {ranks} "
               f"rank{'s' if ranks > 1 else ''})")
        return state


def fused_resume_state(checkpoint: dict, model: torch.nn.Module, path: str) -> tuple[dict, dict]:
    """A single-process resume file's model and optimizer state dicts, for `model`'s parameters. One written before
    q/k/v and gate/up were fused holds them under HF's names (model/checkpoint_io.py, `hf_layout`) and its AdamW
    state numbers them in that order: its weights and moments are concatenated into the fused parameters' (exact),
    its parameters renumbered."""
    weights, state = checkpoint["model"], model.state_dict()
    layout = hf_layout(state, model.config)  # with a tied head, as the state dicts hold it
    if weights.keys() == state.keys() or weights.keys() != layout.keys():
        return weights, checkpoint["optimizer"]  # this layout (or a foreign one, which load_state_dict names)
    parameters = hf_layout(dict(model.named_parameters()), model.config)  # the optimizer's: a tied head once
    return fuse(weights, layout), fused_optimizer_state(checkpoint["optimizer"], parameters, path)


def fused_optimizer_state(saved: dict, layout: dict[str, HFBlock], path: str) -> dict:
    """A torch optimizer's state_dict over the unfused parameters (numbered in `layout`'s order, HF's) -> over
    ours: each fused parameter's per-element state (AdamW's moments) its blocks' concatenated in row order, its
    scalar state (AdamW's step) its blocks', which must agree."""
    blocks: dict[str, list[int]] = {}  # our parameter -> the old numbers of its blocks, in row order
    for old, block in enumerate(layout.values()):
        blocks.setdefault(block.parameter, []).append(old)
    renumbered = {old: new for new, olds in enumerate(blocks.values()) for old in olds}
    state = {}
    for new, (name, olds) in enumerate(blocks.items()):
        if olds[0] not in saved["state"]:
            continue  # no state yet (no step taken)
        parts = [saved["state"][old] for old in olds]
        state[new] = {key: _fused_value([part[key] for part in parts], f"the {key} of {name}", path)
                      for key in parts[0]}
    groups = [{**group, "params": list(dict.fromkeys(renumbered[old] for old in group["params"]))}
              for group in saved["param_groups"]]
    return {"state": state, "param_groups": groups}


def _fused_value(values: list[torch.Tensor], what: str, path: str) -> torch.Tensor:
    """One entry of a fused parameter's optimizer state from its blocks': per-element state concatenated, a scalar
    (the step count) the same in every block."""
    if values[0].dim():
        return torch.cat(values) if len(values) > 1 else values[0]
    if any(not torch.equal(value, values[0]) for value in values):
        raise UserError(f"{path}: {what} differs between its unfused blocks ({[float(v) for v in values]}), which "
                        f"no run writes: the file is damaged; restore it from a backup, or pass --start_over 1 "
                        f"(without --from_resume) to set it aside and start anew")
    return values[0]


def expected_save_bytes(model: torch.nn.Module, export_dtype: torch.dtype | None = None) -> int:
    """Resume file (fp32 trained weights and AdamW's two moments: a LoRA student's adapters only) plus the HF export
    (in `export_dtype`, default each tensor's own; a LoRA student's adapter folder besides), both held beside the
    old ones."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return 3 * 4 * trained + export_bytes(model, export_dtype)


def export_bytes(model: torch.nn.Module, export_dtype: torch.dtype | None = None) -> int:
    """The HF export (in `export_dtype`, default each tensor's own), and a LoRA student's adapter folder (fp32)."""
    return sum(p.numel() * (export_dtype or p.dtype).itemsize for name, p in model.named_parameters()
               if not is_adapter(name)) + 4 * adapter_count(model)


def rank0_save_bytes(model: torch.nn.Module, sharded: bool, export_dtype: torch.dtype | None = None) -> int:
    """What rank 0 writes alone while the other ranks wait at the save's barrier: the resume file and the HF
    export; with --fsdp 1 the export only (every rank writes its own shards, the resume file holds no weights)."""
    if not sharded:
        return expected_save_bytes(model, export_dtype)
    return export_bytes(model, export_dtype)


def check_base(checkpoint: dict, digest: str | None, path: str) -> None:
    """A LoRA student's resume file names the base its adapters were trained on (sha256 of the frozen weights):
    another base, or a full fine-tuning checkpoint, is refused in one line."""
    saved = checkpoint.get("base_sha256")
    if saved == digest:
        return
    if digest is None or saved is None:
        raise UserError(f"{path} was written by a {'LoRA' if saved else 'full fine-tuning'} run: resume with the "
                        f"same --lora_rank, or use another --save_weight")
    raise UserError(f"{path} holds adapters trained on another base (its sha256 {saved[:12]}..., this one's "
                    f"{digest[:12]}...): resume with the same --model_path (or --model_config and --seed) and "
                    f"--dtype, or use another --save_weight")


def load_trained_state(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """A resume file's weights into `model`: all of them, or a LoRA student's adapters alone (its base comes from
    --model_path, checked by its digest: `check_base`); any other missing or unexpected key is torch's error."""
    if not any(is_adapter(name) for name in weights):
        model.load_state_dict(weights)
        return
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any(is_adapter(name) for name in missing):
        model.load_state_dict(weights)  # torch's own message names the keys


def collect_rng_states(info: DistInfo) -> list[dict] | None:
    """Every rank's RNG states, gathered to rank 0. CUDA: only the rank's own device (a resume on a node with
    fewer visible GPUs must still find each rank's state, and no rank draws on another's device)."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "cuda": torch.cuda.get_rng_state(info.device) if info.device.startswith("cuda") else None}
    if not info.enabled:
        return [state]
    gathered = [None] * info.world_size if info.is_main else None
    dist.gather_object(state, gathered, dst=0)
    return gathered


def collect_rollouts(state: RunState, info: DistInfo) -> dict[int, dict] | None:
    """Every rank's kept rollouts of the steps still to train, merged on rank 0 (None elsewhere)."""
    own = dict(state.rollouts)  # one copy at once: a background rollout may be adding a step
    if not info.enabled:
        return merge_rollouts([own], state.step)
    gathered = [None] * info.world_size if info.is_main else None
    dist.gather_object(own, gathered, dst=0)
    return merge_rollouts(gathered, state.step) if info.is_main else None


def restore_rng_states(states: list[dict], saved_world_size: int, info: DistInfo, seed: int, step: int) -> None:
    """Each rank takes back its own RNG state. After a world-size change there is no rank-to-rank mapping, so
    every rank re-seeds from (seed, rank, step) instead: reproducible, though not the uninterrupted stream."""
    if saved_world_size != info.world_size:
        seed_everything(derived_seed(seed, info.rank, step))
        return
    state = states[info.rank]
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and info.device.startswith("cuda"):
        torch.cuda.set_rng_state(state["cuda"], info.device)
