"""xLSTM's mLSTM (Beck et al., 2024; the xLSTM-7B layer): matrix memory with an exponential input gate and a
sigmoid forget gate, max-stabilised, h_t = C_t^T q_t / max(|n_t^T q_t|, exp(-m_t)); then a per-head
LayerNorm and a sigmoid output gate. Gate init as xLSTM-7B: zero gate weights, input bias -10, forget bias
linspace(3, 6) over heads, gate pre-activations soft-capped at 15."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from harness.mixers.base import GateOptions, Mixer, init_output_gate
from harness.mixers.dispatch import mlstm_cell
from harness.mixers.kernel_case import KernelCase
from harness.mixers.kernels import MLSTM_KERNEL


@dataclass
class MLSTMOptions(GateOptions):
    gate_soft_cap: float = field(default=15.0, metadata={"help": "cap * tanh(x / cap) on gate pre-activations."})
    eps: float = field(default=1e-6, metadata={"help": "Added to the mLSTM denominator."})


class MLSTM(Mixer):
    name = "mlstm"
    Options = MLSTMOptions
    # mlstm_kernels at T = 2048 on an H200, three seeds: h 0.79-1.1e-2, df 4.0-4.3e-2, the kernel's own arithmetic
    # (harness/bench/recurrences.py, docs/KERNELS.md)
    kernel_case = KernelCase(route=MLSTM_KERNEL, recurrence="mlstm", tolerances={"out": 1.5e-2, "gate_grad": 5e-2})

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        h, inner = shape.num_heads, shape.num_heads * shape.head_dim
        self.igate = nn.Linear(shape.hidden_size, h, bias=True)
        self.fgate = nn.Linear(shape.hidden_size, h, bias=True)
        self.ogate = nn.Linear(shape.hidden_size, inner, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(inner))
        self.reset_new_parameters()

    def _soft_cap(self, x: torch.Tensor) -> torch.Tensor:
        cap = self.options.gate_soft_cap
        return cap * torch.tanh(x / cap)

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        i = self._soft_cap(self.igate(x).float())
        f = self._soft_cap(self.fgate(x).float())
        # kernel: mlstm_kernels chunkwise--triton_limit_chunk; reference: recurrence.chunk_mlstm
        return mlstm_cell(q, k, v, i, f, scale=self.shape.head_dim**-0.5, prior=prior, backend=backend,
                          chunk_size=self.options.chunk_size, eps=self.options.eps, mask=mask)

    def _output(self, x, o):
        normed = F.layer_norm(o.float(), (o.shape[-1],), eps=1e-6)
        normed = normed * self._heads(self.norm_weight.float())
        return (torch.sigmoid(self._heads(self.ogate(x).float())) * normed).to(o.dtype)

    def reset_new_parameters(self) -> None:
        with torch.no_grad():
            nn.init.zeros_(self.igate.weight)
            self.igate.bias.fill_(-10.0)
            nn.init.zeros_(self.fgate.weight)
            self.fgate.bias.copy_(torch.linspace(3.0, 6.0, self.fgate.bias.numel()))
        small_init = (2 / (5 * self.shape.hidden_size)) ** 0.5  # xLSTM's output-gate init
        init_output_gate(self.ogate, self.norm_weight, "sigmoid", self.options.gate_init, std=small_init)

    @classmethod
    def new_parameter_names(cls):
        return ("igate", "fgate", "ogate", "norm_weight")
