"""TRL 1.16.0's own DPO numbers for a batch saved by tests/test_dpo.py. Runs inside the TRL venv, never in the repo's
environment:

    ~/.cache/distill/trl-venv/bin/python tests/trl_dpo_probe.py IN.pt OUT.pt

The saved batch is the tiny Qwen3's: its final hidden states at every position of 2P right-padded sequences (the P
chosen answers first, as TRL's collator lays them out), its lm_head, the labels, and the reference's (another
model's hidden states and head, or its summed log-probabilities for precompute_ref_log_probs). DPOTrainer.__init__
needs a model, a tokenizer and a dataset, so the trainer is made with `DPOTrainer.__new__` and given the attributes
its __init__ sets from a real DPOConfig (TRL's defaults for the rest); then its real `_compute_loss` runs. The models
are stand-ins for what `add_fused_lm_head` makes of a model: `model(..., labels=labels, fused_lm_head=True)` returns
the per-token log-probabilities of the labels (through TRL's selective_log_softmax over the head's logits), 0 where
the next label is -100, and the per-token fields `_compute_loss` logs. Saved per case: the loss, its gradients with
respect to the hidden states and the head, and TRL's logged rewards, margins and accuracies.
"""
import sys
import tempfile
from collections import defaultdict
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from trl import DPOConfig, DPOTrainer
from trl.trainer.utils import entropy_from_logits, selective_log_softmax


class FusedHead(torch.nn.Module):
    """Stands in for a model with TRL's fused LM head, from saved final hidden states (B, T, H) and a head (V, H)."""
    is_gradient_checkpointing = False

    def __init__(self, hidden: torch.Tensor, head: torch.Tensor):
        super().__init__()
        self.hidden, self.head = torch.nn.Parameter(hidden.clone()), torch.nn.Parameter(head.clone())

    def forward(self, input_ids, attention_mask=None, labels=None, fused_lm_head=False, use_cache=None):
        assert fused_lm_head and input_ids.shape == self.hidden.shape[:2]
        logits = self.hidden[:, :-1] @ self.head.T
        labels = labels[:, 1:]
        mask = labels != -100
        log_probs = selective_log_softmax(logits, labels.clamp(min=0)).masked_fill(~mask, 0)
        return SimpleNamespace(log_probs=log_probs, entropy=entropy_from_logits(logits.detach()),
                               mean_logits=logits.detach().mean(-1), is_top1=logits.detach().argmax(-1) == labels,
                               aux_loss=None)


def make_trainer(data: dict, case: dict, out_dir: str) -> DPOTrainer:
    args = DPOConfig(output_dir=out_dir, use_cpu=True, report_to="none", beta=data["beta"],
                     loss_type=case["loss_type"], loss_weights=case["loss_weights"],
                     precompute_ref_log_probs=case["precompute"])
    trainer = DPOTrainer.__new__(DPOTrainer)
    trainer.args = args
    # the attributes DPOTrainer.__init__ sets from args
    trainer.beta, trainer.precompute_ref_logps = args.beta, args.precompute_ref_log_probs
    trainer.loss_types, trainer.loss_weights = args.loss_type, args.loss_weights or [1.0] * len(args.loss_type)
    trainer.ld_alpha, trainer.f_divergence_type = args.ld_alpha, args.f_divergence_type
    trainer.f_alpha_divergence_coef = args.f_alpha_divergence_coef
    trainer.label_smoothing, trainer.use_weighting = args.label_smoothing, args.use_weighting
    trainer.accelerator = Accelerator(cpu=True)
    trainer.aux_loss_enabled = False
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer._total_train_tokens, trainer._tp_size = 0, 1
    return trainer


def run_case(data: dict, case: dict, out_dir: str) -> dict:
    trainer = make_trainer(data, case, out_dir)
    policy = FusedHead(data["hidden"], data["head"])
    trainer.model = policy
    trainer.ref_model = None if case["precompute"] else FusedHead(data["ref_hidden"], data["ref_head"])
    inputs = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"],
              "completion_mask": data["completion_mask"]}
    if case["precompute"]:
        inputs["ref_chosen_logps"], inputs["ref_rejected_logps"] = data["ref_logps"].unbind(1)
    loss = trainer._compute_loss(policy, inputs, return_outputs=False)
    loss.backward()
    metrics = trainer._metrics["train"]
    return {"loss": loss.detach(), "grad_hidden": policy.hidden.grad, "grad_head": policy.head.grad,
            **{name: metrics[name][-1] for name in ("rewards/chosen", "rewards/rejected", "rewards/margins",
                                                   "rewards/accuracies")}}


def main(in_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    data = torch.load(in_path)
    with tempfile.TemporaryDirectory() as out_dir:
        results = {case["name"]: run_case(data, case, out_dir) for case in data["cases"]}
    torch.save(results, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
