# python -m pytest -q -n 0 tests/test_tool_sft.py
"""SFT on conversations with tool results (dataset/collators.py): such a row is collated in the token order a
multi-turn rollout produces (dataset/tool_conversation.py) with labels on every assistant turn and nowhere else,
checked against transformers' rendering of the pieces; the budgets cut it as they cut any row; rows without tool
results collate bit for bit as before; a conversation that cannot be put in rollout order is refused at start-up in
one line naming the file and the row; and a real SFT run on the demo's tool conversations trains every assistant
token and its loss falls."""
import json

import pytest
import torch

from dataset.collators import (IGNORE_INDEX, PairCollator, RowError, SFTCollator, _keep_end, _pad,
                               in_rollout_order, validate_rows)
from dataset.make_demo_data import build_splits
from dataset.sources import DataError, PairDataset, RowDataset
from dataset.tool_conversation import conversation_ids, results_text
from loop_helpers import loop_args, metrics
from test_tool_template import CALL_ONLY, CONVERSATIONS, RESULT, TOOLS, USER, hf_ids
from trainer.skeleton.data_stream import EpochSampler
from trainer.train_sft import main as train_sft

WITH_RESULTS = [name for name, messages in CONVERSATIONS.items() if in_rollout_order(messages)]


def hf_pieces(hf_qwen, messages: list[dict], thinking: bool) -> list[tuple[str, bool]]:
    """The conversation in rollout order as (text, is it an assistant turn), each piece from transformers' own
    rendering: the prompt with the generation prompt, each assistant turn as the template renders it last (without
    the newline after its <|im_end|>), the results before it and the next generation prompt."""
    options = {"tools": TOOLS, "tokenize": False, "enable_thinking": thinking}
    first = next(k for k, m in enumerate(messages) if m["role"] == "assistant")
    pieces = [(hf_qwen.apply_chat_template(messages[:first], add_generation_prompt=True, **options), False)]
    pending = []
    for k in range(first, len(messages)):
        if messages[k]["role"] == "tool":
            pending.append(messages[k]["content"])
            continue
        if pending:
            pieces.append((results_text(pending, thinking), False))
            pending = []
        prompt = hf_qwen.apply_chat_template(messages[:k], add_generation_prompt=True, **options)
        full = hf_qwen.apply_chat_template(messages[:k + 1], **options)
        pieces.append((full[len(prompt):].removesuffix("\n"), True))
    return pieces


def runs(labels: list[int], ids: list[int]) -> list[tuple[list[int], bool]]:
    """The row cut where labelled and unlabelled tokens meet: (the run's ids, labelled)."""
    out: list[tuple[list[int], bool]] = []
    for token, label in zip(ids, labels):
        labelled = label != IGNORE_INDEX
        if out and out[-1][1] == labelled:
            out[-1][0].append(token)
        else:
            out.append(([token], labelled))
    return out


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("name", WITH_RESULTS)
def test_labels_are_every_assistant_turn_in_rollout_order_and_nothing_else(qwen, hf_qwen, name, thinking):
    messages = CONVERSATIONS[name]
    collator = SFTCollator(qwen, max_length=4096, max_prompt_length=2048, enable_thinking=thinking)
    if name == "reasoning before a call" and not thinking:
        with pytest.raises(RowError, match="--enable_thinking 1"):
            collator([{"messages": messages, "tools": TOOLS}])
        return
    batch = collator([{"messages": messages, "tools": TOOLS}])
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    assert batch["attention_mask"].all()
    expected_ids, mask = conversation_ids(qwen, messages, TOOLS, thinking)
    assert ids == expected_ids
    # unshifted, as for a row without tools: labels[t] is input_ids[t] on a trained token (the loss shifts)
    assert labels == [token if trained else IGNORE_INDEX for token, trained in zip(ids, mask)]
    # independently of conversation_ids: each labelled run is one assistant turn as transformers renders it, each
    # unlabelled run the prompt or the tool results with the next generation prompt
    pieces = hf_pieces(hf_qwen, messages, thinking)
    found = runs(labels, ids)
    assert [(qwen.decode(run), labelled) for run, labelled in found] == pieces
    assert [run for run, _ in found] == [hf_qwen.encode(text, add_special_tokens=False) for text, _ in pieces]
    trained_text = qwen.decode([t for t, label in zip(ids, labels) if label != IGNORE_INDEX])
    assert "<tool_response>" not in trained_text and "<|im_start|>" not in trained_text
    assert trained_text.count("<|im_end|>") == sum(m["role"] == "assistant" for m in messages)


