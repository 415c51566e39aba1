"""The teacher families a student can be built from, and what each carries into the student beyond Llama's layout.

`check_teacher_architecture` (re-exported by harness.teacher, which calls it on every load) refuses, naming what it
found, a teacher whose decoder layers have parts the student would drop, or whose config sets a field that changes
what its network computes and that the student does not carry (`uncarried_fields`). What is carried:

  * `attention_layout`: the attention's biases and per-head q/k norms (Qwen2, Qwen3, Gemma 3, `attention_bias`);
  * `student_layout`: the rest, as HarnessConfig fields of the same names: Gemma's RMSNorm that scales by
    (1 + weight) (`norm_style`), Gemma 2/3's extra norms around attention and MLP (`sandwich_norms`), Gemma's
    embedding scale sqrt(hidden) (`embed_scale`), its MLP activation, its attention scale
    (`query_pre_attn_scalar`), its logit soft-capping (`attn_logit_softcapping`: kept attention layers and mixer
    windows; `final_logit_softcapping`: the head), Gemma 3's local RoPE base on its sliding-window layers
    (`local_rope_layers`, `local_rope_parameters`) and SmolLM3's layers without RoPE (`no_rope_layers`);
  * `teacher_window`: the sliding window of each layer (Mistral's, and where `layer_types` says sliding_attention).

Imports nothing else from harness: harness.teacher, harness.student and the mixers read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from torch import nn


class TeacherLoadError(RuntimeError):
    """A teacher source could not be resolved or loaded, or it is a model the harness does not carry."""


@dataclass(frozen=True)
class Family:
    """What a family's transformers code computes beyond Llama's decoder (every flag False: Llama's)."""

    extra_layer_parts: frozenset[str] = frozenset()  # decoder-layer children beyond Llama's four
    qk_norm: bool = False  # self_attn.q_norm / k_norm before RoPE
    qkv_bias_always: bool = False  # q/k/v biased whatever attention_bias says (Qwen2), o not
    windows: bool = False  # its attention reads sliding_window (everywhere, or where layer_types says so)
    gemma_norms: bool = False  # RMSNorm scaling by (1 + weight), multiplied in float32 before the cast
    sandwich_norms: bool = False  # post_attention_layernorm on the attention output, pre/post_feedforward_layernorm
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    query_scalar: bool = False  # attention scale query_pre_attn_scalar ** -0.5
    attn_softcap: bool = False  # tanh soft-capping of the attention scores (attn_logit_softcapping)
    final_softcap: bool = False  # tanh soft-capping of the logits (final_logit_softcapping)
    rope_by_layer_type: bool = False  # rope_parameters per layer type: full_attention and sliding_attention
    no_rope_layers: bool = False  # no_rope_layers: 1 = the layer uses RoPE, 0 = it does not
    activation_field: str = "hidden_act"  # the config field naming the MLP's activation


_SANDWICH = frozenset({"pre_feedforward_layernorm", "post_feedforward_layernorm"})
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral": Family(windows=True),
    "qwen2": Family(qkv_bias_always=True, windows=True),
    "qwen3": Family(qk_norm=True, windows=True),
    "smollm3": Family(windows=True, no_rope_layers=True),
    "gemma": Family(gemma_norms=True, embed_scale=True),
    "gemma2": Family(extra_layer_parts=_SANDWICH, windows=True, gemma_norms=True, sandwich_norms=True,
                     embed_scale=True, query_scalar=True, attn_softcap=True, final_softcap=True,
                     activation_field="hidden_activation"),
    "gemma3_text": Family(extra_layer_parts=_SANDWICH, qk_norm=True, windows=True, gemma_norms=True,
                          sandwich_norms=True, embed_scale=True, query_scalar=True, final_softcap=True,
                          rope_by_layer_type=True, activation_field="hidden_activation"),
}
# The families whose decoder layers `load_teacher` accepts as they are (README "Teachers"). Any other causal LM is
# accepted when its layers have exactly Llama's shape and its config sets none of the fields `uncarried_fields` reads.
KNOWN_FAMILIES = tuple(FAMILIES)
_LAYER_PARTS = frozenset({"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"})
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_OPTIONAL_ATTENTION_PARTS = {"q_norm", "k_norm", "rotary_emb"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj"}
_LAYER_TYPES = ("full_attention", "sliding_attention")
# Scales some Llama-shaped families (Granite, Cohere) put on embeddings, attention, residuals or logits: 1 is none.
_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling",
                "logit_scale")
