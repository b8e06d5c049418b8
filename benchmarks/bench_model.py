"""Our Qwen3 vs transformers' Qwen3ForCausalLM on the same weights and inputs: forward+backward, greedy and sampled
generate; then our decode step eager vs compiled, and the two forms of the decode step's lm_head.

    python benchmarks/bench_model.py                                   # CPU, fp32, the default sizes below
    python benchmarks/bench_model.py --device cuda --dtype bfloat16    # on a GPU
    python benchmarks/bench_model.py --repeats 3 --new_tokens 32       # a quick look
    python benchmarks/bench_model.py --only sample --threads 2         # sampled generation, the OPD demo student
    python benchmarks/bench_model.py --only decode --threads 2         # the decode step, eager vs compiled
    python benchmarks/bench_model.py --only lm_head --threads 1        # F.linear vs (W @ h.T).T, at 1 and 2 threads

Model: hidden 512, 6 layers, intermediate 1536, 8 query / 4 KV heads, head_dim 64 (~19M non-embedding parameters)
plus the real 151,936-row tied embedding. Workloads:
  (a) forward + backward of a (4, 256) batch, cross entropy over all positions computed the same way for both;
  (b) greedy generate of 8 left-padded prompts of different lengths x 128 new tokens, EOS disabled so both
      produce all 128 tokens (checked: the two must produce identical tokens);
  (c) sampled generate, temperature 1, no top-k / top-p, on --sample_config's shape (default the OPD demo student,
      model/configs/qwen3-tiny-student.json: hidden 64, 2 layers, the real vocabulary; --sample_model a trained
      one such as checkpoints/kd, else random weights), --sample_batches prompts x 64 new tokens, EOS disabled:
      ours with one seeded generator per row (as OPD's rollout), eager and with the compiled decode step
      (--use_compile 1's Decoder, compiled in the warm-up), transformers' generate(do_sample=True) seeded once;
  (e) our sampled generation per step, the eager decode step against the compiled one (torch.compile, inductor;
      on CUDA replayed as CUDA graphs), for the OPD demo student and teacher shapes (8 and 16 rows) and for the
      demo student's layer (width 64) stacked to Qwen3-0.6B's 28 layers with a 1,024-token vocabulary: its
      arithmetic is next to nothing, so its eager step time is what Python and the per-op dispatch cost per step
      (per layer: divided by 28) -- the overhead a GPU's eager step pays too, kernel launches on top, and that a
      CUDA graph replaces by one launch;
  (d) the lm_head of one decode step, F.linear(h, W) vs (W @ h.T).T (+ the contiguous copy sampling needs), eager
      and each under torch.compile, over hidden sizes 64 / 128 / 512 and 8 / 16 rows: what model/generate.py's
      next_token_logits chooses by.
Warm-up, then the median of --repeats timed runs, the contenders alternating so a load change hits them alike. The
ratio is transformers / ours, or eager / compiled (> 1: ours, or the compiled step, is faster).
On a CPU a decode step is memory-bound: the 151,936 x 512 lm_head (311 MB in fp32) is read once per token. Ours reads
it weight-stationary (see model/generate.py: next_token_logits), which also splits across threads where F.linear's
form does not, so the generate ratio grows with --threads (2-core machine: ~1.9x with both cores, ~1.4x with one).
"""
import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import transformers  # noqa: E402  (benchmarks and tests only; project code never imports it)

from model import Decoder, Qwen3Config, create_model, generate, load_pretrained, save_pretrained  # noqa: E402

