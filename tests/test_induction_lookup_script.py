"""scripts/induction_lookup.py (the teacher's induction heads read by linear memories) against direct computations:
the least-squares readout against torch.linalg.lstsq's map of the keys to the values, an exact lookup where the keys
are orthonormal, the softmax readout against the teacher's own attention (harness.transfer.AttentionProbe), and the
hit test on hand-made values."""

from __future__ import annotations

import pytest
import torch

from tests.pipeline import load_script


def script():
    return load_script("induction_lookup")


def test_orthonormal_keys_queried_by_the_target_key_are_read_back_exactly():
    m = script()
    keys = torch.eye(16, dtype=torch.float64)[:8]  # 8 orthonormal keys in 16 dimensions
    queries, targets = torch.tensor([5, 6, 7]), torch.tensor([1, 2, 4])
    q = torch.randn(8, 16, dtype=torch.float64)
    q[queries] = 3.0 * keys[targets]  # each query points at its target key (any length: the readouts normalise it)
    w = m.readout_weights(q, keys, queries, targets, scale=0.25, ridge=1e-9)
    for name in ("least_squares", "capacity", "linear"):
        expected = torch.zeros(3, 8, dtype=torch.float64)
        expected[torch.arange(3), targets] = 1.0
        assert torch.allclose(w[name], expected, atol=1e-6), name
    values = torch.randn(8, 4, dtype=torch.float64)
    assert m.hits(w["least_squares"], values, queries, targets).all()


def test_least_squares_readout_equals_the_fitted_map_and_stays_causal():
    """More keys than dimensions: the readout is S_t^T q with S_t the ridge least-squares map of the keys at
    positions <= t to their values (a direct lstsq on the augmented system), and weights past t are zero."""
    m = script()
    g = torch.Generator().manual_seed(0)
    T, D, V, ridge = 12, 4, 3, 1e-2
    q, k, v = (torch.randn(T, n, generator=g, dtype=torch.float64) for n in (D, D, V))
    queries, targets = torch.tensor([6, 11]), torch.tensor([2, 7])
    w = m.readout_weights(q, k, queries, targets, scale=D ** -0.5, ridge=ridge)
    kn, qn = k / k.norm(dim=-1, keepdim=True), q / q.norm(dim=-1, keepdim=True)
    for row, t in enumerate(queries.tolist()):
        a = torch.cat([kn[:t + 1], ridge ** 0.5 * torch.eye(D, dtype=torch.float64)])
        b = torch.cat([v[:t + 1], torch.zeros(D, V, dtype=torch.float64)])
        S = torch.linalg.lstsq(a, b).solution  # [D, V]
        assert torch.allclose(w["least_squares"][row] @ v, S.T @ qn[t], atol=1e-9)
        assert torch.allclose(w["capacity"][row] @ v, S.T @ kn[targets[row]], atol=1e-9)
        for name, weights in w.items():
            assert (weights[row, t + 1:] == 0).all(), name
        assert torch.isclose(w["taylor"][row].sum(), torch.tensor(1.0, dtype=torch.float64))
        logits = (q[t] @ k[:t + 1].T) * D ** -0.5
        assert torch.allclose(w["softmax"][row, :t + 1], logits.softmax(-1))


def test_a_fitted_query_map_recovers_a_linear_relation_and_reads_like_the_target_key():
    """Queries that are a fixed linear map of their targets' keys: the fitted map inverts it, and the readout
    queried through it equals the capacity readout (queried by the target's key itself)."""
    m = script()
    g = torch.Generator().manual_seed(3)
    D, T = 8, 6
    mix = torch.randn(D, D, generator=g, dtype=torch.float64)
    keys = torch.randn(50, D, generator=g, dtype=torch.float64)
    keys = keys / keys.norm(dim=-1, keepdim=True)
    queries = keys @ torch.linalg.inv(mix)  # q A = k with A = mix
    fitted = m.fit_query_map([(queries[:25], keys[:25]), (queries[25:], keys[25:])], ridge=1e-12)
    assert torch.allclose(fitted, mix, atol=1e-6)
    k = torch.eye(D, dtype=torch.float64)[:T]
    q = torch.zeros(T, D, dtype=torch.float64)
    where, targets = torch.tensor([4, 5]), torch.tensor([1, 3])
    q[where] = k[targets] @ torch.linalg.inv(mix)
    w = m.readout_weights(q, k, where, targets, scale=1.0, ridge=1e-9, query_map=fitted)
    assert torch.allclose(w["fitted_query"], w["capacity"], atol=1e-5)
    assert "fitted_query" not in m.readout_weights(q, k, where, targets, scale=1.0, ridge=1e-9)


