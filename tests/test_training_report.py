"""The comparison's training losses (harness.eval.training): curves and final values computed directly from
metrics files written here, a torn line and a resumed stage's repeated steps, and `harness report` with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main as harness_main
from harness.eval.report import attach_training, comparison_markdown
from harness.eval.training import align_curve, training_summary


def write_rows(path: Path, rows: list[dict], torn: str = "") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + torn)


def fake_run(root: Path, scale: float = 1.0) -> Path:
    """Two layer groups (layers 0-1 and 2-3) in stages 1-2, 20 steps of stage 3 with a resume, one validation."""
    run = root / f"run-{scale}"
    (run / "job.yaml").parent.mkdir(parents=True)
    (run / "job.yaml").write_text("name: fake\n")
    for stage, base in (("align_mixer", 4.0), ("align_hidden", 2.0)):
        for group, layers in (("layers-00-01", (0, 1)), ("layers-02-03", (2, 3))):
            rows = [{"step": s, "tokens": 100 * s, "loss": 0.0,
                     **{f"loss/layer_{i:02d}": scale * base * (i + 1) / s for i in layers}} for s in (10, 20, 30)]
            write_rows(run / stage / group / "metrics.jsonl", rows, torn='{"step": 40, "tok')
    train = [{"step": s, "tokens": 1000 * s, "loss": scale * (10 - 0.1 * s), "ce": scale * (6 - 0.1 * s),
              "kl": scale * 4.0} for s in range(1, 21)]
    resumed = [dict(r, loss=r["loss"] - 0.5) for r in train[-3:]]  # steps 18-20 again after a resume
    val = {"step": 20, "tokens": 20000, "val_ce": scale * 3.5, "val_kl": scale * 1.5, "val_ppl": 33.1}
    write_rows(run / "distill" / "metrics.jsonl", train + resumed + [val])
    return run


def test_align_curve_is_the_mean_over_all_groups_layers(tmp_path):
    run = fake_run(tmp_path)
    curve = align_curve(run, "align_mixer")
    assert curve["layers"] == 4 and curve["steps"] == [10, 20, 30] and curve["tokens"] == [1000, 2000, 3000]
    for step, value in zip(curve["steps"], curve["loss"]):
        assert value == pytest.approx(sum(4.0 * (i + 1) / step for i in range(4)) / 4)


def test_final_losses_are_means_over_the_last_tenth_of_each_stage(tmp_path):
    summary = training_summary(fake_run(tmp_path))
    final = summary["final"]
    assert final["align_mixer"] == pytest.approx(10.0 / 30 / 4 * 4)  # only step 30 is in the last 10% of 30
    assert final["align_hidden"] == pytest.approx(5.0 / 30)
    d = final["distill"]
    # steps 18, 19, 20 are in the last 10% of 20; their resumed values (0.5 lower) replace the first ones
    assert d["loss"] == pytest.approx(sum(10 - 0.1 * s - 0.5 for s in (18, 19, 20)) / 3)
    assert d["ce"] == pytest.approx(sum(6 - 0.1 * s for s in (18, 19, 20)) / 3)
    assert d["kl"] == pytest.approx(4.0)
    assert (d["val_ce"], d["val_kl"], d["val_ppl"], d["tokens"]) == (3.5, 1.5, 33.1, 20000)
    assert summary["curves"]["distill"]["steps"] == list(range(1, 21))


def test_no_stage_metrics_means_no_training_section(tmp_path):
    (tmp_path / "job.yaml").write_text("name: x\n")
    assert training_summary(tmp_path) is None
    report = {"label": "x", "mixer": None, "tasks": {}, "average": {}}
    assert attach_training(report, tmp_path) == report


def test_comparison_lists_the_final_losses_and_draws_the_curves(tmp_path, capsys):
    runs = [fake_run(tmp_path, 1.0), fake_run(tmp_path, 2.0)]
    for i, run in enumerate(runs):
        rows = {"piqa": {"metric": "acc", "student": 0.5 + 0.1 * i, "teacher": 0.8, "recovery": (0.5 + 0.1 * i) / 0.8,
                         "n": 10}}
        report = {"label": f"r{i}", "mixer": "gla", "teacher_dir": "/t", "limit": 10, "tasks": rows,
                  "average": {"tasks": 1, "student": 0.5 + 0.1 * i, "teacher": 0.8, "recovery": (0.5 + 0.1 * i) / 0.8},
                  "niah": {"student": {"overall": 0.25, "by_length": {"256": 0.5, "512": 0.0}},
                           "teacher": {"overall": 0.75, "by_length": {"256": 1.0, "512": 0.5}}, "recovery": 1 / 3},
                  "perplexity": {"student": 40.0, "teacher": 20.0, "ratio": 2.0}}
        (run / "eval").mkdir()
        (run / "eval" / "report.json").write_text(json.dumps(report))
    table = comparison_markdown([attach_training(json.loads((r / "eval" / "report.json").read_text()), r)
                                 for r in runs])
    assert "| r1 [gla] | 0.6667 | 0.3333 |" in table  # stage 1 and 2 MSE of the scale-2 run
    assert "| teacher | 0.8 | 0.8 | 20 |" in table and "| teacher | 100.0% | 50.0% | 75.0% |" in table
    assert harness_main(["report", *map(str, runs), "--out", str(tmp_path / "cmp")]) == 0
    assert "loss_curves.png" in capsys.readouterr().out
    assert (tmp_path / "cmp" / "loss_curves.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["runs"]
    assert saved[0]["training"]["final"]["distill"]["val_ppl"] == 33.1


def test_a_stage_trained_on_the_l2_loss_is_labelled_so(tmp_path):
    run = fake_run(tmp_path)
    (run / "job.yaml").write_text("name: fake\nstages:\n  align_hidden:\n    loss: l2\n")
    summary = training_summary(run)
    assert summary["alignment_loss"] == {"align_mixer": "mse", "align_hidden": "l2"}
    report = {"label": "r", "mixer": "gla", "teacher_dir": "/t", "limit": 10,
              "tasks": {"piqa": {"metric": "acc", "student": 0.5, "teacher": 0.8, "recovery": 0.625, "n": 10}},
              "average": {"tasks": 1, "student": 0.5, "teacher": 0.8, "recovery": 0.625}, "training": summary}
    text = comparison_markdown([report])
    training = text[text.index("## Training losses"):].splitlines()
    row = next(line for line in training if line.startswith("| r [gla]"))
    assert row.startswith("| r [gla] | 0.3333 | 0.1667 (l2) |")


def test_loss_curve_panels_name_the_loss_each_run_logged(tmp_path):
    from harness.eval.training import panel_loss

    mse = {"alignment_loss": {"align_mixer": "mse", "align_hidden": "mse"}}
    l2 = {"alignment_loss": {"align_mixer": "mse", "align_hidden": "l2"}}
    assert panel_loss({"a": mse, "b": mse}, "align_hidden") == ("MSE", set())
    assert panel_loss({"b": l2}, "align_hidden") == ("L2 norm", set())
    assert panel_loss({"a": mse, "b": l2}, "align_hidden") == ("MSE; (l2): L2 norm", {"b"})
    assert panel_loss({"a": mse, "b": l2}, "align_mixer") == ("MSE", set())
    assert panel_loss({"old": {}}, "align_mixer") == ("MSE", set())  # a summary from before the field: mse


def test_every_logged_loss_term_is_in_the_summary_and_the_table(tmp_path):
    """Lines naming their terms (`loss_terms`, as harness.train's logging writes them) give each term its curve,
    final value, validation and table columns; a run without such lines has ce and kl alone."""
    run = fake_run(tmp_path)
    rows = [{"step": s, "tokens": 1000 * s, "loss": 7.0, "kl": 1.0, "reverse_kl": 0.1 * s, "ce": 5.0,
             "loss_terms": ["kl", "reverse_kl", "ce"]} for s in range(1, 11)]
    write_rows(run / "distill" / "metrics.jsonl",
               rows + [{"step": 10, "tokens": 10000, "val_ce": 4.0, "val_kl": 0.5, "val_reverse_kl": 0.25,
                        "val_ppl": 54.6}])
    summary = training_summary(run)
    assert summary["curves"]["distill"]["reverse_kl"] == pytest.approx([0.1 * s for s in range(1, 11)])
    d = summary["final"]["distill"]
    assert d["terms"] == ["ce", "kl", "reverse_kl"] and d["reverse_kl"] == pytest.approx(0.95)  # steps 9, 10
    assert (d["val_reverse_kl"], d["ce"], d["val_ce"]) == (0.25, 5.0, 4.0)
    other = fake_run(tmp_path, 2.0)
    assert training_summary(other)["final"]["distill"]["terms"] == ["ce", "kl"]
    tasks = {"piqa": {"metric": "acc", "student": 0.5, "teacher": 0.8, "recovery": 0.625, "n": 10}}
    average = {"tasks": 1, "student": 0.5, "teacher": 0.8, "recovery": 0.625}
    table = comparison_markdown([{"label": name, "mixer": "gla", "teacher_dir": "/t", "limit": 10, "tasks": tasks,
                                  "average": average, "training": training_summary(r)}
                                 for name, r in (("a", run), ("b", other))])
    training = table[table.index("## Training losses"):].splitlines()
    assert training[2] == ("| run | stage 1 loss | stage 2 loss | stage 3 loss | stage 3 CE | stage 3 KL | "
                           "stage 3 reverse_kl | val CE | val KL | val reverse_kl | val ppl |")
    row = next(line for line in training if line.startswith("| a [gla]"))
    assert row.endswith("| 7 | 5 | 1 | 0.95 | 4 | 0.5 | 0.25 | 54.6 |")
    assert next(line for line in training if line.startswith("| b [gla]")).endswith("| - | 7 | 3 | - | 33.1 |")


def test_stage_3_throughput_is_read_interval_by_interval_from_the_log_lines_times(tmp_path):
    """distill_throughput against the rates computed here: ten lines 1 s apart at 1,000 tokens/s, one checkpoint pause
    (an interval of 5 s), a resume that logs two steps again (no interval across it) and a validation line (no
    loss: not a training line); the report prints the whole, median and 90th-percentile rates."""
    from harness.eval.training import distill_throughput

    run = tmp_path / "run"
    (run / "job.yaml").parent.mkdir(parents=True)
    (run / "job.yaml").write_text("name: fake\n")
    times = [0, 1, 2, 3, 8, 9, 10, 11, 12, 13]  # the interval ending at step 5 holds a 4-s pause
    train = [{"step": s, "tokens": 1000 * s, "time": 100.0 + t, "loss": 1.0} for s, t in zip(range(1, 11), times)]
    resumed = [dict(r, time=r["time"] + 50) for r in train[-2:]]  # steps 9 and 10 again, 50 s later
    write_rows(run / "distill" / "metrics.jsonl",
               train[:9] + [{"step": 9, "tokens": 9000, "time": 112.5, "val_ce": 2.0}] + train[9:] + resumed)
    got = distill_throughput(run)
    # steps 1..10: 9 intervals (one of 5 s), none from 10 back to 9, one from 9 to 10 after the resume
    assert got["intervals"] == 10
    assert got["whole"] == pytest.approx(10_000 / 14)
    assert got["median"] == pytest.approx(1000.0) and got["p90"] == pytest.approx(1000.0)
    assert sorted((got["whole"], got["median"])) == [got["whole"], got["median"]]  # the pause lowers the whole
    rows = {"piqa": {"metric": "acc", "student": 0.5, "teacher": 0.8, "recovery": 0.625, "n": 10}}
    report = attach_training({"label": "r", "mixer": "gla", "teacher_dir": "/t", "limit": 10, "tasks": rows,
                              "average": {"tasks": 1, "student": 0.5, "teacher": 0.8, "recovery": 0.625}}, run)
    assert report["training"]["distill_throughput"] == got
    assert "| r [gla] | 714 | 1,000 | 1,000 | 10 |" in comparison_markdown([report, report])
    assert report["training"]["startup"] == {}  # lines written before the logger measured it


def test_each_stage_start_up_is_summed_over_its_processes_and_printed(tmp_path):
    """The first line of each process (RunLogger's startup_setup_s / startup_first_log_s) per stage: two layer groups
    of stage 1, stage 3 run by two processes (a resume) and SFT after it; stage 2 logged none and is left out."""
    from harness.eval.training import stage_startups

    run = tmp_path / "run"
    (run / "job.yaml").parent.mkdir(parents=True)
    (run / "job.yaml").write_text("name: fake\n")
    for group, setup in (("layers-00-01", 10.0), ("layers-02-03", 12.5)):
        write_rows(run / "align_mixer" / group / "metrics.jsonl",
                   [{"step": 1, "tokens": 10, "time": 1.0, "loss/layer_00": 1.0, "startup_setup_s": setup,
                     "startup_first_log_s": setup + 30}, {"step": 2, "tokens": 20, "time": 2.0, "loss/layer_00": 0.9}])
    write_rows(run / "align_hidden" / "layers-00-03" / "metrics.jsonl",
               [{"step": 1, "tokens": 10, "time": 1.0, "loss/layer_00": 1.0}])
    write_rows(run / "distill" / "metrics.jsonl",
               [{"step": 1, "tokens": 10, "time": 1.0, "loss": 3.0, "startup_setup_s": 20.0, "startup_first_log_s": 90.0},
                {"step": 2, "tokens": 20, "time": 2.0, "loss": 2.9},
                {"step": 2, "tokens": 20, "time": 9.0, "loss": 2.9, "startup_setup_s": 21.0, "startup_first_log_s": 41.0}])
    write_rows(run / "sft" / "metrics.jsonl",
               [{"step": 1, "tokens": 10, "time": 1.0, "loss": 2.0, "startup_setup_s": 7.0, "startup_first_log_s": 19.5}])
    got = stage_startups(run)
    assert got == {"align_mixer": {"processes": 2, "setup_s": 22.5, "first_log_s": 82.5},
                   "distill": {"processes": 2, "setup_s": 41.0, "first_log_s": 131.0},
                   "sft": {"processes": 1, "setup_s": 7.0, "first_log_s": 19.5}}
    rows = {"piqa": {"metric": "acc", "student": 0.5, "teacher": 0.8, "recovery": 0.625, "n": 10}}
    report = attach_training({"label": "r", "mixer": "gla", "teacher_dir": "/t", "limit": 10, "tasks": rows,
                              "average": {"tasks": 1, "student": 0.5, "teacher": 0.8, "recovery": 0.625}}, run)
    text = comparison_markdown([report, report])
    assert "| r [gla] | align_mixer | 2 | 22.5 | 82.5 |" in text and "| r [gla] | distill | 2 | 41.0 | 131.0 |" in text
    assert "align_hidden |" not in text
