# python -m pytest tests/test_train_opd.py
"""train_opd.py on tiny Qwen3s (CPU): labels cover exactly the sampled tokens through the first EOS, the logged loss
is the generalized JSD of independently computed logits, lmbda=0 is KD on the data's completions, per-row sampling
seeds make samples independent of batching, and bad set-ups are refused at start-up. Accumulation, DDP and
SIGKILL-resume equivalence for OPD are in test_loop_invariants.py."""
import json

import pytest
import torch

from common.errors import UserError
from dataset.collators import build_sequences
from dataset.sources import RowDataset
from loop_helpers import first_step_samples, loop_args, max_weight_diff, metrics, weights
from support import give_another_tokenizer
from model import Qwen3Config, create_model, generate, load_pretrained, load_tokenizer, save_pretrained
from trainer.losses.closed_forms import generalized_jsd_loss
from trainer.skeleton.data_stream import EpochSampler
from trainer.train_distillation import main as train_distillation
from trainer.train_opd import main as train_opd

EOS, PAD = 151645, 151643


def test_labels_cover_the_sampled_tokens_through_the_first_eos_only():
    prompt_ids = torch.tensor([[PAD, PAD, 11, 12], [21, 22, 23, 24]])
    prompt_mask = (prompt_ids != PAD).long()
    completion_ids = torch.tensor([[5, 6, EOS, PAD, PAD], [7, EOS, PAD, PAD, PAD]])
    completion_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    input_ids, attention_mask, labels = build_sequences(prompt_ids, prompt_mask, completion_ids, completion_mask)
    # right padded for the training forward: each row's prompt and completion from position 0, the width of the
    # longest row
    assert input_ids.tolist() == [[11, 12, 5, 6, EOS, PAD], [21, 22, 23, 24, 7, EOS]]
    assert labels.tolist() == [[-100, -100, 5, 6, EOS, -100], [-100] * 4 + [7, EOS]]
    assert attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]


