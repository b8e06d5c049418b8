"""Math accuracy of a checkpoint on held-out problems: batched generation, graded with math-verify (eval/grader.py).

    python eval/eval_math.py --model_path checkpoints/sft                        # demo eval set, greedy
    python eval/eval_math.py --model_path Qwen3-0.6B --data_path dapo_test.parquet --device cuda \
        --batch_size 64 --max_new_tokens 2048 --enable_thinking 1
    python eval/eval_math.py --model_path Qwen3-0.6B --n_samples 8 --temperature 0.6 --top_p 0.95   # pass@k

Writes one JSON line per sample (input order: index, prompt, completion, extracted, ground_truth, correct, reason,
completion_tokens, eos, and `sample` when n_samples > 1) to --out, a JSON summary beside it (<out stem>.summary.json:
the numbers, the flags and the commit of the code that made them), and prints one line:

    accuracy 0.735 [0.671, 0.790] (147/200) | mean completion 41.2 tokens | eos 98% | 12.3 s

The default --out lies beside the model folder, not inside it (a training run's next save replaces that folder
whole): `--model_path checkpoints/sft` on the demo set writes checkpoints/sft_eval_eval.jsonl and
checkpoints/sft_eval_eval.summary.json.

The interval is Wilson's 95% score interval. With n_samples > 1 the summary adds pass@k for k = 1, 2, 4, ..., n
(the unbiased estimator of Chen et al. 2021, averaged over problems) and mean@n (the mean per-sample accuracy, the
papers' avg@n), each with a 95% interval over problems (eval/grader.py's problem_interval: a bootstrap of the
problems, since one problem's samples are not independent trials); the accuracy's Wilson interval then counts every
sample as a trial, which is too narrow when problems differ in difficulty.

Prompts are sorted by length (longest first) so that a batch holds similar lengths and little padding, and an
out-of-memory shows in the first batch rather than after an hour. Greedy decoding is batch-independent (left
padding gives the same logits as the unpadded row), and sampled completions use one generator per (row, sample),
seeded by (seed, row, sample): results depend on neither --batch_size nor the sort.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
from safetensors import SafetensorError  # noqa: E402
from tqdm import tqdm  # noqa: E402

from common.checks import check_device, check_model_dir  # noqa: E402
from common.errors import ArgumentParser, UserError, refuse, run_script  # noqa: E402
from common.files import atomic_write, check_writable  # noqa: E402
from dataset.collators import PromptCollator  # noqa: E402
from dataset.make_demo_data import ensure_demo_data  # noqa: E402
from dataset.sources import RowDataset  # noqa: E402
from dataset.tool_conversation import ToolResponder, engine_turns, roll_out, served_turns  # noqa: E402
from eval.grader import grade, problem_interval, wilson_interval  # noqa: E402
from model import DTYPES, Decoder, Qwen3ForCausalLM, generate, load_pretrained, load_tokenizer  # noqa: E402
from model.generate import DECODE_CHOICES, default_decode  # noqa: E402
from model.precision import inference_dtype  # noqa: E402
from serving.engine import CompletionServer, open_checked_server, probe_token_ids  # noqa: E402
from serving.weight_sync import check_served_weights  # noqa: E402
from common.seeds import derived_seed  # noqa: E402
from tools import BUILTIN_TOOLS, answerer, tool_names, unknown_tools  # noqa: E402
from common.version import code_commit  # noqa: E402


@dataclass
class Completion:
    text: str        # decoded without special tokens (EOS and padding gone)
    num_tokens: int  # generated tokens up to and including EOS
    eos: bool        # stopped at EOS, not cut off by max_new_tokens


# ------------------------------------------------------------------------------------------------- model loading

def add_model_args(parser: argparse.ArgumentParser) -> None:
    """--model_path, --device, --dtype: how eval_math.py and chat.py pick the checkpoint they load."""
    parser.add_argument("--model_path", required=True, help="HF model folder (config, safetensors, tokenizer)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda or cuda:N (default: cuda when one is visible)")
    parser.add_argument("--dtype", default=None, choices=list(DTYPES),
                        help="weights dtype (default: bfloat16 on CUDA, float32 on CPU)")


def validate_model_args(args: argparse.Namespace) -> None:
    """Refuse a model folder or a device that cannot work, before anything loads (eval_math.py and chat.py)."""
    check_model_dir(args.model_path, "--model_path")
    check_device(args.device)


def load_for_inference(model_path: str, device: str, dtype_name: str | None):
    """-> (model in eval mode, its tokenizer). The tokenizer comes from the model folder (save_pretrained writes it)."""
    try:
        tokenizer = load_tokenizer(model_path)
        model = load_pretrained(model_path, dtype=inference_dtype(device, dtype_name), device=device)
    except UserError:
        raise  # it names the file and what to do already
    except (FileNotFoundError, ValueError, SafetensorError) as error:  # a missing or damaged file of the folder
        raise UserError(f"--model_path {model_path} cannot be loaded: {error}") from error
    return model.eval(), tokenizer


def stop_token_ids(model: Qwen3ForCausalLM, tokenizer) -> list[int]:
    """The tokenizer's EOS and the model config's: a base model's config names <|endoftext|> while the chat
    template ends turns with <|im_end|>; stopping at either avoids generating past a finished answer."""
    ids = [tokenizer.eos_token_id, getattr(model.config, "eos_token_id", None)]
    return sorted({int(i) for i in ids if i is not None})


# ---------------------------------------------------------------------------------------------------- generation

def complete_batch(model: Qwen3ForCausalLM, tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                   max_new_tokens: int, temperature: float, top_p: float, seeds: Sequence[int],
                   stop_ids: list[int], server: CompletionServer | None = None,
                   decoder: Decoder | None = None, responder: ToolResponder | None = None,
                   max_turns: int = 1) -> list[Completion]:
    """One batch of completions, from the model (one generate call over the left-padded batch, `decoder`'s decode
    step) or from the server that serves it (one request per row). temperature 0 is greedy. With a `responder`
    (--tools) multi-turn conversations, in the built-in engine or on the server, as the loops roll them out
    (docs/tools.md): each completion is the model's own tokens, every turn's, which are graded. (Tests replace this
    function.)"""
    sampling = dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0, top_p=top_p,
                    eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer))
    if responder is not None:
        return conversation_batch(model, tokenizer, prompt_ids, prompt_mask, max_new_tokens, seeds if
                                  temperature > 0 else None, responder, max_turns, decoder, sampling, server)
    if server is not None:
        out = server.generate(prompt_ids, prompt_mask, max_new_tokens, seeds=seeds,
                              model_vocab_size=model.config.vocab_size, **sampling)
    else:
        generators = [torch.Generator(prompt_ids.device).manual_seed(seed) for seed in seeds] if temperature > 0 \
            else None
        out = generate(model, prompt_ids, prompt_mask, max_new_tokens, generator=generators, decoder=decoder,
                       **sampling)
    ended = torch.isin(out.completion_ids, torch.tensor(stop_ids, device=out.completion_ids.device)).any(dim=1)
    return [Completion(tokenizer.decode(ids[mask.bool()], skip_special_tokens=True), int(mask.sum()), bool(eos))
            for ids, mask, eos in zip(out.completion_ids, out.completion_mask, ended)]


def conversation_batch(model: Qwen3ForCausalLM, tokenizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                       max_new_tokens: int, seeds: Sequence[int] | None, responder: ToolResponder, max_turns: int,
                       decoder: Decoder | None, sampling: dict,
                       server: CompletionServer | None = None) -> list[Completion]:
    """complete_batch with tools: each row's conversation (`seeds` None: greedy), its own tokens decoded; each turn
    from the model or, given a `server` serving it, continued there from the conversation's token ids."""
    prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
    options = {k: v for k, v in sampling.items() if k != "pad_token_id"}
    if server is None:
        sample_turn = engine_turns(model, prompts, seeds, max_new_tokens, tokenizer.pad_token_id, decoder=decoder,
                                   **options)
    else:
        sample_turn = served_turns(server, prompts, seeds, max_new_tokens, model_vocab_size=model.config.vocab_size,
                                   **options)
    conversations = roll_out(len(prompts), sample_turn, responder, max_new_tokens, max_turns, tokenizer.eos_token_id)
    completions = []
    for conversation in conversations:
        own = [t for t, sampled in zip(conversation.ids, conversation.sampled) if sampled]
        ended = bool(own) and own[-1] in sampling["eos_token_id"]
        completions.append(Completion(tokenizer.decode(own, skip_special_tokens=True), len(own), ended))
    return completions


def encode_prompts(collator: PromptCollator, rows: Sequence[dict], chunk: int = 256) -> list[list[int]]:
    """Each row's prompt tokens (template applied, truncated), through the same collator that batches them later,
    so the lengths used for sorting are exactly the lengths generated from."""
    prompts = []
    for start in range(0, len(rows), chunk):
        batch = collator(list(rows[start:start + chunk]))
        prompts += [ids[mask.bool()].tolist() for ids, mask in zip(batch["prompt_ids"], batch["prompt_attention_mask"])]
    return prompts


# ------------------------------------------------------------------------------------------------------- metrics

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k), as the
    numerically stable product 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to n, and n itself."""
    return sorted({2 ** p for p in range(n.bit_length()) if 2 ** p <= n} | {n})


def summarize(records: list[dict], num_rows: int, n_samples: int, seconds: float) -> dict:
    total = len(records)
    correct = sum(r["correct"] for r in records)
    low, high = wilson_interval(correct, total)
    summary = {
        "rows": num_rows, "n_samples": n_samples, "samples": total, "correct": correct,
        "accuracy": correct / total, "accuracy_ci95": [low, high],
        "mean_completion_tokens": sum(r["completion_tokens"] for r in records) / total,
        "eos_share": sum(r["eos"] for r in records) / total,
        "reasons": dict(Counter(r["reason"] for r in records)),
        "seconds": seconds,
    }
    if n_samples > 1:
        per_row = Counter(r["index"] for r in records if r["correct"])
        per_k = {str(k): [pass_at_k(n_samples, per_row[i], k) for i in range(num_rows)] for k in pass_ks(n_samples)}
        summary["pass@k"] = {k: sum(values) / num_rows for k, values in per_k.items()}
        summary["pass@k_ci95"] = {k: list(problem_interval(values)) for k, values in per_k.items()}
        summary[f"mean@{n_samples}"] = correct / total
        summary[f"mean@{n_samples}_ci95"] = list(problem_interval([per_row[i] / n_samples for i in range(num_rows)]))
    return summary


def format_summary(summary: dict) -> str:
    low, high = summary["accuracy_ci95"]
    line = (f"accuracy {summary['accuracy']:.3f} [{low:.3f}, {high:.3f}] ({summary['correct']}/{summary['samples']})"
            f" | mean completion {summary['mean_completion_tokens']:.1f} tokens | eos {summary['eos_share']:.0%}"
            f" | {summary['seconds']:.1f} s")
    if summary["n_samples"] > 1:
        n = summary["n_samples"]
        line += " | " + " ".join(f"pass@{k} {v:.3f} [{summary['pass@k_ci95'][k][0]:.3f}, "
                                 f"{summary['pass@k_ci95'][k][1]:.3f}]" for k, v in summary["pass@k"].items())
        low, high = summary[f"mean@{n}_ci95"]
        line += f" | mean@{n} {summary[f'mean@{n}']:.3f} [{low:.3f}, {high:.3f}]"
    return line


# ---------------------------------------------------------------------------------------------------- evaluation

def check_sampling(n_samples: int, temperature: float, top_p: float) -> None:
    """Raise ValueError, saying what to change, on an impossible sampling configuration."""
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if n_samples > 1 and temperature == 0:
        raise ValueError(f"n_samples={n_samples} with temperature 0 (greedy) would repeat one completion "
                         f"{n_samples} times: pass a temperature > 0, e.g. --temperature 0.6")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def check_ground_truth(rows: Sequence[dict]) -> None:
    """Every row needs a ground truth to be graded; refuse before generating anything rather than score it 0."""
    for i, row in enumerate(rows):
        truth = row.get("ground_truth")
        if truth is None or not str(truth).strip():
            raise ValueError(f"row {i} has no ground truth (a `ground_truth` column, or DAPO's "
                             f"reward_model.ground_truth); every evaluated row needs one")


@torch.no_grad()
def evaluate_math(model: Qwen3ForCausalLM, tokenizer, rows: Sequence[dict], batch_size: int = 32,
                  max_new_tokens: int = 256, max_prompt_length: int = 512, enable_thinking: bool = False,
                  n_samples: int = 1, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                  grade_timeout: float = 5.0, progress: bool = True, server: CompletionServer | None = None,
                  decoder: Decoder | None = None, responder: ToolResponder | None = None,
                  max_turns: int = 1) -> tuple[dict, list[dict]]:
    """Generate n_samples completions per row, grade them, -> (summary, per-sample records in input order).

    `rows`: dicts with `messages` and `ground_truth` (RowDataset rows). The model is used as it is (device, dtype);
    it is put in eval mode and left there. With a `server` (serving this model) the completions come from it;
    `decoder`: generate's decode step (default: eager); `responder`: the tools' answers, multi-turn conversations of
    up to `max_turns` turns (complete_batch).
    """
    check_sampling(n_samples, temperature, top_p)
    check_ground_truth(rows)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    model.eval()
    device = next(model.parameters()).device
    collator = PromptCollator(tokenizer, max_prompt_length, enable_thinking)
    prompts = encode_prompts(collator, rows)
    stop_ids = stop_token_ids(model, tokenizer)
    # a job is one (row, sample); sorted by prompt length, longest first (sorted() is stable: ties keep input order)
    jobs = sorted(((i, s) for i in range(len(rows)) for s in range(n_samples)), key=lambda job: -len(prompts[job[0]]))

    results: dict[tuple[int, int], dict] = {}
    start = time.perf_counter()
    bar = tqdm(total=len(jobs), desc="eval", unit="sample", disable=not progress, dynamic_ncols=True)
    for b in range(0, len(jobs), batch_size):
        batch_jobs = jobs[b:b + batch_size]
        batch = collator([rows[i] for i, _ in batch_jobs])
        completions = complete_batch(model, tokenizer, batch["prompt_ids"].to(device),
                                     batch["prompt_attention_mask"].to(device), max_new_tokens, temperature, top_p,
                                     [derived_seed(seed, i, s) for i, s in batch_jobs], stop_ids, server,
                                     decoder=decoder, responder=responder, max_turns=max_turns)
        for (i, s), completion in zip(batch_jobs, completions):
            results[i, s] = make_record(i, s, n_samples, tokenizer.decode(prompts[i]), completion,
                                        str(rows[i]["ground_truth"]), grade_timeout)
        bar.update(len(batch_jobs))
        bar.set_postfix(acc=f"{sum(r['correct'] for r in results.values()) / len(results):.3f}")
    bar.close()
    records = [results[i, s] for i in range(len(rows)) for s in range(n_samples)]
    return summarize(records, len(rows), n_samples, time.perf_counter() - start), records


def make_record(index: int, sample: int, n_samples: int, prompt: str, completion: Completion, ground_truth: str,
                grade_timeout: float) -> dict:
    result = grade(completion.text, ground_truth, grade_timeout)
    record = {"index": index, "prompt": prompt, "completion": completion.text, "extracted": result.extracted,
              "ground_truth": ground_truth, "correct": bool(result.correct), "reason": result.reason,
              "completion_tokens": completion.num_tokens, "eos": completion.eos}
    if n_samples > 1:
        record["sample"] = sample
    return record


# ----------------------------------------------------------------------------------------------------------- CLI

def add_prompt_args(parser: argparse.ArgumentParser, data_help: str) -> None:
    """The prompt rows' flags (this script's and dataset/make_dpo_pairs.py's): the file, how many rows, how each
    prompt is rendered."""
    parser.add_argument("--data_path", default=None, help=data_help)
    parser.add_argument("--max_rows", type=int, default=0, help="use the first N rows only (0 = all)")
    parser.add_argument("--max_prompt_length", type=int, default=512, help="prompt tokens kept (the end of it)")
    parser.add_argument("--enable_thinking", type=int, default=0, choices=[0, 1], help="Qwen3 thinking mode")


def validate_sampling_args(args: argparse.Namespace) -> None:
    """The rules of the sampling, length and grading flags this script and dataset/make_dpo_pairs.py share."""
    try:
        check_sampling(args.n_samples, args.temperature, args.top_p)
    except ValueError as e:
        refuse(str(e))
    for name in ("batch_size", "max_new_tokens", "max_prompt_length"):
        if getattr(args, name) < 1:
            refuse(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.max_rows < 0:
        refuse(f"--max_rows must be >= 0 (0 = all rows), got {args.max_rows}")
    if not args.grade_timeout > 0:
        refuse(f"--grade_timeout must be > 0, got {args.grade_timeout}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description="Math accuracy of a Qwen3 checkpoint (graded with math-verify)")
    add_model_args(parser)
    add_prompt_args(parser, ".parquet/.jsonl in DAPO schema (default: demo eval set)")
    # generation
    parser.add_argument("--batch_size", type=int, default=32, help="sequences per generate call")
    parser.add_argument("--max_new_tokens", type=int, default=256, help="completion budget per sample")
    parser.add_argument("--n_samples", type=int, default=1, help="samples per problem (> 1: pass@k, needs T > 0)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (sampling only)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the per-(row, sample) sampling generators")
    parser.add_argument("--decode", default="auto", choices=DECODE_CHOICES,
                        help="the decode step: compiled = torch.compile (CUDA graphs on CUDA), faster per token once "
                             "compiled, the first batch of each decoding width pays the compilation; auto: compiled "
                             "on CUDA, eager elsewhere")
    parser.add_argument("--server_url", default=None,
                        help="generate on this OpenAI-compatible server (vLLM) serving --model_path, e.g. "
                             "http://127.0.0.1:8000/v1; its log-probabilities are checked against the model's first")
    parser.add_argument("--server_model", default=None,
                        help="the server's --served-model-name (default: --model_path, vLLM's default name)")
    parser.add_argument("--server_api_key_env", default=None,
                        help="environment variable holding the server's API key (default: no key)")
    parser.add_argument("--tools", default="",
                        help=f"comma-separated tools the model's calls are answered by, multi-turn as the loops' "
                             f"rollouts (built in: {', '.join(BUILTIN_TOOLS)}; the rows' `tools` column shows them "
                             f"to it; docs/tools.md). Empty: one answer")
    parser.add_argument("--max_turns", type=int, default=4, help="with --tools: assistant turns per answer at most")
    # grading and output
    parser.add_argument("--grade_timeout", type=float, default=5.0, help="seconds per graded sample")
    parser.add_argument("--out", default=None,
                        help="per-sample JSONL (default: beside the model folder, MODEL_eval_<data stem>.jsonl)")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    validate_sampling_args(args)
    if args.decode == "compiled" and args.server_url:
        refuse("--decode compiled compiles the built-in engine's decode step; with --server_url the server "
               "generates: drop one of them")
    if args.decode == "auto":
        args.decode = default_decode(torch.device(args.device).type)
    validate_model_args(args)
    validate_tool_args(args)
    return args


def validate_tool_args(args: argparse.Namespace) -> None:
    unknown = unknown_tools(tool_names(args.tools))
    if unknown:
        refuse(f"--tools {args.tools}: no tool named {', '.join(unknown)} (built in: {', '.join(BUILTIN_TOOLS)})")
    if args.max_turns < 1:
        refuse(f"--max_turns must be >= 1, got {args.max_turns}")


def output_paths(out: str | None, model_path: str, data_path: str) -> tuple[str, str]:
    """-> (per-sample JSONL, summary JSON). The default lies beside the model folder, never inside it: a training
    run's next save replaces that folder whole, and the results would vanish with it."""
    if out is None:
        folder = os.path.normpath(model_path)
        if os.path.basename(folder) in (".", ".."):  # no folder name to build on
            folder = os.path.abspath(folder)
        stem = os.path.splitext(os.path.basename(data_path))[0]
        out = os.path.join(os.path.dirname(folder), f"{os.path.basename(folder)}_eval_{stem}.jsonl")
    return out, os.path.splitext(out)[0] + ".summary.json"


