"""Training losses: MSE (or L2-norm) alignment (stages 1 and 2), chunked CE + KL distillation (stage 3), chunked CE (SFT).

Stage 3 never builds fp32 logits for the whole batch: `distill_loss` takes the final (post-norm) hidden
states and the two heads' weights, and computes logits, losses and the logits' gradient for
`chunk_tokens` predicted tokens at a time (a custom autograd function that produces the gradient in the
forward pass, as Liger's and fla's fused linear losses do, so nothing is recomputed in backward).

KL convention (stage 3). KL(teacher || student) = sum_v p_t (log p_t - log p_s), both softmaxes at
temperature tau, averaged over predicted tokens and multiplied by tau^2 (Hinton et al. 2015: the
gradient of the softened KL scales as 1/tau^2, so the factor keeps CE and KL balanced when tau
changes). The per-token mean keeps the KL on the same scale as the per-token CE. A common alternative,
`F.kl_div(log_q, p, reduction="batchmean")` on [B, T, V] tensors, divides the sum over all tokens by B
only, which weights KL ~T times more than CE (one public linearization recipe does this); the
`kl_weight` of this harness is relative to the per-token CE.

fla (0.6.0) offers `fla.modules.FusedLinearCrossEntropyLoss` and `fla.modules.fused_kl_div_loss`; they do
not fit this loss exactly, so the softmax work after the logit matmuls is this harness's own: PyTorch on the
CPU, one Triton kernel on CUDA (`harness.loss_kernel`). fla's losses fall short because:
- `fused_kl_div_loss` has no temperature and no ignore index or mask (its 'batchmean' divides by all rows
  passed, so masking needs a gather by the caller, and tau would have to be folded into the hidden
  states);
- both compute logits in the input dtype (bf16 under ZeRO-3) and write the logits' gradient into that
  bf16 buffer, where this loss keeps logits and their gradient in fp32;
- CE and KL are separate kernels, so the student logits would be computed twice.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from harness import loss_kernel

IGNORE_INDEX = -100
# Rows of a low-precision head upcast to fp32 at a time, so that no fp32 copy of a whole head exists.
VOCAB_BLOCK = 8192

__all__ = ["ALIGNMENT_LOSSES", "IGNORE_INDEX", "DistillLosses", "alignment_l2", "alignment_loss", "alignment_mse",
           "distill_loss", "lm_loss"]


def alignment_mse(pred: Tensor, target: Tensor) -> Tensor:
    """Mean squared error for stages 1 and 2: the mean over batch, tokens and hidden features, in fp32.

    pred, target: [B, T, C] (any equal shapes; no broadcasting). Stage 1 compares the student mixer's
    output with the teacher's attention output (o_proj, before the residual); stage 2 compares the
    student block's output with the teacher's h_{l+1}. Returns an fp32 scalar.
    """
    if pred.shape != target.shape:
        raise ValueError(f"alignment_mse: pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
    return F.mse_loss(pred.float(), target.float(), reduction="mean")


def alignment_l2(pred: Tensor, target: Tensor) -> Tensor:
    """The Euclidean norm (not squared) of the difference per token, averaged over batch and tokens, in fp32.

    pred, target: [..., C]: the norm runs over the last (hidden) axis. This is the stage-2 loss of the paper
    authors' public release (`stages.align_hidden.loss=l2`, jobs/paper-recipe/). Unlike MSE, its gradient per
    token has unit norm whatever the size of the error, so large and small errors pull equally hard.
    """
    if pred.shape != target.shape:
        raise ValueError(f"alignment_l2: pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
    return torch.linalg.vector_norm(pred.float() - target.float(), ord=2, dim=-1).mean()


ALIGNMENT_LOSSES = {"mse": alignment_mse, "l2": alignment_l2}


def alignment_loss(name: str):
    """The stage-1/2 loss function called `name` (a key of ALIGNMENT_LOSSES)."""
    if name not in ALIGNMENT_LOSSES:
        raise ValueError(f"alignment loss '{name}' is not one of {sorted(ALIGNMENT_LOSSES)}")
    return ALIGNMENT_LOSSES[name]


class DistillLosses(NamedTuple):
    """Stage-3 loss: `total` carries the gradient; `ce` and `kl` are detached fp32 scalars for logging;
    `tokens` is the number of predicted tokens both are averaged over (for token-weighted averaging
    across ranks or micro-batches)."""

    total: Tensor
    ce: Tensor
    kl: Tensor
    tokens: int


def distill_loss(
    student_hidden: Tensor,
    teacher_hidden: Tensor,
    lm_head_weight_s: Tensor,
    lm_head_weight_t: Tensor,
    labels: Tensor,
    *,
    ce_weight: float,
    kl_weight: float,
    temperature: float,
    chunk_tokens: int = 512,
    loss_mask: Optional[Tensor] = None,
) -> DistillLosses:
    """Stage-3 loss from final hidden states: next-token CE plus tau^2-scaled KL(teacher || student).

    student_hidden: [B, T, Cs], teacher_hidden: [B, T, Ct]: final hidden states, after the final norm.
    lm_head_weight_s: [V, Cs], lm_head_weight_t: [V, Ct]: the heads (no bias; under ZeRO-3 the caller
    gathers them). labels: [B, T] token ids, IGNORE_INDEX (-100) where no loss is wanted.
    loss_mask: optional [B, T] bool/0-1, aligned with labels: True where the token is a training target
    (e.g. assistant tokens for SFT).

    Position t predicts token t+1 (labels are shifted inside). A position counts when its target
    labels[:, t+1] is not -100 and loss_mask[:, t+1] is set; CE and KL use that same set of n tokens (so
    the last position of a row, which has no target, is not in the KL either) and are averaged over it:
    ce = mean CE at temperature 1; kl = tau^2 * mean sum_v p_t (log p_t - log p_s), softmaxes at tau;
    total = ce_weight * ce + kl_weight * kl. Gradients flow to student_hidden and lm_head_weight_s (when
    they require grad), never to the teacher; n = 0 gives zeros. The gradient is computed during the
    forward call whenever one is needed, so evaluate under torch.no_grad() to skip that work.

    Logits, softmaxes and the logits' gradient are fp32 and exist for chunk_tokens rows at a time. Peak
    extra memory is about 5 * chunk_tokens * V * 4 bytes (chunk buffers) + V * Cs * 4 (fp32 weight-gradient
    accumulator) + ~12 * n * C bytes (gathered rows, fp32 input gradient); bf16 heads are upcast
    VOCAB_BLOCK rows at a time. Measured on CPU at V=49152, C=2048, chunk 512, n=1023, fwd+bwd: 0.93 GB.
    On CUDA, bf16 hidden states and heads give their logits by a bf16 matmul with fp32 accumulation and output
    (no upcast; the same values as the fp32 matmul of the upcast operands); `harness.loss_kernel` computes
    the losses and the logits' gradient in fp32 and rounds that gradient once to bf16 (~4e-3 relative per
    element, as Liger's and fla's fused losses keep it), so that both gradient matmuls run on bf16 tensor cores
    with fp32 accumulation and output. Plain fp32 matmuls made this loss 23% of a 135M stage-3 step on an H200;
    TF32 ones on an fp32 gradient still half of it (docs/BENCHMARKS.md). Where the kernel does not run (no
    Triton, fp32 inputs, CPU) the gradient stays fp32 and its matmuls are fp32 (TF32 on a GPU).
    """
    _check_shapes(student_hidden, teacher_hidden, lm_head_weight_s, lm_head_weight_t, labels, loss_mask)
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    if loss_mask is not None:
        keep = keep & loss_mask[:, 1:].bool()
    # Gathering the counted positions first ([n, C], small next to [n, V]) skips ignored ones entirely.
    xs = student_hidden[:, :-1][keep]
    with torch.no_grad():
        xt = teacher_hidden[:, :-1][keep]
    y = targets[keep]
    need_dx = torch.is_grad_enabled() and xs.requires_grad
    need_dw = torch.is_grad_enabled() and lm_head_weight_s.requires_grad
    total, ce, kl = _ChunkedDistill.apply(
        xs, lm_head_weight_s, xt, lm_head_weight_t.detach(), y,
        float(ce_weight), float(kl_weight), float(temperature), int(chunk_tokens), need_dx, need_dw,
    )
    return DistillLosses(total, ce, kl, int(y.numel()))


def lm_loss(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    *,
    chunk_tokens: int = 512,
    loss_mask: Optional[Tensor] = None,
) -> DistillLosses:
    """Next-token CE alone (SFT), chunked like `distill_loss`: no teacher, no whole-batch fp32 logits.

    hidden: [B, T, C] final (post-norm) hidden states; lm_head_weight: [V, C]; labels: [B, T] with -100 where
    no loss is wanted (for SFT: everything but the assistant tokens, and padding); loss_mask as in
    `distill_loss`. Returns DistillLosses with total = ce = the mean CE over the n counted tokens, kl = 0 and
    tokens = n; the gradient is computed during the forward call, as in `distill_loss`.
    """
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(f"lm_loss: hidden must be [B, T, C] and labels [B, T]; got {tuple(hidden.shape)}, "
                         f"{tuple(labels.shape)}")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"lm_loss: head {tuple(lm_head_weight.shape)} does not fit hidden width {hidden.shape[2]}")
    if loss_mask is not None and loss_mask.shape != labels.shape:
        raise ValueError(f"lm_loss: loss_mask {tuple(loss_mask.shape)} must match labels {tuple(labels.shape)}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    targets = labels[:, 1:]
    keep = targets != IGNORE_INDEX
    if loss_mask is not None:
        keep = keep & loss_mask[:, 1:].bool()
    x = hidden[:, :-1][keep]
    y = targets[keep]
    need_dx = torch.is_grad_enabled() and x.requires_grad
    need_dw = torch.is_grad_enabled() and lm_head_weight.requires_grad
    total, ce, kl = _ChunkedDistill.apply(x, lm_head_weight, None, None, y, 1.0, 0.0, 1.0, int(chunk_tokens),
                                          need_dx, need_dw)
    return DistillLosses(total, ce, kl, int(y.numel()))


def _check_shapes(hs: Tensor, ht: Tensor, ws: Tensor, wt: Tensor, labels: Tensor, mask: Optional[Tensor]) -> None:
    if hs.dim() != 3 or ht.dim() != 3 or hs.shape[:2] != ht.shape[:2] or labels.shape != hs.shape[:2]:
        raise ValueError(
            f"distill_loss: hidden states must be [B, T, C] with equal B, T and labels [B, T]; got student "
            f"{tuple(hs.shape)}, teacher {tuple(ht.shape)}, labels {tuple(labels.shape)}"
        )
    if ws.dim() != 2 or wt.dim() != 2 or ws.shape[0] != wt.shape[0]:
        raise ValueError(f"distill_loss: heads must be [V, C] with one V; got {tuple(ws.shape)}, {tuple(wt.shape)}")
    if ws.shape[1] != hs.shape[2] or wt.shape[1] != ht.shape[2]:
        raise ValueError(
            f"distill_loss: head widths {ws.shape[1]} (student), {wt.shape[1]} (teacher) do not match hidden "
            f"widths {hs.shape[2]}, {ht.shape[2]}"
        )
    if mask is not None and mask.shape != labels.shape:
        raise ValueError(f"distill_loss: loss_mask {tuple(mask.shape)} must match labels {tuple(labels.shape)}")


def _vocab_blocks(w: Tensor) -> list[slice]:
    """One block for fp32 heads (no copy); VOCAB_BLOCK rows at a time for low-precision ones."""
    v = w.shape[0]
    step = v if w.dtype == torch.float32 else VOCAB_BLOCK
    return [slice(i, min(i + step, v)) for i in range(0, v, step)]


_MM_OUT_DTYPE: dict[str, bool] = {}  # device type -> whether torch.mm(..., out_dtype=float32) runs there


def _mm_fp32_out(x: Tensor, w: Tensor) -> Optional[Tensor]:
    """x [c, C] @ w[V, C]^T of two bf16 / fp16 tensors with fp32 accumulation and output (cuBLAS, tensor cores),
    or None where torch has no such kernel (CPU) or the dtypes differ. The products of bf16 values are exact in
    fp32, so this equals the fp32 matmul of the upcast values up to summation order, without upcasting."""
    if x.dtype != w.dtype or x.dtype not in (torch.bfloat16, torch.float16) or not x.is_cuda:
        return None
    if _MM_OUT_DTYPE.get("cuda", True):
        try:
            return torch.mm(x, w.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE["cuda"] = False
    return None


@contextmanager
def tf32_matmuls(enabled: bool):
    """torch's CUDA TF32 setting for fp32 matmuls set to `enabled` inside, restored after."""
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def _loss_matmuls(x: Tensor):
    """For bf16 / fp16 inputs on a GPU, fp32 matmuls on TF32 tensor cores: the logits' gradient (fp32) times a
    head or the hidden states. The low-precision operands are exact in TF32; the fp32 gradient is rounded to
    TF32's 10-bit mantissa (~5e-4, finer than the bf16 gradient it becomes) where plain fp32 CUDA matmuls run
    ~15x slower on an H200. fp32 inputs keep torch's own setting."""
    return tf32_matmuls(True) if x.is_cuda and x.dtype != torch.float32 else nullcontext()


