# python -m pytest tests/test_remote_teacher.py
"""OPD with the teacher on a real vLLM CPU server (--teacher_url): its log-probabilities of the student's samples
(with tools: of a conversation's own tokens, between its tool results) replace the local teacher's, exactly. The
servers come from the session fixture `vllm_servers` (tests/vllm_servers.py); without a vLLM environment the server
tests skip, saying how to make one."""
import contextlib
import json
import os
import shutil
import sys
import time

import pytest
import torch

from dataset.collators import IGNORE_INDEX, build_sequences
from dataset.tool_conversation import Conversation, ToolResponder
from loop_helpers import (assert_one_line_error, checkpoint_step, kill_after_first_checkpoint, loop_args,
                          max_weight_diff, metrics, script_exit, weights, without_timing)
from model import generate, load_pretrained, load_tokenizer
from serving.engine import CompletionServer
from support import ROOT, SERVED_CONFIG, give_another_tokenizer, write_chat_jsonl
from tools import answerer
from trainer.losses.topk_divergence import topk_support
from trainer.losses.divergences import Divergence, evaluation_divergence
from trainer.rollouts.tool_turns import conversation_sequences
from trainer.teachers.parts import teacher_scores
from trainer.train_opd import main as train_opd
from vllm_servers import TcpProxy, dies_before_call, free_port

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("remote_teacher")
    config = folder / "served_config.json"
    config.write_text(json.dumps(SERVED_CONFIG))
    return {"config": str(config), "data": write_chat_jsonl(folder / "chat.jsonl", 16), "folder": folder}


def opd_args(files, save_dir, **flags) -> list[str]:
    return loop_args(files["config"], files["data"], save_dir, batch=4, **{"max_length": 80, "max_new_tokens": 32,
                                                                          "max_steps": 3, "loss": "sampled_kl",
                                                                          **flags})



# ------------------------------------------------------------------------------------------------ without a server

@pytest.mark.parametrize("flags, names", [
    ({"loss": "jsd"}, ("--teacher_url", "--loss sampled_kl", "whole distribution", "--teacher_topk")),
    ({"teacher_topk": 8}, ("--teacher_topk", "--loss jsd")),
    ({"loss": "jsd", "teacher_topk": -1}, ("--teacher_topk", ">= 0")),
    ({"temperature": 2.0}, ("--teacher_url", "temperature 1")),
])
def test_what_a_served_teacher_cannot_do_is_refused(files, tmp_path, capsys, flags, names):
    code, stderr = script_exit(train_opd, opd_args(files, tmp_path, teacher_url="http://127.0.0.1:1/v1",
                                                   **{"gen_temperature": flags.get("temperature", 1.0), **flags}),
                               capsys)
    assert_one_line_error(code, stderr, 2, *names)


def test_a_top_k_answer_is_read_as_vllm_sends_it():
    """vLLM's prompt_logprobs with k = 2: per position the top-2 and the prompt's token (2 entries when it is among
    them, 3 when not); the first position has none."""
    from serving.engine import _prompt_topk_logprobs
    body = {"choices": [{"prompt_token_ids": [5, 7, 9], "prompt_logprobs": [
        None,
        {"7": {"logprob": -0.5, "rank": 1}, "3": {"logprob": -1.5, "rank": 2}},
        {"1": {"logprob": -0.2, "rank": 1}, "2": {"logprob": -2.0, "rank": 2}, "9": {"logprob": -9999.0, "rank": 9}},
    ]}]}
    ids, logprobs = _prompt_topk_logprobs(body, 2)
    assert ids.tolist() == [[3, 7, -1], [1, 2, 9]]
    assert torch.equal(logprobs, torch.tensor([[-1.5, -0.5, 0.0], [-0.2, -2.0, -9999.0]]))
    with pytest.raises(ValueError, match="top-3"):
        _prompt_topk_logprobs(body, 3)  # a server that sent fewer than asked


