"""Forgetting Transformer attention, FoX (Lin et al. 2025, "Forgetting Transformer: Softmax Attention with a Forget
Gate"), as fla 0.6.0's ForgettingAttention (fla/layers/forgetting_attn.py): causal softmax attention whose logits are
lowered, per head, by the forget gates between key and query. Quadratic in the sequence, unlike the linear mixers,
and it decodes from a KV cache that grows by a token per step (`FoxCache`), not from a fixed-size state.

    o_i = sum_{j<=i} softmax_j(scale q_i.k_j + G_i - G_j) v_j,  G_i = sum_{l<=i} log f_l,  f_t = sigmoid(w_f x_t + b_f)

(fla's naive_forgetting_attn): the logit of key j at query i is lowered by sum_{l=j+1..i} -log f_l.

Transfer (docs/TRANSFER.md): q/k/v/o with their biases and q/k norms are the teacher's, and so are its softmax scale
(`MixerShape.attention_scale`), its soft-capping (Gemma 2) and, with `rope` (on by default here), its RoPE; fla's
layer and the paper's FoX have no RoPE (`rope: false`). The forget gate f_proj is new: w_f = 0 and b_f =
`forget_bias`, so that f = sigmoid(b_f) ~ 1 for every token and the layer starts as the teacher's attention with each
logit lowered by (i - j) log(1 + exp(-b_f)).

Which path computes it (`_kernel_takes`): on the kernel backend, fla's parallel_forgetting_attn
(`kernels.kernel_forgetting_attention`, in bf16 for float32 layers as the recurrences' kernels) for a whole unpadded
sequence without soft-capping (training); everything else (the reference backend, padding, a cache before the tokens,
as in every decoding step, soft-capping) `forgetting_attention`'s PyTorch form, the reference: queries in blocks of
`chunk_size`, softmax in float32. As window.py routes its sliding window.

The cache holds every token's key, value and G, and which slots are real tokens: a padded token is no key and does
not decay (its log f counts as 0), so a padded row computes at its real tokens what it computes alone, and decoding
steps need no mask. Its keys are cached after RoPE, at the model's positions, which count a row's real tokens only
(`HarnessModel._positions`), as a kept attention layer's KVState. window.py instead caches keys before RoPE and
rotates them by their place in the window, so that its fixed-size cache needs no position counter; a cache that
grows keeps no fixed shape anyway, and would rotate all its keys again at every step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from harness.mixers import kernels
from harness.mixers.base import Mixer, MixerOptions, no_weight_decay
from harness.mixers.kernel_case import KernelCase
from harness.mixers.ops import stack_rows_left_padded


@dataclass
class FoxOptions(MixerOptions):
    rope: bool = field(
        default=True, metadata={"help": "Apply the teacher's rotary embedding to q and k: on, the layer is the "
                                "teacher's attention at step 0 but for the forget gate; off, FoX as fla's layer and "
                                "the paper have it (no position encoding but the forget gate; docs/TRANSFER.md)."})
    forget_bias: float = field(
        default=8.0, metadata={"help": "b_f of the forget gate f = sigmoid(w_f x + b_f), whose weight w_f starts at 0: "
                               "every f starts at sigmoid(b_f), lowering the logit of a key d tokens back by "
                               "d log(1 + exp(-b_f)): 3.4e-4 d at 8 (a decay time -1 / log f of 2,981 tokens), 0.0067 "
                               "d at 5 (149 tokens), 4.5e-5 d at 10 (22,026 tokens). Larger starts closer to the "
                               "teacher, with a gate whose slope 1 - f is smaller (docs/TRANSFER.md)."})


class FoxCache(NamedTuple):
    """Every token seen: keys `[B, S, H, D]` (after RoPE), values `[B, S, H, V]`, the cumulative log forget gate G
    `[B, S, H]` (float32; a padded token adds 0) and which slots are real tokens `[B, S]` (False at padding)."""

    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    valid: torch.Tensor

    stack_left_padded = staticmethod(stack_rows_left_padded)  # rows' caches as one batch, left-padded: no real slots


def forgetting_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_f: torch.Tensor, *, scale: float,
                         mask: Optional[torch.Tensor] = None, prior: Optional[FoxCache] = None,
                         softcap: Optional[float] = None, backend: str = "reference",
                         chunk_size: int = 64) -> tuple[torch.Tensor, FoxCache]:
    """q, k `[B, T, H, D]` (after RoPE), v `[B, T, H, V]`, log_f `[B, T, H]` (the log forget gates, <= 0) -> (o
    `[B, T, H, V]` in v's dtype, the cache after these tokens). mask: bool `[B, T]`, False at padding. prior: the cache
    of the tokens before these, whose keys come first. softcap: cap * tanh(s / cap) on scale q.k (Gemma 2), before the
    forget gates are added. backend: the resolved backend; on 'kernel' fla's kernel computes the cases it takes
    (`_kernel_takes`), else the PyTorch form with queries in blocks of chunk_size (scores `[B, H, chunk_size, keys]`,
    float32). A padded query sees no key: its output is 0."""
    valid = torch.ones(q.shape[:2], dtype=torch.bool, device=q.device) if mask is None else mask.bool()
    log_f = torch.where(valid[..., None], log_f.float(), 0.0)
    g = log_f.cumsum(1) if prior is None else prior.g[:, -1:] + log_f.cumsum(1)
    cache = FoxCache(k, v, g, valid)
    if prior is not None:
        cache = FoxCache(*(torch.cat([old.to(new.dtype), new], 1) for old, new in zip(prior, cache)))
    if _kernel_takes(q, backend, mask=mask, prior=prior, softcap=softcap):
        return kernels.kernel_forgetting_attention(q, k, v, log_f, scale=scale), cache
    past, length = cache.k.shape[1] - q.shape[1], q.shape[1]
    keys, values, key_g = cache.k.float(), cache.v.float(), cache.g.transpose(1, 2)[:, :, None]  # [B, H, 1, S]
    out = []
    for start in range(0, length, chunk_size):
        stop = min(length, start + chunk_size)
        seen = past + stop  # the block's keys: every one up to its last query
        scores = torch.einsum("bthd,bshd->bhts", q[:, start:stop].float(), keys[:, :seen]) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores + g[:, start:stop].transpose(1, 2)[..., None] - key_g[..., :seen]
        own = past + torch.arange(start, stop, device=q.device)[:, None]
        allowed = (torch.arange(seen, device=q.device)[None] <= own) & cache.valid[:, None, None, :seen]
        probs = torch.nan_to_num(scores.masked_fill(~allowed, -math.inf).softmax(-1), nan=0.0)
        out.append(torch.einsum("bhts,bshd->bthd", probs, values[:, :seen]))
    return torch.cat(out, 1).to(v.dtype), cache


def _kernel_takes(q: torch.Tensor, backend: str, *, mask, prior, softcap) -> bool:
    """Whether fla's kernel computes these tokens: the kernel backend, no cache before them, no soft-capping, a
    head_dim parallel_attn holds, and no padding (mask None or all True; the check of its values, a host sync, last)."""
    return (backend == "kernel" and prior is None and softcap is None
            and q.shape[-1] <= kernels.WINDOW_KERNEL_MAX_HEAD_DIM and (mask is None or bool(mask.all())))


class Fox(Mixer):
    name = "fox"
    Options = FoxOptions
    kernel_case = KernelCase(route=kernels.FOX_KERNEL, recurrence="forgetting_attn", gate="forget")
    growing_state = True

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        self.f_proj = nn.Linear(shape.hidden_size, shape.num_heads, bias=True)
        no_weight_decay(self.f_proj.bias)  # the gates' memory at step 0, as the other mixers' decay biases
        self.reset_new_parameters()

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        log_f = F.logsigmoid(self.f_proj(x).float())
        # kernel: fla parallel_forgetting_attn; reference: forgetting_attention's blocks (and every decoding step)
        return forgetting_attention(q, k, v, log_f, scale=self.shape.attention_scale, mask=mask, prior=prior,
                                    softcap=self.shape.softcap, backend=backend, chunk_size=self.options.chunk_size)

    @torch.no_grad()
    def reset_new_parameters(self) -> None:
        self.f_proj.weight.zero_()
        self.f_proj.bias.fill_(self.options.forget_bias)

    @classmethod
    def new_parameter_names(cls):
        return ("f_proj",)
