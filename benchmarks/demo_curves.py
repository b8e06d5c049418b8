"""The demo's learning curves at equal compute: each method's held-out accuracy at every graded step of its runs
against (a) optimizer steps, (b) FLOPs spent and (c) teacher tokens, read from the table's JSON (benchmarks/demo.py
writes the points); one figure into docs/, and each on-policy method against the off-policy baselines at equal steps
and at equal FLOPs (McNemar's exact test on the same held-out problems, seed by seed), printed in Markdown.

    python benchmarks/demo_curves.py --task running_sum   # checkpoints/demo_running_sum/demo.json -> docs/curves_running_sum.png
    python benchmarks/demo_curves.py --json PATH --out PNG

FLOPs are benchmarks/roofline.py's count (`sequence_flops`: 2 per layer parameter per token, 2 H V per position
through the head, attention's causal pairs; a backward twice the forward), per optimizer step of R = 16 sequences
of p prompt tokens (the task's mean, through the chat template) and T / R answer tokens (T: the step's logged
`tokens`, the positions trained on):
    training     R x sequence_flops(student, p + T/R, T/R, backward)   every method (a LoRA student counted as full)
    generation   R x sequence_flops(student, p + T/R, T/R, forward)    the student's sampled answers: OPD, logit-free
                                                                       OPD, RL (a KV-cached decode does these products)
    teacher      R x sequence_flops(teacher, p + T/R, T/R, forward)    KD and OPD score the answers with it; SFT on its
                                                                       answers had it generate them
A black-box teacher's FLOPs are unknown: logit-free OPD's teacher is counted in tokens only. Teacher tokens are what
the teacher read and wrote: R p + T a step for KD, OPD and SFT on its answers; the black box's usage (prompt +
completion tokens) as the loop logs it; none for RL.
"""
from __future__ import annotations

import math
import os
import sys
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.demo_stats import paired_test  # noqa: E402
from benchmarks.roofline import sequence_flops  # noqa: E402
from common.errors import ArgumentParser, UserError, run_script  # noqa: E402
from dataset.make_demo_data import ensure_demo_data  # noqa: E402
from model import Qwen3Config  # noqa: E402

ROWS = 16  # sequences per optimizer step, every method (benchmarks/demo.py)
# the phases each method's step spends (module docstring)
PHASES = {"sft_data": ("training", "teacher"), "kd": ("training", "teacher"),
          "opd": ("generation", "teacher", "training"), "opd_lora": ("generation", "teacher", "training"),
          "lf_vllm": ("generation", "training"), "lf_rule": ("generation", "training"), "rl": ("generation", "training")}
BASELINES = ("sft_data", "kd")  # off-policy: what each on-policy method is tested against


def step_flops(method: str, tokens: float, prompt_tokens: float, student: Qwen3Config,
               teacher: Qwen3Config) -> float:
    """FLOPs of one optimizer step of `method` that trained on `tokens` answer positions (module docstring)."""
    answer = tokens / ROWS
    length = prompt_tokens + answer
    phases = {
        "training": sequence_flops(student, length, answer, student.vocab_size, causal=True, backward=True),
        "generation": sequence_flops(student, length, answer, student.vocab_size, causal=True, backward=False),
        "teacher": sequence_flops(teacher, length, answer, teacher.vocab_size, causal=True, backward=False),
    }
    return ROWS * sum(phases[phase] for phase in PHASES[method])


def teacher_tokens(method: str, point: dict, prompt_tokens: float) -> float:
    """Teacher tokens up to a curve point (module docstring): `point` holds the counts summed up to its step."""
    if "teacher" in PHASES[method]:
        return ROWS * prompt_tokens * point["step"] + point["tokens"]
    return point.get("teacher_tokens", 0.0)


def curves(table: dict, prompt_tokens: float, student: Qwen3Config, teacher: Qwen3Config) -> list[dict]:
    """Every method row's points with its FLOPs and teacher tokens: [{method, seed, points: [{step, accuracy,
    flops, teacher_tokens, gradings}]}]. A step's FLOPs use the run's mean tokens per step up to that point."""
    out = []
    for row in table["rows"]:
        if not row.get("curve") or row["method"] not in PHASES:
            continue
        points = []
        for point in row["curve"]:
            per_step = point["tokens"] / point["step"]
            flops = point["step"] * step_flops(row["method"], per_step, prompt_tokens, student, teacher)
            points.append({"step": point["step"], "accuracy": point["accuracy"], "flops": flops,
                           "teacher_tokens": teacher_tokens(row["method"], point, prompt_tokens),
                           "gradings": point["gradings"]})
        out.append({"method": row["method"], "label": row["label"], "seed": row["seed"], "points": points})
    return out


def nearest_in_flops(points: Sequence[dict], flops: float) -> dict:
    """The point whose FLOPs are nearest `flops` in ratio."""
    return min(points, key=lambda p: abs(math.log(p["flops"] / flops)))


def comparisons(runs: Sequence[dict], root: str) -> list[dict]:
    """Each on-policy run against each baseline run of the same seed: at every step both graded (equal steps), and
    at every on-policy point against the baseline's point nearest in FLOPs (equal FLOPs)."""
    out = []
    for run in (r for r in runs if r["method"] not in BASELINES):
        for base in (b for b in runs if b["method"] in BASELINES and b["seed"] == run["seed"]):
            at_step = {p["step"]: p for p in base["points"]}
            for point in run["points"]:
                pairs = [("steps", at_step.get(point["step"])), ("FLOPs", nearest_in_flops(base["points"],
                                                                                           point["flops"]))]
                for basis, other in pairs:
                    if other is None:
                        continue
                    only_run, only_base, p = paired_test(os.path.join(root, point["gradings"]),
                                                         os.path.join(root, other["gradings"]))
                    out.append({"method": run["method"], "baseline": base["method"], "seed": run["seed"],
                                "basis": basis, "step": point["step"], "baseline_step": other["step"],
                                "flops": point["flops"], "baseline_flops": other["flops"],
                                "accuracy": point["accuracy"], "baseline_accuracy": other["accuracy"],
                                "only_method": only_run, "only_baseline": only_base, "p": p})
    return out


