# python -m pytest tests/test_logit_free_vllm.py            (all slow: real vLLM CPU servers)
"""train_logit_free.py against a real vLLM CPU server as the black-box teacher (text in, text out): the session's
tiny teacher (tests/vllm_servers.py) through /v1/completions and through /v1/chat/completions with vLLM's
continue_final_message, a SIGKILL in the middle of a step's teacher calls and the resume, counted at the server; and
a teacher with a tokenizer of its own (a byte-level BPE trained here, a random Qwen3 of that vocabulary served by a
server of this module). The stub-teacher tests of the same loop are tests/test_train_logit_free.py.

The start-up probe asks the teacher to continue "1, 2, 3, 4," and refuses one that does not go on with 5; a random
model cannot count, so the teachers here hold `make_counting`'s weights (vllm_servers.py): random but for a few
greedy bigrams ("," -> " " -> "5" -> ","). At temperature 1 every other token's continuation stays random text."""
import json
import math
import os
import sys

import pytest
import torch

import trainer.train_logit_free as logit_free
from loop_helpers import checkpoint_step, env_one_thread, loop_args, metrics, weights, without_timing
from support import ROOT, SERVED_CONFIG, write_chat_jsonl
from vllm_servers import counting_weights, make_counting, served_requests, settled_requests

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread", "no_proxy")]

SCRIPT = os.path.join(ROOT, "trainer", "train_logit_free.py")
PATH = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
METHOD = {"max_new_tokens": 12, "chunk_len": 4, "audit_chunks": 2, "continuations": 3, "anchor_beta": 0.5}
USAGE = ("teacher_requests", "teacher_cached", "teacher_tokens")


@pytest.fixture
def no_proxy(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_chat_jsonl(tmp_path_factory.mktemp("logit_free_data") / "chat.jsonl", 16)


@pytest.fixture(scope="module")
def teacher(vllm_servers, tmp_path_factory):
    """The session's teacher server with counting weights for this module; its own weights are pushed back after."""
    with counting_weights(vllm_servers.teacher, vllm_servers.teacher_dir, "teacher",
                          str(tmp_path_factory.mktemp("counting"))):
        yield vllm_servers


def run_args(student_dir, data, save_dir, form, url, tokenizer_dir, steps=3, **flags) -> list[str]:
    """A tiny Qwen3 student (sampled by the built-in engine) against the teacher at `url` (`tokenizer_dir`: its
    tokenizer folder, for the completions form), METHOD's small audit."""
    return loop_args(None, data, save_dir, model_path=student_dir, max_steps=steps, teacher_url=url,
                     teacher_model="teacher", teacher_form=form,
                     teacher_tokenizer_path=tokenizer_dir if form == "completions" else None, **{**METHOD, **flags})


def session_args(servers, data, save_dir, form, **flags) -> list[str]:
    """The session's served student folder against the session's teacher."""
    return run_args(servers.student_dir, data, save_dir, form, servers.teacher.url, servers.teacher_dir, **flags)


def probe_requests(server, form: str, tokenizer_dir: str | None) -> int:
    """The HTTP requests the loop's start-up probe makes, counted at the server: the same client and probe as
    connect_teacher's (temperature 1, n = METHOD's continuations), no cache."""
    from dataset.continuations import ContinuationClient
    from dataset.teacher import SamplingParams
    before = served_requests(server, PATH[form])
    with ContinuationClient(server.url, "teacher", form=form, api_key_env=None,
                            tokenizer_dir=tokenizer_dir if form == "completions" else None,
                            params=SamplingParams(temperature=1.0, n=METHOD["continuations"])) as client:
        client.check_continuation()
    return settled_requests(server, PATH[form]) - before


def without_usage(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in USAGE} for row in without_timing(rows)]


def assert_trained(rows: list[dict], steps: int) -> None:
    assert [m["step"] for m in rows] == list(range(1, steps + 1))
    for m in rows:
        assert 0.0 <= m["pi_hat"] <= 1.0 and 0.0 <= m["phi"] <= 1.0, m
        assert m["teacher_requests"] > 0 and m["teacher_cached"] == 0 and m["teacher_tokens"] > 0, m
        assert 0.0 < m["audited_share"] <= 1.0 and m["anchor_kl"] >= 0.0 and math.isfinite(m["loss"]), m


