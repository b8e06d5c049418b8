# python -m pytest tests/test_serving.py
"""OPD rollouts (and eval_math completions) from a real vLLM CPU server, the student's weights synced into it and
verified every step. The servers come from the session fixture `vllm_servers` (tests/vllm_servers.py); without a
vLLM environment these tests skip, saying how to make one."""
import json
import os
import sys
import time

import pytest
import torch

from loop_helpers import (assert_one_line_error, loop_args, max_weight_diff, metrics, run_command, script_exit,
                          torchrun_command, weights, without_timing)
from model import generate, load_pretrained, load_tokenizer
from serving.engine import CompletionServer
from serving.weight_sync import WeightSync
from support import ROOT, SERVED_CONFIG, write_chat_jsonl
from trainer.train_opd import main as train_opd
from vllm_servers import TcpProxy, dies_before_call, free_port, save_tiny

pytestmark = pytest.mark.usefixtures("one_thread")
OPD = os.path.join(ROOT, "trainer", "train_opd.py")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serving")
    config = folder / "served_config.json"
    config.write_text(json.dumps(SERVED_CONFIG))
    return {"config": str(config), "data": write_chat_jsonl(folder / "chat.jsonl", 16), "folder": folder}


def rollout_server(url: str) -> CompletionServer:
    return CompletionServer(url, "student", what="rollout server", max_retries=2)


def opd_args(files, servers, save_dir, url=None, batch=4, **flags) -> list[str]:
    return loop_args(files["config"], files["data"], save_dir, batch=batch, teacher_path=servers.teacher_dir,
                     max_length=80, max_new_tokens=32, max_steps=3, rollout_url=url or servers.rollout.url,
                     **flags)



def left_padded(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tokenizer.encode(t) for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


# ------------------------------------------------------------------------------------------------ without a server

def test_a_rollout_server_that_is_down_is_refused_in_seconds(files, tmp_path, capsys):
    teacher = save_tiny(str(tmp_path / "teacher"), seed=2, tied=False)
    url = f"http://127.0.0.1:{free_port()}/v1"
    start = time.perf_counter()
    code, stderr = script_exit(train_opd, loop_args(files["config"], files["data"], tmp_path / "out",
                                                    teacher_path=teacher, rollout_url=url), capsys)
    assert time.perf_counter() - start < 10
    assert_one_line_error(code, stderr, 1, "rollout server", url.removesuffix("/v1"), "is the server up")
    assert not os.path.exists(tmp_path / "out" / "run_resume.pt")


def test_sampled_kl_with_stale_rollouts_is_refused(files, tmp_path, capsys):
    teacher = save_tiny(str(tmp_path / "teacher"), seed=2, tied=False)
    code, stderr = script_exit(train_opd, loop_args(files["config"], files["data"], tmp_path, teacher_path=teacher,
                                                    loss="sampled_kl", rollout_url="http://127.0.0.1:1/v1",
                                                    sync_interval=2), capsys)
    assert_one_line_error(code, stderr, 2, "--sync_interval 2", "biased")


# ---------------------------------------------------------------------------------------------- with real servers

@pytest.fixture
def served_student(vllm_servers):
    """The rollout server holding the weights it started with (tests before may have pushed others)."""
    model = load_pretrained(vllm_servers.student_dir)
    server = rollout_server(vllm_servers.rollout.url)
    WeightSync(server, os.path.join(vllm_servers.student_dir, "..", "sync", "model.safetensors"),
               [], torch.float32).push(model, 0)
    yield model, server
    server.close()


@pytest.mark.slow
def test_greedy_rollouts_are_token_identical_to_the_built_in_engine(served_student, tokenizer):
    model, server = served_student
    ids, mask = left_padded(tokenizer, [f"Question {i}: what is {i} + {3 * i}? Think step by step." for i in range(8)])
    sampling = dict(do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                    vocab_size=len(tokenizer))
    served = server.generate(ids, mask, 64, seeds=range(8), model_vocab_size=model.config.vocab_size, **sampling)
    ours = generate(model, ids, mask, 64, **sampling)
    assert served.completion_ids.shape == (8, 64)
    assert torch.equal(served.completion_ids, ours.completion_ids)
    assert torch.equal(served.completion_mask, ours.completion_mask)


@pytest.mark.slow
def test_sampled_rows_depend_on_their_seed_alone(served_student, tokenizer):
    model, server = served_student
    ids, mask = left_padded(tokenizer, [f"Tell me about the number {i}." for i in range(6)])
    sampling = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                    vocab_size=len(tokenizer), model_vocab_size=model.config.vocab_size)
    seeds = [101, 102, 103, 104, 105, 106]
    whole = server.generate(ids, mask, 48, seeds=seeds, **sampling).completion_ids
    again = server.generate(ids, mask, 48, seeds=seeds, **sampling).completion_ids
    part = server.generate(ids[3:], mask[3:], 48, seeds=seeds[3:], **sampling).completion_ids
    assert torch.equal(whole, again)
    assert torch.equal(whole[3:, :part.shape[1]], part)
    assert len({tuple(row.tolist()) for row in whole}) == 6  # different seeds, different samples
    # the embedding's padding rows beyond the tokenizer are never drawn (a random model gives them real mass)
    assert int(whole.max()) < len(tokenizer)


