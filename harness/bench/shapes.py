"""The teachers a bench runs on: the SmolLM2 shapes (random weights) or a real teacher, their parameter counts,
and the (teacher, student) pair that stage 3 starts from."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from harness.bench.machine import resolve_device

_SMOLLM2_COMMON = dict(
    vocab_size=49152, head_dim=64, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5,
    tie_word_embeddings=True, attention_bias=False, mlp_bias=False, initializer_range=0.02,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)

# SmolLM2 teachers as LlamaConfig keyword arguments (HuggingFaceTB/SmolLM2-{135M,360M,1.7B} config.json).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=8192,
                 rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02,
                 rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
    "135M": dict(_SMOLLM2_COMMON, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3,
                 rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}),
    "360M": dict(_SMOLLM2_COMMON, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                 num_attention_heads=15, num_key_value_heads=5,
                 rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}),
    "1.7B": dict(_SMOLLM2_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                 num_attention_heads=32, num_key_value_heads=32,
                 rope_parameters={"rope_theta": 130000.0, "rope_type": "default"}),
}


def canonical_shape(name: str) -> str:
    """'135m', 'smollm2-135m', '1.7b' ... -> the SHAPES key; ValueError listing the shapes otherwise."""
    key = name.strip().lower().removeprefix("smollm2-").removeprefix("smollm2_")
    for shape in SHAPES:
        if shape.lower() == key:
            return shape
    raise ValueError(f"unknown shape '{name}'; choose one of {', '.join(SHAPES)} (or pass --teacher SOURCE)")


def shape_config(shape: str, layers: Optional[int] = None):
    """The LlamaConfig of a teacher shape (sdpa attention), optionally cut to its first `layers` layers."""
    from transformers import LlamaConfig

    kw = dict(SHAPES[canonical_shape(shape)])
    if layers:
        kw["num_hidden_layers"] = min(int(layers), kw["num_hidden_layers"])
    return LlamaConfig(**kw, attn_implementation="sdpa")


def llama_param_count(config: Any) -> int:
    """Closed-form parameter count of a Llama causal LM (tied head counted once), from its config alone."""
    h, i, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or h // heads
    attn = h * heads * d * 2 + h * kv * d * 2  # q, o; k, v
    if getattr(config, "attention_bias", False):
        attn += heads * d + 2 * kv * d + h
    per_layer = attn + 3 * h * i + 2 * h  # q k v o, gate/up/down, two RMSNorms
    embed = config.vocab_size * h
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return embed + n * per_layer + h + head


def count_params(model: nn.Module) -> int:
    """Distinct parameters (tied ones once), also under ZeRO-3 (see harness.student.count_parameters)."""
    from harness.student import count_parameters

    return count_parameters(model)


def build_teacher(shape: str = "135M", *, source: Optional[str] = None, layers: Optional[int] = None,
                  device: Optional[str | torch.device] = None, dtype: torch.dtype = torch.float32,
                  seed: int = 0) -> nn.Module:
    """A frozen Llama teacher in eval mode on `device`: random weights of a SHAPES config (built directly on the
    device: no download, no CPU initialisation of a 1.7B model), or the real `source` (harness.load_teacher),
    cut to `layers` layers if given."""
    device = resolve_device(device)
    if source:
        from harness.stages.common import truncate
        from harness.teacher import load_teacher

        model = load_teacher(source, dtype=dtype).model
        if layers:
            truncate(model, int(layers))
        model.to(device)
    else:
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        with torch.device(device):
            model = LlamaForCausalLM(shape_config(shape, layers))
        fill_zero_embedding_rows(model)
        model.to(dtype)
    model.eval()
    model.requires_grad_(False)
    return model


@torch.no_grad()
def fill_zero_embedding_rows(model: nn.Module) -> None:
    """Gives a freshly initialised teacher's zeroed padding_idx row the other rows' random values, as a trained
    teacher's rows have: a zero row leaves the student's hidden state exactly zero at that token, and the
    RMSNorms' backward then overflows (harness.student.warn_zero_embedding_rows; docs/BENCHMARKS.md)."""
    from harness.student import zero_embedding_rows

    weight = model.get_input_embeddings().weight
    for row in zero_embedding_rows(weight):
        weight[row].normal_(0.0, model.config.initializer_range)


def build_pair(shape: str = "135M", mixer: str = "gated_deltanet", *, options: Optional[dict] = None,
               source: Optional[str] = None, layers: Optional[int] = None,
               device: Optional[str | torch.device] = None, teacher_dtype: torch.dtype = torch.float32,
               seed: int = 0, attention_layers: Sequence[int] = ()) -> tuple[nn.Module, nn.Module]:
    """(teacher in `teacher_dtype`, fp32 student) as stage 3 starts from: the student is built from the fp32
    teacher by `harness.student.build_student` (weights copied, new parameters at their authors' init), keeping
    softmax attention in `attention_layers` (a hybrid)."""
    from harness.student import build_student

    device = resolve_device(device)
    teacher = build_teacher(shape, source=source, layers=layers, device=device, dtype=torch.float32, seed=seed)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs (a 1.7B student on a CPU takes a while)
        student = build_student(teacher, mixer, attention_layers=attention_layers, **(options or {}))
    teacher.to(teacher_dtype)
    return teacher, student
