# python -m pytest tests/test_teachers.py
"""Several teachers in one run (--teachers, trainer/teachers/teacher_set.py) on tiny Qwen3s with the real vocabulary,
CPU: the first step's loss, per-teacher numbers and gradient equal the token-weighted combination of the single-teacher
computations on each teacher's rows (closed forms from full logits, KD and OPD); 2 sharded ranks where one has no
row for a teacher finish; a teacher whose chat template renders the prompts differently is refused with the
differing token; the file and the routing are checked at start-up. Accumulation, 2 ranks and SIGKILL + resume with
two teachers are in test_loop_invariants.py ("kd_teachers", "opd_teachers"); the CPU bf16 tier in
test_cpu_recipe.py; a local and a served top-K teacher in one run in test_remote_teacher.py."""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from common.errors import UserError
from dataset.collators import SFTCollator
from dataset.sources import RowDataset
from loop_helpers import (assert_one_line_error, first_step_samples, loop_args, metrics, run_command, script_exit,
                          torchrun_command, weights)
from model import Qwen3Config, create_model, load_tokenizer, save_pretrained
from support import ROOT, TINY_CONFIG
from trainer.skeleton.data_stream import EpochSampler
from trainer.losses.closed_forms import generalized_jsd_loss
from trainer.teachers.specs import read_teachers_file
from trainer.train_distillation import main as train_distillation
from trainer.train_opd import main as train_opd

# two teachers that disagree: another size than the student's, distinct seeds, sharpened heads (untied: a
# sharpened tied embedding makes any random teacher predict the current token, and two such teachers agree)
TEACHER_CONFIG = {**TINY_CONFIG, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3,
                  "head_dim": 24, "tie_word_embeddings": False}
SEEDS = {"math": 123, "code": 321}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def make_teacher(path, seed: int) -> str:
    save_pretrained(teacher_model(seed), str(path))
    return str(path)


