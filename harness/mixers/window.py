"""Sliding-window softmax attention: each query attends to itself and the `window - 1` real tokens before it.

What `student.options.window` puts beside a mixer's recurrence in the same layer (docs/TRANSFER.md, "Sliding
window"): the teacher's softmax attention, exact over the recent tokens, while the recurrence carries what lies
further back. Computed blockwise in one batched product (blocks of `window` queries read their own block and the
`window - 1` keys before it), so memory and time grow as T x window, not T^2. Decoding keeps the last `window - 1`
keys and values (`WindowCache`), before RoPE: RoPE scores depend only on the distance between query and key, so
every call rotates its keys and queries by their place in the window it sees, and a cache needs no position counter
(rows of different lengths share one batch, and a decoding step has the same shapes every time).

Padding: a masked token is no key for anyone. Padding sits before a row's first token (left) or after its last
(right), so the distance in positions between two real tokens is their distance in the row.

Which path computes it: on the kernel backend, for bf16 or fp16 CUDA tensors of a whole unpadded sequence (no
cache before it, no padding, no soft-capping), fla's flash-style parallel_attn (`kernels.kernel_window_attention`:
the training case); everything else (the reference backend, CPU, padding, decoding with a cache, Gemma 2's soft-capping, and a
mixer whose `window_backend` is blockwise) the blockwise PyTorch form here, which is the reference.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch

from harness.mixers import kernels

RESOLVED_BACKENDS = ("kernel", "reference")
WINDOW_BACKENDS = ("auto", "blockwise")  # a mixer's `window_backend` option: auto routes as below; blockwise never
Rotate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [B, L, H, D], positions [L]) -> x rotated


class WindowCache(NamedTuple):
    """The last `window - 1` keys and values `[B, W - 1, H, D]` (before RoPE) and which of them are real `[B, W - 1]`
    (a row shorter than the window, or left-padded, has empty slots)."""

    k: torch.Tensor
    v: torch.Tensor
    valid: torch.Tensor


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, *, scale: float,
                     mask: Optional[torch.Tensor] = None, prior: Optional[WindowCache] = None,
                     want_cache: bool = False, rotate: Optional[Rotate] = None, softcap: Optional[float] = None,
                     backend: str = "reference") -> tuple[torch.Tensor, Optional[WindowCache]]:
    """q, k, v `[B, T, H, D]` (K/V heads already expanded, q and k before RoPE) -> (o `[B, T, H, D]` in q's dtype, the
    cache after the last token if `want_cache`). mask: bool `[B, T]`, False at padding. prior: the cache of the tokens
    before these, whose keys count as the earliest of the window. rotate: RoPE, applied here to the keys (cached and
    new) at positions 0.. and to the queries at theirs; None for none. softcap: the scores' tanh soft-capping,
    cap * tanh(s / cap) (Gemma 2's attn_logit_softcapping), None for none. backend: the resolved backend
    ('kernel' or 'reference', `kernels.resolve_backend`); on 'kernel' fla's kernel computes the cases it takes
    (`_kernel_takes`), else the blockwise form, softmax in float32."""
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    if backend not in RESOLVED_BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {', '.join(RESOLVED_BACKENDS)} (a resolved backend: "
                         "see harness.mixers.kernels.resolve_backend)")
    on_kernel = _kernel_takes(q, backend, mask=mask, prior=prior, softcap=softcap)
    batch, length, heads, dim = q.shape
    valid = torch.ones(batch, length, dtype=torch.bool, device=q.device) if mask is None else mask.bool()
    if prior is not None:  # the cached keys come first: the window of the first new tokens reaches into them
        k, v = torch.cat([prior.k.to(k.dtype), k], 1), torch.cat([prior.v.to(v.dtype), v], 1)
        valid = torch.cat([prior.valid, valid], 1)
    past = k.shape[1] - length
    cache = _last(k, v, valid, window - 1) if want_cache else None
    if rotate is not None:
        positions = torch.arange(k.shape[1], device=q.device)
        q, k = rotate(q, positions[past:]), rotate(k, positions)
    if on_kernel:
        return kernels.kernel_window_attention(q, k, v, window, scale=scale).to(q.dtype), cache
    return _blockwise(q, k, v, valid, window, scale, past, softcap).to(q.dtype), cache


def _on_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _kernel_takes(q, backend: str, *, mask, prior, softcap) -> bool:
    """Whether fla's parallel_attn computes this window: the kernel backend, CUDA tensors in a dtype it takes and a
    head_dim it holds, no cache before these tokens, no soft-capping, and no padding (mask None or all True; the
    check of a mask's values, a host sync, comes last)."""
    return (backend == "kernel" and prior is None and softcap is None and _on_cuda(q)
            and q.dtype in kernels.WINDOW_KERNEL_DTYPES and q.shape[-1] <= kernels.WINDOW_KERNEL_MAX_HEAD_DIM
            and (mask is None or bool(mask.all())))


def _blockwise(q, k, v, valid, window: int, scale: float, past: int, softcap: Optional[float] = None) -> torch.Tensor:
    """Queries in blocks of C (= the window, or fewer when the sequence is shorter); each block reads, in one batched
    product, the C + W - 1 keys from W - 1 before its first query to its last: all the window of each of its
    queries. The keys are padded on the left to W - 1 before the first query (invalid slots), so that every block
    has the same band: query a of a block sees its keys a .. a + W - 1."""
    batch, length, heads, dim = q.shape
    window = min(window, past + length)  # a longer window sees no more: every key is already in it
    keep = min(past, window - 1)  # the past keys any new query can still see
    k, v, valid = k[:, past - keep:], v[:, past - keep:], valid[:, past - keep:]
    size = min(window, length)
    blocks = -(-length // size)
    left, right = window - 1 - keep, blocks * size - length  # pad the keys to W - 1 before, the queries to C x blocks
    span = size + window - 1

    def spans(x: torch.Tensor) -> torch.Tensor:  # [B, (W - 1) + blocks x C, ...] -> [B, blocks, span, ...]
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (left, right))
        return x.unfold(1, span, size).movedim(-1, 2)

    keys, values = spans(k.float()), spans(v.float())
    seen = spans(valid)  # [B, blocks, span]
    queries = torch.nn.functional.pad(q.float(), (0, 0, 0, 0, 0, right)).unflatten(1, (blocks, size))
    scores = torch.einsum("bnqhd,bnshd->bnhqs", queries, keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    a, s = torch.arange(size, device=q.device)[:, None], torch.arange(span, device=q.device)[None, :]
    allowed = ((s >= a) & (s < a + window))[None, None, None] & seen[:, :, None, None, :]
    scores = scores.masked_fill(~allowed, -math.inf)
    # a padded query can see no key at all: its row would be all -inf (NaN); it gets zeros instead
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    out = torch.einsum("bnhqs,bnshd->bnqhd", probs, values)
    return out.flatten(1, 2)[:, :length]


def _last(k, v, valid, size: int) -> WindowCache:
    """The last `size` keys, values and validity, with empty slots on the left where the sequence is shorter."""
    if size == 0:
        empty = k[:, :0]
        return WindowCache(empty.clone(), v[:, :0].clone(), valid[:, :0].clone())
    short = size - k.shape[1]
    if short > 0:
        k = torch.cat([k.new_zeros(k.shape[0], short, *k.shape[2:]), k], 1)
        v = torch.cat([v.new_zeros(v.shape[0], short, *v.shape[2:]), v], 1)
        valid = torch.cat([valid.new_zeros(valid.shape[0], short), valid], 1)
    return WindowCache(k[:, -size:].clone(), v[:, -size:].clone(), valid[:, -size:].clone())
