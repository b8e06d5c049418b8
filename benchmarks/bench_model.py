"""Our Qwen3 against transformers' Qwen3ForCausalLM on the same weights and inputs: forward+backward, greedy and
sampled generate; then our eager decode step over the filled cache positions against over the whole cache, eager
against compiled (and the compile's cost), and the two forms of the decode step's lm_head.

    python benchmarks/bench_model.py                                   # CPU, fp32, every workload below
    python benchmarks/bench_model.py --device cuda --dtype bfloat16    # on a GPU
    python benchmarks/bench_model.py --only generate,sample            # greedy and sampled against transformers
    python benchmarks/bench_model.py --only cache --threads 1          # attending over the filled positions or all
    python benchmarks/bench_model.py --only decode --threads 2         # the decode step, eager vs compiled
    python benchmarks/bench_model.py --only lm_head --threads 1        # F.linear vs (W @ h.T).T

Workloads (--only takes a comma-separated list):
  train     forward + backward of a (4, 256) batch, cross entropy over all positions computed the same way for both,
            on the flags' model: hidden 512, 6 layers, intermediate 1536, 8 query / 4 KV heads, head_dim 64 (~19M
            non-embedding parameters) plus the real 151,936-row tied embedding (all but the heads are flags)
  generate  greedy generate of --num_prompts (8) left-padded prompts of 16..64 tokens x --new_tokens (64), EOS
            disabled so both produce every token (checked: the two must produce identical tokens), on
            --generate_config's shape with random weights (default the OPD demo teacher, model/configs/
            qwen3-tiny.json: hidden 128, 4 layers, the real vocabulary)
  cache     our eager greedy generate of the same prompts as it runs -- each step attending over the cache's filled
            positions (rounded up to model/generate.py's KEY_BLOCK) -- against each step attending over the whole
            cache under the key mask, as the compiled step does, x each of --cache_tokens (64, 512) new tokens, on
            --generate_config's shape and on the same with Qwen3-0.6B's attention (16 query / 8 KV heads of 128),
            where attention is a larger share of a step
  sample    sampled generate, temperature 1, no top-k / top-p, on --sample_config's shape (default the OPD demo
            student, model/configs/qwen3-tiny-student.json: hidden 64, 2 layers, the real vocabulary; --sample_model
            a trained one such as checkpoints/kd, else random weights), --sample_batches prompts x --sample_tokens,
            EOS disabled: ours with one seeded generator per row (as OPD's rollout), eager and with the compiled
            decode step (--decode compiled's Decoder, compiled in the warm-up), transformers' generate(do_sample=True)
  decode    our sampled generation per step, the eager decode step against the compiled one (torch.compile,
            inductor; on CUDA replayed as CUDA graphs), --sample_batches rows x --sample_tokens, for the OPD demo
            student and teacher shapes and for the demo student's layer (width 64) stacked to Qwen3-0.6B's 28 layers
            with a 1,024-token vocabulary: its arithmetic is next to nothing, so its eager step time is what Python
            and the per-op dispatch cost per step (divided by 28: per layer) -- the overhead a GPU's eager step pays
            too, kernel launches on top, and that a CUDA graph replaces by one launch. Also the compile: how much
            longer the first compiled rollout of a width took than a later one, and in how many rollouts the
            compiled step saves that much (inductor's on-disk cache serves later processes: set
            TORCHINDUCTOR_CACHE_DIR to an empty folder for a cold start)
  lm_head   the lm_head of one decode step, F.linear(h, W) against (W @ h.T).T, eager and each under torch.compile,
            at hidden 64 / 128 / 512 and --sample_batches rows, for each use: sampled (contiguous logits, so the
            weight-stationary form pays a copy) and greedy (their argmax): what model/generate.py's
            next_token_logits chooses by
Warm-up, then the median of --repeats timed runs, the contenders taking turns so a load change hits them alike. The
ratio is transformers / ours, whole cache / filled positions, or eager / compiled (> 1: ours, the filled positions,
or the compiled step is faster).
On a CPU a decode step is memory-bound: the 151,936-row lm_head (78 MB in fp32 at hidden 128, 311 MB at 512) is
read once per token. Ours reads it weight-stationary for greedy up to 8 rows (see model/generate.py:
next_token_logits), which also splits across threads where F.linear's form does not, so the generate ratio grows
with --threads (2-core AMD EPYC: 1.45-1.53x with both cores, 1.20-1.23x with one).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import tempfile
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
import transformers  # noqa: E402  (benchmarks and tests only; project code never imports it)

from benchmarks import harness  # noqa: E402
from common.errors import ArgumentParser, refuse, run_script  # noqa: E402
from model import DTYPES, Decoder, Qwen3Config, create_model, generate, load_pretrained, save_pretrained  # noqa: E402

generate_module = importlib.import_module("model.generate")  # the module: `model.generate` is the function

WORKLOADS = ("train", "generate", "cache", "sample", "decode", "lm_head")
PAD_ID = 151643
# the cache table's model whose attention is a real model's share of a step: Qwen3-0.6B's heads
QWEN3_06B_ATTENTION = "same, 16 query / 8 KV heads of 128 (Qwen3-0.6B's)"
# the decode table's model with almost no arithmetic: its step time is Python and dispatch
OVERHEAD_PROXY = "28 layers (0.6B's depth), width 64, vocab 1,024"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--only", default=",".join(WORKLOADS), help="comma-separated workloads to run")
    g = p.add_argument_group("train: the model")
    g.add_argument("--hidden_size", type=int, default=512)
    g.add_argument("--num_layers", type=int, default=6)
    g.add_argument("--intermediate_size", type=int, default=1536)
    g.add_argument("--vocab_size", type=int, default=151936)
    g.add_argument("--batch_size", type=int, default=4)
    g.add_argument("--seq_len", type=int, default=256)
    g = p.add_argument_group("generate (greedy)")
    g.add_argument("--generate_config", default=harness.TEACHER_CONFIG,
                   help="the model's shape (random weights); default the OPD demo teacher, 4 layers")
    g.add_argument("--num_prompts", type=int, default=8)
    g.add_argument("--new_tokens", type=int, default=64)
    g.add_argument("--cache_tokens", default="64,512", help="cache: the rollout lengths (new tokens)")
    g = p.add_argument_group("sample, decode, lm_head")
    g.add_argument("--sample_config", default=harness.STUDENT_CONFIG)
    g.add_argument("--sample_model", default=os.path.join(ROOT, "checkpoints", "kd"),
                   help="a trained model of that shape (used when its folder exists; else random weights)")
    g.add_argument("--sample_batches", default="8,16", help="prompt counts (rows) of these workloads")
    g.add_argument("--sample_tokens", type=int, default=64)
    g = p.add_argument_group("timing")
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument("--repeats", type=int, default=5)
    harness.add_json_arg(p)
    args = p.parse_args(argv)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = set(args.only) - set(WORKLOADS)
    if unknown or not args.only:
        refuse(f"--only {','.join(sorted(unknown)) or '(empty)'}: choose from {','.join(WORKLOADS)}")
    args.sample_batches = [int(b) for b in args.sample_batches.split(",")]
    args.cache_tokens = [int(n) for n in args.cache_tokens.split(",")]
    if args.repeats < 1 or args.warmup < 0 or min(args.sample_batches + args.cache_tokens) < 1:
        refuse("--repeats, every --sample_batches and every --cache_tokens must be >= 1, --warmup >= 0")
    return args


def left_padded_prompts(num_prompts: int, vocab_size: int, seed: int,
                        device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of 16..64 tokens (different lengths: left padding), padded with Qwen3's pad token (or the last id)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(16, 64, num_prompts).long().tolist()
    width = max(lengths)
    ids = torch.randint(0, min(151000, vocab_size), (num_prompts, width), generator=generator)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, width - n:] = 1
        ids[row, :width - n] = pad_id(vocab_size)
    return ids.to(device), mask.to(device)


def pad_id(vocab_size: int) -> int:
    return min(PAD_ID, vocab_size - 1)


def transformers_model(folder: str, dtype: torch.dtype, device: str, vocab_size: int):
    """transformers' model of the HF folder, set to generate every new token (no EOS), as ours with eos None."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = pad_id(vocab_size)
    return model


