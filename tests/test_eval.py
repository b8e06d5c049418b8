# python -m pytest tests/test_eval.py
"""eval/eval_math.py and eval/chat.py on a tiny random Qwen3 (untied head, so greedy text depends on the prompt)
and a small DAPO-shaped parquet written here; the training loops' held-out evaluation allocates no gradient."""
import io
import json
import math
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.errors import UserError
from common.version import code_commit
from dataset.collators import PromptCollator
from support import ROOT, TINY_CONFIG, Allocations
from dataset.sources import RowDataset
from eval import chat, eval_math
from eval.eval_math import Completion, evaluate_math, pass_at_k
from model import Qwen3Config, create_model, load_tokenizer, save_pretrained
from common.seeds import derived_seed
from trainer.evaluation.heldout import heldout_sums
from trainer.losses.divergences import evaluation_divergence
from trainer.teachers.teacher_set import EvalTeacher

# (question, ground truth); prompt lengths differ, so the length sort really reorders the rows
PROBLEMS = [("What is 2 + 3?", "5"),
            ("Compute 40 - 12, and explain each step of the subtraction in detail before answering.", "28"),
            ("Calculate 7 + 8.", "15"),
            ("What is 9 - 4? Put the final answer in \\boxed{}.", "5"),
            ("What is 6 + 6?", "12")]


def dapo_row(question: str, truth: str | None, index: int) -> dict:
    return {"data_source": "test", "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": index}}


def write_parquet(path, problems) -> str:
    pq.write_table(pa.Table.from_pylist([dapo_row(q, t, i) for i, (q, t) in enumerate(problems)]), str(path))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved tiny model (untied lm_head: a tied random model just repeats its last input token) and the parquet."""
    folder = tmp_path_factory.mktemp("eval")
    config = Qwen3Config.from_dict({**TINY_CONFIG, "tie_word_embeddings": False})
    model = create_model(config, seed=0).eval()
    save_pretrained(model, str(folder / "model"))
    return {"model": model, "tokenizer": load_tokenizer(str(folder / "model")), "model_dir": str(folder / "model"),
            "data": write_parquet(folder / "problems.parquet", PROBLEMS), "folder": folder}


def rows_of(path: str) -> list[dict]:
    dataset = RowDataset(path)
    return [dataset[i] for i in range(len(dataset))]


# ------------------------------------------------------------------------------------------------------ eval_math

def test_cli_writes_results_in_input_order_and_summary(setup, capsys):
    out = setup["folder"] / "cli" / "results.jsonl"
    summary = eval_math.main(["--model_path", setup["model_dir"], "--data_path", setup["data"], "--batch_size", "2",
                              "--max_new_tokens", "4", "--out", str(out), "--device", "cpu", "--no_progress"])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(len(PROBLEMS)))
    assert [r["ground_truth"] for r in records] == [t for _, t in PROBLEMS]
    assert all(q in r["prompt"] for r, (q, _) in zip(records, PROBLEMS))
    assert all(set(r) >= {"completion", "extracted", "correct", "reason"} and "sample" not in r for r in records)

    written = json.loads((setup["folder"] / "cli" / "results.summary.json").read_text())
    correct = sum(r["correct"] for r in records)
    assert written["accuracy"] == summary["accuracy"] == correct / len(records)
    assert written["correct"] == correct and written["samples"] == len(PROBLEMS)
    # what made it: the flags and the code's commit (benchmarks/demo.py reuses a grading only of the same both)
    assert written["args"]["max_new_tokens"] == 4 and written["commit"] == code_commit() != ""
    assert capsys.readouterr().out.startswith(f"accuracy {correct / len(records):.3f} [")


def test_default_output_lies_beside_the_model_folder(setup, capsys):
    """Not inside it: a training run's next save replaces the model folder whole, results and all."""
    eval_math.main(["--model_path", setup["model_dir"], "--data_path", setup["data"], "--max_rows", "2",
                    "--max_new_tokens", "2", "--device", "cpu", "--no_progress"])
    out, summary = setup["folder"] / "model_eval_problems.jsonl", setup["folder"] / "model_eval_problems.summary.json"
    assert f"wrote {out} and {summary}" in capsys.readouterr().out
    save_pretrained(setup["model"], setup["model_dir"])  # what the next save of a training run does
    assert len(out.read_text().splitlines()) == 2 and json.loads(summary.read_text())["out"] == str(out)
    assert not [name for name in os.listdir(setup["model_dir"]) if "eval" in name]


