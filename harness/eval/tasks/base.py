"""The interface of an evaluation task and the registry that the evaluation job, the report, the paired differences
and the curves ask.

A task is one module with one subclass of `EvalTask`, registered with `register_task`. It declares:

  name, title      its registry name (and the key of its part of report.json) and its heading in reports
  settings         a dataclass of described fields (harness.config.described): the section `<name>:` of
                   RUN/eval.yaml, and `eval.<name>` of a job where harness.config.EvalConfig declares that field
                   (else the spec gets the dataclass' defaults); null there: the task does not run. The built-in
                   tasks keep the older keys of the spec (`spec_keys`), so existing jobs and eval.yaml files load.
  sides            whether it runs on the student, the teacher or both; teacher_shared: whether the teacher's
                   results may be shared between runs (teacher_cache), named by `cache_key`
  run              scores one model into its result folder, resumably (a re-run keeps what is finished)
  summarise        reads a result folder back: named `Score`s (value, n, interval, chance, higher is better,
                   whether it enters the normalised-recovery average) and per-example values keyed by example id

Everything the report, the paired differences and the curves need comes from hooks with neutral defaults here;
`ScoredTask` derives them all from `summarise` (its report section, its recovery rows, its comparison table, its
paired differences, its curves), so that a new task writes `run` and `summarise` only. The built-in tasks
(harness/eval/tasks/{benchmarks,niah,perplexity,chat_samples}.py) implement the hooks themselves, which keeps
their older report layout.

    register_task(task) / unregister_task(name)  add or remove a task (tests register their own)
    tasks()                                      the registered tasks, in report order
    tasks_in_run_order()                         the same, cheap ones first (run_order)
    get_task(name)                               one task; ConfigError naming the registered ones
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Optional

import numpy as np

from harness.config import ConfigError
from harness.eval.formatting import fmt, fmt_ci, run_name, teachers
from harness.eval.recovery import difference, paired_bootstrap, paired_row, percentile_interval

UNITS = ("fraction", "score", "value")  # how values print: 48.2% (pts), 0.482, 4 significant digits


@dataclass(frozen=True)
class Score:
    """One named score of one model on a task (one side of the report)."""

    name: str
    value: Optional[float]
    n: Optional[int] = None  # examples (or tokens) it is over
    interval: Optional[tuple[float, float]] = None  # 95% interval, where the task has one
    chance: Optional[float] = None  # the score of guessing, where there is one
    higher_is_better: bool = True
    recovery: bool = False  # a row of the recovery table: in the chance-normalised recovery average
    unit: str = "fraction"  # one of UNITS

    def as_dict(self) -> dict:
        """The score as report.json keeps it (without its name, the key it sits under)."""
        return {"value": self.value, "n": self.n, "interval": _list(self.interval),
                "chance": self.chance, "higher_is_better": self.higher_is_better, "recovery": self.recovery,
                "unit": self.unit}


@dataclass(frozen=True)
class TaskResults:
    """What `summarise` reads from one result folder: the scores, per score the per-example values keyed by example
    id (for intervals and paired differences; a score without them gets neither), and the settings the examples
    depend on (two runs whose settings differ are not paired)."""

    scores: list[Score]
    examples: dict[str, dict[str, float]] = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    def score(self, name: str) -> Optional[Score]:
        return next((s for s in self.scores if s.name == name), None)


@dataclass(frozen=True)
class Curve:
    """A scalar of a report drawn against tokens along stage 3 (harness.eval.curves)."""

    value: Callable[[dict], Any]  # the student's value, from a report
    label: str  # the y axis
    higher_is_better: bool = True
    teacher: Callable[[dict], Any] = lambda report: None  # the teacher's value, drawn as a reference line
    log_scale: bool = False


Column = tuple[str, Callable[[dict], str]]  # (header, cell of a report)
SideColumn = tuple[str, Callable[[dict, str], str]]  # (header, cell of a report's side: "student" or "teacher")


class EvalTask:
    """One evaluation of the evaluation job. Subclasses set the class attributes and implement `run` and `summarise`;
    every other hook may stay as it is (the task then adds nothing there)."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    settings: ClassVar[Optional[type]] = None  # the dataclass of its spec section `<name>:`; None: spec_keys
    spec_keys: ClassVar[tuple[str, ...]] = ()  # the older spec fields a built-in task reads instead
    runs_by_default: ClassVar[bool] = True  # a spec that names no settings for it runs it with the defaults
    sides: ClassVar[tuple[str, ...]] = ("student", "teacher")
    teacher_shared: ClassVar[bool] = True  # the teacher's results may sit in the shared teacher cache
    run_order: ClassVar[int] = 50  # the job runs tasks by ascending run_order (cheap ones first)
    section: ClassVar[str] = "scores"  # where report.md shows it: "scores" (before the training losses) or "samples"
    plots: ClassVar[tuple[str, ...]] = ()  # the files `plot` writes into a comparison folder

    # ------------------------------------------------------------------------------------------ settings

    def spec_fields(self) -> list[tuple[str, Any, Any]]:
        """The fields the task adds to the evaluation spec (dataclasses.make_dataclass' form): `<name>:` holding its
        settings dataclass or null."""
        if self.settings is None:
            return []
        meta = {"help": f"The {self.title or self.name} evaluation ({type(self).__module__}); null: not run.",
                "rule": None}
        return [(self.name, Optional[self.settings], field(default_factory=self.default_settings, metadata=meta))]

    def default_settings(self) -> Any:
        """The settings of a spec that names none: the dataclass' defaults, or None (not run) unless runs_by_default."""
        return self.settings() if self.settings is not None and self.runs_by_default else None

    def settings_from_job(self, ev: Any) -> Any:
        """The settings a job's `eval:` section (harness.config.EvalConfig) gives: a copy of its field `<name>` where
        it has one, else `default_settings`."""
        if self.settings is None:
            return None
        if not any(f.name == self.name for f in dataclasses.fields(ev)):
            return self.default_settings()
        return copy.deepcopy(getattr(ev, self.name))

    def settings_of(self, spec: Any) -> Any:
        """The task's settings in an evaluation spec (None: it does not run)."""
        return getattr(spec, self.name, None) if self.settings is not None else None

    def wanted(self, spec: Any) -> bool:
        """Whether the spec asks for the task."""
        return self.settings_of(spec) is not None

    def cache_key(self, spec: Any) -> dict:
        """What the teacher's results depend on beyond what its result files check themselves (harness.eval.job.
        teacher_cache_key hashes it into the shared teacher folder's name). {} for a task whose files record and
        check their own settings, as every new task should: the cache then stays where it was."""
        return {}

    def for_during(self, spec: Any, during: Any) -> None:
        """Set the spec to the small grid of the evaluations along stage 3 (`during`: the job's eval.during). By
        default the task does not run there."""
        if self.settings is not None:
            setattr(spec, self.name, None)

    # ------------------------------------------------------------------------------------------ running

    def runs_on(self, side: str) -> bool:
        return side in self.sides

    def run(self, model: Any, tokenizer: Any, settings: Any, out_dir: Path, *, label: str, device: Any,
            progress: bool, spec: Any) -> Any:
        """Score `model` into out_dir, resuming from what is there; `spec` holds the spec-wide settings
        (generation_batch_size, the run's job). Returns what it wrote (for the caller's convenience only)."""
        raise NotImplementedError(f"{type(self).__name__}.run")

    def summarise(self, folder: Path) -> Optional[TaskResults]:
        """The scores in one result folder; None when it holds no results of the task."""
        raise NotImplementedError(f"{type(self).__name__}.summarise")

    def teacher_folder(self, student_dir: Path, teacher_dir: Optional[Path]) -> Optional[Path]:
        """Where the task's teacher results are: the (possibly shared) teacher folder, or for a task whose teacher
        results are not shared, the run's own OUTPUT_DIR/teacher beside its student folder."""
        if teacher_dir is None or "teacher" not in self.sides:
            return None
        return teacher_dir if self.teacher_shared else Path(student_dir).parent / "teacher"

    # ------------------------------------------------------------------------------------------ one run's report

    def report_fields(self, student_dir: Path, teacher_dir: Optional[Path]) -> dict:
        """The task's top-level keys of report.json (teacher_dir: `teacher_folder`)."""
        return {}

    def recovery_scores(self, folder: Optional[Path]) -> dict[str, dict]:
        """Its rows of the recovery table in one result folder: {row: {"metric", "score", "n", "chance"}} (and a
        "stderr" where known)."""
        return {}

    def recovery_examples(self, folder: Optional[Path]) -> dict[str, dict]:
        """The per-example results of those rows: {row: {"metric", "by_task": {leaf: {"doc_id": [...], "score": [...],
        and "choices": [...] (chance 1/choices) or "chance": [...]}}}} (harness.eval.report.paired_columns)."""
        return {}

    def markdown(self, report: dict) -> list[str]:
        """Its section of report.md (lines)."""
        return []

    # ------------------------------------------------------------------------------------------ several runs

    def comparison_columns(self) -> list[Column]:
        """Its columns of comparison.md's table of runs."""
        return []

    def comparison_legend(self) -> Optional[str]:
        """What those columns mean (one clause of the legend under the table)."""
        return None

    def score_columns(self) -> list[SideColumn]:
        """Its columns of comparison.md's "Scores" table (one row per student and teacher)."""
        return []

    def score_note(self) -> Optional[str]:
        """A clause of the note under the "Scores" table."""
        return None

    def comparison_sections(self, reports: list[dict]) -> list[str]:
        """Its sections of comparison.md."""
        return []

    def plot(self, reports: list[dict], out: Path) -> None:
        """Its plots (named in `plots`) into a report or comparison folder."""

    # ------------------------------------------------------------------------------------------ paired differences

    def pairing(self, student_dir: Path, report: dict) -> Any:
        """What the paired differences read of one run's student results (RunResults.data[name])."""
        return None

    def example_differences(self, a: Any, b: Any) -> list[str]:
        """What differs between the examples two runs (harness.eval.paired.RunResults) were both scored on; [] if
        none, or if only one has results (`unpaired` names that)."""
        return []

    def unpaired(self, a: Any, b: Any) -> list[str]:
        """Its results when only one of two runs has them (what `pairing` read), which no row can pair."""
        mine, theirs = a.data.get(self.name), b.data.get(self.name)
        if (mine is None) == (theirs is None):
            return []
        has, lacks = (a, b) if mine is not None else (b, a)
        return [f"{self.title or self.name} (only {has.label} has complete results; {lacks.label} has none)"]

    def paired_rows(self, a: Any, b: Any, samples: int, seed: int) -> list[dict]:
        """Rows of B - A: {"metric", "unit", **harness.eval.recovery.paired_row(...)} (or `difference`)."""
        return []

    # ------------------------------------------------------------------------------------------ curves

    def curves(self) -> dict[str, Curve]:
        """The scalars of a report that curves may draw against tokens, by metric name."""
        return {}

    def default_curves(self) -> tuple[str, ...]:
        """Those drawn when a history is reported (harness.eval.curves.curves_report)."""
        return tuple(self.curves())


