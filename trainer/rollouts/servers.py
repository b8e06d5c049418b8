"""OPD's inference servers (docs/serving.md): the --rollout_url / --teacher_url flags and their rules, the longest
wait a batch of requests can take (which --dist_timeout must cover), and connecting to a server at start-up."""
from __future__ import annotations

import argparse
import math
import os

from common.errors import refuse, refuse_first
from common.http import ApiClient
from serving.engine import CompletionServer, open_checked_server
from trainer.skeleton.distributed import print0

SERVER_RESUMABLE = frozenset({"overlap"})  # sampling in the background or in the loop's thread: the same rollouts

SERVERS = {  # role -> (what messages call it, default --ROLE_model, what --ROLE_url does)
    "rollout": ("rollout server", "student",
                "sample on this OpenAI-compatible server (vLLM), e.g. http://127.0.0.1:8000/v1, started with the "
                "weight-sync extension; rank 0 loads the student's weights into it and verifies them"),
    "teacher": ("teacher server", "teacher",
                "the teacher on this OpenAI-compatible server (vLLM), e.g. http://127.0.0.1:8001/v1, instead of "
                "--teacher_path: its log-probabilities of the sampled tokens (--loss sampled_kl), or of its top-K and "
                "the sampled token at every position (--loss jsd --teacher_topk K)"),
}


def add_server_args(parser: argparse.ArgumentParser, teacher: bool = True) -> None:
    """--rollout_url (and, with `teacher`, --teacher_url: a teacher that returns log-probabilities) with their model
    name and API-key variable; the rollout server's sync and request settings."""
    groups = {}
    for role, (what, name, url_help) in SERVERS.items():
        if role == "teacher" and not teacher:
            continue
        g = groups[role] = parser.add_argument_group(f"{what} (docs/serving.md)")
        g.add_argument(f"--{role}_url", default=None, help=url_help)
        g.add_argument(f"--{role}_model", default=name, help=f"the {what}'s --served-model-name")
        g.add_argument(f"--{role}_api_key_env", default=None,
                       help=f"environment variable holding the {what}'s API key (default: no key)")
    g = groups["rollout"]
    g.add_argument("--sync_interval", type=int, default=1,
                   help="optimizer steps between weight syncs (1: strictly on-policy; k: samples from weights up "
                        "to k-1 steps old, k times fewer syncs)")
    g.add_argument("--max_staleness", type=int, default=0,
                   help="S > 0: step s's rollouts are sampled from the weights of step s-S, in the background while "
                        "the trainer trains the steps before (0: strictly on-policy, sampled when the step starts)")
    g.add_argument("--overlap", type=int, default=1, choices=[0, 1],
                   help=argparse.SUPPRESS)  # 0: the same rollouts sampled in the loop's thread (the tests' reference)
    g.add_argument("--sync_dir", default=None,
                   help="folder the server can read where the weights are written for it "
                        "(default SAVE_DIR/SAVE_WEIGHT_rollout_weights; /dev/shm/... on GPU machines)")
    g.add_argument("--rollout_concurrency", type=int, default=64, help="requests in flight per rank and server")
    g.add_argument("--rollout_timeout", type=float, default=600.0, help="seconds to wait for one request")


def validate_server_args(args: argparse.Namespace, samples: bool, teacher: bool = True) -> None:
    """The rollout server's rules (`samples`: some steps sample, so a sharded student needs a server) and, with
    `teacher`, those of a --teacher_url that returns log-probabilities (OPD's --loss and --teacher_topk)."""
    a = args
    rules = [
        (a.fsdp and not a.rollout_url and samples,
         "--fsdp 1: the built-in engine cannot decode with a sharded student; sample on a rollout server "
         "(--rollout_url, docs/serving.md)"),
        (a.sync_interval < 1, f"--sync_interval must be >= 1, got {a.sync_interval}"),
        (a.rollout_concurrency < 1, f"--rollout_concurrency must be >= 1, got {a.rollout_concurrency}"),
        (a.rollout_timeout <= 0, f"--rollout_timeout must be > 0, got {a.rollout_timeout}"),
        (a.max_staleness < 0, f"--max_staleness must be >= 0, got {a.max_staleness}"),
        (a.max_staleness and not a.rollout_url,
         "--max_staleness samples ahead on a rollout server while the trainer trains: add --rollout_url (the "
         "built-in engine samples on the trainer's own device, so there is nothing to overlap)"),
        (a.max_staleness and a.sync_interval > 1,
         f"--max_staleness {a.max_staleness} with --sync_interval {a.sync_interval}: two ways of sampling from older "
         f"weights; --max_staleness pushes the weights every step (keep --sync_interval 1)"),
    ]
    if teacher:
        rules[:0] = [
            (a.teacher_url and a.loss != "sampled_kl" and not a.teacher_topk,
             "--teacher_url gives the log-probabilities of the sampled tokens and of the teacher's top-K only, not "
             "the whole distribution --loss jsd needs: add --teacher_topk K (the divergence over the top-K, the "
             "sampled token and a tail bucket; docs/serving.md), use --loss sampled_kl, or a local --teacher_path"),
            (a.teacher_url and a.temperature != 1.0,
             f"--teacher_url: a server's log-probabilities are at temperature 1, not --temperature {a.temperature}: "
             f"use --temperature 1 or a local --teacher_path"),
        ]
    refuse_first(rules)
    check_server_wait(args, teacher_url=a.teacher_url if teacher else None)


