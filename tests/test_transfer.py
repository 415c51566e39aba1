"""Transfer fidelity: the init options keep what they promise exactly, the report's measures are checked against
the teacher's own attention (zero error) and against direct computations, biases are copied."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness.mixers import MIXERS, MixerShape, mixer_class, mixer_options
from harness.mixers.base import ShortConv
from harness.student import build_student
from harness.teacher import capture_activations
from harness.transfer import (AttentionProbe, MixerProbe, measure, parse_variant, row_pearson, subjects,
                              transfer_report, write_report)
from tests.pipeline import tiny_job
from tests.tiny import tiny_llama

REPO = Path(__file__).resolve().parents[1]
SHAPE = MixerShape(hidden_size=48, num_heads=6, num_kv_heads=2, head_dim=8)
GATED = [name for name in MIXERS if "gate_init" in mixer_options(name).__dataclass_fields__]
CONV = [name for name in MIXERS if "conv_init" in mixer_options(name).__dataclass_fields__]


def mixer(name: str, seed: int = 0, **options):
    """A layer alone, without a model's position embeddings: RoPE off unless asked (fox's default is on)."""
    torch.manual_seed(seed)
    m = mixer_class(name)(SHAPE, mixer_options(name, {"backend": "reference", "chunk_size": 8, "rope": False,
                                                      **options}))
    m.reset_new_parameters()
    return m


# ------------------------------------------------------------------------------------------ the init options


@pytest.mark.parametrize("activation", ["silu", None])
def test_an_identity_initialised_conv_is_its_activation_of_the_input_exactly(activation):
    conv = ShortConv(12, 4, activation=activation)
    conv.reset_parameters("identity")
    x = torch.randn(2, 9, 12)
    y, tail = conv(x)
    if activation is None:
        assert torch.equal(y, x)  # the convolution itself is exact: 1 * x_t + 0 * the earlier tokens
    else:  # SiLU's vectorised and scalar paths may differ in the last bit
        torch.testing.assert_close(y, F.silu(x), rtol=2.5e-7, atol=0)
    later = torch.randn(2, 3, 12)
    y2, _ = conv(later, tail=tail)  # with a decoding tail carried in: still only the current token
    torch.testing.assert_close(y2, F.silu(later) if activation else later, rtol=2.5e-7, atol=0)
    conv.reset_parameters("random")
    assert not torch.equal(conv(x)[0], y)


@pytest.mark.parametrize("name", CONV)
def test_identity_conv_and_identity_activation_keep_the_copied_projections(name):
    m = mixer(name, qkv_activation="identity")
    x = torch.randn(2, 7, SHAPE.hidden_size)
    q, k, v, _ = m.project_qkv(x, None, False)
    if k.dim() == 5:  # deltaproduct: the teacher's k and v are step 1's (tests/test_deltaproduct.py: the others)
        k, v = k[:, :, 0], v[:, :, 0]
    heads = lambda t: t.unflatten(-1, (SHAPE.num_heads, SHAPE.head_dim))  # noqa: E731
    assert torch.equal(q, heads(m.q_proj(x))) and torch.equal(k, heads(m.k_proj(x))) and torch.equal(v, heads(m.v_proj(x)))
    assert torch.equal(mixer(name).project_qkv(x, None, False)[0], q)  # the default
    silu = mixer(name, qkv_activation="silu")
    torch.testing.assert_close(silu.project_qkv(x, None, False)[0], F.silu(heads(silu.q_proj(x))), rtol=2.5e-7, atol=0)
    no_conv = mixer(name, short_conv=False, qkv_activation="silu")
    assert torch.equal(no_conv.project_qkv(x, None, False)[0], F.silu(heads(no_conv.q_proj(x))))


@pytest.mark.parametrize("name", GATED)
def test_an_open_gate_passes_the_normalised_recurrence_output_through(name):
    m = mixer(name, gate_init="open")
    x = torch.randn(2, 11, SHAPE.hidden_size)
    q, k, v, _ = m.project_qkv(x, None, False)
    o, _ = m._mix(x, q, k, v, None, "reference")
    centred = name == "mlstm" or getattr(m.o_norm, "centred", False)  # a LayerNorm per head (mLSTM's, RWKV-7's)
    norm = F.layer_norm if centred else F.rms_norm
    eps = 1e-6 if name == "mlstm" else m.o_norm.eps
    expected = norm(o.float(), (SHAPE.head_dim,), eps=eps).flatten(2)
    heads, _ = m.heads_output(x)
    torch.testing.assert_close(heads, expected, rtol=1e-6, atol=1e-6)
    random = mixer(name, gate_init="random")
    assert (random.heads_output(x)[0] - expected).abs().max() > 0.1  # the authors' gate does not


@pytest.mark.parametrize("name", list(MIXERS))
def test_fit_output_scale_is_the_least_squares_scale_of_each_channel(name):
    m = mixer(name, output_scale="fit")
    x = torch.randn(3, 10, SHAPE.hidden_size)
    heads = m.heads_output(x)[0].detach()
    target = 0.3 * heads + 0.05 * heads.std() * torch.randn_like(heads)
    copied = m.o_proj.weight.detach().clone()
    scale = m.fit_output_scale(x, target)
    residual = (heads * scale - target) * heads  # least squares: each channel's residual is orthogonal to it
    assert residual.sum((0, 1)).abs().max() < 1e-4
    assert torch.allclose(scale, torch.full_like(scale, 0.3), atol=0.1)
    with torch.no_grad():  # the same network with the scale on the heads' output
        torch.testing.assert_close(m(x)[0], F.linear(heads * scale, copied), rtol=1e-5, atol=1e-5)
    none = mixer(name, output_scale="none")
    assert torch.equal(none.fit_output_scale(x, target), torch.ones(SHAPE.num_heads * SHAPE.head_dim))


def test_unknown_init_choices_are_named():
    for options, word in (({"conv_init": "zeros"}, "conv_init='zeros'"), ({"gate_init": "shut"}, "gate_init='shut'"),
                          ({"output_scale": "big"}, "output_scale='big'"),
                          ({"qkv_activation": "relu"}, "qkv_activation='relu'"), ({"rope_theta": -1.0}, "rope_theta")):
        name = "gated_deltanet"
        with pytest.raises(ValueError, match=word):
            mixer_options(name, options)


# ------------------------------------------------------------------------------------------ biases


def test_a_teacher_with_attention_biases_gives_a_student_with_them():
    from transformers import LlamaForCausalLM

    config = tiny_llama(num_layers=2, hidden=48, heads=6, kv_heads=2, vocab=61).config
    config.attention_bias = True
    torch.manual_seed(3)
    teacher = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in teacher.model.layers:
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(layer.self_attn, proj).bias.normal_(0, 0.5)
    student = build_student(teacher, "gated_deltanet")
    attn, mix = teacher.model.layers[1].self_attn, student.model.layers[1].mixer
    assert torch.equal(mix.o_proj.bias, attn.o_proj.bias) and torch.equal(mix.q_proj.bias, attn.q_proj.bias)
    assert torch.equal(mix.k_proj.bias.view(6, 8)[5], attn.k_proj.bias.view(2, 8)[5 // 3])  # GQA order
    x = torch.randn(2, 5, 48)
    with torch.no_grad():
        y = mix(x)[0]
        mix.o_proj.bias.zero_()
        torch.testing.assert_close(y - mix(x)[0], attn.o_proj.bias.expand_as(y))  # the output includes the bias
    # and the report's teacher probe reproduces the biased teacher attention
    ids = torch.randint(0, 61, (2, 12))
    acts = capture_activations(teacher, ids, kinds=("attn_input", "attn_output"))
    pos = torch.arange(12)[None].expand(2, -1)
    probe = AttentionProbe.of_teacher(teacher, 0)
    torch.testing.assert_close(probe.output(acts.attn_input[0], pos), acts.attn_output[0], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ the measures


def test_row_pearson_is_the_mean_of_direct_row_correlations():
    a, b = torch.randn(2, 3, 12, 12), torch.randn(2, 3, 12, 12)
    b[0, 0] = 2 * a[0, 0] + 1  # a perfectly correlated head
    direct = []
    for idx in torch.cartesian_prod(torch.arange(2), torch.arange(3), torch.arange(12)).tolist():
        i, h, t = idx
        if t + 1 >= 8:
            direct.append(torch.corrcoef(torch.stack([a[i, h, t, : t + 1], b[i, h, t, : t + 1]]))[0, 1])
    assert row_pearson(a, b, min_keys=8) == pytest.approx(float(torch.stack(direct).mean()), abs=1e-6)
    assert row_pearson(a[0, 0], b[0, 0]) == pytest.approx(1.0, abs=1e-9)
    assert math.isnan(row_pearson(a, torch.ones_like(a)))  # constant rows are left out: none left


@pytest.mark.parametrize("name", list(MIXERS))
def test_the_mixing_matrix_reproduces_the_recurrence(name):
    m = mixer(name, rope=name == "retnet")
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.2 * torch.randn_like(p))  # gates and decays away from their init
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=48, num_attention_heads=6, head_dim=8))
    probe = MixerProbe(m, rotary)
    x, pos = torch.randn(2, 13, SHAPE.hidden_size), torch.arange(13)[None].expand(2, -1)
    q, k, v = probe._qkv(x, pos)
    if v.dim() == 5:  # deltaproduct: A is per token, summed over its steps; here they share step 1's value
        v = v[:, :, :1].expand_as(v)
    o, _ = m._mix(x, q, k, v, None, "reference")
    a = probe.mixing(x, pos)
    v = v[:, :, 0] if v.dim() == 5 else v
    torch.testing.assert_close(torch.einsum("bhts,bshd->bthd", a, v.float()), o.float(), rtol=1e-4, atol=1e-5)
    assert torch.equal(a.triu(1), torch.zeros_like(a))  # causal


def test_the_teacher_attention_itself_scores_zero_error():
    teacher = tiny_llama(num_layers=2, hidden=48, heads=6, kv_heads=2, vocab=61, seed=1)
    ids = torch.randint(0, 61, (2, 24))
    acts = capture_activations(teacher, ids, kinds=("attn_input", "attn_output"))
    pos = torch.arange(24)[None].expand(2, -1)
    probe = AttentionProbe.of_teacher(teacher, 1)
    x = acts.attn_input[1]
    fid = measure(probe, x, pos, acts.attn_output[1], probe.scores(x, pos), probe.mixing(x, pos))
    assert fid.rel_mse < 1e-10 and fid.mse < 1e-12
    assert fid.cosine == pytest.approx(1.0, abs=1e-6) and fid.norm_ratio == pytest.approx(1.0, abs=1e-6)
    assert fid.qk_corr == pytest.approx(1.0, abs=1e-9) and fid.mix_corr == pytest.approx(1.0, abs=1e-9)


def test_variants_apply_where_the_mixer_has_the_options():
    assert parse_variant("conv_init=random, rope=true,rope_theta=10000") == {
        "conv_init": "random", "rope": True, "rope_theta": 10000}
    with pytest.raises(ValueError, match="not key=value"):
        parse_variant("conv_init")
    todo, notes = subjects(["gla", "kda"], {"conv_init": "random"}, ["gate_init=random", "qkv_activation=identity"])
    assert [(s.mixer, s.variant, s.options) for s in todo] == [
        ("gla", "default", {}), ("gla", "gate_init=random", {"gate_init": "random"}),
        ("kda", "default", {"conv_init": "random"}), ("kda", "gate_init=random", {"conv_init": "random", "gate_init": "random"}),
        ("kda", "qkv_activation=identity", {"conv_init": "random", "qkv_activation": "identity"})]
    assert any("gla: the job's option(s) conv_init" in n for n in notes)
    assert any("gla: variant 'qkv_activation=identity' left out" in n for n in notes)
    # 'authors': the old init under the options each mixer has, none left out
    todo, notes = subjects(["linear_attn", "gla", "deltanet"], {}, ["authors"])
    assert [(s.mixer, s.variant, s.options) for s in todo if s.variant == "authors"] == [
        ("linear_attn", "authors", {"output_scale": "none"}),
        ("gla", "authors", {"gate_init": "random", "output_scale": "none"}),
        ("deltanet", "authors", {"conv_init": "random", "qkv_activation": "silu", "output_scale": "none"})]
    assert not notes


# ------------------------------------------------------------------------------------------ the report


@pytest.fixture(scope="module")
def transfer_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("transfer")
    return tiny_job(root / "setting", root / "run", "data.validation_tokens=512")


def test_the_report_has_a_row_per_mixer_variant_and_layer(transfer_job, tmp_path):
    report = transfer_report(transfer_job, mixers=list(MIXERS), variants=["rope=true"], sequences=2, seq_len=32,
                             progress=False)
    layers = report["layers"]
    assert layers == [0, 1, 2, 3] and report["data"] == {"origin": "validation split", "sequences": 2, "seq_len": 32}
    assert len(report["rows"]) == 2 * len(MIXERS) * len(layers)
    assert {r["when"] for r in report["rows"]} == {"init"}  # no stage 1 has run
    for r in report["rows"]:
        assert all(math.isfinite(r[m]) for m in ("mse", "rel_mse", "cosine", "norm_ratio", "qk_corr", "mix_corr"))
        assert -1 <= r["qk_corr"] <= 1 and -1 <= r["mix_corr"] <= 1 and -1 <= r["cosine"] <= 1
    # with rope, the raw q.k of the mixers without a feature map are the teacher's logits up to their scale
    for r in report["rows"]:
        if r["variant"] == "rope=true" and r["mixer"] in ("retnet", "gla", "mlstm"):
            assert r["qk_corr"] == pytest.approx(1.0, abs=1e-6)
    summary = {(s["mixer"], s["variant"]): s for s in report["summary"]}
    assert summary["kda", "default"]["layers"] == 4
    json_path, md_path = write_report(report, tmp_path / "out", per_layer=True)
    assert json.loads(json_path.read_text())["rows"] == report["rows"]
    assert "| kda | rope=true | init |" in md_path.read_text() and "## Per layer" in md_path.read_text()


def test_the_init_rows_are_what_stage_1_starts_from_and_stage_1_rows_follow(transfer_job):
    """The report builds each layer's mixer as stage 1 does (init_mixer, then the output scale fitted on stage 1's
    first batch): on that batch, its loss is stage 1's first logged loss. After stage 1, "stage1" rows follow."""
    from harness.data import prepare_job_corpus
    from harness.losses import alignment_mse
    from harness.stages.align import align_group, first_batch, init_mixer
    from harness.stages.common import load_job_teacher
    from harness.student import FIT_KINDS, fit_output_scales, student_config

    job = transfer_job
    report = transfer_report(job, mixers=[job.student.mixer], sequences=2, seq_len=32, layers=[1, 2],
                             progress=False)
    assert {r["when"] for r in report["rows"]} == {"init"}
    gdir = align_group(job, "align_mixer", [1, 2])
    first = json.loads((gdir / "metrics.jsonl").read_text().splitlines()[0])
    after = transfer_report(job, mixers=[job.student.mixer], sequences=2, seq_len=32, layers=[1, 2], progress=False)
    rows = {(r["when"], r["layer"]): r for r in after["rows"]}
    assert set(rows) == {("init", 1), ("init", 2), ("stage1", 1), ("stage1", 2)}
    assert rows["init", 1] == next(r for r in report["rows"] if r["layer"] == 1)  # deterministic
    for layer in (1, 2):
        assert rows["stage1", layer]["mse"] != rows["init", layer]["mse"]
    teacher = load_job_teacher(job)
    ids = first_batch(job, prepare_job_corpus(job, teacher.tokenizer))
    acts = capture_activations(teacher.model, ids, layers=[1, 2], kinds=(*FIT_KINDS, "attn_output"))
    config = student_config(teacher.config, job.student.mixer, dict(job.student.options))
    mixers = {l: init_mixer(teacher.model.model.layers[l], config, l, job.seed) for l in (1, 2)}
    fit_output_scales(mixers, acts, None)
    assert first["step"] == 1
    for l in (1, 2):
        with torch.no_grad():
            loss = alignment_mse(mixers[l](acts.attn_input[l])[0], acts.attn_output[l])
        assert float(loss) == pytest.approx(first[f"loss/layer_{l:02d}"], rel=1e-5)


