"""Gated DeltaProduct (harness/mixers/deltaproduct.py): the reference recurrence against its step-by-step oracle and
fla's naive implementation, the identities that tie it to Gated DeltaNet, the transfer and init options, the kernel
wrapper's two routes with fla's call emulated on CPU (the kernels themselves: tests/gpu/test_deltaproduct_gpu.py),
and padded batches on the kernel backend. The parametrised suites (test_mixers, test_padding, test_decoding,
test_student, ...) cover the layer's chunked form, decoding state and padding with its defaults."""

from __future__ import annotations

import pytest
import torch

import harness
from harness.mixers import MixerShape, dispatch, kernels, mixer_class, mixer_options, recurrence
from harness.mixers.ops import apply_rope, l2norm
from tests.fla_naive import assert_runs_match, fla_naive
from tests.tiny import tiny_llama

SHAPE = MixerShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8)


def inputs(B=2, T=13, n=2, H=3, K=8, seed=0, gated=True, beta_max=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = l2norm(torch.randn(B, T, n, H, K, generator=gen))
    v = torch.randn(B, T, n, H, K, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) if gated else None
    beta = beta_max * torch.rand(B, T, n, H, generator=gen)
    h0 = torch.randn(B, H, K, K, generator=gen)
    return q, k, v, g, beta, h0


def make(seed=0, **options):
    torch.manual_seed(seed)
    m = mixer_class("deltaproduct")(SHAPE, mixer_options("deltaproduct", {"backend": "reference", "chunk_size": 4,
                                                                          **options}))
    m.reset_new_parameters()
    return m


# ------------------------------------------------------------------------------------------ the recurrence


@pytest.mark.parametrize("n,gated", [(1, True), (3, True), (2, False)])
def test_chunked_equals_the_step_oracle_with_gradients(n, gated):
    q, k, v, g, beta, h0 = inputs(n=n, gated=gated, beta_max=2.0)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, beta, h0)] + ([g.clone().requires_grad_(True)]
                                                                              if gated else [])
    results = []
    for fn in (recurrence.chunk_gated_delta_product, recurrence.recurrent_gated_delta_product):
        qq, kk, vv, bb, hh, *gg = leaves
        o, s = fn(qq, kk, vv, gg[0] if gated else None, bb, scale=0.4, initial_state=hh, chunk_size=4)
        grads = torch.autograd.grad((o * torch.linspace(-1, 1, o.shape[-1])).sum() + s.square().sum(), leaves)
        results.append(((o, s), grads))
    assert_runs_match(*results)


@pytest.mark.parametrize("n", [2, 3])
def test_the_reference_is_flas_naive_gated_delta_product(n):
    """fla's layout: the steps interleaved `[B, T n, ...]`, step j of token t at row t n + j; beta in (0, 2)."""
    q, k, v, g, beta, h0 = inputs(n=n, beta_max=2.0)
    o, s = recurrence.chunk_gated_delta_product(q, k, v, g, beta, scale=0.4, initial_state=h0, chunk_size=4)
    o_fla, s_fla = fla_naive("gated_delta_product").naive_recurrent_gated_delta_product(q, k.flatten(1, 2), v.flatten(1, 2), g, beta.flatten(1, 2), 0.4,
                               initial_state=h0.clone(), output_final_state=True, num_householder=n)
    torch.testing.assert_close(o, o_fla, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_fla, rtol=1e-4, atol=1e-5)


def test_one_step_is_the_gated_delta_rule_and_repeated_steps_are_one_with_a_larger_beta():
    """n = 1 is Gated DeltaNet's recurrence; two steps with the same (unit) key and value are one step with
    beta' = 1 - (1 - b1)(1 - b2) (what `householder_kv_init: copy` starts from)."""
    q, k, v, g, beta, h0 = inputs(n=1)
    o, s = recurrence.chunk_gated_delta_product(q, k, v, g, beta, scale=0.4, initial_state=h0, chunk_size=4)
    o_gdn, s_gdn = recurrence.chunk_gated_delta(q, k[:, :, 0], v[:, :, 0], g, beta[:, :, 0], scale=0.4,
                                                initial_state=h0, chunk_size=4)
    torch.testing.assert_close(o, o_gdn, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(s, s_gdn, rtol=1e-5, atol=1e-6)
    b2 = torch.rand_like(beta)
    twice = recurrence.chunk_gated_delta_product(q, k.expand(-1, -1, 2, -1, -1), v.expand(-1, -1, 2, -1, -1), g,
                                                 torch.cat([beta, b2], 2), scale=0.4, initial_state=h0)
    merged = 1 - (1 - beta[:, :, 0]) * (1 - b2[:, :, 0])
    once = recurrence.chunk_gated_delta(q, k[:, :, 0], v[:, :, 0], g, merged, scale=0.4, initial_state=h0)
    for a, b in zip(twice, once):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_rope_rotates_every_step_key_at_its_tokens_position():
    q, k = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 2, 3, 8)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    rq, rk = apply_rope(q, k, cos, sin)
    for j in range(2):
        want_q, want_k = apply_rope(q, k[:, :, j], cos, sin)
        assert torch.equal(rq, want_q) and torch.equal(rk[:, :, j], want_k)


