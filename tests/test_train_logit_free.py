# python -m pytest tests/test_train_logit_free.py
"""train_logit_free.py on tiny Qwen3s (CPU) against a stub black-box teacher (a deterministic OpenAI-compatible
endpoint in this process): the first step's loss is the method's closed form recomputed from the run's own audit,
the teacher's answers are cached (a second run of the same steps asks nothing), bad set-ups are refused at start-up,
and accumulation, 2 ranks and a SIGKILL + resume give what one uninterrupted batch gives (the last with no answered
request sent again). The math of the audit is in tests/test_audit.py; a real vLLM teacher in
tests/test_logit_free_vllm.py."""
import math
import os
import sys

import pytest
import torch

import trainer.train_logit_free as logit_free
from trainer.teachers.black_box import audit_requests
from loop_helpers import (checkpoint_step, kill_after_first_checkpoint, loop_args, max_weight_diff, metrics,
                          run_command, script_exit, assert_one_line_error, torchrun_command, weights,
                          without_timing)
from stub_server import Stub, black_box_teacher
from model.tokenizer import default_tokenizer_dir
from support import ROOT, write_chat_jsonl

SCRIPT = os.path.join(ROOT, "trainer", "train_logit_free.py")
METHOD = {"max_new_tokens": 8, "chunk_len": 3, "audit_chunks": 2, "continuations": 3, "anchor_beta": 0.5}


@pytest.fixture
def teacher(black_box_stub):
    return black_box_stub


def args_for(config, data, save_dir, teacher, **flags) -> list[str]:
    return loop_args(config, data, save_dir, **{**METHOD, "teacher_url": teacher.url, **flags})


def continuation_posts(teacher) -> list[dict]:
    """The requests the teacher answered, but for the start-up probes."""
    return [body for _, body in teacher.posts if "1, 2, 3, 4," not in str(body)]


def test_a_run_logs_the_methods_numbers_and_asks_each_chunk_once(tiny_config_path, chat_jsonl, tmp_path, teacher,
                                                                 one_thread):
    logit_free.main(args_for(tiny_config_path, chat_jsonl, tmp_path / "a", teacher, max_steps=2))
    rows = metrics(tmp_path / "a")
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert 0.0 <= m["pi_hat"] <= 1.0 and 0.0 <= m["phi"] <= 1.0 and m["anchor_kl"] >= 0.0
        assert 0.0 < m["audited_share"] <= 1.0 and math.isfinite(m["loss"])
        assert m["teacher_requests"] > 0 and m["teacher_tokens"] > 0 and "teacher_s" in m
    asked = continuation_posts(teacher)
    assert sum(m["teacher_requests"] for m in rows) == len(asked)
    assert all(body["n"] == 3 and body["max_tokens"] == math.ceil(1.5 * 3) for body in asked)
    assert len({body["seed"] for body in asked}) == len(asked)  # a seed per (step, row, chunk)
    # the same run again from scratch (--start_over 1 sets the run aside, not the teacher's answers): every answer
    # comes from the cache, nothing is sent, and the run computes the same
    before = len(asked)
    logit_free.main(args_for(tiny_config_path, chat_jsonl, tmp_path / "a", teacher, max_steps=2, start_over=1))
    assert len(continuation_posts(teacher)) == before
    again = metrics(tmp_path / "a")
    assert [m["teacher_cached"] for m in again] == [m["teacher_requests"] for m in rows]
    usage = ("teacher_requests", "teacher_cached", "teacher_tokens")
    assert [{k: v for k, v in m.items() if k not in usage} for m in without_timing(again)] == \
        [{k: v for k, v in m.items() if k not in usage} for m in without_timing(rows)]


