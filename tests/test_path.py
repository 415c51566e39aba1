"""PaTH attention (harness/mixers/path.py): the PyTorch reference (whole sequence in blocks, and decoding steps
against its cache of transformed keys) against fla's naive_path_attn and against the definition written out here,
one Householder step at a time; padding, soft-capping, the forget gate; the layer against fla's PaTHAttention written
out; the transfer (the teacher's attention at step 0 with beta ~ 0); the kernel wrapper, the routing and the bench's
case with fla's call emulated on CPU (the kernel itself: tests/gpu/test_kernels.py and the contract on a GPU). The
parametrised suites (test_mixers, test_padding, test_state, test_mixer_contract, ...) take path from the registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import harness
from harness.bench import recurrences as bench
from harness.mixers import MixerShape, kernels, mixer_class, mixer_options
from harness.mixers.ops import expand_kv
from harness.mixers.path import PathCache, path_attention
from harness.plain_engine import decays
from tests.fla_naive import fla_naive
from tests.tiny import tiny_gemma2, tiny_gemma3, tiny_llama, tiny_qwen3, tiny_smollm3

SHAPE = MixerShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8)


def inputs(B=2, T=13, H=3, D=8, V=6, seed=0, gate_shift=1.0):
    """q, k, v, unit directions w, beta = 2 sigmoid(N(0, 1)) in (0, 2) and log forget gates."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    w = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
    beta = 2 * torch.sigmoid(torch.randn(B, T, H, generator=gen))
    return q, k, v, w, beta, F.logsigmoid(torch.randn(B, T, H, generator=gen) + gate_shift)


def seen_key(k, w, beta, b, h, j, i, real):
    """Key j as query i sees it, in float64: (I - beta_t w_t w_t^T) applied for each real t in j+1..i, in order."""
    key = k[b, j, h].double()
    for t in range(j + 1, i + 1):
        if real[b, t]:
            u = w[b, t, h].double()
            key = key - beta[b, t, h].double() * (u @ key) * u
    return key


def direct(q, k, v, w, beta, log_f, scale, mask=None, softcap=None):
    """The definition, one query and one key at a time in float64: o_i = sum over real keys j <= i of
    softmax_j(cap(scale q_i . H_i ... H_{j+1} k_j) + scale sum over real l in j+1..i of log f_l) v_j (H of padded
    tokens the identity); a query with no real key gives 0."""
    B, T, H, _ = q.shape
    real = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                keys = [j for j in range(i + 1) if real[b, j]]
                if not keys:
                    continue
                s = torch.stack([q[b, i, h].double() @ seen_key(k, w, beta, b, h, j, i, real) for j in keys]) * scale
                if softcap is not None:
                    s = softcap * torch.tanh(s / softcap)
                if log_f is not None:
                    s = s + scale * torch.stack([sum((log_f[b, l, h].double() for l in range(j + 1, i + 1)
                                                      if real[b, l]), torch.zeros((), dtype=torch.float64))
                                                 for j in keys])
                out[b, i, h] = s.softmax(-1) @ v[b, keys, h].double()
    return out


# ------------------------------------------------------------------------------------------ the reference


