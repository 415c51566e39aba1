"""Teacher-recovery reports: one run's student against its teacher, and several runs side by side.

Per task (both models scored with the task's primary metric on the same examples, see
harness.eval.lm_eval_tasks):
  recovery       the raw ratio student / teacher;
  recovery_norm  the chance-normalised recovery (student - chance) / (teacher - chance), chance being the
                 mean of 1/choices over the examples (0 for generative tasks); see harness.eval.recovery;
  *_ci           95% paired bootstrap intervals over examples of the student's and teacher's scores and of
                 recovery_norm, from the per-example results (bench_examples.json); None for result folders
                 without them (older ones), and the report says so.
The average raw recovery is the mean over the tasks both models have; the average normalised recovery leaves
out (and names) the tasks whose teacher's interval reaches chance. The rows of this recovery table come from the
registered evaluation tasks (harness.eval.tasks: EvalTask.recovery_scores / recovery_examples): every lm-eval
benchmark, and the scores a task marks as recovery scores. Everything else in a report is each task's own part,
asked of the registry in its order: its keys of report.json (report_fields), its section of report.md
(markdown), its columns, notes, sections and plots of a comparison: NIAH by length with both of its scores
(harness.eval.tasks.niah), perplexity as the ratio student / teacher (harness.eval.tasks.perplexity), the chat
samples at the end.

    build_report(student_dir, teacher_dir, ...)  -> report dict  (one run; each task reads its result files)
    write_report(report, out)                    -> out/report.json, out/report.md, out/recovery.png,
                                                    out/niah_by_length.png
    compare(reports, out, paired, along)         -> out/comparison.{json,md}, recovery.png, niah_by_length.png,
                                                    loss_curves.png (reports with attach_training); paired
                                                    differences of chosen pairs (harness.eval.paired), at the
                                                    end and along stage 3
    write_along(along, out)                      -> out/paired_along.{json,md} (a run without a final report)
    attach_training(report, run_dir)             -> the report with the run's stage losses and curves
    find_report(path)                            -> the report of RUN_DIR, RUN_DIR/eval or a report.json
    eval_dirs(path)                              -> its student's and teacher's result folders, found relative
                                                    to where the report lies now (runs copied off their machine)
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import numpy as np

from harness.eval.formatting import figure as _figure
from harness.eval.formatting import fmt as _fmt
from harness.eval.formatting import fmt_ci as _fmt_ci
from harness.eval.formatting import heldout_window
from harness.eval.formatting import run_name as _name
from harness.eval.formatting import teachers as _teachers
from harness.eval.lm_eval_tasks import known_chance
from harness.eval.recovery import BOOTSTRAP_SAMPLES, BOOTSTRAP_SEED, LEVEL, average_recovery, task_recovery
from harness.eval.tasks import tasks as registered_tasks
from harness.eval.tasks.niah import (LIKELIHOOD_KEYS, niah_side, niah_summary,  # noqa: F401  (their old home)
                                     plot_niah_by_length)
from harness.eval.tasks.niah import plot_niah_panel as _plot_niah_panel  # noqa: F401
from harness.eval.tasks.perplexity import perplexity_summary  # noqa: F401

REPORT_FILE = "report.json"
BOOTSTRAP = {"samples": BOOTSTRAP_SAMPLES, "seed": BOOTSTRAP_SEED, "level": LEVEL, "paired": True}


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def paired_columns(student: Optional[dict], teacher: Optional[dict]) -> tuple[Optional[np.ndarray], Optional[str]]:
    """The per-example (student score, teacher score, chance) columns of one task, a (3, n) array over the
    examples both sides scored (bench_examples.json entries, matched by leaf task and doc id), or None and why."""
    if student is None or teacher is None:
        side = " and ".join(name for name, ex in (("student", student), ("teacher", teacher)) if ex is None)
        return None, f"no per-example results for the {side} (result files from before they were stored)"
    if student["metric"] != teacher["metric"]:
        return None, f"the sides were scored with different metrics ({student['metric']}, {teacher['metric']})"
    s, t = student["by_task"], teacher["by_task"]
    if sorted(s) != sorted(t) or any(s[leaf]["doc_id"] != t[leaf]["doc_id"] for leaf in s):
        return None, "the student and the teacher were scored on different examples"
    leaves = sorted(t)
    columns = [[x for leaf in leaves for x in side[leaf]["score"]] for side in (s, t)]
    chance = [x for leaf in leaves for x in _example_chance(t[leaf])]
    if not chance:
        return None, "no examples"
    return np.array([*columns, chance], dtype=float), None


def _example_chance(leaf: dict) -> list[float]:
    """Per example of a leaf task, the score of guessing: its "chance" where stored, else 1 / choices (0 for 0)."""
    if "chance" in leaf:
        return [float(x) for x in leaf["chance"]]
    return [1.0 / n if n > 0 else 0.0 for n in leaf["choices"]]


def _scores_of(examples: Optional[dict]) -> Optional[list[float]]:
    """One side's per-example scores of a task (all leaf tasks), None without per-example results."""
    if examples is None:
        return None
    return [x for leaf in sorted(examples["by_task"]) for x in examples["by_task"][leaf]["score"]]


