"""Which implementation of a recurrence runs: one recurrent step when decoding a single token with a state, the
GPU kernel on the kernel backend (harness.mixers.kernels), else the PyTorch chunkwise reference
(harness.mixers.recurrence). docs/RECURRENCES.md is the contract all three follow.

Each mixer calls the function named after its recurrence (linear_attention, retention, ssd, gated_linear_attention,
delta_rule, gated_delta_rule, kimi_delta_rule, gated_delta_product, dplr_delta, gated_slot_attention, mlstm_cell);
its docstring names the kernel that runs on the kernel backend (for the gated-delta family: the route
`kernels.select_gated_delta_route` takes for the mixer's (g, beta) case) and the reference. The seven gated-delta
functions are `run_gated_delta` under the name of their case; gated_delta_product holds several steps per token.

Padded batches: `mask` (bool `[B, T]`, False at padding, or None for none) makes every padded token leave the state
exactly as it found it: no write (k = 0 and beta = 0; for RWKV-7's rule k = b = 0; for mLSTM an input gate of -inf)
and no decay (log decay 0; for mLSTM a forget gate of log 1 = 0, which also keeps the stabiliser m). Outputs at
padded positions are meaningless. Both backends: the masked inputs go to the same recurrence, so fla's chunk kernels
(and mlstm_kernels') compute exactly what the reference does. On the kernel backend the mLSTM gates are the finite
+-kernels.MLSTM_PAD_GATE (the values the kernel wrapper pads a sequence's end with) rather than +-inf, and a
masked RetNet decay is a per-token g (fla's simple_gla, not the constant-per-head g_gamma route). fla's
variable-length `cu_seqlens` layout (packed, no padded tokens computed at all) is not used.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Optional

import torch

from harness.mixers import kernels, recurrence
from harness.mixers.ops import l2norm


def _is_decoding_step(q, prior) -> bool:
    """One token with a state to continue: the recurrent step, on either backend (no kernel autotuning there)."""
    return q.shape[1] == 1 and prior is not None


def _per_token(mask, x):
    """mask `[B, T]` shaped to broadcast against x `[B, T, ...]`."""
    return mask.reshape(*mask.shape, *(1,) * (x.dim() - 2))


def _route(inputs, *, scale: float, prior, backend: str, chunk_size: int, step, kernel, chunk,
           normalize_qk: bool = False):
    """(o `[B, T, H, V]`, state) of one recurrence on `inputs` (q, k, then the rest; None for an absent gate).

    Off a decoding step, the kernel backend runs `kernel(*inputs, scale, initial_state=prior)` (a caller that
    normalises q, k passes normalize_qk to its kernel itself: fla does it inside). Otherwise q and k are
    L2-normalised first when normalize_qk; then one decoding token (`_is_decoding_step`) runs
    `step(*inputs at that token, scale, state=prior)`, its output given the token axis back, and anything else the
    chunkwise `chunk(*inputs, scale, initial_state=prior, chunk_size)`."""
    decoding = _is_decoding_step(inputs[0], prior)
    if backend == "kernel" and not decoding:
        return kernel(*inputs, scale=scale, initial_state=prior)
    if normalize_qk:
        inputs = (l2norm(inputs[0]), l2norm(inputs[1]), *inputs[2:])
    if decoding:
        o, state = step(*(None if t is None else t[:, 0] for t in inputs), scale=scale, state=prior)
        return o.unsqueeze(1), state
    return chunk(*inputs, scale=scale, initial_state=prior, chunk_size=chunk_size)


def _hold_gated_delta(mask, k, g, beta):
    """k, g, beta with every padded token made a no-op on the state: k = 0 and beta = 0 (no write), g = 0 (no
    decay)."""
    k = torch.where(_per_token(mask, k), k, 0.0)
    g = None if g is None else torch.where(_per_token(mask, g), g, 0.0)
    beta = None if beta is None else torch.where(_per_token(mask, beta), beta, 0.0)
    return k, g, beta


def _hold_mlstm(mask, k, i, f, gate: float = math.inf):
    """k, i, f with every padded token made a no-op on (C, n, m): input gate -gate (no write), forget gate +gate
    (log sigmoid = 0: no decay), so that m_t = max(log f_t + m_{t-1}, i_t) = m_{t-1}; and k = 0. gate: inf for the
    reference; the kernel takes the finite kernels.MLSTM_PAD_GATE, exact in float32 too (see there)."""
    k = torch.where(_per_token(mask, k), k, 0.0)
    keep = _per_token(mask, i)
    return k, torch.where(keep, i, -gate), torch.where(keep, f, gate)


def run_gated_delta(q, k, v, g, beta, *, scale: float, prior, backend: str, chunk_size: int,
                    normalize_qk: bool = False, mask=None):
    """Dispatch the gated-delta recurrence (docs/RECURRENCES.md): one step when decoding a single token,
    fla's kernel on the kernel backend, else the PyTorch chunkwise form. Returns (o `[B,T,H,V]`, state).
    normalize_qk: L2-normalise q and k first (inside fla's kernel on the kernel backend: no separate operators).
    mask: None, or bool `[B, T]` False at padded tokens, which leave the state untouched (either backend)."""
    if mask is not None:
        k, g, beta = _hold_gated_delta(mask, k, g, beta)
    return _route((q, k, v, g, beta), scale=scale, prior=prior, backend=backend, chunk_size=chunk_size,
                  step=recurrence.step_gated_delta, chunk=recurrence.chunk_gated_delta,
                  kernel=partial(kernels.kernel_gated_delta, normalize_qk=normalize_qk), normalize_qk=normalize_qk)


def linear_attention(q, k, v, *, scale: float, prior, backend: str, chunk_size: int, mask=None):
    """Linear attention, S_t = S_{t-1} + k_t v_t^T (no decay, no beta: case none of kernels' table).

    kernel: fla chunk_simple_gla with g=None
    reference: recurrence.chunk_gated_delta; one decoding token: recurrence.step_gated_delta
    """
    return run_gated_delta(q, k, v, None, None, scale=scale, prior=prior, backend=backend, chunk_size=chunk_size,
                           mask=mask)


def retention(q, k, v, g, *, scale: float, prior, backend: str, chunk_size: int, mask=None):
    """Retention, S_t = exp(g_h) S_{t-1} + k_t v_t^T, g a constant per-head log decay (an `[H]` tensor expanded
    to `[B, T, H]`, needing no gradient: case head_const).

    kernel: fla chunk_simple_gla with g_gamma = g[0, 0] (fla's chunk_retention path)
    reference: recurrence.chunk_gated_delta; one decoding token: recurrence.step_gated_delta
    """
    return run_gated_delta(q, k, v, g, None, scale=scale, prior=prior, backend=backend, chunk_size=chunk_size,
                           mask=mask)


def ssd(q, k, v, g, *, scale: float, prior, backend: str, chunk_size: int, mask=None):
    """Mamba2's state space duality (SSD) with one state per head, S_t = exp(g_t) S_{t-1} + k_t v_t^T, g a
    per-head, per-token log decay `[B, T, H]` (the caller folds Mamba2's dt into g and k; case head).

    kernel: fla chunk_simple_gla with g; chunk_gla with g broadcast over K when gradients are needed on a GPU
        where fla's gated backward is blocked
    reference: recurrence.chunk_gated_delta; one decoding token: recurrence.step_gated_delta
    """
    return run_gated_delta(q, k, v, g, None, scale=scale, prior=prior, backend=backend, chunk_size=chunk_size,
                           mask=mask)


def gated_linear_attention(q, k, v, g, *, scale: float, prior, backend: str, chunk_size: int, mask=None):
    """Gated linear attention, S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T, g `[B, T, H, K]` (case channel).

    kernel: fla chunk_gla
    reference: recurrence.chunk_gated_delta; one decoding token: recurrence.step_gated_delta
    """
    return run_gated_delta(q, k, v, g, None, scale=scale, prior=prior, backend=backend, chunk_size=chunk_size,
                           mask=mask)


def delta_rule(q, k, v, beta, *, scale: float, prior, backend: str, chunk_size: int, normalize_qk: bool = False,
               mask=None):
    """The delta rule, S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, beta `[B, T, H]` (case delta).

    kernel: fla chunk_delta_rule
    reference: recurrence.chunk_gated_delta; one decoding token: recurrence.step_gated_delta
    """
    return run_gated_delta(q, k, v, None, beta, scale=scale, prior=prior, backend=backend, chunk_size=chunk_size,
                           normalize_qk=normalize_qk, mask=mask)


def gated_delta_rule(q, k, v, g, beta, *, scale: float, prior, backend: str, chunk_size: int,
                     normalize_qk: bool = False, mask=None):
    """The gated delta rule, S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, g and beta `[B, T, H]`
    (case head_delta); with a gate finer than a head (`decay_group_size`, harness.mixers.decay) g is `[B, T, H, K]`,
    KDA's recurrence and route (case channel_delta).

    kernel: fla chunk_gated_delta_rule; chunk_kda with g broadcast over K when gradients are needed on a GPU
        where fla's gated backward is blocked and TileLang is not usable
    reference: recurrence.chunk_gated_delta; one decoding token: recurrence.step_gated_delta
    """
    return run_gated_delta(q, k, v, g, beta, scale=scale, prior=prior, backend=backend, chunk_size=chunk_size,
                           normalize_qk=normalize_qk, mask=mask)


def kimi_delta_rule(q, k, v, g, beta, *, scale: float, prior, backend: str, chunk_size: int,
                    normalize_qk: bool = False, mask=None):
    """Kimi delta attention's recurrence, S_t = (I - b_t k_t k_t^T) Diag(exp g_t) S_{t-1} + b_t k_t v_t^T,
    g `[B, T, H, K]`, beta `[B, T, H]` (case channel_delta); with one gate per head (`decay_group_size`) g is
    `[B, T, H]`, Gated DeltaNet's recurrence and route (case head_delta).

    kernel: fla chunk_kda (chunk_gated_delta_rule for g `[B, T, H]`)
    reference: recurrence.chunk_gated_delta; one decoding token: recurrence.step_gated_delta
    """
    return run_gated_delta(q, k, v, g, beta, scale=scale, prior=prior, backend=backend, chunk_size=chunk_size,
                           normalize_qk=normalize_qk, mask=mask)


def gated_delta_product(q, k, v, g, beta, *, scale: float, prior, backend: str, chunk_size: int,
                        normalize_qk: bool = False, mask=None):
    """Gated DeltaProduct, n Householder steps per token: S_t = exp(g_t) S_{t-1}, then for j = 1..n
    S_t = (I - b_tj k_tj k_tj^T) S_t + b_tj k_tj v_tj^T; q `[B, T, H, K]`, k `[B, T, n, H, K]`, v `[B, T, n, H, V]`,
    g None | `[B, T, H]`, beta `[B, T, n, H]`. A padded token holds the state through all its steps.

    kernel: fla chunk_gated_delta_product (kernels.kernel_gated_delta_product; where fla's gated backward is blocked,
        the gated delta rule over the interleaved steps)
    reference: recurrence.chunk_gated_delta_product; one decoding token: recurrence.step_gated_delta_product
    """
    if mask is not None:
        k, g, beta = _hold_gated_delta(mask, k, g, beta)
    return _route((q, k, v, g, beta), scale=scale, prior=prior, backend=backend, chunk_size=chunk_size,
                  step=recurrence.step_gated_delta_product, chunk=recurrence.chunk_gated_delta_product,
                  kernel=partial(kernels.kernel_gated_delta_product, normalize_qk=normalize_qk),
                  normalize_qk=normalize_qk)


def gated_slot_attention(q, k, v, s, g, *, scale: float, prior, backend: str, chunk_size: int, mask=None):
    """Gated slot attention, two passes through M slots per head: hk = hk Diag(exp g_t) + k_t s_t^T,
    p_t = softmax(scale hk^T q_t), hv = Diag(exp g_t) hv + s_t v_t^T, o_t = hv^T p_t; s, g `[B, T, H, M]`
    -> (o `[B, T, H, V]`, (hk, hv)). A padded token writes nothing (s = 0) and decays nothing (g = 0).

    kernel: fla chunk_gsa (kernels.kernel_gsa)
    reference: recurrence.chunk_gsa; one decoding token: recurrence.step_gsa
    """
    if mask is not None:
        s = torch.where(_per_token(mask, s), s, 0.0)
        g = torch.where(_per_token(mask, g), g, 0.0)
    return _route((q, k, v, s, g), scale=scale, prior=prior, backend=backend, chunk_size=chunk_size,
                  step=recurrence.step_gsa, kernel=kernels.kernel_gsa, chunk=recurrence.chunk_gsa)


def dplr_delta(q, k, v, a, b, g, *, scale: float, prior, backend: str, chunk_size: int, mask=None,
               decay_floor: Optional[float] = None):
    """The delta rule with a diagonal-plus-low-rank transition (RWKV-7's), S_t = Diag(exp g_t) S_{t-1} +
    b_t a_t^T S_{t-1} + k_t v_t^T; q, k, a, b, g `[B, T, H, K]`, v `[B, T, H, V]`. A padded token writes nothing
    (k = b = 0) and does not decay (g = 0). decay_floor: a bound the caller guarantees, g >= decay_floor (< 0), which
    lets fla's kernel use its 64-token chunks (RWKV-7: -exp(-0.5)).

    kernel: fla chunk_rwkv7 (kernels.kernel_dplr_delta)
    reference: recurrence.chunk_dplr_delta; one decoding token: recurrence.step_dplr_delta
    """
    if mask is not None:
        keep = _per_token(mask, k)
        k, b, g = (torch.where(keep, t, 0.0) for t in (k, b, g))
    return _route((q, k, v, a, b, g), scale=scale, prior=prior, backend=backend, chunk_size=chunk_size,
                  step=recurrence.step_dplr_delta, chunk=recurrence.chunk_dplr_delta,
                  kernel=partial(kernels.kernel_dplr_delta, lower_bound=decay_floor))


def mlstm_cell(q, k, v, i, f, *, scale: float, prior, backend: str, chunk_size: int, eps: float, mask=None):
    """The mLSTM recurrence of docs/RECURRENCES.md, i and f gate pre-activations `[B, T, H]`
    -> (h `[B, T, H, V]`, (C, n, m)).

    kernel: mlstm_kernels chunkwise--triton_limit_chunk (kernels.kernel_mlstm, at its own chunk size)
    reference: recurrence.chunk_mlstm; one decoding token: recurrence.step_mlstm
    """
    if mask is not None:
        k, i, f = _hold_mlstm(mask, k, i, f, kernels.MLSTM_PAD_GATE if backend == "kernel" else math.inf)
    return _route((q, k, v, i, f), scale=scale, prior=prior, backend=backend, chunk_size=chunk_size,
                  step=partial(recurrence.step_mlstm, eps=eps), kernel=partial(kernels.kernel_mlstm, eps=eps),
                  chunk=partial(recurrence.chunk_mlstm, eps=eps))
