# python -m pytest -q tests/test_train_pretrain.py
"""Continued pretraining (trainer/train_pretrain.py): a packed batch trains as its documents run one by one; the
streamed corpus (trainer/skeleton/corpus_stream.py) hands every token of an epoch to exactly one row, the same rows
to 1 and 2 ranks, and resumed at any step boundary continues at the next unseen token; a resume with another
tokenizer, a corpus the ranks cannot share and --packing are refused in one line; the built-in demo runs, and its
held-out perplexity falls. The loop's skeleton invariants (accumulation, 2 ranks, SIGKILL, a world-size change) are
tests/test_loop_invariants.py's "pretrain"."""
import argparse
import json
import math
import os

import pytest
import torch

from support import ROOT, TINY_CONFIG, write_text_corpus
from loop_helpers import (assert_one_line_error, loop_args, max_weight_diff, metrics, run_command, script_exit,
                          torchrun_command, weights)
from dataset.collators import IGNORE_INDEX
from dataset.packed_documents import PADDING, PackedRows
from dataset.text_stream import TextStream
from model import Qwen3Config, create_model
from model.tokenizer import load_tokenizer
from trainer.losses.chunked import document_hidden
from trainer.losses.fused_linear import fused_cross_entropy
from trainer.skeleton.corpus_stream import CorpusStream, document_separator
from trainer.skeleton.distributed import DistInfo
from trainer.train_pretrain import main as train_pretrain

ROW = 32
PRETRAIN = os.path.join(ROOT, "trainer", "train_pretrain.py")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture
def corpus(tmp_path):
    return write_text_corpus(tmp_path / "corpus.jsonl", rows=11, row_length=ROW)


def stream_args(**flags) -> argparse.Namespace:
    values = {"max_length": ROW, "batch_size": 2, "accumulation_steps": 2, "max_steps": 0, "epochs": 2, **flags}
    return argparse.Namespace(**values)


def corpus_stream(corpus, tokenizer, rank=0, world_size=1, **flags) -> CorpusStream:
    stream = CorpusStream(corpus, tokenizer, document_separator(tokenizer), stream_args(**flags),
                          DistInfo(rank=rank, world_size=world_size))
    stream.total_steps = stream.planned_steps()
    return stream


def windows(stream: CorpusStream, step: int = 0) -> list[tuple[int, list[dict]]]:
    return [(epoch, window) for epoch, window, _ in stream.windows_ahead(0, step, 0, 0)]


def rows_of(window: list[dict]) -> list[torch.Tensor]:
    return [row for batch in window for row in batch["input_ids"]]


def test_the_separator_is_endoftext_not_the_chat_eos(tokenizer):
    assert document_separator(tokenizer) == tokenizer.token_to_id("<|endoftext|>") != tokenizer.eos_token_id


