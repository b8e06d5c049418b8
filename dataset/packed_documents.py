"""Documents packed into rows of one length, for continued pretraining: `pack_documents` turns a list of documents
(token-id lists) into rows of exactly `row_length` tokens, with each token's document for the model's `documents`
argument (model/qwen3.py: a token attends to its own document only, and positions restart at 0 at each document's
start) and the labels of a next-token loss.

Layout: the documents, each followed by EOS, are laid end to end in their order and cut into rows of `row_length`
(concatenate and chunk): no padding but at the end of the last row. A document that does not fit in what is left of
a row is split there -- whatever its length, not only one longer than a row: its first part ends the row, and its
continuation starts the next row as a new document segment, at position 0 and without the first part as context (the
price of wasting no token on padding: no mask reaches across rows).

documents: the index of each token's document in the input list (a split document keeps its index in every row it
spans), -1 on the padding, which is a document of its own to the model: pads attend only to pads, no token to them.

labels: as the collators' (dataset/collators.py), unshifted: labels[t] is the token at t, predicted by position
t - 1, the loss shifting them (trainer/losses/chunked.py's completion_hidden). So a document's EOS is predicted by
its last token; a document's first token, which only the previous document's EOS precedes, is IGNORE_INDEX, and so
is every pad. A row's first token is predicted by nothing in its row (the shift drops it): a split document's last
token before the cut predicts nothing -- one label per row boundary, the price of rows that never reach across.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dataset.collators import IGNORE_INDEX

PADDING = -1  # the document index of the last row's padding


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # (R, L) int64
    documents: torch.Tensor  # (R, L) int64: each token's document's index in the input list, PADDING on padding
    labels: torch.Tensor     # (R, L) int64, unshifted: the token, IGNORE_INDEX where its document starts or a pad


def pack_documents(documents: Sequence[Sequence[int]], row_length: int, eos_id: int,
                   pad_id: int | None = None) -> PackedRows:
    """The documents, each followed by `eos_id`, in rows of exactly `row_length` tokens (see the module docstring).
    `pad_id` (default `eos_id`) fills the last row: pads are a document of their own with no label, so their id
    changes no other token's numbers. An empty document is its EOS alone."""
    if row_length < 1:
        raise ValueError(f"row_length: {row_length}, must be at least 1")
    tokens: list[int] = []
    indices: list[int] = []
    labels: list[int] = []
    for index, document in enumerate(documents):
        stream = [*document, eos_id]
        tokens += stream
        indices += [index] * len(stream)
        labels += [IGNORE_INDEX] + stream[1:]
    rows = -(-len(tokens) // row_length)
    padding = rows * row_length - len(tokens)
    tokens += [eos_id if pad_id is None else pad_id] * padding
    indices += [PADDING] * padding
    labels += [IGNORE_INDEX] * padding
    shape = (rows, row_length)
    return PackedRows(torch.tensor(tokens, dtype=torch.long).view(shape),
                      torch.tensor(indices, dtype=torch.long).view(shape),
                      torch.tensor(labels, dtype=torch.long).view(shape))
