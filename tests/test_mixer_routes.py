"""The kernel each mixer runs on the kernel backend, as its file declares it (`kernel_case.route`, beside the
dispatch function of harness.mixers.dispatch it calls), found on CPU: the kernel entry points are replaced by
recorders of the route `kernels.select_gated_delta_route` picks for the mixer's own g and beta, computing with the
reference."""

from __future__ import annotations

import pytest
import torch

from harness.mixers import MIXERS, MixerShape, kernels, mixer_class, mixer_options, recurrence
from harness.mixers.fox import forgetting_attention
from harness.mixers.path import path_attention

SHAPE = MixerShape(hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=8)
# path's kernel takes head dims 16, 32, 64, 128 only (kernels.PATH_KERNEL_HEAD_DIMS)
SHAPE_OF = {"path": MixerShape(hidden_size=32, num_heads=2, num_kv_heads=2, head_dim=16)}

# the kernel each mixer declares, on a machine where fla's gated backward is not blocked
FLA_ROUTE = {name: cls.kernel_case.route for name, cls in MIXERS.items() if cls.kernel_case is not None}


def _record_kernels(monkeypatch) -> list[str]:
    taken: list[str] = []

    def gated_delta(q, k, v, g=None, beta=None, *, scale, initial_state=None, normalize_qk=False):
        taken.append(kernels.select_gated_delta_route(q, k, v, g, beta, initial_state))
        return recurrence.chunk_gated_delta(q, k, v, g, beta, scale=scale, initial_state=initial_state)

    def mlstm(q, k, v, i, f, *, scale, initial_state=None, eps=1e-6):
        taken.append(kernels.MLSTM_KERNEL)
        return recurrence.chunk_mlstm(q, k, v, i, f, scale=scale, initial_state=initial_state, eps=eps)

    def product(q, k, v, g, beta, *, scale, initial_state=None, normalize_qk=False):
        taken.append(kernels.select_gated_delta_product_route(q, k, v, g, beta, initial_state))
        return recurrence.chunk_gated_delta_product(q, k, v, g, beta, scale=scale, initial_state=initial_state)

    def dplr(q, k, v, a, b, g, *, scale, initial_state=None, lower_bound=None):
        taken.append(kernels.DPLR_ROUTES[0])
        return recurrence.chunk_dplr_delta(q, k, v, a, b, g, scale=scale, initial_state=initial_state)

    monkeypatch.setattr(kernels, "kernel_gated_delta", gated_delta)
    monkeypatch.setattr(kernels, "kernel_gated_delta_product", product)
    monkeypatch.setattr(kernels, "kernel_dplr_delta", dplr)
    monkeypatch.setattr(kernels, "kernel_mlstm", mlstm)

    def gsa(q, k, v, s, g, *, scale, initial_state=None):
        taken.append(kernels.GSA_KERNEL)
        return recurrence.chunk_gsa(q, k, v, s, g, scale=scale, initial_state=initial_state)

    monkeypatch.setattr(kernels, "kernel_gsa", gsa)

    def forgetting(q, k, v, g, *, scale):
        taken.append(kernels.FOX_KERNEL)
        return forgetting_attention(q, k, v, g, scale=scale)[0]

    monkeypatch.setattr(kernels, "kernel_forgetting_attention", forgetting)

    def path(q, k, v, w, beta, g=None, *, scale, want_cache=False):
        taken.append(kernels.PATH_KERNEL)
        o, cache = path_attention(q, k, v, w, beta, g, scale=scale)
        return o, cache.k if want_cache else None

    monkeypatch.setattr(kernels, "kernel_path_attention", path)
    monkeypatch.setattr(kernels, "_gated_bwd_blocked", lambda: False)
    monkeypatch.delenv("HARNESS_FLA_ROUTES", raising=False)
    return taken


def test_every_built_in_mixer_declares_its_route():
    assert set(MIXERS.builtins) <= set(FLA_ROUTE)


@pytest.mark.parametrize("name", sorted(FLA_ROUTE))
def test_each_mixer_reaches_the_kernel_its_file_names(monkeypatch, name):
    taken = _record_kernels(monkeypatch)
    torch.manual_seed(0)
    shape = SHAPE_OF.get(name, SHAPE)
    layer = mixer_class(name)(shape, mixer_options(name, {"rope": False}))  # alone: no model's positions
    monkeypatch.setattr(layer, "backend_for", lambda x: "kernel")
    y, _ = layer(torch.randn(2, 16, shape.hidden_size))
    assert taken == [FLA_ROUTE[name]] and y.shape == (2, 16, shape.hidden_size)


# the decay gate's granularity (harness.mixers.decay): one gate per head takes Gated DeltaNet's kernel, finer KDA's
DECAY_GROUP_ROUTES = [("gated_deltanet", 2, "kda"), ("gated_deltanet", 1, "kda"), ("kda", 0, "gated_delta_rule"),
                      ("kda", 8, "gated_delta_rule"), ("kda", 4, "kda")]


@pytest.mark.parametrize("name,group,route", DECAY_GROUP_ROUTES)
def test_a_decay_group_size_reaches_the_kernel_of_its_granularity(monkeypatch, name, group, route):
    taken = _record_kernels(monkeypatch)
    torch.manual_seed(0)
    layer = mixer_class(name)(SHAPE, mixer_options(name, {"decay_group_size": group}))
    monkeypatch.setattr(layer, "backend_for", lambda x: "kernel")
    layer(torch.randn(2, 16, SHAPE.hidden_size))
    assert taken == [route]