def test_output_paths():
    assert eval_math.output_paths(None, "checkpoints/sft", "dataset/demo/eval.parquet") == \
        ("checkpoints/sft_eval_eval.jsonl", "checkpoints/sft_eval_eval.summary.json")
    assert eval_math.output_paths(None, "checkpoints/sft/", "d/test.jsonl")[0] == "checkpoints/sft_eval_test.jsonl"
    assert eval_math.output_paths("r/out.jsonl", "checkpoints/sft", "d/test.jsonl") == ("r/out.jsonl",
                                                                                       "r/out.summary.json")
    here = os.path.abspath(".")
    assert eval_math.output_paths(None, ".", "eval.parquet")[0] == \
        os.path.join(os.path.dirname(here), f"{os.path.basename(here)}_eval_eval.jsonl")


def stub_from(answers: dict[str, str], tokenizer):
    """A complete_batch replacement: the completion is chosen by the question found in the decoded prompt."""
    def complete_batch(model, tok, prompt_ids, prompt_mask, *args, **kwargs):
        texts = [tokenizer.decode(ids[mask.bool()]) for ids, mask in zip(prompt_ids, prompt_mask)]
        return [Completion(next(a for q, a in answers.items() if q in text), 3, True) for text in texts]
    return complete_batch


def test_stub_completions_give_exact_accuracy_and_interval(setup, monkeypatch):
    answers = {PROBLEMS[0][0]: "So \\boxed{5}.", PROBLEMS[1][0]: "\\boxed{27}", PROBLEMS[2][0]: "\\boxed{15}",
               PROBLEMS[3][0]: "The answer is five-ish", PROBLEMS[4][0]: "\\boxed{\\frac{24}{2}}"}
    monkeypatch.setattr(eval_math, "complete_batch", stub_from(answers, setup["tokenizer"]))
    summary, records = evaluate_math(setup["model"], setup["tokenizer"], rows_of(setup["data"]), batch_size=2,
                                     progress=False)
    assert [r["correct"] for r in records] == [True, False, True, False, True]
    assert records[3]["reason"] == "no answer found" and records[4]["extracted"] == "\\frac{24}{2}"
    assert summary["accuracy"] == 0.6 and summary["correct"] == 3
    # Wilson 95% for 3/5, by hand: centre (0.6 + z^2/10) / (1 + z^2/5), half-width 1.96 sqrt(.048 + z^2/100) / same
    assert summary["accuracy_ci95"] == pytest.approx([0.2307, 0.8824], abs=1e-4)
    assert summary["eos_share"] == 1.0 and summary["mean_completion_tokens"] == 3.0


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)                 # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)                 # 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(10, 3, 3) == pytest.approx(1 - 35 / 120)       # 1 - C(7,3)/C(10,3)
    assert pass_at_k(5, 2, 4) == 1.0 and pass_at_k(10, 0, 3) == 0.0 and pass_at_k(3, 3, 1) == 1.0
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_n_samples_report_pass_at_k_and_mean(setup, monkeypatch):
    """Rows 0..2 with 4 samples each; sample s of row i is correct when (i, s) is in `right`. The stub recognises
    the sample by its seed, which is a function of (seed, row, sample) only."""
    right = {(0, 0), (1, 0), (1, 1), (1, 2), (1, 3)}  # c = 1, 4, 0
    by_seed = {derived_seed(7, i, s): (i, s) for i in range(3) for s in range(4)}

    def complete_batch(model, tok, prompt_ids, prompt_mask, max_new_tokens, temperature, top_p, seeds, stop, server,
                       decoder=None, responder=None, max_turns=1):
        jobs = [by_seed[seed] for seed in seeds]
        return [Completion(f"\\boxed{{{PROBLEMS[i][1] if (i, s) in right else 'x'}}}", 2, False) for i, s in jobs]

    monkeypatch.setattr(eval_math, "complete_batch", complete_batch)
    summary, records = evaluate_math(setup["model"], setup["tokenizer"], rows_of(setup["data"])[:3], batch_size=5,
                                     n_samples=4, temperature=0.7, seed=7, progress=False)
    assert [(r["index"], r["sample"]) for r in records] == [(i, s) for i in range(3) for s in range(4)]
    assert {(r["index"], r["sample"]) for r in records if r["correct"]} == right
    assert summary["pass@k"] == pytest.approx({"1": (0.25 + 1 + 0) / 3, "2": (0.5 + 1 + 0) / 3, "4": 2 / 3})
    assert summary["mean@4"] == pytest.approx(5 / 12) and summary["eos_share"] == 0.0
    # the intervals resample the 3 problems (per-problem values 1/4, 1, 0 for mean@4): within the extremes, around
    # the mean; every pass@k's too
    low, high = summary["mean@4_ci95"]
    assert 0.0 <= low < 5 / 12 < high <= 1.0
    assert all(low <= summary["pass@k"][k] <= high for k, (low, high) in summary["pass@k_ci95"].items())
    line = eval_math.format_summary(summary)
    assert f"mean@4 0.417 [{low:.3f}, {high:.3f}]" in line and "pass@4 0.667 [" in line
    with pytest.raises(ValueError, match="temperature > 0"):
        evaluate_math(setup["model"], setup["tokenizer"], rows_of(setup["data"]), n_samples=4, temperature=0.0)
    with pytest.raises(UserError, match="temperature > 0"):
        eval_math.parse_args(["--model_path", "x", "--n_samples", "4"])


