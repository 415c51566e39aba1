"""Sliding-window softmax attention (harness/mixers/window.py) against a dense reference: a full T x T softmax with
the band and padding masks applied; prefill + one-token steps against the whole sequence at once."""

from __future__ import annotations

import math

import pytest
import torch

from harness.mixers.window import window_attention


def dense(q, k, v, window, scale, mask=None):
    """softmax over keys s <= t with t - s < window and mask[s], per head, in float64."""
    t = torch.arange(q.shape[1])
    band = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < window)
    allowed = band[None, None]
    if mask is not None:
        allowed = allowed & mask[:, None, None, :]
    scores = torch.einsum("bthd,bshd->bhts", q.double(), k.double()) * scale
    probs = scores.masked_fill(~allowed, -math.inf).softmax(-1).nan_to_num(0.0)
    return torch.einsum("bhts,bshd->bthd", probs, v.double())


def qkv(batch=2, length=23, heads=3, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, length, heads, dim, generator=g) for _ in range(3)]


@pytest.mark.parametrize("window", [1, 4, 7, 23, 40])
def test_blockwise_equals_the_dense_band(window):
    q, k, v = qkv()
    o, _ = window_attention(q, k, v, window, scale=0.35)
    torch.testing.assert_close(o.double(), dense(q, k, v, window, 0.35), rtol=1e-5, atol=1e-5)


def test_a_window_as_long_as_the_sequence_is_causal_softmax_attention():
    q, k, v = qkv(length=16)
    o, _ = window_attention(q, k, v, 16, scale=0.125)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           is_causal=True, scale=0.125).transpose(1, 2)
    torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [3, 8])
def test_left_padded_rows_compute_what_they_compute_alone(window):
    q, k, v = qkv(batch=2, length=12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False  # row 1: 5 padded tokens, then 7 real ones
    o, _ = window_attention(q, k, v, window, scale=0.3, mask=mask)
    alone, _ = window_attention(q[1:, 5:], k[1:, 5:], v[1:, 5:], window, scale=0.3)
    torch.testing.assert_close(o[1, 5:], alone[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(o.double(), dense(q, k, v, window, 0.3, mask), rtol=1e-5, atol=1e-5)
    assert torch.equal(o[1, :5], torch.zeros_like(o[1, :5]))


@pytest.mark.parametrize("window", [1, 5, 30])
def test_prefill_then_steps_equals_the_whole_sequence(window):
    q, k, v = qkv(length=20)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, :3] = False
    whole, _ = window_attention(q, k, v, window, scale=0.3, mask=mask)
    out, cache = window_attention(q[:, :9], k[:, :9], v[:, :9], window, scale=0.3, mask=mask[:, :9], want_cache=True)
    pieces = [out]
    for t in range(9, 20):
        step, cache = window_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], window, scale=0.3,
                                       mask=mask[:, t:t + 1], prior=cache, want_cache=True)
        pieces.append(step)
        assert cache.k.shape[1] == window - 1
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-6, atol=1e-6)


def test_a_bad_window_is_refused_by_value():
    q, k, v = qkv(length=4)
    with pytest.raises(ValueError, match="window=0 must be >= 1"):
        window_attention(q, k, v, 0, scale=1.0)


def rope_of(dim: int, theta: float = 10000.0):
    """A standard rotary embedding: positions [L] -> x rotated, as `window_attention` takes it."""
    from harness.mixers.ops import rotate_half_rope

    inv = 1.0 / theta ** (torch.arange(0, dim, 2).double() / dim)

    def rotate(x, positions):
        angles = positions.double()[:, None] * inv[None]
        emb = torch.cat([angles, angles], -1)[None]
        return rotate_half_rope(x, emb.cos().to(x.dtype), emb.sin().to(x.dtype))

    return rotate