def test_the_cli_writes_the_report_and_names_bad_input(transfer_job, tmp_path):
    from omegaconf import OmegaConf

    job_path = tmp_path / "job.yaml"
    job_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(transfer_job)))
    run = lambda *a: subprocess.run([sys.executable, "-m", "harness.cli", "transfer", str(job_path), *a],  # noqa: E731
                                    cwd=REPO, capture_output=True, text=True, timeout=300)
    done = run("--mixer", "gla,kda", "--variant", "gate_init=random", "--layers", "0-1", "--seq-len", "16",
               "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| gla | gate_init=random | init |" in done.stdout
    assert (tmp_path / "out" / "transfer.json").is_file()
    bad = run("--mixer", "mamba")
    assert bad.returncode == 2 and "unknown mixer 'mamba'" in bad.stderr
    bad = run("--seq-len", "999")
    assert bad.returncode == 2 and "data.seq_len=32" in bad.stderr
    bad = run("--variant", "gate_init")
    assert bad.returncode == 2 and "not key=value" in bad.stderr


def test_a_student_saved_before_swish_gates_had_a_bias_loads_as_the_same_network(tmp_path):
    """RetNet, GLA and Gated DeltaNet's g_proj gained a bias (the open gate's constant). A student saved without one
    loads with the bias at 0 (transformers initialises the missing tensor so), which is the network it was."""
    from safetensors.torch import load_file, save_file

    from harness.student import HarnessForCausalLM

    teacher = tiny_llama(num_layers=2, hidden=48, heads=6, kv_heads=2, vocab=61)
    student = build_student(teacher, "gla", gate_init="random", chunk_size=8)
    with torch.no_grad():
        for layer in student.model.layers:
            layer.mixer.g_proj.bias.zero_()  # what the older layer computed: no bias
    student.save_pretrained(tmp_path)
    weights = {k: v for k, v in load_file(tmp_path / "model.safetensors").items() if not k.endswith("g_proj.bias")}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = HarnessForCausalLM.from_pretrained(tmp_path)
    ids = torch.randint(0, 61, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, student(ids).logits)
    assert all(torch.equal(layer.mixer.g_proj.bias, torch.zeros(48)) for layer in loaded.model.layers)


def test_build_student_fits_the_output_scales_on_given_tokens():
    teacher = tiny_llama(num_layers=2, hidden=48, heads=6, kv_heads=2, vocab=61, seed=2)
    ids = torch.randint(0, 61, (2, 16))
    student = build_student(teacher, "kda", fit_on=ids, chunk_size=8)
    acts = capture_activations(teacher, ids, kinds=("attn_input", "attn_heads"))
    for l, layer in enumerate(student.model.layers):
        scale = layer.mixer.o_proj.weight[0] / teacher.model.layers[l].self_attn.o_proj.weight[0]
        with torch.no_grad():
            h = layer.mixer.heads_output(acts.attn_input[l])[0]
        residual = ((h * scale - acts.attn_heads[l]) * h).sum((0, 1))  # least squares per channel
        assert residual.abs().max() < 1e-4 * (h * h).sum((0, 1)).max()
    plain = build_student(teacher, "kda", chunk_size=8)
    assert torch.equal(plain.model.layers[0].mixer.o_proj.weight, teacher.model.layers[0].self_attn.o_proj.weight)