def test_a_compiled_decode_step_with_a_server_is_refused(setup):
    with pytest.raises(UserError, match="--decode compiled compiles the built-in engine's decode step"):
        eval_math.parse_args(["--model_path", setup["model_dir"], "--decode", "compiled", "--server_url",
                              "http://127.0.0.1:1/v1"])


@pytest.mark.slow
def test_the_compiled_decode_step_completes_what_the_eager_one_completes(setup, tmp_path):
    """--decode compiled (the decode step under inductor): the same greedy records as the eager step (the CPU's
    default, auto)."""
    runs = []
    for compiled in ("auto", "compiled"):
        out = tmp_path / f"compiled{compiled}.jsonl"
        eval_math.main(["--model_path", setup["model_dir"], "--data_path", setup["data"], "--batch_size", "2",
                        "--max_new_tokens", "6", "--out", str(out), "--device", "cpu", "--no_progress",
                        "--decode", compiled])
        runs.append([json.loads(line) for line in out.read_text().splitlines()])
    assert runs[0] == runs[1]


def test_greedy_is_the_same_across_batch_sizes(setup):
    rows = rows_of(setup["data"])
    kwargs = dict(max_new_tokens=6, progress=False)
    _, one = evaluate_math(setup["model"], setup["tokenizer"], rows, batch_size=1, **kwargs)
    _, four = evaluate_math(setup["model"], setup["tokenizer"], rows, batch_size=4, **kwargs)
    completions = [r["completion"] for r in one]
    assert completions == [r["completion"] for r in four]
    assert len(set(completions)) > 1  # the prompts matter: a degenerate model would make this test vacuous


def test_missing_ground_truth_refused(setup, tmp_path):
    path = write_parquet(tmp_path / "partial.parquet", PROBLEMS[:2] + [("What is 1 + 1?", None)] + PROBLEMS[2:])
    with pytest.raises(UserError, match="row 2 has no ground truth"):
        eval_math.main(["--model_path", setup["model_dir"], "--data_path", path, "--device", "cpu"])
    with pytest.raises(ValueError, match="row 2 has no ground truth"):
        evaluate_math(setup["model"], setup["tokenizer"], rows_of(path), progress=False)


# ----------------------------------------------------------------------------------------------------------- chat

def test_streaming_decode_never_splits_a_character(setup):
    tokenizer = setup["tokenizer"]
    text = "naïve 你好 🙂 done"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # some character really spans several tokens
    pieces, shown = [], ""
    for n in range(1, len(ids) + 1):
        shown = chat.show_new_text(tokenizer, ids[:n], shown, pieces.append)
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_chat_one_shot_prints_the_streamed_reply(setup):
    """The script itself (its sys.path set-up, stdout only holding the reply), against the same greedy reply
    produced in this process."""
    argv = ["--model_path", setup["model_dir"], "--prompt", "What is 2 + 3?", "--temperature", "0",
            "--max_new_tokens", "5", "--device", "cpu"]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "eval", "chat.py"), *argv], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    tokenizer = setup["tokenizer"]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                           add_generation_prompt=True, enable_thinking=False)
    expected = chat.stream_reply(setup["model"], tokenizer, tokenizer.encode(prompt), 5, 0.0, 1.0, None,
                                 lambda piece: None)
    assert expected and result.stdout == expected + "\n"


