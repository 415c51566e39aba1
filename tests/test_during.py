"""Evaluations along stage 3 (eval.every_tokens): fired at the right token counts, never twice after a resume, one
evaluator at a time. A whole run evaluating beside training into its history, drawn by `harness report`, is
tests/test_run.py's run-life test."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.config import ConfigError
from harness.eval import during, history
from tests.pipeline import tiny_job


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


def test_the_merged_student_is_marked_once_at_a_fresh_start_and_kept_after_its_evaluation(tmp_path, monkeypatch):
    """eval.during.at_start: before a fresh stage 3's first step, RUN_DIR/merged is marked at 0 tokens (rank 0), not
    on a resumed stage, not twice, not without the option; its evaluation leaves the folder (stage 3 reads it)."""
    job = tiny_job(tmp_path / "setting", tmp_path / "run", "eval.enabled=true", "eval.every_tokens=256",
                   "eval.during.at_start=true")
    run = Path(job.output_dir)
    launched = []
    monkeypatch.setattr(during, "launch_evaluator", lambda r: launched.append(r) or "test")
    during.DuringTraining(job, rank=1).mark_start(0)  # only rank 0 writes marks
    assert history.pending_marks(run) == [] and launched == []
    during.DuringTraining(job, rank=0, params=5).mark_start(448)  # a resumed stage: its start is no curve point
    assert history.pending_marks(run) == []
    first = during.DuringTraining(job, rank=0, params=5)
    first.mark_start(0)
    first.mark_start(0)
    [mark] = history.pending_marks(run)
    assert (mark["tokens"], mark["step"], mark["keep"], mark["params"]) == (0, 0, True, 5) and len(launched) == 1
    assert mark["checkpoint"] == str((run / "merged").resolve())
    during.DuringTraining(job, rank=0).mark_start(0)  # a restart before step 1: the pending mark stands for it
    assert len(history.pending_marks(run)) == 1 and len(launched) == 1
    (run / "merged").mkdir(parents=True)
    (run / "merged" / "config.json").write_text("{}")
    monkeypatch.setattr("harness.eval.job.run_eval_spec", lambda spec, progress=True: {"label": "x", "mixer": "m"})
    during.evaluate_mark(run, mark, progress=False)
    assert (run / "merged" / "config.json").is_file() and history.pending_marks(run) == []
    assert [e["tokens"] for e in history.read_history(history.eval_dir(run))] == [0]
    off = tiny_job(tmp_path / "setting", tmp_path / "run-off", "eval.enabled=true", "eval.every_tokens=256")
    during.DuringTraining(off, rank=0).mark_start(0)
    assert history.pending_marks(Path(off.output_dir)) == []


def test_every_tokens_below_one_step_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="at least one stage-3 step"):
        tiny_job(tmp_path / "setting", tmp_path / "run", "eval.every_tokens=32")


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


def test_an_evaluator_scoring_two_snapshots_gives_the_second_the_scores_it_gets_alone(tmp_path):
    """The evaluator along stage 3 scores one snapshot after another in one process: nothing of the first (model,
    caches, settings) may move the second's scores. B alone, then A, then B again: B's NIAH records are identical."""
    import json

    from harness.eval.job import run_eval_spec
    from harness.eval.spec import load_eval_spec
    from tests.pipeline import student_run

    root = tmp_path / "root"
    ov = ("eval.enabled=true", "eval.tasks=[]", "eval.niah.lengths=[256]", "eval.niah.samples=1",
          "eval.niah.kinds=[passkey,kv]", "eval.niah.depths=[0.0,1.0]", "eval.perplexity_tokens=512",
          "eval.copy=null")
    for name, seed in (("a", 1), ("b", 2)):
        student_run(root, root / name, *ov, f"name={name}", seed=seed)

    def score(name: str, out: str) -> list[dict]:
        spec = load_eval_spec(root / name / "eval.yaml")
        spec.output_dir = str(tmp_path / out)
        run_eval_spec(spec, progress=False)
        cells = (tmp_path / out / "student" / "niah_cells.jsonl").read_text().splitlines()
        return [json.loads(line) for line in cells][1:]

    alone, other = score("b", "alone"), score("a", "first")
    assert other != alone  # two students, two sets of scores
    assert score("b", "second") == alone
