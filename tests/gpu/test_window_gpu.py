"""On CUDA: the sliding window of `options.window` on fla's parallel_attn (the kernel path of
harness.mixers.window) against the blockwise PyTorch form in float32, the reference: outputs and the gradients of
q, k and v; exactly the band of keys each query sees (and each key's gradient reaches); and a whole gated_deltanet
layer with a window on the kernel backend against the reference backend. Skipped without CUDA or without fla.

    source .devbundle/setup.sh && python3 -m pytest -q tests/gpu/test_window_gpu.py

Tolerances, as relative errors ||a - b|| / ||b|| over the whole tensor. bf16: q, k, v are the same bf16 values on
both sides, so the kernel's error is its own roundings, each about the bf16 unit roundoff u = 2^-8 = 3.9e-3
relative: the probabilities before P @ V, the output and the incoming gradient (stored in bf16), dS before the
dq / dk products, dq, dk and dv stored in bf16; an emulation of those roundings in PyTorch at these shapes gives
2-3e-3, so 1e-2 (2.5 u). float32 never reaches the kernel (kernels.WINDOW_KERNEL_DTYPES: fla's TileLang backend on
Hopper fails to compile it; the H100 run of 2026-12-05 that found it passed every bf16 case), which
test_float32_stays_on_the_blockwise_form holds. A window off by one key (W - 1 or W + 1) moves every
output and gradient by 1e-1 (W = 64) to 2.5e-1 (W = 16) at these shapes, 10x the bf16 tolerance; one wrong key for a
few queries only (e.g. at the kernel's 64- or 128-token block edges) is below these norms, and is what
test_each_query_sees_exactly_its_window catches, exactly.
"""

from __future__ import annotations

import pytest
import torch

from harness.mixers import kernels
from harness.mixers.kernels import kernel_unavailable_reason
from harness.mixers.window import window_attention

REASON = kernel_unavailable_reason("fla")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"needs CUDA and fla: {REASON}")

TOLERANCE = {torch.bfloat16: 1e-2}
HEADS, HEAD_DIM = 9, 64  # SmolLM2-135M's heads
SCALE = HEAD_DIM**-0.5


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of kernels.kernel_window_attention (which still runs): proof that the kernel path ran."""
    calls = []
    original = kernels.kernel_window_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(kernels, "kernel_window_attention", counted)
    return calls


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run(q, k, v, window: int, backend: str, weights: torch.Tensor):
    """(o, dq, dk, dv) of sum(o * weights) through window_attention on `backend`."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    o, _ = window_attention(q, k, v, window, scale=SCALE, backend=backend)
    (o.float() * weights).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("length", [512, 500])
@pytest.mark.parametrize("window", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_the_kernel_matches_the_blockwise_form(dtype, window, length, kernel_calls):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, weights = (torch.randn(2, length, HEADS, HEAD_DIM, device="cuda", generator=gen) for _ in range(4))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    got = run(q, k, v, window, "kernel", weights)
    assert kernel_calls, "the kernel path did not run"
    assert all(t.dtype == dtype for t in got)
    want = run(q.float(), k.float(), v.float(), window, "reference", weights)
    errors = {name: rel(a, b) for name, a, b in zip(("o", "dq", "dk", "dv"), got, want)}
    assert max(errors.values()) < TOLERANCE[dtype], errors


@pytest.mark.parametrize("window", [16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
def test_each_query_sees_exactly_its_window(dtype, window, kernel_calls):
    """v one-hot: channel j is 1 at key s_j only, so o[t, j] is query t's probability on key s_j, nonzero exactly
    for t in s_j .. s_j + W - 1 (a masked key's exp is exactly 0); the gradient one-hot at query t_j in channel j
    makes dv[s, j] = P[t_j, s], nonzero exactly for s in t_j - W + 1 .. t_j. Keys and queries at the kernel's block
    edges (64, 128), at the start and at the end of a sequence of 500."""
    length, dim = 500, 16
    marks = torch.tensor([0, 1, 63, 64, 65, 127, 128, 129, 191, 255, 256, 300, 383, 384, 450, length - 1],
                         device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k = (torch.randn(1, length, 1, dim, device="cuda", generator=gen).to(dtype).requires_grad_(True)
            for _ in range(2))
    channels = torch.arange(dim, device="cuda")
    v = torch.zeros(1, length, 1, dim, device="cuda", dtype=dtype)
    v[0, marks, 0, channels] = 1
    v.requires_grad_(True)
    o, _ = window_attention(q, k, v, window, scale=dim**-0.5, backend="kernel")
    grad = torch.zeros_like(o)
    grad[0, marks, 0, channels] = 1
    o.backward(grad)
    assert kernel_calls, "the kernel path did not run"
    t = torch.arange(length, device="cuda")[:, None]
    sees = (t >= marks) & (t - marks < window)  # [T, dim]: query t sees key marks[j]
    seen_by = (marks >= t) & (marks - t < window)  # [T, dim]: key t is in the window of query marks[j]
    assert torch.equal(o[0, :, 0] != 0, sees)
    assert torch.equal(v.grad[0, :, 0] != 0, seen_by)


def test_a_gated_deltanet_layer_with_a_window_matches_its_reference_backend(kernel_calls):
    """The mixer contract's GPU property (harness.mixers.contract.kernel_matches_reference: SmolLM2-135M's head
    layout, 9 query heads over 3 KV heads, x [2, 512, 576], the teacher's RoPE on the window, window_gain moved off
    0 so that window and recurrence both count): the kernel backend in bf16 within the property's bounds. The
    window's kernel runs once, in the kernel student's forward; the reference students' windows are blockwise."""
    from harness.mixers.contract import PASS, SKIP, run_contract

    (outcome,) = run_contract("gated_deltanet", {"window": 16}, only=["kernel_matches_reference"])
    if outcome.status == SKIP:
        pytest.skip(outcome.detail)
    assert outcome.status == PASS, outcome.detail
    assert len(kernel_calls) == 1, f"the window's kernel ran {len(kernel_calls)} times, not once"


def test_float32_stays_on_the_blockwise_form(kernel_calls):
    """On CUDA and the kernel backend, float32 q, k, v take the blockwise form: the kernel is never called."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 128, HEADS, HEAD_DIM, device="cuda", generator=gen) for _ in range(3))
    out, _ = window_attention(q, k, v, 16, scale=SCALE, backend="kernel")
    assert kernel_calls == []
    torch.testing.assert_close(out, window_attention(q, k, v, 16, scale=SCALE, backend="reference")[0])