def test_the_first_loss_is_the_closed_form_of_its_own_audit(tiny_config_path, chat_jsonl, tmp_path, teacher,
                                                            monkeypatch, one_thread):
    """The logged loss of step 1 = (- sum_c pi_hat_c sum_{t in c} log p(y_t) + beta sum_{t unaudited} KL_t) / tokens,
    recomputed here from the pieces the loop handed to the loss (its weights, the student's and the reference's
    full distributions), densely in float64."""
    seen = []
    chunked_audit_loss = logit_free.chunked_audit_loss

    def spy(hidden, head, targets, weights, chunk_size, vocab):
        seen.append((hidden.detach().double(), head.detach().double()[:vocab], targets.clone(), weights.clone()))
        return chunked_audit_loss(hidden, head, targets, weights, chunk_size, vocab)
    monkeypatch.setattr(logit_free, "chunked_audit_loss", spy)
    references = []
    frozen_hidden = logit_free.frozen_hidden

    def reference_spy(model, *args):
        hidden = frozen_hidden(model, *args)
        references.append((hidden.double(), model.lm_head.weight.detach().double()))
        return hidden
    monkeypatch.setattr(logit_free, "frozen_hidden", reference_spy)
    logit_free.main(args_for(tiny_config_path, chat_jsonl, tmp_path, teacher, max_steps=1, batch=4))
    total, tokens = 0.0, 0
    for (hidden, head, targets, chunk_weights), (ref_hidden, ref_head) in zip(seen, references):
        logp = torch.log_softmax(hidden @ head.T, -1)
        ref_logp = torch.log_softmax(ref_hidden @ ref_head[:head.shape[0]].T, -1)
        chosen = logp.gather(1, targets[:, None]).squeeze(1)
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)
        audited = chunk_weights > 0
        total += float(-(chunk_weights.double() * chosen).sum() + METHOD["anchor_beta"] * kl[~audited].sum())
        tokens += targets.numel()
    assert audited.any() and metrics(tmp_path)[0]["loss"] == pytest.approx(total / tokens, rel=1e-4)


@pytest.mark.parametrize("flags, names", [
    ({"teacher_url": None}, ["--teacher_url"]),
    ({"teacher_form": "completions"}, ["--teacher_tokenizer_path"]),
    ({"chunk_len": 20}, ["--chunk_len 20", "--max_new_tokens 8"]),
    ({"teacher_options": "[1]"}, ["--teacher_options"]),
    ({"teacher_options": '{"n": 2}'}, ["--teacher_options", "'n'"]),
    ({"alpha": 0}, ["--alpha"]),
])
def test_bad_set_ups_are_refused_in_one_line(tiny_config_path, chat_jsonl, tmp_path, teacher, capsys, flags, names):
    argv = args_for(tiny_config_path, chat_jsonl, tmp_path / "out", teacher, **flags)
    code, stderr = script_exit(logit_free.main, argv, capsys)
    assert_one_line_error(code, stderr, 2, *names)
    assert not (tmp_path / "out").exists(), "a refused run leaves nothing behind"


def test_a_teacher_that_starts_a_new_reply_is_refused_before_any_model_loads(tiny_config_path, chat_jsonl, tmp_path,
                                                                            capsys, monkeypatch):
    from stub_server import choices_body
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    server = Stub(lambda path, body: (200, choices_body(path, ["Sure! Here are the numbers."] * body.get("n", 1))))
    try:
        code, stderr = script_exit(logit_free.main, args_for(tiny_config_path, chat_jsonl, tmp_path / "out", server),
                                   capsys)
    finally:
        server.close()
    assert code in (1, 2) and "continue" in stderr and server.url in stderr, stderr
    assert "random weights" not in capsys.readouterr().out
    assert not (tmp_path / "out").exists(), "a refused teacher leaves nothing behind"


def test_a_teacher_that_cannot_count_trains_with_the_request_probe_and_split_n(tiny_config_path, chat_jsonl,
                                                                               tmp_path, capsys, monkeypatch):
    """--teacher_probe request: the teacher's probe answer is not read (the run warns), its requests still are
    checked; --teacher_split_n 1: each chunk's N continuations are N requests of n=1, seeds seed + i."""
    from stub_server import choices_body
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    server = Stub(lambda path, body: (200, choices_body(path, ["Sure! 1 2"] * body.get("n", 1))))
    try:
        logit_free.main(args_for(tiny_config_path, chat_jsonl, tmp_path, server, max_steps=1, teacher_probe="request",
                                 teacher_split_n=1))
    finally:
        server.close()
    assert "--teacher_probe request" in capsys.readouterr().out
    asked = continuation_posts(server)
    assert asked and all(body["n"] == 1 for body in asked)
    assert metrics(tmp_path)[0]["teacher_requests"] * METHOD["continuations"] == len(asked)
    seeds = sorted(body["seed"] for body in asked)
    assert len(set(seeds)) == len(seeds)


