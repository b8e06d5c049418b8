"""The run's teachers as the flags and the --teachers file give them (docs/teachers.md): their specs, the file's
rules, and the routing of every row to one of them -- everything known before any teacher is connected or loaded.

    --teachers teachers.json      {"math": {"path": "/models/Qwen3-32B-math"},
                                   "code": {"url": "http://127.0.0.1:8001/v1", "model": "coder", "topk": 16,
                                            "api_key_env": "CODER_KEY"}}
    --teacher_column teacher      the data column naming a row's teacher (a row without it: --default_teacher)

A run with one teacher (--teacher_path / --teacher_url) is a set of one, named "teacher".
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

import torch

from common.errors import UserError, refuse, refuse_first

SINGLE = "teacher"  # the name of the one teacher of --teacher_path / --teacher_url
SPEC_KEYS = {"path", "url", "model", "api_key_env", "topk"}
# a black-box teacher of the logit-free loop: an endpoint and how to ask it (trainer/teachers/black_box.py's flags)
BLACK_BOX_KEYS = {"url", "model", "api_key_env", "form", "tokenizer_path", "options"}


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher as the file (or the single-teacher flags) gives it: a local `path`, or a served `url` with its
    --served-model-name `model`, the environment variable of its API key, and `topk` (its top-K per position); a
    black-box teacher (logit-free OPD) its request `form`, `tokenizer_path` and `options` (None: the loop's flags)."""
    name: str
    path: str | None = None
    url: str | None = None
    model: str = "teacher"
    api_key_env: str | None = None
    topk: int = 0
    form: str | None = None
    tokenizer_path: str | None = None
    options: dict | None = None


def add_teachers_args(parser: argparse.ArgumentParser, black_box: bool = False) -> None:
    """--teachers and the routing flags; `black_box`: the logit-free loop's endpoints (no template check: a
    black-box teacher of any family reads text)."""
    g = parser.add_argument_group("several teachers (docs/teachers.md)")
    g.add_argument("--teachers", default=None,
                   help="JSON file of name -> {\"url\": ..., \"model\": ..., \"api_key_env\": VAR, \"form\", "
                        "\"tokenizer_path\", \"options\"}: each row's chunks are continued by the teacher its "
                        "--teacher_column names (instead of --teacher_url)" if black_box else
                        "JSON file of name -> {\"path\": HF folder} or {\"url\": ..., \"model\": ..., \"topk\": K, "
                        "\"api_key_env\": VAR}: each row is distilled from the teacher its --teacher_column names "
                        "(instead of --teacher_path / --teacher_url)")
    g.add_argument("--teacher_column", default="teacher", help="the data column that names a row's teacher")
    g.add_argument("--default_teacher", default=None,
                   help="the teacher of rows without --teacher_column (default: such a row is refused)")
    if black_box:
        return
    g.add_argument("--accept_template_difference", default="",
                   help="comma-separated teacher names (\"teacher\" for --teacher_path / --teacher_url) whose chat "
                        "template may render the prompts differently from the student's (checked at start-up)")


