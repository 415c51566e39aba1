"""Tiny random teachers with grouped KV heads, one per supported family (the Llama one is the mixer contract's
teacher), for fast CPU tests."""

from __future__ import annotations

import torch

from harness.mixers.contract import tiny_teacher as tiny_llama  # the mixer contract's teacher: one builder


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


def _randomise_norms(model, seed: int):
    """Every RMSNorm weight of the model drawn at random (Gemma's start at zero, the identity scale of their
    1 + weight; Llama's at one), so that a norm dropped, misplaced or read with the other family's formula shows."""
    generator = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                base = 0.0 if "Gemma" in type(module).__name__ else 1.0
                module.weight.copy_(base + torch.randn(module.weight.shape, generator=generator) * 0.3)
    return model


def _family(config_cls, model_cls, *, num_layers: int, hidden: int, heads: int, kv_heads: int, vocab: int,
            head_dim: int, seed: int, attention: str = "sdpa", **extra):
    torch.manual_seed(seed)
    config = config_cls(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, **{"pad_token_id": None, **extra},
    )
    config._attn_implementation = attention
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


def tiny_smollm3(num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 97,
                 seed: int = 0, no_rope_layers: list[int] | None = None):
    """SmolLM3: Llama's layout, but the layers whose no_rope_layers flag is 0 have no RoPE (here every other one,
    starting with the second)."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    flags = no_rope_layers if no_rope_layers is not None else [int(i % 2 == 0) for i in range(num_layers)]
    return _family(SmolLM3Config, SmolLM3ForCausalLM, num_layers=num_layers, hidden=hidden, heads=heads,
                   kv_heads=kv_heads, vocab=vocab, head_dim=hidden // heads, seed=seed, no_rope_layers=flags)


def tiny_gemma(num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 97,
               seed: int = 0):
    """Gemma: Llama's layers, but RMSNorm scaling by (1 + weight), embeddings times sqrt(hidden), a GELU MLP."""
    from transformers import GemmaConfig, GemmaForCausalLM

    return _randomise_norms(_family(GemmaConfig, GemmaForCausalLM, num_layers=num_layers, hidden=hidden, heads=heads,
                                    kv_heads=kv_heads, vocab=vocab, head_dim=16, seed=seed), seed)


def _alternating(num_layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def tiny_gemma2(num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 97,
                seed: int = 0, sliding_window: int = 8, layer_types: list[str] | None = None,
                attn_logit_softcapping: float | None = 2.0, final_logit_softcapping: float | None = 0.5):
    """Gemma 2: Gemma's norms and embedding, norms after the attention and around the MLP, sliding-window layers
    alternating with full ones (window 8 here), the attention scale query_pre_attn_scalar ** -0.5 with a scalar that
    is not head_dim (12 vs 16), and soft-capping of the attention scores and of the logits at caps low enough to
    bite on random weights. Eager attention: transformers' sdpa path cannot soft-cap."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = _family(Gemma2Config, Gemma2ForCausalLM, num_layers=num_layers, hidden=hidden, heads=heads,
                    kv_heads=kv_heads, vocab=vocab, head_dim=16, seed=seed, attention="eager",
                    sliding_window=sliding_window, layer_types=layer_types or _alternating(num_layers),
                    query_pre_attn_scalar=12, attn_logit_softcapping=attn_logit_softcapping,
                    final_logit_softcapping=final_logit_softcapping)
    return _randomise_norms(model, seed)


def tiny_gemma3(num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, vocab: int = 97,
                seed: int = 0, sliding_window: int = 8, layer_types: list[str] | None = None):
    """Gemma 3 (text): Gemma 2's layout with per-head q/k norms (1 + weight) and without attention soft-capping;
    its sliding-window layers rotate with a local base (10 here) and its full ones with a global base under linear
    RoPE scaling (factor 2), so that a layer given the other kind's RoPE shows; logits capped at 0.5."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}
    model = _family(Gemma3TextConfig, Gemma3ForCausalLM, num_layers=num_layers, hidden=hidden, heads=heads,
                    kv_heads=kv_heads, vocab=vocab, head_dim=16, seed=seed, sliding_window=sliding_window,
                    layer_types=layer_types or _alternating(num_layers), query_pre_attn_scalar=12,
                    final_logit_softcapping=0.5, rope_parameters=rope)
    return _randomise_norms(model, seed)


TINY_FAMILIES = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3, "mistral": tiny_mistral,
                 "smollm3": tiny_smollm3, "gemma": tiny_gemma, "gemma2": tiny_gemma2, "gemma3_text": tiny_gemma3}
