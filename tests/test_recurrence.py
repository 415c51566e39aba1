"""The PyTorch reference recurrences (harness/mixers/recurrence.py) against each other and independent oracles.

- chunkwise == step-by-step (outputs, final states, gradients) for the six gated-delta cases and mLSTM;
- the gated delta rule == a literal per-(batch, head) loop written here, and == fla's naive references;
- mLSTM == mlstm_kernels' native recurrent and chunkwise implementations, states included;
- strong decays stay finite, a split sequence equals the whole, bf16 inputs come close to fp32.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.mixers.recurrence import (
    chunk_gated_delta,
    chunk_mlstm,
    recurrent_gated_delta,
    recurrent_mlstm,
    step_gated_delta,
    step_mlstm,
)
from tests.fla_naive import fla_naive

B, H, K, V = 2, 3, 16, 12  # K != V catches transposed states
SCALE = K**-0.5

# mixer -> (kind of g, whether beta is given), as in docs/RECURRENCES.md
CASES = {
    "linear_attn": (None, False),
    "retnet": ("retnet", False),
    "gla": ("channel", False),
    "deltanet": (None, True),
    "gated_deltanet": ("head", True),
    "kda": ("channel", True),
}
DECAYED = [name for name, (kind, _) in CASES.items() if kind is not None]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    """Max abs error within tol times the larger of 1 and the expected tensor's max magnitude."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.isfinite(actual).all()
    err = (actual.float() - expected.float()).abs().max().item()
    bound = tol * max(1.0, expected.float().abs().max().item())
    assert err <= bound, f"max error {err:.3e} > {bound:.3e}"


def decay(kind: str | None, length: int, gen: torch.Generator, strong: bool = False) -> torch.Tensor | None:
    if kind is None:
        return None
    if kind == "retnet":  # constant log(gamma_h), gamma_h = 1 - 2^(-5-h), expanded as the layer passes it
        gamma = 1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float32))
        return gamma.log().expand(B, length, H)
    shape = (B, length, H) if kind == "head" else (B, length, H, K)
    if strong:  # about -20 per token, all <= 0
        return -18.0 - 4.0 * torch.rand(shape, generator=gen)
    return F.logsigmoid(torch.randn(shape, generator=gen) + 3.0)


def delta_inputs(case: str, length: int, seed: int = 0, strong: bool = False) -> tuple[dict, torch.Tensor]:
    """q, k (L2-normalised), v, g, beta for one mixer, and a nonzero initial state."""
    kind, has_beta = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(
        q=torch.randn(B, length, H, K, generator=gen),
        k=F.normalize(torch.randn(B, length, H, K, generator=gen), dim=-1),
        v=torch.randn(B, length, H, V, generator=gen),
        g=decay(kind, length, gen, strong),
        beta=torch.sigmoid(torch.randn(B, length, H, generator=gen)) if has_beta else None,
    )
    return inputs, 0.5 * torch.randn(B, H, K, V, generator=gen)


def mlstm_inputs(length: int, seed: int = 0, gate_scale: float = 1.0) -> tuple[dict, tuple]:
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(
        q=torch.randn(B, length, H, K, generator=gen),
        k=torch.randn(B, length, H, K, generator=gen),
        v=torch.randn(B, length, H, V, generator=gen),
        i=gate_scale * 2.0 * torch.randn(B, length, H, generator=gen),
        f=gate_scale * (torch.randn(B, length, H, generator=gen) + 3.0),
    )
    state = (
        torch.randn(B, H, K, V, generator=gen),
        torch.randn(B, H, K, generator=gen).abs(),
        torch.randn(B, H, generator=gen),
    )
    return inputs, state


def leaves(inputs: dict, state):
    """Copies of all float inputs (and of the state) that require grad."""
    new = {n: None if x is None else x.clone().requires_grad_() for n, x in inputs.items()}
    if isinstance(state, tuple):
        return new, tuple(s.clone().requires_grad_() for s in state)
    return new, state.clone().requires_grad_()