def test_a_teacher_server_that_is_down_is_refused_in_seconds(files, tmp_path, capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"
    start = time.perf_counter()
    code, stderr = script_exit(train_opd, opd_args(files, tmp_path, teacher_url=url), capsys)
    assert time.perf_counter() - start < 10
    assert_one_line_error(code, stderr, 1, "teacher server", url.removesuffix("/v1"), "is the server up")


# ---------------------------------------------------------------------------------------------- with real servers

@pytest.mark.slow
def test_served_log_probs_of_the_students_samples_equal_the_local_teachers(vllm_servers, files):
    tokenizer = load_tokenizer(None)
    teacher = load_pretrained(vllm_servers.teacher_dir)
    torch.manual_seed(0)
    student = load_pretrained(vllm_servers.student_dir)
    rows = [tokenizer.encode(f"<|im_start|>user\nCount to {i}.<|im_end|>\n<|im_start|>assistant\n") for i in range(6)]
    width = max(map(len, rows))
    prompt_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    prompt_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = generate(student, prompt_ids, prompt_mask, 40, do_sample=True, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer),
                   generator=[torch.Generator().manual_seed(i) for i in range(6)])
    input_ids, attention_mask, labels = build_sequences(prompt_ids, prompt_mask, out.completion_ids,
                                                        out.completion_mask)
    server = CompletionServer(vllm_servers.teacher.url, "teacher", what="teacher server")
    served = teacher_scores(Divergence("sampled_kl"), None, server, contextlib.nullcontext, input_ids,
                            attention_mask, labels)
    hidden = teacher_scores(Divergence("jsd"), teacher, None, contextlib.nullcontext, input_ids, attention_mask,
                            labels)
    local = (hidden @ teacher.lm_head.weight[:len(tokenizer)].T).log_softmax(-1)
    local = local.gather(1, labels[labels != IGNORE_INDEX][:, None]).squeeze(1)
    assert served.shape == local.shape == (int((labels != IGNORE_INDEX).sum()),)
    assert (served - local).abs().max().item() < 1e-4


@pytest.mark.slow
def test_opd_with_a_served_teacher_trains_as_with_the_local_one(vllm_servers, files, tmp_path):
    """Three steps, built-in rollouts: the same losses and weights (1e-5) with the teacher local or served; and the
    same again with the rollouts on one server and the teacher on another."""
    # the server read the sharded export layout (tests/vllm_servers.py): an index and several files
    index = json.loads(open(os.path.join(vllm_servers.teacher_dir, "model.safetensors.index.json")).read())
    assert len(set(index["weight_map"].values())) >= 3
    train_opd(opd_args(files, tmp_path / "local", teacher_path=vllm_servers.teacher_dir, eval_interval=3,
                       eval_rows=4, eval_max_new_tokens=16))
    train_opd(opd_args(files, tmp_path / "served", teacher_url=vllm_servers.teacher.url, eval_interval=3,
                       eval_rows=4, eval_max_new_tokens=16))
    local, served = metrics(tmp_path / "local"), metrics(tmp_path / "served")
    steps = [m for m in local if "loss" in m], [m for m in served if "loss" in m]
    assert [m["loss"] for m in steps[0]] == pytest.approx([m["loss"] for m in steps[1]], abs=1e-5)
    assert [m["reverse_kl_estimate"] for m in steps[0]] == \
        pytest.approx([m["reverse_kl_estimate"] for m in steps[1]], abs=1e-5)
    assert max_weight_diff(weights(tmp_path / "local"), weights(tmp_path / "served")) < 1e-5
    # held-out: the full reverse KL with the local teacher, the sampled-token estimate with the served one
    evals = [m for m in served if "eval/reverse_kl_estimate" in m]
    # a one-sample estimate of a reverse KL of about 0.03 on 4 x 16 tokens: either sign, but small (a misaligned
    # token or log-prob gives several nats: random models put about -11.9 on every token)
    assert [m["step"] for m in evals] == [0, 3] and all(abs(m["eval/reverse_kl_estimate"]) < 0.5 for m in evals)
    assert all("eval/reverse_kl" in m for m in local if "eval/accuracy" in m)

    both = tmp_path / "both_served"
    train_opd(opd_args(files, both, teacher_url=vllm_servers.teacher.url, rollout_url=vllm_servers.rollout.url))
    reference = tmp_path / "rollouts_served"
    train_opd(opd_args(files, reference, teacher_path=vllm_servers.teacher_dir, rollout_url=vllm_servers.rollout.url))
    a, b = metrics(reference), metrics(both)
    assert [m["loss"] for m in a] == pytest.approx([m["loss"] for m in b], abs=1e-5)
    assert max_weight_diff(weights(reference), weights(both)) < 1e-5


