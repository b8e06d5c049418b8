"""A raw-text corpus as the run's optimizer steps (train_pretrain.py): rows of packed documents streamed from
dataset/text_stream.py, cut into accumulation windows, and the stream's position kept in every checkpoint, so that a
resume continues at the first token the run has not trained on -- without reading the corpus again up to there.

Order. Step s of an epoch trains the stream's rows [s*G, (s+1)*G) of that epoch (G the global batch); rank r takes
rows r, r + W, r + 2W, ... of them, in micro-batches of --batch_size -- the order of the map-style stream
(trainer/skeleton/data_stream.py), so 1 process x accumulation 4 and 2 ranks x accumulation 2 train the same rows in
every step and reach the same weights. Every rank reads and tokenises the whole corpus for it (W times the
tokenising of one process: cheap beside a GPU's step at these row lengths, and what keeps the rows of a step
independent of the world size). An epoch's last window holds the rows left, cut to a multiple of W (fewer than W
rows are dropped, as the map-style stream drops them: no rank may have a micro-batch more than another).

Length. Without --max_steps, one tokenising pass at start-up counts an epoch's rows (memory independent of the
corpus's size, as the training's) and the run is --epochs passes. With --max_steps there is no such pass: the run is
that many steps, the corpus repeated as often as they take (--epochs is not read).

Resume. Every save keeps `position()`: the text stream's position after the last trained window (an epoch's end
after its last window) and a digest of the tokenizer, whose token offsets the position counts; `start_at` refuses a
position taken with another tokenizer, and the text stream one taken on other files.
"""
from __future__ import annotations

import hashlib
import math
import os

from common.errors import UserError
from dataset.packed_documents import PackedRows
from dataset.text_stream import TextStream
from model.tokenizer import QwenTokenizer
from trainer.skeleton.data_stream import Windows
from trainer.skeleton.distributed import DistInfo, print0


class CorpusStream(Windows):
    """The corpus at `path` as windows of packed rows of --max_length tokens, each document followed by
    `separator`; see the module docstring."""

    def __init__(self, path: str, tokenizer: QwenTokenizer, separator: int, args, info: DistInfo):
        self.path, self.info, self.separator = path, info, separator
        self.tokenizer, self.row_length = tokenizer, args.max_length
        self.batch_size, self.accumulation_steps = args.batch_size, args.accumulation_steps
        self.max_steps, self.epochs = args.max_steps, args.epochs
        self.tokenizer_digest = file_digest(os.path.join(tokenizer.folder, "tokenizer.json"))
        self.text = self.open(None)  # checks the files now: a missing corpus stops the run before any model loads
        self.rows = None if args.max_steps else self.count_rows()
        if self.rows is not None and self.rows < info.world_size:
            raise UserError(self.too_short(self.rows))
        self.last_position = self.text.position()

    def open(self, start: dict | None) -> TextStream:
        return TextStream(self.path, self.tokenizer, self.row_length, start=start, separator=self.separator)

    def count_rows(self) -> int:
        """An epoch's rows: one pass over the corpus, tokenised as the training will."""
        print0(f"counting the rows of {os.path.relpath(self.path)} (one tokenising pass; --max_steps skips it)")
        return sum(1 for _ in self.open(None).rest_of_epoch())

    def steps_per_epoch(self) -> int:
        usable = self.rows - self.rows % self.info.world_size
        return math.ceil(usable / self.info.world_size / self.batch_size / self.accumulation_steps)

    def planned_steps(self) -> int:
        """--max_steps when given (the corpus then repeats), else --epochs passes over the counted rows."""
        return self.max_steps or self.epochs * self.steps_per_epoch()

    def start_at(self, position: dict | None) -> None:
        """Continue where `position` (a resumed run's kept `position()`) says; None: the corpus's beginning."""
        if position is None:
            return
        if position["tokenizer"] != self.tokenizer_digest:
            raise UserError(f"{self.path}: the run's position in the corpus counts the tokens of another tokenizer "
                            f"(tokenizer.json digest {position['tokenizer']}, now {self.tokenizer_digest}): resume "
                            f"with the tokenizer the run started with, or start over (--start_over 1)")
        self.text = self.open(position["text"])
        self.last_position = self.text.position()

    def position(self) -> dict:
        """Where the corpus stands after the last window handed out: what a checkpoint keeps."""
        return {"text": self.last_position, "tokenizer": self.tokenizer_digest}

    def _stream(self, step: int, current_epoch: int, samples_in_epoch: int):
        """(epoch, window) from the text stream's position on, `step` steps done: the position itself (not the
        epoch and samples, which the run keeps for its logs) says where the corpus stands."""
        global_batch = self.batch_size * self.accumulation_steps * self.info.world_size
        while step < self.total_steps and (self.max_steps or self.text.position()["epoch"] < self.epochs):
            at = self.text.position()
            epoch, whole, handed, rows, seen = at["epoch"], at["rows"] == 0, False, [], 0
            for row in self.text.rest_of_epoch():
                rows.append(row)
                seen += 1
                if len(rows) == global_batch:
                    yield self.handed_out(epoch, rows)
                    step, rows, handed = step + 1, [], True
                    if step >= self.total_steps:
                        return
            rows = rows[:len(rows) - len(rows) % self.info.world_size]
            if rows:
                yield self.handed_out(epoch, rows)
                step, handed = step + 1, True
            if whole and not handed:  # a pass without a window: --max_steps would wait for one forever
                raise UserError(self.too_short(seen))

    def too_short(self, rows: int) -> str:
        return (f"{self.path}: the corpus packs into {rows} row(s) of {self.row_length} tokens, fewer than the "
                f"{self.info.world_size} ranks: give more text, a smaller --max_length or fewer ranks")

    def handed_out(self, epoch: int, rows: list[PackedRows]) -> tuple[int, list[dict]]:
        """A window of the global `rows`: this rank's share in micro-batches; the position moves past them."""
        self.last_position = self.text.position()
        mine = rows[self.info.rank::self.info.world_size]
        window = []
        for start in range(0, len(mine), self.batch_size):
            batch = PackedRows.cat(mine[start:start + self.batch_size])
            window.append({"input_ids": batch.input_ids, "documents": batch.documents, "labels": batch.labels})
        return epoch, window


def file_digest(path: str) -> str:
    """16 hex digits of sha256 over a file's bytes."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def document_separator(tokenizer: QwenTokenizer) -> int:
    """The token after each document: `<|endoftext|>` where the tokenizer has it (Qwen's pretraining separator, and
    its base models' EOS), else the tokenizer's EOS -- not Qwen3's chat EOS `<|im_end|>`, which closes a chat turn."""
    token = tokenizer.token_to_id("<|endoftext|>")
    return tokenizer.eos_token_id if token is None else token
