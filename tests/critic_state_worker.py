"""Run by tests/test_fsdp_estimate.py (under torchrun for the sharded case): PPO's critic built by train_ppo.py's
code (trainer/rl/critic.py's build_critic, beside the student it is built from) from CONFIG's random student, one
backward and one AdamW step, then the bytes this rank holds for the critic alone -- its parameters' storages that
are not the student's, its gradients, its optimizer state, local shards only -- written to OUT_DIR/RANK.json.

    [torchrun --nproc_per_node 2] tests/critic_state_worker.py CONFIG FSDP LORA_RANK OUT_DIR
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model.lora import TARGETS  # noqa: E402
from trainer.rl.critic import build_critic  # noqa: E402
from trainer.skeleton.loading import build_model, lora_settings  # noqa: E402


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a sharded tensor: this rank's shard


def local_bytes(t: torch.Tensor) -> int:
    return local(t).numel() * local(t).element_size()


def main(config_path: str, fsdp: str, lora_rank: str, out_dir: str) -> None:
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    args = argparse.Namespace(fsdp=int(fsdp), dtype="bfloat16", seed=0, model_path=None, model_config=config_path,
                              critic_path=None, lora_rank=int(lora_rank), lora_alpha=8.0, lora_dropout=0.0,
                              lora_targets=",".join(TARGETS))
    student = build_model(args, "cpu", config_path=config_path, lora=lora_settings(args))
    critic = build_critic(args, "cpu", student)
    trained = [p for p in critic.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-3, fused=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values = critic(torch.arange(12).view(2, 6)).logits
    values.float().sum().backward()
    optimizer.step()
    students = {local(p).untyped_storage().data_ptr() for p in student.parameters()}
    own = [p for p in critic.parameters() if local(p).untyped_storage().data_ptr() not in students]
    held = (sum(local_bytes(p) for p in own) + sum(local_bytes(p.grad) for p in trained)
            + sum(local_bytes(v) for state in optimizer.state.values() for v in state.values()
                  if isinstance(v, torch.Tensor) and v.dim()))
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(os.path.join(out_dir, f"{rank}.json"), "w", encoding="utf-8") as f:
        json.dump({"held": held, "shared": len(own) < len(list(critic.parameters()))}, f)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
