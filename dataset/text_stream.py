"""A raw-text corpus for continued pretraining, streamed: each record's `text` tokenised on the fly and packed into
rows of one length (dataset/packed_documents.py's layout), from a position small enough for a checkpoint to keep.

Corpus: a `.parquet` or `.jsonl` file, or a folder of them -- its files of those two kinds in sorted name order (its
subfolders and other files are not read). Each record's `text` column is one document, a string; an empty string is
a document of its EOS alone. JSONL holds one object a line; a blank line is no record (as in dataset/sources.py).
EOS and padding are the tokenizer's `eos_token_id` and `pad_token_id`, or both `separator` when given (continued
pretraining's `<|endoftext|>`: trainer/train_pretrain.py).

Checks. At construction, only what costs no pass over the corpus: the path exists, a folder holds at least one such
file, and every parquet file's footer reads and has a `text` column of strings. A record whose `text` is missing, null
or not a string, a line that is not JSON, a damaged page: a DataError naming the file and the 0-based row (jsonl: and
the 1-based line), raised when the stream reads the batch that holds it -- finding it at start-up would take a full
pass over a corpus of any size. A corpus without a single record is refused at the end of its first epoch.

Memory does not grow with the corpus: parquet is read in record batches of `batch_size` (the `text` column only;
pyarrow's buffers are bounded by a row group, not the file), jsonl line by line; `batch_size` records are tokenised
at a time (`encode_batch`); the stream holds one batch of texts, their token lists, and the tokens of the row being
filled (RowPacker).

Rows: each a PackedRows of one row, (1, row_length), in pack_documents' layout over an epoch's documents; a token's
`documents` value is its record's index in the epoch, counted over the files in order. An epoch is one pass over the
files in order. Its last row is padded (documents PADDING, labels IGNORE_INDEX) and the next epoch starts a fresh row:
every epoch has the same rows. The stream runs from its position to the end of epoch `epochs - 1`, or without end
when `epochs` is None (the loop stops it: a run's length is its steps).

Position: `position()` is a small dict (JSON) naming the first token not yet emitted in a row -- the epoch, the
file's index, the record's index in that file, the token's offset in that record's token list (its EOS counted), the
record's index in the epoch, the rows emitted so far in the epoch -- and `corpus`, a digest of the files' names and
sizes. `TextStream(..., start=position)` emits exactly the rows an uninterrupted stream would have emitted next, and
parses nothing before the position: parquet skips whole row groups by their footer's row counts (the group holding
the position is decoded from its start and sliced), jsonl reads the lines before it only to count them -- no JSON
parsed, but the file's bytes up to the position read, so a corpus of many jsonl shards resumes faster than one large
file. Iterating the stream again goes on from its position. A start taken on other files (one added, removed,
renamed or resized: another digest) is refused at construction; one whose record is not in its file any more, or
whose record has fewer tokens than its offset, when the stream seeks there. An edit that keeps every size and the
records' count goes unnoticed: the digest is cheap by design, not a hash of the corpus. The offset counts the
tokenizer's tokens: resume with the tokenizer the position was taken with.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields, replace

import pyarrow as pa
import pyarrow.parquet as pq

from dataset.packed_documents import PackedRows, RowPacker
from dataset.sources import DataError, decode_line
from model.tokenizer import QwenTokenizer

EXTENSIONS = (".parquet", ".jsonl")
CHANGED = "the corpus changed since the position was taken: restore its files, or start without a position"


@dataclass(frozen=True)
class StreamPosition:
    """The first token not yet emitted in a row (the module docstring)."""
    epoch: int = 0
    file: int = 0      # the file's index in the corpus
    record: int = 0    # the record's 0-based index in its file
    token: int = 0     # the offset in the record's token list, its EOS counted
    document: int = 0  # the record's index in its epoch: its tokens' `documents` value
    rows: int = 0      # the rows emitted so far in the epoch
    corpus: str = ""   # a digest of the files' names and sizes (_corpus_digest)


class TextStream:
    """The corpus at `path` as rows of `row_length` tokens, from `start` (a `position()`) or the beginning."""

    def __init__(self, path: str, tokenizer: QwenTokenizer, row_length: int, batch_size: int = 64,
                 epochs: int | None = None, start: dict | None = None, separator: int | None = None):
        if row_length < 1 or batch_size < 1:
            raise ValueError(f"row_length {row_length}, batch_size {batch_size}: both must be at least 1")
        self.path = path
        self.files = _corpus_files(path)
        for file in self.files:
            if file.endswith(".parquet"):
                _check_parquet_schema(file)
        self.corpus = _corpus_digest(self.files)
        self.tokenizer = tokenizer
        self.row_length = row_length
        self.batch_size = batch_size
        self.epochs = epochs
        self.eos_id = tokenizer.eos_token_id if separator is None else separator
        self.pad_id = tokenizer.pad_token_id if separator is None else separator
        self._at = StreamPosition(corpus=self.corpus) if start is None else self._checked_start(start)

    def position(self) -> dict:
        """Where the stream stands: pass it as `start` to go on from here."""
        return asdict(self._at)

    def __iter__(self) -> Iterator[PackedRows]:
        """The rows from the position on; the position moves with each row emitted."""
        while self.epochs is None or self._at.epoch < self.epochs:
            yield from self.rest_of_epoch()

    def rest_of_epoch(self) -> Iterator[PackedRows]:
        """The rows from the position to the end of its epoch; the position is then the next epoch's start (a
        caller that cuts its own windows by epoch iterates this)."""
        # a packer of its own: one that an error stopped mid-row holds that row's first tokens
        packer = RowPacker(self.row_length, self.eos_id, self.pad_id)
        epoch, offset = self._at.epoch, self._at.token  # the first record starts at the offset, the others at 0
        for file, record, document, tokens in self._records():
            if offset > len(tokens):
                raise DataError(f"{self.files[file]}: row {record}: {len(tokens)} tokens and its EOS, fewer than the "
                                f"start position's offset {offset}: {CHANGED}")
            for row, cut in packer.add(tokens, document, offset):
                done = cut == len(tokens) + 1  # the row ended with the record's EOS: the next row starts the next one
                self._at = replace(self._at, file=file, record=record + 1 if done else record, token=0 if done else cut,
                                   document=document + 1 if done else document, rows=self._at.rows + 1)
                yield row
            offset = 0
        last = packer.pad()
        if self._at.rows == 0 and last is None:
            raise DataError(f"{self.path}: the corpus holds no record: give files with at least one `text`")
        self._at = StreamPosition(epoch=epoch + 1, corpus=self.corpus)
        if last is not None:
            yield last

    def _records(self) -> Iterator[tuple[int, int, int, list[int]]]:
        """(file index, record index, document index, token ids) of each record from the position's to the epoch's
        end, tokenised `batch_size` records at a time."""
        at = self._at
        document = at.document
        for file in range(at.file, len(self.files)):
            record = at.record if file == at.file else 0
            for texts in _read_texts(self.files[file], record, self.batch_size):
                for tokens in self.tokenizer.encode_batch(texts):
                    yield file, record, document, tokens
                    record, document = record + 1, document + 1

    def _checked_start(self, start: dict) -> StreamPosition:
        names = {field.name for field in fields(StreamPosition)}
        counts = names - {"corpus"}
        if (not isinstance(start, dict) or set(start) != names or not isinstance(start["corpus"], str)
                or not all(isinstance(start[name], int) and start[name] >= 0 for name in counts)):
            raise DataError(f"start position {start!r}: not a text stream's position (a dict of "
                            f"{', '.join(sorted(names))}): pass what position() returned")
        if start["corpus"] != self.corpus or start["file"] >= len(self.files):
            raise DataError(f"{self.path}: the start position was taken on other files (names or sizes: corpus "
                            f"{start['corpus']}, now {self.corpus}): {CHANGED}")
        return StreamPosition(**start)


def _corpus_files(path: str) -> list[str]:
    """`path` itself, or a folder's .parquet and .jsonl files in sorted name order."""
    if not os.path.exists(path):
        where = "" if os.path.isabs(path) else f" (looked for {os.path.abspath(path)})"
        raise DataError(f"corpus not found: {path}{where}: check the path")
    if not os.path.isdir(path):
        if not path.endswith(EXTENSIONS):
            raise DataError(f"{path}: unsupported file type: convert it to .parquet or .jsonl")
        return [path]
    files = [os.path.join(path, name) for name in sorted(os.listdir(path))
             if name.endswith(EXTENSIONS) and os.path.isfile(os.path.join(path, name))]
    if not files:
        raise DataError(f"{path}: a folder without a .parquet or .jsonl file (its subfolders are not read): put the "
                        f"corpus's files in it, or give a file")
    return files


