# python -m pytest tests/test_train_sft.py
"""The skeleton's invariants, exercised through train_sft.py on a tiny Qwen3 (real 151,936 vocabulary, CPU):
exact accumulation (with a short tail window), DDP against one process, SIGKILL + resume against an uninterrupted
run (also across a world-size change), damaged and foreign checkpoints, swanlab offline resume, the logged loss."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import ROOT, write_chat_jsonl
from dataset.collators import SFTCollator
from dataset.sources import RowDataset
from model import Qwen3Config, create_model, load_tokenizer, save_pretrained
from trainer.sampler import EpochSampler
from trainer.train_sft import main as train_sft

SCRIPT = os.path.join(ROOT, "trainer", "train_sft.py")


# lr 1e-4: Adam's first steps move a weight by about lr * g / (|g| + eps), which for a gradient near eps amplifies
# float summation-order noise; at 1e-4 that noise stays below 1e-6 while a wrong normalisation (a window mean of
# micro-batch means) moves weights by ~1e-4. The pre-clip grad norm is compared as well: it sees the gradient itself.
def sft_args(config, data, save_dir, name="sft", batch=2, accumulation=1, **extra) -> list[str]:
    args = {"model_config": config, "data_path": data, "save_dir": str(save_dir), "save_weight": name,
            "batch_size": batch, "accumulation_steps": accumulation, "max_length": 96, "max_prompt_length": 32,
            "learning_rate": 1e-4, "log_interval": 1, "seed": 7, **extra}
    return [item for key, value in args.items() for item in (f"--{key}", str(value))]


def weights(save_dir, name="sft") -> dict[str, torch.Tensor]:
    return load_file(os.path.join(str(save_dir), name, "model.safetensors"))


def max_weight_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def metrics(save_dir, name="sft") -> list[dict]:
    with open(os.path.join(str(save_dir), f"{name}_metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def env_one_thread() -> dict:
    # one intra-op thread per process: reproducible sums and no oversubscription of the 2-core machine
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}


def test_accumulation_equals_one_big_batch(tiny_config_path, chat_jsonl, tmp_path):
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path / "big", batch=8, accumulation=1, max_steps=2))
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path / "acc", batch=2, accumulation=4, max_steps=2))
    assert max_weight_diff(weights(tmp_path / "big"), weights(tmp_path / "acc")) <= 1e-5
    big, acc = metrics(tmp_path / "big"), metrics(tmp_path / "acc")
    assert [m["tokens"] for m in big] == [m["tokens"] for m in acc]
    assert [m["loss"] for m in big] == pytest.approx([m["loss"] for m in acc], abs=1e-5)
    assert [m["grad_norm"] for m in big] == pytest.approx([m["grad_norm"] for m in acc], rel=1e-5)


def test_short_tail_window_is_flushed_exactly(tiny_config_path, chat_jsonl, tmp_path):
    # 20 rows: batch 2 x accumulation 4 gives windows of 4, 4 and 2 micro-batches; batch 8 gives 8, 8 and 4 rows
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path / "big", batch=8, accumulation=1))
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path / "acc", batch=2, accumulation=4))
    assert len(metrics(tmp_path / "acc")) == 3
    assert max_weight_diff(weights(tmp_path / "big"), weights(tmp_path / "acc")) <= 1e-5


def test_logged_loss_is_the_token_weighted_mean_of_the_step(tiny_config_path, chat_jsonl, tmp_path):
    # a random init predicts every token at about log(V); larger embeddings make per-token losses differ, so that a
    # mean of micro-batch means and the token-weighted mean are different numbers
    model = create_model(Qwen3Config.from_json(tiny_config_path), seed=7)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(40.0)
    save_pretrained(model, str(tmp_path / "init"))
    # seed 10 puts two short and two long rows into the step: micro-batches of 18 and 115 loss tokens
    train_sft(sft_args(None, chat_jsonl, tmp_path, batch=2, accumulation=2, max_steps=1, seed=10)[2:]
              + ["--model_path", str(tmp_path / "init")])
    logged = metrics(tmp_path)[0]

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


def test_loss_falls(tiny_config_path, tmp_path):
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16)
    train_sft(sft_args(tiny_config_path, data, tmp_path, batch=4, epochs=4, learning_rate=1e-2))
    losses = [m["loss"] for m in metrics(tmp_path)]
    assert losses[-1] < 0.8 * losses[0]


def run_torchrun(args: list[str], nproc: int = 2) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
               SCRIPT, *args]
    return subprocess.run(command, env=env_one_thread(), capture_output=True, text=True, timeout=300)


def test_ddp_two_ranks_equal_one_process(tiny_config_path, chat_jsonl, tmp_path):
    result = run_torchrun(sft_args(tiny_config_path, chat_jsonl, tmp_path / "ddp", batch=2, accumulation=2))
    assert result.returncode == 0, result.stderr[-3000:]
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path / "one", batch=2, accumulation=4))
    assert max_weight_diff(weights(tmp_path / "ddp"), weights(tmp_path / "one")) <= 1e-5
    assert [m["tokens"] for m in metrics(tmp_path / "ddp")] == [m["tokens"] for m in metrics(tmp_path / "one")]


def kill_after_first_checkpoint(command: list[str], resume_path: str) -> None:
    """Start a run, SIGKILL its whole process group as soon as a resume checkpoint appears."""
    process = subprocess.Popen(command, env=env_one_thread(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               start_new_session=True)
    deadline = time.time() + 240
    while not os.path.exists(resume_path):
        assert process.poll() is None, f"run ended before its first checkpoint: {process.stderr.read()[-2000:]}"
        assert time.time() < deadline, "no checkpoint within 240 s"
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def checkpoint_step(resume_path: str) -> int:
    return torch.load(resume_path, map_location="cpu", weights_only=False)["step"]


@pytest.fixture
def long_chat_jsonl(tmp_path):
    return write_chat_jsonl(tmp_path / "long.jsonl", 48, seed=1)


def test_sigkill_then_resume_is_bit_identical(tiny_config_path, long_chat_jsonl, tmp_path):
    args = lambda save_dir: sft_args(tiny_config_path, long_chat_jsonl, save_dir, batch=2, accumulation=2,
                                     save_interval=3)
    subprocess.run([sys.executable, SCRIPT, *args(tmp_path / "full")], env=env_one_thread(), check=True,
                   capture_output=True)
    killed = tmp_path / "killed"
    kill_after_first_checkpoint([sys.executable, SCRIPT, *args(killed)], str(killed / "sft_resume.pt"))
    assert checkpoint_step(str(killed / "sft_resume.pt")) < 12, "the run finished before it could be killed"
    subprocess.run([sys.executable, SCRIPT, *args(killed), "--from_resume", "1"], env=env_one_thread(), check=True,
                   capture_output=True)
    full, resumed = weights(tmp_path / "full"), weights(killed)
    assert all(torch.equal(full[k], resumed[k]) for k in full), "resumed weights are not bit-identical"
    assert [m["loss"] for m in metrics(tmp_path / "full")][-1] == metrics(killed)[-1]["loss"]


def test_resume_across_world_size_change(tiny_config_path, long_chat_jsonl, tmp_path):
    two_ranks = sft_args(tiny_config_path, long_chat_jsonl, tmp_path / "ws", batch=2, accumulation=2, save_interval=3)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", SCRIPT,
               *two_ranks]
    kill_after_first_checkpoint(command, str(tmp_path / "ws" / "sft_resume.pt"))
    assert checkpoint_step(str(tmp_path / "ws" / "sft_resume.pt")) < 6
    one_rank = sft_args(tiny_config_path, long_chat_jsonl, tmp_path / "ws", batch=2, accumulation=4, save_interval=3)
    train_sft(one_rank + ["--from_resume", "1"])
    train_sft(sft_args(tiny_config_path, long_chat_jsonl, tmp_path / "ref", batch=2, accumulation=4))
    assert max_weight_diff(weights(tmp_path / "ws"), weights(tmp_path / "ref")) <= 1e-5


def test_damaged_checkpoint_is_a_clear_error(tiny_config_path, chat_jsonl, tmp_path):
    args = sft_args(tiny_config_path, chat_jsonl, tmp_path, batch=4, max_steps=1)
    train_sft(args)
    resume_path = tmp_path / "sft_resume.pt"
    data = resume_path.read_bytes()
    resume_path.write_bytes(data[:len(data) // 2])
    with pytest.raises(RuntimeError, match="damaged"):
        train_sft(args + ["--from_resume", "1"])
    assert resume_path.read_bytes() == data[:len(data) // 2], "a failed resume must not touch the checkpoint"


def test_checkpoint_of_another_configuration_is_refused(tiny_config_path, chat_jsonl, tmp_path):
    train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, batch=4, max_steps=1))
    with pytest.raises(RuntimeError, match="learning_rate"):
        train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, batch=4, max_steps=1, learning_rate=0.5,
                           from_resume=1))
    with pytest.raises(RuntimeError, match="global batch"):
        train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path, batch=2, max_steps=1, from_resume=1))


def test_swanlab_offline_run_is_resumed_under_the_same_id(tiny_config_path, chat_jsonl, tmp_path):
    args = sft_args(tiny_config_path, chat_jsonl, tmp_path, batch=4, save_interval=1, use_swanlab=1,
                    swanlab_mode="offline")
    train_sft(args + ["--max_steps", "2"])
    train_sft(args + ["--max_steps", "4", "--from_resume", "1"])
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
    with pytest.raises(SystemExit, match=message):
        train_sft(sft_args(tiny_config_path, chat_jsonl, tmp_path) + flags)
