# python -m pytest -q -n0 tests/test_text_stream.py
"""dataset/text_stream.py: a raw-text corpus streamed as packed rows -- the rows are pack_documents' over each epoch,
a stream resumed from any row's position emits exactly the rest, what it holds does not grow with the corpus, bad
corpora and stale positions are refused, and a resume seeks past what it does not read (damaged bytes there and all).
"""
import gc
import itertools
import json
import os
import random
import subprocess
import sys
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from dataset.collators import IGNORE_INDEX
from dataset.packed_documents import PADDING, PackedRows, pack_documents
from dataset.sources import DataError
from dataset.text_stream import TextStream
from model.tokenizer import load_tokenizer
from support import ROOT

ROW = 16
WORDS = ["the", "river", "runs", "north", "past", "seven", "old", "mills", "and", "a", "bridge", "of", "grey", "stone"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


def random_texts(n: int, seed: int, longest: int = 12) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, longest))) for _ in range(n)]


def write_parquet(path, texts: list, row_group_size: int = 3) -> str:
    # no dictionary and no compression: a column chunk's bytes are its pages, which test_a_resume_seeks damages
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), path, row_group_size=row_group_size,
                   use_dictionary=False, compression="NONE")
    return str(path)


def write_jsonl(path, records: list, blank_after: int | None = None) -> str:
    """One JSON object a line (a record that is not a dict is written as {"text": record}); a blank line after
    record `blank_after`."""
    with open(path, "w", encoding="utf-8") as f:
        for i, record in enumerate(records):
            f.write(json.dumps(record if isinstance(record, dict) else {"text": record}) + "\n")
            if i == blank_after:
                f.write("\n")
    return str(path)


@pytest.fixture
def mixed_corpus(tmp_path) -> tuple[str, list[str]]:
    """3 shards, parquet and jsonl in one folder, and the texts in the stream's order: documents of 1 to 12 words,
    an empty one, one longer than two rows; a blank jsonl line; a file of another kind and a subfolder not read."""
    texts = random_texts(22, seed=2)
    texts[3] = ""
    texts[9] = " ".join(WORDS * 3)
    write_parquet(tmp_path / "00.parquet", texts[:8])
    write_jsonl(tmp_path / "01.jsonl", texts[8:15], blank_after=2)
    write_parquet(tmp_path / "02.parquet", texts[15:])
    (tmp_path / "notes.txt").write_text("not a shard")
    (tmp_path / "later").mkdir()
    write_jsonl(tmp_path / "later" / "03.jsonl", ["not read"])
    return str(tmp_path), texts


def rows_equal(a: PackedRows, b: PackedRows) -> bool:
    return all(torch.equal(x, y) for x, y in zip((a.input_ids, a.documents, a.labels),
                                                  (b.input_ids, b.documents, b.labels)))


def run(stream: TextStream) -> tuple[list[PackedRows], list[dict]]:
    """Every row of the stream and the position before each row and after the last."""
    rows, positions = [], [stream.position()]
    for row in stream:
        rows.append(row)
        positions.append(stream.position())
    return rows, positions


