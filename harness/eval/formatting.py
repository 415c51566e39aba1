"""What the reports of every evaluation task share: number formats, run and teacher names, the held-out window,
matplotlib figures.

    fmt(value, pct)              -> '0.4821', '48.2%', '-' for a missing value
    fmt_ci(value, interval, pct) -> '0.512 [0.480, 0.540]', '85.2% [70.1, 99.3]'
    run_name(report)             -> 'LABEL [MIXER]', a run's name in tables and plots
    teachers(reports)            -> ("teacher", report) per distinct teacher result (copies of one cache merged)
    heldout_window(report, dir)  -> the length of the windows its held-out text was scored in
    heldout_comparison(a, b)     -> whether two runs' held-out measures may be differenced, and the rows' note
    figure(width, height)        -> a matplotlib Figure without pyplot

The report (harness.eval.report) and the tasks' own sections (harness.eval.tasks) import it, so it imports neither.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

PERPLEXITY_FILE = "perplexity.json"  # the held-out perplexity's result file (harness.eval.tasks.perplexity)
NO_INTERVAL = "aggregate only: no per-document values are stored"


def read_json(path: Optional[Path]) -> Optional[dict]:
    """The JSON file at `path`; None when there is none (or no path)."""
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


def fmt(value: Optional[float], pct: bool = False) -> str:
    """A value with 4 significant digits, or a percentage with one decimal; '-' when missing or NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{100 * value:.1f}%" if pct else f"{value:.4g}"


def fmt_ci(value: Optional[float], interval: Optional[list[float]], pct: bool = False) -> str:
    """A value and its interval: '0.512 [0.48, 0.54]', '85.2% [70.1, 99.3]'; the value alone without one."""
    if value is None or not interval:
        return fmt(value, pct)
    scale, digits = (100, ".1f") if pct else (1, ".3f")
    return f"{fmt(value, pct)} [{scale * interval[0]:{digits}}, {scale * interval[1]:{digits}}]"


def run_name(report: dict) -> str:
    """A run's name in comparisons: its label and, in brackets, its mixer."""
    return report["label"] + (f" [{report['mixer']}]" if report.get("mixer") else "")


def heldout_window(report: dict, student_dir: Optional[Path] = None) -> Optional[int]:
    """The length in tokens of the windows that a run's held-out perplexity (and stage 3's validation CE and KL,
    on the same split) were computed over: the job's data.seq_len. Recorded in the report (reports written
    before 2026-12-04 lack it), else read from the student's perplexity.json; None where neither says."""
    recorded = (report.get("perplexity") or {}).get("seq_len")
    if recorded is None and student_dir is not None and (Path(student_dir) / PERPLEXITY_FILE).is_file():
        recorded = json.loads((Path(student_dir) / PERPLEXITY_FILE).read_text()).get("seq_len")
    return recorded


def heldout_comparison(a: dict, a_dir: Optional[Path], b: dict, b_dir: Optional[Path]) -> tuple[bool, str]:
    """Whether two runs' held-out measures (perplexity, stage 3's validation CE and KL) were taken in windows of
    different lengths, so that they are not differenced (a token's loss depends on its context), and the note the
    paired rows of those measures carry (reports a, b; their student result folders a_dir, b_dir)."""
    windows = heldout_window(a, a_dir), heldout_window(b, b_dir)
    apart = None not in windows and windows[0] != windows[1]
    return apart, (f"not comparable: held out in windows of {windows[0]} and {windows[1]} tokens" if apart
                   else NO_INTERVAL)


def _teacher_tag(report: dict) -> str:
    """A teacher result folder named by its cache and its own name, e.g. 'teacher-2048/smollm2-...-6d2644406e52'."""
    folder = Path(report["teacher_dir"])
    return str(folder.relative_to(folder.parent.parent))


def _teacher_results(report: dict) -> dict:
    """The teacher's side of a report: per benchmark task, and per section that has one (average, NIAH, ...)."""
    sides = {("tasks", task): row.get("teacher") for task, row in (report.get("tasks") or {}).items()}
    sides.update({(key,): section["teacher"] for key, section in report.items()
                  if key != "tasks" and isinstance(section, dict) and "teacher" in section})
    return sides


def _merged_if_same(a: dict, b: dict) -> Optional[dict]:
    """One teacher report for two result folders that are copies of one cache (runs moved into docs/results/ from
    different output directories): the same tag, the same tasks and every result both hold equal; a section only
    one holds is taken from it. None where they differ."""
    if _teacher_tag(a) != _teacher_tag(b) or set(a.get("tasks") or {}) != set(b.get("tasks") or {}):
        return None
    ours, theirs = _teacher_results(a), _teacher_results(b)
    if any(ours[k] != theirs[k] for k in ours.keys() & theirs.keys() if None not in (ours[k], theirs[k])):
        return None
    merged = dict(a)
    for key in [k for k in theirs if len(k) == 1 and ours.get(k) is None and theirs[k] is not None]:
        merged[key[0]] = {**(a.get(key[0]) or {}), "teacher": theirs[key]}
    return merged


def teachers(reports: list[dict]) -> list[tuple[str, dict]]:
    """(row name, report) for each distinct teacher result (its rows are the same in every report that shares
    it; folders holding the same results under the same cache name count once): "teacher", or where there are
    several, named by their held-out window or their folder."""
    distinct: list[dict] = []
    for report in {r.get("teacher_dir"): r for r in reports if r.get("teacher_dir")}.values():
        for i, kept in enumerate(distinct):
            if (merged := _merged_if_same(kept, report)) is not None:
                distinct[i] = merged
                break
        else:
            distinct.append(report)
    if len(distinct) < 2:
        return [("teacher", r) for r in distinct]
    windows = [heldout_window(r) for r in distinct]
    if None in windows or len(set(windows)) < len(windows):
        tags = [_teacher_tag(r) for r in distinct]
        if len(set(tags)) < len(tags):  # one cache name, different results: the whole folders
            tags = [str(r["teacher_dir"]) for r in distinct]
    else:
        tags = [f"{w}-token windows" for w in windows]
    return [(f"teacher ({tag})", r) for tag, r in zip(tags, distinct)]


def figure(width: float = 7.0, height: float = 4.0):
    """A matplotlib Figure on the Agg canvas (no pyplot, no global state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig
