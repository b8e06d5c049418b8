"""What the tests share that is not a fixture: the repository root, a tiny Qwen3 config with the real vocabulary,
chat data with very different completion lengths and a recorder of the tensors a computation allocates. Test modules
import it directly (conftest is pytest's, not a module to import)."""
import json
import os
import random

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "float32",
}

# What a vLLM CPU server can serve (its attention kernels take head_dim 32, 64, ...; not TINY_CONFIG's 16)
SERVED_CONFIG = {**TINY_CONFIG, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}


def write_chat_jsonl(path, num_rows: int, seed: int = 0) -> str:
    """Chat rows whose completions have very different lengths (2 to ~60 words), so that a mean per micro-batch
    and the exact token-weighted mean over a window differ a lot."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(num_rows):
            words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "seven", "plus"])
                             for _ in range(rng.choice([1, 2, 40, 60])))
            row = {"messages": [{"role": "user", "content": f"Question {i}: say something."},
                                {"role": "assistant", "content": f"{words} \\boxed{{{i}}}"}],
                   "ground_truth": str(i)}  # what the RL loop's reward compares with
            f.write(json.dumps(row) + "\n")
    return str(path)


def write_text_corpus(path, rows: int, row_length: int, seed: int = 0) -> str:
    """A jsonl corpus of documents of very different lengths (1 to 60 words) whose tokens, each document followed by
    its separator, fill exactly `rows` packed rows of `row_length` (the last one part-filled): continued
    pretraining's data, with documents split across rows."""
    from model.tokenizer import load_tokenizer  # the real tokenizer, as train_pretrain.py counts
    tokenizer, rng = load_tokenizer(), random.Random(seed)
    texts, total = [], 0
    while total <= (rows - 1) * row_length:
        text = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "seven", "plus"])
                        for _ in range(rng.choice([1, 2, 40, 60])))
        tokens = len(tokenizer.encode(text)) + 1
        if total + tokens <= rows * row_length:
            texts.append(text)
            total += tokens
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
    return str(path)


def write_pairs_jsonl(path, num_rows: int, seed: int = 0) -> str:
    """Preference pairs in TRL's conversational schema whose answers have very different lengths (2 to ~60 words,
    chosen and rejected drawn apart), so that a mean per micro-batch and the exact mean over a window's pairs differ."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(num_rows):
            chosen, rejected = (" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "seven", "plus"])
                                         for _ in range(rng.choice([1, 2, 40, 60]))) for _ in range(2))
            row = {"prompt": [{"role": "user", "content": f"Question {i}: say something."}],
                   "chosen": [{"role": "assistant", "content": f"{chosen} \\boxed{{{i}}}"}],
                   "rejected": [{"role": "assistant", "content": f"{rejected} \\boxed{{{i + 1}}}"}],
                   "ground_truth": str(i)}
            f.write(json.dumps(row) + "\n")
    return str(path)


def give_another_tokenizer(model_dir) -> None:
    """Rename one added token in a model folder's tokenizer.json: same size, another vocabulary."""
    path = os.path.join(str(model_dir), "tokenizer.json")
    with open(path, encoding="utf-8") as f:
        tokenizer_json = json.load(f)
    tokenizer_json["added_tokens"][-1]["content"] = "<|a_token_only_the_teacher_has|>"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(tokenizer_json, f)


def reference_divergence(p_teacher, q_student, beta: float):
    """Generalized JSD by its definition, in probability space (no log-space tricks): beta 0 forward KL(p || q), 1
    reverse KL(q || p), between beta KL(p || m) + (1 - beta) KL(q || m) with m = beta p + (1 - beta) q. Zero
    probabilities contribute nothing (0 log 0 = 0). The losses' tests compare against it."""
    def kl(a, b):
        return torch.where(a > 0, a * (a.log() - b.log()), torch.zeros_like(a)).sum(-1)
    if beta == 0.0:
        return kl(p_teacher, q_student)
    if beta == 1.0:
        return kl(q_student, p_teacher)
    m = (1 - beta) * q_student + beta * p_teacher
    return beta * kl(p_teacher, m) + (1 - beta) * kl(q_student, m)


class Allocations(TorchDispatchMode):
    """While active, records in `shapes` the shape of every tensor an aten op creates: each output of an op none of
    whose outputs aliases an input (a view, an in-place or an out= result creates nothing)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if all(ret.alias_info is None for ret in func._schema.returns):
            self.shapes += [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else (out,))
                            if isinstance(t, torch.Tensor)]
        return out
