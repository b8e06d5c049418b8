# python -m pytest -q -n0 tests/test_make_dpo_pairs.py
"""dataset/make_dpo_pairs.py: the pairing on hand-made verdicts, the script end to end on a tiny random Qwen3 (its
answers are eval_math.py's for the same seeds; the grader replaced, since a random model is never right) and a
refused file."""
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.errors import run_script
from dataset import make_dpo_pairs
from dataset.make_dpo_pairs import build_pairs, pick_pair
from eval import eval_math
from eval.grader import GradeResult
from model import Qwen3Config, create_model, save_pretrained
from support import TINY_CONFIG

N_SAMPLES = 3
QUESTIONS = [("What is 2 + 3?", "5"), ("Compute 40 - 12.", "28"), ("Calculate 7 + 8.", "15")]


def dapo_row(question: str, truth: str | None) -> dict:
    return {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}],
            "reward_model": {"ground_truth": truth}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved tiny model (untied head: a tied random model repeats its last input token) and a DAPO parquet."""
    folder = tmp_path_factory.mktemp("dpo")
    model = create_model(Qwen3Config.from_dict({**TINY_CONFIG, "tie_word_embeddings": False}), seed=0)
    save_pretrained(model, str(folder / "model"))
    data = str(folder / "problems.parquet")
    pq.write_table(pa.Table.from_pylist([dapo_row(q, t) for q, t in QUESTIONS]), data)
    return {"model_dir": str(folder / "model"), "data": data, "folder": folder}


def flags(setup, out, *more: str, data: str | None = None) -> list[str]:
    return ["--model_path", setup["model_dir"], "--data_path", data or setup["data"], "--device", "cpu",
            "--max_new_tokens", "4", "--n_samples", str(N_SAMPLES), "--seed", "3", "--out", str(out), "--no_progress",
            *more]


# ------------------------------------------------------------------------------------------------------- pairing

def test_pick_pair_takes_the_lowest_right_and_the_lowest_wrong_sample():
    assert pick_pair([False, True]) == (1, 0)
    assert pick_pair([True, False, True, False]) == (0, 1)
    assert pick_pair([False, False, True, False, True]) == (2, 0)
    assert pick_pair([True, True, True]) is None and pick_pair([False, False]) is None


def test_build_pairs_counts_and_schema():
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "old answer",
                                                                  "reasoning_content": "hidden"}]} for i in range(3)]
    verdicts = [[False, True, True], [True, True, True], [False, False, False]]
    records = [{"index": i, "completion": f"answer {i}.{s}", "correct": v, "ground_truth": str(i)}
               for i, row_verdicts in enumerate(verdicts) for s, v in enumerate(row_verdicts)]
    pairs, counts = build_pairs(rows, records, 3)
    assert counts == {"prompts": 3, "pairs": 1, "all right": 1, "all wrong": 1}
    # the prompt is the messages before the last assistant turn, role and content only
    assert pairs == [{"prompt": [{"role": "user", "content": "q0"}],
                      "chosen": [{"role": "assistant", "content": "answer 0.1"}],
                      "rejected": [{"role": "assistant", "content": "answer 0.0"}],
                      "ground_truth": "0", "chosen_sample": 1, "rejected_sample": 0, "row_index": 0}]
    with pytest.raises(ValueError, match="records"):
        build_pairs(rows, records[:-1], 3)


# ---------------------------------------------------------------------------------------------------- end to end

def test_pairs_are_the_models_own_samples(setup, monkeypatch, capsys):
    """eval_math.py samples first (real grader: all wrong); then make_dpo_pairs.py, at another batch size, with a
    grader that calls right: row 0's samples 1 and 2, row 1's every sample, row 2's none."""
    reference = setup["folder"] / "reference.jsonl"
    eval_math.main(flags(setup, reference, "--temperature", "1", "--batch_size", "4"))
    texts = [json.loads(line)["completion"] for line in reference.read_text().splitlines()]
    by_row = [texts[i * N_SAMPLES:(i + 1) * N_SAMPLES] for i in range(len(QUESTIONS))]  # row i's sample s: [i][s]
    assert len({text for row in by_row for text in row}) == len(QUESTIONS) * N_SAMPLES  # all told apart
    right = {by_row[0][1], by_row[0][2], *by_row[1]}
    monkeypatch.setattr(eval_math, "grade", lambda text, truth, timeout: GradeResult(text in right, None, "ok"))

    out = setup["folder"] / "pairs.parquet"
    counts = make_dpo_pairs.main(flags(setup, out, "--batch_size", "2"))
    assert counts == {"prompts": 3, "pairs": 1, "all right": 1, "all wrong": 1}
    assert capsys.readouterr().out.splitlines()[-2].startswith("prompts 3 | pairs 1 | all right 1 | all wrong 1 |")
    pairs = pq.read_table(out).to_pylist()
    assert pairs == [{"prompt": dapo_row(*QUESTIONS[0])["prompt"],
                      "chosen": [{"role": "assistant", "content": by_row[0][1]}],
                      "rejected": [{"role": "assistant", "content": by_row[0][0]}],
                      "ground_truth": "5", "chosen_sample": 1, "rejected_sample": 0, "row_index": 0}]
    assert not [name for name in os.listdir(setup["folder"]) if ".tmp-" in name]  # no temporary left behind


def test_rows_without_a_ground_truth_are_refused_and_nothing_is_written(setup, tmp_path, capsys):
    data = str(tmp_path / "no_truth.parquet")
    pq.write_table(pa.Table.from_pylist([dapo_row("What is 1 + 1?", None)]), data)
    out = tmp_path / "out" / "pairs.jsonl"
    with pytest.raises(SystemExit) as stop:
        run_script(lambda: make_dpo_pairs.main(flags(setup, out, data=data)))
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"error: --data_path {data}: row 0 has no ground truth") and "\n" not in error
    assert sorted(os.listdir(tmp_path)) == ["no_truth.parquet"]  # neither the pairs nor their folder
