"""Evaluations along stage 3 (eval.every_tokens): fired at the right token counts, never twice after a resume,
evaluated beside training into the run's history, drawn by `harness report`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness.config import ConfigError
from harness.eval import during, history
from tests.pipeline import tiny_job
from tests.test_run import harness_cli

TINY_DURING = ["eval.enabled=true", "eval.tasks=[]", "eval.niah.lengths=[]", "eval.perplexity_tokens=64",
               "eval.during.tasks=[piqa]", "eval.during.limit=2", "eval.during.niah_lengths=[256]",
               "eval.niah.depths=[0.5]", "eval.niah.kinds=[kv]", "eval.during.perplexity_tokens=64"]


def test_marks_fire_at_multiples_and_not_twice_after_a_resume(tmp_path, monkeypatch):
    job = tiny_job(tmp_path / "setting", tmp_path / "run", "eval.enabled=true", "eval.every_tokens=256")
    marked, launched = [], []

    def fake_mark(run_dir, tokens, step, checkpoint, *, params):
        marked.append(tokens)
        return history.mark_for_evaluation(run_dir, tokens, step, checkpoint, params=params)

    monkeypatch.setattr(during, "snapshot_and_mark", fake_mark)
    monkeypatch.setattr(during, "launch_evaluator", lambda run: launched.append(run) or "test")
    first = during.DuringTraining(job, rank=0, params=123)
    assert (Path(job.output_dir) / during.DURING_SPEC).is_file()
    before = 0
    for tokens in range(64, 640, 64):  # a crash after 576 tokens
        due, before = first.due(before, tokens), tokens
        first.mark(due, tokens // 64, tmp_path / "ckpt")
    assert marked == [256, 512] and len(launched) == 2
    resumed = during.DuringTraining(job, rank=0, params=123)  # resumed from a checkpoint at 448 tokens
    before = 448
    for tokens in range(512, 1088, 64):
        due, before = resumed.due(before, tokens), tokens
        resumed.mark(due, tokens // 64, tmp_path / "ckpt")
    assert marked == [256, 512, 768, 1024]
    assert [m["tokens"] for m in history.pending_marks(Path(job.output_dir))] == [256, 512, 768, 1024]
    assert history.pending_marks(Path(job.output_dir))[0]["params"] == 123
    other_rank = during.DuringTraining(job, rank=1)
    other_rank.mark([1280], 20, tmp_path / "ckpt")  # only rank 0 writes marks
    assert marked[-1] == 1024


def test_every_tokens_below_one_step_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="at least one stage-3 step"):
        tiny_job(tmp_path / "setting", tmp_path / "run", "eval.every_tokens=32")


def test_run_evaluates_snapshots_into_the_history_and_report_draws_it(tmp_path):
    out = tmp_path / "run"
    job = tiny_job(tmp_path / "setting", out, "budget.split=[0.1,0.1,0.8]", "run.layer_groups=2",
                   "data.validation_tokens=128", "eval.every_tokens=256", *TINY_DURING, total=1280)
    job_path = tmp_path / "job.yaml"
    job_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    result = harness_cli("run", str(job_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    entries = history.read_history(out / "eval")
    # stage 3 trains 1024 tokens at 64 per step: snapshots at 256, 512, 768, and the end (1024)
    assert [e["tokens"] for e in entries] == [256, 512, 768, 1024], (out / "logs" / "eval-during.log").read_text()
    assert [e["step"] for e in entries] == [4, 8, 12, 16]
    assert not history.pending_marks(out) and not list((out / "eval" / "snapshots").glob("tokens-*"))
    for e in entries:
        assert e["report"]["tasks"]["piqa"]["n"] == 2 and e["params"] > 0 and e["mixer"] == "gated_deltanet"
        assert e["report"]["perplexity"]["student"] > 1
    ppl = [e["report"]["perplexity"]["student"] for e in entries]
    assert ppl[-1] < ppl[0]  # training lowers held-out perplexity along the curve
    assert (out / "eval" / "report.json").is_file()  # the final evaluation ran as well

    report = harness_cli("report", str(out), "--out", str(tmp_path / "curves"), "--plateau-threshold", "0.01")
    assert report.returncode == 0, report.stderr[-2000:]
    curves = json.loads((tmp_path / "curves" / "curves.json").read_text())
    run = next(iter(curves["runs"].values()))
    assert run["metrics"]["perplexity"]["tokens"] == [256, 512, 768, 1024]
    assert (tmp_path / "curves" / "curve_perplexity.png").stat().st_size > 1000
    assert "4 evaluations" in report.stdout

    again = harness_cli("run", str(job_path))  # nothing is marked or evaluated twice
    assert again.returncode == 0 and [e["tokens"] for e in history.read_history(out / "eval")] == [256, 512, 768, 1024]


def test_evaluator_leaves_when_another_holds_the_lock(tmp_path, monkeypatch):
    import fcntl

    run = tmp_path / "run"
    history.mark_for_evaluation(run, 256, 4, tmp_path / "snap")
    monkeypatch.setattr(during, "evaluate_mark", lambda *a, **k: pytest.fail("evaluated under a held lock"))
    lock_path = history.eval_dir(run) / during.LOCK_FILE
    with open(lock_path, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert during.evaluate_pending(run) == []
    assert [m["tokens"] for m in history.pending_marks(run)] == [256]
