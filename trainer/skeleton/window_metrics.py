"""The numbers of an accumulation window -- the loss and the loops' own metrics -- summed over its micro-batches
and reduced over all ranks in one all-reduce at the optimizer step, each by the kind its name was added with."""
from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.skeleton.distributed import DistInfo


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


class WindowMetrics:
    """The numbers of one accumulation window, summed over its micro-batches and reduced over all ranks in one
    all-reduce at the optimizer step. Each name says how it is reduced:

        token_mean(name, sum)     a sum over loss tokens, logged per loss token of the whole window (loss, ce, kd)
        ratio(name, num, den)     sum of numerators / sum of denominators (eos_share = rows ended / rows); with
                                  when_empty=False a window whose denominators sum to 0 logs no value at all
                                  (a teacher with no rows has no loss, not a loss of 0)
        total(name, value)        a plain sum (tokens, generated_tokens)
        rank_mean(name, value)    the mean over ranks of a per-rank number (seconds spent in a phase)
        maximum(name, value)      the largest over micro-batches and ranks (a second all-reduce, MAX, only in a
                                  window that has one)

    Every rank must add the same names (they travel in one tensor, in sorted order)."""

    def __init__(self, device: str):
        self.device = device
        self.kinds: dict[str, str] = {}
        self.sums: dict[str, list[torch.Tensor]] = {}
        self.undefined_when_empty: set[str] = set()

    def _add(self, kind: str, name: str, *values) -> None:
        if self.kinds.setdefault(name, kind) != kind:
            raise ValueError(f"metric {name!r} is a {self.kinds[name]}, not a {kind}")
        tensors = [torch.as_tensor(v).detach().to(self.device, torch.float64) for v in values]
        combine = torch.maximum if kind == "maximum" else torch.add
        self.sums[name] = [combine(old, new) for old, new in zip(self.sums[name], tensors)] if name in self.sums \
            else tensors

    def token_mean(self, name: str, value) -> None:
        self._add("token_mean", name, value)

    def ratio(self, name: str, numerator, denominator, when_empty: bool = True) -> None:
        self._add("ratio", name, numerator, denominator)
        if not when_empty:
            self.undefined_when_empty.add(name)

    def total(self, name: str, value) -> None:
        self._add("total", name, value)

    def rank_mean(self, name: str, value) -> None:
        self._add("rank_mean", name, value)

    def maximum(self, name: str, value) -> None:
        self._add("maximum", name, value)

    def merge(self, other: WindowMetrics) -> None:
        """Add what a component collected on its own (`other`, each name with its kind) to this window, and empty
        `other` for the next one."""
        for name, values in other.sums.items():
            self._add(other.kinds[name], name, *values)
        self.undefined_when_empty |= other.undefined_when_empty
        other.kinds, other.sums, other.undefined_when_empty = {}, {}, set()

    def reduce(self, info: DistInfo, extra: float = 0.0) -> tuple[dict[str, float], float]:
        """-> (name -> value, the all-ranks sum of `extra`), and start the next window empty. `extra` rides along
        in the same all-reduce (the stop flag: one collective per step, not two)."""
        maxima = sorted(name for name in self.sums if self.kinds[name] == "maximum")
        names = sorted(name for name in self.sums if self.kinds[name] != "maximum")
        flat = [t for name in names for t in self.sums[name]]
        reduced = all_reduce_sum(torch.stack([*flat, torch.tensor(extra, dtype=torch.float64, device=self.device)]),
                                 info).tolist()
        largest = torch.stack([self.sums[name][0] for name in maxima]) if maxima else None
        if largest is not None and info.enabled:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX)
        sums, position = {}, 0
        for name in names:
            width = len(self.sums[name])
            sums[name], position = reduced[position:position + width], position + width
        tokens = max(sums.get("tokens", [0.0])[0], 1.0)
        divisor = {"token_mean": lambda _: tokens, "ratio": lambda s: max(s[1], 1e-12), "total": lambda _: 1.0,
                   "rank_mean": lambda _: info.world_size}
        values = {name: sums[name][0] / divisor[self.kinds[name]](sums[name]) for name in names
                  if not (name in self.undefined_when_empty and sums[name][1] == 0)}
        values.update(zip(maxima, [] if largest is None else largest.tolist()))
        self.kinds, self.sums, self.undefined_when_empty = {}, {}, set()
        return values, reduced[-1]