def test_chat_interactive_keeps_history_over_two_turns(setup, monkeypatch, capsys):
    prompts = []
    real_stream_reply = chat.stream_reply

    def spy(model, tokenizer, prompt_ids, *args):
        prompts.append(tokenizer.decode(prompt_ids))
        return real_stream_reply(model, tokenizer, prompt_ids, *args)

    monkeypatch.setattr(chat, "stream_reply", spy)
    monkeypatch.setattr(sys, "stdin", io.StringIO("What is 2 + 3?\n\nAnd times 4?\nexit\nnever read\n"))
    history = chat.main(["--model_path", setup["model_dir"], "--system", "Be brief.", "--max_new_tokens", "4",
                         "--device", "cpu", "--seed", "3"])
    assert [turn["role"] for turn in history] == ["system", "user", "assistant", "user", "assistant"]
    assert len(prompts) == 2 and "Be brief." in prompts[1] and "What is 2 + 3?" in prompts[1]
    assert history[2]["content"].strip() in prompts[1]  # the first answer is part of the second turn's context
    assert capsys.readouterr().out == history[2]["content"] + "\n" + history[4]["content"] + "\n"


# ------------------------------------------------------------------------------------------- held-out evaluation

def test_the_held_out_divergence_allocates_no_gradient_of_the_students_head(setup):
    """heldout_sums passes the student's lm_head.weight, a Parameter, to the fused loss under no_grad: no dL/dW of
    the head's shape (V, H) is allocated (622 MB of fp32 at Qwen3-0.6B), so the evaluation's peak is a forward's."""
    student, tokenizer = setup["model"], setup["tokenizer"]
    batch = PromptCollator(tokenizer, 64, enable_thinking=False)(rows_of(setup["data"])[:2])
    teachers = [EvalTeacher("teacher", evaluation_divergence(1.0, local_teacher=True), model=student)]
    head = tuple(student.lm_head.weight.shape)
    with Allocations() as allocated:
        sums = heldout_sums(student, tokenizer, [batch], 3, teachers)
    assert sums["kl_tokens/teacher"] > 0
    assert head not in allocated.shapes


def test_the_code_commit_names_head_and_says_when_the_tree_differs(tmp_path, monkeypatch):
    """common/version.py: HEAD's short commit, marked when a tracked file differs; "unknown" outside a checkout."""
    from common import version
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f.txt").write_text("a")
    subprocess.run(git + ["add", "f.txt"], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(version, "ROOT", str(repo))
    assert version.code_commit() == head and version.is_exact(head)
    (repo / "f.txt").write_text("b")
    assert version.code_commit() == head + " with local changes" and not version.is_exact(version.code_commit())
    monkeypatch.setattr(version, "ROOT", str(tmp_path / "nowhere"))
    assert version.code_commit() == "unknown" and not version.is_exact("unknown")


def test_a_result_stands_across_commits_that_change_only_docs_and_tests(tmp_path):
    """common/version.py's same_code: the same exact commit, or exact commits between which only docs/, *.md and
    tests/ changed; code changed, a commit with local changes, an unknown commit: not the same code."""
    from common.version import LOCAL_CHANGES, same_code
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "tests").mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    commits = []
    for path, text in (("code.py", "a = 1"), ("docs/page.md", "words"), ("README.md", "more"),
                       ("tests/test_x.py", "x = 1"), ("code.py", "a = 2")):
        (repo / path).write_text(text)
        subprocess.run(git + ["add", path], check=True)
        subprocess.run(git + ["commit", "-qm", path], check=True)
        commits.append(subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                      check=True).stdout.strip())
    assert same_code(commits[0], commits[0], str(repo)) and same_code(commits[0], commits[3], str(repo))
    assert not same_code(commits[0], commits[4], str(repo)) and not same_code(commits[3], commits[4], str(repo))
    assert not same_code(commits[0], commits[0] + LOCAL_CHANGES, str(repo))
    assert not same_code("abc1234", commits[0], str(repo)) and not same_code("unknown", "unknown", str(repo))
    assert same_code(commits[3], commits[4], str(repo), unused=(":(exclude)code.py",))  # a file the result never used
