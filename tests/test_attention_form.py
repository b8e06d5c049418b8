# python -m pytest tests/test_attention_form.py
"""Training forwards reach the fused attention kernels by construction: right-padded rows, plain causal attention,
no mask tensor (CUDA's flash kernel takes no attn_mask at all). Proven here with a spy on
F.scaled_dot_product_attention in the three loops (students and teachers), and by the numbers: the right-padded,
unmasked forward gives the left-padded, masked forward's losses and gradients."""
import pytest
import torch
import torch.nn.functional as F

import model.qwen3 as qwen3
import trainer.evaluation.heldout as heldout
import trainer.rollouts.source as rollouts_module
from dataset.collators import IGNORE_INDEX, SFTCollator
from loop_helpers import loop_args
from model import Qwen3Config, create_model, load_pretrained, load_tokenizer, save_pretrained
from support import write_chat_jsonl
from trainer.losses.chunked import chunked_sft_loss, completion_hidden
from trainer.train_distillation import main as train_distillation
from trainer.train_opd import main as train_opd
from trainer.train_sft import main as train_sft


@pytest.fixture
def attention_calls(monkeypatch):
    """Every SDPA call of the model: (mask given, is_causal, GQA, inside generation)."""
    calls, generating = [], [False]
    original = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kwargs):
        calls.append({"mask": attn_mask is not None, "causal": is_causal, "gqa": enable_gqa,
                      "generating": generating[0]})
        return original(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kwargs)

    def marking(generate):
        def wrapper(*args, **kwargs):
            generating[0] = True
            try:
                return generate(*args, **kwargs)
            finally:
                generating[0] = False
        return wrapper

    monkeypatch.setattr(qwen3.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(rollouts_module, "generate", marking(rollouts_module.generate))
    monkeypatch.setattr(heldout, "generate", marking(heldout.generate))
    return calls


def training_forms(calls: list[dict]) -> set[tuple]:
    return {(c["mask"], c["causal"], c["gqa"]) for c in calls if not c["generating"]}


def test_sft_kd_and_opd_train_with_unmasked_causal_attention(tiny_config_path, tmp_path, attention_calls,
                                                             one_thread):
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 8)
    train_sft(loop_args(tiny_config_path, data, tmp_path, name="sft", max_steps=1))
    assert training_forms(attention_calls) == {(False, True, True)}  # no mask, causal, GQA (4 heads, 2 KV heads)
    attention_calls.clear()
    teacher = str(tmp_path / "sft")
    train_distillation(loop_args(tiny_config_path, data, tmp_path, name="kd", max_steps=1, teacher_path=teacher))
    assert training_forms(attention_calls) == {(False, True, True)}  # the teacher's forward and the student's
    attention_calls.clear()
    train_opd(loop_args(tiny_config_path, data, tmp_path, name="opd", max_steps=2, teacher_path=teacher,
                        max_new_tokens=8, lmbda=0.5))
    assert training_forms(attention_calls) == {(False, True, True)}
    # generation (left-padded prompts, the KV-cache decode steps) keeps its mask
    assert {c["mask"] for c in attention_calls if c["generating"]} == {True}


def left_padded(batch: dict) -> dict:
    """The same rows as the collator used to give them: padding first, every row's tokens at the end."""
    lengths = batch["attention_mask"].sum(dim=1)
    shifts = batch["input_ids"].shape[1] - lengths
    return {key: torch.stack([row.roll(int(shift)) for row, shift in zip(value, shifts)])
            for key, value in batch.items()}


def masked_hidden(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous training forward: left-padded rows, a dense mask, positions from the mask."""
    hidden = model(batch["input_ids"], attention_mask=batch["attention_mask"], return_hidden=True).hidden_states
    hidden, targets = hidden[:, :-1], batch["labels"][:, 1:]
    keep = targets != IGNORE_INDEX
    return hidden[keep], targets[keep]


def loss_and_grads(model, hidden_and_targets) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    hidden, targets = hidden_and_targets
    loss, _ = chunked_sft_loss(hidden, model.lm_head.weight, targets, chunk_size=64, vocab_size=151669)
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_right_padded_unmasked_forward_equals_the_left_padded_masked_one(tiny_config_path, tmp_path, one_thread):
    tokenizer = load_tokenizer(None)
    rows = [{"messages": [{"role": "user", "content": f"Question {i}: " + "word " * (3 + 9 * i)},
                          {"role": "assistant", "content": "answer " * (2 + 12 * i)}]} for i in range(3)]
    batch = SFTCollator(tokenizer, max_length=96, max_prompt_length=48)(rows)
    assert int((batch["attention_mask"] == 0).sum()) > 10  # rows of different lengths: real padding
    model = create_model(Qwen3Config.from_json(tiny_config_path), seed=3)
    loss, grads = loss_and_grads(model, completion_hidden(model, batch["input_ids"], batch["attention_mask"],
                                                          batch["labels"]))
    reference_loss, reference_grads = loss_and_grads(model, masked_hidden(model, left_padded(batch)))
    assert abs(loss - reference_loss) <= 1e-6 * abs(reference_loss)
    for name, grad in grads.items():
        assert (grad - reference_grads[name]).abs().max() <= 1e-6 * reference_grads[name].abs().max(), name


def test_completion_hidden_refuses_left_padded_rows(tiny_config_path):
    model = create_model(Qwen3Config.from_json(tiny_config_path), seed=0)
    ids = torch.tensor([[0, 5, 6, 7]])
    with pytest.raises(ValueError, match="right-padded"):
        completion_hidden(model, ids, torch.tensor([[0, 1, 1, 1]]), torch.tensor([[-100, -100, 6, 7]]))


def test_rope_frequencies_stay_fp32_and_both_bf16_constructors_agree(tiny_config_path, tmp_path):
    config = Qwen3Config.from_json(tiny_config_path)
    save_pretrained(create_model(config, seed=5), str(tmp_path / "m"))
    built = create_model(config, seed=5, dtype=torch.bfloat16)
    loaded = load_pretrained(str(tmp_path / "m"), dtype=torch.bfloat16)
    cast = create_model(config, seed=5).half().to(torch.bfloat16)  # any later cast keeps them fp32 too
    for model in (built, loaded, cast):
        assert model.model.rotary_emb.inv_freq.dtype == torch.float32
        assert model.lm_head.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 151669, (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(built(ids).logits, loaded(ids).logits)
