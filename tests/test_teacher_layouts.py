"""Teachers whose network differs from Llama's beyond the attention projections (issue 52): Gemma (norms scaling by
1 + weight, embeddings times sqrt(hidden), GELU MLP), Gemma 2 (norms after the attention and around the MLP, sliding
windows on alternate layers, attention scale query_pre_attn_scalar ** -0.5, tanh soft-capping of attention scores and
logits), Gemma 3 text (per-head q/k norms, local RoPE base on its sliding layers, global RoPE scaled) and SmolLM3
(layers without RoPE). Each is checked against the real transformers model on tiny random weights: a student that keeps
every layer as attention is its teacher, a student whose teacher's v_proj is zeroed is its teacher (every part but the
mixers), each carried feature matters (dropping it moves the logits), mixers read each layer's RoPE, kept layers decode
and pad as full forwards do. Config fields the student would not carry are refused by name."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import harness
from harness.attention import KVState
from harness.layouts import LayerRope
from harness.mixers.contract import padded, real
from harness.probes import AttentionProbe, MixerProbe
from harness.student import HarnessForCausalLM, copy_teacher_weights, rope_for, student_config
from harness.teacher import (
    AttentionLayout,
    TeacherLoadError,
    capture_activations,
    check_teacher_architecture,
    check_teacher_config,
    load_teacher,
)
from tests.tiny import TINY_FAMILIES, tiny_gemma2, tiny_gemma3, tiny_llama, tiny_smollm3

NEW = ("gemma", "gemma2", "gemma3_text", "smollm3")
ATOL = 1e-5
GEN = GenerationConfig(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)


@pytest.fixture(scope="module")
def teachers():
    return {name: TINY_FAMILIES[name](num_layers=3).float() for name in NEW}


def tokens(seed: int = 0, length: int = 24, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 97, (batch, length), generator=torch.Generator().manual_seed(seed))


def kept_all(teacher, mixer: str = "gla", **options):
    torch.manual_seed(1)
    n = teacher.config.num_hidden_layers
    model = harness.build_student(teacher, mixer, attention_layers=list(range(n)), chunk_size=8, backend="reference",
                                  **options).eval()
    model.generation_config.eos_token_id = None
    return model


def logit_gap(a, b) -> float:
    return float((a - b).abs().max())


# ------------------------------------------------------------------------------------------ loading


@pytest.mark.parametrize("family,layout,attention", [
    ("gemma", AttentionLayout(), "sdpa"),
    ("gemma2", AttentionLayout(), "eager"),  # transformers' Gemma 2 has no sdpa path (it cannot soft-cap)
    ("gemma3_text", AttentionLayout(qk_norm=True), "sdpa"),
    ("smollm3", AttentionLayout(), "sdpa"),
])
def test_each_family_loads_from_a_folder_and_computes_as_the_model_in_memory(tmp_path, teachers, family, layout,
                                                                              attention):
    teachers[family].save_pretrained(tmp_path)
    teacher = load_teacher(str(tmp_path))
    assert teacher.config.model_type == family and teacher.config._attn_implementation == attention
    assert check_teacher_architecture(teacher.model) == layout
    ids = tokens()
    with torch.no_grad():
        torch.testing.assert_close(teacher.model(ids).logits, teachers[family](ids).logits, atol=ATOL, rtol=0)


def test_the_students_config_carries_each_familys_layout(teachers):
    expect = {
        "gemma": dict(norm_style="gemma", sandwich_norms=None, embed_scale=8.0, hidden_act="gelu_pytorch_tanh",
                      query_pre_attn_scalar=None, attn_logit_softcapping=None, final_logit_softcapping=None),
        "gemma2": dict(norm_style="gemma", sandwich_norms=True, embed_scale=8.0, hidden_act="gelu_pytorch_tanh",
                       query_pre_attn_scalar=12.0, attn_logit_softcapping=2.0, final_logit_softcapping=0.5,
                       attention_windows=[8, None, 8]),
        "gemma3_text": dict(norm_style="gemma", sandwich_norms=True, qk_norm=True, query_pre_attn_scalar=12.0,
                            attn_logit_softcapping=None, final_logit_softcapping=0.5, local_rope_layers=[0, 2],
                            local_rope_parameters={"rope_type": "default", "rope_theta": 10.0}),
        "smollm3": dict(norm_style=None, no_rope_layers=[1, 0, 1], local_rope_layers=None, embed_scale=None),
    }
    for family, fields in expect.items():
        config = student_config(teachers[family].config, "gla", {}, [0, 1, 2])
        assert {k: getattr(config, k) for k in fields} == fields, family
    gemma3 = student_config(teachers["gemma3_text"].config, "gla", {})
    assert gemma3.rope_parameters["rope_type"] == "linear" and gemma3.rope_parameters["factor"] == 2.0


@pytest.mark.parametrize("family", NEW)
def test_a_saved_student_reloads_with_its_layout(tmp_path, teachers, family):
    """The layout fields survive save/load: a hybrid (layers 0 and 2 kept) with a rope mixer reloads to the same
    logits bit for bit."""
    student = harness.build_student(teachers[family], "gated_deltanet", attention_layers=[0, 2], rope=True,
                                    chunk_size=8, backend="reference").eval()
    student.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = tokens(length=12)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, student(ids).logits)


# ------------------------------------------------------------------------------------------ the student is the teacher


@pytest.mark.parametrize("family", NEW)
def test_a_student_keeping_every_layer_is_the_teacher(teachers, family):
    """24 tokens: past the sliding window (8) of Gemma 2/3's sliding layers."""
    teacher = teachers[family]
    ids = tokens()
    with torch.no_grad():
        assert logit_gap(kept_all(teacher)(ids).logits, teacher(ids).logits) <= ATOL


