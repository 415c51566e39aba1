"""Teachers beyond Llama (issue 28): tiny random Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm before RoPE, a
head_dim that is not hidden / heads), Mistral (Llama's layout, a sliding window in the teacher), each with grouped KV
heads and an odd head count where the family allows it. Transfer copies what it should bit for bit, a student whose
mixers are swapped back for the teacher's attention is the teacher, and save/load and cached generation hold for
every mixer on every family."""

from __future__ import annotations

import copy

import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import harness  # noqa: F401  (registers the student classes)
from harness.mixers import MIXERS
from harness.probes import AttentionProbe
from harness.student import build_student
from harness.teacher import (
    AttentionLayout,
    TeacherLoadError,
    capture_activations,
    check_teacher_architecture,
    load_teacher,
)
from tests.tiny import TINY_FAMILIES, tiny_mistral, tiny_qwen2, tiny_qwen3

FAMILIES = ("qwen2", "qwen3", "mistral")
LAYOUTS = {
    "llama": AttentionLayout(),
    "qwen2": AttentionLayout(qkv_bias=True),
    "qwen3": AttentionLayout(qk_norm=True),
    "mistral": AttentionLayout(),
}


@pytest.fixture(scope="module")
def teachers():
    return {name: TINY_FAMILIES[name]() for name in (*FAMILIES, "llama")}


