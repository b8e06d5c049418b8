# python -m pytest -q -n 0 tests/test_tool_rollouts.py
"""Multi-turn rollouts with tools (dataset/tool_conversation.py's roll_out, trainer/rollouts/tool_turns.py): the
turns' bookkeeping against a scripted sampler; on a (stub) rollout server each turn asks for the conversation's token
ids, the budget left and the turn's seed, and a conversation kept as the rollout queue keeps it rebuilds its
sequence, labels and log-probabilities exactly (the real server: tests/test_served_tools.py); in the built-in engine
each turn continues the conversation token for token, a row's conversation does not depend on its batch-mates, and
a conversation that ends after one turn is the single-turn rollout; and the mask: in a two-call conversation built
by hand, exactly the student's tokens carry the OPD loss, the teacher's score, the KL and the token counts (float64
references over those positions alone)."""
import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

from dataset.collators import IGNORE_INDEX, PromptCollator
from dataset.sources import RowDataset
from dataset.tool_conversation import Conversation, ToolResponder, roll_out, served_turns, turn_seed
from loop_helpers import assert_one_line_error, loop_args, metrics, script_exit
from model import Qwen3Config, create_model, load_pretrained, load_tokenizer, save_pretrained
from model.generate import Decoder, generate_ids
from support import tool_agent_model
from tools import CALCULATOR, ToolRegistry, run_tool_call
from trainer.losses.chunked import completion_hidden
from trainer.losses.closed_forms import generalized_jsd_loss
from trainer.rollouts import source
from trainer.rollouts.tool_turns import (conversation_sequences, kept_conversation, kept_sample,
                                        sample_conversations)

EOS = 151645


def scripted(turns: dict[tuple[int, int], list[int]], seen: list):
    """A sampler that answers turn t of row r with turns[(r, t)] and records what it was asked."""
    def sample_turn(turn, rows, conversations):
        seen.append((turn, list(rows), [list(c) for c in conversations]))
        return [(turns[(r, turn)], [0.5 * turn] * len(turns[(r, turn)])) for r in rows]
    return sample_turn


def test_roll_out_appends_results_after_calls_and_stops_each_row_for_its_own_reason():
    respond = lambda ids: [7, 7] if 99 in ids else None  # noqa: E731  a turn holding token 99 calls a tool
    turns = {(0, 0): [1, 99, EOS], (0, 1): [2, 99, EOS], (0, 2): [3, EOS],   # two calls, then an answer
             (1, 0): [4, EOS],                                               # no call: done after one turn
             (2, 0): [5, 99, 6],                                             # no EOS (the budget): done
             (3, 0): [99, EOS], (3, 1): [99, EOS], (3, 2): [99, EOS]}        # calls until --max_turns
    seen = []
    out = roll_out(4, scripted(turns, seen), respond, max_new_tokens=64, max_turns=3, eos_token_id=EOS)
    assert [c.ids for c in out] == [[1, 99, EOS, 7, 7, 2, 99, EOS, 7, 7, 3, EOS], [4, EOS], [5, 99, 6],
                                    [99, EOS, 7, 7, 99, EOS, 7, 7, 99, EOS]]
    assert out[0].sampled == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert out[0].logprobs == [0.0] * 3 + [0.5] * 3 + [1.0] * 2  # the sampled tokens' only
    assert [c.turns for c in out] == [3, 1, 1, 3]
    # each turn samples only the rows going on, each from its conversation so far
    assert [(t, rows) for t, rows, _ in seen] == [(0, [0, 1, 2, 3]), (1, [0, 3]), (2, [0, 3])]
    assert seen[1][2] == [[1, 99, EOS, 7, 7], [99, EOS, 7, 7]]