def _logits(x: Tensor, w: Tensor) -> Tensor:
    """[c, C] @ [V, C]^T -> [c, V] fp32 logits (x in its own dtype: a bf16 x with a bf16 head never upcasts)."""
    direct = _mm_fp32_out(x, w)
    if direct is not None:
        return direct
    x32 = x.float()
    if w.dtype == torch.float32:
        return x32 @ w.T
    out = x32.new_empty(x32.shape[0], w.shape[0])
    for b in _vocab_blocks(w):
        out[:, b] = x32 @ w[b].float().T
    return out


def _grad_input(g: Tensor, w: Tensor) -> Tensor:
    """[c, V] logits gradient @ [V, C] -> [c, C] fp32 (g fp32, or in w's low precision on CUDA)."""
    direct = _mm_fp32_out(g, w.T)
    if direct is not None:
        return direct
    if w.dtype == torch.float32:
        return g @ w
    out = g.new_zeros(g.shape[0], w.shape[1])
    for b in _vocab_blocks(w):
        out.addmm_(g[:, b], w[b].float())
    return out


def _add_weight_grad(dw: Tensor, g: Tensor, x: Tensor) -> None:
    """dw [V, C] fp32 += g^T [V, c] @ x [c, C]: a low-precision g and x on tensor cores with fp32 output."""
    direct = _mm_fp32_out(g.T, x.T)
    if direct is not None:
        dw.add_(direct)
    else:
        dw.addmm_(g.T.float(), x.float())