# Attention features of other families, each refused when on: (field, what it does).
_SWITCHES = (
    ("use_bidirectional_attention", "attention over the whole sequence, not causal"),
    ("clip_qkv", "q, k and v clipped to +-clip_qkv"),
    ("attention_chunk_size", "attention within fixed chunks"),
    ("use_qk_norm", "a q/k norm the layers do not hold as self_attn.q_norm and k_norm"),
    ("qk_layernorm", "a q/k LayerNorm the layers do not hold as self_attn.q_norm and k_norm"),
    ("attn_temperature_tuning", "a position-dependent temperature on q"),
    ("use_parallel_residual", "attention and MLP in parallel on one residual"),
)


def family_of(config: Any) -> Family:
    """The Family of a teacher config by its model_type (Llama's for a type the harness does not name)."""
    return FAMILIES.get(getattr(config, "model_type", ""), Family())


# ----------------------------------------------------------------------------------------------
# Fields of the config
# ----------------------------------------------------------------------------------------------

def _rope_parameter_sets(config: Any) -> tuple[dict[str, Any], bool]:
    """{layer type or "all": its rope parameters (None: a layer type without RoPE)} and whether they are per type."""
    params = getattr(config, "rope_parameters", None) or {}
    types = set(getattr(config, "layer_types", None) or ()) | set(_LAYER_TYPES)
    nested = [key for key in params if key in types and (params[key] is None or isinstance(params[key], dict))]
    return ({key: params[key] for key in nested}, True) if nested else ({"all": params}, False)


def uncarried_fields(config: Any) -> list[str]:
    """The settings of a teacher `config` that change what its network computes and that a student of its family
    does not carry, each as 'field=value (why)'; [] when the student carries every one."""
    family, name = family_of(config), getattr(config, "model_type", "?")
    found: list[str] = []

    def get(field: str) -> Any:
        return getattr(config, field, None)

    def refuse(field: str, value: Any, why: str) -> None:
        found.append(f"{field}={value!r} ({why})")

    windowed = ", ".join(n for n, f in FAMILIES.items() if f.windows)
    if get("sliding_window") is not None and not family.windows:
        refuse("sliding_window", get("sliding_window"), f"transformers' '{name}' attention has no sliding window; "
               f"the harness carries one for {windowed}")
    types = get("layer_types")
    if types:
        odd = sorted(set(types) - set(_LAYER_TYPES))
        if odd:
            refuse("layer_types", odd, "only full_attention and sliding_attention layers are carried")
        elif "sliding_attention" in types and not family.windows:
            refuse("layer_types", "sliding_attention", f"sliding-window layers are carried for {windowed}")
    sets, per_type = _rope_parameter_sets(config)
    if per_type and not family.rope_by_layer_type:
        refuse("rope_parameters", sorted(sets), "RoPE per layer type is carried for gemma3_text only")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for key, params in sets.items():
        where = "rope_parameters" if key == "all" else f"rope_parameters[{key!r}]"
        if params is None:
            refuse(where, None, "a layer type without RoPE is carried only as SmolLM3's no_rope_layers")
            continue
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            refuse(f"{where}.rope_type", rope_type, f"not one of transformers' RoPE types: default, "
                   f"{', '.join(ROPE_INIT_FUNCTIONS)}")
        partial = params.get("partial_rotary_factor", get("partial_rotary_factor"))
        if partial is not None and float(partial) != 1.0:
            refuse("partial_rotary_factor", partial, "RoPE on part of each head: the student rotates whole heads")
    if get("no_rope_layers") is not None:
        flags = list(get("no_rope_layers"))
        if not family.no_rope_layers and not all(flags):
            refuse("no_rope_layers", flags, "layers without RoPE are carried for smollm3 only")
        elif family.no_rope_layers and len(flags) < config.num_hidden_layers:
            refuse("no_rope_layers", flags, f"names {len(flags)} of the {config.num_hidden_layers} layers")
    if get("query_pre_attn_scalar") is not None and not family.query_scalar:
        refuse("query_pre_attn_scalar", get("query_pre_attn_scalar"), "an attention scale carried for gemma2 and "
               "gemma3_text only")
    if get("attn_logit_softcapping") is not None and not family.attn_softcap:
        why = ("transformers' Gemma 3 attention does not apply it, so what the teacher computes is not what its "
               "config says" if name == "gemma3_text" else "attention soft-capping is carried for gemma2 only")
        refuse("attn_logit_softcapping", get("attn_logit_softcapping"), why)
    if get("final_logit_softcapping") is not None and not family.final_softcap:
        refuse("final_logit_softcapping", get("final_logit_softcapping"), "logit soft-capping is carried for "
               "gemma2 and gemma3_text only")
    for field in _MULTIPLIERS:
        if get(field) is not None and float(get(field)) != 1.0:
            refuse(field, get(field), "a scale the student does not apply")
    for field, what in _SWITCHES:
        if get(field):
            refuse(field, get(field), what)
    activation = get(family.activation_field)
    if activation is not None:
        from transformers.activations import ACT2FN

        if activation not in ACT2FN:
            refuse(family.activation_field, activation, "not an activation transformers names")
    return found


