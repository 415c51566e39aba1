"""A run's training losses, read back from its stages' metrics: the final loss of each stage and the loss curves.

    training_summary(run_dir)   -> {"final": {...}, "curves": {...}, "distill_throughput": {...}, "startup": {...}}
                                   (None when the run has no stage metrics)
    plot_loss_curves(summaries, path)                                  one panel per stage, one line per run

Stages 1 and 2 log, per layer group, the MSE of every layer (`loss/layer_NN`); their curve is the mean over all
the student's layers at each step (the groups step in lockstep over the same batches). Stage 3 logs the total
training loss (the weighted sum of its terms: ce_weight x CE + kl_weight x KL by default) and every loss term by
name per step (`loss_terms` in a line names them; lines without it are read as CE and KL), the validation of each
term (val_<term>) and the perplexity at its end (and every `validate_every` steps); the summary carries every term.
"Final" training values are means over the logged steps in the last FINAL_FRACTION of the stage (at least the last
logged step), which says more than one noisy step; validation values are the last validation.

Stage 3's throughput (`distill_throughput`) is read from the same lines' wall-clock times and token counts, interval by
interval, not from their `tokens_per_s` (the logger's sliding window of 20 lines, which smears a pause over the next
200 steps): the whole stage's rate, and the median and 90th percentile over the intervals between lines. Pauses
(checkpoints, evaluations sharing the GPU, a resume's restart) lower the whole and the median; the 90th percentile
is the loop's own rate where at least a tenth of the intervals ran undisturbed.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Optional

from harness.observe import read_metrics

ALIGN_STAGES = ("align_mixer", "align_hidden")
FINAL_FRACTION = 0.1
LAYER_PREFIX = "loss/layer_"


def align_curve(run_dir: Path, stage: str) -> Optional[dict]:
    """Mean per-layer MSE over all layer groups at each step: {"tokens": [...], "loss": [...], "layers": n}."""
    by_step: dict[int, dict[str, float]] = {}
    tokens: dict[int, int] = {}
    for metrics in sorted((run_dir / stage).glob("*/metrics.jsonl")):
        for row in read_metrics(metrics):
            layers = {k: v for k, v in row.items() if k.startswith(LAYER_PREFIX)}
            if layers and "step" in row:
                by_step.setdefault(row["step"], {}).update(layers)
                tokens[row["step"]] = row.get("tokens", 0)
    if not by_step:
        return None
    n_layers = max(len(v) for v in by_step.values())
    steps = [s for s in sorted(by_step) if len(by_step[s]) == n_layers]  # every group has logged this step
    return {"steps": steps, "tokens": [tokens[s] for s in steps],
            "loss": [sum(by_step[s].values()) / n_layers for s in steps], "layers": n_layers}


DEFAULT_TERMS = ("ce", "kl")  # the terms stage 3 logs by default, and all that lines without `loss_terms` hold


def distill_curves(run_dir: Path) -> Optional[dict]:
    """Stage 3's training loss and each loss term per step, and its validations: {"steps", "tokens", "terms" (the
    logged terms' names, ce and kl first), "loss", <term>..., "val_tokens", "val_<term>"..., "val_ppl"}."""
    rows = read_metrics(run_dir / "distill" / "metrics.jsonl")
    train = {r["step"]: r for r in rows if "loss" in r}  # a resumed run logs its steps again: keep the last
    val = [r for r in rows if "val_ce" in r]
    if not train:
        return None
    steps = sorted(train)
    terms = logged_terms([train[s] for s in steps])
    return {"steps": steps, "tokens": [train[s]["tokens"] for s in steps], "terms": terms,
            **{key: [train[s].get(key) for s in steps] for key in ("loss", *terms)},
            "val_tokens": [r["tokens"] for r in val],
            **{key: [r.get(key) for r in val] for key in (*(f"val_{t}" for t in terms), "val_ppl")}}


def distill_throughput(run_dir: Path) -> Optional[dict]:
    """Stage 3's tokens/s from its training lines' times and tokens: {"whole" (tokens / seconds over every interval),
    "median", "p90" (over the intervals between consecutive lines), "intervals"}; None with fewer than two lines."""
    rows = [r for r in read_metrics(run_dir / "distill" / "metrics.jsonl") if {"loss", "time", "tokens"} <= r.keys()]
    spans = [(b["tokens"] - a["tokens"], b["time"] - a["time"]) for a, b in zip(rows, rows[1:])
             if b["step"] > a["step"] and b["time"] > a["time"] and b["tokens"] > a["tokens"]]
    if not spans:
        return None
    rates = sorted(tokens / seconds for tokens, seconds in spans)
    return {"whole": sum(t for t, _ in spans) / sum(s for _, s in spans), "median": statistics.median(rates),
            "p90": rates[min(len(rates) - 1, math.ceil(0.9 * len(rates)) - 1)], "intervals": len(rates)}


STAGE_FOLDERS = {"align_mixer": "align_mixer/*/metrics.jsonl", "align_hidden": "align_hidden/*/metrics.jsonl",
                 "distill": "distill/metrics.jsonl", "sft": "sft/metrics.jsonl"}


