"""On CUDA: gated slot attention's kernel (kernels.kernel_gsa, fla's chunk_gsa) against the float32 reference
(recurrence.chunk_gsa) at SmolLM2-135M's heads (9 x 64, 64 slots): output, both final states and every input's
gradient, from an initial state, at a length that is not a multiple of fla's chunk; state passing; and the layer with
fla's layer options against fla's own GatedSlotAttention given the same weights. The layer's kernel path against
its reference is tests/gpu/test_mixer_layers.py's, parametrised over every mixer. Skipped without CUDA or fla."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU kernel tests need CUDA", allow_module_level=True)

from harness.mixers import kernels  # noqa: E402

_reason = kernels.kernel_unavailable_reason("fla")
if _reason is not None:
    pytest.skip(f"GPU kernels unavailable: {_reason}", allow_module_level=True)

from harness.bench import recurrences as R  # noqa: E402
from harness.mixers import MixerShape, mixer_class, mixer_options  # noqa: E402

SHAPE = R.SHAPES["smollm2-135m"]


@pytest.mark.parametrize("T", [2048, 1000])
def test_kernel_matches_reference(T):
    x = R.make_inputs("gsa", 2, T, **SHAPE, seed=1, with_state=True)
    errs = R.compare(x)
    table = ", ".join(f"{n}={e:.2e} (<= {R.tol_for(n, 'gsa'):.0e})" for n, e in errs.items())
    assert not R.failures(errs, "gsa"), f"T={T}: {table}"


def test_state_passing_matches_one_pass():
    """Tokens [0, 600) then [600, 1000) from the first part's final (hk, hv) == one pass over 1000."""
    x = R.make_inputs("gsa", 2, 1000, **SHAPE, seed=3)

    def part(sl, h0):
        return kernels.kernel_gsa(*(x[n][:, sl] for n in ("q", "k", "v", "s", "g")), scale=x["scale"],
                                  initial_state=h0)

    with torch.no_grad():
        full, full_state = part(slice(None), None)
        first, state = part(slice(0, 600), None)
        second, last = part(slice(600, None), state)
    assert R.rel_err(torch.cat([first, second], 1), full) < R.tol_for("o")
    for a, b in zip(last, full_state):
        assert R.rel_err(a, b) < R.tol_for("state")


@pytest.mark.parametrize("T", [512, 40])
def test_the_layer_with_flas_options_is_flas_gated_slot_attention(T):
    """fla's GatedSlotAttention (as fla-org/hybrid-distillation builds its GSA students: num_kv_heads = num_heads,
    64 slots, no short conv) and the gsa mixer with fla's layer options, the same weights, bf16: the same output
    (T = 40 takes fla's fused_recurrent mode, 512 its chunk mode)."""
    from fla.layers.gsa import GatedSlotAttention

    torch.manual_seed(0)
    hidden, heads = 576, 9
    fla_layer = GatedSlotAttention(hidden_size=hidden, num_heads=heads, num_kv_heads=heads, num_slots=64,
                                   layer_idx=0).cuda().bfloat16()
    shape = MixerShape(hidden_size=hidden, num_heads=heads, num_kv_heads=heads, head_dim=64)
    options = {"qkv_activation": "silu", "output_activation": "silu", "qk_scale": "one", "slot_decay_init": "uniform",
               "backend": "kernel"}
    ours = mixer_class("gsa")(shape, mixer_options("gsa", options)).cuda().bfloat16()
    with torch.no_grad():
        for proj in (fla_layer.q_proj, fla_layer.k_proj, fla_layer.v_proj, fla_layer.o_proj, fla_layer.f_proj):
            proj.weight.normal_(0, hidden ** -0.5)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj", "f_proj"):
            getattr(ours, name).weight.copy_(getattr(fla_layer, name).weight)
        ours.o_norm.weight.copy_(fla_layer.g_norm.weight)
        x = torch.randn(2, T, hidden, device="cuda", dtype=torch.bfloat16)
        want = fla_layer(x)[0]
        got = ours(x)[0]
    assert R.rel_err(got, want) < 2e-2
