"""Evaluations during stage 3: when they are due, the crash-safe history and marks, plateaus, power laws, plots.

Everything here is CPU-only and fast: the training loop is simulated by token counts, the evaluations by
result files that harness.eval.report.build_report turns into the reports the history holds.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
from pathlib import Path

import pytest

from harness.eval import curves, history
from harness.eval.curves import fit_power_law, plateau_tokens
from harness.eval.history import (append_entry, clear_mark, due_evaluations, handled_tokens, make_entry,
                                  mark_for_evaluation, pending_marks, read_history)
from harness.eval.report import build_report

TAU = 2e9  # time constant of the synthetic learning curves


# --------------------------------------------------------------------------------------------- helpers


def _simulate(tokens_per_step: int, steps: range, every: int, done: set[int]) -> dict[int, int]:
    """Run the training loop's check over `steps`; {fired token count: step that fired it}."""
    fired: dict[int, int] = {}
    for step in steps:
        for t in due_evaluations(step * tokens_per_step, (step + 1) * tokens_per_step, every, done | set(fired)):
            assert t not in fired, f"{t} fired twice"
            fired[t] = step + 1
    return fired


def _report(tmp: Path, name: str, *, score: float, teacher_score: float = 0.6, niah: float = 0.5,
            ppl: float = 20.0) -> dict:
    """A real build_report over result files written for one student and its teacher."""
    student, teacher = tmp / name / "student", tmp / name / "teacher"
    for d, s, n, p in ((student, score, niah, ppl), (teacher, teacher_score, 0.9, 10.0)):
        d.mkdir(parents=True, exist_ok=True)
        (d / "bench.json").write_text(json.dumps({"tasks": {"piqa": {"metric": "acc", "score": s, "n": 10}}}))
        (d / "niah.json").write_text(json.dumps({"overall": n, "by_length": {"256": n}}))
        (d / "perplexity.json").write_text(json.dumps({"ppl": p, "tokens": 128, "source": "held-out"}))
    return build_report(student, teacher, label=name, mixer="gla", tasks=["piqa"])


