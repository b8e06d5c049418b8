# python -m pytest tests/test_train_distillation.py
"""train_distillation.py (white-box KD on fixed data) on tiny Qwen3s with the real vocabulary, CPU: alpha=1 is SFT,
the logged ce / kd / loss and the gradient norm equal a plain-torch computation from full logits, a teacher whose
embedding is padded beyond the tokenizer distils over the tokenizer's vocabulary only, and bad set-ups (a teacher
with another tokenizer or too small a vocabulary, alpha or temperature out of range, no teacher) are refused at
start-up. Accumulation, DDP and resume equivalence for KD are in test_loop_invariants.py; the loss functions
themselves in test_losses.py."""
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from common.errors import UserError
from support import TINY_CONFIG, give_another_tokenizer
from dataset.collators import SFTCollator
from dataset.sources import RowDataset
from loop_helpers import loop_args, max_weight_diff, metrics, weights
from model import Qwen3Config, create_model, load_tokenizer, save_pretrained
from trainer.skeleton.data_stream import EpochSampler
from trainer.train_distillation import main as train_distillation
from trainer.train_sft import main as train_sft

# a teacher of another size than the student (as in the demo), with the same 151,936-row embedding and tokenizer
TEACHER_CONFIG = {**TINY_CONFIG, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3,
                  "head_dim": 24}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def make_teacher(path, sharpen: float = 1.0, **config) -> str:
    """A random teacher; `sharpen` scales its (tied) embedding so that its distributions are far from uniform and
    far from the student's: a KL of several nats instead of ~0.03, so that every term of the loss matters."""
    model = create_model(Qwen3Config.from_dict({**TEACHER_CONFIG, **config}), seed=123)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(sharpen)
    save_pretrained(model, str(path))
    return str(path)


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """Shared by the module's tests: read-only (a test that changes it works on a copy)."""
    return make_teacher(tmp_path_factory.mktemp("teacher") / "teacher", sharpen=30.0)


def kd_args(config, data, save_dir, teacher, **flags) -> list[str]:
    return loop_args(config, data, save_dir, **{"teacher_path": teacher, **flags})


@pytest.mark.slow
def test_alpha_one_is_sft(tiny_config_path, chat_jsonl, teacher_dir, tmp_path):
    # alpha=1: loss = CE + 0 * KD, so the student follows exactly the SFT loop's trajectory on the same stream
    flags = dict(batch=2, accumulation=2, max_steps=2)
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path / "sft", **flags))
    train_distillation(kd_args(tiny_config_path, chat_jsonl, tmp_path / "kd", teacher_dir, alpha=1.0, **flags))
    assert max_weight_diff(weights(tmp_path / "sft"), weights(tmp_path / "kd")) <= 1e-6
    sft, kd = metrics(tmp_path / "sft"), metrics(tmp_path / "kd")
    assert len(sft) == len(kd) == 2
    assert [m["tokens"] for m in kd] == [m["tokens"] for m in sft]
    for s, k in zip(sft, kd):
        assert k["loss"] == pytest.approx(s["loss"], rel=1e-6)
        assert k["ce"] == pytest.approx(s["loss"], rel=1e-6)
        assert k["grad_norm"] == pytest.approx(s["grad_norm"], rel=1e-5)
        assert k["kd"] > 1.0  # the KD term is computed (and large) but carries no weight


def test_a_skew_kl_at_zero_is_the_kl(tiny_config_path, chat_jsonl, teacher_dir, tmp_path):
    """--divergence skew_kl --skew 0: KL(teacher || student) itself, the same two steps as --divergence kl."""
    flags = dict(batch=2, accumulation=2, max_steps=2, alpha=0.3, temperature=2.0)
    train_distillation(kd_args(tiny_config_path, chat_jsonl, tmp_path / "kl", teacher_dir, **flags))
    train_distillation(kd_args(tiny_config_path, chat_jsonl, tmp_path / "skew", teacher_dir, divergence="skew_kl",
                               skew=0.0, **flags))
    assert max_weight_diff(weights(tmp_path / "kl"), weights(tmp_path / "skew")) <= 1e-6
    assert metrics(tmp_path / "skew")[0]["kd"] == pytest.approx(metrics(tmp_path / "kl")[0]["kd"], rel=1e-5)