def test_generated_eos_ends_the_labels(tiny_config_path):
    model = create_model(Qwen3Config.from_json(tiny_config_path), seed=0).eval()
    prompt_ids = torch.tensor([[PAD, 100, 200], [300, 400, 500]])
    prompt_mask = (prompt_ids != PAD).long()
    greedy = generate(model, prompt_ids, prompt_mask, 6, do_sample=False)
    eos = int(greedy.completion_ids[0, 2])  # pretend the third greedy token of row 0 is the EOS
    out = generate(model, prompt_ids, prompt_mask, 6, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    _, _, labels = build_sequences(prompt_ids, prompt_mask, out.completion_ids, out.completion_mask)
    row = out.completion_ids[0].tolist()
    first_eos = row.index(eos)
    assert labels[0, :2].tolist() == [-100, -100]  # the two real prompt tokens come first (right padded)
    assert labels[0, 2:].tolist() == row[:first_eos + 1] + [-100] * (labels.shape[1] - 3 - first_eos)
    assert all(token == PAD for token in row[first_eos + 1:])


def test_per_row_seeds_make_samples_independent_of_batch_mates(tiny_config_path):
    model = create_model(Qwen3Config.from_json(tiny_config_path), seed=0).eval()
    prompts = torch.randint(0, 1000, (4, 5))
    mask = torch.ones_like(prompts)
    seeds = [11, 22, 33, 44]
    together = generate(model, prompts, mask, 6, generator=[torch.Generator().manual_seed(s) for s in seeds])
    alone = [generate(model, prompts[i:i + 1], mask[i:i + 1], 6,
                      generator=[torch.Generator().manual_seed(seeds[i])]).completion_ids[0] for i in range(4)]
    assert torch.equal(together.completion_ids, torch.stack(alone))
    other = generate(model, prompts, mask, 6, generator=[torch.Generator().manual_seed(s + 1) for s in seeds])
    assert not torch.equal(together.completion_ids, other.completion_ids)


@pytest.fixture
def teacher_dir(tiny_config_path, tmp_path):
    save_pretrained(create_model(Qwen3Config.from_json(tiny_config_path), seed=123), str(tmp_path / "teacher"))
    return str(tmp_path / "teacher")


def opd_args(config, data, save_dir, teacher, **flags) -> list[str]:
    return loop_args(config, data, save_dir, teacher_path=teacher, **{"max_new_tokens": 8, **flags})


def test_logged_loss_is_the_jsd_of_independently_computed_logits(tiny_config_path, chat_jsonl, teacher_dir,
                                                                  tmp_path):
    train_opd(opd_args(tiny_config_path, chat_jsonl, tmp_path, teacher_dir, batch=4, max_steps=1, beta=0.5,
                       temperature=1.5))
    logged = metrics(tmp_path)[0]

    tokenizer = load_tokenizer(None)
    student = create_model(Qwen3Config.from_json(tiny_config_path), seed=7).eval()  # --seed 7 initialises it
    teacher = load_pretrained(teacher_dir).eval()
    dataset = RowDataset(chat_jsonl)
    rows = [dataset[i] for i in list(EpochSampler(len(dataset), seed=7, epoch=0))[:4]]
    input_ids, attention_mask, labels = first_step_samples(student, tokenizer, rows, seed=7)
    with torch.no_grad():
        student_logits = student(input_ids, attention_mask=attention_mask).logits[:, :-1, :len(tokenizer)]
        teacher_logits = teacher(input_ids, attention_mask=attention_mask).logits[:, :-1, :len(tokenizer)]
    expected = generalized_jsd_loss(student_logits, teacher_logits, labels[:, 1:], beta=0.5, temperature=1.5)
    assert logged["tokens"] == int((labels != -100).sum())
    assert logged["loss"] == pytest.approx(float(expected), rel=1e-5)
    assert logged["generated_tokens"] == logged["tokens"]


@pytest.mark.slow
def test_use_compile_trains_as_the_eager_run_to_rounding(tiny_config_path, chat_jsonl, teacher_dir, tmp_path):
    """--use_compile 1 --decode compiled: the layers compiled for training and the decode step of the rollouts and
    of the held-out evaluation compiled (one Decoder, its graphs traced through the compiled layers) -- the eager run's numbers to
    rounding. Top-4 samples: 4 CDF boundaries for a rounding difference to flip a draw at."""
    runs = {}
    for compiled in (0, 1):
        train_opd(opd_args(tiny_config_path, chat_jsonl, tmp_path / f"c{compiled}", teacher_dir, batch=2,
                           max_steps=3, top_k=4, use_compile=compiled, decode=["eager", "compiled"][compiled], eval_interval=3,
                           eval_rows=4))
        runs[compiled] = metrics(tmp_path / f"c{compiled}")
    for eager, compiled in zip(runs[0], runs[1]):
        assert eager.keys() == compiled.keys()
        for key in ("loss", "tokens", "eval/reverse_kl", "eval/completion_len"):
            if key in eager:
                assert compiled[key] == pytest.approx(eager[key], rel=1e-4), key
    assert max_weight_diff(weights(tmp_path / "c0"), weights(tmp_path / "c1")) <= 1e-5


@pytest.mark.slow
def test_lmbda_zero_is_kd_on_the_datasets_completions(tiny_config_path, chat_jsonl, teacher_dir, tmp_path):
    # OPD with beta=0 is KL(teacher || student) per token; KD with alpha=0 and T=1 is the same loss
    train_opd(opd_args(tiny_config_path, chat_jsonl, tmp_path / "opd", teacher_dir, batch=4, max_steps=2, lmbda=0.0,
                       beta=0.0))
    train_distillation(loop_args(tiny_config_path, chat_jsonl, tmp_path / "kd", teacher_path=teacher_dir, batch=4,
                                 max_steps=2, alpha=0.0))
    assert max_weight_diff(weights(tmp_path / "opd"), weights(tmp_path / "kd")) <= 1e-6
    assert [m["on_policy_share"] for m in metrics(tmp_path / "opd")] == [0, 0]


def test_mismatched_tokenizers_are_refused(tiny_config_path, chat_jsonl, teacher_dir, tmp_path):
    give_another_tokenizer(teacher_dir)
    with pytest.raises(UserError, match="tokenizer .* differs"):
        train_opd(opd_args(tiny_config_path, chat_jsonl, tmp_path, teacher_dir, max_steps=1))


@pytest.mark.parametrize("loss, beta", [("skew_rkl", 1.0), ("skew_kl", 0.0)])
def test_skew_at_zero_trains_as_the_jsd_at_its_end(tiny_config_path, chat_jsonl, teacher_dir, tmp_path, loss, beta):
    """--loss skew_rkl --skew 0 is the reverse KL (--beta 1), skew_kl --skew 0 the forward KL (--beta 0): the same
    first step (loss, gradient norm) and, two steps on, the same weights to AdamW's amplified rounding (its update
    divides each gradient entry by its own size, so entries near 0 carry their rounding into the step)."""
    common = dict(batch=4, max_steps=2)
    train_opd(opd_args(tiny_config_path, chat_jsonl, tmp_path / "skew", teacher_dir, loss=loss, skew=0.0, **common))
    train_opd(opd_args(tiny_config_path, chat_jsonl, tmp_path / "jsd", teacher_dir, beta=beta, **common))
    skew, jsd = metrics(tmp_path / "skew")[0], metrics(tmp_path / "jsd")[0]
    assert skew["loss"] == pytest.approx(jsd["loss"], rel=1e-5)
    assert skew["grad_norm"] == pytest.approx(jsd["grad_norm"], rel=1e-5)
    assert max_weight_diff(weights(tmp_path / "skew"), weights(tmp_path / "jsd")) <= 1e-5


def test_speculative_kd_with_k_the_vocabulary_trains_as_plain_opd(tiny_config_path, chat_jsonl, teacher_dir,
                                                                    tmp_path):
    """--skd_topk K: K = the vocabulary keeps every proposal, so the run is plain OPD's bit for bit; K = 1 replaces
    the proposals that are not the teacher's argmax, and logs their share."""
    common = dict(batch=4, max_steps=2, decode="eager")
    train_opd(opd_args(tiny_config_path, chat_jsonl, tmp_path / "plain", teacher_dir, **common))
    train_opd(opd_args(tiny_config_path, chat_jsonl, tmp_path / "skd", teacher_dir, skd_topk=151936, **common))
    assert max_weight_diff(weights(tmp_path / "plain"), weights(tmp_path / "skd")) == 0
    assert [m["skd_replaced_share"] for m in metrics(tmp_path / "skd")] == [0.0, 0.0]
    train_opd(opd_args(tiny_config_path, chat_jsonl, tmp_path / "top1", teacher_dir, skd_topk=1, **common))
    assert all(0 < m["skd_replaced_share"] <= 1 for m in metrics(tmp_path / "top1"))


@pytest.mark.slow
def test_speculative_kd_in_the_compiled_decode_step_trains_as_in_the_eager_one(tiny_config_path, chat_jsonl,
                                                                               teacher_dir, tmp_path):
    """--skd_topk with --decode compiled (the default on CUDA): the teacher decodes inside the compiled step, and
    the run replaces the same tokens and ends at the same weights as with the eager step (--top_k 4: few CDF
    boundaries for inductor's rounding to cross; the training steps themselves are eager in both)."""
    common = dict(batch=4, max_steps=2, skd_topk=2, top_k=4)
    for decode in ("eager", "compiled"):
        train_opd(opd_args(tiny_config_path, chat_jsonl, tmp_path / decode, teacher_dir, decode=decode, **common))
    assert max_weight_diff(weights(tmp_path / "eager"), weights(tmp_path / "compiled")) == 0
    shares = [[m["skd_replaced_share"] for m in metrics(tmp_path / decode)] for decode in ("eager", "compiled")]
    assert shares[0] == shares[1] and all(0 < share < 1 for share in shares[0]), shares


@pytest.mark.parametrize("flags, message", [
    ({"skd_topk": 4, "loss": "sampled_kl"}, "--skd_topk with --loss sampled_kl"),
    ({"loss": "skew_kl", "teacher_topk": 4}, "whole distribution"),
    ({"skew": 0.2}, "--skew is the skew"),
    ({"lmbda": 1.5}, "lmbda"),
    ({"beta": -0.1}, "beta"),
    ({"loss": "sampled_kl", "lmbda": 0.5}, "sampled_kl"),
    ({"max_new_tokens": 80}, "max_new_tokens"),
])
def test_impossible_flags_are_refused(tiny_config_path, chat_jsonl, teacher_dir, tmp_path, flags, message):
    with pytest.raises(UserError, match=message):
        train_opd(opd_args(tiny_config_path, chat_jsonl, tmp_path, teacher_dir, **flags))


def test_lmbda_below_one_needs_completions(tiny_config_path, teacher_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 1 + 1?"}]}) + "\n")
    with pytest.raises(UserError, match="no assistant turn"):
        train_opd(opd_args(tiny_config_path, str(prompts), tmp_path, teacher_dir, lmbda=0.5))


def test_sampled_kl_mode_trains(tiny_config_path, chat_jsonl, teacher_dir, tmp_path):
    train_opd(opd_args(tiny_config_path, chat_jsonl, tmp_path, teacher_dir, batch=4, max_steps=2, loss="sampled_kl"))
    logged = metrics(tmp_path)
    assert len(logged) == 2 and all("reverse_kl_estimate" in m for m in logged)