def test_the_smollm3_reproduction_a_layer_without_rope_gets_none():
    """The issue's case: no_rope_layers=[1, 0]; before, the kept second layer was rotated (logits off by 4.9e-3)."""
    teacher = tiny_smollm3(num_layers=2, no_rope_layers=[1, 0]).float()
    ids = tokens()
    with torch.no_grad():
        assert logit_gap(kept_all(teacher)(ids).logits, teacher(ids).logits) <= ATOL


@pytest.mark.parametrize("mixer", ["gated_deltanet", "mlstm"])
@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_with_the_teachers_v_proj_zeroed_the_student_is_the_teacher(family, mixer):
    """v = 0 makes every attention output o_proj's bias alone, and every mixer's too (its heads' output is 0): what is
    left is all the rest of the network (embedding and its scale, every norm in its place, the MLP and its activation,
    the head and its soft-capping), which must be the teacher's. A rope mixer, so that per-layer RoPE runs too."""
    teacher = copy.deepcopy(TINY_FAMILIES[family](num_layers=3)).float()
    with torch.no_grad():
        for layer in teacher.model.layers:
            layer.self_attn.v_proj.weight.zero_()
            if layer.self_attn.v_proj.bias is not None:
                layer.self_attn.v_proj.bias.zero_()
    torch.manual_seed(0)
    student = harness.build_student(teacher, mixer, rope=True, backend="reference").eval()
    ids = tokens()
    with torch.no_grad():
        assert logit_gap(student(ids).logits, teacher(ids).logits) <= ATOL


@pytest.mark.parametrize("family,dropped", [
    ("gemma", {"embed_scale": None}),
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": None}),
    ("gemma2", {"attention_windows": None}),
    ("gemma3_text", {"local_rope_layers": None}),
    ("gemma3_text", {"final_logit_softcapping": None}),
    ("smollm3", {"no_rope_layers": None}),
    ("gemma2", {"norm_style": None}),
    ("gemma2", {"sandwich_norms": None}),
])
def test_each_carried_feature_moves_the_logits_when_dropped(teachers, family, dropped):
    """The all-kept comparison above can fail: the same student built without one carried field is not its teacher."""
    teacher = teachers[family]
    config = student_config(teacher.config, "gla", {"chunk_size": 8, "backend": "reference"}, [0, 1, 2])
    for key, value in dropped.items():
        setattr(config, key, value)
    student = HarnessForCausalLM(config).float().eval()
    if "sandwich_norms" in dropped:  # the teacher has norms this student lacks: copy the rest
        assert not hasattr(student.model.layers[0], "pre_feedforward_layernorm")
        student.model.embed_tokens.load_state_dict(teacher.model.embed_tokens.state_dict())
        student.model.norm.load_state_dict(teacher.model.norm.state_dict())
        for t_layer, s_layer in zip(teacher.model.layers, student.model.layers):
            s_layer.load_state_dict({k: v for k, v in t_layer.state_dict().items() if "feedforward" not in k})
    else:
        copy_teacher_weights(teacher, student)
    ids = tokens()
    with torch.no_grad():
        assert logit_gap(student(ids).logits, teacher(ids).logits) > 1e-3