def template_collate(collator: SFTCollator, rows: list[dict]) -> dict[str, torch.Tensor]:
    """The SFT collation as it was before conversations with tool results were trained in rollout order: every row
    rendered by the template, the prompt's end and the completion's start kept, labels on the completion."""
    input_ids, prompt_lengths = [], []
    for full_ids, boundary in collator.encode(rows):
        prompt = _keep_end(full_ids[:boundary], collator.max_prompt_length)
        input_ids.append(prompt + full_ids[boundary:boundary + collator.max_length - len(prompt)])
        prompt_lengths.append(len(prompt))
    ids = _pad(input_ids, collator.tokenizer.pad_token_id, left=False)
    positions = torch.arange(ids.shape[1])
    real = positions < torch.tensor([len(r) for r in input_ids])[:, None]
    completion = real & (positions >= torch.tensor(prompt_lengths)[:, None])
    return {"input_ids": ids, "attention_mask": real.long(), "labels": ids.masked_fill(~completion, IGNORE_INDEX)}


@pytest.mark.parametrize("thinking", [False, True])
def test_rows_without_tool_results_collate_bit_for_bit_as_before(qwen, thinking):
    """Rows without a tool message before their last assistant turn, truncated or not, beside tool conversations or
    not: the tensors the collation before rollout order gave. With rollout_order=False (preference pairs) a tool
    conversation is the template's rendering too."""
    long_system = {"role": "system", "content": "Answer briefly. " * 60}
    ordinary = [
        {"messages": [USER, {"role": "assistant", "content": "Sunny, 18 °C."}]},
        {"messages": [long_system, USER, {"role": "assistant", "content": "word " * 300}]},
        {"messages": [USER]},
        {"messages": CONVERSATIONS["one call"], "tools": TOOLS},
        {"messages": CONVERSATIONS["malformed call as plain content"], "tools": TOOLS},
        {"messages": [USER, CALL_ONLY, RESULT], "tools": TOOLS},  # the result follows the last assistant turn
    ]
    assert not any(in_rollout_order(row["messages"]) for row in ordinary)
    collator = SFTCollator(qwen, max_length=160, max_prompt_length=96, enable_thinking=thinking)
    before = template_collate(collator, ordinary)
    now = collator(ordinary)
    assert set(now) == set(before) and all(torch.equal(now[key], before[key]) for key in before)
    tool_row = {"messages": CONVERSATIONS["parallel calls"], "tools": TOOLS}
    mixed = collator([ordinary[0], tool_row, ordinary[1]])
    for i, j in ((0, 0), (2, 1)):
        width = int(before["attention_mask"][j].sum())
        assert all(torch.equal(mixed[key][i, :width], before[key][j, :width]) for key in before)
        assert mixed["attention_mask"][i, width:].eq(0).all() and mixed["labels"][i, width:].eq(IGNORE_INDEX).all()
    as_rendered = collator([tool_row], rollout_order=False)
    assert all(torch.equal(as_rendered[key], template_collate(collator, [tool_row])[key]) for key in before)


def test_preference_pairs_with_tool_results_keep_the_templates_rendering(qwen, hf_qwen, tmp_path):
    prompt = CONVERSATIONS["sequential calls with results"][:-1]
    chosen, rejected = CONVERSATIONS["sequential calls with results"][-1:], [{"role": "assistant", "content": "No."}]
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected, "tools": TOOLS}) + "\n",
                    encoding="utf-8")
    pairs = PairDataset(str(path))
    collator = PairCollator(SFTCollator(qwen, max_length=4096, max_prompt_length=2048))
    assert collator.problems([pairs[0]]) == [None]
    batch = collator([pairs[0]])
    assert batch["input_ids"][0].tolist() == hf_ids(hf_qwen, prompt + chosen)
    labelled = batch["labels"][0] != IGNORE_INDEX
    assert qwen.decode(batch["input_ids"][0][labelled]).endswith("Paris 18 °C clear, Zürich 12 °C rain; 2 + 3 = "
                                                                  "5.<|im_end|>\n")
    assert "<tool_call>" not in qwen.decode(batch["input_ids"][0][labelled])