def test_a_packed_batch_trains_as_its_documents_one_by_one(corpus, tokenizer):
    """The loop's loss (document_hidden + the fused cross entropy) over packed rows: its sum, token count and every
    gradient (of the loss per token, as the skeleton divides) equal those of each document segment run alone, without
    a mask (1e-5): no document sees another."""
    rows = PackedRows.cat(list(TextStream(corpus, tokenizer, ROW, epochs=1, separator=document_separator(tokenizer))))
    model = create_model(Qwen3Config.from_dict({**TINY_CONFIG, "initializer_range": 0.1}), seed=3)
    head = model.lm_head.weight
    hidden, targets = document_hidden(model, rows.input_ids, rows.documents, rows.labels)
    packed, tokens = fused_cross_entropy(hidden, head, targets, 64, len(tokenizer))
    packed_grads = torch.autograd.grad(packed / tokens, list(model.parameters()))  # per token, as the skeleton divides
    alone, alone_tokens = 0.0, 0
    for ids, documents, labels in zip(rows.input_ids, rows.documents, rows.labels):
        starts = [0] + [t for t in range(1, ROW) if documents[t] != documents[t - 1]] + [ROW]
        for a, b in zip(starts, starts[1:]):
            if documents[a] == PADDING:
                continue
            out = model(ids[None, a:b], return_hidden=True).hidden_states[0, :-1]
            keep = labels[a + 1:b] != IGNORE_INDEX
            part, count = fused_cross_entropy(out[keep], head, labels[a + 1:b][keep], 64, len(tokenizer))
            alone, alone_tokens = alone + part, alone_tokens + int(count)
    alone_grads = torch.autograd.grad(alone / alone_tokens, list(model.parameters()))
    assert int(tokens) == alone_tokens > 0
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    for a, b in zip(packed_grads, alone_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_every_token_of_an_epoch_is_in_exactly_one_row(corpus, tokenizer):
    """The real tokens of an epoch's windows, in order, are the documents' tokens, each followed by the separator:
    none skipped, none twice; both epochs alike (11 rows: 3 windows of 4, 4 and 3)."""
    separator = document_separator(tokenizer)
    texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
    expected = [t for text in texts for t in (*tokenizer.encode(text), separator)]
    handed = windows(corpus_stream(corpus, tokenizer))
    assert [epoch for epoch, _ in handed] == [0, 0, 0, 1, 1, 1]
    for epoch in (0, 1):
        tokens = [int(t) for _, window in handed if _ == epoch for batch in window
                  for ids, documents in zip(batch["input_ids"], batch["documents"]) for t in ids[documents != PADDING]]
        assert tokens == expected


def test_two_ranks_take_the_rows_one_process_takes_in_every_step(corpus, tokenizer):
    """Rank r's rows of a step are rows r, r + 2, ... of the one-process step's; the epoch's 11th row, which one
    rank would have alone, is dropped (an epoch's tail cut to a multiple of the ranks)."""
    one = windows(corpus_stream(corpus, tokenizer, batch_size=2, accumulation_steps=2))
    ranks = [windows(corpus_stream(corpus, tokenizer, rank=r, world_size=2, batch_size=2, accumulation_steps=1))
             for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) == len(one)
    for (epoch, window), *shares in zip(one, *ranks):
        rows = rows_of(window)
        mine = [rows_of(share[1]) for share in shares]
        usable = len(rows) - len(rows) % 2
        assert all(share[0] == epoch for share in shares)
        assert all(torch.equal(a, b) for a, b in zip(mine[0], rows[0:usable:2]))
        assert all(torch.equal(a, b) for a, b in zip(mine[1], rows[1:usable:2]))
        assert len(mine[0]) == len(mine[1]) == usable // 2


@pytest.mark.parametrize("max_steps", [0, 8])
def test_a_resume_at_any_step_boundary_continues_at_the_next_unseen_token(corpus, tokenizer, max_steps):
    """Stopped after k steps (k = 0 .. the run's steps), a new stream started at the kept position hands out
    exactly the windows the uninterrupted one handed out after its k-th; with --max_steps the corpus repeats past
    its epochs."""
    whole = windows(corpus_stream(corpus, tokenizer, max_steps=max_steps))
    assert len(whole) == (max_steps or 6)
    for k in range(len(whole) + 1):
        first = corpus_stream(corpus, tokenizer, max_steps=max_steps)
        for _ in zip(range(k), first.windows_ahead(0, 0, 0, 0)):
            pass
        resumed = corpus_stream(corpus, tokenizer, max_steps=max_steps)
        resumed.start_at(json.loads(json.dumps(first.position())))  # as the resume file keeps it
        rest = windows(resumed, step=k)
        assert [e for e, _ in rest] == [e for e, _ in whole[k:]], k
        for (_, a), (_, b) in zip(rest, whole[k:]):
            assert all(torch.equal(x[key], y[key]) for x, y in zip(a, b) for key in x), k


def test_a_position_taken_with_another_tokenizer_is_refused(corpus, tokenizer):
    stream = corpus_stream(corpus, tokenizer)
    position = {**stream.position(), "tokenizer": "0" * 16}
    with pytest.raises(Exception, match="another tokenizer"):
        stream.start_at(position)


def test_a_corpus_of_fewer_rows_than_ranks_is_refused(tmp_path, tokenizer):
    one_row = tmp_path / "short.jsonl"
    one_row.write_text(json.dumps({"text": "alpha beta"}) + "\n")
    with pytest.raises(Exception, match="fewer than the 2 ranks"):
        corpus_stream(str(one_row), tokenizer, world_size=2)
    endless = corpus_stream(str(one_row), tokenizer, world_size=2, max_steps=3)  # no count: found when streamed
    with pytest.raises(Exception, match="fewer than the 2 ranks"):
        windows(endless)


@pytest.mark.parametrize("flags, names", [
    (["--packing", "1"], ["--packing", "packed already"]),
    (["--data_path", "{bad}"], ["bad.jsonl", "`text`"]),
])
def test_refusals_are_one_line_and_leave_nothing(flags, names, tiny_config_path, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "no text column"}) + "\n")
    flags = [f.format(bad=bad) for f in flags]
    argv = [*loop_args(tiny_config_path, None, tmp_path / "runs"), *flags]
    code, stderr = script_exit(train_pretrain, argv, capsys)
    assert_one_line_error(code, stderr, 2, *names)
    assert not (tmp_path / "runs" / "run").exists() and not (tmp_path / "runs" / "run_resume.pt").exists()