# ------------------------------------------------------------------------------------------ per-layer RoPE in mixers


@pytest.mark.parametrize("family,layer_type", [("gemma3_text", None), ("smollm3", None)])
def test_rope_mixers_read_each_layers_own_teacher_rope(teachers, family, layer_type):
    """rope_for gives each layer the teacher's (cos, sin) of that layer: Gemma 3's local rotary on its sliding layers
    and its scaled global one on the full layer; nothing on SmolLM3's layer without RoPE."""
    teacher = teachers[family]
    config = student_config(teacher.config, "gla", {"rope": True})
    ids = tokens(length=10)
    rope = rope_for(config, torch.device("cpu"))(ids)
    assert isinstance(rope, LayerRope)
    x = torch.empty(0)
    positions = torch.arange(10)[None].expand(2, -1)
    for i, layer in enumerate(teacher.model.layers):
        attn = layer.self_attn
        if family == "smollm3":
            want = teacher.model.rotary_emb(x, positions) if attn.use_rope else None
        else:
            want = teacher.model.rotary_emb(x, positions, attn.layer_type)
        got = rope.for_layer(i)
        assert (got is None) == (want is None), i
        if want is not None:
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


def test_a_rope_mixer_on_a_layer_without_rope_does_not_rotate(teachers):
    """SmolLM3 layer 1 has no RoPE: its rope mixer computes what the same mixer without rope computes; layer 0's
    does not (it rotates)."""
    teacher = teachers["smollm3"]
    with_rope = harness.build_student(teacher, "gla", rope=True, backend="reference").eval()
    without = copy.deepcopy(with_rope)
    x = torch.randn(2, 10, teacher.config.hidden_size, generator=torch.Generator().manual_seed(2))
    rope = rope_for(with_rope.config, torch.device("cpu"))(tokens(length=10))
    for layer in without.model.layers:
        layer.mixer.options.rope = False
    with torch.no_grad():
        mix = [(with_rope.model.layers[i].mixer(x, position_embeddings=rope)[0],
                without.model.layers[i].mixer(x)[0]) for i in (0, 1)]
    assert logit_gap(*mix[0]) > 1e-3
    assert torch.equal(*mix[1])


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_a_mixers_window_is_the_teachers_attention_at_step_0(family):
    """options.window at step 0 is the teacher's softmax attention cut to the window: over 8 tokens (within every
    window) each layer's mixer output is the teacher's attention output, with the teacher's scale, q/k norms,
    soft-capping and that layer's RoPE (local, global or none)."""
    teacher = TINY_FAMILIES[family](num_layers=3).float()
    ids = tokens(length=8)
    acts = capture_activations(teacher, ids, kinds=("attn_input", "attn_output"))
    student = harness.build_student(teacher, "gated_deltanet", window=8, backend="reference").eval()
    with torch.no_grad():
        for i, layer in enumerate(student.model.layers):
            out = layer.mixer(acts.attn_input[i])[0]
            torch.testing.assert_close(out, acts.attn_output[i], atol=ATOL, rtol=0)


@pytest.mark.parametrize("family", NEW)
def test_the_attention_probes_reproduce_the_teachers_attention(teachers, family):
    """harness transfer's teacher probe, and the copy probe's reading of a hybrid's kept layer (its SoftmaxAttention
    and the student's LayerRotary), both give the teacher's attention output (8 tokens: within the windows)."""
    teacher = teachers[family]
    ids = tokens(length=8)
    acts = capture_activations(teacher, ids, kinds=("attn_input", "attn_output"))
    positions = torch.arange(8)[None].expand(2, -1)
    student = kept_all(teacher)
    s = student.model.layers[0].self_attn.shape
    for i in range(3):
        block = student.model.layers[i]
        probes = [AttentionProbe.of_teacher(teacher, i),
                  AttentionProbe(block.self_attn, student.model.attention_rotary, s.num_heads, s.num_kv_heads,
                                 s.head_dim)]
        with torch.no_grad():
            for probe in probes:
                torch.testing.assert_close(probe.output(acts.attn_input[i], positions), acts.attn_output[i],
                                           atol=ATOL, rtol=0)


