# python -m pytest tests/test_rule_teacher.py
"""benchmarks/rule_teacher.py, the demo's rule-based black-box teacher: it continues every prefix of a demo solution
to that solution and a partial that went wrong in the demo's format (as its docstring says); it answers both request
forms alike through the project's own client and answer cache (dataset/continuations.py), the start-up probe
included; the logit-free loop trains against it with its continuations as the teacher's answers; and a SIGKILLed
run, resumed, asks it nothing it had asked before."""
import json
import math
import os
import random
import signal
import subprocess
import sys

import httpx
import pytest

import trainer.train_logit_free as logit_free
from benchmarks.rule_teacher import BadRequest, RuleTeacher, continue_solution, correct_solution
from common.errors import RuntimeFailure
from dataset.continuations import ContinuationCache, ContinuationClient, ContinuationRequest
from dataset.make_demo_data import build_splits, make_row, numbers_of, question as demo_question, solve
from dataset.teacher import SamplingParams
from loop_helpers import assert_one_line_error, checkpoint_step, env_one_thread, loop_args, metrics
from model.tokenizer import default_tokenizer_dir
from support import ROOT
from trainer.logit_free.agreement import agreement

SCRIPT = os.path.join(ROOT, "trainer", "train_logit_free.py")
DRIVER = os.path.join(ROOT, "tests", "kill_driver.py")
SERVE = os.path.join(ROOT, "benchmarks", "rule_teacher.py")
METHOD = {"max_new_tokens": 8, "chunk_len": 3, "audit_chunks": 2, "continuations": 3, "anchor_beta": 0.5,
          "max_prompt_length": 48}
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
# what may stand before the answer in a partial: nothing, the empty thinking block, a student's thoughts
LEADS = ("", "<think>\n\n</think>\n\n", "<think>\nadd the columns\n</think>\n\n")


@pytest.fixture(scope="module")
def server():
    """One rule teacher for the module (loading the tokenizer takes seconds), reached without a proxy."""
    with pytest.MonkeyPatch.context() as patch:
        for name in PROXY_VARIABLES:
            patch.delenv(name, raising=False)
        with RuleTeacher() as teacher:
            yield teacher


@pytest.fixture
def teacher(server):
    server.posts.clear()
    return server


def question(*numbers: int) -> str:
    return demo_question(numbers)


