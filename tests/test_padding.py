"""Padded batches are exact for every mixer on the reference backend (and through the kernel backend's wrappers,
emulated on CPU): a row padded on the left (generation) or
on the right (scoring) gives, at its real tokens, the logits, greedy tokens and recurrent states of the same
prompt run alone; an all-ones mask is the unpadded path bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import harness
from harness.mixers import MIXERS, MixerState, dispatch, kernels, recurrence
from harness.mixers.contract import PAD, padded, real, row_state
from harness.mixers.ops import l2norm
from tests.tiny import tiny_llama

LENGTHS = (5, 13, 22)  # chunk_size 8: the shortest row starts after two whole chunks of padding
ATOL = 1e-5


@pytest.fixture(scope="module")
def teacher():
    return tiny_llama()


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(3)
    return [torch.randint(3, 97, (n,)) for n in LENGTHS]


def student(teacher, mixer, rope=False):
    torch.manual_seed(1)
    # random conv taps: the identity init would look at the current token only and hide a wrong conv tail
    model = harness.build_student(teacher, mixer, chunk_size=8, backend="reference", rope=rope).eval()
    for layer in model.model.layers:
        if hasattr(layer.mixer, "qkv_conv"):
            layer.mixer.qkv_conv.reset_parameters("random")
    return model


# every mixer without RoPE; with RoPE a sample (a per-channel gate, a delta rule with its convolution, the mLSTM),
# which a new mixer need not join
MIXER_CASES = [(m, False) for m in sorted(MIXERS)] + [(m, True) for m in ("gla", "gated_deltanet", "mlstm")]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("mixer,rope", MIXER_CASES)
def test_padded_logits_equal_each_prompt_alone(teacher, prompts, mixer, rope, side):
    model = student(teacher, mixer, rope)
    ids, mask = padded(prompts, side)
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        unmasked = model(ids).logits
        for row, p in enumerate(prompts):
            alone = model(p[None]).logits[0]
            torch.testing.assert_close(real(batch[row], len(p), side), alone, atol=ATOL, rtol=0)
    if side == "left":  # the comparison can fail: the same padded ids without their mask differ
        shortest = len(prompts[0])
        assert (real(unmasked[0], shortest, side) - real(batch[0], shortest, side)).abs().max() > 1e-3


@pytest.mark.parametrize("mixer,rope", MIXER_CASES)
def test_left_padded_state_equals_the_state_alone(teacher, prompts, mixer, rope):
    model = student(teacher, mixer, rope)
    ids, mask = padded(prompts, "left")
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).cache
        unmasked = model(ids, use_cache=True).cache
        for row, p in enumerate(prompts):
            alone = model(p[None], use_cache=True).cache
            for mine, theirs in zip(cache.states, alone.states):  # a growing cache's real slots (fox's)
                for a, b in zip(row_state(mine, row), row_state(theirs, 0), strict=True):
                    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-6)  # entries reach ~100 (no decay)
    first = [t[:1].float() for t in unmasked.states[0].tensors()]  # without the mask, padding is written into the state
    assert max((a - b).abs().max() for a, b in zip(first, [t[:1].float() for t in cache.states[0].tensors()])) > 1e-4


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_right_padding_neither_writes_nor_decays_the_recurrent_state(teacher, prompts, mixer):
    """After right padding the recurrence's state is the real tokens' (a decay at the padding would shrink it;
    before a row's first token, as in left padding, a decay of the zero state is invisible)."""
    model = student(teacher, mixer)
    ids, mask = padded(prompts, "right")
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).cache
        for row, p in enumerate(prompts):
            alone = model(p[None], use_cache=True).cache
            for mine, theirs in zip(cache.states, alone.states):
                for a, b in zip(row_state(MixerState(mine.recurrent), row), row_state(MixerState(theirs.recurrent), 0),
                                strict=True):
                    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-6)


def greedy(model, ids, mask, new: int):
    model.generation_config.eos_token_id = None
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, num_beams=1,
                              pad_token_id=PAD)
    return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)[:, ids.shape[1]:]


