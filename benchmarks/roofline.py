"""A roofline for each phase of an OPD step: the least time the machine allows for the work the phase must do.

    bound = max(FLOPs / GEMM rate + exponentials / exp rate, bytes / memory bandwidth)

The rates are measured in the same run (`measure_rates`): the GEMM rate is a large square matmul's in the step's
compute dtype (on a GPU of known kind, its peak dense bf16 rate instead: benchmarks/bench_gpu.py's table, so the
multiple of the bound is 1 / MFU), the exp rate a log_softmax's over rows of the vocabulary (one exponential per
element, its max and write passes counted against it: a lower bound of the exp rate), the bandwidth a large copy's
(bytes read + written). What each phase must do (`opd_work`), from the models' shapes:

  generation       per decode step, the student's layers (2 FLOPs per parameter per row) and head (2 H V per row)
                   and one exponential per logit (the sampling softmax); bytes: the student's weights, read once
                   a step, and the KV cache read so far. The prefill: 2 FLOPs per layer parameter per prompt token.
  teacher forward  2 FLOPs per teacher layer parameter per token; bytes: the teacher's layer weights
  training         the student's forward and backward (6 FLOPs per layer parameter per token), the vocabulary
                   projections at the N loss positions: 2 N H V for the student's forward, twice that for its backward
                   (dL/dh and dL/dW), 2 N H_t V for the teacher's; c N V exponentials (c = 2 for a KL, one per
                   softmax: p is exp(log p); 3 for the generalized JSD's mixture, whose log m is one more); bytes: the
                   student's and teacher's weights and the hidden states at the loss positions
  optimizer        bytes only: clipping reads the gradient, AdamW reads it and reads and writes the weights and its
                   two moments (8 accesses x 4 bytes per student parameter)
Tokens are a step's real (unpadded) ones, attention's own FLOPs are left out (a few percent at these lengths), so a
bound is never above what a perfect implementation would need.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from benchmarks import harness
from benchmarks.fsdp_estimate import parameter_count
from model import Qwen3Config

# peak dense bf16 TFLOP/s of GPUs of known kind (also bench_gpu.py's MFU)
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_bf16_tflops(device_name: str) -> float | None:
    """The GPU's peak dense bf16 TFLOP/s, if its kind (in its name) is known."""
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in device_name), None)


@dataclass(frozen=True)
class Rates:
    gemm: float       # FLOP/s
    exp: float        # exponentials/s
    bandwidth: float  # bytes/s
    source: str       # how the GEMM rate was found

    def best(self, other: "Rates") -> "Rates":
        """Each rate's better measurement: on a shared machine a rate measured while other work ran is too low, and
        a bound from it too high."""
        return Rates(max(self.gemm, other.gemm), max(self.exp, other.exp), max(self.bandwidth, other.bandwidth),
                     self.source)


@dataclass(frozen=True)
class Work:
    flops: float = 0.0
    exps: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.flops + other.flops, self.exps + other.exps, self.bytes + other.bytes)

    def seconds(self, rates: Rates) -> float:
        return max(self.flops / rates.gemm + self.exps / rates.exp, self.bytes / rates.bandwidth)