@pytest.mark.parametrize("chunk", [1, 4, 64])
@pytest.mark.parametrize("gated", [False, True])
def test_the_reference_is_flas_naive_path_attn_with_gradients(chunk, gated):
    """GQA as fla takes it (k, v, w and beta at fewer heads; ours expanded as the mixer expands them), outputs and
    the gradients of every input, in blocks of 1, 4 and all the queries; without the gate, fla's naive form gets
    zeros (it always adds one)."""
    q, k, v, w, beta, g = inputs(T=21, H=4, V=8)
    k, v, w, beta = k[:, :, :2], v[:, :, :2], w[:, :, :2], beta[:, :, :2]  # two KV heads under four query heads
    g = g if gated else torch.zeros_like(g)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, w, beta, g)]
    ours_in = [t.clone().requires_grad_(True) for t in (q, k, v, w, beta, g)]
    want = fla_naive("path_attn").naive_path_attn(*leaves, scale=0.3, chunk_size=8)
    qq, kk, vv, ww, bb, gg = ours_in
    got, cache = path_attention(qq, *(t.repeat_interleave(2, 2) for t in (kk, vv, ww, bb)), gg if gated else None,
                                scale=0.3, chunk_size=chunk)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(want)
    grads_want = torch.autograd.grad((want * weights).sum(), leaves[:5] + leaves[5:] * gated)
    grads_got = torch.autograd.grad((got * weights).sum(), ours_in[:5] + ours_in[5:] * gated)
    for a, b in zip(grads_want, grads_got, strict=True):
        torch.testing.assert_close(b, a.float(), rtol=1e-4, atol=1e-4)
    assert cache.valid.all() and cache.k.shape == (2, 21, 4, 8) and cache.k.dtype == torch.float32


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_the_reference_is_the_definition_under_padding_soft_capping_and_the_gate(softcap):
    """Left- and right-padded rows and holes (a padded token is no key, no transform and no decay), Gemma 2's cap
    on scale q.Hk, the forget gate scaled with the logits as fla's kernel scales it; a left-padded row is the row
    alone."""
    q, k, v, w, beta, g = inputs(B=3, T=11, gate_shift=-0.5)
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[0, :4], mask[1, 7:], mask[2, 3:5] = False, False, False
    got, _ = path_attention(q, k, v, w, beta, g, scale=0.4, mask=mask, softcap=softcap, chunk_size=4)
    want = direct(q, k, v, w, beta, g, 0.4, mask, softcap)
    torch.testing.assert_close(got.double()[mask], want[mask], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0, :4], torch.zeros_like(got[0, :4]))  # left padding: no key to read
    alone, _ = path_attention(*(t[:1, 4:] for t in (q, k, v, w, beta, g)), scale=0.4, softcap=softcap)
    torch.testing.assert_close(got[0, 4:], alone[0], rtol=1e-6, atol=1e-6)
    ungated, _ = path_attention(q, k, v, w, beta, None, scale=0.4, mask=mask, softcap=softcap, chunk_size=3)
    torch.testing.assert_close(ungated.double()[mask], direct(q, k, v, w, beta, None, 0.4, mask, softcap)[mask],
                               rtol=1e-5, atol=1e-6)


def test_decoding_steps_transform_every_cached_key_and_equal_the_whole_sequence():
    """A prefill (a left-padded row included), then one token at a time from the cache, then three at once: the
    whole sequence's outputs. Each step applies its token's transform to every cached key and appends its own key
    untouched (fla's rank_one_update): the cache holds each key as the last token sees it."""
    q, k, v, w, beta, g = inputs(T=20, gate_shift=0.0)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :6] = False
    whole, full_cache = path_attention(q, k, v, w, beta, g, scale=0.3, mask=mask)
    out, cache = path_attention(*(t[:, :9] for t in (q, k, v, w, beta, g)), scale=0.3, mask=mask[:, :9])
    pieces = [out]
    for t in list(range(9, 17)) + [(17, 20)]:
        span = slice(t, t + 1) if isinstance(t, int) else slice(*t)
        before = cache.k
        step, cache = path_attention(*(x[:, span] for x in (q, k, v, w, beta, g)), scale=0.3, prior=cache)
        pieces.append(step)
        if isinstance(t, int):
            u = w[:, t, None].double()  # [B, 1, H, D]
            want = before.double() - beta[:, t, None, :, None] * (before.double() * u).sum(-1, keepdim=True) * u
            torch.testing.assert_close(cache.k[:, :t].double(), want, rtol=1e-6, atol=1e-6)
            assert torch.equal(cache.k[:, t], k[:, t])
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-5, atol=1e-6)
    for a, b in zip(cache, full_cache):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    real = mask.clone()
    for b, j in ((0, 0), (0, 13), (1, 7)):
        want = torch.stack([seen_key(k, w, beta, b, h, j, 19, real) for h in range(3)])
        torch.testing.assert_close(cache.k[b, j].double(), want, rtol=1e-5, atol=1e-5)
    assert cache.k.shape == (2, 20, 3, 8) and cache.valid.sum(1).tolist() == [20, 14]


