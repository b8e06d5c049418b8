"""Collators: chat rows (from `dataset.sources.RowDataset`) -> left-padded token tensors.

The chat template is applied here, per batch, so `enable_thinking` is decided in one place.

Split of a conversation (`split_conversation`): the target is the LAST assistant turn; the prompt is every message
before it. Messages after the last assistant turn have no target and are dropped. A row without an assistant turn is
prompt-only. Only the last assistant turn is trained on; earlier assistant turns are context (masked).

SFTCollator
    prompt text     = template(prompt messages, add_generation_prompt=True)
    full text       = template(prompt messages + last assistant turn)
    completion text = full text minus the prompt text (the full text must start with the prompt text).
    The full text is tokenised once; the boundary is where the UNTRUNCATED prompt text ends in it (from the tokens'
    character offsets), and no token may straddle it. (Tokenising prompt and completion separately is not the same as
    tokenising their concatenation: "\\n" + "\\n" is two tokens, "\\n\\n" is one.)
    Independent budgets: the prompt keeps its last `max_prompt_length` tokens (so the generation header
    `<|im_start|>assistant\\n` survives), the completion keeps its first `max_length - len(prompt)` tokens: a long
    solution can never squeeze the question out. Rows are LEFT padded with `pad_token_id`.
    labels are unshifted (the loss shifts): labels[t] == input_ids[t] on completion tokens, -100 on prompt and padding.
    Qwen3's template with enable_thinking=False ends the prompt with an empty `<think>\\n\\n</think>\\n\\n`; with True
    the same empty block is rendered inside the completion (and so is trained on). The completion ends with
    `<|im_end|>\\n`: the newline after EOS is one extra label token, as the template renders it.

PromptCollator (OPD): the same prompt text, truncated the same way, left padded, plus the input rows unchanged
    (ground truth, messages, ...) so the loop can grade or fall back to the dataset's own completions.
"""
from __future__ import annotations

import os

import numpy as np
import torch

IGNORE_INDEX = -100


def split_conversation(messages: list[dict]) -> tuple[list[dict], list[dict] | None]:
    """-> (prompt messages, prompt + last assistant turn), or (all messages, None) when there is no assistant turn."""
    for k in range(len(messages) - 1, -1, -1):
        if messages[k]["role"] == "assistant":
            return messages[:k], messages[:k + 1]
    return messages, None


def _left_pad(rows: list[list[int]], pad_value: int) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    # numpy converts a list of ints several times faster than torch.tensor does, and one conversion per row suffices.
    out = np.full((len(rows), width), pad_value, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, width - len(row):] = row
    return torch.from_numpy(out)


def _last_positions(lengths: list[int], width: int) -> torch.Tensor:
    """(B, width) bool, True on the last lengths[i] positions of row i (the real tokens of a left-padded row)."""
    return torch.arange(width) >= width - torch.tensor(lengths, dtype=torch.long)[:, None]


def _keep_end(ids: list[int], budget: int) -> list[int]:
    return ids[len(ids) - budget:] if len(ids) > budget else ids