# ------------------------------------------------------------------------------------------ the layer


def test_with_one_step_the_layer_is_gated_deltanet():
    gdn = mixer_class("gated_deltanet")(SHAPE, mixer_options("gated_deltanet", {"backend": "reference",
                                                                                "chunk_size": 4}))
    torch.manual_seed(1)
    gdn.reset_new_parameters()
    with torch.no_grad():
        for p in gdn.parameters():
            p.add_(0.2 * torch.randn_like(p))
    dp = make(num_householder=1)
    missing, unexpected = dp.load_state_dict(gdn.state_dict(), strict=False)
    assert missing == ["b_proj.bias"] and not unexpected
    x = torch.randn(2, 11, SHAPE.hidden_size)
    with torch.no_grad():
        dp.b_proj.bias.zero_()
        torch.testing.assert_close(dp(x)[0], gdn(x)[0], rtol=1e-5, atol=1e-6)


def test_layer_chunked_equals_decoding_steps_with_three_steps_and_negative_eigenvalues():
    m = make(num_householder=3, negative_eigenvalues=True, householder_kv_init="copy", householder_beta_bias=1.0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x = torch.randn(1, 11, SHAPE.hidden_size)
    with torch.no_grad():
        full, _ = m(x)
        head, state = m(x[:, :5], use_cache=True)
        tail = []
        for t in range(5, 11):
            y, state = m(x[:, t:t + 1], state=state, use_cache=True)
            tail.append(y)
    torch.testing.assert_close(torch.cat([head, *tail], 1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("negative", [False, True])
def test_beta_per_step_and_its_range(monkeypatch, negative):
    m = make(num_householder=3, negative_eigenvalues=negative)
    seen = {}

    def record(q, k, v, g, beta, **kw):
        seen["beta"], seen["k"] = beta, k
        return dispatch.gated_delta_product(q, k, v, g, beta, **kw)

    monkeypatch.setattr("harness.mixers.deltaproduct.gated_delta_product", record)
    x = torch.randn(2, 5, SHAPE.hidden_size)
    m(x)
    want = torch.sigmoid(m.b_proj(x).float()).unflatten(-1, (3, SHAPE.num_heads)) * (2 if negative else 1)
    assert torch.equal(seen["beta"], want) and seen["k"].shape == (2, 5, 3, SHAPE.num_heads, SHAPE.head_dim)


@pytest.mark.parametrize("kv_init", ["copy", "random"])
def test_transfer_copies_the_teacher_into_step_1_and_inits_the_others(kv_init):
    teacher = tiny_llama(num_layers=1, hidden=32, heads=4, kv_heads=2)
    student = harness.build_student(teacher, "deltaproduct", householder_kv_init=kv_init, householder_beta_bias=-4.0,
                                    num_householder=3)
    m, attn = student.model.layers[0].mixer, teacher.model.layers[0].self_attn
    expanded = attn.k_proj.weight.unflatten(0, (2, -1)).repeat_interleave(2, 0).flatten(0, 1)
    assert torch.equal(m.k_proj.weight, expanded)
    copies = [torch.equal(w, m.k_proj.weight) for w in m.extra_k_proj.weight.chunk(2)]
    copies += [torch.equal(w, m.v_proj.weight) for w in m.extra_v_proj.weight.chunk(2)]
    assert all(copies) if kv_init == "copy" else not any(copies)
    heads = SHAPE.num_heads
    assert torch.equal(m.b_proj.bias, torch.tensor([0.0] * heads + [-4.0] * 2 * heads))
    x = torch.randn(1, 6, 32)
    q, k, v, _ = m.project_qkv(x, None, False)  # identity conv and activation: the projections themselves
    assert torch.equal(k[:, :, 1:].flatten(2), m.extra_k_proj(x)) and torch.equal(v[:, :, 0].flatten(2), m.v_proj(x))


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="num_householder=0 must be an integer >= 1"):
        mixer_options("deltaproduct", {"num_householder": 0})
    with pytest.raises(ValueError, match="householder_kv_init='zeros' is not one of random, copy"):
        mixer_options("deltaproduct", {"householder_kv_init": "zeros"})


# ------------------------------------------------------------------------------------------ the kernel wrapper


@pytest.fixture
def on_cpu(monkeypatch):
    """The kernel wrapper with its CUDA check off and fla's calls emulated by references: the gated delta rule by
    ours, chunk_gated_delta_product by fla's naive form given exactly what the wrapper passes fla."""
    calls = []

    def gated_delta(q, k, v, g=None, beta=None, *, scale, initial_state=None, output_final_state=True,
                    normalize_qk=False):
        calls.append(("gated_delta", kernels.gated_delta_case(g, beta)))
        if normalize_qk:
            q, k = l2norm(q), l2norm(k)
        return recurrence.chunk_gated_delta(q, k, v, g, beta, scale=scale, initial_state=initial_state)

    def fla_product(q, k, v, g, beta, *, scale, initial_state, output_final_state, num_householder,
                    use_qk_l2norm_in_kernel):
        calls.append(("gated_delta_product", num_householder))
        if use_qk_l2norm_in_kernel:
            q, k = l2norm(q), l2norm(k)
        return fla_naive("gated_delta_product").naive_recurrent_gated_delta_product(q, k, v, g, beta, scale, initial_state=initial_state,
                           output_final_state=output_final_state, num_householder=num_householder)

    monkeypatch.setattr(kernels, "_require", lambda *a, **kw: None)
    monkeypatch.setattr(kernels, "kernel_gated_delta", gated_delta)
    monkeypatch.setattr(kernels, "_fla_gated_delta_product", lambda: fla_product)
    monkeypatch.delenv("HARNESS_FLA_ROUTES", raising=False)
    return calls


@pytest.mark.parametrize("route", ["gated_delta_product", "interleaved"])
def test_both_kernel_routes_compute_the_reference(on_cpu, route):
    q, k, v, g, beta, h0 = inputs(n=3)
    k = 3 * k  # unnormalised: the wrapper asks for the L2 norm inside the kernel
    o, s = kernels.kernel_gated_delta_product(q, k, v, g, beta, scale=0.4, initial_state=h0, normalize_qk=True,
                                              route=route)
    o_ref, s_ref = recurrence.chunk_gated_delta_product(l2norm(q), l2norm(k), v, g, beta, scale=0.4,
                                                        initial_state=h0)
    assert on_cpu == ([("gated_delta_product", 3)] if route == "gated_delta_product" else
                      [("gated_delta", "head_delta")])
    tol = 3e-2 if route == "gated_delta_product" else 1e-5  # that route hands fla bf16 q, k, v
    torch.testing.assert_close(o, o_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(s, s_ref, rtol=tol, atol=tol)


def test_route_selection(on_cpu, monkeypatch):
    q, k, v, g, beta, _ = inputs()
    g.requires_grad_(True)
    for blocked, tilelang, want in ((False, False, "gated_delta_product"), (True, True, "gated_delta_product"),
                                    (True, False, "interleaved")):
        monkeypatch.setattr(kernels, "_gated_bwd_blocked", lambda b=blocked: b)
        monkeypatch.setattr(kernels, "_tilelang_usable", lambda t=tilelang: t)
        assert kernels.select_gated_delta_product_route(q, k, v, g, beta) == want
    with torch.no_grad():  # no backward, no block
        assert kernels.select_gated_delta_product_route(q, k, v, g, beta) == "gated_delta_product"
    monkeypatch.setenv("HARNESS_FLA_ROUTES", "product=interleaved, head_delta=kda")
    monkeypatch.setattr(kernels, "_gated_bwd_blocked", lambda: False)
    assert kernels.select_gated_delta_product_route(q, k, v, g, beta) == "interleaved"
    monkeypatch.setenv("HARNESS_FLA_ROUTES", "product=kda")
    with pytest.raises(ValueError, match="case product .* route one of gated_delta_product, interleaved"):
        kernels.select_gated_delta_product_route(q, k, v, g, beta)


def test_the_kernel_backend_takes_a_padded_batch(on_cpu):
    """A left-padded batch through the kernel wrapper (fla's call emulated) gives each row's outputs and final state
    of that row alone on the reference backend."""
    lengths = (4, 9, 13)
    q, k, v, g, beta, _ = inputs(B=3, n=2)
    mask = torch.arange(13)[None] >= torch.tensor([[13 - n] for n in lengths])
    o, state = dispatch.gated_delta_product(q, k, v, g, beta, scale=0.4, prior=None, backend="kernel", chunk_size=4,
                                            normalize_qk=True, mask=mask)
    for row, n in enumerate(lengths):
        alone = [t[row:row + 1, -n:] for t in (q, k, v, g, beta)]
        o1, s1 = dispatch.gated_delta_product(*alone, scale=0.4, prior=None, backend="reference", chunk_size=4,
                                              normalize_qk=True)
        torch.testing.assert_close(o[row, -n:], o1[0], atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(state[row], s1[0], atol=3e-2, rtol=3e-2)
