"""Under torchrun: join the process group and build a model the way the training scripts do, then print where the
model's weights are. `python -m torch.distributed.run --nproc_per_node 2 tests/device_probe.py CONFIG DEVICE`"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from trainer.skeleton.distributed import init_distributed_mode  # noqa: E402
from trainer.skeleton.loading import build_model  # noqa: E402

config, device = sys.argv[1], sys.argv[2]
info = init_distributed_mode(device)
model = build_model(argparse.Namespace(seed=0, fsdp=0, dtype="float32"), info.device, config_path=config)
print(f"rank {info.rank} local_rank {info.local_rank} device {info.device} weights {next(model.parameters()).device}",
      flush=True)
dist.destroy_process_group()
