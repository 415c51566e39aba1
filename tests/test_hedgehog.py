"""The hedgehog mixer: LoLCATs' feature map against its definition written per head, the layer against fla's naive
normalised linear attention on those features, a feature size other than head_dim (chunked == step by step), and
stage 1 training the maps. Padding, decoding and transfer are the registry-wide tests'; the kernel is tests/gpu's."""

from __future__ import annotations

import pytest
import torch

from harness.mixers import MixerShape, mixer_class, mixer_options
from harness.mixers.hedgehog import hedgehog_features
from tests.fla_naive import fla_naive

SHAPE = MixerShape(hidden_size=24, num_heads=3, num_kv_heads=1, head_dim=8)


def hedgehog(seed: int = 0, perturb: float = 0.3, **options):
    torch.manual_seed(seed)
    layer = mixer_class("hedgehog")(SHAPE, mixer_options("hedgehog", {"backend": "reference", "chunk_size": 8,
                                                                      **options}))
    with torch.no_grad():
        for weight in (layer.feature_q, layer.feature_k):
            weight.add_(perturb * torch.randn_like(weight))
    return layer


def test_the_feature_map_is_lolcats_softmax_pair_per_head():
    torch.manual_seed(0)
    x, weight = torch.randn(2, 5, 3, 8), torch.randn(3, 8, 6)
    got = hedgehog_features(x, weight)
    assert got.shape == (2, 5, 3, 12)
    for h in range(3):
        y = x[:, :, h] @ weight[h]
        torch.testing.assert_close(got[:, :, h], torch.cat([y.softmax(-1), (-y).softmax(-1)], -1))
    identity = hedgehog(perturb=0.0)
    assert torch.equal(identity.feature_q[1], torch.eye(8)) and torch.equal(identity.feature_k[2], torch.eye(8))
    q = torch.randn(1, 4, 3, 8)
    torch.testing.assert_close(identity.score_features(q, q)[0], torch.cat([q.softmax(-1), (-q).softmax(-1)], -1))


def test_the_random_init_is_lolcats_kaiming_uniform():
    layer = hedgehog(perturb=0.0, feature_init="random", feature_dim=4)
    bound = (6 / (8 * 4)) ** 0.5  # kaiming_uniform_ of an [H, D, F] tensor: fan_in = D x F
    for weight in (layer.feature_q, layer.feature_k):
        assert weight.shape == (3, 8, 4) and weight.abs().max() <= bound and weight.abs().max() > 0.8 * bound
    assert not torch.equal(layer.feature_q, layer.feature_k)  # untied, as LoLCATs' q and k maps
    with pytest.raises(ValueError, match="feature_init='eye'.*identity, random"):
        mixer_options("hedgehog", {"feature_init": "eye"})
    with pytest.raises(ValueError, match="feature_dim=0"):
        mixer_options("hedgehog", {"feature_dim": 0})


@pytest.mark.parametrize("feature_dim", [None, 5])
def test_the_layer_is_fla_naive_normalised_linear_attention_on_the_features(feature_dim):
    layer = hedgehog(feature_dim=feature_dim)
    u = torch.randn(2, 29, SHAPE.hidden_size)
    with torch.no_grad():
        heads, state = layer.heads_output(u, use_cache=True)
        q, k, v, _ = layer.project_qkv(u, None, False)
        fq, fk = hedgehog_features(q, layer.feature_q), hedgehog_features(k, layer.feature_k)
        want, _ = fla_naive("linear_attn").naive_recurrent_linear_attn(fq, fk, v, scale=1.0, normalize=True)
    torch.testing.assert_close(heads, want.flatten(2), rtol=1e-4, atol=1e-5)
    S, z = state.recurrent
    features = 2 * (feature_dim or SHAPE.head_dim)
    assert S.shape == (2, 3, features, SHAPE.head_dim) and z.shape == (2, 3, features)
    torch.testing.assert_close(z, fk.sum(1))


def test_a_feature_size_other_than_head_dim_decodes_step_by_step():
    layer = hedgehog(feature_dim=5)
    u = torch.randn(1, 21, SHAPE.hidden_size)
    with torch.no_grad():
        full, _ = layer(u)
        state, steps = None, []
        for t in range(u.shape[1]):
            y, state = layer(u[:, t:t + 1], state=state, use_cache=True)
            steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-4, atol=1e-5)


def test_stage1_trains_the_feature_maps():
    """Stage 1's optimizer groups (`param_groups` of the mixer as `init_mixer` builds it) hold the maps, and a few
    AdamW steps of its loss on a teacher's activations move them off the identity, q's and k's each its own way."""
    from torch import nn

    from harness.stages.align import init_mixer, layer_loss, param_groups
    from harness.student import student_config
    from harness.teacher import capture_activations
    from tests.tiny import tiny_llama

    teacher = tiny_llama(num_layers=1, hidden=24, heads=3, kv_heads=1)
    mixer = init_mixer(teacher.model.layers[0], student_config(teacher.config, "hedgehog", {}), 0, seed=0)
    groups = param_groups(nn.ModuleDict({"0": mixer}), weight_decay=0.01)
    held = {id(p) for g in groups for p in g["params"]}
    assert id(mixer.feature_q) in held and id(mixer.feature_k) in held
    acts = capture_activations(teacher, torch.randint(3, 97, (2, 24)), kinds=("attn_input", "attn_output"))
    optimizer = torch.optim.AdamW(groups, lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        layer_loss(mixer, "align_mixer", acts, 0).backward()
        optimizer.step()
    fq, fk = mixer.feature_q.detach(), mixer.feature_k.detach()
    eye = torch.eye(SHAPE.head_dim).expand_as(fq)
    assert (fq - eye).abs().max() > 1e-3 and (fk - eye).abs().max() > 1e-3 and not torch.equal(fq, fk)