def test_stacked_caches_decode_as_a_left_padded_batch():
    """Two rows' caches of different lengths stacked (harness.decoding's batches) continue as the rows alone."""
    x = inputs(B=1, T=12)
    caches = [path_attention(*(t[:, :n] for t in x), scale=0.3)[1] for n in (5, 11)]
    stacked = PathCache.stack_left_padded(caches)
    assert stacked.k.shape[1] == 11 and stacked.valid.sum(1).tolist() == [5, 11]
    nxt = [torch.cat([t[:, 11:12]] * 2) for t in x]
    both, _ = path_attention(*nxt, scale=0.3, prior=stacked)
    for row, cache in enumerate(caches):
        alone, _ = path_attention(*(t[:1] for t in nxt), scale=0.3, prior=cache)
        torch.testing.assert_close(both[row], alone[0], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------ the layer


def make(seed=0, **options):
    torch.manual_seed(seed)
    return mixer_class("path")(SHAPE, mixer_options("path", {"backend": "reference", "chunk_size": 4, **options}))


@pytest.mark.parametrize("gated", [False, True])
@torch.no_grad()
def test_the_layer_is_flas_path_attention_written_out(gated):
    """fla's PaTHAttention (no RoPE, no q/k norm): q, k, v projected (k, v at the KV heads), w = l2norm(silu(conv3(
    w_proj x))) (l2norm: x / sqrt(sum x^2 + 1e-6)) through the low-rank w_proj at the KV heads, beta = 2 sigmoid(
    bt_proj x), with the gate g = logsigmoid(g_proj x); naive_path_attn at head_dim^-1/2, o_proj. Then decoding from
    its cache, token by token."""
    m = make(rope=False, forget_gate=gated)
    kv = {name: torch.randn(2 * 8, SHAPE.hidden_size) * 0.3 for name in ("k_proj", "v_proj")}  # at the KV heads
    for name, weight in kv.items():
        getattr(m, name).weight.copy_(expand_kv(weight, 2, 2))  # as the transfer expands them
    m.bt_proj.weight.normal_(0, 0.5)
    m.bt_proj.bias.normal_(0, 1)
    if gated:
        m.g_proj.weight.normal_(0, 0.5)
        m.g_proj.bias.normal_(0, 1)
    x = torch.randn(2, 11, SHAPE.hidden_size)
    q = m.q_proj(x).unflatten(-1, (4, 8))
    k, v = ((x @ kv[name].T).unflatten(-1, (2, 8)) for name in ("k_proj", "v_proj"))
    conv = m.w_conv1d.conv.weight[:, 0]  # [C, 3]
    u = F.pad(m.w_proj[1](m.w_proj[0](x)), (0, 0, 2, 0))
    w = F.silu(sum(u[:, j:j + 11] * conv[:, j] for j in range(3))).unflatten(-1, (2, 8))
    w = w / (w.square().sum(-1, keepdim=True) + 1e-6).sqrt()  # fla's l2_norm
    beta = 2 * torch.sigmoid(m.bt_proj(x))
    g = F.logsigmoid(m.g_proj(x)) if gated else torch.zeros(2, 11, 4)
    o = fla_naive("path_attn").naive_path_attn(q, k, v, w, beta, g, scale=8 ** -0.5, chunk_size=4)
    want = m.o_proj(o.flatten(2))
    torch.testing.assert_close(m(x)[0], want, rtol=1e-5, atol=1e-5)
    y, state = m(x[:, :4], use_cache=True)
    steps = [y]
    for t in range(4, 11):
        y, state = m(x[:, t:t + 1], state=state, use_cache=True)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), want, rtol=1e-5, atol=1e-5)
    assert state.conv is None and state.recurrent.conv_in.shape == (2, 11, 16)


