"""Paired differences between two runs: run B - run A in each headline metric, on the same examples and prompts.

Two students scored on the same benchmark examples and the same NIAH prompts share much of their noise: both
find the same examples hard. Each bootstrap replicate therefore draws one set of example indices and applies it
to both runs (and to their teachers, for the recoveries), and the 95% interval is the percentile range of the
replicate differences (harness.eval.recovery.paired_bootstrap: seeded by the metric's name, deterministic; a
task's replicates use the same indices as its per-run intervals in the report). That interval is narrower
than one from resampling the runs independently whenever the runs are correlated.

Metrics, B - A: first those of the recovery table (harness.eval.report), over its rows from every task,
  average normalised recovery  over the tasks both reports average (teacher clearly above chance); the tasks
                               are resampled independently (different examples) and their draws averaged
  average raw recovery         student / teacher, over the tasks both have
  per task                     the score, and the normalised recovery of the averaged tasks
then each registered task's own rows (harness.eval.tasks: EvalTask.paired_rows, in the registry's order), e.g.
  NIAH                         exact match and the likelihood score (top1), overall and by length, over the
                               prompts matched by (kind, length, depth, index)
  held-out perplexity          perplexity.json: an aggregate only (no per-document values are stored), so a plain
                               difference without an interval
and last stage 3's validation CE and KL, aggregates too.

A pair is refused (PairError) unless both runs were scored on the same examples in what both have: the limit and
documents of the recovery table's shared tasks, and what each task checks (EvalTask.example_differences: for NIAH
the same grid, seed, haystack, prompt mode and tokenizer). What only one run has (a task added after the other
was evaluated, an evaluation cut short) is left out and named in the pair's "unpaired" (EvalTask.unpaired).

    parse_pairs("A:B,C:D") / baseline_pairs(name, runs)   -> [(A, B), ...] as given
    load_run(path, report)                               -> RunResults (result folders via report.eval_dirs;
                                                            each task's data: EvalTask.pairing)
    resolve_pairs(specs, runs)                           -> [(run A, run B)], unknown names refused
    difference(a, b, stream=...)                         -> one metric's B - A with its paired interval
    paired_report(a, b)                                  -> {"a", "b", "rows", "unpaired", ...}; PairError if the
                                                            examples both have differ
    paired_markdown(pairs)                               -> the "Paired differences" section of comparison.md
    paired_along(run_a, run_b)                           -> the same rows at each token count both runs were
                                                            evaluated at along stage 3 (eval/during/tokens-N);
                                                            a run with no final report pairs as AlongOnly
    side_by_side(a, b, out)                              -> two evaluations compared in out/, with B - A (the
                                                            post-trained student's against the distilled one's)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from harness.eval.formatting import NO_INTERVAL, heldout_comparison, teachers  # noqa: F401  (NO_INTERVAL: its old home)
from harness.eval.history import read_history, run_name, snapshot_reports
from harness.eval.recovery import (BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED, LEVEL, difference, normalised_draws,
                                   normalised_recovery, paired_bootstrap)
from harness.eval.recovery import paired_row as _row
from harness.eval.report import eval_dirs, paired_columns, report_file
from harness.eval.tasks import tasks
from harness.eval.tasks.niah import NIAH_SETTINGS, NiahPrompts, read_niah_prompts  # noqa: F401  (their old home)


class PairError(ValueError):
    """A pair that cannot be compared: an unknown run name, or runs scored on different examples."""


@dataclass(frozen=True)
class RunResults:
    """What the paired differences read of one run: its report and, from its result folders, the student's and
    the teacher's per-example results of the recovery table's rows, and each task's own data (EvalTask.pairing:
    the student's NIAH prompts, ...)."""

    label: str
    names: tuple[str, ...]  # what a pair may call the run: its label, its directory's name
    report: dict
    student_dir: Path
    teacher_dir: Optional[Path]
    examples: dict[str, dict]  # {row: per-example results} of the student (EvalTask.recovery_examples)
    teacher_examples: dict[str, dict]
    data: dict[str, Any]  # {task name: EvalTask.pairing of the student's results}