def cache_records(save_dir, name="run") -> list[dict]:
    """The teacher's answers a run stored, complete lines only (a kill may tear the last one)."""
    path = os.path.join(str(save_dir), f"{name}_teacher_cache.rank0.jsonl")
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


# ---------------------------------------------------------------------------------------------------------------------
# both request forms, each run twice

def test_both_forms_train_repeat_exactly_and_agree(teacher, data, tmp_path):
    """Per form: 3 steps finish with pi_hat and phi in [0, 1], teacher requests and tokens counted, every request
    sent (the server counts the probe + the logged teacher_requests); a second run into another folder (its own
    empty cache: every request sent again, seeded) gives the same metrics and bit-identical weights. And the two
    forms agree: vLLM's chat endpoint builds from (messages, partial) the token ids the completions form renders
    through the teacher's template, so the same seeds give the same continuations, the same prompt-token counts
    and the same training."""
    runs = {}
    for form in ("completions", "chat"):
        probe = probe_requests(teacher.teacher, form, teacher.teacher_dir)
        for attempt in ("a", "b"):
            before = served_requests(teacher.teacher, PATH[form])
            logit_free.main(session_args(teacher, data, tmp_path / f"{form}_{attempt}", form))
            rows = metrics(tmp_path / f"{form}_{attempt}")
            assert_trained(rows, 3)
            sent = settled_requests(teacher.teacher, PATH[form]) - before
            assert sent == probe + sum(m["teacher_requests"] for m in rows)       # the probe + the loop's requests
            assert len(cache_records(tmp_path / f"{form}_{attempt}")) == sum(m["teacher_requests"] for m in rows)
            runs[form, attempt] = rows, weights(tmp_path / f"{form}_{attempt}")
    for form in ("completions", "chat"):
        (rows_a, weights_a), (rows_b, weights_b) = runs[form, "a"], runs[form, "b"]
        assert without_timing(rows_a) == without_timing(rows_b), form
        assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a), form
    (completions, completion_weights), (chat, chat_weights) = runs["completions", "a"], runs["chat", "a"]
    assert without_timing(completions) == without_timing(chat)
    assert all(torch.equal(completion_weights[k], chat_weights[k]) for k in completion_weights)


# ---------------------------------------------------------------------------------------------------------------------
# a SIGKILL in the middle of a step's teacher calls, and the resume

# Runs the loop and SIGKILLs it right after the first answer of step argv[1] is in the cache (fsynced): the step's
# other requests were sent at once (all of a micro-batch's chunks are in flight together) and are in flight at the
# server. A real SIGKILL, nothing cleans up; at an instant a timer watching the files could not hit reliably.
KILL_DRIVER = """
import os, runpy, signal, sys
sys.path.insert(0, {root!r})
from dataset.continuations import ContinuationClient
step, script = sys.argv[1], sys.argv[2]
store = ContinuationClient._store
def store_then_die(self, key, prepared, request, parts):
    answer = store(self, key, prepared, request, parts)
    if request.name.startswith(f"step {{step}} "):
        os.kill(os.getpid(), signal.SIGKILL)
    return answer
ContinuationClient._store = store_then_die
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
"""


