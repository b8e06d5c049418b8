"""The distributed start: joining torchrun's process group, which rank this process is, and leaving the group.

Every rank runs the same script. `init_distributed_mode` is called first (each rank then builds its models on its
own device) and records the process's place in the run; `print0` and `is_main_process` read that record, never the
environment, so a process that has not joined a group (one process, a test) is rank 0.
"""
from __future__ import annotations

import atexit
import ctypes
import datetime
import math
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.errors import refuse
from trainer.skeleton.console import say

# A rank waits in a collective while another works alone; past --dist_timeout the process group fails every rank
# (NCCL's watchdog kills them, gloo raises), before the failure protocol can save or say anything. The default
# covers the longest legitimate waits: a batch of server requests at the default --rollout_timeout with all their
# retries (3340 s, server_wait_seconds) and rank 0 writing an 8B model's checkpoint (~131 GB: ~1310 s at the
# speed below); both are checked at start-up against the value given.
DEFAULT_DIST_TIMEOUT = 3600.0
SAVE_WRITE_BYTES_PER_S = 100e6  # a conservative sustained write speed: a network file system's, a busy disk's


@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


_process = DistInfo()  # this process's place in the run, as init_distributed_mode found it


def is_main_process() -> bool:
    """Rank 0 of the run (or the only process)."""
    return _process.is_main


def print0(*parts) -> None:
    """print on rank 0 only (all ranks run the same script); above the progress bar while one is up."""
    if _process.is_main:
        say(" ".join(str(part) for part in parts))


def init_distributed_mode(device: str, timeout: float = DEFAULT_DIST_TIMEOUT) -> DistInfo:
    """Join the process group torchrun describes in the environment (nccl on CUDA, gloo on CPU). `timeout`
    (--dist_timeout, seconds): how long a collective may wait for the other ranks before the group fails."""
    global _process
    if "RANK" not in os.environ:
        _process = DistInfo(device=device)
        return _process
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    die_with_launcher()
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo",
                            timeout=datetime.timedelta(seconds=timeout))
    atexit.register(leave_process_group)
    _process = DistInfo(rank, local_rank, world_size, device)
    return _process


def leave_process_group() -> None:
    """At exit, for a run that stops on an error (a failed server, a refusal after the start): the finished run's
    close() has given the group back already. A process that exits holding a gloo group it has used may abort in
    its teardown ("terminate called without an active exception", exit -6 instead of its own code; a quarter of
    2-rank runs here); gloo's destroy is local, so it is safe while other ranks are gone or still waiting. An NCCL
    group is left to PyTorch's own teardown: destroying its communicators can wait for peers that never come."""
    if dist.is_initialized() and dist.get_backend() == "gloo":
        dist.destroy_process_group()


def die_with_launcher() -> None:
    """torchrun starts each worker in a session of its own, so a launcher killed with SIGKILL leaves its workers
    training on, into the folder a rerun will use. On Linux the kernel is asked to kill a worker when its launcher
    dies (PR_SET_PDEATHSIG); a launcher that died before the request was made is noticed by the parent PID."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if parent == 1 or os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def check_save_time(rank0_bytes: int, dist_timeout: float) -> None:
    """With more than one rank: rank 0 writes `rank0_bytes` of a checkpoint alone while the other ranks wait at the
    save's barrier. Refused at start-up when that could take longer than --dist_timeout at a conservative write
    speed (every rank computes the same, so every rank refuses)."""
    seconds = rank0_bytes / SAVE_WRITE_BYTES_PER_S
    if seconds > dist_timeout:
        refuse(f"--dist_timeout {dist_timeout:g}: rank 0 writes {rank0_bytes / 1e9:.1f} GB of each checkpoint while "
               f"the other ranks wait, up to {seconds:.0f} s at {SAVE_WRITE_BYTES_PER_S / 1e6:.0f} MB/s; raise "
               f"--dist_timeout to {math.ceil(seconds)} or more")
