"""The output-head matmuls of the chunked losses: fp32 logits of a chunk of rows, and the gradients of a loss with
respect to the hidden states and the head, each in the precision that keeps fp32 results without an fp32 copy of a
whole low-precision head."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Optional

import torch
from torch import Tensor

# Rows of a low-precision head upcast to fp32 at a time, so that no fp32 copy of a whole head exists.
VOCAB_BLOCK = 8192


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


def loss_matmuls(x: Tensor):
    """For bf16 / fp16 inputs on a GPU, fp32 matmuls on TF32 tensor cores: the logits' gradient (fp32) times a
    head or the hidden states. The low-precision operands are exact in TF32; the fp32 gradient is rounded to
    TF32's 10-bit mantissa (~5e-4, finer than the bf16 gradient it becomes) where plain fp32 CUDA matmuls run
    ~15x slower on an H200. fp32 inputs keep torch's own setting."""
    return tf32_matmuls(True) if x.is_cuda and x.dtype != torch.float32 else nullcontext()


def logits(x: Tensor, w: Tensor) -> Tensor:
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


def grad_input(g: Tensor, w: Tensor) -> Tensor:
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


def add_weight_grad(dw: Tensor, g: Tensor, x: Tensor) -> None:
    """dw [V, C] fp32 += g^T [V, c] @ x [c, C]: a low-precision g and x on tensor cores with fp32 output."""
    direct = _mm_fp32_out(g.T, x.T)
    if direct is not None:
        dw.add_(direct)
    else:
        dw.addmm_(g.T.float(), x.float())
