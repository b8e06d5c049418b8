"""The logit-free loop's black-box teacher: its flags, the client that asks it (with its per-rank answer cache and
the start-up probe: dataset/continuations.py), and the questions of an audit -- everything the loop says to a text
endpoint, so that trainer/train_logit_free.py reads as the method.

    add_black_box_teacher_args(parser); validate_black_box_teacher_args(args)   # --teacher_url, _form, ...
    teachers = connect_teachers(args, rank, dataset)   # rows routed, each teacher checked at once: up, continuing
    chunks, requests, texts = audit_requests(args, tokenizer, batch, labels, chunks, epoch, step)
    answers, usages = teachers.continue_batch(requests, rows)      # each request to its row's teacher

Several black-box teachers (--teachers, docs/teachers.md): each row's chunks go to the teacher its column names;
each teacher's form, tokenizer and options are its entry's, or the loop's flags where the entry gives none; each
has its own answer cache (SAVE_DIR/NAME_teacher_cache_TEACHER.rank*.jsonl).
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch

from common.errors import refuse, refuse_first
from common.http import ApiClient
from common.seeds import derived_seed
from dataset.collators import split_conversation
from dataset.continuations import (FORMS, RESERVED, ContinuationBatch, ContinuationCache, ContinuationClient,
                                   ContinuationRequest, ContinuationUsage, ends_inside_thinking)
from dataset.teacher import SamplingParams
from trainer.rollouts.servers import requests_wait_seconds
from trainer.skeleton.distributed import print0
from trainer.teachers.specs import BLACK_BOX_KEYS, SINGLE, Routing, TeacherSpec, read_teachers_file, routing


def add_black_box_teacher_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("the black-box teacher (an OpenAI-compatible text endpoint)")
    g.add_argument("--teacher_url", default=None, help="its base URL, e.g. http://127.0.0.1:8001/v1 (required)")
    g.add_argument("--teacher_model", default="teacher", help="the model name the endpoint serves")
    g.add_argument("--teacher_api_key_env", default=None,
                   help="environment variable holding its API key (default: no key)")
    g.add_argument("--teacher_form", default="chat", choices=FORMS,
                   help="chat: /v1/chat/completions with the partial answer as a final assistant message to continue; "
                        "completions: /v1/completions with the prefix rendered through the teacher's chat template "
                        "(--teacher_tokenizer_path)")
    g.add_argument("--teacher_tokenizer_path", default=None,
                   help="with --teacher_form completions: a folder with the teacher's tokenizer files and chat "
                        "template")
    g.add_argument("--teacher_options", default=None,
                   help="JSON merged into every request, replacing the form's own keys (default for chat: vLLM's "
                        "{\"continue_final_message\": true, \"add_generation_prompt\": false}; '{}' for APIs that "
                        "continue a final assistant message unasked)")
    g.add_argument("--teacher_split_n", type=int, default=0, choices=[0, 1],
                   help="1: ask for the N continuations of a chunk as N requests of one (seeds seed + i, as vLLM "
                        "seeds its i-th sample), for an endpoint without `n`")
    g.add_argument("--teacher_probe", default="count", choices=["count", "request"],
                   help="the start-up probe: count checks that the teacher continues '1, 2, 3, 4,' with 5 (a "
                        "continuation, not a new reply); request checks only that both probe requests are accepted "
                        "and answered in full, for a teacher too small to count (the CPU demo's)")
    g.add_argument("--teacher_concurrency", type=int, default=0,
                   help="teacher requests in flight per rank (0: all of a micro-batch's, batch x --audit_chunks)")
    g.add_argument("--teacher_timeout", type=float, default=300.0,
                   help="seconds to wait for one teacher request (the default keeps a micro-batch's requests, with "
                        "their retries, within the default --dist_timeout)")
    g.add_argument("--teacher_price_in", type=float, default=0.0,
                   help="price per million prompt tokens: the metrics' teacher_cost (0: not estimated)")
    g.add_argument("--teacher_price_out", type=float, default=0.0, help="price per million completion tokens")
    g.add_argument("--eval_teacher_path", default=None,
                   help="a local copy of the teacher (same tokenizer): the held-out evaluation reports the student's "
                        "reverse KL to it")


def validate_black_box_teacher_args(args: argparse.Namespace) -> None:
    """The teacher flags' rules; with --teachers, each teacher's (its entry over the flags: `teacher_flags`)."""
    if args.teachers:
        for spec in black_box_specs(args):
            validate_black_box_teacher_args(teacher_flags(args, spec))
        return
    a = args
    refuse_first([
        (not a.teacher_url, "--teacher_url is required: the black-box teacher's OpenAI-compatible endpoint, e.g. "
                            "http://127.0.0.1:8001/v1 (serving/vllm_launch.py serves a local model), or several: "
                            "--teachers FILE"),
        (a.teacher_form == "completions" and not a.teacher_tokenizer_path,
         "--teacher_form completions renders the prefix through the teacher's chat template: pass "
         "--teacher_tokenizer_path (a folder with its tokenizer files), or use --teacher_form chat"),
        (a.teacher_concurrency < 0 or a.teacher_timeout <= 0,
         "--teacher_concurrency must be >= 0 and --teacher_timeout > 0"),
        (a.teacher_price_in < 0 or a.teacher_price_out < 0, "--teacher_price_in/out must be >= 0"),
    ])
    if a.teacher_tokenizer_path and not os.path.exists(a.teacher_tokenizer_path):
        refuse(f"--teacher_tokenizer_path {a.teacher_tokenizer_path} does not exist")
    try:
        options = None if a.teacher_options is None else json.loads(a.teacher_options)
    except ValueError:
        refuse(f"--teacher_options {a.teacher_options!r} is not JSON: e.g. '{{}}' or '{{\"top_k\": 20}}'")
    if options is not None and not isinstance(options, dict):
        refuse(f"--teacher_options must be a JSON object, got {a.teacher_options!r}")
    if options and RESERVED & set(options):
        refuse(f"--teacher_options must not set {sorted(RESERVED & set(options))}: the loop sets them per request")


def black_box_specs(args: argparse.Namespace) -> list[TeacherSpec]:
    """The --teachers file's endpoints (every one a "url"; a "form" among FORMS), or --teacher_url's, named
    "teacher"."""
    if not args.teachers:
        return [TeacherSpec(SINGLE, url=args.teacher_url)]
    specs = read_teachers_file(args.teachers, BLACK_BOX_KEYS)
    for spec in specs:
        refuse_first([
            (spec.url is None, f"--teachers {args.teachers}: teacher {spec.name!r} needs a \"url\": the logit-free "
                               f"loop's teachers are endpoints"),
            (spec.form is not None and spec.form not in FORMS,
             f"--teachers {args.teachers}: teacher {spec.name!r}'s \"form\" must be one of {', '.join(FORMS)}"),
        ])
    return specs


def teacher_flags(args: argparse.Namespace, spec: TeacherSpec) -> argparse.Namespace:
    """The loop's flags as one teacher of --teachers is asked: its endpoint, and its form, tokenizer and options
    where its entry gives them (else the flags')."""
    options = args.teacher_options if spec.options is None else json.dumps(spec.options)
    return argparse.Namespace(**{**vars(args), "teachers": None, "teacher_url": spec.url,
                                 "teacher_model": spec.model, "teacher_api_key_env": spec.api_key_env,
                                 "teacher_form": spec.form or args.teacher_form, "teacher_options": options,
                                 "teacher_tokenizer_path": spec.tokenizer_path or args.teacher_tokenizer_path})


def check_teacher_wait(args: argparse.Namespace) -> None:
    """With more than one rank, a micro-batch's teacher requests (up to batch x --audit_chunks) that could outlast
    --dist_timeout with their retries are refused at once, as the rollout server's are (trainer/rollouts/servers.py)."""
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    max_retries = ApiClient.__init__.__kwdefaults__["max_retries"]
    seconds = requests_wait_seconds(args.batch_size * args.audit_chunks, teacher_concurrency(args),
                                    args.teacher_timeout, max_retries)
    if seconds > args.dist_timeout:
        refuse(f"--teacher_timeout {args.teacher_timeout:g}: a micro-batch's teacher requests can take up to "
               f"{seconds:.0f} s with their retries, longer than --dist_timeout {args.dist_timeout:g}; raise "
               f"--dist_timeout to {math.ceil(seconds)}, or lower --teacher_timeout or raise --teacher_concurrency")


def teacher_concurrency(args: argparse.Namespace) -> int:
    """--teacher_concurrency, 0 resolved: all of a micro-batch's requests in flight at once."""
    return args.teacher_concurrency or args.batch_size * args.audit_chunks


def connect_teacher(args: argparse.Namespace, rank: int, name: str | None = None) -> ContinuationClient:
    """The black-box teacher, checked at once: up, and it continues a given partial answer (one short probe), and
    its answers cached in this rank's file (every rank's read: a resume at another world size finds them all).
    `name`: a teacher of --teachers (its own cache file)."""
    params = SamplingParams(temperature=1.0, n=args.continuations)
    stem = f"{args.save_weight}_teacher_cache" + (f"_{name}" if name else "")
    cache = ContinuationCache(os.path.join(args.save_dir, stem), rank=rank)
    options = None if args.teacher_options is None else json.loads(args.teacher_options)
    client = ContinuationClient(args.teacher_url, args.teacher_model, form=args.teacher_form,
                                tokenizer_dir=args.teacher_tokenizer_path, params=params, cache=cache, options=options,
                                template_kwargs={"enable_thinking": bool(args.enable_thinking)},
                                api_key_env=args.teacher_api_key_env, concurrency=teacher_concurrency(args),
                                read_timeout=args.teacher_timeout, split_n=bool(args.teacher_split_n))
    client.check_continuation(check_text=args.teacher_probe == "count")
    if args.teacher_probe == "request":
        print0("warning: --teacher_probe request: whether the teacher continues a partial answer (rather than "
               "starting a new reply) is not checked")
    print0(f"teacher{f' {name!r}' if name else ''} on {args.teacher_url} ({args.teacher_model}, {args.teacher_form} "
           f"form): {args.continuations} "
           f"continuations of each audited chunk, answers cached in {cache.stem}.rank*.jsonl")
    return client


class BlackBoxTeachers:
    """The loop's black-box teachers by name (one: --teacher_url's; several: --teachers) and which one each audited
    chunk asks: the teacher of the chunk's row."""

    def __init__(self, clients: dict[str, ContinuationClient], routes: Routing):
        self.clients, self.routes = clients, routes

    def continue_batch(self, requests: list[ContinuationRequest],
                       rows: list[dict]) -> tuple[ContinuationBatch, dict[str, ContinuationUsage]]:
        """Each request (of the row in `rows` at its index) to that row's teacher, one teacher after the other ->
        the answers in the requests' order with the usage summed, and each teacher's usage."""
        if len(self.clients) == 1:
            (name, client), = self.clients.items()
            batch = client.continue_batch(requests)
            return batch, {name: batch.usage}
        texts, reasons, cached = [[]] * len(requests), [[]] * len(requests), [False] * len(requests)
        usages, names = {}, [self.routes.teacher_of(row) for row in rows]
        for name, client in self.clients.items():
            mine = [i for i, owner in enumerate(names) if owner == name]
            batch = client.continue_batch([requests[i] for i in mine])
            for j, i in enumerate(mine):
                texts[i], reasons[i], cached[i] = batch.texts[j], batch.finish_reasons[j], batch.cached[j]
            usages[name] = batch.usage
        return ContinuationBatch(texts, reasons, cached, sum(usages.values(), ContinuationUsage())), usages

    def add_to(self, metrics, rows: list[dict], pi_hats: list[float], usages: dict[str, ContinuationUsage]) -> None:
        """Several teachers: teacher/NAME/pi_hat (the mean weight of its audited chunks; none in a step where it had
        none), /requests (sent) and /tokens, on every micro-batch (the ranks add the same names)."""
        if len(self.clients) == 1:
            return
        names = [self.routes.teacher_of(row) for row in rows]
        for name, usage in usages.items():
            mine = [pi_hat for pi_hat, owner in zip(pi_hats, names) if owner == name]
            metrics.ratio(f"teacher/{name}/pi_hat", sum(mine), len(mine), when_empty=False)
            metrics.total(f"teacher/{name}/requests", usage.requests)
            metrics.total(f"teacher/{name}/tokens", usage.prompt_tokens + usage.completion_tokens)

    def shown(self) -> tuple[str, ...]:
        """The console's per-teacher numbers: each one's pi_hat (several teachers only)."""
        return tuple(f"teacher/{name}/pi_hat" for name in self.clients) if len(self.clients) > 1 else ()

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


def connect_teachers(args: argparse.Namespace, rank: int, dataset) -> BlackBoxTeachers:
    """--teacher_url's teacher, or each of --teachers (`connect_teacher`), once every row of `dataset` is found to
    name one of them (or to get the default)."""
    routes = routing(args, black_box_specs(args))
    routes.check(dataset)
    if not args.teachers:
        return BlackBoxTeachers({SINGLE: connect_teacher(args, rank)}, routes)
    return BlackBoxTeachers({spec.name: connect_teacher(teacher_flags(args, spec), rank, spec.name)
                             for spec in black_box_specs(args)}, routes)


def audit_requests(args: argparse.Namespace, tokenizer, batch: dict, labels: torch.Tensor, chunks, epoch: int,
                   step: int) -> tuple[list, list[ContinuationRequest], list[str]]:
    """Step 3's questions: per chunk, the row's prompt messages and the student's completion up to the chunk's
    first token, as text (the teacher re-tokenises it), with a seed from (seed, epoch, step, row, chunk); and the
    student's own text of the chunk, which the continuations are compared with. -> (the chunks asked about, their
    requests, their texts): a chunk whose partial a chat template cannot hand over as the start of an answer is
    not audited (`continuable`)."""
    kept, requests, texts = [], [], []
    for chunk in chunks:
        row = batch["rows"][chunk.row]
        completion = labels[chunk.row][labels[chunk.row] != -100].tolist()
        prompt_messages, _ = split_conversation(row["messages"])
        partial = tokenizer.decode(completion[:chunk.anchor], skip_special_tokens=True)
        if not continuable(tokenizer, prompt_messages, partial):
            continue
        kept.append(chunk)
        texts.append(tokenizer.decode(completion[chunk.anchor:chunk.anchor + chunk.length], skip_special_tokens=True))
        seed = derived_seed(args.seed, epoch, step, row["row_index"], chunk.anchor)
        requests.append(ContinuationRequest(prompt_messages, partial, max_tokens=math.ceil(1.5 * args.chunk_len),
                                            seed=seed, name=f"step {step + 1} row {row['row_index']} "
                                                            f"chunk at token {chunk.anchor}"))
    return kept, requests, texts


def continuable(tokenizer, messages, partial: str) -> bool:
    """Whether the student's own (Qwen3) chat template renders `partial` back unchanged as the start of the answer
    to `messages`: not inside a thinking block (a `<think>` spelled with ordinary tokens, which the scheduler's
    token mask cannot see), and no `</think>` the template would move (a weak student writes stray ones mid-answer;
    the template splits the answer there, and vLLM's continue_final_message then refuses the request with HTTP
    400). A Qwen3 teacher's template does the same; another family's reads such text as text, and loses only those
    rare chunks."""
    if ends_inside_thinking(partial):
        return False
    try:
        tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": partial}],
                                      continue_final_message=True)
    except ValueError:
        return False
    return True
