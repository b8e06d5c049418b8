"""The data stream: an order that depends on (seed, epoch) alone, sharded across ranks, resumable mid-epoch, and
cut into optimizer steps (`DataStream`: accumulation windows of collated micro-batches).

EpochSampler: one permutation of the dataset per (seed, epoch), from a torch.Generator seeded with a function of
seed and epoch only — never of rank or world size. The permutation is cut to a multiple of world_size W (this drops
fewer than W examples per epoch, different ones each epoch) so that every rank gets the same number of examples and
so the same number of micro-batches: a rank with one micro-batch more would wait forever in DDP's all-reduce.
Rank r takes positions r, r+W, r+2W, ...

Why this order: with batch size b per rank, accumulation A and global batch G = W*b*A, micro-batch m of optimizer
step s on rank r holds the rank-local positions [(s*A+m)*b, (s*A+m+1)*b), i.e. global positions W*j + r. Over all
ranks and micro-batches of step s that is exactly global positions [s*G, (s+1)*G). So 1 process x accumulation 4 and
2 processes x accumulation 2 consume the same examples in every optimizer step and reach the same weights.

SkipBatchSampler: batches of `batch_size` indices from a sampler (the last batch may be short), with the first
`skip_batches` skipped without loading anything (only indices are skipped). After `consumed_samples` examples of an
epoch (counted over all ranks), resume with skip_batches = consumed_samples // (W * b) — see `batches_to_skip`.
That is rank-local position consumed_samples / W, global position consumed_samples: the same stream continues, also
when the world size changed but the global batch did not. Build a new SkipBatchSampler (skip 0) for later epochs.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from common.seeds import derived_seed

class EpochSampler(Sampler[int]):
    """This rank's share of one (seed, epoch) permutation of range(dataset_len); see the module docstring."""

    def __init__(self, dataset_len: int, seed: int = 0, epoch: int = 0, rank: int = 0, world_size: int = 1):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if dataset_len < world_size:
            raise ValueError(f"the dataset has {dataset_len} rows, fewer than world_size={world_size}: "
                             "every rank needs at least one example")
        self.dataset_len = dataset_len
        self.seed = seed
        self.epoch = epoch
        self.rank = rank
        self.world_size = world_size

    def global_order(self) -> list[int]:
        """The epoch's permutation, cut to a multiple of world_size; identical on every rank and world size."""
        generator = torch.Generator().manual_seed(derived_seed(self.seed, self.epoch))  # never rank or world size
        order = torch.randperm(self.dataset_len, generator=generator).tolist()
        return order[:len(order) - len(order) % self.world_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.global_order()[self.rank::self.world_size])

    def __len__(self) -> int:
        return self.dataset_len // self.world_size


def batches_to_skip(consumed_samples: int, world_size: int, batch_size: int) -> int:
    """Per-rank batches to skip after `consumed_samples` examples of this epoch (over all ranks) were trained on.

    Checkpoints are taken at optimizer-step boundaries, so consumed_samples is a multiple of the global batch and
    hence of world_size * batch_size; anything else would resume at a different example, so it is an error.
    """
    per_step = world_size * batch_size
    if consumed_samples < 0 or consumed_samples % per_step:
        raise ValueError(f"consumed_samples={consumed_samples} is not a multiple of world_size*batch_size="
                         f"{per_step}: resume needs the same global batch (world_size*batch_size*accumulation) "
                         "as the run that wrote the checkpoint")
    return consumed_samples // per_step


class SkipBatchSampler(Sampler[list[int]]):
    """Batches of indices from `sampler`, without the first `skip_batches` batches (last batch may be short)."""

    def __init__(self, sampler: Sampler[int], batch_size: int, skip_batches: int = 0):
        if batch_size < 1 or skip_batches < 0:
            raise ValueError(f"need batch_size >= 1 and skip_batches >= 0, got {batch_size}, {skip_batches}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.skip_batches = skip_batches

    def __iter__(self) -> Iterator[list[int]]:
        indices = itertools.islice(iter(self.sampler), self.skip_batches * self.batch_size, None)
        while batch := list(itertools.islice(indices, self.batch_size)):
            yield batch

    def __len__(self) -> int:
        return max(0, math.ceil(len(self.sampler) / self.batch_size) - self.skip_batches)


class Windows:
    """What the run asks of a data stream (DataStream here; a streamed corpus, trainer/skeleton/corpus_stream.py):
    its `rows` per epoch (None: not counted), its `path`, the run's `planned_steps()`, and `_stream(step, epoch,
    samples_in_epoch)`: (epoch, window) from a position, which `windows_ahead` hands out with the steps after each."""
    total_steps = 0  # set by the run once its length is known (--max_steps)

    def windows_ahead(self, count: int, step: int, epoch: int, samples_in_epoch: int):
        """Yield (epoch, window, coming) from the position (`step` optimizer steps done, `samples_in_epoch` global
        samples of `epoch` consumed): `coming` the (step, epoch, window) of the optimizer steps after this one, up
        to `count` of them and none beyond the run's last (OPD's --max_staleness samples them ahead). Yields nothing
        for a run already complete; ends early only when the loop breaks (--max_steps, a stop signal)."""
        stream = self._stream(step, epoch, samples_in_epoch)
        coming = list(itertools.islice(stream, count))
        while True:
            coming.extend(itertools.islice(stream, 1))  # one more, while the stream has any
            if not coming:
                return
            epoch, window = coming.pop(0)
            yield epoch, window, [(step + 1 + i, e, w) for i, (e, w) in enumerate(coming)
                                  if step + 1 + i < self.total_steps]
            step += 1


class DataStream(Windows):
    """The run's rows as optimizer steps: (epoch, window), a window being up to accumulation_steps collated
    micro-batches of this rank (an epoch's last, shorter window is a step of its own), from where the run stands
    (its step, epoch and samples consumed in that epoch: the run's state, which the run alone moves, as windows are
    yielded) to the end of its last epoch."""

    def __init__(self, dataset, collate_fn, args, info):
        self.dataset, self.collate_fn, self.info = dataset, collate_fn, info
        self.batch_size, self.accumulation_steps = args.batch_size, args.accumulation_steps
        self.epochs, self.seed, self.num_workers = args.epochs, args.seed, args.num_workers
        self.rows, self.path = len(dataset), dataset.path

    def micro_batches_per_epoch(self) -> int:
        per_rank = len(self.dataset) // self.info.world_size
        return math.ceil(per_rank / self.batch_size)

    def steps_per_epoch(self) -> int:
        return math.ceil(self.micro_batches_per_epoch() / self.accumulation_steps)

    def planned_steps(self) -> int:
        """The run's steps before --max_steps caps them: its epochs."""
        return self.epochs * self.steps_per_epoch()

    def _stream(self, step: int, current_epoch: int, samples_in_epoch: int):
        """(epoch, window) from the data position on."""
        first_epoch = self.epochs if step >= self.total_steps else current_epoch
        for epoch in range(first_epoch, self.epochs):
            skip = 0
            if epoch == first_epoch:
                skip = batches_to_skip(samples_in_epoch, self.info.world_size, self.batch_size)
            sampler = EpochSampler(len(self.dataset), self.seed, epoch, self.info.rank, self.info.world_size)
            loader = DataLoader(self.dataset, batch_sampler=SkipBatchSampler(sampler, self.batch_size, skip),
                                collate_fn=self.collate_fn, num_workers=self.num_workers)
            window = []
            for batch in loader:
                window.append(batch)
                if len(window) == self.accumulation_steps:
                    yield epoch, window
                    window = []
            if window:
                yield epoch, window