def test_a_partial_no_template_can_hand_over_is_not_asked():
    """A `<think>` spelled with ordinary tokens (the scheduler's token mask sees only the real <think> token), and a
    stray `</think>` token mid-answer (the template would split the answer there; vLLM answers HTTP 400): the chunks
    after them are dropped from the audit, the others are asked."""
    import argparse
    from model import load_tokenizer
    from trainer.logit_free.audit import Chunk
    tokenizer = load_tokenizer(None)
    spelled = [i for piece in ("<", "think", ">") for i in tokenizer.encode(piece)]
    assert tokenizer.decode(spelled) == "<think>" and 151667 not in spelled
    words = tokenizer.encode(" one two three four")
    labels = torch.tensor([words + spelled + words])
    batch = {"rows": [{"row_index": 3, "messages": [{"role": "user", "content": "Say four words."}]}]}
    chunks = [Chunk(0, 1, 2, 0.5), Chunk(0, len(words) + len(spelled), 2, 0.5)]
    args = argparse.Namespace(seed=7, chunk_len=2)
    kept, requests, texts = audit_requests(args, tokenizer, batch, labels, chunks, 0, 0)
    assert kept == chunks[:1] and len(requests) == len(texts) == 1 and requests[0].partial == " one"
    stray = torch.tensor([words + [151668] + words])              # " one two three four</think> one ..."
    chunks = [Chunk(0, 2, 2, 0.5), Chunk(0, len(words) + 2, 2, 0.5)]
    kept, requests, _ = audit_requests(args, tokenizer, batch, stray, chunks, 0, 0)
    assert kept == chunks[:1] and requests[0].partial == " one two"


@pytest.mark.serial
@pytest.mark.slow
@pytest.mark.parametrize("chunk_weight", ["posterior", "advantage"])
def test_accumulation_and_two_ranks_equal_one_batch(tiny_config_path, chat_jsonl, tmp_path, teacher, one_thread,
                                                    chunk_weight):
    """Both per-chunk weights: the same steps. The advantage weight, pi_hat - pi_bar, is near 0 on chunks the stub
    teacher agrees with as much as the student expected, so some embedding rows' gradients are rounding-sized and
    Adam's first steps magnify their rounding (lr x g / (|g| + eps)): its weights are compared after step 1 by the
    step's loss and pre-clip gradient norm (the gradient itself) and its pi_hat (step 2 samples from those weights:
    other tokens)."""
    flags = {"max_steps": 2, "chunk_weight": chunk_weight}
    logit_free.main(args_for(tiny_config_path, chat_jsonl, tmp_path / "big", teacher, batch=4, **flags))
    logit_free.main(args_for(tiny_config_path, chat_jsonl, tmp_path / "acc", teacher, batch=2, accumulation=2,
                             **flags))
    run_command(torchrun_command(SCRIPT, args_for(tiny_config_path, chat_jsonl, tmp_path / "ddp", teacher, batch=1,
                                                  accumulation=2, **flags)))
    big = metrics(tmp_path / "big")
    for other in ("acc", "ddp"):
        if chunk_weight == "posterior":
            assert max_weight_diff(weights(tmp_path / "big"), weights(tmp_path / other)) <= 1e-5
        first = metrics(tmp_path / other)[0]
        assert first["loss"] == pytest.approx(big[0]["loss"], rel=1e-5)
        assert first["grad_norm"] == pytest.approx(big[0]["grad_norm"], rel=1e-4)
        steps = len(big) if chunk_weight == "posterior" else 1  # step 2 samples from step 1's weights
        assert [m["tokens"] for m in metrics(tmp_path / other)][:steps] == [m["tokens"] for m in big][:steps]
        assert [m["pi_hat"] for m in metrics(tmp_path / other)][:steps] == pytest.approx(
            [m["pi_hat"] for m in big][:steps], abs=1e-6)


