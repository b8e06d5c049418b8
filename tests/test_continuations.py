# python -m pytest tests/test_continuations.py                  (the fast ones: -m "not slow")
"""The continuation client of logit-free distillation (dataset/continuations.py).

Fast: the template's continue_final_message against transformers' on the real Qwen3 tokenizer files, what the
teacher sees at the thinking block, the cache key, the rank files, and requests / usage / failures / the probe
against a stub HTTP server on 127.0.0.1. Slow: against a real vLLM CPU server (the session fixture `vllm_servers`).
"""
import json
import os
import subprocess
import sys

import pytest

from common.errors import RuntimeFailure, UserError
from dataset.continuations import (DEFAULT_OPTIONS, PROBE_PARTIAL, ContinuationCache, ContinuationClient,
                                   ContinuationRequest, ContinuationUsage, continuation_key, resumes)
from dataset.teacher import SamplingParams
from model.tokenizer import default_tokenizer_dir
from stub_server import Stub, choices_body
from vllm_servers import counting_weights

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONVERSATIONS = {
    "answer": [{"role": "user", "content": "Count to ten."}, {"role": "assistant", "content": "1, 2, 3, 4,"}],
    "system-and-cut-word": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Greet."},
                            {"role": "assistant", "content": "Hello, wor"}],
    "multi-turn": [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "A1"},
                   {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "The answer is "}],
    "closed-thinking": [{"role": "user", "content": "2+2?"},
                        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is"}],
    "empty": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}],
    "trailing-newline": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "line one\n"}],
    "unicode": [{"role": "user", "content": "Grüße?"}, {"role": "assistant", "content": "Grüße zurück — "}],
}


# ---------------------------------------------------------------------------------------------------------------------
# the template

@pytest.mark.parametrize("enable_thinking", [False, True])
def test_continue_final_message_renders_as_transformers_does(qwen, hf_qwen, enable_thinking):
    for name, conversation in CONVERSATIONS.items():
        ours = qwen.apply_chat_template(conversation, continue_final_message=True, enable_thinking=enable_thinking)
        theirs = hf_qwen.apply_chat_template(conversation, tokenize=False, continue_final_message=True,
                                             enable_thinking=enable_thinking)
        assert ours == theirs, name
        assert ours.endswith(conversation[-1]["content"]) and not ours.endswith("<|im_end|>\n"), name
    # spacing around </think> that the template rewrites: the content is not in the rendering, both refuse
    odd = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>hmm</think>It is"}]
    with pytest.raises(ValueError, match="does not appear in the rendered conversation"):
        qwen.apply_chat_template(odd, continue_final_message=True, enable_thinking=enable_thinking)
    with pytest.raises(ValueError):
        hf_qwen.apply_chat_template(odd, tokenize=False, continue_final_message=True, enable_thinking=enable_thinking)
    with pytest.raises(ValueError, match="exclude each other"):
        qwen.apply_chat_template(CONVERSATIONS["answer"], continue_final_message=True, add_generation_prompt=True)


