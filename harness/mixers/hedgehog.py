"""Hedgehog linear attention (Zhang et al., 2024) with LoLCATs' learned feature map (Zhang et al., 2025): per head
and separately for q and k, phi(x) = [softmax(x W), softmax(-x W)] (each softmax over the F features of x W,
W `[head_dim, F]`), then normalised linear attention, o_t = sum_s phi(q_t).phi(k_s) v_s / sum_s phi(q_t).phi(k_s),
Linear Attention's recurrence with a state `[2F, head_dim]` per head. The maps are the mixer's new parameters, so
stage 1 trains them. With `options.window` this is LoLCATs' layer (linear attention beside a sliding-window softmax
attention; docs/TRANSFER.md)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from harness.mixers.base import MixerOptions
from harness.mixers.kernel_case import KernelCase
from harness.mixers.linear_attn import LinearAttention

FEATURE_INITS = ("identity", "random")


@dataclass
class HedgehogOptions(MixerOptions):
    feature_dim: Optional[int] = field(
        default=None, metadata={"help": "F, the outputs of each head's map x W (the state has 2F rows); null: "
                                "head_dim (LoLCATs: 64)."})
    feature_init: str = field(
        default="identity", metadata={"help": "identity: W = I (the first min(head_dim, F) diagonal entries 1; "
                                      "Hedgehog's and fla's init, LoLCATs' zero_init); random: kaiming-uniform, "
                                      "as LoLCATs' released configs (docs/TRANSFER.md)."})
    normalize: bool = field(default=True, metadata={"help": "Divide by phi(q) . sum phi(k) (the normaliser)."})
    eps: float = field(default=1e-6, metadata={"help": "Added to the normaliser's denominator."})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("feature_init", FEATURE_INITS)
        if self.feature_dim is not None and self.feature_dim < 1:
            raise ValueError(f"feature_dim={self.feature_dim} must be >= 1 (or null for head_dim)")


def hedgehog_features(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x `[B, T, H, D]`, weight `[H, D, F]` -> [softmax(x W), softmax(-x W)] `[B, T, H, 2F]` in x's dtype (the
    softmaxes in float32)."""
    y = torch.einsum("bthd,hdf->bthf", x.float(), weight.float())
    return torch.cat([y.softmax(-1), (-y).softmax(-1)], dim=-1).to(x.dtype)


class Hedgehog(LinearAttention):
    name = "hedgehog"
    Options = HedgehogOptions
    kernel_case = KernelCase(route="simple_gla", features="softmax_pair", alternative_routes=("gla",))

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        features = options.feature_dim or shape.head_dim
        self.feature_q = nn.Parameter(torch.empty(shape.num_heads, shape.head_dim, features))
        self.feature_k = nn.Parameter(torch.empty(shape.num_heads, shape.head_dim, features))
        self.reset_new_parameters()

    def score_features(self, q, k):
        return hedgehog_features(q, self.feature_q), hedgehog_features(k, self.feature_k)

    @torch.no_grad()
    def reset_new_parameters(self) -> None:
        for weight in (self.feature_q, self.feature_k):
            if self.options.feature_init == "random":
                nn.init.kaiming_uniform_(weight)  # LoLCATs' FeatureMapMLP: fan_in = head_dim x F
            else:
                weight.copy_(torch.eye(*weight.shape[1:]).expand_as(weight))

    @classmethod
    def new_parameter_names(cls):
        return ("feature_q", "feature_k")
