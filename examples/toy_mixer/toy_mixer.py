"""toy_decay, a harness mixer plug-in: linear attention with a learned decay per head,
S_t = gamma_h S_{t-1} + k_t v_t^T, o_t = S_t^T q_t / sqrt(D), gamma_h = sigmoid(decay_logit_h), then a per-head
RMSNorm before the teacher's o_proj. Plain PyTorch on every backend: a quadratic parallel form for a whole
sequence (training, prefill), the same formula for one-token decoding steps from the state S `[B, H, D, D]`.

The worked example of docs/MIXERS.md: what a mixer defines (options, new parameters and their init, `_mix`,
`_output`), what it inherits from `harness.mixers.Mixer` (q/k/v/o projections copied from the teacher's attention,
GQA expansion, RoPE, the sliding window, the output-scale fit), and how padding and decoding states work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from harness.mixers import Mixer, MixerOptions, no_weight_decay
from harness.mixers.base import HeadRMSNorm


@dataclass
class ToyDecayOptions(MixerOptions):
    """The options every mixer takes (rope, chunk_size, window, backend, output_scale), and this one's own."""

    initial_decay: float = field(default=0.9, metadata={"help": "gamma of every head at step 0, in (0, 1)."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.initial_decay < 1.0:
            raise ValueError(f"initial_decay={self.initial_decay} must lie in (0, 1)")


class ToyDecay(Mixer):
    name = "toy_decay"
    Options = ToyDecayOptions

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)  # q_proj, k_proj, v_proj, o_proj of the teacher's shape
        self.decay_logit = no_weight_decay(nn.Parameter(torch.zeros(shape.num_heads)))
        self.o_norm = HeadRMSNorm(shape.head_dim)
        self.reset_new_parameters()

    def reset_new_parameters(self) -> None:
        """The parameters the teacher does not have (the student builder calls this after copying q/k/v/o)."""
        gamma = self.options.initial_decay
        with torch.no_grad():
            self.decay_logit.fill_(math.log(gamma / (1 - gamma)))
            self.o_norm.weight.fill_(1.0)

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        """q, k, v `[B, T, H, D]`, prior: the state S `[B, H, D, D]` or None -> (o `[B, T, H, D]`, S after the last
        token). mask (bool `[B, T]`, False at padding): a padded token neither writes nor decays the state."""
        log_decay = F.logsigmoid(self.decay_logit.float()).expand(*x.shape[:2], -1)  # [B, T, H]
        if mask is not None:
            k = torch.where(mask[..., None, None], k, 0.0)
            log_decay = torch.where(mask[..., None], log_decay, 0.0)
        return decayed_linear_attention(q.float(), k.float(), v.float(), log_decay, prior,
                                        scale=self.shape.head_dim ** -0.5)

    def _output(self, x, o):
        return self.o_norm(o)

    @classmethod
    def new_parameter_names(cls):
        return ("decay_logit", "o_norm")


def decayed_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                             prior: Optional[torch.Tensor], *, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """With G_t = sum_{u<=t} log_decay_u: o_t = scale (sum_{s<=t} exp(G_t - G_s) (q_t . k_s) v_s + exp(G_t) S0^T q_t)
    and S_T = exp(G_T) S0 + sum_s exp(G_T - G_s) k_s v_s^T. Quadratic in T (a toy, not a chunked kernel)."""
    G = log_decay.cumsum(1).transpose(1, 2)  # [B, H, T]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
    T = q.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    weights = torch.where(causal, G[..., :, None] - G[..., None, :], float("-inf")).exp()  # [B, H, T, T]
    o = (qh @ kh.transpose(-1, -2) * weights) @ vh
    state = (kh * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2) @ vh  # [B, H, D, D]
    if prior is not None:
        o = o + G.exp()[..., None] * (qh @ prior)
        state = state + G[..., -1].exp()[..., None, None] * prior
    return (scale * o).transpose(1, 2), state
