"""The local single-node Slurm (slurm/local/cluster.sh) does what the harness's Slurm pipeline relies on:
job arrays, `afterok` on a whole array, DependencyNeverSatisfied after a failed task, `--parsable`, requeue.

Every test submits real jobs with sbatch and cleans up with scancel; all are skipped without Slurm installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.slurm.conftest import SlurmCluster

pytestmark = pytest.mark.timeout(90)

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL"}


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\nset -eu\n" + body)
    path.chmod(0o755)
    return path


def _times(path: Path) -> tuple[float, float]:
    start, end = path.read_text().split()
    return float(start), float(end)


def test_cluster_is_idle_with_two_cpus(slurm_cluster: SlurmCluster) -> None:
    out = slurm_cluster.run("sinfo", "-h", "-N", "-o", "%T %c %P").stdout.split()
    assert out[0] == "idle" and int(out[1]) >= 1 and out[2] == "debug*", out


def test_parsable_returns_the_job_id(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    job_id = slurm_cluster.sbatch("--chdir", str(tmp_path), "-o", str(tmp_path / "out-%j"), "--wrap", "echo hi")
    try:
        assert job_id.isdigit()
        assert slurm_cluster.wait_states(job_id, FINAL) == ["COMPLETED"]
        assert (tmp_path / f"out-{job_id}").read_text().strip() == "hi"
        # MinJobAge=600: the finished job is still visible to scontrol (no sacct without accounting)
        assert slurm_cluster.jobs(job_id)[0]["ExitCode"] == "0:0"
    finally:
        slurm_cluster.scancel(job_id)


def test_array_runs_every_task(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    script = _script(
        tmp_path / "task.sh",
        f'd={tmp_path}\nt0=$(date +%s.%N)\nsleep 2\necho "$t0 $(date +%s.%N)" > "$d/task_$SLURM_ARRAY_TASK_ID"\n'
        f'echo "$SLURM_ARRAY_JOB_ID" > "$d/array_id_$SLURM_ARRAY_TASK_ID"\n',
    )
    job_id = slurm_cluster.sbatch("--array=0-1", "--cpus-per-task=1", "-o", str(tmp_path / "%A_%a.out"), str(script))
    try:
        states = slurm_cluster.wait_states(job_id, FINAL)
        assert states == ["COMPLETED", "COMPLETED"], states
        for task in (0, 1):
            assert (tmp_path / f"array_id_{task}").read_text().strip() == job_id
        (s0, e0), (s1, e1) = _times(tmp_path / "task_0"), _times(tmp_path / "task_1")
        # select/cons_tres + CR_Core: two 1-CPU tasks share the 2-core node, so they overlap in time
        assert max(s0, s1) < min(e0, e1), "the two array tasks ran one after the other"
    finally:
        slurm_cluster.scancel(job_id)


def test_afterok_waits_for_the_whole_array(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    task = _script(
        tmp_path / "task.sh",
        f'sleep $((1 + 3 * SLURM_ARRAY_TASK_ID))\ndate +%s.%N > "{tmp_path}/end_$SLURM_ARRAY_TASK_ID"\n',
    )
    after = _script(tmp_path / "after.sh", f'date +%s.%N > "{tmp_path}/after_start"\n')
    array_id = slurm_cluster.sbatch("--array=0-1", "-o", str(tmp_path / "%A_%a.out"), str(task))
    dep_id = slurm_cluster.sbatch(f"--dependency=afterok:{array_id}", "-o", str(tmp_path / "after.out"), str(after))
    try:
        # once task 0 is done and task 1 still runs, the dependent must still be held on Dependency
        slurm_cluster.wait_for("array task 0 to finish", lambda: (tmp_path / "end_0").exists())
        held = slurm_cluster.jobs(dep_id)[0]
        if not (tmp_path / "end_1").exists():
            assert held["JobState"] == "PENDING" and held["Reason"] == "Dependency", held
        assert slurm_cluster.wait_states(dep_id, FINAL) == ["COMPLETED"]
        after_start = float((tmp_path / "after_start").read_text())
        assert after_start >= float((tmp_path / "end_0").read_text())
        assert after_start >= float((tmp_path / "end_1").read_text())
        assert slurm_cluster.states(array_id) == ["COMPLETED", "COMPLETED"]
    finally:
        slurm_cluster.scancel(dep_id, array_id)


def test_failed_array_task_leaves_afterok_dependent_pending(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    task = _script(tmp_path / "task.sh", '[ "$SLURM_ARRAY_TASK_ID" = 1 ] && exit 3\nexit 0\n')
    after = _script(tmp_path / "after.sh", f'touch "{tmp_path}/after_ran"\n')
    array_id = slurm_cluster.sbatch("--array=0-1", "-o", str(tmp_path / "%A_%a.out"), str(task))
    dep_id = slurm_cluster.sbatch(f"--dependency=afterok:{array_id}", "-o", str(tmp_path / "after.out"), str(after))
    try:
        assert sorted(slurm_cluster.wait_states(array_id, FINAL)) == ["COMPLETED", "FAILED"]
        slurm_cluster.wait_for(
            "DependencyNeverSatisfied",
            lambda: slurm_cluster.jobs(dep_id)[0].get("Reason") == "DependencyNeverSatisfied",
        )
        job = slurm_cluster.jobs(dep_id)[0]
        assert job["JobState"] == "PENDING", job
        assert not (tmp_path / "after_ran").exists()
        failed = [j for j in slurm_cluster.jobs(array_id) if j["JobState"] == "FAILED"]
        assert failed[0]["ArrayTaskId"] == "1" and failed[0]["ExitCode"] == "3:0", failed
    finally:
        slurm_cluster.scancel(dep_id, array_id)
    assert slurm_cluster.wait_states(dep_id, FINAL) == ["CANCELLED"]


def test_requeue_runs_the_job_again(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # first run: count 1, then sleep (we requeue it while it runs); second run: count 2, exit 0
    script = _script(
        tmp_path / "requeue.sh",
        f'c="{tmp_path}/count"\nn=$(( $(cat "$c" 2>/dev/null || echo 0) + 1 ))\necho $n > "$c"\n'
        f'echo "${{SLURM_RESTART_COUNT:-0}}" >> "{tmp_path}/restarts"\n'
        '[ "$n" -ge 2 ] && exit 0\nsleep 120\n',
    )
    job_id = slurm_cluster.sbatch("--requeue", "-o", str(tmp_path / "out-%j"), str(script))
    try:
        slurm_cluster.wait_for(
            "the first run", lambda: slurm_cluster.states(job_id) == ["RUNNING"] and (tmp_path / "count").exists()
        )
        slurm_cluster.run("scontrol", "requeue", job_id)

        # the requeued job goes COMPLETING -> PENDING (Reason=BeginTime, ~2 min out): start it now, repeatedly
        def started_again() -> bool:
            job = slurm_cluster.release_requeued(job_id)
            return job["JobState"] in FINAL and (tmp_path / "count").read_text().strip() == "2"

        slurm_cluster.wait_for("the requeued run", started_again)
        assert slurm_cluster.states(job_id) == ["COMPLETED"], slurm_cluster.diagnose(job_id)
        assert (tmp_path / "restarts").read_text().split() == ["0", "1"]
        assert slurm_cluster.jobs(job_id)[0]["Restarts"] == "1"
    finally:
        slurm_cluster.scancel(job_id)
