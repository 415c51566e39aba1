"""Paired differences between runs (harness.eval.paired), the rebasing of copied run directories
(harness.eval.report.eval_dirs) and `harness report --pairs / --baseline`. CPU only: result files are written here
in the layout the evaluation job leaves (RUN/eval/report.json, RUN/eval/student/, a shared teacher folder)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from harness.cli import main as harness_main
from harness.eval import paired, recovery
from harness.eval.lm_eval_tasks import EXAMPLES_FILE
from harness.eval.report import build_report, eval_dirs, paired_markdown, rebase

LIMIT = 12
# per task: per-example scores of the teacher and choices per example (12 examples: the teacher's interval stays
# above piqa's chance 1/2); the students' and the teacher's means are multiples of 1/6
TEACHER = {"piqa": ([1, 1, 1, 1, 1, 0] * 2, [2] * 12), "lambada_openai": ([1, 1, 1, 0, 1, 0] * 2, [0] * 12)}
STUDENT_A = {"piqa": [1, 0, 1, 0, 1, 0] * 2, "lambada_openai": [1, 0, 0, 0, 0, 0] * 2}
STUDENT_B = {"piqa": [1, 1, 1, 0, 1, 0] * 2, "lambada_openai": [1, 1, 1, 0, 0, 0] * 2}
GRID = {"lengths": [256, 512], "depths": [0.0, 1.0], "kinds": ["passkey"], "samples": 2, "haystack": "essays",
        "prompt": "plain", "seed": 0, "max_new_tokens": 48, "distractors": 9}
NIAH_A = [1, 0, 0, 0, 1, 0, 0, 0]  # likelihood top1 per prompt, in the grid's order (length, depth, index)
NIAH_B = [1, 1, 0, 1, 1, 1, 0, 0]


def _write_bench(folder: Path, scores: dict[str, list[int]], limit: int = LIMIT, docs_from: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    header = {"label": folder.name, "limit": limit, "offline": True}
    bench, examples = {**header, "tasks": {}}, {**header, "tasks": {}}
    for name, values in scores.items():
        choices = TEACHER[name][1]
        bench["tasks"][name] = {"metric": "acc", "score": sum(values) / len(values), "n": len(values),
                                "chance": float(np.mean([1 / n if n else 0.0 for n in choices]))}
        examples["tasks"][name] = {"metric": "acc", "by_task": {name: {
            "doc_id": list(range(docs_from, docs_from + len(values))), "score": values, "choices": choices}}}
    (folder / "bench.json").write_text(json.dumps(bench))
    (folder / EXAMPLES_FILE).write_text(json.dumps(examples))


def _grid_keys(grid: dict) -> list[tuple]:
    return [("passkey", n, d, i) for n in grid["lengths"] for d in grid["depths"] for i in range(grid["samples"])]


def _write_niah(folder: Path, top1: list[int], grid: dict = GRID, seed: int = 0) -> None:
    """niah_cells.jsonl (header, one record per prompt) and the niah.json fields a report reads."""
    keys = _grid_keys(grid)
    header = {"niah_format": 1, "label": folder.name, "haystack": "essays", "prompt": "plain", "seed": seed,
              "max_new_tokens": 48, "tokenizer": "abc"}
    lines = [{"header": header}] + [{"kind": k, "length": n, "depth": d, "index": i, "value": f"v{n}{d}{i}",
                                     "correct": bool(t and n == 256), "top1": float(t), "rank": 1.0 if t else 2.0}
                                    for (k, n, d, i), t in zip(keys, top1)]
    (folder / "niah_cells.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    by_length = {str(n): float(np.mean([t for (_, m, _, _), t in zip(keys, top1) if m == n]))
                 for n in grid["lengths"]}
    exact = [float(t and k[1] == 256) for k, t in zip(keys, top1)]
    summary = {"grid": {**grid, "seed": seed}, "prompt_mode": "plain", "overall": float(np.mean(exact)),
               "by_length": {str(n): float(np.mean([e for k, e in zip(keys, exact) if k[1] == n]))
                             for n in grid["lengths"]},
               "likelihood": {"overall": float(np.mean(top1)), "by_length": by_length, "chance": 0.1,
                              "candidates": 10}}
    (folder / "niah.json").write_text(json.dumps(summary))


def make_run(runs: Path, name: str, student: dict[str, list[int]], niah: list[int], *, ppl: float = 20.0,
             seq_len: int = 2048, **changes) -> Path:
    """runs/NAME/eval/{report.json, student/} beside runs/teacher/, as the evaluation job leaves them."""
    teacher = runs / "teacher"
    if not (teacher / "bench.json").is_file():
        _write_bench(teacher, {t: s for t, (s, _) in TEACHER.items()})
        _write_niah(teacher, [1] * 8)
        (teacher / "perplexity.json").write_text(json.dumps({"ppl": 10.0, "tokens": 4096, "source": "text"}))
    run = runs / name
    out = run / "eval" / "student"
    _write_bench(out, student, limit=changes.get("limit", LIMIT), docs_from=changes.get("docs_from", 0))
    _write_niah(out, niah, changes.get("grid", GRID), changes.get("seed", 0))
    (out / "perplexity.json").write_text(json.dumps({"ppl": ppl, "tokens": 4096, "source": "text",
                                                     "seq_len": seq_len}))
    report = build_report(out, teacher, label=name, mixer="gla", tasks=list(TEACHER))
    (run / "eval" / "report.json").write_text(json.dumps(report))
    return run


def _loaded(run: Path) -> paired.RunResults:
    return paired.load_run(run, json.loads((run / "eval" / "report.json").read_text()))


def _rows(result: dict) -> dict[str, dict]:
    return {row["metric"]: row for row in result["rows"]}


@pytest.fixture
def two_runs(tmp_path) -> tuple[Path, Path]:
    runs = tmp_path / "runs"
    return make_run(runs, "run-a", STUDENT_A, NIAH_A), make_run(runs, "run-b", STUDENT_B, NIAH_B, ppl=30.0)


# --------------------------------------------------------------------------------------------- statistics


def test_difference_by_hand():
    """B is right on one more of 5 examples: B - A = 0.2. The per-example differences are [0, 1, 0, 0, 0], so a
    replicate's difference is k/5 with k ~ Binomial(5, 1/5): P(k = 0) = 0.33 puts the 2.5% percentile at 0, and
    P(k <= 2) = 0.942 < 0.975 <= P(k <= 3) = 0.993 puts the 97.5% percentile at 3/5."""
    row = paired.difference([1, 0, 1, 0, 1], [1, 1, 1, 0, 1], stream="hand", samples=4000)
    assert row["a"] == pytest.approx(0.6) and row["b"] == pytest.approx(0.8) and row["diff"] == pytest.approx(0.2)
    assert row["ci"] == (pytest.approx(0.0), pytest.approx(0.6)) and row["excludes_zero"] is False and row["n"] == 5
    better = paired.difference([0] * 6, [1] * 6, stream="hand")
    assert better["ci"] == (1.0, 1.0) and better["excludes_zero"] is True


def test_identical_runs_differ_by_zero_with_a_zero_width_interval():
    scores = [1, 0, 1, 1, 0, 0, 1]
    row = paired.difference(scores, scores, stream="same")
    assert row["diff"] == 0 and row["ci"] == (0.0, 0.0) and row["excludes_zero"] is False


def test_difference_is_deterministic_and_refuses_different_lengths():
    rng = np.random.default_rng(1)
    a, b = list(rng.random(50)), list(rng.random(50))
    assert paired.difference(a, b, stream="x") == paired.difference(a, b, stream="x")
    assert paired.difference(a, b, stream="x")["ci"] != paired.difference(a, b, stream="x", seed=3)["ci"]
    with pytest.raises(ValueError, match="same examples"):
        paired.difference(a, b[:-1], stream="x")


def test_paired_interval_is_narrower_than_unpaired_for_correlated_runs():
    """B = A with 10 of 200 examples flipped: pairing cancels the shared part of the noise; resampling the runs
    independently does not (its width is about 0.2, the paired one about 0.06)."""
    rng = np.random.default_rng(5)
    a = rng.integers(0, 2, 200).astype(float)
    b = a.copy()
    b[:10] = 1 - b[:10]
    low, high = paired.difference(a, b, stream="corr")["ci"]
    alone = [recovery.paired_bootstrap(x[None], stream=s)[0] for x, s in ((a, "a"), (b, "b"))]
    u_low, u_high = recovery.percentile_interval(alone[1] - alone[0])
    assert high - low < (u_high - u_low) / 2
    assert low <= b.mean() - a.mean() <= high and u_low <= b.mean() - a.mean() <= u_high


def test_recovery_differences_by_hand():
    """A shared teacher: the normalised difference is (b - a) / (teacher - chance), the raw one (b - a) / teacher."""
    a, b, t = [1, 0, 1, 0, 1, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 1, 0]
    columns = np.array([a, b, t, t, [0.5] * 6], dtype=float)
    got = paired.recovery_differences(columns, stream="piqa")
    assert got["norm"].a == pytest.approx((0.5 - 0.5) / (5 / 6 - 0.5))
    assert got["norm"].b - got["norm"].a == pytest.approx((4 / 6 - 3 / 6) / (5 / 6 - 0.5))
    assert got["raw"].b - got["raw"].a == pytest.approx((4 / 6 - 3 / 6) / (5 / 6))
    same = paired.recovery_differences(np.array([a, a, t, t, [0.5] * 6], dtype=float), stream="piqa")
    finite = same["norm"].draws[np.isfinite(same["norm"].draws)]
    assert finite.size > 0 and np.all(finite == 0) and np.all(same["raw"].draws == 0)


# --------------------------------------------------------------------------------------------- runs


def test_paired_report_by_hand(two_runs):
    a, b = map(_loaded, two_runs)
    result = paired.paired_report(a, b)
    rows = _rows(result)
    assert result["a"] == "run-a" and result["b"] == "run-b" and result["shared_teacher"] is True
    assert rows["piqa (acc)"]["diff"] == pytest.approx(1 / 6) and rows["piqa (acc)"]["n"] == 12
    assert rows["lambada_openai (acc)"]["diff"] == pytest.approx(2 / 6)
    piqa = rows["piqa normalised recovery"]  # teacher 5/6 over chance 1/2
    assert piqa["diff"] == pytest.approx((1 / 6) / (5 / 6 - 0.5))
    assert piqa["a"] == pytest.approx(a.report["tasks"]["piqa"]["recovery_norm"])
    assert piqa["b"] == pytest.approx(b.report["tasks"]["piqa"]["recovery_norm"])
    lambada = rows["lambada_openai normalised recovery"]  # chance 0: teacher 4/6
    assert lambada["diff"] == pytest.approx((2 / 6) / (4 / 6))
    average = rows["average normalised recovery (2 tasks)"]
    assert average["diff"] == pytest.approx((piqa["diff"] + lambada["diff"]) / 2)
    assert average["a"] == pytest.approx(a.report["average"]["recovery_norm"])
    raw = rows["average raw recovery (2 tasks)"]
    assert raw["diff"] == pytest.approx(((1 / 6) / (5 / 6) + (2 / 6) / (4 / 6)) / 2)
    likelihood = rows["NIAH likelihood, overall"]
    assert likelihood["diff"] == pytest.approx((sum(NIAH_B) - sum(NIAH_A)) / 8) and likelihood["n"] == 8
    assert rows["NIAH likelihood, 256 tokens"]["diff"] == pytest.approx((3 - 1) / 4)
    assert rows["NIAH likelihood, 512 tokens"]["diff"] == pytest.approx((2 - 1) / 4)
    assert rows["NIAH exact match, 256 tokens"]["diff"] == pytest.approx((3 - 1) / 4)
    for row in result["rows"]:
        if row["ci"] is not None:
            assert row["ci"][0] <= row["diff"] <= row["ci"][1], row["metric"]
    ppl = rows["held-out perplexity"]
    assert (ppl["a"], ppl["b"], ppl["diff"], ppl["ci"]) == (20.0, 30.0, 10.0, None)
    assert ppl["note"] == paired.NO_INTERVAL


def test_a_run_against_its_copy_differs_by_zero_everywhere(two_runs, tmp_path):
    copy = tmp_path / "runs" / "run-a-copy"
    shutil.copytree(two_runs[0], copy)
    result = paired.paired_report(_loaded(two_runs[0]), _loaded(copy))
    intervals = [row for row in result["rows"] if row["ci"] is not None]
    assert len(intervals) == len(result["rows"]) - 1  # all but perplexity
    for row in result["rows"]:
        assert row["diff"] == pytest.approx(0.0), row["metric"]
    for row in intervals:
        assert row["ci"] == (pytest.approx(0.0), pytest.approx(0.0)) and row["excludes_zero"] is False


@pytest.mark.parametrize("changes, named", [
    ({"limit": 5}, "benchmark limit (12 against 5)"),
    ({"docs_from": 100}, "piqa's documents"),
    ({"grid": {**GRID, "lengths": [256, 1024]}}, "NIAH lengths ([256, 512] against [256, 1024])"),
    ({"seed": 7}, "NIAH seed (0 against 7)"),
])
def test_pairs_scored_on_different_examples_are_refused(tmp_path, changes, named):
    runs = tmp_path / "runs"
    a = _loaded(make_run(runs, "run-a", STUDENT_A, NIAH_A))
    b = _loaded(make_run(runs, "run-b", STUDENT_B, NIAH_B, **changes))
    with pytest.raises(paired.PairError, match="not scored on the same examples") as err:
        paired.paired_report(a, b)
    assert named in str(err.value)


def test_what_only_one_run_has_is_left_unpaired_and_named(tmp_path):
    """A run evaluated before a task existed (or whose evaluation was cut short) pairs on what both runs have: the
    shared task gets the same difference as between two runs that both have only it; the rest is named, not
    refused."""
    runs = tmp_path / "runs"
    a = _loaded(make_run(runs, "run-a", STUDENT_A, NIAH_A))
    b_run = make_run(runs, "run-b", {"piqa": STUDENT_B["piqa"]}, NIAH_B)
    (b_run / "eval" / "student" / "niah_cells.jsonl").unlink()
    result = paired.paired_report(a, _loaded(b_run))
    assert result["unpaired"] == ["benchmarks lambada_openai (only run-a has them)",
                                  "Needle in a haystack (only run-a has complete results; run-b has none)"]
    rows = _rows(result)
    assert not any(m.startswith("NIAH") for m in rows) and not any("lambada" in m for m in rows)
    only_piqa = _loaded(make_run(runs, "run-a-piqa", {"piqa": STUDENT_A["piqa"]}, NIAH_A))
    reference = _rows(paired.paired_report(only_piqa, _loaded(b_run)))
    for metric in ("piqa (acc)", "piqa normalised recovery"):
        assert rows[metric]["diff"] == pytest.approx(reference[metric]["diff"]) and rows[metric]["ci"] is not None
        assert rows[metric]["ci"] == pytest.approx(reference[metric]["ci"])
    text = "\n".join(paired_markdown([result]))
    assert "Not paired (only one run was scored on them): benchmarks lambada_openai (only run-a has them); " in text


def test_pair_names_and_unknown_names(two_runs):
    a, b = map(_loaded, two_runs)
    assert paired.parse_pairs("run-a:run-b, x:y") == [("run-a", "run-b"), ("x", "y")]
    for bad in ("run-a", "run-a:", "a:b:c"):
        with pytest.raises(paired.PairError, match="A:B,C:D"):
            paired.parse_pairs(bad)
    assert paired.resolve_pairs(paired.baseline_pairs("run-a", [a, b]), [a, b]) == [(a, b)]
    relabelled = {**a.report, "label": "tiny"}  # a run is also called by its directory's name
    assert paired.run_names(two_runs[0] / "eval", relabelled) == ("tiny", "run-a")
    with pytest.raises(paired.PairError, match="'gla' is not one of the runs; the runs are called: run-a, run-b"):
        paired.resolve_pairs([("gla", "run-b")], [a, b])
    with pytest.raises(paired.PairError, match="with itself"):
        paired.resolve_pairs([("run-a", "run-a")], [a, b])


# --------------------------------------------------------------------------------------------- copied runs


def test_copied_run_dirs_find_their_results_beside_the_report(two_runs, tmp_path):
    """The runs were evaluated under tmp/runs (recorded in report.json) and copied to tmp/copy/study/runs: the
    result folders are found at the same place relative to the report, the teacher beside the runs."""
    copied = tmp_path / "copy" / "study" / "runs"
    shutil.copytree(tmp_path / "runs", copied)
    recorded = json.loads((two_runs[0] / "eval" / "report.json").read_text())
    shutil.rmtree(tmp_path / "runs")  # the machine that ran them is gone
    student, teacher = eval_dirs(copied / "run-a")
    assert student == copied / "run-a" / "eval" / "student" and teacher == copied / "teacher"
    assert Path(recorded["student_dir"]) == tmp_path / "runs" / "run-a" / "eval" / "student"
    assert eval_dirs(copied / "run-a" / "eval" / "report.json") == (student, teacher)
    result = paired.paired_report(_loaded(copied / "run-a"), _loaded(copied / "run-b"))
    assert _rows(result)["piqa normalised recovery"]["ci"] is not None
    assert result["dirs"]["b"]["teacher"] == str(copied / "teacher")


def test_rebase_keeps_the_recorded_path_when_only_it_exists(tmp_path):
    kept = tmp_path / "machine" / "teacher"
    kept.mkdir(parents=True)
    assert rebase(kept, tmp_path / "machine" / "run" / "eval", tmp_path / "elsewhere" / "run" / "eval") == kept
    moved = rebase(tmp_path / "gone" / "run" / "eval" / "student", tmp_path / "gone" / "run" / "eval",
                   tmp_path / "here" / "eval")
    assert moved == tmp_path / "here" / "eval" / "student"


# --------------------------------------------------------------------------------------------- command


def test_report_command_writes_the_paired_section(two_runs, tmp_path, capsys):
    a, b = map(str, two_runs)
    assert harness_main(["report", a, b, "--out", str(tmp_path / "plain")]) == 0
    assert harness_main(["report", a, b, "--out", str(tmp_path / "cmp"), "--baseline", "run-a"]) == 0
    assert "## Paired differences" in capsys.readouterr().out
    plain, text = ((tmp_path / d / "comparison.md").read_text() for d in ("plain", "cmp"))
    assert text.startswith(plain) and "## Paired differences" not in plain
    assert "### run-b (B) - run-a (A)" in text
    assert "| piqa (acc) | 12 | 0.500 | 0.667 | +0.167 [" in text
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert [(p["a"], p["b"]) for p in saved["paired"]] == [("run-a", "run-b")]
    assert "paired" not in json.loads((tmp_path / "plain" / "comparison.json").read_text())
    assert saved["runs"] == json.loads((tmp_path / "plain" / "comparison.json").read_text())["runs"]
    assert harness_main(["report", a, b, "--out", str(tmp_path / "both"), "--pairs", "run-b:run-a",
                         "--baseline", "run-a"]) == 0
    both = json.loads((tmp_path / "both" / "comparison.json").read_text())["paired"]
    assert [(p["a"], p["b"]) for p in both] == [("run-a", "run-b"), ("run-b", "run-a")]
    assert both[1]["rows"][0]["diff"] == pytest.approx(-both[0]["rows"][0]["diff"])


def _snapshot(run: Path, tokens: int, niah: list[int], seed: int = 0) -> None:
    """RUN/eval/during/tokens-N/ as an evaluation along stage 3 leaves it (NIAH and perplexity, no benchmarks)
    and its history entry."""
    from harness.eval import history as hist

    folder = run / "eval" / "during" / f"tokens-{tokens:012d}"
    (folder / "student").mkdir(parents=True)
    _write_niah(folder / "student", niah, GRID, seed)
    (folder / "student" / "perplexity.json").write_text(json.dumps({"ppl": 20.0, "tokens": 4096, "source": "text",
                                                                    "seq_len": 2048}))
    report = build_report(folder / "student", run.parent / "teacher", label=run.name, mixer="gla")
    (folder / "report.json").write_text(json.dumps(report))
    hist.append_entry(run / "eval", hist.make_entry(tokens, tokens // 100, run / "snap", report))


def test_pairs_are_also_differenced_along_stage_3_at_the_token_counts_both_runs_have(two_runs, tmp_path, capsys):
    """Where both runs were evaluated along stage 3, --pairs also gives B - A at each token count both have, with
    the final evaluation's intervals; a count only one run has is named, a snapshot scored on other prompts is
    named and left out, not an error; a run whose lease ended before its final report pairs by its history alone."""
    a, b = two_runs
    flipped = NIAH_A[::-1]
    for tokens, (na, nb) in {1000: (NIAH_A, NIAH_B), 2000: (NIAH_B, flipped)}.items():
        _snapshot(a, tokens, na)
        _snapshot(b, tokens, nb)
    _snapshot(b, 3000, NIAH_B)
    _snapshot(a, 4000, NIAH_A)
    _snapshot(b, 4000, NIAH_A, seed=7)
    assert harness_main(["report", str(a), str(b), "--out", str(tmp_path / "cmp"), "--pairs", "run-a:run-b"]) == 0
    along = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["paired_along"]
    assert [(x["a"], x["b"]) for x in along] == [("run-a", "run-b")]
    snaps = {snap["tokens"]: snap for snap in along[0]["snapshots"]}
    assert sorted(snaps) == [1000, 2000, 4000] and along[0]["only_b"] == [3000] and along[0]["only_a"] == []
    likelihood = {t: _rows(snaps[t])["NIAH likelihood, overall"] for t in (1000, 2000)}
    assert likelihood[1000]["diff"] == pytest.approx(np.mean(NIAH_B) - np.mean(NIAH_A))  # 3 of 8 prompts more
    assert likelihood[2000]["diff"] == pytest.approx(np.mean(flipped) - np.mean(NIAH_B))
    low, high = likelihood[1000]["ci"]
    assert low <= likelihood[1000]["diff"] <= high and low < high  # an interval over the 8 prompts, as at the end
    assert "NIAH seed (0 against 7)" in snaps[4000]["refused"] and "rows" not in snaps[4000]
    text = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "## Paired differences along stage 3" in text and "| metric | 1,000 | 2,000 | 4,000 |" in text
    assert "Only run-b was evaluated at 3,000." in text and "Not paired at 4,000:" in text
    assert "## Paired differences along stage 3" in capsys.readouterr().out
    # the same run without its final report (a lease that ended inside its evaluation): its history alone
    (b / "eval" / "report.json").unlink()
    assert harness_main(["report", str(a), str(b), "--out", str(tmp_path / "alone"), "--pairs", "run-a:run-b"]) == 0
    alone = json.loads((tmp_path / "alone" / "paired_along.json").read_text())
    assert [snap["tokens"] for snap in alone[0]["snapshots"]] == [1000, 2000, 4000]
    assert _rows(alone[0]["snapshots"][0])["NIAH likelihood, overall"]["diff"] == likelihood[1000]["diff"]
    assert not (tmp_path / "alone" / "comparison.json").exists()
    assert "# Evaluation: run-a" in capsys.readouterr().out  # the one final report is printed beside the pairs
    # one run with its final report and its history: the report's tables, then its curves
    assert harness_main(["report", str(a), "--out", str(tmp_path / "single")]) == 0
    printed = capsys.readouterr().out
    assert "# Evaluation: run-a" in printed and "## Needle in a haystack" in printed, printed[:2000]
    assert "curves against tokens" in printed and (tmp_path / "single" / "curves.json").is_file()


def test_a_job_run_twice_pairs_as_label_and_label_2(tmp_path, capsys):
    """The same job run in two leases (same label, same directory name, two result folders): the report tells them
    apart as LABEL and LABEL#2 in the order given, --pairs takes those names for the final evaluation and along
    stage 3, the curves use the same names, and the bare label still means the first run."""
    first = make_run(tmp_path / "lease1", "run-a", STUDENT_A, NIAH_A)
    again = make_run(tmp_path / "lease2", "run-a", STUDENT_B, NIAH_B)
    for run, niah in ((first, NIAH_A), (again, NIAH_B)):
        _snapshot(run, 1000, niah)
    out = tmp_path / "cmp"
    assert harness_main(["report", str(first), str(again), "--out", str(out), "--pairs", "run-a:run-a#2"]) == 0
    saved = json.loads((out / "comparison.json").read_text())
    assert [(p["a"], p["b"]) for p in saved["paired"]] == [("run-a", "run-a#2")]
    assert _rows(saved["paired"][0])["piqa (acc)"]["diff"] == pytest.approx(2 / 12)  # B is the second folder
    assert [(x["a"], x["b"]) for x in saved["paired_along"]] == [("run-a", "run-a#2")]
    along = _rows(saved["paired_along"][0]["snapshots"][0])["NIAH likelihood, overall"]["diff"]
    assert along == pytest.approx(np.mean(NIAH_B) - np.mean(NIAH_A))
    assert sorted(json.loads((out / "curves.json").read_text())["runs"]) == ["run-a", "run-a#2"]
    assert "### run-a#2 (B) - run-a (A)" in (out / "comparison.md").read_text()
    capsys.readouterr()
    assert harness_main(["report", str(again), str(first), "--out", str(tmp_path / "swapped"), "--baseline",
                         "run-a"]) == 0  # the order given decides which is #2
    swapped = json.loads((tmp_path / "swapped" / "comparison.json").read_text())["paired"][0]
    assert (swapped["a"], swapped["b"]) == ("run-a", "run-a#2")
    assert _rows(swapped)["piqa (acc)"]["diff"] == pytest.approx(-2 / 12)


def test_held_out_measures_of_runs_at_different_windows_are_not_differenced(two_runs, tmp_path, capsys):
    """A run held out in 512-token windows against one in 2048: the benchmarks and NIAH pair as ever, perplexity
    and validation CE/KL get no difference (a token's loss depends on its context), and the comparison names the
    run whose window differs. The window is read from the student's perplexity.json when the report lacks it."""
    short = make_run(tmp_path / "runs-512", "run-short", STUDENT_B, NIAH_B, ppl=30.0, seq_len=512)
    report_path = short / "eval" / "report.json"
    report = json.loads(report_path.read_text())
    assert report["perplexity"]["seq_len"] == 512
    del report["perplexity"]["seq_len"]  # as a report written before the window was recorded
    report_path.write_text(json.dumps(report))
    rows = _rows(paired.paired_report(_loaded(two_runs[0]), _loaded(short)))
    ppl = rows["held-out perplexity"]
    assert (ppl["a"], ppl["b"], ppl["diff"], ppl["ci"]) == (20.0, 30.0, None, None)
    assert ppl["note"] == "not comparable: held out in windows of 2048 and 512 tokens"
    assert rows["piqa (acc)"]["diff"] == pytest.approx(2 / 12)  # the benchmarks still pair
    same = _rows(paired.paired_report(_loaded(two_runs[0]), _loaded(two_runs[1])))["held-out perplexity"]
    assert same["diff"] == 10.0 and same["note"] == paired.NO_INTERVAL
    a, b = map(str, two_runs)
    assert harness_main(["report", a, b, str(short), "--out", str(tmp_path / "cmp"), "--baseline", "run-a"]) == 0
    text = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "are over windows of 2048 tokens, but for run-short [gla]: 512 tokens" in text
    assert "| held-out perplexity | 4096 | 20 | 30 | - | not comparable: held out in windows of 2048 and 512 tokens |" \
        in text
    assert "| held-out perplexity | 4096 | 20 | 30 | +10 | no interval (" in text  # run-b - run-a, one window
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert [r["perplexity"]["seq_len"] for r in saved["runs"]] == [2048, 2048, 512]
    assert "| teacher (2048-token windows) | 0.8333 |" in text and "| teacher (512-token windows) | 0.8333 |" in text
    assert "| teacher |" not in text
    assert harness_main(["report", a, b, "--out", str(tmp_path / "one")]) == 0
    assert "| teacher | 0.8333 |" in (tmp_path / "one" / "comparison.md").read_text()  # one teacher: one plain row


def test_teachers_at_one_window_are_named_by_folder(two_runs, tmp_path):
    from harness.eval.report import _teachers

    other = make_run(tmp_path / "elsewhere", "run-c", STUDENT_B, NIAH_B)
    reports = [json.loads((run / "eval" / "report.json").read_text()) for run in (*two_runs, other)]
    assert [name for name, _ in _teachers(reports)] == ["teacher (runs/teacher)", "teacher (elsewhere/teacher)"]


def test_copies_of_one_teacher_cache_make_one_teacher_row(tmp_path):
    """Runs brought into docs/results/ from different output directories: their teacher folders have one cache
    name and the same results, so the report shows one teacher (a section only one copy holds, e.g. the copy probe
    added later, comes from that copy); where the results differ, each row names its whole folder."""
    from harness.eval.report import _teachers

    first = make_run(tmp_path / "study" / "runs", "run-a", STUDENT_A, NIAH_A)
    second = make_run(tmp_path / "retrieval" / "runs", "run-b", STUDENT_B, NIAH_B)
    reports = [json.loads((run / "eval" / "report.json").read_text()) for run in (first, second)]
    reports[1]["copy"] = {"student": {"scores": {}}, "teacher": {"scores": {"after first": {"value": 0.75}}}}
    (name, merged), = _teachers(reports)
    assert name == "teacher" and merged["copy"]["teacher"]["scores"]["after first"]["value"] == 0.75
    assert merged["niah"]["teacher"] == reports[0]["niah"]["teacher"]
    reports[1]["perplexity"] = {**reports[1]["perplexity"], "teacher": 11.0}
    assert [name for name, _ in _teachers(reports)] == [f"teacher ({r['teacher_dir']})" for r in reports]
    out = tmp_path / "cmp"
    assert harness_main(["report", str(first), str(second), "--out", str(out)]) == 0
    text = (out / "comparison.md").read_text()
    assert text.count("| teacher | 0.8333 |") == 1 and "| teacher (" not in text
    assert harness_main(["report", str(first), str(second), "--out", str(out), "--pairs", "run-a:run-b"]) == 0
    assert "result folders differ" not in (out / "comparison.md").read_text()
    assert paired.paired_report(_loaded(first), _loaded(second))["shared_teacher"] is True
    third = make_run(tmp_path / "other" / "runs", "run-c", STUDENT_B, NIAH_B)
    report = json.loads((third / "eval" / "report.json").read_text())
    report["perplexity"]["teacher"] = 11.0  # a teacher of that cache name scored otherwise
    (third / "eval" / "report.json").write_text(json.dumps(report))
    assert paired.paired_report(_loaded(first), _loaded(third))["shared_teacher"] is False


def test_report_command_refuses_unknown_names(two_runs, tmp_path, capsys):
    a, b = map(str, two_runs)
    assert harness_main(["report", a, b, "--out", str(tmp_path / "cmp"), "--pairs", "run-a:kda"]) == 2
    assert "'kda' is not one of the runs; the runs are called: run-a, run-b" in capsys.readouterr().err
    assert harness_main(["report", a, "--baseline", "run-a"]) == 2
    assert "at least two runs" in capsys.readouterr().err


def test_niah_plot_draws_each_run_and_each_teacher_folder_once_in_its_own_style(two_runs, tmp_path):
    from harness.eval.report import _figure, _plot_niah_panel
    from harness.eval.training import run_line_style

    short = make_run(tmp_path / "runs-512", "run-short", STUDENT_B, NIAH_B, seq_len=512)
    reports = [json.loads((run / "eval" / "report.json").read_text()) for run in (*two_runs, short)]
    ax = _figure().add_subplot()
    _plot_niah_panel(ax, reports, lambda side: side, "exact")
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["run-a [gla]", "run-b [gla]", "run-short [gla]",
                                                    "teacher (2048-token windows)", "teacher (512-token windows)"]
    assert len({(line.get_color(), line.get_linestyle()) for line in lines}) == len(lines)
    styles = [tuple(run_line_style(i).values()) for i in range(30)]
    assert len(set(styles)) == 30  # colours repeat past ten runs, their dashes do not


def test_side_by_side_pairs_two_evaluations_and_keeps_the_comparison_when_their_examples_differ(tmp_path):
    """What the post-trained student's evaluation ends with (its spec's compare_to): both runs side by side with the
    paired differences B - A, the same rows `paired_report` gives; runs scored on different examples are still shown
    side by side, without differences, and the reason is written under them."""
    runs = tmp_path / "runs"
    a, b = make_run(runs, "run-a", STUDENT_A, NIAH_A), make_run(runs, "run-b", STUDENT_B, NIAH_B, ppl=30.0)
    written, why = paired.side_by_side(a / "eval", b / "eval", tmp_path / "cmp")
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert why is None and written == tmp_path / "cmp" / "comparison.md"
    assert [r["label"] for r in saved["runs"]] == ["run-a", "run-b"]
    assert saved["paired"] == json.loads(json.dumps([paired.paired_report(_loaded(a), _loaded(b))]))
    assert "### run-b (B) - run-a (A)" in written.read_text()
    other = make_run(runs, "run-c", STUDENT_B, NIAH_B, seed=7)
    written, why = paired.side_by_side(a / "eval", other / "eval", tmp_path / "cmp2")
    assert "NIAH seed (0 against 7)" in why
    assert "paired" not in json.loads((tmp_path / "cmp2" / "comparison.json").read_text())
    text = written.read_text()
    assert text.endswith(f"No paired differences: {why}\n") and "## Paired differences" not in text
