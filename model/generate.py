"""Batched KV-cache generation: the rollout engine of on-policy distillation, so it stays lean.

One prefill over the left-padded prompts, then one token per step (`decode_step`) against a pre-allocated cache (the
prefix is never recomputed): every row writes the same cache column (prompts are left padded), and its query sees
the prompt's real tokens and the tokens generated so far under a key mask. The eager step (the default) attends over
the cache's filled positions only (rounded up to KEY_BLOCK: the same logits, bit for bit, as over the whole cache);
the compiled one (`Decoder(compiled=True)`: on CUDA as CUDA graphs) over the whole cache, so that no shape changes
from step to step and one compiled graph per width serves every step. Rows stop independently at EOS and emit pad
afterwards; once as many rows have stopped as still decode, the batch narrows to a power of two (the rows still
decoding, filled up with stopped ones), and the loop ends when all rows stopped.

Sampling is one batched inverse-CDF draw per step: each row's uniforms for the whole rollout come from its own
generator up front (one call per row per rollout, not per token), so a row's token depends only on its seed, its
step and its logits -- not on its batch-mates, and a resumed run draws exactly what the killed one would have.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from model.lora import LoRALinear
from model.precision import cache_dtype
from model.qwen3 import KVCache, Qwen3ForCausalLM, positions_from_mask

# vocabulary block of the two-level inverse CDF (see inverse_cdf_sample): ~150 blocks for Qwen3's 151,936 tokens,
# so both levels' scans are short
CDF_BLOCK = 1024
# the eager cache's length, and the leading positions an eager step attends over (those filled, rounded up), are
# multiples of this: the CPU attention kernel sums over the keys in SIMD vectors (16 fp32 lanes with AVX-512, 8 with
# AVX2) and the rest one by one, so a step sums exactly what it would over the whole cache (a masked key adds an exact
# zero), and a row's logits do not depend on the rollout's length. Cut at the filled length, or over a cache of any
# length, they differ by rounding, and a seeded draw near a token boundary can change.
KEY_BLOCK = 16


@dataclass
class GenerateOutput:
    sequences: torch.Tensor        # (B, P + R): prompts (left padded) followed by the completions
    completion_ids: torch.Tensor   # (B, R), pad after a row's EOS
    completion_mask: torch.Tensor  # (B, R), 1 up to and including the first EOS
    replaced: torch.Tensor | None = None  # (B, R) bool, with a Speculative teacher: the completion tokens it chose


@dataclass
class Speculative:
    """Speculative KD's teacher beside the student in the decode loop (SKD, arXiv 2410.11325): at every position
    the student proposes its sampled token; a proposal outside the teacher's `topk` most likely tokens there is
    replaced by the teacher's own sample (from the row's second stream of uniforms, drawn after the student's, so
    the student's draws are those of plain sampling). The teacher prefills the prompt and decodes each chosen token
    into its own cache (`cache`, set by `generate`), in step with the student."""
    teacher: Qwen3ForCausalLM
    topk: int
    cache: KVCache | None = None


def draw_uniforms(generator: torch.Generator | Sequence[torch.Generator] | None, batch_size: int, steps: int,
                  device: torch.device) -> torch.Tensor:
    """(B, steps) float64 uniforms in [0, 1), column t drives step t's draw. With one generator per row, row r's
    come from generator r alone: its samples do not depend on which rows share its batch, nor on the batch size."""
    if isinstance(generator, Sequence):
        return torch.stack([torch.rand(steps, generator=g, dtype=torch.float64, device=g.device)
                            for g in generator]).to(device)
    gen_device = generator.device if generator is not None else device
    return torch.rand(batch_size, steps, generator=generator, dtype=torch.float64, device=gen_device).to(device)


def sample_next_token(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float,
                      uniforms: torch.Tensor | None) -> torch.Tensor:
    """logits (B, V) -> token ids (B,). Greedy, or temperature -> top-k -> top-p (nucleus) sampling, each row's
    token the inverse CDF of its uniform (B,) under the resulting softmax."""
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        kth_largest = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return inverse_cdf_sample(logits.softmax(dim=-1), uniforms)


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor, block: int = CDF_BLOCK) -> torch.Tensor:
    """probs (B, V) (rows sum to 1, zeros allowed), uniforms (B,) in [0, 1) -> the token whose CDF interval holds
    each row's uniform: token i with probability probs[i], and never a zero-probability token.

    Two levels, because one float64 cumsum over the whole vocabulary costs ~7x the fused softmax on a CPU and a
    float32 one is not exact (a partial sum near 1 rounds to ~6e-8, as large as a near-uniform row's tokens over
    151,936). First the block: an fp64 CDF of the blocks' masses; then the token: the row's residual uniform on an
    fp64 CDF of that block alone. A block mass is an fp32 sum of its tokens (relative error ~1e-7), so every token's
    probability is exact to fp32 rounding, as the softmax itself is."""
    B, V = probs.shape
    full = V // block * block
    masses = probs[:, :full].reshape(B, -1, block).sum(dim=-1)
    if full < V:  # a ragged last block
        masses = torch.cat([masses, probs[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    chosen, residual = inverse_cdf(masses.double(), uniforms)
    index = chosen[:, None] * block + torch.arange(block, device=probs.device)
    in_block = probs.gather(1, index.clamp(max=V - 1)).masked_fill(index >= V, 0.0)
    offset, _ = inverse_cdf(in_block.double(), residual)
    return chosen * block + offset


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weights (B, N) >= 0 in float64, with a positive sum per row; uniforms (B,) in [0, 1) -> the index i whose
    interval [cdf[i-1], cdf[i]) holds uniform * total, and where in it it fell, as a fresh uniform in [0, 1)."""
    cdf = weights.cumsum(dim=-1)
    total = cdf[:, -1:]
    # strictly below the total: uniform * total can round up to it, and then no index would be found
    target = torch.minimum(uniforms[:, None] * total, total.nextafter(torch.zeros_like(total)))
    index = torch.searchsorted(cdf, target, right=True)  # the first i with cdf[i] > target: weights[i] > 0
    below = torch.where(index > 0, cdf.gather(1, (index - 1).clamp(min=0)), 0.0)  # cdf[i-1]
    residual = ((target - below) / weights.gather(1, index)).clamp(0.0, 1.0 - 2.0 ** -53)
    return index.squeeze(1), residual.squeeze(1)


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked (a compiled decode step takes these as constants)."""
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    vocab_size: int | None  # the tokenizer's: the embedding's padding rows beyond it are never picked


def pick_token(logits: torch.Tensor, sampling: Sampling, uniforms: torch.Tensor | None) -> torch.Tensor:
    """(B, V) logits -> (B,) tokens (the logits' padding rows are overwritten)."""
    if sampling.vocab_size is not None:
        logits[:, sampling.vocab_size:] = float("-inf")
    return sample_next_token(logits, sampling.do_sample, sampling.temperature, sampling.top_k, sampling.top_p,
                             uniforms)


# the host reads how many rows stopped once every this many tokens, not at every token: a read waits for the
# device to finish all it was given (on CUDA the launch queue drains and the GPU idles while the host catches up),
# so between reads the host queues steps ahead. A row leaves the decoding batch, and a rollout whose rows all
# stopped ends, at most STOP_CHECK - 1 steps later than a per-token read would see it; a 64-token rollout reads
# the device 7 times for this and once for the completions' width.
STOP_CHECK = 8


DECODE_CHOICES = ["auto", "eager", "compiled"]  # the scripts' --decode


def speculative_pick(student_logits: torch.Tensor, teacher_logits: torch.Tensor, sampling: Sampling,
                     uniforms: torch.Tensor, teacher_uniforms: torch.Tensor,
                     topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) logits of both -> (B,) tokens and (B,) whether the teacher's sample replaced the student's proposal:
    the student's token where it is among the teacher's `topk` most likely (over the tokenizer's vocabulary), else
    the teacher's, both drawn as `pick_token` draws (the logits' padding rows are overwritten)."""
    proposal = pick_token(student_logits, sampling, uniforms)
    teacher_token = pick_token(teacher_logits, sampling, teacher_uniforms)  # its padding rows now -inf
    top = torch.topk(teacher_logits, min(topk, teacher_logits.shape[-1]), dim=-1).indices
    accepted = (top == proposal[:, None]).any(dim=1)
    return torch.where(accepted, proposal, teacher_token), ~accepted


def default_decode(device_type: str) -> str:
    """--decode auto: "compiled" on CUDA (the first GPU run, Qwen3-0.6B's shape, 32 x 256 greedy: 12.7x the eager
    step's tokens/s, its compile paid once, 44 s), "eager" on a CPU (inductor's step is 1.1-2.5x faster there, but
    its compile, 9-16 s per batch width, is repaid only after dozens of rollouts: docs/generation.md)."""
    return "compiled" if device_type == "cuda" else "eager"


@dataclass
class DecodeState:
    """What one decode step reads and updates in place, so that a compiled step finds every tensor at the address
    it captured: the decoding batch's rows (`rows`: which output rows they are), each row's latest token (not yet
    recorded), its position, its key mask over the cache, whether it emitted EOS, and the step index (`step`, one
    element: the completion column of `token`), the cache column it writes; the whole rollout's completions and
    per-row uniforms."""
    rows: torch.Tensor             # (B,) long
    token: torch.Tensor            # (B,) long
    position: torch.Tensor         # (B, 1) long
    key_mask: torch.Tensor         # (B, L) bool
    finished: torch.Tensor         # (B,) bool
    step: torch.Tensor             # (1,) long
    column: torch.Tensor           # (1,) long: the cache column this step writes (the cache's `column`)
    completion_ids: torch.Tensor   # (B_all, R) long, pad where nothing is recorded
    uniforms: torch.Tensor | None  # (B_all, R) float64, sampling only
    eos_ids: torch.Tensor          # (E,) long
    pad_token_id: int
    teacher_uniforms: torch.Tensor | None = None  # (B_all, R) float64: a Speculative teacher's draws
    replaced: torch.Tensor | None = None          # (B_all, R) bool: the tokens a Speculative teacher chose

    def tensors(self) -> list[torch.Tensor]:
        """The tensors a step writes in place."""
        return [self.token, self.position, self.key_mask, self.finished, self.step, self.column, self.completion_ids,
                *([] if self.replaced is None else [self.replaced])]

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the decoding batch's rows `index`, moved to the leading rows of the same storage (as
        KVCache.select_rows: a CUDA graph replays at the addresses it captured)."""
        n = len(index)
        for name in ("rows", "token", "position", "key_mask", "finished"):
            buffer = getattr(self, name)
            buffer[:n] = buffer[index]  # indexing gathers a copy first: overlapping rows are safe
            setattr(self, name, buffer[:n])


def record(state: DecodeState) -> None:
    """The latest token of each decoding row into its completion (pad once the row has stopped), and EOS noted."""
    state.completion_ids[state.rows, state.step] = state.token.masked_fill(state.finished, state.pad_token_id)
    state.finished |= torch.isin(state.token, state.eos_ids)


def decode_step(model: Qwen3ForCausalLM, state: DecodeState, cache: KVCache, sampling: Sampling,
                speculative: Speculative | None = None) -> None:
    """One token for every row of the decoding batch, all in place: the latest token recorded; the model on it,
    its keys and values written to the cache's column, its query seeing the positions the key mask allows; the
    next token picked (seeded: the row's uniform of the next step; with a `speculative` teacher, which decodes the
    same token into its own cache, `speculative_pick`). No shape changes from one step to the next unless the
    cache's length does, and nothing is read back to the host."""
    record(state)
    state.key_mask.index_fill_(1, cache.column, True)
    hidden = model(state.token[:, None], attention_mask=state.key_mask, position_ids=state.position, kv_cache=cache,
                   return_hidden=True).hidden_states
    uniforms = None if state.uniforms is None else state.uniforms[state.rows, state.step + 1]
    logits = next_token_logits(model, hidden[:, -1], greedy=not sampling.do_sample)
    if speculative is None:
        state.token.copy_(pick_token(logits, sampling, uniforms))
    else:
        teacher = speculative.teacher
        teacher_hidden = teacher(state.token[:, None], attention_mask=state.key_mask, position_ids=state.position,
                                 kv_cache=speculative.cache, return_hidden=True).hidden_states
        token, replaced = speculative_pick(logits, next_token_logits(teacher, teacher_hidden[:, -1]), sampling,
                                           uniforms, state.teacher_uniforms[state.rows, state.step + 1],
                                           speculative.topk)
        state.token.copy_(token)
        state.replaced[state.rows, state.step + 1] = replaced
    state.position += 1
    state.step += 1
    state.column += 1  # the cache's column


class Decoder:
    """The decode step of `generate`, eager or compiled.

    Eager (the default), every rollout gets a cache of its own, as long as it needs rounded up to KEY_BLOCK, and a
    step attends over its positions filled so far (rounded up likewise), not over those still empty: as fast as
    attending over the whole cache for short rollouts (0.98-1.03x at 64 new tokens) and faster as the rollout, and
    with it attention's share of the step, grows (512 tokens: 1.00-1.02x on the OPD demo teacher, 1.28-1.33x with
    Qwen3-0.6B's attention heads; `benchmarks/bench_model.py --only cache`, 1 and 2 threads, 2-core AMD EPYC), so it
    is the eager form at every length.

    Compiled (`--decode compiled`, the default on CUDA), the step -- the token's bookkeeping included -- runs under
    torch.compile with mode "reduce-overhead": on CUDA each shape of the step is captured once as a CUDA graph and
    replayed as one launch per token (the eager step launches every kernel of every layer from Python); on a CPU it
    runs as inductor's fused C++ kernels. A CUDA graph replays at the addresses it captured, so the Decoder holds
    one cache storage and one DecodeState storage from rollout to rollout (grown when a rollout needs more rows,
    positions or tokens) and each rollout uses their leading rows and positions, its length rounded up to a
    multiple of CACHE_BLOCK, and every step attends over all of them under the key mask: few shapes, so few graphs,
    at the price of attending to the positions not yet filled. The storage stays allocated between rollouts: layers
    x rows x KV heads x length x head_dim x 2 (keys and values) x the autocast dtype's bytes.

    Compiled under autocast, the steps run a twin of the model whose linear layers' weights are held in the autocast
    dtype, refreshed in place once per rollout (`step_model`): eager autocast casts each fp32 weight once per rollout
    (its cast cache lives as long as the autocast context), but a compiled graph cannot keep that cache and would
    cast every weight at every token (3x the weight traffic of reading bf16 weights, and on CUDA the casts held in
    the graphs' memory pool). The twin computes what autocast computes (the same casts, made ahead), and shares the
    embedding and the norms, which autocast leaves in fp32. It stays allocated between rollouts too: 2 bytes per
    parameter of the linear layers (the head's own copy included when it is tied to the embedding).

    A Speculative teacher decodes inside the same compiled step: its cache a second held storage ("teacher"), its
    twin a second twin, both kept between rollouts as the model's are."""

    CACHE_BLOCK = 128

    def __init__(self, compiled: bool = False):
        self.compiled = compiled
        self.compiled_step = torch.compile(decode_step, fullgraph=True, mode="reduce-overhead") if compiled else None
        self.storage: dict[str, KVCache] = {}  # the compiled step's cache storage per model: "model", "teacher"
        self.held: DecodeState | None = None  # the compiled step's state storage
        self.twins: dict[str, tuple[Qwen3ForCausalLM, weakref.ref]] = {}  # per model: (twin, the model it copies)

    def cache(self, config, batch_size: int, length: int, dtype: torch.dtype, device: torch.device,
              role: str = "model") -> KVCache:
        """An empty cache of `batch_size` rows and at least `length` positions for the model `role` names ("model";
        "teacher": a Speculative teacher's, held beside the model's when compiled)."""
        if not self.compiled:
            return KVCache(config, batch_size, -(-length // KEY_BLOCK) * KEY_BLOCK, dtype, device)
        length = -(-length // self.CACHE_BLOCK) * self.CACHE_BLOCK
        held = self.storage.get(role)
        if held is None or len(held.keys[0]) < batch_size or held.max_length < length \
                or held.keys[0].dtype != dtype or held.keys[0].device != device:
            rows = max(batch_size, len(held.keys[0]) if held is not None else 0)
            longest = max(length, held.max_length if held is not None else 0)
            self.storage.pop(role, None)  # the old storage goes before the new one is allocated
            self.storage[role] = KVCache(config, rows, longest, dtype, device)
        return self.storage[role].view(batch_size, length)

    def state(self, batch_size: int, length: int, new_tokens: int, sampled: bool, device: torch.device,
              speculative: bool = False) -> DecodeState:
        """A DecodeState of `batch_size` rows, a key mask over `length` cache positions and `new_tokens` completion
        columns (with a `speculative` teacher's uniforms and replaced tokens): fresh when eager; compiled, views of
        the held storage (at its addresses; grown when too small), its completions filled with pad by `generate`."""
        if not self.compiled:
            return empty_state(batch_size, length, new_tokens, sampled, device, speculative)
        held = self.held
        if held is None or len(held.rows) < batch_size or held.key_mask.shape[1] < length \
                or held.completion_ids.shape[1] < new_tokens or held.rows.device != device \
                or (sampled and held.uniforms is None) or (speculative and held.replaced is None):
            rows = max(batch_size, len(held.rows) if held is not None else 0)
            longest = max(length, held.key_mask.shape[1] if held is not None else 0)
            tokens = max(new_tokens, held.completion_ids.shape[1] if held is not None else 0)
            speculative = speculative or (held is not None and held.replaced is not None)
            self.held = None
            self.held = empty_state(rows, longest, tokens, True, device, speculative)
        held = self.held
        return DecodeState(held.rows[:batch_size], held.token[:batch_size], held.position[:batch_size],
                           held.key_mask[:batch_size, :length], held.finished[:batch_size], held.step,
                           held.column, held.completion_ids, held.uniforms if sampled else None, held.eos_ids, 0,
                           held.teacher_uniforms if speculative else None, held.replaced if speculative else None)

    def step_model(self, model: Qwen3ForCausalLM, role: str = "model") -> Qwen3ForCausalLM:
        """The model one rollout's decode steps run for `role` (as in `cache`): `model` itself, or compiled under
        an autocast whose dtype its linear weights do not have, the low-precision twin (see the class docstring),
        its weights copied from `model` now."""
        device_type = model.lm_head.weight.device.type
        if not (self.compiled and torch.is_autocast_enabled(device_type)):
            return model
        dtype = torch.get_autocast_dtype(device_type)
        if model.lm_head.weight.dtype == dtype:
            return model
        twin, twin_of = self.twins.get(role, (None, None))
        if twin is None or twin_of() is not model or twin.lm_head.weight.dtype != dtype:
            twin = None
            self.twins.pop(role, None)  # the old twin goes before the new one is allocated
            self.twins[role] = low_precision_twin(model, dtype), weakref.ref(model)
        else:  # in place: a CUDA graph replays at the addresses it captured
            for twin_linear, linear in linear_pairs(twin, model):
                twin_linear.weight.copy_(linear.weight)
        return self.twins[role][0]

    def __call__(self, model: Qwen3ForCausalLM, state: DecodeState, cache: KVCache, filled: int,
                 sampling: Sampling, speculative: Speculative | None = None) -> None:
        """One decode step (`decode_step`), in place. `filled`: the cache positions written once this step's are.
        A `speculative` teacher decodes the same token into its own cache in the same step (compiled: in the same
        graph, its cache a second held storage)."""
        if not self.compiled:
            visible = -(-filled // KEY_BLOCK) * KEY_BLOCK
            if visible < cache.max_length:  # the key mask's view is written in place: the whole mask follows
                cache, state = cache.prefix(visible), replace(state, key_mask=state.key_mask[:, :visible])
                if speculative is not None:
                    speculative = replace(speculative, cache=speculative.cache.prefix(visible))
            return decode_step(model, state, cache, sampling, speculative)
        # the step writes the caches and the state in place: marked as inputs of fixed address, which a CUDA graph
        # may write (it is skipped for a graph that mutates an ordinary input)
        teacher_cache = [] if speculative is None else speculative.cache.keys + speculative.cache.values
        for buffer in cache.keys + cache.values + teacher_cache + state.tensors():
            torch._dynamo.mark_static_address(buffer)
        torch.compiler.cudagraph_mark_step_begin()
        self.compiled_step(model, state, cache, sampling, speculative)


def empty_state(batch_size: int, length: int, new_tokens: int, sampled: bool, device: torch.device,
                speculative: bool = False) -> DecodeState:
    long = dict(dtype=torch.long, device=device)
    uniforms = lambda: torch.zeros(batch_size, new_tokens, dtype=torch.float64, device=device)  # noqa: E731
    return DecodeState(torch.arange(batch_size, device=device), torch.zeros(batch_size, **long),
                       torch.zeros(batch_size, 1, **long), torch.zeros(batch_size, length, dtype=torch.bool,
                                                                        device=device),
                       torch.zeros(batch_size, dtype=torch.bool, device=device), torch.zeros(1, **long),
                       torch.zeros(1, **long), torch.zeros(batch_size, new_tokens, **long),
                       uniforms() if sampled else None, torch.zeros(0, **long), 0,
                       uniforms() if speculative else None,
                       torch.zeros(batch_size, new_tokens, dtype=torch.bool, device=device) if speculative else None)


def low_precision_twin(model: Qwen3ForCausalLM, dtype: torch.dtype) -> Qwen3ForCausalLM:
    """A frozen Qwen3ForCausalLM whose linear layers hold copies of `model`'s weights in `dtype` and whose
    embedding, norms, RoPE buffers and LoRA adapters are `model`'s own tensors (nothing else is allocated): a LoRA
    layer's twin is a LoRA layer on the copy of its base weight, so the twin computes what autocast computes."""
    with torch.device("meta"):
        twin = Qwen3ForCausalLM(model.config)
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            twin.set_submodule(name, module.sharing_adapters(twin.get_submodule(name)))
    twin_modules = dict(twin.named_modules())  # paired by name: a LoRA layer's children shift positions
    for name, module in model.named_modules():
        twin_module = twin_modules[name]
        if isinstance(module, torch.nn.Linear):  # the head too: tied or not, its own copy in `dtype`
            twin_module.weight = torch.nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
        elif hasattr(module, "weight"):  # embedding and RMSNorms: shared, in their stored dtype
            twin_module.weight = module.weight
    twin.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq
    twin.model.rotary_emb.table = model.model.rotary_emb.table
    return twin.eval()


def linear_pairs(twin: Qwen3ForCausalLM, model: Qwen3ForCausalLM) -> list[tuple[torch.nn.Linear, torch.nn.Linear]]:
    """(the twin's linear layer, `model`'s of the same name), for every linear layer of `model`."""
    twin_modules = dict(twin.named_modules())
    return [(twin_modules[name], module) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear)]


@torch.no_grad()
def generate(model: Qwen3ForCausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
             max_new_tokens: int, do_sample: bool = True, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             generator: torch.Generator | Sequence[torch.Generator] | None = None,
             vocab_size: int | None = None, decoder: Decoder | None = None,
             all_stopped: Callable[[bool], bool] | None = None,
             speculative: Speculative | None = None) -> GenerateOutput:
    """Generate up to `max_new_tokens` per row. `generator`: one for the batch, or one per row (then a row's
    sample depends on its own seed alone). `vocab_size` (the tokenizer's) keeps the embedding's padding rows
    (Qwen3 pads 151,669 real tokens to 151,936) from ever being sampled. `decoder`: a compiled Decoder to reuse
    across calls (default: the eager step). `all_stopped`: for processes that must run every forward together (a
    sharded model all-gathers each layer's weights in it), whether this process's rows have all stopped -> whether
    every process's have (asked every STOP_CHECK steps, at the same steps on every process); until then a process
    whose rows stopped decodes on, one stopped row wide, its tokens never recorded. `speculative`: speculative KD's
    teacher (sampling; in the compiled step its cache and twin held by `decoder` beside the model's), the tokens
    it chose in the output's `replaced`."""
    model = getattr(model, "module", model)
    decoder = decoder or Decoder()
    B, P = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    eos_list = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    pad_token_id = pad_token_id if pad_token_id is not None else (eos_list[0] if eos_list else 0)
    sampling = Sampling(do_sample, temperature, top_k, top_p, vocab_size)

    if speculative is not None and not do_sample:
        raise ValueError("speculative KD samples: do_sample=True")
    cache = decoder.cache(model.config, B, P + max_new_tokens, cache_dtype(model, device), device)
    state = decoder.state(B, cache.max_length, max_new_tokens, do_sample, device, speculative is not None)
    # the EOS ids padded with -1 (no token) to a multiple of 8: one shape, so one compiled graph, for the usual lists
    eos_ids = torch.tensor(eos_list + [-1] * (max(8, -(-len(eos_list) // 8) * 8) - len(eos_list)), device=device)
    state = replace(state, eos_ids=eos_ids, pad_token_id=pad_token_id)
    state.completion_ids.fill_(pad_token_id)
    if do_sample:
        state.uniforms[:B, :max_new_tokens] = draw_uniforms(generator, B, max_new_tokens, device)
    hidden = model(input_ids, attention_mask=attention_mask, kv_cache=cache, return_hidden=True).hidden_states
    logits = next_token_logits(model, hidden[:, -1], greedy=not do_sample)
    if speculative is None:
        state.token.copy_(pick_token(logits, sampling, None if state.uniforms is None else state.uniforms[:B, 0]))
    else:
        # the teacher's uniforms after the student's: each row's own draws are those of plain sampling
        state.teacher_uniforms[:B, :max_new_tokens] = draw_uniforms(generator, B, max_new_tokens, device)
        state.replaced.zero_()
        teacher = speculative.teacher
        speculative = replace(speculative, cache=decoder.cache(teacher.config, B, cache.max_length,
                                                               cache_dtype(teacher, device), device, "teacher"))
        teacher_hidden = teacher(input_ids, attention_mask=attention_mask, kv_cache=speculative.cache,
                                 return_hidden=True).hidden_states
        token, replaced = speculative_pick(logits, next_token_logits(teacher, teacher_hidden[:, -1]), sampling,
                                           state.uniforms[:B, 0], state.teacher_uniforms[:B, 0], speculative.topk)
        state.token.copy_(token)
        state.replaced[:B, 0] = replaced
        speculative.cache.column = state.column
        speculative = replace(speculative, teacher=decoder.step_model(teacher, "teacher"))
        speculative.teacher.model.rotary_emb.reserve(cache.max_length)
    # from here the cache is written one position per step (prompts are left padded: the same position for every
    # row), and a row's query sees its prompt's real tokens and every token generated so far
    state.column.fill_(P)
    cache.column = state.column
    step_model = decoder.step_model(model)
    step_model.model.rotary_emb.reserve(cache.max_length)  # so that no step grows the table (a compiled one can't)
    state.rows.copy_(torch.arange(B, device=device))
    state.key_mask.zero_()
    state.key_mask[:, :P] = attention_mask.bool()
    state.position.copy_(positions_from_mask(attention_mask)[:, -1:] + 1)
    state.finished.zero_()
    state.step.zero_()

    for step in range(max_new_tokens - 1):  # each step records token `step` and picks token `step + 1`
        if step and step % STOP_CHECK == 0:
            done = int(state.finished.sum())  # the host waits for the device here, and only here
            if (all_stopped or bool)(done == len(state.rows)):
                break
            if 2 * done >= len(state.rows):  # stopped rows leave once they are half the batch: the width halves
                # a power of two (the rows still decoding first, stopped ones filling up): few widths, so few
                # compiled graphs; a stopped row that stays decodes on, its tokens never recorded
                keep = state.finished.long().argsort(stable=True)[:1 << max(len(state.rows) - done - 1, 0).bit_length()]
                state.keep(keep)
                cache.select_rows(keep)
                if speculative is not None:
                    speculative.cache.select_rows(keep)
        decoder(step_model, state, cache, P + step + 1, sampling, speculative)
    record(state)

    completion_ids = state.completion_ids[:B, :max_new_tokens].clone()
    completion_mask = completion_mask_through_eos(completion_ids, state.eos_ids)
    # the completions' width: up to the step where this process's rows had all stopped
    steps = int(completion_mask.sum(dim=1).max()) if B else max_new_tokens
    completion_ids, completion_mask = completion_ids[:, :steps], completion_mask[:, :steps]
    replaced = None if speculative is None else state.replaced[:B, :steps] & completion_mask.bool()
    return GenerateOutput(sequences=torch.cat([input_ids, completion_ids], dim=1), completion_ids=completion_ids,
                          completion_mask=completion_mask, replaced=replaced)


def next_token_logits(model: Qwen3ForCausalLM, hidden: torch.Tensor, greedy: bool = False) -> torch.Tensor:
    """(B, H) final hidden states -> (B, V) logits, the lm_head that dominates a decoding step; `greedy`: only
    their argmax is read.

    On a CPU with <= 8 rows, computed as (W @ h.T).T -- the same products, which CPU BLAS runs faster weight-stationary
    than as F.linear's h @ W.T -- for greedy at every width and for sampling at hidden >= 512. The result is a
    transposed view: greedy's argmax reads it as it is, sampling needs it contiguous. Greedy, the form is 1.05-1.1x
    as fast at hidden 64, 1.3x at 128, 1.5-2.3x at 512 (compiled 0.87-1.0x, 1.1-1.2x, 1.5-2.2x); sampled, counting
    the copy, 1.5-2.2x at 512 but 0.7-1.4x at 64 and 128, where F.linear stays (a new form would round the logits
    differently, and a seeded draw within rounding of a token boundary would change); at 16 rows neither use gains
    everywhere (`benchmarks/bench_model.py --only lm_head`, torch 2.13, 2 and 1 threads, 2-core AMD EPYC). On CUDA
    the two forms are the same GEMM."""
    weight = model.lm_head.weight
    if hidden.device.type == "cpu" and hidden.shape[0] <= 8 and (greedy or weight.shape[1] >= 512):
        return (weight @ hidden.T).T
    return F.linear(hidden, weight)


def completion_mask_through_eos(completion_ids: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """1 on every token up to and including the first EOS of its row, 0 after it."""
    is_eos = torch.isin(completion_ids, eos_ids).long()
    eos_before = is_eos.cumsum(dim=1) - is_eos  # number of EOS strictly before each position
    return (eos_before == 0).long()


def generate_ids(model: Qwen3ForCausalLM, contexts: list[list[int]], max_new_tokens: int, pad_token_id: int,
                 **options) -> list[list[int]]:
    """Each context (its token ids, no padding) continued, all in one `generate` batch (left padded, `options` as
    generate's): each row's new tokens through its first EOS, or all `max_new_tokens` of them without one. A
    multi-turn rollout's turn: the conversation so far, prefilled, continued."""
    width = max(len(ids) for ids in contexts)
    device = getattr(model, "module", model).lm_head.weight.device
    input_ids = torch.full((len(contexts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(len(contexts), width, dtype=torch.long)
    for i, ids in enumerate(contexts):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attention_mask[i, width - len(ids):] = 1
    out = generate(model, input_ids.to(device), attention_mask.to(device), max_new_tokens,
                   pad_token_id=pad_token_id, **options)
    lengths = out.completion_mask.sum(dim=1).tolist()
    return [row[:n] for row, n in zip(out.completion_ids.tolist(), lengths)]
