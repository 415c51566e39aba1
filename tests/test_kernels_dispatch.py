"""CPU tests of the pure-Python parts of harness.mixers.kernels: backend choice, clear errors, lazy imports,
fla route selection and argument mapping (with stand-in fla functions built on the PyTorch reference), and the
mLSTM layout / scale / padding wrapper (with mlstm_kernels' native chunkwise functions, which run on CPU)."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness.mixers import kernels, recurrence

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------- resolve_backend
def test_reference_is_always_reference():
    assert kernels.resolve_backend("reference", "cpu") == "reference"
    assert kernels.resolve_backend("reference", torch.device("cuda", 0)) == "reference"


def test_auto_on_cpu_is_reference():
    assert kernels.resolve_backend("auto", "cpu") == "reference"
    assert kernels.resolve_backend("auto", torch.device("cpu")) == "reference"


def test_kernel_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError) as err:
        kernels.resolve_backend("kernel", "cpu")
    msg = str(err.value)
    assert "auto, kernel, reference" in msg and "CUDA" in msg and "'cpu'" in msg


def test_unknown_backend_names_the_choices():
    with pytest.raises(ValueError, match="auto, kernel, reference"):
        kernels.resolve_backend("fast", "cpu")


def test_cuda_device_without_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "kernel_unavailable_reason", lambda which="fla": "fla.ops not importable: boom")
    with pytest.raises(ValueError, match="fla.ops not importable: boom"):
        kernels.resolve_backend("kernel", "cuda")
    with pytest.warns(RuntimeWarning, match="reference"):
        monkeypatch.setattr(kernels, "_warned", set())
        assert kernels.resolve_backend("auto", "cuda:0") == "reference"


def test_cuda_device_with_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "kernel_unavailable_reason", lambda which="fla": None)
    assert kernels.resolve_backend("auto", "cuda") == "kernel"
    assert kernels.resolve_backend("kernel", torch.device("cuda", 1)) == "kernel"
    assert kernels.resolve_backend("reference", "cuda") == "reference"


# ------------------------------------------------------------------------------------- availability
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_no_cuda_here_means_unavailable():
    assert kernels.kernels_available() is False
    assert "CUDA is not available" in kernels.kernel_unavailable_reason()


def test_missing_module_is_named(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_KERNEL_MODULES", {"fla": ("harness_no_such_module_x",),
                                                     "mlstm": ("harness_no_such_module_y",)})
    reason = kernels.kernel_unavailable_reason("fla")
    assert reason.startswith("harness_no_such_module_x not importable:") and "No module named" in reason
    assert "harness_no_such_module_y" in kernels.kernel_unavailable_reason("mlstm")
    assert "harness_no_such_module_x" in kernels.kernel_unavailable_reason("all")
    with pytest.raises(ValueError, match="unknown kernel family"):
        kernels.kernel_unavailable_reason("nope")


@pytest.mark.skipif(importlib.util.find_spec("triton") is not None, reason="triton is installed here")
def test_triton_missing_reason_on_this_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = kernels.kernel_unavailable_reason("fla")
    assert reason == "triton not importable: No module named 'triton'"


def test_kernel_calls_on_cpu_raise_kernel_unavailable():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(kernels.KernelUnavailable, match="CUDA tensors.*reference"):
        kernels.kernel_gated_delta(q, q, q, scale=0.5)
    i = torch.randn(1, 8, 2)
    with pytest.raises(kernels.KernelUnavailable, match="CUDA tensors"):
        kernels.kernel_mlstm(q, q, q, i, i, scale=0.5)
    assert issubclass(kernels.KernelUnavailable, RuntimeError)


def test_bad_shapes_are_value_errors():
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="g must be"):
        kernels.kernel_gated_delta(q, q, q, torch.zeros(1, 8, 3), scale=1.0)
    with pytest.raises(ValueError, match="beta must be"):
        kernels.kernel_gated_delta(q, q, q, None, torch.zeros(1, 8), scale=1.0)
    with pytest.raises(ValueError, match="initial_state must be"):
        kernels.kernel_gated_delta(q, q, q, scale=1.0, initial_state=torch.zeros(1, 2, 4, 5))
    with pytest.raises(ValueError, match="i and f"):
        kernels.kernel_mlstm(q, q, q, torch.zeros(1, 8), torch.zeros(1, 8), scale=1.0)


def test_importing_kernels_imports_no_kernel_library():
    code = ("import sys, torch; import harness.mixers.kernels as K; "
            "K.resolve_backend('auto', 'cpu'); K.resolve_backend('reference', 'cpu'); "
            "bad = [m for m in ('fla', 'triton', 'mlstm_kernels', 'tilelang') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout + res.stderr


# ------------------------------------------------------------------------------------- route selection
def _g_head(B=2, T=8, H=3, grad=False):
    g = -torch.rand(B, T, H)
    return g.requires_grad_(grad)


def _g_const(B=2, T=8, H=3):
    return torch.log1p(-torch.pow(2.0, -5.0 - torch.arange(H, dtype=torch.float32))).expand(B, T, H)


def test_case_classification():
    B, T, H, K = 2, 8, 3, 4
    beta = torch.rand(B, T, H)
    assert kernels.gated_delta_case(None, None) == "none"
    assert kernels.gated_delta_case(_g_const(), None) == "head_const"
    assert kernels.gated_delta_case(_g_head(), None) == "head"  # not an expanded constant
    assert kernels.gated_delta_case(_g_const().clone(), None) == "head"
    leaf = torch.zeros(H, requires_grad=True)
    assert kernels.gated_delta_case(leaf.expand(B, T, H), None) == "head"  # constant but needs a gradient
    with torch.no_grad():
        assert kernels.gated_delta_case(leaf.expand(B, T, H), None) == "head_const"
    assert kernels.gated_delta_case(-torch.rand(B, T, H, K), None) == "channel"
    assert kernels.gated_delta_case(None, beta) == "delta"
    assert kernels.gated_delta_case(_g_head(), beta) == "head_delta"
    assert kernels.gated_delta_case(_g_const(), beta) == "head_delta"
    assert kernels.gated_delta_case(-torch.rand(B, T, H, K), beta) == "channel_delta"
    with pytest.raises(ValueError):
        kernels.gated_delta_case(torch.zeros(B, T), None)


@pytest.mark.parametrize("blocked,tilelang", [(False, False), (True, True), (True, False)])
def test_route_selection(monkeypatch, blocked, tilelang):
    monkeypatch.setattr(kernels, "_gated_bwd_blocked", lambda: blocked)
    monkeypatch.setattr(kernels, "_tilelang_usable", lambda: tilelang)
    monkeypatch.setattr(kernels, "_warned", set())
    monkeypatch.delenv("HARNESS_FLA_ROUTES", raising=False)
    B, T, H, K = 2, 8, 3, 4
    q = torch.randn(B, T, H, K, requires_grad=True)
    beta = torch.rand(B, T, H)
    sel = kernels.select_gated_delta_route
    assert sel(q, q, q) == "simple_gla"
    assert sel(q, q, q, _g_const()) == "simple_gla_gamma"
    assert sel(q, q, q, _g_head()) == ("gla" if blocked else "simple_gla")
    with torch.no_grad():  # forward only: the backward guard does not matter
        assert sel(q, q, q, _g_head()) == "simple_gla"
    assert sel(q, q, q, -torch.rand(B, T, H, K)) == "gla"
    assert sel(q, q, q, None, beta) == "delta_rule"
    if blocked and not tilelang:
        with pytest.warns(RuntimeWarning, match="chunk_kda"):
            assert sel(q, q, q, _g_head(), beta) == "kda"
    else:
        assert sel(q, q, q, _g_head(), beta) == "gated_delta_rule"
    assert sel(q, q, q, -torch.rand(B, T, H, K), beta) == "kda"


def test_route_override(monkeypatch):
    q = torch.randn(2, 8, 3, 4)
    monkeypatch.setenv("HARNESS_FLA_ROUTES", " head_const=gla , delta=gated_delta_rule")
    assert kernels.select_gated_delta_route(q, q, q, _g_const()) == "gla"
    assert kernels.select_gated_delta_route(q, q, q, None, torch.rand(2, 8, 3)) == "gated_delta_rule"
    monkeypatch.setenv("HARNESS_FLA_ROUTES", "head_const=fast")
    with pytest.raises(ValueError, match="HARNESS_FLA_ROUTES"):
        kernels.select_gated_delta_route(q, q, q, _g_const())


# ------------------------------------------------------------------------------------- argument mapping
class FakeFla:
    """Stand-ins for the fla.ops functions kernels.py calls, implementing each op's documented semantics
    (fla 0.6.0 docstrings) with the PyTorch reference, and recording what they were given."""

    def __init__(self):
        self.calls = []

    def _common(self, name, q, k, v, scale, initial_state, output_final_state, **flags):
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16)
        assert initial_state is None or initial_state.dtype == torch.float32
        self.calls.append(dict(name=name, scale=scale, output_final_state=output_final_state, **flags))

    def _ref(self, q, k, v, g, beta, scale, initial_state, output_final_state):
        o, s = recurrence.chunk_gated_delta(q, k, v, g, beta, scale=scale, initial_state=initial_state)
        return o.to(q.dtype), (s if output_final_state else None)

    def chunk_simple_gla(self, q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                         output_final_state=False, **kw):
        self._common("simple_gla", q, k, v, scale, initial_state, output_final_state, g_gamma=g_gamma, **kw)
        assert g is None or g_gamma is None
        if g_gamma is not None:
            assert g_gamma.shape == (q.shape[2],)
            g = g_gamma.expand(*q.shape[:3])
        assert g is None or g.shape == q.shape[:3]
        return self._ref(q, k, v, g, None, scale, initial_state, output_final_state)

    def chunk_gla(self, q, k, v, g, scale=None, initial_state=None, output_final_state=False, **kw):
        self._common("gla", q, k, v, scale, initial_state, output_final_state, **kw)
        assert g.shape == q.shape and g.dtype == torch.float32
        return self._ref(q, k, v, g, None, scale, initial_state, output_final_state)

    def chunk_delta_rule(self, q, k, v, beta, scale=None, initial_state=None, output_final_state=False, **kw):
        self._common("delta_rule", q, k, v, scale, initial_state, output_final_state, **kw)
        return self._ref(q, k, v, None, beta, scale, initial_state, output_final_state)

    def chunk_gated_delta_rule(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               **kw):
        self._common("gated_delta_rule", q, k, v, scale, initial_state, output_final_state, **kw)
        assert g.shape == q.shape[:3] and g.dtype == torch.float32
        return self._ref(q, k, v, g, beta, scale, initial_state, output_final_state)

    def chunk_kda(self, q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, **kw):
        self._common("kda", q, k, v, scale, initial_state, output_final_state, **kw)
        assert g.shape == q.shape and g.dtype == torch.float32
        return self._ref(q, k, v, g, beta, scale, initial_state, output_final_state)

    def install(self, monkeypatch):
        monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
        for sub, fn in (("simple_gla", "chunk_simple_gla"), ("gla", "chunk_gla"), ("delta_rule", "chunk_delta_rule"),
                        ("gated_delta_rule", "chunk_gated_delta_rule"), ("kda", "chunk_kda")):
            mod = types.ModuleType(f"fla.ops.{sub}")
            setattr(mod, fn, getattr(self, fn))
            monkeypatch.setitem(sys.modules, f"fla.ops.{sub}", mod)
        monkeypatch.setattr(kernels, "_require", lambda *a, **kw: None)


def _inputs(kind, beta_on, B=2, T=37, H=3, K=8, V=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen).to(torch.bfloat16)
    g = {"none": None, "head": -torch.rand(B, T, H, generator=gen),
         "channel": -torch.rand(B, T, H, K, generator=gen) / 4, "head_const": _g_const(B, T, H)}[kind]
    beta = torch.rand(B, T, H, generator=gen) if beta_on else None
    h0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, h0


ROUTE_CASES = [
    ("simple_gla", "none", False), ("simple_gla", "head", False), ("simple_gla_gamma", "head_const", False),
    ("gla", "none", False), ("gla", "head", False), ("gla", "channel", False), ("gla", "head_const", False),
    ("delta_rule", "none", True), ("gated_delta_rule", "none", True), ("gated_delta_rule", "head", True),
    ("kda", "none", True), ("kda", "head", True), ("kda", "channel", True),
]


@pytest.mark.parametrize("route,kind,beta_on", ROUTE_CASES)
def test_routes_map_arguments_faithfully(monkeypatch, route, kind, beta_on):
    fake = FakeFla()
    fake.install(monkeypatch)
    q, k, v, g, beta, h0 = _inputs(kind, beta_on)
    want_o, want_s = recurrence.chunk_gated_delta(q, k, v, g, beta, scale=0.3, initial_state=h0)
    o, s = kernels.run_gated_delta_route(route, q, k, v, g, beta, scale=0.3, initial_state=h0)
    assert o.dtype == v.dtype and o.shape == v.shape and s.dtype == torch.float32
    torch.testing.assert_close(o.float(), want_o.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(s, want_s, atol=1e-3, rtol=1e-3)
    call = fake.calls[-1]
    assert call["scale"] == 0.3 and call["output_final_state"] is True
    if route in ("delta_rule", "gated_delta_rule", "kda"):
        assert call["use_qk_l2norm_in_kernel"] is False
    if route in ("gated_delta_rule", "kda"):
        assert call["use_beta_sigmoid_in_kernel"] is False
    if route == "kda":
        assert call["use_gate_in_kernel"] is False and call["safe_gate"] is False


def test_route_refuses_what_it_cannot_compute(monkeypatch):
    FakeFla().install(monkeypatch)
    q, k, v, g, beta, _ = _inputs("channel", True)
    for route in ("simple_gla", "gated_delta_rule", "delta_rule", "simple_gla_gamma"):
        with pytest.raises(ValueError, match="route"):
            kernels.run_gated_delta_route(route, q, k, v, g, beta, scale=1.0)
    q, k, v, g, beta, _ = _inputs("head", False)
    with pytest.raises(ValueError, match="simple_gla_gamma"):
        kernels.run_gated_delta_route("simple_gla_gamma", q, k, v, g, None, scale=1.0)
    with pytest.raises(ValueError, match="unknown route"):
        kernels.run_gated_delta_route("chunk_retention", q, k, v, g, None, scale=1.0)


def test_float32_inputs_run_in_bf16_and_come_back_float32(monkeypatch):
    fake = FakeFla()
    fake.install(monkeypatch)
    q, k, v, g, beta, h0 = _inputs("head", True)
    o, s = kernels.kernel_gated_delta(q.float(), k.float(), v.float(), g, beta, scale=0.5, initial_state=h0,
                                      output_final_state=False)
    assert o.dtype == torch.float32 and s is None
    assert fake.calls[-1]["output_final_state"] is False


def test_gradients_flow_through_the_mapping(monkeypatch):
    """Broadcasting a per-head g over K (gla / kda routes) gives g the summed gradient."""
    FakeFla().install(monkeypatch)
    q, k, v, g, beta, h0 = _inputs("head", True)
    grads = {}
    for route in ("gated_delta_rule", "kda"):
        gg = g.clone().requires_grad_(True)
        o, s = kernels.run_gated_delta_route(route, q, k, v, gg, beta, scale=0.5, initial_state=h0)
        (o.float().square().sum() + s.sum()).backward()
        grads[route] = gg.grad
    torch.testing.assert_close(grads["kda"], grads["gated_delta_rule"], atol=1e-3, rtol=1e-3)


# ------------------------------------------------------------------------------------- mLSTM wrapper
def _mlstm_inputs(B=2, T=100, H=3, K=8, V=6, seed=0, state=False):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    i = 15 * torch.tanh((2 * torch.randn(B, T, H, generator=gen) - 3) / 15)
    f = 15 * torch.tanh((torch.randn(B, T, H, generator=gen) + 4.5) / 15)
    s0 = None
    if state:
        s0 = (torch.randn(B, H, K, V, generator=gen), torch.randn(B, H, K, generator=gen),
              torch.randn(B, H, generator=gen))
    return q, k, v, i, f, s0


def _native(name):
    from mlstm_kernels.torch.chunkwise import native

    return getattr(native, name)


@pytest.mark.parametrize("T", [100, 128, 5])
@pytest.mark.parametrize("state", [False, True])
@pytest.mark.parametrize("scale", ["default", 0.2])
def test_mlstm_padding_layout_and_scale_are_exact(T, state, scale):
    """_mlstm_padded around mlstm_kernels' native chunkwise forward == the recurrent oracle, including the final
    (C, n, m) after end padding, and a scale other than K^-0.5."""
    q, k, v, i, f, s0 = _mlstm_inputs(T=T, state=state)
    sc = q.shape[-1] ** -0.5 if scale == "default" else scale
    h, (c, n, m) = kernels._mlstm_padded(_native("mlstm_chunkwise__native_autograd"), q, k, v, i, f, scale=sc,
                                         state=s0, eps=1e-6, chunk_size=64, dtype=torch.float32)
    hr, (cr, nr, mr) = recurrence.recurrent_mlstm(q, k, v, i, f, scale=sc, initial_state=s0)
    assert h.shape == hr.shape and m.shape == mr.shape == (q.shape[0], q.shape[2])
    for a, b in ((h, hr), (c, cr), (n, nr), (m, mr)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_mlstm_custom_backward_is_exact_behind_the_layer_norm():
    """mlstm_kernels' custom backward (native_custbw, the algorithm of triton_limit_chunk's backward), through
    the padding wrapper, gives the oracle's gradients of LayerNorm(h) (the mLSTM layer's use of h) for q, k, v,
    i, f and C0, but not of raw h: it does not differentiate the normaliser."""
    q, k, v, i, f, s0 = _mlstm_inputs(T=100, state=True)
    K, V = q.shape[-1], v.shape[-1]
    do = torch.randn(v.shape, generator=torch.Generator().manual_seed(9))

    def grads(fn, use_ln):
        xs = [t.clone().requires_grad_(True) for t in (q, k, v, i, f, s0[0])]
        state = (xs[5], s0[1], s0[2])
        h, _ = fn(*xs[:5], state)
        y = F.layer_norm(h, (V,), eps=1e-6) if use_ln else h
        return torch.autograd.grad((y * do).sum(), xs)

    def kernel(q, k, v, i, f, state):
        return kernels._mlstm_padded(_native("mlstm_chunkwise__native_custbw"), q, k, v, i, f, scale=K ** -0.5,
                                     state=state, eps=1e-6, chunk_size=64, dtype=torch.float32)

    def oracle(q, k, v, i, f, state):
        return recurrence.chunk_mlstm(q, k, v, i, f, scale=K ** -0.5, initial_state=state)

    names = ("q", "k", "v", "i", "f", "C0")
    for name, a, b in zip(names, grads(kernel, True), grads(oracle, True)):
        assert (a - b).norm() / b.norm() < 1e-4, name
    raw = dict(zip(names, ((a - b).norm() / b.norm() for a, b in zip(grads(kernel, False), grads(oracle, False)))))
    assert raw["v"] < 1e-4 and raw["q"] > 0.1  # documents the semantics, not a requirement


def test_mlstm_final_state_gradient_is_refused():
    q, k, v, i, f, _ = _mlstm_inputs(T=64)
    k.requires_grad_(True)
    h, state = kernels._mlstm_padded(_native("mlstm_chunkwise__native_autograd"), q, k, v, i, f, scale=0.3, state=None,
                                     eps=1e-6, chunk_size=64, dtype=torch.float32)
    kernels._refuse_state_grads(state)
    h.sum().backward(retain_graph=True)  # the output alone is fine
    with pytest.raises(RuntimeError, match="final mLSTM state"):
        state[0].sum().backward()


def test_mlstm_pad_gate_is_exactly_neutral():
    assert F.logsigmoid(torch.tensor(kernels.MLSTM_PAD_GATE)).item() == 0.0
    assert torch.exp(torch.tensor(-kernels.MLSTM_PAD_GATE) - 15).item() == 0.0
    assert math.isfinite(torch.tensor(-kernels.MLSTM_PAD_GATE, dtype=torch.bfloat16).item())
