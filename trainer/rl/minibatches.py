"""A rollout batch cut into minibatches for several updates (PPO's epochs): the rows a step sampled, each
micro-batch's sequences and per-token values kept until its last update, then E passes over M minibatches of whole
groups.

Minibatch k of a step is the prompts [k P / M, (k + 1) P / M) of this rank's P (in the data stream's order, with all
G completions of each), which over all ranks is the block [k N / M, (k + 1) N / M) of the step's N global rows
(trainer/skeleton/data_stream.py: rank r's local row j is global row W j + r): the same rows whatever the world size,
batch size and accumulation, when M divides the rows per rank (trainer/config/rl.py refuses it otherwise; a short tail
window is cut as evenly as its rows allow). A minibatch's rows may lie in several micro-batches, or be part of one:
each part is trained as it lies, one forward per part, DDP syncing on the minibatch's last.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dataset.collators import IGNORE_INDEX


@dataclass
class Rollout:
    """One micro-batch's sampled sequences (right padded), its per-token values (n, 4) and the rollout
    correction's importance weights (n,) (None: 1), in completion_hidden's order (trainer/losses/chunked.py: row by
    row)."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    values: torch.Tensor
    is_weights: torch.Tensor | None = None

    def rows(self, start: int, stop: int) -> Rollout:
        """Rows [start, stop) with their tokens' values and weights."""
        tokens = (self.labels[:, 1:] != IGNORE_INDEX).sum(dim=1).tolist()  # each row's positions, in order
        first = sum(tokens[:start])
        taken = slice(first, first + sum(tokens[start:stop]))
        return Rollout(self.input_ids[start:stop], self.attention_mask[start:stop], self.labels[start:stop],
                       self.values[taken], None if self.is_weights is None else self.is_weights[taken])

    def corrected(self, weights: torch.Tensor, keep: torch.Tensor) -> Rollout:
        """With the rollout correction's weights (n,) on its tokens, and the tokens `keep` (n,) marks False out of
        the loss and its token count (their labels ignored, their values and weights gone)."""
        positions = (self.labels[:, 1:] != IGNORE_INDEX).nonzero()  # (n, 2): completion_hidden's order
        dropped = positions[~keep]
        labels = self.labels.clone()
        labels[dropped[:, 0], dropped[:, 1] + 1] = IGNORE_INDEX
        return Rollout(self.input_ids, self.attention_mask, labels, self.values[keep], weights[keep])


def minibatches(batch: list[Rollout], epochs: int, count: int, group_size: int) -> Iterator[list[Rollout]]:
    """`epochs` passes over `count` minibatches of the rollout batch `batch` (its micro-batches in order), each a list
    of parts (module docstring); with one minibatch, the micro-batches themselves."""
    prompts = sum(len(part.input_ids) for part in batch) // group_size
    for _ in range(epochs):
        for k in range(count):
            if count == 1:
                yield batch
                continue
            start, stop = k * prompts // count * group_size, (k + 1) * prompts // count * group_size
            parts, offset = [], 0
            for part in batch:
                rows = len(part.input_ids)
                first, last = max(start - offset, 0), min(stop - offset, rows)
                if first < last:
                    parts.append(part if (first, last) == (0, rows) else part.rows(first, last))
                offset += rows
            yield parts