def teacher_model(seed: int, sharpen: float = 20.0) -> torch.nn.Module:
    """A random teacher whose head is scaled by `sharpen`: distributions far from uniform and from the student's."""
    model = create_model(Qwen3Config.from_dict(TEACHER_CONFIG), seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model.eval()


def write_routed_rows(path, num_rows: int, names=("math", "code"), missing_every: int = 0) -> str:
    """Chat rows (2 to ~60 words each) whose `teacher` column alternates between `names`; every `missing_every`-th
    row has no column (0: none)."""
    rows = []
    for i in range(num_rows):
        words = " ".join(["alpha", "beta", "seven", "plus"][(i * j) % 4] for j in range([2, 40, 7, 60][i % 4]))
        row = {"messages": [{"role": "user", "content": f"Question {i}: say something."},
                            {"role": "assistant", "content": f"{words} \\boxed{{{i}}}"}], "ground_truth": str(i)}
        if not (missing_every and i % missing_every == 0):
            row["teacher"] = names[i % len(names)]
        rows.append(row)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


def write_teachers_file(path, teachers: dict) -> str:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(teachers, f)
    return str(path)


@pytest.fixture(scope="module")
def two_teachers(tmp_path_factory):
    """{"math": folder, "code": folder} and the --teachers file naming them; read-only."""
    folder = tmp_path_factory.mktemp("teachers")
    dirs = {name: make_teacher(folder / name, seed) for name, seed in SEEDS.items()}
    return dirs, write_teachers_file(folder / "teachers.json", {name: {"path": d} for name, d in dirs.items()})


def step_rows(data: str, seed: int, count: int) -> list[dict]:
    """The first optimizer step's rows, in the loops' order (EpochSampler at epoch 0)."""
    dataset = RowDataset(data)
    return [dataset[i] for i in list(EpochSampler(len(dataset), seed=seed, epoch=0))[:count]]


def split_by_name(rows: list[dict], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """name -> a bool mask over the completion positions (`mask` (B, T-1)) of that teacher's rows."""
    out = {}
    for name in SEEDS:
        mine = torch.tensor([row["teacher"] == name for row in rows])
        out[name] = mine[:, None].expand_as(mask)[mask]
    return out


@pytest.mark.slow  # long for the fast tier: the whole suite runs it
def test_kd_with_two_teachers_is_the_token_weighted_combination_of_each_on_its_rows(tiny_config_path, two_teachers,
                                                                                     tmp_path):
    """One step, 2 micro-batches of 2 rows, each with rows of both teachers: the logged ce / kd / loss, each
    teacher's loss, rows and tokens, and the gradient norm are those of sum over micro-batches and teachers of the
    single-teacher CE and T^2 KL(teacher || student) from full logits, over the window's tokens."""
    alpha, temperature = 0.3, 2.0
    data = write_routed_rows(tmp_path / "routed.jsonl", 16)
    _, teachers_file = two_teachers
    train_distillation(loop_args(tiny_config_path, data, tmp_path, batch=2, accumulation=2, max_steps=1, seed=5,
                                 teachers=teachers_file, alpha=alpha, temperature=temperature, loss_chunk_size=16))
    logged = metrics(tmp_path)[0]

    tokenizer = load_tokenizer(None)
    vocab = len(tokenizer)
    student = create_model(Qwen3Config.from_json(tiny_config_path), seed=5)
    teachers = {name: teacher_model(seed) for name, seed in SEEDS.items()}
    rows = step_rows(data, 5, 4)  # seed 5: both micro-batches mix the teachers
    ce = kd = swapped = 0
    per_teacher = {name: {"loss": 0.0, "rows": 0, "tokens": 0} for name in SEEDS}
    for micro in (rows[:2], rows[2:]):
        assert {row["teacher"] for row in micro} == set(SEEDS), "each micro-batch must mix the teachers"
        batch = SFTCollator(tokenizer, 96, 32, enable_thinking=False)(micro)
        targets = batch["labels"][:, 1:]
        mask = targets != -100
        student_logits = student(batch["input_ids"]).logits[:, :-1][mask][:, :vocab].double()
        for name, positions in split_by_name(micro, mask).items():  # each teacher alone on its own rows
            mine = torch.tensor([row["teacher"] == name for row in micro])
            kd_of = {}
            for judge in SEEDS:  # the row's teacher, and the other one (what a routing mix-up would compute)
                with torch.no_grad():
                    logits = teachers[judge](batch["input_ids"][mine]).logits[:, :-1][mask[mine]][:, :vocab]
                kd_of[judge] = temperature ** 2 * F.kl_div(
                    F.log_softmax(student_logits[positions] / temperature, dim=-1),
                    F.log_softmax(logits.double() / temperature, dim=-1), log_target=True, reduction="sum")
            ce_t = F.cross_entropy(student_logits[positions], targets[mask][positions], reduction="sum")
            kd_t = kd_of[name]
            ce, kd = ce + ce_t, kd + kd_t
            swapped += float(kd_of[next(other for other in SEEDS if other != name)].detach())
            per_teacher[name]["loss"] += float((alpha * ce_t + (1 - alpha) * kd_t).detach())
            per_teacher[name]["rows"] += sum(row["teacher"] == name for row in micro)
            per_teacher[name]["tokens"] += int(positions.sum())
    tokens = sum(t["tokens"] for t in per_teacher.values())
    assert logged["tokens"] == tokens
    loss = (alpha * ce + (1 - alpha) * kd) / tokens
    assert logged["ce"] == pytest.approx(float(ce.detach()) / tokens, rel=1e-5)
    # the loop's KL sums 151,669 terms per token in fp32 (a few 1e-5 off the fp64 reference here); a teacher
    # mix-up moves it by far more (the last assertion)
    assert logged["kd"] == pytest.approx(float(kd.detach()) / tokens, rel=1e-4)
    assert logged["loss"] == pytest.approx(float(loss.detach()), rel=1e-4)
    for name, expected in per_teacher.items():
        assert logged[f"teacher/{name}/rows"] == expected["rows"] and logged[f"teacher/{name}/tokens"] == \
            expected["tokens"]
        assert logged[f"teacher/{name}/loss"] == pytest.approx(expected["loss"] / expected["tokens"], rel=1e-4)
    assert abs(logged["kd"] - swapped / tokens) > 1e-3 * logged["kd"], "the teachers must be told apart"
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in student.parameters()]))
    assert logged["grad_norm"] == pytest.approx(float(grad_norm), rel=1e-4)


