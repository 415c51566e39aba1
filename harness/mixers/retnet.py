"""RetNet retention (Sun et al., 2023): S_t = gamma_h S_{t-1} + k_t v_t^T with a fixed per-head decay
gamma_h = 1 - 2^(-5-h), then a per-head RMSNorm and a swish output gate (fla's MultiScaleRetention)."""

from __future__ import annotations

import torch
from torch import nn

from harness.mixers.base import GateOptions, HeadRMSNorm, Mixer, init_output_gate
from harness.mixers.dispatch import retention
from harness.mixers.kernel_case import KernelCase


class RetNet(Mixer):
    name = "retnet"
    Options = GateOptions
    kernel_case = KernelCase(route="simple_gla_gamma", gate="head_const", alternative_routes=("simple_gla", "gla"))

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        inner = shape.num_heads * shape.head_dim
        self.g_proj = nn.Linear(shape.hidden_size, inner, bias=True)  # the open gate's constant
        self.o_norm = HeadRMSNorm(shape.head_dim, activation="silu")

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        heads = torch.arange(self.shape.num_heads, dtype=torch.float32, device=x.device)
        g = torch.log1p(-torch.pow(2.0, -5.0 - heads)).expand(*x.shape[:2], -1)
        # kernel: fla chunk_simple_gla with g_gamma (fla's chunk_retention); reference: recurrence.chunk_gated_delta
        return retention(q, k, v, g, scale=self.shape.head_dim**-0.5, prior=prior, backend=backend,
                         chunk_size=self.options.chunk_size, mask=mask)

    def _output(self, x, o):
        return self.o_norm(o, self._heads(self.g_proj(x)), fused=self.pieces_for(x))

    def reset_new_parameters(self) -> None:
        init_output_gate(self.g_proj, self.o_norm.weight, "silu", self.options.gate_init)

    @classmethod
    def new_parameter_names(cls):
        return ("g_proj", "o_norm")
