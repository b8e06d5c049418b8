# python -m pytest tests/test_train_sft.py
"""train_sft.py on a tiny Qwen3 (real 151,936 vocabulary, CPU): the logged loss is the step's token-weighted mean,
the loss falls, damaged and foreign checkpoints are refused, swanlab offline resumes its run id, bad flags are
refused. The invariants shared by all loops (accumulation, DDP, resume) are in test_loop_invariants.py."""
import os

import pytest
import torch
import torch.nn.functional as F

from support import write_chat_jsonl
from loop_helpers import loop_args, max_weight_diff, metrics, script_exit, weights
from common.errors import UserError
from dataset.collators import SFTCollator
from dataset.sources import RowDataset
from model import Qwen3Config, create_model, load_tokenizer, save_pretrained
from trainer.skeleton.data_stream import EpochSampler
from trainer.train_sft import main as train_sft

def sft_args(*args, **kwargs) -> list[str]:
    return loop_args(*args, name="sft", **kwargs)


def test_logged_loss_is_the_token_weighted_mean_of_the_step(tiny_config_path, chat_jsonl, tmp_path):
    # a random init predicts every token at about log(V); larger embeddings make per-token losses differ, so that a
    # mean of micro-batch means and the token-weighted mean are different numbers
    model = create_model(Qwen3Config.from_json(tiny_config_path), seed=7)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(40.0)
    save_pretrained(model, str(tmp_path / "init"))
    # seed 10 puts two short and two long rows into the step: micro-batches of 18 and 115 loss tokens
    train_sft(sft_args(None, chat_jsonl, tmp_path, batch=2, accumulation=2, max_steps=1, seed=10,
                       model_path=tmp_path / "init"))
    logged = metrics(tmp_path, "sft")[0]

    # independently: the same weights, the step's 4 rows, full logits, one cross entropy over all their tokens
    tokenizer = load_tokenizer(None)
    dataset = RowDataset(chat_jsonl)
    rows = [dataset[i] for i in list(EpochSampler(len(dataset), seed=10, epoch=0))[:4]]
    batch = SFTCollator(tokenizer, 96, 32, enable_thinking=False)(rows)
    with torch.no_grad():
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1, :len(tokenizer)]
    targets = batch["labels"][:, 1:]
    token_losses = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
    expected = token_losses.sum() / (targets != -100).sum()
    assert logged["tokens"] == int((targets != -100).sum())
    assert logged["loss"] == pytest.approx(float(expected), rel=1e-5)
    # the reference implementation's bug: the mean of the two micro-batches' means is a different number here
    micro_means = [token_losses[i:i + 2].sum() / (targets[i:i + 2] != -100).sum() for i in (0, 2)]
    assert abs(float(sum(micro_means) / 2) - logged["loss"]) > 0.05


def test_export_steps_keep_snapshots_that_later_saves_and_start_over_leave_whole(tiny_config_path, chat_jsonl,
                                                                                 tmp_path):
    """--export_steps 1,3: SAVE_DIR/sft_step1/ and sft_step3/ beside the run's folder; the last equals the run's final
    export, the first holds other (earlier) weights, and a resume that passes step 1 again rewrites it unchanged;
    --start_over moves the snapshots aside with the run's other files."""
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=3, export_steps="1,3", save_interval=1))
    final, first, last = weights(tmp_path, "sft"), weights(tmp_path, "sft_step1"), weights(tmp_path, "sft_step3")
    assert max_weight_diff(final, last) == 0 and max_weight_diff(final, first) > 0
    mtime = os.path.getmtime(tmp_path / "sft_step1" / "model.safetensors")
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=4, export_steps="1,3", save_interval=1,
                       from_resume=1, resume_changes="max_steps"))
    assert os.path.getmtime(tmp_path / "sft_step1" / "model.safetensors") == mtime  # resumed at step 3: not passed
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=1, start_over=1))
    aside = [p for p in os.listdir(tmp_path) if p.startswith("sft.replaced-")]
    assert len(aside) == 1 and {"sft_step1", "sft_step3"} <= set(os.listdir(tmp_path / aside[0]))
    assert not os.path.exists(tmp_path / "sft_step1")


