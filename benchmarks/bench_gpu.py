"""First contact with a GPU: every CUDA path of the loops run once, and the numbers users care about, one command.

    python benchmarks/bench_gpu.py                        # one CUDA GPU, at most ~8 minutes on an H100/H200
    python benchmarks/bench_gpu.py --device cpu --tiny    # the same code paths on tiny shapes (< 3 min; a test runs it)
    python benchmarks/bench_gpu.py --out gpu.json         # where the JSON goes (default: bench_gpu.json here)

Without a CUDA device (and without --device cpu) it says so and exits 0. What it does, in order:
  1. models   random-weight HF folders shaped like Qwen3-0.6B (the student: hidden 1024, 28 layers, 16 heads of
              128, 8 KV heads, MLP 3072, tied) and Qwen3-1.7B (the teacher: hidden 2048, MLP 6144, otherwise the
              same), with the real 151,936-row vocabulary (--tiny: 2-layer models of hidden 64 / 128)
  2. smoke    the three training loops' main() for 2 steps each on the demo data, in bf16, in fp16 (a
              GradScaler), with --use_compile 1, with --gradient_checkpointing 1, and one resume (SFT: 2 more steps
              with --from_resume 1); each must finish with finite losses (their output: WORKDIR/smoke.log). Then bf16 against fp32: the first SFT
              loss of the same batch and weights must agree within 2% (bf16 keeps 8 bits of mantissa; a cross
              entropy of ~12 nats moves by ~0.1 between the two on random weights)
  3. SFT / KD throughput  batch 8 x 2,048 tokens (labels on the last 1,024), bf16 autocast, fp32 master weights
              and AdamW, the loops' chunked losses: tokens/s (all 16,384 tokens of a step), model FLOPs
              utilisation and peak memory. MFU = tokens/s x FLOPs per token / the GPU's peak dense bf16 FLOPs,
              with FLOPs per token = 6 x N (N: parameters except the input embedding, whose lookup is not a
              matmul) + 12 x layers x heads x head_dim x sequence length (attention scores and values, forward
              and backward); a KD step adds the teacher's forward, 2 x N_teacher + 4 x layers x ... x sequence.
              The peak is known for H100/H200 (989 TFLOP/s) and A100 (312); otherwise MFU is not shown
              (--peak_tflops to give it)
  4. OPD      one step split into generation (batch 32 x 512 new tokens: tokens/s), teacher forward and student
              forward + backward + optimizer (benchmarks/bench_opd.py's opd_step: the loop's own rollout); and,
              when transformers is installed, its generate on the same weights and prompts, greedy, same length
  5. report   a table on stdout, the same numbers in --out (JSON)
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.bench_opd import opd_step  # noqa: E402
from dataset.collators import PromptCollator  # noqa: E402
from dataset.make_demo_data import ensure_demo_data  # noqa: E402
from dataset.sources import RowDataset  # noqa: E402
from model import Qwen3Config, create_model, generate, load_pretrained, load_tokenizer, save_pretrained  # noqa: E402
from trainer.losses import chunked_loss, chunked_sft_loss, completion_hidden, distillation_loss, sft_loss  # noqa: E402
from trainer.trainer_utils import autocast_context  # noqa: E402

SHAPES = {  # (student, teacher)
    "full": ({"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128},
             {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128}),
    "tiny": ({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32},
             {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32}),
}
WORKLOAD = {  # sft/kd: (batch, sequence, completion); opd: (batch, new tokens); steps timed after warm-up
    "full": {"sft": (8, 2048, 1024), "opd": (32, 512), "steps": 3, "warmup": 1},
    "tiny": {"sft": (2, 128, 64), "opd": (4, 16), "steps": 2, "warmup": 1},
}
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
BF16_TOLERANCE = 0.02


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (what the test runs)")
    p.add_argument("--out", default="bench_gpu.json")
    p.add_argument("--peak_tflops", type=float, default=None, help="the GPU's peak dense bf16 TFLOP/s, for MFU")
    p.add_argument("--workdir", default=None, help="models and runs (default: a temporary folder)")
    return p.parse_args(argv)


def write_models(shape: str, folder: str) -> tuple[str, str]:
    base = Qwen3Config.from_json(os.path.join(ROOT, "model", "configs", "qwen3-tiny.json")).to_hf_dict()
    paths = []
    for name, sizes, seed in (("student", SHAPES[shape][0], 0), ("teacher", SHAPES[shape][1], 1)):
        config = Qwen3Config.from_dict({**base, **sizes, "tie_word_embeddings": True, "max_position_embeddings": 4096})
        save_pretrained(create_model(config, seed=seed), os.path.join(folder, name))
        paths.append(os.path.join(folder, name))
    return paths[0], paths[1]


# ---------------------------------------------------------------------------------------------------------- smoke

def smoke_runs(args, student: str, teacher: str, folder: str) -> list[dict]:
    """Each loop's main() in this process (imports and CUDA set-up once) for 2 steps per precision / mode, then
    one resume; -> one record per run. Their console output goes to FOLDER/smoke.log."""
    from trainer.train_distillation import main as train_distillation
    from trainer.train_opd import main as train_opd
    from trainer.train_sft import main as train_sft
    variants = [("bf16", ["--dtype", "bfloat16"]), ("fp16 + GradScaler", ["--dtype", "float16"]),
                ("compile", ["--dtype", "bfloat16", "--use_compile", "1"]),
                ("gradient checkpointing", ["--dtype", "bfloat16", "--gradient_checkpointing", "1"])]
    loops = {"sft": (train_sft, ["--model_path", student]),
             "kd": (train_distillation, ["--model_path", student, "--teacher_path", teacher]),
             "opd": (train_opd, ["--model_path", student, "--teacher_path", teacher, "--max_new_tokens", "16"])}
    records = []
    with open(os.path.join(folder, "smoke.log"), "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        for loop, (main, models) in loops.items():
            for variant, flags in variants:
                name = f"{loop}_{variant.split()[0]}"
                argv = [*models, *flags, "--device", args.device, "--save_dir", folder, "--save_weight", name,
                        "--batch_size", "2", "--max_length", "384", "--max_prompt_length", "128", "--log_interval", "1",
                        "--save_interval", "1"]
                records.append(run_loop(main, [*argv, "--max_steps", "2"], folder, name, loop, variant))
                if loop == "sft" and variant == "bf16":  # the resume: two more steps from the checkpoint of step 2
                    records.append(run_loop(main, [*argv, "--max_steps", "4", "--from_resume", "1"], folder, name,
                                            loop, "bf16, resumed for 2 more steps"))
    return records


def run_loop(main, argv: list[str], folder: str, name: str, loop: str, variant: str) -> dict:
    start = time.perf_counter()
    record = {"loop": loop, "variant": variant, "ok": False}
    try:
        main(argv)
    except BaseException as error:  # a failed run is a row of the report, not the end of the check
        record.update(error=f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}",
                      seconds=time.perf_counter() - start)
        return record
    with open(os.path.join(folder, f"{name}_metrics.jsonl")) as f:
        losses = [json.loads(line)["loss"] for line in f if '"loss"' in line]
    record.update(ok=all(math.isfinite(x) for x in losses), last_loss=losses[-1], steps=len(losses),
                  seconds=time.perf_counter() - start)
    return record


def bf16_agrees_with_fp32(args, student: str) -> dict:
    """The first SFT loss of one batch in bf16 autocast and in fp32, same weights."""
    model = load_pretrained(student, device=args.device)
    ids, labels = sft_batch(args, 1)
    losses = {}
    for dtype in ("bfloat16", "float32"):
        with torch.no_grad(), autocast_context(args.device, dtype):
            hidden, targets = completion_hidden(model, ids, torch.ones_like(ids), labels)
            loss_sum, tokens = chunked_sft_loss(hidden, model.lm_head.weight, targets, vocab_size=151669)
        losses[dtype] = float(loss_sum) / int(tokens)
    relative = abs(losses["bfloat16"] - losses["float32"]) / abs(losses["float32"])
    return {**losses, "relative_difference": relative, "tolerance": BF16_TOLERANCE, "ok": relative <= BF16_TOLERANCE}


# ----------------------------------------------------------------------------------------------------- throughput

def sft_batch(args, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random real-vocabulary tokens, labels on the last `completion` positions of each row."""
    batch, length, completion = WORKLOAD[args.shape]["sft"]
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151669, (rows or batch, length), generator=generator).to(args.device)
    labels = ids.clone()
    labels[:, :length - completion] = -100
    return ids, labels


