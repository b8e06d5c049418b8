"""Write SFT data with a teacher model behind an OpenAI-compatible chat-completions endpoint.

    # a local vLLM teacher (any non-empty key when the server has no auth)
    vllm serve Qwen/Qwen3-4B --port 8000 &
    OPENAI_API_KEY=EMPTY python dataset/teacher_generate.py --data_path dapo-math-17k.parquet \
        --out sft_qwen3_4b.parquet --base_url http://127.0.0.1:8000/v1 --model Qwen/Qwen3-4B \
        --temperature 0.6 --top_p 0.95 --max_tokens 8192 --concurrency 32
    # how much is cached / would be sent, without sending anything
    python dataset/teacher_generate.py ... --dry_run

Input: any file `dataset.sources.RowDataset` reads (DAPO parquet/jsonl whose `prompt` is a chat list, possibly stored
as a JSON string, ...). The request is the row's turns up to, excluding, the first assistant turn.
Output (.parquet, or .jsonl by extension) in DAPO's schema, which the SFT loop reads directly:
`prompt` = those turns + {"role": "assistant", "content": answer}, plus the row's other columns unchanged.
The teacher's thinking (`<think>` / `reasoning_content`) is not in the answer; it is kept in the cache.

Every answer is in the cache (default OUT.cache.jsonl) the moment it arrives: after a crash or Ctrl-C, run the same
command again and only the missing prompts are sent. A damaged cache line is skipped with a warning (its prompt is
asked again).

Before any request: the output and cache folders must be writable, and one probe (GET BASE_URL/models, a few
seconds at most) must reach the server, so a wrong URL is refused at once and no paid answer is lost to an
unwritable --out.

Rows left out of the output (reported on stderr with their indices): no answer after the last retry, an empty answer
once the thinking is removed, and answers cut off by max_tokens (finish_reason "length") unless --keep_truncated 1.
Failures end with one line, `error: ...`, and no traceback (common.errors). Exit status: 0 when the output was
written, even with rows left out (a warning says how many); 2 for a bad flag, a missing or damaged --data_path, an
unset API key variable or an unwritable --out / --cache; 1 when the server cannot be reached, on 401/403/404 (wrong
key, URL or model: the run stops at once), when a server that answered the probe never answers a request, when no
row could be answered (nothing is written), or with --strict 1 when any row was left out; 130 on Ctrl-C (in-flight
requests are dropped, not awaited; the answers so far are in the cache).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tqdm import tqdm  # noqa: E402

from common.errors import (EXIT_INTERRUPTED, ArgumentParser, RuntimeFailure, Stopped, UserError,  # noqa: E402
                           disk_error_message, refuse, run_script)
from common.files import atomic_write, check_writable, remove_stale_temporaries  # noqa: E402
from common.http import RequestError, ServerUnreachable, one_line  # noqa: E402
from dataset.teacher import (AnswerCache, RequestPlan, SamplingParams, TeacherAnswer, TeacherClient,  # noqa: E402
                             plan_requests)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)
    # data
    p.add_argument("--data_path", required=True, help="prompts: .parquet or .jsonl (DAPO's `prompt` chat list, ...)")
    p.add_argument("--out", required=True, help="output .parquet or .jsonl in DAPO's schema")
    p.add_argument("--cache", default=None, help="JSONL answer cache (default: OUT.cache.jsonl)")
    p.add_argument("--limit", type=int, default=0, help="use only the first N rows (0 = all)")
    # teacher
    p.add_argument("--base_url", required=True, help="e.g. http://127.0.0.1:8000/v1 (the OpenAI SDK's base_url)")
    p.add_argument("--model", required=True, help="model name the server expects")
    p.add_argument("--api_key_env", default="OPENAI_API_KEY",
                   help="NAME of the environment variable holding the API key ('' = send no key)")
    # sampling (part of the cache key: changing one re-asks every prompt)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--max_tokens", type=int, default=0, help="answer budget in tokens (0 = server default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed sent to the server (optional)")
    p.add_argument("--extra", default="{}", help='JSON object merged into each request, e.g. \'{"top_k": 20}\'')
    # transport
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at most")
    p.add_argument("--timeout", type=float, default=600.0, help="read timeout per request, seconds")
    p.add_argument("--connect_timeout", type=float, default=10.0, help="connect timeout, seconds")
    p.add_argument("--max_retries", type=int, default=5, help="retries per prompt after the first attempt")
    p.add_argument("--backoff", type=float, default=1.0, help="first backoff in seconds (doubles per retry)")
    # behaviour
    p.add_argument("--keep_truncated", type=int, default=0, choices=(0, 1),
                   help="1 = keep answers cut off by max_tokens (finish_reason=length)")
    p.add_argument("--strict", type=int, default=0, choices=(0, 1), help="1 = exit 1 if any row is left out")
    p.add_argument("--dry_run", action="store_true", help="count cached / to-send prompts; send nothing")
    args = p.parse_args(argv)
    validate_args(args)
    return args


def validate_args(args: argparse.Namespace) -> None:
    if not os.path.isfile(args.data_path):
        refuse(f"--data_path {args.data_path}: no such file")
    if not args.out.endswith((".parquet", ".jsonl")):
        refuse(f"--out {args.out}: the extension must be .parquet or .jsonl (it picks the format)")
    args.cache = args.cache or args.out + ".cache.jsonl"
    paths = {os.path.abspath(path) for path in (args.data_path, args.out, args.cache)}
    if len(paths) < 3:
        refuse("--data_path, --out and --cache must be three different files: one would overwrite another")
    if args.concurrency < 1 or args.max_retries < 0 or args.limit < 0 or args.max_tokens < 0:
        refuse("--concurrency must be >= 1 and --max_retries, --limit, --max_tokens >= 0")
    if args.timeout <= 0 or args.connect_timeout <= 0 or args.backoff < 0:
        refuse("--timeout and --connect_timeout must be > 0, --backoff >= 0")
    try:
        args.extra = json.loads(args.extra)
    except json.JSONDecodeError as e:
        refuse(f"--extra is not JSON: {e}")
    if not isinstance(args.extra, dict):
        refuse("--extra must be a JSON object")


def check_outputs(out: str, cache: str) -> None:
    """Refuse, before any request, an --out or --cache that could not be written: answers are paid for."""
    for flag, path in (("--out", out), ("--cache", cache)):
        if os.path.isdir(path):
            raise UserError(f"{flag} {path} is a folder: give a file name")
        check_writable(os.path.dirname(os.path.abspath(path)), f"the {flag} folder")
    if os.path.exists(cache) and not os.access(cache, os.W_OK):
        raise UserError(f"--cache {cache} is not writable: fix its permissions or give another --cache")


# ---------------------------------------------------------------------------------------------------------------------
# rows in, rows out

def request_messages(row: dict[str, Any]) -> list[dict[str, str]]:
    """The turns before the first assistant turn, as {role, content} only (extra keys are for our template)."""
    turns = []
    for turn in row["messages"]:
        if turn["role"] == "assistant":
            break
        turns.append({"role": turn["role"], "content": turn["content"]})
    return turns


def output_row(row: dict[str, Any], answer: str) -> dict[str, Any]:
    """DAPO's schema: `prompt` = question turns + the teacher's answer, other columns as in the source."""
    out = {k: v for k, v in row.items() if k not in ("messages", "row_index")}  # row_index: RowDataset's own
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and out.get("ground_truth") == reward_model.get("ground_truth"):
        del out["ground_truth"]      # RowDataset lifted it out of reward_model; DAPO keeps it only there
    out["prompt"] = request_messages(row) + [{"role": "assistant", "content": answer}]
    return out


def write_rows(rows: list[dict[str, Any]], path: str, cache: str) -> None:
    """Write the output atomically (readers see the old file or the new one); a full disk is one line saying that
    the answers are safe in the cache."""
    try:
        with atomic_write(path) as f:
            if path.endswith(".jsonl"):
                for row in rows:
                    f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
            else:
                import pyarrow as pa
                import pyarrow.parquet as pq
                pq.write_table(pa.Table.from_pylist(rows), f)
    except OSError as e:
        message = disk_error_message(e, path)
        if message is None:
            raise
        raise RuntimeFailure(f"{message}; every answer is in {cache}: rerun to write {path} without new "
                             f"requests") from None


def left_out_reason(result: TeacherAnswer | RequestError, keep_truncated: bool) -> str | None:
    if isinstance(result, RequestError):
        return "error"
    if not result.content:
        return "empty"
    if result.finish_reason == "length" and not keep_truncated:
        return "truncated"
    return None


def report_left_out(results: list[TeacherAnswer | RequestError], keep_truncated: bool) -> list[int]:
    """Print the rows left out, by reason, with their indices; return their indices."""
    by_reason: dict[str, list[int]] = {}
    for i, r in enumerate(results):
        reason = left_out_reason(r, keep_truncated)
        if reason is not None:
            by_reason.setdefault(reason, []).append(i)
    for reason, indices in by_reason.items():
        print(f"teacher: {len(indices)} row(s) left out ({reason}): {indices}", file=sys.stderr)
    errors = [r for r in results if isinstance(r, RequestError)]
    for e in errors[:10]:
        print(f"  {e}", file=sys.stderr)
    if len(errors) > 10:
        print(f"  ... and {len(errors) - 10} more errors", file=sys.stderr)
    return sorted(i for indices in by_reason.values() for i in indices)


# ---------------------------------------------------------------------------------------------------------------------
# main

def load_rows(path: str, limit: int) -> list[dict[str, Any]]:
    # imported here, not at the top: torch (under dataset.sources) takes seconds to import, and a wrong URL or an
    # unwritable --out must be refused at once
    from dataset.sources import RowDataset

    try:
        dataset = RowDataset(path)
    except (ValueError, OSError) as e:        # DataError, a damaged parquet (ArrowInvalid), an unreadable file
        raise UserError(f"--data_path {path}: {one_line(str(e))}") from None
    n = min(len(dataset), limit) if limit else len(dataset)
    return [dataset[i] for i in range(n)]


def load_cache(path: str) -> AnswerCache:
    """The answer cache, its warnings (a damaged line) printed as one line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cache = AnswerCache(path)
        except (ValueError, OSError) as e:
            raise UserError(f"--cache {path}: {one_line(str(e))}") from None
    for warning in caught:
        print(f"teacher: warning: {warning.message}", file=sys.stderr)
    return cache


