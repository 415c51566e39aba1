"""Which implementation of a recurrence runs: one recurrent step when decoding a single token with a state, the
GPU kernel on the kernel backend (harness.mixers.kernels), else the PyTorch chunkwise reference
(harness.mixers.recurrence). docs/RECURRENCES.md is the contract all three follow."""

from __future__ import annotations

from harness.mixers import kernels, recurrence
from harness.mixers.ops import l2norm


def _is_decoding_step(q, prior) -> bool:
    """One token with a state to continue: the recurrent step, on either backend (no kernel autotuning there)."""
    return q.shape[1] == 1 and prior is not None


def run_gated_delta(q, k, v, g, beta, *, scale: float, prior, backend: str, chunk_size: int,
                    normalize_qk: bool = False):
    """Dispatch the gated-delta recurrence (docs/RECURRENCES.md): one step when decoding a single token,
    fla's kernel on the kernel backend, else the PyTorch chunkwise form. Returns (o `[B,T,H,V]`, state).
    normalize_qk: L2-normalise q and k first (inside fla's kernel on the kernel backend: no separate operators)."""
    if backend == "kernel" and not _is_decoding_step(q, prior):
        return kernels.kernel_gated_delta(q, k, v, g, beta, scale=scale, initial_state=prior,
                                          normalize_qk=normalize_qk)
    if normalize_qk:
        q, k = l2norm(q), l2norm(k)
    if _is_decoding_step(q, prior):
        o, state = recurrence.step_gated_delta(
            q[:, 0], k[:, 0], v[:, 0], None if g is None else g[:, 0], None if beta is None else beta[:, 0],
            scale=scale, state=prior,
        )
        return o.unsqueeze(1), state
    return recurrence.chunk_gated_delta(q, k, v, g, beta, scale=scale, initial_state=prior, chunk_size=chunk_size)


def run_mlstm(q, k, v, i, f, *, scale: float, prior, backend: str, chunk_size: int, eps: float):
    """Dispatch the mLSTM recurrence (docs/RECURRENCES.md): one step when decoding a single token, mlstm_kernels'
    chunkwise kernel on the kernel backend, else the PyTorch chunkwise form. Returns (h `[B,T,H,V]`, (C, n, m)).
    chunk_size is the reference's; the kernel keeps its own default."""
    if _is_decoding_step(q, prior):
        h, state = recurrence.step_mlstm(q[:, 0], k[:, 0], v[:, 0], i[:, 0], f[:, 0], scale=scale, state=prior,
                                         eps=eps)
        return h.unsqueeze(1), state
    if backend == "kernel":
        return kernels.kernel_mlstm(q, k, v, i, f, scale=scale, initial_state=prior, eps=eps)
    return recurrence.chunk_mlstm(q, k, v, i, f, scale=scale, initial_state=prior, chunk_size=chunk_size, eps=eps)