@dataclass(frozen=True)
class AlongOnly:
    """A run with evaluations along stage 3 and no final report yet (a lease ended inside its evaluation): a pair
    with it gets the differences along stage 3 only."""

    label: str
    names: tuple[str, ...]
    run_dir: Path


# --------------------------------------------------------------------------------------------- reading


def _examples(folder: Optional[Path], teacher_of: Optional[Path] = None) -> dict[str, dict]:
    """The per-example results of the recovery table's rows in a result folder, from every task; with
    `teacher_of` (the student's folder), `folder` is the teacher folder and each task reads its own
    (EvalTask.teacher_folder)."""
    found: dict[str, dict] = {}
    for task in tasks():
        where = folder if teacher_of is None else task.teacher_folder(teacher_of, folder)
        found.update(task.recovery_examples(where))
    return found


def run_dir(path: str | Path) -> Path:
    """The run directory of a run given as RUN_DIR, its eval folder or its report.json (an evaluation folder
    outside a run is its own)."""
    return _above_eval(report_file(path).parent)


def _above_eval(folder: Path) -> Path:
    """RUN_DIR for RUN_DIR/eval, else the folder itself."""
    return folder.parent if folder.name == "eval" else folder


def run_names(path: str | Path, report: dict) -> tuple[str, ...]:
    """The names a pair may use for the run at `path`: its report's label and its run directory's name."""
    return tuple(dict.fromkeys([report["label"], run_dir(path).name]))


def along_only(path: str | Path, label: Optional[str] = None) -> AlongOnly:
    """A run directory (or its eval folder) known by its history alone: its label (from the history unless given),
    and its name."""
    folder = _above_eval(Path(path))
    label = label or run_name(folder, read_history(folder / "eval"))
    return AlongOnly(label, tuple(dict.fromkeys([label, folder.name])), folder)


def load_run(path: str | Path, report: dict) -> RunResults:
    """One run's results for pairing, read from its result folders where they lie now (report.eval_dirs)."""
    student, teacher = eval_dirs(path, report)
    data = {task.name: task.pairing(student, report) for task in tasks()}
    return RunResults(report["label"], run_names(path, report), report, student, teacher, _examples(student),
                      _examples(teacher, student) if teacher is not None else {}, data)