def check_teacher_config(config: Any, source: str = "") -> None:
    """TeacherLoadError naming every field and value of a teacher's config that its student would not carry
    (`uncarried_fields`), or the multimodal Gemma 3 whose text decoder is the supported `gemma3_text`."""
    name = getattr(config, "model_type", "?")
    what = f"Teacher {source!r} is a '{name}' model"
    if name == "gemma3":
        raise TeacherLoadError(f"{what}: a multimodal Gemma 3 (Gemma3ForConditionalGeneration), refused; its text "
                               "decoder is supported as 'gemma3_text' (a text-only checkpoint such as gemma-3-1b, or "
                               "the text model saved alone as a Gemma3ForCausalLM).")
    found = uncarried_fields(config)
    if found:
        raise TeacherLoadError(f"{what} whose config sets what the student would not carry: {'; '.join(found)}. "
                               "Supported: README \"Teachers\".")


def student_layout(config: Any) -> dict[str, Any]:
    """The HarnessConfig fields that carry what a teacher's `config` computes beyond Llama's decoder (module
    docstring); every value None for a Llama-like family. `rope_parameters` is the RoPE of full-attention layers."""
    family = family_of(config)
    hidden = config.hidden_size
    layout: dict[str, Any] = {
        "norm_style": "gemma" if family.gemma_norms else None,
        "sandwich_norms": True if family.sandwich_norms else None,
        "embed_scale": float(hidden ** 0.5) if family.embed_scale else None,
        "query_pre_attn_scalar": float(config.query_pre_attn_scalar) if family.query_scalar else None,
        "attn_logit_softcapping": _float_or_none(getattr(config, "attn_logit_softcapping", None))
        if family.attn_softcap else None,
        "final_logit_softcapping": _float_or_none(getattr(config, "final_logit_softcapping", None))
        if family.final_softcap else None,
        "no_rope_layers": None, "local_rope_layers": None, "local_rope_parameters": None,
    }
    if family.activation_field != "hidden_act":
        layout["hidden_act"] = getattr(config, family.activation_field)
    flags = getattr(config, "no_rope_layers", None)
    if family.no_rope_layers and flags is not None and not all(flags[:config.num_hidden_layers]):
        layout["no_rope_layers"] = [int(bool(f)) for f in flags[:config.num_hidden_layers]]
    sets, per_type = _rope_parameter_sets(config)
    if per_type:
        layout["rope_parameters"] = dict(sets["full_attention"])
        types = list(config.layer_types)[:config.num_hidden_layers]
        local = [i for i, t in enumerate(types) if t == "sliding_attention"]
        if local:
            layout["local_rope_layers"] = local
            layout["local_rope_parameters"] = dict(sets["sliding_attention"])
    return layout


def _float_or_none(value: Any) -> Optional[float]:
    return None if value is None else float(value)


def teacher_window(teacher_config: Any, layer: int) -> Optional[int]:
    """The sliding window of the teacher's layer `layer`: Mistral's everywhere, the others' (Qwen2/3, SmolLM3,
    Gemma 2/3) where their layer_types say sliding_attention; None for full attention."""
    window = getattr(teacher_config, "sliding_window", None)
    types = getattr(teacher_config, "layer_types", None)
    if window is None or (types is not None and types[layer] != "sliding_attention"):
        return None
    return int(window)


# ----------------------------------------------------------------------------------------------
# Modules of the layers
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionLayout:
    """What a teacher's attention holds beyond Llama's four bias-free projections, which a student keeps."""

    qkv_bias: bool = False  # q_proj, k_proj, v_proj carry biases (Qwen2/2.5; Llama/Qwen3 with attention_bias)
    o_bias: bool = False  # o_proj carries a bias (Llama/Qwen3 with attention_bias)
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before RoPE (Qwen3, Gemma 3)


def attention_layout(config: Any) -> AttentionLayout:
    """The attention layout of a teacher from its config (no weights): Qwen2 biases q/k/v and not o; Qwen3 and
    Gemma 3 normalise q and k per head; the others bias all four projections when `attention_bias` says so."""
    family = family_of(config)
    if family.qkv_bias_always:
        return AttentionLayout(qkv_bias=True, o_bias=False)
    bias = bool(getattr(config, "attention_bias", False))
    return AttentionLayout(qkv_bias=bias, o_bias=bias, qk_norm=family.qk_norm)