def matmul_parameters(model) -> int:
    embedding = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embedding
    return model.num_parameters() - (0 if tied else embedding.numel())


def attention_flops(config, length: int) -> float:
    """Scores and values for one token against a sequence of `length`, forward only: 2 x 2 x layers x width x L."""
    return 4.0 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * length


def timed_steps(args, step, steps: int | None = None) -> float:
    """Seconds per call of `step`, after the warm-up."""
    steps = steps or WORKLOAD[args.shape]["steps"]
    for _ in range(WORKLOAD[args.shape]["warmup"]):
        step()
    synchronize(args.device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    synchronize(args.device)
    return (time.perf_counter() - start) / steps


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None


def throughput(args, student_dir: str, teacher_dir: str, peak_tflops: float | None) -> dict:
    """SFT and KD steps at the workload's shape: tokens/s, MFU, peak memory."""
    student = load_pretrained(student_dir, device=args.device).train()
    teacher = load_pretrained(teacher_dir, dtype=torch.bfloat16 if args.device.startswith("cuda") else torch.float32,
                              device=args.device).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)
    ids, labels = sft_batch(args)
    mask = torch.ones_like(ids)
    length = ids.shape[1]

    def sft_step():
        with autocast_context(args.device, "bfloat16"):
            hidden, targets = completion_hidden(student, ids, mask, labels)
            loss_sum, tokens = chunked_sft_loss(hidden, student.lm_head.weight, targets, vocab_size=151669)
        (loss_sum / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def kd_step():
        with torch.no_grad(), autocast_context(args.device, "bfloat16"):
            teacher_hidden, _ = completion_hidden(teacher, ids, mask, labels)
        with autocast_context(args.device, "bfloat16"):
            hidden, targets = completion_hidden(student, ids, mask, labels)
            kd_sum, tokens = chunked_loss(
                lambda s, t, y: (distillation_loss(s, t, y, 1.0, reduction="sum"), sft_loss(s, y)[1]), hidden,
                student.lm_head.weight, targets, teacher_hidden, teacher.lm_head.weight, vocab_size=151669)
        (kd_sum / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    student_flops = 6.0 * matmul_parameters(student) + 3.0 * attention_flops(student.config, length)
    teacher_flops = 2.0 * matmul_parameters(teacher) + attention_flops(teacher.config, length)
    results = {}
    for name, step, per_token in (("sft", sft_step, student_flops), ("kd", kd_step, student_flops + teacher_flops)):
        reset_peak(args.device)
        seconds = timed_steps(args, step)
        tokens_per_s = ids.numel() / seconds
        results[name] = {"tokens_per_s": tokens_per_s, "step_s": seconds, "flops_per_token": per_token,
                         "mfu": tokens_per_s * per_token / (peak_tflops * 1e12) if peak_tflops else None,
                         "peak_memory_gib": peak_gib(args.device)}
    return results


def opd_split(args, student_dir: str, teacher_dir: str) -> dict:
    """One OPD step by phase (bench_opd.opd_step), and generate against transformers' on the same weights."""
    batch_size, new_tokens = WORKLOAD[args.shape]["opd"]
    opts = SimpleNamespace(device=args.device, dtype="bfloat16", seed=0, max_new_tokens=new_tokens,
                           gen_temperature=1.0, top_k=0, top_p=1.0, beta=1.0, temperature=1.0, loss_chunk_size=512,
                           batch_size=batch_size)
    tokenizer = load_tokenizer(None)
    student = load_pretrained(student_dir, device=args.device).train()
    teacher = load_pretrained(teacher_dir, dtype=torch.bfloat16 if args.device.startswith("cuda") else torch.float32,
                              device=args.device).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-6)
    rows = RowDataset(ensure_demo_data()["opd_prompts"])
    batch = PromptCollator(tokenizer, 256, False)([rows[i % len(rows)] for i in range(batch_size)])
    batch = {**batch, "prompt_ids": batch["prompt_ids"].to(args.device),
             "prompt_attention_mask": batch["prompt_attention_mask"].to(args.device)}
    opd_step(opts, student, teacher, optimizer, tokenizer, batch, 0)  # warm-up
    reset_peak(args.device)
    phases, stats = opd_step(opts, student, teacher, optimizer, tokenizer, batch, 1)
    result = {"phases_ms": phases, "generated_tokens": stats["generated_tokens"],
              "generation_tokens_per_s": stats["generated_tokens"] / (phases["generation"] / 1000.0),
              "peak_memory_gib": peak_gib(args.device)}
    result["generate_vs_transformers"] = generate_against_transformers(args, student_dir, batch, new_tokens)
    return result


def generate_against_transformers(args, student_dir: str, batch: dict, new_tokens: int) -> dict | None:
    """Greedy, every row exactly `new_tokens` long (no EOS), bf16 on CUDA: seconds of ours and of transformers'."""
    try:
        import transformers  # benchmarks only; the project never imports it
    except ImportError:
        return None
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    ours = load_pretrained(student_dir, dtype=dtype, device=args.device).eval()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(student_dir, dtype=dtype).to(args.device).eval()
    ids, mask = batch["prompt_ids"], batch["prompt_attention_mask"]

    def run_ours():
        generate(ours, ids, mask, new_tokens, do_sample=False)

    def run_theirs():
        with torch.no_grad():
            theirs.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            do_sample=False, pad_token_id=0)
    seconds = {"ours": timed_steps(args, run_ours, 1), "transformers": timed_steps(args, run_theirs, 1)}
    return {**seconds, "transformers_over_ours": seconds["transformers"] / seconds["ours"],
            "transformers_version": transformers.__version__}