def _chunk_losses(
    s: Tensor, t: Tensor, y: Tensor, tau: float, ce_scale: float, kl_scale: float, need_grad: bool,
    grad_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """Summed CE and tau^2-scaled KL of one chunk, and d(loss)/d(student logits) if needed.

    s, t: [c, V] fp32 student / teacher logits (both may be overwritten; t None: CE only, KL 0); y: [c]
    targets. ce_scale and kl_scale are the weights over the token count. On CUDA one Triton kernel does it
    (`harness.loss_kernel`: two reads of each logit and one write, where the PyTorch form makes ~6 passes) and
    stores the gradient in grad_dtype; the PyTorch form returns it in fp32.
    """
    if loss_kernel.available(s):
        return loss_kernel.distill_rows(s, t, y, tau, ce_scale, kl_scale, need_grad, grad_dtype)
    return _chunk_losses_torch(s, t, y, tau, ce_scale, kl_scale, need_grad)


def _chunk_losses_torch(
    s: Tensor, t: Tensor, y: Tensor, tau: float, ce_scale: float, kl_scale: float, need_grad: bool
) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """`_chunk_losses` in PyTorch (CPU, and the reference for the kernel). In-place updates keep ~5 [c, V]
    buffers alive."""
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    ce_sum = (lse.squeeze(1) - s.gather(1, y[:, None]).squeeze(1)).sum()
    if t is None:
        if not need_grad:
            return ce_sum, ce_sum.new_zeros(()), None
        soft = s.sub_(lse).exp_()
        soft.scatter_add_(1, y[:, None], soft.new_full((soft.shape[0], 1), -1.0))
        return ce_sum, ce_sum.new_zeros(()), soft.mul_(ce_scale)
    log_p = t.div_(tau)
    log_p -= torch.logsumexp(log_p, dim=-1, keepdim=True)
    log_q = s - lse if tau == 1.0 else s / tau
    if tau != 1.0:
        log_q -= torch.logsumexp(log_q, dim=-1, keepdim=True)
    p = log_p.exp()
    kl_sum = log_p.sub_(log_q).mul_(p).sum() * tau**2
    if not need_grad:
        return ce_sum, kl_sum, None
    # d(tau^2 KL)/ds = tau (q - p); d(CE)/ds = softmax(s) - onehot(y).
    g = log_q.exp_().sub_(p).mul_(kl_scale * tau)
    del p
    soft = s.sub_(lse).exp_()
    soft.scatter_add_(1, y[:, None], soft.new_full((soft.shape[0], 1), -1.0))
    g.add_(soft, alpha=ce_scale)
    return ce_sum, kl_sum, g


class _ChunkedDistill(torch.autograd.Function):
    """Rows already selected: xs [n, Cs], xt [n, Ct] (None: CE only), y [n]. Returns (total, ce, kl) fp32 scalars."""

    @staticmethod
    def forward(ctx, xs, ws, xt, wt, y, ce_weight, kl_weight, tau, chunk, need_dx, need_dw):
        # Autocast would run the fp32 logit matmuls in bf16.
        with torch.autocast(device_type=xs.device.type, enabled=False), _loss_matmuls(xs):
            total, ce, kl, dx, dw = _chunked_forward(xs, ws, xt, wt, y, ce_weight, kl_weight, tau, chunk,
                                                     need_dx, need_dw)
        ctx.grads = (dx, dw)
        ctx.dtypes = (xs.dtype, ws.dtype)
        ctx.mark_non_differentiable(ce, kl)
        return total, ce, kl

    @staticmethod
    def backward(ctx, g_total, _g_ce, _g_kl):
        dx, dw = ctx.grads
        ctx.grads = None
        # Computed for d(total) = 1 and kept in fp32 so that a scaled g_total (1/grad_accum) is exact.
        g = g_total.float()
        dx = None if dx is None else dx.mul_(g).to(ctx.dtypes[0])
        dw = None if dw is None else dw.mul_(g).to(ctx.dtypes[1])
        return dx, dw, None, None, None, None, None, None, None, None, None


def _chunked_forward(
    xs: Tensor, ws: Tensor, xt: Tensor, wt: Tensor, y: Tensor, ce_weight: float, kl_weight: float, tau: float,
    chunk: int, need_dx: bool, need_dw: bool,
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor], Optional[Tensor]]:
    """Loop over [chunk]-row slices: (total, ce, kl, d total/d xs [n, Cs], d total/d ws [V, Cs]), grads fp32."""
    n = xs.shape[0]
    denom = max(n, 1)
    ce_acc = xs.new_zeros((), dtype=torch.float32)
    kl_acc = xs.new_zeros((), dtype=torch.float32)
    dx = torch.empty_like(xs, dtype=torch.float32) if need_dx else None
    dw = torch.zeros_like(ws, dtype=torch.float32) if need_dw else None
    # bf16 hidden states and head on CUDA: the logits' gradient is rounded once to bf16, so that both gradient
    # matmuls run on bf16 tensor cores (TF32 on the fp32 gradient took half of the fused loss's time)
    low = xs.dtype in (torch.bfloat16, torch.float16) and ws.dtype == xs.dtype and loss_kernel.available(xs)
    grad_dtype = xs.dtype if low else torch.float32
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        s, t = _logits(xs[lo:hi], ws), (None if xt is None else _logits(xt[lo:hi], wt))
        ce_sum, kl_sum, g = _chunk_losses(
            s, t, y[lo:hi], tau, ce_weight / denom, kl_weight / denom, need_dx or need_dw, grad_dtype
        )
        del s, t
        ce_acc += ce_sum
        kl_acc += kl_sum
        if dx is not None:
            dx[lo:hi] = _grad_input(g, ws)
        if dw is not None:
            _add_weight_grad(dw, g, xs[lo:hi])
    ce, kl = ce_acc / denom, kl_acc / denom
    total = ce_weight * ce + kl_weight * kl
    return total, ce, kl, dx, dw
