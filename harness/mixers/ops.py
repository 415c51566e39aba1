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
    """Rotary embedding on `[B, T, H, D]` q and k with transformers' (cos, sin) of shape `[B, T, D]`."""
    cos, sin = cos.unsqueeze(2).to(q.dtype), sin.unsqueeze(2).to(q.dtype)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin


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
