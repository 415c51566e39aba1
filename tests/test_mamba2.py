"""The mamba2 mixer against Mamba2 written out from its equations (a per-token loop over one head at a time), its
recurrence against fla's naive simple_gla, its gated norm against the gate-before-norm formula, and its options.
Chunked == step by step, padding, decoding and transfer are the registry-wide tests' (tests/test_mixers.py,
test_padding.py, test_decoding.py, test_student.py, test_transfer.py); the kernel is tests/gpu's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.mixers import MixerShape, dispatch, mixer_class, mixer_options
from harness.mixers.mamba2 import GateThenRMSNorm
from tests.fla_naive import fla_naive

SHAPE = MixerShape(hidden_size=24, num_heads=3, num_kv_heads=1, head_dim=4)


def mamba2(seed: int = 0, **options):
    """A mamba2 layer whose every parameter is away from its init (a random conv with SiLU, gates, decays, D)."""
    torch.manual_seed(seed)
    layer = mixer_class("mamba2")(SHAPE, mixer_options("mamba2", {"backend": "reference", "chunk_size": 8,
                                                                  "conv_init": "random", "qkv_activation": "silu",
                                                                  **options}))
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if not name.startswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                p.add_(0.3 * torch.randn_like(p))
    return layer


def mamba2_by_its_equations(layer, u: torch.Tensor) -> torch.Tensor:
    """Mamba2 with one group per head, token by token (Dao & Gu 2024, as MambaInLlama maps attention onto it):
    xBC = act(causal depthwise conv(x, B, C)), dt = softplus(u W_dt + dt_bias), h_t = exp(dt A) h_{t-1} + dt B_t x_t^T,
    y_t = h_t^T C_t + D x_t, out = W_o rms_norm_per_head(y * silu(u W_z)) * w."""
    H, P = SHAPE.num_heads, SHAPE.head_dim
    xbc = torch.cat([layer.q_proj(u), layer.k_proj(u), layer.v_proj(u)], -1)  # C, B, x
    w = layer.qkv_conv.conv.weight[:, 0]  # [channels, kernel]
    width = w.shape[1]
    padded = F.pad(xbc, (0, 0, width - 1, 0))
    conv = torch.stack([(padded[:, t:t + width] * w.T).sum(1) for t in range(u.shape[1])], 1)
    C, Bm, x = (part.unflatten(-1, (H, P)) for part in F.silu(conv).split(H * P, -1))
    dt = F.softplus(layer.dt_proj(u) + layer.dt_bias)  # [B, T, H]
    A = -layer.A_log.exp()
    y = torch.zeros_like(x)
    for b in range(u.shape[0]):
        for h in range(H):
            state = torch.zeros(P, P)  # [B's dim, x's dim]
            for t in range(u.shape[1]):
                state = torch.exp(dt[b, t, h] * A[h]) * state + dt[b, t, h] * torch.outer(Bm[b, t, h], x[b, t, h])
                y[b, t, h] = state.T @ C[b, t, h] + layer.D[h] * x[b, t, h]
    z = layer.z_proj(u).unflatten(-1, (H, P))
    gated = y * F.silu(z)
    normed = gated / torch.sqrt(gated.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps)
    return layer.o_proj((normed * layer.o_norm.weight.view(H, P)).flatten(2))


@pytest.mark.parametrize("d_init", ["one", "zero"])
def test_the_layer_is_mamba2_by_its_equations(d_init):
    layer = mamba2(d_init=d_init)
    u = torch.randn(2, 19, SHAPE.hidden_size)
    with torch.no_grad():
        got, _ = layer(u)
        want = mamba2_by_its_equations(layer, u)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_its_recurrence_is_fla_simple_gla_with_dt_folded_into_b():
    """The SSD call (chunked and one step, from a state) == fla's naive recurrent and chunk simple_gla on
    q = C, k = dt B, v = x, g = dt A, scale 1."""
    gen = torch.Generator().manual_seed(4)
    B, T, H, K, V = 2, 40, 3, 8, 6
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    dt = F.softplus(torch.randn(B, T, H, generator=gen) - 2)
    g = -torch.rand(H, generator=gen) * 8 * dt
    h0 = torch.randn(B, H, K, V, generator=gen)
    kdt = k * dt[..., None]
    o, s = dispatch.ssd(q, kdt, v, g, scale=1.0, prior=h0, backend="reference", chunk_size=16)
    naive = fla_naive("simple_gla")
    o_ref, s_ref = naive.naive_recurrent_simple_gla(q, kdt, v, g, scale=1.0, initial_state=h0)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_ref, rtol=1e-4, atol=1e-5)
    o_chunk, s_chunk = naive.naive_chunk_simple_gla(q, kdt, v, g, initial_state=h0, output_final_state=True,
                                                     chunk_size=16, scale=1.0)
    torch.testing.assert_close(o, o_chunk, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, s_chunk, rtol=1e-4, atol=1e-5)
    o1, s1 = dispatch.ssd(q[:, :1], kdt[:, :1], v[:, :1], g[:, :1], scale=1.0, prior=h0, backend="reference",
                          chunk_size=16)
    torch.testing.assert_close(o1[:, 0], o_ref[:, 0], rtol=1e-4, atol=1e-5)


def test_the_gated_norm_gates_before_it_normalises():
    """Mamba2's norm_before_gate=False, per head: rms_norm(o * silu(z)) * weight (fla's rms_norm_ref with
    group_size = head_dim), which is not norm(o) * silu(z)."""
    torch.manual_seed(0)
    norm = GateThenRMSNorm(3, 4)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    o, z = torch.randn(2, 5, 3, 4), torch.randn(2, 5, 3, 4)
    gated = o * F.silu(z)
    want = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.view(3, 4)
    torch.testing.assert_close(norm(o, z), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm(o, z, fused=True), want, rtol=1e-5, atol=1e-6)  # CPU: the PyTorch path
    after = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.view(3, 4) * F.silu(z)
    assert (norm(o, z) - after).abs().max() > 0.1


def test_the_inits():
    """d_init sets D (zero by default); the open gate makes z a constant silu(z) = 1; A ~ U(1, 16) and dt_bias =
    softplus^-1 of dt in [1e-3, 0.1] (Mamba2's); an unknown d_init is named."""
    one = mixer_class("mamba2")(SHAPE, mixer_options("mamba2", {"d_init": "one"}))
    assert torch.equal(one.D, torch.ones(3))
    layer = mixer_class("mamba2")(SHAPE, mixer_options("mamba2", {}))
    assert torch.equal(layer.D, torch.zeros(3))
    assert torch.equal(layer.z_proj.weight, torch.zeros_like(layer.z_proj.weight))
    torch.testing.assert_close(F.silu(layer.z_proj.bias), torch.ones(12))
    A = layer.A_log.exp()
    assert bool(((A >= 1) & (A <= 16)).all())
    dt = F.softplus(layer.dt_bias)
    assert bool(((dt >= 1e-3 - 1e-7) & (dt <= 0.1 + 1e-7)).all())
    with pytest.raises(ValueError, match="d_init='half'.*one, zero"):
        mixer_options("mamba2", {"d_init": "half"})
