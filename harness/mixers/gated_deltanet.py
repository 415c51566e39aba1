"""Gated DeltaNet (Yang et al., 2025): S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T with a scalar
gate per head g_t = -exp(A_log) softplus(W_a x_t + dt_bias) (Mamba2-style init), b_t = sigmoid(W_b x_t),
short convolutions, L2-normalised q and k, and a per-head RMSNorm with a swish output gate. With
`decay_group_size` < head_dim the gate is one per group of key channels (harness.mixers.decay), KDA's recurrence."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from harness.mixers.base import (ConvMixer, GatedConvOptions, HeadRMSNorm, init_output_gate, mamba_dt_bias,
                                 no_weight_decay)
from harness.mixers.decay import check_decay_group_size, decay_group_field, expand_decay, gates_per_head
from harness.mixers.dispatch import gated_delta_rule
from harness.mixers.kernel_case import KernelCase


@dataclass
class GatedDeltaNetOptions(GatedConvOptions):
    decay_group_size: int = decay_group_field(0)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_decay_group_size(self.decay_group_size)


class GatedDeltaNet(ConvMixer):
    name = "gated_deltanet"
    Options = GatedDeltaNetOptions
    kernel_case = KernelCase(route="gated_delta_rule", features="l2", gate="head", beta=True,
                             alternative_routes=("kda",))

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        h, inner = shape.num_heads, shape.num_heads * shape.head_dim
        self.gates_per_head = gates_per_head(options.decay_group_size, shape.head_dim)
        gates = h * self.gates_per_head
        self.a_proj = nn.Linear(shape.hidden_size, gates, bias=False)
        self.b_proj = nn.Linear(shape.hidden_size, h, bias=False)
        self.A_log = no_weight_decay(nn.Parameter(torch.log(torch.empty(h).uniform_(0, 16))))
        self.dt_bias = no_weight_decay(nn.Parameter(mamba_dt_bias(gates)))
        self.g_proj = nn.Linear(shape.hidden_size, inner, bias=True)  # the open gate's constant
        self.o_norm = HeadRMSNorm(shape.head_dim, activation="silu")

    def _decay(self, x):
        """The log decay: `[B, T, H]` with one gate per head, else `[B, T, H, K]` (harness.mixers.decay)."""
        if self.gates_per_head == 1:
            return -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        logits = (self.a_proj(x).float() + self.dt_bias.float()).unflatten(-1, (self.shape.num_heads, -1))
        return expand_decay(-self.A_log.float().exp()[:, None] * F.softplus(logits), self.shape.head_dim)

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        g = self._decay(x)
        beta = torch.sigmoid(self.b_proj(x).float())
        # kernel: fla chunk_gated_delta_rule (chunk_kda where its backward is blocked, or for gates finer than a
        # head); reference: recurrence.chunk_gated_delta
        return gated_delta_rule(q, k, v, g, beta, scale=self.shape.head_dim**-0.5, prior=prior, backend=backend,
                                chunk_size=self.options.chunk_size, normalize_qk=True, mask=mask)

    def _output(self, x, o):
        return self.o_norm(o, self._heads(self.g_proj(x)), fused=self.pieces_for(x))

    def reset_new_parameters(self) -> None:
        for lin in (self.a_proj, self.b_proj):
            nn.init.normal_(lin.weight, std=0.02)
        init_output_gate(self.g_proj, self.o_norm.weight, "silu", self.options.gate_init)
        self._reset_decay_norm_conv(a_low=0)

    @classmethod
    def new_parameter_names(cls):
        return ("a_proj", "b_proj", "A_log", "dt_bias", "g_proj", "o_norm", "qkv_conv")