@pytest.mark.slow
def test_a_teacher_server_with_another_tokenizer_is_refused(vllm_servers, files, tmp_path, capsys):
    tokenizer_dir = tmp_path / "tokenizer"
    shutil.copytree(vllm_servers.teacher_dir, tokenizer_dir)
    give_another_tokenizer(tokenizer_dir)
    code, stderr = script_exit(train_opd, opd_args(files, tmp_path / "out", teacher_url=vllm_servers.teacher.url,
                                                   tokenizer_path=str(tokenizer_dir)), capsys)
    assert_one_line_error(code, stderr, 2, "teacher server", "differently", "tokenizer")
    assert not os.path.exists(tmp_path / "out" / "run_resume.pt")


@pytest.mark.slow
def test_a_teacher_server_that_dies_mid_run_stops_it_and_the_resumed_run_is_exact(vllm_servers, files, tmp_path,
                                                                                 capsys, monkeypatch):
    train_opd(opd_args(files, tmp_path / "reference", teacher_url=vllm_servers.teacher.url))
    proxy = TcpProxy(vllm_servers.teacher.port)
    dies_before_call(monkeypatch, "completion_logprobs", proxy, 3)  # the third step's scoring
    killed = tmp_path / "killed"
    code, stderr = script_exit(train_opd, opd_args(files, killed, teacher_url=proxy.url), capsys)
    assert_one_line_error(code, stderr, 1, "teacher server", "failed", "step 2", "--from_resume 1")
    monkeypatch.undo()
    proxy.up()
    train_opd(opd_args(files, killed, teacher_url=proxy.url, from_resume=1))
    proxy.down()
    assert max_weight_diff(weights(tmp_path / "reference"), weights(killed)) == 0.0
    assert without_timing(metrics(tmp_path / "reference")) == without_timing(metrics(killed))


# ------------------------------------------------------------------------------- the teacher's top-K from a server

def sampled_rows(vllm_servers, tokenizer, rows=6, new_tokens=40):
    torch.manual_seed(0)
    student = load_pretrained(vllm_servers.student_dir)
    prompts = [tokenizer.encode(f"<|im_start|>user\nCount to {i}.<|im_end|>\n<|im_start|>assistant\n")
               for i in range(rows)]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in prompts])
    out = generate(student, prompt_ids, prompt_mask, new_tokens, do_sample=True, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer),
                   generator=[torch.Generator().manual_seed(i) for i in range(rows)])
    return build_sequences(prompt_ids, prompt_mask, out.completion_ids, out.completion_mask)


