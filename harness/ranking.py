"""Layer ranking: which attention layers cost the most to linearize, measured one layer at a time.

`harness transfer --rank-layers JOB` builds each layer's mixer as stage 1 starts it (`harness.stages.align.init_mixer`
and `fit_output_scales`, as `harness transfer` does), or takes its stage-1 weights where the run has finished stage 1
for that layer, and measures what replacing that one layer costs on held-out sequences of the job's data:

  stage1  the layer's stage-1 loss (stages.align_mixer.loss, `mse` by default: the mixer's output against the
          teacher's attention output on the teacher's own input to that layer), as stage 1 computes it
  kl      KL(teacher || model) per token, the model being the teacher with ONLY that layer's attention replaced
          by the mixer (everything else the teacher's): what the replacement costs end to end
  copy    the in-context copying that replacing ONLY that layer costs: the teacher's copy accuracy minus the
          model's, on random token sequences shown twice (harness.eval.copy: teacher-forced greedy accuracy on the
          second copy after its first token; copies of seq_len // 2 tokens, at least 8 sequences). The layers
          holding the teacher's induction heads should cost most; a hybrid that keeps them keeps copying

For kl and copy each layer also gets `removed_cost`: the same measure with that layer's attention taken out (its
output zero, `RemovedAttention`: the block adds only its MLP's). It is the mixer's floor: a mixer whose cost equals
it gives the layer back nothing of what its attention did for that measure.

The costliest layers are the ones a hybrid student keeps as softmax attention (`costliest_layers`).

Files under RUN/ranking/ (RUN = the job's output_dir), written atomically:
  parts/<measure>/layers-AA-BB.json  one layer group's costs (what one Slurm array task writes)
  layer_ranking.json / .md           every layer of the teacher, costliest first (ties: the lower index first),
                                     merged from the parts once they cover every layer (`merge_ranking`)
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
from torch import nn

from harness.config import RANK_MEASURES as MEASURES, ConfigError, JobConfig
from harness.files import atomic_write_text
# the ranking's file and what reads it live with the stages, which read the kept layers from it
from harness.stages.common import RANK_COMMAND, RANKING_DIR, RANKING_JSON, costliest_layers, ranking_dir  # noqa: F401

RANKING_MD, PARTS_DIR = "layer_ranking.md", "parts"
# What a part's costs depend on besides its layers: parts that differ in any of these are not one ranking.
SETTINGS = ("job", "teacher", "teacher_layers", "mixer", "options", "measure", "loss", "data", "seed")

__all__ = ["MEASURES", "MixerAsAttention", "RemovedAttention", "replaced_attention", "kl_per_token", "rank_layers",
           "merge_ranking", "costliest_layers", "ranking_dir", "ranking_order"]


def part_path(job: JobConfig, measure: str, layers: Sequence[int]) -> Path:
    from harness.stages.common import group_name

    return ranking_dir(job) / PARTS_DIR / measure / f"{group_name(list(layers))}.json"


def check_measure(measure: str) -> str:
    if measure not in MEASURES:
        raise ConfigError(f"--rank-by '{measure}' is not a ranking measure; use one of {', '.join(MEASURES)}.")
    return measure


# ------------------------------------------------------------------------------------------ one layer replaced


class MixerAsAttention(nn.Module):
    """A token mixer standing in for a teacher layer's `self_attn`.

    transformers 5.x calls the attention as `self_attn(hidden_states=..., position_embeddings=..., attention_mask=...,
    ...)` and reads `(output, weights)`. The mixer reads the normalised hidden states (in its own dtype) and, when
    its options use RoPE, the student's position embeddings for positions 0..T-1 (`rope(ids-shaped [B, T])`), not the
    teacher's: its rope_theta may differ. Sequences must be unpadded: the teacher's mask (causal, or None) is not
    read, the mixer is causal by construction.
    """

    def __init__(self, mixer: nn.Module, rope: Any = None, autocast: Any = None):
        super().__init__()
        self.mixer = mixer
        self.rope = rope if rope is not None else (lambda ids: None)
        self.autocast = autocast if autocast is not None else contextlib.nullcontext()  # stage 1's (stage_autocast)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Any = None, attention_mask: Any = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
        dtype = next(self.mixer.parameters()).dtype
        with self.autocast:
            y, _ = self.mixer(hidden_states.to(dtype), position_embeddings=self.rope(hidden_states[..., 0]))
        return y.to(hidden_states.dtype), None


class RemovedAttention(nn.Module):
    """A teacher layer's `self_attn` taken out: its output is zero, so the block adds only its MLP's output."""

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return torch.zeros_like(hidden_states), None


@contextlib.contextmanager
def replaced_attention(model: nn.Module, layer: int, module: Optional[nn.Module]) -> Iterator[nn.Module]:
    """The block runs `model` (a Llama-style causal LM) with layer `layer`'s `self_attn` replaced by `module`
    (None: nothing replaced); the teacher's attention is put back afterwards, also when the block fails."""
    block = model.model.layers[layer]
    original = block.self_attn
    if module is not None:
        block.self_attn = module
    try:
        yield model
    finally:
        block.self_attn = original