def test_the_mixer_probe_runs_a_rope_mixer_on_a_layer_without_rope(teachers):
    """harness transfer's mixer probe, given the student's LayerRotary, reads layer 1's entry (none): it measures what
    the same mixer without rope computes."""
    student = harness.build_student(teachers["smollm3"], "gla", rope=True, backend="reference").eval()
    mixer = student.model.layers[1].mixer
    plain = copy.deepcopy(mixer)
    plain.options.rope = False
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(4))
    positions = torch.arange(6)[None]
    probe, reference = MixerProbe(mixer, student.model.rotary_emb), MixerProbe(plain)
    with torch.no_grad():
        assert torch.equal(probe.output(x, positions), reference.output(x, positions))
        assert torch.equal(probe.mixing(x, positions), reference.mixing(x, positions))


# ------------------------------------------------------------------------------------------ decoding and padding


def greedy_by_full_forwards(model, ids, n):
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "smollm3"])
def test_kept_layers_decode_with_their_cache_as_full_forwards(teachers, family):
    """Cached decoding past the sliding window (prompt 10 + 6 new > 8), soft-capped scores, per-layer RoPE; the teacher's
    own greedy tokens are the reference."""
    teacher, student = teachers[family], kept_all(teachers[family])
    ids = tokens(seed=5, length=10, batch=1)
    out = student.generate(ids, generation_config=GEN)
    assert torch.equal(out, greedy_by_full_forwards(student, ids, GEN.max_new_tokens))
    assert torch.equal(out, greedy_by_full_forwards(teacher, ids, GEN.max_new_tokens))


@pytest.mark.parametrize("family", ["gemma2", "smollm3"])
def test_padded_rows_of_a_kept_student_compute_what_the_teacher_computes(teachers, family):
    """Right padding: each row's logits at its real tokens are the teacher's on the same padded batch; left padding:
    the teacher's on the row alone (the student counts positions over real tokens only)."""
    teacher, student = teachers[family], kept_all(teachers[family])
    prompts = [tokens(seed=s, length=n, batch=1)[0] for s, n in ((7, 5), (8, 13), (9, 22))]
    with torch.no_grad():
        ids, mask = padded(prompts, "right")
        want = teacher(ids, attention_mask=mask).logits
        got = student(ids, attention_mask=mask).logits
        for row, p in enumerate(prompts):
            torch.testing.assert_close(real(got[row], len(p), "right"), real(want[row], len(p), "right"),
                                       atol=ATOL, rtol=0)
        ids, mask = padded(prompts, "left")
        got = student(ids, attention_mask=mask).logits
        for row, p in enumerate(prompts):
            torch.testing.assert_close(real(got[row], len(p), "left"), teacher(p[None]).logits[0], atol=ATOL, rtol=0)


