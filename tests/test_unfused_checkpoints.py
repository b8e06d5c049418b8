# python -m pytest tests/test_unfused_checkpoints.py
"""Resume checkpoints written before q/k/v and gate/up were fused (model/qwen3.py) -- the weights and AdamW's
moments under HF's names (q_proj, k_proj, v_proj, gate_proj, up_proj), the optimizer's parameters numbered in that
order -- still resume, to the same weights and optimizer state bit for bit as the same checkpoint in today's layout:
the single-process resume file, and --fsdp 1's shard folder read by 3 ranks whose shards cut across the blocks. The
old checkpoints are made here from today's, split by the model's own sizes (not by model/checkpoint_io.py's mapping,
which the loading side uses)."""
import os
import shutil
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

from loop_helpers import loop_args, max_weight_diff, run_command, torchrun_command, weights
from model import Qwen3Config, create_model
from support import ROOT
from trainer.skeleton.checkpoint import fused_resume_state
from trainer.skeleton.sharding import load_shards, sharded_state, single_process_quietly
from trainer.train_sft import main as train_sft

pytestmark = pytest.mark.usefixtures("one_thread")
SFT = os.path.join(ROOT, "trainer", "train_sft.py")


def unfused(name: str, tensor: torch.Tensor, config: Qwen3Config) -> dict[str, torch.Tensor]:
    """A parameter's tensor (its weight, or an AdamW moment of it) as it was saved before the fusion: q, k, v and
    gate, up apart, under their own names; any other whole."""
    if name.endswith("qkv_proj.weight"):
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        blocks = zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]))
        return {name.replace("qkv_proj", block): rows.clone() for block, rows in blocks}
    if name.endswith("gate_up_proj.weight"):
        blocks = zip(("gate_proj", "up_proj"), tensor.chunk(2))
        return {name.replace("gate_up_proj", block): rows.clone() for block, rows in blocks}
    return {name: tensor.clone()}


def unfused_optimizer_entry(name: str, entry: dict, config: Qwen3Config) -> dict[str, dict]:
    """One parameter's AdamW state -> each unfused block's: the moments split as the weight, the step in each."""
    shape = {key: value for key, value in entry.items() if value.dim()}
    split = {key: unfused(name, value, config) for key, value in shape.items()}
    blocks = next(iter(split.values())).keys()
    return {block: {key: split[key][block] if key in split else value.clone() for key, value in entry.items()}
            for block in blocks}


def unfuse_resume_file(path, config: Qwen3Config) -> None:
    """Rewrite a single-process resume file as the code before the fusion wrote it."""
    checkpoint = torch.load(path, weights_only=False)
    model = {old: t for name, tensor in checkpoint["model"].items() for old, t in unfused(name, tensor, config).items()}
    names = [name for name in checkpoint["model"] if not (config.tie_word_embeddings and name == "lm_head.weight")]
    state, number = {}, 0  # the optimizer numbers the parameters in named_parameters' order: the tied head once
    for index, name in enumerate(names):
        for entry in unfused_optimizer_entry(name, checkpoint["optimizer"]["state"][index], config).values():
            state[number], number = entry, number + 1
    groups = [{**group, "params": list(range(number))} for group in checkpoint["optimizer"]["param_groups"]]
    torch.save({**checkpoint, "model": model, "optimizer": {"state": state, "param_groups": groups}}, path)


def unfuse_shard_folder(folder: str, config: Qwen3Config) -> None:
    """Rewrite a shard folder as the code before the fusion wrote it (read whole by this one process)."""
    model = create_model(config)
    optimizer = torch.optim.AdamW(model.parameters())
    load_shards(folder, model, optimizer)
    state = sharded_state(model, optimizer)  # FQN keys, as DCP saved them
    old_model = {old: t for name, tensor in state["model"].items() for old, t in unfused(name, tensor, config).items()}
    old_state = {old: entry for name, full in state["optimizer"]["state"].items()
                 for old, entry in unfused_optimizer_entry(name, full, config).items()}
    groups = [{**group, "params": [old for name in group["params"] for old in unfused(name, state["model"][name],
                                                                                          config)]}
              for group in state["optimizer"]["param_groups"]]
    shutil.rmtree(folder)
    with single_process_quietly():
        dcp.save({"model": old_model, "optimizer": {"state": old_state, "param_groups": groups}}, checkpoint_id=folder)


def assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for index, entry in a["state"].items():
        assert entry.keys() == b["state"][index].keys()
        assert all(torch.equal(value, b["state"][index][key]) for key, value in entry.items()), index


def assert_same_tensors(a: dict, b: dict) -> None:
    assert list(a) == list(b) and all(torch.equal(a[name], b[name]) for name in a)


def test_a_resume_file_from_before_the_fusion_resumes_as_todays(tiny_config_path, chat_jsonl, tmp_path):
    config = Qwen3Config.from_json(tiny_config_path)
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path / "new", max_steps=1))
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    unfuse_resume_file(tmp_path / "old" / "run_resume.pt", config)
    old, new = (torch.load(tmp_path / run / "run_resume.pt", weights_only=False) for run in ("old", "new"))
    assert "model.layers.1.mlp.up_proj.weight" in old["model"] and len(old["optimizer"]["state"]) == 24

    # as loaded: today's state dicts, bit for bit
    weights_in, moments_in = fused_resume_state(old, create_model(config), "run_resume.pt")
    assert_same_tensors(weights_in, new["model"])
    assert_same_optimizer_state(moments_in, new["optimizer"])

    # through the loop: one more step from each, to the same weights and AdamW state
    for run in ("new", "old"):
        train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path / run, max_steps=2, from_resume=1,
                            resume_changes="max_steps"))
    old, new = (torch.load(tmp_path / run / "run_resume.pt", weights_only=False) for run in ("old", "new"))
    assert old["step"] == new["step"] == 2
    assert_same_tensors(old["model"], new["model"])
    assert_same_optimizer_state(old["optimizer"], new["optimizer"])
    assert max_weight_diff(weights(tmp_path / "old"), weights(tmp_path / "new")) == 0


@pytest.mark.serial
@pytest.mark.slow
def test_a_shard_folder_from_before_the_fusion_resumes_as_todays_on_three_ranks(tiny_config_path, long_chat_jsonl,
                                                                                 tmp_path):
    """Written by one --fsdp 1 process, made old, resumed by 3 ranks: the 128 rows of qkv_proj are split 43/43/42
    over them and the 256 of gate_up_proj 86/86/84, so a rank reads parts of two blocks (and of one block only the
    rows it holds). Global batch 6 throughout."""
    config = Qwen3Config.from_json(tiny_config_path)

    def args(run: str, **flags) -> list[str]:
        return loop_args(tiny_config_path, long_chat_jsonl, tmp_path / run, fsdp=1, batch=2, **flags)

    run_command([sys.executable, SFT, *args("new", accumulation=3, max_steps=1)])
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    shards = torch.load(tmp_path / "old" / "run_resume.pt", weights_only=False)["shards"]
    unfuse_shard_folder(str(tmp_path / "old" / shards), config)
    for run in ("new", "old"):
        run_command(torchrun_command(SFT, args(run, max_steps=2, from_resume=1, resume_changes="max_steps"),
                                     nproc=3))
    assert max_weight_diff(weights(tmp_path / "old"), weights(tmp_path / "new")) == 0
    states = []
    for run in ("new", "old"):  # the shard folders of step 2, read whole by one process
        model = create_model(config)
        optimizer = torch.optim.AdamW(model.parameters())
        shards = torch.load(tmp_path / run / "run_resume.pt", weights_only=False)["shards"]
        load_shards(str(tmp_path / run / shards), model, optimizer)
        states.append((model.state_dict(), optimizer.state_dict()))
    assert_same_tensors(states[0][0], states[1][0])
    assert_same_optimizer_state(states[0][1], states[1][1])