def test_opd_with_two_teachers_is_the_token_weighted_combination_of_each_on_its_rows(tiny_config_path,
                                                                                      two_teachers, tmp_path):
    """One on-policy step of 4 rows with per-row seeds: the logged loss and each teacher's loss are the generalized
    JSD of the student's and that teacher's full logits on its rows' samples, weighted by their tokens."""
    beta, temperature = 0.5, 1.5
    data = write_routed_rows(tmp_path / "routed.jsonl", 16)
    _, teachers_file = two_teachers
    train_opd(loop_args(tiny_config_path, data, tmp_path, batch=4, max_steps=1, teachers=teachers_file, beta=beta,
                        temperature=temperature, max_new_tokens=8))
    logged = metrics(tmp_path)[0]

    tokenizer = load_tokenizer(None)
    student = create_model(Qwen3Config.from_json(tiny_config_path), seed=7).eval()
    rows = step_rows(data, 7, 4)
    input_ids, attention_mask, labels = first_step_samples(student, tokenizer, rows, seed=7)
    total, tokens = 0.0, 0
    for name, seed in SEEDS.items():
        mine = torch.tensor([row["teacher"] == name for row in rows])
        ids, mask, mine_labels = input_ids[mine], attention_mask[mine], labels[mine]
        with torch.no_grad():
            student_logits = student(ids, attention_mask=mask).logits[:, :-1, :len(tokenizer)]
            teacher_logits = teacher_model(seed)(ids, attention_mask=mask).logits[:, :-1, :len(tokenizer)]
        mean = float(generalized_jsd_loss(student_logits, teacher_logits, mine_labels[:, 1:], beta=beta,
                                          temperature=temperature))
        count = int((mine_labels != -100).sum())
        assert logged[f"teacher/{name}/tokens"] == count and logged[f"teacher/{name}/rows"] == int(mine.sum())
        assert logged[f"teacher/{name}/loss"] == pytest.approx(mean, rel=1e-5)
        total, tokens = total + mean * count, tokens + count
    assert logged["tokens"] == tokens
    assert logged["loss"] == pytest.approx(total / tokens, rel=1e-5)


def test_one_teacher_named_in_the_file_trains_as_the_teacher_path_flag(tiny_config_path, two_teachers, tmp_path):
    """--teachers with one teacher is --teacher_path: the same weights, bit for bit (the rows need no column)."""
    dirs, _ = two_teachers
    data = write_routed_rows(tmp_path / "routed.jsonl", 8)
    one = write_teachers_file(tmp_path / "one.json", {"math": {"path": dirs["math"]}})
    flags = dict(batch=4, max_steps=2, alpha=0.5)
    train_distillation(loop_args(tiny_config_path, data, tmp_path / "file", teachers=one, **flags))
    train_distillation(loop_args(tiny_config_path, data, tmp_path / "flag", teacher_path=dirs["math"], **flags))
    file, flag = weights(tmp_path / "file"), weights(tmp_path / "flag")
    assert all(torch.equal(file[k], flag[k]) for k in file)


@pytest.mark.serial
@pytest.mark.slow
def test_two_sharded_ranks_finish_when_one_has_no_row_for_a_teacher(tiny_config_path, two_teachers, tmp_path):
    """--fsdp 1 on 2 ranks with sharded teachers; only every 8th row is "code"'s, so most micro-batches leave a
    rank without a row for it: that rank still runs the sharded teacher's forward (its all-gathers are
    collectives), so the run finishes, and trains as one process does."""
    data = tmp_path / "rare.jsonl"
    rows = [json.loads(line) for line in open(write_routed_rows(tmp_path / "routed.jsonl", 16))]
    for i, row in enumerate(rows):
        row["teacher"] = "code" if i % 8 == 0 else "math"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    _, teachers_file = two_teachers
    flags = dict(teachers=teachers_file, max_steps=3, alpha=0.5)
    script = os.path.join(ROOT, "trainer", "train_distillation.py")
    run_command(torchrun_command(script, loop_args(tiny_config_path, str(data), tmp_path / "two", batch=2,
                                                   accumulation=1, fsdp=1, **flags)))
    train_distillation(loop_args(tiny_config_path, str(data), tmp_path / "one", batch=4, **flags))
    two, one = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    assert len(two) == 3 and [m["tokens"] for m in two] == [m["tokens"] for m in one]
    assert any(m["teacher/code/rows"] == 1 for m in two), "a step with a single code row: one rank had none"
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=1e-4)
    diff = max(float((a - b).abs().max()) for a, b in zip(weights(tmp_path / "two").values(),
                                                          weights(tmp_path / "one").values()))
    assert diff <= 1e-5


