"""Gated Linear Attention (Yang et al., 2024): S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T with a data-dependent
per-channel gate g_t = logsigmoid(W2 W1 x_t + b) / 16 (low-rank, as in fla), per-head RMSNorm and a swish
output gate."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F
from torch import nn

from harness.mixers.base import GateOptions, HeadRMSNorm, Mixer, init_output_gate
from harness.mixers.dispatch import gated_linear_attention
from harness.mixers.kernel_case import KernelCase


@dataclass
class GLAOptions(GateOptions):
    gate_low_rank_dim: int = field(default=16, metadata={"help": "Rank of the forget-gate projection."})
    gate_logit_normalizer: float = field(default=16.0, metadata={"help": "g = logsigmoid(.) / this."})


class GLA(Mixer):
    name = "gla"
    Options = GLAOptions
    kernel_case = KernelCase(route="gla", gate="channel")

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        inner = shape.num_heads * shape.head_dim
        self.gk_proj = nn.Sequential(
            nn.Linear(shape.hidden_size, options.gate_low_rank_dim, bias=False),
            nn.Linear(options.gate_low_rank_dim, inner, bias=True),
        )
        self.g_proj = nn.Linear(shape.hidden_size, inner, bias=True)  # the open gate's constant
        self.o_norm = HeadRMSNorm(shape.head_dim, activation="silu")

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        g = self._heads(F.logsigmoid(self.gk_proj(x).float()) / self.options.gate_logit_normalizer)
        # kernel: fla chunk_gla; reference: recurrence.chunk_gated_delta
        return gated_linear_attention(q, k, v, g, scale=self.shape.head_dim**-0.5, prior=prior, backend=backend,
                                      chunk_size=self.options.chunk_size, mask=mask)

    def _output(self, x, o):
        return self.o_norm(o, self._heads(self.g_proj(x)), fused=self.pieces_for(x))

    def reset_new_parameters(self) -> None:
        for lin in self.gk_proj:
            nn.init.normal_(lin.weight, std=0.02)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        init_output_gate(self.g_proj, self.o_norm.weight, "silu", self.options.gate_init)

    @classmethod
    def new_parameter_names(cls):
        return ("gk_proj", "g_proj", "o_norm")