def comparison_table(rows: Sequence[dict]) -> str:
    lines = ["| method | vs | seed | at equal | method: step, FLOPs, accuracy | baseline: step, FLOPs, accuracy | "
             "only method / only baseline, McNemar p |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['baseline']} | {r['seed']} | {r['basis']} | {r['step']}, "
                     f"{r['flops']:.3g}, {r['accuracy']:.1%} | {r['baseline_step']}, {r['baseline_flops']:.3g}, "
                     f"{r['baseline_accuracy']:.1%} | +{r['only_method']} / -{r['only_baseline']}, p = {r['p']:.2g} |")
    return "\n".join(lines)


def plot(runs: Sequence[dict], student_accuracy: float, teacher_accuracy: float, title: str, path: str) -> None:
    """Three panels (steps, FLOPs, teacher tokens), one line per method (the mean of its seeds at each step, the
    seeds' own points faint); the starting student and the teacher as dashed lines."""
    import matplotlib
    import matplotlib.ticker
    matplotlib.use("Agg")  # no display: a file
    import matplotlib.pyplot as plt
    axes_keys = (("step", "optimizer steps", "linear"), ("flops", "FLOPs spent", "log"),
                 ("teacher_tokens", "teacher tokens", "log"))
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    methods = list(dict.fromkeys(r["method"] for r in runs))
    for index, method in enumerate(methods):
        color = f"C{index}"
        seeds = [r for r in runs if r["method"] == method]
        for axis, (key, _, scale) in zip(axes, axes_keys):
            if scale == "log" and not all(p[key] > 0 for r in seeds for p in r["points"]):
                continue  # RL has no teacher tokens
            for run in seeds:
                axis.plot([p[key] for p in run["points"]], [p["accuracy"] for p in run["points"]], "o", color=color,
                          alpha=0.3, markersize=3)
            steps = [p["step"] for p in seeds[0]["points"]]
            mean = [[sum(r["points"][i][field] for r in seeds) / len(seeds) for i in range(len(steps))]
                    for field in (key, "accuracy")]
            axis.plot(mean[0], mean[1], "-o", color=color, label=seeds[0]["label"], markersize=4)
    for axis, (_, label, scale) in zip(axes, axes_keys):
        axis.axhline(student_accuracy, color="gray", linestyle="--", linewidth=1)
        axis.axhline(teacher_accuracy, color="black", linestyle="--", linewidth=1)
        axis.set_xscale(scale)
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # the decades only: no overlapping labels
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy (greedy)")
    axes[0].legend(fontsize=7, loc="best")
    figure.suptitle(f"{title} (dashed: the starting student, grey; the teacher, black)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def mean_prompt_tokens(data_path: str) -> float:
    """The task's prompts' mean length through the chat template, as the loops render them (no thinking)."""
    from dataset.collators import PromptCollator
    from dataset.sources import RowDataset
    from model.tokenizer import load_tokenizer
    collator = PromptCollator(load_tokenizer(), max_prompt_length=512, enable_thinking=False)
    rows = RowDataset(data_path)
    lengths = [int(m.sum()) for m in collator([rows[i] for i in range(len(rows))])["prompt_attention_mask"]]
    return sum(lengths) / len(lengths)


def main(argv: list[str] | None = None, root: str = ROOT) -> dict:
    """`root`: the repository root the table's paths are relative to (the tests' own)."""
    from benchmarks.demo import SCALES, read_json
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="running_sum", choices=list(SCALES), help="the demo's task")
    parser.add_argument("--json", default=None, help="the table's JSON (default: the task's demo.json)")
    parser.add_argument("--out", default=None, help="the figure (default: docs/curves_TASK.png)")
    args = parser.parse_args(argv)
    task = SCALES[args.task]["cpu"].task
    path = args.json or os.path.join(root, task.save_dir, "demo.json")
    table = read_json(path, f"python benchmarks/demo.py --task {args.task}")
    by_name = {r["name"]: r for r in table["rows"]}
    student = next(r for r in table["rows"][1:] if r["method"] is None)  # the row after the teacher
    folder = os.path.join(root, task.save_dir)
    student_config = Qwen3Config.from_json(os.path.join(folder, student["name"], "config.json"))
    teacher_config = Qwen3Config.from_json(os.path.join(folder, "teacher", "config.json"))
    prompts = mean_prompt_tokens(ensure_demo_data(task=args.task)["opd_prompts"])
    runs = curves(table, prompts, student_config, teacher_config)
    if not runs:
        raise UserError(f"{path} holds no curve: its table was made without --export_steps points (SCALE.curve)")
    out = args.out or os.path.join(root, "docs", f"curves_{args.task}.png")
    plot(runs, student["accuracy"], by_name["teacher"]["accuracy"], table["header"].split(":")[0].strip("# `"), out)
    compared = comparisons(runs, root)
    print(f"wrote {out} (mean prompt {prompts:.1f} tokens)\n\n{comparison_table(compared)}", flush=True)
    return {"runs": runs, "comparisons": compared}


if __name__ == "__main__":
    run_script(main)
