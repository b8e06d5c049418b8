"""What each rank holds for training, DDP against FSDP (--fsdp 1), and which Qwen3 student / teacher pairs fit.

    python benchmarks/bench_fsdp.py             # 2 ranks (it launches torchrun itself), CPU/gloo, qwen3-tiny
    python benchmarks/bench_fsdp.py --config model/configs/qwen3-tiny-student.json --nproc 4
    python benchmarks/bench_fsdp.py --sizing    # only the sizing table (arithmetic, no run)

Measured: one SFT optimizer step of the same model wrapped as train_sft.py wraps it (Run: DDP, or fully_shard per
decoder layer and root), then each rank's bytes of parameters, gradients and AdamW state -- its local shards
(`DTensor.to_local()`), everything else whole -- the fp32 master copy that training keeps; printed per rank with the
FSDP/DDP ratio. What is not counted: activations, and under FSDP the layer being computed, gathered whole for its
forward and backward (one decoder layer, or the root's embedding and head).

The sizing table is arithmetic from bytes per parameter: a trained student keeps 16 B/parameter (fp32 weights,
fp32 gradients, AdamW's two fp32 moments) on every GPU with DDP, 16/W with FSDP over W GPUs; a teacher in bf16 keeps
2 B/parameter, whole on every GPU (replicated) or 2/W (sharded). A pair "fits" when that stays within 80% of an
80 GB GPU, leaving 16 GB for activations, the gathered layer and the CUDA context; long sequences need more
(--gradient_checkpointing 1 cuts activations). Parameter counts: the Qwen3 model cards (embeddings included).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from model import Qwen3Config, create_model  # noqa: E402
from trainer.sharding import per_rank_training_bytes, shard  # noqa: E402

QWEN3_PARAMS = {"Qwen3-0.6B": 0.6e9, "Qwen3-1.7B": 1.7e9, "Qwen3-4B": 4.0e9, "Qwen3-8B": 8.2e9,
                "Qwen3-14B": 14.8e9, "Qwen3-32B": 32.8e9}
PAIRS = [("Qwen3-0.6B", "Qwen3-4B"), ("Qwen3-0.6B", "Qwen3-8B"), ("Qwen3-1.7B", "Qwen3-8B"),
         ("Qwen3-4B", "Qwen3-32B"), ("Qwen3-8B", "Qwen3-32B"), ("Qwen3-14B", "Qwen3-32B")]
BUDGET_GB = 0.8 * 80


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "model", "configs", "qwen3-tiny.json"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizing", action="store_true", help="print the sizing table only")
    p.add_argument("--out", help=argparse.SUPPRESS)  # set by the launcher for its torchrun ranks
    return p.parse_args(argv)


def one_step_bytes(config_path: str, sharded: bool) -> dict[str, int]:
    torch.manual_seed(0)
    model = create_model(Qwen3Config.from_json(config_path))
    if sharded:
        shard(model, "cpu", "float32")
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    raw = model.module if not sharded else model
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-4)
    ids = torch.randint(0, 1000, (2, 32))
    hidden = model(ids, return_hidden=True).hidden_states
    (hidden[:, -1] @ raw.lm_head.weight[:1000].T).logsumexp(-1).sum().backward()
    optimizer.step()
    return per_rank_training_bytes(raw, optimizer)


def measure(args) -> None:
    """Runs on every rank under torchrun: DDP, then FSDP; each rank writes its bytes to --out/RANK.json.

    No collective after the last training step: a gloo worker thread can still be releasing the tensors of an
    object collective (all_gather_object) when the interpreter exits, which aborts the process."""
    dist.init_process_group("gloo")
    results = {name: one_step_bytes(args.config, name == "FSDP") for name in ("DDP", "FSDP")}
    with open(os.path.join(args.out, f"{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def print_per_rank_table(config_path: str, out_dir: str, nproc: int) -> None:
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    print(f"\n{os.path.basename(config_path)}, {nproc} ranks, one SFT step, fp32 + AdamW\n")
    print("| rank | DDP params / grads / AdamW, MiB | DDP total | FSDP params / grads / AdamW, MiB | FSDP total "
          "| FSDP / DDP |")
    print("|---|---|---|---|---|---|")
    for rank in range(nproc):
        with open(os.path.join(out_dir, f"{rank}.json")) as f:
            ddp, fsdp = json.load(f).values()
        print(f"| {rank} | {' / '.join(mib(v) for v in ddp.values())} | {mib(sum(ddp.values()))} | "
              f"{' / '.join(mib(v) for v in fsdp.values())} | {mib(sum(fsdp.values()))} | "
              f"{sum(fsdp.values()) / sum(ddp.values()):.3f} |")


def sizing_table() -> None:
    print(f"\nGB per GPU for the student's training state + the bf16 teacher; fits (yes) within {BUDGET_GB:.0f} GB "
          f"of an 80 GB GPU\n")
    layouts = [("1 GPU", 1, False), ("4 GPUs DDP", 4, False), ("4 GPUs FSDP", 4, True), ("8 GPUs DDP", 8, False),
               ("8 GPUs FSDP", 8, True)]
    print("| student / teacher | " + " | ".join(name for name, _, _ in layouts) + " |")
    print("|---|" + "---|" * len(layouts))
    for student, teacher in PAIRS:
        cells = []
        for _, gpus, sharded in layouts:
            share = gpus if sharded else 1
            gb = (16 * QWEN3_PARAMS[student] + 2 * QWEN3_PARAMS[teacher]) / share / 1e9
            cells.append(f"{gb:.0f} {'yes' if gb <= BUDGET_GB else 'no'}")
        print(f"| {student} / {teacher} | " + " | ".join(cells) + " |")


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:
        measure(args)
        return
    if not args.sizing:
        with tempfile.TemporaryDirectory() as out_dir:
            command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "--standalone",
                       os.path.abspath(__file__), "--config", args.config, "--out", out_dir]
            subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            print_per_rank_table(args.config, out_dir, args.nproc)
    sizing_table()


if __name__ == "__main__":
    main()