def layout_of_layer(attn: nn.Module) -> AttentionLayout:
    """The layout a decoder layer's attention module actually has (its biases and q/k norms)."""
    return AttentionLayout(qkv_bias=getattr(attn.q_proj, "bias", None) is not None,
                           o_bias=getattr(attn.o_proj, "bias", None) is not None,
                           qk_norm=hasattr(attn, "q_norm") and hasattr(attn, "k_norm"))


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack (the module holding `.layers`) of a causal LM, a base model or a harness Teacher (an object
    whose `.model` is the causal LM)."""
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "model", None), nn.Module):
        model = model.model  # a harness.teacher.Teacher
    if hasattr(model, "module") and not hasattr(model, "layers") and not hasattr(model, "model"):
        model = model.module  # DeepSpeed / DDP wrappers
    if hasattr(model, "layers"):
        return model
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "layers"):
        return inner
    raise TeacherLoadError(f"{type(model).__name__} has no decoder layers (expected .model.layers or .layers)")


def check_teacher_architecture(model: nn.Module, source: str = "") -> AttentionLayout:
    """Raise a TeacherLoadError naming what is missing or extra unless the config sets nothing the student would not
    carry (`check_teacher_config`) and every decoder layer is a pre-norm block (input_layernorm, self_attn with
    q/k/v/o projections and optionally per-head q/k norms, post_attention_layernorm, a gated MLP of gate/up/down
    projections; Gemma 2/3 add pre_feedforward_layernorm and post_feedforward_layernorm) whose attention matches the
    layout its config describes; returns that layout."""
    config = model.config
    check_teacher_config(config, source)
    model_type = getattr(config, "model_type", "?")
    what = f"Teacher {source!r} is a '{model_type}' model ({type(model).__name__})"
    supported = (f"supported: {', '.join(KNOWN_FAMILIES)}, and any causal LM whose decoder layers have Llama's "
                 "parts with the same meaning (README \"Teachers\")")
    try:
        layers = decoder_of(model).layers
    except TeacherLoadError as err:
        raise TeacherLoadError(f"{what}; {supported}: {err}") from err
    expected = attention_layout(config)
    parts = _LAYER_PARTS | family_of(config).extra_layer_parts
    for index, layer in enumerate(layers):
        problems = _layer_problems(layer, parts)
        if not problems and layout_of_layer(layer.self_attn) != expected:
            problems = [f"attention {layout_of_layer(layer.self_attn)} where its config says {expected}"]
        if problems:
            raise TeacherLoadError(f"{what}; {supported}, but layer {index} {'; '.join(problems)}.")
    return expected


def _layer_problems(layer: nn.Module, expected: frozenset[str]) -> list[str]:
    """What a decoder layer lacks or has beyond the parts the student copies (`expected`), as phrases ('lacks ...',
    'also has ...')."""
    problems = []
    parts = {name for name, _ in layer.named_children()}
    if parts - expected:
        problems.append(f"also has {', '.join(sorted(parts - expected))} (the student would drop it)")
    if expected - parts:
        problems.append(f"lacks {', '.join(sorted(expected - parts))}")
        return problems
    attn = {name for name, _ in layer.self_attn.named_children()}
    if _ATTENTION_PARTS - attn:
        problems.append(f"lacks self_attn.{', self_attn.'.join(sorted(_ATTENTION_PARTS - attn))}")
    extra = attn - _ATTENTION_PARTS - _OPTIONAL_ATTENTION_PARTS
    if extra:
        problems.append(f"also has self_attn.{', self_attn.'.join(sorted(extra))} (the student would drop it)")
    if len({"q_norm", "k_norm"} & attn) == 1:
        problems.append("has only one of self_attn.q_norm and self_attn.k_norm")
    mlp = {name for name, _ in layer.mlp.named_children()} - {"act_fn"}
    if mlp != _MLP_PARTS:
        problems.append(f"has an MLP of {', '.join(sorted(mlp)) or 'nothing'}, not the gated gate/up/down_proj")
    return problems


def attention_implementation(config: Any, requested: str) -> str:
    """The attention implementation to load a teacher with: `requested`, but eager where the family's transformers
    class has no sdpa path (Gemma 2: sdpa cannot soft-cap the scores)."""
    if requested != "sdpa":
        return requested
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return requested
    return requested if getattr(model_class, "_supports_sdpa", True) else "eager"
