# python -m pytest tests/test_value_model.py
"""PPO's critic as train_ppo.py builds it (trainer/rl/critic.py's build_critic): from the student's own source its
body is the student's (the same hidden states) and its head one zero row; its export is transformers'
Qwen3ForTokenClassification with one label, whose per-token values equal ours; --critic_path takes such an export
whole, or a causal LM's body; a LoRA critic holds the student's frozen tensors themselves, its adapters and head
its own."""
import argparse
import json

import pytest
import torch

from model import Qwen3Config, create_model
from model.checkpoint_io import save_pretrained
from model.config import ModelFileError
from trainer.rl.critic import build_critic
from trainer.skeleton.loading import build_model, lora_settings

CONFIG = dict(vocab_size=151936, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, max_position_embeddings=128)


def flags(**given) -> argparse.Namespace:
    """The flags build_model and build_critic read, as train_ppo.py's parser leaves them."""
    defaults = dict(fsdp=0, dtype="float32", seed=0, model_path=None, model_config=None, critic_path=None,
                    lora_rank=0, lora_alpha=32.0, lora_dropout=0.0, lora_targets="q_proj,k_proj,v_proj,o_proj")
    return argparse.Namespace(**{**defaults, **given})


@pytest.fixture
def student_dir(tmp_path) -> str:
    save_pretrained(create_model(Qwen3Config(**CONFIG), seed=1), str(tmp_path / "student"))
    return str(tmp_path / "student")


def hidden(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, return_hidden=True).hidden_states


def test_the_critic_starts_as_the_students_body_with_a_zero_head(student_dir, tmp_path):
    """From the student's folder, and from its config and seed (a random student): the student's hidden states, V = 0
    everywhere, a head of its own (never tied to the embedding)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(Qwen3Config(**CONFIG).to_hf_dict()))
    ids = torch.randint(0, 1000, (2, 6))
    for args in (flags(model_path=student_dir), flags(model_config=str(config), seed=3)):
        student = build_model(args, "cpu", path=args.model_path, config_path=args.model_config)
        critic = build_critic(args, "cpu", student)
        assert torch.equal(hidden(critic, ids), hidden(student, ids))
        with torch.no_grad():
            assert torch.equal(critic(ids).logits, torch.zeros(2, 6, 1))
        assert critic.lm_head.weight.data_ptr() != critic.model.embed_tokens.weight.data_ptr()


def trained_critic(student_dir: str):
    """The critic of the student's folder with a random head and changed body: what a run exports."""
    args = flags(model_path=student_dir)
    critic = build_critic(args, "cpu", build_model(args, "cpu", path=student_dir))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        critic.lm_head.weight.normal_(generator=generator)
        critic.model.norm.weight.add_(torch.randn(critic.model.norm.weight.shape, generator=generator))
    return critic


def test_the_export_is_transformers_token_classification_with_our_values(student_dir, tmp_path):
    from transformers import AutoModelForTokenClassification
    critic = trained_critic(student_dir)
    save_pretrained(critic, str(tmp_path / "critic"))
    theirs = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic")).eval()
    assert type(theirs).__name__ == "Qwen3ForTokenClassification"
    ids = torch.randint(0, 1000, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    with torch.no_grad():
        ours, reference = critic(ids, attention_mask=mask).logits, theirs(ids, attention_mask=mask).logits
    assert torch.allclose(ours[mask.bool()], reference[mask.bool()], atol=1e-5)


def test_critic_path_takes_a_critics_export_whole_and_a_causal_lms_body(student_dir, tmp_path):
    """--critic_path: an export (NAME_critic/) comes back with its head, the same values bit for bit; a causal LM's
    folder gives its body and a zero head; a folder that is no model is one error naming it."""
    critic = trained_critic(student_dir)
    save_pretrained(critic, str(tmp_path / "critic"))
    ids = torch.randint(0, 1000, (2, 5))
    student = build_model(flags(), "cpu", path=student_dir)
    again = build_critic(flags(model_path=student_dir, critic_path=str(tmp_path / "critic")), "cpu", student)
    with torch.no_grad():
        assert torch.equal(again(ids).logits, critic(ids).logits) and again.lm_head.weight.abs().sum() > 0
    other = tmp_path / "other"
    save_pretrained(create_model(Qwen3Config(**CONFIG), seed=7), str(other))
    body = build_critic(flags(model_path=student_dir, critic_path=str(other)), "cpu", student)
    assert torch.equal(hidden(body, ids), hidden(create_model(Qwen3Config(**CONFIG), seed=7), ids))
    assert not body.lm_head.weight.any()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelFileError, match="empty"):
        build_critic(flags(model_path=student_dir, critic_path=str(tmp_path / "empty")), "cpu", student)


def test_a_lora_critic_holds_the_students_frozen_tensors_and_trains_its_adapters_and_head(student_dir):
    """--lora_rank: the critic's frozen body is the student's tensors (one copy of the base), its adapters and its
    head (fp32, trained whole) its own; a --critic_path critic keeps a body of its own."""
    args = flags(model_path=student_dir, lora_rank=4, lora_alpha=8.0)
    student = build_model(args, "cpu", path=student_dir, lora=lora_settings(args))
    critic = build_critic(args, "cpu", student)
    own = dict(student.named_parameters())
    trained = {name for name, p in critic.named_parameters() if p.requires_grad}
    assert trained == {name for name in own if ".lora_" in name} | {"lm_head.weight"}
    for name, p in critic.named_parameters():
        assert (p is own.get(name)) == (name not in trained), name
    assert critic.lm_head.weight.dtype == torch.float32
    ids = torch.randint(0, 1000, (2, 5))
    assert torch.equal(hidden(critic, ids), hidden(student, ids))  # B = 0: the adapters change nothing yet