def ids(seed: int = 0, length: int = 8, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ architecture check


@pytest.mark.parametrize("family", [*FAMILIES, "llama"])
def test_each_family_loads_from_a_folder_with_its_layout(tmp_path, teachers, family):
    teachers[family].save_pretrained(tmp_path)
    teacher = load_teacher(str(tmp_path))
    assert teacher.config.model_type == family
    assert check_teacher_architecture(teacher.model) == LAYOUTS[family]


def test_a_qwen3_teacher_with_attention_bias_biases_all_four_projections():
    model = tiny_qwen3(attention_bias=True)
    assert check_teacher_architecture(model) == AttentionLayout(qkv_bias=True, o_bias=True, qk_norm=True)


def test_a_layer_with_a_part_the_student_would_drop_is_refused_by_name():
    model = tiny_qwen2()
    model.model.layers[1].post_feedforward_layernorm = nn.LayerNorm(60)  # as Gemma2's layers have
    with pytest.raises(TeacherLoadError, match=r"layer 1 also has post_feedforward_layernorm"):
        check_teacher_architecture(model, "gemma-like")


def test_a_missing_projection_or_half_a_qk_norm_is_refused_by_name():
    model = tiny_mistral()
    del model.model.layers[0].self_attn.k_proj
    with pytest.raises(TeacherLoadError, match=r"layer 0 lacks self_attn.k_proj"):
        check_teacher_architecture(model)
    model = tiny_qwen3()
    del model.model.layers[0].self_attn.k_norm
    with pytest.raises(TeacherLoadError, match=r"only one of self_attn.q_norm and self_attn.k_norm"):
        check_teacher_architecture(model)


def test_attention_that_differs_from_what_its_config_says_is_refused():
    model = tiny_qwen2()
    model.model.layers[0].self_attn.q_proj.bias = None  # config says Qwen2: q/k/v biased
    with pytest.raises(TeacherLoadError, match=r"layer 0 attention .* where its config says"):
        check_teacher_architecture(model)


# ------------------------------------------------------------------------------------------ transfer


@pytest.mark.parametrize("mixer", list(MIXERS))
@pytest.mark.parametrize("family", FAMILIES)
def test_transfer_copies_biases_and_qk_norms_bit_for_bit(teachers, family, mixer):
    teacher = teachers[family]
    student = build_student(teacher, mixer)
    cfg = teacher.config
    n_rep = cfg.num_attention_heads // cfg.num_key_value_heads
    for t_layer, s_layer in zip(teacher.model.layers, student.model.layers):
        attn, mix = t_layer.self_attn, s_layer.mixer
        assert torch.equal(mix.q_proj.weight, attn.q_proj.weight)
        assert torch.equal(mix.o_proj.weight, attn.o_proj.weight)
        for name in ("k_proj", "v_proj"):
            expanded = getattr(attn, name).weight.unflatten(0, (cfg.num_key_value_heads, -1))
            expanded = expanded.repeat_interleave(n_rep, 0).flatten(0, 1)
            assert torch.equal(getattr(mix, name).weight, expanded)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            src, dst = getattr(attn, name).bias, getattr(mix, name).bias
            assert (src is None) == (dst is None), f"{name} bias kept {dst is not None}, teacher has {src is not None}"
        if attn.q_proj.bias is not None:
            assert torch.equal(mix.q_proj.bias, attn.q_proj.bias)
            assert torch.equal(mix.k_proj.bias, attn.k_proj.bias.unflatten(0, (cfg.num_key_value_heads, -1))
                               .repeat_interleave(n_rep, 0).flatten())
        if family == "qwen3":
            assert torch.equal(mix.q_norm.weight, attn.q_norm.weight)
            assert torch.equal(mix.k_norm.weight, attn.k_norm.weight)
        else:
            assert not hasattr(mix, "q_norm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_mixers_q_and_k_are_the_teachers_before_rope(teachers, family, dtype):
    """What every mixer's q/k path starts from (before its conv, feature map, RoPE): the teacher's q_norm(q_proj(x))
    and k_norm(k_proj(x)), with K expanded over the query heads; in bfloat16 bit for bit (the q/k norms round as
    the teacher's do)."""
    teacher = copy.deepcopy(teachers[family]).to(dtype)
    student = build_student(teacher, "gla").to(dtype)
    x = torch.randn(2, 7, teacher.config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    attn, mix = teacher.model.layers[0].self_attn, student.model.layers[0].mixer
    d = teacher.config.head_dim
    q_t, k_t = attn.q_proj(x).unflatten(-1, (-1, d)), attn.k_proj(x).unflatten(-1, (-1, d))
    if hasattr(attn, "q_norm"):
        q_t, k_t = attn.q_norm(q_t), attn.k_norm(k_t)
    n_rep = teacher.config.num_attention_heads // teacher.config.num_key_value_heads
    q_s, k_s = mix.project_qk(x)
    tol = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(q_s, q_t.flatten(2), rtol=tol, atol=tol)
    torch.testing.assert_close(k_s, k_t.repeat_interleave(n_rep, 2).flatten(2), rtol=tol, atol=tol)


def test_a_qwen3_students_logits_follow_the_teachers_qk_norms():
    """The defect the issue reported: a Qwen3 student ignored the teacher's q_norm/k_norm weights."""
    teacher = tiny_qwen3()
    before = build_student(teacher, "gated_deltanet")(ids()).logits
    with torch.no_grad():
        for layer in teacher.model.layers:
            layer.self_attn.q_norm.weight.mul_(3.0)
    after = build_student(teacher, "gated_deltanet")(ids()).logits
    assert not torch.allclose(before, after, atol=1e-4)


class TeacherAttention(nn.Module):
    """The teacher's attention module behind a mixer's interface (what StudentBlock calls), with its own RoPE."""

    def __init__(self, attn: nn.Module, rotary: nn.Module):
        super().__init__()
        self.attn, self.rotary = attn, rotary

    def forward(self, x, position_embeddings=None, state=None, use_cache=False, mask=None):
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        y, _ = self.attn(x, position_embeddings=self.rotary(x, positions), attention_mask=None)
        return y, None

    def fused_ops(self, x):
        return False


@pytest.mark.parametrize("family", [*FAMILIES, "llama"])
def test_a_student_with_the_teachers_attention_swapped_back_is_the_teacher(teachers, family):
    """Embeddings, norms, MLPs and head are the teacher's, in the teacher's order: only the mixers differ. 8 tokens,
    the Mistral teacher's sliding window, so that causal attention without a mask is the teacher's."""
    teacher = teachers[family]
    student = build_student(teacher, "retnet")
    for t_layer, s_layer in zip(teacher.model.layers, student.model.layers):
        s_layer.mixer = TeacherAttention(t_layer.self_attn, teacher.model.rotary_emb)
    tokens = ids(length=8)
    with torch.no_grad():
        torch.testing.assert_close(student(tokens).logits, teacher(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_fidelity_probe_reproduces_the_teachers_attention_output(teachers, family):
    """`harness transfer`'s reference for each family: its softmax attention recomputed from the module (q/k norms,
    biases, grouped KV heads) equals the teacher's own o_proj output."""
    teacher = teachers[family]
    tokens = ids(length=8)
    acts = capture_activations(teacher, tokens, kinds=("attn_input", "attn_output"))
    positions = torch.arange(8)[None].expand(2, -1)
    for layer in range(teacher.config.num_hidden_layers):
        probe = AttentionProbe.of_teacher(teacher, layer)
        with torch.no_grad():
            out = probe.output(acts.attn_input[layer], positions)
        torch.testing.assert_close(out, acts.attn_output[layer], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ save, load, generate


@pytest.mark.parametrize("mixer", list(MIXERS))
@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_and_cached_generate_on_every_family(tmp_path, teachers, family, mixer):
    torch.manual_seed(0)
    student = build_student(teachers[family], mixer, chunk_size=4).eval()
    student.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert {k: saved[k] for k in ("qkv_bias", "o_bias", "qk_norm")} == {
        "qkv_bias": family == "qwen2", "o_bias": False, "qk_norm": family == "qwen3"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = ids(seed=3, length=6, batch=1)
    with torch.no_grad():
        torch.testing.assert_close(loaded(prompt).logits, student(prompt).logits, rtol=0, atol=0)
        loaded.generation_config.eos_token_id = None  # all 5 tokens, also where one of them is the eos id
        out = loaded.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        tokens = prompt
        for _ in range(5):  # greedy by full forwards, no cache
            tokens = torch.cat([tokens, loaded(tokens).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, tokens)


def test_a_student_saved_before_the_layout_fields_reads_attention_bias_as_before(tmp_path):
    """Old students have only Llama's `attention_bias` (all four projections biased or none)."""
    from tests.tiny import tiny_llama

    teacher = tiny_llama()
    teacher.config.attention_bias = True
    student = build_student(tiny_llama(), "deltanet")
    config = student.config.to_dict()
    for key in ("qkv_bias", "o_bias", "qk_norm"):
        config.pop(key)
    config["attention_bias"] = True
    (tmp_path / "config.json").write_text(json.dumps(config))
    from harness.student import HarnessConfig, HarnessForCausalLM

    old = HarnessForCausalLM(HarnessConfig.from_pretrained(tmp_path))
    mixer = old.model.layers[0].mixer
    assert mixer.q_proj.bias is not None and mixer.o_proj.bias is not None and not hasattr(mixer, "q_norm")


# The pipeline on a Qwen3 teacher (stage-1/2 capture, merge, stage 3, reload): tests/test_hybrid.py's run.
