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


def _randomise(model, seed: int):
    """Distinct K/V rows per head, and non-trivial biases and q/k norms where the family has them, so that a
    dropped or misplaced one is visible."""
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                proj.weight.copy_(torch.randn(proj.weight.shape, generator=generator) * 0.2)
                if proj.bias is not None:
                    proj.bias.copy_(torch.randn(proj.bias.shape, generator=generator) * 0.5)
            for norm in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)):
                if norm is not None:
                    norm.weight.copy_(1.0 + torch.randn(norm.weight.shape, generator=generator) * 0.5)
    return model.eval()


def _family(config_cls, model_cls, *, num_layers: int, hidden: int, heads: int, kv_heads: int, vocab: int,
            head_dim: int, seed: int, **extra):
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, **extra,
    )
    config._attn_implementation = "sdpa"
    return _randomise(model_cls(config), seed)


def tiny_qwen2(num_layers: int = 2, hidden: int = 60, heads: int = 5, kv_heads: int = 1, vocab: int = 97,
               seed: int = 0):
    """Qwen2/2.5: biases on q, k and v (not o). Odd head count, one KV head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _family(Qwen2Config, Qwen2ForCausalLM, num_layers=num_layers, hidden=hidden, heads=heads,
                   kv_heads=kv_heads, vocab=vocab, head_dim=hidden // heads, seed=seed)


def tiny_qwen3(num_layers: int = 2, hidden: int = 48, heads: int = 3, kv_heads: int = 1, vocab: int = 97,
               seed: int = 0, attention_bias: bool = False):
    """Qwen3: per-head q/k RMSNorm before RoPE, and a head_dim that is not hidden / heads (as in Qwen3-0.6B)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _family(Qwen3Config, Qwen3ForCausalLM, num_layers=num_layers, hidden=hidden, heads=heads,
                   kv_heads=kv_heads, vocab=vocab, head_dim=24, seed=seed, attention_bias=attention_bias)


def tiny_mistral(num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 97,
                 seed: int = 0, sliding_window: int = 8):
    """Mistral: Llama's layout; its sliding window (short here) acts in the teacher only."""
    from transformers import MistralConfig, MistralForCausalLM

    return _family(MistralConfig, MistralForCausalLM, num_layers=num_layers, hidden=hidden, heads=heads,
                   kv_heads=kv_heads, vocab=vocab, head_dim=hidden // heads, seed=seed, sliding_window=sliding_window)


TINY_FAMILIES = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "mistral": tiny_mistral}