@pytest.mark.slow
def test_served_top_k_equals_the_local_teachers(vllm_servers):
    """Per completion position the server's top-8 plus the sampled token: the same ids as the local teacher's top-8
    and label, and the same log-probabilities (fp32: 1e-4)."""
    tokenizer = load_tokenizer(None)
    teacher = load_pretrained(vllm_servers.teacher_dir)
    input_ids, attention_mask, labels = sampled_rows(vllm_servers, tokenizer)
    server = CompletionServer(vllm_servers.teacher.url, "teacher", what="teacher server")
    ids, logprobs = teacher_scores(Divergence("topk", topk=8), None, server, contextlib.nullcontext, input_ids,
                                   attention_mask, labels)
    hidden = teacher_scores(Divergence("jsd"), teacher, None, contextlib.nullcontext, input_ids, attention_mask,
                            labels)
    targets = labels[labels != IGNORE_INDEX]
    local_ids, local_logprobs = topk_support(hidden @ teacher.lm_head.weight[:len(tokenizer)].T, targets, 8)
    assert ids.shape == logprobs.shape == (targets.numel(), 9)
    for n in range(targets.numel()):
        served = {int(i): float(v) for i, v in zip(ids[n], logprobs[n]) if i >= 0}
        local = {int(i): float(v) for i, v in zip(local_ids[n], local_logprobs[n]) if i >= 0}
        assert served.keys() == local.keys() and int(targets[n]) in served
        assert max(abs(served[i] - local[i]) for i in served) < 1e-4


@pytest.mark.slow
def test_a_served_teacher_scores_exactly_the_students_own_tokens_of_a_conversation(vllm_servers):
    """With --tools the labelled tokens are the student's turns, between which the tool results lie (they are not the
    rows' last tokens): the served teacher's log-probabilities and top-8 of exactly those tokens are the local
    teacher's (fp32: 1e-4)."""
    tokenizer = load_tokenizer(None)
    teacher = load_pretrained(vllm_servers.teacher_dir)
    call = tokenizer.encode('<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
                            '<|im_end|>')
    results = ToolResponder(tokenizer, answerer(["calculator"]), enable_thinking=False)(call)
    answer = tokenizer.encode("6 * 7 = 42. \\boxed{42}<|im_end|>")
    conversation = Conversation(call + results + answer, [1] * len(call) + [0] * len(results) + [1] * len(answer))
    prompts = [tokenizer.encode(f"<|im_start|>user\nWhat is {i} * 7?<|im_end|>\n<|im_start|>assistant\n")
               for i in (6, 16)]
    sequences = conversation_sequences(prompts, [conversation] * 2, tokenizer.pad_token_id, "cpu")
    server = CompletionServer(vllm_servers.teacher.url, "teacher", what="teacher server")
    hidden = teacher_scores(Divergence("jsd"), teacher, None, contextlib.nullcontext, *sequences)
    logits = hidden @ teacher.lm_head.weight[:len(tokenizer)].T
    targets = sequences[2][sequences[2] != IGNORE_INDEX]
    assert targets.tolist() == (call + answer) * 2
    local = logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    served = teacher_scores(Divergence("sampled_kl"), None, server, contextlib.nullcontext, *sequences)
    assert served.shape == local.shape and (served - local).abs().max().item() < 1e-4
    ids, logprobs = teacher_scores(Divergence("topk", topk=8), None, server, contextlib.nullcontext, *sequences)
    local_ids, local_logprobs = topk_support(logits, targets, 8)
    for n in range(targets.numel()):
        served_k = {int(i): float(v) for i, v in zip(ids[n], logprobs[n]) if i >= 0}
        local_k = {int(i): float(v) for i, v in zip(local_ids[n], local_logprobs[n]) if i >= 0}
        assert served_k.keys() == local_k.keys() and max(abs(served_k[i] - local_k[i]) for i in served_k) < 1e-4


def initial_weights(files, tmp_path) -> dict:
    """The student every test run starts from: --model_config with --seed 7 (loop_args)."""
    from model import Qwen3Config, create_model, save_pretrained
    save_pretrained(create_model(Qwen3Config.from_json(files["config"]), seed=7), str(tmp_path / "initial"))
    return weights(tmp_path, "initial")