# the decode table's model with almost no arithmetic: its step time is Python and dispatch
OVERHEAD_PROXY = "28 layers (0.6B's depth), width 64, vocab 1,024"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    # model
    p.add_argument("--hidden_size", type=int, default=512)
    p.add_argument("--num_layers", type=int, default=6)
    p.add_argument("--intermediate_size", type=int, default=1536)
    p.add_argument("--vocab_size", type=int, default=151936)
    # workloads
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--num_prompts", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sample_config", default=os.path.join(ROOT, "model", "configs", "qwen3-tiny-student.json"))
    p.add_argument("--sample_model", default=os.path.join(ROOT, "checkpoints", "kd"),
                   help="a trained model of that shape (used when its folder exists; else random weights)")
    p.add_argument("--sample_batches", default="8,16", help="prompt counts of the sampled workload")
    p.add_argument("--sample_tokens", type=int, default=64)
    p.add_argument("--only", choices=["train", "generate", "sample", "decode", "lm_head"], default=None,
                   help="run one workload only")
    return p.parse_args()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fns, device, warmup, repeats) -> list[float]:
    """Median wall time of each of `fns`, in ms. They alternate, so a load change on a shared machine hits all alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, runs in zip(fns, times):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            runs.append((time.perf_counter() - start) * 1000)
    return [statistics.median(runs) for runs in times]


def build_models(args, device, dtype, folder):
    cfg = transformers.Qwen3Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
        max_position_embeddings=4096, rope_theta=1000000.0, tie_word_embeddings=True,
        bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(cfg)
    hf.save_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    hf.generation_config.eos_token_id = None  # generate all new tokens, like ours with eos_token_id=None
    hf.generation_config.pad_token_id = 151643
    ours = load_pretrained(folder, dtype=dtype, device=device)
    return hf, ours


def train_step(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    return loss.detach()


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    print(f"device {device}, dtype {args.dtype}, threads {torch.get_num_threads()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    if args.only in (None, "train", "generate"):
        with tempfile.TemporaryDirectory() as folder:
            hf, ours = build_models(args, device, dtype, folder)
        non_embedding = sum(p.numel() for n, p in ours.named_parameters() if "embed_tokens" not in n)
        print(f"model: {non_embedding / 1e6:.1f}M non-embedding parameters + {args.vocab_size} x "
              f"{args.hidden_size} tied embedding, transformers attn {hf.config._attn_implementation}")
    gen = torch.Generator().manual_seed(0)
    rows = []

    if args.only in (None, "train"):
        ids = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), generator=gen).to(device)
        hf.train(), ours.train()
        loss_hf, loss_ours = train_step(hf, ids), train_step(ours, ids)
        assert torch.allclose(loss_hf.float(), loss_ours.float(), rtol=1e-3), (loss_hf, loss_ours)
        t_ours, t_hf = median_ms([lambda: train_step(ours, ids), lambda: train_step(hf, ids)], device, args.warmup,
                                 args.repeats)
        rows.append((f"forward+backward {args.batch_size}x{args.seq_len}", t_ours, t_hf))
        hf.zero_grad(set_to_none=True), ours.zero_grad(set_to_none=True)

    if args.only in (None, "generate"):
        hf.eval(), ours.eval()
        ids, mask = left_padded_prompts(args.num_prompts, gen, device)
        P = ids.shape[1]
        R = args.new_tokens

        def run_ours():
            return generate(ours, ids, mask, R, do_sample=False, eos_token_id=None, pad_token_id=151643).sequences

        def run_hf():
            with torch.no_grad():
                return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=R, min_new_tokens=0,
                                   do_sample=False, top_k=None, top_p=None, temperature=None)

        seq_ours, seq_hf = run_ours(), run_hf()
        assert seq_ours.shape == seq_hf.shape == (args.num_prompts, P + R), (seq_ours.shape, seq_hf.shape)
        same = (seq_ours == seq_hf).float().mean().item()
        print(f"generate: identical tokens {same:.1%}" + ("" if same == 1.0 else " (bf16/fp16 near-ties may "
                                                                               "diverge; fp32 should be 100%)"))
        t_ours, t_hf = median_ms([run_ours, run_hf], device, args.warmup, args.repeats)
        rows.append((f"generate {args.num_prompts} prompts x {R} new (greedy)", t_ours, t_hf))

    if args.only in (None, "sample"):
        rows += sampled_rows(args, device, dtype)

    if args.only in (None, "decode"):
        decode_table(args, device, dtype)

    if args.only in (None, "lm_head"):
        lm_head_table(args, device)

    if rows:
        print(f"\n{'workload':<42} {'ours ms':>10} {'transformers ms':>16} {'ratio hf/ours':>14}")
    for name, t_ours, t_hf in rows:
        print(f"{name:<42} {t_ours:>10.1f} {t_hf:>16.1f} {t_hf / t_ours:>13.2f}x")


def left_padded_prompts(num_prompts: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of 16..64 tokens (different lengths -> left padding), pad 151643."""
    lengths = torch.linspace(16, 64, num_prompts).long().tolist()
    P = max(lengths)
    ids = torch.randint(0, 151000, (num_prompts, P), generator=gen)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, P - n:] = 1
        ids[row, :P - n] = 151643
    return ids.to(device), mask.to(device)


