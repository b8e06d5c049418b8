# python -m pytest tests/test_self_distillation.py
"""Self-distillation in the OPD loop (--self_teacher start | ema | live, trainer/teachers/self_teacher.py): the
teacher's sequence is the privileged prompt and then exactly the student's completion (token sequences read from
the forwards themselves); with a template that adds nothing the live teacher is the student (every step's loss 0)
and the start is the student at step 1; the EMA equals its closed form over the exported weights and is in the
resume file; the flags' and the rows' errors are one line at start-up, nothing written. The EMA's SIGKILL resume,
2 ranks and accumulation: tests/test_loop_invariants.py ("opd_self"); a LoRA student's start held once:
tests/test_lora_training.py."""
import json
import os

import pytest
import torch

from loop_helpers import assert_one_line_error, loop_args, metrics, script_exit
from support import TINY_CONFIG, write_chat_jsonl
from dataset.collators import IGNORE_INDEX, PromptCollator, build_sequences
from model import load_pretrained, load_tokenizer
from trainer.teachers import parts
from trainer.teachers.self_teacher import privileged_sequences
from trainer import train_opd

pytestmark = pytest.mark.usefixtures("one_thread")
TEMPLATE = "{question} The answer: {ground_truth}."


@pytest.fixture
def files(tmp_path):
    config = tmp_path / "tiny_config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    return str(config), write_chat_jsonl(tmp_path / "chat.jsonl", 8)


def opd_args(files, save_dir, **flags):
    config, data = files
    return loop_args(config, data, save_dir, max_new_tokens=8, max_prompt_length=64, **flags)