@pytest.mark.slow
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_opd_with_a_served_top_k_teacher_trains_as_with_the_local_top_k(vllm_servers, files, tmp_path, beta):
    """Three steps, --loss jsd --teacher_topk 8: the teacher's top-8 from the server or from its local logits, the
    same divergence function on both. Losses within 1e-5; weights within 2% of how far they moved (AdamW turns fp32
    noise in near-zero gradients into lr-sized differences)."""
    flags = dict(loss="jsd", teacher_topk=8, beta=beta)
    train_opd(opd_args(files, tmp_path / "local", teacher_path=vllm_servers.teacher_dir, **flags))
    train_opd(opd_args(files, tmp_path / "served", teacher_url=vllm_servers.teacher.url, **flags))
    local, served = ([m for m in metrics(tmp_path / name) if "loss" in m] for name in ("local", "served"))
    assert len(local) == len(served) == 3
    assert [m["loss"] for m in local] == pytest.approx([m["loss"] for m in served], abs=1e-5)
    assert [m["teacher_tail_mass"] for m in local] == pytest.approx([m["teacher_tail_mass"] for m in served],
                                                                    abs=1e-5)
    moved = max_weight_diff(weights(tmp_path / "local"), initial_weights(files, tmp_path))
    apart = max_weight_diff(weights(tmp_path / "local"), weights(tmp_path / "served"))
    print(f"beta {beta}: losses {max(abs(a['loss'] - b['loss']) for a, b in zip(local, served)):.2e} apart, "
          f"weights {apart:.2e} apart = {apart / moved:.2%} of their movement {moved:.2e}")
    assert apart <= 0.02 * moved


@pytest.mark.slow
@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_the_held_out_evaluation_with_a_served_top_k_teacher_is_the_local_top_k_divergence(vllm_servers, beta):
    """With --teacher_topk K the held-out evaluation against a served teacher logs the training loss's top-K
    divergence on the student's greedy completions (not the sampled-token estimate): the same number as the local
    teacher's top-K from its logits on those completions."""
    from trainer.evaluation.heldout import heldout_metrics, heldout_sums
    from trainer.teachers.teacher_set import EvalTeacher
    from trainer.losses.chunked import completion_hidden
    from trainer.losses.topk_divergence import chunked_topk_divergence
    tokenizer = load_tokenizer(None)
    student, teacher = load_pretrained(vllm_servers.student_dir), load_pretrained(vllm_servers.teacher_dir)
    prompts = [tokenizer.encode(f"<|im_start|>user\nAdd {i} and 3.<|im_end|>\n<|im_start|>assistant\n")
               for i in range(4)]
    width = max(map(len, prompts))
    batch = {"prompt_ids": torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in prompts]),
             "prompt_attention_mask": torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in prompts]),
             "rows": [{"row_index": i} for i in range(4)]}
    server = CompletionServer(vllm_servers.teacher.url, "teacher", what="teacher server")
    divergence = evaluation_divergence(beta, local_teacher=False, teacher_topk=8)
    teachers = [EvalTeacher("teacher", divergence, server=server)]
    sums = heldout_sums(student, tokenizer, [batch], 24, teachers)
    served = heldout_metrics(sums, teachers)
    name = "eval/reverse_kl_top8" if beta == 1.0 else "eval/jsd_beta0.5_top8"
    assert list(served) == ["eval/accuracy", "eval/completion_len", "eval/eos_share", name]
    with torch.no_grad():
        out = generate(student, batch["prompt_ids"], batch["prompt_attention_mask"], 24, do_sample=False,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       vocab_size=len(tokenizer))
        sequences = build_sequences(batch["prompt_ids"], batch["prompt_attention_mask"], out.completion_ids,
                                    out.completion_mask)
        hidden, targets = completion_hidden(student, *sequences)
        teacher_hidden, _ = completion_hidden(teacher, *sequences)
        local, tokens, _ = chunked_topk_divergence(hidden, student.lm_head.weight, targets, 8,
                                                   teacher_hidden=teacher_hidden,
                                                   teacher_weight=teacher.lm_head.weight, beta=beta,
                                                   vocab_size=len(tokenizer))
    assert sums["kl_tokens/teacher"] == int(tokens) > 0
    assert served[name] == pytest.approx(float(local) / int(tokens), rel=1e-4)