def build_models(args: argparse.Namespace, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' model and ours of the train flags' shape, the same random weights (one HF folder both load)."""
    config = transformers.Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=True,
        bos_token_id=pad_id(args.vocab_size), eos_token_id=min(151645, args.vocab_size - 1),
        pad_token_id=pad_id(args.vocab_size))
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
        hf = transformers_model(folder, dtype, args.device, args.vocab_size)
        ours = load_pretrained(folder, dtype=dtype, device=args.device)
    return hf, ours


def same_weight_models(config_path: str, trained_folder: str | None, dtype: torch.dtype,
                       device: str) -> tuple[torch.nn.Module, torch.nn.Module, bool]:
    """transformers' model and ours in eval mode, both loaded from one HF folder: `trained_folder` when it holds a
    model, else random weights of `config_path`'s shape (seed 0). The third value: whether the folder was used."""
    trained = trained_folder is not None and os.path.isfile(os.path.join(trained_folder, "config.json"))
    with tempfile.TemporaryDirectory() as scratch:
        folder = trained_folder if trained else scratch
        if not trained:
            save_pretrained(create_model(Qwen3Config.from_json(config_path), seed=0), folder)
        ours = load_pretrained(folder, dtype=dtype, device=device).eval()
        hf = transformers_model(folder, dtype, device, ours.config.vocab_size).eval()
    return hf, ours, trained


def describe_config(config: Qwen3Config) -> str:
    return f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, vocabulary {config.vocab_size}"


def train_step(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def row(workload: str, ours_ms: float, transformers_ms: float) -> dict:
    return {"workload": workload, "ours_ms": ours_ms, "transformers_ms": transformers_ms,
            "transformers_over_ours": transformers_ms / ours_ms}


def train_row(args: argparse.Namespace, hf, ours) -> dict:
    ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    hf.train(), ours.train()
    loss_hf, loss_ours = train_step(hf, ids), train_step(ours, ids)
    assert torch.allclose(loss_hf.float(), loss_ours.float(), rtol=1e-3), (loss_hf, loss_ours)
    t_ours, t_hf = harness.median_ms([lambda: train_step(ours, ids), lambda: train_step(hf, ids)], args.device,
                                     args.warmup, args.repeats)
    hf.zero_grad(set_to_none=True), ours.zero_grad(set_to_none=True)
    return row(f"forward+backward {args.batch_size}x{args.seq_len}", t_ours, t_hf)


def generate_row(args: argparse.Namespace, dtype: torch.dtype) -> dict:
    hf, ours, _ = same_weight_models(args.generate_config, None, dtype, args.device)
    print(f"greedy generate: random weights, {describe_config(ours.config)}")
    vocab = ours.config.vocab_size
    ids, mask = left_padded_prompts(args.num_prompts, vocab, 0, args.device)
    new = args.new_tokens

    def run_ours():
        return generate(ours, ids, mask, new, do_sample=False, eos_token_id=None, pad_token_id=pad_id(vocab)).sequences

    def run_hf():
        with torch.no_grad():
            return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=0,
                               do_sample=False, top_k=None, top_p=None, temperature=None)

    seq_ours, seq_hf = run_ours(), run_hf()
    assert seq_ours.shape == seq_hf.shape == (args.num_prompts, ids.shape[1] + new), (seq_ours.shape, seq_hf.shape)
    same = (seq_ours == seq_hf).float().mean().item()
    print(f"generate: identical tokens {same:.1%}" + ("" if same == 1.0 else " (bf16/fp16 near-ties may "
                                                                           "diverge; fp32 should be 100%)"))
    t_ours, t_hf = harness.median_ms([run_ours, run_hf], args.device, args.warmup, args.repeats)
    return {**row(f"generate {args.num_prompts} prompts x {new} new (greedy)", t_ours, t_hf),
            "identical_tokens": same}


def cache_rows(args: argparse.Namespace, dtype: torch.dtype) -> list[dict]:
    """Our eager greedy generate as it is -- a step attends over the cache's filled positions, rounded up to
    KEY_BLOCK -- against each step attending over the whole cache under its key mask, as the compiled step does
    (KEY_BLOCK patched to the cache's length), --num_prompts rows x each of --cache_tokens new tokens, on
    --generate_config's shape and on the same with Qwen3-0.6B's attention: the same tokens, checked."""
    config = Qwen3Config.from_json(args.generate_config)
    shapes = [(describe_config(config), config),
              (QWEN3_06B_ATTENTION, Qwen3Config.from_dict({**config.to_hf_dict(), "num_attention_heads": 16,
                                                           "num_key_value_heads": 8, "head_dim": 128}))]
    rows = []
    for name, shape in shapes:
        model = create_model(shape, seed=0, dtype=dtype, device=args.device).eval()
        ids, mask = left_padded_prompts(args.num_prompts, shape.vocab_size, 0, args.device)
        for new in args.cache_tokens:
            def filled():
                return generate(model, ids, mask, new, do_sample=False, eos_token_id=None,
                                pad_token_id=pad_id(shape.vocab_size)).sequences

            def whole():
                with mock.patch.object(generate_module, "KEY_BLOCK", ids.shape[1] + new):
                    return filled()
            assert torch.equal(filled(), whole())
            filled_ms, whole_ms = harness.median_ms([filled, whole], args.device, args.warmup, args.repeats)
            rows.append({"model": name, "new_tokens": new, "rows": args.num_prompts, "filled_ms": filled_ms,
                         "whole_ms": whole_ms, "whole_over_filled": whole_ms / filled_ms})
    return rows


def sampled_rows(args: argparse.Namespace, dtype: torch.dtype) -> list[dict]:
    """The same weights in both, loaded from one HF folder: ours eager and compiled against transformers'."""
    hf, ours, trained = same_weight_models(args.sample_config, args.sample_model, dtype, args.device)
    vocab = ours.config.vocab_size
    print(f"sampled generate: {args.sample_model if trained else 'random weights'}, {describe_config(ours.config)}")
    new, rows, decoder = args.sample_tokens, [], Decoder(compiled=True)
    for num_prompts in args.sample_batches:
        ids, mask = left_padded_prompts(num_prompts, vocab, num_prompts, args.device)

        def run_ours(step_decoder=None):
            generators = [torch.Generator(args.device).manual_seed(r) for r in range(num_prompts)]
            return generate(ours, ids, mask, new, do_sample=True, eos_token_id=None, pad_token_id=pad_id(vocab),
                            generator=generators, decoder=step_decoder).sequences

        def run_hf():
            torch.manual_seed(0)
            with torch.no_grad():
                return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=0,
                                   do_sample=True, temperature=1.0, top_k=0, top_p=1.0)

        assert run_ours().shape == run_hf().shape == (num_prompts, ids.shape[1] + new)
        same = (run_ours(decoder) == run_ours()).float().mean().item()  # the first call compiles
        print(f"{num_prompts} prompts: the compiled decode step's tokens {same:.1%} identical to the eager step's "
              f"(fused kernels round differently: a draw near a boundary can flip, and its row goes on differently)")
        t_eager, t_compiled, t_hf = harness.median_ms([run_ours, lambda: run_ours(decoder), run_hf], args.device,
                                                      args.warmup, args.repeats)
        rows.append(row(f"generate {num_prompts} prompts x {new} new (sampled)", t_eager, t_hf))
        rows.append(row("  same, compiled decode step", t_compiled, t_hf))
    return rows


