"""Qwen3 for causal LM in plain PyTorch. Parameter names are HF's but for two fused projections per layer --
`self_attn.qkv_proj` (HF's q_proj, k_proj, v_proj as its row blocks) and `mlp.gate_up_proj` (gate_proj, up_proj):
one GEMM each instead of three and two. model/checkpoint_io.py (`fused_blocks`, `hf_layout`) reads and writes them
under HF's names and shapes, so HF folders, vLLM and transformers see HF's layout.

decoder layer:  x = x + attn(input_layernorm(x));  x = x + mlp(post_attention_layernorm(x))
attention:      q/k/v projection, per-head RMSNorm on q and k *before* RoPE, grouped-query attention
                through F.scaled_dot_product_attention; rotate-half RoPE (a table of fp32 cos / sin whatever the
                model's dtype) with positions taken from the mask, so a left-padded row gives the same logits as
                the row alone.

Two attention inputs (docs/architecture.md, "Attention kernels"), each given to SDPA in a form the device's fused
kernels take (`attention_form`):
  * no attention_mask: plain causal attention (`is_causal=True`, no mask tensor), the form CUDA's flash kernel
    takes. Training forwards use it: their rows are right padded (each row's tokens at positions 0..n-1, pads at
    the end), and under a causal mask a real token never attends a pad that comes after it.
  * attention_mask (left-padded prompts of generation, and the KV-cache decode steps): a dense boolean mask.
A third, optional: `documents` (several documents packed into one row, continued pretraining's rows,
dataset/packed_documents.py) -- a dense boolean mask, causal and block diagonal by document (`build_document_mask`),
with positions restarting at 0 at each document's start (`positions_from_documents`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model.config import Qwen3Config


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None = None         # (B, T, V), or (B, K, V) with logits_to_keep=K
    hidden_states: torch.Tensor | None = None  # final-norm hidden states (B, T, H), with return_hidden=True


class KVCache:
    """Pre-allocated key/value storage for all layers, filled two ways:

      * prefix (`column` None): a forward's T new positions follow the `length` filled ones, and its queries see
        the filled prefix -- the prefill, and chat's one token at a time;
      * column (`column` a 1-element long tensor, set by generate's decode step): the step's one new position goes
        to that column, and its query sees the whole buffer under the key mask the forward gets as its
        attention_mask. Every shape stays the same from token to token, so one compiled graph (on CUDA, one CUDA
        graph) serves the whole rollout; the eager step runs on a `prefix` of the buffer (the positions filled,
        rounded up: model/generate.py, KEY_BLOCK).

    Zero-filled: the column form attends to unfilled positions under a mask, and a softmax weight of exactly 0 times
    the NaN a torch.empty buffer may hold is still NaN."""

    def __init__(self, config: Qwen3Config, batch_size: int, max_length: int, dtype: torch.dtype,
                 device: torch.device | str):
        # one tensor per layer: a compiled step's in-place write then touches that layer's buffer alone
        shape = (batch_size, config.num_key_value_heads, max_length, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.length = 0
        self.column: torch.Tensor | None = None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]
        # under autocast k and v need not share a dtype (k leaves RMSNorm as fp32 weight x bf16 activation, which
        # autocast does not lower; v leaves a lowered matmul): both are stored in the cache's
        k, v = k.to(keys.dtype), v.to(values.dtype)
        if self.column is not None:
            keys.index_copy_(2, self.column, k)
            values.index_copy_(2, self.column, v)
            return keys, values
        end = self.length + k.shape[2]
        keys[:, :, self.length:end] = k
        values[:, :, self.length:end] = v
        return keys[:, :, :end], values[:, :, :end]

    @property
    def max_length(self) -> int:
        return self.keys[0].shape[2]

    def view(self, batch_size: int, max_length: int) -> KVCache:
        """An empty cache over this one's first `batch_size` rows and `max_length` positions: the same storage, at
        the same addresses."""
        view = KVCache.__new__(KVCache)
        view.keys = [k[:batch_size, :, :max_length] for k in self.keys]
        view.values = [v[:batch_size, :, :max_length] for v in self.values]
        view.length, view.column = 0, None
        return view

    def prefix(self, length: int) -> KVCache:
        """This cache's first `length` positions, in the same storage, filled as far and at the same column."""
        prefix = self.view(len(self.keys[0]), length)
        prefix.length, prefix.column = self.length, self.column
        return prefix

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows `index` (generation drops the rows that stopped), moved to the leading rows of
        the same storage: the addresses do not change, which a CUDA graph replaying the decode step needs."""
        n = len(index)
        for buffers in (self.keys, self.values):
            for layer, buffer in enumerate(buffers):
                buffer[:n] = buffer[index]  # indexing gathers a copy first: overlapping rows are safe
                buffers[layer] = buffer[:n]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen3RMSNorm: the variance in fp32, the normalised x back in x's dtype, then times the weight (whose
    dtype the result takes when it is wider). F.rms_norm without a weight computes exactly the first part (fp32
    inside, rounded once to x's dtype: bit for bit HF's on the CPU) and is one fused kernel on CUDA; the weight
    goes after it, as HF multiplies (F.rms_norm's own weight would multiply before the rounding)."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE from a table: row p holds [cos(p f), cos(p f)] and [-sin(p f), sin(p f)] for the D/2
    frequencies f, in fp32 (HF computes p * f in fp32 too), so that a forward looks its positions up in one gather
    instead of computing them. Then x * cos + roll(x, D/2) * sin is HF's x * cos + rotate_half(x) * sin bit for bit
    (rotate_half(x) = [-x2, x1] and roll(x, D/2) = [x2, x1]: the sign moves into the table, and (-a) * b = -(a * b)
    exactly). The table grows (doubling) to the positions a forward may use, known before it runs: no read of the
    device."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)
        # a plain attribute, not a buffer: its length is each process's own (DDP broadcasts buffers from rank 0 at
        # every forward, and ranks whose sequences differ in length would hand it tables of different shapes)
        self.table = self.compute_table(0)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) casts floating buffers too: bf16 frequencies are off by 0.59 rad at position 512. The
        # buffers are pure functions of (head_dim, theta), so after any move or cast they are recomputed in fp32 on
        # the device they landed on (meta included).
        super()._apply(fn, recurse)
        self.inv_freq = self.compute_inv_freq(device=self.inv_freq.device)
        self.table = self.compute_table(len(self.table))
        return self

    def compute_inv_freq(self, device=None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        return 1.0 / (self.theta ** exponents)

    def compute_table(self, length: int) -> torch.Tensor:
        """(length, 2 * head_dim) fp32: each position's [cos, cos, -sin, sin]."""
        freqs = torch.arange(length, device=self.inv_freq.device).float()[:, None] * self.inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos, -sin, sin), dim=-1)

    def reserve(self, length: int) -> None:
        """Make the table cover positions 0 .. length - 1 (a Python-side decision: nothing is read off the device)."""
        if length > len(self.table):
            self.table = self.compute_table(max(length, 2 * len(self.table), 64))

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) positions -> cos and signed sin (B, T, D) in `dtype`."""
        rows = F.embedding(position_ids, self.table)
        if rows.dtype != dtype:
            rows = rows.to(dtype)
        return rows.split(self.head_dim, dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, D), cos and signed sin (B, 1, T, D): HF's rotate-half RoPE (see RotaryEmbedding)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


class Attention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        # q, k and v as one GEMM (rows: q's, then k's, then v's); the HF checkpoints' q_proj / k_proj / v_proj are
        # its row blocks (model/checkpoint_io.py: fused_blocks)
        self.qkv_split = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.qkv_proj = nn.Linear(hidden, sum(self.qkv_split), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, attn_mask, kv_cache: KVCache | None = None, packing: "Packing | None" = None):
        if packing is not None:
            return self.packed_forward(x, cos, sin, packing)
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
        q = self.q_norm(q.view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        out = attention(q, k, v, attn_mask, self.num_heads // self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def packed_forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       packing: "Packing") -> torch.Tensor:
        """x (N, hidden): the real tokens only. Every projection, norm and RoPE runs on them; only the attention
        itself runs on the rows' padded layout (Packing.pad), where the causal form -- the fused kernel's, with no
        mask -- keeps every real token to its own row and away from the pads after it."""
        N = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = apply_rope(self.q_norm(q.view(N, self.num_heads, self.head_dim)), cos, sin)
        k = apply_rope(self.k_norm(k.view(N, self.num_kv_heads, self.head_dim)), cos, sin)
        q, k, v = (packing.pad(t.reshape(N, -1, self.head_dim)) for t in (q, k, v))
        out = attention(q, k, v, None, self.num_heads // self.num_kv_heads)  # (B, heads, T, D)
        return self.o_proj(packing.unpad(out.transpose(1, 2)).reshape(N, -1))


def attention_form(device_type: str, dtype: torch.dtype, masked: bool, query_len: int, groups: int) -> str:
    """How an attention call is given to SDPA so that a fused kernel of the device takes it (docs/architecture.md,
    "Attention kernels"; tests/test_attention_form.py checks every loop's calls against the kernels' rules):

      "gqa"     grouped heads as they are (enable_gqa): the CPU's fused kernel takes every form (masks, grouped
                heads, fp32/bf16/fp16); on CUDA FlashAttention takes the unmasked causal form in fp16/bf16;
      "fold"    CUDA, a masked single-query step (decode): each KV head's G query heads become G queries of
                that head, all under the row's key mask -- the memory-efficient kernel (masks, every dtype) takes
                it without a copy of the cache, and attends exactly what grouped heads attend;
      "expand"  CUDA otherwise (a masked prefill, or fp32 where flash refuses): keys and values repeated per query
                head, for the memory-efficient kernel, which takes masks and fp32 but not grouped heads (torch 2.11;
                a newer one may, a copy per call is the price of being sure).
    `dtype`: the one the kernel computes in (autocast's where it is on)."""
    if groups == 1 or device_type != "cuda" or (not masked and dtype in (torch.float16, torch.bfloat16)):
        return "gqa"
    return "fold" if masked and query_len == 1 else "expand"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              groups: int) -> torch.Tensor:
    """SDPA of q (B, H, T, D) over k, v (B, H / groups, S, D) under `mask` (boolean, broadcast to (B, 1, T, S);
    None: causal, T == S), in the form `attention_form` picks for the device: (B, H, T, D)."""
    device_type = q.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else q.dtype
    form = attention_form(device_type, dtype, mask is not None, q.shape[2], groups)
    if form == "fold":
        B, H, _, D = q.shape
        out = F.scaled_dot_product_attention(q.reshape(B, H // groups, groups, D), k, v, attn_mask=mask)
        return out.reshape(B, H, 1, D)
    if form == "expand":
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=form == "gqa" and groups > 1)


class MLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        # gate and up as one GEMM (rows: gate's, then up's; HF's gate_proj / up_proj are its halves)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.compiled_block = None  # `block` under torch.compile (Qwen3ForCausalLM.compile_layers)

    def forward(self, x, cos, sin, attn_mask, kv_cache=None, packing=None):
        if kv_cache is None and self.compiled_block is not None:
            return self.compiled_block(x, cos, sin, attn_mask, None, packing)
        return self.block(x, cos, sin, attn_mask, kv_cache, packing)

    def block(self, x, cos, sin, attn_mask, kv_cache=None, packing=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, kv_cache, packing)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)