@pytest.mark.slow
def test_packing_computes_what_the_padded_batch_computes(tiny_config_path, chat_jsonl, tmp_path, teacher,
                                                         one_thread):
    """--packing 1 against the right-padded batch, one step (the next rollouts would sample from weights that differ
    by rounding): the same loss, gradient norm and weights to rounding."""
    logit_free.main(args_for(tiny_config_path, chat_jsonl, tmp_path / "padded", teacher, batch=4, max_steps=1))
    logit_free.main(args_for(tiny_config_path, chat_jsonl, tmp_path / "packed", teacher, batch=4, max_steps=1,
                             packing=1))
    padded, packed = metrics(tmp_path / "padded"), metrics(tmp_path / "packed")
    assert [m["loss"] for m in packed] == pytest.approx([m["loss"] for m in padded], rel=1e-5, abs=1e-6)
    assert [m["grad_norm"] for m in packed] == pytest.approx([m["grad_norm"] for m in padded], rel=1e-5)
    assert max_weight_diff(weights(tmp_path / "padded"), weights(tmp_path / "packed")) <= 1e-5


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical_and_asks_nothing_twice(tiny_config_path, long_chat_jsonl, tmp_path,
                                                                     teacher, one_thread):
    flags = dict(batch=2, accumulation=2, save_interval=2)  # 24 rows: 6 optimizer steps, a checkpoint every 2
    logit_free.main(args_for(tiny_config_path, long_chat_jsonl, tmp_path / "full", teacher, **flags))
    uninterrupted = len(continuation_posts(teacher))
    killed = tmp_path / "killed"
    kill_after_first_checkpoint([sys.executable, SCRIPT, *args_for(tiny_config_path, long_chat_jsonl, killed,
                                                                   teacher, **flags)],
                                str(killed / "run_resume.pt"))
    assert checkpoint_step(killed / "run_resume.pt") < 6, "the run finished before it could be killed"
    logit_free.main(args_for(tiny_config_path, long_chat_jsonl, killed, teacher, **flags, from_resume=1))
    full, resumed = weights(tmp_path / "full"), weights(killed)
    assert all(torch.equal(full[k], resumed[k]) for k in full), "resumed weights are not bit-identical"
    usage = ("teacher_requests", "teacher_cached", "teacher_tokens")
    timeless = [{k: v for k, v in m.items() if k not in usage} for m in without_timing(metrics(killed))]
    assert timeless == [{k: v for k, v in m.items() if k not in usage}
                        for m in without_timing(metrics(tmp_path / "full"))]
    # every answer the killed run received was cached: the resumed run re-asked at most one micro-batch's chunks
    resent = len(continuation_posts(teacher)) - 2 * uninterrupted
    assert 0 <= resent <= 2 * METHOD["audit_chunks"], resent


def test_two_black_box_teachers_each_continue_their_own_rows(tiny_config_path, tmp_path, teacher, one_thread):
    """--teachers with two endpoints (the second one in another request form, from its entry): every chunk of a row
    goes to the teacher its column names, and only there; each teacher has its own answer cache and its numbers in
    the metrics; a rerun of the same steps asks neither teacher anything."""
    import json
    second = Stub(black_box_teacher)
    try:
        rows = [json.loads(line) for line in open(write_chat_jsonl(tmp_path / "chat.jsonl", 12))]
        data = tmp_path / "routed.jsonl"
        data.write_text("".join(json.dumps({**row, "teacher": "ab"[i % 2]}) + "\n" for i, row in enumerate(rows)))
        teachers = tmp_path / "teachers.json"
        teachers.write_text(json.dumps({"a": {"url": teacher.url},
                                        "b": {"url": second.url, "form": "completions",
                                              "tokenizer_path": default_tokenizer_dir(), "options": {}}}))
        args = loop_args(tiny_config_path, str(data), tmp_path / "run", **METHOD, teachers=str(teachers), max_steps=2)
        logit_free.main(args)
        steps = metrics(tmp_path / "run")
        for stub, name, form in ((teacher, "a", "messages"), (second, "b", "prompt")):
            asked = continuation_posts(stub)
            assert asked and all(form in body for body in asked)
            questions = [int(str(body).split("Question ")[1].split(":")[0]) for body in asked]
            assert all("ab"[q % 2] == name for q in questions), (name, questions)
            assert sum(m[f"teacher/{name}/requests"] for m in steps) == len(asked)
            assert os.path.exists(tmp_path / "run" / f"run_teacher_cache_{name}.rank0.jsonl")
        assert [m["teacher_requests"] for m in steps] == [m["teacher/a/requests"] + m["teacher/b/requests"]
                                                          for m in steps]
        before = len(continuation_posts(teacher)), len(continuation_posts(second))
        logit_free.main(args + ["--start_over", "1"])  # the run set aside, not the teachers' answers
        assert (len(continuation_posts(teacher)), len(continuation_posts(second))) == before
        assert [m["teacher_cached"] for m in metrics(tmp_path / "run")] == [m["teacher_requests"] for m in steps]
    finally:
        second.close()