def decode_rows(args: argparse.Namespace, dtype: torch.dtype) -> list[dict]:
    """ms per step of generate (a token for every row; the prefill included, spread over the steps) with the eager
    and the compiled decode step, random weights, --sample_tokens new tokens after 16..64-token prompts, no EOS; and
    what the first compiled rollout of a width took beyond a later one (its compile), in rollouts of the time the
    compiled step saves."""
    student = Qwen3Config.from_json(args.sample_config)
    shapes = [("OPD demo student", student), ("OPD demo teacher", Qwen3Config.from_json(harness.TEACHER_CONFIG)),
              (OVERHEAD_PROXY, Qwen3Config.from_dict({**student.to_hf_dict(), "num_hidden_layers": 28,
                                                      "vocab_size": 1024}))]
    steps, rows = args.sample_tokens, []
    for name, config in shapes:
        model = create_model(config, seed=0, dtype=dtype, device=args.device).eval()
        decoder = Decoder(compiled=True)
        for num_prompts in args.sample_batches:
            ids, mask = left_padded_prompts(num_prompts, config.vocab_size, num_prompts, args.device)

            def run(step_decoder=None):
                generators = [torch.Generator(args.device).manual_seed(r) for r in range(num_prompts)]
                generate(model, ids, mask, steps, eos_token_id=None, pad_token_id=0, generator=generators,
                         decoder=step_decoder)
            first_ms, = harness.median_ms([lambda: run(decoder)], args.device, 0, 1)  # compiles this width
            eager, compiled = (t / steps for t in harness.median_ms([run, lambda: run(decoder)], args.device,
                                                                    args.warmup, args.repeats))
            compile_ms, saved_ms = max(first_ms - compiled * steps, 0.0), (eager - compiled) * steps
            rows.append({"model": name, "rows": num_prompts, "layers": config.num_hidden_layers,
                         "eager_ms": eager, "compiled_ms": compiled, "eager_over_compiled": eager / compiled,
                         "compile_s": compile_ms / 1000.0,
                         "rollouts_to_repay": compile_ms / saved_ms if saved_ms > 0 else None})
    return rows


