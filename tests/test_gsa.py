"""Gated slot attention (harness/mixers/gsa.py): the reference recurrence (chunked and one step) against its step
oracle and fla's naive implementation, the layer against fla's GatedSlotAttention written out from fla's naive
recurrence, the transfer and the slot-gate init, the kernel wrapper and the bench's gsa case with fla's call emulated
on CPU (the kernel itself: tests/gpu/test_gsa_gpu.py). The parametrised suites (test_mixers, test_padding,
test_decoding, test_mixer_contract, ...) cover the layer's decoding state, padding and save/load with its
defaults."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import harness
from harness.bench import recurrences as bench
from harness.mixers import KernelCase, MixerShape, dispatch, kernels, mixer_class, mixer_options, recurrence
from harness.mixers.gsa import SPREAD_MEMORY
from harness.plain_engine import decays
from tests.fla_naive import assert_runs_match, fla_naive
from tests.tiny import tiny_llama

SHAPE = MixerShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8)
FLA_LAYER = {"qkv_activation": "silu", "output_activation": "silu", "qk_scale": "one",  # fla's GatedSlotAttention
             "slot_decay_init": "uniform"}


def inputs(B=2, T=13, H=3, K=8, V=6, M=5, seed=0, strength=1.0):
    """q, k, v, s, g and an initial state (hk, hv); g = logsigmoid(x) * strength, s = 1 - exp(g) as the layer."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = F.logsigmoid(2 * torch.randn(B, T, H, M, generator=gen)) * strength
    h0 = (torch.randn(B, H, K, M, generator=gen), torch.randn(B, H, M, V, generator=gen))
    return q, k, v, -torch.expm1(g), g, h0


def make(seed=0, **options):
    torch.manual_seed(seed)
    return mixer_class("gsa")(SHAPE, mixer_options("gsa", {"backend": "reference", "chunk_size": 4, **options}))


# ------------------------------------------------------------------------------------------ the recurrence


@pytest.mark.parametrize("chunk,strength", [(4, 1.0), (16, 40.0)])
def test_chunked_equals_the_step_oracle_with_gradients(chunk, strength):
    """Also with decays down to exp(-560) a token (strength 40): every exponent of the chunked form stays <= 0."""
    q, k, v, s, g, (hk, hv) = inputs(T=37, strength=strength)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, s, g, hk, hv)]
    results = []
    for fn in (recurrence.chunk_gsa, recurrence.recurrent_gsa):
        qq, kk, vv, ss, gg, h1, h2 = leaves
        o, (sk, sv) = fn(qq, kk, vv, ss, gg, scale=0.4, initial_state=(h1, h2), chunk_size=chunk)
        loss = (o * torch.linspace(-1, 1, o.shape[-1])).sum() + sk.square().sum() + sv.sin().sum()
        results.append(((o, sk, sv), torch.autograd.grad(loss, leaves)))
    (out1, g1), _ = results
    assert all(torch.isfinite(t).all() for t in out1 + g1)
    assert_runs_match(*results)


@pytest.mark.parametrize("with_state", [False, True])
def test_the_reference_is_flas_naive_gsa(with_state):
    q, k, v, s, g, h0 = inputs(T=21)
    h0 = h0 if with_state else None
    o, state = recurrence.chunk_gsa(q, k, v, s, g, scale=0.4, initial_state=h0, chunk_size=16)
    o_fla, state_fla = fla_naive("gsa").naive_recurrent_gsa(q, k, v, s, g, scale=0.4, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, o_fla, rtol=1e-4, atol=1e-5)
    for a, b in zip(state, state_fla):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    o1, state1 = recurrence.step_gsa(q[:, 0], k[:, 0], v[:, 0], s[:, 0], g[:, 0], scale=0.4, state=h0)
    o1_fla, state1_fla = fla_naive("gsa").naive_recurrent_gsa(q[:, :1], k[:, :1], v[:, :1], s[:, :1], g[:, :1], scale=0.4, initial_state=h0,
                                     output_final_state=True)
    torch.testing.assert_close(o1, o1_fla[:, 0], rtol=1e-5, atol=1e-6)
    for a, b in zip(state1, state1_fla):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ the layer


@torch.no_grad()
def test_the_layer_is_flas_gated_slot_attention_written_out():
    """fla's GatedSlotAttention (num_kv_heads = num_heads, no short conv, swish feature map, scale 1), its forward
    written out here: q, k = swish(W x), v = silu(W_v x), f = logsigmoid(W_f x) / 8, s = 1 - exp(f), the naive
    recurrence, rms_norm(silu(o)) over all heads, o_proj; and the same with fla's layer options off."""
    for options in (FLA_LAYER, {}):
        m = make(**options)
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
        x = torch.randn(2, 11, SHAPE.hidden_size)
        act = F.silu if options else (lambda t: t)
        q, k, v = (act(proj(x)).unflatten(-1, (4, 8)) for proj in (m.q_proj, m.k_proj, m.v_proj))
        f = F.logsigmoid(m.f_proj(x).unflatten(-1, (4, 64))) / 8
        o, _ = fla_naive("gsa").naive_recurrent_gsa(q, k, v, 1 - f.exp(), f, scale=1.0 if options else 8 ** -0.5)
        o = F.rms_norm(act(o).flatten(2), (32,), m.o_norm.weight, eps=1e-5)
        torch.testing.assert_close(m(x)[0], m.o_proj(o), rtol=1e-5, atol=1e-5)


