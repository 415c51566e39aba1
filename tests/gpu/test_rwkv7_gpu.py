"""On CUDA: RWKV-7's kernel route (kernels.kernel_dplr_delta: fla's chunk_rwkv7) against the float32 reference
(recurrence.chunk_dplr_delta) at SmolLM2-135M's heads (9 x 64), with the layer's input distributions: output,
final state and every input's gradient, with an initial state, on fla's 64-token chunks (the decay floor given) and
its 16-token ones (none); state passing; a padded batch. The layer itself (LoRAs, norm, gate) is
tests/gpu/test_mixer_layers.py's, parametrised over every mixer. Skipped without CUDA or fla."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("GPU kernel tests need CUDA", allow_module_level=True)

from harness.mixers import dispatch, kernels, recurrence  # noqa: E402

_reason = kernels.kernel_unavailable_reason("fla")
if _reason is not None:
    pytest.skip(f"GPU kernels unavailable: {_reason}", allow_module_level=True)

from harness.bench.recurrences import rel_err, tol_for  # noqa: E402

H, K = 9, 64  # SmolLM2-135M: 9 heads of 64
FLOOR = -math.exp(-0.5)  # RWKV-7's bound on the log decay (harness.mixers.rwkv7.DECAY_SCALE)
NAMES = ("q", "k", "v", "a", "b", "g", "h0")


def make_inputs(B: int, T: int, seed: int, decay_init: str = "radlads") -> dict:
    """As the layer passes them: r, k ~ N(0, 1) (the copied q, k; scale 1), a = -kk, b = kk * sigmoid(N(0, 1)),
    g = -exp(-0.5) sigmoid(w0 + N(0, 1)) with w0 RADLADS' slow schedule (or RWKV-7's, down to decays of 0.56), an
    initial state, and cotangents on the output and the final state."""
    from harness.mixers.rwkv7 import decay_bias

    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).cuda()

    removal = F.normalize(randn(B, T, H, K), dim=-1)
    w0 = decay_bias(decay_init, H * K, K, 0.5).cuda().view(H, K)
    x = {"q": randn(B, T, H, K).bfloat16(), "k": randn(B, T, H, K).bfloat16(), "v": randn(B, T, H, K).bfloat16(),
         "a": (-removal).bfloat16(), "b": (removal * torch.sigmoid(randn(B, T, H, K))).bfloat16(),
         "g": FLOOR * torch.sigmoid(w0 + randn(B, T, H, K)), "h0": randn(B, H, K, K)}
    x = {name: t.detach().requires_grad_(True) for name, t in x.items()}
    x["do"], x["dS"] = randn(B, T, H, K), randn(B, H, K, K)
    return x


def forward_backward(x: dict, kernel: bool, lower_bound=FLOOR):
    """(o, final state, {input: gradient}) of <o, do> + <S, dS>; the kernel, or the float32 reference."""
    ins = {n: x[n] if kernel else x[n].detach().float().requires_grad_(True) for n in NAMES}
    args = [ins[n] for n in NAMES[:6]]
    if kernel:
        o, s = kernels.kernel_dplr_delta(*args, scale=1.0, initial_state=ins["h0"], lower_bound=lower_bound)
    else:
        o, s = recurrence.chunk_dplr_delta(*args, scale=1.0, initial_state=ins["h0"])
    loss = (o.float() * x["do"]).sum() + (s.float() * x["dS"]).sum()
    return o, s, dict(zip(NAMES, torch.autograd.grad(loss, list(ins.values()))))


@pytest.mark.parametrize("T", [2048, 1000])
@pytest.mark.parametrize("decay_init", ["radlads", "rwkv7"])
@pytest.mark.parametrize("lower_bound", [FLOOR, None], ids=["chunk64", "chunk16"])
def test_kernel_matches_reference(lower_bound, decay_init, T):
    x = make_inputs(2, T, seed=1, decay_init=decay_init)
    o, s, grads = forward_backward(x, True, lower_bound)
    o_ref, s_ref, grads_ref = forward_backward(x, False)
    errs = {"o": rel_err(o, o_ref), "state": rel_err(s, s_ref)}
    errs.update({f"d{name}": rel_err(grads[name], grads_ref[name]) for name in grads})
    bad = {name: e for name, e in errs.items() if not e <= tol_for(name, "rwkv7")}
    table = ", ".join(f"{name}={e:.2e} (<= {tol_for(name, 'rwkv7'):.0e})" for name, e in errs.items())
    assert not bad, f"{decay_init}, T={T}, lower_bound={lower_bound}: {', '.join(bad)} over tolerance. All: {table}"


def test_state_passing_matches_one_pass():
    """Tokens [0, 600) then [600, 1000) from the first part's final state == one pass over 1000."""
    x = make_inputs(2, 1000, seed=3)

    def part(sl, h0):
        return kernels.kernel_dplr_delta(*(x[n][:, sl] for n in NAMES[:6]), scale=1.0, initial_state=h0,
                                         lower_bound=FLOOR)

    with torch.no_grad():
        full, full_state = part(slice(None), x["h0"])
        first, state = part(slice(0, 600), x["h0"])
        second, last = part(slice(600, None), state)
    assert rel_err(torch.cat([first, second], 1), full) < tol_for("o", "rwkv7")
    assert rel_err(last, full_state) < tol_for("state", "rwkv7")


def test_a_padded_batch_on_the_kernel_is_each_row_alone():
    """Left padding (k = b = 0, no decay at padded tokens) through fla's kernel: each row's outputs and final state
    are those of the row alone on the reference."""
    lengths = (300, 777, 1000)
    x = make_inputs(3, 1000, seed=4)
    mask = torch.arange(1000, device="cuda")[None] >= torch.tensor([[1000 - n] for n in lengths], device="cuda")
    args = [x[n].detach() for n in NAMES[:6]]
    with torch.no_grad():
        o, state = dispatch.dplr_delta(*args, scale=1.0, prior=None, backend="kernel", chunk_size=64, mask=mask,
                                       decay_floor=FLOOR)
        for row, n in enumerate(lengths):
            alone = [t[row:row + 1, -n:].float() for t in args]
            o1, s1 = dispatch.dplr_delta(*alone, scale=1.0, prior=None, backend="reference", chunk_size=64)
            assert rel_err(o[row, -n:], o1[0]) < tol_for("o", "rwkv7"), row
            assert rel_err(state[row], s1[0]) < tol_for("state", "rwkv7"), row
