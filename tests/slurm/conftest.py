"""A real single-node Slurm cluster for the tests under tests/slurm, started once per session (and a two-node
one on the same host, for the multi-node tests, once per module that asks for it).

The cluster comes from slurm/local/cluster.sh, in a fresh state directory and on free ports (so it can run
beside a developer's cluster on the default ports), and is stopped at the end of the session. When the Slurm
and munge binaries are absent every test here is SKIPPED: install them with `slurm/local/cluster.sh install`
(CI does), or set HARNESS_SLURM_INSTALL=1 to let this fixture run that install itself (needs root/apt-get).
"""

from __future__ import annotations

import contextlib
import os
import re
from datetime import datetime
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

REPO = Path(__file__).resolve().parents[2]
CLUSTER_SH = REPO / "slurm" / "local" / "cluster.sh"
BINARIES = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "slurmctld", "slurmd", "munged", "mungekey")


def _missing_binaries() -> list[str]:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass
class SlurmCluster:
    """A running cluster: `env` is os.environ plus SLURM_CONF, for subprocesses that call sbatch & co."""

    state_dir: Path
    env: dict[str, str]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, check=check, timeout=30)

    def sbatch(self, *args: str) -> str:
        """`sbatch --parsable ARGS`: the job id (for an array, the array's job id)."""
        out = self.run("sbatch", "--parsable", *args).stdout.strip()
        job_id = out.split(";")[0]
        assert re.fullmatch(r"\d+", job_id), f"sbatch --parsable printed {out!r}"
        return job_id

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """`scontrol show job -o ID` as one dict per line (an array gives one per task, or one while unsplit)."""
        proc = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        if proc.returncode != 0:
            return []
        records = []
        for line in proc.stdout.splitlines():
            if not line.strip():
                continue
            fields = {}
            for token in line.split():
                key, sep, value = token.partition("=")
                if sep:
                    fields[key] = value
            records.append(fields)
        return records

    def states(self, job_id: str) -> list[str]:
        return [j.get("JobState", "?") for j in self.jobs(job_id)]

    def release_requeued(self, job_id: str) -> dict[str, str]:
        """A requeued job waits ~2 min (PENDING, Reason=BeginTime) before it runs again; start it sooner. Not
        within the second of the requeue: slurmd revoked the job's credential then, and a new one made in the same
        second counts as revoked ("Job credential revoked", the launch fails and the job ends FAILED; Slurm's own
        BeginTime delay exists for this), so wait until its (reset) SubmitTime is 3 s old. Call repeatedly: an
        update made while the job is still COMPLETING is accepted and lost. Returns the job's record as read."""
        job = self.jobs(job_id)[0]
        if job["JobState"] == "PENDING" and job.get("Reason") == "BeginTime":
            requeued = datetime.fromisoformat(job["SubmitTime"])
            if (datetime.now() - requeued).total_seconds() >= 3:
                self.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
        return job

    def diagnose(self, job_id: str, lines: int = 40) -> str:
        """The job's full record and what slurmctld / slurmd logged about it: for assertion messages."""
        record = self.run("scontrol", "show", "job", "-d", job_id, check=False).stdout
        out = [f"\n== scontrol show job {job_id}\n{record}"]
        for name in ("slurmctld.log", "slurmd.log"):
            log = self.state_dir / "log" / name
            if log.is_file():
                mentions = re.compile(rf"(JobId=|[Jj]ob |StepId=|jobid |job_id ){job_id}\b")
                hits = [line for line in log.read_text(errors="replace").splitlines() if mentions.search(line)]
                out.append(f"== {name} (lines naming {job_id})\n" + "\n".join(hits[-lines:]))
        return "\n".join(out)

    def scancel(self, *job_ids: str) -> None:
        if job_ids:
            self.run("scancel", *job_ids, check=False)

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float = 25.0, poll: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(poll)
        squeue = self.run("squeue", "-t", "all", "-o", "%.12i %.10T %.25r %.8M", check=False).stdout
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{squeue}")

    def wait_states(self, job_id: str, done: set[str], timeout: float = 25.0) -> list[str]:
        """Wait until every record of JOB_ID is in one of DONE's states; returns the states."""
        self.wait_for(
            f"job {job_id} in {sorted(done)}",
            lambda: (s := self.states(job_id)) != [] and all(x in done for x in s),
            timeout,
        )
        return self.states(job_id)


def _free_ports(count: int) -> int:
    """The first of `count` consecutive TCP ports that are free now."""
    for _ in range(50):
        first = _free_port()
        try:
            with contextlib.ExitStack() as stack:
                for port in range(first + 1, first + count):
                    s = stack.enter_context(socket.socket())
                    s.bind(("", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {count} consecutive free ports found")


@contextlib.contextmanager
def _cluster(nodes: int):
    """A cluster of `nodes` nodes on this host (one slurmd each), started by cluster.sh, stopped and deleted after."""
    missing = _missing_binaries()
    if missing and os.environ.get("HARNESS_SLURM_INSTALL") == "1":
        subprocess.run(["bash", str(CLUSTER_SH), "install"], check=False, timeout=600)
        missing = _missing_binaries()
    if missing:
        pytest.skip(
            f"Slurm binaries not found ({', '.join(missing)}): run `slurm/local/cluster.sh install` "
            "(or set HARNESS_SLURM_INSTALL=1) to run the local-cluster tests"
        )

    # mkdtemp directly under the temp dir: the munge socket path must stay under the ~108-byte AF_UNIX limit
    state_dir = Path(tempfile.mkdtemp(prefix="harness-slurm-"))
    env = dict(os.environ)
    env.pop("SLURM_CONF", None)
    env["HARNESS_SLURMCTLD_PORT"] = str(_free_port())
    env["HARNESS_SLURMD_PORT"] = str(_free_ports(nodes))
    env["HARNESS_SLURM_NODES"] = str(nodes)
    env["PATH"] = env.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    proc = subprocess.run(
        ["bash", str(CLUSTER_SH), "start", str(state_dir)], env=env, capture_output=True, text=True, timeout=90
    )
    if proc.returncode != 0:
        subprocess.run(["bash", str(CLUSTER_SH), "stop", str(state_dir)], env=env, capture_output=True, timeout=60)
        pytest.fail(f"cluster.sh start failed (rc {proc.returncode}):\n{proc.stderr}\n{proc.stdout}")
    for line in proc.stdout.splitlines():
        m = re.fullmatch(r"export (\w+)=(.*)", line.strip())
        if m:
            env[m.group(1)] = m.group(2)
    assert "SLURM_CONF" in env, proc.stdout
    try:
        yield SlurmCluster(state_dir=state_dir, env=env)
    finally:
        subprocess.run(["bash", str(CLUSTER_SH), "stop", str(state_dir)], env=env, capture_output=True, timeout=60)
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    with _cluster(1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def slurm_two_nodes() -> SlurmCluster:
    """Two nodes on this host (node1, node2: one slurmd each, one CPU each on a 2-core machine)."""
    with _cluster(2) as cluster:
        yield cluster


@pytest.fixture
def slurm_env(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The cluster, with SLURM_CONF set in os.environ for code under test that shells out to sbatch itself."""
    monkeypatch.setenv("SLURM_CONF", slurm_cluster.env["SLURM_CONF"])
    monkeypatch.setenv("PATH", slurm_cluster.env["PATH"])
    return slurm_cluster
