"""Collators: chat rows (from `dataset.sources.RowDataset`) -> padded token tensors.

Training sequences (SFTCollator, build_sequences) are RIGHT padded: each row's tokens at positions 0..n-1, pads at
the end, so a training forward is plain causal attention with no mask (the form CUDA's flash kernel takes; a real
token never attends a pad that comes after it). Prompts to generate from (PromptCollator) are LEFT padded, so all
rows' next tokens share one column.

The chat template is applied here, per batch, so `enable_thinking` is decided in one place.

Split of a conversation (`split_conversation`): the target is the LAST assistant turn; the prompt is every message
before it. Messages after the last assistant turn have no target and are dropped. A row without an assistant turn is
prompt-only. Only the last assistant turn is trained on; earlier assistant turns are context (masked). Except a
conversation with tool results (`in_rollout_order`), which SFT trains on every assistant turn, below.

SFTCollator
    prompt text     = template(prompt messages, add_generation_prompt=True)
    full text       = template(prompt messages + last assistant turn)
    completion text = full text minus the prompt text (the full text must start with the prompt text).
    The full text is tokenised once; the boundary is where the UNTRUNCATED prompt text ends in it (from the tokens'
    character offsets), and no token may straddle it. (Tokenising prompt and completion separately is not the same as
    tokenising their concatenation: "\\n" + "\\n" is two tokens, "\\n\\n" is one.)
    Independent budgets: the prompt keeps its last `max_prompt_length` tokens (so the generation header
    `<|im_start|>assistant\\n` survives), the completion keeps its first `max_length - len(prompt)` tokens: a long
    solution can never squeeze the question out. Rows are RIGHT padded with `pad_token_id`.
    labels are unshifted (the loss shifts): labels[t] == input_ids[t] on completion tokens, -100 on prompt and padding.
    Qwen3's template with enable_thinking=False ends the prompt with an empty `<think>\\n\\n</think>\\n\\n`; with True
    the same empty block is rendered inside the completion (and so is trained on). The completion ends with
    `<|im_end|>\\n`: the newline after EOS is one extra label token, as the template renders it.

SFTCollator on a conversation with tool results (a `tool` message before its last assistant turn): the token
    sequence a multi-turn rollout produces, dataset.tool_conversation.conversation_ids (the prompt with the
    generation prompt, each assistant turn as sampled through its `<|im_end|>`, each run of tool results followed by
    the next generation prompt), the messages after the last assistant turn dropped as above; labels on every
    assistant token and nowhere else (tool results, generation prompts and the template's tokens are -100), unshifted
    as above. So a student learns to call, to read the results and to answer on exactly the tokens its own rollouts
    will hold (the template's rendering differs: Qwen3 drops a call-only turn's empty think block once a result
    follows it). A turn ends at its `<|im_end|>`: the newline after it is the results' first token, not a label.
    The budgets as for any row: the prompt (everything before the first assistant turn) keeps its last
    `max_prompt_length` tokens, the rest (turns, results, generation prompts) its first `max_length - len(prompt)`,
    so a long conversation loses its last turns as a long solution loses its end (it may stop inside a turn or a
    result; only the assistant tokens kept are labelled). A conversation conversation_ids cannot render (a user turn
    after the first assistant turn, two assistant turns without a result between them, a turn whose rendering does
    not follow its prompt's, such as <think> reasoning under enable_thinking=False) is a RowError. Preference pairs
    (PairCollator) keep the template's rendering: their target is the one answer after a shared prompt.

PromptCollator (OPD): the same prompt text, truncated the same way, left padded, plus the input rows unchanged
    (ground truth, messages, ...) so the loop can grade or fall back to the dataset's own completions.

A row the collator cannot use (the template refuses it, no prompt/completion boundary, a token across the boundary)
is a `RowError`. `validate_rows` finds every such row at start-up, through the collators' own `problems` (the code
that collates), so a bad row stops the run before the model is built instead of hours in
(`benchmarks/bench_data.py` times it on DAPO-shaped rows).
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import jinja2
import numpy as np
import torch
from tqdm import tqdm

from common.errors import UserError
from dataset.sources import DataError
from dataset.tool_conversation import conversation_ids

IGNORE_INDEX = -100  # the label of a position that no loss counts (PyTorch's cross_entropy default)
PROGRESS_MIN_ROWS = 2000   # validate_rows shows a progress bar above this many rows (on a terminal)
SHOWN_BAD_ROWS = 3         # validate_rows lists this many bad rows, then counts the rest
VALIDATION_CHUNK = 512     # rows per collator call in validate_rows (the tokenizer encodes a chunk in parallel)


class RowError(ValueError):
    """A row the collator cannot turn into tokens; the message says why and what to change."""


def split_conversation(messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """-> (prompt messages, prompt + last assistant turn), or (all messages, None) when there is no assistant turn."""
    for k in range(len(messages) - 1, -1, -1):
        if messages[k]["role"] == "assistant":
            return messages[:k], messages[:k + 1]
    return messages, None


def has_completion(messages: list[dict]) -> bool:
    return split_conversation(messages)[1] is not None


def in_rollout_order(messages: list[dict]) -> bool:
    """Whether SFT trains `messages` turn by turn in a rollout's token order: a tool result comes before the last
    assistant turn (see the module docstring)."""
    conversation = split_conversation(messages)[1]
    return conversation is not None and any(message["role"] == "tool" for message in conversation)


def _apply_template(tokenizer, messages: list[dict], add_generation_prompt: bool, enable_thinking: bool,
                    tools: list[dict] | None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             enable_thinking=enable_thinking, tools=tools)
    except jinja2.TemplateSyntaxError:
        raise  # the template itself is broken, not the row
    except jinja2.TemplateError as e:
        raise RowError(f"the chat template refuses the row: {e}") from None


def _pad(rows: list[list[int]], pad_value: int, left: bool) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    # numpy converts a list of ints several times faster than torch.tensor does, and one conversion per row suffices.
    out = np.full((len(rows), width), pad_value, dtype=np.int64)
    for i, row in enumerate(rows):
        start = width - len(row) if left else 0
        out[i, start:start + len(row)] = row
    return torch.from_numpy(out)


def _last_positions(lengths: list[int], width: int) -> torch.Tensor:
    """(B, width) bool, True on the last lengths[i] positions of row i (the real tokens of a left-padded row)."""
    return torch.arange(width) >= width - torch.tensor(lengths, dtype=torch.long)[:, None]


def _first_positions(lengths: list[int], width: int) -> torch.Tensor:
    """(B, width) bool, True on the first lengths[i] positions of row i (the real tokens of a right-padded row)."""
    return torch.arange(width) < torch.tensor(lengths, dtype=torch.long)[:, None]


def _keep_end(ids: list[int], budget: int) -> list[int]:
    return ids[len(ids) - budget:] if len(ids) > budget else ids


class SFTCollator:
    """rows -> input_ids, attention_mask, labels (B, T), right padded; see the module docstring."""

    def __init__(self, tokenizer, max_length: int, max_prompt_length: int, enable_thinking: bool = True):
        if not 0 < max_prompt_length < max_length:
            raise ValueError(f"need 0 < max_prompt_length < max_length, got max_prompt_length={max_prompt_length}, "
                             f"max_length={max_length}: lower --max_prompt_length or raise --max_length")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_prompt_length = max_prompt_length
        self.enable_thinking = enable_thinking
        # One id for a 12-character string with "<|", "_" and "|>" in it: a special token, not a BPE merge.
        self._special_header = "<|im_start|>" if len(tokenizer.encode("<|im_start|>")) == 1 else None

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, str]:
        """-> (prompt text, full text); full == prompt for a prompt-only row. RowError when the row cannot be split.
        `tools`: the row's tool schemas (its `tools` column), rendered into both texts."""
        prompt_messages, full_messages = split_conversation(messages)
        prompt = _apply_template(self.tokenizer, prompt_messages, True, self.enable_thinking, tools)
        if full_messages is None:
            return prompt, prompt
        full = _apply_template(self.tokenizer, full_messages, False, self.enable_thinking, tools)
        if not full.startswith(prompt):
            at = len(os.path.commonprefix([prompt, full]))
            raise RowError("no prompt/completion boundary: the chat template renders the conversation so that it "
                           "does not start with the prompt rendered with add_generation_prompt=True. A common cause: "
                           "an assistant turn with <think> reasoning under enable_thinking=False (the prompt then "
                           "ends with an empty think block): use --enable_thinking 1 or strip the <think> block from "
                           f"the data. They differ after {prompt[max(0, at - 60):at]!r}: prompt goes on "
                           f"{prompt[at:at + 40]!r}, conversation goes on {full[at:at + 40]!r}")
        return prompt, full

    def encode(self, rows: list[dict], tail_only: bool = False) -> list[tuple[list[int], int] | RowError]:
        """Per row: (ids of the full text, how many of them are the prompt), or the RowError that keeps it out: the
        template's rendering, its last assistant turn the completion (a conversation in rollout order is
        `encode_turns`' instead; `labelled` chooses).

        tail_only (for validation): tokenise each text only from the last special `<|im_start|>` of its prompt; the
        ids are then the tail's. The tokenizer cuts a text at special tokens before anything else, so the tokens after
        one do not depend on the text before it: whether a token straddles the prompt's end is decided the same way,
        at a third of the cost on DAPO-shaped rows (the prompt is most of the text)."""
        results: list = [None] * len(rows)
        texts: dict[int, tuple[str, int, int]] = {}  # row -> (full text, where the prompt ends, where to start)
        for i, row in enumerate(rows):
            try:
                prompt, full = self.render(row["messages"], row.get("tools"))
            except RowError as e:
                results[i] = e
                continue
            texts[i] = full, len(prompt), self._tail_start(prompt) if tail_only else 0
        # One tokenisation per row, of the full text; the boundary is where the prompt text ends, and no token may
        # straddle it (then the prefix tokens are exactly the prompt's own tokens).
        encoded = self.tokenizer.encode_batch_split([full[start:] for full, _, start in texts.values()],
                                                    [end - start for _, end, start in texts.values()])
        for (i, (full, end, _)), (ids, boundary) in zip(texts.items(), encoded):
            results[i] = (ids, boundary) if boundary is not None else RowError(
                "tokenising the full conversation puts a token across the end of the prompt (prompt ends "
                f"{full[max(0, end - 40):end]!r}); the boundary between prompt and completion falls inside a token")
        return results

    def _tail_start(self, prompt: str) -> int:
        return max(prompt.rfind(self._special_header), 0) if self._special_header else 0

    def encode_turns(self, row: dict) -> tuple[list[int], list[int]] | RowError:
        """A conversation with tool results, through its last assistant turn, in rollout order -> (ids, 1 on every
        assistant token): dataset.tool_conversation.conversation_ids; or the RowError that keeps it out."""
        conversation = split_conversation(row["messages"])[1]
        try:
            return conversation_ids(self.tokenizer, conversation, row.get("tools"), self.enable_thinking)
        except (jinja2.TemplateSyntaxError, UserError):
            raise  # the template itself, or the tokenizer's files, are broken, not the row
        except jinja2.TemplateError as e:
            return RowError(f"the chat template refuses the row: {e}")
        except ValueError as e:
            return RowError(f"a conversation with tool results is trained turn by turn in a rollout's token order, "
                            f"and this one cannot be rendered so: {e}{self._reasoning_hint(conversation)}")

    def _reasoning_hint(self, conversation: list[dict]) -> str:
        """What to change when an assistant turn reasons under enable_thinking=False: the prompt then ends with an
        empty think block and the turn's own rendering does not follow it."""
        reasons = any("<think>" in m["content"] or m.get("reasoning_content")
                      for m in conversation if m["role"] == "assistant")
        if self.enable_thinking or not reasons:
            return ""
        return (" (an assistant turn holds <think> reasoning under enable_thinking=False: use --enable_thinking 1 "
                "or strip the <think> block from the data)")

    def labelled(self, rows: list[dict], rollout_order: bool = True) -> list[tuple[list[int], list[int]] | RowError]:
        """Per row, untruncated: (ids, 1 on each token the loss counts), or the RowError that keeps it out. A row
        `in_rollout_order` is `encode_turns`' (unless `rollout_order` is False); any other is `encode`'s, its
        completion labelled."""
        turns = [rollout_order and in_rollout_order(row["messages"]) for row in rows]
        whole = iter(self.encode([row for row, by_turns in zip(rows, turns) if not by_turns]))
        out: list = []
        for row, by_turns in zip(rows, turns):
            if by_turns:
                out.append(self.encode_turns(row))
                continue
            result = next(whole)
            if isinstance(result, RowError):
                out.append(result)
            else:
                ids, boundary = result
                out.append((ids, [0] * boundary + [1] * (len(ids) - boundary)))
        return out

    def problems(self, rows: list[dict], rollout_order: bool = True) -> list[RowError | None]:
        """Per row: why `__call__` would refuse it, or None."""
        turns = [rollout_order and in_rollout_order(row["messages"]) for row in rows]
        whole = iter(self.encode([row for row, by_turns in zip(rows, turns) if not by_turns], tail_only=True))
        results = [self.encode_turns(row) if by_turns else next(whole) for row, by_turns in zip(rows, turns)]
        return [result if isinstance(result, RowError) else None for result in results]

    def fit(self, ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
        """A row's (ids, mask) within the budgets (module docstring): the prompt, every token before the first
        labelled one, keeps its last `max_prompt_length`, the rest its first `max_length - len(prompt)`."""
        start = mask.index(1) if 1 in mask else len(mask)
        prompt = _keep_end(ids[:start], self.max_prompt_length)
        end = start + self.max_length - len(prompt)
        return prompt + ids[start:end], [0] * len(prompt) + mask[start:end]

    def __call__(self, rows: list[dict], rollout_order: bool = True) -> dict[str, torch.Tensor]:
        """`rollout_order` False: every row rendered by the template, its last assistant turn the target
        (PairCollator's pairs)."""
        input_ids, masks = [], []
        for result in self.labelled(rows, rollout_order):
            if isinstance(result, RowError):
                raise result
            ids, mask = self.fit(*result)
            input_ids.append(ids)
            masks.append(mask)
        ids = _pad(input_ids, self.tokenizer.pad_token_id, left=False)
        real = _first_positions([len(r) for r in input_ids], ids.shape[1])
        labelled = _pad(masks, 0, left=False).bool()  # padding is never labelled
        return {"input_ids": ids, "attention_mask": real.long(), "labels": ids.masked_fill(~labelled, IGNORE_INDEX)}


class PromptCollator:
    """rows -> prompt_ids, prompt_attention_mask (B, P) left padded, and rows (passed through unchanged)."""

    def __init__(self, tokenizer, max_prompt_length: int, enable_thinking: bool = True):
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.enable_thinking = enable_thinking

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text: the messages before the last assistant turn, with the generation prompt (and the row's
        `tools` schemas)."""
        return _apply_template(self.tokenizer, split_conversation(messages)[0], True, self.enable_thinking, tools)

    def problems(self, rows: list[dict]) -> list[RowError | None]:
        """Per row: why `__call__` would refuse it, or None (tokenising a prompt cannot fail, rendering it can)."""
        out: list[RowError | None] = []
        for row in rows:
            try:
                self.render(row["messages"], row.get("tools"))
                out.append(None)
            except RowError as e:
                out.append(e)
        return out

    def __call__(self, rows: list[dict]) -> dict:
        texts = [self.render(row["messages"], row.get("tools")) for row in rows]
        prompts = [_keep_end(ids, self.max_prompt_length) for ids in self.tokenizer.encode_batch(texts)]
        prompt_ids = _pad(prompts, self.tokenizer.pad_token_id, left=True)
        return {
            "prompt_ids": prompt_ids,
            "prompt_attention_mask": _last_positions([len(p) for p in prompts], prompt_ids.shape[1]).long(),
            "rows": rows,
        }


class PairCollator:
    """Preference pairs (dataset.sources.PairDataset rows) -> the SFT collator's input_ids, attention_mask, labels for
    2B sequences, the B chosen answers first, then the B rejected ones in the same order (TRL's layout), each rendered
    and truncated exactly as SFT renders a conversation's last turn: prompt + that answer (`sft`, an SFTCollator),
    by the template even when the prompt holds tool results (`rollout_order=False`: the target is the one answer
    after a prompt both share). Plus `row_index` (B,): each pair's row, the key of a precomputed reference
    (trainer/train_dpo.py)."""

    def __init__(self, sft: SFTCollator):
        self.sft = sft

    @staticmethod
    def conversations(rows: list[dict]) -> list[dict]:
        """The 2B conversations of B pairs, chosen ones first, each with its pair's tools: what the SFT collator
        renders."""
        return ([{"messages": row["prompt"] + row["chosen"], "tools": row.get("tools")} for row in rows]
                + [{"messages": row["prompt"] + row["rejected"], "tools": row.get("tools")} for row in rows])

    def problems(self, rows: list[dict]) -> list[RowError | None]:
        """Per pair: why `__call__` would refuse it (its chosen or its rejected conversation), or None."""
        found = self.sft.problems(self.conversations(rows), rollout_order=False)
        out: list[RowError | None] = []
        for chosen, rejected in zip(found[:len(rows)], found[len(rows):]):
            error = chosen or rejected
            out.append(None if error is None else RowError(f"{'chosen' if chosen else 'rejected'}: {error}"))
        return out

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        return {**self.sft(self.conversations(rows), rollout_order=False),
                "row_index": torch.tensor([row["row_index"] for row in rows], dtype=torch.long)}


def validate_rows(dataset: Sequence[dict], collator: SFTCollator | PromptCollator | PairCollator,
                  need_completion: bool, progress: bool = True) -> None:
    """Check that `collator` can use every row of `dataset`, exactly as it will during training.

    `need_completion`: every row must have an assistant turn (SFT, KD and OPD with --lmbda < 1 train on the last
    one). Raises one DataError naming the file, the first SHOWN_BAD_ROWS bad rows with their reasons, and how many
    rows are bad. A progress bar is shown when `progress`, stderr is a terminal and there are over PROGRESS_MIN_ROWS
    rows."""
    total, bad, shown = len(dataset), 0, []
    show_bar = progress and total > PROGRESS_MIN_ROWS and sys.stderr.isatty()
    with tqdm(total=total, desc="checking rows", unit="row", disable=not show_bar, file=sys.stderr) as bar:
        for start in range(0, total, VALIDATION_CHUNK):
            indices = range(start, min(start + VALIDATION_CHUNK, total))
            for index, reason in _chunk_problems(dataset, indices, collator, need_completion):
                bad += 1
                if len(shown) < SHOWN_BAD_ROWS:
                    shown.append(f"row {index}: {reason}")
            bar.update(len(indices))
    if bad:
        more = f"; and {bad - len(shown)} more" if bad > len(shown) else ""
        raise DataError(f"{getattr(dataset, 'path', 'the data')}: {bad} of {total} rows cannot be used: "
                        + "; ".join(shown) + more)


def _chunk_problems(dataset: Sequence[dict], indices: range,
                    collator: SFTCollator | PromptCollator | PairCollator,
                    need_completion: bool) -> list[tuple[int, str]]:
    """(row index, one-line reason) for every bad row among `indices`."""
    rows = [dataset[i] for i in indices]
    out = []
    for index, row, error in zip(indices, rows, collator.problems(rows)):
        if need_completion and not has_completion(row["messages"]):
            out.append((index, "no assistant turn to train on (SFT, KD and OPD with --lmbda < 1 train on the last "
                               "assistant turn): add one or drop the row"))
        elif error is not None:
            out.append((index, str(error).replace("\n", " ")))
    return out


def build_sequences(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                    completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt (left padded, as generation takes it) + completion -> right-padded input_ids, attention_mask, labels,
    the training forward's layout: each row's prompt and completion through its first EOS at positions 0..n-1,
    padding after them, the width that of the longest row.

    Labels are the completion tokens up to and including the first EOS; IGNORE_INDEX on the prompt and padding."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)
    labels = torch.cat([torch.full_like(prompt_ids, IGNORE_INDEX),
                        completion_ids.masked_fill(completion_mask == 0, IGNORE_INDEX)],
                       dim=1)
    # A stable sort of "is padding" moves each row's real tokens to its front, in order: the left padding of the
    # prompt and the padding after EOS both end up behind them. The tokens there are never attended by a real one.
    order = torch.sort((attention_mask == 0).to(torch.uint8), dim=1, stable=True).indices
    width = int(attention_mask.sum(dim=1).max()) if attention_mask.numel() else 0
    order = order[:, :width]
    return input_ids.gather(1, order), attention_mask.gather(1, order), labels.gather(1, order)
