# python -m pytest tests/test_data_stream.py
"""Data order: a function of (seed, epoch) alone; equal optimizer steps across world sizes; exact resume."""
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from trainer.skeleton.data_stream import EpochSampler, SkipBatchSampler, batches_to_skip

N, SEED = 103, 7  # N is deliberately not a multiple of any world size used below


def rank_batches(world_size: int, batch_size: int, epoch: int = 0, skip_batches: int = 0, n: int = N):
    """Per rank, the list of micro-batches (lists of indices) it would load."""
    return [list(SkipBatchSampler(EpochSampler(n, SEED, epoch, rank, world_size), batch_size, skip_batches))
            for rank in range(world_size)]


def optimizer_steps(world_size: int, batch_size: int, accumulation: int, skip_batches: int = 0) -> list[set[int]]:
    """The SET of examples each full optimizer step consumes, over all ranks and micro-batches."""
    per_rank = rank_batches(world_size, batch_size, skip_batches=skip_batches)
    steps = len(per_rank[0]) // accumulation
    return [{i for batches in per_rank for batch in batches[s * accumulation:(s + 1) * accumulation]
             if len(batch) == batch_size for i in batch} for s in range(steps)]


def test_permutation_depends_on_seed_and_epoch_only():
    orders = {w: EpochSampler(N, SEED, epoch=3, world_size=w).global_order() for w in (1, 2, 4)}
    for w, order in orders.items():
        assert order == orders[1][:len(order)] and N - len(order) < w
    sampler = EpochSampler(N, SEED, epoch=0)
    first = list(sampler)
    next_epoch = list(EpochSampler(N, SEED, epoch=1))
    assert next_epoch != first and sorted(next_epoch) == sorted(first) == list(range(N))
    assert list(EpochSampler(N, SEED + 1)) != first
    assert list(EpochSampler(N, SEED, epoch=0)) == first


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_partition_the_truncated_permutation(world_size):
    order = EpochSampler(N, SEED, world_size=world_size).global_order()
    shards = [list(EpochSampler(N, SEED, rank=r, world_size=world_size)) for r in range(world_size)]
    assert len({len(s) for s in shards}) == 1, "every rank needs the same number of examples (else DDP hangs)"
    assert all(len(EpochSampler(N, SEED, rank=r, world_size=world_size)) == len(s) for r, s in enumerate(shards))
    for r, shard in enumerate(shards):
        assert shard == order[r::world_size]
    assert sorted(i for s in shards for i in s) == sorted(order)


@pytest.mark.parametrize("world_size,batch_size,accumulation", [(1, 4, 2), (2, 2, 2), (2, 4, 1), (4, 2, 1)])
def test_optimizer_step_consumes_same_examples_on_any_world_size(world_size, batch_size, accumulation):
    global_batch = world_size * batch_size * accumulation
    assert global_batch == 8
    order = EpochSampler(N, SEED).global_order()
    reference = [set(order[s * 8:(s + 1) * 8]) for s in range(N // 8)]
    steps = optimizer_steps(world_size, batch_size, accumulation)
    full = (N - N % world_size) // global_batch  # steps whose micro-batches are all full
    assert full >= 12 and steps[:full] == reference[:full]
    assert steps[:full] == optimizer_steps(1, 8, 1)[:full]


@pytest.mark.parametrize("before,after", [((1, 4, 2), (1, 4, 2)), ((2, 2, 2), (2, 2, 2)), ((1, 8, 1), (2, 2, 2)),
                                          ((2, 2, 2), (4, 1, 2)), ((4, 2, 1), (1, 2, 4))])
def test_resume_continues_the_same_stream(before, after):
    (w0, b0, a0), (w1, b1, a1) = before, after
    assert w0 * b0 * a0 == w1 * b1 * a1 == 8
    done_steps = 5
    consumed = done_steps * 8
    skip = batches_to_skip(consumed, w1, b1)
    resumed = optimizer_steps(w1, b1, a1, skip_batches=skip)
    uninterrupted = optimizer_steps(w1, b1, a1)[done_steps:]
    assert resumed[:len(uninterrupted)] == uninterrupted and len(uninterrupted) >= 6
    assert uninterrupted[0] == set(EpochSampler(N, SEED).global_order()[consumed:consumed + 8])
    full = (N - N % max(w0, w1)) // 8  # steps that are complete under both layouts
    assert resumed[:full - done_steps] == optimizer_steps(w0, b0, a0)[done_steps:full]
    if before == after:  # same layout: the exact micro-batch stream continues on every rank
        for rank_resumed, rank_full in zip(rank_batches(w1, b1, skip_batches=skip), rank_batches(w1, b1)):
            assert rank_resumed == rank_full[skip:]


def test_skip_batch_sampler_batches_and_len():
    sampler = EpochSampler(10, SEED)
    batches = list(SkipBatchSampler(sampler, 4))
    assert [len(b) for b in batches] == [4, 4, 2] and sum(batches, []) == list(sampler)
    assert len(SkipBatchSampler(sampler, 4)) == 3
    skipped = SkipBatchSampler(sampler, 4, skip_batches=2)
    assert list(skipped) == batches[2:] and len(skipped) == 1
    past_end = SkipBatchSampler(sampler, 4, skip_batches=5)
    assert list(past_end) == [] and len(past_end) == 0


class RecordingDataset(Dataset):
    def __init__(self, n: int):
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        self.loaded.append(i)
        return i


def test_skipped_batches_are_never_loaded():
    dataset = RecordingDataset(20)
    sampler = EpochSampler(len(dataset), SEED)
    loader = DataLoader(dataset, batch_sampler=SkipBatchSampler(sampler, 3, skip_batches=4))
    seen = torch.cat(list(loader)).tolist()
    assert seen == list(sampler)[12:] and dataset.loaded == seen


def test_batches_to_skip_refuses_a_changed_global_batch():
    assert batches_to_skip(48, world_size=2, batch_size=4) == 6
    with pytest.raises(ValueError, match="global batch"):
        batches_to_skip(40, world_size=4, batch_size=4)


def test_bad_arguments():
    with pytest.raises(ValueError):
        EpochSampler(10, rank=2, world_size=2)
    with pytest.raises(ValueError):
        EpochSampler(1, world_size=2)
    with pytest.raises(ValueError):
        SkipBatchSampler(EpochSampler(10), batch_size=0)
