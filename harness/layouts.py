"""The parts of a teacher's network beyond Llama's that its student computes as the teacher does
(harness.teacher_families says which family has which; the student's config holds them, harness.student):

  * `GemmaRMSNorm`: Gemma's RMSNorm, which scales by (1 + weight) and multiplies in float32 before the cast
    (Llama's rounds to the input's dtype first, then multiplies by the weight);
  * `ScaledEmbedding`: Gemma's embedding, multiplied by sqrt(hidden) rounded to the weight's dtype;
  * `softcap`: tanh soft-capping, cap * tanh(x / cap), of attention scores (Gemma 2) and logits (Gemma 2/3);
  * per-layer RoPE: `LayerRotary` computes, once per forward, the rotary embedding of each kind of layer (the
    `rope_parameters` of full-attention layers, Gemma 3's `local_rope_parameters` of its sliding-window layers) and
    hands each layer its own in a `LayerRope`, None for a layer without RoPE (SmolLM3's `no_rope_layers`). A model
    whose layers all share one rotary keeps transformers' LlamaRotaryEmbedding and its plain (cos, sin).

Imports nothing else from harness.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding


class GemmaRMSNorm(nn.Module):
    """transformers' Gemma/Gemma2/Gemma3RMSNorm: x / rms(x) * (1 + weight), in float32, then cast to x's dtype; the
    weight starts at zero (the identity scale), under the name `weight` as theirs."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


def norm_class(style: Optional[str]) -> type[nn.Module]:
    """The RMSNorm of a norm style: Gemma's for "gemma", Llama's for None."""
    if style not in (None, "gemma"):
        raise ValueError(f"norm_style={style!r} is not one of None, 'gemma'")
    return GemmaRMSNorm if style == "gemma" else LlamaRMSNorm


class ScaledEmbedding(nn.Embedding):
    """An embedding whose rows are multiplied by `scale` (Gemma: sqrt(hidden)), the scale rounded to float32 and then
    to the weight's dtype, as transformers' Gemma*ScaledWordEmbedding does; its state is the weight alone."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int], scale: float):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.scale = float(scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        factor = torch.tensor(self.scale, dtype=torch.float32, device=self.weight.device).to(self.weight.dtype)
        return super().forward(input_ids) * factor


def softcap(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap * tanh(x / cap) (transformers' order of operations), or x unchanged when cap is None."""
    if cap is None:
        return x
    return torch.tanh(x / cap) * cap


# ---------------------------------------------------------------------------------------------- per-layer RoPE


class LayerRope:
    """The rotary embedding of every layer for one forward: `for_layer(i)` is layer i's (cos, sin), or None where the
    layer has no RoPE. What a student hands its mixers and kept attention layers where its layers' RoPE differs."""

    def __init__(self, per_layer: Sequence[Optional[tuple[torch.Tensor, torch.Tensor]]]):
        self.per_layer = tuple(per_layer)

    def for_layer(self, layer: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        return self.per_layer[layer]


def layer_rope(position_embeddings: Any, layer: int) -> Any:
    """Layer `layer`'s position embeddings: its entry of a LayerRope, or `position_embeddings` as given otherwise
    (one (cos, sin) shared by every layer, or None)."""
    if isinstance(position_embeddings, LayerRope):
        return position_embeddings.for_layer(layer)
    return position_embeddings


def rope_kinds(config: Any) -> Optional[list[Optional[str]]]:
    """Per layer of a student config, which teacher rotary its attention uses: "global" (`rope_parameters`),
    "local" (`local_rope_parameters`, Gemma 3's sliding-window layers) or None (no RoPE: SmolLM3's
    `no_rope_layers`); None when every layer uses "global"."""
    n = config.num_hidden_layers
    flags = getattr(config, "no_rope_layers", None) or [1] * n
    local = set(getattr(config, "local_rope_layers", None) or ())
    kinds = [None if not flags[i] else "local" if i in local else "global" for i in range(n)]
    return None if all(k == "global" for k in kinds) else kinds


def _rotary_config(config: Any, kind: str, theta: Optional[float]) -> Any:
    """A copy of `config` whose rope_parameters are those of `kind` ("global" or "local"), with base `theta` if set."""
    params = config.rope_parameters if kind == "global" else config.local_rope_parameters
    config = copy.deepcopy(config)
    params = dict(params) if isinstance(params, dict) else None
    if theta is not None:
        if params is None:
            config.rope_theta = float(theta)
        else:
            params["rope_theta"] = float(theta)
    if params is not None:
        config.rope_parameters = params
    return config


def rotary_of(config: Any, kind: str = "global", theta: Optional[float] = None) -> LlamaRotaryEmbedding:
    """The teacher's rotary embedding of layers of `kind` (its own base, or `theta` when given)."""
    if kind == "global" and theta is None:
        return LlamaRotaryEmbedding(config)
    return LlamaRotaryEmbedding(_rotary_config(config, kind, theta))


class LayerRotary(nn.Module):
    """The rotary embeddings of a student whose layers' RoPE differs (`rope_kinds`): (x, positions) -> LayerRope,
    each kind of rotary computed once. `theta`: one base for every kind (a mixer's rope_theta option)."""

    def __init__(self, config: Any, theta: Optional[float] = None):
        super().__init__()
        self.kinds = rope_kinds(config) or ["global"] * config.num_hidden_layers
        self.rotaries = nn.ModuleDict({kind: rotary_of(config, kind, theta)
                                       for kind in sorted({k for k in self.kinds if k is not None})})

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> LayerRope:
        made = {kind: rotary(x, position_ids) for kind, rotary in self.rotaries.items()}
        return LayerRope([made[kind] if kind is not None else None for kind in self.kinds])


def model_rotary(config: Any, theta: Optional[float] = None) -> nn.Module:
    """The rotary embedding a student computes once per forward: transformers' LlamaRotaryEmbedding when every layer
    shares the teacher's (plain (cos, sin)), else a LayerRotary (a LayerRope). `theta`: one base for all."""
    if rope_kinds(config) is None:
        return rotary_of(config, "global", theta)
    return LayerRotary(config, theta)


def layer_rotary(config: Any, layer: int) -> Optional[LlamaRotaryEmbedding]:
    """The teacher's rotary embedding of layer `layer` alone (its own kind's base), None where it has no RoPE."""
    kinds = rope_kinds(config)
    kind = kinds[layer] if kinds is not None else "global"
    return rotary_of(config, kind) if kind is not None else None
