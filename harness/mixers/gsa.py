"""Gated Slot Attention (Zhang et al., 2024) as fla's GatedSlotAttention and fla-org/hybrid-distillation's GSA
students: per head, M memory slots that keys and values write into with one forget gate per slot and token,
alpha_t = exp(g_t), g_t = logsigmoid(W_f x_t + b_f) / n (n = `gate_logit_normalizer`), and write strength
s_t = 1 - alpha_t. Two passes of gated linear attention share the gate:

    hk = hk Diag(alpha_t) + k_t s_t^T          p_t = softmax(scale hk^T q_t)      (which slots the query reads)
    hv = Diag(alpha_t) hv + s_t v_t^T          o_t = hv^T p_t                     (what they hold of the values)

then RMSNorm over all heads' channels (fla's g_norm; after SiLU with `output_activation: silu`) before o_proj.
q, k, v are the teacher's projections (what hybrid-distillation copies), with fla's SiLU on them under
`qkv_activation: silu`; the slot gate W_f, b_f and the norm are new.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from harness.mixers.base import Mixer, MixerOptions, no_weight_decay
from harness.mixers.dispatch import gated_slot_attention
from harness.mixers.kernel_case import KernelCase
from harness.mixers.kernels import GSA_KERNEL

ACTIVATIONS = ("silu", "identity")
QK_SCALES = ("one", "head_dim")
SLOT_DECAY_INITS = ("uniform", "spread")
SPREAD_MEMORY = (2.0, 512.0)  # slot_decay_init spread: memories 1 / (1 - alpha) from 2 to 512 tokens at step 0


@dataclass
class GSAOptions(MixerOptions):
    num_slots: int = field(
        default=64, metadata={"help": "Memory slots per head (M): 64, as fla-org/hybrid-distillation's GSA students "
                              "(fla's layer defaults to head_dim)."})
    qkv_activation: str = field(
        default="identity", metadata={"help": "identity keeps the copied q, k, v linear, as the teacher's are; silu: "
                                      "SiLU on q and k (fla's swish feature map) and on v, as fla's layer "
                                      "(docs/TRANSFER.md)."})
    output_activation: str = field(
        default="identity", metadata={"help": "Before the output RMSNorm: silu (fla's layer) or identity "
                                      "(docs/TRANSFER.md)."})
    qk_scale: str = field(
        default="head_dim", metadata={"help": "Scale of q . k in the slot scores before their softmax: head_dim "
                                      "(head_dim^-1/2, the teacher's softmax scale) or one (fla's layer, scale 1)."})
    gate_logit_normalizer: float = field(
        default=8.0, metadata={"help": "n of the forget gate alpha = sigmoid(W_f x + b_f)^(1/n) (fla's, 8): a "
                               "larger n keeps alpha nearer 1."})
    slot_decay_init: str = field(
        default="spread", metadata={"help": "The slot gate's bias b_f: spread, one bias per slot so that the slots' "
                                    "memories 1 / (1 - alpha) start log-spaced from 2 to 512 tokens (closer to the "
                                    "teacher at step 0, docs/TRANSFER.md); uniform, 0 for every slot, fla's layer "
                                    "(which has no bias): every slot starts at alpha ~ 0.5^(1/n), 0.917 at n = 8."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.num_slots, bool) or not isinstance(self.num_slots, int) or self.num_slots < 1:
            raise ValueError(f"num_slots={self.num_slots!r} must be an integer >= 1")
        if not self.gate_logit_normalizer > 0:
            raise ValueError(f"gate_logit_normalizer={self.gate_logit_normalizer} must be > 0")
        self.check_choice("qkv_activation", ACTIVATIONS)
        self.check_choice("output_activation", ACTIVATIONS)
        self.check_choice("qk_scale", QK_SCALES)
        self.check_choice("slot_decay_init", SLOT_DECAY_INITS)


def spread_gate_bias(slots: int, normalizer: float) -> torch.Tensor:
    """The bias b `[slots]` with sigmoid(b)^(1/n) = alpha_m, 1 / (1 - alpha_m) log-spaced over SPREAD_MEMORY."""
    low, high = (math.log(m) for m in SPREAD_MEMORY)
    memory = torch.exp(torch.linspace(low, high, slots, dtype=torch.float64)) if slots > 1 \
        else torch.tensor([SPREAD_MEMORY[0]], dtype=torch.float64)
    return torch.logit((1 - 1 / memory) ** normalizer).float()


class GSA(Mixer):
    name = "gsa"
    Options = GSAOptions
    kernel_case = KernelCase(route=GSA_KERNEL, recurrence="gsa", gate="slot")

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        inner = shape.num_heads * shape.head_dim
        self.f_proj = nn.Linear(shape.hidden_size, shape.num_heads * options.num_slots, bias=True)
        no_weight_decay(self.f_proj.bias)  # the slots' decays at step 0, as the other mixers' dt_bias
        self.o_norm = nn.RMSNorm(inner, eps=1e-5)
        self.reset_new_parameters()

    def project_qkv(self, x, state, use_cache, mask=None, projected=None):
        q, k, v, _ = super().project_qkv(x, state, use_cache, mask, projected)
        if self.options.qkv_activation == "silu":
            q, k, v = F.silu(q), F.silu(k), F.silu(v)
        return q, k, v, None

    def slot_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, g) `[B, T, H, M]` float32: the slots' write strengths 1 - alpha and log decays log alpha."""
        f = self.f_proj(x).float().unflatten(-1, (self.shape.num_heads, self.options.num_slots))
        g = F.logsigmoid(f) / self.options.gate_logit_normalizer
        return -torch.expm1(g), g

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        s, g = self.slot_gate(x)
        scale = 1.0 if self.options.qk_scale == "one" else self.shape.head_dim ** -0.5
        # kernel: fla chunk_gsa; reference: recurrence.chunk_gsa
        return gated_slot_attention(q, k, v, s, g, scale=scale, prior=prior, backend=backend,
                                    chunk_size=self.options.chunk_size, mask=mask)

    def _output(self, x, o):
        y = F.silu(o.float()) if self.options.output_activation == "silu" else o.float()
        y = F.rms_norm(y.flatten(-2), (y.shape[-2] * y.shape[-1],), self.o_norm.weight.float(), self.o_norm.eps)
        return y.unflatten(-1, o.shape[-2:]).to(o.dtype)

    @torch.no_grad()
    def reset_new_parameters(self) -> None:
        nn.init.normal_(self.f_proj.weight, std=0.02)
        if self.options.slot_decay_init == "spread":
            bias = spread_gate_bias(self.options.num_slots, self.options.gate_logit_normalizer)
            self.f_proj.bias.copy_(bias.repeat(self.shape.num_heads))
        else:
            self.f_proj.bias.zero_()
        self.o_norm.weight.fill_(1.0)

    @classmethod
    def new_parameter_names(cls):
        return ("f_proj", "o_norm")
