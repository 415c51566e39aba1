"""RWKV-7 (harness/mixers/rwkv7.py): its DPLR recurrence against its step-by-step oracle, fla's naive
dplr_recurrence and the two rules it contains (GLA, the delta rule), the layer against RWKV-7 written out token by
token, the transfer and init options, the kernel wrapper with fla's call emulated on CPU (the kernel itself:
tests/gpu/test_rwkv7_gpu.py) and the bench's inputs. The registry-wide suites (test_mixers, test_padding,
test_decoding, test_student, test_mixer_contract, ...) cover the layer's chunked form, decoding state and padding."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import harness
from harness.mixers import MixerShape, dispatch, kernels, mixer_class, mixer_options, recurrence
from harness.plain_engine import decays
from tests.fla_naive import assert_runs_match, fla_naive
from tests.tiny import tiny_llama

SHAPE = MixerShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8)


def inputs(B=2, T=21, H=3, K=8, V=6, seed=0, decay=1.0):
    """RWKV-7's kind of inputs: a = -kk, b = kk * iclr with kk unit, a per-channel log decay in [-decay, 0]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    kk = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    b = kk * torch.rand(B, T, H, K, generator=gen)
    g = -decay * torch.rand(B, T, H, K, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, -kk, b, g, h0


def layer(seed=0, **options):
    torch.manual_seed(seed)
    return mixer_class("rwkv7")(SHAPE, mixer_options("rwkv7", {"backend": "reference", "chunk_size": 8, **options}))


def perturbed(seed=0, **options):
    """A layer with every new parameter moved off its init (LoRAs that vary per token, keys mixed)."""
    m = layer(seed, **options)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.startswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                p.add_(0.3 * torch.randn_like(p))
    return m


# ------------------------------------------------------------------------------------------ the recurrence


@pytest.mark.parametrize("decay", [1.0, 20.0])
def test_chunked_equals_the_step_oracle_with_gradients(decay):
    """Strong decays too (log decay down to -20 a token: every exponent of the chunked form stays <= 0)."""
    leaves = [t.clone().requires_grad_(True) for t in inputs(decay=decay)]
    results = []
    for fn in (recurrence.chunk_dplr_delta, recurrence.recurrent_dplr_delta):
        q, k, v, a, b, g, h0 = leaves
        o, s = fn(q, k, v, a, b, g, scale=0.4, initial_state=h0, chunk_size=8)
        grads = torch.autograd.grad((o * torch.linspace(-1, 1, o.shape[-1])).sum() + s.square().sum(), leaves)
        results.append(((o, s), grads))
    assert_runs_match(*results)


def test_the_reference_is_flas_naive_dplr_recurrence():
    """fla's layout: S_t = S_{t-1} exp(gk_t) + beta_t (alpha_t^T S_{t-1}) + k_t v_t^T, o_t = S_t^T q_t / sqrt(K)."""
    q, k, v, a, b, g, h0 = inputs(T=19)
    o, s = recurrence.chunk_dplr_delta(q, k, v, a, b, g, scale=8**-0.5, initial_state=h0, chunk_size=8)
    heads_first = lambda t: t.transpose(1, 2)  # noqa: E731
    o_fla, s_fla = fla_naive("generalized_delta_rule/dplr").dplr_recurrence(*(heads_first(t) for t in (q, k, v, a, b, g)), initial_state=h0.clone())
    torch.testing.assert_close(o, heads_first(o_fla), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_fla, rtol=1e-4, atol=1e-5)


def test_without_the_low_rank_term_it_is_gla_and_with_a_unit_key_the_delta_rule():
    """b = 0: the per-channel gated linear attention of chunk_gated_delta. g = 0, a = -kk, b = beta kk, k = beta kk
    (kk unit): S = (I - beta kk kk^T) S + beta kk v^T, the delta rule with key kk."""
    q, k, v, a, b, g, h0 = inputs()
    for got, want in zip(recurrence.chunk_dplr_delta(q, k, v, a, torch.zeros_like(b), g, scale=0.4, initial_state=h0),
                         recurrence.chunk_gated_delta(q, k, v, g, None, scale=0.4, initial_state=h0)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    kk, beta = -a, torch.rand(a.shape[:-1])
    delta = recurrence.chunk_dplr_delta(q, beta[..., None] * kk, v, a, beta[..., None] * kk, torch.zeros_like(g),
                                        scale=0.4, initial_state=h0)
    for got, want in zip(delta, recurrence.chunk_gated_delta(q, kk, v, None, beta, scale=0.4, initial_state=h0)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------------ the layer


def rwkv7_by_its_equations(m, x: torch.Tensor) -> torch.Tensor:
    """RADLADS' RWKV-7 token by token, one head at a time, from its equations: r, k, v the copied projections (K, V
    expanded over the query heads), w = exp(-exp(-0.5) sigmoid(w0 + W2 tanh(W1 x))), a = sigmoid(a0 + A2 A1 x),
    kk = l2norm(k k_k), k~ = k (1 + (a - 1) k_a); S = Diag(w) S - (kk a)(kk^T S) + k~ v^T, o = S^T r; a GroupNorm
    per head (its weight, no bias) times G2 sigmoid(G1 x), then o_proj."""
    H, D = SHAPE.num_heads, SHAPE.head_dim
    heads = lambda t: t.unflatten(-1, (H, D))  # noqa: E731
    r, k, v = heads(m.q_proj(x)), heads(m.k_proj(x)), heads(m.v_proj(x))
    w = torch.exp(-math.exp(-0.5) * torch.sigmoid(heads(m.w_lora.up(torch.tanh(m.w_lora.down(x))))))
    a = torch.sigmoid(heads(m.a_lora.up(m.a_lora.down(x))))
    gate = heads(m.g_lora.up(torch.sigmoid(m.g_lora.down(x))))
    k_k, k_a, norm_w = heads(m.k_k), heads(m.k_a), heads(m.o_norm.weight)
    out = torch.zeros_like(r)
    for n in range(x.shape[0]):
        for h in range(H):
            state = torch.zeros(D, D)
            for t in range(x.shape[1]):
                kt = k[n, t, h]
                kk = kt * k_k[h] / (kt * k_k[h]).norm()
                written = kt * (1 + (a[n, t, h] - 1) * k_a[h])
                state = (torch.diag(w[n, t, h]) @ state - torch.outer(kk * a[n, t, h], kk @ state)
                         + torch.outer(written, v[n, t, h]))
                o = state.T @ r[n, t, h]
                normed = (o - o.mean()) / torch.sqrt(o.var(unbiased=False) + D * 1e-5)
                out[n, t, h] = normed * norm_w[h] * gate[n, t, h]
    return m.o_proj(out.flatten(2))


@pytest.mark.parametrize("options", [{}, {"decay_init": "rwkv7", "gate_init": "random", "iclr_bias": -1.0}])
def test_the_layer_is_rwkv7_by_its_equations(options):
    m = perturbed(**options)
    x = torch.randn(2, 11, SHAPE.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(m(x)[0], rwkv7_by_its_equations(m, x), rtol=1e-4, atol=1e-5)


def test_transfer_copies_q_k_v_o_and_reads_the_depth():
    teacher = tiny_llama(num_layers=3, hidden=32, heads=4, kv_heads=2)
    student = harness.build_student(teacher, "rwkv7")
    for l, block in enumerate(student.model.layers):
        m, attn = block.mixer, teacher.model.layers[l].self_attn
        expanded = attn.k_proj.weight.unflatten(0, (2, -1)).repeat_interleave(2, 0).flatten(0, 1)
        assert torch.equal(m.q_proj.weight, attn.q_proj.weight) and torch.equal(m.o_proj.weight, attn.o_proj.weight)
        assert torch.equal(m.k_proj.weight, expanded) and m.num_layers == 3 and m.depth() == l / 2
    # RADLADS' decay schedule over the channels, slowest first, its spread set by the depth
    w0 = [block.mixer.w_lora.up.bias for block in student.model.layers]
    decay = torch.exp(-math.exp(-0.5) * torch.sigmoid(w0[1]))
    assert decay.max() < 0.9992 and decay.min() > 0.89 and bool((decay[1:] <= decay[:-1]).all())
    assert w0[0][10] > w0[1][10] > w0[2][10]  # a deeper layer keeps more channels slow


@torch.no_grad()
def test_the_init_options():
    x = torch.randn(2, 7, SHAPE.hidden_size)
    m = layer()
    torch.testing.assert_close(m.g_lora(x), torch.ones(2, 7, 32), rtol=0, atol=1e-6)  # open: rows of G2 sum to 2
    random = layer(gate_init="random")
    gate = random.g_lora(x)
    assert torch.equal(gate, gate[:1, :1].expand_as(gate)) and gate.abs().max() < 0.2  # constant, small
    assert torch.equal(layer(iclr_bias=-4.0).a_lora.up.bias, torch.full((32,), -4.0))
    fla = layer(decay_init="rwkv7").w_lora.up.bias  # with its zigzag within each head, down to a decay of 0.56
    assert fla.max() == pytest.approx(3.0) and fla.min() == pytest.approx(-8.0)
    with pytest.raises(ValueError, match="decay_init='fast' is not one of radlads, rwkv7"):
        mixer_options("rwkv7", {"decay_init": "fast"})


def test_decay_and_bias_like_parameters_are_not_weight_decayed():
    m = layer()
    decayed = {name for name, p in m.named_parameters() if decays(name, p)}
    assert decayed == {f"{lora}.{part}.weight" for lora in ("w_lora", "a_lora", "g_lora") for part in ("down", "up")}\
        | {f"{proj}.weight" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")}
    assert all(getattr(p, "_no_weight_decay", False) for p in (m.k_k, m.k_a, m.w_lora.up.bias, m.a_lora.up.bias))


# ------------------------------------------------------------------------------------------ the kernel wrapper


@pytest.fixture
def on_cpu(monkeypatch):
    """kernels.kernel_dplr_delta with its CUDA check off and fla's chunk_rwkv7 emulated by fla's naive recurrence,
    given exactly what the wrapper passes fla."""
    calls = []

    def chunk_rwkv7(r, w, k, v, a, b, *, scale, initial_state, output_final_state, lower_bound):
        calls.append((r.dtype, w.dtype, lower_bound))
        heads_first = lambda t: t.float().transpose(1, 2)  # noqa: E731
        r = r.float() * scale * r.shape[-1] ** 0.5  # the naive form scales by K^-0.5 itself
        o, s = fla_naive("generalized_delta_rule/dplr").dplr_recurrence(*(heads_first(t) for t in (r, k, v, a, b, w)), initial_state=initial_state)
        return o.transpose(1, 2).to(v.dtype), s

    monkeypatch.setattr(kernels, "_require", lambda *a, **kw: None)
    monkeypatch.setattr(kernels, "_fla_rwkv7", lambda: chunk_rwkv7)
    return calls


def test_the_kernel_backend_takes_a_padded_batch(on_cpu):
    """A left-padded batch through the kernel wrapper gives each row's outputs and final state of that row alone on
    the reference backend; fla gets bf16 q, k, v, a, b, a float32 decay and the decay's floor."""
    lengths = (4, 9, 21)
    q, k, v, a, b, g, _ = inputs(B=3)
    mask = torch.arange(21)[None] >= torch.tensor([[21 - n] for n in lengths])
    o, state = dispatch.dplr_delta(q, k, v, a, b, g, scale=0.4, prior=None, backend="kernel", chunk_size=8,
                                   mask=mask, decay_floor=-0.5)
    assert on_cpu == [(torch.bfloat16, torch.float32, -0.5)]
    for row, n in enumerate(lengths):
        alone = [t[row:row + 1, -n:] for t in (q, k, v, a, b, g)]
        o1, s1 = dispatch.dplr_delta(*alone, scale=0.4, prior=None, backend="reference", chunk_size=8)
        torch.testing.assert_close(o[row, -n:], o1[0], atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(state[row], s1[0], atol=3e-2, rtol=3e-2)


def test_the_bench_builds_rwkv7s_inputs():
    """The recurrence bench's case (harness bench --what recurrences; tests/gpu/test_kernels.py): RWKV-7's a, b and
    decay, which the reference takes on CPU."""
    from harness.bench import recurrences

    x = recurrences.make_inputs("rwkv7", 2, 30, H=3, K=8, V=8, device="cpu", with_state=True)
    assert x["recurrence"] == "dplr_delta" and recurrences.selected_route(x, "auto") == "rwkv7"
    removal = -x["a"].float()
    torch.testing.assert_close(removal.norm(dim=-1), torch.ones(2, 30, 3), rtol=1e-2, atol=1e-2)
    b = x["b"].float()  # kk times a rate in (0, 1): kk's sign, no larger
    assert bool((b * removal >= 0).all()) and bool((b.abs() <= removal.abs() * 1.01).all())
    assert x["g"].min() >= -math.exp(-0.5) and x["g"].max() < 0
    out, states, grads = recurrences.forward_backward(recurrences.run_reference, recurrences.upcast(x))
    assert out.shape == (2, 30, 3, 8) and set(grads) == {"q", "k", "v", "a", "b", "g", "h0"}
