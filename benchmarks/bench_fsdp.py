"""What each rank holds for training, DDP against FSDP (--fsdp 1), and which Qwen3 student / teacher pairs fit.

    python benchmarks/bench_fsdp.py             # 2 ranks (it launches torchrun itself), CPU/gloo, qwen3-tiny
    python benchmarks/bench_fsdp.py --config model/configs/qwen3-tiny-student.json --nproc 4
    python benchmarks/bench_fsdp.py --load --config benchmarks/qwen3-1gb.json   # the load peaks
    python benchmarks/bench_fsdp.py --phases --config benchmarks/qwen3-1gb.json # load, step, push, save peaks
    python benchmarks/bench_fsdp.py --precision  # FSDP's bf16 autocast numbers against DDP's
    python benchmarks/bench_fsdp.py --sizing    # only the sizing table (arithmetic, no run)
    python benchmarks/bench_fsdp.py --estimate  # each rank's GPU memory by phase, real Qwen3 shapes, fake tensors
    python benchmarks/bench_fsdp.py --estimate_check   # that estimate against a real 2-rank CPU run (qwen3-tiny)
    python benchmarks/bench_fsdp.py --estimate --lora_rank 16   # LoRA students beside full training (LORA_CASES)
    python benchmarks/bench_fsdp.py --phases --lora_rank 16 --config benchmarks/qwen3-1gb.json  # LoRA vs full, CPU

Measured: one SFT optimizer step over a window of 8 micro-batches of the same model wrapped as Run takes it (DDP, or
fully_shard per RMSNorm, decoder layer and root), then each rank's bytes of parameters, gradients (the most it held
after any backward of the window, FSDP2's internal unsharded gradients included) and AdamW state -- its local shards
(`DTensor.to_local()`), everything else whole -- the fp32 master copy that training keeps; printed per rank with the
FSDP/DDP ratios. What is not counted: activations, and under FSDP the unit being computed, gathered whole for its
forward and backward (one decoder layer, or the root's embedding and head).

--load: an HF folder of --config's random model, loaded as student (fp32) and teacher, once by one unsharded
process and once by --nproc sharded ranks, each case in processes of its own: the growth of each process's peak
resident memory (VmHWM, reset just before the load) and whether the weights equal the files' bit for bit.

--phases: what a rank holds in each phase of a run, against the formula of docs/architecture.md ("Sharded
training: what a rank holds"): an HF folder of --config's random model, then one unsharded process and --nproc
sharded ranks (--fsdp 1), each running as train_sft.py does -- the load, two optimizer steps (the second measured),
the weights pushed to a stand-in rollout server, the save (export + resume); per phase the peak resident memory
above the process's start (VmHWM, reset as the phase starts), with glibc's mmap threshold fixed (see
FIXED_MMAP_THRESHOLD; --malloc_default leaves it).

--estimate (benchmarks/fsdp_estimate.py): one real training step -- the distillation loop's, teacher included --
of each pair of the sizing table at 1, 4 and 8 ranks, with and without gradient checkpointing, on fake tensors
(shapes, no storage) under a fake process group, counted by torch's FSDPMemTracker: each rank's peak by phase
(teacher forward, student forward, backward, optimizer; the full depths extrapolated from 2 and 3 layers per model,
exactly: fsdp_estimate.by_depth), then the sizing table from those peaks (DDP: one GPU's
peak plus its reducer's fp32 gradient buckets), "yes" within 80 GB less an 8 GB reserve. --estimate_check: the
estimate of --config's SFT step against the same step on --nproc real gloo ranks, counted by the CPU allocator
(torch.profiler's memory events). What the estimate stands in for and leaves out: fsdp_estimate.py's docstring.

--lora_rank R: LoRA students (model/lora.py: the base frozen in bf16, fp32 adapters of rank R on all seven
projections, only they in AdamW, no gradient of the frozen head) against full training. With --estimate, the cases
of LORA_CASES (a GPU of 80 or 141 GB, one or several), each estimated at the models' full depths, with the load and
the save (arithmetic: fsdp_estimate.digest_bytes, export_bytes). With --phases, full training and a LoRA student of
--config in one process and on --nproc sharded ranks, both under bf16 autocast: each phase's peak resident memory
(load, forward, backward, optimizer, save) and LoRA / full. With --estimate_check, a LoRA student's step.

The --sizing table is arithmetic from bytes per parameter: a trained student keeps 16 B/parameter (fp32 weights,
fp32 gradients, AdamW's two fp32 moments) on every GPU with DDP, 16/W with FSDP over W GPUs; a teacher in bf16 keeps
2 B/parameter, whole on every GPU (replicated) or 2/W (sharded). A pair "fits" when that stays within 80% of an
80 GB GPU, leaving 16 GB for activations, the gathered layer and the CUDA context; long sequences need more
(--gradient_checkpointing 1 cuts activations). Parameter counts: the Qwen3 model cards (embeddings included).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import fsdp_estimate as fe  # noqa: E402
from benchmarks.harness import FIXED_MMAP_THRESHOLD, process_kib, reset_peak_rss  # noqa: E402
from model import Qwen3Config, create_model, save_pretrained  # noqa: E402
from model.checkpoint_io import fuse, hf_layout  # noqa: E402
from trainer.skeleton.distributed import init_distributed_mode  # noqa: E402
from trainer.teachers.frozen import read_frozen  # noqa: E402
from trainer.skeleton.loading import build_model  # noqa: E402
from trainer.skeleton.sharding import shard  # noqa: E402

QWEN3_PARAMS = {"Qwen3-0.6B": 0.6e9, "Qwen3-1.7B": 1.7e9, "Qwen3-4B": 4.0e9, "Qwen3-8B": 8.2e9,
                "Qwen3-14B": 14.8e9, "Qwen3-32B": 32.8e9}
PAIRS = [("Qwen3-0.6B", "Qwen3-4B"), ("Qwen3-0.6B", "Qwen3-8B"), ("Qwen3-1.7B", "Qwen3-8B"),
         ("Qwen3-4B", "Qwen3-32B"), ("Qwen3-8B", "Qwen3-32B"), ("Qwen3-14B", "Qwen3-32B")]
BUDGET_GB = 0.8 * 80
WINDOW = 8  # micro-batches per optimizer step (--accumulation_steps 8, as the README's example)
MODES = ("DDP", "FSDP", "FSDP no-sync")


def per_rank_training_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state (local shards only)."""
    params = [_local(p) for p in model.parameters()]
    return {"parameters": sum(p.numel() * p.element_size() for p in params),
            "gradients": held_gradient_bytes(model),
            "optimizer": sum(_local(v).numel() * _local(v).element_size() for s in optimizer.state.values()
                             for v in s.values() if isinstance(v, torch.Tensor))}