def test_transfer_copies_q_k_v_o_and_the_slot_gate_is_new():
    teacher = tiny_llama(num_layers=1, hidden=32, heads=4, kv_heads=2)
    student = harness.build_student(teacher, "gsa", num_slots=6, slot_decay_init="uniform")
    m, attn = student.model.layers[0].mixer, teacher.model.layers[0].self_attn
    expand = lambda w: w.unflatten(0, (2, -1)).repeat_interleave(2, 0).flatten(0, 1)  # noqa: E731
    assert torch.equal(m.q_proj.weight, attn.q_proj.weight) and torch.equal(m.o_proj.weight, attn.o_proj.weight)
    assert torch.equal(m.k_proj.weight, expand(attn.k_proj.weight))
    assert torch.equal(m.v_proj.weight, expand(attn.v_proj.weight))
    assert m.f_proj.weight.shape == (4 * 6, 32) and 0.01 < m.f_proj.weight.std() < 0.03
    assert torch.equal(m.f_proj.bias, torch.zeros(24)) and torch.equal(m.o_norm.weight, torch.ones(32))
    assert not decays("f_proj.bias", m.f_proj.bias) and decays("f_proj.weight", m.f_proj.weight)


@pytest.mark.parametrize("normalizer", [8.0, 2.0])
def test_spread_decays_start_log_spaced_over_the_slots(normalizer):
    m = make(slot_decay_init="spread", num_slots=5, gate_logit_normalizer=normalizer)
    with torch.no_grad():
        m.f_proj.weight.zero_()
        s, g = m.slot_gate(torch.randn(1, 1, SHAPE.hidden_size))
    memory = 1 / s[0, 0]  # [H, M]: 1 / (1 - alpha)
    want = torch.logspace(*(torch.tensor(SPREAD_MEMORY).log10().tolist()), 5)
    torch.testing.assert_close(memory, want.expand(4, 5), rtol=1e-4, atol=0)
    torch.testing.assert_close(g.exp(), 1 - s)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="num_slots=0 must be an integer >= 1"):
        mixer_options("gsa", {"num_slots": 0})
    with pytest.raises(ValueError, match="qk_scale='sqrt' is not one of one, head_dim"):
        mixer_options("gsa", {"qk_scale": "sqrt"})
    with pytest.raises(ValueError, match="gate_logit_normalizer=0.0 must be > 0"):
        mixer_options("gsa", {"gate_logit_normalizer": 0.0})
    with pytest.raises(ValueError, match="gate 'slot' goes with recurrence 'gsa'"):
        KernelCase(route="gla", gate="slot")


# ------------------------------------------------------------------------------------------ the kernel wrapper


@pytest.fixture
def on_cpu(monkeypatch):
    """kernels.kernel_gsa with its CUDA check off and fla's chunk_gsa emulated by fla's naive form, given exactly
    what the wrapper passes fla."""
    calls = []

    def fla_chunk_gsa(q, k, v, s, g, *, scale, initial_state, output_final_state):
        calls.append((q.dtype, s.dtype, g.dtype))
        return fla_naive("gsa").naive_recurrent_gsa(q, k, v, s, g, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state)

    monkeypatch.setattr(kernels, "_require", lambda *a, **kw: None)
    monkeypatch.setattr(kernels, "_fla_chunk_gsa", lambda: fla_chunk_gsa)
    return calls


def test_the_kernel_backend_takes_a_padded_batch(on_cpu):
    """A left-padded batch through dispatch on the kernel backend gives each row's outputs and final states of that
    row alone on the reference backend; fla gets q, k, v, s in bf16 and g in float32."""
    lengths = (4, 9, 13)
    q, k, v, s, g, _ = inputs(B=3)
    mask = torch.arange(13)[None] >= torch.tensor([[13 - n] for n in lengths])
    o, (hk, hv) = dispatch.gated_slot_attention(q, k, v, s, g, scale=0.4, prior=None, backend="kernel",
                                                chunk_size=4, mask=mask)
    assert on_cpu == [(torch.bfloat16, torch.bfloat16, torch.float32)] and o.dtype == torch.float32
    for row, n in enumerate(lengths):
        alone = [t[row:row + 1, -n:] for t in (q, k, v, s, g)]
        o1, (hk1, hv1) = dispatch.gated_slot_attention(*alone, scale=0.4, prior=None, backend="reference",
                                                       chunk_size=4)
        for a, b in ((o[row, -n:], o1[0]), (hk[row], hk1[0]), (hv[row], hv1[0])):
            torch.testing.assert_close(a, b, atol=3e-2, rtol=3e-2)


def test_the_bench_case_compares_the_kernel_with_the_reference(on_cpu):
    """The recurrence bench's gsa case (its inputs, both runners, the loss over both states, the error table)
    runs end to end with the emulated kernel, within the bench's limits, an initial state included."""
    x = bench.make_inputs("gsa", 1, 40, H=2, K=16, V=16, device="cpu", seed=1, with_state=True)
    errs = bench.compare(x)
    assert set(errs) == {"o", "state_k", "state_v", "dq", "dk", "dv", "ds", "dg", "dhk0", "dhv0"}
    assert bench.failures(errs, "gsa") == {}, errs
    assert bench.selected_route(x, "auto") == kernels.GSA_KERNEL


def test_harness_eval_state_reads_the_value_slots():
    from harness.eval.state import state_measures

    _, _, _, _, _, (hk, hv) = inputs(B=2, H=3, K=8, V=6, M=5)
    measures = state_measures("gsa", (hk, hv))
    torch.testing.assert_close(measures["norm"], torch.linalg.matrix_norm(hv.double()))
    torch.testing.assert_close(measures["key_slots_norm"], torch.linalg.matrix_norm(hk.double()))
    assert measures["rank"].shape == (2, 3)
