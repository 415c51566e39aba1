"""Small tensor operations the mixer layers and the kernel path share: L2 norm of q and k, the rotary embedding,
and the expansion of grouped K/V heads. Plain PyTorch; imports nothing else from harness."""

from __future__ import annotations

import torch


def expand_kv(weight: torch.Tensor, num_kv_heads: int, n_rep: int) -> torch.Tensor:
    """`[KVH * D, ...]` -> `[KVH * n_rep * D, ...]`: student head j gets teacher KV head j // n_rep."""
    head_dim = weight.shape[0] // num_kv_heads
    per_head = weight.reshape(num_kv_heads, head_dim, *weight.shape[1:])
    return per_head.repeat_interleave(n_rep, dim=0).reshape(num_kv_heads * n_rep * head_dim, *weight.shape[1:])


def apply_rope(q, k, cos, sin):
    """Rotary embedding on q and k `[B, T, ..., D]` (`[B, T, H, D]`; a DeltaProduct's keys `[B, T, n, H, D]`: each
    of a token's keys at the token's position) with transformers' (cos, sin) of shape `[B, T, D]`."""

    def rotate(x):
        c, s = (t.reshape(*t.shape[:2], *(1,) * (x.dim() - 3), t.shape[-1]).to(q.dtype) for t in (cos, sin))
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat((-x2, x1), dim=-1) * s

    return rotate(q), rotate(k)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (fla's l2norm), the sum in float32, the result in x's dtype."""
    xf = x.float()  # one upcast, not two
    return x * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps).to(x.dtype)


def rotate_half_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of one of q or k, `[B, T, H, D]`, with (cos, sin) `[B or 1, T, D]`: `apply_rope` for one
    tensor (for keys and queries at different positions)."""
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def stack_rows_left_padded(caches: list):
    """Rows' growing caches (NamedTuples of `[1, S, ...]` tensors, any S) as one batch of the same type, each padded
    on the left to the longest with zeros, which a cache's `valid` field then marks as no real slots."""
    width = max(c[0].shape[1] for c in caches)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.new_zeros(t.shape[0], width - t.shape[1], *t.shape[2:]), t], 1)

    return type(caches[0])(*(torch.cat([pad(t) for t in parts]) for parts in zip(*caches)))