@pytest.mark.parametrize("mixer,rope", MIXER_CASES)
def test_left_padded_generate_gives_the_tokens_of_each_prompt_alone(teacher, prompts, mixer, rope):
    model = student(teacher, mixer, rope)
    ids, mask = padded(prompts, "left")
    with torch.no_grad():
        batch = greedy(model, ids, mask, 5)
        for row, p in enumerate(prompts):
            alone = greedy(model, p[None], torch.ones(1, len(p), dtype=torch.long), 5)
            assert batch[row].tolist() == alone[0].tolist()
        # the decoding steps after the prompt see the same states and positions: logits, not only argmaxes
        out = model(ids, attention_mask=mask, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        step = model(token, attention_mask=torch.cat([mask, torch.ones_like(token)], 1), cache=out.cache).logits
        for row, p in enumerate(prompts):
            first = model(p[None], use_cache=True)
            step_alone = model(token[row:row + 1], cache=first.cache).logits
            torch.testing.assert_close(step[row], step_alone[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("mixer,rope", MIXER_CASES)
def test_an_all_ones_mask_is_the_unpadded_path(teacher, prompts, mixer, rope):
    model = student(teacher, mixer, rope)
    ids = torch.stack([p[:5] for p in prompts])
    with torch.no_grad():
        plain = model(ids, use_cache=True)
        ones = model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
        assert torch.equal(plain.logits, ones.logits)
        for a, b in zip(plain.cache.states, ones.cache.states):
            assert all(torch.equal(x, y) for x, y in zip(a.tensors(), b.tensors(), strict=True))


def test_rope_positions_skip_left_padding(teacher):
    model = student(teacher, "gla", rope=True).model
    hidden = torch.zeros(2, 4, 1)
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert model._positions(hidden, None, mask).tolist() == [[0, 0, 0, 1], [0, 1, 2, 3]]
    cache = harness.student.RecurrentCache(0)
    cache.seen_tokens = 4
    step = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    assert model._positions(hidden[:, :1], cache, step).tolist() == [[2], [4]]


def test_a_mask_must_cover_the_cached_tokens(teacher, prompts):
    model = student(teacher, "retnet")
    ids, mask = padded(prompts, "left")
    with torch.no_grad():
        out = model(ids, attention_mask=mask, use_cache=True)
        with pytest.raises(ValueError, match="cached \\+ new tokens"):
            model(ids[:, -1:], attention_mask=torch.cat([mask[:, :1] * 0, mask[:, :1]], 1), cache=out.cache)


def _route_like_fla(calls):
    """A CPU stand-in for kernels.kernel_gated_delta: the reference recurrence, except that the constant-per-head
    route reads only g[0, 0], as fla's g_gamma does, so a masked RetNet decay sent there would come out wrong."""
    def run(q, k, v, g=None, beta=None, *, scale, initial_state=None, normalize_qk=False):
        case = kernels.gated_delta_case(g, beta)
        calls.append(case)
        if case == "head_const":
            g = g[:1, :1].expand_as(g)
        if normalize_qk:
            q, k = l2norm(q), l2norm(k)
        return recurrence.chunk_gated_delta(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=8)
    return run


def _native_mlstm_kernel(q, k, v, i, f, *, scale, initial_state=None, eps=1e-6, **_):
    """kernels.kernel_mlstm on CPU: the same wrapper around mlstm_kernels' native chunkwise forward."""
    from mlstm_kernels.torch.chunkwise import native

    return kernels._mlstm_padded(native.mlstm_chunkwise__native_autograd, q, k, v, i, f, scale=scale,
                                 state=initial_state, eps=eps, chunk_size=16, dtype=torch.float32)


def _recurrence_inputs(B=3, T=22, H=2, K=8, seed=5):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, K, generator=gen) for _ in range(3))
    g_head = -torch.rand(B, T, H, generator=gen)
    g_channel = -torch.rand(B, T, H, K, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    gate_i = 3 * torch.randn(B, T, H, generator=gen)
    gate_f = 3 + torch.randn(B, T, H, generator=gen)
    return q, k, v, g_head, g_channel, beta, gate_i, gate_f


def _left_mask(T=22):
    return torch.arange(T)[None] >= torch.tensor([[T - n] for n in LENGTHS])


GATED_DELTA_CALLS = {  # function, its extra tensors from _recurrence_inputs, the case fla sees once masked
    "linear_attention": (lambda a: (), "none"),
    "retention": (lambda a: (torch.tensor([-0.1, -0.5]).expand(3, 22, 2),), "head"),
    "gated_linear_attention": (lambda a: (a[4],), "channel"),
    "delta_rule": (lambda a: (a[5],), "delta"),
    "gated_delta_rule": (lambda a: (a[3], a[5]), "head_delta"),
    "kimi_delta_rule": (lambda a: (a[4], a[5]), "channel_delta"),
}


@pytest.mark.parametrize("name", sorted(GATED_DELTA_CALLS))
def test_the_kernel_backend_takes_a_padded_batch(name, monkeypatch):
    """A left-padded batch on the kernel backend (its fla call emulated on CPU) gives each row's real outputs and
    final state of that row alone; a masked RetNet decay leaves fla's constant-per-head route."""
    calls = []
    monkeypatch.setattr(kernels, "kernel_gated_delta", _route_like_fla(calls))
    a = _recurrence_inputs()
    extra, case = GATED_DELTA_CALLS[name]
    fn, tensors, mask = getattr(dispatch, name), extra(a), _left_mask()
    o, state = fn(a[0], a[1], a[2], *tensors, scale=0.5, prior=None, backend="kernel", chunk_size=8, mask=mask)
    assert calls == [case]
    for row, n in enumerate(LENGTHS):
        alone = [t[row:row + 1, -n:] for t in (a[0], a[1], a[2], *tensors)]
        o1, s1 = fn(*alone, scale=0.5, prior=None, backend="reference", chunk_size=8)
        torch.testing.assert_close(o[row, -n:], o1[0], atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(state[row], s1[0], atol=ATOL, rtol=ATOL)


def test_the_mlstm_kernel_takes_a_padded_batch(monkeypatch):
    """A left-padded batch through the mLSTM kernel wrapper (mlstm_kernels' native chunkwise on CPU), with the
    finite padding gates, gives each row's outputs and (C, n, m) of that row alone on the reference backend; the
    shortest row's padding fills a whole kernel chunk."""
    monkeypatch.setattr(kernels, "kernel_mlstm", _native_mlstm_kernel)
    q, k, v, _, _, _, i, f = _recurrence_inputs()
    h, state = dispatch.mlstm_cell(q, k, v, i, f, scale=0.5, prior=None, backend="kernel", chunk_size=8, eps=1e-6,
                                   mask=_left_mask())
    for row, n in enumerate(LENGTHS):
        alone = [t[row:row + 1, -n:] for t in (q, k, v, i, f)]
        h1, s1 = dispatch.mlstm_cell(*alone, scale=0.5, prior=None, backend="reference", chunk_size=8, eps=1e-6)
        torch.testing.assert_close(h[row, -n:], h1[0], atol=1e-4, rtol=1e-4)
        for a, b in zip(state, s1):
            torch.testing.assert_close(a[row], b[0], atol=1e-4, rtol=1e-4)
