"""Linear Attention (Katharopoulos et al., 2020): S_t = S_{t-1} + phi(k_t) v_t^T, o_t = S_t^T phi(q_t) / z_t.

The optional normaliser z_t = phi(q_t) . sum_{s<=t} phi(k_s) is carried as a second state `[B, H, K]`.
No output gate or norm: the teacher's o_proj reads the mixed values directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn.functional as F

from harness.mixers.base import Mixer, MixerOptions, run_gated_delta

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
        if self.feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map='{self.feature_map}' is not one of {', '.join(FEATURE_MAPS)}")


class LinearAttention(Mixer):
    name = "linear_attn"
    Options = LinearAttnOptions

    def _mix(self, x, q, k, v, prior, backend):
        phi = FEATURE_MAPS[self.options.feature_map]
        q, k = phi(q), phi(k)
        scale = 1.0 if self.options.normalize else self.shape.head_dim**-0.5
        S0, z0 = prior if prior is not None else (None, None)
        o, S = run_gated_delta(q, k, v, None, None, scale=scale, prior=S0, backend=backend,
                               chunk_size=self.options.chunk_size)
        if not self.options.normalize:
            return o, (S, None)
        z = k.float().cumsum(1)  # [B, T, H, K]
        if z0 is not None:
            z = z + z0.unsqueeze(1)
        denom = (q.float() * z).sum(-1, keepdim=True) + self.options.eps
        return (o.float() / denom).to(o.dtype), (S, z[:, -1])