def test_fixed_kv_steps_with_soft_capped_scores_compute_what_growing_ones_do():
    """A Gemma 2 teacher with full-context layers only (fixable KV states): the in-place FixedKVState step soft-caps
    and scales its scores as the growing KVState's does."""
    teacher = tiny_gemma2(num_layers=2, layer_types=["full_attention"] * 2).float()
    student = kept_all(teacher)
    prompts = [tokens(seed=s, length=n, batch=1)[0] for s, n in ((1, 4), (2, 9))]
    ids, mask = padded(prompts, "left")
    steps = tokens(seed=3, length=4, batch=2)
    from harness.student import RecurrentCache

    with torch.no_grad():
        grow, fixed = RecurrentCache(2), RecurrentCache(2)
        student(ids, attention_mask=mask, cache=grow, use_cache=True)
        student(ids, attention_mask=mask, cache=fixed, use_cache=True)
        assert isinstance(grow.states[0], KVState)
        fixed.fix_kv(4, mask)
        for j in range(4):
            mask = torch.cat([mask, mask.new_ones(2, 1)], 1)
            want = student(steps[:, j:j + 1], attention_mask=mask, cache=grow).logits
            torch.testing.assert_close(student(steps[:, j:j + 1], cache=fixed).logits, want, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------ refused by name


def test_a_llama_config_with_a_sliding_window_is_refused_by_name(tmp_path):
    """transformers' Llama attention has no window, so the student must not apply one: refused, naming the field."""
    model = tiny_llama()
    model.config.sliding_window = 4
    model.save_pretrained(tmp_path)
    with pytest.raises(TeacherLoadError, match=r"'llama' model whose config sets .*sliding_window=4 \("):
        load_teacher(str(tmp_path))
    with pytest.raises(TeacherLoadError, match=r"sliding_window=4"):
        harness.build_student(model, "gla")


@pytest.mark.parametrize("make,field,value,message", [
    (lambda: tiny_gemma3(), "attn_logit_softcapping", 50.0, r"attn_logit_softcapping=50.0 \(transformers' Gemma 3 "
     r"attention does not apply it"),
    (lambda: tiny_gemma2(), "use_bidirectional_attention", True, r"use_bidirectional_attention=True \(attention over "
     r"the whole sequence"),
    (lambda: tiny_llama(), "no_rope_layers", [1, 0], r"no_rope_layers=\[1, 0\] \(layers without RoPE are carried for "
     r"smollm3 only"),
    (lambda: tiny_llama(), "attn_logit_softcapping", 30.0, r"attn_logit_softcapping=30.0 \(attention soft-capping is "
     r"carried for gemma2 only"),
    (lambda: tiny_llama(), "final_logit_softcapping", 30.0, r"final_logit_softcapping=30.0"),
    (lambda: tiny_llama(), "query_pre_attn_scalar", 144, r"query_pre_attn_scalar=144"),
    (lambda: tiny_llama(), "partial_rotary_factor", 0.5, r"partial_rotary_factor=0.5 \(RoPE on part of each head"),
    (lambda: tiny_llama(), "attention_multiplier", 0.015625, r"attention_multiplier=0.015625 \(a scale"),
    (lambda: tiny_llama(), "clip_qkv", 8.0, r"clip_qkv=8.0"),
])
def test_a_config_field_the_student_would_not_carry_is_refused_by_name(make, field, value, message):
    model = make()
    setattr(model.config, field, value)
    with pytest.raises(TeacherLoadError, match=message):
        check_teacher_architecture(model, "t")


def test_an_unknown_rope_type_and_rope_per_layer_type_outside_gemma3_are_refused():
    model = tiny_llama()
    model.config.rope_parameters = {"rope_type": "mrope", "rope_theta": 10000.0}
    with pytest.raises(TeacherLoadError, match=r"rope_parameters.rope_type='mrope'"):
        check_teacher_config(model.config)
    model = tiny_smollm3()
    model.config.rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(TeacherLoadError, match=r"rope_parameters=\['full_attention'\] \(RoPE per layer type"):
        check_teacher_config(model.config)


def test_a_granite_teacher_llama_shaped_but_scaled_is_refused_by_name():
    """Granite's layers have Llama's parts, so the module check alone let it through; its multipliers are refused."""
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, embedding_multiplier=12.0,
                           residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=8.0)
    with pytest.raises(TeacherLoadError, match=r"'granite' model .*embedding_multiplier=12.0 .*attention_multiplier="
                       r"0.0078125 .*residual_multiplier=0.22 .*logits_scaling=8.0"):
        check_teacher_architecture(GraniteForCausalLM(config), "granite")


def test_a_multimodal_gemma3_is_refused_naming_the_text_model():
    from transformers import Gemma3Config

    with pytest.raises(TeacherLoadError, match=r"multimodal Gemma 3 .* supported as 'gemma3_text'"):
        check_teacher_config(Gemma3Config())


def test_a_gemma2_layer_without_its_extra_norms_is_refused_by_name():
    model = tiny_gemma2()
    del model.model.layers[1].pre_feedforward_layernorm
    with pytest.raises(TeacherLoadError, match=r"layer 1 lacks pre_feedforward_layernorm"):
        check_teacher_architecture(model)