def test_a_teacher_whose_template_differs_is_refused_with_the_first_differing_token(tiny_config_path, two_teachers,
                                                                                   tmp_path, capsys):
    """A copy of "code" whose chat template adds a default system prompt (a common change): the prompts it would
    score start differently, and the run stops before any model loads, naming the teacher and the token; the
    flag that accepts the difference lets it train."""
    dirs, _ = two_teachers
    changed = shutil.copytree(dirs["code"], tmp_path / "code")
    load_tokenizer(None).save_pretrained(str(changed))
    config_path = changed / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = ("{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are a helpful "
                               "assistant.<|im_end|>\\n' }}{%- endif %}" + config["chat_template"])
    config_path.write_text(json.dumps(config))
    teachers_file = write_teachers_file(tmp_path / "t.json", {"math": {"path": dirs["math"]},
                                                              "code": {"path": str(changed)}})
    data = write_routed_rows(tmp_path / "routed.jsonl", 8)
    args = loop_args(tiny_config_path, data, tmp_path / "out", batch=4, max_steps=1, teachers=teachers_file)
    code, stderr = script_exit(train_distillation, args, capsys)
    line = assert_one_line_error(code, stderr, 2, "teacher 'code'", "token 1 is 'system' (id 8948)",
                                 "'user' (id 872)", "--accept_template_difference code")
    assert "row 0" in line
    assert not os.path.exists(tmp_path / "out")  # nothing left behind
    train_distillation(args + ["--accept_template_difference", "code"])
    assert len(metrics(tmp_path / "out")) == 1


def test_a_single_teacher_with_another_template_is_refused_too(tiny_config_path, two_teachers, tmp_path, capsys):
    """The check holds for --teacher_path runs as well (they have one teacher, named "teacher")."""
    dirs, _ = two_teachers
    changed = shutil.copytree(dirs["math"], tmp_path / "math")
    load_tokenizer(None).save_pretrained(str(changed))
    config_path = changed / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = config["chat_template"].replace("<|im_start|>assistant\\n", "<|im_start|>assistant\\n\\n")
    config_path.write_text(json.dumps(config))
    data = write_routed_rows(tmp_path / "routed.jsonl", 8)
    code, stderr = script_exit(train_opd, loop_args(tiny_config_path, data, tmp_path / "out", batch=4,
                                                    teacher_path=str(changed), max_new_tokens=4), capsys)
    assert_one_line_error(code, stderr, 2, "the teacher (", "differently", "--accept_template_difference teacher")


@pytest.mark.parametrize("content, message", [
    ("not json", "is not JSON"),
    ("[]", "non-empty JSON object"),
    ('{"a": {"path": "x", "url": "y"}}', "exactly one of"),
    ('{"a": {"path": "/nowhere"}}', "no model at /nowhere"),
    ('{"a": {"url": "http://h/v1", "topk": -1}}', "\"topk\" must be an integer >= 0"),
    ('{"a": {"url": "http://h/v1", "port": 1}}', "unknown keys ['port']"),
    ('{"a/b": {"url": "http://h/v1"}}', "without '/'"),
])
def test_a_bad_teachers_file_is_one_line(tmp_path, content, message):
    path = tmp_path / "teachers.json"
    path.write_text(content)
    with pytest.raises(UserError, match=None) as info:
        read_teachers_file(str(path))
    assert message in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("case, names", [
    ("unknown", ("row 1", "'physics'", "math, code")),
    ("missing", ("row 0", "no 'teacher' column", "--default_teacher")),
    ("bad default", ("--default_teacher 'physics'",)),
    ("served kd", ("local \"path\"",)),
    ("both", ("drop --teacher_path",)),
    ("served jsd", ("teacher 'remote' is served", "\"topk\": K")),
])
def test_routing_and_teacher_problems_are_refused_at_start_up(tiny_config_path, two_teachers, tmp_path, capsys,
                                                              case, names):
    dirs, teachers_file = two_teachers
    data = write_routed_rows(tmp_path / "routed.jsonl", 8, missing_every=4 if case == "missing" else 0)
    if case == "unknown":
        rows = [json.loads(line) for line in open(data)]
        rows[1]["teacher"] = "physics"
        open(data, "w").write("".join(json.dumps(row) + "\n" for row in rows))
    served = write_teachers_file(tmp_path / "served.json", {"math": {"path": dirs["math"]},
                                                            "remote": {"url": "http://127.0.0.1:1/v1"}})
    flags = {"bad default": dict(default_teacher="physics"), "served kd": dict(teachers=served),
             "both": dict(teacher_path=dirs["math"]), "served jsd": dict(teachers=served)}.get(case, {})
    main = train_opd if case == "served jsd" else train_distillation
    args = loop_args(tiny_config_path, data, tmp_path / "out", batch=4, max_steps=1,
                     **{"teachers": teachers_file, **flags})
    code, stderr = script_exit(main, args, capsys)
    assert_one_line_error(code, stderr, 2, *names)
    assert not os.path.exists(tmp_path / "out")


