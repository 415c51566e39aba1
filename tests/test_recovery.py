"""Chance-normalised recovery and its paired bootstrap intervals (harness.eval.recovery), in the reports
(harness.eval.report) and the curves (harness.eval.curves). CPU only, no model: result files are written here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from harness.eval import curves, recovery
from harness.eval.lm_eval_tasks import EXAMPLES_FILE
from harness.eval.history import make_entry
from harness.eval.report import build_report, compare, comparison_markdown, markdown, write_report


def _ones(k: int, n: int) -> list[int]:
    """n per-example scores, the first k correct."""
    return [1] * k + [0] * (n - k)


# per task: (student scores, teacher scores, choices per example); 40 examples each
ARC_CHOICES = [3, 4, 5, 4] * 10
TASKS = {
    "piqa": (_ones(26, 40), _ones(32, 40), [2] * 40),  # teacher 0.8, clearly above chance 0.5
    "winogrande": (_ones(21, 40), _ones(22, 40), [2] * 40),  # teacher 0.55: its interval reaches 0.5
    "lambada_openai": (_ones(12, 40), _ones(30, 40), [0] * 40),  # generative: chance 0
    "arc_easy": (_ones(20, 40), _ones(36, 40), ARC_CHOICES),  # 3 to 5 choices
}


def _write_side(folder: Path, tasks: dict[str, tuple[list[int], list[int]]], *, examples: bool = True,
                stderr: float | None = None) -> None:
    """bench.json (and, with `examples`, bench_examples.json) for one model as harness.eval.lm_eval_tasks writes
    them."""
    folder.mkdir(parents=True, exist_ok=True)
    header = {"label": folder.name, "limit": 40, "offline": True}
    bench, per_example = {**header, "tasks": {}}, {**header, "tasks": {}}
    for name, (scores, choices) in tasks.items():
        bench["tasks"][name] = {"metric": "acc", "score": sum(scores) / len(scores), "n": len(scores),
                                "stderr": stderr}
        if examples:
            bench["tasks"][name]["chance"] = float(np.mean([1 / n if n else 0.0 for n in choices]))
            per_example["tasks"][name] = {"metric": "acc", "by_task": {name: {
                "doc_id": list(range(len(scores))), "score": scores, "choices": choices}}}
    (folder / "bench.json").write_text(json.dumps(bench))
    if examples:
        (folder / EXAMPLES_FILE).write_text(json.dumps(per_example))


def _report(tmp: Path, name: str = "run", *, student_examples: bool = True, tasks=TASKS) -> dict:
    student, teacher = tmp / name / "student", tmp / name / "teacher"
    _write_side(student, {t: (s, c) for t, (s, _, c) in tasks.items()}, examples=student_examples)
    _write_side(teacher, {t: (s, c) for t, (_, s, c) in tasks.items()})
    return build_report(student, teacher, label=name, mixer="gla", tasks=list(tasks))


# --------------------------------------------------------------------------------------------- statistics


def test_chance_level_and_normalised_recovery_by_hand():
    assert recovery.chance_level([2, 4, 5, 0]) == pytest.approx((1 / 2 + 1 / 4 + 1 / 5 + 0) / 4)
    assert recovery.chance_level([4] * 7) == pytest.approx(0.25)
    assert recovery.normalised_recovery(0.65, 0.8, 0.5) == pytest.approx(0.15 / 0.3)
    assert recovery.normalised_recovery(0.3, 0.75, 0.0) == pytest.approx(0.3 / 0.75)  # chance 0: the raw ratio
    assert recovery.normalised_recovery(0.6, 0.5, 0.5) is None  # teacher at chance: undefined
    assert recovery.normalised_recovery(0.6, 0.45, 0.5) is None
    with pytest.raises(ValueError):
        recovery.chance_level([])


def test_bootstrap_is_deterministic_and_seeded_per_task():
    data = np.array([_ones(13, 30), _ones(20, 30), [0.5] * 30], dtype=float)
    first = recovery.paired_bootstrap(data, stream="piqa")
    assert first.shape == (3, recovery.BOOTSTRAP_SAMPLES)
    assert np.array_equal(first, recovery.paired_bootstrap(data, stream="piqa"))
    assert not np.array_equal(first, recovery.paired_bootstrap(data, stream="winogrande"))
    assert not np.array_equal(first, recovery.paired_bootstrap(data, stream="piqa", seed=1))


def test_two_examples_give_the_hand_computed_interval():
    """Scores [0, 1]: a resample's mean is 0, 1/2 or 1 with probabilities 1/4, 1/2, 1/4, so the 2.5% and 97.5%
    percentiles are 0 and 1."""
    means = recovery.paired_bootstrap(np.array([[0.0, 1.0]]), samples=2000, stream="x")[0]
    assert set(np.unique(means)) == {0.0, 0.5, 1.0}
    assert np.mean(means == 0.0) == pytest.approx(0.25, abs=0.04)
    assert recovery.percentile_interval(means) == (0.0, 1.0)


def test_interval_of_a_mean_matches_the_normal_approximation():
    """400 examples, half correct: the 95% interval is 0.5 +- 1.96 sqrt(0.25 / 400) = 0.5 +- 0.049."""
    means = recovery.paired_bootstrap(np.array([_ones(200, 400)], dtype=float), stream="big")[0]
    low, high = recovery.percentile_interval(means)
    half = 1.96 * math.sqrt(0.5 * 0.5 / 400)
    assert low == pytest.approx(0.5 - half, abs=0.01) and high == pytest.approx(0.5 + half, abs=0.01)


def test_resampling_is_paired():
    """A student right exactly where the teacher is: every paired resample recovers 100%; resampling the two
    sides independently would not."""
    same = _ones(70, 100)
    row, draws = recovery.task_recovery("piqa", 0.7, 0.7, 0.5, np.array([same, same, [0.5] * 100], float))
    assert row["at_chance"] is False and np.allclose(draws, 1.0)
    assert row["recovery_norm_ci"] == (pytest.approx(1.0), pytest.approx(1.0))
    assert row["student_ci"] == row["teacher_ci"]


def test_teacher_at_chance_bases():
    assert recovery.teacher_at_chance(0.55, 0.5, (0.40, 0.70)) == (True, "bootstrap")
    assert recovery.teacher_at_chance(0.8, 0.5, (0.68, 0.92)) == (False, "bootstrap")
    assert recovery.teacher_at_chance(0.52, 0.5, None, stderr=0.014) == (True, "stderr")  # 0.52 - 0.027 < 0.5
    assert recovery.teacher_at_chance(0.56, 0.5, None, stderr=0.014) == (False, "stderr")
    assert recovery.teacher_at_chance(0.5, 0.5) == (True, "score")
    assert recovery.teacher_at_chance(None, 0.5) == (None, None)


# --------------------------------------------------------------------------------------------- one-run report


def test_report_rows_by_hand(tmp_path):
    report = _report(tmp_path)
    rows = report["tasks"]
    arc_chance = np.mean([1 / n for n in ARC_CHOICES])
    expected = {  # chance, student, teacher
        "piqa": (0.5, 26 / 40, 32 / 40), "winogrande": (0.5, 21 / 40, 22 / 40),
        "lambada_openai": (0.0, 12 / 40, 30 / 40), "arc_easy": (arc_chance, 20 / 40, 36 / 40)}
    for name, (chance, s, t) in expected.items():
        row = rows[name]
        assert row["chance"] == pytest.approx(chance)
        assert row["recovery"] == pytest.approx(s / t)  # the raw ratio is still there
        assert row["recovery_norm"] == pytest.approx((s - chance) / (t - chance))
        for key, value in (("student_ci", s), ("teacher_ci", t)):
            low, high = row[key]
            assert low < value < high
        assert row["intervals"] is None
    assert rows["winogrande"]["at_chance"] is True and rows["winogrande"]["teacher_ci"][0] <= 0.5
    assert rows["winogrande"]["recovery_norm_ci"] is None  # no interval dividing by a gain that may be zero
    for name in ("piqa", "lambada_openai", "arc_easy"):
        assert rows[name]["at_chance"] is False
        low, high = rows[name]["recovery_norm_ci"]
        assert low < rows[name]["recovery_norm"] < high


def test_teacher_at_chance_is_shown_but_left_out_of_the_average_and_named(tmp_path):
    report = _report(tmp_path)
    average, rows = report["average"], report["tasks"]
    kept = ["piqa", "lambada_openai", "arc_easy"]
    assert average["excluded"] == ["winogrande"] and average["norm_tasks"] == kept
    assert average["recovery_norm"] == pytest.approx(np.mean([rows[t]["recovery_norm"] for t in kept]))
    assert average["recovery"] == pytest.approx(np.mean([rows[t]["recovery"] for t in TASKS]))  # raw: all
    low, high = average["recovery_norm_ci"]
    assert low < average["recovery_norm"] < high
    text = markdown(report)
    winogrande = next(line for line in text.splitlines() if line.startswith("| winogrande"))
    assert f"{100 * rows['winogrande']['recovery_norm']:.1f}% (not averaged)" in winogrande
    left_out = next(line for line in text.splitlines() if line.startswith("Left out of the normalised average"))
    assert "winogrande" in left_out and "piqa" not in left_out
    assert "Intervals unavailable" not in text and "Paired intervals" not in text


def test_report_is_deterministic_and_independent_of_task_order(tmp_path):
    first, again = _report(tmp_path / "a"), _report(tmp_path / "b")
    assert json.dumps(first["tasks"]) == json.dumps(again["tasks"])
    reordered = _report(tmp_path / "c", tasks=dict(reversed(list(TASKS.items()))))
    for name in TASKS:
        assert reordered["tasks"][name]["recovery_norm_ci"] == first["tasks"][name]["recovery_norm_ci"]


def test_result_files_without_per_example_results_stay_readable(tmp_path):
    """A student evaluated before bench_examples.json existed: scores, chance and normalised recovery are
    still there, its and the normalised intervals are not (and the report says so); the teacher, which has
    per-example results, keeps its own interval and is judged at chance by it."""
    report = _report(tmp_path, student_examples=False)
    for name, row in report["tasks"].items():
        assert row["student_ci"] is None and row["recovery_norm_ci"] is None
        assert row["teacher_ci"] is not None and row["at_chance_basis"] == "bootstrap"
        assert "no per-example results for the student" in row["intervals"]
    assert report["tasks"]["piqa"]["recovery_norm"] == pytest.approx((26 / 40 - 0.5) / (32 / 40 - 0.5))
    assert report["average"]["excluded"] == ["winogrande"] and report["average"]["recovery_norm_ci"] is None
    assert "Paired intervals (normalised recovery" in markdown(report)


def test_oldest_result_files_fall_back_to_known_chance_and_stderr(tmp_path):
    """Neither side has per-example results: chance from the task's fixed choices (none for ARC, whose
    choices vary), the at-chance test from lm-eval's stderr."""
    student, teacher = tmp_path / "student", tmp_path / "teacher"
    tasks = {"piqa": (_ones(26, 40), [2] * 40), "arc_easy": (_ones(20, 40), ARC_CHOICES)}
    _write_side(student, tasks, examples=False)
    _write_side(teacher, {"piqa": (_ones(21, 40), [2] * 40), "arc_easy": (_ones(36, 40), ARC_CHOICES)},
                examples=False, stderr=0.03)
    report = build_report(student, teacher, label="old", tasks=["piqa", "arc_easy"])
    piqa, arc = report["tasks"]["piqa"], report["tasks"]["arc_easy"]
    assert piqa["chance"] == 0.5 and piqa["at_chance_basis"] == "stderr"
    assert piqa["at_chance"] is (21 / 40 - 1.96 * 0.03 <= 0.5)
    assert arc["chance"] is None and arc["recovery_norm"] is None and arc["recovery"] == pytest.approx(20 / 36)
    assert report["average"]["no_chance"] == ["arc_easy"] and report["average"]["excluded"] == ["piqa"]
    assert "Not normalised (chance unknown" in markdown(report)