def _best_seconds(fn, device: str, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        harness.synchronize(device)
        start = time.perf_counter()
        fn()
        harness.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def measure_rates(device: str, dtype: torch.dtype, vocab: int) -> Rates:
    """The machine's GEMM, exp and copy rates now (a few seconds on a CPU)."""
    # a CPU's side is small: without AVX512-BF16 a bf16 GEMM runs at ~1 GFLOP/s on one core (a 4096 product took
    # 142 s on this project's 2-core AMD EPYC, 1.6 s in fp32), and the rate is taken 4 times
    side = 1024 if device == "cpu" else 8192
    a, b = torch.randn(side, side, device=device, dtype=dtype), torch.randn(side, side, device=device, dtype=dtype)
    gemm = 2 * side ** 3 / _best_seconds(lambda: a @ b, device)
    source = f"a {side} x {side} {str(dtype).removeprefix('torch.')} matmul, measured"
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        peak = peak_bf16_tflops(name)
        if peak:
            gemm, source = peak * 1e12, f"the {name}'s peak dense bf16 rate"
    # outputs written in place: a fresh CPU tensor this large is page-faulted in on first touch, which would be
    # counted against the rate
    logits = torch.randn(64, vocab, device=device)
    log_probs = torch.empty_like(logits)
    exp = logits.numel() / _best_seconds(lambda: torch.log_softmax(logits, dim=-1, out=log_probs), device)
    source_tensor = torch.randn(64 * 2 ** 20, device=device)  # 256 MiB of fp32: past any cache
    copy = torch.empty_like(source_tensor)
    bandwidth = 2 * copy.numel() * 4 / _best_seconds(lambda: copy.copy_(source_tensor), device)
    return Rates(gemm, exp, bandwidth, source)


def layer_parameters(config: Qwen3Config) -> int:
    """Parameters of the decoder layers and final norm: all but the embedding and the head."""
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return parameter_count(config) - embeddings


def sequence_flops(config: Qwen3Config, length: int, labelled: int, vocab: int, causal: bool,
                   backward: bool = True) -> float:
    """FLOPs of one sequence of `length` tokens whose `labelled` positions go through the head (its `vocab`
    columns), forward only or forward + backward (3x): 2 per layer parameter per token, 2 H V per labelled
    position, and attention's scores and values, 4 x layers x heads x head_dim per (query, key) pair -- every pair
    (torchtitan's count: 6 N + 12 L H d T per token with the backward) or the causal half plus the diagonal, the
    pairs a causal kernel computes."""
    pairs = length * (length + 1) / 2 if causal else length * length
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * pairs
    forward = 2 * layer_parameters(config) * length + 2 * config.hidden_size * vocab * labelled + attention
    return forward * (3 if backward else 1)


def opd_work(student: Qwen3Config, teacher: Qwen3Config, vocab: int, rows: int, prompt_tokens: int,
             completion_tokens: int, decode_steps: int, exps_per_logit: int, weight_bytes: int = 4,
             teacher_bytes: int = 4) -> dict[str, Work]:
    """What each phase of one OPD step must do (see the module docstring). `prompt_tokens`, `completion_tokens`:
    the step's real tokens over all rows (the loss positions are the completion tokens); `decode_steps` the
    rollout's width; `weight_bytes` the student's bytes per parameter as the rollout reads them."""
    p_s, p_t = layer_parameters(student), layer_parameters(teacher)
    h_s, h_t = student.hidden_size, teacher.hidden_size
    tokens, n = prompt_tokens + completion_tokens, completion_tokens
    kv_per_token = student.num_hidden_layers * 2 * student.num_key_value_heads * student.head_dim * weight_bytes
    step_weights = (p_s + vocab * h_s) * weight_bytes
    context = rows * (prompt_tokens / rows + decode_steps / 2)  # positions the cache holds on average
    generation = Work(2 * p_s * prompt_tokens, 0, step_weights) + Work(
        flops=decode_steps * rows * 2 * (p_s + h_s * vocab), exps=decode_steps * rows * vocab,
        bytes=decode_steps * (step_weights + context * kv_per_token))
    return {
        "generation": generation,
        "teacher forward": Work(2 * p_t * tokens, 0, p_t * teacher_bytes),
        "training": Work(flops=6 * p_s * tokens + 2 * n * vocab * (3 * h_s + h_t), exps=exps_per_logit * n * vocab,
                         bytes=(p_s + vocab * h_s) * 4 + (p_t + vocab * h_t) * teacher_bytes + n * (h_s + h_t) * 4),
        "optimizer": Work(bytes=8 * 4 * parameter_count(student)),
    }


def exps_per_logit(beta: float) -> int:
    """c of the bound: a KL's two softmaxes (beta 0 or 1), the mixture's log m on top for 0 < beta < 1."""
    return 2 if beta in (0.0, 1.0) else 3