class SFTCollator:
    """rows -> input_ids, attention_mask, labels (B, T), prompt_lengths (B,); see the module docstring."""

    def __init__(self, tokenizer, max_length: int, max_prompt_length: int, enable_thinking: bool = True):
        if not 0 < max_prompt_length < max_length:
            raise ValueError(f"need 0 < max_prompt_length < max_length, got max_prompt_length={max_prompt_length}, "
                             f"max_length={max_length}: lower --max_prompt_length or raise --max_length")
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_prompt_length = max_prompt_length
        self.enable_thinking = enable_thinking

    def render(self, messages: list[dict]) -> tuple[str, str]:
        """-> (prompt text, full text); full == prompt for a prompt-only row."""
        prompt_messages, full_messages = split_conversation(messages)
        template = self.tokenizer.apply_chat_template
        prompt = template(prompt_messages, add_generation_prompt=True, enable_thinking=self.enable_thinking)
        if full_messages is None:
            return prompt, prompt
        full = template(full_messages, add_generation_prompt=False, enable_thinking=self.enable_thinking)
        if not full.startswith(prompt):
            at = len(os.path.commonprefix([prompt, full]))
            raise ValueError("the chat template renders the conversation so that it does not start with the prompt "
                             "rendered with add_generation_prompt=True, so there is no prompt/completion boundary. "
                             "A common cause: an assistant turn with <think> reasoning under enable_thinking=False "
                             "(the prompt then ends with an empty think block). They differ after "
                             f"{prompt[max(0, at - 60):at]!r}: prompt goes on {prompt[at:at + 40]!r}, "
                             f"conversation goes on {full[at:at + 40]!r}")
        return prompt, full

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        texts = [self.render(row["messages"]) for row in rows]
        # One tokenisation per row, of the full text; the boundary is where the prompt text ends, and no token may
        # straddle it (then the prefix tokens are exactly the prompt's own tokens).
        encoded = self.tokenizer.encode_batch_split([full for _, full in texts], [len(prompt) for prompt, _ in texts])
        input_ids, prompt_lengths, completion_lengths = [], [], []
        for (prompt_text, _), (full_ids, boundary) in zip(texts, encoded):
            if boundary is None:
                raise ValueError("tokenising the full conversation puts a token across the end of the prompt "
                                 f"(prompt ends {prompt_text[-40:]!r}); the boundary between prompt and completion "
                                 "falls inside a token")
            prompt = _keep_end(full_ids[:boundary], self.max_prompt_length)
            completion = full_ids[boundary:boundary + self.max_length - len(prompt)]
            input_ids.append(prompt + completion)
            prompt_lengths.append(len(prompt))
            completion_lengths.append(len(completion))
        ids = _left_pad(input_ids, self.tokenizer.pad_token_id)
        width = ids.shape[1]
        return {
            "input_ids": ids,
            "attention_mask": _last_positions([len(r) for r in input_ids], width).long(),
            # Rows are [padding, prompt, completion]: the completion is the last completion_lengths[i] positions.
            "labels": ids.masked_fill(~_last_positions(completion_lengths, width), IGNORE_INDEX),
            # Real prompt tokens per row (after truncation). Informational: the loss must trust `labels`.
            "prompt_lengths": torch.tensor(prompt_lengths, dtype=torch.long),
        }


class PromptCollator:
    """rows -> prompt_ids, prompt_attention_mask (B, P) left padded, and rows (passed through unchanged)."""

    def __init__(self, tokenizer, max_prompt_length: int, enable_thinking: bool = True):
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length must be positive, got {max_prompt_length}")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.enable_thinking = enable_thinking

    def __call__(self, rows: list[dict]) -> dict:
        texts = [self.tokenizer.apply_chat_template(split_conversation(row["messages"])[0], add_generation_prompt=True,
                                                    enable_thinking=self.enable_thinking) for row in rows]
        prompts = [_keep_end(ids, self.max_prompt_length) for ids in self.tokenizer.encode_batch(texts)]
        prompt_ids = _left_pad(prompts, self.tokenizer.pad_token_id)
        return {
            "prompt_ids": prompt_ids,
            "prompt_attention_mask": _last_positions([len(p) for p in prompts], prompt_ids.shape[1]).long(),
            "rows": rows,
        }


def build_sequences(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                    completion_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt (left padded) + completion -> input_ids, attention_mask, labels.

    Labels are the completion tokens up to and including the first EOS; -100 on the prompt, its padding and
    everything after EOS (those positions are padding, masked in attention as well)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention_mask = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)
    labels = torch.cat([torch.full_like(prompt_ids, -100), completion_ids.masked_fill(completion_mask == 0, -100)],
                       dim=1)
    return input_ids, attention_mask, labels
