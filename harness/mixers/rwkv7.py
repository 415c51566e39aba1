"""RWKV-7 "Goose" (Peng et al., 2025) as RADLADS (Goldstein et al., 2025) converts attention into it: the delta
rule with a diagonal-plus-low-rank transition, in fla's layout (the state S `[K, V]` per head),

    S_t = Diag(w_t) S_{t-1} - (kk_t * a_t) (kk_t^T S_{t-1}) + k~_t v_t^T,    o_t = S_t^T r_t,

with a per-channel decay w_t = exp(-exp(-0.5) sigmoid(w0 + LoRA_w(x_t))) in [0.545, 1) (RWKV-7's
exp(-exp(-0.5 - softplus(-z)))), the in-context learning rate a_t = sigmoid(a0 + LoRA_a(x_t)), the removal key
kk_t = l2norm(k_t * k_k) per head, and the written key k~_t = k_t (1 + (a_t - 1) k_a); then a GroupNorm per head
and the gate LoRA_g(x_t) = sigmoid(x_t G1) G2 before o_proj. r, k, v, o are the teacher's q, k, v, o (what RADLADS
copies; K and V expanded over the query heads).

What RADLADS' conversion keeps of RWKV-7 (its training code's `TMix_qwen3rwkv7`; docs/TRANSFER.md): no token
shift (every projection reads x_t itself), no bonus term (r_k is allocated there but never used), the value
residual, the GroupNorm and the low-rank gate. This mixer drops the value residual too: RWKV-7's "v first" lerps
every layer's v towards layer 0's (by sigmoid(1) = 0.73 at RADLADS' init), which a mixer cannot do on its own (it
sees only its layer's input; stages 1 and 2 train each layer apart from the others, on the teacher's activations),
and which at step 0 would replace most of every layer's copied values by another layer's. The GroupNorm has no
bias, so that the layer reads its values only through v (with v = 0 it outputs 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from harness.mixers.base import GateOptions, Mixer, no_weight_decay
from harness.mixers.dispatch import dplr_delta
from harness.mixers.kernel_case import KernelCase
from harness.mixers.ops import l2norm

DECAY_INITS = ("radlads", "rwkv7")
DECAY_SCALE = math.exp(-0.5)  # -log w = DECAY_SCALE * sigmoid(.): every decay w lies in [exp(-DECAY_SCALE), 1)
REMOVAL_KEY_SCALE, WRITE_KEY_MIX = 0.85, 1.0  # RADLADS' k_k and k_a


@dataclass
class RWKV7Options(GateOptions):
    gate_init: str = field(
        default="open", metadata={"help": "The gate sigmoid(x G1) G2 starts constant (G1 = 0) either way; open: G2's "
                                  "rows each sum to 2, so the gate is 1 and the mixer passes its normalised recurrence "
                                  "output to the copied o_proj at step 0; random: G2 orthogonal with gain 0.1 "
                                  "(RWKV-7's and RADLADS' init), a small constant of random sign per channel."})
    decay_init: str = field(
        default="radlads", metadata={"help": "The decay's bias w0 over the H x K channels, from the slowest (channel "
                                     "0) to the fastest, the layer's depth d = l / (L - 1) shaping the spread: "
                                     "radlads, -6.5 + 5 (n / (N - 1))^(0.85 + d^0.5) (RADLADS: decays 0.9991-0.90 a "
                                     "token); rwkv7, RWKV-7's and fla's, -5.5 + 6 (n / (N - 1))^(1 + d^0.3) plus a "
                                     "zigzag of +-2.5 within each head (down to 0.56). docs/TRANSFER.md."})
    iclr_bias: float = field(
        default=-2.0, metadata={"help": "a0, the in-context learning rate's bias: a = sigmoid(a0 + LoRA(x)) is how "
                                "much of the removal key's direction each token replaces; -2: a = 0.12 at step 0 (it "
                                "ended stage 1 lowest, docs/TRANSFER.md); 0: 1/2 (RADLADS' and RWKV-7's); -4: 0.018, "
                                "nearly a decayed linear attention."})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("decay_init", DECAY_INITS)


def lora_rank(hidden_size: int, exponent: float, multiplier: float) -> int:
    """RADLADS' LoRA rank: hidden^exponent * multiplier rounded to a multiple of 32, at least 32."""
    return max(1, round(hidden_size**exponent * multiplier / 32)) * 32