def test_the_rl_opd_term_reads_each_rows_teacher(two_teachers):
    """The RL loop's step 3 with two teachers: each completion token's teacher log-probability is its own row's
    teacher's, from that teacher's full logits (rows of both teachers in one micro-batch)."""
    import contextlib
    import types

    from trainer.losses.divergences import Divergence
    from trainer.losses.policy_gradient import TEACHER_LOGP
    from trainer.teachers.specs import Routing
    from trainer.teachers.teacher_set import Teacher, Teachers
    from trainer.train_rl import token_values
    from trainer.skeleton.window_metrics import WindowMetrics
    tokenizer = load_tokenizer(None)
    rows = [{"messages": [{"role": "user", "content": f"Question {i}"},
                          {"role": "assistant", "content": "seven plus " * (i + 1)}], "teacher": ["math", "code"][i % 2]}
            for i in range(4)]
    batch = SFTCollator(tokenizer, 96, 32, enable_thinking=False)(rows)
    models = {name: teacher_model(seed) for name, seed in SEEDS.items()}
    teachers = Teachers([Teacher(name, model, None, 0, Divergence("sampled_kl")) for name, model in models.items()],
                        Routing(list(SEEDS), "teacher", None))
    metrics = WindowMetrics("cpu")
    scores = teachers.score({"rows": rows}, batch["input_ids"], batch["attention_mask"], batch["labels"],
                            contextlib.nullcontext)
    values = token_values(torch.zeros(4), batch["labels"], batch["input_ids"], batch["attention_mask"], None,
                          teachers, scores, temperature=1.0, chunk=16, vocab=len(tokenizer),
                          autocast=contextlib.nullcontext, metrics=metrics)
    expected = []
    for i, row in enumerate(rows):
        with torch.no_grad():
            logits = models[row["teacher"]](batch["input_ids"][i:i + 1]).logits[0, :-1, :len(tokenizer)]
        targets = batch["labels"][i, 1:]
        keep = targets != -100
        expected.append(F.log_softmax(logits[keep].double(), dim=-1).gather(-1, targets[keep][:, None])[:, 0])
    assert torch.allclose(values[:, TEACHER_LOGP].double(), torch.cat(expected), atol=1e-4)
    sums, _ = metrics.reduce(types.SimpleNamespace(enabled=False, world_size=1))
    assert sums["teacher/math/rows"] == sums["teacher/code/rows"] == 2


def test_the_held_out_numbers_per_teacher_and_overall():
    """Several teachers: each one's divergence per token over its held-out rows; the overall number only where
    they report the same divergence (token-weighted); a teacher no held-out row names has none."""
    from trainer.losses.divergences import Divergence
    from trainer.evaluation.heldout import heldout_metrics
    from trainer.teachers.teacher_set import EvalTeacher
    sums = {"correct": 1, "rows": 4, "generated": 40, "ended": 2, "kl_sum/math": 3.0, "kl_tokens/math": 10,
            "kl_sum/code": 9.0, "kl_tokens/code": 30, "kl_sum/idle": 0.0, "kl_tokens/idle": 0}
    same = [EvalTeacher(name, Divergence("jsd")) for name in ("math", "code", "idle")]
    metrics = heldout_metrics(sums, same)
    assert metrics["eval/math/reverse_kl"] == 0.3 and metrics["eval/code/reverse_kl"] == 0.3
    assert metrics["eval/reverse_kl"] == pytest.approx(12.0 / 40) and "eval/idle/reverse_kl" not in metrics
    mixed = [EvalTeacher("math", Divergence("jsd")), EvalTeacher("code", Divergence("topk", topk=8)),
             EvalTeacher("idle", Divergence("jsd"))]
    metrics = heldout_metrics(sums, mixed)
    assert metrics["eval/code/reverse_kl_top8"] == 0.3 and "eval/reverse_kl" not in metrics