def build_attention_mask(attention_mask: torch.Tensor | None, query_len: int, past_len: int) -> torch.Tensor | None:
    """Boolean (B, 1, Tq, Tk) mask: causal and not a padded key. None means plain causal (no padding at all).

    A left-padding query row would see no key at all and SDPA would return NaN there (and NaN gradients flow into
    the weights through the backward of the masked softmax), so every position may always see itself.
    """
    if attention_mask is None:
        return None
    key_len = past_len + query_len
    device = attention_mask.device
    q_pos = torch.arange(past_len, key_len, device=device)[:, None]
    k_pos = torch.arange(key_len, device=device)[None, :]
    causal = k_pos <= q_pos
    mask = causal[None, None] & attention_mask[:, None, None, :key_len].bool()
    return mask | (k_pos == q_pos)[None, None]


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of each token among the real tokens of its row (left padding does not shift positions)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def document_starts(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True where a document starts. A document is a run of equal consecutive ids in a row."""
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return starts


def positions_from_documents(documents: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) position of each token among the real tokens of its document: 0 at every document start, and the pads
    that `attention_mask` marks inside a document do not count (positions_from_mask's rule, one document a row)."""
    real = torch.ones_like(documents) if attention_mask is None else attention_mask.long()
    count = real.cumsum(-1)  # real tokens up to and including each column
    column = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    start = torch.where(document_starts(documents), column, 0).cummax(-1).values  # where each token's document starts
    before = (count - real).gather(-1, start)  # real tokens of the row before that start
    return (count - before - 1).clamp(min=0)


def build_document_mask(documents: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean (B, 1, T, T) mask of rows of packed documents: causal, block diagonal by document (a query sees the
    keys of its own document only) and not a padded key; every position sees itself (build_attention_mask's rule)."""
    # documents as runs (document_starts), not by their ids: an id that comes back later in the row is another
    # document, whose positions restarted at 0, and must not see the first one
    segments = document_starts(documents).cumsum(-1)
    T = documents.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    mask = (segments[:, :, None] == segments[:, None, :]) & causal
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, :].bool()
    return (mask | torch.eye(T, dtype=torch.bool, device=documents.device))[:, None]


@dataclass
class Packing:
    """Right-padded rows (B, T) reduced to their N real tokens: `index` (N,) their flat positions in B x T, row by
    row. A packed forward runs embeddings, norms, projections, RoPE and the MLP on the N tokens only -- padding costs
    nothing there -- and the attention on the padded layout, restored around it (`pad`, `unpad`)."""
    index: torch.Tensor
    rows: int
    length: int

    @staticmethod
    def of(attention_mask: torch.Tensor) -> "Packing":
        """From the rows' (B, T) mask, 1 on real tokens, right padded (a data-dependent size: one host sync)."""
        return Packing(attention_mask.reshape(-1).nonzero().squeeze(1), *attention_mask.shape)

    def positions(self) -> torch.Tensor:
        """(N,) each real token's position in its row (right padding: its column)."""
        return self.index % self.length

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(N, heads, D) -> (B, heads, T, D), zeros at the pads."""
        padded = x.new_zeros(self.rows * self.length, *x.shape[1:]).index_copy(0, self.index, x)
        return padded.view(self.rows, self.length, *x.shape[1:]).transpose(1, 2)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (N, ...): the real tokens' rows."""
        return x.reshape(self.rows * self.length, *x.shape[2:]).index_select(0, self.index)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.pack_rows = False  # completion_hidden runs the packed forward (Packing): the loops' --packing
        self.tie_weights()

    HF_HEAD = "lm_head.weight"  # the head's name in an export (model/value.py's critic names its own)
    TRAINED_WHOLE: tuple[str, ...] = ()  # modules trained whole beside LoRA adapters (model/lora.py)

    def hf_config(self) -> dict:
        """config.json of an export (model/checkpoint_io.py's save_pretrained)."""
        return self.config.to_hf_dict()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int | None = None) -> None:
        """Random initialisation as HF does it: normal(0, initializer_range) for linear and embedding weights."""
        self.draw_weights(self.modules(), seed)
        self.tie_weights()

    def draw_weights(self, modules, seed: int | None) -> None:
        """`modules`' weights drawn in their order, each whole on the CPU from one generator, then copied in."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        for module in modules:
            if isinstance(module, (nn.Linear, nn.Embedding)):
                weight = torch.empty(module.weight.shape).normal_(0.0, self.config.initializer_range,
                                                                  generator=generator)
                with torch.no_grad():
                    module.weight.copy_(weight)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, return_hidden: bool = False, logits_to_keep: int = 0,
                kv_cache: KVCache | None = None, packing: Packing | None = None,
                documents: torch.Tensor | None = None) -> CausalLMOutput:
        """`return_hidden=True` skips the lm_head (losses project chunk by chunk); `logits_to_keep=K` projects only
        the last K positions. With a `kv_cache`, `attention_mask` covers past + new tokens; in the cache's column
        form (see KVCache) it is the key mask over the whole cache, and `position_ids` are required. With `packing`
        (right-padded rows, no mask, no cache) the outputs are the N real tokens' rows, (N, ...).

        `documents` (B, T), any integer ids: each row holds several documents, a document being a run of equal
        consecutive ids; each token attends only to its own document (`build_document_mask`, with
        `attention_mask`'s padding if given), and positions, unless given, restart at 0 at each document's start
        (`positions_from_documents`). Mark padding as a document of its own or with `attention_mask`. Neither a
        cache nor `packing` takes it."""
        if documents is not None:
            check_documents(documents, input_ids, kv_cache, packing)
        if packing is not None:
            return self.packed_forward(input_ids, packing, return_hidden)
        # the column form reads no Python int off the cache: one compiled graph for every step of every rollout
        column = kv_cache is not None and kv_cache.column is not None
        past_len = kv_cache.length if kv_cache is not None and not column else 0
        T = input_ids.shape[1]
        if position_ids is None:
            if documents is not None:
                position_ids = positions_from_documents(documents, attention_mask)
            elif attention_mask is not None:
                position_ids = positions_from_mask(attention_mask)[:, past_len:past_len + T]
            else:
                position_ids = torch.arange(past_len, past_len + T, device=input_ids.device)[None]
        x = self.model.embed_tokens(input_ids)
        # positions stay below the cache's length, or the forward's own length (given positions are a row's own)
        self.model.rotary_emb.reserve(kv_cache.max_length if kv_cache is not None else past_len + T)
        cos, sin = self.model.rotary_emb(position_ids, x.dtype)
        if documents is not None:
            attn_mask = build_document_mask(documents, attention_mask)
        elif column:  # generate's decode step: attention_mask (B, L) marks the cache positions its query may see
            attn_mask = attention_mask[:, None, None, :].bool()
        else:
            attn_mask = build_attention_mask(attention_mask, T, past_len)
        if attn_mask is None and past_len > 0:  # is_causal would align the causal band to the wrong corner
            attn_mask = torch.ones(1, 1, T, past_len + T, dtype=torch.bool, device=x.device).tril(past_len)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, attn_mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, attn_mask, kv_cache)
        if kv_cache is not None and not column:
            kv_cache.length += T
        x = self.model.norm(x)
        if return_hidden:
            return CausalLMOutput(hidden_states=x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return CausalLMOutput(logits=self.lm_head(x))

    def packed_forward(self, input_ids: torch.Tensor, packing: Packing, return_hidden: bool) -> CausalLMOutput:
        """The forward of right-padded rows on their real tokens only (Packing): the numbers of the padded forward's
        real positions (to the GEMMs' rounding: other shapes), without the pads' share of the work outside the
        attention."""
        x = self.model.embed_tokens(input_ids.reshape(-1).index_select(0, packing.index))
        self.model.rotary_emb.reserve(packing.length)
        cos, sin = self.model.rotary_emb(packing.positions(), x.dtype)
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, None, None, packing, use_reentrant=False)
            else:
                x = layer(x, cos, sin, None, None, packing)
        x = self.model.norm(x)
        return CausalLMOutput(hidden_states=x) if return_hidden else CausalLMOutput(logits=self.lm_head(x))

    def compile_layers(self, **options) -> None:
        """torch.compile each decoder layer's forward without a KV cache -- training's, the held-out scoring's and
        the teachers' -- in place (torchtitan compiles per block too). The module tree and its parameter names stay
        as they are, and whatever wraps a layer from outside -- FSDP2's per-layer all-gather hooks, DDP's gradient
        hooks, activation checkpointing -- runs between compiled blocks: DDP can reduce a layer's gradients while the
        backward of the layers below still computes, which it cannot when the whole model is one compiled graph whose
        backward hands over every gradient at its end.

        The KV-cache path (generation's prefill and decode steps) stays eager here: it reads the layer's index, an
        integer dynamo specialises, so each layer and cache shape would be a graph of its own, and one rollout would
        reach dynamo's recompile limit (8 graphs per code object), after which every layer -- training's too -- runs
        eager. A compiled decode step (model/generate.py, Decoder) traces the eager path into its own graph."""
        for layer in self.model.layers:
            layer.compiled_block = torch.compile(layer.block, **options)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once


def check_documents(documents: torch.Tensor, input_ids: torch.Tensor, kv_cache: KVCache | None,
                    packing: Packing | None) -> None:
    """Refuse what a forward with `documents` does not take: a cache, `packing`, another shape than input_ids'."""
    if kv_cache is not None or packing is not None:
        raise ValueError("documents: a forward of packed documents takes neither a kv_cache nor packing "
                         "(--packing); pass documents to a forward of whole rows without them")
    if documents.shape != input_ids.shape:
        raise ValueError(f"documents: shape {tuple(documents.shape)}, but input_ids' is {tuple(input_ids.shape)}: "
                         "one document id per token")


COMPILE_CHOICES = ["auto", "0", "1"]  # the scripts' --use_compile


def default_compile(device_type: str) -> int:
    """--use_compile auto: 1 on CUDA, 0 on a CPU. On CUDA the first GPU run measured SFT at 18.8% MFU with eager
    layers, whose norms, RoPE and SiLU-mul ran as kernels of their own, the norms keeping fp32 intermediates for the
    backward; compiled blocks (`compile_layers`) fuse them (what that gains on a GPU is not measured yet:
    docs/gpu.md). On a CPU a short run would pay inductor's compile (131 s cold for the first compiled run on this
    project's 2-core machine) for a speed-up nobody measured, and the eager layers are what the tests check."""
    return 1 if device_type == "cuda" else 0


def unwrap(model: nn.Module) -> nn.Module:
    """The Qwen3ForCausalLM inside a DDP (`.module`) or whole-model torch.compile (`._orig_mod`) wrapper."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def create_model(config: Qwen3Config, seed: int | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> Qwen3ForCausalLM:
    """A randomly initialised model; the same seed gives the same weights on every machine (drawn in fp32 on the
    CPU, copied to `device`, then the parameters cast to `dtype`; RoPE's buffer stays fp32)."""
    with torch.device(device):  # built where it will live: no whole CPU copy on the way to a GPU
        model = Qwen3ForCausalLM(config)
    model.init_weights(seed)
    return model.to(dtype=dtype)
