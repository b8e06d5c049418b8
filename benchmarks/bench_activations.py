"""Saved-for-backward bytes per token of one decoder layer under CPU bf16 autocast (fp32 master weights), eager
against compiled (--use_compile 1's torch.compile of the layer): what a training step keeps for its backward.

    python benchmarks/bench_activations.py                   # Qwen3-0.6B's layer, 1 x 512 (and 1 x 1,024) tokens
    python benchmarks/bench_activations.py --tokens 1024     # another length
    python benchmarks/bench_activations.py --backend aot_eager_decomp_partition   # no inductor code generation

The layer: layer 0 of a model of the flags' shape (default Qwen3-0.6B's: hidden 1024, 16 query / 8 KV heads of 128,
MLP 3072), built from model/qwen3.py, its input the fp32 residual stream (B, T, hidden) with grad, the RoPE cos / sin
the model computes for T positions, no attention mask (the training forward's plain causal form), under
torch.autocast("cpu", torch.bfloat16).

What is counted: every tensor autograd packs for the backward during the layer's forward
(torch.autograd.graph.saved_tensors_hooks), each storage once, all of its bytes (untyped_storage(): a view shares
its base's storage and keeps the whole of it alive, so views are not counted twice and a narrow view of a wide
tensor counts the wide one). Not counted: the parameters (the fp32 master weights, held anyway) and cos / sin
(computed once per forward, shared by every layer). Compiled, the layer is one autograd Function (AOT autograd's
CompiledFunction) whose forward saves its activations with ctx.save_for_backward, which the hooks see as they see
an eager op's saves: the script checks it, comparing the storages the hooks saw with the compiled node's own
saved_tensors, and refuses to report a compiled figure where they differ. Each graph is compiled static
(dynamic=False) for its shape, as a run's first step compiles it.

Per token: the forward runs at T and at 2T tokens, and the difference over T tokens is the per-token figure, so
that what does not grow with the tokens drops out -- the bf16 copies of the weights autocast makes, which eager and
compiled both keep for the backward: the table shows them apart ("fixed"). Beside the measurement, the eager
figure by hand (`eager_bytes_per_token`). It is the CPU's: on CUDA an eager RMSNorm is one fused kernel, which need
not keep an fp32 upcast of a bf16 input as the CPU's composite one does, so a GPU's eager figure may be lower.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import harness  # noqa: E402
from common.errors import ArgumentParser, refuse, run_script  # noqa: E402
from model import Qwen3Config  # noqa: E402
from model.qwen3 import DecoderLayer, RotaryEmbedding  # noqa: E402

# inductor: what --use_compile 1 compiles with. aot_eager_decomp_partition: the same decompositions and min-cut
# partition into forward and backward (what decides the saved tensors), without inductor's code generation -- the
# test's stand-in, seconds instead of a minute (at the tiny and the 0.6B shapes they save the same bytes)
BACKENDS = ("inductor", "aot_eager_decomp_partition")
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, None], torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv_heads", type=int, default=8)
    p.add_argument("--head_dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=512, help="T: the forward runs at T and at 2T tokens per row")
    p.add_argument("--backend", default="inductor", choices=BACKENDS, help="torch.compile's backend")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    harness.add_json_arg(p)
    args = p.parse_args(argv)
    if min(args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim, args.batch, args.tokens) < 1:
        refuse("every size must be >= 1")
    if args.heads % args.kv_heads:
        refuse(f"--heads ({args.heads}) must be a multiple of --kv_heads ({args.kv_heads})")
    return args


def layer_config(args: argparse.Namespace) -> Qwen3Config:
    """The tiny demo config with the flags' layer shape: one layer (the vocabulary is never built)."""
    base = Qwen3Config.from_json(os.path.join(ROOT, "model", "configs", "qwen3-tiny.json")).to_hf_dict()
    sizes = {"hidden_size": args.hidden, "intermediate_size": args.intermediate, "num_attention_heads": args.heads,
             "num_key_value_heads": args.kv_heads, "head_dim": args.head_dim, "num_hidden_layers": 1}
    return Qwen3Config.from_dict({**base, **sizes})


