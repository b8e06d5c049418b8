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


def tool_agent_model(seed: int = 0, config: dict = TINY_CONFIG):
    """A tiny untied Qwen3 of `config`'s shape (the real vocabulary; SERVED_CONFIG's for a vLLM server) that plays an
    agent: every token's embedding is one shared vector
    plus a third of its random one, so every position computes about the same final hidden state h, and the head's
    rows are set along h so that at any position (temperature 1) EOS has probability ~0.36, `<tool_call>` ~0.24,
    seven ordinary tokens ~0.40 between them and the rest of the vocabulary ~1e-5: short turns, about half of them
    calling a tool (malformed calls, answered with an error text) -- multi-turn rollouts from a model of the tests'
    size. A peaked distribution, as a trained model's: a seeded draw lands within rounding of a token boundary about
    never (over a flat one it would, and a row's samples would change with its batch's padding, which moves its
    logits by rounding). The embeddings' own parts keep positions apart: with one embedding for all, attention's
    gradients would be zero up to rounding, which Adam's first steps blow up to whole updates."""
    from model import Qwen3Config, create_model
    from model.tokenizer import load_tokenizer
    model = create_model(Qwen3Config.from_dict({**config, "tie_word_embeddings": False}), seed=seed)
    tokenizer = load_tokenizer(None)
    with torch.no_grad():
        embeddings = model.model.embed_tokens.weight
        embeddings.copy_(embeddings[0] + (embeddings - embeddings[0]) / 3)
        h = model(torch.tensor([[0]]), return_hidden=True).hidden_states[0, -1]
        direction = h / h.dot(h)  # a head row c * direction gives the logit c at every position
        model.lm_head.weight.copy_(-20.0 * direction)
        model.lm_head.weight[tokenizer.eos_token_id] = 2.0 * direction
        model.lm_head.weight[tokenizer.token_to_id("<tool_call>")] = 1.6 * direction
        for token in tokenizer.encode(" the 1 2+3="):
            model.lm_head.weight[token] = 0.3 * direction
    return model
