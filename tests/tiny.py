"""A tiny random Llama with the default model's tokenizer, built in memory for fast tests."""
from __future__ import annotations

from pathlib import Path

import torch


def build_tiny_model(out_dir: str | Path, *, seed: int = 0) -> str:
    """Save a 2-layer, 32-wide random LlamaForCausalLM + the SmolLM2 tokenizer to ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rft_core.models.loading import DEFAULT_MODEL, load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return str(out_dir)
