"""Mamba2 (Dao & Gu, 2024) as MambaInLlama (Wang et al., 2024) maps attention onto it: the SSD recurrence with one
state per head, S_t = exp(dt_t A_h) S_{t-1} + dt_t B_t x_t^T, y_t = S_t^T C_t + D_h x_t, where x is the teacher's v,
B its k and C its q (one group per head, state size head_dim), dt_t = softplus(W_dt u_t + dt_bias) per head and
A_h = -exp(A_log_h); a short causal convolution (+SiLU, or none) over x, B and C; then Mamba2's gated RMSNorm,
norm(y * silu(z)) over each head with z = W_z u, before the teacher's o_proj (Mamba2's out_proj)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from harness.mixers.base import ConvMixer, GatedConvOptions, init_output_gate, no_weight_decay
from harness.mixers.dispatch import ssd
from harness.mixers.kernel_case import KernelCase

D_INITS = ("one", "zero")


@dataclass
class Mamba2Options(GatedConvOptions):
    d_init: str = field(
        default="zero", metadata={"help": "The skip y += D_h x per head starts at zero (the layer's output is the "
                                  "SSM's alone at step 0; it ended stage 1 lower, docs/TRANSFER.md) or one (Mamba2's "
                                  "and MambaInLlama's init)."})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("d_init", D_INITS)


class GateThenRMSNorm(nn.Module):
    """Mamba2's gated norm (`norm_before_gate=False`, one group per head): rms_norm(o * silu(z)) over each head's
    head_dim channels, times a weight per channel."""

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """o, z `[B, T, H, D]` -> `[B, T, H, D]` in o's dtype, computed in float32. fused: fla's Triton gated
        group norm when o is on a GPU and longer than one token (decoding steps stay in PyTorch)."""
        if fused and o.is_cuda and o.shape[1] > 1:
            from fla.modules.norm.layernorm_gated import rmsnorm_fn

            y = rmsnorm_fn(o.flatten(2), self.weight, None, z=z.to(o.dtype).flatten(2), eps=self.eps,
                           group_size=o.shape[-1], norm_before_gate=False)
            return y.unflatten(-1, o.shape[-2:])
        gated = o.float() * F.silu(z.float())
        y = F.rms_norm(gated, (o.shape[-1],), eps=self.eps) * self.weight.float().view(o.shape[-2:])
        return y.to(o.dtype)


class Mamba2(ConvMixer):
    name = "mamba2"
    Options = Mamba2Options
    kernel_case = KernelCase(route="simple_gla", gate="ssd", alternative_routes=("gla",))

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        h = shape.num_heads
        self.dt_proj = nn.Linear(shape.hidden_size, h, bias=False)
        self.dt_bias = no_weight_decay(nn.Parameter(torch.zeros(h)))
        self.A_log = no_weight_decay(nn.Parameter(torch.zeros(h)))
        self.D = no_weight_decay(nn.Parameter(torch.zeros(h)))
        self.z_proj = nn.Linear(shape.hidden_size, h * shape.head_dim, bias=True)  # the open gate's constant
        self.o_norm = GateThenRMSNorm(h, shape.head_dim)
        self.reset_new_parameters()

    def score_features(self, q, k):
        return q, k  # C and B as they are: Mamba2 normalises neither

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        dt = F.softplus(self.dt_proj(x).float() + self.dt_bias.float())  # [B, T, H]
        g = -self.A_log.float().exp() * dt
        # the input dt_t x_t is folded into B_t (k); Mamba2 has no q.k scale
        # kernel: fla chunk_simple_gla (chunk_gla where fla's gated backward is blocked); reference:
        # recurrence.chunk_gated_delta
        o, state = ssd(q, (k.float() * dt.unsqueeze(-1)).to(k.dtype), v, g, scale=1.0, prior=prior,
                       backend=backend, chunk_size=self.options.chunk_size, mask=mask)
        return (o.float() + self.D.float()[:, None] * v.float()).to(o.dtype), state

    def _output(self, x, o):
        return self.o_norm(o, self._heads(self.z_proj(x)), fused=self.pieces_for(x))

    @torch.no_grad()
    def reset_new_parameters(self) -> None:
        nn.init.normal_(self.dt_proj.weight, std=0.02)
        init_output_gate(self.z_proj, self.o_norm.weight, "silu", self.options.gate_init)
        self.D.fill_(1.0 if self.options.d_init == "one" else 0.0)
        self._reset_decay_norm_conv(a_low=1)  # Mamba2's A ~ U(1, 16), dt ~ LogU(1e-3, 0.1); the conv

    @classmethod
    def new_parameter_names(cls):
        return ("dt_proj", "dt_bias", "A_log", "D", "z_proj", "o_norm", "qkv_conv")