def decoder_layer(config: Qwen3Config, seed: int = 0) -> DecoderLayer:
    """Layer 0 of `config`'s model, fp32, its linear weights drawn as Qwen3ForCausalLM.init_weights draws them (the
    norms' weights ones)."""
    layer = DecoderLayer(config, 0)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, config.initializer_range, generator=generator)
    return layer


def eager_bytes_per_token(config: Qwen3Config) -> int:
    """What the eager layer saves per token on the CPU (torch 2.13) under bf16 autocast, by hand, with H hidden, Q
    and K the query and key/value widths (heads x head_dim), h and k their head counts, I the MLP's width:
      each RMSNorm of the fp32 residual (2): its input (4H), the fp32 normalised x its weight multiplies (4H), 1/rms
        (4); each bf16 GEMM input cast (qkv and gate_up): 2H each (o_proj's and down_proj's inputs are bf16 already)
      q / k norms on the bf16 projections: the fp32 upcast (4Q / 4K), the bf16 normalised output the fp32 weight
        multiplies (2Q / 2K), 1/rms per head (4h / 4k); RoPE saves only cos / sin (not counted)
      attention: the bf16 casts of the fp32 q and k after RoPE (2Q, 2K); v, a view into the bf16 qkv output,
        which it keeps whole (2(Q + 2K)); the output (2Q; o_proj's input is a view of it) and the logsumexp (4h)
      MLP: the gate_up output whole (gate and up are views of it: 4I), silu(gate) (2I), silu(gate) * up (2I)
    = 20H + 8 + 12Q + 12K + 8h + 4k + 8I."""
    H, I = config.hidden_size, config.intermediate_size
    h, k = config.num_attention_heads, config.num_key_value_heads
    Q, K = h * config.head_dim, k * config.head_dim
    return 20 * H + 8 + 12 * Q + 12 * K + 8 * h + 4 * k + 8 * I


@dataclass
class Saved:
    """The storages a forward saved for its backward: bytes by dtype, and how many storages."""
    bytes_by_dtype: dict[str, int]
    storages: int

    @property
    def total(self) -> int:
        return sum(self.bytes_by_dtype.values())