def _corpus_digest(files: list[str]) -> str:
    """16 hex digits of sha256 over the files' names (without their folder: a corpus moved is the same) and sizes:
    cheap for any number of shards of any size, and a position's size whatever the corpus."""
    listing = [[os.path.basename(file), os.path.getsize(file)] for file in files]
    return hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:16]


def _unreadable_parquet(path: str, error: Exception) -> DataError:
    return DataError(f"{path}: not a readable parquet file ({' '.join(str(error).split())}): the file is damaged, "
                     f"cut short or not parquet; export or download it again")


def _check_parquet_schema(path: str) -> None:
    """The footer only: the file is parquet and has a `text` column of strings."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise _unreadable_parquet(path, e) from None
    if "text" not in schema.names:
        raise DataError(f"{path}: no `text` column (columns: {', '.join(schema.names)}): name the column that holds "
                        f"each document's text `text`")
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: the `text` column holds {kind}, not strings: store each document's text as a string")


def _read_texts(path: str, start: int, batch_size: int) -> Iterator[list[str]]:
    """The texts of a file's records from record `start` on, at most `batch_size` at a time (pyarrow's batches may
    be shorter), each checked to be a string."""
    reader = _parquet_texts if path.endswith(".parquet") else _jsonl_texts
    return reader(path, start, batch_size)


def _parquet_texts(path: str, start: int, batch_size: int) -> Iterator[list[str]]:
    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise _unreadable_parquet(path, e) from None
    with file:
        groups, skip = _row_groups_from(file.metadata, start, path)
        if not groups:  # the position is the file's end (iter_batches would read every group of an empty list)
            return
        batches = file.iter_batches(batch_size=batch_size, row_groups=groups, columns=["text"])
        row = start
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as e:
                raise _unreadable_parquet(path, e) from None
            if batch is None:
                return
            if skip >= batch.num_rows:  # before the start, in the first group: decoded with it, never converted
                skip -= batch.num_rows
                continue
            texts = batch.column(0).slice(skip).to_pylist()
            skip = 0
            for i, text in enumerate(texts):  # a string column: a null is the only value that is not a string
                if text is None:
                    raise DataError(f"{path}: row {row + i}: `text` is null: every record needs its text as a string")
            yield texts
            row += len(texts)


def _row_groups_from(metadata: pq.FileMetaData, start: int, path: str) -> tuple[list[int], int]:
    """The row groups from the one holding record `start` on, and how many of that group's records come before it;
    no group when `start` is the file's end."""
    if start > metadata.num_rows:
        raise DataError(f"{path}: the start position's row {start} is past the file's end (it holds "
                        f"{metadata.num_rows}): {CHANGED}")
    before = 0
    for group in range(metadata.num_row_groups):
        rows = metadata.row_group(group).num_rows
        if start < before + rows:
            return list(range(group, metadata.num_row_groups)), start - before
        before += rows
    return [], 0


