"""Run under torchrun by tests/test_fsdp_loading.py: build CONFIG's seeded random model sharded over the ranks
(each rank only its shards), then export it with files of at most MAX_BYTES -- streamed tensor by tensor, each rank
sending its rows of each to rank 0, which writes them.

    torchrun --nproc_per_node 2 tests/fsdp_export_worker.py CONFIG SEED OUT_DIR MAX_BYTES
"""
import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import Qwen3Config, save_pretrained  # noqa: E402
from trainer.skeleton.sharding import sharded_random_model  # noqa: E402


def main(config_path: str, seed: str, out_dir: str, max_bytes: str) -> None:
    dist.init_process_group("gloo")
    model = sharded_random_model(Qwen3Config.from_json(config_path), int(seed), "cpu")
    save_pretrained(model, out_dir, write=dist.get_rank() == 0, max_shard_bytes=int(max_bytes))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
