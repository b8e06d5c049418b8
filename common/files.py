"""Safe file writes, the one implementation every script uses.

- `atomic_write(path)` / `atomic_directory(path)`: write into a temporary beside the target, fsync, rename into place.
  A kill at any instant leaves the old file (or folder) or the new one, never half of one; a failed write removes
  its own temporary. Temporaries are named `.NAME.tmp-PID-RANDOM`, so `remove_stale_temporaries` can find what a
  killed process left behind (and leaves alone those of a process that is still alive).
- Files and folders get ordinary permissions: what `umask` allows, like any file the user writes (the `tempfile`
  module would make them owner-only, which hides a model from colleagues on a shared cluster).
- `check_writable` and `check_free_space`: refuse at start-up, or before a save, with one line instead of losing
  work to a traceback hours in.
"""
from __future__ import annotations

import contextlib
import glob
import os
import secrets
import shutil
from collections.abc import Iterator
from typing import BinaryIO

from common.errors import RuntimeFailure, UserError, disk_error_message


def temporary_name(path: str) -> str:
    """`dir/.NAME.tmp-PID-RANDOM` for the target `dir/NAME`."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def process_start_time(pid: int) -> str | None:
    """The kernel's start time of a running process (Linux /proc), None when none runs under that PID: it tells a
    live owner from a new process that reuses the PID. A zombie (killed, not yet reaped) does not run."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def remove_stale_temporaries(path: str) -> list[str]:
    """Remove the temporaries of `path` left by processes that no longer run; -> what was removed."""
    folder, name = os.path.split(os.path.abspath(path))
    removed = []
    for tmp in glob.glob(os.path.join(glob.escape(folder), f".{glob.escape(name)}.tmp-*")):
        pid = os.path.basename(tmp)[len(name) + 6:].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and process_start_time(int(pid)) is not None:
            continue
        _remove(tmp)
        removed.append(tmp)
    return removed


def current_umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it; put it straight back
    os.umask(mask)
    return mask


def fsync_directory(folder: str) -> None:
    """Make a rename inside `folder` durable (the rename itself is atomic; surviving a power cut needs this)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@contextlib.contextmanager
def atomic_write(path: str) -> Iterator[BinaryIO]:
    """`with atomic_write(path) as f: f.write(...)`: binary file, replaced whole or not at all."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)  # a folder check_writable accepted is created by its first file
    tmp = temporary_name(path)
    try:
        with open(tmp, "xb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    fsync_directory(folder)


@contextlib.contextmanager
def atomic_directory(path: str) -> Iterator[str]:
    """`with atomic_directory(out) as tmp: write files into tmp`: the folder appears (or replaces the old one) whole.

    An existing folder is renamed aside first and removed after the swap; a kill between the two renames leaves no
    `path` but both temporaries, which the next `remove_stale_temporaries(path)` cleans up (the training loops
    export before they write the resume checkpoint, so a resumed run exports again)."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = temporary_name(path)
    os.mkdir(tmp)
    try:
        yield tmp
        file_mode = 0o666 & ~current_umask()
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                os.fsync(f.fileno())
            os.chmod(os.path.join(tmp, name), file_mode)  # some writers (safetensors) create owner-only files
        old = None
        if os.path.exists(path):
            old = temporary_name(path)
            os.replace(path, old)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    fsync_directory(folder)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def check_writable(folder: str, what: str) -> None:
    """Prove a file can be written in `folder` -- or, when it does not exist yet, in the nearest folder above it, so
    that it can be created when the first file is written; a UserError naming `what` otherwise. Nothing is left
    behind, not even the folder: a run refused at start-up leaves the disk as it found it."""
    existing = os.path.abspath(folder)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UserError(f"{what} {folder} is not writable ({existing} is a file, not a folder): choose a folder you "
                        f"can write to")
    try:
        probe = os.path.join(existing, f".write-probe-{os.getpid()}-{secrets.token_hex(4)}")
        with open(probe, "xb"):
            pass
        os.remove(probe)
    except OSError as error:
        raise UserError(f"{what} {folder} is not writable ({error.strerror}): choose a folder you can write "
                        f"to") from None


def check_free_space(folder: str, needed_bytes: int, what: str) -> None:
    """Refuse a write of about `needed_bytes` into `folder` when the disk does not have them plus a margin
    (10% + 64 MiB: file-system overhead, and other writers meanwhile)."""
    free = shutil.disk_usage(folder).free
    wanted = int(needed_bytes * 1.1) + 64 * 2**20
    if free < wanted:
        raise RuntimeFailure(f"not enough free space in {folder} for {what}: {free / 2**30:.2f} GiB free, about "
                             f"{wanted / 2**30:.2f} GiB needed; free disk space or use another --save_dir "
                             f"(the previous checkpoint is intact)")


def raise_disk_error(error: OSError, what: str) -> None:
    """Re-raise a full-disk or permission OSError met while writing `what` as one clear line; others unchanged."""
    message = disk_error_message(error, what)
    if message is None:
        raise error
    raise RuntimeFailure(message) from None
