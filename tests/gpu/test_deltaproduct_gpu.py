"""On CUDA: gated DeltaProduct's fla routes (kernels.kernel_gated_delta_product: fla's chunk_gated_delta_product and
the gated delta rule over the interleaved steps) against the float32 reference (recurrence.chunk_gated_delta_product)
at SmolLM2-135M's heads (9 x 64): output, final state and every input's gradient, with an initial state; and state
passing. The layer itself (projections, convolution, gates, norm) is tests/gpu/test_mixer_layers.py's, parametrised
over every mixer. Skipped without CUDA or fla."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("GPU kernel tests need CUDA", allow_module_level=True)

from harness.mixers import kernels, recurrence  # noqa: E402
from harness.mixers.ops import l2norm  # noqa: E402

_reason = kernels.kernel_unavailable_reason("fla")
if _reason is not None:
    pytest.skip(f"GPU kernels unavailable: {_reason}", allow_module_level=True)

from harness.bench.recurrences import rel_err, tol_for  # noqa: E402

H, K = 9, 64  # SmolLM2-135M: 9 heads of 64


def make_inputs(B: int, T: int, n: int, seed: int, negative: bool = False) -> dict:
    """The layer's distributions: raw q, k ~ N(0, 1) (L2-normalised in the kernel), Gated DeltaNet's per-head decay
    (A ~ U(0, 16), dt ~ LogU(1e-3, 0.1), logits ~ N(0, 0.5^2)), beta = sigmoid(N(0, 1)) (x 2 with negative
    eigenvalues), an initial state, and cotangents on the output and the final state."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).cuda()

    A = torch.rand(H, generator=gen).cuda() * 16
    dt = torch.exp(torch.rand(H, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).cuda()
    g = -A * F.softplus(randn(B, T, H, std=0.5) + dt + torch.log(-torch.expm1(-dt)))
    beta = torch.sigmoid(randn(B, T, n, H)) * (2 if negative else 1)
    x = {"q": randn(B, T, H, K).bfloat16(), "k": randn(B, T, n, H, K).bfloat16(),
         "v": randn(B, T, n, H, K).bfloat16(), "g": g, "beta": beta, "h0": randn(B, H, K, K)}
    x = {name: t.detach().requires_grad_(True) for name, t in x.items()}
    x["do"], x["dS"] = randn(B, T, H, K), randn(B, H, K, K)
    return x


def forward_backward(x: dict, route):
    """(o, final state, {input: gradient}) of <o, do> + <S, dS>; route None: the float32 reference."""
    names = ("q", "k", "v", "g", "beta", "h0")
    ins = {n: x[n] if route else x[n].detach().float().requires_grad_(True) for n in names}
    if route:
        o, s = kernels.kernel_gated_delta_product(*(ins[n] for n in names[:5]), scale=K**-0.5,
                                                  initial_state=ins["h0"], normalize_qk=True, route=route)
    else:
        o, s = recurrence.chunk_gated_delta_product(l2norm(ins["q"]), l2norm(ins["k"]), ins["v"], ins["g"],
                                                    ins["beta"], scale=K**-0.5, initial_state=ins["h0"])
    loss = (o.float() * x["do"]).sum() + (s.float() * x["dS"]).sum()
    return o, s, dict(zip(names, torch.autograd.grad(loss, list(ins.values()))))


def run_route(x: dict, route: str):
    try:
        return forward_backward(x, route)
    except RuntimeError as exc:  # fla's Hopper guard (triton 3.4 - 3.7.1 without TileLang): the other route serves
        if "tilelang" in str(exc).lower() or "#640" in str(exc):
            pytest.skip(f"fla refuses route {route} here: {str(exc).splitlines()[0]}")
        raise


@pytest.mark.parametrize("T", [2048, 1000])
@pytest.mark.parametrize("n,negative", [(2, False), (3, True)])
@pytest.mark.parametrize("route", kernels.PRODUCT_ROUTES)
def test_kernel_matches_reference(route, n, negative, T):
    x = make_inputs(2, T, n, seed=1, negative=negative)
    o, s, grads = run_route(x, route)
    o_ref, s_ref, grads_ref = forward_backward(x, None)
    errs = {"o": rel_err(o, o_ref), "state": rel_err(s, s_ref)}
    errs.update({f"d{name}": rel_err(grads[name], grads_ref[name]) for name in grads})
    bad = {name: e for name, e in errs.items() if not e <= tol_for(name)}
    table = ", ".join(f"{name}={e:.2e} (<= {tol_for(name):.0e})" for name, e in errs.items())
    assert not bad, f"route {route}, n={n}, T={T}: {', '.join(bad)} over tolerance. All: {table}"


def test_the_default_route_runs_forward_and_backward_here():
    """The route select_gated_delta_product_route picks on this machine is not refused by fla's Hopper guard."""
    x = make_inputs(1, 128, 2, seed=5)
    o, s, grads = forward_backward(x, kernels.select_gated_delta_product_route(x["q"], x["k"], x["v"], x["g"],
                                                                               x["beta"], x["h0"]))
    assert torch.isfinite(o).all() and all(torch.isfinite(g).all() for g in grads.values())


@pytest.mark.parametrize("route", kernels.PRODUCT_ROUTES)
def test_state_passing_matches_one_pass(route):
    """Tokens [0, 600) then [600, 1000) from the first part's final state == one pass over 1000."""
    x = make_inputs(2, 1000, 2, seed=3)
    names = ("q", "k", "v", "g", "beta")

    def part(sl, h0):
        return kernels.kernel_gated_delta_product(*(x[n][:, sl] for n in names), scale=K**-0.5, initial_state=h0,
                                                  normalize_qk=True, route=route)

    with torch.no_grad():
        full, full_state = part(slice(None), x["h0"])
        first, state = part(slice(0, 600), x["h0"])
        second, last = part(slice(600, None), state)
    assert rel_err(torch.cat([first, second], 1), full) < tol_for("o")
    assert rel_err(last, full_state) < tol_for("state")
