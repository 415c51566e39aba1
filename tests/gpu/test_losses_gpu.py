"""The chunked stage-3 loss on CUDA: bf16 inputs against the fp32 direct computation, and peak memory at
a SmolLM2-1.7B-shaped head (B=8, T=2048, V=49152, C=2048) against the 3.2 GB of whole-batch fp32 logits.
On CUDA the softmax work runs in harness.loss_kernel's Triton kernel, also checked directly against the
PyTorch form. Skipped without CUDA. (There is no fla path to compare: fla's fused losses do not fit, see
harness.losses.kl_ce.)
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU loss tests need CUDA", allow_module_level=True)

from harness import loss_kernel  # noqa: E402
from harness.losses import distill_loss, tf32_matmuls  # noqa: E402
from harness.losses.kl_ce import ce_kl_rows_torch  # noqa: E402
from tests.test_losses import direct_distill  # noqa: E402

DEV = torch.device("cuda")


def loss_inputs(b: int, t: int, c: int, v: int, dtype: torch.dtype, seed: int = 0, ignored_prefix: bool = True):
    """Student and teacher hidden states and heads, and labels (the first eighth ignored, with ignored_prefix)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    hs = torch.randn(b, t, c, device=DEV, generator=g).to(dtype).requires_grad_()
    ht = torch.randn(b, t, c, device=DEV, generator=g).to(dtype)
    ws = (torch.randn(v, c, device=DEV, generator=g) / c**0.5).to(dtype).requires_grad_()
    wt = (ws.detach().float() + 0.3 * torch.randn(v, c, device=DEV, generator=g) / c**0.5).to(dtype)
    labels = torch.randint(0, v, (b, t), device=DEV, generator=g)
    if ignored_prefix:
        labels[:, : t // 8] = -100
    return hs, ht, ws, wt, labels


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_bf16_chunked_matches_fp32_direct(tau):
    hs, ht, ws, wt, labels = loss_inputs(2, 512, 512, 8192, torch.bfloat16)
    kw = dict(ce_weight=1.0, kl_weight=1.0, temperature=tau)
    out = distill_loss(hs, ht, ws, wt, labels, chunk_tokens=256, **kw)
    with tf32_matmuls(False):
        ref_total, ref_ce, ref_kl = direct_distill(hs, ht, ws, wt, labels, **kw)
    for got, want in [(out.total, ref_total), (out.ce, ref_ce), (out.kl, ref_kl)]:
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-3, atol=1e-5)
    got = torch.autograd.grad(out.total, (hs, ws))
    want = torch.autograd.grad(ref_total, (hs, ws))
    for a, b in zip(got, want):  # bf16 gradients: compare by relative norm
        err = (a.float() - b.float()).norm() / b.float().norm()
        assert err < 1e-2, err


@pytest.mark.parametrize("tau,teacher,need_grad", [(1.0, True, True), (2.0, True, True), (0.5, True, False),
                                                   (1.0, False, True)])
def test_triton_row_kernel_equals_the_pytorch_form(tau, teacher, need_grad):
    """harness.loss_kernel against ce_kl_rows_torch on the same fp32 logits, at the SmolLM2 vocabulary (49,152 =
    12 column blocks) and at a vocabulary that leaves a partial block; logits spread like a trained head's."""
    assert loss_kernel.available(torch.empty(1, device=DEV)), "Triton is needed on CUDA machines"
    g = torch.Generator(device=DEV).manual_seed(1)
    for rows, vocab in [(300, 49152), (77, 5003)]:
        s = 4 * torch.randn(rows, vocab, device=DEV, generator=g)
        t = (s + 2 * torch.randn(rows, vocab, device=DEV, generator=g)) if teacher else None
        y = torch.randint(0, vocab, (rows,), device=DEV, generator=g)
        want = ce_kl_rows_torch(s.clone(), None if t is None else t.clone(), y, tau, 0.7, 0.3, need_grad)
        got = loss_kernel.distill_rows(s.clone(), None if t is None else t.clone(), y, tau, 0.7, 0.3, need_grad)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-4)
        if need_grad:
            torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-7)
            # the bf16 gradient the chunked loss uses on CUDA: the fp32 one rounded once (one bf16 step apart at most)
            low = loss_kernel.distill_rows(s.clone(), None if t is None else t.clone(), y, tau, 0.7, 0.3, True,
                                           torch.bfloat16)[2]
            assert low.dtype == torch.bfloat16
            torch.testing.assert_close(low.float(), want[2].to(torch.bfloat16).float(), rtol=8e-3, atol=1e-7)
        else:
            assert got[2] is None and want[2] is None


def test_peak_memory_well_below_whole_batch_logits():
    b, t, c, v = 8, 2048, 2048, 49152
    logits_bytes = b * t * v * 4  # 3.2 GB
    hs, ht, ws, wt, labels = loss_inputs(b, t, c, v, torch.bfloat16)
    labels[:, : t // 8] = labels[:, t // 8 : t // 4]  # count (almost) every token
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = distill_loss(hs, ht, ws, wt, labels, ce_weight=1.0, kl_weight=1.0, temperature=1.0)
    out.total.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    print(f"chunked loss fwd+bwd peak {peak / 1e9:.2f} GB over inputs; whole-batch fp32 logits "
          f"{logits_bytes / 1e9:.2f} GB; tokens {out.tokens}")
    assert torch.isfinite(out.total) and hs.grad is not None and ws.grad is not None
    assert peak < 0.5 * logits_bytes