def _entry(tokens: int, report: dict | None = None, **kw) -> dict:
    return make_entry(tokens, tokens // 10, f"/ckpt/step-{tokens // 10}", report or {"label": "r"}, **kw)


# --------------------------------------------------------------------------------------------- due evaluations


def test_due_evaluations_fire_once_at_each_multiple():
    fired = _simulate(tokens_per_step=30, steps=range(40), every=100, done=set())  # 1200 tokens in all
    assert sorted(fired) == list(range(100, 1201, 100))
    for t, step in fired.items():  # the first step whose token count reaches the multiple
        assert step * 30 >= t > (step - 1) * 30


def test_due_evaluations_bounds_and_big_steps():
    assert due_evaluations(100, 200, 100, set()) == [200]  # (before, after]: 100 was the previous step's
    assert due_evaluations(0, 99, 100, set()) == []  # token 0 is never due
    assert due_evaluations(0, 350, 100, {200}) == [100, 300]  # a long step crosses several; done is skipped
    assert due_evaluations(5, 5, 1, set()) == []
    for args in ((10, 5, 100), (0, 10, 0), (-1, 10, 5), (0, 10, 2.5), (0, 10, True)):
        with pytest.raises(ValueError):
            due_evaluations(*args, set())


def test_no_evaluation_twice_after_a_resume(tmp_path):
    """Crash after the marks at 300 and 400 but with the last checkpoint at step 8 (240 tokens): the replayed
    steps cross 300 and 400 again and must not mark them; later multiples fire as usual."""
    run, per_step, every = tmp_path / "run", 30, 100
    before_crash = _simulate(per_step, range(15), every, done=handled_tokens(run))  # up to 450 tokens
    assert sorted(before_crash) == [100, 200, 300, 400]
    for t, step in before_crash.items():
        mark_for_evaluation(run, t, step, tmp_path / f"step-{step}")
    for t in (100, 200):  # the evaluator finished these two
        append_entry(history.eval_dir(run), _entry(t))
        clear_mark(run, t)
    done = handled_tokens(run)
    assert done == {100, 200, 300, 400}
    after_resume = _simulate(per_step, range(8, 40), every, done=done)
    assert sorted(after_resume) == list(range(500, 1201, 100))
    assert not set(after_resume) & set(before_crash)


# --------------------------------------------------------------------------------------------- history


def test_history_sorted_and_deduplicated(tmp_path):
    for t, label in ((300, "a"), (100, "a"), (200, "a"), (200, "again")):
        append_entry(tmp_path, _entry(t, label=label))
    entries = read_history(tmp_path)
    assert [e["tokens"] for e in entries] == [100, 200, 300]
    assert entries[1]["label"] == "again"  # the re-run after a resume wins
    assert all(e["time"] and e["checkpoint"].startswith("/ckpt/") for e in entries)
    assert len((tmp_path / history.HISTORY_FILE).read_text().splitlines()) == 4  # the file only grows
    assert read_history(tmp_path / "nowhere") == []


def test_history_survives_a_torn_line(tmp_path):
    append_entry(tmp_path, _entry(100))
    append_entry(tmp_path, _entry(200))
    path = tmp_path / history.HISTORY_FILE
    whole = json.dumps(_entry(300))
    with open(path, "a") as f:  # the crash: half a line, no newline
        f.write(whole[: len(whole) // 2])
    assert [e["tokens"] for e in read_history(tmp_path)] == [100, 200]
    append_entry(tmp_path, _entry(300))  # the next append starts a fresh line
    append_entry(tmp_path, _entry(400))
    assert [e["tokens"] for e in read_history(tmp_path)] == [100, 200, 300, 400]


def test_history_rejects_bad_entries(tmp_path):
    for bad in ({"tokens": -1, "step": 0, "report": {}}, {"tokens": 5, "step": 0, "report": None},
                {"tokens": "5", "step": 0, "report": {}}, {"tokens": 5, "step": 0, "report": {}, "params": 0}):
        with pytest.raises(ValueError):
            append_entry(tmp_path, bad)
    assert not (tmp_path / history.HISTORY_FILE).exists()


def test_entry_defaults_from_the_report(tmp_path):
    report = _report(tmp_path, "run-a", score=0.3)
    entry = make_entry(1000, 10, tmp_path / "ckpt", report, params=1234)
    assert entry["label"] == "run-a" and entry["mixer"] == "gla" and entry["params"] == 1234
    assert set(entry) == {"tokens", "step", "checkpoint", "label", "mixer", "params", "report", "time"}


# --------------------------------------------------------------------------------------------- marks


def test_marks_written_listed_and_cleared(tmp_path):
    run = tmp_path / "run"
    for t in (2000, 1000):
        path = mark_for_evaluation(run, t, t // 10, tmp_path / f"step-{t // 10}", mixer="gla")
        assert path == run / "eval" / "pending" / f"tokens-{t}.json"
    pending = run / "eval" / "pending"
    (pending / ".tokens-3000.json.partial-abcd").write_text('{"tokens": 3000')  # an interrupted write
    (pending / "tokens-4000.json").write_text('{"tokens": 40')  # not a mark
    marks = pending_marks(run)
    assert [m["tokens"] for m in marks] == [1000, 2000]
    assert marks[0]["step"] == 100 and marks[0]["mixer"] == "gla"
    assert marks[0]["checkpoint"] == str((tmp_path / "step-100").resolve()) and Path(marks[0]["path"]).is_file()
    assert clear_mark(run, 1000) and not clear_mark(run, 1000)
    assert [m["tokens"] for m in pending_marks(run)] == [2000]
    assert pending_marks(tmp_path / "other") == []
    with pytest.raises(ValueError):
        mark_for_evaluation(run, 10, 1, tmp_path, time="now")


def test_a_mark_is_all_or_nothing(tmp_path, monkeypatch):
    """A crash between writing and renaming leaves no mark; a completed mark is replaced whole."""
    run = tmp_path / "run"
    mark_for_evaluation(run, 1000, 10, tmp_path / "old")

    def crash(*args):
        raise OSError("killed")

    monkeypatch.setattr(history.os, "replace", crash)
    with pytest.raises(OSError):
        mark_for_evaluation(run, 2000, 20, tmp_path / "new")
    with pytest.raises(OSError):
        mark_for_evaluation(run, 1000, 11, tmp_path / "new")
    monkeypatch.undo()
    marks = pending_marks(run)
    assert [(m["tokens"], m["step"]) for m in marks] == [(1000, 10)]
    assert marks[0]["checkpoint"] == str((tmp_path / "old").resolve())
    assert not (run / "eval" / "pending" / "tokens-2000.json").exists()


# --------------------------------------------------------------------------------------------- plateau


def _grid(step: float, end: float = 20e9) -> list[int]:
    return [int(i * step) for i in range(int(end / step) + 1)]


def test_plateau_of_a_saturating_curve():
    """v = 1 - exp(-t/tau): gain per 1e9 tokens 1e9/tau * exp(-t/tau) = 0.01 at t* = tau ln 50 (7.82e9)."""
    t_star = TAU * math.log(50.0)
    for h in (1e8, 5e8):
        ts = _grid(h)
        vs = [1 - math.exp(-t / TAU) for t in ts]
        at = plateau_tokens(ts, vs, 0.01)
        assert abs(at - t_star) <= h
        # exactly: the first segment whose secant 1e9/tau e^{-t/tau} (1 - e^{-h/tau}) / (h/tau) is < 0.01
        bound = TAU * math.log(50.0 * (1 - math.exp(-h / TAU)) / (h / TAU))
        assert at == min(t for t in ts if t > bound)


def test_plateau_of_a_falling_perplexity():
    """ppl = 10 + 5 exp(-t/tau), lower is better: the fall per 1e9 tokens is 2.5 exp(-t/tau) = 0.05 at tau ln 50."""
    ts = _grid(1e8)
    vs = [10 + 5 * math.exp(-t / TAU) for t in ts]
    assert abs(plateau_tokens(ts, vs, 0.05, higher_is_better=False) - TAU * math.log(50.0)) <= 1e8
    assert plateau_tokens(ts, vs, 0.05) == 0  # read as higher-is-better it never gains at all


def test_plateau_of_lines_and_edge_cases():
    ts = _grid(1e9, 10e9)
    assert plateau_tokens(ts, [0.02 * t / 1e9 for t in ts], 0.01) is None  # a steady gain never plateaus
    assert plateau_tokens(ts, [0.005 * t / 1e9 for t in ts], 0.01) == 0  # below the threshold from the start
    assert plateau_tokens(ts, [0.7] * len(ts), 0.01) == 0  # flat: the first point
    assert plateau_tokens([5], [0.7], 0.01) is None  # one point: no segment to judge
    rise_then_flat = [min(t, 4e9) / 1e9 * 0.1 for t in ts]
    assert plateau_tokens(ts, rise_then_flat, 0.01) == int(4e9)
    for args in (([0, 0], [1, 2], 0.01), ([0, 1], [1], 0.01), ([0, 1], [1, 2], 0), ([0, 1], [1, math.nan], 0.01)):
        with pytest.raises(ValueError):
            plateau_tokens(*args)


def test_plateau_smoothing_ignores_a_noise_dip():
    ts = [int(i * 1e9) for i in range(9)]
    vs = [0.0, 0.4, 0.6, 0.7, 0.75, 0.8, 0.8, 0.75, 0.8]  # the dip at 7e9 and the rebound are noise
    assert plateau_tokens(ts, vs, 0.02) is None  # the rebound reads as a gain of 0.05 per 1e9
    assert plateau_tokens(ts, vs, 0.02, smooth=True) == int(5e9)
    assert curves.isotonic([1, 3, 2, 4]) == [1, 2.5, 2.5, 4]


# --------------------------------------------------------------------------------------------- power law


SIZES = [1e7 * 10 ** (i / 4) for i in range(12)]  # 1e7 .. 5.6e9


def test_power_law_exact():
    recovery = [1 - 3 * n ** -0.3 for n in SIZES]
    fit = fit_power_law(SIZES, recovery)
    assert fit["alpha"] == pytest.approx(0.3, abs=1e-9) and fit["a"] == pytest.approx(3.0, rel=1e-9)
    assert fit["r2"] == pytest.approx(1.0, abs=1e-12) and fit["n_points"] == 12 and fit["reason"] is None
    assert curves.power_law_value(fit, 1e8) == pytest.approx(1 - 3 * 1e8 ** -0.3)


def test_power_law_with_noise_and_points_at_the_teacher():
    rng = random.Random(0)
    recovery = [1 - 3 * n ** -0.3 * math.exp(rng.gauss(0, 0.02)) for n in SIZES]
    fit = fit_power_law(SIZES + [1e10, 2e10], recovery + [1.0, 1.02])
    assert fit["alpha"] == pytest.approx(0.3, abs=0.02) and fit["r2"] > 0.99
    assert fit["n_points"] == 12 and fit["excluded"] == [[1e10, 1.0], [2e10, 1.02]]


def test_power_law_needs_two_sizes():
    for params, values in (([1e8], [0.9]), ([1e8, 1e8], [0.9, 0.8]), ([1e8, 1e9], [0.9, 1.0]), ([], [])):
        fit = fit_power_law(params, values)
        assert fit["alpha"] is None and fit["a"] is None and fit["r2"] is None and fit["reason"]
    assert "fractions" in fit_power_law([1e8, 1e9], [95.0, 97.0])["reason"]  # percentages, not fractions
    for params, values in (([0, 1e9], [0.9, 0.95]), ([1e8], [0.9, 0.95]), ([1e8, 1e9], [0.9, math.inf])):
        with pytest.raises(ValueError):
            fit_power_law(params, values)


# --------------------------------------------------------------------------------------------- reports, plots


def _histories(tmp_path: Path) -> dict[str, list[dict]]:
    """Two runs with saturating score curves (teacher 0.6), one per mixer, evaluated every 1e9 tokens."""
    out = {}
    for name, mixer, tau, params in (("run-gla", "gla", 1e9, 10**8), ("run-gdn", "gated_deltanet", 5e9, 10**9)):
        entries = []
        for i in range(11):
            t = int(i * 1e9)
            report = _report(tmp_path, f"{name}-{i}", score=0.6 * (1 - 0.5 * math.exp(-t / tau)),
                             niah=0.9 * (1 - math.exp(-t / tau)), ppl=10 + 10 * math.exp(-t / tau))
            entries.append(make_entry(t, i, f"/ckpt/{i}", report, label=name, mixer=mixer, params=params))
        out[name] = entries
    return out


def test_metrics_come_from_the_report(tmp_path):
    report = _report(tmp_path, "one", score=0.3, niah=0.45, ppl=25.0)
    h = [make_entry(10, 1, "/c", report)]
    assert curves.metric_series(h, "average_recovery") == ([10], [pytest.approx(0.5)])
    assert curves.metric_series(h, "average_score") == ([10], [0.3])
    assert curves.metric_series(h, "niah_overall") == ([10], [0.45])
    assert curves.metric_series(h, "perplexity") == ([10], [25.0])
    assert curves.metric_series(h, "perplexity_ratio") == ([10], [2.5])
    assert curves.metric_series([make_entry(10, 1, "/c", {"label": "x"})], "niah_overall") == ([], [])
    with pytest.raises(ValueError, match="Unknown metric"):
        curves.metric_series(h, "accuracy")


def test_curves_report_writes_json_and_plots(tmp_path):
    histories = _histories(tmp_path / "results")
    result = curves.curves_report(histories, tmp_path / "out", {"average_recovery": 0.01, "perplexity": 0.1})
    saved = json.loads((tmp_path / "out" / "curves.json").read_text())
    assert saved == json.loads(json.dumps(result))
    run = saved["runs"]["run-gla"]
    assert run["mixer"] == "gla" and run["metrics"]["average_recovery"]["tokens"] == [int(i * 1e9) for i in range(11)]
    ts, vs = curves.metric_series(histories["run-gla"], "average_recovery")
    assert run["metrics"]["average_recovery"]["plateau"] == plateau_tokens(ts, vs, 0.01) is not None
    # recovery 1 - 0.5 e^{-t/1e9}: gain 0.5 e^{-t/1e9} per 1e9 tokens, secants drop below 0.01 from t = 4e9
    assert run["metrics"]["average_recovery"]["plateau"] == int(4e9)
    assert run["metrics"]["niah_overall"]["plateau"] is None  # no threshold for this metric
    assert saved["runs"]["run-gdn"]["metrics"]["average_recovery"]["plateau"] is None  # still climbing at 10e9
    assert set(saved["plots"]) == {"average_recovery_norm", "average_recovery", "average_score", "niah_overall",
                                   "perplexity"}
    for name in saved["plots"].values():
        assert (tmp_path / "out" / name).stat().st_size > 1024


def test_scale_report_fits_each_mixer(tmp_path):
    points = {"gla": [(n, 1 - 3 * n ** -0.3) for n in SIZES[::3]],
              "gated_deltanet": [(n, 1 - 2 * n ** -0.2) for n in SIZES[::3]],
              "mamba2": [(1e8, 0.9)]}
    result = curves.scale_report(points, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "scaling.json").read_text())
    assert saved["mixers"]["gla"]["fit"]["alpha"] == pytest.approx(0.3)
    assert saved["mixers"]["gated_deltanet"]["fit"]["alpha"] == pytest.approx(0.2)
    assert saved["mixers"]["mamba2"]["fit"]["alpha"] is None and result["plot"] == "scaling.png"
    assert (tmp_path / "out" / "scaling.png").stat().st_size > 1024


def test_scale_points_and_histories_from_run_dirs(tmp_path):
    histories = _histories(tmp_path / "results")
    points = curves.scale_points(histories)  # the chance-normalised recovery, by default
    assert set(points) == {"gla", "gated_deltanet"}
    last = 0.6 * (1 - 0.5 * math.exp(-10))  # the last entry's piqa score; teacher 0.6, chance 1/2
    assert points["gla"] == [(10**8, pytest.approx((last - 0.5) / (0.6 - 0.5)))]
    assert curves.recovery_metric(histories) == "average_recovery_norm"
    raw = curves.scale_points(histories, "average_recovery")  # the raw ratio stays readable
    assert raw["gla"] == [(10**8, pytest.approx(last / 0.6))]
    older = copy.deepcopy(histories)  # as written before the normalised recovery existed
    for entries in older.values():
        for e in entries:
            del e["report"]["average"]["recovery_norm"]
    assert curves.recovery_metric(older) == "average_recovery" and curves.scale_points(older) == {}
    for name, entries in histories.items():
        for e in reversed(entries):  # appended in any order; read back sorted
            append_entry(tmp_path / "runs" / name / "eval", e)
    for e in histories["run-gla"]:  # another run with the same label
        append_entry(tmp_path / "copy" / "eval", e)
    loaded = history.load_histories([tmp_path / "runs" / "run-gla", tmp_path / "runs" / "run-gdn" / "eval",
                                     tmp_path / "runs" / "run-gla" / "eval", tmp_path / "copy"])
    assert list(loaded) == ["run-gla", "run-gdn", "run-gla#2"]  # a folder given twice counts once
    del loaded["run-gla#2"]
    assert [e["tokens"] for e in loaded["run-gdn"]] == [int(i * 1e9) for i in range(11)]
    assert curves.scale_points(loaded)["gla"] == points["gla"]


def test_plots_refuse_nothing_to_draw(tmp_path):
    with pytest.raises(ValueError, match="No run"):
        curves.plot_against_tokens({"a": [_entry(10)]}, "niah_overall", tmp_path / "x.png")
    with pytest.raises(ValueError, match="nothing to plot"):
        curves.plot_against_scale({"gla": []}, tmp_path / "y.png")
    assert not os.listdir(tmp_path)