@torch.no_grad()
def log_probs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's next-token log-probabilities `[B, T, V]` (float32) on unpadded ids `[B, T]`."""
    return torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)


@torch.no_grad()
def kl_per_token(teacher_log_p: torch.Tensor, log_q: torch.Tensor) -> float:
    """KL(teacher || model) = sum_v p (log p - log q), averaged over every token (float64 sum)."""
    p = teacher_log_p.exp()
    per_token = (p * (teacher_log_p - log_q)).sum(-1)
    return float(per_token.double().mean())


class CopyProbe:
    """Copy accuracy of a model on one fixed set of copy prompts (harness.eval.copy's sequences and score)."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor, length: int):
        self.ids, self.rows, self.length = ids, rows, length

    @classmethod
    def for_model(cls, model: nn.Module, tokenizer: Any, sequences: int, seq_len: int,
                  device: torch.device) -> "CopyProbe":
        """Prompts of copies of seq_len // 2 tokens (at least 8 sequences), drawn as `harness eval copy` draws them."""
        from harness.eval.copy import (CopyConfig, draw_sequences, prompts, token_range, tokenizer_prefix,
                                       vocabulary_size)

        length = max(seq_len // 2, 2)
        cfg = CopyConfig(lengths=[length], sequences=max(sequences, 8))
        rng = token_range(cfg, vocabulary_size(model, tokenizer), list(tokenizer.all_special_ids))
        rows = draw_sequences(cfg, length, rng)
        return cls(prompts(rows, tokenizer_prefix(tokenizer), length).to(device), rows[:, :length], length)

    @torch.no_grad()
    def measure(self, model: nn.Module) -> dict[str, float]:
        """copy_acc: the fraction of the second copies' tokens after their first that the model predicts (argmax);
        nll_after_first: their mean negative log-likelihood (nats), which still moves where the accuracy is 0."""
        from harness.eval.copy import copy_record, forward_logits

        logits = forward_logits(model, self.ids, self.length + 1)
        records = [copy_record(logits[i], self.rows[i]) for i in range(self.rows.shape[0])]
        hits = [r["hits"][1:] for r in records]
        return {"copy_acc": sum(h.count("1") for h in hits) / sum(len(h) for h in hits),
                "nll_after_first": sum(r["nll_after_first"] for r in records) / len(records)}

    def accuracy(self, model: nn.Module) -> float:
        return self.measure(model)["copy_acc"]


# ------------------------------------------------------------------------------------------ measuring


def start_mixers(job: JobConfig, model: nn.Module, config: Any, layers: Sequence[int], fit_ids: torch.Tensor,
                 device: torch.device) -> dict[int, tuple[nn.Module, str]]:
    """layer -> (its mixer, "stage1" or "init"): the stage-1 weights where a complete stage-1 group holds the
    layer, else the mixer as stage 1 starts it (init_mixer, output scales fitted on stage 1's first batch)."""
    from harness.stages.align import find_group_weights, init_mixer, stage_autocast
    from harness.student import FIT_KINDS, fit_output_scales, rope_for
    from harness.teacher import capture_activations
    from harness.transfer import stage1_mixer

    stage1 = find_group_weights(job, "align_mixer")
    out: dict[int, tuple[nn.Module, str]] = {}
    fresh = [l for l in layers if l not in stage1]
    if fresh:
        acts = capture_activations(model, fit_ids, layers=fresh, kinds=FIT_KINDS)
        mixers = {l: init_mixer(model.model.layers[l], config, l, job.seed).to(device) for l in fresh}
        fit_output_scales(mixers, acts, rope_for(config, device)(fit_ids), stage_autocast(job, device))
        out.update({l: (m, "init") for l, m in mixers.items()})
    for l in layers:
        if l in stage1:
            out[l] = (stage1_mixer(job, config, model.model.layers[l], l, stage1[l]).to(device), "stage1")
    return {l: out[l] for l in layers}


def rank_layers(job: JobConfig, *, measure: str = "stage1", layers: Optional[Sequence[int]] = None,
                sequences: int = 2, seq_len: int = 512, device: Optional[torch.device] = None,
                progress: bool = True) -> dict[str, Any]:
    """Each layer's cost under `measure` (see the module docstring), for `layers` (default: all). Returns the
    part (JSON-able): the settings (SETTINGS) and {"layers": {"L": {"cost", "weights"}}}, with "removed_cost" beside
    "cost" for kl and copy."""
    from tqdm import tqdm

    from harness.data import prepare_job_corpus
    from harness.stages.align import first_batch, layer_loss, stage_autocast
    from harness.stages.common import load_job_teacher, num_student_layers, resolve_device
    from harness.student import rope_for, student_config
    from harness.teacher import capture_activations, teacher_identity
    from harness.transfer import sample_sequences

    check_measure(measure)
    device = device or resolve_device(job)
    n_layers = num_student_layers(job)
    chosen = sorted(set(layers)) if layers is not None else list(range(n_layers))
    if not chosen or chosen[0] < 0 or chosen[-1] >= n_layers:
        raise ConfigError(f"layers {list(layers or [])} are outside the teacher's 0-{n_layers - 1}.")
    # the stage-1 loss reads the teacher up to the last chosen layer; the KL runs all of it
    teacher = load_job_teacher(job, device, up_to_layer=chosen[-1] + 1 if measure == "stage1" else None)
    model = teacher.model
    corpus = prepare_job_corpus(job, teacher.tokenizer, max_positions=model.config.max_position_embeddings)
    ids, origin = sample_sequences(corpus, sequences, seq_len)
    ids = ids.to(device)
    config = student_config(model.config, job.student.mixer, dict(job.student.options))
    rope = rope_for(config, device)
    mixers = start_mixers(job, model, config, chosen, first_batch(job, corpus).to(device), device)
    loss = job.stages.align_mixer.loss
    if measure == "stage1":
        acts = capture_activations(model, ids, layers=chosen, kinds=("attn_input", "attn_output"))
    elif measure == "copy":
        probe = CopyProbe.for_model(model, teacher.tokenizer, sequences, seq_len, device)
        teacher_copy = probe.accuracy(model)
    else:
        teacher_log_p = log_probs(model, ids)

    def end_to_end_cost(layer: int, attention: nn.Module) -> float:
        with replaced_attention(model, layer, attention):
            return (teacher_copy - probe.accuracy(model) if measure == "copy"
                    else kl_per_token(teacher_log_p, log_probs(model, ids)))

    costs = {}
    for layer in tqdm(chosen, desc=f"rank ({measure})", unit="layer", disable=not progress):
        mixer, weights = mixers[layer]
        mixer.eval()
        with torch.no_grad():
            if measure == "stage1":
                with stage_autocast(job, device):
                    cost = float(layer_loss(mixer, "align_mixer", acts, layer, rope(ids), loss))
                costs[str(layer)] = {"cost": cost, "weights": weights}
                continue
            replaced = MixerAsAttention(mixer, rope, stage_autocast(job, device))
            costs[str(layer)] = {"cost": end_to_end_cost(layer, replaced), "weights": weights,
                                 "removed_cost": end_to_end_cost(layer, RemovedAttention())}
    return {"job": job.name, "teacher": teacher_identity(job.teacher.source), "teacher_layers": n_layers,
            "mixer": job.student.mixer, "options": dict(job.student.options), "measure": measure,
            "loss": loss if measure == "stage1" else None,
            "data": ({"origin": "random token ids (harness.eval.copy)", "sequences": probe.rows.shape[0],
                      "seq_len": probe.ids.shape[1], "teacher_copy_acc": teacher_copy} if measure == "copy" else
                     {"origin": origin, "sequences": int(ids.shape[0]), "seq_len": int(ids.shape[1])}),
            "seed": job.seed, "layers": costs}


# ------------------------------------------------------------------------------------------ files


def write_part(job: JobConfig, part: dict[str, Any]) -> Path:
    """One layer group's costs under RUN/ranking/parts/<measure>/ (atomically)."""
    layers = sorted(int(l) for l in part["layers"])
    path = part_path(job, part["measure"], layers)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(part, indent=1, sort_keys=True))
    return path


