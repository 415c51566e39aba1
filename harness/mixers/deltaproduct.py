"""Gated DeltaProduct (Siems et al., 2025): n Householder steps per token, each with its own key, value and beta:
S = exp(g_t) S_{t-1}, then for j = 1..n S = (I - b_tj k_tj k_tj^T) S + b_tj k_tj v_tj^T, with one decay gate per
token and head g_t = -exp(A_log) softplus(W_a x_t + dt_bias) (as Gated DeltaNet), short convolutions,
L2-normalised q and keys, and a per-head RMSNorm with a swish output gate (fla's GatedDeltaProduct, expand_v=1).
With n = 1 it is Gated DeltaNet.

Step 1 is the teacher's: q, k, v, o copied as for every mixer. Steps 2..n have their own k and v projections
(`extra_k_proj`, `extra_v_proj`, `householder_kv_init`) and beta rows (b_proj has a bias, `householder_beta_bias`
for those steps). A token's keys `[B, T, n, H, D]` take RoPE at the token's position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from harness.mixers.base import (ConvMixer, GatedConvOptions, HeadRMSNorm, init_output_gate, mamba_dt_bias,
                                 no_weight_decay)
from harness.mixers.dispatch import gated_delta_product
from harness.mixers.kernel_case import KernelCase
from harness.mixers.ops import l2norm

HOUSEHOLDER_KV_INITS = ("random", "copy")


@dataclass
class DeltaProductOptions(GatedConvOptions):
    num_householder: int = field(
        default=2, metadata={"help": "Householder steps per token (n), each with its own k, v and beta; one decay gate "
                             "per token. 2 as the authors (Siems et al. 2025); 1 is Gated DeltaNet."})
    householder_kv_init: str = field(
        default="random", metadata={"help": "Steps 2..n's k and v projections: random (~N(0, 0.02), as the other new "
                                    "projections; fla's layers draw every projection at random) or copy (the "
                                    "teacher's k and v, as step 1: each extra step then repeats step 1's write). "
                                    "random ends stage 1 closer to the teacher (docs/TRANSFER.md)."})
    householder_beta_bias: float = field(
        default=0.0, metadata={"help": "Initial bias of steps 2..n's beta logits (step 1's is 0, beta ~1/2 as Gated "
                               "DeltaNet): sigmoid(bias) is their write strength at step 0; e.g. -4 (beta ~0.018) "
                               "starts the extra steps near the identity."})
    negative_eigenvalues: bool = field(
        default=False, metadata={"help": "beta = 2 sigmoid(.) in (0, 2), so each Householder factor's eigenvalue "
                                 "1 - beta reaches down to -1 (the authors' and fla's allow_neg_eigval); false: "
                                 "beta in (0, 1), as Gated DeltaNet."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.num_householder, bool) or not isinstance(self.num_householder, int) \
                or self.num_householder < 1:
            raise ValueError(f"num_householder={self.num_householder!r} must be an integer >= 1")
        self.check_choice("householder_kv_init", HOUSEHOLDER_KV_INITS)


class DeltaProduct(ConvMixer):
    name = "deltaproduct"
    Options = DeltaProductOptions
    kernel_case = KernelCase(route="gated_delta_product", recurrence="gated_delta_product", features="l2",
                             gate="head", beta=True, alternative_routes=("interleaved",))
    value_projections = ("v_proj", "extra_v_proj")

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        h, inner, n = shape.num_heads, shape.num_heads * shape.head_dim, options.num_householder
        if n > 1:
            self.extra_k_proj = nn.Linear(shape.hidden_size, (n - 1) * inner, bias=shape.qkv_bias)
            self.extra_v_proj = nn.Linear(shape.hidden_size, (n - 1) * inner, bias=shape.qkv_bias)
        self.a_proj = nn.Linear(shape.hidden_size, h, bias=False)
        self.b_proj = nn.Linear(shape.hidden_size, n * h, bias=True)  # step-major: row j * H + head
        self.A_log = no_weight_decay(nn.Parameter(torch.log(torch.empty(h).uniform_(0, 16))))
        self.dt_bias = no_weight_decay(nn.Parameter(mamba_dt_bias(h)))
        self.g_proj = nn.Linear(shape.hidden_size, inner, bias=True)  # the open gate's constant
        self.o_norm = HeadRMSNorm(shape.head_dim, activation="silu")

    def conv_channels(self) -> int:
        """q, then the n steps' keys, then their values."""
        return (1 + 2 * self.options.num_householder) * self.shape.num_heads * self.shape.head_dim

    def project_qkv(self, x, state, use_cache, mask=None, projected=None):
        """q `[B, T, H, D]`, the steps' k and v `[B, T, n, H, D]` (step 1 the teacher's projections), the conv
        tail."""
        q, k, v = projected if projected is not None else (*self.project_qk(x), self.v_proj(x))
        keys, values = [k], [v]
        if self.options.num_householder > 1:
            extra_k = self.extra_k_proj(x)
            if self.shape.qk_norm:  # every key of the layer passes the teacher's k norm, as step 1's does
                extra_k = self.k_norm(extra_k.unflatten(-1, (-1, self.shape.head_dim))).flatten(2)
            keys.append(extra_k)
            values.append(self.extra_v_proj(x))
        qkv, tail = self.convolve(x, torch.cat([q, *keys, *values], dim=-1), state, use_cache, mask)
        inner, n = q.shape[-1], self.options.num_householder
        q, k, v = qkv.split([inner, n * inner, n * inner], dim=-1)
        steps = lambda t: t.unflatten(-1, (n, self.shape.num_heads, self.shape.head_dim))  # noqa: E731
        return self._heads(q), steps(k), steps(v), tail

    def score_features(self, q, k):
        """The L2-normalised q and step 1's keys (the teacher's)."""
        return l2norm(q), l2norm(k[:, :, 0])

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias.float())
        beta = torch.sigmoid(self.b_proj(x).float()).unflatten(-1, (self.options.num_householder, -1))
        if self.options.negative_eigenvalues:
            beta = 2 * beta
        # kernel: fla chunk_gated_delta_product; reference: recurrence.chunk_gated_delta_product
        return gated_delta_product(q, k, v, g, beta, scale=self.shape.head_dim**-0.5, prior=prior, backend=backend,
                                   chunk_size=self.options.chunk_size, normalize_qk=True, mask=mask)

    def _output(self, x, o):
        return self.o_norm(o, self._heads(self.g_proj(x)), fused=self.pieces_for(x))

    @torch.no_grad()
    def reset_new_parameters(self) -> None:
        for lin in (self.a_proj, self.b_proj):
            nn.init.normal_(lin.weight, std=0.02)
        heads = self.shape.num_heads
        self.b_proj.bias.zero_()
        self.b_proj.bias[heads:] = self.options.householder_beta_bias
        if self.options.num_householder > 1:
            self._reset_extra_kv()
        init_output_gate(self.g_proj, self.o_norm.weight, "silu", self.options.gate_init)
        self._reset_decay_norm_conv(a_low=0)

    def _reset_extra_kv(self) -> None:
        """Steps 2..n's k and v projections as `householder_kv_init` says: ~N(0, 0.02) with zero biases, or copies
        of k_proj and v_proj (which hold the teacher's after `transfer_from_attention`)."""
        repeats = self.options.num_householder - 1
        for extra, first in ((self.extra_k_proj, self.k_proj), (self.extra_v_proj, self.v_proj)):
            if self.options.householder_kv_init == "copy":
                extra.weight.copy_(first.weight.repeat(repeats, 1))
                if extra.bias is not None:
                    extra.bias.copy_(first.bias.repeat(repeats))
            else:
                nn.init.normal_(extra.weight, std=0.02)
                if extra.bias is not None:
                    extra.bias.zero_()

    @classmethod
    def new_parameter_names(cls):
        return ("extra_k_proj", "extra_v_proj", "a_proj", "b_proj", "A_log", "dt_bias", "g_proj", "o_norm",
                "qkv_conv")