def test_logged_ce_kd_loss_and_grad_norm_equal_a_full_logits_computation(tiny_config_path, chat_jsonl, teacher_dir,
                                                                         tmp_path):
    alpha, temperature = 0.3, 2.0
    # seed 10: the first step's 4 rows mix short and long completions (left padding of very different widths)
    train_distillation(kd_args(tiny_config_path, chat_jsonl, tmp_path, teacher_dir, batch=4, max_steps=1, seed=10,
                               alpha=alpha, temperature=temperature, loss_chunk_size=16))
    logged = metrics(tmp_path)[0]

    # independently: the step's rows, both models' full logits, plain torch.nn.functional
    tokenizer = load_tokenizer(None)
    vocab = len(tokenizer)
    dataset = RowDataset(chat_jsonl)
    rows = [dataset[i] for i in list(EpochSampler(len(dataset), seed=10, epoch=0))[:4]]
    batch = SFTCollator(tokenizer, 96, 32, enable_thinking=False)(rows)
    targets = batch["labels"][:, 1:]
    mask = targets != -100
    student = create_model(Qwen3Config.from_json(tiny_config_path), seed=10)  # --model_config with --seed 10
    teacher = create_model(Qwen3Config.from_dict(TEACHER_CONFIG), seed=123)
    with torch.no_grad():
        teacher.model.embed_tokens.weight.mul_(30.0)
        teacher_logits = teacher(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    teacher_logits = teacher_logits[:, :-1][mask][:, :vocab]
    student_logits = student(batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1][mask][:, :vocab]
    num_tokens = int(mask.sum())

    ce = F.cross_entropy(student_logits.double(), targets[mask], reduction="sum") / num_tokens
    kl = F.kl_div(F.log_softmax(student_logits.double() / temperature, dim=-1),
                  F.log_softmax(teacher_logits.double() / temperature, dim=-1), log_target=True,
                  reduction="none").sum(-1)  # KL(teacher || student) per token, over the tokenizer's vocabulary
    kd = temperature ** 2 * kl.sum() / num_tokens
    assert logged["tokens"] == num_tokens
    loss = alpha * ce + (1 - alpha) * kd
    assert logged["ce"] == pytest.approx(ce.detach().item(), rel=1e-5)
    assert logged["kd"] == pytest.approx(kd.detach().item(), rel=1e-5)
    assert logged["loss"] == pytest.approx(loss.detach().item(), rel=1e-5)
    assert kd.item() > 1.0 and abs(ce.item() - kd.item()) > 1.0, "the two terms must be told apart"

    # the gradient is that of the same loss, with respect to the student only
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in student.parameters()]))
    assert logged["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)


@pytest.mark.slow
def test_a_teacher_with_a_padded_embedding_distils_over_the_tokenizers_vocabulary(tiny_config_path, chat_jsonl,
                                                                                 tmp_path):
    # Qwen checkpoints pad the embedding beyond the tokenizer (e.g. 151,936 rows for 151,669 tokens); rows beyond
    # the tokenizer must take no probability mass: huge padding rows change nothing
    vocab = len(load_tokenizer(None))
    plain = create_model(Qwen3Config.from_dict(TEACHER_CONFIG), seed=123)
    padded = create_model(Qwen3Config.from_dict({**TEACHER_CONFIG, "vocab_size": 152064}), seed=5)
    state = plain.state_dict()
    with torch.no_grad():
        for name, tensor in padded.state_dict().items():
            if name == "model.embed_tokens.weight":  # tied: lm_head.weight is the same tensor
                tensor[:vocab] = state[name][:vocab]
                # every row beyond the tokenizer: logits of about +-100, which would win any softmax they entered
                tensor[vocab:] = 10.0 * torch.randn(tensor.shape[0] - vocab, tensor.shape[1],
                                                    generator=torch.Generator().manual_seed(0))
            elif name != "lm_head.weight":
                tensor.copy_(state[name])
    assert padded.lm_head.weight.data_ptr() == padded.model.embed_tokens.weight.data_ptr()
    save_pretrained(plain, str(tmp_path / "plain"))
    save_pretrained(padded, str(tmp_path / "padded"))
    for name in ("plain", "padded"):  # alpha=0 (the end of the range): pure KD
        train_distillation(kd_args(tiny_config_path, chat_jsonl, tmp_path / f"kd_{name}", tmp_path / name, batch=4,
                                   max_steps=1, alpha=0.0))
    assert max_weight_diff(weights(tmp_path / "kd_plain"), weights(tmp_path / "kd_padded")) <= 1e-6
    plain_metrics, padded_metrics = metrics(tmp_path / "kd_plain")[0], metrics(tmp_path / "kd_padded")[0]
    assert padded_metrics["kd"] == pytest.approx(plain_metrics["kd"], rel=1e-6)
    assert padded_metrics["loss"] == pytest.approx(padded_metrics["kd"], rel=1e-6)


def test_a_teacher_with_another_tokenizer_is_refused(tiny_config_path, chat_jsonl, teacher_dir, tmp_path):
    teacher_dir = shutil.copytree(teacher_dir, tmp_path / "teacher")
    give_another_tokenizer(teacher_dir)
    with pytest.raises(UserError, match="tokenizer .* differs"):
        train_distillation(kd_args(tiny_config_path, chat_jsonl, tmp_path, teacher_dir, max_steps=1))
    assert not os.path.exists(tmp_path / "run_resume.pt")


def test_a_teacher_with_fewer_rows_than_the_tokenizer_is_refused(tiny_config_path, chat_jsonl, tmp_path):
    teacher = make_teacher(tmp_path / "small_vocab", vocab_size=1000)
    with pytest.raises(UserError, match="teacher's embedding has 1000 rows"):
        train_distillation(kd_args(tiny_config_path, chat_jsonl, tmp_path, teacher, max_steps=1))


@pytest.mark.parametrize("flags, message", [
    ({"alpha": -0.1}, "--alpha must be in"),
    ({"alpha": 1.5}, "--alpha must be in"),
    ({"skew": 0.3}, "--skew is the skew"),
    ({"divergence": "skew_rkl", "skew": 1.0}, "--skew must be in"),
    ({"temperature": 0.0}, "--temperature must be > 0"),
    ({"teacher_path": None}, "no teacher model"),  # default SAVE_DIR/sft, where nothing was trained
])
def test_impossible_flags_are_refused(tiny_config_path, chat_jsonl, teacher_dir, tmp_path, flags, message):
    with pytest.raises(UserError, match=message):
        train_distillation(kd_args(tiny_config_path, chat_jsonl, tmp_path, teacher_dir, **{"max_steps": 1, **flags}))