def sampled_rows(args, device, dtype) -> list[tuple[str, float, float]]:
    """Workload (c): the same weights in both, loaded from one HF folder."""
    trained = os.path.isfile(os.path.join(args.sample_model, "config.json"))
    with tempfile.TemporaryDirectory() as folder:
        if trained:
            folder = args.sample_model
        else:
            save_pretrained(create_model(Qwen3Config.from_json(args.sample_config), seed=0), folder)
        ours = load_pretrained(folder, dtype=dtype, device=device).eval()
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    print(f"sampled generate: {args.sample_model if trained else 'random weights'} "
          f"({ours.config.hidden_size} hidden, {ours.config.num_hidden_layers} layers)")
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 151643
    R = args.sample_tokens
    rows = []
    decoder = Decoder(compiled=True)
    for num_prompts in (int(b) for b in args.sample_batches.split(",")):
        ids, mask = left_padded_prompts(num_prompts, torch.Generator().manual_seed(num_prompts), device)

        def run_ours(step_decoder=None):
            generators = [torch.Generator(device).manual_seed(row) for row in range(num_prompts)]
            return generate(ours, ids, mask, R, do_sample=True, eos_token_id=None, pad_token_id=151643,
                            generator=generators, decoder=step_decoder).sequences

        def run_hf():
            torch.manual_seed(0)
            with torch.no_grad():
                return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=R, min_new_tokens=0,
                                   do_sample=True, temperature=1.0, top_k=0, top_p=1.0)

        assert run_ours().shape == run_hf().shape == (num_prompts, ids.shape[1] + R)
        same = (run_ours(decoder) == run_ours()).float().mean().item()  # the first call compiles
        print(f"{num_prompts} prompts: the compiled decode step's tokens {same:.1%} identical to the eager step's "
              f"(fused kernels round differently: a draw near a boundary can flip, and its row goes on differently)")
        t_eager, t_compiled, t_hf = median_ms([run_ours, lambda: run_ours(decoder), run_hf], device, args.warmup,
                                              args.repeats)
        rows.append((f"generate {num_prompts} prompts x {R} new (sampled)", t_eager, t_hf))
        rows.append((f"  same, compiled decode step", t_compiled, t_hf))
    return rows


def decode_table(args, device, dtype) -> None:
    """Workload (e): ms per step of generate (a token for every row; the prefill included, spread over the steps)
    with the eager and the compiled decode step, on random weights, 64 new tokens after 16..64-token prompts, EOS
    disabled."""
    student = Qwen3Config.from_json(args.sample_config)
    shapes = [("OPD demo student", student, (8, 16)),
              ("OPD demo teacher", Qwen3Config.from_json(os.path.join(ROOT, "model", "configs", "qwen3-tiny.json")),
               (8, 16)),
              (OVERHEAD_PROXY, Qwen3Config.from_dict({**student.to_hf_dict(), "num_hidden_layers": 28,
                                                      "vocab_size": 1024}), (8, 16))]
    print(f"\ngenerate, ms per step (a token for every row; 64 steps), eager vs compiled decode step, threads "
          f"{torch.get_num_threads()} (ratio > 1: the compiled step is faster)")
    print(f"{'model':<48} {'rows':>5} {'eager':>8} {'compiled':>9} {'ratio':>6}")
    for name, config, batches in shapes:
        model = create_model(config, seed=0, dtype=dtype, device=device).eval()
        decoder = Decoder(compiled=True)
        for num_prompts in batches:
            ids, mask = left_padded_prompts(num_prompts, torch.Generator().manual_seed(num_prompts), device)
            ids = ids % config.vocab_size

            def run(step_decoder=None):
                generators = [torch.Generator(device).manual_seed(row) for row in range(num_prompts)]
                generate(model, ids, mask, 64, eos_token_id=None, pad_token_id=0, generator=generators,
                         decoder=step_decoder)
            run(decoder)  # compiles this width
            eager, compiled = (t / 64 for t in median_ms([run, lambda: run(decoder)], device, args.warmup,
                                                         args.repeats))
            layers = config.num_hidden_layers
            per_layer = f" ({1000 * eager / layers:.0f} us per layer eager, {1000 * compiled / layers:.0f} us " \
                        f"compiled)" if name == OVERHEAD_PROXY else ""
            print(f"{name:<48} {num_prompts:>5} {eager:>8.2f} {compiled:>9.2f} {eager / compiled:>5.2f}x{per_layer}")


def lm_head_table(args, device) -> None:
    """Workload (d), paired: the forms alternate in each repeat."""
    print(f"\nlm_head of a decode step, {args.vocab_size} rows, threads {torch.get_num_threads()} "
          f"(ratio > 1: the weight-stationary form is faster)")
    print(f"{'hidden':>6} {'rows':>5} {'F.linear ms':>12} {'(W@h.T).T ms':>13} {'ratio':>6} {'+contiguous':>12} "
          f"{'compiled: F.linear':>19} {'(W@h.T).T':>10} {'ratio':>6}")
    forms = [lambda h, w: F.linear(h, w), lambda h, w: (w @ h.T).T, lambda h, w: (w @ h.T).T.contiguous()]
    compiled = [torch.compile(form, dynamic=False) for form in forms[:2]]
    for hidden in (64, 128, 512):
        weight = torch.randn(args.vocab_size, hidden, device=device) * 0.02
        for rows in (8, 16):
            h = torch.randn(rows, hidden, device=device)
            linear, stationary, copied, c_linear, c_stationary = median_ms(
                [functools.partial(form, h, weight) for form in forms + compiled], device, args.warmup + 1,
                max(args.repeats, 9))
            print(f"{hidden:>6} {rows:>5} {linear:>12.2f} {stationary:>13.2f} {linear / stationary:>5.2f}x "
                  f"{linear / copied:>11.2f}x {c_linear:>19.2f} {c_stationary:>10.2f} {c_linear / c_stationary:>5.2f}x")


if __name__ == "__main__":
    main()