def connect(args: argparse.Namespace, params: SamplingParams, cache: AnswerCache) -> TeacherClient:
    """The client, once one probe has reached the server (seconds, not the retries' minutes, for a wrong URL)."""
    try:
        client = TeacherClient(args.base_url, args.model, api_key_env=args.api_key_env, params=params, cache=cache,
                               concurrency=args.concurrency, connect_timeout=args.connect_timeout,
                               read_timeout=args.timeout, max_retries=args.max_retries, backoff_base=args.backoff)
    except ValueError as e:                   # an unset API key variable, a URL without scheme or host
        raise UserError(str(e)) from None
    try:
        client.check_reachable()
    except ServerUnreachable as e:
        client.close()
        raise RuntimeFailure(str(e)) from None
    return client


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens or None,
                              seed=args.seed, extra=args.extra)
    except ValueError as e:
        refuse(str(e))


def plan(args: argparse.Namespace, params: SamplingParams, prompts: list[list[dict[str, str]]],
         cache: AnswerCache) -> RequestPlan:
    request_plan = plan_requests(args.model, params, prompts, cache)
    print(f"teacher: {len(prompts)} prompts ({len(request_plan.groups)} distinct), {request_plan.cached_rows} cached "
          f"in {args.cache}, {len(request_plan.to_send)} request(s) to send", file=sys.stderr)
    return request_plan


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = sampling_params(args)
    if args.dry_run:             # no request, no file written
        prompts = [request_messages(row) for row in load_rows(args.data_path, args.limit)]
        plan(args, params, prompts, load_cache(args.cache))
        return 0
    # everything that can refuse the run does so before the first request (and before torch is imported)
    check_outputs(args.out, args.cache)
    remove_stale_temporaries(args.out)        # a killed run's half-written output
    cache = load_cache(args.cache)
    try:
        with connect(args, params, cache) as client:
            rows = load_rows(args.data_path, args.limit)
            prompts = [request_messages(row) for row in rows]
            request_plan = plan(args, params, prompts, cache)
            print(f"teacher: {client!r}", file=sys.stderr)
            results = ask(client, prompts, request_plan, bool(args.keep_truncated))
        return write_output(args, rows, results)
    except KeyboardInterrupt:
        raise Stopped(f"interrupted: the {len(cache)} answers so far are in {args.cache}; run the same command "
                      f"again to continue (only missing prompts are sent)", EXIT_INTERRUPTED) from None
    finally:
        cache.close()


