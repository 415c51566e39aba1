"""GPU kernels (fla, mlstm_kernels) against the PyTorch reference, for every recurrence case of
docs/RECURRENCES.md, at SmolLM2 head layouts. Skipped without CUDA or without the kernel libraries.

Cases, input distributions and tolerances live in harness/bench/recurrences.py (shared with `harness bench
--what recurrences`).
The first call of each case compiles and autotunes its Triton kernels (tens of seconds per head layout).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU kernel tests need CUDA", allow_module_level=True)

from harness.mixers import kernels  # noqa: E402

_reason = kernels.kernel_unavailable_reason("all")
if _reason is not None:
    pytest.skip(f"GPU kernels unavailable: {_reason}", allow_module_level=True)


from harness.bench import recurrences as R  # noqa: E402

B = 4
CASES = tuple(R.kernel_cases())  # every registered mixer that declares a kernel case, plug-ins too
DELTA_CASES = tuple(n for n, case in R.kernel_cases().items() if case.recurrence == "gated_delta")
WITH_ALTERNATIVES = tuple(n for n, case in R.kernel_cases().items() if case.alternative_routes)
STATEFUL = tuple(n for n, case in R.kernel_cases().items() if case.stateful)  # fox's softmax attention has no state
# (shape, T): both head layouts at T = 2048, and the small one at T = 1000 (not a multiple of 64).
GRID = [("smollm2-135m", 2048), ("smollm2-135m", 1000), ("smollm2-1.7b", 2048)]


def _assert_within(errs: dict, what: str, case: str) -> None:
    bad = R.failures(errs, case)
    table = ", ".join(f"{n}={e:.2e} (<= {R.tol_for(n, case):.1e})" for n, e in errs.items())
    assert not bad, f"{what}: {', '.join(bad)} over tolerance. All: {table}"


@pytest.mark.parametrize("shape,T", GRID, ids=[f"{s}-T{t}" for s, t in GRID])
@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_reference(case, shape, T):
    """Output, final state and every input gradient of the default kernel route vs the float32 reference."""
    x = R.make_inputs(case, B, T, **R.SHAPES[shape], seed=1)
    errs = R.compare(x)
    _assert_within(errs, f"{case} {shape} T={T} route={R.selected_route(x, 'auto')}", case)


@pytest.mark.parametrize("case", STATEFUL)
def test_initial_state_is_honoured(case):
    """With a random initial state (T = 1000): matches the reference, including the initial state's gradient,
    and differs from the run without it over the first chunk. (Over all 1000 tokens the state's share of
    linear attention's output is only ~0.6%: the unnormalised sum of k v^T outgrows a N(0, 1) state.)"""
    x = R.make_inputs(case, B, 1000, **R.SHAPES["smollm2-135m"], seed=2, with_state=True)
    errs = R.compare(x)
    _assert_within(errs, f"{case} with initial state", case)
    with torch.no_grad():
        with_state, _ = R.run_kernel(x)
        without, _ = R.run_kernel(dict(x, h0=None))
    # the reference in fp32 puts this at 2.2e-2 (linear_attn) .. 2.5 (deltanet)
    assert R.rel_err(with_state[:, :64], without[:, :64]) > 1e-2, "the initial state did not change the output"


@pytest.mark.parametrize("case", STATEFUL)
def test_state_passing_matches_one_pass(case):
    """Kernel on tokens [0, 600) then [600, 1000) from the first part's final state == one pass over 1000
    (split points not multiples of 64: exercises fla's partial chunks and the mLSTM padding)."""
    x = R.make_inputs(case, B, 1000, **R.SHAPES["smollm2-135m"], seed=3)
    cut = 600

    def part(sl, h0):
        y = dict(x, h0=h0)
        for n in ("q", "k", "v", "a", "b", "g", "beta", "i", "f", "s"):
            if isinstance(x.get(n), torch.Tensor):
                y[n] = x[n][:, sl]
        return R.run_kernel(y)

    with torch.no_grad():
        full_out, full_state = R.run_kernel(x)
        out1, state1 = part(slice(0, cut), None)
        out2, state2 = part(slice(cut, None), state1 if x["recurrence"] in ("mlstm", "gsa") else state1[0])
    errs = {"o": R.rel_err(torch.cat([out1, out2], 1), full_out)}
    for n, a, b in zip(("C", "n", "m"), state2, full_state):
        errs[f"state_{n}"] = R.rel_err(a, b)
    _assert_within(errs, f"{case} split at {cut}", case)


@pytest.mark.parametrize("case", WITH_ALTERNATIVES)
def test_alternative_routes_match_reference(case):
    """The fallback fla routes (other kernels for the same recurrence) are right too, so that switching a
    route with HARNESS_FLA_ROUTES is safe. A route fla refuses on this machine is skipped with its message."""
    x = R.make_inputs(case, B, 1000, **R.SHAPES["smollm2-135m"], seed=4)
    for variant in R.kernel_cases()[case].alternative_routes:
        try:
            errs = R.compare(x, variant)
        except RuntimeError as exc:
            if "tilelang" in str(exc).lower() or "#640" in str(exc):
                continue  # e.g. simple_gla with a per-head g: backward refused on Hopper + triton < 3.7.1
            raise
        _assert_within(errs, f"{case} via {variant}", case)


@pytest.mark.parametrize("case", DELTA_CASES)
def test_route_selection_on_this_machine(case):
    """Every default route runs forward and backward here (no refusal by fla's Hopper guard). One case per test
    so that each can run (and fail) alone: the first call in a fresh process compiles every kernel it touches."""
    x = R.make_inputs(case, 1, 128, **R.SHAPES["smollm2-135m"], seed=5)
    out, states, grads = R.forward_backward(R.run_kernel, x)
    assert torch.isfinite(out).all(), case
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values()), case


