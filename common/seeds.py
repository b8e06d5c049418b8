"""Seeds: the one way this project turns numbers into a seed, and seeds the global generators."""
from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def derived_seed(*parts: int) -> int:
    """A seed that is a pure function of its parts (e.g. seed, epoch, row, sample). Python's hash() is salted per
    process, so it cannot serve: a resumed run must draw exactly what the killed one would have."""
    digest = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global generators (all CUDA devices included)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)  # numpy's legacy generator takes 32 bits
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