@pytest.mark.slow
def test_a_teacher_server_with_too_few_logprobs_is_refused(vllm_servers, files, tmp_path, capsys):
    """The fixture's teacher server runs with vLLM's default --max-logprobs 20: --teacher_topk 21 is refused at
    start-up in one line that says how to restart it."""
    code, stderr = script_exit(train_opd, opd_args(files, tmp_path / "out", teacher_url=vllm_servers.teacher.url,
                                                   loss="jsd", teacher_topk=21), capsys)
    assert_one_line_error(code, stderr, 2, "teacher server", "at most 20", "--teacher_topk 21", "--max-logprobs 21",
                          "vllm_launch.py --max_logprobs 21")
    assert not os.path.exists(tmp_path / "out" / "run_resume.pt")


# ------------------------------------------------------------------------- a local and a served teacher in one run

@pytest.mark.slow
def test_a_local_and_a_served_top_k_teacher_in_one_run_resume_bit_identically(vllm_servers, files, tmp_path):
    """--teachers with a local teacher and one on the vLLM server, both top-8 (--loss jsd), rows routed by their
    column: the served teacher's chat template is checked through the server's /tokenize, each teacher scores its
    own rows, and a run SIGKILLed after its first checkpoint and resumed ends bit-identical to an uninterrupted one.
    The served teacher's loss equals the same model's as a local top-8 teacher (the server's log-probabilities)."""
    rows = [json.loads(line) for line in open(files["data"], encoding="utf-8")]
    data = tmp_path / "routed.jsonl"
    data.write_text("".join(json.dumps({**row, "teacher": ("local", "served")[i % 2]}) + "\n"
                            for i, row in enumerate(rows)))
    teachers = {"local": {"path": vllm_servers.student_dir, "topk": 8},
                "served": {"url": vllm_servers.teacher.url, "model": "teacher", "topk": 8}}
    (tmp_path / "teachers.json").write_text(json.dumps(teachers))
    (tmp_path / "as_local.json").write_text(json.dumps({**teachers, "served": {"path": vllm_servers.teacher_dir,
                                                                               "topk": 8}}))

    def args(save_dir, teachers_file="teachers.json", **flags):
        argv = opd_args(files, save_dir, loss="jsd", teachers=str(tmp_path / teachers_file), save_interval=1,
                        **flags)
        argv[argv.index("--data_path") + 1] = str(data)
        return argv
    train_opd(args(tmp_path / "full"))
    killed = tmp_path / "killed"
    kill_after_first_checkpoint([sys.executable, os.path.join(ROOT, "trainer", "train_opd.py"), *args(killed)],
                                str(killed / "run_resume.pt"))
    assert checkpoint_step(killed / "run_resume.pt") < 3, "the run finished before it could be killed"
    train_opd(args(killed, from_resume=1))
    full, resumed = weights(tmp_path / "full"), weights(killed)
    assert all(torch.equal(full[k], resumed[k]) for k in full), "resumed weights are not bit-identical"
    assert without_timing(metrics(tmp_path / "full")) == without_timing(metrics(killed))
    steps = metrics(tmp_path / "full")
    assert all(m["teacher/local/rows"] + m["teacher/served/rows"] == 4 for m in steps)
    train_opd(args(tmp_path / "local", teachers_file="as_local.json"))  # the served model, read from its folder
    for served, local in zip(steps, metrics(tmp_path / "local")):
        assert served["teacher/served/tokens"] == local["teacher/served/tokens"]
        if served["teacher/served/rows"]:
            assert served["teacher/served/loss"] == pytest.approx(local["teacher/served/loss"], rel=1e-3, abs=1e-4)