def test_float32_inputs_come_back_float32():
    x = R.make_inputs("gated_deltanet", 1, 256, **R.SHAPES["smollm2-135m"], seed=6, dtype=torch.float32)
    o, (s,) = R.run_kernel(x)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    x = R.make_inputs("mlstm", 1, 256, **R.SHAPES["smollm2-135m"], seed=6, dtype=torch.float32)
    h, (c, n, m) = R.run_kernel(x)
    assert h.dtype == torch.float32 and c.dtype == n.dtype == m.dtype == torch.float32
    assert m.shape == (1, 9)


@pytest.mark.parametrize("route", ["delta_rule", "gated_delta_rule", "kda"])
def test_l2norm_inside_the_kernel_equals_l2norm_before_it(route):
    """normalize_qk=True (fla's in-kernel L2 norm of q and k) == our l2norm applied first: outputs and the
    gradients of the unnormalised q and k, in the bf16 the layers run."""
    from harness.mixers.ops import l2norm

    torch.manual_seed(7)
    Bn, T, H, K = 2, 1000, 9, 64
    q, k, v = (torch.randn(Bn, T, H, K, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(3))
    beta = torch.rand(Bn, T, H, device="cuda", dtype=torch.float32)
    g = None if route == "delta_rule" else -torch.rand(Bn, T, H, device="cuda") * 0.1
    if route == "kda":
        g = g.unsqueeze(-1).expand(Bn, T, H, K).contiguous()

    def run(inside: bool):
        qq, kk = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        qi, ki = (qq, kk) if inside else (l2norm(qq), l2norm(kk))
        o, s = kernels.run_gated_delta_route(route, qi, ki, v, g, beta, scale=K**-0.5, normalize_qk=inside)
        (o.float().square().mean() + s.square().mean()).backward()
        return o, s, qq.grad, kk.grad

    for name, a, b in zip(("o", "state", "dq", "dk"), run(True), run(False)):
        assert R.rel_err(a, b) < 2e-2, f"{route} {name}: {R.rel_err(a, b):.2e}"
