# python -m pytest tests/test_golden_losses.py
"""Golden numbers of the three CPU quick starts: any change to the numerics shows.

The demo chain `python trainer/train_sft.py && python trainer/train_distillation.py && python trainer/train_opd.py`
(model/configs/qwen3-tiny.json, qwen3-tiny-student.json, the built-in demo data, the real tokenizer) is run for its
first 3 optimizer steps, each loop's main() in-process, one intra-op thread, into a fresh temporary SAVE_DIR:

    train_sft           FLAGS
    train_distillation  FLAGS --teacher_path SAVE_DIR/sft                          (the SFT run's output)
    train_opd           FLAGS --teacher_path SAVE_DIR/sft --model_path SAVE_DIR/kd (the KD run's output)
    FLAGS = --max_steps 3 --log_interval 1 --save_dir SAVE_DIR --batch_size 4 --loss_chunk_size 128

The paths are the demo's defaults for that SAVE_DIR, spelled out; every flag not listed is the demo's default.
Smaller than the demo: --batch_size 4 (demo 16), because at the demo's batch the chain took 102 s (SFT 16, KD 29,
OPD 58 s) on this project's loaded 2-core machine, at 4 rows 28 s (SFT 6, KD 8, OPD 14 s); and --loss_chunk_size 128
(demo 512), so that each step's loss is still split into several lm_head chunks, as at the demo's batch (SFT/KD
~140 completion tokens a step, OPD 4 x 64 sampled). The code paths are the quick starts'.

The logged numbers of each step -- loss, grad_norm (before clipping), lr, tokens, and the loop's own: KD `ce` and
`kd`, OPD `completion_len`, `generated_tokens`, `eos_share`, `on_policy_share` -- must equal tests/golden_losses.json
within 1e-5 (absolute).

A deliberate change of the numerics (initialisation, data, collation, a loss, the optimizer, the schedule,
sampling...) regenerates the file and says so in its commit:

    python tests/test_golden_losses.py --regenerate     # reruns the chain (~30 s), rewrites tests/golden_losses.json

The values are those of this project's CPU fp32 PyTorch build (its version is stored in the file): another PyTorch
version or CPU may differ in the last float bits; regenerate after an upgrade, checking that the diff is rounding.
"""
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
if __name__ == "__main__":  # before torch is imported: one OpenMP thread for the regeneration too
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

GOLDEN_PATH = os.path.join(ROOT, "tests", "golden_losses.json")
STEPS = 3
TOLERANCE = 1e-5
COMMON_KEYS = ("loss", "grad_norm", "lr", "tokens")
LOOP_KEYS = {"sft": COMMON_KEYS, "kd": COMMON_KEYS + ("ce", "kd"),
             "opd": COMMON_KEYS + ("completion_len", "generated_tokens", "eos_share", "on_policy_share")}
# smaller than the demo (16 rows, chunks of 512) to keep the test fast; see the docstring
SMALLER = ["--batch_size", "4", "--loss_chunk_size", "128"]


def run_quick_starts(save_dir: str) -> tuple[dict[str, list[dict]], dict[str, float]]:
    """The demo chain's first STEPS steps into save_dir -> ({loop: [per-step metrics]}, {loop: seconds})."""
    from trainer.train_distillation import main as train_distillation
    from trainer.train_opd import main as train_opd
    from trainer.train_sft import main as train_sft

    common = ["--max_steps", str(STEPS), "--log_interval", "1", "--save_dir", save_dir, *SMALLER]
    sft_dir, kd_dir = os.path.join(save_dir, "sft"), os.path.join(save_dir, "kd")
    chain = [("sft", train_sft, []),
             ("kd", train_distillation, ["--teacher_path", sft_dir]),
             ("opd", train_opd, ["--model_path", kd_dir, "--teacher_path", sft_dir])]
    logged, seconds = {}, {}
    for name, main, extra in chain:
        start = time.perf_counter()
        main(common + extra)
        seconds[name] = time.perf_counter() - start
        with open(os.path.join(save_dir, f"{name}_metrics.jsonl"), encoding="utf-8") as f:
            records = [json.loads(line) for line in f]
        logged[name] = [{key: record[key] for key in LOOP_KEYS[name]} for record in records]
    return logged, seconds


@pytest.fixture(scope="module")
def quick_starts(one_thread, tmp_path_factory):
    logged, _ = run_quick_starts(str(tmp_path_factory.mktemp("quick_starts")))
    return logged


@pytest.fixture(scope="module")
def golden():
    with open(GOLDEN_PATH, encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("loop", ["sft", "kd", "opd"])
def test_first_steps_of_the_quick_start_match_the_golden_numbers(quick_starts, golden, loop):
    expected, got = golden["loops"][loop], quick_starts[loop]
    assert [m.get("step", i + 1) for i, m in enumerate(expected)] == list(range(1, STEPS + 1))
    assert len(got) == STEPS, f"{loop}: {len(got)} logged steps, expected {STEPS}"
    differences = []
    for step, (want, have) in enumerate(zip(expected, got), start=1):
        assert set(have) == set(LOOP_KEYS[loop])
        for key in LOOP_KEYS[loop]:
            if abs(have[key] - want[key]) > TOLERANCE:
                differences.append(f"step {step} {key}: golden {want[key]!r}, now {have[key]!r}")
    assert not differences, (f"{loop}: the quick start's numerics changed (torch {torch.__version__}, golden file "
                             f"written with torch {golden['torch']}):\n  " + "\n  ".join(differences)
                             + "\nIf the change is deliberate: python tests/test_golden_losses.py --regenerate, and "
                               "say so in the commit.")


def regenerate() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as save_dir:
        logged, seconds = run_quick_starts(save_dir)
    golden = {"description": "first logged steps of the CPU quick starts; written by "
                             "`python tests/test_golden_losses.py --regenerate` (see that file's docstring)",
              "torch": torch.__version__, "steps": STEPS,
              "flags": ["--max_steps", str(STEPS), "--log_interval", "1", *SMALLER],
              "loops": {loop: [{"step": i + 1, **m} for i, m in enumerate(steps)] for loop, steps in logged.items()}}
    with open(GOLDEN_PATH, "w", encoding="utf-8") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    print(f"wrote {GOLDEN_PATH}: " + ", ".join(f"{loop} {s:.1f} s" for loop, s in seconds.items())
          + f", total {sum(seconds.values()):.1f} s")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/test_golden_losses.py --regenerate   (rewrites tests/golden_losses.json)")
    regenerate()