def test_a_long_conversation_keeps_the_prompts_end_and_loses_its_last_turns(qwen):
    """The budgets of any row: the prompt (the messages before the first assistant turn) keeps its last
    max_prompt_length tokens, the rest its first max_length - len(prompt); only the kept assistant tokens are
    labelled. The cut may fall inside a turn or inside a tool result."""
    system = {"role": "system", "content": "Use the tools. " * 200}
    messages = [system, *CONVERSATIONS["sequential calls with results"][1:]]
    row = {"messages": messages, "tools": TOOLS}
    ids, mask = conversation_ids(qwen, messages, TOOLS, False)
    start = mask.index(1)
    assert start > 300
    for max_length, max_prompt_length in ((4096, 2048), (400, 300), (330, 300), (300, 250)):
        batch = SFTCollator(qwen, max_length, max_prompt_length, enable_thinking=False)([row])
        prompt = ids[:start][-max_prompt_length:]
        kept = slice(start, start + max_length - len(prompt))
        assert batch["input_ids"][0].tolist() == prompt + ids[kept]
        assert batch["labels"][0].tolist() == [IGNORE_INDEX] * len(prompt) + [
            token if trained else IGNORE_INDEX for token, trained in zip(ids[kept], mask[kept])]
        assert qwen.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert batch["input_ids"].shape[1] == min(len(prompt) + len(ids) - start, max_length)
    short = SFTCollator(qwen, 330, 300, enable_thinking=False)([row])
    assert qwen.decode(short["input_ids"][0]).endswith("<tool_response>\n{\"temp\": ")  # cut inside a result
    assert int((short["labels"] != IGNORE_INDEX).sum()) == sum(mask[start:start + 30])


BAD_CONVERSATIONS = {
    "a user turn after the results": ([USER, CALL_ONLY, RESULT, {"role": "assistant", "content": "18 °C."}, USER,
                                       {"role": "assistant", "content": "Still 18 °C."}],
                                      "message 4 is a user turn after the first assistant turn"),
    "two answers after one result": ([USER, CALL_ONLY, RESULT, {"role": "assistant", "content": "18 °C."},
                                      {"role": "assistant", "content": "Clear."}],
                                     "message 4: an assistant turn that follows no tool result"),
    "reasoning without thinking": (CONVERSATIONS["reasoning before a call"],
                                   "renders the turns before it differently once it follows (an assistant turn holds "
                                   "<think> reasoning under enable_thinking=False: use --enable_thinking 1"),
}


@pytest.mark.parametrize("name", list(BAD_CONVERSATIONS))
def test_a_tool_conversation_that_cannot_be_put_in_rollout_order_is_refused_naming_file_and_row(qwen, tmp_path,
                                                                                                 name):
    messages, reason = BAD_CONVERSATIONS[name]
    path = tmp_path / "tools.jsonl"
    good = {"messages": CONVERSATIONS["sequential calls with results"], "tools": TOOLS}
    path.write_text("".join(json.dumps(row) + "\n" for row in (good, {"messages": messages, "tools": TOOLS})),
                    encoding="utf-8")
    dataset = RowDataset(str(path))
    collator = SFTCollator(qwen, max_length=4096, max_prompt_length=2048, enable_thinking=False)
    with pytest.raises(DataError) as refused:
        validate_rows(dataset, collator, need_completion=True)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: 1 of 2 rows cannot be used: row 1: a conversation with tool results is "
                              f"trained turn by turn in a rollout's token order, and this one cannot be rendered so: ")
    assert reason in message
    with pytest.raises(RowError, match="cannot be rendered so"):  # the verdict of the collation itself
        collator([dataset[1]])


@pytest.mark.slow
def test_sft_on_the_demos_tool_conversations_trains_every_assistant_token_and_the_loss_falls(qwen, tiny_config_path,
                                                                                              tmp_path):
    """16 of the products task's conversations with the calculator (call, result, answer), 4 epochs of 4 steps: the
    first step's loss counts exactly the assistant tokens of its rows, both turns of each, and the loss falls."""
    rows = [row for row in build_splits("products")["sft_train"] if row["tools"]][:16]
    data = tmp_path / "tools.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    train_sft(loop_args(tiny_config_path, str(data), tmp_path, name="sft", batch=4, epochs=4, learning_rate=1e-2,
                        max_length=320, max_prompt_length=256))
    logged = metrics(tmp_path, "sft")
    dataset = RowDataset(str(data))
    first_step = [dataset[i] for i in list(EpochSampler(len(dataset), seed=7, epoch=0))[:4]]
    trained = 0
    for row in first_step:
        ids, mask = conversation_ids(qwen, row["messages"], row["tools"], False)
        assert mask[0] == 0 and qwen.decode([t for t, m in zip(ids, mask) if m]).count("<|im_end|>") == 2
        trained += sum(mask)
    assert logged[0]["tokens"] == trained  # every assistant token, both turns; nothing else
    losses = [m["loss"] for m in logged]
    assert len(losses) == 16 and losses[-1] < 0.5 * losses[0]