def test_the_transforms_start_near_the_identity_and_are_new():
    teacher = tiny_llama(num_layers=1, hidden=32, heads=4, kv_heads=2)
    student = harness.build_student(teacher, "path", beta_bias=-7.0)
    m, attn = student.model.layers[0].mixer, teacher.model.layers[0].self_attn
    assert torch.equal(m.q_proj.weight, attn.q_proj.weight) and torch.equal(m.o_proj.weight, attn.o_proj.weight)
    assert torch.equal(m.k_proj.weight, attn.k_proj.weight.unflatten(0, (2, -1)).repeat_interleave(2, 0).flatten(0, 1))
    assert torch.equal(m.bt_proj.weight, torch.zeros(2, 32)) and torch.equal(m.bt_proj.bias, torch.full((2,), -7.0))
    assert m.w_proj[0].weight.std() > 0 and m.w_conv1d.conv.weight.std() > 0  # random directions, as fla's
    assert not decays("bt_proj.bias", m.bt_proj.bias) and decays("w_proj.0.weight", m.w_proj[0].weight)
    assert m.options.rope and not m.options.forget_gate and student.config.mixer_options["rope"]


@pytest.mark.parametrize("family", [tiny_llama, tiny_qwen3, tiny_smollm3, tiny_gemma2, tiny_gemma3])
def test_at_step_0_with_beta_at_zero_the_student_is_the_teacher(family):
    """beta_bias -40 (beta = 8e-18): the teacher's attention, with its RoPE (none on SmolLM3's NoPE layers), q/k
    norms, scale and soft-capping; Gemma's layers all full attention here. beta_bias 0 (fla's beta ~ 1) and the
    student without RoPE are not the teacher (random weights here: a real teacher's numbers are docs/TRANSFER.md's)."""
    kwargs = {"layer_types": ["full_attention"] * 2} if family in (tiny_gemma2, tiny_gemma3) else {}
    teacher = family(**kwargs)
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = teacher(ids).logits
        gaps = {bias: (harness.build_student(teacher, "path", beta_bias=bias)(ids).logits - want).abs().max().item()
                for bias in (-40.0, 0.0)}
        nope = (harness.build_student(teacher, "path", rope=False, beta_bias=-40.0)(ids).logits - want).abs().max()
    assert gaps[-40.0] < 1e-5 < 1e-3 < gaps[0.0] and nope > 1e-2, (gaps, nope)


def test_bad_options_and_cases_are_named():
    with pytest.raises(ValueError, match="conv_size=0"):
        mixer_options("path", {"conv_size": 0})
    assert not mixer_class("path").kernel_case.stateful and mixer_class("path").growing_state


# ------------------------------------------------------------------------------------------ the kernel path


@pytest.fixture
def fla_calls(monkeypatch):
    """kernels.kernel_path_attention with its CUDA check off and fla's parallel_path_attn emulated: its output by
    fla's naive form and its key cache by the definition, given exactly what the wrapper passes fla; the list of
    the dtypes it was given and whether it was asked for the cache."""
    calls = []

    def parallel_path_attn(q, k, v, w, beta, g, *, scale, use_cache):
        calls.append((q.dtype, k.dtype, v.dtype, w.dtype, beta.dtype, None if g is None else g.dtype, use_cache))
        zeros = torch.zeros(q.shape[:3])
        o = fla_naive("path_attn").naive_path_attn(q, k, v, w, beta, zeros if g is None else g, scale=scale)
        real = torch.ones(q.shape[:2], dtype=torch.bool)
        B, T, H, _ = k.shape
        keys = torch.stack([torch.stack([torch.stack([seen_key(k, w, beta, b, h, j, T - 1, real) for h in range(H)])
                                         for j in range(T)]) for b in range(B)]).to(k.dtype) if use_cache else None
        return o.to(q.dtype), keys

    monkeypatch.setattr(kernels, "_require", lambda *a, **kw: None)
    monkeypatch.setattr(kernels, "_fla_path_attn", lambda: parallel_path_attn)
    return calls


