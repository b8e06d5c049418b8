"""bench_fsdp.py --estimate's fake-tensor estimate of a rank's memory against what the same step allocates for real;
PPO's critic's state against its formula."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from benchmarks import fsdp_estimate as fe
from loop_helpers import env_one_thread
from model import Qwen3Config
from support import ROOT

MARGIN = 0.10  # the estimate within 10% of the CPU allocator's count, phase by phase


@pytest.mark.slow  # long for the fast tier: the whole suite runs it
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_one_unsharded_rank_estimated_with_fake_tensors_allocates_what_the_real_step_does(tiny_config_path,
                                                                                          one_thread, lora_rank):
    """One rank (no sharding, MemTracker): the fake estimate of an SFT step of 3 micro-batches against the same
    step on real tensors in this process, counted by the CPU allocator (torch.profiler's memory events), phase by
    phase; and from the second micro-batch on each micro-batch's peak repeats (why --estimate's window of 2 stands
    for any). Full training, and a LoRA student (--estimate --lora_rank: its base frozen in bf16, fp32 adapters,
    only they in AdamW, no gradient of the frozen head)."""
    if dist.is_initialized():
        pytest.skip("needs a process without a process group: the estimate starts a fake one")
    config, shape = Qwen3Config.from_json(tiny_config_path), fe.StepShape(batch=2, seq=64, window=3, chunk=32)
    fake, real = fe.estimate(config, None, 1, shape, lora_rank), fe.measured_step(config, shape, lora_rank)
    assert abs(fake["state"] / real["state"] - 1.0) <= MARGIN, (fake["state"], real["state"])
    assert fake["peaks"].keys() == real["peaks"].keys() == {"forward", "backward", "optimizer"}
    for phase, values in fake["peaks"].items():
        for estimate, measured in zip(values, real["peaks"][phase], strict=True):
            assert abs(estimate / measured - 1.0) <= MARGIN, (phase, estimate, measured)
    for phase in ("forward", "backward"):
        first, *later = fake["peaks"][phase]
        assert min(later) == max(later) > first, (phase, fake["peaks"][phase])


@pytest.mark.parametrize("world", [1, 2])
def test_an_estimate_at_full_depth_is_extrapolated_exactly_from_shallow_ones(tiny_config_path, one_thread, world):
    """--estimate runs each real shape at 2 and 3 layers per model and extrapolates linearly (the tracker is too
    slow for 64 layers on a CPU): a 5-layer student with a 4-layer teacher predicted that way equals the direct
    estimate of that depth."""
    if dist.is_initialized():
        pytest.skip("needs a process without a process group: the estimate starts a fake one")
    import dataclasses
    config, shape = Qwen3Config.from_json(tiny_config_path), fe.StepShape(batch=2, seq=64, window=2, chunk=32)
    student, teacher = (dataclasses.replace(config, num_hidden_layers=n) for n in (5, 4))
    predicted = fe.by_depth(student, teacher, world, shape)
    direct = fe.estimate(student, teacher, world, shape)
    assert predicted["state"] == direct["state"]
    assert predicted["peaks"] == {phase: max(values) for phase, values in direct["peaks"].items()}


def step_peak(estimate: dict) -> int:
    return max(max(values) for values in estimate["peaks"].values())


@pytest.mark.parametrize("world", [1, 2])
def test_one_more_teacher_adds_what_the_sizing_formula_says(tiny_config_path, one_thread, world):
    """--teachers: the fake-tensor estimate of a KD step with two teachers against one, each teacher scoring its
    rows: the step's peak (the forward's end) grows by `extra_teacher_bytes` -- its bf16 shards, its gathered root when
    sharded, one more fp32 gradient of the student's head -- within 2%, and the training state by its shards (and
    its RoPE buffer)."""
    if dist.is_initialized():
        pytest.skip("needs a process without a process group: the estimate starts a fake one")
    import dataclasses
    student = Qwen3Config.from_json(tiny_config_path)
    teacher = dataclasses.replace(student, hidden_size=96, intermediate_size=192, num_hidden_layers=3, head_dim=24,
                                  tie_word_embeddings=False)
    shape = fe.StepShape(batch=2, seq=64, window=2, chunk=32)
    one, two = fe.estimate(student, [teacher], world, shape), fe.estimate(student, [teacher, teacher], world, shape)
    grown = step_peak(two) - step_peak(one)
    assert abs(grown / fe.extra_teacher_bytes(student, teacher, world) - 1.0) <= 0.02, grown
    held = two["state"] - one["state"] - 2 * fe.parameter_count(teacher) // world
    assert 0 <= held <= 1024, held  # and its RoPE buffer (48 bytes)


def test_the_estimates_lora_student_is_the_one_the_loops_build(tiny_config_path):
    """--estimate --lora_rank's student, tensor by tensor, is what trainer/skeleton/loading.build_model builds for
    --lora_rank under bf16 autocast: the same names, shapes and dtypes (the base in bf16, the adapters in fp32), the
    same parameters trained (the adapters alone)."""
    import argparse
    from model.lora import TARGETS
    from trainer.skeleton.loading import build_model
    lora = {"rank": 4, "alpha": 32.0, "dropout": 0.0, "targets": TARGETS}
    loops = build_model(argparse.Namespace(fsdp=0, dtype="bfloat16", seed=0), "cpu", config_path=tiny_config_path,
                        lora=lora)
    ours = fe.materialise(fe.build(Qwen3Config.from_json(tiny_config_path), 1, trained=True, lora_rank=4))
    (held, trained), theirs = tensors(ours), tensors(loops)
    assert (held, trained) == theirs
    assert trained and all(".lora_" in name for name in trained)
    assert {dtype for name, (_, dtype) in held.items() if name in trained} == {torch.float32}
    assert {dtype for name, (_, dtype) in held.items() if name not in trained} == {torch.bfloat16}


def tensors(model: torch.nn.Module) -> tuple[dict, set]:
    """({state-dict name: (shape, dtype)}, the names of the parameters that train)."""
    held = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    return held, {name for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_critics_state_per_rank_is_what_the_sizing_formula_says(tiny_config_path, tmp_path, lora_rank):
    """PPO's critic as train_ppo.py builds it, after a backward and an AdamW step: what each rank holds for it alone
    (its own parameters' storages, gradients, AdamW's moments) is `critic_state_bytes` -- one process, where a LoRA
    critic's frozen body is the student's tensors (nothing more), and 2 sharded gloo ranks, each its share (within
    rounding of uneven shards). AdamW's step counters (a scalar per tensor) are not counted."""
    worker = os.path.join(ROOT, "tests", "critic_state_worker.py")
    config = Qwen3Config.from_json(tiny_config_path)
    for world, command in ((1, [sys.executable, worker]),
                           (2, [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                                worker])):
        out = tmp_path / f"world{world}"
        out.mkdir()
        result = subprocess.run([*command, tiny_config_path, str(int(world > 1)), str(lora_rank), str(out)],
                                env=env_one_thread(), capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        expected = fe.critic_state_bytes(config, world, sharded=world > 1, lora_rank=lora_rank)
        for rank in range(world):
            probe = json.loads((out / f"{rank}.json").read_text())
            assert probe["shared"] == (lora_rank > 0 and world == 1)
            assert abs(probe["held"] / expected - 1) <= (0 if world == 1 else 0.01), (world, rank, probe, expected)
