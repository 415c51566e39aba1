"""Transfer fidelity: how close each student mixer starts to the teacher attention it replaces, per layer.

`harness transfer JOB` builds every layer's mixer exactly as stage 1 starts it (`harness.stages.align.init_mixer`:
the teacher's Q/K/V/O, new parameters drawn under the layer's seed), feeds it the teacher's normalised input on
held-out sequences of the job's data, and compares it with the teacher's attention on the same input:

  output   mse        the stage-1 loss at step 0 (mean squared error over tokens and features)
           rel_mse    |y - t|^2 / |t|^2 over the layer: 0 is the teacher, 1 no better than outputting zero
           cosine     mean over tokens of cos(y_t, t_t)
           norm_ratio |y| / |t|: a scale mismatch costs rel_mse even where the direction is right
  scores   qk_corr    per query row, the Pearson correlation over its causal keys of the mixer's q.k (after its
                      feature map or L2 norm, with RoPE where the mixer uses it) with the teacher's attention logits
                      (after RoPE), averaged over rows, heads and sequences. Row-wise, because softmax ignores a
                      row's offset and scale.
  mixing   mix_corr   the same for the mixer's effective mixing weights A (o_t = sum_s A_ts v_s before its output
                      norm and gate; decays, betas, normalisers and feature maps included, found by running its
                      recurrence on one-hot values) against the teacher's attention probabilities.

With a finished stage 1 in the run directory, the job's own mixer is measured again with its stage-1 weights
("stage1"). `--mixer all` and `--variant` compare mixers and init options on the same sequences.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from harness.files import atomic_write_text
from harness.mixers import MIXERS, Mixer, mixer_class
from harness.probes import AttentionProbe, MixerProbe, Probe

MIN_KEYS = 8  # rows with fewer causal keys than this are left out of the row correlations
REPORT_JSON, REPORT_MD = "transfer.json", "transfer.md"


@dataclass
class LayerFidelity:
    """One layer's closeness to the teacher (see the module docstring)."""

    mse: float
    rel_mse: float
    cosine: float
    norm_ratio: float
    qk_corr: float
    mix_corr: float


METRICS = tuple(f.name for f in fields(LayerFidelity))


# ------------------------------------------------------------------------------------------------ metrics


def row_pearson(a: torch.Tensor, b: torch.Tensor, min_keys: int = MIN_KEYS) -> float:
    """Mean over query rows (of all leading dims) of the Pearson correlation between a and b `[..., T, T]` over
    each row's causal entries (key s <= query t). Rows with fewer than `min_keys` keys, or constant in a or b,
    are left out; NaN when none is left."""
    length = a.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=a.device).tril()
    n = causal.sum(-1).to(torch.float64)
    a, b = (t.to(torch.float64).masked_fill(~causal, 0.0) for t in (a, b))
    da = (a - a.sum(-1, keepdim=True) / n[:, None]).masked_fill(~causal, 0.0)
    db = (b - b.sum(-1, keepdim=True) / n[:, None]).masked_fill(~causal, 0.0)
    va, vb = (da * da).sum(-1), (db * db).sum(-1)
    keep = (n >= min_keys) & (va > 1e-24 * n) & (vb > 1e-24 * n)
    if not bool(keep.any()):
        return float("nan")
    r = (da * db).sum(-1) / (va * vb).clamp_min(1e-300).sqrt()
    return float(r[keep].mean())


def output_metrics(y: torch.Tensor, t: torch.Tensor) -> dict[str, float]:
    y, t = y.double(), t.double()
    err, energy = (y - t).pow(2).sum(), t.pow(2).sum()
    cos = torch.nn.functional.cosine_similarity(y, t, dim=-1, eps=1e-12)
    return {"mse": float((y - t).pow(2).mean()), "rel_mse": float(err / energy), "cosine": float(cos.mean()),
            "norm_ratio": float(y.norm() / t.norm())}


@torch.no_grad()
def measure(probe: Probe, x: torch.Tensor, positions: torch.Tensor, target: torch.Tensor,
            teacher_logits: torch.Tensor, teacher_probs: torch.Tensor) -> LayerFidelity:
    """A probe's fidelity on one layer's input x, against the teacher's output and attention on it."""
    out = output_metrics(probe.output(x, positions), target)
    return LayerFidelity(**out, qk_corr=row_pearson(probe.scores(x, positions), teacher_logits),
                         mix_corr=row_pearson(probe.mixing(x, positions), teacher_probs))


# ------------------------------------------------------------------------------------------------ the report


@dataclass
class Subject:
    """One mixer with one set of options (a variant), as the report names it."""

    mixer: str
    variant: str  # "default" (the job's options) or the variant's own spelling, e.g. "conv_init=random"
    options: dict[str, Any]


