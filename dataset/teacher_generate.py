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
command again and only the missing prompts are sent.

Rows left out of the output (reported on stderr with their indices): no answer after the last retry, an empty answer
once the thinking is removed, and answers cut off by max_tokens (finish_reason "length") unless --keep_truncated 1.
Exit status: 0 when the output was written, even with rows left out (a warning says how many);
1 when no row could be answered (nothing is written), on 401/403/404 (wrong key, URL or model: the run stops at
once) or a server that never answered (refused / unreachable after the retries), or with --strict 1 when any row
was left out; 130 on Ctrl-C (in-flight requests are dropped, not awaited).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tqdm import tqdm  # noqa: E402

from dataset.sources import RowDataset  # noqa: E402
from dataset.teacher import (AnswerCache, SamplingParams, TeacherAnswer, TeacherClient, TeacherError,  # noqa: E402
                             plan_requests)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    validate_args(p, args)
    return args


def validate_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not os.path.isfile(args.data_path):
        p.error(f"--data_path {args.data_path}: no such file")
    if not args.out.endswith((".parquet", ".jsonl")):
        p.error(f"--out {args.out}: the extension must be .parquet or .jsonl (it picks the format)")
    if os.path.abspath(args.out) == os.path.abspath(args.data_path):
        p.error("--out must differ from --data_path: the input would be overwritten")
    if args.concurrency < 1 or args.max_retries < 0 or args.limit < 0 or args.max_tokens < 0:
        p.error("--concurrency must be >= 1 and --max_retries, --limit, --max_tokens >= 0")
    if args.timeout <= 0 or args.connect_timeout <= 0 or args.backoff < 0:
        p.error("--timeout and --connect_timeout must be > 0, --backoff >= 0")
    try:
        args.extra = json.loads(args.extra)
    except json.JSONDecodeError as e:
        p.error(f"--extra is not JSON: {e}")
    if not isinstance(args.extra, dict):
        p.error("--extra must be a JSON object")
    args.cache = args.cache or args.out + ".cache.jsonl"


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


def write_rows_atomic(rows: list[dict[str, Any]], path: str) -> None:
    """Temporary file in the same folder, fsync, os.replace: readers see the old file or the new one, never half."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if path.endswith(".jsonl"):
                for row in rows:
                    f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
            else:
                import pyarrow as pa
                import pyarrow.parquet as pq
                pq.write_table(pa.Table.from_pylist(rows), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)           # no stray temporary file; the error itself goes on up
        raise


def left_out_reason(result: TeacherAnswer | TeacherError, keep_truncated: bool) -> str | None:
    if isinstance(result, TeacherError):
        return "error"
    if not result.content:
        return "empty"
    if result.finish_reason == "length" and not keep_truncated:
        return "truncated"
    return None


def report_left_out(results: list[TeacherAnswer | TeacherError], keep_truncated: bool) -> list[int]:
    """Print the rows left out, by reason, with their indices; return their indices."""
    by_reason: dict[str, list[int]] = {}
    for i, r in enumerate(results):
        reason = left_out_reason(r, keep_truncated)
        if reason is not None:
            by_reason.setdefault(reason, []).append(i)
    for reason, indices in by_reason.items():
        print(f"teacher: {len(indices)} row(s) left out ({reason}): {indices}", file=sys.stderr)
    errors = [r for r in results if isinstance(r, TeacherError)]
    for e in errors[:10]:
        print(f"  {e}", file=sys.stderr)
    if len(errors) > 10:
        print(f"  ... and {len(errors) - 10} more errors", file=sys.stderr)
    return sorted(i for indices in by_reason.values() for i in indices)


# ---------------------------------------------------------------------------------------------------------------------
# main

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dataset = RowDataset(args.data_path)
    n = min(len(dataset), args.limit) if args.limit else len(dataset)
    rows = [dataset[i] for i in range(n)]
    prompts = [request_messages(row) for row in rows]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens or None,
                            seed=args.seed, extra=args.extra)
    cache = AnswerCache(args.cache)
    plan = plan_requests(args.model, params, prompts, cache)
    print(f"teacher: {n} prompts ({len(plan.groups)} distinct), {plan.cached_rows} cached in {args.cache}, "
          f"{len(plan.to_send)} request(s) to send", file=sys.stderr)
    if args.dry_run:
        return 0

    client = TeacherClient(args.base_url, args.model, api_key_env=args.api_key_env, params=params, cache=cache,
                           concurrency=args.concurrency, connect_timeout=args.connect_timeout,
                           read_timeout=args.timeout, max_retries=args.max_retries, backoff_base=args.backoff)
    print(f"teacher: {client!r}", file=sys.stderr)
    # the bar counts what this run sends; cached rows are shown in the postfix, so the rate and ETA stay honest
    bar = tqdm(total=plan.rows_to_send, unit="ans", desc="teacher", dynamic_ncols=True, mininterval=0.5)
    counts = {"done": 0, "failed": 0}

    def on_result(result: TeacherAnswer | TeacherError) -> None:
        if isinstance(result, TeacherAnswer) and result.cached:
            return
        counts["failed" if left_out_reason(result, bool(args.keep_truncated)) else "done"] += 1
        bar.set_postfix(done=counts["done"], cached=plan.cached_rows, failed=counts["failed"], refresh=False)
        bar.update(1)

    try:
        with client:
            results = client.run(prompts, on_result=on_result)
    except TeacherError as e:            # 401/403/404 or never reached: the other prompts would fail alike
        print(f"teacher: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"teacher: interrupted; {len(cache)} answers are in {args.cache}: run the same command to continue",
              file=sys.stderr)
        return 130
    finally:
        bar.close()
        cache.close()
        print(f"teacher: stats {json.dumps(client.stats.snapshot())}", file=sys.stderr)

    left_out = set(report_left_out(results, bool(args.keep_truncated)))
    out_rows = [output_row(row, r.content) for i, (row, r) in enumerate(zip(rows, results)) if i not in left_out]
    if not out_rows:
        print(f"teacher: no row could be answered; {args.out} not written", file=sys.stderr)
        return 1
    write_rows_atomic(out_rows, args.out)
    print(f"teacher: wrote {len(out_rows)} rows to {args.out}"
          + (f" (WARNING: {len(left_out)} row(s) left out, see above)" if left_out else ""), file=sys.stderr)
    return 1 if (left_out and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
