"""CE and forward KL of a chunk of logits in one fused pass: what `ChunkedLoss` runs when its terms are `ce` and
`kl` (the default stage 3, and SFT's CE alone). One Triton kernel on CUDA (`harness.loss_kernel`: two reads of
each logit and one write), PyTorch elsewhere and as the kernel's reference (~6 passes, ~5 [c, V] buffers alive).

The same values and gradient as `CrossEntropy` plus `ForwardKL` term by term, with the student's log-softmax shared
at temperature 1 and the buffers overwritten in place. fla (0.6.0) offers `fla.modules.FusedLinearCrossEntropyLoss`
and `fla.modules.fused_kl_div_loss`; they do not fit this loss exactly, so the softmax work after the logit
matmuls is this harness's own. fla's losses fall short because:
- `fused_kl_div_loss` has no temperature and no ignore index or mask (its 'batchmean' divides by all rows
  passed, so masking needs a gather by the caller, and tau would have to be folded into the hidden states);
- both compute logits in the input dtype (bf16 under ZeRO-3) and write the logits' gradient into that
  bf16 buffer, where this loss keeps logits and their gradient in fp32;
- CE and KL are separate kernels, so the student logits would be computed twice.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from harness import loss_kernel


def ce_kl_rows(
    s: Tensor, t: Optional[Tensor], y: Tensor, tau: float, ce_scale: float, kl_scale: float, need_grad: bool,
    grad_dtype: torch.dtype = torch.float32, row_weight: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """CE and tau^2-scaled KL of each row of one chunk ([c] each, unweighted), and d(loss)/d(student logits) if
    needed, where loss = sum over rows of row_weight * (ce_scale * CE + kl_scale * KL) (row_weight None: 1).

    s, t: [c, V] fp32 student / teacher logits (both may be overwritten; t None: CE only, KL 0); y: [c]
    targets. ce_scale and kl_scale are the weights over the token count. On CUDA one Triton kernel does it
    and stores the gradient in grad_dtype (a row weight then scales the stored gradient); the PyTorch form returns
    it in fp32.
    """
    if loss_kernel.available(s):
        ce, kl, g = loss_kernel.distill_rows(s, t, y, tau, ce_scale, kl_scale, need_grad, grad_dtype)
    else:
        ce, kl, g = ce_kl_rows_torch(s, t, y, tau, ce_scale, kl_scale, need_grad)
    if g is not None and row_weight is not None:
        g.mul_(row_weight[:, None].to(g.dtype))
    return ce, kl, g


def ce_kl_rows_torch(
    s: Tensor, t: Optional[Tensor], y: Tensor, tau: float, ce_scale: float, kl_scale: float, need_grad: bool
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """`ce_kl_rows` in PyTorch without row weights (CPU, and the reference for the kernel). In-place updates keep ~5
    [c, V] buffers alive."""
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    ce = lse.squeeze(1) - s.gather(1, y[:, None]).squeeze(1)
    if t is None:
        if not need_grad:
            return ce, torch.zeros_like(ce), None
        soft = s.sub_(lse).exp_()
        soft.scatter_add_(1, y[:, None], soft.new_full((soft.shape[0], 1), -1.0))
        return ce, torch.zeros_like(ce), soft.mul_(ce_scale)
    log_p = t.div_(tau)
    log_p -= torch.logsumexp(log_p, dim=-1, keepdim=True)
    log_q = s - lse if tau == 1.0 else s / tau
    if tau != 1.0:
        log_q -= torch.logsumexp(log_q, dim=-1, keepdim=True)
    p = log_p.exp()
    kl = log_p.sub_(log_q).mul_(p).sum(-1) * tau**2
    if not need_grad:
        return ce, kl, None
    # d(tau^2 KL)/ds = tau (q - p); d(CE)/ds = softmax(s) - onehot(y).
    g = log_q.exp_().sub_(p).mul_(kl_scale * tau)
    del p
    soft = s.sub_(lse).exp_()
    soft.scatter_add_(1, y[:, None], soft.new_full((soft.shape[0], 1), -1.0))
    g.add_(soft, alpha=ce_scale)
    return ce, kl, g