def _chance(name: str, student: Optional[dict], teacher: Optional[dict],
            paired: Optional[np.ndarray]) -> Optional[float]:
    """The task's chance level: from the paired examples, else bench.json's "chance", else known_chance."""
    if paired is not None:
        return float(paired[2].mean())
    stored = (teacher or {}).get("chance", (student or {}).get("chance"))
    return stored if stored is not None else known_chance(name)


def task_row(name: str, s: Optional[dict], t: Optional[dict], ex_s: Optional[dict],
             ex_t: Optional[dict]) -> tuple[dict, Optional[np.ndarray]]:
    """One task's row (scores, raw and normalised recovery, intervals, at-chance verdict) and its normalised
    bootstrap draws; s, t: the bench.json entries, ex_s, ex_t: the per-example results (None where missing)."""
    s_score, t_score = (s or {}).get("score"), (t or {}).get("score")
    paired, why = paired_columns(ex_s, ex_t)
    stats, draws = task_recovery(name, s_score, t_score, _chance(name, s, t, paired), paired,
                                 (t or {}).get("stderr"), alone=(_scores_of(ex_s), _scores_of(ex_t)))
    row = {"metric": (s or t)["metric"], "student": s_score, "teacher": t_score,
           "recovery": s_score / t_score if s_score is not None and t_score else None, "n": (s or t).get("n"),
           **stats, "intervals": None if paired is not None else why}
    return row, draws


def task_rows(student: dict[str, dict], teacher: dict[str, dict], order: list[str],
              examples: tuple[dict, dict] = ({}, {})) -> tuple[dict[str, dict], dict[str, Optional[np.ndarray]]]:
    """Per task in `order` (then the rest, sorted): task_row's row, and its normalised draws.

    examples: the student's and the teacher's per-example results ({task: bench_examples.json entry})."""
    names = [t for t in order if t in student or t in teacher]
    names += sorted(set(student) | set(teacher) - set(names))
    rows, draws = {}, {}
    for name in names:
        rows[name], draws[name] = task_row(name, student.get(name), teacher.get(name), examples[0].get(name),
                                           examples[1].get(name))
    return rows, draws


def average_row(rows: dict[str, dict], draws: Optional[dict[str, Optional[np.ndarray]]] = None) -> dict:
    """Mean scores and raw recovery over the tasks both sides have; the normalised average, its interval and
    the tasks left out of it (harness.eval.recovery.average_recovery)."""
    both = [r for r in rows.values() if r["student"] is not None and r["teacher"] is not None]
    return {"tasks": len(both), "student": _mean([r["student"] for r in both]),
            "teacher": _mean([r["teacher"] for r in both]),
            "recovery": _mean([r["recovery"] for r in both if r["recovery"] is not None]),
            **average_recovery(rows, draws or {})}


def build_report(student_dir: Path, teacher_dir: Optional[Path], *, label: str, mixer: Optional[str] = None,
                 tasks: Optional[list[str]] = None, lengths: Optional[list[int]] = None) -> dict:
    """The recovery report of one student from the result files in student_dir and teacher_dir: the recovery
    table over every task's recovery rows (in the order `tasks`, then the rest sorted), then each registered
    task's own keys (EvalTask.report_fields)."""
    student_dir = Path(student_dir)
    teacher_dir = Path(teacher_dir) if teacher_dir is not None else None
    report = {"label": label, "mixer": mixer,
              "student_dir": str(student_dir), "teacher_dir": str(teacher_dir) if teacher_dir else None,
              "limit": None, "tasks": {}, "average": {}, "bootstrap": BOOTSTRAP}  # limit: the benchmarks' (their task)
    scores: tuple[dict, dict] = ({}, {})
    examples: tuple[dict, dict] = ({}, {})
    for task in registered_tasks():
        own_teacher = task.teacher_folder(student_dir, teacher_dir)
        report.update(task.report_fields(student_dir, own_teacher))
        for i, folder in enumerate((student_dir, own_teacher)):
            scores[i].update(task.recovery_scores(folder))
            examples[i].update(task.recovery_examples(folder))
    rows, draws = task_rows(scores[0], scores[1], list(tasks or []), examples)
    report["tasks"], report["average"] = rows, average_row(rows, draws)
    return report