def test_the_agreement_is_reported_apart_for_right_and_wrong_answers():
    """add_separation: pi_hat over the chunks of answers math-verify grades right and of those it grades wrong, the
    share right; a row without a ground truth is left out; a window with no right answer logs no pi_hat_right."""
    from dataset.collators import IGNORE_INDEX
    from model import load_tokenizer
    from trainer.logit_free.audit import Chunk
    from trainer.skeleton.distributed import DistInfo
    from trainer.skeleton.window_metrics import WindowMetrics
    tokenizer = load_tokenizer(None)
    answers = ["2+3=5. \\boxed{5}", "2+3=6. \\boxed{6}", "1+1=2. \\boxed{2}"]
    ids = [tokenizer.encode("Q") + tokenizer.encode(a) for a in answers]
    width = max(map(len, ids))
    input_ids = torch.tensor([row + [0] * (width - len(row)) for row in ids])
    labels = input_ids.clone()
    labels[:, :1] = IGNORE_INDEX
    for i, row in enumerate(ids):
        labels[i, len(row):] = IGNORE_INDEX
    rows = [{"ground_truth": "5"}, {"ground_truth": "5"}, {}]
    chunks = [Chunk(0, 0, 2, 0.5), Chunk(0, 8, 2, 0.5), Chunk(1, 0, 2, 0.5), Chunk(2, 0, 2, 0.5)]
    metrics = WindowMetrics("cpu")
    logit_free.add_separation(metrics, tokenizer, input_ids, labels, rows, chunks, [0.9, 0.7, 0.2, 0.4])
    values = metrics.reduce(DistInfo())[0]
    assert values["answer_right"] == pytest.approx(0.5)
    assert values["pi_hat_right"] == pytest.approx(0.8) and values["pi_hat_wrong"] == pytest.approx(0.2)
    # by the third of the answer a chunk starts in: row 0's chunks at token 0 and 8 of its completion's
    thirds = [min(3 * anchor // int((labels[0] != IGNORE_INDEX).sum()), 2) for anchor in (0, 8)]
    assert thirds[0] == 0 and thirds[1] > 0
    assert values["pi_hat_right_early"] == pytest.approx(0.9)
    assert values[f"pi_hat_right_{logit_free.THIRDS[thirds[1]]}"] == pytest.approx(0.7)
    assert values["pi_hat_wrong_early"] == pytest.approx(0.2)
    assert [k for k in values if k.startswith("pi_hat_")] == ["pi_hat_right", "pi_hat_right_early",
        f"pi_hat_right_{logit_free.THIRDS[thirds[1]]}", "pi_hat_wrong", "pi_hat_wrong_early"]
    metrics = WindowMetrics("cpu")
    logit_free.add_separation(metrics, tokenizer, input_ids[1:2], labels[1:2], rows[1:2], [Chunk(0, 0, 2, 0.5)],
                              [0.3])
    values = metrics.reduce(DistInfo())[0]
    assert "pi_hat_right" not in values and values["pi_hat_wrong"] == pytest.approx(0.3)