# --------------------------------------------------------------------------------------------- pairs


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """'A:B,C:D' -> [("A", "B"), ("C", "D")]: each pair is read as B - A."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        a, sep, b = item.partition(":")
        if not sep or not a or not b or ":" in b:
            raise PairError(f"--pairs takes A:B,C:D (run labels or directory names, B - A), not '{item}'.")
        pairs.append((a, b))
    return pairs


def baseline_pairs(baseline: str, runs: Sequence[RunResults | AlongOnly]) -> list[tuple[str, str]]:
    """Every run minus the baseline: [(baseline, run label), ...] for the other runs."""
    base = find_run(baseline, runs)
    return [(baseline, r.label) for r in runs if r is not base]


def find_run(name: str, runs: Sequence[RunResults | AlongOnly]) -> RunResults | AlongOnly:
    """The run a label or directory name means, a label before a directory name (a job run twice: LABEL and
    LABEL#2 share their directory's name); PairError naming the known names when none or several match."""
    matches = [r for r in runs if r.label == name] or [r for r in runs if name in r.names]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(dict.fromkeys(n for r in runs for n in r.names))
    what = "matches several runs" if matches else "is not one of the runs"
    raise PairError(f"'{name}' {what}; the runs are called: {known}.")


def resolve_pairs(specs: Sequence[tuple[str, str]],
                  runs: Sequence[RunResults | AlongOnly]) -> list[tuple[RunResults | AlongOnly, RunResults | AlongOnly]]:
    """The (A, B) runs of each pair, once each, in the order given; a run paired with itself is refused."""
    pairs = []
    for a_name, b_name in dict.fromkeys(specs):
        a, b = find_run(a_name, runs), find_run(b_name, runs)
        if a is b:
            raise PairError(f"'{a_name}:{b_name}' pairs the run {a.label} with itself.")
        pairs.append((a, b))
    return pairs


# --------------------------------------------------------------------------------------------- same examples


def example_differences(a: RunResults, b: RunResults) -> list[str]:
    """What differs between the examples the two runs were scored on, in what both have ([] when the same)."""
    found = []
    shared = [t for t in scored_tasks(a) if t in scored_tasks(b)]
    if shared and a.report.get("limit") != b.report.get("limit"):
        found.append(f"benchmark limit ({a.report.get('limit')} against {b.report.get('limit')})")
    for task in shared:
        found += _task_difference(task, a, b)
    return found + [what for task in tasks() for what in task.example_differences(a, b)]


def unpaired(a: RunResults, b: RunResults) -> list[str]:
    """What only one of the two runs was scored on (a task added after the other's evaluation, an evaluation cut
    short): left out of the differences and named beside them."""
    only = [(x, [t for t in scored_tasks(x) if t not in scored_tasks(y)]) for x, y in ((a, b), (b, a))]
    found = [f"benchmarks {', '.join(names)} (only {x.label} has them)" for x, names in only if names]
    return found + [what for task in tasks() for what in task.unpaired(a, b)]


def scored_tasks(run: RunResults) -> list[str]:
    """The benchmark tasks the run's student was scored on (a report also lists tasks only its teacher has)."""
    return [t for t, row in run.report["tasks"].items() if row.get("student") is not None]


def _task_difference(task: str, a: RunResults, b: RunResults) -> list[str]:
    if a.report["tasks"][task]["metric"] != b.report["tasks"][task]["metric"]:
        return [f"{task}'s metric ({a.report['tasks'][task]['metric']} against {b.report['tasks'][task]['metric']})"]
    ex_a, ex_b = a.examples.get(task), b.examples.get(task)
    if ex_a is None or ex_b is None:
        return []  # no per-example results to compare: the difference gets no interval
    docs = lambda ex: {leaf: entry["doc_id"] for leaf, entry in ex["by_task"].items()}  # noqa: E731
    return [] if docs(ex_a) == docs(ex_b) else [f"{task}'s documents (different doc ids)"]


# --------------------------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class RecoveryDraws:
    """One task's recovery of both runs and the replicate differences B - A (NaN where undefined)."""

    a: Optional[float]
    b: Optional[float]
    draws: np.ndarray


def recovery_differences(columns: np.ndarray, *, stream: str, samples: int = BOOTSTRAP_SAMPLES,
                         seed: int = BOOTSTRAP_SEED) -> dict[str, RecoveryDraws]:
    """From one task's (5, n) columns (student A, student B, teacher of A, teacher of B, chance) over the same
    examples: {"norm": normalised recovery, "raw": student / teacher} of both runs with the paired replicate
    differences; a shared teacher is the same column twice."""
    means = paired_bootstrap(columns, samples=samples, seed=seed, stream=stream)
    m = columns.mean(axis=1)
    norm = normalised_draws(means[[1, 3, 4]]) - normalised_draws(means[[0, 2, 4]])
    with np.errstate(divide="ignore", invalid="ignore"):
        raw = np.where((means[2] > 0) & (means[3] > 0), means[1] / means[3] - means[0] / means[2], np.nan)
    ratio = lambda s, t: float(s / t) if t > 0 else None  # noqa: E731
    return {"norm": RecoveryDraws(normalised_recovery(m[0], m[2], m[4]), normalised_recovery(m[1], m[3], m[4]), norm),
            "raw": RecoveryDraws(ratio(m[0], m[2]), ratio(m[1], m[3]), raw)}


def _scores(examples: Optional[dict]) -> Optional[list[float]]:
    """A task's per-example scores over its leaf tasks in sorted order (report.paired_columns' order)."""
    if examples is None:
        return None
    return [x for leaf in sorted(examples["by_task"]) for x in examples["by_task"][leaf]["score"]]


def _columns(task: str, a: RunResults, b: RunResults) -> tuple[Optional[np.ndarray], str]:
    """One task's (5, n) recovery columns (report.paired_columns of each run), or None and why not."""
    cols_a, why_a = paired_columns(a.examples.get(task), a.teacher_examples.get(task))
    cols_b, why_b = paired_columns(b.examples.get(task), b.teacher_examples.get(task))
    if cols_a is None or cols_b is None:
        return None, why_a or why_b
    if not np.array_equal(cols_a[2], cols_b[2]):
        return None, "the teachers' examples have different numbers of choices"
    return np.array([cols_a[0], cols_b[0], cols_a[1], cols_b[1], cols_a[2]]), ""


# --------------------------------------------------------------------------------------------- rows


def benchmark_rows(a: RunResults, b: RunResults, samples: int = BOOTSTRAP_SAMPLES,
                   seed: int = BOOTSTRAP_SEED) -> list[dict]:
    """The averages of normalised and raw recovery, then per task the score and the normalised recovery."""
    tasks = [t for t in scored_tasks(a) if t in scored_tasks(b)]
    scores, recoveries, whys = [], {}, {}
    for task in tasks:
        ra, rb = a.report["tasks"][task], b.report["tasks"][task]
        sa, sb = _scores(a.examples.get(task)), _scores(b.examples.get(task))
        row = (difference(sa, sb, stream=task, samples=samples, seed=seed) if sa and sb else
               _row(ra["student"], rb["student"], None, ra.get("n"), "no per-example results"))
        scores.append({"metric": f"{task} ({ra['metric']})", "unit": "score", **row})
        columns, whys[task] = _columns(task, a, b)
        if columns is not None:
            recoveries[task] = recovery_differences(columns, stream=task, samples=samples, seed=seed)
    norm_tasks = [t for t in a.report["average"].get("norm_tasks") or []
                  if t in (b.report["average"].get("norm_tasks") or [])]
    raw_tasks = [t for t in tasks if a.report["tasks"][t]["recovery"] is not None
                 and b.report["tasks"][t]["recovery"] is not None]
    per_task = [_recovery_row(f"{t} normalised recovery", t, "norm", "recovery_norm", a, b, recoveries, whys)
                for t in norm_tasks]
    averages = [_average_row(f"average normalised recovery ({len(norm_tasks)} tasks)", norm_tasks, "norm",
                             "recovery_norm", a, b, recoveries),
                _average_row(f"average raw recovery ({len(raw_tasks)} tasks)", raw_tasks, "raw", "recovery", a, b,
                             recoveries)]
    return [r for r in averages if r["a"] is not None or r["b"] is not None] + scores + per_task


def _recovery_row(metric: str, task: str, kind: str, key: str, a: RunResults, b: RunResults,
                  recoveries: dict[str, dict[str, RecoveryDraws]], whys: dict[str, str]) -> dict:
    n = a.report["tasks"][task].get("n")
    if task in recoveries:
        got = recoveries[task][kind]
        return {"metric": metric, "unit": "fraction", **_row(got.a, got.b, got.draws, n)}
    return {"metric": metric, "unit": "fraction",
            **_row(a.report["tasks"][task][key], b.report["tasks"][task][key], None, n, whys.get(task))}


def _average_row(metric: str, tasks: list[str], kind: str, key: str, a: RunResults, b: RunResults,
                 recoveries: dict[str, dict[str, RecoveryDraws]]) -> dict:
    """The mean over `tasks` of a recovery; its interval averages the tasks' replicate differences (each task
    resampled on its own examples) and needs every task's."""
    if not tasks:
        return {"metric": metric, "unit": "fraction", **_row(None, None, None, 0)}
    if all(t in recoveries for t in tasks):
        got = [recoveries[t][kind] for t in tasks]
        if all(g.a is not None and g.b is not None for g in got):
            return {"metric": metric, "unit": "fraction",
                    **_row(float(np.mean([g.a for g in got])), float(np.mean([g.b for g in got])),
                           np.mean([g.draws for g in got], axis=0), len(tasks))}
    mean = lambda run: float(np.mean([run.report["tasks"][t][key] for t in tasks]))  # noqa: E731
    return {"metric": metric, "unit": "fraction",
            **_row(mean(a), mean(b), None, len(tasks), "a task has no paired per-example results")}


def training_rows(a: RunResults, b: RunResults) -> list[dict]:
    """Stage 3's validation CE and KL (on the held-out split): plain differences, no interval; no difference at
    all when the two runs' held-out windows differ in length (a token's loss depends on its context)."""
    distill = lambda run: ((run.report.get("training") or {}).get("final") or {}).get("distill") or {}  # noqa: E731
    apart, note = heldout_comparison(a.report, a.student_dir, b.report, b.student_dir)
    rows = [{"metric": name, "unit": "value", **_row(distill(a).get(key), distill(b).get(key), None, None, note)}
            for key, name in (("val_ce", "stage 3 validation CE"), ("val_kl", "stage 3 validation KL"))
            if distill(a).get(key) is not None or distill(b).get(key) is not None]
    return [{**row, "diff": None} if apart else row for row in rows]


def paired_report(a: RunResults, b: RunResults, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> dict:
    """B - A in every headline metric with paired 95% intervals; PairError when the examples differ."""
    differ = example_differences(a, b)
    if differ:
        raise PairError(f"{b.label} - {a.label}: the runs were not scored on the same examples; they differ in "
                        + "; ".join(differ) + ".")
    return {"a": a.label, "b": b.label, "unpaired": unpaired(a, b),
            "dirs": {"a": {"student": str(a.student_dir), "teacher": _str(a.teacher_dir)},
                     "b": {"student": str(b.student_dir), "teacher": _str(b.teacher_dir)}},
            "shared_teacher": _same(a.teacher_dir, b.teacher_dir) or _one_teacher(a, b),
            "bootstrap": {"samples": samples, "seed": seed, "level": LEVEL, "paired": True},
            "rows": benchmark_rows(a, b, samples, seed)
                    + [row for task in tasks() for row in task.paired_rows(a, b, samples, seed)]
                    + training_rows(a, b)}


def paired_along(a: str | Path, b: str | Path, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED,
                 labels: Optional[tuple[str, str]] = None) -> dict:
    """B - A at each token count where both runs (run directories) have a finished evaluation along stage 3, the
    same rows as paired_report with their intervals: {"a", "b", "snapshots": [{"tokens", "rows"} or {"tokens",
    "refused": why}], "only_a", "only_b": token counts only one run evaluated}. "a" and "b" are `labels` where
    given (the report's names for the two runs), else the snapshots' own labels, else the folders' names."""
    found = snapshot_reports(a), snapshot_reports(b)
    found_labels = [None, None]
    snapshots = []
    for tokens in sorted(set(found[0]) & set(found[1])):
        runs = [load_run(found[i][tokens], json.loads(found[i][tokens].read_text())) for i in (0, 1)]
        found_labels = [run.label for run in runs]
        try:
            snapshots.append({"tokens": tokens, "rows": paired_report(runs[0], runs[1], samples, seed)["rows"]})
        except PairError as err:
            snapshots.append({"tokens": tokens, "refused": str(err)})
    if labels is None:
        labels = (found_labels[0] or Path(a).name, found_labels[1] or Path(b).name)
    return {"a": labels[0], "b": labels[1], "snapshots": snapshots,
            "only_a": sorted(set(found[0]) - set(found[1])), "only_b": sorted(set(found[1]) - set(found[0])),
            "bootstrap": {"samples": samples, "seed": seed, "level": LEVEL, "paired": True}}


def side_by_side(a: Path, b: Path, out: Path) -> tuple[Path, Optional[str]]:
    """Two evaluations (RUN_DIR/eval-like folders with a report) side by side in `out` (report.compare: each with its
    training losses where its run has them), with the paired differences B - A; when they were not scored on the same
    examples, without them, the reason written under the comparison and returned."""
    from harness.eval.report import attach_training, compare, find_report, with_heldout_window

    reports = [attach_training(with_heldout_window(find_report(path), path), path) for path in (a, b)]
    try:
        pairs, why = [paired_report(load_run(a, reports[0]), load_run(b, reports[1]))], None
    except PairError as err:
        pairs, why = [], str(err)
    written = compare(reports, out, pairs)
    if why:
        with open(written, "a") as f:
            f.write(f"\nNo paired differences: {why}\n")
    return written, why


def _str(path: Optional[Path]) -> Optional[str]:
    return None if path is None else str(path)


def _same(x: Optional[Path], y: Optional[Path]) -> bool:
    return x is not None and y is not None and Path(x).resolve() == Path(y).resolve()


def _one_teacher(a: RunResults, b: RunResults) -> bool:
    """Whether two teacher folders are copies of one cache holding the same results (as the report counts them)."""
    return None not in (a.teacher_dir, b.teacher_dir) and len(teachers([a.report, b.report])) == 1