def demo_problems(count: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    pool = [(a, b) for a in range(10, 100) for b in range(a, 100)]  # the addition task's unordered pairs
    return [(a, b) if rng.random() < 0.5 else (b, a) for a, b in rng.sample(pool, count)]


def continuation_posts(teacher) -> list[dict]:
    """The requests the teacher answered, but for the start-up probes."""
    return [body for _, body in teacher.posts if "1, 2, 3, 4," not in json.dumps(body)]


def cut(teacher, text: str, max_tokens: int | None) -> str:
    """`text` as a request of `max_tokens` tokens gets it."""
    return text if max_tokens is None else teacher.tokenizer.decode(teacher.tokenizer.encode(text)[:max_tokens])


# ------------------------------------------------------------------------------------------------------ the solver

def test_every_prefix_of_a_solution_continues_to_the_solution():
    problems = demo_problems(200)
    kinds = {(a % 10 + b % 10 >= 10, a + b >= 100) for a, b in problems}
    assert kinds == {(False, False), (False, True), (True, False), (True, True)}  # carry or not, 2 or 3 digits
    for a, b in problems:
        solution = solve(a, b)[1]
        assert correct_solution(question(a, b)) == solution
        for lead in LEADS:
            for k in range(len(solution) + 1):
                assert solution[:k] + continue_solution(question(a, b), lead + solution[:k]) == solution


@pytest.mark.parametrize("a, b, partial, continuation", [
    (47, 38, "7+8=14", ", 4+3+1=8. \\boxed{85}"),
    (47, 38, "7+8=14,", " 4+3+1=8. \\boxed{85}"),
    (47, 38, "7+8=15, 5", "+3+1=8. \\boxed{85}"),
    (47, 38, "7+8=15, 4+3=", ". \\boxed{85}"),
    (25, 22, "5+2=7, 2+2+1=", ". \\boxed{47}"),
    (25, 22, "5+2=17", ", 2+2=4. \\boxed{47}"),
    (47, 38, "7+8=15, 4+3+1=8. \\boxed{84", "}"),
    (99, 99, "9+9=18, 9+9+1=19. \\boxed{188", "}"),
    (47, 38, "7+8=15, 4+3+1=8. \\boxed{845", ""),
    (47, 38, "7+8=14, 4+3+1=8. \\boxed{", "85}"),
    (47, 38, "7+8=15, 4+3+1=8. \\boxed{85}. ", ""),
    (47, 38, "The answer", ", 4+3+1=8. \\boxed{85}"),
], ids=["wrong-ones-sum", "wrong-ones-sum-comma", "wrong-tens-digit", "missing-carry", "carry-where-none",
        "two-digit-ones-sum", "wrong-boxed-digit", "wrong-boxed-digit-3", "boxed-too-long", "earlier-step-wrong",
        "past-the-end", "other-text"])
def test_a_partial_that_went_wrong_is_continued_in_the_format(a, b, partial, continuation):
    """The docstring's rule: the same format so far (digits aside) -> the correct segment from the offset, then the
    rest; another format -> the segment's separator and the correct segments after it."""
    for lead in LEADS:
        assert continue_solution(question(a, b), lead + partial) == continuation


def test_every_prefix_of_a_running_sum_continues_to_its_solution():
    """The long task's answers (dataset/make_demo_data.py, running_sum): the same segment rule, one segment a step;
    a wrong total is kept and the later steps are the correct solution's."""
    for row in build_splits("running_sum")["eval"][:40]:
        numbers = numbers_of(row["prompt"][0]["content"])
        solution = solve(*numbers)[1]
        assert correct_solution(question(*numbers)) == solution
        for k in range(len(solution) + 1):
            assert solution[:k] + continue_solution(question(*numbers), LEADS[0] + solution[:k]) == solution
    assert continue_solution(question(37, 8, 5, 9), "a+b=37+8=46") == ", 45+c=45+5=50, 50+d=50+9=59. \\boxed{59}"
    assert continue_solution(question(37, 8, 5, 9), "a+b=37+8=45, 45+c=45+6") == "=50, 50+d=50+9=59. \\boxed{59}"
    assert continue_solution(question(37, 8, 5, 9), "a+b=37+8=45, 45+c=45+5=50, 50+d=50+9=59. \\boxed{5") == "9}"


def test_a_question_it_cannot_parse_is_refused():
    assert correct_solution("Count from 1 to 5, separated by commas.") == "1, 2, 3, 4, 5"
    with pytest.raises(BadRequest, match="cannot parse"):
        continue_solution("What is the capital of France?", "Paris")


# ------------------------------------------------------------------------------------------- over HTTP, the client

def client(teacher, form: str, cache_stem, n: int = 3, **kwargs) -> ContinuationClient:
    tokenizer_dir = default_tokenizer_dir() if form == "completions" else None
    return ContinuationClient(teacher.url, "teacher", form=form, tokenizer_dir=tokenizer_dir,
                              params=SamplingParams(temperature=1.0, n=n), cache=ContinuationCache(str(cache_stem)),
                              api_key_env=None, **kwargs)


@pytest.mark.parametrize("form, options", [("chat", None), ("chat", {}), ("completions", None)],
                         ids=["chat", "chat-prefill", "completions"])
def test_each_request_form_gets_the_continuation_through_the_client_and_its_cache(teacher, tmp_path, form, options):
    """The start-up probe (continue "1, 2, 3, 4,") passes; every (question, partial) gets n copies of
    continue_solution's text, cut to max_tokens tokens; usage counts tokens; a new client on the same cache (a
    resumed run's) answers all from the cache and sends nothing."""
    requests, expected = [], []
    for i, (a, b) in enumerate(demo_problems(12, seed=1)):
        solution = solve(a, b)[1]
        for partial, max_tokens in ((solution[:i], None), (solution[:i], 4), ("7+8=1" + solution[6:i], 5)):
            requests.append(ContinuationRequest([{"role": "user", "content": question(a, b)}], partial,
                                                max_tokens=max_tokens, seed=len(requests)))
            expected.append(cut(teacher, continue_solution(question(a, b), partial), max_tokens))
    first = client(teacher, form, tmp_path / "cache", options=options)
    assert first.check_continuation().startswith(" 5, 6")
    batch = first.continue_batch(requests)
    assert batch.texts == [[text] * 3 for text in expected]
    assert {reason for reasons in batch.finish_reasons for reason in reasons} == {"stop", "length"}
    assert batch.usage.requests == len(requests) == len(continuation_posts(teacher))
    assert batch.usage.prompt_tokens >= 30 * len(requests) and batch.usage.completion_tokens > 0
    first.close()
    sent = len(teacher.posts)
    again = client(teacher, form, tmp_path / "cache", options=options).continue_batch(requests)
    assert again.texts == batch.texts and again.usage.cached == len(requests) and len(teacher.posts) == sent


def test_both_forms_agree_with_and_without_the_thinking_block(teacher, tmp_path):
    """One (question, partial), the chat form's partial with and without a thinking block, the completions form's
    prompt rendered with enable_thinking on and off: the same continuation."""
    requests = [ContinuationRequest([{"role": "user", "content": question(47, 38)}], lead + "7+8=1") for lead in LEADS]
    texts = set()
    for form, thinking in (("chat", False), ("completions", False), ("completions", True)):
        asked = client(teacher, form, tmp_path / f"{form}{thinking}", n=2,
                       template_kwargs={"enable_thinking": thinking})
        texts.update(text for choices in asked.continue_batch(requests).texts for text in choices)
    assert texts == {"5, 4+3+1=8. \\boxed{85}"}


@pytest.mark.slow
def test_the_script_serves_until_sigterm_and_refuses_a_taken_port(teacher):
    """`python benchmarks/rule_teacher.py --port 0`: one line with its URL when ready, answers there, exits 0 on
    SIGTERM; on a port in use (the in-process teacher's), one error line and exit code 2."""
    taken = teacher.url.split(":")[2].split("/")[0]
    refused = subprocess.run([sys.executable, SERVE, "--port", taken], env=env_one_thread(), capture_output=True,
                             text=True, timeout=120)
    assert_one_line_error(refused.returncode, refused.stderr, 2, f"127.0.0.1:{taken}", "--port")
    process = subprocess.Popen([sys.executable, SERVE, "--port", "0"], env=env_one_thread(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().split(" on ")[1].split()[0]
        assert httpx.get(url + "/models").json()["data"][0]["id"] == "teacher"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_what_it_refuses_and_what_it_lists(teacher, tmp_path):
    v1 = teacher.url
    bad = {"model": "teacher", "messages": [{"role": "user", "content": "Name a colour."}]}
    for path, body in (("/chat/completions", bad), ("/completions", {"prompt": "What is 1 + 2?"}),
                       ("/chat/completions", {**bad, "messages": []}),
                       ("/completions", {"prompt": "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
                                                   "<|im_start|>assistant\n", "n": 0})):
        response = httpx.post(v1 + path, json=body)
        assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error", body
    assert httpx.post(v1 + "/chat/completions", content=b"{").status_code == 400
    assert httpx.post(v1 + "/embeddings", json=bad).status_code == 404
    assert httpx.get(v1 + "/models").json()["data"][0]["id"] == "teacher"
    assert httpx.get(v1.removesuffix("/v1") + "/health").status_code == 200
    with pytest.raises(RuntimeFailure, match="HTTP 400.*cannot parse"):
        client(teacher, "chat", tmp_path / "cache").continue_batch(
            [ContinuationRequest([bad["messages"][0]], "Red", name="the colour")])


def test_a_chunk_that_is_the_correct_text_agrees_fully(teacher, tmp_path):
    """The loop's agreement k of a student chunk that is literally the solution's next text is N (phi = 1); a wrong
    digit in it costs agreement."""
    chunk_len, n = 8, 4
    requests, chunks = [], []
    for a, b in demo_problems(10, seed=2):
        ids = teacher.tokenizer.encode(solve(a, b)[1])
        for anchor in range(0, len(ids) - chunk_len + 1, 3):
            requests.append(ContinuationRequest([{"role": "user", "content": question(a, b)}],
                                                teacher.tokenizer.decode(ids[:anchor]),
                                                max_tokens=math.ceil(1.5 * chunk_len)))
            chunks.append(teacher.tokenizer.decode(ids[anchor:anchor + chunk_len]))
    answers = client(teacher, "chat", tmp_path / "cache", n=n).continue_batch(requests).texts
    for chunk, continuations in zip(chunks, answers):
        assert agreement(chunk, continuations) == n
        wrong = chunk.replace(next(c for c in chunk if c.isdigit()), "x", 1)
        assert agreement(wrong, continuations) < n


# ----------------------------------------------------------------------------------------------- the logit-free loop

def demo_rows(path, count: int) -> str:
    """`count` demo prompts (the opd_prompts rows' schema) as a JSONL file."""
    with open(path, "w", encoding="utf-8") as f:
        for i, (a, b) in enumerate(demo_problems(count, seed=3)):
            f.write(json.dumps(make_row(i, "opd_prompts", (a, b), with_solution=False)) + "\n")
    return str(path)


def test_the_logit_free_loop_trains_on_its_continuations(teacher, tiny_config_path, tmp_path, monkeypatch,
                                                         one_thread):
    """Two steps with the default --teacher_form chat and --teacher_probe count: the teacher is asked, pi_hat and
    phi are in [0, 1], and every audited chunk's continuations, as the loop compares them, are the rule's
    continuation of that chunk's partial (cut to the loop's ceil(1.5 C) tokens)."""
    asked, compared = [], []
    audit_requests, real_agreement = logit_free.audit_requests, logit_free.agreement

    def audit_spy(*args):
        chunks, requests, texts = audit_requests(*args)
        asked.extend(requests)
        return chunks, requests, texts

    def agreement_spy(text, continuations, kind):
        compared.append(list(continuations))
        return real_agreement(text, continuations, kind)
    monkeypatch.setattr(logit_free, "audit_requests", audit_spy)
    monkeypatch.setattr(logit_free, "agreement", agreement_spy)
    logit_free.main(loop_args(tiny_config_path, demo_rows(tmp_path / "demo.jsonl", 8), tmp_path, **METHOD,
                              teacher_url=teacher.url, max_steps=2))
    rows = metrics(tmp_path)
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        assert 0.0 <= m["pi_hat"] <= 1.0 and 0.0 <= m["phi"] <= 1.0 and math.isfinite(m["loss"])
        assert m["grad_norm"] > 0 and m["teacher_requests"] > 0 and m["teacher_tokens"] > 0
    assert sum(m["teacher_requests"] for m in rows) == len(continuation_posts(teacher)) == len(asked)
    max_tokens = math.ceil(1.5 * METHOD["chunk_len"])
    assert compared == [[cut(teacher, continue_solution(r.messages[-1]["content"], r.partial), max_tokens)] *
                        METHOD["continuations"] for r in asked]


@pytest.mark.slow
def test_a_killed_run_resumes_asking_the_teacher_nothing_it_asked_before(teacher, tiny_config_path, tmp_path,
                                                                           one_thread):
    """SIGKILL in step 3's last backward (tests/kill_driver.py: every answer of the step is in the cache by then),
    the last checkpoint step 2's; the resume redoes step 3 from the cache and asks only step 4's chunks: no request
    after the resume repeats one before it (the start-up probes aside: they are never cached)."""
    flags = dict(**METHOD, teacher_url=teacher.url, batch=2, accumulation=2, save_interval=2, max_steps=4)
    argv = loop_args(tiny_config_path, demo_rows(tmp_path / "demo.jsonl", 16), tmp_path, **flags)
    killed = subprocess.run([sys.executable, DRIVER, SCRIPT, "backward", "6", *argv], env=env_one_thread(),
                            capture_output=True, text=True, timeout=400)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert checkpoint_step(tmp_path / "run_resume.pt") == 2
    before = {json.dumps(body, sort_keys=True) for body in continuation_posts(teacher)}
    teacher.posts.clear()
    logit_free.main(loop_args(tiny_config_path, str(tmp_path / "demo.jsonl"), tmp_path, **flags, from_resume=1))
    after = [json.dumps(body, sort_keys=True) for body in continuation_posts(teacher)]
    steps = {m["step"]: m for m in metrics(tmp_path)}
    assert steps[3]["teacher_requests"] == 0 and steps[3]["teacher_cached"] > 0, steps[3]
    assert after and len(after) == steps[4]["teacher_requests"]
    assert not before & set(after), "the resumed run asked again what the killed one had asked"
