"""Qwen3 for causal LM in plain PyTorch. Parameter names equal HF's, so state dicts map 1:1.

decoder layer:  x = x + attn(input_layernorm(x));  x = x + mlp(post_attention_layernorm(x))
attention:      q/k/v projections, per-head RMSNorm on q and k *before* RoPE, grouped-query attention
                through F.scaled_dot_product_attention; rotate-half RoPE (frequencies in fp32 whatever the
                model's dtype) with positions taken from the mask, so a left-padded row gives the same logits as
                the row alone.

Two attention forms (docs/architecture.md, "Attention kernels"):
  * no attention_mask: plain causal attention (`is_causal=True`, no mask tensor), the form CUDA's flash kernel
    takes. Training forwards use it: their rows are right padded (each row's tokens at positions 0..n-1, pads at
    the end), and under a causal mask a real token never attends a pad that comes after it.
  * attention_mask (left-padded prompts of generation, and the KV-cache decode steps): a dense boolean mask.
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
        # variance in fp32, then back to the input dtype before the weight, exactly as HF's Qwen3RMSNorm
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self.compute_inv_freq(), persistent=False)

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) casts floating buffers too: bf16 frequencies are off by 0.59 rad at position 512. The
        # buffer is a pure function of (head_dim, theta), so after any move or cast it is recomputed in fp32 on
        # the device it landed on (meta included).
        super()._apply(fn, recurse)
        self.inv_freq = self.compute_inv_freq(device=self.inv_freq.device)
        return self

    def compute_inv_freq(self, device=None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float() / self.head_dim
        return 1.0 / (self.theta ** exponents)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq  # (B, T, D/2), in fp32 like HF
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, cos, sin, attn_mask, kv_cache: KVCache | None = None):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, attn_mask, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, kv_cache)
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


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int | None = None) -> None:
        """Random initialisation as HF does it: normal(0, initializer_range) for linear and embedding weights."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                weight = torch.empty(module.weight.shape).normal_(0.0, self.config.initializer_range,
                                                                  generator=generator)
                with torch.no_grad():
                    module.weight.copy_(weight)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        self.tie_weights()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, return_hidden: bool = False, logits_to_keep: int = 0,
                kv_cache: KVCache | None = None) -> CausalLMOutput:
        """`return_hidden=True` skips the lm_head (losses project chunk by chunk); `logits_to_keep=K` projects only
        the last K positions. With a `kv_cache`, `attention_mask` covers past + new tokens; in the cache's column
        form (see KVCache) it is the key mask over the whole cache, and `position_ids` are required."""
        # the column form reads no Python int off the cache: one compiled graph for every step of every rollout
        column = kv_cache is not None and kv_cache.column is not None
        past_len = kv_cache.length if kv_cache is not None and not column else 0
        T = input_ids.shape[1]
        if position_ids is None:
            if attention_mask is not None:
                position_ids = positions_from_mask(attention_mask)[:, past_len:past_len + T]
            else:
                position_ids = torch.arange(past_len, past_len + T, device=input_ids.device)[None]
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(position_ids, x.dtype)
        if column:  # generate's decode step: attention_mask (B, L) marks the cache positions its query may see
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

    def compile_layers(self, **options) -> None:
        """torch.compile each decoder layer's forward, in place (torchtitan compiles per block too). The module
        tree and its parameter names stay as they are, and whatever wraps a layer from outside -- FSDP2's
        per-layer all-gather hooks, DDP's gradient hooks, activation checkpointing -- runs between compiled blocks:
        DDP can reduce a layer's gradients while the backward of the layers below still computes, which it cannot
        when the whole model is one compiled graph whose backward hands over every gradient at its end."""
        for layer in self.model.layers:
            layer.forward = torch.compile(layer.forward, **options)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once


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
