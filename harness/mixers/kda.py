"""Kimi Delta Attention (Kimi Team, 2025): the delta rule with a per-channel gate,
S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T, g_t = -exp(A_log_h) softplus(W_f x_t + dt_bias)
with a low-rank W_f, short convolutions, L2-normalised q and k, and a per-head RMSNorm with a sigmoid output
gate from a low-rank projection (fla's KimiDeltaAttention with expand_v=1). With `decay_group_size` > 1 the gate
is one per group of key channels, up to one per head (harness.mixers.decay)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from harness.mixers.base import (ConvMixer, GatedConvOptions, HeadRMSNorm, init_output_gate, mamba_dt_bias,
                                 no_weight_decay)
from harness.mixers.decay import check_decay_group_size, decay_group_field, expand_decay, gates_per_head
from harness.mixers.dispatch import kimi_delta_rule
from harness.mixers.kernel_case import KernelCase


@dataclass
class KDAOptions(GatedConvOptions):
    decay_group_size: int = decay_group_field(1)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_decay_group_size(self.decay_group_size)


class KDA(ConvMixer):
    name = "kda"
    Options = KDAOptions
    kernel_case = KernelCase(route="kda", features="l2", gate="channel", beta=True)

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        h, d, inner = shape.num_heads, shape.head_dim, shape.num_heads * shape.head_dim
        gates = h * gates_per_head(options.decay_group_size, d)
        self.f_proj = nn.Sequential(nn.Linear(shape.hidden_size, d, bias=False), nn.Linear(d, gates, bias=False))
        self.b_proj = nn.Linear(shape.hidden_size, h, bias=False)
        self.A_log = no_weight_decay(nn.Parameter(torch.log(torch.empty(h).uniform_(1, 16))))
        self.dt_bias = no_weight_decay(nn.Parameter(mamba_dt_bias(gates)))
        self.g_proj = nn.Sequential(nn.Linear(shape.hidden_size, d, bias=False), nn.Linear(d, inner, bias=True))
        self.o_norm = HeadRMSNorm(d, activation="sigmoid")

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        f = (self.f_proj(x).float() + self.dt_bias.float()).unflatten(-1, (self.shape.num_heads, -1))
        g = expand_decay(-self.A_log.float().exp()[:, None] * F.softplus(f), self.shape.head_dim)
        beta = torch.sigmoid(self.b_proj(x).float())
        # kernel: fla chunk_kda (chunk_gated_delta_rule with one gate per head); reference:
        # recurrence.chunk_gated_delta
        return kimi_delta_rule(q, k, v, g, beta, scale=self.shape.head_dim**-0.5, prior=prior, backend=backend,
                               chunk_size=self.options.chunk_size, normalize_qk=True, mask=mask)

    def _output(self, x, o):
        return self.o_norm(o, self._heads(self.g_proj(x)), fused=self.pieces_for(x))

    def reset_new_parameters(self) -> None:
        for lin in (*self.f_proj, self.b_proj, self.g_proj[0]):
            nn.init.normal_(lin.weight, std=0.02)
        init_output_gate(self.g_proj[1], self.o_norm.weight, "sigmoid", self.options.gate_init)
        self._reset_decay_norm_conv(a_low=1)

    @classmethod
    def new_parameter_names(cls):
        return ("f_proj", "b_proj", "A_log", "dt_bias", "g_proj", "o_norm", "qkv_conv")
