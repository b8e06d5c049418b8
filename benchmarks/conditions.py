"""The conditions the on-policy papers say decide whether on-policy distillation pays, measured on a student and its
teacher over the held-out problems of a demo task:

    python benchmarks/conditions.py --student checkpoints/demo/student --teacher checkpoints/demo/teacher
    python benchmarks/conditions.py --student S --teacher T --task running_sum --rows 200 --json conditions.json
    python benchmarks/conditions.py --table checkpoints/demo_running_sum/demo.json   # before and after each method

- exposure bias, directly: the student's next-token accuracy against the teacher's greedy token (its argmax at the
  same position) on the student's own sampled answers and on the teacher's greedy answers. A student trained only on
  the teacher's prefixes agrees with it there and less on its own: the gap is what on-policy training works on.
- where the student's greedy answers first go wrong: the share whose first wrong step (a segment of the worked
  solution: ", "- and ". "-separated, dataset/make_demo_data.py) is step j, and the share with every step right up
  to step j. On the running-sum task a wrong step makes the rest wrong: early errors are what compound.
- the teacher's top-k on the student's own samples (Rethinking OPD's compatibility measure): the student's
  probability mass inside the teacher's k most likely tokens, k = 1, 5, 16, averaged over the answers' tokens.
  OPD is reported to work where this is 97-99% for a small k.

With --table, a demo table's models are measured in turn against its teacher: the starting student, then each
method's first seed (its final model), one Markdown table printed and every measurement in --json.

Sampling: temperature 1, one sample per problem, seeded per row (the same samples for the same weights); every
answer up to --max_new_tokens. Forwards in fp32 on the CPU; the vocabulary is the tokenizer's (the head's padding
rows are never a token).
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from benchmarks.harness import add_json_arg, prompt_batch, write_json  # noqa: E402
from benchmarks.rule_teacher import correct_solution, segments  # noqa: E402
from common.errors import ArgumentParser, run_script  # noqa: E402
from dataset.collators import build_sequences  # noqa: E402
from dataset.make_demo_data import ensure_demo_data  # noqa: E402
from dataset.sources import RowDataset  # noqa: E402
from model import generate, load_pretrained, load_tokenizer  # noqa: E402
from trainer.evaluation.heldout import sample_prompts  # noqa: E402
from trainer.losses.chunked import completion_hidden  # noqa: E402

TOP_KS = (1, 5, 16)
SUM_TASKS = ("addition", "running_sum")  # the demo tasks whose worked steps the rule teacher writes (not products)


@torch.no_grad()
def token_sums(student, teacher, sequences: tuple, vocab_size: int, ks: Sequence[int] = TOP_KS,
               chunk_tokens: int = 256) -> dict[str, float]:
    """Over the answer tokens of `sequences` (build_sequences' right-padded input_ids, attention_mask, labels): the
    tokens, how many the student's argmax equals the teacher's at, and for each k the student's probability mass
    summed over the teacher's top k (softmax over the first `vocab_size` logits of each)."""
    student_hidden, _ = completion_hidden(student, *sequences)
    teacher_hidden, _ = completion_hidden(teacher, *sequences)
    sums = {"tokens": float(len(student_hidden)), "agree": 0.0, **{f"mass@{k}": 0.0 for k in ks}}
    for start in range(0, len(student_hidden), chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        student_logits = (student_hidden[rows] @ student.lm_head.weight[:vocab_size].T).float()
        teacher_logits = (teacher_hidden[rows] @ teacher.lm_head.weight[:vocab_size].T).float()
        sums["agree"] += float((student_logits.argmax(-1) == teacher_logits.argmax(-1)).sum())
        probabilities = student_logits.softmax(-1)
        top = teacher_logits.topk(max(ks), dim=-1).indices
        for k in ks:
            sums[f"mass@{k}"] += float(probabilities.gather(1, top[:, :k]).sum())
    return sums


def first_wrong_step(question: str, answer: str) -> int | None:
    """The index of the first segment (step, then the boxed answer; its separator aside) of `answer` that differs
    from the correct worked solution's, a missing one included; None when every segment is right."""
    correct = [segment.strip().rstrip(",.") for segment in segments(correct_solution(question))]
    written = [segment.strip().rstrip(",.") for segment in segments(answer.strip())]
    for index, segment in enumerate(correct):
        if index >= len(written) or written[index] != segment:
            return index
    return None


def step_profile(firsts: Sequence[int | None], steps: int) -> dict[str, list[float]]:
    """-> the share of answers whose first wrong segment is j, and the share right through segment j, j = 0 ..
    steps - 1 (`steps`: the longest solution's segments)."""
    n = max(len(firsts), 1)
    first = [sum(f == j for f in firsts) / n for j in range(steps)]
    right_through = [sum(f is None or f > j for f in firsts) / n for j in range(steps)]
    return {"first_wrong": first, "right_through": right_through}


def answers(model, tokenizer, batch: dict, max_new_tokens: int, sampled: bool, seed: int) -> tuple:
    """The model's answers to the batch's prompts (greedy, or sampled at temperature 1 with each row's seed, as the
    held-out evaluation samples them) -> (build_sequences' sequences, the decoded texts)."""
    if sampled:
        out = sample_prompts(model, tokenizer, batch, max_new_tokens, contextlib.nullcontext, seed)
    else:
        out = generate(model, batch["prompt_ids"], batch["prompt_attention_mask"], max_new_tokens, do_sample=False,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                       vocab_size=len(tokenizer))
    texts = [tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
             for ids, mask in zip(out.completion_ids, out.completion_mask)]
    sequences = build_sequences(batch["prompt_ids"], batch["prompt_attention_mask"], out.completion_ids,
                                out.completion_mask)
    return sequences, texts


def measure(student, teacher, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int = 16,
            seed: int = 0) -> dict:
    """Every measure of the module docstring over `rows` (prompt rows with a `ground_truth`)."""
    student.eval()
    teacher.eval()
    own, teachers = {}, {}
    firsts = []
    for start in range(0, len(rows), batch_size):
        batch = prompt_batch(tokenizer, rows[start:start + batch_size])
        for model, sampled, into in ((student, True, own), (teacher, False, teachers)):
            sequences, _ = answers(model, tokenizer, batch, max_new_tokens, sampled, seed)
            for name, value in token_sums(student, teacher, sequences, len(tokenizer)).items():
                into[name] = into.get(name, 0.0) + value
        _, greedy = answers(student, tokenizer, batch, max_new_tokens, False, seed)
        firsts += [first_wrong_step(row["messages"][-1]["content"], text) for row, text in zip(batch["rows"], greedy)]
    questions = [row["messages"][-1]["content"] for row in rows]
    steps = max(len(segments(correct_solution(question))) for question in questions)
    return {
        "rows": len(rows),
        "agreement_on_own_samples": own["agree"] / own["tokens"],
        "agreement_on_teacher_answers": teachers["agree"] / teachers["tokens"],
        "top_k_mass_on_own_samples": {str(k): own[f"mass@{k}"] / own["tokens"] for k in TOP_KS},
        "greedy_steps": step_profile(firsts, steps),
        "greedy_accuracy": sum(f is None for f in firsts) / max(len(firsts), 1),
    }


def parse_args(argv: Sequence[str] | None = None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--student", default=None, help="the student's HF folder")
    parser.add_argument("--teacher", default=None, help="the teacher's HF folder (the same tokenizer)")
    parser.add_argument("--table", default=None, help="a benchmarks/demo.py table's JSON: its student and each "
                                                      "method's first seed against its teacher, its task")
    parser.add_argument("--task", default="addition", choices=SUM_TASKS, help="whose held-out problems")
    parser.add_argument("--rows", type=int, default=200, help="the first ROWS held-out problems")
    parser.add_argument("--max_new_tokens", type=int, default=None,
                        help="answer budget (default: 64 for addition, 128 for running_sum)")
    parser.add_argument("--seed", type=int, default=0)
    add_json_arg(parser)
    args = parser.parse_args(argv)
    if (args.table is None) == (args.student is None or args.teacher is None):
        parser.error("pass --student and --teacher, or --table (a demo table's JSON)")
    return args


def table_models(path: str) -> tuple[str, str, list[tuple[str, str]]]:
    """A demo table's (task, teacher folder, [(label, model folder)]): its starting student, then each method's
    first seed."""
    from benchmarks.demo import read_json
    table = read_json(path, "python benchmarks/demo.py")
    folder = os.path.dirname(os.path.abspath(path))
    student = next(r for r in table["rows"] if r["method"] is None and r["name"] != "teacher")
    seeds = [r["seed"] for r in table["rows"] if r["method"]]
    methods = [r for r in table["rows"] if r["method"] and r["seed"] == min(seeds) and not r["skipped"]]
    task = table["scale"].get("task", {"name": "addition"})["name"]  # tables older than the long task: the addition's
    models = [(f"the student ({student['name']})", student["name"])] + [(r["label"], r["name"]) for r in methods]
    return task, os.path.join(folder, "teacher"), [(label, os.path.join(folder, name)) for label, name in models]


def measure_model(student_dir: str, teacher_dir: str, task: str, rows_wanted: int, budget: int | None,
                  seed: int, teacher: torch.nn.Module | None = None) -> dict:
    """`teacher`: the teacher's model already loaded (--table measures several students against one)."""
    torch.manual_seed(seed)
    tokenizer = load_tokenizer(student_dir)
    student, teacher = load_pretrained(student_dir), teacher or load_pretrained(teacher_dir)
    dataset = RowDataset(ensure_demo_data(task=task)["eval"])
    rows = [dataset[i] for i in range(min(rows_wanted, len(dataset)))]
    budget = budget or (128 if task == "running_sum" else 64)
    return {"student": student_dir, "teacher": teacher_dir, "task": task,
            **measure(student, teacher, tokenizer, rows, budget, seed=seed)}


def markdown(measured: Sequence[tuple[str, dict]]) -> str:
    steps = max(len(r["greedy_steps"]["right_through"]) for _, r in measured)
    lines = ["| model | agreement with the teacher's argmax: on its answers / on the model's own samples | mass in "
             "the teacher's top-" + " / ".join(map(str, TOP_KS)) + " (own samples) | greedy right through step "
             + " / ".join(map(str, range(1, steps))) + " / the box | greedy accuracy |", "|---|---|---|---|---|"]
    for label, r in measured:
        mass = " / ".join(f"{v:.1%}" for v in r["top_k_mass_on_own_samples"].values())
        through = " / ".join(f"{v:.0%}" for v in r["greedy_steps"]["right_through"])
        lines.append(f"| {label} | {r['agreement_on_teacher_answers']:.1%} / {r['agreement_on_own_samples']:.1%} | "
                     f"{mass} | {through} | {r['greedy_accuracy']:.1%} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.table:
        task, teacher, models = table_models(args.table)
        loaded = load_pretrained(teacher)
        measured = [(label, measure_model(folder, teacher, task, args.rows, args.max_new_tokens, args.seed, loaded))
                    for label, folder in models]
        print(markdown(measured), flush=True)
        results = {"task": task, "teacher": teacher, "models": [{"label": l, **r} for l, r in measured]}
        write_json(args.json, results)
        return results
    results = measure_model(args.student, args.teacher, args.task, args.rows, args.max_new_tokens, args.seed)
    mass = ", ".join(f"top-{k} {v:.1%}" for k, v in results["top_k_mass_on_own_samples"].items())
    print(f"agreement with the teacher's argmax: {results['agreement_on_teacher_answers']:.1%} on its answers, "
          f"{results['agreement_on_own_samples']:.1%} on the student's own samples | student mass in the teacher's "
          f"{mass} | greedy right through each step: "
          + " ".join(f"{v:.0%}" for v in results["greedy_steps"]["right_through"]))
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    run_script(main)
