"""Run under torchrun by tests/test_lockstep_generate.py: two ranks greedy-decode the same prompts with CONFIG's
seeded random model sharded over them (every forward all-gathers each layer: the ranks must step together), but rank
0 stops at EOS_IDS (comma-separated) and rank 1 has no EOS: the divergence a greedy rounding difference between ranks could cause.
Each rank writes its completions to OUT_DIR/rank<r>.json. With STOP_TOGETHER 0 the ranks decode as one process would,
each on its own, and rank 1 waits in an all-gather rank 0 never joins (the group's timeout is TIMEOUT_S).

    torchrun --nproc_per_node 2 tests/lockstep_worker.py CONFIG EOS_IDS STOP_TOGETHER TIMEOUT_S OUT_DIR
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from model import Qwen3Config, generate  # noqa: E402
from trainer.evaluation.heldout import stop_together  # noqa: E402
from trainer.skeleton.sharding import sharded_random_model  # noqa: E402


def main(config_path: str, eos_ids: str, together: str, timeout_s: str, out_dir: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(timeout_s)))
    rank = dist.get_rank()
    model = sharded_random_model(Qwen3Config.from_json(config_path), 0, "cpu").eval()
    ids = torch.randint(0, 1000, (2, 6), generator=torch.Generator().manual_seed(0))
    out = generate(model, ids, None, 16, do_sample=False, eos_token_id=[int(i) for i in eos_ids.split(",")] if rank == 0 else None,
                   pad_token_id=0, all_stopped=stop_together("cpu") if int(together) else None)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out.completion_ids.tolist(), f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