# --------------------------------------------------------------------------------------------------------- report

def gpu_peak_tflops(args) -> float | None:
    if args.peak_tflops or not args.device.startswith("cuda"):
        return args.peak_tflops
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def print_report(report: dict) -> None:
    print(f"\n{report['device_name']} | torch {report['torch']} | shapes {report['shape']}\n")
    print("| smoke run | ok | last loss | seconds |")
    print("|---|---|---|---|")
    for r in report["smoke"]:
        print(f"| {r['loop']} {r['variant']} | {'yes' if r['ok'] else 'NO: ' + r.get('error', 'non-finite loss')} | "
              f"{r.get('last_loss', float('nan')):.4f} | {r['seconds']:.0f} |")
    b = report["bf16_vs_fp32"]
    print(f"\nbf16 vs fp32 first SFT loss: {b['bfloat16']:.4f} vs {b['float32']:.4f}, relative difference "
          f"{b['relative_difference']:.2e} (tolerance {b['tolerance']}): {'ok' if b['ok'] else 'NOT OK'}\n")
    batch, length, _ = WORKLOAD[report["shape"]]["sft"]
    print(f"| step ({batch} x {length} tokens, bf16 autocast) | tokens/s | MFU | peak memory GiB |")
    print("|---|---|---|---|")
    for name, t in report["throughput"].items():
        mfu = f"{100 * t['mfu']:.1f}%" if t["mfu"] is not None else "-"
        memory = f"{t['peak_memory_gib']:.1f}" if t["peak_memory_gib"] is not None else "-"
        print(f"| {name.upper()} | {t['tokens_per_s']:,.0f} | {mfu} | {memory} |")
    o = report["opd"]
    batch, new_tokens = WORKLOAD[report["shape"]]["opd"]
    print(f"\nOPD step ({batch} prompts x {new_tokens} new tokens): " + ", ".join(
        f"{phase} {ms:.0f} ms" for phase, ms in o["phases_ms"].items())
        + f"; generation {o['generation_tokens_per_s']:,.0f} tokens/s")
    g = o["generate_vs_transformers"]
    if g:
        print(f"greedy generate, same weights: ours {g['ours']:.2f} s, transformers {g['transformers']:.2f} s "
              f"({g['transformers_over_ours']:.2f}x)")


def main(argv=None) -> int:
    args = parse_args(argv)
    args.shape = "tiny" if args.tiny else "full"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: nothing to measure (python benchmarks/bench_gpu.py --device cpu --tiny runs the "
              "same code paths on tiny shapes)")
        return 0
    folder = args.workdir or tempfile.mkdtemp(prefix="bench_gpu_")
    started = time.perf_counter()
    student, teacher = write_models(args.shape, folder)
    report = {"device": args.device, "shape": args.shape, "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "smoke": smoke_runs(args, student, teacher, folder), "bf16_vs_fp32": bf16_agrees_with_fp32(args, student),
              "throughput": throughput(args, student, teacher, gpu_peak_tflops(args)),
              "opd": opd_split(args, student, teacher)}
    report["seconds"] = time.perf_counter() - started
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
    print_report(report)
    print(f"\n{report['seconds']:.0f} s in all; wrote {args.out}")
    failed = [r for r in report["smoke"] if not r["ok"]] + ([] if report["bf16_vs_fp32"]["ok"] else ["bf16"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
