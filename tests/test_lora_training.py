# python -m pytest tests/test_lora_training.py
"""LoRA students in the loops (--lora_rank): a fresh one computes what its base does; after training, transformers
loading the merged export and PEFT loading the adapter onto a transformers-written base compute the LoRA student's
logits; only the adapters are in the optimizer and the resume file; a resume onto another base is refused in one
line; RL's and logit-free OPD's reference is the student's own base (no second copy of the weights); and a real vLLM
server samples a LoRA student's rollouts, the sync check passing after a resumed run. Accumulation, 2 DDP ranks,
--packing and SIGKILL + resume are tests/test_loop_invariants.py's (sft_lora, rl_lora), 2 FSDP ranks
tests/test_fsdp.py's."""
import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from loop_helpers import (assert_one_line_error, checkpoint_step, env_one_thread, kill_after_first_checkpoint,
                          loop_args, metrics, script_exit)
from model import save_pretrained
from model.lora import adapters_disabled, is_adapter, lora_layers
from model.precision import resolve_precision
from support import ROOT, SERVED_CONFIG, write_chat_jsonl
from trainer.skeleton.checkpoint import load_trained_state
from trainer.skeleton.loading import build_model
from trainer.train_sft import main as train_sft

pytestmark = pytest.mark.usefixtures("one_thread")
LORA = {"lora_rank": 4, "lora_alpha": 8, "learning_rate": 1e-2}
SETTINGS = {"rank": 4, "alpha": 8.0, "dropout": 0.0,
            "targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")}
IDS = torch.tensor([[151644, 872, 198, 9707, 11, 1879, 30, 151645]])


def flags(dtype: str = "float32") -> argparse.Namespace:
    return argparse.Namespace(seed=7, fsdp=0, dtype=dtype)  # loop_args' seed: the loops' students


def student(config: str, dtype: str = "float32", lora: bool = True) -> torch.nn.Module:
    """A loop's student as build_student makes it (the base from the config and seed 7)."""
    return build_model(flags(dtype), "cpu", config_path=config, lora=SETTINGS if lora else None)


def test_a_fresh_lora_student_computes_exactly_what_its_base_does(tiny_config_path):
    base, lora = student(tiny_config_path, lora=False), student(tiny_config_path)
    assert len(lora_layers(lora)) == 4 * 2  # qkv, o, gate/up, down in each of the 2 layers
    with torch.no_grad():
        assert torch.equal(lora(IDS).logits, base(IDS).logits)
    # under bf16 autocast the base is held in bf16, the adapters in fp32; fresh, they change nothing there either
    low = student(tiny_config_path, "bfloat16")
    assert {p.dtype for name, p in low.named_parameters() if not is_adapter(name)} == {torch.bfloat16}
    assert {p.dtype for name, p in low.named_parameters() if is_adapter(name)} == {torch.float32}
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        adapted = low(IDS).logits
        with adapters_disabled(low):
            assert torch.equal(low(IDS).logits, adapted)


def test_a_float16_lora_students_base_is_held_in_the_frozen_teachers_dtype(tiny_config_path, chat_jsonl, tmp_path):
    """--dtype float16: the frozen base -- embedding, norms and linear weights, and so the reference that is the base
    with its adapters off -- in the dtype the precision rule gives a frozen teacher (bf16 on a CPU: a real Qwen3 may
    overflow fp16), not in fp16; the adapters fp32. The loop trains it."""
    low = student(tiny_config_path, "float16")
    teacher = resolve_precision("cpu", "float16").teacher
    base = {name: p.dtype for name, p in low.named_parameters() if not is_adapter(name)}
    assert teacher == torch.bfloat16 and set(base.values()) == {teacher}
    assert {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= set(base)
    assert {p.dtype for name, p in low.named_parameters() if is_adapter(name)} == {torch.float32}
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=1, dtype="float16", **LORA))
    steps = [m for m in metrics(tmp_path) if "loss" in m]
    assert [m["step"] for m in steps] == [1] and torch.isfinite(torch.tensor(steps[0]["loss"]))


