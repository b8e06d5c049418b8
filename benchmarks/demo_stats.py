"""The demo table's numbers that no training run writes: each model's held-out reverse KL to the teacher on its own
greedy answers, and the paired test between two rows graded on the same problems.

    reverse_kl_to_teacher(model_dir, teacher_dir, gradings_path)   # mean over answer tokens of KL(p_model || p_teacher)
    paired_test(first_path, second_path)                           # McNemar's exact test on two eval_math outputs

The reverse KL is the quantity on-policy distillation minimises (trainer/losses/closed_forms.py), measured where it
is defined for every model of the table: on each of the model's own greedy completions of the held-out prompts (the
`prompt` and `completion` of eval/eval_math.py's JSON lines, the completion followed by <|im_end|> where it ended), both
models teacher-forced in float32 on CPU, the full-vocabulary KL(p_model || p_teacher) at temperature 1 at every answer
position, averaged over all answer tokens of all problems.
"""
from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from eval.grader import mcnemar_exact  # noqa: E402
from model import load_pretrained  # noqa: E402
from model.tokenizer import load_tokenizer  # noqa: E402


def read_gradings(path: str) -> list[dict]:
    """eval_math's JSON lines (one sample per problem), in problem order."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return sorted(records, key=lambda r: r["index"])


def paired_test(first_path: str, second_path: str) -> tuple[int, int, float]:
    """McNemar's exact test of two models' gradings of the same problems: (only the first right, only the second
    right, two-sided p)."""
    first, second = read_gradings(first_path), read_gradings(second_path)
    if [r["index"] for r in first] != [r["index"] for r in second]:
        raise ValueError(f"{first_path} and {second_path} grade different problems")
    return mcnemar_exact([r["correct"] for r in first], [r["correct"] for r in second])


@torch.no_grad()
def reverse_kl_to_teacher(model_dir: str, teacher_dir: str, gradings_path: str, batch_size: int = 32) -> float:
    """Mean over the model's answer tokens of KL(p_model || p_teacher) on its own greedy answers (module docstring)."""
    tokenizer = load_tokenizer(model_dir)
    model = load_pretrained(model_dir).eval()
    teacher = load_pretrained(teacher_dir).eval()
    records = read_gradings(gradings_path)
    total, tokens = 0.0, 0
    for start in range(0, len(records), batch_size):
        kl, count = batch_reverse_kl(model, teacher, tokenizer, records[start:start + batch_size])
        total, tokens = total + kl, tokens + count
    return total / max(tokens, 1)


@torch.no_grad()
def batch_reverse_kl(model, teacher, tokenizer, records: list[dict]) -> tuple[float, int]:
    """(sum of the per-token KL over the batch's answer positions, their count); rows right-padded."""
    rows, answer_starts = [], []
    for record in records:
        prompt = tokenizer.encode(record["prompt"])
        answer = tokenizer.encode(record["completion"]) + ([tokenizer.eos_token_id] if record["eos"] else [])
        rows.append(prompt + answer)
        answer_starts.append(len(prompt))
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    answer = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (row, start) in enumerate(zip(rows, answer_starts)):
        input_ids[i, :len(row)] = torch.tensor(row)
        attention_mask[i, :len(row)] = 1
        answer[i, start - 1:len(row) - 1] = True  # the positions whose next token is an answer token
    vocab = len(tokenizer)
    log_p = torch.log_softmax(model(input_ids, attention_mask=attention_mask).logits[..., :vocab][answer].float(), -1)
    log_q = torch.log_softmax(teacher(input_ids, attention_mask=attention_mask).logits[..., :vocab][answer].float(),
                              -1)
    return float((log_p.exp() * (log_p - log_q)).sum()), int(answer.sum())
