"""The distillation loss's per-row softmax work as one Triton kernel (CUDA): CE, tau-scaled KL and the logits' gradient.

`harness.losses.chunked` computes fp32 logits of both models for a chunk of rows with tensor-core matmuls; everything
after that is memory traffic over [rows x V] fp32 buffers. The PyTorch form makes ~6 elementwise passes over
them (logsumexps, `sub_`, `exp_`, `mul_`, `add_`) and measured 119 ms of a 419 ms 135M step on an H200
(docs/BENCHMARKS.md). This kernel reads each row of both logits twice and writes the gradient once, in place of
the student's logits:

- pass 1 (online, one read of s and t): lse(s), lse(s / tau), lse(t / tau), s[y], and
  A = sum_v exp(t_v / tau - m) (t_v - s_v) / tau, rescaled as the running max m moves. With p = softmax(t / tau)
  and q = softmax(s / tau), KL(p || q) = sum_v p_v (t_v - s_v) / tau - lse(t / tau) + lse(s / tau), so the
  loss needs no second pass;
- pass 2 (only when a gradient is wanted): g = ce_scale (softmax(s) - onehot(y)) + kl_scale tau (q - p), the
  same formula as `harness.losses.kl_ce.ce_kl_rows_torch`, written over s (fp32) or to a bf16 / fp16 buffer.

The kernel writes per-row CE and KL (KL without the tau^2 factor, which `distill_rows` applies). Written by hand
because no library kernel fits: fla's `fused_kl_div` and Liger's fused linear JSD have one side's logits, no CE
beside the KL and no temperature (see harness.losses.kl_ce). Triton's interpreter (`TRITON_INTERPRET=1`) runs it
on CPU tensors.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU machines have no Triton; `available()` says so
    triton = None

__all__ = ["available", "distill_rows"]

BLOCK = 4096  # columns per step of a row's loop; V = 49,152 is 12 steps
NUM_WARPS = 8


def available(t: Tensor) -> bool:
    """Whether the kernel runs for tensors like `t`: Triton importable and `t` on a CUDA device."""
    return triton is not None and t.is_cuda


def distill_rows(
    s: Tensor, t: Optional[Tensor], y: Tensor, tau: float, ce_scale: float, kl_scale: float, need_grad: bool,
    grad_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """CE and tau^2-scaled KL of each row of a chunk, and d(loss)/d(student logits), as
    `harness.losses.kl_ce.ce_kl_rows_torch`.

    s: [c, V] fp32 student logits, t: [c, V] fp32 teacher logits or None (CE only), y: [c] int targets in
    [0, V). Returns (ce [c], kl [c], g or None). g is computed in fp32 and stored in grad_dtype: an fp32 g is
    written over `s` itself; a bf16 / fp16 one (rounded once, for the gradient matmuls' tensor cores) is new.
    """
    if s.dtype != torch.float32 or (t is not None and (t.dtype != torch.float32 or t.shape != s.shape)):
        raise ValueError(f"distill_rows: fp32 [c, V] logits expected; got {s.dtype} {tuple(s.shape)} and "
                         f"{None if t is None else (t.dtype, tuple(t.shape))}")
    if s.stride(1) != 1 or (t is not None and t.stride(1) != 1):
        raise ValueError("distill_rows: logits must be contiguous along the vocabulary")
    rows, vocab = s.shape
    g = s if grad_dtype == torch.float32 or not need_grad else torch.empty_like(s, dtype=grad_dtype)
    ce = torch.empty(rows, dtype=torch.float32, device=s.device)
    kl = torch.zeros(rows, dtype=torch.float32, device=s.device)
    if rows:
        _distill_rows_kernel[(rows,)](
            s, s if t is None else t, y, g, ce, kl, g.stride(0), s.stride(0), 0 if t is None else t.stride(0), vocab,
            1.0 / tau, float(ce_scale), float(kl_scale) * tau,
            HAS_T=t is not None, NEED_GRAD=need_grad, TAU_ONE=tau == 1.0, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )
    return ce, kl.mul_(tau**2), (g if need_grad else None)


if triton is not None:

    @triton.jit
    def _distill_rows_kernel(S, T, Y, G, CE, KL, g_stride, s_stride, t_stride, V, inv_tau, ce_scale, g_kl_scale,
                             HAS_T: tl.constexpr, NEED_GRAD: tl.constexpr, TAU_ONE: tl.constexpr,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s_row = S + row * s_stride
        t_row = T + row * t_stride
        g_row = G + row * g_stride
        y = tl.load(Y + row).to(tl.int64)
        lanes = tl.arange(0, BLOCK)
        neg_inf = float("-inf")
        # running max and sum of exp for s, s / tau, t / tau; a_t: sum exp(t' - m_t) (t' - s')
        m_s = neg_inf
        d_s = 0.0
        m_q = neg_inf
        d_q = 0.0
        m_t = neg_inf
        d_t = 0.0
        a_t = 0.0
        for off in range(0, V, BLOCK):
            cols = off + lanes
            inside = cols < V
            s = tl.load(s_row + cols, mask=inside, other=neg_inf)
            m_new = tl.maximum(m_s, tl.max(s, axis=0))
            d_s = d_s * tl.exp(m_s - m_new) + tl.sum(tl.exp(s - m_new), axis=0)
            m_s = m_new
            if HAS_T:
                sq = s * inv_tau
                if not TAU_ONE:
                    m_new = tl.maximum(m_q, tl.max(sq, axis=0))
                    d_q = d_q * tl.exp(m_q - m_new) + tl.sum(tl.exp(sq - m_new), axis=0)
                    m_q = m_new
                tp = tl.load(t_row + cols, mask=inside, other=neg_inf) * inv_tau
                m_new = tl.maximum(m_t, tl.max(tp, axis=0))
                e = tl.exp(tp - m_new)
                scale = tl.exp(m_t - m_new)
                d_t = d_t * scale + tl.sum(e, axis=0)
                a_t = a_t * scale + tl.sum(tl.where(inside, e * (tp - sq), 0.0), axis=0)
                m_t = m_new
        lse_s = m_s + tl.log(d_s)
        tl.store(CE + row, lse_s - tl.load(s_row + y))
        lse_q = lse_s
        lse_t = 0.0
        if HAS_T:
            if not TAU_ONE:
                lse_q = m_q + tl.log(d_q)
            lse_t = m_t + tl.log(d_t)
            tl.store(KL + row, a_t / d_t - lse_t + lse_q)
        if NEED_GRAD:
            for off in range(0, V, BLOCK):
                cols = off + lanes
                inside = cols < V
                s = tl.load(s_row + cols, mask=inside, other=0.0)
                g = ce_scale * (tl.exp(s - lse_s) - tl.where(cols == y, 1.0, 0.0))
                if HAS_T:
                    tp = tl.load(t_row + cols, mask=inside, other=0.0) * inv_tau
                    g += g_kl_scale * (tl.exp(s * inv_tau - lse_q) - tl.exp(tp - lse_t))
                tl.store(g_row + cols, g.to(G.dtype.element_ty), mask=inside)
