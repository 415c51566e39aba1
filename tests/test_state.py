"""State saturation (`harness eval state`, harness/eval/state.py): the state read along the context against a hand
computation, the cache-continuation reading path against one prefill, the effective rank's fixed points, the
retrieval prompts' exact distances, and the command end to end on a tiny student and its teacher."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from harness.cli import main as harness_main
from harness.config import ConfigError
from harness.eval import state as state_mod
from harness.eval.state import StateConfig, distance_sample, effective_rank, measure_states, state_text, states_at
from harness.mixers import MIXERS
from harness.student import RecurrentCache, build_student
from tests.pipeline import make_setting


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory):
    """(teacher dir, the tiny teacher, its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher_dir, _ = make_setting(tmp_path_factory.mktemp("state"))
    return teacher_dir, AutoModelForCausalLM.from_pretrained(teacher_dir), AutoTokenizer.from_pretrained(teacher_dir)


def student_of(teacher, mixer: str, **options):
    torch.manual_seed(0)
    return build_student(teacher, mixer, chunk_size=16, backend="reference", **options).eval()


# ---------------------------------------------------------------------------------------------- measures


def test_effective_rank_of_rank_one_identity_and_zero():
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, generator=generator, dtype=torch.float64) for n in (16, 12))
    ranks = effective_rank(torch.stack([torch.outer(a, b), torch.eye(16, dtype=torch.float64)[:, :12] * 3.0,
                                          torch.zeros(16, 12, dtype=torch.float64)]))
    assert ranks[0].item() == pytest.approx(1.0, abs=1e-6)
    assert ranks[1].item() == pytest.approx(12.0, abs=1e-9)  # equal singular values: min(K, V)
    assert ranks[2].item() == 0.0
    two = torch.diag(torch.tensor([3.0, 1.0, 0.0]))  # p = (3/4, 1/4): exp(H) by hand
    assert effective_rank(two).item() == pytest.approx(np.exp(-(0.75 * np.log(0.75) + 0.25 * np.log(0.25))))


def test_every_built_in_mixer_says_what_its_state_is():
    """state.json's "what" comes from STATE_OF; a built-in mixer without an entry would fall back to a vague phrase,
    and an entry for no built-in mixer is stale."""
    assert set(state_mod.STATE_OF) == set(MIXERS.builtins)


