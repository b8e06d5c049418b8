"""What every benchmark shares: clocks and medians, peak memory, the machine line, Markdown tables, the --json file,
and the workloads several of them build (the demo prompts, random tiny models).

Each script prints the machine line first (date, nproc, CPU model, commit), its results as Markdown tables, and with
`--json PATH` writes what it measured there (the tests read that file; docs/benchmarks.md lists the scripts).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from common.files import atomic_write
from common.version import code_commit
from model.precision import DTYPE_CHOICES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "model", "configs")
STUDENT_CONFIG = os.path.join(CONFIGS, "qwen3-tiny-student.json")  # the OPD demo's student shape
TEACHER_CONFIG = os.path.join(CONFIGS, "qwen3-tiny.json")          # and its teacher's
GIB = 1024 ** 3


# ------------------------------------------------------------------------------------------------------------ time

def synchronize(device: str | torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; a CPU clock read is already after it)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_ms(fns: Sequence[Callable[[], object]], device: str | torch.device = "cpu", warmup: int = 1,
              repeats: int = 5) -> list[float]:
    """Median wall time of each of `fns`, in ms, after `warmup` untimed rounds. They take turns within each round,
    so a load change on a shared machine hits all of them alike: their ratios are paired."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, runs in zip(fns, times):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            runs.append((time.perf_counter() - start) * 1000.0)
    return [statistics.median(runs) for runs in times]


def seconds_per_call(fn: Callable[[], object], device: str | torch.device, warmup: int, calls: int) -> float:
    """Mean seconds of `calls` back-to-back calls of `fn` after `warmup` (one clock around all: no sync between)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - start) / calls


def add_device_args(group) -> None:
    """--device, --dtype (as the loops': auto is bf16 autocast on CUDA, fp32 elsewhere) and --threads."""
    group.add_argument("--device", default="cpu", help="cpu or cuda")
    group.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                       help="as the loops' --dtype (auto: bf16 autocast on CUDA, fp32 elsewhere)")
    group.add_argument("--threads", type=int, default=0,
                       help="torch CPU threads (0: torch's default); 1 gives steadier times on a shared machine")


def set_threads(threads: int) -> None:
    """torch's intra-op threads; 0 keeps torch's default. One thread gives steadier times on a shared machine."""
    if threads:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------------------- memory

def process_kib(field: str) -> int:
    """VmRSS (resident now) or VmHWM (the most resident since the start or the last reset_peak_rss) of this
    process, in KiB (Linux)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak_rss() -> bool:
    """Reset this process's VmHWM to its VmRSS (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# glibc raises its mmap threshold (up to 32 MiB) each time it frees a mapped block, and from then on keeps freed blocks
# below it in its heaps, resident: memory no count of live tensors predicts (it added 11-46% to bench_fsdp.py's
# sharded peaks, and made the small shapes' chunks of bench_losses.py stay resident). In a child's environment, this
# fixes the threshold at 1 MiB, so that freed buffers go back to the system as they do in glibc's start state.
FIXED_MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


@contextlib.contextmanager
def environment(variables: dict[str, str]):
    """os.environ with `variables` set for the block (what a process started in it inherits), then as it was."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def memory_baseline(device: str | torch.device) -> tuple[int, bool]:
    """-> (bytes held now, whether the peak could be reset to it): CUDA's allocated bytes (its peak reset), else
    the process's resident bytes (VmHWM reset). What a measured step adds is peak_bytes minus this."""
    synchronize(device)
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated(), True
    was_reset = reset_peak_rss()
    return process_kib("VmRSS") * 1024, was_reset


def peak_bytes(device: str | torch.device) -> int:
    """The peak since memory_baseline: CUDA's max_memory_allocated, else VmHWM."""
    synchronize(device)
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated()
    return process_kib("VmHWM") * 1024


# -------------------------------------------------------------------------------------------------------- report

def machine() -> str:
    """The date, `nproc`, the CPU model and the commit (marked when the working tree has local changes)."""
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{datetime.date.today().isoformat()}, nproc {nproc} ({cpu}), commit {code_commit()}"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; each cell is str() of what is given, with any `|` in it escaped."""
    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(cell).replace("|", "\\|") for cell in cells) + " |"
    return "\n".join([line(header), "|" + "---|" * len(header), *(line(row) for row in rows)])


def add_json_arg(parser) -> None:
    parser.add_argument("--json", default=None, metavar="PATH", help="also write what was measured to PATH (JSON)")


def write_json(path: str | None, results: dict) -> None:
    """`results` with the machine line, replaced whole at `path`; nothing without a path."""
    if path:
        with atomic_write(path) as f:
            f.write(json.dumps({"machine": machine(), **results}, indent=2).encode("utf-8"))


# ----------------------------------------------------------------------------------------------------- workloads

def demo_rows(split: str, indices: Sequence[int]) -> list[dict]:
    """Rows of the built-in demo data (dataset/make_demo_data.py: sft_train, opd_prompts, eval...), cycling."""
    from dataset.make_demo_data import ensure_demo_data
    from dataset.sources import RowDataset
    dataset = RowDataset(ensure_demo_data()[split])
    return [dataset[i % len(dataset)] for i in indices]


def prompt_batch(tokenizer, rows: list[dict], device: str = "cpu", max_prompt_length: int = 256,
                 enable_thinking: bool = False) -> dict:
    """PromptCollator's batch of `rows` (left padded, as OPD's rollouts take them), its tensors on `device`."""
    from dataset.collators import PromptCollator
    batch = PromptCollator(tokenizer, max_prompt_length, enable_thinking)(rows)
    return {**batch, "prompt_ids": batch["prompt_ids"].to(device),
            "prompt_attention_mask": batch["prompt_attention_mask"].to(device)}


def save_random_models(folder: str, student_config: str = STUDENT_CONFIG, teacher_config: str = TEACHER_CONFIG,
                       seed: int = 0) -> tuple[str, str]:
    """A random student (seed) and teacher (seed + 1) written as HF folders folder/student and folder/teacher."""
    from model import Qwen3Config, create_model, save_pretrained
    paths = []
    for name, config, offset in (("student", student_config, 0), ("teacher", teacher_config, 1)):
        paths.append(os.path.join(folder, name))
        save_pretrained(create_model(Qwen3Config.from_json(config), seed=seed + offset), paths[-1])
    return paths[0], paths[1]