def grads(fn, inputs: dict, state, **kw) -> list[torch.Tensor]:
    """Gradients of a fixed random projection of (output, final state) wrt every input and the state."""
    inputs, state = leaves(inputs, state)
    out, final = fn(**inputs, initial_state=state, **kw)
    finals = final if isinstance(final, tuple) else (final,)
    gen = torch.Generator().manual_seed(123)
    loss = (out * torch.randn(out.shape, generator=gen)).sum()
    loss = loss + sum((s * torch.randn(s.shape, generator=gen)).sum() for s in finals)
    params = [x for x in inputs.values() if x is not None] + list(state if isinstance(state, tuple) else (state,))
    return list(torch.autograd.grad(loss, params))


# ------------------------------------------------------------------------------------------- gated delta
# (T, chunk): T padded, T a multiple, then with a per-channel g (SUB_CHUNK = 8): 3 sub-chunks, sub-chunks of
# one token, a single sub-chunk; last T < C
SHAPES = [(100, 64), (64, 16), (50, 24), (20, 7), (12, 4), (5, 64)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("length,chunk", SHAPES)
def test_chunk_equals_recurrent(case: str, length: int, chunk: int) -> None:
    inputs, h0 = delta_inputs(case, length)
    o, s = chunk_gated_delta(**inputs, scale=SCALE, initial_state=h0, chunk_size=chunk)
    o_ref, s_ref = recurrent_gated_delta(**inputs, scale=SCALE, initial_state=h0)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert o.shape == (B, length, H, V) and s.shape == (B, H, K, V)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("case", CASES)
def test_no_initial_state(case: str) -> None:
    inputs, _ = delta_inputs(case, 40, seed=1)
    o, s = chunk_gated_delta(**inputs, scale=SCALE, chunk_size=16)
    o_ref, s_ref = recurrent_gated_delta(**inputs, scale=SCALE)
    assert_close(o, o_ref)
    assert_close(s, s_ref)


@pytest.mark.parametrize("case", CASES)
def test_gradients_chunk_equal_recurrent(case: str) -> None:
    inputs, h0 = delta_inputs(case, 50, seed=2)
    ours = grads(chunk_gated_delta, inputs, h0, scale=SCALE, chunk_size=32)
    ref = grads(recurrent_gated_delta, inputs, h0, scale=SCALE)
    assert len(ours) == len(ref) == sum(x is not None for x in inputs.values()) + 1
    for a, b in zip(ours, ref):
        assert_close(a, b, tol=2e-5)


@pytest.mark.parametrize("case", DECAYED)
def test_strong_decay(case: str) -> None:
    inputs, h0 = delta_inputs(case, 70, seed=3, strong=True)
    o, s = chunk_gated_delta(**inputs, scale=SCALE, initial_state=h0, chunk_size=64)
    o_ref, s_ref = recurrent_gated_delta(**inputs, scale=SCALE, initial_state=h0)
    assert_close(o, o_ref)
    assert_close(s, s_ref)
    for a, b in zip(grads(chunk_gated_delta, inputs, h0, scale=SCALE, chunk_size=64),
                    grads(recurrent_gated_delta, inputs, h0, scale=SCALE)):
        assert_close(a, b, tol=2e-5)


@pytest.mark.parametrize("case", CASES)
def test_split_equals_whole(case: str) -> None:
    inputs, h0 = delta_inputs(case, 90, seed=4)
    first = {n: None if x is None else x[:, :37] for n, x in inputs.items()}
    second = {n: None if x is None else x[:, 37:] for n, x in inputs.items()}
    o1, s1 = chunk_gated_delta(**first, scale=SCALE, initial_state=h0, chunk_size=16)
    o2, s2 = chunk_gated_delta(**second, scale=SCALE, initial_state=s1, chunk_size=16)
    o, s = chunk_gated_delta(**inputs, scale=SCALE, initial_state=h0, chunk_size=16)
    assert_close(torch.cat([o1, o2], 1), o)
    assert_close(s2, s)


def literal_delta(q, k, v, g, beta, scale, h0):
    """The recurrence of docs/RECURRENCES.md, one (batch, head) matrix at a time."""
    o = torch.zeros(*v.shape)
    state = h0.clone()
    for t in range(q.shape[1]):
        for b in range(q.shape[0]):
            for h in range(q.shape[2]):
                S, kt, vt = state[b, h], k[b, t, h], v[b, t, h]
                if g is not None:
                    S = torch.diag(torch.exp(g[b, t, h].expand(K))) @ S
                if beta is not None:
                    S = S + beta[b, t, h] * torch.outer(kt, vt - S.T @ kt)
                else:
                    S = S + torch.outer(kt, vt)
                state[b, h] = S
                o[b, t, h] = scale * S.T @ q[b, t, h]
    return o, state


@pytest.mark.parametrize("case", CASES)
def test_literal_reference(case: str) -> None:
    inputs, h0 = delta_inputs(case, 30, seed=5)
    o_lit, s_lit = literal_delta(**inputs, scale=0.7, h0=h0)
    o, s = chunk_gated_delta(**inputs, scale=0.7, initial_state=h0, chunk_size=16)
    assert_close(o, o_lit)
    assert_close(s, s_lit)
    o, s = recurrent_gated_delta(**inputs, scale=0.7, initial_state=h0)
    assert_close(o, o_lit)
    assert_close(s, s_lit)


def test_step_shapes_and_zero_state() -> None:
    inputs, _ = delta_inputs("kda", 1, seed=6)
    one = {n: x[:, 0] for n, x in inputs.items()}
    o, s = step_gated_delta(**one, scale=SCALE, state=None)
    o2, s2 = step_gated_delta(**one, scale=SCALE, state=torch.zeros(B, H, K, V))
    assert o.shape == (B, H, V) and s.shape == (B, H, K, V)
    assert torch.equal(o, o2) and torch.equal(s, s2)


@pytest.mark.parametrize("case", CASES)
def test_bf16_close_to_fp32(case: str) -> None:
    inputs, h0 = delta_inputs(case, 60, seed=7)
    low = {n: None if x is None else x.bfloat16() for n, x in inputs.items()}
    o, s = chunk_gated_delta(**low, scale=SCALE, initial_state=h0, chunk_size=32)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    high = {n: None if x is None else x.float() for n, x in low.items()}
    o_ref, s_ref = recurrent_gated_delta(**high, scale=SCALE, initial_state=h0)
    assert_close(o, o_ref, tol=2e-2)
    assert_close(s, s_ref, tol=1e-4)
    o_step, _ = recurrent_gated_delta(**low, scale=SCALE, initial_state=h0)
    assert o_step.dtype == torch.bfloat16


@pytest.mark.parametrize("case", ["deltanet", "kda"])
def test_autocast_does_not_lower_precision(case: str) -> None:
    inputs, h0 = delta_inputs(case, 40, seed=9)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, s = chunk_gated_delta(**inputs, scale=SCALE, initial_state=h0, chunk_size=16)
        o_step, _ = step_gated_delta(*(None if x is None else x[:, 0] for x in inputs.values()), scale=SCALE,
                                     state=h0)
    o_ref, s_ref = recurrent_gated_delta(**inputs, scale=SCALE, initial_state=h0)
    assert_close(o, o_ref)
    assert_close(s, s_ref)
    assert_close(o_step, o_ref[:, 0])


@pytest.mark.parametrize("case", CASES)
def test_fla_naive_references(case: str) -> None:
    """Our (g, beta) map onto fla's ops as the kernel wrapper will use them (fla's naive forms, fp32)."""
    inputs, h0 = delta_inputs(case, 64, seed=8)
    q, k, v, g, beta = inputs.values()
    o, s = chunk_gated_delta(**inputs, scale=SCALE, initial_state=h0, chunk_size=32)
    if case == "linear_attn":
        ref = fla_naive("linear_attn").naive_recurrent_linear_attn(
            q, k, v, scale=SCALE, initial_state=h0, output_final_state=True, normalize=False)
    elif case == "retnet":
        ref = fla_naive("simple_gla").naive_recurrent_simple_gla(q, k, v, g, scale=SCALE, initial_state=h0)
    elif case == "gla":  # scale fixed at K^-0.5 there
        ref = fla_naive("gla").naive_recurrent_gla(q, k, v, g, initial_state=h0, output_final_state=True)
    elif case in ("deltanet", "gated_deltanet"):  # deltanet: gated with g = 0
        gd = torch.zeros(B, 64, H) if g is None else g
        mod = fla_naive("gated_delta_rule")
        ref = mod.naive_recurrent_gated_delta_rule(q, k, v, beta, gd, scale=SCALE, initial_state=h0,
                                                   output_final_state=True)
        chunk_ref = mod.naive_chunk_gated_delta_rule(q, k, v, gd, beta, chunk_size=16, scale=SCALE,
                                                     initial_state=h0, output_final_state=True)
        assert_close(o, chunk_ref[0], tol=1e-4)
    else:
        mod = fla_naive("kda")
        ref = mod.naive_recurrent_kda(q, k, v, g, beta, scale=SCALE, initial_state=h0, output_final_state=True)
        chunk_ref = mod.naive_chunk_kda(q, k, v, g, beta, scale=SCALE, initial_state=h0, output_final_state=True,
                                        chunk_size=16)
        assert_close(o, chunk_ref[0], tol=1e-4)
    assert_close(o, ref[0])
    assert_close(s, ref[1])


# ------------------------------------------------------------------------------------------------- mLSTM
@pytest.mark.parametrize("length,chunk", SHAPES)
@pytest.mark.parametrize("with_state", [True, False])
def test_mlstm_chunk_equals_recurrent(length: int, chunk: int, with_state: bool) -> None:
    inputs, state = mlstm_inputs(length)
    state = state if with_state else None
    h, (c, n, m) = chunk_mlstm(**inputs, scale=SCALE, initial_state=state, chunk_size=chunk)
    h_ref, (c_ref, n_ref, m_ref) = recurrent_mlstm(**inputs, scale=SCALE, initial_state=state)
    assert h.shape == (B, length, H, V) and c.shape == (B, H, K, V) and n.shape == (B, H, K) and m.shape == (B, H)
    assert_close(h, h_ref)
    for a, b in ((c, c_ref), (n, n_ref), (m, m_ref)):
        assert_close(a, b)


def test_mlstm_gradients_chunk_equal_recurrent() -> None:
    inputs, state = mlstm_inputs(50, seed=1)
    ours = grads(chunk_mlstm, inputs, state, scale=SCALE, chunk_size=16)
    ref = grads(recurrent_mlstm, inputs, state, scale=SCALE)
    assert len(ours) == 8
    for a, b in zip(ours, ref):
        assert_close(a, b, tol=2e-5)


def test_mlstm_extreme_gates() -> None:
    inputs, state = mlstm_inputs(70, seed=2, gate_scale=10.0)  # i ~ +-20..60, f ~ -30..60
    h, final = chunk_mlstm(**inputs, scale=SCALE, initial_state=state, chunk_size=32)
    h_ref, final_ref = recurrent_mlstm(**inputs, scale=SCALE, initial_state=state)
    # Looser: where n^T q nearly cancels (|h| ~ 1e3 here) rounding is amplified in any summation order.
    assert_close(h, h_ref, tol=1e-3)
    for a, b in zip(final, final_ref):
        assert_close(a, b)
    for a in grads(chunk_mlstm, inputs, state, scale=SCALE, chunk_size=32):
        assert torch.isfinite(a).all()


def test_mlstm_split_equals_whole() -> None:
    inputs, state = mlstm_inputs(90, seed=3)
    first = {n: x[:, :37] for n, x in inputs.items()}
    second = {n: x[:, 37:] for n, x in inputs.items()}
    h1, s1 = chunk_mlstm(**first, scale=SCALE, initial_state=state, chunk_size=16)
    h2, s2 = chunk_mlstm(**second, scale=SCALE, initial_state=s1, chunk_size=16)
    h, s = chunk_mlstm(**inputs, scale=SCALE, initial_state=state, chunk_size=16)
    assert_close(torch.cat([h1, h2], 1), h)
    for a, b in zip(s2, s):
        assert_close(a, b)


def _bhtd(x: torch.Tensor) -> torch.Tensor:
    return x.movedim(1, 2).contiguous()


@pytest.mark.parametrize("with_state", [True, False])
def test_mlstm_matches_mlstm_kernels(with_state: bool) -> None:
    """mlstm_kernels (layout [B, H, T, D], scale K^-0.5, m as [B, H, 1]): recurrent loop and chunkwise."""
    import mlstm_kernels.torch.recurrent.native_sequence as recurrent
    from mlstm_kernels.torch import get_mlstm_kernel

    inputs, state = mlstm_inputs(64, seed=4)
    state = state if with_state else None
    theirs = dict(q=_bhtd(inputs["q"]), k=_bhtd(inputs["k"]), v=_bhtd(inputs["v"]),
                  i=inputs["i"].transpose(1, 2).contiguous(), f=inputs["f"].transpose(1, 2).contiguous())
    init = {} if state is None else dict(c_initial=state[0], n_initial=state[1], m_initial=state[2][..., None])
    h, (c, n, m) = chunk_mlstm(**inputs, scale=SCALE, initial_state=state, chunk_size=16)
    h_step, final_step = recurrent_mlstm(**inputs, scale=SCALE, initial_state=state)

    h_rec, last_rec = recurrent.mlstm_recurrent_sequence__native_fw(**theirs, **init, return_last_states=True)
    h_chk, last_chk = get_mlstm_kernel("chunkwise--native_autograd")(
        **theirs, **init, return_last_states=True, chunk_size=16)
    for h_theirs, last in ((h_rec, last_rec), (h_chk, last_chk)):
        assert_close(h, h_theirs.transpose(1, 2))
        assert_close(h_step, h_theirs.transpose(1, 2))
        for ours, ref in zip((c, n, m), (last[0], last[1], last[2].squeeze(-1))):
            assert_close(ours, ref)


def test_mlstm_gradients_match_mlstm_kernels() -> None:
    from mlstm_kernels.torch import get_mlstm_kernel

    kernel = get_mlstm_kernel("chunkwise--native_autograd")
    inputs, state = mlstm_inputs(64, seed=5)

    def theirs(q, k, v, i, f, initial_state):
        h, (c, n, m) = kernel(_bhtd(q), _bhtd(k), _bhtd(v), i.transpose(1, 2), f.transpose(1, 2),
                              c_initial=initial_state[0], n_initial=initial_state[1],
                              m_initial=initial_state[2][..., None], return_last_states=True, chunk_size=32)
        return h.transpose(1, 2), (c, n, m.squeeze(-1))

    ours = grads(chunk_mlstm, inputs, state, scale=SCALE, chunk_size=16)
    for a, b in zip(ours, grads(theirs, inputs, state)):
        assert_close(a, b, tol=2e-5)


def test_mlstm_step_zero_state() -> None:
    inputs, _ = mlstm_inputs(1, seed=6)
    one = {n: x[:, 0] for n, x in inputs.items()}
    h, (c, n, m) = step_mlstm(**one, scale=SCALE, state=None)
    zeros = (torch.zeros(B, H, K, V), torch.zeros(B, H, K), torch.zeros(B, H))
    h2, _ = step_mlstm(**one, scale=SCALE, state=zeros)
    assert h.shape == (B, H, V) and m.shape == (B, H)
    assert torch.equal(h, h2)
    assert torch.equal(m, torch.maximum(F.logsigmoid(one["f"]), one["i"]))  # m starts at 0


def test_mlstm_autocast_does_not_lower_precision() -> None:
    inputs, state = mlstm_inputs(40, seed=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h, _ = chunk_mlstm(**inputs, scale=SCALE, initial_state=state, chunk_size=16)
        h_step, _ = step_mlstm(*(x[:, 0] for x in inputs.values()), scale=SCALE, state=state)
    h_ref, _ = recurrent_mlstm(**inputs, scale=SCALE, initial_state=state)
    assert_close(h, h_ref)
    assert_close(h_step, h_ref[:, 0])


def test_mlstm_bf16_close_to_fp32() -> None:
    inputs, state = mlstm_inputs(60, seed=7)
    low = {n: x.bfloat16() for n, x in inputs.items()}
    h, final = chunk_mlstm(**low, scale=SCALE, initial_state=state, chunk_size=32)
    assert h.dtype == torch.bfloat16 and all(s.dtype == torch.float32 for s in final)
    h_ref, final_ref = recurrent_mlstm(**{n: x.float() for n, x in low.items()}, scale=SCALE, initial_state=state)
    assert_close(h, h_ref, tol=2e-2)
    for a, b in zip(final, final_ref):
        assert_close(a, b, tol=1e-4)


def test_bad_chunk_size() -> None:
    inputs, _ = delta_inputs("gla", 8)
    with pytest.raises(ValueError):
        chunk_gated_delta(**inputs, scale=SCALE, chunk_size=0)