def _benchmark_table(report: dict) -> list[str]:
    """The one-run benchmark table: per task chance, scores and recoveries with their 95% intervals."""
    limit = report.get("limit")
    lines = [f"## Benchmarks (lm-eval, {'limit ' + str(limit) if limit else 'all examples'})", "",
             "| task | metric | n | chance | student [95% CI] | teacher [95% CI] | recovery (raw) | "
             "normalised recovery [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for name, r in report["tasks"].items():
        norm = _fmt_ci(r.get("recovery_norm"), r.get("recovery_norm_ci"), pct=True)
        norm += " (not averaged)" if r.get("at_chance") and r.get("recovery_norm") is not None else ""
        lines.append(f"| {name} | {r['metric']} | {r['n']} | {_fmt(r.get('chance'))} | "
                     f"{_fmt_ci(r['student'], r.get('student_ci'))} | {_fmt_ci(r['teacher'], r.get('teacher_ci'))} | "
                     f"{_fmt(r['recovery'], pct=True)} | {norm} |")
    a = report["average"]
    norm_tasks = a.get("norm_tasks")
    norm = _fmt_ci(a.get("recovery_norm"), a.get("recovery_norm_ci"), pct=True)
    lines += [f"| **average** ({a['tasks']} tasks) | | | | {_fmt(a['student'])} | {_fmt(a['teacher'])} | "
              f"**{_fmt(a['recovery'], pct=True)}** | **{norm}**"
              + (f" ({len(norm_tasks)} tasks)" if norm_tasks is not None else "") + " |", ""]
    return lines


def recovery_notes(report: dict) -> list[str]:
    """What the recovery columns mean, which tasks the normalised average leaves out and why, and which tasks
    have no intervals (result files without per-example results)."""
    boot = report.get("bootstrap") or BOOTSTRAP
    lines = ["Recovery (raw): student / teacher, averaged over every task both have. Normalised recovery: "
             "(student - chance) / (teacher - chance), chance = the mean of 1/choices over the examples (0 for "
             f"generative tasks). {100 * boot['level']:.0f}% intervals: paired bootstrap over examples "
             f"({boot['samples']} resamples, seed {boot['seed']}).", ""]
    rows, average = report["tasks"], report["average"]
    if average.get("excluded"):
        lines += ["Left out of the normalised average (the teacher is not clearly above chance: its interval "
                  "reaches chance): " + "; ".join(_at_chance(name, rows[name]) for name in average["excluded"])
                  + ".", ""]
    if average.get("no_chance"):
        lines += [f"Not normalised (chance unknown without per-example results): {', '.join(average['no_chance'])}.",
                  ""]
    missing = {name: r["intervals"] for name, r in rows.items()
               if r.get("intervals") and r["student"] is not None and r["teacher"] is not None}
    for why in dict.fromkeys(missing.values()):
        names = [name for name, w in missing.items() if w == why]
        lines += [f"Paired intervals (normalised recovery; a side without per-example results gets none) "
                  f"unavailable for {', '.join(names)}: {why}. Re-running the benchmarks into a fresh result "
                  "folder stores them.", ""]
    return lines


def _at_chance(name: str, row: dict) -> str:
    """'winogrande (teacher 0.505 [0.477, 0.533], chance 0.5)', saying how it was judged without an interval."""
    basis = {"stderr": ", judged by teacher - 1.96 stderr", "score": ", judged by the score alone"}
    return (f"{name} (teacher {_fmt_ci(row['teacher'], row.get('teacher_ci'))}, chance {_fmt(row['chance'])}"
            f"{basis.get(row.get('at_chance_basis'), '')})")


def markdown(report: dict) -> str:
    """One run's report as Markdown: the recovery table, each task's section (NIAH by length, perplexity, ...),
    the training losses, then the tasks' samples to read (chat samples)."""
    title = report["label"] + (f" ({report['mixer']})" if report.get("mixer") else "")
    lines = [f"# Evaluation: {title}", ""]
    if report["tasks"]:
        lines += _benchmark_table(report) + recovery_notes(report)
    lines += [line for task in registered_tasks() if task.section == "scores" for line in task.markdown(report)]
    lines += _training_table([report])
    lines += [line for task in registered_tasks() if task.section == "samples" for line in task.markdown(report)]
    return "\n".join(lines)


def write_report(report: dict, out: Path) -> None:
    """out/report.json, out/report.md, out/recovery.png when there are benchmark results, and the tasks' plots
    (out/niah_by_length.png when there are NIAH results)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report))
    if report["tasks"]:
        plot_recovery([report], out / "recovery.png")
    for task in registered_tasks():
        task.plot([report], out)


def report_file(path: str | Path) -> Path:
    """The report.json of RUN_DIR (RUN_DIR/eval/report.json), of an eval folder, or the file itself."""
    path = Path(path)
    for candidate in (path, path / REPORT_FILE, path / "eval" / REPORT_FILE):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"No {REPORT_FILE} in {path} or {path / 'eval'}: run `harness eval {path}/eval.yaml` "
                            "first.")


def find_report(path: str | Path) -> dict:
    """The report of RUN_DIR, of an eval folder, or of a report.json (`report_file`)."""
    return json.loads(report_file(path).read_text())


def rebase(recorded: str | Path, recorded_eval: str | Path, eval_dir: Path) -> Path:
    """Where a result folder recorded in a report lies now that the report is in `eval_dir`: at the same position
    relative to the report's folder as when the report was written in `recorded_eval` (a run directory copied off
    the machine that ran it keeps its eval/student beside its report, and a teacher cache such as
    ../../teacher-2048/NAME beside the runs). The recorded path itself when only it exists (a report moved alone)."""
    relative = os.path.relpath(Path(recorded), Path(recorded_eval))
    moved = Path(os.path.normpath(Path(eval_dir) / relative))
    return Path(recorded) if not moved.exists() and Path(recorded).exists() else moved


def eval_dirs(path: str | Path, report: Optional[dict] = None) -> tuple[Path, Optional[Path]]:
    """The student's and the teacher's result folders of the report of `path` (a RUN_DIR, its eval folder or a
    report.json), found relative to where the report lies now (`rebase`), not at the absolute paths it records.

    The report was written beside its student's folder (the evaluation job writes OUTPUT_DIR/report.json and
    OUTPUT_DIR/student/), so the recorded student_dir's parent is where the report was written; a report that
    records no student_dir has its student in student/ beside it, and its teacher_dir is taken as recorded."""
    file = report_file(path)
    report = report if report is not None else json.loads(file.read_text())
    teacher = report.get("teacher_dir")
    if report.get("student_dir") is None:
        return file.parent / "student", None if teacher is None else Path(teacher)
    recorded_eval = Path(report["student_dir"]).parent
    student = rebase(report["student_dir"], recorded_eval, file.parent)
    return student, None if teacher is None else rebase(teacher, recorded_eval, file.parent)


def comparison_markdown(reports: list[dict], paired: Optional[list[dict]] = None,
                        along: Optional[list[dict]] = None) -> str:
    """Several runs: normalised (and raw) recovery per task with each task's columns (NIAH overall, the
    perplexity ratio); then the raw scores, each task's sections (NIAH by length), (for runs read from their run
    directories) the final loss of each stage, and the paired differences of chosen pairs
    (harness.eval.paired.paired_report) when given, at the end and along stage 3 (paired_along)."""
    tasks = list(dict.fromkeys(t for r in reports for t in r["tasks"]))
    columns = [column for task in registered_tasks() for column in task.comparison_columns()]
    head = ["run"] + tasks + ["average normalised", "average raw"] + [header for header, _ in columns]
    lines = ["# Teacher recovery, by run", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in reports:
        average = r["average"]
        cells = [_recovery_cell(r["tasks"].get(t)) for t in tasks]
        cells += [_fmt_ci(average.get("recovery_norm"), average.get("recovery_norm_ci"), pct=True),
                  _fmt(average["recovery"], pct=True)]
        cells += [cell(r) for _, cell in columns]
        lines.append(f"| {_name(r)} | " + " | ".join(cells) + " |")
    legend = "; ".join(text for task in registered_tasks() if (text := task.comparison_legend()))
    lines += ["", "Per task: chance-normalised recovery (student - chance) / (teacher - chance) with its 95% paired "
              "bootstrap interval, the raw ratio student / teacher in parentheses; * = the teacher's interval "
              "reaches chance, so the task is left out of the normalised average (the raw average keeps every "
              "task both have)."] + ([legend + "."] if legend else []) + [""]
    lines += _left_out(reports) + _window_note(reports)
    lines += _scores_table(reports, tasks)
    lines += [line for task in registered_tasks() for line in task.comparison_sections(reports)]
    lines += _training_table(reports, plotted=True)
    lines += paired_markdown(paired or [])
    lines += along_markdown(along or [])
    return "\n".join(lines)


def _paired_value(value: Optional[float], unit: str) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.1f}%" if unit == "fraction" else (f"{value:.3f}" if unit == "score" else f"{value:.4g}")


def _paired_diff(row: dict) -> str:
    """'-0.090 [-0.131, -0.048]', '-47.3 pts [-58.1, -36.0]' (percentage points), '74.81' without interval."""
    diff, ci, unit = row["diff"], row["ci"], row["unit"]
    if diff is None:
        return "-"
    if unit == "fraction":
        text = f"{100 * diff:+.1f} pts" + (f" [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]" if ci else "")
    elif unit == "score":
        text = f"{diff:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "")
    else:
        text = f"{diff:+.4g}" + (f" [{ci[0]:+.4g}, {ci[1]:+.4g}]" if ci else "")
    return text


def _excludes_zero(row: dict) -> str:
    if row["excludes_zero"] is None:
        if row["diff"] is None and row.get("note"):
            return row["note"]  # e.g. not comparable (harness.eval.paired.heldout_rows)
        return f"no interval ({row['note']})" if row.get("note") else "-"
    return "yes" if row["excludes_zero"] else "no"


def paired_markdown(pairs: Sequence[dict]) -> list[str]:
    """The "Paired differences" section: one table per pair (harness.eval.paired.paired_report), B - A."""
    if not pairs:
        return []
    boot = pairs[0]["bootstrap"]
    lines = ["## Paired differences", "",
             f"B - A on the same examples and NIAH prompts. Each of {boot['samples']} bootstrap replicates (seed "
             f"{boot['seed']}) draws one set of example indices and applies it to both runs, and to their teachers "
             f"for the recoveries; the {100 * boot['level']:.0f}% CI is the percentile range of the replicate "
             "differences. The average normalised recovery resamples its tasks independently and averages them. "
             "pts: percentage points; n: examples or prompts (tasks for the averages, tokens for perplexity). "
             "Held-out perplexity and stage 3's validation CE and KL are stored as aggregates only, so their "
             "difference has no interval, and between runs held out in windows of different lengths no "
             "difference is given.", ""]
    for pair in pairs:
        teacher = "" if pair["shared_teacher"] else " (the runs' teachers' result folders differ)"
        lines += [f"### {pair['b']} (B) - {pair['a']} (A){teacher}", "",
                  "| metric | n | A | B | B - A [95% CI] | CI excludes 0 |", "|---|---|---|---|---|---|"]
        for row in pair["rows"]:
            lines.append(f"| {row['metric']} | {row['n'] if row['n'] is not None else '-'} | "
                         f"{_paired_value(row['a'], row['unit'])} | {_paired_value(row['b'], row['unit'])} | {_paired_diff(row)} | "
                         f"{_excludes_zero(row)} |")
        lines.append("")
        if pair.get("unpaired"):
            lines += ["Not paired (only one run was scored on them): " + "; ".join(pair["unpaired"]) + ".", ""]
    return lines


def _tokens(count: int) -> str:
    return f"{count / 1e6:.1f}M" if count >= 100_000 else f"{count:,}"


def along_markdown(alongs: Sequence[dict]) -> list[str]:
    """The "Paired differences along stage 3" section: per pair (harness.eval.paired.paired_along) one table, a
    row per metric and a column per snapshot both runs evaluated, B - A with its interval; * where it excludes 0."""
    alongs = [along for along in alongs if along["snapshots"]]
    if not alongs:
        return []
    lines = ["## Paired differences along stage 3", "",
             "B - A at each token count both runs were evaluated at during stage 3 (RUN/eval/during/tokens-N), on "
             "the same examples and prompts, with the intervals above; * marks an interval that excludes 0.", ""]
    for along in alongs:
        snaps = along["snapshots"]
        metrics = list(dict.fromkeys(row["metric"] for snap in snaps for row in snap.get("rows", [])))
        lines += [f"### {along['b']} (B) - {along['a']} (A)", "",
                  "| metric | " + " | ".join(_tokens(snap["tokens"]) for snap in snaps) + " |",
                  "|---|" + "---|" * len(snaps)]
        for metric in metrics:
            cells = []
            for snap in snaps:
                row = next((r for r in snap.get("rows", []) if r["metric"] == metric), None)
                cells.append("-" if row is None else _paired_diff(row) + (" *" if row["excludes_zero"] else ""))
            lines.append(f"| {metric} | " + " | ".join(cells) + " |")
        lines.append("")
        lines += [f"Not paired at {_tokens(snap['tokens'])}: {snap['refused']}" for snap in snaps if "refused" in snap]
        for key, name in (("only_a", along["a"]), ("only_b", along["b"])):
            if along[key]:
                lines.append(f"Only {name} was evaluated at " + ", ".join(_tokens(t) for t in along[key]) + ".")
        lines.append("")
    return lines


def write_along(alongs: list[dict], out: Path) -> list[str]:
    """out/paired_along.{json,md}: the differences along stage 3 alone (a run of the pairs has no final report);
    returns the markdown's lines."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines = along_markdown(alongs)
    (out / "paired_along.json").write_text(json.dumps(alongs, indent=1))
    (out / "paired_along.md").write_text("\n".join(lines) + "\n")
    return lines + [f"[harness] paired along stage 3: {out / 'paired_along.md'}"]


