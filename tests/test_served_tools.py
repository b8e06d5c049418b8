# python -m pytest -q -n 0 tests/test_served_tools.py
"""Multi-turn rollouts with tools on a real vLLM CPU server (--rollout_url with --tools): each turn continues the
conversation's token ids on the server, so greedy conversations are the built-in engine's token for token (and
eval_math.py's --server_url --tools answers the built-in engine's); RL on served conversations of a tiny agent model
(tests/support.py) trains with accumulation as with one batch, a SIGKILL with conversations sampled ahead resumes
bit for bit from the ones the checkpoint kept, and 2 sharded ranks (--fsdp 1) train as one process does. Both
models are untied, so they are pushed into the session's teacher server (tests/vllm_servers.py), whose own weights
are pushed back after each test. The requests themselves, against a stub server: tests/test_tool_rollouts.py."""
import math
import os
import signal
import subprocess
import sys

import pytest
import torch

from dataset.collators import PromptCollator
from dataset.tool_conversation import ToolResponder, engine_turns, roll_out, served_turns
from loop_helpers import (assert_bit_identical_runs, env_one_thread, loop_args, max_weight_diff, metrics, run_command,
                          torchrun_command, weights)
from model import load_pretrained, load_tokenizer, save_pretrained
from rl_length_reward import main as train_rl_varied
from serving.engine import CompletionServer
from support import ROOT, SERVED_CONFIG, tool_agent_model, write_chat_jsonl
from tools import answerer
from trainer.rollouts import source
from vllm_servers import TOKENIZER_SIZE, counting_weights, weights_restored

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
RL = os.path.join(ROOT, "tests", "rl_length_reward.py")
DRIVER = os.path.join(ROOT, "tests", "kill_driver.py")
EOS = 151645

# greedy: after a generation prompt ("\n\n", with thinking off) a call, `<tool_call>1<|im_end|>` (malformed: answered
# with an error text, then the next generation prompt: the same again); after "2" an answer without a call
CALLING_BIGRAMS = {"\n\n": "<tool_call>", "<tool_call>": "1", "1": "<|im_end|>", "2": "<|im_end|>"}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def responder(tokenizer):
    return ToolResponder(tokenizer, answerer(["calculator"]), enable_thinking=False)


@pytest.fixture
def calling(vllm_servers, tmp_path):
    """The teacher server holding a model that calls in bigrams (vllm_servers.py's make_counting, CALLING_BIGRAMS),
    and the same model here."""
    from vllm_servers import make_counting
    with counting_weights(vllm_servers.teacher, vllm_servers.teacher_dir, "teacher", str(tmp_path),
                          CALLING_BIGRAMS) as server:
        model = load_pretrained(vllm_servers.teacher_dir)
        make_counting(model, load_tokenizer(vllm_servers.teacher_dir), CALLING_BIGRAMS)
        client = CompletionServer(server.url, "teacher", what="rollout server")
        yield model.eval(), client
        client.close()


def test_greedy_conversations_on_the_server_are_the_built_in_engines_token_for_token(calling, tokenizer, responder):
    """Rows that call until the budget cuts their third turn, and rows that answer at once, in one batch: the server
    continues each row's token ids turn by turn (for its budget left) exactly as the engine does."""
    model, server = calling
    collator = PromptCollator(tokenizer, 64, enable_thinking=False)
    batch = collator([{"messages": [{"role": "user", "content": f"What is {i} * 7?" + " Think." * i}]}
                      for i in range(4)])
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(batch["prompt_ids"], batch["prompt_attention_mask"])]
    prompts[1] += tokenizer.encode("2")  # this row answers at once
    call = tokenizer.encode("<tool_call>1<|im_end|>")
    max_new_tokens = 2 * (len(call) + len(responder(call))) + 2  # two calls answered, the third cut after 2 tokens
    options = dict(do_sample=False, eos_token_id=EOS, vocab_size=len(tokenizer))
    ours = roll_out(4, engine_turns(model, prompts, None, max_new_tokens, tokenizer.pad_token_id, **options),
                    responder, max_new_tokens, 4, EOS)
    served = roll_out(4, served_turns(server, prompts, None, max_new_tokens, model_vocab_size=TOKENIZER_SIZE,
                                      **options), responder, max_new_tokens, 4, EOS)
    assert [(c.ids, c.sampled, c.turns) for c in served] == [(c.ids, c.sampled, c.turns) for c in ours]
    assert [c.turns for c in ours] == [3, 1, 3, 3]
    assert ours[0].ids[-2:] == call[:2] and len(ours[0].ids) == max_new_tokens and ours[1].ids == [EOS]
    assert all(len(c.logprobs) == sum(c.sampled) for c in served)

    from eval.eval_math import conversation_batch  # eval_math.py --server_url --tools: the same answers
    prompt_ids, prompt_mask = batch["prompt_ids"], batch["prompt_attention_mask"]
    sampling = dict(do_sample=False, temperature=1.0, top_p=1.0, eos_token_id=[EOS],
                    pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer))
    answers = [conversation_batch(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, None, responder, 4, None,
                                  sampling, server=s) for s in (None, server)]
    assert answers[0] == answers[1] and answers[0][0].num_tokens == sum(ours[0].sampled)


