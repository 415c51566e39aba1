"""What a NIAH run's sample records add up to: niah.json (`summarise`: exact match and the likelihood score, overall
and by length, kind and depth, per cell), niah.csv (`write_csv`) and the depth x length heatmaps (`plot_heatmap`).
The measures are defined in harness.eval.niah's docstring."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from harness.files import atomic_write_text

if TYPE_CHECKING:
    from harness.eval.niah import NiahGrid

TIE_TOLERANCE = 1e-4  # candidates' log-probabilities (nats) this close count as tied (harness.eval.niah.rank_of_true)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


LIKELIHOOD_RULE = (
    "teacher-forced: the needle's value and its distractors (other values of its kind, drawn from the sample's "
    "seed, of the value's token count where the kind has enough) are each scored as the continuation ' VALUE' of "
    "the prompt by the sum of their tokens' log-probabilities (not length-normalised; same_token_count is the "
    "share of samples whose candidates all have one token count); top1 = 1 when the true value scores highest, "
    f"1/(1 + tied) when it ties (within {TIE_TOLERANCE} nats) at the top, else 0; accuracy = mean top1, chance = "
    "1/candidates; rank: 1 = best, ties at their mean rank, chance (candidates + 1)/2")


def _cell(rows: list[dict], kind: str, length: int, depth: float, max_positions: int | None) -> dict:
    """One (kind, length, depth) cell of niah.json from its samples' records."""
    correct = sum(bool(r["correct"]) for r in rows)
    return {"kind": kind, "length": length, "depth": depth, "samples": len(rows), "correct": correct,
            "accuracy": correct / len(rows), "likelihood_accuracy": _mean([r["top1"] for r in rows]),
            "mean_rank": _mean([r["rank"] for r in rows]),
            "beyond_max_positions": max_positions is not None and length > max_positions}


def _by(cells: list[dict], metric: str, field_name: str, values: list) -> dict[str, float]:
    """The mean of `metric` over the cells with each value of `field_name`, keyed by str(value)."""
    return {str(v): _mean([c[metric] for c in cells if c[field_name] == v]) for v in values}


def likelihood_summary(cells: list[dict], rows: list[dict], grid: NiahGrid) -> dict:
    """niah.json's "likelihood" block: accuracy (mean top1) and mean rank overall and by length, kind and depth,
    with the chance levels and the rule (LIKELIHOOD_RULE)."""
    k = 1 + grid.distractors
    dims = (("length", grid.lengths), ("kind", grid.kinds), ("depth", grid.depths))
    summary = {"candidates": k, "distractors": grid.distractors, "chance": 1 / k, "chance_rank": (k + 1) / 2,
               "scoring": LIKELIHOOD_RULE, "overall": _mean([c["likelihood_accuracy"] for c in cells]),
               "mean_rank": _mean([c["mean_rank"] for c in cells]),
               "same_token_count": _mean([float(len(set(r["candidate_tokens"])) == 1) for r in rows])}
    for name, values in dims:
        summary[f"by_{name}"] = _by(cells, "likelihood_accuracy", name, values)
    for name, values in dims:
        summary[f"mean_rank_by_{name}"] = _by(cells, "mean_rank", name, values)
    return {**summary, **first_token_summary(rows, grid)}


def _first_choice_share(rows: list[dict], prefix: str = "first_token") -> float:
    return _mean([float(r[f"{prefix}_rank"] == 1) for r in rows])


FIRST_TOKEN_RULE = ("teacher-forced, at the answer's start: first_token_top1 = the share of samples whose value's "
                    "first token is the model's most likely next token over the whole vocabulary (what greedy "
                    "decoding starts with); first_token_gap = the mean log-probability (nats) of the most likely "
                    "token above the value's first token (0 where it is the value's); a value starting with a digit starts "
                    "with a lone space token in SmolLM2's tokenizer, so there it scores the start of a number")
VALUE_TOKEN_RULE = ("teacher-forced at the value's first token that carries a character of it (after the value's "
                    "tokens before it: a number's first digit after its lone space token; else its first token): "
                    "value_token_top1 = the share of samples where it is the model's most likely next token over the "
                    "whole vocabulary; value_token_gap = the mean log-probability (nats) of the most likely token "
                    "above it")


def first_token_summary(rows: list[dict], grid: NiahGrid) -> dict:
    """The likelihood block's first- and value-token parts, overall and by length (None where no record has the
    fields: results written before them)."""
    out = {}
    for prefix, rule in (("first_token", FIRST_TOKEN_RULE), ("value_token", VALUE_TOKEN_RULE)):
        scored = [r for r in rows if f"{prefix}_rank" in r]
        if not scored:
            out.update({f"{prefix}_top1": None, f"{prefix}_top1_by_length": None, f"{prefix}_gap": None})
            continue
        out.update({f"{prefix}_top1": _first_choice_share(scored, prefix),
                    f"{prefix}_top1_by_length": {str(n): _first_choice_share([r for r in scored if r["length"] == n],
                                                                              prefix) for n in grid.lengths},
                    f"{prefix}_gap": _mean([r[f"{prefix}_gap"] for r in scored]), f"{prefix}_scoring": rule})
    return out