def write_text(path: str, text: str) -> None:
    with atomic_write(path) as f:
        f.write(text.encode("utf-8"))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    data_path = args.data_path or ensure_demo_data()["eval"]
    out_path, summary_path = output_paths(args.out, args.model_path, data_path)
    check_writable(os.path.dirname(os.path.abspath(out_path)), "the output folder")  # not after an hour of generation
    dataset = RowDataset(data_path)
    rows = [dataset[i] for i in range(len(dataset) if args.max_rows == 0 else min(args.max_rows, len(dataset)))]
    try:
        check_ground_truth(rows)  # before the model loads: a bad file should fail in a second, not a minute
    except ValueError as e:
        raise UserError(f"{data_path}: {e}") from None
    server = None
    if args.server_url:  # a server that is down is refused before the model loads
        server = open_checked_server(args.server_url, args.server_model or args.model_path, what="server",
                                     max_length=args.max_prompt_length + args.max_new_tokens,
                                     api_key_env=args.server_api_key_env)
    torch.manual_seed(args.seed)
    model, tokenizer = load_for_inference(args.model_path, args.device, args.dtype)
    if server is not None:
        check_served_weights(server, model, probe_token_ids(tokenizer), next(model.parameters()).dtype,
                             contextlib.nullcontext, "for --model_path",
                             f"the server serves another model or --dtype than --model_path {args.model_path}")
    summary, records = evaluate_math(model, tokenizer, rows, batch_size=args.batch_size,
                                     max_new_tokens=args.max_new_tokens, max_prompt_length=args.max_prompt_length,
                                     enable_thinking=bool(args.enable_thinking), n_samples=args.n_samples,
                                     temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                     grade_timeout=args.grade_timeout, progress=not args.no_progress,
                                     server=server, decoder=Decoder(compiled=args.decode == "compiled"),
                                     responder=ToolResponder(tokenizer, answerer(tool_names(args.tools)),
                                                             bool(args.enable_thinking)) if args.tools else None,
                                     max_turns=args.max_turns)
    # the code and the settings that made it: a script reusing the summary can tell whether it still holds
    summary.update(model_path=args.model_path, data_path=data_path, out=out_path, args=vars(args),
                   commit=code_commit())
    write_text(out_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    write_text(summary_path, json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    print(format_summary(summary))
    print(f"wrote {out_path} and {summary_path}")
    return summary


if __name__ == "__main__":
    run_script(main)