def _jsonl_texts(path: str, start: int, batch_size: int) -> Iterator[list[str]]:
    row, texts = 0, []
    try:
        with open(path, "rb") as f:
            for line_no, raw_line in enumerate(f, start=1):
                if not raw_line.strip():
                    continue
                if row >= start:  # the lines before the start are counted, never parsed
                    texts.append(_jsonl_text(raw_line, path, row, line_no))
                    if len(texts) == batch_size:
                        yield texts
                        texts = []
                row += 1
    except OSError as e:
        raise DataError(f"{path}: cannot read the file ({e.strerror}): check that you may read it") from None
    if row < start:
        raise DataError(f"{path}: the start position's row {start} is past the file's end (it holds {row}): "
                        f"{CHANGED}")
    if texts:
        yield texts


def _jsonl_text(raw_line: bytes, path: str, row: int, line_no: int) -> str:
    where = f"{path}: row {row} (line {line_no})"
    try:
        record = json.loads(decode_line(raw_line, path, line_no))
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: invalid JSON: {e}") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, expected an object with a `text` string")
    text = record.get("text")
    if not isinstance(text, str):
        what = "missing" if "text" not in record else "null" if text is None else f"a {type(text).__name__}"
        raise DataError(f"{where}: `text` is {what}, not a string: every record needs its text as a string")
    return text