def test_export_step_0_is_the_model_the_run_starts_from(tiny_config_path, chat_jsonl, tmp_path, one_thread):
    """--export_steps 0: SAVE_DIR/NAME_step0/ holds the weights the run starts from (here --model_path's, exactly),
    written before the first step; the run's own export holds the trained ones."""
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, name="start", max_steps=1))
    argv = loop_args(None, chat_jsonl, tmp_path, name="next", max_steps=1, export_steps="0")
    train_sft(argv + ["--model_path", str(tmp_path / "start")])
    start, step0, trained = weights(tmp_path, "start"), weights(tmp_path, "next_step0"), weights(tmp_path, "next")
    assert max_weight_diff(start, step0) == 0 and max_weight_diff(start, trained) > 0


@pytest.mark.parametrize("value", ["4x", "-1", "2,-1"])
def test_export_steps_must_be_steps(tiny_config_path, chat_jsonl, tmp_path, value, capsys):
    code, err = script_exit(train_sft, sft_args(tiny_config_path, chat_jsonl, tmp_path, export_steps=value), capsys)
    assert code == 2 and err.startswith("error: argument --export_steps: ") and len(err.splitlines()) == 1
    assert not os.path.exists(tmp_path / "sft")


@pytest.mark.slow
def test_loss_falls(tiny_config_path, tmp_path):
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16)
    train_sft(sft_args(tiny_config_path, data, tmp_path, batch=4, epochs=4, learning_rate=1e-2))
    losses = [m["loss"] for m in metrics(tmp_path, "sft")]
    assert losses[-1] < 0.8 * losses[0]


def test_damaged_checkpoint_is_a_clear_error(tiny_config_path, chat_jsonl, tmp_path):
    args = sft_args(tiny_config_path, chat_jsonl, tmp_path, batch=4, max_steps=1)
    train_sft(args)
    resume_path = tmp_path / "sft_resume.pt"
    data = resume_path.read_bytes()
    resume_path.write_bytes(data[:len(data) // 2])
    with pytest.raises(UserError, match="damaged"):
        train_sft(args + ["--from_resume", "1"])
    assert resume_path.read_bytes() == data[:len(data) // 2], "a failed resume must not touch the checkpoint"


@pytest.mark.slow
def test_checkpoint_of_another_configuration_is_refused(tiny_config_path, chat_jsonl, tmp_path):
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, batch=4, max_steps=1))
    with pytest.raises(UserError, match="learning_rate"):
        train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, batch=4, max_steps=1, learning_rate=0.5,
                           from_resume=1))
    with pytest.raises(UserError, match="global batch"):
        train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, batch=2, max_steps=1, from_resume=1))


@pytest.mark.slow
def test_swanlab_offline_run_is_resumed_under_the_same_id(tiny_config_path, chat_jsonl, tmp_path):
    args = sft_args(tiny_config_path, chat_jsonl, tmp_path, batch=4, save_interval=1, use_swanlab=1,
                    swanlab_mode="offline")
    train_sft(args + ["--max_steps", "2"])
    train_sft(args + ["--max_steps", "4", "--from_resume", "1", "--resume_changes", "max_steps"])
    runs = sorted(os.listdir(tmp_path / "swanlog"))
    run_dirs = [d for d in runs if d.startswith("run-")]
    assert len(run_dirs) == 2
    assert len({d.rsplit("-", 1)[1] for d in run_dirs}) == 1, f"two different run ids: {run_dirs}"
    assert torch.load(tmp_path / "sft_resume.pt", weights_only=False)["swanlab_run_id"] == run_dirs[0].rsplit("-", 1)[1]


@pytest.mark.parametrize("flags, message", [
    (["--max_prompt_length", "96"], "max_prompt_length"),
    (["--accumulation_steps", "0"], "accumulation_steps"),
    (["--warmup_ratio", "1.5"], "warmup_ratio"),
])
def test_impossible_flags_are_refused_up_front(tiny_config_path, chat_jsonl, tmp_path, flags, message, capsys):
    with pytest.raises(UserError, match=message):
        train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path) + flags)
