"""Forgetting attention (harness/mixers/fox.py): the PyTorch reference (whole sequence, in blocks, and one decoding
step against its cache) against fla's naive_forgetting_attn and against the definition written out per query here;
padding, soft-capping; the layer against fla's ForgettingAttention written out; the transfer (the teacher's
attention at step 0 with the forget gate shut off); the kernel wrapper, the routing and the bench's case with fla's
call emulated on CPU (the kernel itself: tests/gpu/test_kernels.py and the contract on a GPU). The parametrised
suites (test_mixers, test_padding, test_decoding, test_state, test_mixer_contract, ...) take fox from the registry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import harness
from harness.bench import recurrences as bench
from harness.mixers import MixerShape, kernels, mixer_class, mixer_options
from harness.mixers.fox import FoxCache, forgetting_attention
from harness.mixers.ops import expand_kv
from harness.plain_engine import decays
from tests.fla_naive import fla_naive
from tests.tiny import tiny_gemma2, tiny_gemma3, tiny_llama, tiny_qwen3, tiny_smollm3

SHAPE = MixerShape(hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8)


def inputs(B=2, T=13, H=3, D=8, V=6, seed=0, gate_shift=1.0):
    """q, k, v and log forget gates logsigmoid(N(0, 1) + gate_shift)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    return q, k, v, F.logsigmoid(torch.randn(B, T, H, generator=gen) + gate_shift)


def direct(q, k, v, log_f, scale, mask=None, softcap=None):
    """The definition, one query at a time in float64: o_i = sum over real keys j <= i of softmax_j(cap(scale q_i.k_j)
    + sum over real l in j+1..i of log f_l) v_j; a query with no real key (left padding) gives 0."""
    B, T, H, _ = q.shape
    real = torch.ones(B, T, dtype=torch.bool) if mask is None else mask
    out = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for i in range(T):
            keys = [j for j in range(i + 1) if real[b, j]]
            if not keys:
                continue
            s = torch.einsum("hd,jhd->hj", q[b, i].double(), k[b, keys].double()) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            forget = torch.stack([sum((log_f[b, l].double() for l in range(j + 1, i + 1) if real[b, l]),
                                      torch.zeros(H, dtype=torch.float64)) for j in keys], -1)
            out[b, i] = torch.einsum("hj,jhd->hd", (s + forget).softmax(-1), v[b, keys].double())
    return out


# ------------------------------------------------------------------------------------------ the reference


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_the_reference_is_flas_naive_forgetting_attn_with_gradients(chunk):
    """GQA as fla takes it (k, v at fewer heads; ours expanded as the mixer expands them), outputs and the gradients
    of q, k, v and the gates, in blocks of 1, 4 and all the queries."""
    q, k, v, g = inputs(T=21, H=4)
    k, v = k[:, :, :2], v[:, :, :2]  # two KV heads under four query heads
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, g)]
    ours_in = [t.clone().requires_grad_(True) for t in (q, k, v, g)]
    want = fla_naive("forgetting_attn").naive_forgetting_attn(*leaves, scale=0.3)
    qq, kk, vv, gg = ours_in
    got, cache = forgetting_attention(qq, kk.repeat_interleave(2, 2), vv.repeat_interleave(2, 2), gg, scale=0.3,
                                      chunk_size=chunk)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad((want * weights).sum(), leaves),
                    torch.autograd.grad((got * weights).sum(), ours_in)):
        torch.testing.assert_close(b, a.float(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cache.g, g.cumsum(1))
    assert cache.valid.all() and cache.k.shape == (2, 21, 4, 8)


@pytest.mark.parametrize("softcap", [None, 1.5])
def test_the_reference_is_the_definition_under_padding_and_soft_capping(softcap):
    """Left- and right-padded rows (a padded token is no key and does not decay), and Gemma 2's cap on q.k."""
    q, k, v, g = inputs(B=3, T=11, gate_shift=-0.5)  # strong forgetting: a decay at a padded token would show
    mask = torch.ones(3, 11, dtype=torch.bool)
    mask[0, :4], mask[1, 7:], mask[2, 3:5] = False, False, False  # left, right; and holes, which generate never makes
    got, _ = forgetting_attention(q, k, v, g, scale=0.4, mask=mask, softcap=softcap, chunk_size=4)
    want = direct(q, k, v, g, 0.4, mask, softcap)
    torch.testing.assert_close(got.double()[mask], want[mask], rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0, :4], torch.zeros_like(got[0, :4]))  # left padding: no key to read
    alone, _ = forgetting_attention(q[:1, 4:], k[:1, 4:], v[:1, 4:], g[:1, 4:], scale=0.4, softcap=softcap)
    torch.testing.assert_close(got[0, 4:], alone[0], rtol=1e-6, atol=1e-6)