def ranking_order(costs: dict[int, float]) -> list[int]:
    """Layers costliest first; equal costs (and NaN, last) by layer index, so that the order is deterministic."""
    return sorted(costs, key=lambda l: (math.isnan(costs[l]), -costs[l] if not math.isnan(costs[l]) else 0.0, l))


def _settings(part: dict[str, Any]) -> dict[str, Any]:
    return {k: part.get(k) for k in SETTINGS}


def merge_ranking(job: JobConfig, measure: str = "stage1", *, require_all: bool = True) -> Optional[Path]:
    """Merge the parts of `measure` into RUN/ranking/layer_ranking.json and .md; returns the JSON's path.

    Parts made under other settings than the newest part (data, seed, teacher, mixer, loss: an older ranking) are
    left out. When the parts do not cover every layer of the teacher: a ConfigError naming the missing layers
    (`require_all`), else None and nothing written."""
    folder = ranking_dir(job) / PARTS_DIR / check_measure(measure)
    files = sorted(folder.glob("layers-*.json"), key=lambda p: (p.stat().st_mtime_ns, p.name)) if folder.is_dir() else []
    if not files:
        raise ConfigError(f"No {measure} ranking parts under {folder}; write them with `{RANK_COMMAND} --rank-by "
                          f"{measure}` (or `harness submit JOB --rank-layers`).")
    parts = [json.loads(p.read_text()) for p in files]
    newest = _settings(parts[-1])
    costs: dict[int, dict[str, Any]] = {}
    for part in parts:  # oldest first: a layer measured again later takes its newer cost
        if _settings(part) == newest:
            costs.update({int(l): v for l, v in part["layers"].items()})
    missing = [l for l in range(newest["teacher_layers"]) if l not in costs]
    if missing:
        if not require_all:
            return None
        from harness.stages.align import _spans

        raise ConfigError(f"The {measure} ranking parts under {folder} lack layer(s) {missing} of the teacher's "
                          f"{newest['teacher_layers']}; run `{RANK_COMMAND} --rank-by {measure} --layers "
                          f"{_spans(missing)}` first.")
    order = ranking_order({l: v["cost"] for l, v in costs.items()})
    ranking = {**newest, "order": order,
               "layers": [{"layer": l, "rank": order.index(l) + 1, **costs[l]} for l in sorted(costs)]}
    out = ranking_dir(job)
    atomic_write_text(out / RANKING_JSON, json.dumps(ranking, indent=1, sort_keys=True))
    atomic_write_text(out / RANKING_MD, markdown(ranking))
    return out / RANKING_JSON