def test_hit_is_the_nearest_value_among_the_causal_ones():
    m = script()
    values = torch.eye(4, dtype=torch.float64)
    weights = torch.tensor([[0.1, 0.7, 0.2, 0.0], [0.0, 0.1, 0.0, 0.9]], dtype=torch.float64)
    queries = torch.tensor([2, 2])  # value 3 lies past both queries: it cannot be the nearest
    assert m.hits(weights, values, queries, torch.tensor([1, 1])).tolist() == [True, True]
    assert m.hits(weights, values, queries, torch.tensor([2, 2])).tolist() == [False, False]


class _Tokenizer:
    """What the copy probe reads of a tokenizer: its size, its special ids and the prefix of an encoding."""

    all_special_ids: list[int] = []

    def __len__(self) -> int:
        return 128

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [5]}


def test_the_softmax_readout_is_the_teachers_attention_and_every_row_is_written(tiny_llama_dir):
    from harness.eval.copy import layer_inputs, layer_probes
    from harness.teacher import load_teacher

    m = script()
    model = load_teacher(str(tiny_llama_dir)).model.eval()
    heads, lengths = [(1, 0), (3, 2)], [4, 8]
    result = m.measure(model, _Tokenizer(), heads, lengths, sequences=2, seed=0, ridge=1e-3, progress=False)
    assert len(result["rows"]) == len(lengths) * 2 * len(heads) * 2 * len(m.READOUTS)
    assert all(0.0 <= r["hit_rate"] <= 1.0 for r in result["rows"])
    summary = m.summarise(result["rows"])
    assert len(summary) == len(lengths) * len(heads) * 2 * len(m.READOUTS)
    assert "| 3.2 | 8 |" in m.markdown(summary, result["chance"], {
        "model": "tiny", "command": "c", "sequences": 2, "seed": 0, "ridge": 1e-3, "machine": "cpu", "seconds": 1.0})

    ids = torch.randint(10, 100, (1, 12), generator=torch.Generator().manual_seed(1))
    probe = layer_probes(model)[3].probe
    with layer_inputs(model) as store, torch.no_grad():
        model(input_ids=ids)
        x = store[3].float()
    q, k, v = m.head_qkv(probe, x, 2, rope=True)
    queries, targets = torch.tensor([7, 11]), torch.tensor([1, 3])
    w = m.readout_weights(q, k, queries, targets, scale=probe.scaling, ridge=1e-3)
    attention = probe.mixing(x, torch.arange(12)[None])[0, 2].double()  # [T, T], the module's own softmax
    assert torch.allclose(w["softmax"], attention[queries], atol=1e-5)
    q_plain, k_plain, _ = m.head_qkv(probe, x, 2, rope=False)  # no RoPE: the projections themselves
    d, group = probe.head_dim, probe.heads // probe.kv_heads
    assert torch.allclose(q_plain, probe.attn.q_proj(x)[0, :, 2 * d:3 * d].double(), atol=1e-6)
    assert torch.allclose(k_plain, probe.attn.k_proj(x)[0, :, (2 // group) * d:(2 // group + 1) * d].double(), atol=1e-6)
    assert not torch.allclose(q_plain, q)


@pytest.mark.parametrize("argv, message", [
    (["--heads", "18"], "is not LAYER.HEAD"),
    (["--heads", "1.0", "--lengths", "1"], "--lengths [1]"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys, tmp_path):
    m = script()
    with pytest.raises(SystemExit):
        m.main([*argv, "--out", str(tmp_path / "x")])
    assert message in capsys.readouterr().err
