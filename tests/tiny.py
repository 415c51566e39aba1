"""Tiny random Llama teachers with grouped KV heads, for fast CPU tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 97,
               tie: bool = True, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
        tie_word_embeddings=tie, attn_implementation="sdpa", bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    # distinct K/V rows per head make a wrong head mapping visible
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.normal_(0, 0.2)
            layer.self_attn.v_proj.weight.normal_(0, 0.2)
    return model