def held_gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of gradient this rank holds now: each parameter's `.grad` (a sharded one's local shard) plus what FSDP2
    keeps outside `.grad` between backwards -- the unsharded gradients of its no-sync accumulation
    (`FSDPParam.unsharded_accumulated_grad`, or the unsharded parameter's own `.grad`), which `.grad` does not show."""
    tensors = [p.grad for p in model.parameters() if p.grad is not None]
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    unsharded = getattr(param, "_unsharded_param", None)
                    tensors += [t for t in (param.unsharded_accumulated_grad,
                                            unsharded.grad if unsharded is not None else None) if t is not None]
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "model", "configs", "qwen3-tiny.json"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sizing", action="store_true", help="print the sizing table only")
    p.add_argument("--load", action="store_true",
                   help="the load peaks: --config's model (e.g. model/configs/qwen3-1gb.json) loaded unsharded and "
                        "sharded, as student and teacher")
    p.add_argument("--phases", action="store_true",
                   help="per-rank peak resident memory of a load, one training step, a save and a weight push: "
                        "--nproc sharded ranks against one process, each against the README's formula")
    p.add_argument("--malloc_default", action="store_true",
                   help="--phases with glibc's own mmap threshold (by default it is fixed at 1 MiB: see "
                        "FIXED_MMAP_THRESHOLD)")
    p.add_argument("--precision", action="store_true",
                   help="FSDP's mixed precision against DDP's under CPU bf16 autocast (loss and gradient)")
    p.add_argument("--estimate", action="store_true",
                   help="each rank's GPU memory by phase for the sizing table's pairs, estimated on the CPU with "
                        "fake tensors (benchmarks/fsdp_estimate.py), and the sizing table from it")
    p.add_argument("--estimate_check", action="store_true",
                   help="the estimate of --config's SFT step at --nproc fake ranks against the bytes the same step "
                        "allocates on the CPU in --nproc real gloo ranks")
    p.add_argument("--lora_rank", type=int, default=0,
                   help="LoRA students of this rank against full training: with --estimate the LoRA table "
                        "(LORA_CASES), with --phases each phase's per-rank peak, with --estimate_check the step of "
                        "a LoRA student")
    p.add_argument("--estimate_batch", type=int, default=2, help="rows per micro-batch (--estimate)")
    p.add_argument("--estimate_seq", type=int, default=2048, help="tokens per row (--estimate)")
    p.add_argument("--estimate_window", type=int, default=2,
                   help="micro-batches per step (--estimate): from the second on each repeats the one before, the "
                        "same work on the same held state (--estimate_check shows it), so 2 stand for any window")
    p.add_argument("--real_step", help=argparse.SUPPRESS)  # a StepShape as JSON, for --estimate_check's ranks
    p.add_argument("--load_case", choices=["student", "teacher"], help=argparse.SUPPRESS)  # one measured load
    p.add_argument("--phases_case", choices=["one", "sharded", "tokenizer"], help=argparse.SUPPRESS)  # a --phases case
    p.add_argument("--training_case", choices=["full", "lora"], help=argparse.SUPPRESS)  # --phases --lora_rank's
    p.add_argument("--model_dir", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)  # set by the launcher for its torchrun ranks
    return p.parse_args(argv)


def one_step_bytes(config_path: str, mode: str) -> dict[str, int]:
    """One SFT optimizer step over a window of WINDOW micro-batches, as Run takes it (DDP syncs on the window's
    last; FSDP reduce-scatters after each backward; "FSDP no-sync", FSDP2's set_requires_gradient_sync(False)
    until the last, is what Run did before and is measured to show what the counter sees). Gradients: the most this
    rank held after any backward of the window."""
    torch.manual_seed(0)
    config = Qwen3Config.from_json(config_path)
    model = create_model(config)
    if mode == "DDP":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        shard(model, "cpu")
    raw = model.module if mode == "DDP" else model
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-4)
    gradients = 0
    for index in range(WINDOW):
        last = index == WINDOW - 1
        if mode == "FSDP no-sync":
            raw.set_requires_gradient_sync(last)
        context = model.no_sync() if mode == "DDP" and not last else contextlib.nullcontext()
        with context:
            ids = torch.randint(0, config.vocab_size, (2, 32))
            hidden = model(ids, return_hidden=True).hidden_states
            (hidden[:, -1] @ raw.lm_head.weight.T).logsumexp(-1).sum().backward()
        gradients = max(gradients, held_gradient_bytes(raw))
    optimizer.step()
    return {**per_rank_training_bytes(raw, optimizer), "gradients": gradients}