def trained_student(config: str, save_dir) -> torch.nn.Module:
    """The run's LoRA student as it trained: the base rebuilt from the config and seed, its adapters from the
    resume file."""
    model = student(config).eval()
    load_trained_state(model, torch.load(save_dir / "run_resume.pt", weights_only=False)["model"])
    return model


@pytest.mark.slow
def test_transformers_and_peft_compute_the_trained_lora_students_logits(tiny_config_path, chat_jsonl, tmp_path):
    peft = pytest.importorskip("peft", reason="peft is a test dependency: python -m pip install -r requirements.txt")
    import transformers
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=3, **LORA))
    model = trained_student(tiny_config_path, tmp_path)
    assert any(float(b.detach().abs().max()) > 1e-3 for layer in lora_layers(model) for b in layer.lora_B.values())
    with torch.no_grad():
        ours = model(IDS).logits
        with adapters_disabled(model):
            assert not torch.allclose(model(IDS).logits, ours, atol=1e-3)  # the adapters did change the model
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run"), dtype=torch.float32).eval()
    # the base as transformers writes it: ours loaded into transformers and saved by it
    with adapters_disabled(model):
        save_pretrained(model, str(tmp_path / "our_base"))  # the export of what it computes: the base alone
    transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "our_base")).save_pretrained(
        str(tmp_path / "hf_base"))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_base"), dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "run_adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(IDS).logits, ours, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(adapted(IDS).logits, ours, rtol=1e-5, atol=1e-5)
    config = json.loads((tmp_path / "run_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8.0, sorted(SETTINGS["targets"]))


def test_only_the_adapters_are_trained_and_resumed(tiny_config_path, chat_jsonl, tmp_path):
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path / "lora", max_steps=2, **LORA))
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path / "full", max_steps=2))
    saved = torch.load(tmp_path / "lora" / "run_resume.pt", weights_only=False)
    adapters = [name for name, _ in student(tiny_config_path).named_parameters() if is_adapter(name)]
    assert sorted(saved["model"]) == sorted(adapters)
    # AdamW's state: one entry (step, two moments) per adapter, each shaped as its adapter
    state = saved["optimizer"]["state"]
    assert len(state) == len(adapters) == len(saved["optimizer"]["param_groups"][0]["params"])
    assert sorted(s["exp_avg"].numel() for s in state.values()) == sorted(saved["model"][k].numel() for k in adapters)
    assert saved["base_sha256"]
    lora_bytes, full_bytes = (os.path.getsize(tmp_path / run / "run_resume.pt") for run in ("lora", "full"))
    assert lora_bytes < 0.02 * full_bytes, (lora_bytes, full_bytes)
    # the adapter alone, beside the merged export
    assert sorted(os.listdir(tmp_path / "lora" / "run_adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    assert len(load_file(tmp_path / "lora" / "run_adapter" / "adapter_model.safetensors")) == len(adapters)


def test_a_resume_onto_another_base_or_without_lora_is_refused_in_one_line(tiny_config_path, chat_jsonl, tmp_path,
                                                                           capsys):
    args = loop_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=1, **LORA)
    train_sft(args)
    before = os.path.getmtime(tmp_path / "run_resume.pt")
    # another random base (the seed draws it): accepted as a flag change, refused by the base's digest
    code, stderr = script_exit(train_sft, [*args, "--from_resume", "1", "--seed", "8", "--resume_changes", "seed"],
                               capsys)
    assert_one_line_error(code, stderr, 2, "run_resume.pt", "another base", "--model_path")
    full = loop_args(tiny_config_path, chat_jsonl, tmp_path, max_steps=1, learning_rate=1e-2)
    code, stderr = script_exit(train_sft, [*full, "--from_resume", "1", "--resume_changes", "lora_rank,lora_alpha"],
                               capsys)
    assert_one_line_error(code, stderr, 2, "run_resume.pt", "LoRA", "--lora_rank")
    assert os.path.getmtime(tmp_path / "run_resume.pt") == before and checkpoint_step(tmp_path / "run_resume.pt") == 1


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["rl", "logit_free", "opd_self", "ppo"])
def test_a_lora_students_reference_is_its_own_base(loop, tiny_config_path, chat_jsonl, tmp_path, black_box_stub):
    """Every live module's parameters and buffers at the first optimizer step, distinct storages by data_ptr: with a
    LoRA student and no --reference_path under 1.1 copies of the base; a full student's reference is a second copy
    (the probe sees it: about 2). The same for self-distillation's --self_teacher start, the student as it began,
    and for PPO, whose LoRA critic's frozen body is the student's base too (a full critic: a third copy)."""
    script, own = {
        "rl": (os.path.join(ROOT, "tests", "rl_length_reward.py"), dict(num_generations=2, kl_coef=0.1)),
        "logit_free": (os.path.join(ROOT, "trainer", "train_logit_free.py"),
                       dict(teacher_url=black_box_stub.url, chunk_len=3, audit_chunks=2, continuations=3,
                            anchor_beta=0.5)),
        "opd_self": (os.path.join(ROOT, "trainer", "train_opd.py"),
                     dict(self_teacher="start", max_prompt_length=64,
                          privileged_template="{question} The answer: {ground_truth}.")),
        "ppo": (os.path.join(ROOT, "tests", "ppo_length_reward.py"), dict(kl_coef=0.1)),
    }[loop]
    copies = {}
    for name, lora in (("lora", LORA), ("full", {})):
        out = tmp_path / f"{name}.json"
        args = loop_args(tiny_config_path, chat_jsonl, tmp_path / name, max_steps=1, max_new_tokens=8, **own, **lora)
        result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "storage_probe.py"), str(out), script,
                                 *args], env=env_one_thread(), capture_output=True, text=True, timeout=400)
        assert result.returncode == 0, result.stderr[-3000:]
        probe = json.loads(out.read_text())
        copies[name] = probe["weights_bytes"] / probe["base_bytes"]
    assert copies["lora"] < 1.1 and copies["full"] > (2.9 if loop == "ppo" else 1.9), copies


