"""Pure-PyTorch reference recurrences (docs/RECURRENCES.md): the gated delta family (and gated DeltaProduct, its
several steps per token), the delta rule with a diagonal-plus-low-rank transition (RWKV-7's), mLSTM and gated
slot attention (GSA).

Each recurrence has three forms with one meaning:
- ``chunk_*``: chunkwise-parallel (training): a matrix form inside each chunk, the state passed between chunks;
- ``step_*``: one token (decoding);
- ``recurrent_*``: ``step_*`` looped over time, the oracle the other two are tested against.

Layout ``[B, T, H, D]``. Computation is float32 whatever the input dtype; outputs take ``v``'s dtype and
states are float32. Everything is differentiable by autograd and runs on CPU and GPU.

The chunkwise delta rule uses the WY (UT-transform) representation of fla's naive references
(fla/ops/{delta_rule,gated_delta_rule,kda,gla}/naive.py, MIT license, Copyright (c) 2023-2026 Songlin Yang,
Yu Zhang, Zhiyuan Li), rewritten to keep every exponent <= 0 so that strong decays cannot overflow.
The mLSTM forms are written from the mLSTM equations; they follow the conventions of mlstm_kernels
(NXAI), whose states (C, n, m) they exchange exactly (see ``chunk_mlstm``).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

MLSTMState = tuple[Tensor, Tensor, Tensor]
GSAState = tuple[Tensor, Tensor]  # (hk [B, H, K, M], hv [B, H, M, V])
_Fn = TypeVar("_Fn", bound=Callable)

# Per-channel decays need a [c, c, K] tensor for each diagonal block of the intra-chunk scores; this is c.
SUB_CHUNK = 8

__all__ = [
    "chunk_gated_delta",
    "step_gated_delta",
    "recurrent_gated_delta",
    "chunk_gated_delta_product",
    "step_gated_delta_product",
    "recurrent_gated_delta_product",
    "chunk_dplr_delta",
    "step_dplr_delta",
    "recurrent_dplr_delta",
    "chunk_mlstm",
    "step_mlstm",
    "recurrent_mlstm",
    "chunk_gsa",
    "step_gsa",
    "recurrent_gsa",
]


# ----------------------------------------------------------------------------------------------- helpers
def _to_chunks(x: Tensor, chunk: int, pad_value: float = 0.0) -> Tensor:
    """``[B, T, H, *D]`` -> float32 ``[B, H, N, C, *D]``, padded at the end to ``N * C`` tokens."""
    x = x.float().movedim(1, 2)
    pad = -x.shape[2] % chunk
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad), value=pad_value)
    return x.unflatten(2, (-1, chunk))


def _from_chunks(x: Tensor, length: int, dtype: torch.dtype) -> Tensor:
    """``[B, H, N, C, D]`` -> ``[B, T, H, D]`` of ``dtype``, the padding dropped."""
    return x.flatten(2, 3)[:, :, :length].movedim(2, 1).to(dtype)


def _causal(size: int, strict: bool, device: torch.device) -> Tensor:
    """Boolean ``[size, size]``: True where j <= i (j < i when strict)."""
    return torch.ones(size, size, dtype=torch.bool, device=device).tril(-1 if strict else 0)


def _float32(fn: _Fn) -> _Fn:
    """Run ``fn`` with autocast off: under an enclosing autocast its matmuls would drop to 16 bits."""

    @functools.wraps(fn)
    def wrapper(q: Tensor, *args, **kwargs):
        with torch.autocast(q.device.type, enabled=False):
            return fn(q, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def _check_chunk(chunk_size: int) -> None:
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")


# ------------------------------------------------------------------------------------ gated delta family
def _scores(a: Tensor, b: Tensor, gc: Optional[Tensor], strict: bool, row_gc: Optional[Tensor] = None) -> Tensor:
    """Decayed causal scores ``s_ij = sum_d a_id b_jd exp(rc_id - gc_jd)`` for j <= i (j < i if strict), else 0.

    a, b: ``[..., C, K]``; gc (within-chunk cumulative log decay): None | ``[..., C]`` | ``[..., C, K]``; row_gc
    (rc): the rows' own cumulative log decay, gc's shape (None: gc), such that every rc_i - gc_j of the causal part
    is <= 0 (the DPLR rule's exclusive cumsum for its rows, with strict). Returns ``[..., C, C]``.
    """
    row_gc = gc if row_gc is None else row_gc
    if gc is not None and gc.dim() == a.dim():
        return _channel_scores(a, b, gc, strict, row_gc)
    mask = _causal(a.shape[-2], strict, a.device)
    s = a @ b.transpose(-1, -2)
    if gc is not None:
        # Exponentiate only the causal part: above the diagonal gc_i - gc_j is positive and may overflow.
        s = s * (row_gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~mask, -math.inf).exp()
    return s.masked_fill(~mask, 0.0)


def _channel_scores(a: Tensor, b: Tensor, gc: Tensor, strict: bool, row_gc: Tensor) -> Tensor:
    """``_scores`` with per-channel decay, in sub-chunks of ``c`` tokens to bound memory.

    Diagonal ``c x c`` blocks are built pairwise (``[..., c, c, K]``); a block below the diagonal factors
    through the first token r of its row sub-chunk: exp(rc_i - gc_j) = exp(rc_i - rc_r) exp(rc_r - gc_j),
    both factors <= 1, so it is one matmul. Peak memory ~ (c + C / c) * K floats per token instead of C * K.
    """
    size = a.shape[-2]
    c = math.gcd(size, SUB_CHUNK)
    m = size // c
    a4, b4, g4, r4 = (x.unflatten(-2, (m, c)) for x in (a, b, gc, row_gc))  # [..., M, c, K]
    pair = r4.unsqueeze(-2) - g4.unsqueeze(-3)  # [..., M, c(i), c(j), K]
    pair = pair.masked_fill(~_causal(c, strict, a.device)[:, :, None], -math.inf).exp()
    diag = ((pair * b4.unsqueeze(-3)) @ a4.unsqueeze(-1)).squeeze(-1)  # [..., M, c, c]
    eye = torch.eye(m, dtype=a.dtype, device=a.device)[:, None, :, None]
    full = diag.unsqueeze(-2) * eye  # [..., M, c, M, c], the diagonal blocks in place
    if m > 1:
        ref = r4[..., :1, :]  # [..., M, 1, K]
        before = torch.arange(size, device=a.device) < torch.arange(0, size, c, device=a.device)[:, None]
        kdec = (ref - gc.unsqueeze(-3)).masked_fill(~before[:, :, None], -math.inf).exp()  # [..., M, C, K]
        off = (a4 * (r4 - ref).exp()) @ (b.unsqueeze(-3) * kdec).transpose(-1, -2)  # [..., M, c, C]
        full = full + off.unflatten(-1, (m, c))
    return full.reshape(*a.shape[:-2], size, size)


def _expand_decay(x: Tensor, like: Tensor) -> Tensor:
    """A per-head decay ``[..., C]`` gets a channel axis to multiply ``[..., C, K]``; per-channel stays."""
    return x if x.dim() == like.dim() else x.unsqueeze(-1)


def _wy(k: Tensor, v: Tensor, gc: Optional[Tensor], beta: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
    """Per chunk, the values actually written, ``u = U - W @ S0`` (S0: state entering the chunk).

    The delta rule makes u_t depend on u_j (j < t): (I + A) u = beta (v - (k * exp(gc)) S0) with
    A_tj = beta_t k_t^T Diag(exp(gc_t - gc_j)) k_j strictly lower. One unit-triangular solve gives
    U = (I + A)^-1 beta v and W = (I + A)^-1 beta (k * exp(gc)). Without beta, u = v and W is None.
    Returns U ``[B, H, N, C, V]`` and W ``[B, H, N, C, K]`` | None.
    """
    if beta is None:
        return v, None
    bt = beta.unsqueeze(-1)
    a = _scores(k * bt, k, gc, strict=True)
    kdec = k if gc is None else k * _expand_decay(gc, k).exp()
    rhs = torch.cat([v, kdec], dim=-1) * bt
    sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    return sol.split([v.shape[-1], k.shape[-1]], dim=-1)


def _pass_states(
    u: Tensor, w: Optional[Tensor], k_to_end: Tensor, chunk_decay: Optional[Tensor], state: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The sequential part: walk the chunks, carrying the ``[B, H, K, V]`` state.

    u, w: from ``_wy``; k_to_end: k decayed to the chunk's end ``[B, H, N, C, K]``;
    chunk_decay: the chunk's total decay, ``[B, H, N, 1, 1]`` | ``[B, H, N, K, 1]`` | None.
    Returns the states entering each chunk ``[B, H, N, K, V]``, the written values ``[B, H, N, C, V]`` and
    the final state.
    """
    count = u.shape[2]
    ws = [None] * count if w is None else w.unbind(2)  # unbind, not u[:, :, n]: one stack in backward
    decays = [None] * count if chunk_decay is None else chunk_decay.unbind(2)
    states, written = [], []
    for un, wn, kn, dn in zip(u.unbind(2), ws, k_to_end.unbind(2), decays):
        if wn is not None:
            un = un - wn @ state
        states.append(state)
        written.append(un)
        state = (state if dn is None else dn * state) + kn.transpose(-1, -2) @ un
    return torch.stack(states, 2), torch.stack(written, 2), state


@_float32
def chunk_gated_delta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor] = None,
    beta: Optional[Tensor] = None,
    *,
    scale: float,
    initial_state: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunkwise-parallel gated delta rule (training form); equals ``recurrent_gated_delta``.

    Per token: S = Diag(exp g_t) S; S += beta_t k_t (v_t - S^T k_t)^T (S += k_t v_t^T when beta is None);
    o_t = scale * S^T q_t.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; any float dtype.
        g: log decay <= 0, None | ``[B, T, H]`` (per head) | ``[B, T, H, K]`` (per key channel).
        beta: None | ``[B, T, H]``, in (0, 1) for a contraction.
        scale: applied to q.
        initial_state: None (zeros) | ``[B, H, K, V]``.
        chunk_size: tokens per chunk; T need not be a multiple. The sequential loop has T / C steps. Beyond
            the inputs, autograd keeps ~C + 2K floats per token and head, plus ~2 (c + C / c) K per score
            matrix with a per-channel g (c = SUB_CHUNK; about 400 MB at B=1, T=2048, H=9, K=V=64, C=64 for
            kda, a quarter of that without g or with a per-head g).

    Returns:
        o ``[B, T, H, V]`` of v's dtype, final state ``[B, H, K, V]`` float32.
    """
    _check_chunk(chunk_size)
    (batch, length, heads, dk), dtype = q.shape, v.dtype
    q, k, v = (_to_chunks(x, chunk_size) for x in (q, k, v))
    q = q * scale
    gc = None if g is None else _to_chunks(g, chunk_size).cumsum(3)  # padding g = 0: no decay
    beta = None if beta is None else _to_chunks(beta, chunk_size)  # padding beta = 0, k = 0: no write
    state = q.new_zeros(batch, heads, dk, v.shape[-1]) if initial_state is None else initial_state.float()

    scores = _scores(q, k, gc, strict=False)
    u, w = _wy(k, v, gc, beta)
    if gc is None:
        q_from_start, k_to_end, chunk_decay = q, k, None
    else:
        last = gc[:, :, :, -1:]  # [B, H, N, 1(, K)]
        q_from_start = q * _expand_decay(gc, q).exp()
        k_to_end = k * _expand_decay(last - gc, k).exp()
        chunk_decay = last.exp().unsqueeze(-1) if gc.dim() == 4 else last.exp().transpose(-1, -2)
    states, u, state = _pass_states(u, w, k_to_end, chunk_decay, state)
    o = q_from_start @ states + scores @ u
    return _from_chunks(o, length, dtype), state


@_float32
def step_gated_delta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor] = None,
    beta: Optional[Tensor] = None,
    *,
    scale: float,
    state: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """One token of the gated delta rule.

    Args:
        q, k: ``[B, H, K]``; v: ``[B, H, V]``; g: None | ``[B, H]`` | ``[B, H, K]``; beta: None | ``[B, H]``.
        state: None (zeros) | ``[B, H, K, V]``.

    Returns:
        o ``[B, H, V]`` of v's dtype, new state ``[B, H, K, V]`` float32.
    """
    dtype = v.dtype
    q, k, v = q.float(), k.float(), v.float()
    if state is None:
        state = q.new_zeros(*k.shape, v.shape[-1])
    state = state.float()
    if g is not None:
        g = g.float()
        state = state * (g.unsqueeze(-1) if g.dim() == 3 else g[..., None, None]).exp()
    u = v
    if beta is not None:
        u = beta.float().unsqueeze(-1) * (v - (k.unsqueeze(-2) @ state).squeeze(-2))
    state = state + k.unsqueeze(-1) * u.unsqueeze(-2)
    o = scale * (q.unsqueeze(-2) @ state).squeeze(-2)
    return o.to(dtype), state


def recurrent_gated_delta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor] = None,
    beta: Optional[Tensor] = None,
    *,
    scale: float,
    initial_state: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """``step_gated_delta`` looped over T: the oracle. Same arguments and results as ``chunk_gated_delta``;
    ``chunk_size`` is ignored (accepted so that the two are interchangeable)."""
    batch, length, heads, dk = q.shape
    state = q.new_zeros(batch, heads, dk, v.shape[-1], dtype=torch.float32) if initial_state is None else initial_state
    gs = [None] * length if g is None else g.unbind(1)
    betas = [None] * length if beta is None else beta.unbind(1)
    outs = []
    for qt, kt, vt, gt, bt in zip(q.unbind(1), k.unbind(1), v.unbind(1), gs, betas):
        o, state = step_gated_delta(qt, kt, vt, gt, bt, scale=scale, state=state)
        outs.append(o)
    return torch.stack(outs, 1) if outs else v.new_zeros(v.shape), state.float()


# ------------------------------------------------------------------------------- gated DeltaProduct
def interleave_householder(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Tensor):
    """A gated DeltaProduct's inputs as the gated delta rule over T * n steps (n Householder steps per token, each
    its own step): the decay on each token's first step, its query on its last (zero elsewhere).

    q ``[B, T, H, K]``, k ``[B, T, n, H, K]``, v ``[B, T, n, H, V]``, g None | ``[B, T, H]``, beta ``[B, T, n, H]``
    -> q, k ``[B, T n, H, K]``, v ``[B, T n, H, V]``, g None | ``[B, T n, H]``, beta ``[B, T n, H]``; step j of token
    t is row t n + j (fla's ``(t n)`` layout)."""
    steps = k.shape[2]
    q_steps = q.new_zeros(*q.shape[:2], steps, *q.shape[2:])
    q_steps[:, :, -1] = q
    g_steps = None
    if g is not None:
        g_steps = g.new_zeros(*g.shape[:2], steps, g.shape[2])
        g_steps[:, :, 0] = g
        g_steps = g_steps.flatten(1, 2)
    return q_steps.flatten(1, 2), k.flatten(1, 2), v.flatten(1, 2), g_steps, beta.flatten(1, 2)


def chunk_gated_delta_product(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor],
    beta: Tensor,
    *,
    scale: float,
    initial_state: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunkwise-parallel gated DeltaProduct (training form); equals ``recurrent_gated_delta_product``.

    Per token: S = exp(g_t) S; then for each Householder step j = 1..n: S += beta_tj k_tj (v_tj - S^T k_tj)^T;
    o_t = scale * S^T q_t. It is ``chunk_gated_delta`` over the interleaved T * n steps (``interleave_householder``),
    read at each token's last step.

    Args:
        q: ``[B, T, H, K]``; k: ``[B, T, n, H, K]``; v: ``[B, T, n, H, V]``; any float dtype.
        g: log decay <= 0, None | ``[B, T, H]`` (one per token and head).
        beta: ``[B, T, n, H]``, in (0, 2) for a contraction.
        initial_state: None (zeros) | ``[B, H, K, V]``.
        chunk_size: tokens per chunk (chunk_size * n steps of the interleaved sequence).

    Returns:
        o ``[B, T, H, V]`` of v's dtype, final state ``[B, H, K, V]`` float32.
    """
    _check_chunk(chunk_size)
    steps = k.shape[2]
    o, state = chunk_gated_delta(*interleave_householder(q, k, v, g, beta), scale=scale, initial_state=initial_state,
                                 chunk_size=chunk_size * steps)
    return o.unflatten(1, (q.shape[1], steps))[:, :, -1], state


def step_gated_delta_product(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor],
    beta: Tensor,
    *,
    scale: float,
    state: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """One token of the gated DeltaProduct: ``step_gated_delta`` for each Householder step, the decay on the first.

    Args:
        q: ``[B, H, K]``; k: ``[B, n, H, K]``; v: ``[B, n, H, V]``; g: None | ``[B, H]``; beta: ``[B, n, H]``.
        state: None (zeros) | ``[B, H, K, V]``.

    Returns:
        o ``[B, H, V]`` of v's dtype (read after the last step), new state ``[B, H, K, V]`` float32.
    """
    o = None
    for j in range(k.shape[1]):
        o, state = step_gated_delta(q, k[:, j], v[:, j], g if j == 0 else None, beta[:, j], scale=scale, state=state)
    return o, state


def recurrent_gated_delta_product(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Optional[Tensor],
    beta: Tensor,
    *,
    scale: float,
    initial_state: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """``step_gated_delta_product`` looped over T: the oracle. Same arguments and results as
    ``chunk_gated_delta_product``; ``chunk_size`` is ignored."""
    batch, length, heads, dk = q.shape
    state = q.new_zeros(batch, heads, dk, v.shape[-1], dtype=torch.float32) if initial_state is None else initial_state
    gs = [None] * length if g is None else g.unbind(1)
    outs = []
    for qt, kt, vt, gt, bt in zip(q.unbind(1), k.unbind(1), v.unbind(1), gs, beta.unbind(1)):
        o, state = step_gated_delta_product(qt, kt, vt, gt, bt, scale=scale, state=state)
        outs.append(o)
    return torch.stack(outs, 1) if outs else v.new_zeros(v[:, :, 0].shape), state.float()


# ------------------------------------------------------------------------- DPLR delta rule (RWKV-7)
def _dplr_pseudo_values(a: Tensor, b: Tensor, k: Tensor, v: Tensor, gc: Tensor, ge: Tensor) -> tuple[Tensor, Tensor]:
    """Per chunk, what the low-rank term reads, ``u_i = S_{i-1}^T a_i = U_i + W_i S0`` (S0: the state entering the
    chunk): u depends on u_j (j < i) through (I - A_ab) u = A_ak v + (a * exp(ge)) S0, with
    A_xy_ij = a_i^T Diag(exp(ge_i - gc_j)) y_j strictly lower (ge: the exclusive cumulative log decay, the decay
    from the chunk's start to token i - 1). One unit-triangular solve gives U ``[..., C, V]`` and W ``[..., C, K]``."""
    a_ab = _scores(a, b, gc, strict=True, row_gc=ge)
    a_ak = _scores(a, k, gc, strict=True, row_gc=ge)
    rhs = torch.cat([a_ak @ v, a * ge.exp()], dim=-1)
    sol = torch.linalg.solve_triangular(-a_ab, rhs, upper=False, unitriangular=True)
    return sol.split([v.shape[-1], k.shape[-1]], dim=-1)


@_float32
def chunk_dplr_delta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    g: Tensor,
    *,
    scale: float,
    initial_state: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """Chunkwise-parallel delta rule with a diagonal-plus-low-rank transition (training form); equals
    ``recurrent_dplr_delta``.

    Per token: S = Diag(exp g_t) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T (the low-rank term reads the state
    before the decay, as fla's ``dplr_recurrence``); o_t = scale * S_t^T q_t. RWKV-7 is a = -kk, b = kk * iclr.

    Args:
        q, k, a, b: ``[B, T, H, K]``; v: ``[B, T, H, V]``; any float dtype.
        g: log decay <= 0, ``[B, T, H, K]`` (per key channel).
        initial_state: None (zeros) | ``[B, H, K, V]``.
        chunk_size: tokens per chunk; T need not be a multiple.

    Returns:
        o ``[B, T, H, V]`` of v's dtype, final state ``[B, H, K, V]`` float32.
    """
    _check_chunk(chunk_size)
    (batch, length, heads, dk), dtype = q.shape, v.dtype
    q, k, v, a, b = (_to_chunks(x, chunk_size) for x in (q, k, v, a, b))  # padding k = b = 0: no write
    q = q * scale
    gc = _to_chunks(g, chunk_size).cumsum(3)  # padding g = 0: no decay
    ge = gc - _to_chunks(g, chunk_size)
    state = q.new_zeros(batch, heads, dk, v.shape[-1]) if initial_state is None else initial_state.float()

    u_part, w_part = _dplr_pseudo_values(a, b, k, v, gc, ge)
    last = gc[..., -1:, :]  # [B, H, N, 1, K]
    to_end = (last - gc).exp()
    states, written = [], []
    for un, wn, kn, bn, vn, dn in zip(u_part.unbind(2), w_part.unbind(2), (k * to_end).unbind(2),
                                      (b * to_end).unbind(2), v.unbind(2), last.exp().transpose(-1, -2).unbind(2)):
        un = un + wn @ state
        states.append(state)
        written.append(un)
        state = dn * state + kn.transpose(-1, -2) @ vn + bn.transpose(-1, -2) @ un
    u = torch.stack(written, 2)
    o = (q * gc.exp()) @ torch.stack(states, 2) + _scores(q, k, gc, strict=False) @ v \
        + _scores(q, b, gc, strict=False) @ u
    return _from_chunks(o, length, dtype), state


@_float32
def step_dplr_delta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    g: Tensor,
    *,
    scale: float,
    state: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    """One token of the DPLR delta rule: S = Diag(exp g) S + b (a^T S) + k v^T; o = scale * S^T q.

    Args:
        q, k, a, b, g: ``[B, H, K]``; v: ``[B, H, V]``; state: None (zeros) | ``[B, H, K, V]``.

    Returns:
        o ``[B, H, V]`` of v's dtype, new state ``[B, H, K, V]`` float32.
    """
    dtype = v.dtype
    q, k, v, a, b, g = (t.float() for t in (q, k, v, a, b, g))
    state = q.new_zeros(*k.shape, v.shape[-1]) if state is None else state.float()
    read = a.unsqueeze(-2) @ state  # [B, H, 1, V]: a^T S, before the decay
    state = state * g.exp().unsqueeze(-1) + b.unsqueeze(-1) * read + k.unsqueeze(-1) * v.unsqueeze(-2)
    o = scale * (q.unsqueeze(-2) @ state).squeeze(-2)
    return o.to(dtype), state


def recurrent_dplr_delta(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    g: Tensor,
    *,
    scale: float,
    initial_state: Optional[Tensor] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, Tensor]:
    """``step_dplr_delta`` looped over T: the oracle. Same arguments and results as ``chunk_dplr_delta``;
    ``chunk_size`` is ignored."""
    batch, length, heads, dk = q.shape
    state = q.new_zeros(batch, heads, dk, v.shape[-1], dtype=torch.float32) if initial_state is None else initial_state
    outs = []
    for qt, kt, vt, at, bt, gt in zip(*(x.unbind(1) for x in (q, k, v, a, b, g))):
        o, state = step_dplr_delta(qt, kt, vt, at, bt, gt, scale=scale, state=state)
        outs.append(o)
    return torch.stack(outs, 1) if outs else v.new_zeros(v.shape), state.float()


# -------------------------------------------------------------------------------------------------- mLSTM
def _mlstm_initial(state: Optional[MLSTMState], batch: int, heads: int, dk: int, dv: int, ref: Tensor) -> MLSTMState:
    """Float32 (C, n, m); zeros (m = 0 too, as mlstm_kernels) when ``state`` is None."""
    if state is None:
        return ref.new_zeros(batch, heads, dk, dv), ref.new_zeros(batch, heads, dk), ref.new_zeros(batch, heads)
    c, n, m = state
    return c.float(), n.float(), m.float()


def _mlstm_pass_states(
    k: Tensor, v: Tensor, logi: Tensor, cumf: Tensor, state: MLSTMState
) -> tuple[MLSTMState, MLSTMState]:
    """The sequential part of chunkwise mLSTM: the stabilised state entering each chunk, and the final one.

    k ``[B, H, N, C, K]``, v ``[B, H, N, C, V]``, logi and cumf (within-chunk cumsum of log f) ``[B, H, N, C]``.
    At the chunk's end, token j's write has log weight a_j = cumf_C - cumf_j + i_j and the previous state
    cumf_C + m; the new m is their max, the same m the step recurrence reaches.
    """
    c, n, m = state
    a = cumf[..., -1:] - cumf + logi
    # a chunk of padded tokens only (input gate -inf) has a_max = -inf; a finite floor keeps exp(a - a_max) at 0
    a_max = a.max(-1).values.clamp_min(torch.finfo(a.dtype).min)  # [B, H, N]
    kw = k * (a - a_max.unsqueeze(-1)).exp().unsqueeze(-1)
    c_chunk, n_chunk = kw.transpose(-1, -2) @ v, kw.sum(-2)  # each chunk's own writes, scaled by exp(-a_max)
    cs, ns, ms = [], [], []
    for total, top, cc, nc in zip(cumf[..., -1].unbind(2), a_max.unbind(2), c_chunk.unbind(2), n_chunk.unbind(2)):
        cs.append(c)
        ns.append(n)
        ms.append(m)
        m_new = torch.maximum(total + m, top)
        carry, write = (total + m - m_new).exp(), (top - m_new).exp()
        c = carry[..., None, None] * c + write[..., None, None] * cc
        n = carry[..., None] * n + write[..., None] * nc
        m = m_new
    return (torch.stack(cs, 2), torch.stack(ns, 2), torch.stack(ms, 2)), (c, n, m)


@_float32
def chunk_mlstm(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i: Tensor,
    f: Tensor,
    *,
    scale: float,
    initial_state: Optional[MLSTMState] = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> tuple[Tensor, MLSTMState]:
    """Chunkwise-parallel mLSTM (training form); equals ``recurrent_mlstm``.

    Per token: logf = logsigmoid(f_t); m_t = max(logf + m, i_t); C = exp(logf + m - m_t) C + exp(i_t - m_t) k v^T;
    n likewise with k; h_t = C^T q~ / (max(|n^T q~|, exp(-m_t)) + eps), q~ = scale * q.
    Conventions of mlstm_kernels (its native recurrent and chunkwise forms): m starts at 0 when there is no
    initial state, eps is added after the max, and the state (C, n, m) holds the true sums scaled by
    exp(-m), so it is exchangeable with theirs (their m is ``[B, H, 1]``, ours ``[B, H]``). mlstm_kernels
    fixes scale = K ** -0.5; pass that to match it.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; i, f: gate pre-activations ``[B, T, H]``.
        initial_state: None | (C ``[B, H, K, V]``, n ``[B, H, K]``, m ``[B, H]``).
        chunk_size: tokens per chunk; T need not be a multiple.

    Returns:
        h ``[B, T, H, V]`` of v's dtype, final (C, n, m) float32.
    """
    _check_chunk(chunk_size)
    (batch, length, heads, dk), dtype = q.shape, v.dtype
    q, k, v = (_to_chunks(x, chunk_size) for x in (q, k, v))
    q = q * scale
    cumf = _to_chunks(F.logsigmoid(f.float()), chunk_size).cumsum(-1)  # padding log f = 0: state kept
    logi = _to_chunks(i, chunk_size, pad_value=-math.inf)  # padding writes nothing
    state = _mlstm_initial(initial_state, batch, heads, dk, v.shape[-1], q)
    (c0, n0, m0), final = _mlstm_pass_states(k, v, logi, cumf, state)

    mask = _causal(chunk_size, False, q.device)
    logd = (cumf.unsqueeze(-1) - cumf.unsqueeze(-2) + logi.unsqueeze(-2)).masked_fill(~mask, -math.inf)
    m_inter = cumf + m0.unsqueeze(-1)  # [B, H, N, C]
    m = torch.maximum(m_inter, logd.max(-1).values)
    weights = (q @ k.transpose(-1, -2)) * (logd - m.unsqueeze(-1)).exp()
    q_inter = q * (m_inter - m).exp().unsqueeze(-1)
    num = q_inter @ c0 + weights @ v
    den = (q_inter @ n0.unsqueeze(-1)).squeeze(-1) + weights.sum(-1)
    h = num / (torch.maximum(den.abs(), (-m).exp()) + eps).unsqueeze(-1)
    return _from_chunks(h, length, dtype), final


@_float32
def step_mlstm(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i: Tensor,
    f: Tensor,
    *,
    scale: float,
    state: Optional[MLSTMState],
    eps: float = 1e-6,
) -> tuple[Tensor, MLSTMState]:
    """One token of mLSTM (mlstm_kernels' ``mlstm_recurrent_step__native`` with an explicit scale).

    Args:
        q, k: ``[B, H, K]``; v: ``[B, H, V]``; i, f: ``[B, H]`` gate pre-activations.
        state: None (zeros, m = 0) | (C ``[B, H, K, V]``, n ``[B, H, K]``, m ``[B, H]``).

    Returns:
        h ``[B, H, V]`` of v's dtype, new (C, n, m) float32.
    """
    dtype = v.dtype
    q, k, v = q.float() * scale, k.float(), v.float()
    c, n, m = _mlstm_initial(state, *k.shape, v.shape[-1], q)
    logf = F.logsigmoid(f.float())
    m_new = torch.maximum(logf + m, i.float())
    carry = (logf + m - m_new).exp()
    write = (i.float() - m_new).exp()
    c = carry[..., None, None] * c + write[..., None, None] * (k.unsqueeze(-1) * v.unsqueeze(-2))
    n = carry[..., None] * n + write[..., None] * k
    num = (q.unsqueeze(-2) @ c).squeeze(-2)
    den = (q * n).sum(-1)
    h = num / (torch.maximum(den.abs(), (-m_new).exp()) + eps).unsqueeze(-1)
    return h.to(dtype), (c, n, m_new)


def recurrent_mlstm(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i: Tensor,
    f: Tensor,
    *,
    scale: float,
    initial_state: Optional[MLSTMState] = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> tuple[Tensor, MLSTMState]:
    """``step_mlstm`` looped over T: the oracle. Same arguments and results as ``chunk_mlstm``;
    ``chunk_size`` is ignored (accepted so that the two are interchangeable)."""
    state = _mlstm_initial(initial_state, q.shape[0], q.shape[2], q.shape[3], v.shape[-1], q.float())
    outs = []
    for qt, kt, vt, it, ft in zip(*(x.unbind(1) for x in (q, k, v, i, f))):
        h, state = step_mlstm(qt, kt, vt, it, ft, scale=scale, state=state, eps=eps)
        outs.append(h)
    return torch.stack(outs, 1) if outs else v.new_zeros(v.shape), state


# ------------------------------------------------------------------------------------ gated slot attention
def _slot_decayed_sum(a: Tensor, s: Tensor, gc: Tensor) -> Tensor:
    """Per chunk, ``o_tm = sum_{j <= t} a_tj exp(gc_tm - gc_jm) s_jm``: scores ``a`` ``[..., C, C]`` spread over slots
    with a decay per slot (gc, the within-chunk cumulative log decay, and s: ``[..., C, M]``) -> ``[..., C, M]``.

    In sub-chunks of ``c`` tokens, every exponent <= 0 (as ``_channel_scores``): a diagonal ``c x c`` block pairwise
    (``[..., c, c, M]``); the columns before a row sub-chunk through its first token r,
    exp(gc_t - gc_j) = exp(gc_t - gc_r) exp(gc_r - gc_j), one matmul. Entries of ``a`` above the diagonal are ignored.
    """
    size = a.shape[-1]
    c = math.gcd(size, SUB_CHUNK)
    n = size // c
    s4, g4 = s.unflatten(-2, (n, c)), gc.unflatten(-2, (n, c))  # [..., n, c, M]
    rows = a.unflatten(-2, (n, c))  # [..., n, c, C]
    diag_a = rows.unflatten(-1, (n, c)).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)  # [..., n, c(i), c(j)]
    pair = (g4.unsqueeze(-2) - g4.unsqueeze(-3)).masked_fill(~_causal(c, False, a.device)[:, :, None], -math.inf)
    out = torch.einsum("...bij,...bijm,...bjm->...bim", diag_a, pair.exp(), s4)
    if n > 1:
        ref = g4[..., :1, :]  # [..., n, 1, M]: each row sub-chunk's first token
        before = torch.arange(size, device=a.device) < torch.arange(0, size, c, device=a.device)[:, None]  # [n, C]
        sdec = s.unsqueeze(-3) * (ref - gc.unsqueeze(-3)).masked_fill(~before[:, :, None], -math.inf).exp()
        out = out + (rows @ sdec) * (g4 - ref).exp()  # [..., n, c, C] @ [..., n, C, M]
    return out.flatten(-3, -2)


def _slot_scores(q: Tensor, k: Tensor, s: Tensor, gc: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """GSA's first pass over the chunks: the keys written into the slots, decayed per slot,
    hk = hk Diag(exp g_t) + k_t s_t^T, read as ok_t = hk^T q_t (q already scaled).

    q, k ``[B, H, N, C, K]``; s, gc ``[B, H, N, C, M]``; state ``[B, H, K, M]``. Returns ok ``[B, H, N, C, M]`` and the
    final state."""
    last = gc[..., -1:, :]  # [B, H, N, 1, M]
    writes = k.transpose(-1, -2) @ (s * (last - gc).exp())  # each chunk's own writes at its end [B, H, N, K, M]
    entering = []
    for write, decay in zip(writes.unbind(2), last.exp().unbind(2)):
        entering.append(state)
        state = state * decay + write
    inter = (q @ torch.stack(entering, 2)) * gc.exp()
    return inter + _slot_decayed_sum(q @ k.transpose(-1, -2), s, gc), state


def _gsa_initial(state: Optional[GSAState], batch: int, heads: int, dk: int, slots: int, dv: int,
                 ref: Tensor) -> GSAState:
    """Float32 (hk, hv); zeros when ``state`` is None."""
    if state is None:
        return ref.new_zeros(batch, heads, dk, slots), ref.new_zeros(batch, heads, slots, dv)
    hk, hv = state
    return hk.float(), hv.float()


@_float32
def chunk_gsa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: Tensor,
    g: Tensor,
    *,
    scale: float,
    initial_state: Optional[GSAState] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, GSAState]:
    """Chunkwise-parallel gated slot attention (Zhang et al. 2024; training form); equals ``recurrent_gsa``.

    Per token, M slots per head with a log decay g_t (<= 0) and a write strength s_t per slot (the layer's
    s = 1 - exp(g)): hk = hk Diag(exp g_t) + k_t s_t^T; p_t = softmax(scale * hk^T q_t) over the slots;
    hv = Diag(exp g_t) hv + s_t v_t^T; o_t = hv^T p_t. The second pass is ``chunk_gated_delta`` with q = p, k = s
    and a per-channel decay g, scale 1.

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, H, V]``; s, g: ``[B, T, H, M]``; any float dtype.
        initial_state: None (zeros) | (hk ``[B, H, K, M]``, hv ``[B, H, M, V]``).
        chunk_size: tokens per chunk; T need not be a multiple.

    Returns:
        o ``[B, T, H, V]`` of v's dtype, final (hk, hv) float32.
    """
    _check_chunk(chunk_size)
    (batch, length, heads, dk), slots = q.shape, s.shape[-1]
    hk, hv = _gsa_initial(initial_state, batch, heads, dk, slots, v.shape[-1], q.float())
    qc, kc, sc = (_to_chunks(x, chunk_size) for x in (q, k, s))  # padding s = 0, g = 0: no write, no decay
    gc = _to_chunks(g, chunk_size).cumsum(3)
    ok, hk = _slot_scores(qc * scale, kc, sc, gc, hk)
    p = _from_chunks(ok, length, torch.float32).softmax(-1)
    o, hv = chunk_gated_delta(p, s, v, g, None, scale=1.0, initial_state=hv, chunk_size=chunk_size)
    return o, (hk, hv)


@_float32
def step_gsa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: Tensor,
    g: Tensor,
    *,
    scale: float,
    state: Optional[GSAState],
) -> tuple[Tensor, GSAState]:
    """One token of gated slot attention (fla's ``fused_recurrent_gsa`` inference step).

    Args:
        q, k: ``[B, H, K]``; v: ``[B, H, V]``; s, g: ``[B, H, M]``.
        state: None (zeros) | (hk ``[B, H, K, M]``, hv ``[B, H, M, V]``).

    Returns:
        o ``[B, H, V]`` of v's dtype, new (hk, hv) float32.
    """
    dtype = v.dtype
    q, k, v, s, g = (x.float() for x in (q, k, v, s, g))
    hk, hv = _gsa_initial(state, *k.shape, s.shape[-1], v.shape[-1], q)
    decay = g.exp()
    hk = hk * decay.unsqueeze(-2) + k.unsqueeze(-1) * s.unsqueeze(-2)
    p = (scale * (q.unsqueeze(-2) @ hk).squeeze(-2)).softmax(-1)
    hv = hv * decay.unsqueeze(-1) + s.unsqueeze(-1) * v.unsqueeze(-2)
    return (p.unsqueeze(-2) @ hv).squeeze(-2).to(dtype), (hk, hv)


def recurrent_gsa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: Tensor,
    g: Tensor,
    *,
    scale: float,
    initial_state: Optional[GSAState] = None,
    chunk_size: int = 64,
) -> tuple[Tensor, GSAState]:
    """``step_gsa`` looped over T: the oracle. Same arguments and results as ``chunk_gsa``; ``chunk_size`` is
    ignored."""
    state = _gsa_initial(initial_state, q.shape[0], q.shape[2], q.shape[3], s.shape[-1], v.shape[-1], q.float())
    outs = []
    for qt, kt, vt, st, gt in zip(*(x.unbind(1) for x in (q, k, v, s, g))):
        o, state = step_gsa(qt, kt, vt, st, gt, scale=scale, state=state)
        outs.append(o)
    return torch.stack(outs, 1) if outs else v.new_zeros(v.shape), state