class ScoredTask(EvalTask):
    """A task whose report, recovery rows, comparison, paired differences and curves all come from `summarise`.

    report.json holds {name: {"student": {"scores": {score: Score.as_dict()}, "settings": {...}}, "teacher": ...}}
    (the key only where a side has results); report.md a table of the scores; comparison.md a table of every
    run's scores; the paired differences B - A of every score with per-example values (matched by example id),
    but those of recovery scores, which the recovery rows pair; the curves the scores named in `curve_scores`.
    """

    curve_scores: ClassVar[dict[str, bool]] = {}  # score -> higher is better: drawn against tokens as <name>_<score>

    def side(self, folder: Optional[Path]) -> Optional[dict]:
        """One result folder's part of the report section; a score without an interval gets the bootstrap interval
        of its per-example values, where it has them."""
        results = self.summarise(folder) if folder is not None else None
        if results is None:
            return None
        scores = {s.name: s.as_dict() for s in results.scores}
        for name, entry in scores.items():
            values = list(results.examples.get(name, {}).values())
            if entry["interval"] is None and values:
                means = paired_bootstrap(np.array([values], dtype=float), stream=f"{self.name} {name}")[0]
                entry["interval"] = _list(percentile_interval(means))
        return {"scores": scores, "settings": results.settings}

    def report_fields(self, student_dir: Path, teacher_dir: Optional[Path]) -> dict:
        student, teacher = self.side(student_dir), self.side(teacher_dir)
        return {} if student is None and teacher is None else {self.name: {"student": student, "teacher": teacher}}

    def row_name(self, score: str) -> str:
        """A recovery score's row in the recovery table."""
        return f"{self.name}/{score}"

    def recovery_scores(self, folder: Optional[Path]) -> dict[str, dict]:
        results = self.summarise(folder) if folder is not None else None
        return {} if results is None else {self.row_name(s.name): {"metric": s.name, "score": s.value, "n": s.n,
                                                                    "chance": s.chance}
                                           for s in results.scores if s.recovery}

    def recovery_examples(self, folder: Optional[Path]) -> dict[str, dict]:
        results = self.summarise(folder) if folder is not None else None
        entries = {}
        for s in results.scores if results is not None else []:
            values = results.examples.get(s.name)
            if s.recovery and values:
                ids = sorted(values)
                entries[self.row_name(s.name)] = {"metric": s.name, "by_task": {self.row_name(s.name): {
                    "doc_id": ids, "score": [values[i] for i in ids], "chance": [s.chance or 0.0] * len(ids)}}}
        return entries

    def _section(self, report: dict) -> dict:
        return report.get(self.name) or {}

    def markdown(self, report: dict) -> list[str]:
        section = self._section(report)
        sides = [(side, section.get(side)) for side in ("student", "teacher") if section.get(side)]
        if not sides:
            return []
        names = list(dict.fromkeys(n for _, side in sides for n in side["scores"]))
        lines = [f"## {self.title or self.name}", "", "| score | n | chance | " + " | ".join(
            f"{name} [95% CI]" for name, _ in sides) + " |", "|" + "---|" * (3 + len(sides))]
        for score in names:
            first = next(side["scores"][score] for _, side in sides if score in side["scores"])
            pct = first["unit"] == "fraction"
            cells = [_score_cell(side["scores"].get(score), pct) for _, side in sides]
            lines.append(f"| {score} | {first['n'] if first['n'] is not None else '-'} | {fmt(first['chance'], pct)} | "
                         + " | ".join(cells) + " |")
        return lines + [""]

    def comparison_rows(self, reports: list[dict]) -> list[tuple[str, dict]]:
        """(row name, this task's section of one side) for every run's student, then each distinct teacher, leaving
        out those without results."""
        rows = [(run_name(r), self._section(r).get("student")) for r in reports]
        rows += [(name, self._section(r).get("teacher")) for name, r in teachers(reports)]
        return [(name, side) for name, side in rows if side]

    def comparison_sections(self, reports: list[dict]) -> list[str]:
        rows = self.comparison_rows(reports)
        if not rows:
            return []
        names = list(dict.fromkeys(n for _, side in rows for n in side["scores"]))
        lines = [f"## {self.title or self.name}", "", "| model | " + " | ".join(names) + " |",
                 "|" + "---|" * (1 + len(names))]
        for name, side in rows:
            scores = side["scores"]
            cells = [_score_cell(scores.get(n), (scores.get(n) or {}).get("unit") == "fraction") for n in names]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return lines + [""]

    def pairing(self, student_dir: Path, report: dict) -> Optional[TaskResults]:
        return self.summarise(student_dir)

    def example_differences(self, a: Any, b: Any) -> list[str]:
        mine, theirs = a.data.get(self.name), b.data.get(self.name)
        if mine is None or theirs is None:
            return []
        keys = sorted(set(mine.settings) | set(theirs.settings))
        found = [f"{self.name} {k} ({mine.settings.get(k)} against {theirs.settings.get(k)})"
                 for k in keys if mine.settings.get(k) != theirs.settings.get(k)]
        for score in self._paired_scores(mine, theirs):
            if set(mine.examples.get(score, {})) != set(theirs.examples.get(score, {})):
                found.append(f"{self.name} {score}'s examples (different example ids)")
        return found

    @staticmethod
    def _paired_scores(mine: TaskResults, theirs: TaskResults) -> list[str]:
        """The scores both runs have that the recovery rows do not already pair."""
        return [s.name for s in mine.scores if not s.recovery and theirs.score(s.name) is not None]

    def paired_rows(self, a: Any, b: Any, samples: int, seed: int) -> list[dict]:
        mine, theirs = a.data.get(self.name), b.data.get(self.name)
        if mine is None or theirs is None:
            return []
        rows = []
        for score in self._paired_scores(mine, theirs):
            sa, sb = mine.score(score), theirs.score(score)
            ea, eb = mine.examples.get(score), theirs.examples.get(score)
            if ea and eb:
                ids = sorted(ea)
                row = difference([ea[i] for i in ids], [eb[i] for i in ids], stream=f"{self.name} {score}",
                                 samples=samples, seed=seed)
            else:
                row = paired_row(sa.value, sb.value, None, sa.n, "no per-example results")
            rows.append({"metric": f"{self.title or self.name}: {score}", "unit": sa.unit, **row})
        return rows

    def curves(self) -> dict[str, Curve]:
        def pick(score: str, side: str) -> Callable[[dict], Any]:
            return lambda r: (((self._section(r).get(side) or {}).get("scores") or {}).get(score) or {}).get("value")

        return {re.sub(r"\W+", "_", f"{self.name}_{score}"): Curve(
                    pick(score, "student"), f"{self.title or self.name}: {score}", higher, pick(score, "teacher"))
                for score, higher in self.curve_scores.items()}


