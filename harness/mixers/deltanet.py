"""DeltaNet (Schlag et al., 2021; Yang et al., 2024): S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T with
q, k L2-normalised after a short convolution, b_t = sigmoid(W_b x_t), and a per-head RMSNorm on the output."""

from __future__ import annotations

import torch
from torch import nn

from harness.mixers.base import ConvMixer, ConvOptions, HeadRMSNorm
from harness.mixers.dispatch import delta_rule
from harness.mixers.kernel_case import KernelCase


class DeltaNet(ConvMixer):
    name = "deltanet"
    Options = ConvOptions
    kernel_case = KernelCase(route="delta_rule", features="l2", beta=True, alternative_routes=("gated_delta_rule",))

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        self.b_proj = nn.Linear(shape.hidden_size, shape.num_heads, bias=False)
        self.o_norm = HeadRMSNorm(shape.head_dim)

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        beta = torch.sigmoid(self.b_proj(x).float())
        # kernel: fla chunk_delta_rule; reference: recurrence.chunk_gated_delta
        return delta_rule(q, k, v, beta, scale=self.shape.head_dim**-0.5, prior=prior, backend=backend,
                          chunk_size=self.options.chunk_size, normalize_qk=True, mask=mask)

    def _output(self, x, o):
        return self.o_norm(o)

    def reset_new_parameters(self) -> None:
        nn.init.normal_(self.b_proj.weight, std=0.02)
        nn.init.ones_(self.o_norm.weight)
        self._reset_decay_norm_conv()

    @classmethod
    def new_parameter_names(cls):
        return ("b_proj", "o_norm", "qkv_conv")
