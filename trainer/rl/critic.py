"""PPO's critic beside the run's policy: its model (model/value.py), built as the student is -- from --critic_path,
else the student's own --model_path (or its --model_config and --seed), its head zero unless the folder is a critic's
export; with --lora_rank adapters on its frozen body (which, taken from the student's base, is the student's tensors:
no second copy) and its head trained whole; with --fsdp 1 sharded as the student is. Its own AdamW and learning
rate, its backward and updates under the same exact normalisation as the policy's
(trainer/skeleton/optimizer_step.py), and its state in the policy's resume file (Run.keep_state: one commit for
both) -- with --fsdp 1 in a shard folder of its own that the resume file names."""
from __future__ import annotations

import argparse
import contextlib
import os

import torch
from torch.nn.parallel import DistributedDataParallel

from common.files import check_free_space, raise_disk_error
from model.checkpoint_io import save_pretrained
from model.lora import adapter_count, base_digest
from model.value import Qwen3ValueModel, is_value_export
from trainer.losses.chunked import completion_hidden
from trainer.losses.ppo import OLD_VALUE, RETURN, value_loss
from trainer.skeleton.checkpoint import check_base, expected_save_bytes, load_trained_state
from trainer.skeleton.loading import build_model, check_embedding, lora_settings
from trainer.skeleton.optimizer_step import get_lr, loss_divisor, window_step
from trainer.skeleton.run import Run
from trainer.skeleton.sharding import is_sharded, load_shards, reshard_root, save_shards
from trainer.skeleton.window_metrics import all_reduce_sum


class Critic:
    def __init__(self, run: Run, args: argparse.Namespace, tokenizer):
        self.run, self.args = run, args
        self.raw_model = build_critic(args, run.device, run.raw_model)
        check_embedding(self.raw_model, tokenizer, "critic")
        self.model = (DistributedDataParallel(self.raw_model, device_ids=[run.dist.local_rank]
                                              if run.device.startswith("cuda") else None)
                      if run.dist.enabled and not args.fsdp else self.raw_model)
        self.optimizer = torch.optim.AdamW([p for p in self.raw_model.parameters() if p.requires_grad],
                                           lr=args.critic_learning_rate, weight_decay=args.weight_decay,
                                           betas=(0.9, 0.95), fused=True)
        self.scaler = run.precision.scaler()
        # a LoRA critic's frozen body, by its digest (its head is trained): a resume onto another is refused
        self.base_digest = base_digest(self.raw_model.model) if adapter_count(self.raw_model) else None
        self.export_dtype = torch.float32 if self.base_digest else None  # merged adapters: as the student's export
        # the value loss and tokens backwarded since the last update
        self.pending = torch.zeros(2, dtype=torch.float64, device=run.device)
        run.keep_state("critic", self.state)
        if "critic" in run.state.kept:
            self.load(run.state.kept["critic"])

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """V(s_t) at each completion position (completion_hidden's order), no gradient."""
        with torch.no_grad(), self.run.autocast():
            hidden, _ = completion_hidden(self.model, input_ids, attention_mask, labels)
            values = (hidden @ self.raw_model.lm_head.weight.T).squeeze(-1).float()
        reshard_root(self.raw_model)  # no backward follows: a sharded root's gathered head is given back now
        return values

    def micro_step(self, index: int, size: int):
        """As Run.micro_step: DDP syncs the critic's gradients on a minibatch's last part only (FSDP
        reduce-scatters after every backward)."""
        if self.run.dist.enabled and not self.args.fsdp and index < size - 1:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def backward(self, part, metrics) -> None:
        """The clipped value loss of one minibatch part (its old values and returns: trainer/losses/ppo.py's
        columns of `part.values`), summed and backwarded; its mean and clip fraction into the window's `metrics`."""
        with self.run.autocast():
            hidden, _ = completion_hidden(self.model, part.input_ids, part.attention_mask, part.labels)
            values = (hidden @ self.raw_model.lm_head.weight.T).squeeze(-1).float()
        keep = torch.ones_like(values, dtype=torch.bool)
        loss, clipped = value_loss(values, part.values[:, OLD_VALUE], part.values[:, RETURN], keep,
                                   self.args.value_clip)
        self.scaler.scale(loss / loss_divisor(self.args)).backward()
        self.pending += torch.stack([loss.detach().double(), torch.tensor(float(len(values)), dtype=torch.float64,
                                                                          device=loss.device)])
        metrics.ratio("value_loss", loss.detach(), len(values))
        metrics.ratio("value_clip_fraction", clipped, len(values))

    def update(self) -> float:
        """The gradients since the last update over all ranks, divided by their tokens, clipped, AdamW at the
        step's critic rate -> the gradient norm."""
        loss_sum, tokens = all_reduce_sum(self.pending.clone(), self.run.dist).tolist()
        run = self.run
        lr = get_lr(run.state.step, run.total_steps, self.args.critic_learning_rate, run.warmup_steps)
        scale = loss_divisor(self.args) * run.dist.world_size / max(tokens, 1.0)
        # the mean value loss: a non-finite one stops the run before it reaches the critic (window_step)
        norm, _ = window_step(self.raw_model, self.optimizer, self.scaler, lr, scale, self.args.grad_clip,
                              loss_sum / max(tokens, 1.0), run.state.step + 1)
        self.pending.zero_()
        return norm

    def state(self) -> dict:
        """What a save keeps of the critic, every rank (rank 0's is written): its trained weights (a LoRA critic's
        adapters and head) and AdamW's state -- with --fsdp 1 each rank's shards, in a folder of their own that
        this names --, its loss scale, its frozen body's digest."""
        kept = {"scaler": self.scaler.state_dict(), "base_sha256": self.base_digest}
        if self.args.fsdp:
            folder = save_shards(self.run.out_prefix + "_resume", self.run.step, self.raw_model, self.optimizer,
                                 self.run.dist.is_main, part="critic-")
            return {**kept, "shards": os.path.basename(folder)}
        if not self.run.dist.is_main:
            return kept  # unsharded, only rank 0's is written: no other rank copies the weights
        trained = {name for name, p in self.raw_model.named_parameters() if p.requires_grad}
        weights = {k: v.detach().cpu().clone() for k, v in self.raw_model.state_dict().items() if k in trained}
        return {**kept, "model": weights, "optimizer": self.optimizer.state_dict()}

    def load(self, state: dict) -> None:
        """A resumed run's critic, from the resume file's kept state (a shard folder at any world size, or the
        file's own weights)."""
        check_base(state, self.base_digest, f"{self.run.resume_path} (the critic)")
        if state.get("shards"):
            load_shards(os.path.join(self.args.save_dir, state["shards"]), self.raw_model, self.optimizer)
        else:
            load_trained_state(self.raw_model, state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])

    def export(self) -> None:
        """NAME_critic/ beside the policy's export (before the resume file: the commit point); rank 0 writes it,
        every rank of a sharded critic sends its rows."""
        path = f"{self.run.out_prefix}_critic"
        check_free_space(self.args.save_dir, expected_save_bytes(self.raw_model, self.export_dtype),
                         f"the critic's checkpoint of step {self.run.step}")
        if not self.run.dist.is_main and not is_sharded(self.raw_model):
            return
        try:
            save_pretrained(self.raw_model, path, tokenizer_dir=None, dtype=self.export_dtype,
                            write=self.run.dist.is_main)
        except OSError as error:
            raise_disk_error(error, f"the critic's export of step {self.run.step} to {path}")


