"""PPO's critic beside the run's policy: its model (model/value.py), its own AdamW and learning rate, its backward
and updates under the same exact normalisation as the policy's (trainer/skeleton/optimizer_step.py), and its state
in the policy's resume file (Run.keep_state: one commit for both). One process or DDP: not sharded, no LoRA (refused
at start-up: trainer/config/ppo.py)."""
from __future__ import annotations

import argparse
import contextlib

import torch
from torch.nn.parallel import DistributedDataParallel

from model.checkpoint_io import save_pretrained
from model.value import value_model_from
from trainer.losses.chunked import completion_hidden
from trainer.losses.ppo import OLD_VALUE, RETURN, value_loss
from trainer.skeleton.optimizer_step import get_lr, loss_divisor, window_step
from trainer.skeleton.run import Run
from trainer.skeleton.window_metrics import all_reduce_sum


class Critic:
    def __init__(self, run: Run, args: argparse.Namespace):
        self.run, self.args = run, args
        self.raw_model = value_model_from(run.raw_model)
        self.model = (DistributedDataParallel(self.raw_model, device_ids=[run.dist.local_rank]
                                              if run.device.startswith("cuda") else None)
                      if run.dist.enabled else self.raw_model)
        self.optimizer = torch.optim.AdamW(self.raw_model.parameters(), lr=args.critic_learning_rate,
                                           weight_decay=args.weight_decay, betas=(0.9, 0.95), fused=True)
        self.scaler = run.precision.scaler()
        # the value loss and tokens backwarded since the last update
        self.pending = torch.zeros(2, dtype=torch.float64, device=run.device)
        run.keep_state("critic", self.state)
        if "critic" in run.state.kept:
            self.load(run.state.kept["critic"])

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """V(s_t) at each completion position (completion_hidden's order), no gradient."""
        with torch.no_grad(), self.run.autocast():
            hidden, _ = completion_hidden(self.model, input_ids, attention_mask, labels)
            return (hidden @ self.raw_model.lm_head.weight.T).squeeze(-1).float()

    def micro_step(self, index: int, size: int):
        """As Run.micro_step: DDP syncs the critic's gradients on a minibatch's last part only."""
        if self.run.dist.enabled and index < size - 1:
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
        """What a save keeps of the critic (rank 0's: the same on every rank under DDP)."""
        return {"model": {k: v.detach().cpu().clone() for k, v in self.raw_model.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict()}

    def load(self, state: dict) -> None:
        """A resumed run's critic, from the resume file's kept state."""
        self.raw_model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scaler.load_state_dict(state["scaler"])

    def export(self) -> None:
        """NAME_critic/ beside the policy's export, rank 0 (before the resume file: the commit point)."""
        if self.run.dist.is_main:
            save_pretrained(self.raw_model, f"{self.run.out_prefix}_critic", tokenizer_dir=None)