def read_teachers_file(path: str, keys: set[str] = SPEC_KEYS) -> list[TeacherSpec]:
    """The --teachers file -> its specs, in the file's order; anything wrong is one line naming the file and the
    teacher. `keys`: what an entry may hold (BLACK_BOX_KEYS for the logit-free loop)."""
    where = f"--teachers {path}"
    if not os.path.isfile(path):
        refuse(f"{where} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        refuse(f"{where} is not JSON ({e}): write an object of name -> {{\"path\": ...}} or {{\"url\": ...}}")
    if not isinstance(entries, dict) or not entries:
        refuse(f"{where} must be a non-empty JSON object of name -> {{\"path\": ...}} or {{\"url\": ...}}")
    specs = []
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            refuse(f"{where}: teacher {name!r} must be an object with \"path\" or \"url\", got {entry!r}")
        unknown = sorted(set(entry) - keys)
        topk = entry.get("topk", 0)
        refuse_first([
            (not name or "/" in name, f"{where}: a teacher's name must be non-empty and without '/', got {name!r}"),
            (bool(unknown), f"{where}: teacher {name!r} has unknown keys {unknown} (known: {sorted(keys)})"),
            (("path" in entry) == ("url" in entry), f"{where}: teacher {name!r} needs exactly one of \"path\" (a "
                                                    f"local HF folder) and \"url\" (a served endpoint)"),
            ("options" in entry and not isinstance(entry["options"], dict),
             f"{where}: teacher {name!r}'s \"options\" must be a JSON object, got {entry.get('options')!r}"),
            (not isinstance(topk, int) or isinstance(topk, bool) or topk < 0,
             f"{where}: teacher {name!r}'s \"topk\" must be an integer >= 0, got {topk!r}"),
        ])
        spec = TeacherSpec(name, entry.get("path"), entry.get("url"), entry.get("model", "teacher"),
                           entry.get("api_key_env"), topk, entry.get("form"), entry.get("tokenizer_path"),
                           entry.get("options"))
        if spec.path and not os.path.isfile(os.path.join(spec.path, "config.json")):
            refuse(f"{where}: teacher {name!r}: no model at {spec.path} (no config.json)")
        specs.append(spec)
    return specs


def teacher_specs(args: argparse.Namespace) -> list[TeacherSpec]:
    """The run's teachers: the --teachers file's, or the one of --teacher_path / --teacher_url, named "teacher"
    (its top-K: --teacher_topk where the loop has it)."""
    if args.teachers:
        return read_teachers_file(args.teachers)
    topk = getattr(args, "teacher_topk", 0)
    if getattr(args, "teacher_url", None):
        return [TeacherSpec(SINGLE, url=args.teacher_url, model=args.teacher_model,
                            api_key_env=args.teacher_api_key_env, topk=topk)]
    return [TeacherSpec(SINGLE, path=args.teacher_path, topk=topk)]


def validate_teachers_args(args: argparse.Namespace, specs: list[TeacherSpec], served: bool = True) -> None:
    """The rules of several teachers: not with the single-teacher flags, a --default_teacher the file names, names in
    --accept_template_difference that exist; `served`: whether this loop can read a served teacher (KD cannot)."""
    names = [spec.name for spec in specs]
    accepted = sorted(accepted_differences(args) - set(names))
    refuse_first([
        (bool(args.teachers and (getattr(args, "teacher_path", None) or getattr(args, "teacher_url", None))),
         "--teachers names every teacher: drop --teacher_path / --teacher_url"),
        (args.default_teacher is not None and args.default_teacher not in names,
         f"--default_teacher {args.default_teacher!r} is not a teacher of --teachers {args.teachers} "
         f"({', '.join(names)})"),
        (bool(accepted), f"--accept_template_difference names no teacher of this run: {', '.join(accepted)} "
                         f"(the teachers: {', '.join(names)})"),
        (not served and any(spec.url for spec in specs),
         "this loop reads a teacher's logits over the whole vocabulary: every teacher of --teachers needs a "
         "local \"path\""),
    ])


def accepted_differences(args: argparse.Namespace) -> set[str]:
    return {name.strip() for name in getattr(args, "accept_template_difference", "").split(",") if name.strip()}


def served_teacher_rules(specs: list[TeacherSpec], loss: str, temperature: float) -> list[tuple[bool, str]]:
    """What a served teacher of --teachers gives (log-probabilities at temperature 1 of the sampled tokens, or of
    its top-K) against what OPD's --loss needs (the rules of --teacher_url, trainer/rollouts/servers.py, per
    teacher)."""
    rules = []
    for spec in specs:
        if spec.url:
            rules += [
                (loss in ("skew_kl", "skew_rkl"),
                 f"teacher {spec.name!r} is served: --loss {loss} needs the whole distribution, a local teacher "
                 f"(\"path\" in --teachers)"),
                (loss != "sampled_kl" and not spec.topk,
                 f"teacher {spec.name!r} is served: it gives the log-probabilities of the sampled tokens and of its "
                 f"top-K only, not the whole distribution --loss jsd needs: give it \"topk\": K in --teachers "
                 f"(docs/serving.md), or use --loss sampled_kl"),
                (temperature != 1.0, f"teacher {spec.name!r} is served: a server's log-probabilities are at "
                                     f"temperature 1, not --temperature {temperature:g}: use --temperature 1"),
            ]
    return rules


class Routing:
    """Which teacher each row is distilled from: its --teacher_column, else --default_teacher; with one teacher,
    that one for every row."""

    def __init__(self, names: list[str], column: str, default: str | None):
        self.names, self.column = names, column
        self.index = {name: i for i, name in enumerate(names)}
        self.default = names[0] if len(names) == 1 else default

    def teacher_of(self, row: dict) -> str | None:
        """The name of a row's teacher (None: the row names none and there is no default)."""
        if len(self.names) == 1:
            return self.default
        name = row.get(self.column)
        return self.default if name is None else name

    def route(self, rows: list[dict]) -> torch.Tensor:
        """rows -> (B,) the index of each row's teacher (the rows were checked at start-up: each has one)."""
        return torch.tensor([self.index[self.teacher_of(row)] for row in rows], dtype=torch.long)

    def check(self, dataset) -> None:
        """Every row of `dataset` names a teacher of the run (or gets the default): the first that does not is
        refused at start-up, naming the file, the row and the value (one teacher or none: nothing to route)."""
        if len(self.names) <= 1:
            return
        path = getattr(dataset, "path", "the data")
        for i in range(len(dataset)):
            name = self.teacher_of(dataset[i])
            if name is None:
                raise UserError(f"{path}: row {i} has no {self.column!r} column and there is no --default_teacher: "
                                f"name its teacher ({', '.join(self.names)}) or pass --default_teacher NAME")
            if name not in self.index:
                raise UserError(f"{path}: row {i} names teacher {name!r} in column {self.column!r}, which --teachers "
                                f"does not give ({', '.join(self.names)})")


def routing(args: argparse.Namespace, specs: list[TeacherSpec]) -> Routing:
    return Routing([spec.name for spec in specs], args.teacher_column, args.default_teacher)


class RoutedCollator:
    """A collator whose batches also carry `teacher_index` (B,): each row's teacher (for collators that do not pass
    the rows on, as SFTCollator)."""

    def __init__(self, collator, routes: Routing):
        self.collator, self.routes = collator, routes

    def __call__(self, rows: list[dict]) -> dict:
        return {**self.collator(rows), "teacher_index": self.routes.route(rows)}