def build_critic(args: argparse.Namespace, device: str, student: torch.nn.Module) -> Qwen3ValueModel:
    """The critic at the run's start: --critic_path (a critic's export: whole; a causal LM: its body), else the
    student's own source's body; a head from no critic's export is zero (V = 0 everywhere: the first targets are the
    returns themselves). A LoRA critic built from the student's own base shares the student's frozen tensors."""
    source = args.critic_path or args.model_path
    whole = bool(source) and is_value_export(source)
    critic = build_model(args, device, path=source, config_path=None if args.critic_path else args.model_config,
                         lora=lora_settings(args), model_class=Qwen3ValueModel, body_only=not whole)
    if source is None:  # a random student's: its body as drawn (a tied config's embedding is its head's draw)
        critic.model.load_state_dict(student.model.state_dict())
    if not whole:
        with torch.no_grad():
            critic.lm_head.weight.zero_()
    if adapter_count(student) and not args.critic_path and not is_sharded(critic):
        share_frozen_body(critic, student)
    return critic


def share_frozen_body(critic: Qwen3ValueModel, policy: torch.nn.Module) -> None:
    """A LoRA critic's frozen body, loaded from the student's own base, replaced by the student's frozen tensors
    (equal: checked first), so the base is held once. Its adapters and head stay its own."""
    own = dict(policy.named_parameters())
    for name, p in list(critic.named_parameters()):
        if p.requires_grad:
            continue
        if not torch.equal(p, own[name]):
            raise RuntimeError(f"the critic's frozen {name} differs from the student's: not the same base")
        module, attribute = name.rsplit(".", 1)
        setattr(critic.get_submodule(module), attribute, own[name])
