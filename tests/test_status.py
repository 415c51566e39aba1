"""`harness status`: stage progress from the run directory, Slurm states of recorded jobs, failed logs."""

from __future__ import annotations

import json
import os
import stat

from harness.cli import main


def test_status_reports_progress_slurm_states_and_failed_logs(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    done = run / "align_mixer" / "layers-00-01"
    done.mkdir(parents=True)
    (done / "COMPLETE.json").write_text(json.dumps({"meta": {}}))
    (done / "metrics.jsonl").write_text(json.dumps({"step": 5, "tokens": 640}) + "\n")
    partial = run / "align_mixer" / "layers-02-03"
    partial.mkdir(parents=True)
    (partial / "metrics.jsonl").write_text(json.dumps({"step": 2, "tokens": 256}) + "\n")
    (run / "logs").mkdir()
    (run / "logs" / "align_mixer-layers-02-03.log").write_text("Traceback (most recent call last):\n  boom\n")
    (run / "slurm").mkdir()
    (run / "slurm" / "jobs.json").write_text(json.dumps({"jobs": {"align_mixer": "7", "align_hidden": "8"}}))
    fake = tmp_path / "scontrol"
    fake.write_text("""#!/bin/sh
if [ "$3" = 7 ]; then
  printf 'JobId=7 ArrayJobId=7 ArrayTaskId=0 JobState=COMPLETED Reason=None\\n\\nJobId=9 ArrayJobId=7 ArrayTaskId=1 JobState=FAILED Reason=NonZeroExitCode\\n'
else
  printf 'JobId=8 JobState=PENDING Reason=DependencyNeverSatisfied\\n'
fi
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "align_mixer/layers-00-01     complete, 640 tokens" in out
    assert "align_mixer/layers-02-03     in progress, 256 tokens" in out
    assert "7_1" in out and "FAILED (NonZeroExitCode)" in out
    assert "PENDING (DependencyNeverSatisfied)" in out
    assert "align_mixer-layers-02-03.log" in out


def test_status_of_a_missing_run_exits_2(tmp_path, capsys):
    assert main(["status", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_status_knows_post_training_and_its_evaluation(tmp_path, capsys):
    """SFT is listed once it started or a run with stages.sft.enabled recorded its settings; its evaluation once its
    spec is there, complete with its report and the comparison with the distilled student's."""
    run = tmp_path / "run"
    (run / "settings").mkdir(parents=True)
    assert main(["status", str(run)]) == 0
    assert "sft" not in capsys.readouterr().out
    (run / "settings" / "sft.json").write_text("{}")
    assert main(["status", str(run)]) == 0
    assert "  sft                          not started" in capsys.readouterr().out
    (run / "sft").mkdir()
    (run / "sft" / "metrics.jsonl").write_text(json.dumps({"step": 3, "tokens": 900}) + "\n")
    (run / "eval-sft.yaml").write_text("{}")
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "  sft                          in progress, 900 tokens" in out
    assert "  eval-sft                     not started" in out
    (run / "sft" / "checkpoints").mkdir()
    (run / "sft" / "checkpoints" / "COMPLETE.json").write_text("{}")
    (run / "eval-sft" / "comparison").mkdir(parents=True)
    (run / "eval-sft" / "report.json").write_text("{}")
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert "  sft                          complete, 900 tokens" in out
    assert "  eval-sft                     complete" in out