def parse_variant(text: str) -> dict[str, Any]:
    """'conv_init=random,short_conv=false' -> {'conv_init': 'random', 'short_conv': False} (YAML scalars)."""
    import yaml

    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"--variant '{text}': '{part}' is not key=value (e.g. conv_init=random,rope=true)")
        out[key.strip()] = yaml.safe_load(value.strip())
    if not out:
        raise ValueError(f"--variant '{text}' sets no option")
    return out


# --variant authors: each mixer's new parameters as its authors initialise them (the options it has of
# LEGACY_OPTION_VALUES), whatever those options are called
AUTHORS = "authors"


def authors_options(mixer: str) -> dict[str, Any]:
    """The options that make `mixer` start as its authors' layers do (the harness's init until 2026-12-01)."""
    from harness.mixers import LEGACY_OPTION_VALUES

    allowed = {f.name for f in fields(mixer_class(mixer).Options)}
    return {k: v for k, v in LEGACY_OPTION_VALUES.items() if k in allowed}


def subjects(mixers: Sequence[str], job_options: dict[str, Any], variants: Sequence[str]) -> tuple[list[Subject], list[str]]:
    """Every (mixer, variant) to measure, and notes on what was left out. The job's options apply to each mixer
    that has them; a variant applies to the mixers that have all of its options."""
    out, notes = [], []
    for name in mixers:
        allowed = {f.name for f in fields(mixer_class(name).Options)}
        base = {k: v for k, v in job_options.items() if k in allowed}
        dropped = sorted(set(job_options) - allowed)
        if dropped:
            notes.append(f"{name}: the job's option(s) {', '.join(dropped)} do not apply to it")
        out.append(Subject(name, "default", base))
        for text in variants:
            extra = authors_options(name) if text == AUTHORS else parse_variant(text)
            if set(extra) - allowed:
                notes.append(f"{name}: variant '{text}' left out ({', '.join(sorted(set(extra) - allowed))} "
                             "is not one of its options)")
                continue
            out.append(Subject(name, text, {**base, **extra}))
    return out, notes


def resolve_mixers(spec: Optional[str], job_mixer: str) -> list[str]:
    """--mixer: None (the job's), 'all', or a comma list of names."""
    if not spec:
        return [job_mixer]
    if spec == "all":
        return list(MIXERS)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        mixer_class(n)  # a clear error naming the valid mixers
    return names


def sample_sequences(corpus: Any, sequences: int, seq_len: int) -> tuple[torch.Tensor, str]:
    """`sequences` rows of held-out text (the corpus's validation split; the first training sequences when it has
    too few), cut to `seq_len` tokens. Returns (input_ids `[sequences, seq_len]`, where they came from)."""
    import numpy as np

    split, origin = corpus.validation, "validation split"
    if split is None or split.num_sequences < sequences:
        split, origin = corpus.train, "training split (the validation split is too small)"
    if split.num_sequences < sequences:
        raise ValueError(f"--sequences {sequences}: the corpus holds only {split.num_sequences} sequences")
    ids = split.batch(np.arange(sequences, dtype=np.int64))["input_ids"]
    if seq_len > ids.shape[1]:
        raise ValueError(f"--seq-len {seq_len} is longer than the job's sequences (data.seq_len={ids.shape[1]})")
    return ids[:, :seq_len], origin


def stage1_mixer(job: Any, config: Any, teacher_layer: nn.Module, layer: int, weights: Path) -> Mixer:
    """Layer `layer`'s mixer with its stage-1 weights."""
    from harness.stages.align import init_mixer, read_layer_tensors

    mixer = init_mixer(teacher_layer, config, layer, job.seed)
    mixer.load_state_dict(read_layer_tensors(weights, f"model.layers.{layer}.mixer."))
    return mixer