def test_the_rows_are_pack_documents_epoch_by_epoch(mixed_corpus, tokenizer):
    path, texts = mixed_corpus
    documents = [tokenizer.encode(text) for text in texts]  # one by one: the stream tokenises in batches
    assert len(documents[9]) > 2 * ROW and documents[3] == []
    expected = pack_documents(documents, ROW, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert expected.documents[-1, -1] == PADDING  # the test needs a padded last row
    rows = list(TextStream(path, tokenizer, ROW, batch_size=3, epochs=2))
    assert all(row.input_ids.shape == (1, ROW) for row in rows)
    per_epoch = len(expected.input_ids)
    assert len(rows) == 2 * per_epoch
    for epoch in range(2):  # the same rows each epoch: the last padded, the next epoch starting a fresh row
        assert rows_equal(PackedRows.cat(rows[epoch * per_epoch:(epoch + 1) * per_epoch]), expected)


def test_a_resume_from_any_row_emits_the_rest(mixed_corpus, tokenizer):
    path, texts = mixed_corpus
    rows, positions = run(TextStream(path, tokenizer, ROW, batch_size=3, epochs=2))
    assert positions[-1]["epoch"] == 2 and len(json.dumps(positions[-1])) < 200
    for k, position in enumerate(positions):
        position = json.loads(json.dumps(position))  # as a checkpoint keeps it
        resumed, resumed_positions = run(TextStream(path, tokenizer, ROW, batch_size=3, epochs=2, start=position))
        assert len(resumed) == len(rows) - k and all(map(rows_equal, resumed, rows[k:])), f"cut after {k} rows"
        assert resumed_positions == positions[k:]
        same = TextStream(path, tokenizer, ROW, batch_size=3, epochs=2)  # one stream, stopped and iterated again
        assert len(list(itertools.islice(same, k))) == k
        assert all(map(rows_equal, list(same), rows[k:])), f"iterated again after {k} rows"
    # every token of every document in exactly one row per epoch, in order, its EOS after it
    streams = [tokenizer.encode(text) + [tokenizer.eos_token_id] for text in texts]
    for epoch in range(2):
        epoch_rows = PackedRows.cat([row for row, p in zip(rows, positions) if p["epoch"] == epoch])
        ids, docs, labels = epoch_rows.input_ids.flatten(), epoch_rows.documents.flatten(), epoch_rows.labels.flatten()
        for index, stream in enumerate(streams):
            assert ids[docs == index].tolist() == stream
        assert docs.ge(PADDING).all() and docs.lt(len(texts)).all()
        assert labels[docs == PADDING].eq(IGNORE_INDEX).all() and docs[-1] == PADDING


def traced_peak(stream: TextStream) -> tuple[int, int]:
    """(rows, the peak of Python memory allocated while they were streamed, beyond what was held before)."""
    tracemalloc.start()
    try:
        held, rows = tracemalloc.get_traced_memory()[0], 0
        for _ in stream:  # each row dropped as it comes, as a loop that trains on it
            rows += 1
            if rows % 50 == 0:
                # CPython's free lists keep freed tuples as allocated blocks, which tracemalloc counts, and a full
                # collection empties them: without it about 45 bytes a row that no object holds (torch.tensor's
                # tuples), up to 2,000 tuples of a size
                gc.collect()
        return rows, tracemalloc.get_traced_memory()[1] - held
    finally:
        tracemalloc.stop()


def write_shards(folder, shards: int, records: int, seed: int) -> str:
    folder.mkdir()
    for shard in range(shards):
        texts = random_texts(records, seed=seed + shard, longest=40)
        if shard % 2:
            write_jsonl(folder / f"{shard:02d}.jsonl", texts)
        else:
            write_parquet(folder / f"{shard:02d}.parquet", texts, row_group_size=50)
    return str(folder)


def stream_peaks(small: str, large: str) -> tuple[int, int, int, int]:
    """(rows, peak) of each corpus streamed, in this process: the large one first, so first-use allocations (the
    tokenizer's, torch's) are out of the way."""
    tokenizer = load_tokenizer(None)
    sum(1 for _ in TextStream(large, tokenizer, 32, batch_size=8, epochs=1))
    return (*traced_peak(TextStream(small, tokenizer, 32, batch_size=8, epochs=1)),
            *traced_peak(TextStream(large, tokenizer, 32, batch_size=8, epochs=1)))


def test_what_the_stream_holds_does_not_grow_with_the_corpus(tmp_path):
    """tracemalloc sees the Python objects the stream holds (texts, token lists, the row being filled), not Arrow's
    or the tokenizer's own buffers, which hold one batch and one row group. Measured in a fresh interpreter: what
    other tests left in a worker's process (caches, free lists) would move the peaks."""
    small = write_shards(tmp_path / "small", shards=2, records=40, seed=0)
    large = write_shards(tmp_path / "large", shards=8, records=100, seed=10)  # 10x the records, 4x the shards
    probe = (f"import json, sys; sys.path[:0] = [{ROOT!r}, {os.path.join(ROOT, 'tests')!r}]; "
             f"from test_text_stream import stream_peaks; print(json.dumps(stream_peaks({small!r}, {large!r})))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    small_rows, small_peak, large_rows, large_peak = json.loads(result.stdout.strip().splitlines()[-1])
    assert large_rows > 8 * small_rows
    # measured: 24 and 32 kB; had the stream kept the large corpus's token ids as Python lists, 36 bytes an id
    held_if_whole = 36 * large_rows * 32
    assert large_peak < 1.5 * small_peak + 10_000 and large_peak < held_if_whole / 10, (small_peak, large_peak)


def test_a_parquet_file_without_a_text_column_of_strings_is_refused_at_start_up(tmp_path, tokenizer):
    write_jsonl(tmp_path / "a.jsonl", ["fine"])
    pq.write_table(pa.table({"content": ["a", "b"]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet: no `text` column \(columns: content\): name the column"):
        TextStream(str(tmp_path), tokenizer, ROW)
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet: the `text` column holds int64, not strings"):
        TextStream(str(tmp_path), tokenizer, ROW)


@pytest.mark.parametrize("bad, message", [
    (5, r"bad\.jsonl: row 20 \(line 22\): `text` is a int, not a string"),
    (None, r"bad\.jsonl: row 20 \(line 22\): `text` is null"),
    ({"title": "no text"}, r"bad\.jsonl: row 20 \(line 22\): `text` is missing"),
    ("parquet", r"bad\.parquet: row 20: `text` is null"),
])
def test_a_record_without_a_text_string_is_refused_when_reached(tmp_path, tokenizer, bad, message):
    texts = random_texts(20, seed=2)
    if bad == "parquet":
        write_parquet(tmp_path / "bad.parquet", texts + [None, "after"])
    else:
        write_jsonl(tmp_path / "bad.jsonl", texts + [{"text": bad} if not isinstance(bad, dict) else bad, "after"],
                    blank_after=4)
    stream = TextStream(str(tmp_path), tokenizer, 8, batch_size=4)  # start-up reads no record
    rows = []
    with pytest.raises(DataError, match=message):
        for row in stream:
            rows.append(row)
    assert len(rows) > 5  # the rows before its batch came first


def test_a_missing_path_an_empty_folder_and_another_kind_of_file_are_refused(tmp_path, tokenizer):
    with pytest.raises(DataError, match="corpus not found"):
        TextStream(str(tmp_path / "nowhere"), tokenizer, ROW)
    (tmp_path / "notes.txt").write_text("text")
    with pytest.raises(DataError, match=r"a folder without a \.parquet or \.jsonl file"):
        TextStream(str(tmp_path), tokenizer, ROW)
    with pytest.raises(DataError, match="unsupported file type"):
        TextStream(str(tmp_path / "notes.txt"), tokenizer, ROW)
    write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match="the corpus holds no record"):
        next(iter(TextStream(str(tmp_path), tokenizer, ROW)))


def test_a_position_from_changed_files_is_refused(mixed_corpus, tokenizer):
    path, _ = mixed_corpus
    stream = TextStream(path, tokenizer, ROW, batch_size=3)
    next(iter(stream))
    position = stream.position()
    with pytest.raises(DataError, match="not a text stream's position"):
        TextStream(path, tokenizer, ROW, start={k: v for k, v in position.items() if k != "rows"})
    with open(f"{path}/01.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(DataError, match="the start position was taken on other files .* the corpus changed"):
        TextStream(path, tokenizer, ROW, start=position)


def test_a_record_gone_or_shorter_in_a_file_of_the_same_size_is_refused_when_sought(tmp_path, tokenizer):
    """The digest sees names and sizes only; the seek sees a record that is no longer there or is too short."""
    write_jsonl(tmp_path / "a.jsonl", ["aaaa"] * 3)  # 3 lines of 17 bytes
    stream = TextStream(str(tmp_path), tokenizer, 2, batch_size=1)
    position = next(stream.position() for row in stream if stream.position()["record"] == 2)
    write_jsonl(tmp_path / "a.jsonl", ["a" * 38])  # 51 bytes: the same size, 1 record
    with pytest.raises(DataError, match=r"a\.jsonl: the start position's row 2 is past the file's end \(it holds 1\)"):
        list(TextStream(str(tmp_path), tokenizer, 2, epochs=1, start=position))
    text = " ".join(["the"] * 12)  # 12 tokens; as many x's, 7
    write_jsonl(tmp_path / "a.jsonl", [text])
    stream = TextStream(str(tmp_path), tokenizer, 10, epochs=1)
    next(iter(stream))
    position = stream.position()
    assert position["token"] == 10
    write_jsonl(tmp_path / "a.jsonl", ["x" * len(text)])
    with pytest.raises(DataError, match=r"a\.jsonl: row 0: 7 tokens and its EOS, fewer than the start position's"):
        list(TextStream(str(tmp_path), tokenizer, 10, epochs=1, start=position))


def test_a_resume_seeks_past_what_it_does_not_read(tmp_path, tokenizer):
    """Row groups and lines before the start position damaged in place (same sizes: the same corpus digest): a
    resume after them emits the rows of an undamaged run; a stream from the start stops at the damage."""
    texts = random_texts(24, seed=3)
    parquet = write_parquet(tmp_path / "00.parquet", texts[:18], row_group_size=3)  # 6 row groups
    jsonl = write_jsonl(tmp_path / "01.jsonl", texts[18:])
    rows, positions = run(TextStream(str(tmp_path), tokenizer, 8, batch_size=2, epochs=1))
    k = next(k for k, p in enumerate(positions) if p["file"] == 0 and p["record"] >= 13 and p["token"] > 0)
    metadata = pq.ParquetFile(parquet).metadata
    with open(parquet, "r+b") as f:
        for group in range(positions[k]["record"] // 3):  # every row group before the one the position is in
            chunk = metadata.row_group(group).column(0)
            f.seek(chunk.data_page_offset)
            f.write(b"\0" * chunk.total_compressed_size)
    resumed = list(TextStream(str(tmp_path), tokenizer, 8, batch_size=2, epochs=1, start=positions[k]))
    assert all(map(rows_equal, resumed, rows[k:])) and len(resumed) == len(rows) - k
    with pytest.raises(DataError, match=r"00\.parquet: not a readable parquet file"):
        list(TextStream(str(tmp_path), tokenizer, 8, batch_size=2, epochs=1))
    # jsonl: the lines before the position made invalid JSON; skipped, never parsed
    k = next(k for k, p in enumerate(positions) if p["file"] == 1 and p["record"] >= 3)
    with open(jsonl, "rb") as f:
        lines = f.readlines()
    with open(jsonl, "wb") as f:
        f.writelines([b"x" * (len(line) - 1) + b"\n" for line in lines[:positions[k]["record"]]])
        f.writelines(lines[positions[k]["record"]:])
    resumed = list(TextStream(str(tmp_path), tokenizer, 8, batch_size=2, epochs=1, start=positions[k]))
    assert all(map(rows_equal, resumed, rows[k:])) and len(resumed) == len(rows) - k
    j = next(j for j, p in enumerate(positions) if p["file"] == 1)
    assert positions[j]["record"] < positions[k]["record"]
    with pytest.raises(DataError, match=rf"01\.jsonl: row {positions[j]['record']} \(line \d+\): invalid JSON"):
        list(TextStream(str(tmp_path), tokenizer, 8, batch_size=2, epochs=1, start=positions[j]))