def linear_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(h, w)  # contiguous already


def stationary_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w @ h.T).T.contiguous()  # the copy sampling needs


def linear_argmax(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(h, w).argmax(dim=-1)


def stationary_argmax(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (w @ h.T).T.argmax(dim=-1)  # greedy reads the transposed view as it is


# what a decode step needs from its lm_head: sampled, contiguous logits; greedy, their argmax
LM_HEAD_USES = {"sampled": (linear_logits, stationary_logits), "greedy": (linear_argmax, stationary_argmax)}


def lm_head_rows(args: argparse.Namespace) -> list[dict]:
    """Per width, rows and use, four contenders take turns in each repeat: F.linear, (W @ h.T).T, then each
    compiled (one compiled function per form: a recompile per shape, under dynamo's limit of 8)."""
    compiled = {use: [torch.compile(form, dynamic=False) for form in forms] for use, forms in LM_HEAD_USES.items()}
    results = []
    for hidden in (64, 128, 512):
        weight = torch.randn(args.vocab_size, hidden, device=args.device) * 0.02
        for rows in args.sample_batches:
            h = torch.randn(rows, hidden, device=args.device)
            for use, forms in LM_HEAD_USES.items():
                linear, stationary, c_linear, c_stationary = harness.median_ms(
                    [functools.partial(form, h, weight) for form in (*forms, *compiled[use])], args.device,
                    args.warmup + 1, max(args.repeats, 9))
                results.append({"hidden": hidden, "rows": rows, "use": use, "linear_ms": linear,
                                "stationary_ms": stationary, "compiled_linear_ms": c_linear,
                                "compiled_stationary_ms": c_stationary})
    return results


def print_tables(results: dict, args: argparse.Namespace) -> None:
    if results["rows"]:
        print("\n" + harness.table(["workload", "ours ms", "transformers ms", "transformers / ours"], [
            [r["workload"], f"{r['ours_ms']:.1f}", f"{r['transformers_ms']:.1f}", f"{r['transformers_over_ours']:.2f}x"]
            for r in results["rows"]]))
    if results["cache"]:
        print(f"\nour eager greedy generate, {args.num_prompts} prompts, threads {torch.get_num_threads()}: each step "
              f"attending over the cache's filled positions (as it does) against over the whole cache (ratio > 1: "
              f"the filled positions are faster)")
        print(harness.table(["model", "new tokens", "filled ms", "whole cache ms", "ratio"], [
            [r["model"], r["new_tokens"], f"{r['filled_ms']:.1f}", f"{r['whole_ms']:.1f}",
             f"{r['whole_over_filled']:.2f}x"] for r in results["cache"]]))
    if results["decode"]:
        print(f"\ngenerate, ms per step (a token for every row; {args.sample_tokens} steps), eager vs compiled decode "
              f"step, threads {torch.get_num_threads()} (ratio > 1: the compiled step is faster); compile: the first "
              f"compiled rollout of a width beyond a later one (inductor's on-disk cache as this run found it), and "
              f"how many rollouts of this shape the compiled step needs to save that much")
        print(harness.table(["model", "rows", "eager", "compiled", "ratio", "compile s", "rollouts to repay"], [
            [r["model"], r["rows"], f"{r['eager_ms']:.2f}", f"{r['compiled_ms']:.2f}",
             f"{r['eager_over_compiled']:.2f}x" + (f" ({1000 * r['eager_ms'] / r['layers']:.0f} us per layer eager, "
                                                   f"{1000 * r['compiled_ms'] / r['layers']:.0f} compiled)"
                                                   if r["model"] == OVERHEAD_PROXY else ""),
             f"{r['compile_s']:.1f}",
             "never" if r["rollouts_to_repay"] is None else f"{r['rollouts_to_repay']:.0f}"]
            for r in results["decode"]]))
    if results["lm_head"]:
        print(f"\nlm_head of a decode step, {args.vocab_size} rows, threads {torch.get_num_threads()}: sampled needs "
              f"contiguous logits ((W@h.T).T copied), greedy their argmax (of the view as it is) (ratio > 1: the "
              f"weight-stationary form is faster)")
        print(harness.table(["hidden", "rows", "use", "F.linear ms", "(W@h.T).T ms", "ratio", "compiled F.linear ms",
                             "compiled (W@h.T).T ms", "ratio"], [
            [r["hidden"], r["rows"], r["use"], f"{r['linear_ms']:.2f}", f"{r['stationary_ms']:.2f}",
             f"{r['linear_ms'] / r['stationary_ms']:.2f}x", f"{r['compiled_linear_ms']:.2f}",
             f"{r['compiled_stationary_ms']:.2f}", f"{r['compiled_linear_ms'] / r['compiled_stationary_ms']:.2f}x"]
            for r in results["lm_head"]]))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    harness.set_threads(args.threads)
    dtype = DTYPES[args.dtype]
    print(f"{harness.machine()}; {args.device} {args.dtype}, threads {torch.get_num_threads()}, torch "
          f"{torch.__version__}, transformers {transformers.__version__}", flush=True)
    results: dict = {"rows": [], "cache": [], "decode": [], "lm_head": []}
    if "train" in args.only:
        hf, ours = build_models(args, dtype)
        non_embedding = sum(p.numel() for n, p in ours.named_parameters() if "embed_tokens" not in n)
        print(f"train: {non_embedding / 1e6:.1f}M non-embedding parameters + {args.vocab_size} x "
              f"{args.hidden_size} tied embedding, transformers attention {hf.config._attn_implementation}")
        results["rows"].append(train_row(args, hf, ours))
        del hf, ours
    if "generate" in args.only:
        results["rows"].append(generate_row(args, dtype))
    if "cache" in args.only:
        results["cache"] = cache_rows(args, dtype)
    if "sample" in args.only:
        results["rows"] += sampled_rows(args, dtype)
    if "decode" in args.only:
        results["decode"] = decode_rows(args, dtype)
    if "lm_head" in args.only:
        results["lm_head"] = lm_head_rows(args)
    print_tables(results, args)
    harness.write_json(args.json, results)
    return results


if __name__ == "__main__":
    run_script(main)