def measure(args) -> None:
    """Runs on every rank under torchrun: DDP, then FSDP; each rank writes its bytes to --out/RANK.json.

    No collective after the last training step: a gloo worker thread can still be releasing the tensors of an
    object collective (all_gather_object) when the interpreter exits, which aborts the process."""
    dist.init_process_group("gloo")
    results = {mode: one_step_bytes(args.config, mode) for mode in MODES}
    with open(os.path.join(args.out, f"{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def load_growth(load):
    """-> (the model `load()` returns, by how many bytes this process's peak resident memory grew while it ran)."""
    reset_peak_rss()
    before = process_kib("VmRSS")
    model = load()
    return model, (process_kib("VmHWM") - before) * 1024


def measure_load(args) -> None:
    """One case, in a process of its own (or one per rank, under torchrun): load --model_dir as the student
    (build_model: fp32) or the teacher (read_frozen: the autocast dtype -- fp32 on CPU), sharded when there are
    ranks; write the growth of this rank's peak resident memory, and whether every weight equals the file's tensor
    cast to that dtype (read whole by safetensors itself: not our loader), to --out/ROLE-RANK.json."""
    init_distributed_mode("cpu")  # under torchrun: the gloo group, and print0 on rank 0 only
    flags = argparse.Namespace(fsdp=1, dtype="float32", teacher_dtype="auto", seed=0, teacher_path=args.model_dir,
                               replicate_teacher=0)
    load = {"student": lambda: build_model(flags, "cpu", path=args.model_dir),
            "teacher": lambda: read_frozen(flags, args.model_dir, "cpu")}[args.load_case]
    model, growth = load_growth(load)
    state, expected = model.state_dict(), {}
    if int(os.environ.get("RANK", 0)) == 0:
        file = load_file_tensors(args.model_dir)
        # the file's tensors in our layout (q/k/v and gate/up fused); a tied head is not in the file: the embedding
        expected = fuse({"lm_head.weight": file["model.embed_tokens.weight"], **file}, hf_layout(state, model.config))
    equal = True
    for name, tensor in state.items():
        whole = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # every rank gathers
        if expected:
            equal &= torch.equal(whole, expected[name].to(whole.dtype))
    with open(os.path.join(args.out, f"{args.load_case}-{case_name()}.json"), "w") as f:
        json.dump({"growth": growth, "equal": equal}, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def case_name() -> str:
    """"unsharded", or "rank-R" under torchrun."""
    return f"rank-{os.environ['RANK']}" if "RANK" in os.environ else "unsharded"


def load_file_tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.path.join(folder, "model.safetensors"))


def run_load_benchmark(config_path: str, nproc: int) -> None:
    """Save a random model of `config_path` as an HF folder, then load it as student and teacher, in one unsharded
    process and in `nproc` sharded ranks; print each rank's peak growth and its ratio to the unsharded process's."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "model")
        model = create_model(Qwen3Config.from_json(config_path), seed=0)
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        save_pretrained(model, folder)
        del model
        for role in ("student", "teacher"):
            case = [os.path.abspath(__file__), "--load_case", role, "--model_dir", folder, "--out", tmp]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run([sys.executable, *case], check=True, env=env)
            subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                            "--standalone", *case], check=True, env=env)
        print(f"\nloading {os.path.basename(config_path)} ({size / 2**20:.0f} MiB in fp32; student fp32, teacher in "
              f"the autocast dtype, fp32 on CPU): growth of each process's peak resident memory (VmHWM)\n")
        print("| model | unsharded process, MiB | " + " | ".join(f"rank {r} of {nproc}, MiB" for r in range(nproc))
              + " | largest rank / unsharded | weights equal the files' |")
        print("|---|---|" + "---|" * nproc + "---|---|")
        for role in ("student", "teacher"):
            one, *ranks = [read_json(os.path.join(tmp, f"{role}-{name}.json"))
                          for name in ["unsharded", *(f"rank-{r}" for r in range(nproc))]]
            print(f"| {role} | {one['growth'] / 2**20:.0f} | "
                  + " | ".join(f"{r['growth'] / 2**20:.0f}" for r in ranks)
                  + f" | {max(r['growth'] for r in ranks) / one['growth']:.3f} | "
                  f"{one['equal'] and all(r['equal'] for r in ranks)} |")


PHASE_NAMES = ("load", "step", "push", "save")


class StandInServer:
    """The rollout server for --phases' push: it accepts the load request and the prefix-cache reset (the file is
    written as for a real server; nothing reads it)."""
    what = "stand-in rollout server"

    def __init__(self):
        self.client = self

    def post_once(self, path: str, body: dict) -> dict:
        return {"results": [None]} if path == "/collective_rpc" else {"success": True}


@contextlib.contextmanager
def measured_phase(name: str, results: dict, baseline_kib: int):
    """The phase's peak resident memory (VmHWM, reset to VmRSS when it starts) in bytes above `baseline_kib`, into
    results[name] (a phase that recurs, a micro-batch's forward: the most over its occurrences). Every rank starts
    together (a gloo thread could still be freeing the last phase's buffers)."""
    if dist.is_initialized():
        dist.barrier()
    reset_peak_rss()
    yield
    results[name] = max(results.get(name, 0), (process_kib("VmHWM") - baseline_kib) * 1024)


def sft_step(run, tokenizer, flags: argparse.Namespace, window: list,
             phase: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()) -> None:
    """One optimizer step of train_sft.py's loop over `window`: forward, fused loss, backward per micro-batch.
    `phase(name)`: a context around each forward (with the loss), backward and the optimizer step."""
    from trainer.losses.chunked import completion_hidden
    from trainer.losses.fused_linear import fused_cross_entropy
    for i, batch in enumerate(window):
        batch = {k: v.to(run.device) for k, v in batch.items()}
        with run.micro_step(i, len(window)):
            with phase("forward"), run.autocast():
                hidden, targets = completion_hidden(run.model, batch["input_ids"], batch["attention_mask"],
                                                    batch["labels"])
                loss_sum, num_tokens = fused_cross_entropy(hidden, run.raw_model.lm_head.weight, targets,
                                                           chunk_size=flags.loss_chunk_size,
                                                           vocab_size=len(tokenizer))
            with phase("backward"):
                run.backward(loss_sum, num_tokens)
    with phase("optimizer"):
        run.optimizer_step()


def phases_flags(args, save_dir: str, *extra: str) -> argparse.Namespace:
    """train_sft.py's flags for a --phases case: --model_dir, the chat rows, 2 micro-batches of one short row per
    step, 2 steps, --fsdp 1 on the sharded ranks; `extra` flags besides."""
    from trainer.config.sft import parse_args as sft_args
    return sft_args(["--device", "cpu", "--model_path", args.model_dir, "--data_path",
                     os.path.join(args.out, "chat.jsonl"), "--save_dir", save_dir, "--batch_size", "1",
                     "--accumulation_steps", "2", "--max_length", "32", "--max_prompt_length", "16",
                     "--max_steps", "2", "--fsdp", str(int(args.phases_case == "sharded")), *extra])


def measure_phases(args) -> None:
    """One --phases case in processes of its own: one process without --fsdp, or (under torchrun) each rank of
    --fsdp 1. As the loops run: load --model_dir (fp32), two SFT optimizer steps (the second measured: from then
    on AdamW's moments exist in every backward), the weights pushed as OPD pushes them (to a stand-in server), the
    save (HF export + resume). Each phase's peak resident memory above the process's baseline (VmRSS before the
    load), and the sizes the formula takes -> --out/phases-CASE.json."""
    from serving.weight_sync import WeightSync
    from trainer.skeleton.loading import load_sft_data
    from trainer.skeleton.run import Run
    from trainer.config import sft as sft_config
    save_dir = os.path.join(args.out, args.phases_case)
    flags = phases_flags(args, save_dir)
    info = init_distributed_mode(flags.device, flags.dist_timeout)
    tokenizer_dir, tokenizer, dataset, collator = load_sft_data(flags)
    peaks, baseline = {}, process_kib("VmRSS")
    with measured_phase("load", peaks, baseline):
        model = build_model(flags, info.device, path=flags.model_path)
    run = Run(flags, info, model, dataset, collator, tokenizer_dir, sft_config.RESUMABLE)
    windows = run.windows()
    sft_step(run, tokenizer, flags, next(windows)[1])  # the first: AdamW's moments are created at its end
    with measured_phase("step", peaks, baseline):
        sft_step(run, tokenizer, flags, next(windows)[1])
    sync = WeightSync(StandInServer(), os.path.join(save_dir, "push", "model.safetensors"), [], torch.float32,
                      active=info.is_main)
    with measured_phase("push", peaks, baseline):
        sync.push(run.raw_model, run.step)
    with measured_phase("save", peaks, baseline):
        run.save()
    with open(os.path.join(args.out, f"phases-{case_name()}.json"), "w") as f:
        json.dump({"peaks": peaks, "sizes": formula_sizes(run.raw_model, info.world_size)}, f)
    run.finish()
    if dist.is_initialized():
        dist.destroy_process_group()


LORA_PHASE_NAMES = ("load", "forward", "backward", "optimizer", "save")


def measure_training_phases(args) -> None:
    """One case of --phases --lora_rank, in processes of its own: --training_case full or lora (a LoRA student of
    --lora_rank), in one process or (under torchrun) each rank of --fsdp 1, both with --dtype bfloat16, a GPU's
    recipe -- a full student's fp32 master weights under bf16 autocast, a LoRA student's base frozen in bf16 beside
    its fp32 adapters (trainer/skeleton/loading.build_model). As measure_phases: the load, two SFT steps, the save
    (export: a LoRA student's merged in fp32, and its adapter; resume file), the second step split into its
    forwards (with the loss), backwards and optimizer step, each phase's peak resident memory above the process's
    baseline (the most over the window's micro-batches) -> --out/training-TRAINING-CASE.json."""
    from trainer.config import sft as sft_config
    from trainer.skeleton.loading import load_sft_data, lora_settings
    from trainer.skeleton.run import Run
    rank = args.lora_rank if args.training_case == "lora" else 0
    flags = phases_flags(args, os.path.join(args.out, f"{args.training_case}-{args.phases_case}"),
                         "--dtype", "bfloat16", "--lora_rank", str(rank))
    info = init_distributed_mode(flags.device, flags.dist_timeout)
    tokenizer_dir, tokenizer, dataset, collator = load_sft_data(flags)
    peaks, baseline = {}, process_kib("VmRSS")
    with measured_phase("load", peaks, baseline):
        model = build_model(flags, info.device, path=flags.model_path, lora=lora_settings(flags))
    run = Run(flags, info, model, dataset, collator, tokenizer_dir, sft_config.RESUMABLE)
    windows = run.windows()
    sft_step(run, tokenizer, flags, next(windows)[1])  # the first: AdamW's moments are created at its end
    sft_step(run, tokenizer, flags, next(windows)[1], lambda name: measured_phase(name, peaks, baseline))
    with measured_phase("save", peaks, baseline):
        run.save()
    with open(os.path.join(args.out, f"training-{args.training_case}-{case_name()}.json"), "w") as f:
        json.dump({"peaks": peaks, "trained": sum(p.numel() for p in run.raw_model.parameters() if p.requires_grad)},
                  f)
    run.finish()
    if dist.is_initialized():
        dist.destroy_process_group()


def measure_tokenizer(args) -> None:
    """--phases' one term that is no tensor, alone in a process holding a tokenizer already (as a run's does): what
    the export adds on the rank that writes it -- save_pretrained loads the tokenizer again and writes its files
    -- as the growth of the peak resident memory -> --out/phases-tokenizer.json."""
    from model import load_tokenizer
    load_tokenizer(args.model_dir)
    results = {}
    with measured_phase("tokenizer", results, process_kib("VmRSS")), tempfile.TemporaryDirectory() as folder:
        load_tokenizer(args.model_dir).save_pretrained(folder)
    with open(os.path.join(args.out, "phases-tokenizer.json"), "w") as f:
        json.dump(results, f)


def formula_sizes(model: torch.nn.Module, world: int) -> dict:
    """What the formula is made of, for this rank, in bytes: its parameters (its shards when sharded), the root
    unit's parameters whole (embedding and head, gathered from the forward to the end of the backward), the head
    whole, the most rows of one tensor that one rank holds (what rank 0 receives at once in the export and the
    push), the whole model; and the world size and this rank."""
    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    def most_rows(p: torch.Tensor) -> int:  # FSDP2 splits dim 0 as torch.chunk: the first ranks hold the most
        return -(-p.shape[0] // world) * (p.numel() // p.shape[0]) * p.element_size()
    roots = {id(p): p for name, p in model.named_parameters(remove_duplicate=False)
             if name.startswith(("model.embed_tokens.", "lm_head."))}
    return {"local": nbytes(_local(p) for p in model.parameters()), "root": nbytes(roots.values()),
            "head": nbytes([model.lm_head.weight]), "rows": max(most_rows(p) for p in model.parameters()),
            "model": nbytes(model.parameters()), "world": world, "rank": int(os.environ.get("RANK", 0))}


def predicted_bytes(sizes: dict, tokenizer: int) -> dict[str, float]:
    """The formula of docs/architecture.md ("Sharded training: what a rank holds"), per phase. P parameters, W
    ranks; S: the rank's parameters in fp32 (4P/W bytes), R: the root unit's whole (embedding and head), H: the
    head's whole (R itself when tied). `tokenizer`: what the export's tokenizer adds (measured alone).
    One process: load 2 x 4P (the weights, and the file's pages, mapped while it is read); step 16P + 2H (weights,
    gradients, AdamW's two moments; the loss's gradient of the head and its zero-padded copy); push 12P (the step
    freed the gradients; the file is written from the weights' own memory); save 12P and the tokenizer.
    A sharded rank: load 2S (its shards and its rows of the file); step 4S + 2R + R/W + H (the root's
    reduce-scatter, the backward's last act: its input and output, gloo's copy of the input, and the head's
    unsharded gradient, which FSDP2 frees only after it); push 3S, and on rank 0 one other rank's rows of one
    tensor at a time; save the same, and on rank 0 the tokenizer."""
    writes = sizes["rank"] == 0
    if sizes["world"] == 1:
        model = sizes["model"]
        return {"load": 2 * model, "step": 4 * model + 2 * sizes["head"], "push": 3 * model,
                "save": 3 * model + tokenizer}
    shards, root, world = sizes["local"], sizes["root"], sizes["world"]
    push = 3 * shards + (sizes["rows"] if writes else 0)
    return {"load": 2 * shards, "step": 4 * shards + 2 * root + root / world + sizes["head"], "push": push,
            "save": push + (tokenizer if writes else 0)}


def run_phases_benchmark(config_path: str, nproc: int, malloc_default: bool) -> dict:
    """An HF folder of `config_path`'s random model, then --phases' cases, each in processes of its own: one
    unsharded process, `nproc` sharded ranks, and the tokenizer's term; prints each phase's peak against the
    formula -> {"cases": {"unsharded" / "rank-R": {"peaks", "sizes"}}, "tokenizer": bytes}."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_phases_inputs(tmp, config_path)
        env = {**os.environ, "OMP_NUM_THREADS": "1", **({} if malloc_default else FIXED_MMAP_THRESHOLD)}
        case = [os.path.abspath(__file__), "--model_dir", folder, "--out", tmp, "--phases_case"]
        subprocess.run([sys.executable, *case, "tokenizer"], check=True, env=env)
        subprocess.run([sys.executable, *case, "one"], check=True, env=env)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
                        *case, "sharded"], check=True, env=env)
        cases = {name: read_json(os.path.join(tmp, f"phases-{name}.json"))
                 for name in ["unsharded", *(f"rank-{r}" for r in range(nproc))]}
        tokenizer = read_json(os.path.join(tmp, "phases-tokenizer.json"))["tokenizer"]
    print_phases_table(config_path, cases, tokenizer, malloc_default)
    return {"cases": cases, "tokenizer": tokenizer}


def run_lora_phases_benchmark(config_path: str, nproc: int, lora_rank: int, malloc_default: bool) -> dict:
    """--phases --lora_rank: an HF folder of `config_path`'s random model, then full training and a LoRA student of
    `lora_rank` (`measure_training_phases`), each in one process and on `nproc` sharded ranks, each case in
    processes of its own; prints each phase's per-rank peak, LoRA against full -> {"full" / "lora": {"unsharded" /
    "rank-R": {"peaks", "trained"}}}."""
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_phases_inputs(tmp, config_path)
        env = {**os.environ, "OMP_NUM_THREADS": "1", **({} if malloc_default else FIXED_MMAP_THRESHOLD)}
        for training in ("full", "lora"):
            case = [os.path.abspath(__file__), "--model_dir", folder, "--out", tmp, "--training_case", training,
                    "--lora_rank", str(lora_rank), "--phases_case"]
            subprocess.run([sys.executable, *case, "one"], check=True, env=env)
            subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                            "--standalone", *case, "sharded"], check=True, env=env)
            results[training] = {name: read_json(os.path.join(tmp, f"training-{training}-{name}.json"))
                                 for name in ["unsharded", *(f"rank-{r}" for r in range(nproc))]}
    print_lora_phases_table(config_path, results, lora_rank)
    return results


def print_lora_phases_table(config_path: str, results: dict, lora_rank: int) -> None:
    """Per phase, side by side for one process and each sharded rank: full training's peak, LoRA's, LoRA / full."""
    full, lora = results["full"], results["lora"]
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    ranks = len(full) - 1
    names = {name: "one process" if name == "unsharded" else f"rank {name.removeprefix('rank-')} of {ranks}"
             for name in full}
    print(f"\n{os.path.basename(config_path)}, SFT under bf16 autocast (--dtype bfloat16), CPU/gloo: each phase's "
          f"peak resident memory above the process's start, MiB, full training ({full['unsharded']['trained']:,} "
          f"trained parameters, fp32 master weights) against LoRA rank {lora_rank} ({lora['unsharded']['trained']:,}, "
          f"the base frozen in bf16)\n")
    print("| phase | " + " | ".join(f"{label}: full | LoRA | LoRA / full" for label in names.values()) + " |")
    print("|---|" + "---|---|---|" * len(names))
    for phase in LORA_PHASE_NAMES:
        cells = [f"{mib(full[name]['peaks'][phase])} | {mib(lora[name]['peaks'][phase])} | "
                 f"{lora[name]['peaks'][phase] / full[name]['peaks'][phase]:.3f}" for name in names]
        print(f"| {phase} | " + " | ".join(cells) + " |")


def print_phases_table(config_path: str, cases: dict, tokenizer: int, malloc_default: bool) -> None:
    one = cases["unsharded"]
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    print(f"\n{os.path.basename(config_path)} ({mib(one['sizes']['model'])} MiB in fp32, the root unit "
          f"{mib(one['sizes']['root'])} MiB of it), SFT, CPU/gloo"
          f"{', glibc malloc as it comes' if malloc_default else ''}: each phase's peak resident memory above the "
          f"process's start, MiB, against the formula (the export's tokenizer: {mib(tokenizer)} MiB, measured "
          f"alone), and against one process\n")
    print("| phase | case | measured | formula | measured / formula | / one process |")
    print("|---|---|---|---|---|---|")
    for phase in PHASE_NAMES:
        for name, result in cases.items():
            measured, formula = result["peaks"][phase], predicted_bytes(result["sizes"], tokenizer)[phase]
            print(f"| {phase} | {name} | {mib(measured)} | {mib(formula)} | {measured / formula:.3f} | "
                  f"{measured / one['peaks'][phase]:.3f} |")


def write_phases_inputs(tmp: str, config_path: str) -> str:
    """Into `tmp`: an HF folder of `config_path`'s random model (-> its path) and the chat rows --phases trains on."""
    folder = os.path.join(tmp, "model")
    save_pretrained(create_model(Qwen3Config.from_json(config_path), seed=0), folder)
    write_chat_rows(os.path.join(tmp, "chat.jsonl"), 16)
    return folder


def write_chat_rows(path: str, rows: int) -> None:
    """Short chat rows for --phases' steps (the activations stay small next to the weights)."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: say something."},
                                             {"role": "assistant", "content": f"Answer {i} \\boxed{{{i}}}"}]}) + "\n")


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def precision_case(config_path: str, mode: str) -> tuple[float, torch.Tensor]:
    """One forward + backward of a fixed batch (the same on every rank, so the ranks' average is that batch's
    gradient) under CPU bf16 autocast: -> (loss, the whole flattened gradient). Modes: "fp32" (no autocast, the
    reference), "DDP" (fp32 weights, autocast lowers the matmuls), "FSDP" (trainer/skeleton/sharding.shard's policies),
    "FSDP all-bf16" (every unit gathered in bf16: the policy Run used before)."""
    torch.manual_seed(0)
    config = Qwen3Config.from_json(config_path)
    model = create_model(config, seed=0)
    if mode == "FSDP":
        shard(model, "cpu", torch.bfloat16)
    elif mode == "FSDP all-bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    ids = torch.randint(0, config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "fp32"):
        hidden = model(ids[:, :-1], return_hidden=True).hidden_states
        logits = (hidden @ model.lm_head.weight.T).float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    return float(loss), torch.cat([g.flatten() for g in grads])


def measure_precision(args) -> None:
    dist.init_process_group("gloo")
    cases = {mode: precision_case(args.config, mode) for mode in ("fp32", "DDP", "FSDP", "FSDP all-bf16")}
    if dist.get_rank() == 0:
        (_, ref), (ddp_loss, ddp) = cases["fp32"], cases["DDP"]
        rows = {mode: {"loss_vs_ddp": abs(loss - ddp_loss), "grad_vs_ddp": float((g - ddp).norm() / ddp.norm()),
                       "grad_vs_fp32": float((g - ref).norm() / ref.norm())} for mode, (loss, g) in cases.items()}
        with open(os.path.join(args.out, "precision.json"), "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def print_precision_table(config_path: str, out_dir: str, nproc: int) -> None:
    rows = read_json(os.path.join(out_dir, "precision.json"))
    print(f"\n{os.path.basename(config_path)}, {nproc} ranks, CPU bf16 autocast, one forward + backward: |loss - "
          f"DDP's| and the gradient's relative distance to DDP's and to fp32's\n")
    print("| mode | loss vs DDP | gradient vs DDP | gradient vs fp32 |")
    print("|---|---|---|---|")
    for mode, row in rows.items():
        print(f"| {mode} | {row['loss_vs_ddp']:.2e} | {row['grad_vs_ddp']:.2e} | {row['grad_vs_fp32']:.2e} |")


def print_per_rank_table(config_path: str, out_dir: str, nproc: int) -> None:
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    print(f"\n{os.path.basename(config_path)}, {nproc} ranks, one SFT step of {WINDOW} micro-batches, fp32 + AdamW; "
          f"MiB of parameters / gradients (the window's peak) / AdamW state per rank, and each mode's total and "
          f"gradients over DDP's\n")
    print("| rank | mode | params / grads / AdamW, MiB | total | total / DDP | grads / DDP |")
    print("|---|---|---|---|---|---|")
    for rank in range(nproc):
        with open(os.path.join(out_dir, f"{rank}.json")) as f:
            results = json.load(f)
        ddp = results["DDP"]
        for mode in MODES:
            held = results[mode]
            print(f"| {rank} | {mode} | {' / '.join(mib(v) for v in held.values())} | {mib(sum(held.values()))} | "
                  f"{sum(held.values()) / sum(ddp.values()):.3f} | {held['gradients'] / ddp['gradients']:.3f} |")


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


def critic_table() -> None:
    """PPO's critic: what it adds to each rank's training state (fsdp_estimate.critic_state_bytes, from the real
    shapes), fully trained and with LoRA rank 16 on all seven projections (the student's settings)."""
    print("\nGB per GPU that PPO's critic adds to the student's training state (train_ppo.py; full / LoRA rank 16)\n")
    layouts = [("1 GPU", 1, False), ("4 GPUs DDP", 4, False), ("4 GPUs FSDP", 4, True), ("8 GPUs DDP", 8, False),
               ("8 GPUs FSDP", 8, True)]
    print("| student | " + " | ".join(name for name, _, _ in layouts) + " |")
    print("|---|" + "---|" * len(layouts))
    for student in dict.fromkeys(student for student, _ in PAIRS):
        config = fe.qwen3_config(student)
        cells = [" / ".join(f"{fe.critic_state_bytes(config, gpus, sharded, rank) / 1e9:.1f}" for rank in (0, 16))
                 for _, gpus, sharded in layouts]
        print(f"| {student} | " + " | ".join(cells) + " |")


ESTIMATE_LAYOUTS = [("1 GPU", 1), ("4 GPUs FSDP", 4), ("8 GPUs FSDP", 8)]
ESTIMATE_BUDGET_GB = fe.GPU_GB - fe.RESERVE_GB
DDP_BUCKET_BYTES = 4  # per parameter: DDP's reducer keeps its own fp32 copy of the gradients in its buckets


def run_estimates(shape_args: dict) -> dict:
    """Every pair of PAIRS at every layout of ESTIMATE_LAYOUTS, with and without gradient checkpointing: rank 0's
    peak per phase in bytes (the most over the micro-batches), printed as it comes. A layout whose training state
    alone (16 B/parameter of student and 2 of teacher, over W) is over the budget is not run: "no" already."""
    print(f"\nOne step per rank, fake tensors on the CPU (benchmarks/fsdp_estimate.py): {shape_args['window']} "
          f"micro-batches of {shape_args['batch']} x {shape_args['seq']} tokens, loss chunk {shape_args['chunk']}; "
          f"GB (1e9 B) held at the peak of each phase; fits within {ESTIMATE_BUDGET_GB:.0f} GB (80 GB less "
          f"{fe.RESERVE_GB:.0f} GB for the CUDA context, NCCL, the allocator and kernel workspaces)\n", flush=True)
    print("| student / teacher | layout | checkpointing | state | teacher fwd | forward | backward | optimizer | "
          "peak | fits |\n|---|---|---|---|---|---|---|---|---|---|", flush=True)
    results = {}
    for student, teacher in PAIRS:
        for layout, world in ESTIMATE_LAYOUTS:
            if state_gb(student, teacher, world) > ESTIMATE_BUDGET_GB:
                continue
            for checkpointing in (True, False):
                shape = fe.StepShape(**shape_args, gradient_checkpointing=checkpointing)
                result = fe.by_depth(fe.qwen3_config(student), fe.qwen3_config(teacher), world, shape)
                peaks = result["peaks"]
                results[student, teacher, world, checkpointing] = peaks
                cells = " | ".join(f"{peaks[phase] / 1e9:.1f}" for phase in fe.PHASES)
                peak = max(peaks.values()) / 1e9
                print(f"| {student} / {teacher} | {layout} | {'on' if checkpointing else 'off'} | "
                      f"{result['state'] / 1e9:.1f} | {cells} | {peak:.1f} | "
                      f"{'yes' if peak <= ESTIMATE_BUDGET_GB else 'no'} |", flush=True)
    return results


def state_gb(student: str, teacher: str | None, world: int) -> float:
    return (16 * QWEN3_PARAMS[student] + 2 * QWEN3_PARAMS.get(teacher, 0)) / world / 1e9


def estimated_sizing_table(results: dict) -> None:
    """The sizing table from the estimate: per pair and layout the peak with / without gradient checkpointing. DDP
    holds what one GPU holds plus its reducer's fp32 gradient buckets; a layout not run shows its state alone."""
    print(f"\nGB per GPU at the step's peak, gradient checkpointing on / off; yes: within {ESTIMATE_BUDGET_GB:.0f} "
          f"GB\n")
    layouts = [("1 GPU", 1, 0), ("4 GPUs DDP", 1, 4), ("4 GPUs FSDP", 4, 0), ("8 GPUs DDP", 1, 8),
               ("8 GPUs FSDP", 8, 0)]
    print("| student / teacher | " + " | ".join(name for name, _, _ in layouts) + " |")
    print("|---|" + "---|" * len(layouts))
    for student, teacher in PAIRS:
        cells = []
        for _, world, ddp in layouts:
            extra = DDP_BUCKET_BYTES * QWEN3_PARAMS[student] / 1e9 if ddp else 0.0
            gbs = [max(results[student, teacher, world, gc].values()) / 1e9 + extra
                   if (student, teacher, world, gc) in results else None for gc in (True, False)]
            if gbs[0] is None:
                cells.append(f"> {state_gb(student, teacher, world) + extra:.0f} no")
                continue
            cells.append(" / ".join(f"{gb:.0f} {'yes' if gb <= ESTIMATE_BUDGET_GB else 'no'}" for gb in gbs))
        print(f"| {student} / {teacher} | " + " | ".join(cells) + " |")


# --estimate --lora_rank: (student, teacher -- None: SFT --, GPUs, GB per GPU), each a LoRA student and, for
# contrast, full training of the same pair on the same GPUs (sharded with FSDP over several)
LORA_CASES = [("Qwen3-8B", None, 1, 80), ("Qwen3-14B", None, 1, 80), ("Qwen3-32B", None, 1, 80),
              ("Qwen3-8B", "Qwen3-4B", 1, 141), ("Qwen3-8B", "Qwen3-32B", 1, 141), ("Qwen3-4B", "Qwen3-32B", 1, 141),
              ("Qwen3-32B", None, 1, 141), ("Qwen3-8B", "Qwen3-32B", 4, 80), ("Qwen3-14B", "Qwen3-32B", 8, 80),
              ("Qwen3-32B", None, 8, 80)]


def run_lora_estimates(shape_args: dict, lora_rank: int) -> dict:
    """Every case of LORA_CASES, a LoRA student of `lora_rank` and full training, with and without gradient
    checkpointing: rank 0's bytes per phase -- the step's estimated (fake tensors), the load and the save
    arithmetic (`lora_case_peaks`) -- printed as they come. Full training whose state alone is over the budget
    is not run."""
    print(f"\nOne step per rank, fake tensors on the CPU (benchmarks/fsdp_estimate.py), at the models' full depths: "
          f"{shape_args['window']} micro-batches of {shape_args['batch']} x {shape_args['seq']} tokens, loss chunk "
          f"{shape_args['chunk']}; LoRA rank {lora_rank} on all seven projections (base frozen in bf16, fp32 "
          f"adapters, only they in AdamW); "
          f"GB (1e9 B) at the peak of each phase, the load and the save arithmetic; fits within the GPU's GB less "
          f"{fe.RESERVE_GB:.0f}\n", flush=True)
    print("| student / teacher | GPUs | training | checkpointing | state | load | teacher fwd | forward | backward | "
          "optimizer | save | peak | fits |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    results = {}
    for student, teacher, world, gpu_gb in LORA_CASES:
        for rank in (lora_rank, 0):
            if not rank and state_gb(student, teacher, world) > gpu_gb - fe.RESERVE_GB:
                continue
            for checkpointing in (True, False):
                shape = fe.StepShape(**shape_args, gradient_checkpointing=checkpointing)
                peaks = lora_case_peaks(student, teacher, world, shape, rank)
                results[student, teacher, world, rank, checkpointing] = peaks
                peak = max(peaks.values()) / 1e9
                cells = " | ".join(f"{peaks[phase] / 1e9:.1f}" if phase in peaks else "-"  # SFT: no teacher
                                   for phase in LORA_TABLE_PHASES)
                print(f"| {student} / {teacher or 'none (SFT)'} | {gpus(world, gpu_gb)} | "
                      f"{f'LoRA r{rank}' if rank else 'full'} | {'on' if checkpointing else 'off'} | {cells} | "
                      f"{peak:.1f} | {'yes' if peak <= gpu_gb - fe.RESERVE_GB else 'no'} |", flush=True)
    return results


LORA_TABLE_PHASES = ("state", "load", "teacher", "forward", "backward", "optimizer", "save")


def lora_case_peaks(student: str, teacher: str | None, world: int, shape: fe.StepShape, lora_rank: int) -> dict:
    """One case of the LoRA table: the estimate's state and peaks at the full depths (`fe.full_depth`: sharded, a
    LoRA student's peak moves between shallow depths, which `fe.by_depth` would take for a slope), with the load and
    the save. The load holds the state but AdamW's moments (created by the first step), and a LoRA student's base
    digest (fe.digest_bytes); the save holds the state (the step freed the gradients) and the export's rows on rank
    0 (fe.export_bytes). AdamW's moments: 8 bytes per trained parameter (a LoRA student's adapters), over W."""
    config = fe.qwen3_config(student)
    result = fe.full_depth(config, teacher and fe.qwen3_config(teacher), world, shape, lora_rank)
    state = result["state"]
    trained = fe.adapter_parameter_count(config, lora_rank) if lora_rank else fe.parameter_count(config)
    return {"state": state, "load": state - 8 * trained // world + fe.digest_bytes(config, world, lora_rank),
            **result["peaks"], "save": state + fe.export_bytes(config, world, lora_rank)}


def lora_sizing_table(results: dict, lora_rank: int) -> None:
    """The LoRA table's summary: per case the peak over all phases, LoRA and full, checkpointing on / off."""
    print(f"\nGB per GPU at the peak of the load, the accumulation window and the save, gradient checkpointing on / "
          f"off; yes: within the GPU's GB less {fe.RESERVE_GB:.0f}\n")
    print(f"| student / teacher | GPUs | LoRA r{lora_rank} | full training |\n|---|---|---|---|")
    for student, teacher, world, gpu_gb in LORA_CASES:
        cells = []
        for rank in (lora_rank, 0):
            if (student, teacher, world, rank, True) not in results:
                cells.append(f"> {state_gb(student, teacher, world):.0f} no")
                continue
            gbs = [max(results[student, teacher, world, rank, gc].values()) / 1e9 for gc in (True, False)]
            cells.append(" / ".join(f"{gb:.0f} {'yes' if gb <= gpu_gb - fe.RESERVE_GB else 'no'}" for gb in gbs))
        print(f"| {student} / {teacher or 'none (SFT)'} | {gpus(world, gpu_gb)} | " + " | ".join(cells) + " |")


def gpus(world: int, gpu_gb: int) -> str:
    return f"{world} x {gpu_gb} GB" + (" FSDP" if world > 1 else "")


def estimate_check(config_path: str, nproc: int, lora_rank: int = 0) -> None:
    """--config's SFT step (of a LoRA student with `lora_rank`) at `nproc` fake ranks against the same step on
    `nproc` real gloo ranks (the CPU allocator's own count): per phase and micro-batch, MiB and the ratio. Both
    under CPU bf16 autocast."""
    shape = fe.StepShape(batch=2, seq=128, window=4, chunk=64)
    config = Qwen3Config.from_json(config_path)
    fake = fe.estimate(config, None, nproc, shape, lora_rank)
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
                        os.path.abspath(__file__), "--config", config_path, "--out", out, "--lora_rank",
                        str(lora_rank), "--real_step", json.dumps(dataclasses.asdict(shape))],
                       check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        real = [read_json(os.path.join(out, f"real-{rank}.json")) for rank in range(nproc)]
    lora = f", LoRA rank {lora_rank}" if lora_rank else ""
    print(f"\n{os.path.basename(config_path)}{lora}, one SFT step of {shape.window} micro-batches of {shape.batch} "
          f"x {shape.seq}, {nproc} ranks, CPU bf16 autocast: MiB at each phase's peak, the fake estimate (rank 0) "
          f"against what the CPU allocator counted on each real rank\n")
    print("| phase | occurrence | estimate | " + " | ".join(f"rank {r}" for r in range(nproc))
          + " | estimate / largest rank |\n|---|---|---|" + "---|" * nproc + "---|")
    print(f"| before the step | | {fake['state'] / 2**20:.1f} | "
          + " | ".join(f"{r['state'] / 2**20:.1f}" for r in real) + f" | "
          f"{fake['state'] / max(r['state'] for r in real):.3f} |")
    for phase, values in fake["peaks"].items():
        for index, value in enumerate(values):
            measured = [r["peaks"][phase][index] for r in real]
            print(f"| {phase} | {index + 1} | {value / 2**20:.1f} | "
                  + " | ".join(f"{m / 2**20:.1f}" for m in measured) + f" | {value / max(measured):.3f} |")


def measure_real_step(args) -> None:
    """One rank of --estimate_check: the step on real tensors; writes its peaks to --out/real-RANK.json."""
    dist.init_process_group("gloo")
    result = fe.measured_step(Qwen3Config.from_json(args.config), fe.StepShape(**json.loads(args.real_step)),
                              args.lora_rank)
    with open(os.path.join(args.out, f"real-{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.load_case:
        measure_load(args)
        # its result is on disk: leave without the interpreter's teardown, where a rank of this case aborted now and
        # then after its group was destroyed ("terminate called without an active exception": 1 run in 2 on this
        # machine, none with this exit in 10; the loops' own runs, tested throughout, never did)
        sys.stdout.flush()
        os._exit(0)
    if args.phases_case == "tokenizer":
        measure_tokenizer(args)
        return
    if args.phases_case:
        measure_training_phases(args) if args.training_case else measure_phases(args)
        return
    if args.real_step:
        measure_real_step(args)
        return
    if "RANK" in os.environ:
        measure_precision(args) if args.precision else measure(args)
        return
    if args.estimate_check:
        estimate_check(args.config, args.nproc, args.lora_rank)
        return
    if args.estimate:
        shape = {"batch": args.estimate_batch, "seq": args.estimate_seq, "window": args.estimate_window,
                 "chunk": 512}
        if args.lora_rank:
            lora_sizing_table(run_lora_estimates(shape, args.lora_rank), args.lora_rank)
        else:
            estimated_sizing_table(run_estimates(shape))
        return
    if args.load:
        run_load_benchmark(args.config, args.nproc)
        return
    if args.phases and args.lora_rank:
        run_lora_phases_benchmark(args.config, args.nproc, args.lora_rank, args.malloc_default)
        return
    if args.phases:
        run_phases_benchmark(args.config, args.nproc, args.malloc_default)
        return
    if not args.sizing:
        with tempfile.TemporaryDirectory() as out_dir:
            command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}", "--standalone",
                       os.path.abspath(__file__), "--config", args.config, "--out", out_dir,
                       *(["--precision"] if args.precision else [])]
            subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            (print_precision_table if args.precision else print_per_rank_table)(args.config, out_dir, args.nproc)
    if not args.precision:
        sizing_table()
        critic_table()


if __name__ == "__main__":
    main()
