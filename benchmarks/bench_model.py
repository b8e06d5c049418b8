"""Our Qwen3 vs transformers' Qwen3ForCausalLM on the same weights and inputs: forward+backward, greedy and sampled
generate, and the two forms of the decode step's lm_head.

    python benchmarks/bench_model.py                                   # CPU, fp32, the default sizes below
    python benchmarks/bench_model.py --device cuda --dtype bfloat16    # on a GPU
    python benchmarks/bench_model.py --repeats 3 --new_tokens 32       # a quick look
    python benchmarks/bench_model.py --only sample --threads 2         # sampled generation, the OPD demo student
    python benchmarks/bench_model.py --only lm_head --threads 1        # F.linear vs (W @ h.T).T, at 1 and 2 threads

Model: hidden 512, 6 layers, intermediate 1536, 8 query / 4 KV heads, head_dim 64 (~19M non-embedding parameters)
plus the real 151,936-row tied embedding. Workloads:
  (a) forward + backward of a (4, 256) batch, cross entropy over all positions computed the same way for both;
  (b) greedy generate of 8 left-padded prompts of different lengths x 128 new tokens, EOS disabled so both
      produce all 128 tokens (checked: the two must produce identical tokens);
  (c) sampled generate, temperature 1, no top-k / top-p, on --sample_config's shape (default the OPD demo student,
      model/configs/qwen3-tiny-student.json: hidden 64, 2 layers, the real vocabulary; --sample_model a trained
      one such as checkpoints/kd, else random weights), --sample_batches prompts x 64 new tokens, EOS disabled:
      ours with one seeded generator per row (as OPD's rollout), transformers' generate(do_sample=True) seeded once;
  (d) the lm_head of one decode step, F.linear(h, W) vs (W @ h.T).T (+ the contiguous copy sampling needs), over
      hidden sizes 64 / 128 / 512 and 8 / 16 rows: what model/generate.py's next_token_logits chooses by.
Warm-up, then the median of --repeats timed runs (ours and transformers' alternate). The ratio is transformers / ours (> 1: we are faster).
On a CPU a decode step is memory-bound: the 151,936 x 512 lm_head (311 MB in fp32) is read once per token. Ours reads
it weight-stationary (see model/generate.py: next_token_logits), which also splits across threads where F.linear's
form does not, so the generate ratio grows with --threads (2-core machine: ~1.9x with both cores, ~1.4x with one).
"""
import argparse
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

from model import Qwen3Config, create_model, generate, load_pretrained, save_pretrained  # noqa: E402

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
    p.add_argument("--only", choices=["train", "generate", "sample", "lm_head"], default=None,
                   help="run one workload only")
    return p.parse_args()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn_ours, fn_hf, device, warmup, repeats):
    """Median wall time of each, in ms. The two alternate, so a load change on a shared machine hits both alike."""
    for _ in range(warmup):
        fn_ours(), fn_hf()
    times = {fn_ours: [], fn_hf: []}
    for _ in range(repeats):
        for fn in (fn_ours, fn_hf):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times[fn].append((time.perf_counter() - start) * 1000)
    return statistics.median(times[fn_ours]), statistics.median(times[fn_hf])


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
        t_ours, t_hf = median_ms(lambda: train_step(ours, ids), lambda: train_step(hf, ids), device, args.warmup,
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
        t_ours, t_hf = median_ms(run_ours, run_hf, device, args.warmup, args.repeats)
        rows.append((f"generate {args.num_prompts} prompts x {R} new (greedy)", t_ours, t_hf))

    if args.only in (None, "sample"):
        rows += sampled_rows(args, device, dtype)

    if args.only in (None, "lm_head"):
        lm_head_table(args, device)

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
    for num_prompts in (int(b) for b in args.sample_batches.split(",")):
        ids, mask = left_padded_prompts(num_prompts, torch.Generator().manual_seed(num_prompts), device)

        def run_ours():
            generators = [torch.Generator(device).manual_seed(row) for row in range(num_prompts)]
            return generate(ours, ids, mask, R, do_sample=True, eos_token_id=None, pad_token_id=151643,
                            generator=generators).sequences

        def run_hf():
            torch.manual_seed(0)
            with torch.no_grad():
                return hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=R, min_new_tokens=0,
                                   do_sample=True, temperature=1.0, top_k=0, top_p=1.0)

        assert run_ours().shape == run_hf().shape == (num_prompts, ids.shape[1] + R)
        t_ours, t_hf = median_ms(run_ours, run_hf, device, args.warmup, args.repeats)
        rows.append((f"generate {num_prompts} prompts x {R} new (sampled)", t_ours, t_hf))
    return rows


def lm_head_table(args, device) -> None:
    """Workload (d), paired: the two forms alternate in each repeat."""
    print(f"\nlm_head of a decode step, {args.vocab_size} rows, threads {torch.get_num_threads()} "
          f"(ratio > 1: the weight-stationary form is faster)")
    print(f"{'hidden':>6} {'rows':>5} {'F.linear ms':>12} {'(W@h.T).T ms':>13} {'ratio':>6} {'+contiguous':>12}")
    for hidden in (64, 128, 512):
        weight = torch.randn(args.vocab_size, hidden, device=device) * 0.02
        for rows in (8, 16):
            h = torch.randn(rows, hidden, device=device)
            forms = [lambda: F.linear(h, weight), lambda: (weight @ h.T).T,
                     lambda: (weight @ h.T).T.contiguous()]
            times = [[] for _ in forms]
            for _ in range(args.warmup + max(args.repeats, 9)):
                for i, form in enumerate(forms):
                    sync(device)
                    start = time.perf_counter()
                    form()
                    sync(device)
                    times[i].append(time.perf_counter() - start)
            linear, stationary, copied = (statistics.median(t[args.warmup:]) * 1000 for t in times)
            print(f"{hidden:>6} {rows:>5} {linear:>12.2f} {stationary:>13.2f} {linear / stationary:>5.2f}x "
                  f"{linear / copied:>11.2f}x")


if __name__ == "__main__":
    main()