def test_with_rope_each_call_rotating_its_own_window_equals_absolute_positions():
    """RoPE scores depend on the query-key distance only: rotating by place in the window (cached keys from 0) is the
    dense attention over the whole sequence rotated at its absolute positions."""
    q, k, v = qkv(length=19)
    rotate = rope_of(8)
    positions = torch.arange(19)
    ref = dense(rotate(q, positions), rotate(k, positions), v, 6, 0.3)
    whole, _ = window_attention(q, k, v, 6, scale=0.3, rotate=rotate)
    torch.testing.assert_close(whole.double(), ref, rtol=1e-5, atol=1e-5)
    out, cache = window_attention(q[:, :7], k[:, :7], v[:, :7], 6, scale=0.3, rotate=rotate, want_cache=True)
    pieces = [out]
    for t in range(7, 19):
        step, cache = window_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], 6, scale=0.3, prior=cache,
                                       want_cache=True, rotate=rotate)
        pieces.append(step)
    torch.testing.assert_close(torch.cat(pieces, 1).double(), ref, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ in a student

from harness.mixers import MIXERS  # noqa: E402


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_at_step_0_a_windowed_student_with_a_window_as_long_as_the_text_is_the_teacher(mixer):
    """window_gain starts at 0, so the layer is the window alone; a window covering the whole text is the teacher's
    causal softmax attention, so the student is the teacher (biases and q/k norms included: Qwen3 here)."""
    from harness.student import build_student
    from tests.tiny import tiny_qwen3

    teacher = tiny_qwen3()
    student = build_student(teacher, mixer, window=16, chunk_size=4)
    ids = torch.randint(3, 97, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, teacher(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mixer", ["gated_deltanet", "gla", "mlstm"])
def test_a_windowed_student_decodes_with_its_cache_as_by_full_forwards(mixer):
    """Cached generate (window cache + recurrent state) equals greedy by full forwards, with the mixer's share
    trained away from 0 so that both parts count; a left-padded batch gives each row what it gives alone."""
    from harness.student import build_student
    from tests.tiny import tiny_llama

    student = build_student(tiny_llama(), mixer, window=3, chunk_size=4).eval()
    with torch.no_grad():
        for layer in student.model.layers:
            layer.mixer.window_gain.fill_(0.7)
    prompt = torch.randint(3, 97, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = student.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        tokens = prompt
        for _ in range(6):
            tokens = torch.cat([tokens, student(tokens).logits[:, -1:].argmax(-1)], dim=1)
        assert torch.equal(out, tokens)
        short = prompt[:, 3:]
        padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)
        batch = torch.cat([prompt, padded])
        mask = torch.ones_like(batch)
        mask[1, :3] = 0
        logits = student(batch, attention_mask=mask).logits
        torch.testing.assert_close(logits[1, 3:], student(short).logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logits[0], student(prompt).logits[0], rtol=1e-5, atol=1e-5)


def test_the_window_needs_a_positive_size():
    from harness.mixers import mixer_options

    with pytest.raises(ValueError, match="window=-2 must be >= 0"):
        mixer_options("gla", {"window": -2})


def test_a_windowed_student_saves_and_loads_with_its_window(tmp_path):
    from transformers import AutoModelForCausalLM

    from harness.student import build_student
    from tests.tiny import tiny_llama

    student = build_student(tiny_llama(), "retnet", window=4).eval()
    with torch.no_grad():
        for layer in student.model.layers:
            layer.mixer.window_gain.uniform_(0.2, 1.0)
    student.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.mixer_options["window"] == 4
    ids = torch.randint(3, 97, (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, student(ids).logits, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------ which path computes it
# The routing only: fla's kernel itself is checked against the blockwise form on a GPU (tests/gpu/test_window_gpu.py).

from harness.mixers import kernels  # noqa: E402
from harness.mixers import window as window_module  # noqa: E402

MARK = 2.0  # what the stand-in kernel outputs everywhere: no blockwise output is constant


@pytest.fixture
def kernel_calls(monkeypatch):
    """kernels.kernel_window_attention replaced by a recorder that outputs MARK; the list of what it was given."""
    calls = []

    def record(q, k, v, window, *, scale):
        calls.append({"q": q, "k": k, "v": v, "window": window, "scale": scale})
        return torch.full_like(q, MARK)

    monkeypatch.setattr(kernels, "kernel_window_attention", record)
    return calls


@pytest.fixture
def on_cuda(monkeypatch):
    """The routing sees every tensor as a CUDA tensor."""
    monkeypatch.setattr(window_module, "_on_cuda", lambda t: True)


def blockwise_cases():
    """name -> (whether tensors count as CUDA, window_attention's arguments): each a case the kernel does not take."""
    q, k, v = (t.to(torch.bfloat16) for t in qkv(length=12))  # a dtype the kernel takes: each case has one reason
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :4] = False
    _, prior = window_attention(q[:, :5], k[:, :5], v[:, :5], 4, scale=0.3, want_cache=True)
    wide = [t.to(torch.bfloat16) for t in qkv(batch=1, length=5, heads=1, dim=kernels.WINDOW_KERNEL_MAX_HEAD_DIM + 32)]
    plain = {"q": q, "k": k, "v": v, "window": 4, "scale": 0.3, "backend": "kernel"}
    return {
        "cpu": (False, plain),
        "reference backend": (True, {**plain, "backend": "reference"}),
        "padding": (True, {**plain, "mask": mask}),
        "a cache before": (True, {**plain, "q": q[:, 5:], "k": k[:, 5:], "v": v[:, 5:], "prior": prior}),
        "softcap": (True, {**plain, "softcap": 5.0}),
        "float64": (True, {**plain, "q": q.double(), "k": k.double(), "v": v.double()}),
        "float32": (True, {**plain, "q": q.float(), "k": k.float(), "v": v.float()}),
        "head_dim over the kernel's": (True, {**plain, "q": wide[0], "k": wide[1], "v": wide[2]}),
    }


@pytest.mark.parametrize("case", list(blockwise_cases()))
def test_the_cases_the_kernel_does_not_take_stay_blockwise(case, kernel_calls, monkeypatch):
    cuda, args = blockwise_cases()[case]
    if cuda:
        monkeypatch.setattr(window_module, "_on_cuda", lambda t: True)
    args = dict(args)
    q, k, v, window = args.pop("q"), args.pop("k"), args.pop("v"), args.pop("window")
    out, _ = window_attention(q, k, v, window, **args)
    assert kernel_calls == []
    blockwise, _ = window_attention(q, k, v, window, **{**args, "backend": "reference"})
    assert torch.equal(out, blockwise)


@pytest.mark.parametrize("mask", [None, "all real"])
def test_a_whole_unpadded_sequence_on_the_kernel_backend_goes_to_the_kernel(mask, kernel_calls, on_cuda):
    """Rotated q and k (RoPE before the call), v as given, the window and the scale; the output in q's dtype; the
    cache as the blockwise path makes it."""
    q, k, v = (t.to(torch.bfloat16) for t in qkv(length=10))
    rotate = rope_of(8)
    mask = None if mask is None else torch.ones(2, 10, dtype=torch.bool)
    out, cache = window_attention(q, k, v, 4, scale=0.3, rotate=rotate, mask=mask, want_cache=True, backend="kernel")
    (call,) = kernel_calls
    positions = torch.arange(10)
    assert torch.equal(call["q"], rotate(q, positions)) and torch.equal(call["k"], rotate(k, positions))
    assert torch.equal(call["v"], v) and call["window"] == 4 and call["scale"] == 0.3
    assert out.dtype == torch.bfloat16 and torch.equal(out, torch.full_like(out, MARK))
    _, expected = window_attention(q, k, v, 4, scale=0.3, rotate=rotate, want_cache=True, backend="reference")
    for got, want in zip(cache, expected):
        assert torch.equal(got, want)


def test_an_unresolved_backend_is_refused_by_value():
    q, k, v = qkv(length=4)
    with pytest.raises(ValueError, match="backend='auto' is not one of kernel, reference"):
        window_attention(q, k, v, 2, scale=1.0, backend="auto")


def test_a_mixer_hands_its_resolved_backend_to_the_window(kernel_calls, on_cuda, monkeypatch):
    """On the reference backend the window stays blockwise; where the mixer resolves to the kernel backend, its
    window goes to the kernel (the recurrence stood in for: no fla on this machine)."""
    from harness.mixers import MixerShape, mixer_class, mixer_options

    shape = MixerShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8)
    options = mixer_options("linear_attn", {"window": 4, "backend": "reference"})
    layer = mixer_class("linear_attn")(shape, options).to(torch.bfloat16)  # a dtype the window's kernel takes
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    layer(x)
    assert kernel_calls == []
    monkeypatch.setattr(layer, "backend_for", lambda x: "kernel")
    monkeypatch.setattr(layer, "_mix", lambda x, q, k, v, prior, backend, mask=None: (torch.zeros_like(v), None))
    layer(x)
    assert len(kernel_calls) == 1 and kernel_calls[0]["window"] == 4


def test_window_backend_blockwise_keeps_the_window_off_the_kernel(kernel_calls, on_cuda, monkeypatch):
    """`window_backend: blockwise` sends the window to the PyTorch form even where the mixer runs on the kernel
    backend (the fallback a lease takes if the kernel's window disagrees with the blockwise form)."""
    from harness.mixers import MixerShape, mixer_class, mixer_options

    shape = MixerShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8)
    options = mixer_options("linear_attn", {"window": 4, "window_backend": "blockwise"})
    layer = mixer_class("linear_attn")(shape, options).to(torch.bfloat16)
    monkeypatch.setattr(layer, "backend_for", lambda x: "kernel")
    monkeypatch.setattr(layer, "_mix", lambda x, q, k, v, prior, backend, mask=None: (torch.zeros_like(v), None))
    layer(torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16))
    assert kernel_calls == []


def test_a_bad_window_backend_is_refused_by_value():
    from harness.mixers import mixer_options

    with pytest.raises(ValueError, match="window_backend='flash' is not one of auto, blockwise"):
        mixer_options("gla", {"window": 4, "window_backend": "flash"})
