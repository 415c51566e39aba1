"""The kernel each mixer runs on the kernel backend, as its file and its dispatch function
(harness.mixers.dispatch) name it, found on CPU: the kernel entry points are replaced by recorders of the route
`kernels.select_gated_delta_route` picks for the mixer's own g and beta, computing with the reference."""

from __future__ import annotations

import pytest
import torch

from harness.mixers import MIXERS, MixerShape, kernels, mixer_class, mixer_options, recurrence

SHAPE = MixerShape(hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=8)

# the fla op named at each mixer's recurrence call, on a machine where fla's gated backward is not blocked
FLA_ROUTE = {"linear_attn": "simple_gla", "retnet": "simple_gla_gamma", "gla": "gla", "deltanet": "delta_rule",
             "gated_deltanet": "gated_delta_rule", "kda": "kda", "mlstm": "mlstm_kernels", "mamba2": "simple_gla",
             "hedgehog": "simple_gla"}


def _record_kernels(monkeypatch) -> list[str]:
    taken: list[str] = []

    def gated_delta(q, k, v, g=None, beta=None, *, scale, initial_state=None, normalize_qk=False):
        taken.append(kernels.select_gated_delta_route(q, k, v, g, beta, initial_state))
        return recurrence.chunk_gated_delta(q, k, v, g, beta, scale=scale, initial_state=initial_state)

    def mlstm(q, k, v, i, f, *, scale, initial_state=None, eps=1e-6):
        taken.append("mlstm_kernels")
        return recurrence.chunk_mlstm(q, k, v, i, f, scale=scale, initial_state=initial_state, eps=eps)

    monkeypatch.setattr(kernels, "kernel_gated_delta", gated_delta)
    monkeypatch.setattr(kernels, "kernel_mlstm", mlstm)
    monkeypatch.setattr(kernels, "_gated_bwd_blocked", lambda: False)
    monkeypatch.delenv("HARNESS_FLA_ROUTES", raising=False)
    return taken


def test_every_mixer_has_a_route():
    assert set(FLA_ROUTE) == set(MIXERS)


@pytest.mark.parametrize("name", sorted(FLA_ROUTE))
def test_each_mixer_reaches_the_kernel_its_file_names(monkeypatch, name):
    taken = _record_kernels(monkeypatch)
    torch.manual_seed(0)
    layer = mixer_class(name)(SHAPE, mixer_options(name, {}))
    monkeypatch.setattr(layer, "backend_for", lambda x: "kernel")
    y, _ = layer(torch.randn(2, 16, SHAPE.hidden_size))
    assert taken == [FLA_ROUTE[name]] and y.shape == (2, 16, SHAPE.hidden_size)