@pytest.mark.slow
def test_a_vllm_server_samples_a_lora_students_rollouts_and_the_sync_check_holds_after_a_resume(vllm_servers,
                                                                                                  tmp_path):
    """OPD with the rollout server: the merged weights pushed every step and probed against the student (adapters
    on); killed after its first checkpoint and resumed, the resumed run pushes again and the check still passes."""
    config = tmp_path / "served_config.json"
    config.write_text(json.dumps(SERVED_CONFIG))
    data = write_chat_jsonl(tmp_path / "chat.jsonl", 16)
    args = loop_args(str(config), data, tmp_path / "run", batch=2, accumulation=2, max_length=80, max_new_tokens=16,
                     rollout_url=vllm_servers.rollout.url, teacher_path=vllm_servers.teacher_dir, save_interval=1,
                     max_steps=3, **LORA)
    script = os.path.join(ROOT, "trainer", "train_opd.py")
    kill_after_first_checkpoint([sys.executable, script, *args], str(tmp_path / "run" / "run_resume.pt"))
    assert checkpoint_step(tmp_path / "run" / "run_resume.pt") < 3, "the run finished before it could be killed"
    result = subprocess.run([sys.executable, script, *args, "--from_resume", "1"], env=env_one_thread(),
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    steps = [m for m in metrics(tmp_path / "run") if "loss" in m]
    assert steps[-1]["step"] == 3 and all(m["sync_logprob_diff"] < 1e-4 for m in steps), steps
    assert "resumed from" in result.stdout