def test_a_whole_unpadded_sequence_on_the_kernel_backend_goes_to_fla(fla_calls):
    """q, k, v in bf16 (a float32 layer's too), w, beta and the gates in float32, the output in v's dtype; the cache
    (fla's transformed keys, asked for only with want_cache) as the reference makes it."""
    q, k, v, w, beta, g = inputs(D=16, V=16)
    for mask, gate in ((None, g), (torch.ones(2, 13, dtype=torch.bool), None)):
        out, cache = path_attention(q, k, v, w, beta, gate, scale=0.3, mask=mask, backend="kernel")
        ref, ref_cache = path_attention(q, k, v, w, beta, gate, scale=0.3)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2)
        torch.testing.assert_close(cache.k, ref_cache.k, rtol=3e-2, atol=5e-2)
        assert all(torch.equal(a, b) for a, b in zip(cache[1:], ref_cache[1:]))
    out, cache = path_attention(q, k, v, w, beta, scale=0.3, backend="kernel", want_cache=False)
    assert cache is None
    f32, bf16 = torch.float32, torch.bfloat16
    assert fla_calls == [(bf16,) * 3 + (f32,) * 3 + (True,), (bf16,) * 3 + (f32, f32, None, True),
                         (bf16,) * 3 + (f32, f32, None, False)]


@pytest.mark.parametrize("case", ["reference backend", "padding", "a cache before", "softcap", "head_dim 24"])
def test_the_cases_the_kernel_does_not_take_stay_with_the_reference(case, fla_calls):
    q, k, v, w, beta, g = inputs(D=24 if case == "head_dim 24" else 16, V=16)
    args = {"scale": 0.3, "backend": "reference" if case == "reference backend" else "kernel"}
    if case == "padding":
        args["mask"] = torch.arange(13)[None].expand(2, -1) >= torch.tensor([[0], [4]])
    if case == "softcap":
        args["softcap"] = 2.0
    x = (q, k, v, w, beta, g)
    if case == "a cache before":
        args["prior"] = path_attention(*(t[:, :5] for t in x), scale=0.3)[1]
        x = tuple(t[:, 5:] for t in x)
    out, _ = path_attention(*x, **args)
    assert fla_calls == []
    assert torch.equal(out, path_attention(*x, **{**args, "backend": "reference"})[0])


def test_the_layer_asks_fla_for_the_cache_only_when_it_keeps_one(fla_calls, monkeypatch):
    """Training (no cache kept) does not ask fla for the transformed keys; a prefill that keeps its cache does."""
    shape = MixerShape(hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16)  # a head_dim fla's kernel takes
    m = mixer_class("path")(shape, mixer_options("path", {"rope": False}))
    monkeypatch.setattr(m, "backend_for", lambda x: "kernel")
    x = torch.randn(1, 6, shape.hidden_size)
    _, none = m(x)
    _, state = m(x, use_cache=True)
    assert none is None and state.recurrent.k.shape == (1, 6, 2, 16)
    assert [call[-1] for call in fla_calls] == [False, True]


def test_the_bench_case_compares_the_kernel_with_the_reference(fla_calls):
    """The recurrence bench's path case (its inputs, both runners, the error table: no state) runs end to end with
    the emulated kernel, within the bench's limits."""
    x = bench.make_inputs("path", 1, 20, H=2, K=16, V=16, device="cpu", seed=1, with_state=True)
    assert x["h0"] is None and x["dS"] is None
    errs = bench.compare(x)
    assert set(errs) == {"o", "dq", "dk", "dv", "dw", "dbeta"}
    assert bench.failures(errs, "path") == {}, errs
    assert bench.selected_route(x, "auto") == kernels.PATH_KERNEL