def _recovery_cell(row: Optional[dict]) -> str:
    """'85.2% [70.1, 99.3] (97.1%)': normalised recovery, its interval, the raw ratio; '*' when not averaged."""
    if row is None:
        return "-"
    mark = "*" if row.get("at_chance") and row.get("recovery_norm") is not None else ""
    return (f"{_fmt_ci(row.get('recovery_norm'), row.get('recovery_norm_ci'), pct=True)}{mark} "
            f"({_fmt(row['recovery'], pct=True)})")


def _left_out(reports: list[dict]) -> list[str]:
    """Per run, the tasks its normalised average leaves out (teacher at chance), or that have no intervals."""
    lines = []
    for r in reports:
        average = r["average"]
        if average.get("excluded"):
            lines.append(f"- {_name(r)}: left out of the normalised average (teacher at chance): "
                         + ", ".join(average["excluded"]))
        if average.get("no_chance"):
            lines.append(f"- {_name(r)}: chance unknown, not normalised: " + ", ".join(average["no_chance"]))
        if "recovery_norm" not in average:
            lines.append(f"- {_name(r)}: its report predates normalised recovery; `harness eval` on its eval.yaml "
                         "rebuilds it (finished benchmarks are reused)")
        no_ci = [t for t, row in r["tasks"].items() if row.get("intervals")]
        if no_ci:
            lines.append(f"- {_name(r)}: no intervals (no per-example results) for " + ", ".join(no_ci))
    return lines + [""] if lines else []


