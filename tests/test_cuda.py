# python -m pytest -m cuda tests/test_cuda.py        (on a machine with a CUDA device; elsewhere they skip)
"""The CUDA paths a CPU machine cannot take: bf16 autocast numerics, the KV cache in the autocast dtype, each loop
training in bf16 and in fp16 with a GradScaler. `benchmarks/bench_gpu.py` exercises the rest (compile, gradient
checkpointing, throughput) in one command."""
import math

import pytest
import torch

import model.generate as generate_module
from loop_helpers import loop_args, metrics
from model import Qwen3Config, create_model, generate, save_pretrained
from trainer.train_distillation import main as train_distillation
from trainer.train_opd import main as train_opd
from trainer.train_sft import main as train_sft

pytestmark = pytest.mark.cuda


@pytest.fixture
def tiny_model(tiny_config_path):
    return create_model(Qwen3Config.from_json(tiny_config_path), seed=0, device="cuda")


def test_bf16_autocast_log_probs_stay_close_to_fp32(tiny_model):
    ids = torch.randint(0, 151669, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        fp32 = tiny_model(ids).logits.float().log_softmax(-1)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            bf16 = tiny_model(ids).logits.float().log_softmax(-1)
    # bf16 keeps 8 mantissa bits: log-probs of ~12 nats move by a few hundredths on random weights
    assert (fp32 - bf16).abs().max().item() < 0.1


def test_generate_keeps_its_cache_in_the_autocast_dtype(tiny_model, monkeypatch):
    dtypes = []
    original = generate_module.KVCache

    def recording(config, batch_size, max_length, dtype, device):
        dtypes.append(dtype)
        return original(config, batch_size, max_length, dtype, device)

    monkeypatch.setattr(generate_module, "KVCache", recording)
    ids = torch.randint(0, 151669, (2, 8)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = generate(tiny_model, ids, None, 4, do_sample=False)
    assert dtypes == [torch.bfloat16] and out.completion_ids.shape == (2, 4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("loop", ["sft", "kd", "opd"])
def test_each_loop_trains_on_cuda(loop, dtype, tiny_config_path, chat_jsonl, tmp_path):
    teacher = str(tmp_path / "teacher")
    save_pretrained(create_model(Qwen3Config.from_json(tiny_config_path), seed=1), teacher)
    main = {"sft": train_sft, "kd": train_distillation, "opd": train_opd}[loop]
    extra = {} if loop == "sft" else {"teacher_path": teacher}
    main(loop_args(tiny_config_path, chat_jsonl, tmp_path / "run", device="cuda", dtype=dtype, max_steps=3,
                   **({"max_new_tokens": 8} if loop == "opd" else {}), **extra))
    losses = [m["loss"] for m in metrics(tmp_path / "run")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