@pytest.mark.slow
def test_opd_on_the_server_verifies_every_sync_and_repeats_exactly(vllm_servers, files, tmp_path, capsys):
    for name in ("a", "b"):
        train_opd(opd_args(files, vllm_servers, tmp_path / name))
    out = capsys.readouterr().out
    # the run says where it samples, and the first verification's numbers, once per run
    assert out.count(f"rollouts on {vllm_servers.rollout.url}") == 2
    assert out.count("weights of step 0 pushed to") == 2 and out.count(" and verified: ") == 2
    a, b = metrics(tmp_path / "a"), metrics(tmp_path / "b")
    assert [m["step"] for m in a] == [1, 2, 3]
    # one push and one verification before each step's rollouts, every one within fp32's 1e-4
    assert all("sync_s" in m and "verify_s" in m and m["sync_logprob_diff"] < 1e-4 for m in a)
    assert all(0 <= m["sync_logprob_mean"] <= m["sync_logprob_diff"] for m in a)
    assert all(m["on_policy_share"] == 1.0 and m["completion_len"] > 0 and m["weight_pushes"] == 1 for m in a)
    assert without_timing(a) == without_timing(b)
    # the weights written for the server (the student's size again) are gone when the run ends
    assert not [p for p in os.listdir(tmp_path / "a") if "rollout_weights" in p], os.listdir(tmp_path / "a")
    assert max_weight_diff(weights(tmp_path / "a"), weights(tmp_path / "b")) == 0.0


@pytest.mark.slow
def test_an_off_policy_step_pushes_no_weights(vllm_servers, files, tmp_path):
    """With lmbda 0.5 (seed 7) the steps are on-, off-, on-policy: the off-policy step samples nothing, so it neither
    pushes nor verifies, and the next on-policy step does both."""
    train_opd(opd_args(files, vllm_servers, tmp_path, lmbda=0.5))
    rows = metrics(tmp_path)
    assert [m["on_policy_share"] for m in rows] == [1.0, 0.0, 1.0]
    assert ["sync_logprob_diff" in m for m in rows] == [True, False, True]
    assert all(m["sync_logprob_diff"] < 1e-4 for m in rows if "sync_logprob_diff" in m)


@pytest.mark.slow
def test_a_skipped_sync_is_detected_and_stops_the_run(vllm_servers, files, tmp_path, capsys, monkeypatch):
    push = WeightSync.push

    def push_only_once(self, model, step):
        if step == 0:
            return push(self, model, step)
        self.synced_step = step  # the schedule moves on, the server keeps the weights of step 0

    monkeypatch.setattr(WeightSync, "push", push_only_once)
    code, stderr = script_exit(train_opd, opd_args(files, vllm_servers, tmp_path), capsys)
    line = assert_one_line_error(code, stderr, 1, "does not serve the trainer's weights", "after the sync of step 1",
                                 "tolerance 0.0001", "--from_resume 1")
    assert "Nothing from these weights was trained on" in line
    assert [m["step"] for m in metrics(tmp_path)] == [1]  # stopped before step 2's rollouts
    assert torch.load(tmp_path / "run_resume.pt", weights_only=False)["step"] == 1


@pytest.mark.slow
def test_vllms_own_reload_misses_the_tied_head_and_is_caught(vllm_servers, files, tmp_path, capsys, monkeypatch):
    """vLLM 0.32's `reload_weights` reloads the layers but leaves the tied head's packed CPU copy stale: exactly the
    silent half-sync the verification exists for. Where vLLM computes fp32 from the weight itself (no packed copy on
    that CPU) the stock reload is a correct sync, and there is nothing to catch."""
    from serving.vllm_launch import keeps_packed_copy, vllm_python
    if not keeps_packed_copy(vllm_python(), "float32"):
        pytest.skip("vLLM's fp32 GEMM keeps no packed copy of the weight on this CPU: the stock reload refreshes the "
                    "head (serving/vllm_launch.py keeps_packed_copy)")
    def stock_reload(self):
        return {"method": "reload_weights", "kwargs": {"weights_path": os.path.dirname(self.path)}}

    monkeypatch.setattr(WeightSync, "load_request", stock_reload)
    code, stderr = script_exit(train_opd, opd_args(files, vllm_servers, tmp_path), capsys)
    assert_one_line_error(code, stderr, 1, "does not serve the trainer's weights")
    # caught at the first push that changes the weights: step 0's, or step 1's when the server already held the
    # initial weights (the head then matches by chance)
    assert len(metrics(tmp_path)) <= 1


