# python -m pytest tests/test_value_model.py
"""model/value.py's critic: its body is the policy's (the same hidden states), its head one zero row at the start,
and its export is transformers' Qwen3ForTokenClassification with one label, whose per-token values equal ours."""
import torch

from model import Qwen3Config, create_model
from model.checkpoint_io import save_pretrained
from model.value import value_model_from

CONFIG = dict(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128)


def test_the_critic_starts_as_the_policys_body_with_a_zero_head():
    policy = create_model(Qwen3Config(**CONFIG), seed=1)
    critic = value_model_from(policy)
    ids = torch.randint(0, 1000, (2, 6))
    assert torch.equal(critic(ids, return_hidden=True).hidden_states, policy(ids, return_hidden=True).hidden_states)
    assert torch.equal(critic(ids).logits, torch.zeros(2, 6, 1))
    assert critic.lm_head.weight.data_ptr() != critic.model.embed_tokens.weight.data_ptr()  # never tied


def test_the_export_is_transformers_token_classification_with_our_values(tmp_path):
    from transformers import AutoModelForTokenClassification
    critic = value_model_from(create_model(Qwen3Config(**CONFIG), seed=1))
    with torch.no_grad():
        critic.lm_head.weight.normal_(generator=torch.Generator().manual_seed(2))
    save_pretrained(critic, str(tmp_path / "critic"))
    theirs = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic")).eval()
    assert type(theirs).__name__ == "Qwen3ForTokenClassification"
    ids = torch.randint(0, 1000, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    with torch.no_grad():
        ours, reference = critic(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits
    assert torch.allclose(ours[mask.bool()], reference[mask.bool()], atol=1e-5)