def summarise(records: dict[tuple, dict], grid: NiahGrid, label: str, prompt_mode: str,
              max_positions: int | None) -> dict:
    """niah.json: both scores of `grid` from its sample records (all present, with the likelihood fields).

    {"label", "grid" (NiahGrid as a dict), "prompt_mode", "max_position_embeddings" (None for students),
     "scoring" (the exact-match rule, in words), "overall", "by_length" {"256": acc, ...}, "by_kind" {"passkey":
     acc, ...}, "by_depth" {"0.5": acc, ...} (exact match), "likelihood" (`likelihood_summary`), "cells":
     [{"kind", "length", "depth", "samples", "correct", "accuracy", "likelihood_accuracy", "mean_rank",
     "beyond_max_positions"}, ...] ordered by kind, length, depth}; accuracies are in [0, 1]. Files written
    before the likelihood score lack "likelihood" and the cells' likelihood fields.
    """
    cells, rows = [], []
    for kind in grid.kinds:
        for length in grid.lengths:
            for depth in grid.depths:
                cell_rows = [records[(kind, length, depth, i)] for i in range(grid.samples)]
                cells.append(_cell(cell_rows, kind, length, depth, max_positions))
                rows += cell_rows
    return {"label": label, "grid": asdict(grid), "prompt_mode": prompt_mode,
            "max_position_embeddings": max_positions,
            "scoring": "correct iff the needle value occurs as a whole word (no letter or digit on either side), "
                       "case-insensitively, in the first non-empty line of the greedy continuation",
            "overall": _mean([c["accuracy"] for c in cells]),
            "by_length": _by(cells, "accuracy", "length", grid.lengths),
            "by_kind": _by(cells, "accuracy", "kind", grid.kinds),
            "by_depth": _by(cells, "accuracy", "depth", grid.depths),
            "likelihood": likelihood_summary(cells, rows, grid), "cells": cells}


def write_csv(result: dict, path: Path) -> None:
    """niah.csv: one row per cell."""
    columns = ["kind", "length", "depth", "samples", "correct", "accuracy", "likelihood_accuracy", "mean_rank",
               "beyond_max_positions"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows({c: cell[c] for c in columns} for cell in result["cells"])


def plot_heatmap(result: dict, path: Path, metric: str = "accuracy") -> None:
    """Heatmaps of a cell metric ("accuracy": exact match, or "likelihood_accuracy"), depth (rows, 0% on top) x
    length (columns): one per kind, plus the mean over kinds."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    grid = result["grid"]
    lengths, depths, kinds = grid["lengths"], grid["depths"], grid["kinds"]
    acc = {(c["kind"], c["length"], c["depth"]): c[metric] for c in result["cells"]}
    panels = [(k, [[acc[(k, n, d)] for n in lengths] for d in depths]) for k in kinds]
    if len(kinds) > 1:
        panels.append(("mean over kinds", [[_mean([acc[(k, n, d)] for k in kinds]) for n in lengths]
                                           for d in depths]))
    cols = 2 if len(panels) == 4 else len(panels)  # three kinds and their mean: 2 x 2
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(1.5 + cols * (1.2 + 0.7 * len(lengths)), rows * (1.4 + 0.45 * len(depths))),
                 layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    image = None
    for n, (ax, (title, matrix)) in enumerate(zip(axes, panels)):
        image = ax.imshow(matrix, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [_short_length(x) for x in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        ax.set_title(title)
        if n % cols == 0:
            ax.set_ylabel("needle depth")
        if n >= len(panels) - cols:
            ax.set_xlabel("prompt length (tokens)")
        for row, values in enumerate(matrix):
            for col, value in enumerate(values):
                ax.text(col, row, f"{value:.0%}", ha="center", va="center", fontsize=8)
    fig.colorbar(image, ax=axes, label="accuracy", shrink=0.9)
    fig.suptitle(_heatmap_title(result, metric), fontsize=9)
    fig.savefig(path, dpi=120)


def _heatmap_title(result: dict, metric: str) -> str:
    samples = f"{result['grid']['samples']} samples per cell"
    if metric == "accuracy":
        return f"NIAH exact match: {result['label']}\n(overall {result['overall']:.1%}, {samples})"
    lik = result["likelihood"]
    return (f"NIAH likelihood: {result['label']}\n(true value first of {lik['candidates']}: "
            f"{lik['overall']:.1%}, chance {lik['chance']:.0%}; {samples})")


def _short_length(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def write_json(result: dict, path: Path) -> None:
    atomic_write_text(path, json.dumps(result, indent=2) + "\n")
