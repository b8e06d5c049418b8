"""Multi-turn rollouts with tools (--tools), in the built-in engine or on the rollout server (--rollout_url): the
student samples a turn; a turn that ends with EOS and calls tools gets their results and the next generation prompt
appended (dataset/tool_conversation.py) and the student goes on from there, up to --max_turns turns and
--max_new_tokens tokens after the prompt, sampled and results together. Only the student's own tokens carry labels:
the tool results and the template tokens around them are context, masked from the loss, the teachers' scores, the KL
terms and every token count, which all read the labels. A served conversation is kept by the rollout queue (and a
checkpoint) in the single-turn samples' form, token ids and log-probabilities (`kept_sample`). docs/tools.md.
"""
from __future__ import annotations

import argparse
import math

import torch

from dataset.collators import IGNORE_INDEX
from dataset.tool_conversation import Conversation, ToolResponder, engine_turns, roll_out
from model.generate import Decoder
from tools import BUILTIN_TOOLS, answerer, tool_names, unknown_tools

Sequences = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # input_ids, attention_mask, labels (the student's)


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tools: multi-turn rollouts (docs/tools.md)")
    g.add_argument("--tools", default="",
                   help=f"comma-separated tools the student's calls are answered by (built in: "
                        f"{', '.join(BUILTIN_TOOLS)}); the rows' `tools` column shows them to it. Empty: one turn")
    g.add_argument("--max_turns", type=int, default=4,
                   help="with --tools: assistant turns per rollout at most (a call in the last goes unanswered)")


def tool_rules(args: argparse.Namespace) -> list[tuple[bool, str]]:
    """The --tools flags' rules, each with what to do instead (common.errors.refuse_first's form; what a loop cannot
    do with tools yet, its own config refuses: trainer/config/opd.py)."""
    a = args
    unknown = unknown_tools(tool_names(a.tools))
    return [
        (bool(unknown), f"--tools {a.tools}: no tool named {', '.join(unknown)} (built in: "
                        f"{', '.join(BUILTIN_TOOLS)}; add your own to tools.BUILTIN_TOOLS, docs/tools.md)"),
        (a.max_turns < 1, f"--max_turns must be >= 1, got {a.max_turns}"),
    ]


def tool_responder(args: argparse.Namespace, tokenizer) -> ToolResponder | None:
    """What the rollouts append after a turn with calls, answered by the --tools registry (None without --tools)."""
    if not args.tools:
        return None
    return ToolResponder(tokenizer, answerer(tool_names(args.tools)), bool(args.enable_thinking))


def sample_conversations(student, batch: dict, seeds: list[int], responder: ToolResponder, max_new_tokens: int,
                         max_turns: int, device: str, autocast, decoder: Decoder, pad: int,
                         settings: dict) -> Sequences:
    """Steps 1-2 of a micro-batch with tools in the built-in engine (eval mode, no grad): each row's conversation
    from its prompt (`seeds`: its single-turn seed; `settings`: generate's sampling options) -> input_ids,
    attention_mask and labels on the tokens the student sampled."""
    prompts = prompt_rows(batch)
    sample_turn = engine_turns(student, prompts, seeds, max_new_tokens, pad, decoder=decoder, **settings)
    was_training = student.training
    student.eval()
    with autocast():
        conversations = roll_out(len(prompts), sample_turn, responder, max_new_tokens, max_turns,
                                 settings["eos_token_id"])
    student.train(was_training)
    return conversation_sequences(prompts, conversations, pad, device)


def add_turn_stats(metrics, labels: torch.Tensor) -> None:
    """A micro-batch of conversations' assistant turns per rollout (`turns`: each turn a run of labelled tokens) and
    the share of rollouts that read a tool's result (`tool_result_share`: results are appended only before another
    turn, so a rollout with more than one turn)."""
    labelled = (labels != IGNORE_INDEX).long()
    starts = labelled.diff(dim=1, prepend=torch.zeros_like(labelled[:, :1])) == 1
    turns = starts.sum(dim=1)
    metrics.ratio("turns", turns.sum(), len(turns))
    metrics.ratio("tool_result_share", (turns > 1).sum(), len(turns))


def prompt_rows(batch: dict) -> list[list[int]]:
    """A collated batch's prompts as token ids, their left padding dropped: what a conversation continues."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch["prompt_ids"], batch["prompt_attention_mask"])]


def conversation_sequences(prompts: list[list[int]], conversations: list[Conversation], pad_token_id: int,
                           device: str) -> Sequences:
    """Prompts and their conversations -> the training forward's layout (build_sequences'): each row's prompt and
    conversation at positions 0..n-1, right padded; labels on the tokens the policy sampled only."""
    rows = [prompt + c.ids for prompt, c in zip(prompts, conversations)]
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (prompt, conversation) in enumerate(zip(prompts, conversations)):
        input_ids[i, :len(rows[i])] = torch.tensor(rows[i])
        attention_mask[i, :len(rows[i])] = 1
        sampled = torch.tensor(conversation.sampled, dtype=torch.bool)
        labels[i, len(prompt):len(rows[i])] = torch.tensor(conversation.ids).masked_fill(~sampled, IGNORE_INDEX)
    return input_ids.to(device), attention_mask.to(device), labels.to(device)


def kept_sample(conversation: Conversation) -> tuple[list[int], list[float]]:
    """A served conversation as the rollout queue keeps it, and a checkpoint saves it: its token ids and, aligned
    with them, the log-probability the server drew each sampled token with, NaN on the tool results' tokens (never
    drawn). The single-turn samples' form, (ids, log-probabilities), so the queue and the resume file hold both
    alike and `kept_conversation` rebuilds the conversation exactly."""
    drawn = iter(conversation.logprobs)
    return list(conversation.ids), [next(drawn) if sampled else math.nan for sampled in conversation.sampled]


def kept_conversation(sample: tuple[list[int], list[float]]) -> Conversation:
    """`kept_sample`'s inverse: the conversation, its sampled mask, the sampled tokens' log-probabilities and its
    turns (each a run of sampled tokens: tool results always lie between two turns)."""
    ids, logprobs = sample
    sampled = [0 if math.isnan(x) else 1 for x in logprobs]
    turns = sum(1 for k, s in enumerate(sampled) if s and (k == 0 or not sampled[k - 1]))
    return Conversation(list(ids), sampled, [x for x in logprobs if not math.isnan(x)], turns)
