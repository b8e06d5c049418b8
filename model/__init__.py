"""Qwen3 in plain PyTorch: model, HF safetensors load/save, tokenizer with chat template, KV-cache generation."""
from model.checkpoint_io import DTYPES, load_pretrained, save_pretrained
from model.config import Qwen3Config
from model.generate import Decoder, GenerateOutput, generate
from model.qwen3 import CausalLMOutput, KVCache, Qwen3ForCausalLM, create_model
from model.tokenizer import QwenTokenizer, default_tokenizer_dir, load_tokenizer

__all__ = ["DTYPES", "CausalLMOutput", "Decoder", "GenerateOutput", "KVCache", "Qwen3Config", "Qwen3ForCausalLM",
           "QwenTokenizer", "create_model", "default_tokenizer_dir", "generate", "load_pretrained",
           "load_tokenizer", "save_pretrained"]