def test_roll_out_keeps_every_conversation_within_its_budget():
    respond = lambda ids: [7, 7, 7]  # noqa: E731
    turns = {(0, 0): [1, EOS], (0, 1): [2, 2, 2, 2, 2, EOS],   # the second turn is cut at the budget
             (1, 0): [1, 1, 1, 1, 1, EOS],                      # its results would pass the budget: done
             (2, 0): [1, 1, 1, 1, EOS]}                         # they would fill it, no token left to a turn: done
    seen = []
    out = roll_out(3, scripted(turns, seen), respond, max_new_tokens=8, max_turns=4, eos_token_id=EOS)
    assert out[0].ids == [1, EOS, 7, 7, 7, 2, 2, 2] and out[0].sampled == [1, 1, 0, 0, 0, 1, 1, 1]
    assert out[1].ids == [1, 1, 1, 1, 1, EOS] and out[1].turns == 1
    assert out[2].ids == [1, 1, 1, 1, EOS] and out[2].turns == 1
    assert [rows for _, rows, _ in seen] == [[0, 1, 2], [0]]  # every row asked for a turn has a token left


# --- on a rollout server: what each turn asks of it (a stub server) and how its conversations are kept ---

CALLER = 99  # a turn holding it calls a tool, answered [7, 7]