def ask(client: TeacherClient, prompts: list[list[dict[str, str]]], request_plan: RequestPlan,
        keep_truncated: bool) -> list[TeacherAnswer | RequestError]:
    """client.run with a progress bar; a fatal teacher error (401/403/404, never answering) as a RuntimeFailure."""
    # the bar counts what this run sends; cached rows are shown in the postfix, so the rate and ETA stay honest
    bar = tqdm(total=request_plan.rows_to_send, unit="ans", desc="teacher", dynamic_ncols=True, mininterval=0.5)
    counts = {"done": 0, "failed": 0}

    def on_result(result: TeacherAnswer | RequestError) -> None:
        if isinstance(result, TeacherAnswer) and result.cached:
            return
        counts["failed" if left_out_reason(result, keep_truncated) else "done"] += 1
        bar.set_postfix(done=counts["done"], cached=request_plan.cached_rows, failed=counts["failed"], refresh=False)
        bar.update(1)

    try:
        return client.run(prompts, on_result=on_result)
    except RequestError as e:        # fatal: 401/403/404 or never answered; the other prompts would fail alike
        raise RuntimeFailure(f"teacher stopped: {one_line(str(e))}") from None
    finally:
        bar.close()
        print(f"teacher: stats {json.dumps(client.stats.snapshot())}", file=sys.stderr)


def write_output(args: argparse.Namespace, rows: list[dict[str, Any]],
                 results: list[TeacherAnswer | RequestError]) -> int:
    left_out = set(report_left_out(results, bool(args.keep_truncated)))
    out_rows = [output_row(row, r.content) for i, (row, r) in enumerate(zip(rows, results)) if i not in left_out]
    if not out_rows:
        raise RuntimeFailure(f"no row could be answered (see above); {args.out} not written")
    write_rows(out_rows, args.out, args.cache)
    print(f"teacher: wrote {len(out_rows)} rows to {args.out}"
          + (f" (WARNING: {len(left_out)} row(s) left out, see above)" if left_out else ""), file=sys.stderr)
    if left_out and args.strict:
        raise RuntimeFailure(f"--strict 1: {len(left_out)} row(s) left out (see above)")
    return 0


if __name__ == "__main__":
    run_script(main)
