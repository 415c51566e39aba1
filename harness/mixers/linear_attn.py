"""Linear Attention (Katharopoulos et al., 2020): S_t = S_{t-1} + phi(k_t) v_t^T, o_t = S_t^T phi(q_t) / z_t.

The optional normaliser z_t = phi(q_t) . sum_{s<=t} phi(k_s) is carried as a second state `[B, H, K]`.
No output gate or norm: the teacher's o_proj reads the mixed values directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from harness.mixers.base import Mixer, MixerOptions
from harness.mixers.dispatch import linear_attention
from harness.mixers.kernel_case import KernelCase

FEATURE_MAPS = {
    "elu": lambda x: F.elu(x) + 1.0,
    "relu": F.relu,
    "identity": lambda x: x,
}


@dataclass
class LinearAttnOptions(MixerOptions):
    feature_map: str = field(default="elu", metadata={"help": "phi: elu (elu+1), relu or identity."})
    normalize: bool = field(default=True, metadata={"help": "Divide by phi(q) . sum phi(k) (the normaliser)."})
    eps: float = field(default=1e-6, metadata={"help": "Added to the normaliser's denominator."})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("feature_map", FEATURE_MAPS)


class LinearAttention(Mixer):
    name = "linear_attn"
    Options = LinearAttnOptions
    kernel_case = KernelCase(route="simple_gla", features="elu1", alternative_routes=("gla",))

    def score_features(self, q, k):
        phi = FEATURE_MAPS[self.options.feature_map]
        return phi(q), phi(k)

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        q, k = self.score_features(q, k)
        if mask is not None:  # phi(k) = 0 at padding: no write, and nothing added to the normaliser
            k = torch.where(mask[..., None, None], k, 0.0)
        S0, z0 = prior if prior is not None else (None, None)
        # each branch runs linear_attention (kernel: fla chunk_simple_gla with g=None; reference:
        # recurrence.chunk_gated_delta); they differ in how the normaliser is formed
        if not self.options.normalize:
            o, S = linear_attention(q, k, v, scale=self.shape.head_dim**-0.5, prior=S0, backend=backend,
                                    chunk_size=self.options.chunk_size, mask=mask)
            return o, (S, None)
        if backend == "kernel" and q.shape[1] > 1:
            return normalised_in_the_recurrence(q, k, v, S0, z0, eps=self.options.eps, backend=backend,
                                                chunk_size=self.options.chunk_size, mask=mask)
        o, S = linear_attention(q, k, v, scale=1.0, prior=S0, backend=backend, chunk_size=self.options.chunk_size,
                                mask=mask)
        z = k.float().cumsum(1)  # [B, T, H, K]
        if z0 is not None:
            z = z + z0.unsqueeze(1)
        denom = (q.float() * z).sum(-1, keepdim=True) + self.options.eps
        return (o.float() / denom).to(o.dtype), (S, z[:, -1])


def normalised_in_the_recurrence(q, k, v, S0, z0, *, eps: float, backend: str, chunk_size: int, mask=None):
    """Normalised linear attention with the normaliser carried by the recurrence itself: a value column of ones
    makes the state's column V equal z_t = sum_{s<=t} phi(k_s) and the output's entry V equal phi(q_t) . z_t, so
    one recurrence call gives numerator and denominator. Equal to the explicit form of `LinearAttention._mix`; on
    the GPU it replaces a float32 cumsum over T and its backward (1.5 ms of a 4.9 ms layer at the 1.7B layout,
    docs/KERNELS.md) with one or two more value columns in the kernel (two for an even V: fla's 16-bit backward
    asserts an even V). -> (o, (S, z))."""
    V = v.shape[-1]
    ones = 2 - V % 2
    v1 = torch.cat([v, v.new_ones(*v.shape[:-1], ones)], dim=-1)
    prior = None
    if S0 is not None or z0 is not None:
        B, _, H, K = k.shape
        S0 = S0 if S0 is not None else k.new_zeros(B, H, K, V, dtype=torch.float32)
        z0 = z0 if z0 is not None else k.new_zeros(B, H, K, dtype=torch.float32)
        prior = torch.cat([S0.float(), z0.float().unsqueeze(-1).expand(B, H, K, ones)], dim=-1)
    o1, S1 = linear_attention(q, k, v1, scale=1.0, prior=prior, backend=backend, chunk_size=chunk_size, mask=mask)
    o = (o1[..., :V] / (o1[..., V:V + 1].float() + eps)).to(v.dtype)
    return o, (S1[..., :V].contiguous(), S1[..., V].contiguous())
