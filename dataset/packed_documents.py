"""Documents packed into rows of one length, for continued pretraining: `pack_documents` turns a list of documents
(token-id lists) into rows of exactly `row_length` tokens, with each token's document for the model's `documents`
argument (model/qwen3.py: a token attends to its own document only, and positions restart at 0 at each document's
start) and the labels of a next-token loss. `RowPacker` builds the same layout a row at a time, for a corpus too large
to hold (dataset/text_stream.py); pack_documents is made with it.

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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from dataset.collators import IGNORE_INDEX

PADDING = -1  # the document index of the last row's padding


@dataclass
class PackedRows:
    input_ids: torch.Tensor  # (R, L) int64
    documents: torch.Tensor  # (R, L) int64: each token's document's index in the input list, PADDING on padding
    labels: torch.Tensor     # (R, L) int64, unshifted: the token, IGNORE_INDEX where its document starts or a pad

    @staticmethod
    def cat(rows: Sequence[PackedRows]) -> PackedRows:
        """The rows of several PackedRows (at least one) one under the other, in their order."""
        return PackedRows(*(torch.cat(parts) for parts in zip(*((r.input_ids, r.documents, r.labels) for r in rows))))


class RowPacker:
    """The layout above built row by row: documents are added one at a time and each row is handed out as soon as
    it is full, so at most one row's tokens wait here (dataset/text_stream.py packs a corpus with it)."""

    def __init__(self, row_length: int, eos_id: int, pad_id: int | None = None):
        if row_length < 1:
            raise ValueError(f"row_length: {row_length}, must be at least 1")
        self.row_length = row_length
        self.eos_id = eos_id
        self.pad_id = eos_id if pad_id is None else pad_id
        self._tokens: list[int] = []
        self._documents: list[int] = []
        self._labels: list[int] = []

    def add(self, document: Sequence[int], index: int, offset: int = 0) -> Iterator[tuple[PackedRows, int]]:
        """Lays `document` followed by EOS, from its token `offset` on (0: the whole document), after the tokens
        waiting, as document `index`; yields each row this fills (1, row_length) with the offset of the document's
        first token not in it (len(document) + 1 once the EOS is in). A document resumed at an offset > 0 is a
        continuation at a row's start: its first token keeps its label, which that row cannot predict anyway."""
        stream = [*document, self.eos_id]
        while offset < len(stream):
            piece = stream[offset:offset + self.row_length - len(self._tokens)]
            self._tokens += piece
            self._documents += [index] * len(piece)
            self._labels += [IGNORE_INDEX] + piece[1:] if offset == 0 else piece
            offset += len(piece)
            if len(self._tokens) == self.row_length:
                yield self._take(), offset

    def pad(self) -> PackedRows | None:
        """The tokens waiting, padded to a row (None when none wait): the last row. The next add starts a new row."""
        if not self._tokens:
            return None
        padding = self.row_length - len(self._tokens)
        self._tokens += [self.pad_id] * padding
        self._documents += [PADDING] * padding
        self._labels += [IGNORE_INDEX] * padding
        return self._take()

    def _take(self) -> PackedRows:
        row = PackedRows(*(torch.tensor([values], dtype=torch.long)
                           for values in (self._tokens, self._documents, self._labels)))
        self._tokens, self._documents, self._labels = [], [], []
        return row


def pack_documents(documents: Sequence[Sequence[int]], row_length: int, eos_id: int,
                   pad_id: int | None = None) -> PackedRows:
    """The documents, each followed by `eos_id`, in rows of exactly `row_length` tokens (see the module docstring).
    `pad_id` (default `eos_id`) fills the last row: pads are a document of their own with no label, so their id
    changes no other token's numbers. An empty document is its EOS alone."""
    packer = RowPacker(row_length, eos_id, pad_id)
    rows = [row for index, document in enumerate(documents) for row, _ in packer.add(document, index)]
    last = packer.pad()
    rows += [] if last is None else [last]
    if not rows:  # no documents: no rows
        return PackedRows(*(torch.empty(0, row_length, dtype=torch.long) for _ in range(3)))
    return PackedRows.cat(rows)