@pytest.mark.slow
def test_the_demo_corpus_runs_with_its_defaults_and_its_held_out_perplexity_falls(tmp_path, capsys):
    """Four steps of the built-in default (the demo corpus, the tiny model from scratch), evaluated before and
    after: the held-out loss falls, and the step lines show the window's perplexity."""
    train_pretrain(["--device", "cpu", "--save_dir", str(tmp_path), "--max_steps", "4", "--eval_interval", "4",
                    "--batch_size", "4", "--max_length", "128"])
    evaluations = [m for m in metrics(tmp_path, "pretrain") if "eval/loss" in m]
    assert [m["step"] for m in evaluations] == [0, 4]
    assert evaluations[1]["eval/loss"] < evaluations[0]["eval/loss"] - 0.5
    assert evaluations[0]["eval/perplexity"] == pytest.approx(math.exp(evaluations[0]["eval/loss"]), rel=1e-12)
    assert "perplexity" in capsys.readouterr().out


@pytest.mark.serial
@pytest.mark.slow
def test_two_sharded_ranks_train_and_evaluate_as_one_process(tiny_config_path, tmp_path):
    """--fsdp 1 on 2 gloo ranks against one process (the same global batch): the same weights, step losses and
    held-out losses (every sharded rank evaluates all the held-out rows in step; rank 0 logs)."""
    corpus = write_text_corpus(tmp_path / "corpus.jsonl", rows=12, row_length=96)
    held_out = write_text_corpus(tmp_path / "held_out.jsonl", rows=3, row_length=96, seed=1)
    extra = dict(max_steps=3, eval_interval=3, eval_rows=3, eval_data_path=held_out)
    train_pretrain(loop_args(tiny_config_path, corpus, tmp_path / "one", batch=2, accumulation=2, **extra))
    run_command(torchrun_command(PRETRAIN, loop_args(tiny_config_path, corpus, tmp_path / "two", batch=2, fsdp=1,
                                                     **extra)))
    assert max_weight_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) <= 1e-5
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for key in ("loss", "eval/loss"):
        assert [m[key] for m in one if key in m] == pytest.approx([m[key] for m in two if key in m], abs=1e-5)
    assert [m["step"] for m in two if "eval/loss" in m] == [0, 3]


@pytest.mark.slow
def test_a_lora_student_under_bf16_autocast_trains_its_adapters_only(tiny_config_path, corpus, tmp_path):
    """--lora_rank with --dtype bfloat16 (fp32 masters under CPU autocast): the loss falls over 3 steps on one
    repeated window of text and the export's adapter folder holds the adapters."""
    train_pretrain(loop_args(tiny_config_path, corpus, tmp_path, batch=4, max_length=ROW, max_steps=3, epochs=1,
                             lora_rank=4, lora_alpha=8, learning_rate=1e-2, dtype="bfloat16"))
    losses = [m["loss"] for m in metrics(tmp_path)]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert (tmp_path / "run_adapter" / "adapter_model.safetensors").exists()