def stub_turn(path: str, body: dict) -> tuple[int, dict]:
    """A stub rollout server's turn: a row whose prompt starts with token c calls c % 3 times ([10 + k, CALLER,
    EOS]), then answers [20, EOS]; cut at max_tokens. Each token's log-probability is minus its position in the
    sequence (prompt and conversation so far) / 1000: a wrong order of the log-probabilities shows."""
    prompt = body["prompt"]
    calls = prompt.count(CALLER)
    ids = ([10 + calls, CALLER, EOS] if calls < prompt[0] % 3 else [20, EOS])[:body["max_tokens"]]
    logprobs = [-(len(prompt) + k) / 1000 for k in range(len(ids))]
    return 200, {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": logprobs}}]}


@pytest.fixture
def turn_server(monkeypatch):
    from serving.engine import CompletionServer
    from stub_server import Stub
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    stub = Stub(stub_turn)
    yield stub, CompletionServer(stub.url, "student", what="rollout server")
    stub.close()


SERVED_PROMPTS = [[2, 5, 6], [0, 5], [1, 8, 9, 10]]  # 2 calls (the last turn cut at the budget), none, one


def served_conversations(server, seeds=(11, 12, 13), max_new_tokens=11) -> list[Conversation]:
    respond = lambda ids: [7, 7] if CALLER in ids else None  # noqa: E731
    sample_turn = served_turns(server, SERVED_PROMPTS, list(seeds), max_new_tokens, eos_token_id=EOS, vocab_size=100,
                               model_vocab_size=100)
    return roll_out(len(SERVED_PROMPTS), sample_turn, respond, max_new_tokens, 4, EOS)


def turn_starts(conversation: Conversation) -> list[int]:
    return [k for k, s in enumerate(conversation.sampled) if s and (k == 0 or not conversation.sampled[k - 1])]


def test_each_served_turn_continues_the_conversations_token_ids_with_its_budget_left_and_turn_seed(turn_server):
    stub, server = turn_server
    out = served_conversations(server)
    assert [c.ids for c in out] == [[10, CALLER, EOS, 7, 7, 11, CALLER, EOS, 7, 7, 20], [20, EOS],
                                    [10, CALLER, EOS, 7, 7, 20, EOS]]
    assert [c.turns for c in out] == [3, 1, 2]
    # one request per row and turn: the prompt and the conversation so far as token ids, the budget left, the seed
    expected = sorted((tuple(prompt + c.ids[:start]), 11 - start, turn_seed(seed, t))
                      for prompt, c, seed in zip(SERVED_PROMPTS, out, (11, 12, 13))
                      for t, start in enumerate(turn_starts(c)))
    assert sorted((tuple(b["prompt"]), b["max_tokens"], b["seed"]) for _, b in stub.posts) == expected
    # each sampled token's log-probability, as the server drew it, in order
    assert out[0].logprobs == [-(3 + k) / 1000 for k in (0, 1, 2, 5, 6, 7, 10)]


def test_a_kept_conversation_rebuilds_its_sequence_mask_and_log_probabilities_exactly(turn_server, tmp_path):
    """The rollout queue keeps a served conversation as (ids, log-probabilities, NaN on the tool results) -- the
    single-turn samples' form -- and a checkpoint saves it: the resumed run rebuilds the conversation, its training
    sequence (labels on every sampled token, not cut at the first EOS) and the server's log-probabilities of exactly
    the labelled tokens, in completion_hidden's order."""
    _, server = turn_server
    out = served_conversations(server)
    samples = [kept_sample(c) for c in out]
    assert [math.isnan(x) for x in samples[0][1]] == [not s for s in out[0].sampled]
    torch.save({"rows": samples}, tmp_path / "kept.pt")  # as the resume file holds them
    resumed = torch.load(tmp_path / "kept.pt", weights_only=False)["rows"]
    assert [kept_conversation(sample) for sample in resumed] == out
    batch, tokenizer = left_padded(SERVED_PROMPTS), load_tokenizer(None)
    input_ids, attention_mask, labels = source.served_sequences(batch, resumed, tokenizer, "cpu", tools=True)
    expected = conversation_sequences(SERVED_PROMPTS, out, tokenizer.pad_token_id, "cpu")
    assert all(torch.equal(a, b) for a, b in zip((input_ids, attention_mask, labels), expected))
    assert int((labels != IGNORE_INDEX).sum()) == sum(sum(c.sampled) for c in out) == 7 + 2 + 5
    queue = SimpleNamespace(take=lambda step, batch: (resumed, 0))
    with_tools = SimpleNamespace(queue=queue, responder=object())  # Rollouts' state that `sampler` reads
    logprobs, version = source.Rollouts.sampler(with_tools, batch, 0, labels)
    positions = [(row, p) for row, p in (labels[:, 1:] != IGNORE_INDEX).nonzero().tolist()]
    # the target at label column p + 1 sits at position p + 1 of its row: drawn with log-probability -(p + 1) / 1000
    assert logprobs.tolist() == pytest.approx([-(p + 1) / 1000 for _, p in positions]) and version == 0


def left_padded(prompts: list[list[int]]) -> dict:
    width = max(map(len, prompts))
    return {"prompt_ids": torch.tensor([[0] * (width - len(p)) + p for p in prompts]),
            "prompt_attention_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])}


@pytest.fixture(scope="module")
def agent():
    return tool_agent_model().eval()


@pytest.fixture(scope="module")
def responder():
    registry = ToolRegistry([CALCULATOR])
    return ToolResponder(load_tokenizer(None), lambda call: run_tool_call(registry, call), enable_thinking=False)


def prompt_batch(tokenizer, count: int, start: int = 0) -> dict:
    rows = [{"messages": [{"role": "user", "content": f"What is {i} * 7?" + " Think." * (i % 3)}]}
            for i in range(start, start + count)]
    return PromptCollator(tokenizer, 64, enable_thinking=False)(rows)


def conversations_of(model, batch, seeds, responder, max_new_tokens=96):
    tokenizer = load_tokenizer(None)
    settings = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tokenizer.eos_token_id,
                    vocab_size=len(tokenizer))
    return sample_conversations(model, batch, seeds, responder, max_new_tokens, 4, "cpu", contextlib.nullcontext,
                                Decoder(), tokenizer.pad_token_id, settings)


def rows_of(sequences) -> list[tuple[list[int], list[int]]]:
    input_ids, attention_mask, labels = sequences
    return [(ids[mask.bool()].tolist(), lab[mask.bool()].tolist())
            for ids, mask, lab in zip(input_ids, attention_mask, labels)]


def test_a_conversation_does_not_depend_on_its_batch_mates(agent, responder, one_thread):
    tokenizer = load_tokenizer(None)
    batch = prompt_batch(tokenizer, 6)
    together = rows_of(conversations_of(agent, batch, list(range(100, 106)), responder))
    assert sum(lab.count(IGNORE_INDEX) for _, lab in together) > sum(len(ids) // 2 for ids, _ in together) // 4, \
        "the agent model should have called tools"
    for i in (0, 3, 5):
        alone = {k: v[i:i + 1] for k, v in batch.items()}
        assert rows_of(conversations_of(agent, alone, [100 + i], responder)) == [together[i]]


def test_each_turn_continues_the_conversation_with_its_own_seed(agent, responder, one_thread):
    tokenizer = load_tokenizer(None)
    batch = prompt_batch(tokenizer, 4)
    seeds = [7, 8, 9, 10]
    (ids, labels), = rows_of(conversations_of(agent, {k: v[:1] for k, v in batch.items()}, seeds[:1], responder))
    prompt = batch["prompt_ids"][0][batch["prompt_attention_mask"][0].bool()].tolist()
    # the tokens labelled are those sampled; each turn starts right after a tool result, sampled with turn t's seed
    starts = [k for k in range(len(prompt), len(ids)) if labels[k] != IGNORE_INDEX
              and (k == len(prompt) or labels[k - 1] == IGNORE_INDEX)]
    assert len(starts) >= 2, "the agent model's first row should take two turns or more"
    for turn, start in enumerate(starts):
        end = next((k for k in range(start, len(ids)) if labels[k] == IGNORE_INDEX), len(ids))
        expected = generate_ids(agent, [ids[:start]], 96, tokenizer.pad_token_id,
                                generator=[torch.Generator().manual_seed(turn_seed(seeds[0], turn))],
                                eos_token_id=EOS, vocab_size=len(tokenizer))[0]
        assert ids[start:end] == expected[:end - start]


def test_a_conversation_of_one_turn_is_the_single_turn_rollout(agent, one_thread):
    tokenizer = load_tokenizer(None)
    batch = prompt_batch(tokenizer, 5)
    batch["rows"] = [{"row_index": i} for i in range(5)]

    class Args:
        seed, gen_temperature, top_k, top_p, max_new_tokens = 3, 1.0, 0, 1.0, 24
    never = lambda ids: None  # noqa: E731  no turn calls: every conversation ends after its first turn
    single = source.sample_completions(agent, Args, tokenizer, batch, 0, "cpu", contextlib.nullcontext)
    turns = conversations_of(agent, batch, source.row_seeds(3, batch, 0), never, max_new_tokens=24)
    assert all(torch.equal(a, b) for a, b in zip(single, turns))


# --- the mask: a two-call conversation built by hand, through the loops' own losses ---

@pytest.fixture
def teacher_dir(tiny_config_path, tmp_path):
    save_pretrained(create_model(Qwen3Config.from_json(tiny_config_path), seed=123), str(tmp_path / "teacher"))
    return str(tmp_path / "teacher")


CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call><|im_end|>'


def two_call_conversation(tokenizer, responder) -> Conversation:
    """Call, result, call, result, answer: the student's three turns and the two results between them."""
    conversation = Conversation()
    for turn in (CALL.format("123 * 45"), CALL.format("5535 + 6"), "123 * 45 + 6 = 5541. \\boxed{5541}<|im_end|>"):
        ids = tokenizer.encode(turn)
        conversation.ids += ids
        conversation.sampled += [1] * len(ids)
        results = responder(ids)
        if results is not None:
            conversation.ids += results
            conversation.sampled += [0] * len(results)
    return conversation


@pytest.fixture
def hand_built_rollouts(monkeypatch, responder):
    """Every on-policy micro-batch's rollouts: the two-call conversation after each row's prompt."""
    tokenizer = load_tokenizer(None)
    conversation = two_call_conversation(tokenizer, responder)
    assert tokenizer.decode([t for t, s in zip(conversation.ids, conversation.sampled) if not s]).count(
        "<tool_response>\n5535\n</tool_response>") == 1

    def sequences(self, batch, step, epoch, on_policy, clock):
        prompts = [ids[m.bool()].tolist() for ids, m in zip(batch["prompt_ids"], batch["prompt_attention_mask"])]
        return conversation_sequences(prompts, [conversation] * len(prompts), tokenizer.pad_token_id, "cpu")
    monkeypatch.setattr(source.Rollouts, "sequences", sequences)
    return conversation


def test_the_losses_read_exactly_the_students_tokens_of_a_two_call_conversation(tiny_config_path, responder):
    """completion_hidden is where every loss, teacher score and KL term of the loops takes its positions from
    (frozen_hidden for the frozen models): in a hand-built two-call conversation its targets are exactly the tokens
    the student sampled, in order, and its hidden states those of the positions before them."""
    tokenizer = load_tokenizer(None)
    conversation = two_call_conversation(tokenizer, responder)
    prompts = [tokenizer.encode("<|im_start|>user\nWhat is 123 * 45 + 6?<|im_end|>\n<|im_start|>assistant\n"),
               tokenizer.encode("<|im_start|>user\nAnd this?<|im_end|>\n<|im_start|>assistant\n")]
    input_ids, attention_mask, labels = conversation_sequences(prompts, [conversation] * 2, tokenizer.pad_token_id,
                                                               "cpu")
    model = create_model(Qwen3Config.from_json(tiny_config_path), seed=0).eval()
    with torch.no_grad():
        hidden, targets = completion_hidden(model, input_ids, attention_mask, labels)
        full = model(input_ids, return_hidden=True).hidden_states
    sampled = [t for t, s in zip(conversation.ids, conversation.sampled) if s]
    assert targets.tolist() == sampled * 2
    positions = [(row, len(prompts[row]) + k - 1) for row in range(2) for k, s in enumerate(conversation.sampled) if s]
    assert torch.equal(hidden, torch.stack([full[row, t] for row, t in positions]))


def first_rows(data: str, count: int) -> list[dict]:
    from trainer.skeleton.data_stream import EpochSampler
    dataset = RowDataset(data)
    return [dataset[i] for i in list(EpochSampler(len(dataset), seed=7, epoch=0))[:count]]


def hand_built_batch(data, count, conversation):
    tokenizer = load_tokenizer(None)
    prompts = PromptCollator(tokenizer, 32, enable_thinking=False)(first_rows(data, count))
    prompt_lists = [ids[m.bool()].tolist() for ids, m in zip(prompts["prompt_ids"], prompts["prompt_attention_mask"])]
    return conversation_sequences(prompt_lists, [conversation] * count, tokenizer.pad_token_id, "cpu")


def test_only_the_students_tokens_carry_the_opd_loss_and_the_teachers_score(tiny_config_path, chat_jsonl, teacher_dir,
                                                                             tmp_path, hand_built_rollouts):
    from trainer.train_opd import main as train_opd
    train_opd(loop_args(tiny_config_path, chat_jsonl, tmp_path / "run", batch=2, max_steps=1, beta=0.5,
                        teacher_path=teacher_dir, max_new_tokens=128, max_length=160, tools="calculator",
                        grad_clip=0))
    logged = metrics(tmp_path / "run")[0]
    input_ids, attention_mask, labels = hand_built_batch(chat_jsonl, 2, hand_built_rollouts)
    assert int((labels != IGNORE_INDEX).sum()) == 2 * sum(hand_built_rollouts.sampled) == logged["tokens"]
    # a float64 reference over the labelled positions: the results' tokens are context, never a target
    student = create_model(Qwen3Config.from_json(tiny_config_path), seed=7).double()
    teacher = load_pretrained(teacher_dir).double().eval()
    vocab = len(load_tokenizer(None))
    with torch.no_grad():
        teacher_logits = teacher(input_ids, attention_mask=attention_mask).logits[:, :-1, :vocab]
    student_logits = student(input_ids, attention_mask=attention_mask).logits[:, :-1, :vocab]

    expected = generalized_jsd_loss(student_logits, teacher_logits, labels[:, 1:], beta=0.5)
    expected.backward()
    loss, grad_norm = expected.item(), torch.stack([p.grad.norm() for p in student.parameters()]).norm().item()
    assert logged["loss"] == pytest.approx(loss, rel=1e-5)
    assert logged["grad_norm"] == pytest.approx(grad_norm, rel=1e-3)  # fp32 training, a float64 reference


def test_only_the_students_tokens_carry_the_kl_and_the_opd_term(tiny_config_path, chat_jsonl, teacher_dir, tmp_path,
                                                                 hand_built_rollouts):
    from trainer.train_rl import main as train_rl
    train_rl(loop_args(tiny_config_path, chat_jsonl, tmp_path / "run", batch=1, max_steps=1, num_generations=2,
                       teacher_path=teacher_dir, kl_coef=0.1, opd_coef=0.5, max_new_tokens=128, max_length=160,
                       tools="calculator"))
    logged = metrics(tmp_path / "run")[0]
    input_ids, attention_mask, labels = hand_built_batch(chat_jsonl, 1, hand_built_rollouts)
    student = create_model(Qwen3Config.from_json(tiny_config_path), seed=7).double().eval()
    teacher = load_pretrained(teacher_dir).double().eval()
    targets = labels[:, 1:]
    taken = targets != IGNORE_INDEX

    def logp(model):
        with torch.no_grad():
            logits = model(input_ids, attention_mask=attention_mask).logits[:, :-1, :len(load_tokenizer(None))]
        return logits.log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0][taken]
    student_logp, teacher_logp = logp(student), logp(teacher)
    d = student_logp - student_logp  # the reference is the student's start: k3 = 0 at the first step
    assert logged["kl"] == pytest.approx(float((torch.exp(d) - d - 1).mean()), abs=1e-7)
    assert logged["reverse_kl_estimate"] == pytest.approx(float((student_logp - teacher_logp).mean()), rel=1e-5)
    assert logged["tokens"] == 2 * sum(hand_built_rollouts.sampled)


@pytest.mark.parametrize("script, flags, names", [
    ("rl", {"tools": "calculator,abacus"}, ["--tools", "abacus", "BUILTIN_TOOLS"]),
    ("rl", {"tools": "calculator", "max_turns": 0}, ["--max_turns"]),
    ("rl", {"tools": "calculator", "fsdp": 1}, ["--fsdp 1", "--rollout_url"]),  # its turns run on the server
    ("opd", {"tools": "calculator", "skd_topk": 4}, ["--tools", "--skd_topk"]),
    ("opd", {"tools": "calculator", "self_teacher": "ema", "privileged_template": "{question} {ground_truth}"},
     ["--tools", "--self_teacher"]),
    ("eval", {"tools": "abacus"}, ["--tools", "abacus"]),
    ("eval", {"tools": "calculator", "max_turns": 0}, ["--max_turns"]),
])
def test_what_tools_cannot_go_with_is_refused_in_one_line(tiny_config_path, chat_jsonl, teacher_dir, tmp_path,
                                                          capsys, script, flags, names):
    from eval.eval_math import main as eval_math
    from trainer.train_opd import main as train_opd
    from trainer.train_rl import main as train_rl
    if script == "eval":
        argv = ["--model_path", teacher_dir, "--data_path", chat_jsonl, "--device", "cpu",
                *[item for k, v in flags.items() for item in (f"--{k}", str(v))]]
        main = eval_math
    else:
        teacher = {"teacher_path": teacher_dir} if script == "opd" and "self_teacher" not in flags else {}
        argv = loop_args(tiny_config_path, chat_jsonl, tmp_path / "out", **teacher, **flags)
        main = train_rl if script == "rl" else train_opd
    code, stderr = script_exit(main, argv, capsys)
    assert_one_line_error(code, stderr, 2, *names)
    assert not (tmp_path / "out").exists(), "a refused run leaves nothing behind"


def test_eval_grades_the_conversations_the_loops_roll_out(agent, responder, one_thread):
    """eval_math.py --tools: the same conversations as the loops' rollouts for the same seeds, each graded on the
    model's own tokens (every turn's; the tool results are not its answer)."""
    from eval.eval_math import conversation_batch
    tokenizer = load_tokenizer(None)
    batch = prompt_batch(tokenizer, 4)
    seeds = [5, 6, 7, 8]
    sampling = dict(do_sample=True, temperature=1.0, top_p=1.0, eos_token_id=[EOS], pad_token_id=tokenizer.pad_token_id,
                    vocab_size=len(tokenizer))
    completions = conversation_batch(agent, tokenizer, batch["prompt_ids"], batch["prompt_attention_mask"], 96, seeds,
                                     responder, 4, Decoder(), sampling)
    rolled = rows_of(conversations_of(agent, batch, seeds, responder))
    for completion, (_, labels) in zip(completions, rolled):
        own = [t for t in labels if t != IGNORE_INDEX]
        assert completion.text == tokenizer.decode(own, skip_special_tokens=True)
        assert completion.num_tokens == len(own) and completion.eos == (own[-1] == EOS)


def test_self_distillation_refuses_rows_with_tool_results(tiny_config_path, tmp_path, capsys):
    """Its teacher's view keeps the student's labelled tokens only: a conversation's results would fall out of it."""
    import json
    from trainer.train_opd import main as train_opd
    data = tmp_path / "tools.jsonl"
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 * 3"}}}
    row = {"messages": [{"role": "user", "content": "2 * 3?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": "6"}, {"role": "assistant", "content": "\\boxed{6}"}],
           "ground_truth": "6"}
    data.write_text(json.dumps(row) + "\n")
    argv = loop_args(tiny_config_path, str(data), tmp_path / "out", self_teacher="ema", lmbda=0.5,
                     privileged_template="{question} {ground_truth}")
    code, stderr = script_exit(train_opd, argv, capsys)
    assert_one_line_error(code, stderr, 2, "row 0", "tool results", "--teacher_path")


def test_turns_and_the_share_of_rollouts_that_read_a_result_are_logged(tmp_path, agent, one_thread, capsys):
    """--tools: each step logs the assistant turns per rollout and the share of rollouts that read a tool's result
    (a turn is a run of labelled tokens: results lie between turns), the turns on the console line too."""
    from trainer.rollouts.tool_turns import add_turn_stats
    from trainer.skeleton.distributed import DistInfo
    from trainer.skeleton.window_metrics import WindowMetrics
    from trainer.train_rl import main as train_rl
    window = WindowMetrics("cpu")
    add_turn_stats(window, torch.tensor([[-100, -100, 5, 6, -100, -100, 7, -100], [-100, 3, 4, 5, -100, -100, -100,
                                                                                    -100]]))
    reduced, _ = window.reduce(DistInfo())
    assert reduced["turns"] == 1.5 and reduced["tool_result_share"] == 0.5
    save_pretrained(agent, str(tmp_path / "agent"))
    from support import write_chat_jsonl
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 8)
    train_rl(loop_args(None, data, tmp_path / "run", batch=2, max_steps=2, num_generations=2,
                       model_path=str(tmp_path / "agent"), tools="calculator", max_new_tokens=64))
    logged = metrics(tmp_path / "run")
    assert all(1 <= m["turns"] <= 4 and 0 <= m["tool_result_share"] <= 1 for m in logged)
    assert any(m["tool_result_share"] > 0 for m in logged), "the agent model should have read a result"
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert steps and all(" turns " in line for line in steps), steps