class LowRank(nn.Module):
    """RWKV-7's LoRA, up(act(down(x))): down `[rank, in]` without bias, up `[out, rank]` with an optional bias."""

    def __init__(self, in_features: int, out_features: int, rank: int, activation: Optional[str], bias: bool):
        super().__init__()
        self.down = nn.Linear(in_features, rank, bias=False)
        self.up = nn.Linear(rank, out_features, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(x)
        if self.activation == "tanh":
            h = torch.tanh(h)
        elif self.activation == "sigmoid":
            h = torch.sigmoid(h)
        return self.up(h)

    @torch.no_grad()
    def reset_parameters(self, bias: Optional[torch.Tensor] = None) -> None:
        """RWKV-7's (fla's and RADLADS'): down 0, up orthogonal with gain 0.1 (times sqrt(rank / out) when the rank
        is the larger), the bias as given (else 0). The LoRA starts constant, and its down weights learn through
        the random up."""
        nn.init.zeros_(self.down.weight)
        out, rank = self.up.weight.shape
        gain = 0.1 * (math.sqrt(rank / out) if rank > out else 1.0)
        self.up.weight.copy_(nn.init.orthogonal_(torch.empty(out, rank), gain=gain))
        if self.up.bias is not None:
            self.up.bias.copy_(torch.zeros(out) if bias is None else bias)


class HeadGroupNorm(nn.Module):
    """RWKV-7's GroupNorm with one group per head (a LayerNorm over each head's channels, eps head_dim x 1e-5) and a
    weight per channel, without its bias."""

    centred = True  # subtracts each head's mean (an RMSNorm does not)

    def __init__(self, num_heads: int, head_dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))
        self.eps = head_dim * eps

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        """o `[B, T, H, D]` -> float32 `[B, T, H, D]`."""
        return F.layer_norm(o.float(), o.shape[-1:], eps=self.eps) * self.weight.float().view(o.shape[-2:])


def decay_bias(how: str, channels: int, head_dim: int, depth: float) -> torch.Tensor:
    """w0 `[channels]` (options.decay_init): the decay's logit, -log w = exp(-0.5) sigmoid(w0) at step 0."""
    position = torch.arange(channels, dtype=torch.float32) / max(channels - 1, 1)
    if how == "radlads":
        return -6.5 + 5.0 * position ** (0.85 + depth**0.5)
    half = (head_dim - 1) / 2
    zigzag = (torch.arange(channels) % head_dim - half) / half if half > 0 else torch.zeros(channels)
    return -5.5 + 6.0 * position ** (1.0 + depth**0.3) + 2.5 * zigzag * zigzag.abs()


class RWKV7(Mixer):
    name = "rwkv7"
    Options = RWKV7Options
    kernel_case = KernelCase(route="rwkv7", recurrence="dplr_delta", features="raw", gate="rwkv7")

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        inner, hidden = shape.num_heads * shape.head_dim, shape.hidden_size
        self.w_lora = LowRank(hidden, inner, lora_rank(hidden, 0.5, 1.8), "tanh", bias=True)
        self.a_lora = LowRank(hidden, inner, lora_rank(hidden, 0.5, 1.8), None, bias=True)
        self.g_lora = LowRank(hidden, inner, lora_rank(hidden, 0.8, 0.6), "sigmoid", bias=False)
        no_weight_decay(self.w_lora.up.bias)
        no_weight_decay(self.a_lora.up.bias)
        self.k_k = no_weight_decay(nn.Parameter(torch.zeros(inner)))
        self.k_a = no_weight_decay(nn.Parameter(torch.zeros(inner)))
        self.o_norm = HeadGroupNorm(shape.num_heads, shape.head_dim)
        self.num_layers: Optional[int] = None  # the teacher's depth, read at transfer (decay_init's d)
        self.reset_new_parameters()

    def transfer_from_attention(self, attn: nn.Module) -> None:
        super().transfer_from_attention(attn)
        self.num_layers = getattr(getattr(attn, "config", None), "num_hidden_layers", None)

    def depth(self) -> float:
        """l / (L - 1), the layer's place in the teacher (0 when built without one)."""
        layers = self.num_layers or 1
        return self.layer_idx / (layers - 1) if layers > 1 else 0.0

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        g = -DECAY_SCALE * torch.sigmoid(self._heads(self.w_lora(x).float()))
        iclr = torch.sigmoid(self._heads(self.a_lora(x).float()))
        removal = l2norm(k.float() * self._heads(self.k_k.float()))
        written = k.float() * (1 + (iclr - 1) * self._heads(self.k_a.float()))
        # kernel: fla chunk_rwkv7; reference: recurrence.chunk_dplr_delta
        return dplr_delta(q, written, v, -removal, removal * iclr, g, scale=1.0, prior=prior, backend=backend,
                          chunk_size=self.options.chunk_size, mask=mask, decay_floor=-DECAY_SCALE)

    def _output(self, x, o):
        return (self.o_norm(o) * self._heads(self.g_lora(x).float())).to(o.dtype)

    @torch.no_grad()
    def reset_new_parameters(self) -> None:
        s = self.shape
        inner = s.num_heads * s.head_dim
        self.w_lora.reset_parameters(decay_bias(self.options.decay_init, inner, s.head_dim, self.depth()))
        self.a_lora.reset_parameters(torch.full((inner,), float(self.options.iclr_bias)))
        self.g_lora.reset_parameters()
        if self.options.gate_init == "open":  # sigmoid(0) = 1/2 times each row's sum 2: the gate is 1 everywhere
            up = self.g_lora.up.weight
            up.add_(2.0 / up.shape[1] - up.mean(1, keepdim=True))
        self.k_k.fill_(REMOVAL_KEY_SCALE)
        self.k_a.fill_(WRITE_KEY_MIX)
        self.o_norm.weight.fill_(1.0)

    @classmethod
    def new_parameter_names(cls):
        return ("w_lora", "a_lora", "g_lora", "k_k", "k_a", "o_norm")