def transfer_report(job: Any, *, mixers: Sequence[str], variants: Sequence[str] = (), layers: Optional[Sequence[int]] = None,
                    sequences: int = 2, seq_len: int = 512, device: Optional[torch.device] = None,
                    progress: bool = True) -> dict[str, Any]:
    """Measure every (mixer, variant, layer) at init, and the job's own mixer after stage 1 where the run has it.
    Returns the JSON-able report: {"job", "teacher", "data", "subjects", "notes", "rows", "summary"}."""
    from tqdm import tqdm

    from harness.data import prepare_job_corpus
    from harness.stages.align import find_group_weights, first_batch, init_mixer, stage_autocast
    from harness.stages.common import load_job_teacher, resolve_device
    from harness.student import FIT_KINDS, fit_output_scales, rope_for, student_config, student_rotary
    from harness.teacher import capture_activations

    device = device or resolve_device(job)
    teacher = load_job_teacher(job, device)
    model = teacher.model
    n_layers = model.config.num_hidden_layers
    chosen = sorted(set(layers)) if layers is not None else list(range(n_layers))
    if not chosen or chosen[0] < 0 or chosen[-1] >= n_layers:
        raise ValueError(f"layers {list(layers or [])} outside the teacher's 0-{n_layers - 1}")
    todo, notes = subjects(mixers, dict(job.student.options), variants)
    corpus = prepare_job_corpus(job, teacher.tokenizer, max_positions=model.config.max_position_embeddings)
    ids, origin = sample_sequences(corpus, sequences, seq_len)
    ids = ids.to(device)
    positions = torch.arange(ids.shape[1], device=device)[None].expand(ids.shape[0], -1)
    acts = capture_activations(model, ids, layers=chosen, kinds=("attn_input", "attn_output"))
    fit_ids = first_batch(job, corpus).to(device)  # what stage 1 fits the output scales on
    fit_acts = capture_activations(model, fit_ids, layers=chosen, kinds=FIT_KINDS)
    stage1 = find_group_weights(job, "align_mixer")
    own = Subject(job.student.mixer, "default", dict(job.student.options))
    configs = {id(s): student_config(model.config, s.mixer, s.options) for s in todo}
    rows = []
    bar = tqdm(total=len(chosen) * len(todo), desc="transfer", unit="mixer-layer", disable=not progress)
    for layer in chosen:
        x = acts.attn_input[layer].float()
        target = acts.attn_output[layer].float()
        teacher_probe = AttentionProbe.of_teacher(model, layer)
        with torch.no_grad():
            logits = teacher_probe.scores(acts.attn_input[layer], positions)
            probs = teacher_probe.mixing(acts.attn_input[layer], positions)
        t_layer = model.model.layers[layer]
        for s in todo:
            config = configs[id(s)]
            rotary = student_rotary(config)
            rotary = rotary.to(device) if rotary is not None else None
            start = init_mixer(t_layer, config, layer, job.seed).to(device)
            fit_output_scales({layer: start}, fit_acts, rope_for(config, device)(fit_ids), stage_autocast(job, device))
            measured = {"init": start}
            if s.mixer == own.mixer and s.options == own.options and layer in stage1:
                measured["stage1"] = stage1_mixer(job, config, t_layer, layer, stage1[layer])
            for when, mixer in measured.items():
                fid = measure(MixerProbe(mixer.to(device).eval(), rotary), x, positions, target, logits, probs)
                rows.append({"mixer": s.mixer, "variant": s.variant, "when": when, "layer": layer, **asdict(fid)})
            bar.update(1)
    bar.close()
    return {
        "job": job.name, "teacher": job.teacher.source, "teacher_layers": n_layers,
        "data": {"origin": origin, "sequences": int(ids.shape[0]), "seq_len": int(ids.shape[1])},
        "seed": job.seed, "layers": chosen,
        "subjects": [asdict(s) for s in todo], "notes": notes, "rows": rows, "summary": summarise(rows),
    }


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (mixer, variant, when): each metric's mean over layers (NaN-free layers only) and the layer count."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["mixer"], r["variant"], r["when"]), []).append(r)
    out = []
    for (mixer, variant, when), rs in groups.items():
        means = {}
        for m in METRICS:
            vals = [r[m] for r in rs if not math.isnan(r[m])]
            means[m] = sum(vals) / len(vals) if vals else float("nan")
        out.append({"mixer": mixer, "variant": variant, "when": when, "layers": len(rs), **means})
    return out


def markdown(report: dict[str, Any], per_layer: bool = False) -> str:
    """The report as Markdown: one summary row per (mixer, variant, when); per layer too with `per_layer`."""
    d = report["data"]
    lines = [f"# Transfer fidelity: {report['job']}", "",
             f"Teacher `{report['teacher']}` ({report['teacher_layers']} layers), {d['sequences']} sequences x "
             f"{d['seq_len']} tokens of the {d['origin']}, seed {report['seed']}. Means over layers "
             f"{_span(report['layers'])}; docs/TRANSFER.md says what each column means.", ""]
    header = "| mixer | variant | when | mse | rel_mse | cosine | norm_ratio | qk_corr | mix_corr |"
    rule = "|---|---|---|---|---|---|---|---|---|"
    lines += [header, rule] + [_row(r, r["variant"]) for r in report["summary"]]
    if report["notes"]:
        lines += [""] + [f"- {note}" for note in report["notes"]]
    if per_layer:
        lines += ["", "## Per layer", "", header.replace("| variant |", "| variant | layer |"),
                  rule + "---|"]
        lines += [_row(r, f"{r['variant']} | {r['layer']}") for r in report["rows"]]
    return "\n".join(lines) + "\n"


def _row(r: dict[str, Any], label: str) -> str:
    return f"| {r['mixer']} | {label} | {r['when']} | " + " | ".join(_fmt(r[m]) for m in METRICS) + " |"


def _fmt(v: float) -> str:
    return "-" if math.isnan(v) else (f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}")


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else str(layers)


def write_report(report: dict[str, Any], out: Path, per_layer: bool = False) -> tuple[Path, Path]:
    """transfer.json and transfer.md under `out` (written whole, then renamed into place)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = out / REPORT_JSON, out / REPORT_MD
    for path, text in zip(paths, (json.dumps(report, indent=1), markdown(report, per_layer))):
        atomic_write_text(path, text)
    return paths