@pytest.mark.slow
def test_the_compiled_decode_step_rolls_out_the_conversations_the_eager_one_does(agent, responder, one_thread,
                                                                                fresh_compile_cache):
    """--decode compiled, the default on CUDA, through inductor on the CPU: every turn a generate call of its own
    width and context length on the one held cache and state (grown when a turn needs more), the same
    conversations as the eager step's (the agent model's peaked distributions: rounding moves no draw)."""
    tokenizer = load_tokenizer(None)
    batch = prompt_batch(tokenizer, 4)
    settings = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tokenizer.eos_token_id,
                    vocab_size=len(tokenizer))
    rolled = [rows_of(sample_conversations(agent, batch, [21, 22, 23, 24], responder, 96, 4, "cpu",
                                           contextlib.nullcontext, decoder, tokenizer.pad_token_id, settings))
              for decoder in (Decoder(), Decoder(compiled=True))]
    assert rolled[0] == rolled[1]
    turns = [sum(1 for k, t in enumerate(labels) if t != IGNORE_INDEX and (k == 0 or labels[k - 1] == IGNORE_INDEX))
             for _, labels in rolled[0]]
    assert max(turns) >= 2, "no row read a tool's result"


@pytest.mark.slow
def test_tool_rollouts_train_under_bf16_autocast(tmp_path, agent, one_thread):
    """The GPU recipe's precision on the CPU's own autocast (--dtype bfloat16: fp32 masters, bf16 compute): OPD with
    the calculator rolls out its conversations under the run's autocast and trains on the student's tokens."""
    from support import write_chat_jsonl
    from trainer.train_opd import main as train_opd
    save_pretrained(agent, str(tmp_path / "agent"))
    save_pretrained(tool_agent_model(seed=5), str(tmp_path / "teacher"))  # another agent: a divergence to learn
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 8)
    train_opd(loop_args(None, data, tmp_path / "run", batch=2, max_steps=2, model_path=str(tmp_path / "agent"),
                        teacher_path=str(tmp_path / "teacher"), tools="calculator", max_new_tokens=64,
                        dtype="bfloat16"))
    logged = metrics(tmp_path / "run")
    assert len(logged) == 2 and all(m["tokens"] > 0 and 0 < m["loss"] < 1e3 for m in logged)
    assert all(m["turns"] >= 1 for m in logged) and any(m["tool_result_share"] > 0 for m in logged)