def saved_for_backward(forward: Forward, layer: DecoderLayer, rope: RotaryEmbedding, rows: int, tokens: int,
                       hidden: int) -> Saved:
    """One forward of `forward` (the layer, eager or compiled) under bf16 autocast on fp32 residual inputs with
    grad: each storage packed for the backward once, neither the parameters nor cos / sin. Where the forward is a
    compiled function, the storages its autograd node saved must be those the hooks saw."""
    x = torch.randn(rows, tokens, hidden, requires_grad=True, generator=torch.Generator().manual_seed(0))
    rope.reserve(tokens)
    cos, sin = rope(torch.arange(tokens)[None].expand(rows, -1), x.dtype)
    skipped = {tensor.untyped_storage().data_ptr() for tensor in (*layer.parameters(), cos, sin)}
    packed: dict[int, tuple[int, torch.dtype]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        # the backward holds what is packed until it runs: no packed storage is freed, so none reuses an address
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skipped:
            packed.setdefault(storage.data_ptr(), (storage.nbytes(), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast("cpu", torch.bfloat16):
        out = forward(x, cos, sin, None)
    check_compiled_node(out, set(packed), skipped)
    by_dtype: dict[str, int] = {}
    for nbytes, dtype in packed.values():
        name = str(dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + nbytes
    return Saved(by_dtype, len(packed))


def check_compiled_node(out: torch.Tensor, seen: set[int], skipped: set[int]) -> None:
    """A compiled layer's output comes from AOT autograd's node (CompiledFunctionBackward): the storages in its
    saved_tensors, but the skipped ones, must be those the hooks saw (an eager layer's output has no such node)."""
    node = out.grad_fn
    if type(node).__name__ != "CompiledFunctionBackward":
        return
    saved = {t.untyped_storage().data_ptr() for t in node.saved_tensors if isinstance(t, torch.Tensor)} - skipped
    if saved != seen:
        raise RuntimeError(f"the compiled layer saved {len(saved)} storages, the hooks saw {len(seen)}: the hooks do "
                           f"not see what this compiled graph saves, so no compiled figure is reported")


def per_token(forward: Forward, layer: DecoderLayer, rope: RotaryEmbedding, args: argparse.Namespace) -> dict:
    """Saved bytes at T and 2T tokens -> bytes per token (by dtype: the difference over B x T tokens), the fixed
    bytes (what does not grow with the tokens: the bf16 weight copies) and the storages saved at T."""
    at_t, at_2t = (saved_for_backward(forward, layer, rope, args.batch, tokens, args.hidden)
                   for tokens in (args.tokens, 2 * args.tokens))
    added = args.batch * args.tokens
    by_dtype = {dtype: (at_2t.bytes_by_dtype.get(dtype, 0) - at_t.bytes_by_dtype.get(dtype, 0)) / added
                for dtype in sorted(at_2t.bytes_by_dtype.keys() | at_t.bytes_by_dtype.keys())}
    per_token_bytes = sum(by_dtype.values())
    return {"bytes_per_token": per_token_bytes, "by_dtype": by_dtype,
            "fixed_bytes": at_t.total - per_token_bytes * added, "storages": at_t.storages}


def measure(args: argparse.Namespace) -> dict:
    config = layer_config(args)
    layer = decoder_layer(config)
    rope = RotaryEmbedding(config.head_dim, config.rope_theta)
    eager = per_token(layer, layer, rope, args)
    # static graphs, one per length: what a run's first step compiles (compile_layers, --use_compile 1)
    compiled = per_token(torch.compile(layer.block, dynamic=False, backend=args.backend), layer, rope, args)
    return {"shape": {"hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads,
                      "kv_heads": args.kv_heads, "head_dim": args.head_dim},
            "batch": args.batch, "tokens": args.tokens, "backend": args.backend, "torch": torch.__version__,
            "eager": eager, "compiled": compiled, "eager_by_hand": eager_bytes_per_token(config),
            "compiled_over_eager": compiled["bytes_per_token"] / eager["bytes_per_token"]}


def print_results(results: dict) -> None:
    eager, compiled = results["eager"], results["compiled"]
    dtypes = sorted(eager["by_dtype"].keys() | compiled["by_dtype"].keys())
    shape = results["shape"]
    print(f"\none decoder layer (hidden {shape['hidden']}, {shape['heads']} query / {shape['kv_heads']} KV heads of "
          f"{shape['head_dim']}, MLP {shape['intermediate']}), {results['batch']} x {results['tokens']} and "
          f"{results['batch']} x {2 * results['tokens']} tokens, CPU bf16 autocast, fp32 master weights; torch "
          f"{results['torch']}, compiled with {results['backend']}")

    def row(name: str, r: dict) -> list:
        return [name, f"{r['bytes_per_token']:,.0f}",
                *(f"{r['by_dtype'].get(dtype, 0):,.0f}" for dtype in dtypes),
                f"{r['fixed_bytes'] / 2**20:,.2f}", r["storages"]]
    print(harness.table(["layer", "saved bytes / token", *(f"of which {dtype}" for dtype in dtypes),
                         "fixed MiB (weight copies)", "storages saved"],
                        [row("eager", eager), row("compiled", compiled)]))
    print(f"compiled / eager: {results['compiled_over_eager']:.3f}; eager by hand "
          f"(eager_bytes_per_token): {results['eager_by_hand']:,} bytes / token")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    harness.set_threads(args.threads)
    print(harness.machine(), flush=True)
    results = measure(args)
    print_results(results)
    harness.write_json(args.json, results)
    return results


if __name__ == "__main__":
    run_script(main)