def hand_linear_attn_states(student, ids: torch.Tensor, p: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per layer, (S_p [H, K, V], z_p [H, K]) from the layer's own projections: the mixer's input x captured in a plain
    forward, k = phi(k_proj x), v = v_proj x per head, S_p = sum_{t<p} k_t v_t^T and z_p = sum_{t<p} k_t, in float64."""
    inputs = {}
    hooks = [layer.mixer.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
             for i, layer in enumerate(student.model.layers)]
    with torch.no_grad():
        student(ids)
    for hook in hooks:
        hook.remove()
    out = {}
    for i, layer in enumerate(student.model.layers):
        mixer = layer.mixer
        heads, dim = mixer.shape.num_heads, mixer.shape.head_dim
        with torch.no_grad():
            x = inputs[i][0, :p].double()
            k = F.elu(x @ mixer.k_proj.weight.double().T).reshape(p, heads, dim) + 1.0
            v = (x @ mixer.v_proj.weight.double().T).reshape(p, heads, dim)
        out[i] = (torch.einsum("thk,thv->hkv", k, v).numpy(), k.sum(0).numpy())
    return out


def hand_rank(matrix: np.ndarray) -> float:
    sigma = np.linalg.svd(matrix, compute_uv=False)
    p = sigma / sigma.sum()
    p = p[p > 0]
    return float(np.exp(-(p * np.log(p)).sum()))


def test_linear_attn_state_norm_and_rank_equal_a_hand_computation(setting):
    _, teacher, tok = setting
    student = student_of(teacher, "linear_attn")
    assert student.model.layers[0].mixer.options.feature_map == "elu"
    cfg = StateConfig(length=96, positions=[1, 7, 40, 96], sequences=1, retrieval=False)
    ids = state_text(tok, cfg)
    result = measure_states(student, tok, cfg, "cpu", progress=False)
    assert result["positions"] == [1, 7, 40, 96] and result["mixer"] == "linear_attn"
    for n, (p, cache) in enumerate(states_at(student, ids, cfg.read_positions())):
        hand = hand_linear_attn_states(student, ids, p)
        for i, layer in enumerate(result["layers"]):
            S, z = cache.states[i].recurrent
            np.testing.assert_allclose(S[0].double().numpy(), hand[i][0], rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(z[0].double().numpy(), hand[i][1], rtol=1e-5, atol=1e-5)
            norms = [float(np.linalg.norm(h)) for h in hand[i][0]]
            ranks = [hand_rank(h) for h in hand[i][0]]
            got_norms = [row[n] for row in layer["norm_per_head"]]
            got_ranks = [row[n] for row in layer["rank_per_head"]]
            assert got_norms == pytest.approx(norms, rel=1e-4)
            assert got_ranks == pytest.approx(ranks, rel=1e-4, abs=1e-4)
            assert layer["norm_mean"][n] == pytest.approx(np.mean(norms), rel=1e-4)
            assert layer["norm_max"][n] == pytest.approx(max(norms), rel=1e-4)
            assert layer["rank_mean"][n] == pytest.approx(np.mean(ranks), rel=1e-4)
            assert [row[n] for row in layer["normaliser_norm_per_head"]] == pytest.approx(
                [float(np.linalg.norm(h)) for h in hand[i][1]], rel=1e-4)
    assert result["layers"][0]["rank_per_head"][0][0] == pytest.approx(1.0)  # one write: rank 1


def test_mlstm_state_is_reported_de_stabilised(setting):
    """The mLSTM's reported norm is that of the true sum of gated writes, C_p = sum_t exp(i_t + sum_{t<s<=p}
    logsigmoid(f_s)) k_t v_t^T (computed here from the layer's projections and gates), not of the stored
    C_p exp(-m_p)."""
    _, teacher, tok = setting
    student = student_of(teacher, "mlstm")
    with torch.no_grad():  # data-dependent gates, so that every token's weight differs
        for layer in student.model.layers:
            layer.mixer.igate.weight.normal_(0, 0.5)
            layer.mixer.fgate.weight.normal_(0, 0.5)
    cfg = StateConfig(length=40, positions=[40], sequences=1, retrieval=False)
    ids = state_text(tok, cfg)
    result = measure_states(student, tok, cfg, "cpu", progress=False)
    inputs = {}
    mixer = student.model.layers[2].mixer
    hook = mixer.register_forward_pre_hook(lambda m, args: inputs.__setitem__("x", args[0]))
    with torch.no_grad():
        student(ids)
        hook.remove()
        x = inputs["x"][0].double()
        heads, dim = mixer.shape.num_heads, mixer.shape.head_dim
        k = (x @ mixer.k_proj.weight.double().T).reshape(40, heads, dim)
        v = (x @ mixer.v_proj.weight.double().T).reshape(40, heads, dim)
        cap = mixer.options.gate_soft_cap
        i = cap * torch.tanh((x @ mixer.igate.weight.double().T + mixer.igate.bias.double()) / cap)  # [T, H]
        logf = F.logsigmoid(cap * torch.tanh((x @ mixer.fgate.weight.double().T + mixer.fgate.bias.double()) / cap))
        after = logf.flip(0).cumsum(0).flip(0) - logf  # sum_{t<s<=T} logf_s
        C = torch.einsum("th,thk,thv->hkv", (i + after).exp(), k, v)
    norms = [row[0] for row in result["layers"][2]["norm_per_head"]]
    assert norms == pytest.approx(torch.linalg.matrix_norm(C).tolist(), rel=1e-4)
    stored = [row[0] for row in result["layers"][2]["stored_norm_per_head"]]
    m = [row[0] for row in result["layers"][2]["stabiliser_per_head"]]
    assert stored == pytest.approx([n * np.exp(-mh) for n, mh in zip(norms, m)], rel=1e-4)
    assert min(abs(a - b) / b for a, b in zip(stored, norms)) > 0.01  # the two differ here


# ---------------------------------------------------------------------------------------------- reading path


def snapshot(cache: RecurrentCache) -> list[list[torch.Tensor]]:
    return [[t.clone() for t in s.tensors()] for s in cache.states]


@pytest.mark.parametrize("mixer", list(MIXERS))
def test_reading_positions_by_continuation_equals_one_prefill(setting, mixer):
    _, teacher, tok = setting
    student = student_of(teacher, mixer)
    ids = state_text(tok, StateConfig(length=80, sequences=2, retrieval=False))
    positions = [1, 2, 9, 33, 80]
    read = {p: snapshot(cache) for p, cache in states_at(student, ids, positions)}
    for p in positions:
        cache = RecurrentCache(student.config.num_hidden_layers)
        with torch.no_grad():
            student(ids[:, :p], cache=cache, use_cache=True)
        for layer, (got, want) in enumerate(zip(read[p], snapshot(cache))):
            assert len(got) == len(want)
            for g, w in zip(got, want):  # float32 sums in another order: errors relative to the state's scale
                if not w.is_floating_point():  # a KV cache's real slots (fox)
                    assert torch.equal(g, w), f"{mixer} p={p} layer {layer}"
                    continue
                scale = max(1.0, w.abs().max().item())
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * scale,
                                           msg=lambda m: f"{mixer} p={p} layer {layer}: {m}")


def test_a_hybrids_kept_layers_are_named_and_not_measured(setting):
    _, teacher, tok = setting
    student = student_of(teacher, "gated_deltanet", attention_layers=[1])
    cfg = StateConfig(length=32, positions=[4, 32], sequences=1, retrieval=False)
    layers = measure_states(student, tok, cfg, "cpu", progress=False)["layers"]
    assert [layer["kind"] for layer in layers] == ["mixer", "attention", "mixer", "mixer"]
    assert "norm_mean" not in layers[1] and "softmax" in layers[1]["note"]
    assert all(len(layer["rank_mean"]) == 2 for layer in layers if layer["kind"] == "mixer")


def test_gated_state_saturates_and_linear_attention_grows(setting):
    """What the curve is for: on the same text, linear attention's state norm grows about linearly with position
    (its elu+1 keys are all positive), a gated delta rule's levels off."""
    _, teacher, tok = setting
    cfg = StateConfig(length=256, positions=[64, 128, 256], sequences=2, retrieval=False)
    linear = measure_states(student_of(teacher, "linear_attn"), tok, cfg, "cpu", progress=False)
    gated = measure_states(student_of(teacher, "gated_deltanet"), tok, cfg, "cpu", progress=False)
    assert linear["over_layers"]["norm_growth"] > 0.7
    assert abs(gated["over_layers"]["norm_growth"]) < 0.2


# ---------------------------------------------------------------------------------------------- retrieval prompts


def test_retrieval_prompts_put_exactly_d_tokens_between_needle_and_question(setting):
    _, _, tok = setting
    cfg = StateConfig(length=400, distances=[1, 50, 150], kinds=["passkey", "kv"], samples=2)
    for kind in ("passkey", "kv"):
        needles = set()
        for d in cfg.distances:
            sample = distance_sample(tok, cfg, kind, d, 1)
            needle_ids = tok(sample.needle.text, add_special_tokens=False)["input_ids"]
            ids = sample.input_ids
            assert len(ids) == 400
            assert ids[sample.needle_offset:sample.needle_offset + len(needle_ids)] == needle_ids
            question = tok.decode(ids[sample.haystack_end:])
            assert question.startswith("\n\nQuestion: ") and question.endswith(sample.needle.answer_prefix)
            assert sample.haystack_end - (sample.needle_offset + len(needle_ids)) == d
            needles.add((sample.value, sample.distractors))
        assert len(needles) == 1  # sample 1 keeps its needle and distractors at every distance
    with pytest.raises(ConfigError, match="the largest distance is"):
        distance_sample(tok, cfg, "passkey", 390, 0)


def test_bad_settings_are_one_paragraph_errors():
    with pytest.raises(ConfigError, match=r"positions \[600\] lie beyond state.length=512"):
        StateConfig(length=512, positions=[600])
    with pytest.raises(ConfigError, match="state.distances"):
        StateConfig(distances=[0])
    with pytest.raises(ConfigError, match="state.kinds"):
        StateConfig(kinds=["needle"])
    with pytest.raises(ConfigError, match="haystack"):
        StateConfig(text="/nowhere/prose.txt")


# ---------------------------------------------------------------------------------------------- the command


ARGS = ["--length", "320", "--positions", "1,8,64,320", "--sequences", "1", "--distances", "16,100", "--kinds",
        "passkey", "--samples", "1", "--max-new-tokens", "4", "--device", "cpu"]


def test_command_on_a_student_writes_both_curves_and_resumes(setting, tmp_path, monkeypatch, capsys):
    teacher_dir, teacher, tok = setting
    folder = tmp_path / "student"
    student_of(teacher, "linear_attn").save_pretrained(folder)
    tok.save_pretrained(folder)
    out = tmp_path / "out"
    assert harness_main(["eval", "state", str(folder), *ARGS, "--out", str(out)]) == 0
    assert "Effective rank" in capsys.readouterr().out
    result = json.loads((out / "state.json").read_text())
    state = result["state"]
    assert result["model"]["kind"] == "student" and state["mixer"] == "linear_attn"
    assert state["positions"] == [1, 8, 64, 320] and len(state["layers"]) == 4
    assert all(len(layer["norm_mean"]) == 4 and layer["norm_growth"] is not None for layer in state["layers"])
    retrieval = result["retrieval"]
    assert [p["distance"] for p in retrieval["by_distance"]] == [16, 100]
    assert all(0 <= p["exact_ci"][0] <= p["exact"] <= p["exact_ci"][1] <= 1 for p in retrieval["by_distance"])
    lines = (out / "state_retrieval.jsonl").read_text().splitlines()
    assert "header" in json.loads(lines[0]) and len(lines) == 3
    assert sorted(json.loads(line)["distance"] for line in lines[1:]) == [16, 100]
    assert (out / "state.md").is_file() and (out / "state_curves.png").is_file()

    def no_generation(*args, **kwargs):
        raise AssertionError("a resumed run generated again")

    monkeypatch.setattr(state_mod, "generate_answers", no_generation)
    assert harness_main(["eval", "state", str(folder), *ARGS, "--out", str(out)]) == 0
    assert json.loads((out / "state.json").read_text())["retrieval"] == retrieval
    assert harness_main(["eval", "state", str(folder), *ARGS, "--max-new-tokens", "5", "--out", str(out)]) == 2
    assert "max_new_tokens" in capsys.readouterr().err


def test_command_on_a_teacher_gives_only_the_retrieval_curve(setting, tmp_path):
    teacher_dir, _, _ = setting
    out = tmp_path / "teacher"
    assert harness_main(["eval", "state", str(teacher_dir), *ARGS, "--out", str(out)]) == 0
    result = json.loads((out / "state.json").read_text())
    assert result["state"] is None and result["model"]["kind"] == "teacher"
    assert [p["samples"] for p in result["retrieval"]["by_distance"]] == [1, 1]


def test_command_refuses_a_distance_that_does_not_fit(setting, tmp_path, capsys):
    teacher_dir, _, _ = setting
    args = [a if a != "16,100" else "16,300" for a in ARGS]
    assert harness_main(["eval", "state", str(teacher_dir), *args, "--out", str(tmp_path / "x")]) == 2
    assert "the largest distance is" in capsys.readouterr().err


GROWING = sorted(name for name, cls in MIXERS.items() if cls.growing_state)


def test_the_mixers_whose_state_grows_are_the_kv_cache_ones():
    assert GROWING == ["fox", "path"]


@pytest.mark.parametrize("name", GROWING)
def test_a_growing_cache_decodes_eagerly_and_has_no_state_measures(name):
    """A mixer decoding from a KV cache (fox, path): no CUDA graph captures its steps (their shapes grow), and the
    state probe lists its layers with a note instead of norms and ranks it cannot read."""
    from harness.decoding import graph_blocker
    from tests.pipeline import tiny_tokenizer
    from tests.tiny import tiny_llama

    tok = tiny_tokenizer()
    student = build_student(tiny_llama(vocab=len(tok)), name).eval()
    assert "grows" in graph_blocker(student)
    cfg = StateConfig(length=32, positions=[4, 32], sequences=1, retrieval=False)
    layers = measure_states(student, tok, cfg, "cpu", progress=False)["layers"]
    assert [layer["kind"] for layer in layers] == ["attention", "attention"]
    assert all(name in layer["note"] and "norm_mean" not in layer for layer in layers)