# --- RL on served conversations of the agent model ---

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The agent model in the teacher server's shape (untied, a head of the tokenizer's rows) and 16 prompts."""
    folder = tmp_path_factory.mktemp("served_tools")
    save_pretrained(tool_agent_model(config={**SERVED_CONFIG, "vocab_size": TOKENIZER_SIZE}), str(folder / "agent"))
    return {"agent": str(folder / "agent"), "data": write_chat_jsonl(folder / "chat.jsonl", 16)}


@pytest.fixture
def agent_server(vllm_servers, tmp_path):
    """The teacher server samples the runs' conversations (each run pushes its weights); its own come back after."""
    with weights_restored(vllm_servers.teacher, vllm_servers.teacher_dir, "teacher", str(tmp_path)):
        yield vllm_servers.teacher


def rl_args(files, server, save_dir, batch=2, **flags) -> list[str]:
    """Groups of 3 conversations of up to 3 turns (a tool result is about 40 tokens: up to two fit in the budget)."""
    return loop_args(None, files["data"], save_dir, batch=batch, model_path=files["agent"], rollout_url=server.url,
                     rollout_model="teacher", tools="calculator", max_turns=3, num_generations=3, max_new_tokens=96,
                     max_length=128, **flags)


def test_served_conversations_accumulation_equals_one_batch(files, agent_server, tmp_path, monkeypatch):
    """2 micro-batches of 2 prompts x 3 land on one batch of 4 x 3 (every conversation seeded per row, generation
    and turn); the server's log-probabilities of the sampled tokens, over every turn, are the trainer's to rounding
    (the sampler gap: on-policy, the weights pushed and verified before each step)."""
    turns = []

    def recorded(*args, **kwargs):
        conversations = roll_out(*args, **kwargs)
        turns.extend(c.turns for c in conversations)
        return conversations
    monkeypatch.setattr(source, "roll_out", recorded)
    flags = dict(max_steps=2, kl_coef=0.1)
    train_rl_varied(rl_args(files, agent_server, tmp_path / "big", batch=4, **flags))
    train_rl_varied(rl_args(files, agent_server, tmp_path / "acc", batch=2, accumulation=2, **flags))
    assert len(turns) == 2 * 2 * 12 and max(turns) >= 2 and min(turns) == 1, turns
    big, acc = metrics(tmp_path / "big"), metrics(tmp_path / "acc")
    assert [m["tokens"] for m in big] == [m["tokens"] for m in acc]
    assert [m["reward"] for m in big] == [m["reward"] for m in acc]
    assert max_weight_diff(weights(tmp_path / "big"), weights(tmp_path / "acc")) <= 1e-5
    assert all(m["sampler_logp_gap_max"] < 1e-3 and m["sync_logprob_diff"] < 1e-4 for m in big), big


def test_a_sigkill_with_conversations_sampled_ahead_resumes_bit_for_bit(files, agent_server, tmp_path):
    """--max_staleness 1, a checkpoint every 2 steps: killed while training step 3 (step 4's conversations in flight),
    the resume file keeps step 3's, sampled from the weights of step 2 -- token ids and log-probabilities, NaN on the
    tool results -- and the resumed run trains on them as the uninterrupted run did (TIS weights read the server's
    log-probabilities of exactly the labelled tokens)."""
    flags = dict(batch=4, max_staleness=1, max_steps=4, save_interval=2, rollout_correction="tis")
    train_rl_varied(rl_args(files, agent_server, tmp_path / "reference", **flags))
    args = rl_args(files, agent_server, tmp_path / "killed", **flags)
    killed = subprocess.run([sys.executable, DRIVER, RL, "backward", "3", *args], env=env_one_thread(),
                            capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    saved = torch.load(tmp_path / "killed" / "run_resume.pt", weights_only=False)
    assert saved["step"] == 2 and list(saved["rollouts"]) == [2] and saved["rollouts"][2]["version"] == 1
    rows = list(saved["rollouts"][2]["rows"].values())
    assert len(rows) == 12 and all(len(ids) == len(logprobs) for ids, logprobs in rows)
    assert any(math.isnan(x) for _, logprobs in rows for x in logprobs), "some conversation should hold a result"
    train_rl_varied(rl_args(files, agent_server, tmp_path / "killed", **flags, from_resume=1))
    assert_bit_identical_runs(tmp_path / "reference", tmp_path / "killed")


@pytest.mark.serial
def test_a_sharded_student_rolls_out_conversations_on_the_server(files, agent_server, tmp_path):
    """A sharded student (--fsdp 1) samples on a rollout server, which runs every turn (the student never decodes):
    2 sharded ranks, each rolling out its own rows' conversations in its queue's thread, train as one process with
    2 micro-batches does."""
    flags = dict(max_steps=2, kl_coef=0.1)
    train_rl_varied(rl_args(files, agent_server, tmp_path / "one", accumulation=2, **flags))
    run_command(torchrun_command(RL, rl_args(files, agent_server, tmp_path / "two", fsdp=1, **flags)))
    assert max_weight_diff(weights(tmp_path / "one"), weights(tmp_path / "two")) <= 1e-5
    assert [m["tokens"] for m in metrics(tmp_path / "one")] == [m["tokens"] for m in metrics(tmp_path / "two")]