def _scores_table(reports: list[dict], tasks: list[str]) -> list[str]:
    """The raw scores of every student and teacher: the recovery table's tasks, their average, and the tasks'
    score columns (perplexity)."""
    if not tasks:
        return []
    metrics = [next((r["tasks"][t]["metric"] for r in reports if t in r["tasks"]), "") for t in tasks]
    extra = [column for task in registered_tasks() for column in task.score_columns()]
    head = ["model"] + [f"{t} ({m})" for t, m in zip(tasks, metrics)] + ["average"] + [h for h, _ in extra]
    lines = ["## Scores", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = [(_name(r), r, "student") for r in reports] + [(name, r, "teacher") for name, r in _teachers(reports)]
    for name, r, side in rows:
        cells = [_fmt(r["tasks"].get(t, {}).get(side)) for t in tasks]
        cells += [_fmt(r["average"][side])] + [cell(r, side) for _, cell in extra]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    limit = next((r.get("limit") for r in reports if r.get("limit")), None)
    notes = "".join(f"; {note}" for task in registered_tasks() if (note := task.score_note()))
    return lines + ["", f"Benchmarks: lm-eval, {'the first ' + str(limit) + ' examples' if limit else 'all examples'}"
                        f" of each task{notes}.", ""]


def _training_table(reports: list[dict], plotted: bool = False) -> list[str]:
    runs = [(r, r["training"]["final"]) for r in reports if r.get("training")]
    if not runs:
        return []
    fraction = runs[0][0]["training"].get("final_fraction")
    # stage 3's other loss terms (stages.distill.losses, terms registered in code), each run's where it logged them
    others = list(dict.fromkeys(t for _, final in runs for t in (final.get("distill") or {}).get("terms", ())
                                if t not in ("ce", "kl")))
    head = ["run", "stage 1 loss", "stage 2 loss", "stage 3 loss", "stage 3 CE", "stage 3 KL",
            *(f"stage 3 {t}" for t in others), "val CE", "val KL", *(f"val {t}" for t in others), "val ppl"]
    lines = ["## Training losses", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, final in runs:
        d = final.get("distill") or {}
        kinds = r["training"].get("alignment_loss") or {}
        align = [_fmt(final.get(stage)) + ("" if kinds.get(stage, "mse") == "mse" else f" ({kinds[stage]})")
                 for stage in ("align_mixer", "align_hidden")]
        cells = [d.get("loss"), d.get("ce"), d.get("kl"), *(d.get(t) for t in others), d.get("val_ce"),
                 d.get("val_kl"), *(d.get(f"val_{t}") for t in others), d.get("val_ppl")]
        lines.append(f"| {_name(r)} | " + " | ".join(align + [_fmt(c) for c in cells]) + " |")
    return lines + ["", f"Stages 1-2: mean per-layer MSE, or the per-token L2 norm where marked (l2); stage 3: loss = "
                        "the weighted terms (CE + KL by default; every term a run logged has a column). "
                        f"Training values are means over the logged steps of the stage's last {fraction:.0%}; "
                        "validation on the held-out split at the end of stage 3."
                        + (" Curves: loss_curves.png." if plotted else ""), ""] + _throughput_lines(reports) \
        + _startup_lines(reports)


def _throughput_lines(reports: list[dict]) -> list[str]:
    """Stage 3's tokens/s per run (harness.eval.training.distill_throughput) as a table, where a run logged it."""
    rows = [(r, r["training"].get("distill_throughput")) for r in reports if r.get("training")]
    rows = [(r, t) for r, t in rows if t]
    if not rows:
        return []
    lines = ["| run | stage 3 tokens/s: whole stage | median interval | 90th percentile | intervals |",
             "|---|---|---|---|---|"]
    lines += [f"| {_name(r)} | {t['whole']:,.0f} | {t['median']:,.0f} | {t['p90']:,.0f} | {t['intervals']} |"
              for r, t in rows]
    return lines + ["", "Stage-3 tokens/s from the log lines' times, interval by interval (all processes): pauses "
                        "(checkpoints, evaluations beside it, restarts) lower the whole and the median; the 90th "
                        "percentile is the loop's undisturbed rate, the figure to hold against `harness bench`.", ""]


def _startup_lines(reports: list[dict]) -> list[str]:
    """Each stage's start-up per run (harness.eval.training.stage_startups) as a table, where a run logged it."""
    rows = [(r, stage, t) for r in reports for stage, t in ((r.get("training") or {}).get("startup") or {}).items()]
    if not rows:
        return []
    lines = ["| run | stage | processes | start to the logger, s | start to the first line, s |", "|---|---|---|---|---|"]
    lines += [f"| {_name(r)} | {stage} | {t['processes']} | {t['setup_s']:,.1f} | {t['first_log_s']:,.1f} |"
              for r, stage, t in rows]
    return lines + ["", "Start-up per stage, summed over its processes (layer groups, resumes; SFT too): from each process's "
                        "start to its logger (imports, teacher, student, data, engine) and to its first logged line "
                        "(the first steps too, where a GPU compiles its kernels).", ""]


def with_heldout_window(report: dict, path: str | Path) -> dict:
    """The report with perplexity.seq_len (`heldout_window`) read from its student's result folder where the
    report does not record it."""
    ppl = report.get("perplexity")
    if not ppl or ppl.get("seq_len") is not None:
        return report
    return {**report, "perplexity": {**ppl, "seq_len": heldout_window(report, eval_dirs(path, report)[0])}}


def _window_note(reports: list[dict]) -> list[str]:
    """A line naming the runs whose held-out windows are not the most common length, when the runs differ."""
    windows = {_name(r): (r.get("perplexity") or {}).get("seq_len") for r in reports}
    known = [w for w in windows.values() if w is not None]
    if len(set(known)) < 2:
        return []
    common = max(set(known), key=known.count)
    others = "; ".join(f"{name}: {w}" for name, w in windows.items() if w is not None and w != common)
    return [f"- Held-out perplexity, the ppl ratio and the validation CE and KL are over windows of {common} tokens, "
            f"but for {others} tokens: compare them only between runs of one window length (a token in a shorter "
            "window has less context), and the benchmarks and NIAH across all."]


def attach_training(report: dict, path: str | Path) -> dict:
    """Add the run's training losses (harness.eval.training) when `path` is a run directory or its eval folder."""
    from harness.eval.training import training_summary

    path = Path(path)
    run = path.parent if path.name == "eval" else path
    summary = training_summary(run) if (run / "job.yaml").is_file() else None
    return {**report, "training": summary} if summary else report


def compare(reports: list[dict], out: Path, paired: Optional[list[dict]] = None,
            along: Optional[list[dict]] = None) -> Path:
    """out/comparison.{json,md}, out/recovery.png, the tasks' plots (out/niah_by_length.png) and (with training
    losses) out/loss_curves.png for several runs; with `paired` (harness.eval.paired.paired_report of chosen
    pairs), their differences under comparison.json's "paired" and in comparison.md, and with `along`
    (paired_along) the same along stage 3 under "paired_along"."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.json").write_text(json.dumps({"runs": reports, **({"paired": paired} if paired else {}),
                                                     **({"paired_along": along} if along else {})}, indent=1))
    (out / "comparison.md").write_text(comparison_markdown(reports, paired, along))
    plot_recovery(reports, out / "recovery.png")
    for task in registered_tasks():
        task.plot(reports, out)
    if any(r.get("training") for r in reports):
        from harness.eval.training import plot_loss_curves

        plot_loss_curves({_name(r): r.get("training") for r in reports}, out / "loss_curves.png")
    return out / "comparison.md"


def _xerr(value: float, interval: Optional[list[float]]) -> Optional[list[list[float]]]:
    """Matplotlib's xerr (in %) for a value and its interval; None without one."""
    if not interval:
        return None
    return [[max(0.0, 100 * (value - interval[0]))], [max(0.0, 100 * (interval[1] - value))]]


def plot_recovery(reports: list[dict], path: Path) -> None:
    """Horizontal bars (run names are long): the average chance-normalised recovery per run, per-task
    normalised recoveries as dots; whiskers are 95% bootstrap intervals; hollow dots: teacher at chance (not
    averaged)."""
    fig = _figure(height=1.5 + 0.45 * len(reports))
    ax = fig.add_subplot()
    for i, r in enumerate(reports):
        average = r["average"].get("recovery_norm")
        if average is not None:
            ax.barh(i, 100 * average, color="tab:blue", alpha=0.7,
                    xerr=_xerr(average, r["average"].get("recovery_norm_ci")), capsize=3)
        per_task = [t for t in r["tasks"].values() if t.get("recovery_norm") is not None]
        for j, t in enumerate(per_task):
            y = i + (0.5 * (j / (len(per_task) - 1)) - 0.25 if len(per_task) > 1 else 0.0)
            hollow = bool(t.get("at_chance"))
            ax.errorbar(100 * t["recovery_norm"], y, xerr=_xerr(t["recovery_norm"], t.get("recovery_norm_ci")),
                        fmt="o", markersize=3.5, color="black", mfc="white" if hollow else "black",
                        elinewidth=0.8, capsize=2, zorder=3)
    ax.axvline(100, color="gray", linestyle="--", linewidth=1)
    ax.axvline(0, color="gray", linestyle=":", linewidth=1)
    ax.set_yticks(range(len(reports)), [_name(r) for r in reports], fontsize=8)
    ax.invert_yaxis()  # the first run on top, as in the tables
    ax.set_xlabel("chance-normalised teacher recovery (%): (student - chance) / (teacher - chance)")
    ax.set_title("Normalised recovery: average (bars), per task (dots; hollow: teacher at chance, not averaged); "
                 "95% intervals", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