def test_the_teachers_sequence_is_the_privileged_prompt_then_the_students_completion():
    tokenizer = load_tokenizer()
    collator = PromptCollator(tokenizer, 64, enable_thinking=False)
    rows = [{"messages": [{"role": "user", "content": "What is 2 + 5?"}], "ground_truth": "7"},
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "And 30 + 4?"}],
             "ground_truth": "34"}]
    prompts = collator(rows)
    completions = [tokenizer.encode("2+5=7. \\boxed{7}"), tokenizer.encode("34")]
    width = max(map(len, completions))
    completion_ids = torch.tensor([c + [tokenizer.pad_token_id] * (width - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions])
    input_ids, _, labels = build_sequences(prompts["prompt_ids"], prompts["prompt_attention_mask"], completion_ids,
                                           completion_mask)
    teacher_ids, teacher_mask, teacher_labels = privileged_sequences(collator, TEMPLATE, rows, input_ids, labels)
    for i, row in enumerate(rows):
        student_text = tokenizer.decode(input_ids[i][labels[i] == IGNORE_INDEX].tolist())
        n = int(teacher_mask[i].sum())
        teacher_prompt = tokenizer.decode(teacher_ids[i, :n][teacher_labels[i, :n] == IGNORE_INDEX].tolist())
        privileged = f"The answer: {row['ground_truth']}."
        assert privileged in teacher_prompt and privileged not in student_text
        assert row["messages"][-1]["content"] in teacher_prompt  # {question}: the student's own question
        assert ("Be brief." in teacher_prompt) == (i == 1)  # the other turns as they are
        # the same completion tokens, in order, and nothing after them but padding
        assert teacher_labels[i][teacher_labels[i] != IGNORE_INDEX].tolist() == completions[i]
        assert torch.equal(teacher_ids[i, :n][teacher_labels[i, :n] != IGNORE_INDEX], torch.tensor(completions[i]))


def test_in_the_loop_the_teacher_reads_the_privileged_prompt_and_the_student_does_not(files, tmp_path,
                                                                                      monkeypatch):
    """The token sequences each forward received, read at the forwards: the teacher's (trainer/teachers/parts.py's
    frozen_hidden) and the student's (the loop's completion_hidden)."""
    seen = {"teacher": [], "student": []}
    teacher_forward, student_forward = parts.frozen_hidden, train_opd.completion_hidden

    def teacher_spy(model, autocast, input_ids, attention_mask, labels):
        seen["teacher"].append((input_ids, labels))
        return teacher_forward(model, autocast, input_ids, attention_mask, labels)

    def student_spy(model, input_ids, attention_mask, labels):
        seen["student"].append((input_ids, labels))
        return student_forward(model, input_ids, attention_mask, labels)

    monkeypatch.setattr(parts, "frozen_hidden", teacher_spy)
    monkeypatch.setattr(train_opd, "completion_hidden", student_spy)
    train_opd.main(opd_args(files, tmp_path, max_steps=1, self_teacher="live", privileged_template=TEMPLATE))
    tokenizer = load_tokenizer()
    (teacher_ids, teacher_labels), = seen["teacher"]
    (student_ids, student_labels), = seen["student"]
    for i in range(student_ids.shape[0]):
        teacher_prompt = tokenizer.decode(teacher_ids[i][teacher_labels[i] == IGNORE_INDEX].tolist())
        student_prompt = tokenizer.decode(student_ids[i][student_labels[i] == IGNORE_INDEX].tolist())
        assert "The answer: " in teacher_prompt and "The answer: " not in student_prompt
        question = student_prompt.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert question in teacher_prompt
        assert torch.equal(teacher_labels[i][teacher_labels[i] != IGNORE_INDEX],
                           student_labels[i][student_labels[i] != IGNORE_INDEX])


def test_with_a_template_that_adds_nothing_the_live_teacher_is_the_student(files, tmp_path):
    """{question} alone: the teacher's sequences are the student's, its weights the student's: every step's reverse
    KL is exactly 0 (so is the gradient: the weights never move)."""
    train_opd.main(opd_args(files, tmp_path, max_steps=3, learning_rate=1e-2, self_teacher="live",
                            privileged_template="{question}"))
    assert [m["loss"] for m in metrics(tmp_path)] == [0.0, 0.0, 0.0]


def test_the_start_teaches_as_the_live_weights_do_at_step_one_and_then_stays(files, tmp_path):
    """The privileged template: at step 1 the start and the live weights are one model (the same loss, bit for bit);
    by step 3 the student has moved and only the live teacher moved with it."""
    losses = {}
    for teacher in ("live", "start"):
        train_opd.main(opd_args(files, tmp_path / teacher, max_steps=3, learning_rate=1e-2, self_teacher=teacher,
                                privileged_template=TEMPLATE))
        losses[teacher] = [m["loss"] for m in metrics(tmp_path / teacher)]
    assert losses["live"][0] == losses["start"][0] > 0
    assert losses["live"][2] != losses["start"][2], losses


def test_the_ema_is_its_closed_form_over_the_weights_and_is_in_the_resume_file(files, tmp_path):
    """decay d after steps 1-3 from the start w0: d^3 w0 + d^2 (1 - d) w1 + d (1 - d) w2 + (1 - d) w3, the exports
    at steps 0-3 against the resume file's average (float64 here, 1e-6)."""
    d = 0.75
    train_opd.main(opd_args(files, tmp_path, max_steps=3, learning_rate=1e-2, self_teacher="ema", ema_decay=d,
                            privileged_template=TEMPLATE, export_steps="0,1,2,3"))
    w = [dict(load_pretrained(str(tmp_path / f"run_step{s}")).named_parameters()) for s in range(4)]
    kept = torch.load(tmp_path / "run_resume.pt", weights_only=False)["kept"]["self_teacher_ema"]
    assert kept.keys() == w[0].keys()
    for name, average in kept.items():
        weights = [x[name].detach().double() for x in w]
        closed = d ** 3 * weights[0] + d ** 2 * (1 - d) * weights[1] + d * (1 - d) * weights[2] + (1 - d) * weights[3]
        torch.testing.assert_close(average.double(), closed, rtol=1e-6, atol=1e-7)
    moved = max(float((kept[n].double() - w[3][n].detach().double()).abs().max()) for n in kept)
    assert moved > 1e-4  # it lags the weights


@pytest.mark.parametrize("flags, names", [
    (dict(self_teacher="live", teacher_path="x"), ["--self_teacher", "--teacher_path"]),
    (dict(self_teacher="ema", fsdp=1), ["--self_teacher ema", "--fsdp"]),
    (dict(ema_decay=0.5, self_teacher="live"), ["--ema_decay", "--self_teacher ema"]),
    (dict(self_teacher="ema", ema_decay=1.0), ["--ema_decay"]),
    (dict(privileged_template="{question}"), ["--privileged_template", "--self_teacher"]),
    (dict(self_teacher="live", skd_topk=2), ["--skd_topk", "--self_teacher"]),
])
def test_a_refused_combination_is_one_line(flags, names, files, tmp_path, capsys):
    code, stderr = script_exit(train_opd.main, opd_args(files, tmp_path / "out", max_steps=1, **flags), capsys)
    assert_one_line_error(code, stderr, 2, *names)
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("template, names", [
    ("{question} {solution}", ["'solution'", "row 0", "chat.jsonl", "ground_truth"]),
    ("{question} {", ["--privileged_template", "format string"]),
    ("{question}" + " and more" * 40, ["row 0", "--max_prompt_length 64"]),
])
def test_a_template_a_row_cannot_fill_is_refused_at_start_up(template, names, files, tmp_path, capsys):
    code, stderr = script_exit(train_opd.main, opd_args(files, tmp_path / "out", max_steps=1, self_teacher="start",
                                                        privileged_template=template), capsys)
    assert_one_line_error(code, stderr, 2, *names)
    assert not os.path.exists(tmp_path / "out")
