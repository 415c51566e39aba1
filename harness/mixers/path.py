"""PaTH attention (Yang et al. 2025, "PaTH Attention: Position Encoding via Accumulating Householder
Transformations"), as fla 0.6.0's PaTHAttention (fla/layers/path_attn.py): causal softmax attention in which the key
of token j, as query i sees it, has passed through the Householder-like transforms of every token after it:

    o_i = sum_{j<=i} softmax_j(scale (q_i . H_i H_{i-1} ... H_{j+1} k_j + G_i - G_j)) v_j,  H_t = I - beta_t w_t w_t^T

(fla's naive_path_attn). w_t = l2norm(SiLU(conv(w_proj x))) per KV head (a low-rank w_proj and a short convolution of
width 3, as fla's defaults), beta_t = 2 sigmoid(bt_proj x_t) in (0, 2) per KV head (beyond 1 an eigenvalue turns
negative), both expanded to the query heads as k is; G is the optional forget gate's cumulative log sigmoid(g_proj x)
per query head (fla's `use_forget_gate`, PaTH-FoX), which, unlike fox's, fla scales by `scale` with the logits.

Transfer (docs/TRANSFER.md): q/k/v/o with their biases and q/k norms are the teacher's, and so are its softmax scale,
its soft-capping (Gemma 2, on scale q.Hk before the gate) and, with `rope` (on by default here), its RoPE on q and k
before the transforms; fla's layer has no RoPE (`rope: false`). bt_proj is new with weight 0 and bias `beta_bias`
(-8: beta = 6.7e-4 for every token), so every H_t starts near the identity and the layer near the teacher's
attention; w_proj and the convolution start at PyTorch's default (random) init, as fla's, so that the directions
already differ from token to token; the forget gate's weight 0 and bias `forget_bias`, as fox's.

Which path computes it (`_kernel_takes`): on the kernel backend, fla's parallel_path_attn
(`kernels.kernel_path_attention`, q/k/v in bf16 for float32 layers, w and beta in float32) for a whole unpadded
sequence without soft-capping at a head_dim it takes (16, 32, 64, 128); everything else `path_attention`'s PyTorch
form, the reference: queries in blocks of `chunk_size`, each block's transforms in the compact WY form (one
triangular solve), the keys before it held transformed up to the block's start, all in float32.

The cache (`PathCache`) holds every token's key as the last token sees it (transformed by every H since), so that a
decoding step applies its token's H_t to every cached key (fla's rank_one_update) and appends its own key untouched;
the keys are float32 (fla keeps them in k's dtype: each step would round every key again). A padded token is no key,
its beta and log f count as 0 (no transform, no decay) and its convolution input as 0, so a padded row computes at
its real tokens what it computes alone. The convolution's input (w_proj x) of every token is cached too, its last
two real slots the convolution's tail, so that all of the state is one cache of slots that left padding marks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from harness.mixers import kernels
from harness.mixers.base import Mixer, MixerOptions, ShortConv, no_weight_decay
from harness.mixers.kernel_case import KernelCase
from harness.mixers.ops import l2norm, stack_rows_left_padded

W_RANK = 32  # fla's low-rank w_proj: hidden -> 32 -> KV heads x head_dim


@dataclass
class PathOptions(MixerOptions):
    rope: bool = field(
        default=True, metadata={"help": "Apply the teacher's rotary embedding to q and k before the transforms: on, "
                                "the layer is the teacher's attention at step 0 but for beta; off, PaTH as fla's layer "
                                "and the paper have it (the transforms are its only position encoding; "
                                "docs/TRANSFER.md)."})
    beta_bias: float = field(
        default=-8.0, metadata={"help": "Bias of beta = 2 sigmoid(bt_proj x), whose weight starts at 0: every "
                                "beta starts at 2 sigmoid(beta_bias), 6.7e-4 at -8, 0.036 at -4, 1 at 0 (fla's "
                                "init, a projection at every token). More negative starts closer to the teacher, "
                                "with a slope d beta / d bias ~ beta that is smaller (docs/TRANSFER.md)."})
    low_rank_w: bool = field(default=True, metadata={"help": "w_proj as fla's default: hidden -> 32 -> KV "
                                                     "heads x head_dim; false: one full linear map."})
    w_conv: bool = field(default=True, metadata={"help": "Short convolution + SiLU on w_proj's output (fla's "
                                                 "use_w_shortconv)."})
    conv_size: int = field(default=3, metadata={"help": "Width of w's short convolution (fla's default 3)."})
    forget_gate: bool = field(default=False, metadata={"help": "PaTH-FoX: a forget gate per query head as fla's "
                                                       "use_forget_gate, its log added to the logits before scale."})
    forget_bias: float = field(default=8.0, metadata={"help": "With forget_gate: the gate's bias; its weight starts "
                                                      "at 0 (as fox's forget_bias)."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.conv_size < 1:
            raise ValueError(f"conv_size={self.conv_size} must be >= 1")


class PathCache(NamedTuple):
    """Every token seen: keys `[B, S, H, D]` (float32, after RoPE, transformed by every token's H since), values
    `[B, S, H, V]`, the cumulative log forget gate G `[B, S, H]` (float32; 0 without the gate), which slots are real
    tokens `[B, S]` and the convolution's input `[B, S, C]` (w_proj x, 0 at padding; C = 0 without a convolution)."""

    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    valid: torch.Tensor
    conv_in: torch.Tensor

    stack_left_padded = staticmethod(stack_rows_left_padded)  # rows' caches as one batch, left-padded: no real slots


def path_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
                   log_f: Optional[torch.Tensor] = None, *, scale: float, mask: Optional[torch.Tensor] = None,
                   prior: Optional[PathCache] = None, softcap: Optional[float] = None, backend: str = "reference",
                   chunk_size: int = 64, conv_in: Optional[torch.Tensor] = None, want_cache: bool = True,
                   ) -> tuple[torch.Tensor, Optional[PathCache]]:
    """q, k, w `[B, T, H, D]` (q, k after RoPE; w unit or 0), v `[B, T, H, V]`, beta `[B, T, H]`, log_f `[B, T, H]`
    (the log forget gates, or None) -> (o `[B, T, H, V]` in v's dtype, the cache after these tokens, or None on the
    kernel route without `want_cache`). mask: bool `[B, T]`, False at padding. prior: the cache of the tokens before.
    softcap: cap * tanh(s / cap) on scale q.Hk, before the gates. conv_in: `[B, T, C]`, stored in the cache as is.
    A padded query sees no key: its output is 0."""
    B, T, H, D = q.shape
    valid = torch.ones(B, T, dtype=torch.bool, device=q.device) if mask is None else mask.bool()
    beta = torch.where(valid[..., None], beta.float(), 0.0)
    gated = log_f is not None
    log_f = torch.where(valid[..., None], log_f.float(), 0.0) if gated else q.new_zeros(B, T, H, dtype=torch.float32)
    g = log_f.cumsum(1) if prior is None else prior.g[:, -1:] + log_f.cumsum(1)
    conv_in = q.new_zeros(B, T, 0) if conv_in is None else conv_in
    tail = PathCache(k.new_zeros(B, 0, H, D).float(), v[:, :0], g[:, :0], valid[:, :0], conv_in[:, :0])
    before = prior if prior is not None else tail
    if _kernel_takes(q, v, backend, mask=mask, prior=prior, softcap=softcap):
        o, keys = kernels.kernel_path_attention(q, k, v, w, beta, log_f if gated else None, scale=scale,
                                                want_cache=want_cache)
        if not want_cache:
            return o, None
        return o, PathCache(keys.float(), v, g, valid, conv_in)
    keys, key_g, key_valid = before.k.float().transpose(1, 2), before.g.transpose(1, 2), before.valid  # [B, H, S, *]
    values = torch.cat([before.v.to(v.dtype), v], 1).float().transpose(1, 2)
    qs, ks, ws = (t.float().transpose(1, 2) for t in (q, k, w))
    bs, gs = beta.transpose(1, 2), g.transpose(1, 2)
    out = []
    for start in range(0, T, chunk_size):
        stop = min(T, start + chunk_size)
        qb, kb, wb, bb = qs[:, :, start:stop], ks[:, :, start:stop], ws[:, :, start:stop], bs[:, :, start:stop, None]
        n = stop - start
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)
        # the block's transforms in WY form: H_n ... H_1 = I - W^T U; key j moved to the block's end: k_j - C_j^T W
        system = torch.eye(n, device=q.device) + (bb * wb @ wb.transpose(-1, -2)).masked_fill(~lower, 0.0)
        rhs = torch.cat([bb * wb, bb * (wb @ kb.transpose(-1, -2)).masked_fill(~lower, 0.0)], -1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        u, c = solved[..., :D], solved[..., D:]
        qw = (qb @ wb.transpose(-1, -2)).tril()  # q_i . w_t for t <= i
        past = (qb - qw @ u) @ keys.transpose(-1, -2)  # the earlier keys through the block's transforms up to i
        own = qb @ kb.transpose(-1, -2) - qw @ c  # key j through the transforms of j+1..i (j <= i)
        scores = torch.cat([past, own], -1) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        seen_g = torch.cat([key_g, gs[:, :, start:stop]], -1)
        scores = scores + scale * (gs[:, :, start:stop, None] - seen_g[:, :, None])  # fla scales the gates too
        causal = torch.cat([torch.ones_like(past[0, 0], dtype=torch.bool), ~lower.T], -1)
        allowed = causal & torch.cat([key_valid, valid[:, start:stop]], 1)[:, None, None]
        probs = torch.nan_to_num(scores.masked_fill(~allowed, -math.inf).softmax(-1), nan=0.0)
        out.append(probs @ values[:, :, :keys.shape[2] + n])
        keys = torch.cat([keys - keys @ u.transpose(-1, -2) @ wb, kb - c.transpose(-1, -2) @ wb], 2)
        key_g, key_valid = seen_g, torch.cat([key_valid, valid[:, start:stop]], 1)
    o = torch.cat(out, 2).transpose(1, 2).to(v.dtype)
    cache = PathCache(keys.transpose(1, 2), *(torch.cat([a.to(b.dtype), b], 1) for a, b in
                                                zip(before[1:], (v, g, valid, conv_in))))
    return o, cache


def _kernel_takes(q: torch.Tensor, v: torch.Tensor, backend: str, *, mask, prior, softcap) -> bool:
    """Whether fla's kernel computes these tokens: the kernel backend, no cache before them, no soft-capping, head
    dims parallel_path_attn takes, and no padding (mask None or all True; the check of its values, a host sync,
    last)."""
    return (backend == "kernel" and prior is None and softcap is None
            and q.shape[-1] in kernels.PATH_KERNEL_HEAD_DIMS and v.shape[-1] in kernels.PATH_KERNEL_HEAD_DIMS
            and (mask is None or bool(mask.all())))


class Path(Mixer):
    name = "path"
    Options = PathOptions
    kernel_case = KernelCase(route=kernels.PATH_KERNEL, recurrence="path_attn", beta=True)
    growing_state = True

    def __init__(self, shape, options, layer_idx=0):
        super().__init__(shape, options, layer_idx)
        inner = shape.num_kv_heads * shape.head_dim  # w and beta per KV head, as fla's (expanded as k is)
        self.w_proj = (nn.Sequential(nn.Linear(shape.hidden_size, W_RANK, bias=False),
                                     nn.Linear(W_RANK, inner, bias=False))
                       if options.low_rank_w else nn.Linear(shape.hidden_size, inner, bias=False))
        if options.w_conv:
            self.w_conv1d = ShortConv(inner, options.conv_size, bias=False, activation="silu")
        self.bt_proj = nn.Linear(shape.hidden_size, shape.num_kv_heads, bias=True)
        no_weight_decay(self.bt_proj.bias)  # the transforms' strength at step 0, as the decay biases
        if options.forget_gate:
            self.g_proj = nn.Linear(shape.hidden_size, shape.num_heads, bias=True)
            no_weight_decay(self.g_proj.bias)
        self.reset_new_parameters()
        self._want_cache = True  # _mix alone (the probes) gives its cache

    def heads_output(self, x, *, use_cache=False, **kwargs):
        self._want_cache = use_cache  # whether the kernel route builds the cache (training does not need it)
        return super().heads_output(x, use_cache=use_cache, **kwargs)

    def directions(self, x: torch.Tensor, prior: Optional[PathCache], mask: Optional[torch.Tensor]):
        """(w `[B, T, H, D]` float32, unit or 0; beta `[B, T, H]` float32; the convolution's input `[B, T, C]`) of
        these tokens, the convolution continuing from the cached inputs before them."""
        s = self.shape
        conv_in = self.w_proj(x)
        if mask is not None:  # a padded input is a zero, as before the first token: left padding changes nothing
            conv_in = torch.where(mask[..., None], conv_in, 0.0)
        w = conv_in
        if self.options.w_conv:
            width = self.options.conv_size - 1
            tail = None if prior is None or width == 0 else self.w_conv1d.tail_of(prior.conv_in)
            w, _ = self.w_conv1d(conv_in, tail, fused=self.pieces_for(x) if prior is None else "", want_tail=False)
        else:
            conv_in = conv_in[..., :0]
        w = l2norm(w.float().unflatten(-1, (s.num_kv_heads, s.head_dim))).repeat_interleave(s.n_rep, 2)
        beta = (2 * torch.sigmoid(self.bt_proj(x).float())).repeat_interleave(s.n_rep, 2)
        return w, beta, conv_in

    def _mix(self, x, q, k, v, prior, backend, mask=None):
        w, beta, conv_in = self.directions(x, prior, mask)
        log_f = F.logsigmoid(self.g_proj(x).float()) if self.options.forget_gate else None
        # kernel: fla parallel_path_attn; reference: path_attention's blocks (and every decoding step)
        return path_attention(q, k, v, w, beta, log_f, scale=self.shape.attention_scale, mask=mask, prior=prior,
                              softcap=self.shape.softcap, backend=backend, chunk_size=self.options.chunk_size,
                              conv_in=conv_in, want_cache=self._want_cache)

    @torch.no_grad()
    def reset_new_parameters(self) -> None:
        for layer in self.w_proj.modules():
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
        if self.options.w_conv:
            self.w_conv1d.reset_parameters("random")
        self.bt_proj.weight.zero_()
        self.bt_proj.bias.fill_(self.options.beta_bias)
        if self.options.forget_gate:
            self.g_proj.weight.zero_()
            self.g_proj.bias.fill_(self.options.forget_bias)

    @classmethod
    def new_parameter_names(cls):
        return ("w_proj", "w_conv1d", "bt_proj", "g_proj")