def test_a_sigkill_during_the_teacher_calls_resumes_bit_identical_and_asks_nothing_answered_again(teacher, data,
                                                                                                  tmp_path):
    """The uninterrupted run vs one SIGKILLed after the first answer of step 2 (a checkpoint after every step: the
    kill is past step 1's) and resumed: bit-identical weights, the same metrics (but wall times and the teacher's
    usage). At the server (vLLM's /metrics): the resumed run sends exactly the requests the full run sent minus the
    answers the killed run had stored -- none of those again -- and what it re-sends is what was in flight at the
    kill (sent by the killed run, not stored)."""
    import subprocess
    path, flags = PATH["completions"], dict(save_interval=1)
    probe = probe_requests(teacher.teacher, "completions", teacher.teacher_dir)
    before = served_requests(teacher.teacher, path)
    logit_free.main(session_args(teacher, data, tmp_path / "full", "completions", **flags))
    full = metrics(tmp_path / "full")
    needed = sum(m["teacher_requests"] for m in full)
    assert settled_requests(teacher.teacher, path) - before == probe + needed

    killed = tmp_path / "killed"
    before = served_requests(teacher.teacher, path)
    command = [sys.executable, "-c", KILL_DRIVER.format(root=ROOT), "2", SCRIPT,
               *session_args(teacher, data, killed, "completions", **flags)]
    result = subprocess.run(command, env=env_one_thread(), capture_output=True, text=True, timeout=600)
    assert result.returncode == -9, result.stderr[-3000:]
    sent_by_killed = settled_requests(teacher.teacher, path) - before - probe      # but its probe
    stored = cache_records(killed)
    assert checkpoint_step(killed / "run_resume.pt") == 1
    step_2 = [r for r in stored if r["name"].startswith("step 2 ")]
    assert len(step_2) == 1, [r["name"] for r in stored]
    in_flight = sent_by_killed - len(stored)                 # sent and not stored: in flight at the kill
    assert in_flight >= 1, (sent_by_killed, len(stored))

    before = served_requests(teacher.teacher, path)
    logit_free.main(session_args(teacher, data, killed, "completions", **flags, from_resume=1))
    resent_total = settled_requests(teacher.teacher, path) - before - probe
    assert resent_total == needed - len(stored)           # every stored answer read from the cache, never asked
    resent = sent_by_killed + resent_total - needed       # requests the server got twice over the two processes
    assert resent == in_flight <= full[1]["teacher_requests"] - 1     # (the first: the line above, restated)

    resumed = metrics(killed)
    assert [m["step"] for m in resumed] == [1, 2, 3]
    assert sum(m["teacher_requests"] for m in resumed[1:]) == resent_total
    assert resumed[1]["teacher_cached"] == 1 and resumed[1]["teacher_requests"] == full[1]["teacher_requests"] - 1
    assert resumed[2]["teacher_cached"] == 0
    full_weights, resumed_weights = weights(tmp_path / "full"), weights(killed)
    assert all(torch.equal(full_weights[k], resumed_weights[k]) for k in full_weights), "not bit-identical"
    assert without_usage(resumed) == without_usage(full)


# ---------------------------------------------------------------------------------------------------------------------
# a teacher with another tokenizer

def train_bpe(folder: str, vocab_size: int = 4096) -> str:
    """A byte-level BPE (GPT-2's pre-tokenizer, not Qwen3's) trained on the demo data's text and this repository's
    docs (the demo's arithmetic alone gives ~700 merges), with Qwen3's chat template and its special tokens
    <|endoftext|> (padding), <|im_start|>, <|im_end|> (end of turn) as added special tokens: a tokenizer folder our
    QwenTokenizer and vLLM's transformers both load."""
    import glob

    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    from dataset.make_demo_data import ensure_demo_data
    from model.tokenizer import default_tokenizer_dir
    texts = []
    for parquet in ensure_demo_data().values():
        texts += [message["content"] for row in pq.read_table(parquet).to_pylist() for message in row["prompt"]]
    for doc in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]:
        with open(doc, encoding="utf-8") as f:
            texts += f.read().split("\n\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    os.makedirs(folder, exist_ok=True)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(default_tokenizer_dir(), "tokenizer_config.json"), encoding="utf-8") as f:
        template = json.load(f)["chat_template"]
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "add_bos_token": False, "clean_up_tokenization_spaces": False,
                   "model_max_length": 1024, "chat_template": template}, f, indent=1)
    return folder


