"""The decay gate's granularity (`decay_group_size`, harness.mixers.decay) on gated_deltanet and kda: each mixer's
default is its gate as written before the option existed, a grouped gate is the recurrence with each gate on its
channels (against the step-by-step oracle), gates that agree within a head are the per-head gate, the layer's
chunked form equals its decoding steps, and bad sizes are refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.mixers import MixerShape, dispatch, mixer_class, mixer_options, recurrence
from harness.mixers.ops import l2norm

SHAPE = MixerShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8)
H, D = SHAPE.num_heads, SHAPE.head_dim


def make(name: str, seed: int = 0, **options):
    torch.manual_seed(seed)
    m = mixer_class(name)(SHAPE, mixer_options(name, {"backend": "reference", "chunk_size": 8, **options}))
    m.reset_new_parameters()
    with torch.no_grad():  # decays and betas away from their init, so that every gate matters
        for n, p in m.named_parameters():
            if n.startswith(("a_proj", "f_proj", "b_proj", "dt_bias", "A_log")):
                p.add_(0.3 * torch.randn_like(p))
    return m


def inputs(m, seed: int = 1, length: int = 19):
    torch.manual_seed(seed)
    x = torch.randn(2, length, SHAPE.hidden_size)
    q, k, v, _ = m.project_qkv(x, None, False)
    return x, q, k, v


def gate_logits(m, x):
    """The decay gate's pre-activation per gate `[B, T, H, n]`, as each mixer's file computes it."""
    proj = m.a_proj if m.name == "gated_deltanet" else m.f_proj
    return (proj(x).float() + m.dt_bias.float()).unflatten(-1, (H, -1))


@pytest.mark.parametrize("name", ["gated_deltanet", "kda"])
def test_the_default_is_the_gate_written_before_the_option(name):
    """Gated DeltaNet: one gate per head, g = -exp(A_log) softplus(a_proj x + dt_bias) `[B, T, H]`; KDA: one per
    channel, g = -exp(A_log_h) softplus(f_proj x + dt_bias) `[B, T, H, K]`. Same parameters, bit-identical outputs."""
    m = make(name)
    x, q, k, v = inputs(m)
    beta = torch.sigmoid(m.b_proj(x).float())
    if name == "gated_deltanet":
        assert m.a_proj.weight.shape == (H, SHAPE.hidden_size) and m.dt_bias.shape == (H,)
        g = -m.A_log.float().exp() * F.softplus(m.a_proj(x).float() + m.dt_bias.float())
        run = dispatch.gated_delta_rule
    else:
        assert m.f_proj[1].weight.shape == (H * D, D) and m.dt_bias.shape == (H * D,)
        g = -m.A_log.float().exp()[:, None] * F.softplus(m._heads(m.f_proj(x).float() + m.dt_bias.float()))
        run = dispatch.kimi_delta_rule
    want, want_state = run(q, k, v, g, beta, scale=D**-0.5, prior=None, backend="reference", chunk_size=8,
                           normalize_qk=True)
    got, state = m._mix(x, q, k, v, None, "reference")
    assert torch.equal(got, want) and torch.equal(state, want_state)
    head = "gated_deltanet" == name
    explicit = make(name, decay_group_size=D if head else 1)  # the default spelled out: the same network
    assert all(torch.equal(a, b) for a, b in zip(explicit.state_dict().values(), m.state_dict().values()))


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("name", ["gated_deltanet", "kda"])
def test_a_grouped_gate_is_the_recurrence_with_each_gate_on_its_channels(name, group):
    """Against the step-by-step oracle, with channel c of head h decayed by gate c // group of that head."""
    m = make(name, decay_group_size=group)
    x, q, k, v = inputs(m)
    per_gate = -m.A_log.float().exp()[:, None] * F.softplus(gate_logits(m, x))
    assert per_gate.shape[-1] == D // group
    g = torch.stack([per_gate[..., c // group] for c in range(D)], -1)
    beta = torch.sigmoid(m.b_proj(x).float())
    want, want_state = recurrence.recurrent_gated_delta(l2norm(q), l2norm(k), v, g, beta, scale=D**-0.5)
    got, state = m._mix(x, q, k, v, None, "reference")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["gated_deltanet", "kda"])
def test_gates_that_agree_within_a_head_are_the_per_head_gate(name):
    """Two gates per head with the same projection rows and dt_bias compute the per-head gate's layer (another
    route through the reference: g `[B, T, H, K]` against `[B, T, H]`)."""
    per_head, grouped = make(name, decay_group_size=0), make(name, decay_group_size=D // 2)
    grouped.load_state_dict({k: v for k, v in per_head.state_dict().items() if k not in
                             ("a_proj.weight", "f_proj.1.weight", "dt_bias")}, strict=False)
    with torch.no_grad():
        for src, dst in ((per_head.dt_bias, grouped.dt_bias),
                         *(((per_head.a_proj.weight, grouped.a_proj.weight),) if name == "gated_deltanet" else
                           ((per_head.f_proj[1].weight, grouped.f_proj[1].weight),))):
            dst.copy_(src.repeat_interleave(2, dim=0))
    x = torch.randn(2, 19, SHAPE.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(grouped(x)[0], per_head(x)[0], rtol=1e-4, atol=1e-5)
        assert (make(name, decay_group_size=D // 2)(x)[0] - per_head(x)[0]).abs().max() > 1e-3  # can fail


@pytest.mark.parametrize("name,group", [("gated_deltanet", 2), ("kda", 0)])
def test_chunked_layer_equals_its_decoding_steps(name, group):
    m = make(name, decay_group_size=group)
    x = torch.randn(1, 13, SHAPE.hidden_size)
    with torch.no_grad():
        full, _ = m(x)
        head, state = m(x[:, :6], use_cache=True)
        tail = []
        for t in range(6, 13):
            y, state = m(x[:, t:t + 1], state=state, use_cache=True)
            tail.append(y)
    torch.testing.assert_close(torch.cat([head, *tail], 1), full, rtol=1e-4, atol=1e-5)


def test_bad_group_sizes_are_named():
    with pytest.raises(ValueError, match=r"decay_group_size=3 does not divide head_dim=8; allowed: 0 .* 1, 2, 4, 8"):
        mixer_class("kda")(SHAPE, mixer_options("kda", {"decay_group_size": 3}))
    with pytest.raises(ValueError, match="decay_group_size=-1 must be an integer >= 0"):
        mixer_options("gated_deltanet", {"decay_group_size": -1})
    with pytest.raises(ValueError, match="Allowed: .*decay_group_size"):
        mixer_options("gated_deltanet", {"decay_groups": 2})
