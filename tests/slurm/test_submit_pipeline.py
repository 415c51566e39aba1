"""`harness submit` against the real single-node Slurm (slurm/local/cluster.sh): a failing layer-group task
blocks its dependents and `harness status` names it; `--resume` resubmits what is left, which runs through sbatch
arrays and dependencies to an evaluated student; a USR1 before the time limit checkpoints and requeues the job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

from tests.pipeline import tiny_job

REPO = Path(__file__).resolve().parents[2]
SETTINGS = ["budget.split=[0.1,0.1,0.8]", "run.layer_groups=2", "data.validation_tokens=128"]


def write_job(tmp: Path, name: str, *extra: str) -> tuple[Path, Path]:
    out = tmp / name
    job = tiny_job(tmp / "setting", out, *SETTINGS, *extra, total=1280)
    path = tmp / f"{name}.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    return path, out


def harness(cluster, *args: str) -> subprocess.CompletedProcess:
    env = {**cluster.env, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def submitted(out: Path) -> dict[str, str]:
    return json.loads((out / "slurm" / "jobs.json").read_text())["jobs"]


TINY_EVAL = ["eval.enabled=true", "eval.tasks=[piqa]", "eval.limit=2", "eval.niah.lengths=[256]",
             "eval.niah.depths=[0.5]", "eval.niah.kinds=[kv]", "eval.niah.samples=1", "eval.perplexity_tokens=64"]


DURING = ["eval.every_tokens=256", "eval.during.tasks=[]", "eval.during.niah_lengths=[]",
          "eval.during.perplexity_tokens=64"]


def test_a_failed_task_blocks_its_dependents_then_resume_runs_the_rest_through_arrays_and_evaluations(
        slurm_cluster, tmp_path):
    """One submission's whole life (each pipeline through Slurm costs ~50 s of CI): one layer group's array task
    fails, its dependents wait with DependencyNeverSatisfied and `harness status` names the failed task's log;
    `--resume` cancels what waits, resubmits only the failed group and the rest, which run through the arrays and
    dependencies to a student; stage 3 starts its snapshot evaluations as Slurm jobs of their own; the evaluation
    job reads eval.yaml; a last `--dry-run` finds nothing left."""
    from harness.eval.history import pending_marks, read_history

    path, out = write_job(tmp_path, "run", *TINY_EVAL, *DURING)
    blocker = out / "align_mixer" / "layers-02-03"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a directory: this group's task fails")
    result = harness(slurm_cluster, "submit", str(path), "--cpus-per-task", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    first = submitted(out)
    assert list(first) == ["align_mixer", "align_hidden", "merge", "distill", "eval"]
    second: dict[str, str] = {}
    try:
        slurm_cluster.wait_states(first["align_mixer"], {"COMPLETED", "FAILED"}, timeout=300)
        assert sorted(slurm_cluster.states(first["align_mixer"])) == ["COMPLETED", "FAILED"]  # one task per group
        slurm_cluster.wait_for("align_hidden blocked", lambda: any(
            j.get("Reason") == "DependencyNeverSatisfied" for j in slurm_cluster.jobs(first["align_hidden"])), 60)
        status = harness(slurm_cluster, "status", str(out)).stdout
        assert "FAILED" in status and "DependencyNeverSatisfied" in status
        assert "align_mixer-1-" in status  # the failed array task's log

        blocker.unlink()
        result = harness(slurm_cluster, "submit", "--resume", str(out), "--cpus-per-task", "1")
        assert result.returncode == 0, result.stderr[-3000:]
        assert "cancelled 4 pending job(s)" in result.stdout  # align_hidden, merge, distill, eval
        second = submitted(out)
        assert "GROUPS_=(2-3)" in (out / "slurm" / "align_mixer.sbatch").read_text()  # only the failed group
        slurm_cluster.wait_states(second["eval"], {"COMPLETED", "FAILED", "CANCELLED"}, timeout=900)
        for stage, job_id in second.items():
            states = slurm_cluster.states(job_id)
            assert states and all(s == "COMPLETED" for s in states), (stage, states, _logs(out))
        assert (out / "student" / "config.json").is_file() and (out / "eval.yaml").is_file()
        report = json.loads((out / "eval" / "report.json").read_text())  # the evaluation job read eval.yaml
        assert report["tasks"]["piqa"]["n"] == 2 and report["niah"]["teacher"] is not None
        distill_log = "\n".join(p.read_text() for p in (out / "logs").glob("distill-*.log"))
        assert "evaluation of the snapshot at 256 tokens started (slurm job" in distill_log
        assert [e["tokens"] for e in read_history(out / "eval")] == [256, 512, 768, 1024], _logs(out)
        assert not pending_marks(out)
        status = harness(slurm_cluster, "status", str(out)).stdout
        assert "distill                      complete" in status and "COMPLETED" in status
        again = harness(slurm_cluster, "submit", str(path), "--dry-run")
        assert "nothing left to run" in again.stdout
    finally:
        slurm_cluster.scancel(*first.values(), *second.values())


def _logs(out: Path) -> str:
    return "\n".join(f"== {p}\n{p.read_text()[-1500:]}" for p in sorted((out / "logs").glob("*.log")))


def test_usr1_before_the_limit_checkpoints_and_requeues(slurm_cluster, tmp_path):
    path, out = write_job(tmp_path, "preempted", "budget.total_tokens=5120", "budget.split=[0.025,0.025,0.95]")
    result = harness(slurm_cluster, "submit", str(path), "--cpus-per-task", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    ids = submitted(out)
    distill = ids["distill"]
    metrics = out / "distill" / "metrics.jsonl"
    try:
        slurm_cluster.wait_for("stage 3 training", lambda: metrics.is_file() and metrics.read_text().count("\n") >= 2,
                               timeout=400)
        slurm_cluster.run("scancel", "--signal=USR1", "--batch", distill)
        slurm_cluster.wait_for("the requeue", lambda: _restarts(slurm_cluster, distill) >= 1, timeout=120)
        log = "\n".join(p.read_text() for p in (out / "logs").glob("distill-*.log"))
        assert "preempted at step" in log and "requeueing job" in log
        steps = [int(p.name.split("-")[1]) for p in (out / "distill" / "checkpoints").glob("step-*")]
        assert steps and 0 < max(steps) < 76  # a checkpoint mid-stage, written on the signal
        preempted_at = max(steps)

        # the requeued job waits (Reason=BeginTime, ~2 min): start it as soon as the node is idle again
        def finished_again() -> bool:
            return slurm_cluster.release_requeued(distill)["JobState"] in {"COMPLETED", "FAILED", "CANCELLED"}

        slurm_cluster.wait_for("the requeued stage 3 to finish", finished_again, timeout=600, poll=2.0)
        assert slurm_cluster.states(distill) == ["COMPLETED"], _logs(out) + slurm_cluster.diagnose(distill)
        logged = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        train_steps = [r["step"] for r in logged if "loss" in r]
        # the second run resumed from the checkpoint: no step trained twice, and it went on to the last step
        assert train_steps == sorted(set(train_steps)) and train_steps[-1] == 76, train_steps
        assert any(s > preempted_at for s in train_steps) and (out / "student" / "config.json").is_file()
    finally:
        slurm_cluster.scancel(*ids.values())


def _restarts(cluster, job_id: str) -> int:
    return max((int(j.get("Restarts", 0)) for j in cluster.jobs(job_id)), default=0)
