"""A LoRA student's memory against full training's, measured: bench_fsdp.py --phases --lora_rank (each phase's peak
resident memory, in one process and on 2 sharded ranks, CPU, gloo). The estimate's LoRA student against the CPU
allocator: tests/test_fsdp_estimate.py."""
import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

STEP = ("forward", "backward", "optimizer")


@pytest.mark.slow
def test_the_benchmark_shows_a_lora_student_holding_less_than_full_training_in_every_phase(tiny_config_path):
    """The tiny model (its tied embedding 99% of it), SFT under bf16 autocast: full training (fp32 master weights,
    AdamW over all of them) against LoRA rank 4 (the base frozen in bf16, AdamW over the adapters only). On every
    rank every phase -- load, forward, backward, optimizer, save -- holds less with LoRA, and the step at most half:
    no gradient, no moment of the base, and no gradient of the frozen head."""
    from benchmarks import bench_fsdp
    result = bench_fsdp.run_lora_phases_benchmark(tiny_config_path, 2, 4, malloc_default=False)
    full, lora = result["full"], result["lora"]
    assert full.keys() == lora.keys() == {"unsharded", "rank-0", "rank-1"}
    for name in full:
        assert lora[name]["trained"] * 100 < full[name]["trained"], (name, lora[name], full[name])
        ours, theirs = lora[name]["peaks"], full[name]["peaks"]
        assert ours.keys() == theirs.keys() == set(bench_fsdp.LORA_PHASE_NAMES)
        assert all(ours[phase] < theirs[phase] for phase in ours), (name, ours, theirs)
        assert max(ours[phase] for phase in STEP) <= 0.5 * max(theirs[phase] for phase in STEP), (name, ours, theirs)