def test_examples_of_different_documents_are_not_paired(tmp_path):
    report = _report(tmp_path)
    stored = json.loads((tmp_path / "run" / "student" / EXAMPLES_FILE).read_text())
    stored["tasks"]["piqa"]["by_task"]["piqa"]["doc_id"] = list(range(1, 41))
    (tmp_path / "run" / "student" / EXAMPLES_FILE).write_text(json.dumps(stored))
    again = build_report(tmp_path / "run" / "student", tmp_path / "run" / "teacher", label="run", tasks=list(TASKS))
    piqa = again["tasks"]["piqa"]
    assert piqa["recovery_norm_ci"] is None and "different examples" in piqa["intervals"]
    assert again["tasks"]["arc_easy"] == report["tasks"]["arc_easy"]


# --------------------------------------------------------------------------------------------- outputs


def test_comparison_and_plots_show_normalised_and_raw(tmp_path):
    reports = [_report(tmp_path, "run-a"), _report(tmp_path, "run-b", student_examples=False)]
    write_report(reports[0], tmp_path / "one")
    assert (tmp_path / "one" / "recovery.png").stat().st_size > 1000
    compare(reports, tmp_path / "cmp")
    text = (tmp_path / "cmp" / "comparison.md").read_text()
    assert text == comparison_markdown(reports)
    row = next(line for line in text.splitlines() if line.startswith("| run-a"))
    piqa = reports[0]["tasks"]["piqa"]
    low, high = piqa["recovery_norm_ci"]
    assert (f"{100 * piqa['recovery_norm']:.1f}% [{100 * low:.1f}, {100 * high:.1f}] "
            f"({100 * piqa['recovery']:.1f}%)") in row
    assert f"{100 * reports[0]['tasks']['winogrande']['recovery_norm']:.1f}%*" in row
    assert "- run-a [gla]: left out of the normalised average (teacher at chance): winogrande" in text
    assert "- run-b [gla]: no intervals (no per-example results) for" in text
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["runs"][0]
    assert saved["tasks"]["piqa"]["recovery_norm_ci"] == [low, high] and saved["average"]["excluded"] == ["winogrande"]
    assert (tmp_path / "cmp" / "recovery.png").stat().st_size > 1000


def test_curves_read_the_normalised_average_and_the_raw_one(tmp_path):
    report = _report(tmp_path)
    entry = make_entry(10, 1, "/c", report, params=10**8)
    assert curves.metric_series([entry], "average_recovery_norm") == ([10], [report["average"]["recovery_norm"]])
    assert curves.metric_series([entry], "average_recovery") == ([10], [report["average"]["recovery"]])
    assert curves.scale_points({"r": [entry]}) == {"gla": [(10**8, report["average"]["recovery_norm"])]}