def test_decoding_steps_against_the_cache_equal_the_whole_sequence():
    """A prefill (left-padded row included), then one token at a time from the cache, then two at once: the whole
    sequence's outputs; the cache holds every token, G and which slots are real."""
    q, k, v, g = inputs(T=20, gate_shift=0.0)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :6] = False
    whole, full_cache = forgetting_attention(q, k, v, g, scale=0.3, mask=mask)
    out, cache = forgetting_attention(q[:, :9], k[:, :9], v[:, :9], g[:, :9], scale=0.3, mask=mask[:, :9])
    pieces = [out]
    for t in list(range(9, 17)) + [(17, 20)]:
        span = slice(t, t + 1) if isinstance(t, int) else slice(*t)
        step, cache = forgetting_attention(q[:, span], k[:, span], v[:, span], g[:, span], scale=0.3, prior=cache)
        pieces.append(step)
    torch.testing.assert_close(torch.cat(pieces, 1), whole, rtol=1e-5, atol=1e-6)
    for a, b in zip(cache, full_cache):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert cache.k.shape == (2, 20, 3, 8) and cache.valid.sum(1).tolist() == [20, 14]
    torch.testing.assert_close(cache.g[1, 6:], g[1, 6:].cumsum(0))  # the padding added no decay


def test_stacked_caches_decode_as_a_left_padded_batch():
    """Two rows' caches of different lengths stacked (harness.decoding's batches) continue as the rows alone."""
    q, k, v, g = inputs(B=1, T=12)
    caches = [forgetting_attention(q[:, :n], k[:, :n], v[:, :n], g[:, :n], scale=0.3)[1] for n in (5, 11)]
    stacked = FoxCache.stack_left_padded(caches)
    assert stacked.k.shape[1] == 11 and stacked.valid.sum(1).tolist() == [5, 11]
    nxt = [torch.cat([t[:, 11:12]] * 2) for t in (q, k, v, g)]
    both, _ = forgetting_attention(*nxt, scale=0.3, prior=stacked)
    for row, cache in enumerate(caches):
        alone, _ = forgetting_attention(*(t[:1] for t in nxt), scale=0.3, prior=cache)
        torch.testing.assert_close(both[row], alone[0], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------ the layer


def make(seed=0, **options):
    torch.manual_seed(seed)
    return mixer_class("fox")(SHAPE, mixer_options("fox", {"backend": "reference", "chunk_size": 4, **options}))


@torch.no_grad()
def test_the_layer_is_flas_forgetting_attention_written_out():
    """fla's ForgettingAttention (no RoPE, no q/k norm, no output gate): q, k, v projected (k, v at the KV heads), f =
    logsigmoid(f_proj x) per head, naive_forgetting_attn at head_dim^-1/2, o_proj."""
    m = make(rope=False)
    kv = {name: torch.randn(2 * 8, SHAPE.hidden_size) * 0.3 for name in ("k_proj", "v_proj")}  # at the KV heads
    for name, weight in kv.items():
        getattr(m, name).weight.copy_(expand_kv(weight, 2, 2))  # as the transfer expands them
    m.f_proj.weight.normal_(0, 0.5)
    m.f_proj.bias.normal_(0, 1)
    x = torch.randn(2, 11, SHAPE.hidden_size)
    q = m.q_proj(x).unflatten(-1, (4, 8))
    k, v = ((x @ kv[name].T).unflatten(-1, (2, 8)) for name in ("k_proj", "v_proj"))
    o = fla_naive("forgetting_attn").naive_forgetting_attn(q, k, v, F.logsigmoid(m.f_proj(x)), scale=8 ** -0.5)
    torch.testing.assert_close(m(x)[0], m.o_proj(o.flatten(2)), rtol=1e-5, atol=1e-5)


def test_the_forget_gate_starts_shut_off_and_is_new():
    teacher = tiny_llama(num_layers=1, hidden=32, heads=4, kv_heads=2)
    student = harness.build_student(teacher, "fox", forget_bias=7.0)
    m, attn = student.model.layers[0].mixer, teacher.model.layers[0].self_attn
    assert torch.equal(m.q_proj.weight, attn.q_proj.weight) and torch.equal(m.o_proj.weight, attn.o_proj.weight)
    assert torch.equal(m.k_proj.weight, attn.k_proj.weight.unflatten(0, (2, -1)).repeat_interleave(2, 0).flatten(0, 1))
    assert torch.equal(m.f_proj.weight, torch.zeros(4, 32)) and torch.equal(m.f_proj.bias, torch.full((4,), 7.0))
    assert not decays("f_proj.bias", m.f_proj.bias) and decays("f_proj.weight", m.f_proj.weight)
    assert m.options.rope and student.config.mixer_options["rope"]  # the teacher's RoPE by default


@pytest.mark.parametrize("family", [tiny_llama, tiny_qwen3, tiny_smollm3, tiny_gemma2, tiny_gemma3])
def test_at_step_0_with_the_gate_at_one_the_student_is_the_teacher(family):
    """forget_bias 40 (log f = -4e-18): the teacher's attention, with its RoPE (per layer, none on SmolLM3's NoPE
    layers), q/k norms, scale and soft-capping; Gemma's layers all full attention here (fox has no window). A gate that
    forgets (bias 3) and the student without RoPE are not the teacher (random weights here: how far off the default
    and each variant are on a real teacher is docs/TRANSFER.md's)."""
    kwargs = {"layer_types": ["full_attention"] * 2} if family in (tiny_gemma2, tiny_gemma3) else {}
    teacher = family(**kwargs)
    ids = torch.randint(3, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = teacher(ids).logits
        gaps = {bias: (harness.build_student(teacher, "fox", forget_bias=bias)(ids).logits - want).abs().max().item()
                for bias in (40.0, 3.0)}
        nope = (harness.build_student(teacher, "fox", rope=False, forget_bias=40.0)(ids).logits - want).abs().max()
    assert gaps[40.0] < 1e-5 < 1e-3 < gaps[3.0] and nope > 1e-2, (gaps, nope)


def test_bad_options_and_cases_are_named():
    with pytest.raises(ValueError, match="gate 'forget' goes with recurrence 'forgetting_attn'"):
        harness.mixers.KernelCase(route="gla", gate="forget")
    assert not mixer_class("fox").kernel_case.stateful and mixer_class("gla").kernel_case.stateful


# ------------------------------------------------------------------------------------------ the kernel path


@pytest.fixture
def fla_calls(monkeypatch):
    """kernels.kernel_forgetting_attention with its CUDA check off and fla's parallel_forgetting_attn emulated by fla's
    naive form, given exactly what the wrapper passes fla; the list of the dtypes it was given."""
    calls = []

    def parallel_forgetting_attn(q, k, v, g, *, scale):
        calls.append((q.dtype, k.dtype, v.dtype, g.dtype))
        return fla_naive("forgetting_attn").naive_forgetting_attn(q, k, v, g, scale=scale).to(q.dtype)

    monkeypatch.setattr(kernels, "_require", lambda *a, **kw: None)
    monkeypatch.setattr(kernels, "_fla_forgetting_attn", lambda: parallel_forgetting_attn)
    return calls


def test_a_whole_unpadded_sequence_on_the_kernel_backend_goes_to_fla(fla_calls):
    """q, k, v in bf16 (a float32 layer's too, as the recurrences' kernels), the gates in float32, the output in v's
    dtype, the cache as the reference makes it."""
    q, k, v, g = inputs()
    for mask in (None, torch.ones(2, 13, dtype=torch.bool)):
        out, cache = forgetting_attention(q, k, v, g, scale=0.3, mask=mask, backend="kernel")
        ref, ref_cache = forgetting_attention(q, k, v, g, scale=0.3)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, ref, rtol=3e-2, atol=3e-2)
        assert all(torch.equal(a, b) for a, b in zip(cache, ref_cache))
    assert fla_calls == [(torch.bfloat16,) * 3 + (torch.float32,)] * 2


@pytest.mark.parametrize("case", ["reference backend", "padding", "a cache before", "softcap", "head_dim 320"])
def test_the_cases_the_kernel_does_not_take_stay_with_the_reference(case, fla_calls):
    q, k, v, g = inputs(D=320 if case == "head_dim 320" else 8)
    args = {"scale": 0.3, "backend": "reference" if case == "reference backend" else "kernel"}
    if case == "padding":
        args["mask"] = torch.arange(13)[None].expand(2, -1) >= torch.tensor([[0], [4]])
    if case == "softcap":
        args["softcap"] = 2.0
    if case == "a cache before":
        args["prior"] = forgetting_attention(q[:, :5], k[:, :5], v[:, :5], g[:, :5], scale=0.3)[1]
        q, k, v, g = (t[:, 5:] for t in (q, k, v, g))
    out, _ = forgetting_attention(q, k, v, g, **args)
    assert fla_calls == []
    assert torch.equal(out, forgetting_attention(q, k, v, g, **{**args, "backend": "reference"})[0])


def test_the_bench_case_compares_the_kernel_with_the_reference(fla_calls):
    """The recurrence bench's fox case (its inputs, both runners, the error table: no state) runs end to end with
    the emulated kernel, within the bench's limits; an initial state is not asked of it."""
    x = bench.make_inputs("fox", 1, 40, H=3, K=16, V=16, device="cpu", seed=1, with_state=True)
    assert x["h0"] is None and x["dS"] is None
    errs = bench.compare(x)
    assert set(errs) == {"o", "dq", "dk", "dv", "dg"}
    assert bench.failures(errs, "fox") == {}, errs
    assert bench.selected_route(x, "auto") == kernels.FOX_KERNEL
