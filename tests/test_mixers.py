"""Every mixer layer: chunked form == one-token recurrence (outputs and gradients), GQA expansion, options."""

from __future__ import annotations

import pytest
import torch

from harness.mixers import MIXERS, MixerShape, mixer_class, mixer_options
from harness.mixers.ops import expand_kv

SHAPE = MixerShape(hidden_size=48, num_heads=6, num_kv_heads=2, head_dim=8)


def make_mixer(name: str, seed: int = 0, **options):
    """A layer alone, without a model's position embeddings: RoPE off unless asked (fox's default is on)."""
    torch.manual_seed(seed)
    mixer = mixer_class(name)(SHAPE, mixer_options(name, {"backend": "reference", "chunk_size": 16, "rope": False,
                                                          **options}))
    mixer.reset_new_parameters()
    # make every new parameter matter: gates far from their (often saturated) initial values
    with torch.no_grad():
        for n, p in mixer.named_parameters():
            if not n.startswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                p.add_(0.3 * torch.randn_like(p))
    return mixer


def step_by_step(mixer, x):
    """Run the layer one token at a time, carrying its state."""
    state, outs = None, []
    for t in range(x.shape[1]):
        y, state = mixer(x[:, t : t + 1], state=state, use_cache=True)
        outs.append(y)
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("name", list(MIXERS))
def test_chunked_equals_recurrent_outputs_and_gradients(name):
    mixer = make_mixer(name)
    x = torch.randn(2, 37, SHAPE.hidden_size)  # 37: not a multiple of the chunk size
    y_chunk, _ = mixer(x)
    grads_chunk = torch.autograd.grad(y_chunk.square().sum(), list(mixer.parameters()), allow_unused=True)
    y_step, _ = step_by_step(mixer, x)
    grads_step = torch.autograd.grad(y_step.square().sum(), list(mixer.parameters()), allow_unused=True)
    torch.testing.assert_close(y_chunk, y_step, rtol=1e-4, atol=1e-5)
    for (pname, _), gc, gs in zip(mixer.named_parameters(), grads_chunk, grads_step):
        assert (gc is None) == (gs is None), pname
        if gc is not None:
            rel = ((gc - gs).norm() / gs.norm()).item()
            assert rel < 1e-4, f"{name}: gradient of {pname} differs by {rel:.2e} (relative norm)"