def stage_startups(run_dir: Path) -> dict[str, dict]:
    """Each stage's start-up, summed over the processes that ran it (every layer group, every resume): {stage:
    {"processes", "setup_s" (process start to the stage's logger), "first_log_s" (to its first line)}}, from the
    first lines' `startup_setup_s` / `startup_first_log_s` (harness.observe.RunLogger); stages without them are left
    out."""
    found: dict[str, dict] = {}
    for stage, pattern in STAGE_FOLDERS.items():
        starts = [r for path in sorted(run_dir.glob(pattern)) for r in read_metrics(path)
                  if {"startup_setup_s", "startup_first_log_s"} <= r.keys()]
        if starts:
            found[stage] = {"processes": len(starts), "setup_s": sum(r["startup_setup_s"] for r in starts),
                            "first_log_s": sum(r["startup_first_log_s"] for r in starts)}
    return found


def logged_terms(train: list[dict]) -> list[str]:
    """The loss terms of stage 3's training lines: ce and kl, then the others in the order the lines name them."""
    named = [t for r in train for t in r.get("loss_terms") or () if isinstance(t, str)]
    return [*DEFAULT_TERMS, *dict.fromkeys(t for t in named if t not in DEFAULT_TERMS)]


def _tail_mean(steps: list[int], values: list) -> Optional[float]:
    """Mean of the values logged in the last FINAL_FRACTION of the steps (at least the last one)."""
    start = min(steps[-1] * (1 - FINAL_FRACTION), steps[-1])
    tail = [v for s, v in zip(steps, values) if s >= start and v is not None and math.isfinite(v)]
    return sum(tail) / len(tail) if tail else None


def training_summary(run_dir: str | Path) -> Optional[dict]:
    """The final losses and the curves of every stage that logged metrics in run_dir; None if none did."""
    run_dir = Path(run_dir)
    curves = {stage: align_curve(run_dir, stage) for stage in ALIGN_STAGES}
    curves["distill"] = distill_curves(run_dir)
    curves = {k: v for k, v in curves.items() if v}
    if not curves:
        return None
    final: dict = {stage: _tail_mean(curves[stage]["steps"], curves[stage]["loss"])
                   for stage in ALIGN_STAGES if stage in curves}
    if "distill" in curves:
        d = curves["distill"]
        final["distill"] = {key: _tail_mean(d["steps"], d[key]) for key in ("loss", *d["terms"])}
        final["distill"].update({key: (d[key][-1] if d[key] else None)
                                 for key in (*(f"val_{t}" for t in d["terms"]), "val_ppl")})
        final["distill"]["terms"] = d["terms"]
        final["distill"]["tokens"] = d["tokens"][-1]
    return {"run_dir": str(run_dir), "final_fraction": FINAL_FRACTION, "final": final, "curves": curves,
            "alignment_loss": alignment_losses(run_dir), "distill_throughput": distill_throughput(run_dir),
            "startup": stage_startups(run_dir)}


def alignment_losses(run_dir: Path) -> dict[str, str]:
    """Which loss stages 1 and 2 logged (stages.<stage>.loss of RUN/job.yaml: mse unless the job says l2)."""
    import yaml

    try:
        job = yaml.safe_load((run_dir / "job.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        job = {}
    stages = job.get("stages") if isinstance(job, dict) else None
    stages = stages if isinstance(stages, dict) else {}
    return {stage: str((stages.get(stage) or {}).get("loss", "mse")) for stage in ALIGN_STAGES}


PANELS = (("align_mixer", "loss", "stage 1: mixer-output {loss} (mean over layers)"),
          ("align_hidden", "loss", "stage 2: hidden-state {loss} (mean over layers)"),
          ("distill", "ce", "stage 3: CE (training; dots: validation)"))
LOSS_TITLES = {"mse": "MSE", "l2": "L2 norm"}


def panel_loss(summaries: dict[str, dict], stage: str) -> tuple[str, set[str]]:
    """The loss a stage-1/2 panel shows, for its title, and the runs that logged another one (labelled with it):
    "MSE" when every run logged the MSE, "L2 norm" when every run the L2 norm, else "MSE; (l2): L2 norm"."""
    losses = {name: ((s or {}).get("alignment_loss") or {}).get(stage, "mse") for name, s in summaries.items()}
    kinds = set(losses.values())
    if len(kinds) == 1:
        return LOSS_TITLES.get(next(iter(kinds)), next(iter(kinds))), set()
    return "MSE; (l2): L2 norm", {name for name, loss in losses.items() if loss != "mse"}


def run_line_style(i: int) -> dict:
    """The colour and dash of the i-th run's line in a plot of several runs (these loss curves, the report's NIAH
    by length): matplotlib's ten colours, dashed past ten runs, dotted past 20."""
    return {"color": f"C{i % 10}", "linestyle": ("-", "--", ":")[i // 10 % 3]}


def plot_loss_curves(summaries: dict[str, dict], path: str | Path) -> Path:
    """One panel per stage (log-scale loss against tokens), one line per run; stage 3's validation CE as dots."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PANELS))
    for ax, (stage, key, title) in zip(axes, PANELS):
        loss, marked = panel_loss(summaries, stage) if stage != "distill" else ("", set())
        for i, (name, summary) in enumerate(summaries.items()):
            curve = (summary or {}).get("curves", {}).get(stage)
            if not curve:
                continue
            style = run_line_style(i)
            label = f"{name} (l2)" if name in marked else name
            ax.plot([t / 1e6 for t in curve["tokens"]], curve[key], label=label, linewidth=1, **style)
            if stage == "distill" and curve.get("val_tokens"):
                ax.scatter([t / 1e6 for t in curve["val_tokens"]], curve["val_ce"], color=style["color"], s=18,
                           zorder=3)
        ax.set_yscale("log")
        ax.set_xlabel("tokens (M)")
        ax.set_title(title.format(loss=loss), fontsize=10)
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)