def markdown(ranking: dict[str, Any]) -> str:
    """The ranking as Markdown: costliest layer first."""
    d = ranking["data"]
    what = {"stage1": f"stage-1 loss ({ranking['loss']}) of the layer's mixer",
            "kl": "KL(teacher || model) per token, only this layer's attention replaced by its mixer",
            "copy": f"copy accuracy lost (the teacher's {d.get('teacher_copy_acc', float('nan')):.1%} minus the "
                    "model's, only this layer's attention replaced by its mixer)"}[ranking["measure"]]
    removed = all("removed_cost" in r for r in ranking["layers"])  # parts written before it have none
    columns = ["rank", "layer", "cost", *(["cost with the attention removed"] if removed else []), "weights"]
    lines = [f"# Layer ranking: {ranking['job']}", "",
             f"Teacher `{ranking['teacher']}` ({ranking['teacher_layers']} layers), mixer {ranking['mixer']}; "
             f"cost = {what}, on {d['sequences']} sequences x {d['seq_len']} tokens of the {d['origin']}, seed "
             f"{ranking['seed']}. Costliest first (equal costs: lower layer first).", "",
             "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    by_layer = {r["layer"]: r for r in ranking["layers"]}
    for i, l in enumerate(ranking["order"]):
        row = by_layer[l]
        cells = [i + 1, l, f"{row['cost']:.6g}", *([f"{row['removed_cost']:.6g}"] if removed else []), row["weights"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if removed:
        lines += ["", "Cost with the attention removed: the same measure with only this layer's attention output "
                  "zero (the block adds its MLP's alone); a mixer at that cost gives the layer back nothing."]
    return "\n".join(lines) + "\n"