def server_wait_seconds(args: argparse.Namespace) -> float:
    """The longest a rank can wait for one batch of rollout or teacher-score requests before they fail, while the
    other ranks wait in the next collective (`requests_wait_seconds` of a batch's rows at --rollout_concurrency)."""
    max_retries = CompletionServer.__init__.__kwdefaults__["max_retries"]
    return requests_wait_seconds(args.batch_size, args.rollout_concurrency, args.rollout_timeout, max_retries)


def requests_wait_seconds(requests: int, concurrency: int, timeout: float, max_retries: int) -> float:
    """Every attempt of a request (retries + 1) up to the client's connect timeout plus `timeout`, between attempts
    up to the longest backoff or Retry-After the client honours (common/http.py), the requests sent `concurrency`
    at a time."""
    client = ApiClient.__init__.__kwdefaults__
    attempts = max_retries + 1
    request = (attempts * (client["connect_timeout"] + timeout)
               + (attempts - 1) * max(client["backoff_max"], client["max_retry_after"]))
    return math.ceil(requests / concurrency) * request


def check_server_wait(args: argparse.Namespace, teacher_url: str | None) -> None:
    """With more than one rank, a batch of server requests that could outlast --dist_timeout is refused at once:
    the other ranks would be failed by the process group before the failure protocol (fail_together) saves."""
    if not (args.rollout_url or teacher_url) or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return
    seconds = server_wait_seconds(args)
    if seconds > args.dist_timeout:
        refuse(f"--rollout_timeout {args.rollout_timeout:g}: a batch of server requests can take up to {seconds:.0f} s "
               f"with its retries (--batch_size {args.batch_size}, --rollout_concurrency {args.rollout_concurrency}), "
               f"longer than --dist_timeout {args.dist_timeout:g}; raise --dist_timeout to {math.ceil(seconds)} or "
               f"lower --rollout_timeout")


def connect_server(args: argparse.Namespace, role: str) -> CompletionServer | None:
    """The --ROLE_url server (None without one), checked at once (`open_server`; teachers:
    trainer/teachers/teacher_set.py)."""
    url = getattr(args, f"{role}_url")
    if not url:
        return None
    return open_server(args, url, getattr(args, f"{role}_model"), getattr(args, f"{role}_api_key_env"),
                       SERVERS[role][0])


def open_server(args: argparse.Namespace, url: str, model: str, api_key_env: str | None, what: str,
                tokenizer=None, topk: int = 0) -> CompletionServer:
    """`open_checked_server` with the run's flags: a context of at least --max_length, requests at
    --rollout_concurrency and --rollout_timeout."""
    return open_checked_server(url, model, what=what, max_length=args.max_length, api_key_env=api_key_env,
                               tokenizer=tokenizer, topk=topk, concurrency=args.rollout_concurrency,
                               timeout=args.rollout_timeout)


def say_servers(args: argparse.Namespace, teacher_topk: int | None = 0) -> None:
    """One start-up line per server: what it does for the run (a --teacher_url of log-probabilities: of its top-K
    with `teacher_topk` K, of the sampled tokens with 0; None: the loop has no such teacher)."""
    if args.rollout_url:
        print0(f"rollouts on {args.rollout_url} ({args.rollout_model}): rank 0 pushes the student's weights every "
               f"{args.sync_interval} on-policy step{'s' if args.sync_interval > 1 else ''} and verifies them "
               f"against the server's log-probabilities of a probe before sampling"
               + (f"; step s samples from the weights of step s-{args.max_staleness}, in the background while the "
                  f"trainer trains" if args.max_staleness else ""))
    if teacher_topk is not None and args.teacher_url:
        what = (f"its top-{teacher_topk} log-probabilities and the sampled token's at every position"
                if teacher_topk else "its log-probabilities of the sampled tokens")
        print0(f"teacher on {args.teacher_url} ({args.teacher_model}): {what}")