@pytest.mark.slow
def test_a_server_that_dies_mid_run_stops_it_and_the_resumed_run_is_exact(vllm_servers, files, tmp_path, capsys,
                                                                         monkeypatch):
    train_opd(opd_args(files, vllm_servers, tmp_path / "reference"))
    proxy = TcpProxy(vllm_servers.rollout.port)
    dies_before_call(monkeypatch, "sample_tokens", proxy, 3)  # the third step's rollout
    killed = tmp_path / "killed"
    code, stderr = script_exit(train_opd, opd_args(files, vllm_servers, killed, url=proxy.url), capsys)
    assert_one_line_error(code, stderr, 1, "rollout server", "failed", "step 2", "--from_resume 1")
    assert torch.load(killed / "run_resume.pt", weights_only=False)["step"] == 2  # saved when it failed
    monkeypatch.undo()
    proxy.up()
    train_opd(opd_args(files, vllm_servers, killed, url=proxy.url, from_resume=1))
    proxy.down()
    assert max_weight_diff(weights(tmp_path / "reference"), weights(killed)) == 0.0
    assert without_timing(metrics(tmp_path / "reference")) == without_timing(metrics(killed))


@pytest.mark.serial
@pytest.mark.slow
def test_two_ranks_sample_and_train_as_one_does(vllm_servers, files, tmp_path):
    """Rank 0 alone pushes and verifies; rank 1 waits for it in the loop's all-reduce. Per-row seeds: the same rows
    sampled whichever rank asks."""
    one = opd_args(files, vllm_servers, tmp_path / "one", accumulation=2, batch=2)
    two = opd_args(files, vllm_servers, tmp_path / "two", batch=2)
    run_command([sys.executable, OPD, *one])
    run_command(torchrun_command(OPD, two))
    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [m["completion_len"] for m in a] == [m["completion_len"] for m in b]
    assert [m["loss"] for m in a] == pytest.approx([m["loss"] for m in b], rel=1e-5)
    assert max_weight_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) < 1e-5


@pytest.mark.slow
def test_eval_math_on_the_server_gives_the_built_in_engines_answers(served_student, vllm_servers, tmp_path, capsys):
    from eval.eval_math import main as eval_math
    model_dir = vllm_servers.student_dir
    common = ["--model_path", model_dir, "--max_rows", "6", "--max_new_tokens", "24", "--no_progress"]
    built_in = eval_math([*common, "--out", str(tmp_path / "built_in.jsonl")])
    served = eval_math([*common, "--out", str(tmp_path / "served.jsonl"), "--server_url", vllm_servers.rollout.url,
                        "--server_model", "student"])
    assert served["accuracy"] == built_in["accuracy"]
    assert (tmp_path / "served.jsonl").read_text() == (tmp_path / "built_in.jsonl").read_text()
    # a server that serves other weights than --model_path is refused before any generation
    code, stderr = script_exit(eval_math, ["--model_path", vllm_servers.teacher_dir, "--server_url",
                                           vllm_servers.rollout.url, "--server_model", "student", "--max_rows", "2",
                                           "--out", str(tmp_path / "wrong.jsonl")], capsys)
    assert_one_line_error(code, stderr, 1, "does not serve", "--model_path")
    assert not os.path.exists(tmp_path / "wrong.jsonl")


TOKENIZER_PROBES = [
    "12345 + 67890 = 80235, 3.14159, 1e-5 and 2,048", "数学题：三加五等于多少？答案是八。", "日本語のテキスト、한국어 텍스트",
    "emoji 🙂👍🏽🚀 and a family 👨‍👩‍👧", "runs   of  spaces\t\ttabs\n\n\nnewlines \r\n end   ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n\\boxed{4}",
    "def f(x):\n    return x ** 2  # indented code", "Ünïcödé àccents, ß, ﬁ ligature, İstanbul",
]


@pytest.mark.slow
def test_the_server_tokenises_as_we_do(vllm_servers):
    """vLLM warns at start-up about the tokenizer's pre-tokenizer regex (a check transformers makes for Mistral
    tokenizers, fix_mistral_regex): its /tokenize gives the ids our tokenizer gives, on digits, CJK, emojis,
    whitespace runs, special tokens and accents."""
    import httpx
    ours = load_tokenizer(None)
    base = vllm_servers.rollout.url.removesuffix("/v1")
    for text in TOKENIZER_PROBES:
        answer = httpx.post(f"{base}/tokenize", json={"model": "student", "prompt": text,
                                                      "add_special_tokens": False}, timeout=60).json()
        assert answer["tokens"] == ours.encode(text), text