@pytest.mark.parametrize("name", list(MIXERS))
def test_prefill_then_steps_equals_one_pass(name):
    """Prefill with the chunked form, then decode step by step: the generation path."""
    mixer = make_mixer(name, seed=1)
    x = torch.randn(1, 29, SHAPE.hidden_size)
    with torch.no_grad():
        full, _ = mixer(x)
        head, state = mixer(x[:, :20], use_cache=True)
        tail = []
        for t in range(20, 29):
            y, state = mixer(x[:, t : t + 1], state=state, use_cache=True)
            tail.append(y)
    torch.testing.assert_close(torch.cat([head, *tail], dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", list(MIXERS))
def test_bf16_runs_close_to_fp32(name):
    mixer = make_mixer(name, seed=2)
    x = torch.randn(1, 24, SHAPE.hidden_size)
    with torch.no_grad():
        ref, _ = mixer(x)
        low, _ = mixer.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert low.dtype == torch.bfloat16
    rel = (low.float() - ref).norm() / ref.norm()
    assert rel < 5e-2, rel


@pytest.mark.parametrize("name", list(MIXERS))
def test_rope_requires_position_embeddings(name):
    mixer = make_mixer(name, seed=3, rope=True)
    x = torch.randn(1, 8, SHAPE.hidden_size)
    with pytest.raises(ValueError, match="position_embeddings"):
        mixer(x)


def test_expand_kv_maps_student_head_j_to_teacher_head_j_div_nrep():
    kv_heads, n_rep, d, c = 3, 3, 4, 5
    w = torch.arange(kv_heads * d * c, dtype=torch.float32).reshape(kv_heads * d, c)
    out = expand_kv(w, kv_heads, n_rep).reshape(kv_heads * n_rep, d, c)
    teacher = w.reshape(kv_heads, d, c)
    for j in range(kv_heads * n_rep):
        assert torch.equal(out[j], teacher[j // n_rep])


def test_unknown_option_lists_allowed():
    with pytest.raises(ValueError, match="Allowed: .*short_conv"):
        mixer_options("gated_deltanet", {"expand_v": 2})
    with pytest.raises(ValueError, match="unknown mixer 'no_such_mixer'; valid mixers: " + ", ".join(MIXERS)):
        mixer_options("no_such_mixer", {})


def test_the_built_in_mixers_come_first_each_under_its_own_name():
    assert list(MIXERS)[:len(MIXERS.builtins)] == list(MIXERS.builtins)
    assert {"linear_attn", "gated_deltanet", "mlstm"} <= set(MIXERS.builtins)
    assert all(MIXERS[name].name == name for name in MIXERS)


@pytest.mark.parametrize("T", [1, 2, 3, 10])
def test_short_conv_tail_is_the_last_inputs_and_owns_its_memory(T):
    from harness.mixers.base import ShortConv

    torch.manual_seed(0)
    conv = ShortConv(6, kernel_size=4)
    x = torch.randn(2, T, 6)
    y, tail = conv(x)
    y_fused, tail_fused = conv(x, fused=True)  # on a CPU the fused request falls back to PyTorch's conv1d
    assert torch.equal(y, y_fused) and torch.equal(tail, tail_fused)
    assert torch.equal(tail, conv.tail_of(x)) and tail.shape == (2, 6, 3)
    want = torch.cat([torch.zeros(2, 6, 3), x.transpose(1, 2)], -1)[..., -3:]
    assert torch.equal(tail, want)
    for t in (tail, conv.tail_of(x)):  # not a view of x or of the padded input
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("bias", [False, True])
def test_shifted_causal_conv_equals_pytorch_conv1d(activation, bias):
    """`causal_conv_shifted` (the form the `compiled` pieces run on a GPU) == ShortConv's conv1d path, output and
    gradients of the input, the weight and the bias."""
    from harness.mixers.base import ShortConv, causal_conv_shifted

    torch.manual_seed(0)
    conv = ShortConv(6, kernel_size=4, bias=bias, activation=activation)
    conv.reset_parameters("random")
    outs = []
    for shifted in (False, True):
        x = torch.randn(2, 9, 6, generator=torch.Generator().manual_seed(1)).requires_grad_()
        conv.zero_grad()
        y = (causal_conv_shifted(x, conv.conv.weight.squeeze(1), conv.conv.bias, activation) if shifted
             else conv(x, want_tail=False)[0])
        (y * torch.linspace(-1, 1, 6)).sum().backward()
        outs.append([y, x.grad, conv.conv.weight.grad.clone()] + ([conv.conv.bias.grad.clone()] if bias else []))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_stacked_qkv_projection_equals_the_three_projections():
    """`fused_qkv`'s one matmul over the stacked weights (with biases, as Qwen2's layout has them) == q_proj, k_proj
    and v_proj concatenated, and its gradients reach each weight."""
    from dataclasses import replace

    from harness.mixers import mixer_class, mixer_options

    torch.manual_seed(0)
    layer = mixer_class("gated_deltanet")(replace(SHAPE, qkv_bias=True), mixer_options("gated_deltanet",
                                                                                      {"fused_qkv": True}))
    with torch.no_grad():
        for proj in (layer.q_proj, layer.k_proj, layer.v_proj):
            proj.bias.normal_()
    x = torch.randn(2, 5, SHAPE.hidden_size)
    stacked = layer.stacked_qkv(x)
    three = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], -1)
    torch.testing.assert_close(stacked, three, rtol=1e-6, atol=1e-6)
    (stacked * torch.linspace(-1, 1, stacked.shape[-1])).sum().backward()
    grads = [p.weight.grad.clone() for p in (layer.q_proj, layer.k_proj, layer.v_proj)]
    layer.zero_grad()
    (three * torch.linspace(-1, 1, three.shape[-1])).sum().backward()
    for g, p in zip(grads, (layer.q_proj, layer.k_proj, layer.v_proj)):
        torch.testing.assert_close(g, p.weight.grad)


def test_fused_qkv_layer_equals_the_three_projection_layer(monkeypatch):
    """With fused_ops forced on (the kernel backend's condition; the CPU runs the PyTorch forms of the rest), a
    fused_qkv layer projects through `stacked_qkv` and equals the three-matmul layer. (Under ZeRO-3, DeepSpeed's
    parameter getter gathers q_proj's weight when the mixer reads it, as it does the short convolution's weight.)"""
    from harness.mixers import mixer_class, mixer_options

    torch.manual_seed(0)
    fused = mixer_class("gated_deltanet")(SHAPE, mixer_options("gated_deltanet", {"fused_qkv": True}))
    plain = mixer_class("gated_deltanet")(SHAPE, mixer_options("gated_deltanet", {"fused_qkv": False}))
    plain.load_state_dict(fused.state_dict())
    x = torch.randn(2, 7, SHAPE.hidden_size)
    calls = []
    monkeypatch.setattr(type(fused), "fused_ops", lambda self, x: True)
    monkeypatch.setattr(type(fused), "stacked_qkv", lambda self, x, _f=type(fused).stacked_qkv: calls.append(1)
                        or _f(self, x))
    torch.testing.assert_close(fused(x)[0], plain(x)[0], rtol=1e-5, atol=1e-6)
    assert len(calls) == 1  # the fused layer only


def test_compiled_pieces_trace_and_equal_their_eager_forms():
    """`pieces: compiled` runs `gated_rms_norm` and `causal_conv_shifted` under torch.compile on a GPU; here Inductor's
    CPU backend compiles the same functions (a graph break or a tracing error would show), forward and backward."""
    from harness.mixers.base import causal_conv_shifted, compiled, gated_rms_norm

    torch.manual_seed(0)
    cases = [(gated_rms_norm, [torch.randn(2, 16, 3, 8), torch.randn(2, 16, 3, 8), torch.rand(8)], (1e-5, "silu")),
             (causal_conv_shifted, [torch.randn(2, 16, 12), torch.randn(12, 4)], (None, "silu"))]
    for fn, tensors, rest in cases:
        outs = []
        for run in (fn, compiled(fn)):
            leaves = [t.clone().requires_grad_() for t in tensors]
            y = run(*leaves, *rest)
            (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
            outs.append([y] + [t.grad for t in leaves])
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_pieces_option_names_the_bad_value():
    from harness.mixers import MIXERS

    with pytest.raises(ValueError, match="pieces='triton' is not one of fla, compiled, compiled-norm"):
        MIXERS["gated_deltanet"].Options(pieces="triton")


@pytest.mark.parametrize("pieces, conv, norm", [("fla", "fla", "fla"), ("compiled", "compiled", "compiled"),
                                                ("compiled-norm", "fla", "compiled")])
def test_each_pieces_choice_routes_its_convolution_and_norm(monkeypatch, pieces, conv, norm):
    """What each `pieces` choice runs, read off the calls on a tensor that says it is on CUDA (the kernels
    themselves are replaced: the routing is what is checked here; tests/gpu/test_mixer_layers.py runs them)."""
    import sys
    import types

    from harness.mixers import base

    ran = []
    monkeypatch.setattr(base, "compiled", lambda fn: (lambda *a, **k: ran.append(("compiled", fn.__name__))
                                                      or fn(*a, **k)))
    fake_fla = {"fla.modules.norm.fused_norm_gate": types.SimpleNamespace(
                    rms_norm_gated=lambda o, *a, **k: ran.append(("fla", "norm")) or o),
                "fla.modules.causal_conv1d": types.SimpleNamespace(
                    causal_conv1d=lambda x, **k: ran.append(("fla", "conv")) or (x, None))}
    for name, module in fake_fla.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x, o = torch.randn(1, 8, 6), torch.randn(1, 8, 2, 3)
    base.ShortConv(6).forward(x, fused=pieces, want_tail=False)
    base.HeadRMSNorm(3, activation="silu").forward(o, torch.randn(1, 8, 2, 3), fused=pieces)
    conv_ran = ("compiled", "causal_conv_shifted") if conv == "compiled" else ("fla", "conv")
    norm_ran = ("compiled", "gated_rms_norm") if norm == "compiled" else ("fla", "norm")
    assert ran == [conv_ran, norm_ran]


@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_gated_head_norm_is_rms_norm_times_the_activated_gate(activation):
    """HeadRMSNorm against a direct computation; fused=True on a CPU tensor stays on the PyTorch path (the fused
    Triton kernel is checked against it on a GPU: tests/gpu/test_mixer_layers.py)."""
    from harness.mixers.base import HeadRMSNorm

    torch.manual_seed(0)
    norm = HeadRMSNorm(8, eps=1e-5, activation=activation)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    o, gate = torch.randn(2, 5, 3, 8), torch.randn(2, 5, 3, 8)
    act = torch.nn.functional.silu if activation == "silu" else torch.sigmoid
    direct = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight * act(gate)
    torch.testing.assert_close(norm(o, gate), direct, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm(o, gate, fused=True), direct, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm(o, gate, fused="compiled"), direct, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_prior", [False, True])
def test_linear_attention_normaliser_in_the_recurrence_equals_the_explicit_form(with_prior):
    """The kernel backend's linear attention carries its normaliser as a value column of ones in the recurrence
    (`normalised_in_the_recurrence`); through the reference recurrence it must equal the explicit cumsum form:
    outputs, final (S, z) and gradients, also from a prior state."""
    from harness.mixers.linear_attn import normalised_in_the_recurrence

    mixer = make_mixer("linear_attn")
    B, T, H, D = 2, 37, SHAPE.num_heads, SHAPE.head_dim
    torch.manual_seed(3)
    x = torch.randn(B, T, SHAPE.hidden_size)
    q, k, v = (torch.randn(B, T, H, D, requires_grad=True) for _ in range(3))
    prior = (torch.randn(B, H, D, D), torch.rand(B, H, D) * 5) if with_prior else None
    o_ref, (S_ref, z_ref) = mixer._mix(x, q, k, v, prior, "reference")
    feature = lambda t: torch.nn.functional.elu(t) + 1.0  # noqa: E731 - the layer's default feature map
    o, (S, z) = normalised_in_the_recurrence(feature(q), feature(k), v, *(prior or (None, None)), eps=mixer.options.eps,
                                             backend="reference", chunk_size=16)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(S, S_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(z, z_ref, rtol=1e-5, atol=1e-4)
    weights = torch.randn_like(o)
    g_ref = torch.autograd.grad((o_ref * weights).sum(), (q, k, v))
    g = torch.autograd.grad((o * weights).sum(), (q, k, v))
    for name, a, b in zip("qkv", g, g_ref):
        rel = ((a - b).norm() / b.norm()).item()
        assert rel < 1e-4, f"d{name} differs by {rel:.2e}"