def test_what_the_teacher_sees_at_the_thinking_block(qwen):
    """The docstrings' claims: the teacher's prefix is the student's prompt + partial, character for character, for
    an answer partial with enable_thinking 0 and for a closed canonical thinking block with enable_thinking 1; not
    for an open one (refused), and the answer's leading newlines are dropped by the template."""
    prompt = [{"role": "user", "content": "2+2?"}]

    def student(enable_thinking: bool) -> str:
        return qwen.apply_chat_template(prompt, add_generation_prompt=True, enable_thinking=enable_thinking)

    def teacher(partial: str) -> str:
        return qwen.apply_chat_template([*prompt, {"role": "assistant", "content": partial}],
                                        continue_final_message=True)

    assert student(False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for partial in ("It is", "It is 4", "", "It is\n\n4 "):
        assert teacher(partial) == student(False) + partial           # the same empty thinking block
    closed = "<think>\nadd two and two\n</think>\n\nIt is"
    assert student(True).endswith("<|im_start|>assistant\n") and teacher(closed) == student(True) + closed
    open_thinking = "<think>\nadd two"
    assert teacher(open_thinking) == student(True) + "<think>\n\n</think>\n\n" + open_thinking     # misread
    with pytest.raises(ValueError, match="inside the student's thinking"):
        ContinuationRequest(prompt, open_thinking)
    assert teacher("\n\nIt is") == student(False) + "It is"           # the template's content.lstrip('\n')


def test_requests_are_checked():
    prompt = [{"role": "user", "content": "Q"}]
    with pytest.raises(ValueError, match="end with an assistant message"):
        ContinuationRequest([*prompt, {"role": "assistant", "content": "A"}], "B")
    with pytest.raises(ValueError, match="non-empty list"):
        ContinuationRequest([], "B")
    with pytest.raises(ValueError, match="max_tokens=0"):
        ContinuationRequest(prompt, "B", max_tokens=0)
    ContinuationRequest(prompt, "<think>\nx\n</think>\n\nIt is")                     # a closed block is fine
    with pytest.raises(ValueError, match="inside the student's thinking"):
        ContinuationRequest(prompt, "<think>\nx\n</think>\n\nI wrote <think>")
    with pytest.raises(ValueError, match="completions"):
        ContinuationClient("http://127.0.0.1:9/v1", "m", api_key_env=None)          # no tokenizer_dir
    with pytest.raises(ValueError, match=r"\['seed'\]"):
        ContinuationClient("http://127.0.0.1:9/v1", "m", form="chat", api_key_env=None, options={"seed": 1})
    assert SamplingParams(n=4).to_payload()["n"] == 4
    with pytest.raises(ValueError, match="n=0"):
        SamplingParams(n=0)


# ---------------------------------------------------------------------------------------------------------------------
# the cache

def test_continuation_key_is_stable_across_processes_and_covers_every_part():
    args = ("http://h:8000/v1", "teacher", "chat", {"continue_final_message": True},
            {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]},
            SamplingParams(temperature=1.0, n=4, max_tokens=12, seed=7).to_payload())
    here = continuation_key(*args)
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); from dataset.continuations import continuation_key; "
            "print(continuation_key(*json.loads(sys.argv[2])))")
    there = subprocess.run([sys.executable, "-c", code, ROOT, json.dumps(args)], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": "4242"}).stdout.strip()
    assert here == there and len(here) == 64
    url, model, form, options, prefix, params = args
    changed = [
        (url.replace("8000", "8001"), model, form, options, prefix, params),
        (url, "other", form, options, prefix, params),
        (url, model, "completions", options, prefix, params),
        (url, model, form, {}, prefix, params),
        (url, model, form, options, {"messages": [*prefix["messages"][:1], {"role": "assistant", "content": "A "}]},
         params),
        (url, model, form, options, {"prompt": "Q A"}, params),
        *[(url, model, form, options, prefix, {**params, name: value})
          for name, value in (("seed", 8), ("n", 3), ("max_tokens", 13), ("temperature", 0.9), ("seed", None))],
    ]
    keys = {continuation_key(*c) for c in changed}
    assert len(keys) == len(changed) and here not in keys


def test_every_ranks_file_is_read_and_new_answers_go_to_this_ranks_file(tmp_path):
    stem = str(tmp_path / "opd_teacher_cache")
    for rank in (0, 1):
        cache = ContinuationCache(stem, rank=rank)
        for i in range(3):
            cache.put({"key": f"r{rank}k{i}", "texts": [f"t{rank}{i}a", f"t{rank}{i}b"]})
        cache.close()
    (tmp_path / "opd_teacher_cache.rank1.jsonl.tmp").write_text("not a rank file")
    (tmp_path / "other_teacher_cache.rank0.jsonl").write_text('{"key": "x", "texts": ["y"]}\n')
    rank1 = tmp_path / "opd_teacher_cache.rank1.jsonl"
    lines = rank1.read_text().splitlines()
    rank1.write_text("\n".join([lines[0], lines[1][:25] + "\x00", lines[2]]) + "\n")     # a disk error mid-file

    # one rank now (a resume at another world size): it finds both ranks' answers but the damaged one
    with pytest.warns(RuntimeWarning, match=r"rank1.jsonl:2: skipping 1 damaged cache line"):
        cache = ContinuationCache(stem, rank=0)
    assert len(cache) == 5 and "r1k1" not in cache and "x" not in cache
    assert cache.get("r1k2")["texts"] == ["t12a", "t12b"]
    assert cache.paths == [f"{stem}.rank0.jsonl", str(rank1)]
    before = rank1.read_bytes()
    cache.put({"key": "r1k1", "texts": ["again"]})
    cache.close()
    assert rank1.read_bytes() == before                                   # another rank's file is never written
    assert json.loads((tmp_path / "opd_teacher_cache.rank0.jsonl").read_text().splitlines()[-1])["key"] == "r1k1"

    # a rank's torn last line: that rank cuts it off; the others only skip it
    rank1.write_text("\n".join(lines) + "\n")
    own = tmp_path / "opd_teacher_cache.rank2.jsonl"
    own.write_text('{"key": "r2k0", "texts": ["a"]}\n{"key": "r2k1", "te')
    with pytest.warns(RuntimeWarning, match="rank2.jsonl:2: ignoring a damaged last line.*Its writer cuts it off"):
        assert len(ContinuationCache(stem, rank=0)) == 7
    with pytest.warns(RuntimeWarning, match="It will be cut off before the next append"):
        cache = ContinuationCache(stem, rank=2)
    cache.put({"key": "r2k2", "texts": ["b"]})
    cache.close()
    assert [json.loads(x)["key"] for x in own.read_text().splitlines()] == ["r2k0", "r2k2"]


# ---------------------------------------------------------------------------------------------------------------------
# against a stub server

def echo(path: str, body: dict) -> tuple[int, dict]:
    """n texts naming the request's seed and the choice; usage 10 + 3 per choice."""
    texts = [f"<{body.get('seed')}|{i}>" for i in range(body["n"])]
    return 200, choices_body(path, texts, {"prompt_tokens": 10, "completion_tokens": 3 * body["n"]})


@pytest.fixture
def stub(monkeypatch):
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    servers = []

    def start(respond=echo):
        servers.append(Stub(respond))
        return servers[-1]
    yield start
    for server in servers:
        server.close()


def client_for(url: str, form: str, **kw) -> ContinuationClient:
    options = dict(api_key_env=None, params=SamplingParams(temperature=1.0, n=2, max_tokens=8), max_retries=1,
                   backoff_base=0.01, read_timeout=5.0, concurrency=4)
    if form == "completions":
        options["tokenizer_dir"] = default_tokenizer_dir()
    options.update(kw)
    return ContinuationClient(url, "teacher", form=form, **options)


PROMPTS = [[{"role": "user", "content": f"Question {i}?"}] for i in range(3)]


def batch_requests() -> list[ContinuationRequest]:
    return [ContinuationRequest(PROMPTS[0], "First, ", max_tokens=5, seed=11, name="row 0 chunk 0"),
            ContinuationRequest(PROMPTS[1], "Then", seed=12, name="row 1 chunk 0"),
            ContinuationRequest(PROMPTS[2], "So x = ", max_tokens=6, seed=13, name="row 2 chunk 0"),
            ContinuationRequest(PROMPTS[0], "First, ", max_tokens=5, seed=11, name="row 3 chunk 0")]   # = row 0


@pytest.mark.parametrize("form", ["chat", "completions"])
def test_payloads_usage_and_the_cache_with_a_stub_server(stub, tmp_path, qwen, form):
    server = stub()
    cache = ContinuationCache(str(tmp_path / "run_teacher_cache"), rank=0)
    with client_for(server.url, form, cache=cache) as client:
        batch = client.continue_batch(batch_requests())
    assert batch.texts[0] == ["<11|0>", "<11|1>"] and batch.texts[1] == ["<12|0>", "<12|1>"]
    assert batch.texts[3] == batch.texts[0] and batch.cached == [False, False, False, True]
    assert batch.finish_reasons[2] == ["length", "length"]
    assert batch.usage == ContinuationUsage(requests=3, cached=1, http_requests=3, prompt_tokens=30,
                                            completion_tokens=18)
    assert batch.usage.cost(input_per_million=2.0, output_per_million=10.0) == pytest.approx((60 + 180) / 1e6)

    path, body = sorted(server.posts, key=lambda p: p[1]["seed"])[0]
    assert {k: body[k] for k in ("model", "n", "seed", "max_tokens", "temperature")} == {
        "model": "teacher", "n": 2, "seed": 11, "max_tokens": 5, "temperature": 1.0}
    messages = [*PROMPTS[0], {"role": "assistant", "content": "First, "}]
    if form == "chat":
        assert path == "/v1/chat/completions" and body["messages"] == messages
        assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    else:
        assert path == "/v1/completions" and "messages" not in body and "continue_final_message" not in body
        assert body["prompt"] == qwen.apply_chat_template(messages, continue_final_message=True)
        assert body["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nFirst, ")
    assert next(b for _, b in server.posts if b["seed"] == 12)["max_tokens"] == 8      # the client's default

    # the same requests again, from the cache files alone: nothing sent, nothing counted
    cache.close()
    with client_for(server.url, form, cache=ContinuationCache(str(tmp_path / "run_teacher_cache"), rank=1)) as again:
        repeat = again.continue_batch(batch_requests())
    assert repeat.texts == batch.texts and all(repeat.cached) and len(server.posts) == 3
    assert repeat.usage == ContinuationUsage(requests=0, cached=4)
    assert again.stats.snapshot()["sent"] == 0


def test_a_prefill_api_without_vllms_keys_and_a_response_without_usage(stub):
    server = stub(lambda path, body: (200, choices_body(path, ["go on"] * body["n"])))
    with client_for(server.url, "chat", options={}) as client:
        batch = client.continue_batch(batch_requests()[:1])
    assert batch.texts == [["go on", "go on"]]
    assert set(server.posts[0][1]) == {"model", "messages", "n", "seed", "max_tokens", "temperature", "top_p"}
    assert batch.usage.prompt_tokens == batch.usage.completion_tokens == 0 and batch.usage.requests == 1


def test_split_n_asks_n_times_with_seeds_seed_plus_i(stub):
    server = stub()
    with client_for(server.url, "chat", split_n=True, params=SamplingParams(n=3, max_tokens=4)) as client:
        batch = client.continue_batch(batch_requests()[:2])
    assert batch.texts[0] == ["<11|0>", "<12|0>", "<13|0>"]
    assert sorted(b["seed"] for _, b in server.posts) == [11, 12, 12, 13, 13, 14]
    assert all(b["n"] == 1 for _, b in server.posts)
    assert batch.usage.requests == 2 and batch.usage.http_requests == 6 and batch.usage.completion_tokens == 18


def test_a_failed_request_is_a_runtime_failure_naming_it_and_earlier_answers_are_kept(stub, tmp_path):
    def flaky(path, body):
        if body["seed"] == 12:
            return 500, {"error": {"message": "overloaded"}}
        return echo(path, body)
    server = stub(flaky)
    cache = ContinuationCache(str(tmp_path / "c"), rank=0)
    with client_for(server.url, "chat", cache=cache, concurrency=1) as client:
        with pytest.raises(RuntimeFailure, match=r"\(chat form\) gave no continuation for row 1 chunk 0: .*"
                                                 r"2 attempt\(s\); last: HTTP 500") as info:
            client.continue_batch(batch_requests())
    assert server.url.removesuffix("/v1") in str(info.value) and "\n" not in str(info.value)
    assert "row 0 chunk 0" not in str(info.value) and len(cache) >= 1       # row 0 was answered first, and kept

    few = stub(lambda path, body: (200, choices_body(path, ["only one"])))
    with client_for(few.url, "completions") as client:
        with pytest.raises(RuntimeFailure, match=r"row 0 chunk 0: .*1 choice\(s\) for n=2.*split_n=True"):
            client.continue_batch(batch_requests()[:1])
        odd = ContinuationRequest(PROMPTS[0], "<think>x</think>It is", name="row 5 chunk 2")
        with pytest.raises(RuntimeFailure, match="row 5 chunk 2: the teacher's chat template cannot continue it"):
            client.continue_batch([odd])


def test_an_unreachable_teacher_is_one_runtime_failure(stub):
    server = stub()
    url = server.url
    server.close()
    with client_for(url, "chat") as client:
        with pytest.raises(RuntimeFailure, match="cannot be reached"):
            client.continue_batch(batch_requests()[:1])
        with pytest.raises(RuntimeFailure, match="cannot be reached"):
            client.check_continuation()


def test_the_probe_tells_a_continuation_from_a_new_reply(stub):
    assert resumes(" 5, 6, 7") and resumes("5,6") and resumes(" 5") and resumes("\n5, 6")
    for new_reply in ("1, 2, 3, 4, 5", "Sure! 5, 6, 7", "Here you go: 1, 2", "", "I cannot count", " 6, 7"):
        assert not resumes(new_reply), new_reply

    def reply_with(text):
        return lambda path, body: (200, choices_body(path, [text] * body["n"]))
    good = stub(reply_with(" 5, 6, 7, 8"))
    for form in ("chat", "completions"):
        with client_for(good.url, form) as client:
            assert client.check_continuation() == " 5, 6, 7, 8"
    (_, greedy), (_, sampled) = good.posts[:2]    # chat: greedy n=1 (vLLM refuses greedy n > 1), then n=2 sampled
    assert greedy["messages"][-1] == {"role": "assistant", "content": PROBE_PARTIAL}
    assert greedy["temperature"] == 0.0 and greedy["n"] == 1 and "seed" not in greedy and greedy["max_tokens"] == 8
    assert sampled["temperature"] == 1.0 and sampled["n"] == 2 and sampled["seed"] == 0 and sampled["max_tokens"] == 1
    assert good.posts[2][1]["prompt"].endswith("</think>\n\n" + PROBE_PARTIAL) and len(good.posts) == 4
    with client_for(good.url, "chat", split_n=True) as client:      # n requests of one: the greedy probe only
        client.check_continuation()
    assert len(good.posts) == 5 and good.posts[4][1]["n"] == 1

    bad = stub(reply_with("1, 2, 3, 4, 5, 6, 7"))
    with client_for(bad.url, "chat") as client:
        with pytest.raises(UserError) as info:
            client.check_continuation()
    message = str(info.value)
    assert bad.url.removesuffix("/v1") in message and "(chat form)" in message and "'1, 2, 3, 4, 5, 6, 7'" in message
    assert "Try the completions form" in message and "without assistant prefill is out of scope" in message
    assert "\n" not in message
    with client_for(bad.url, "chat") as client:           # a teacher too weak to count: the requests still checked
        assert client.check_continuation(check_text=False) == "1, 2, 3, 4, 5, 6, 7"

    rejects_keys = stub(lambda path, body: (400, {"error": {"message": "unknown field continue_final_message"}}))
    with client_for(rejects_keys.url, "chat") as client:
        with pytest.raises(UserError, match=r"\(chat form\) could not continue.*HTTP 400.*try the completions form"):
            client.check_continuation()
    one_choice = stub(reply_with(" 5, 6"))
    with client_for(one_choice.url, "chat", params=SamplingParams(n=4)) as client:
        one_choice.respond = lambda path, body: (200, choices_body(path, [" 5, 6"]))
        with pytest.raises(UserError, match="fewer choices than n: pass split_n=True"):
            client.check_continuation()
        with pytest.raises(UserError, match="fewer choices than n"):   # not skipped with the text check
            client.check_continuation(check_text=False)


# ---------------------------------------------------------------------------------------------------------------------
# against a real vLLM CPU server

def teacher_client(servers, form: str, **kw) -> ContinuationClient:
    options = dict(api_key_env=None, tokenizer_dir=servers.teacher_dir, max_retries=2, concurrency=8,
                   params=SamplingParams(temperature=0.0, max_tokens=12))
    options.update(kw)
    return ContinuationClient(servers.teacher.url, "teacher", form=form, **options)


SERVED_REQUESTS = [
    ContinuationRequest([{"role": "user", "content": "What is 2 + 2?"}], "The sum of two and two is", name="a"),
    ContinuationRequest([{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a "
                         "colour."}], "One colour is bl", name="b"),
    ContinuationRequest([{"role": "user", "content": "Q"}], "<think>\nshort\n</think>\n\nSo", name="c"),
]


@pytest.mark.slow
def test_both_forms_continue_and_agree_at_temperature_0(vllm_servers):
    with teacher_client(vllm_servers, "completions") as completions, teacher_client(vllm_servers, "chat") as chat:
        for request in SERVED_REQUESTS:     # what vLLM's chat endpoint builds == the prompt we render, in tokens
            messages = [*request.messages, {"role": "assistant", "content": request.partial}]
            served = chat.post_once("/tokenize", {"model": "teacher", "messages": messages,
                                                  **DEFAULT_OPTIONS["chat"]})["tokens"]
            ours = completions.post_once("/tokenize", {"model": "teacher", "prompt": completions.render(
                request.messages, request.partial), "add_special_tokens": False})["tokens"]
            assert served == ours == completions.tokenizer.encode(completions.render(request.messages,
                                                                                     request.partial))
        by_completions = completions.continue_batch(SERVED_REQUESTS)
        by_chat = chat.continue_batch(SERVED_REQUESTS)
        # spacing around </think> that the template rewrites: refused by our rendering and by vLLM's alike
        odd = ContinuationRequest([{"role": "user", "content": "Q"}], "<think>hmm</think>It is", name="odd one")
        with pytest.raises(RuntimeFailure, match="odd one: the teacher's chat template cannot continue it"):
            completions.continue_batch([odd])
        with pytest.raises(RuntimeFailure, match=r"gave no continuation for odd one: .*HTTP 400"):
            chat.continue_batch([odd])
    assert by_chat.texts == by_completions.texts
    assert all(len(t) == 1 and t[0] for t in by_chat.texts)
    assert by_chat.usage.prompt_tokens == by_completions.usage.prompt_tokens > 0
    assert by_chat.usage.completion_tokens == by_completions.usage.completion_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("form", ["chat", "completions"])
def test_n_seeded_continuations_repeat_and_a_cached_request_sends_nothing(vllm_servers, tmp_path, form):
    params = SamplingParams(temperature=1.0, n=4, max_tokens=10)
    requests = [ContinuationRequest(r.messages, r.partial, seed=1000 + i, name=r.name)
                for i, r in enumerate(SERVED_REQUESTS)]
    cache = ContinuationCache(str(tmp_path / "opd_teacher_cache"), rank=0)
    with teacher_client(vllm_servers, form, params=params, cache=cache) as client:
        first = client.continue_batch(requests)
    cache.close()
    assert [len(t) for t in first.texts] == [4, 4, 4] and first.usage.requests == 3
    assert all(len(set(t)) > 1 for t in first.texts)                  # n samples, not one repeated
    with teacher_client(vllm_servers, form, params=params) as client:
        assert client.continue_batch(requests).texts == first.texts        # no cache: the seed alone repeats them
        other_seed = client.continue_batch([ContinuationRequest(requests[0].messages, requests[0].partial,
                                                                seed=77)])
        assert other_seed.texts[0] != first.texts[0]
    with teacher_client(vllm_servers, form, params=params, split_n=True) as client:
        assert client.continue_batch(requests).texts == first.texts        # n requests, seeds seed + i: the same
    with teacher_client(vllm_servers, form, params=params,
                        cache=ContinuationCache(str(tmp_path / "opd_teacher_cache"), rank=1)) as client:
        cached = client.continue_batch(requests)
        assert client.stats.snapshot()["sent"] == 0
    assert cached.texts == first.texts and cached.usage == ContinuationUsage(requests=0, cached=3)


@pytest.fixture
def counting_teacher(vllm_servers, tmp_path):
    """The teacher server with weights that count (tests/vllm_servers.py's make_counting: greedy decoding maps
    "," -> " ", " " -> "5", "5" -> "," and "\\n" -> "1": a continuation of "1, 2, 3, 4," reads " 5, 5, ...", and a
    new reply (after "<|im_start|>assistant\\n") starts with "1"). The served teacher's own weights are put back
    after."""
    with counting_weights(vllm_servers.teacher, vllm_servers.teacher_dir, "teacher", str(tmp_path)):
        yield vllm_servers


@pytest.mark.slow
def test_the_probe_accepts_vllm_in_both_forms_and_refuses_it_when_it_starts_a_new_reply(counting_teacher):
    for form in ("chat", "completions"):
        with teacher_client(counting_teacher, form) as client:
            assert client.check_continuation().startswith(" 5,")
    # the chat form without vLLM's keys: the partial is taken for a finished turn and a new reply is started
    with teacher_client(counting_teacher, "chat", options={}) as client:
        with pytest.raises(UserError, match=r"\(chat form\) does not continue a partial answer.*'1, 5"):
            client.check_continuation()
    with teacher_client(counting_teacher, "chat") as client:            # the other form, asked by name
        assert client.check_continuation("completions").startswith(" 5,")
