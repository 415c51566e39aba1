"""The stage 3 that `harness submit --nodes 2` renders, run on a real two-node Slurm (two slurmd on this host)
with the deepspeed launcher (srun + one launcher per node, --no_ssh): it ends with the losses of one process at
the same global batch. (torchrun's two-node form, the same rendezvous flags, runs in tests/test_launchers.py;
under this Slurm it gave the deepspeed run's losses and student exactly when run by hand.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.checkpoint import CheckpointManager
from tests.test_distill import losses, plain_run, write_job
from tests.test_launchers import JOB

REPO = Path(__file__).resolve().parents[2]


def stage_3_only(tmp: Path, name: str) -> tuple[Path, Path]:
    """A job whose stages 1-2 and merge count as complete (its merged student is the initial one), so that
    `harness submit` plans stage 3 alone."""
    out = tmp / name
    job = write_job(tmp, out, *JOB)
    (out / "merged" / "MERGE.json").write_text("{}")
    for stage in ("align_mixer", "align_hidden"):
        for group in ("layers-00-01", "layers-02-03"):
            CheckpointManager(out / stage / group).mark_complete({"steps": 1}, collective=False)
            (out / stage / group / "weights.safetensors").write_text("")
    return job, out


def submit(cluster, job: Path, launcher: str) -> str:
    env = {**cluster.env, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-m", "harness.cli", "submit", str(job), "--nodes", "2", "--cpus-per-task",
                           "1", "--launcher", launcher], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "distill:" in done.stdout and "align" not in done.stdout, done.stdout
    return done.stdout.split("distill:")[1].split()[0]


@pytest.mark.timeout(600)
def test_the_rendered_two_node_stage_3_runs_on_two_slurm_nodes(slurm_two_nodes, tmp_path):
    job, out = stage_3_only(tmp_path, "deepspeed")
    job_id = submit(slurm_two_nodes, job, "deepspeed")
    states = slurm_two_nodes.wait_states(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=300)
    log = "".join(p.read_text() for p in (out / "logs").glob("distill-*.log"))
    assert states == ["COMPLETED"], log[-3000:] + slurm_two_nodes.diagnose(job_id)
    assert slurm_two_nodes.jobs(job_id)[0]["NodeList"] == "node[1-2]"
    assert "--node_rank=0" in log and "--node_rank=1" in log  # one deepspeed launcher per node
    single, _ = plain_run(job, micro_batch=4)
    assert list(losses(out).values()) == pytest.approx(single, rel=1e-4) and len(single) >= 5
    assert (out / "student" / "model.safetensors").is_file()