def _list(interval: Optional[tuple[float, float]]) -> Optional[list[float]]:
    return None if interval is None else list(interval)


def _score_cell(score: Optional[dict], pct: bool) -> str:
    return "-" if score is None else fmt_ci(score["value"], score.get("interval"), pct)


# --------------------------------------------------------------------------------------------- registry

_REGISTRY: dict[str, EvalTask] = {}


def register_task(task: EvalTask, *, replace: bool = False) -> EvalTask:
    """Add `task` (an EvalTask instance) to the registry, after those there; returns it. ValueError for a name
    that is taken (unless `replace`) or that is no identifier."""
    if not isinstance(task, EvalTask) or not task.name.isidentifier():
        raise ValueError(f"register_task takes an EvalTask instance with an identifier as its name, got {task!r}.")
    if task.name in _REGISTRY and not replace:
        raise ValueError(f"An evaluation task '{task.name}' is registered already ({type(_REGISTRY[task.name])}).")
    bad = [s for s in task.sides if s not in ("student", "teacher")]
    if bad or task.section not in ("scores", "samples"):
        raise ValueError(f"Task '{task.name}': sides are 'student'/'teacher' and section 'scores'/'samples'.")
    _REGISTRY[task.name] = task
    return task


def unregister_task(name: str) -> None:
    """Remove a task from the registry (tests that registered their own)."""
    _REGISTRY.pop(name, None)


def tasks() -> tuple[EvalTask, ...]:
    """The registered tasks in registration order: the order of report.json, report.md and the comparisons."""
    return tuple(_REGISTRY.values())


def tasks_in_run_order() -> tuple[EvalTask, ...]:
    """The registered tasks by ascending run_order (ties in registration order): the evaluation job's order."""
    return tuple(sorted(_REGISTRY.values(), key=lambda t: t.run_order))


def task_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_task(name: str) -> EvalTask:
    """The registered task `name`; ConfigError (one paragraph) naming the registered ones otherwise."""
    if name not in _REGISTRY:
        raise ConfigError(f"Unknown evaluation task '{name}'. The registered tasks: {describe_tasks()}.")
    return _REGISTRY[name]


def describe_tasks() -> str:
    """'benchmarks (tasks, limit, batch_size), niah (niah), ...': each task and where the spec holds its settings."""
    return ", ".join(f"{t.name} ({', '.join(t.spec_keys or [t.name])})" for t in _REGISTRY.values())