@pytest.fixture(scope="module")
def bpe_teacher(tmp_path_factory):
    """A random-init untied tiny Qwen3 of the BPE's vocabulary, with counting weights (saved: the server starts
    with them), served by its own vLLM CPU server (--enforce-eager: up in about a minute) for this module ->
    (server, the BPE folder, a student: the session's served student's weights, tied)."""
    from model import Qwen3Config, create_model, load_tokenizer, save_pretrained
    from serving.vllm_launch import stop_vllm
    from vllm_servers import require_vllm, save_tiny, start_server
    require_vllm()
    folder = str(tmp_path_factory.mktemp("bpe_teacher"))
    bpe_dir = train_bpe(os.path.join(folder, "bpe"))
    bpe = load_tokenizer(bpe_dir)
    config = Qwen3Config.from_dict({**SERVED_CONFIG, "vocab_size": len(bpe), "tie_word_embeddings": False,
                                    "bos_token_id": bpe.pad_token_id, "eos_token_id": bpe.eos_token_id})
    torch.manual_seed(3)
    model = create_model(config)
    make_counting(model, bpe)
    model_dir = os.path.join(folder, "model")
    save_pretrained(model, model_dir, tokenizer_dir=bpe_dir)
    student_dir = save_tiny(os.path.join(folder, "student"), seed=1, tied=True)
    server = start_server(folder, model_dir, "teacher", "float32", extra=["--enforce-eager"])
    yield server, bpe_dir, student_dir
    stop_vllm(server.process)


@pytest.mark.vllm
def test_a_teacher_with_another_tokenizer_trains_the_student(bpe_teacher, data, tmp_path):
    """The black box has its own vocabulary (a 4,096-token BPE, not Qwen3's 151,669): the student's partial answers
    (Qwen3 tokens, decoded) are rendered through the BPE folder's template and re-tokenised by the server, and the
    loop trains on the text that comes back. The server tokenises our rendered prompts with the BPE (its prompt
    token counts are the BPE's, not Qwen3's), its chat endpoint agrees with our rendering, and 2 steps of the loop
    (completions form, --teacher_tokenizer_path the BPE folder) log pi_hat in [0, 1] and teacher tokens."""
    from dataset.continuations import ContinuationClient, ContinuationRequest
    from dataset.teacher import SamplingParams
    from model import load_tokenizer
    server, bpe_dir, student_dir = bpe_teacher
    bpe, qwen = load_tokenizer(bpe_dir), load_tokenizer(student_dir)
    assert 1000 < len(bpe) <= 4096 and len(qwen) == 151669
    # the question ends in Chinese, which the BPE (trained on English docs and arithmetic) splits into bytes and
    # Qwen3's vocabulary does not: the two token counts differ by construction, not by what the docs say today
    request = ContinuationRequest([{"role": "user", "content": "What is 47 + 38? Put the final answer in "
                                                               "\\boxed{}. 答案是多少？"}], "First 47 + 30 = 77, then",
                                  max_tokens=6, seed=5, name="by hand")
    params = SamplingParams(temperature=1.0, n=2)
    with ContinuationClient(server.url, "teacher", form="completions", tokenizer_dir=bpe_dir, params=params,
                            api_key_env=None) as completions, \
            ContinuationClient(server.url, "teacher", form="chat", params=params, api_key_env=None) as chat:
        for client in (completions, chat):
            assert client.check_continuation().startswith(" 5,")
        by_completions, by_chat = completions.continue_batch([request]), chat.continue_batch([request])
    prompt = completions.render(request.messages, request.partial)
    assert by_completions.usage.prompt_tokens == by_chat.usage.prompt_tokens == len(bpe.encode(prompt))
    assert len(bpe.encode(prompt)) != len(qwen.encode(prompt))
    assert by_completions.texts == by_chat.texts and all(by_completions.texts[0])

    probe = probe_requests(server, "completions", bpe_dir)
    before = served_requests(server, PATH["completions"])
    logit_free.main(run_args(student_dir, data, tmp_path, "completions", server.url, bpe_dir, steps=2))
    rows = metrics(tmp_path)
    assert_trained(rows, 2)
    assert settled_requests(server, PATH["completions"]) - before == probe + sum(m["teacher_requests"] for m in rows)
    prompt_tokens = [r["usage"]["prompt_tokens"] for r in cache_records(tmp_path)]
    assert sum(prompt_tokens) + sum(r["usage"]["completion_tokens"] for r in cache_records(tmp_path)) == \
        sum(m["teacher_tokens"] for m in rows)
