"""Stage 3 under the launchers users start it with, on this one CPU machine (gloo, rendezvous over loopback):
the deepspeed launcher with 2 processes gives the losses of torchrun with 2; two "nodes" of 1 process each (two
torchrun agents with --nnodes 2; two deepspeed launchers with a two-host hostfile and --no_ssh) give the losses of
1 node x 2 processes and of one process at the same global batch, as does one deepspeed launcher reaching two
loopback hosts over pdsh and ssh; SIGKILL of one node's process makes the other
node fail within the collective timeout, and a resume ends as the uninterrupted run. Every distributed command
takes the deepspeed launcher's --local_rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from harness.cli import apply_local_rank, build_parser
from harness.config import ConfigError, load_job
from harness.launch.local import distill_command, free_port
from tests.test_distill import CONDITIONED, losses, plain_run, student_weights, write_job

REPO = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60  # run.collective_timeout_s of these runs
HUNG_TIMEOUT_S = 20  # ... and of the one whose peer hangs: short, but longer than any wait of a healthy run here
# a replicated teacher keeps each run ~15 s on 2 cores; the student is ZeRO-3, every parameter sharded
JOB = ["deepspeed.world_size=2", "deepspeed.teacher_placement=replicated", "run.checkpoint_every_tokens=256",
       f"run.collective_timeout_s={TIMEOUT_S}", *CONDITIONED]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    handle = open(log, "w")
    return subprocess.Popen(cmd, env=ENV, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT)


def finish(procs: list[subprocess.Popen], logs: list[Path], timeout: float = 300) -> None:
    for proc, log in zip(procs, logs):
        assert proc.wait(timeout=timeout) == 0, log.read_text()[-3000:]


def torchrun_node(job: Path, rank: int, port: int) -> list[str]:
    """One torchrun agent of a two-node run, with the c10d rendezvous `harness submit` renders."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
            f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=launchers", f"--rdzv_conf=is_host={int(rank == 0)}",
            "-m", "harness.cli", "stage", "distill", str(job)]


def deepspeed_node(job: Path, rank: int, port: int, hostfile: Path) -> list[str]:
    """One deepspeed launcher of a two-node run: the hostfile names two hosts, --no_ssh starts only this one's."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", f"--hostfile={hostfile}", "--no_ssh",
            f"--node_rank={rank}", "--master_addr=127.0.0.1", f"--master_port={port}", "--module", "harness.cli",
            "stage", "distill", str(job)]


def two_nodes(kind: str, job: Path, logs: Path) -> tuple[list[subprocess.Popen], list[Path]]:
    port = free_port()
    hostfile = logs / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    paths = [logs / f"{job.stem}-{kind}-node{r}.log" for r in (0, 1)]
    cmds = [torchrun_node(job, r, port) if kind == "torchrun" else deepspeed_node(job, r, port, hostfile)
            for r in (0, 1)]
    return [start(c, p) for c, p in zip(cmds, paths)], paths


def on_one_node(launcher: str, job: Path, log: Path) -> None:
    """Stage 3 as `harness run` starts it with run.launcher=LAUNCHER."""
    cmd = distill_command(load_job(job, [f"run.launcher={launcher}"]), [str(job), f"run.launcher={launcher}"])
    finish([start(cmd, log)], [log])


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, Path]:
    """1 node x 2 processes under torchrun: (its run directory, its job file)."""
    tmp = tmp_path_factory.mktemp("launchers")
    job = write_job(tmp, tmp / "torchrun-1x2", *JOB)
    on_one_node("torchrun", job, tmp / "torchrun-1x2.log")
    return tmp / "torchrun-1x2", job


def assert_same_run(out: Path, ref: Path) -> None:
    got, want = losses(out), losses(ref)
    assert len(want) >= 5 and got == pytest.approx(want, rel=1e-6), (got, want)
    a, b = student_weights(out), student_weights(ref)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7, msg=name)


def test_the_deepspeed_launcher_with_two_processes_matches_torchrun(reference, tmp_path):
    ref, _ = reference
    job = write_job(tmp_path, tmp_path / "deepspeed-1x2", *JOB)
    on_one_node("deepspeed", job, tmp_path / "deepspeed-1x2.log")
    assert "--local_rank=1" in (tmp_path / "deepspeed-1x2.log").read_text()  # the launcher passed it: accepted
    assert_same_run(tmp_path / "deepspeed-1x2", ref)


def test_two_torchrun_nodes_match_one_node_and_one_process(reference, tmp_path):
    ref, ref_job = reference
    job = write_job(tmp_path, tmp_path / "torchrun-2x1", *JOB)
    finish(*two_nodes("torchrun", job, tmp_path))
    assert_same_run(tmp_path / "torchrun-2x1", ref)
    single, _ = plain_run(ref_job, micro_batch=4)  # one process, the same 4 sequences per step
    assert [losses(tmp_path / "torchrun-2x1")[s] for s in sorted(losses(ref))] == pytest.approx(single, rel=1e-4)


def signal_node_1_after_a_checkpoint(job: Path, out: Path, logs: Path, sig: int) -> tuple[int, float, str]:
    """Two torchrun agents; once the first checkpoint is written, SIG to node 1's process. Returns node 0's exit
    code, the seconds it took to exit after the signal, and its log; every process of the run is gone after."""
    procs, paths = two_nodes("torchrun", job, logs)
    worker = None
    try:
        deadline = time.time() + 240
        while not list((out / "distill" / "checkpoints").glob("step-*/manifest.json")):
            assert time.time() < deadline and all(p.poll() is None for p in procs), paths[0].read_text()[-3000:]
            time.sleep(0.05)
        worker = next(c for c in psutil.Process(procs[1].pid).children(recursive=True)
                      if "harness.cli" in c.cmdline())
        worker.send_signal(sig)
        signalled = time.time()
        code = procs[0].wait(timeout=TIMEOUT_S + 60)
        return code, time.time() - signalled, paths[0].read_text()
    finally:
        if worker is not None and worker.is_running():
            worker.kill()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=60)


SSH_PORT = os.environ.get("HARNESS_SSH_PORT", "2222")  # scripts/loopback_ssh.sh, which `make test` starts


def loopback_ssh() -> bool:
    return subprocess.call(["bash", str(REPO / "scripts" / "loopback_ssh.sh"), "check"],
                           env={**os.environ, "HARNESS_SSH_PORT": SSH_PORT}) == 0


@pytest.mark.skipif(not loopback_ssh(), reason="needs pdsh and passwordless ssh to 127.0.0.1 (`scripts/loopback_ssh.sh "
                    "start`, which `make test` runs as root)")
def test_one_deepspeed_launcher_reaches_two_loopback_hosts_over_pdsh(reference, tmp_path):
    """The deepspeed launcher's own multi-node mode: one `deepspeed --hostfile` whose two hosts (localhost and
    127.0.0.1, the same machine) it starts over pdsh and ssh gives the run of 1 node x 2 processes."""
    ref, _ = reference
    job = write_job(tmp_path, tmp_path / "pdsh-2x1", *JOB)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    env_file = tmp_path / "deepspeed_env"  # what the runner exports to every host besides PYTHON*
    env_file.write_text("DS_ACCELERATOR=cpu\n")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", f"--hostfile={hostfile}", f"--ssh_port={SSH_PORT}",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", "--module", "harness.cli", "stage", "distill",
           str(job)]
    log = tmp_path / "pdsh.log"
    proc = subprocess.Popen(cmd, env={**ENV, "DS_ENV_FILE": str(env_file)}, cwd=REPO, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    finish([proc], [log])
    text = log.read_text()
    assert "localhost: " in text and "127.0.0.1: " in text, text[-3000:]  # pdsh's prefix: each host ran
    assert_same_run(tmp_path / "pdsh-2x1", ref)


def test_a_killed_node_fails_the_other_within_the_timeout_and_deepspeed_nodes_resume(reference, tmp_path):
    """SIGKILL of node 1's process after the first checkpoint (two torchrun agents): node 0 exits non-zero within
    the collective timeout; the run resumed on two deepspeed "nodes" (hostfile, --no_ssh) ends as the
    uninterrupted run."""
    ref, _ = reference
    out = tmp_path / "killed"
    job = write_job(tmp_path, out, *JOB)
    code, waited, log = signal_node_1_after_a_checkpoint(job, out, tmp_path, signal.SIGKILL)
    assert code != 0 and waited < TIMEOUT_S, (code, waited, log[-3000:])
    assert not (out / "student").exists()
    finish(*two_nodes("deepspeed", job, tmp_path))
    assert_same_run(out, ref)


def test_a_hung_node_fails_the_other_after_the_collective_timeout(tmp_path):
    """SIGSTOP instead: the connection stays open, so node 0 waits for its peer until run.collective_timeout_s,
    then exits non-zero (gloo's own timeout), instead of hanging."""
    out = tmp_path / "hung"
    job = write_job(tmp_path, out, *JOB, f"run.collective_timeout_s={HUNG_TIMEOUT_S}")
    code, waited, log = signal_node_1_after_a_checkpoint(job, out, tmp_path, signal.SIGSTOP)
    assert code != 0 and waited < HUNG_TIMEOUT_S + 30, (code, waited, log[-3000:])
    assert f"Timed out waiting {HUNG_TIMEOUT_S * 1000}ms" in log, log[-3000:]


@pytest.mark.parametrize("command", [["stage", "distill", "JOB"], ["stage", "sft", "JOB"], ["bench", "--shape", "tiny"]])
@pytest.mark.parametrize("where", ["before", "after"])
def test_every_distributed_command_takes_the_launchers_local_rank(command, where, monkeypatch):
    """The deepspeed launcher passes --local_rank=N before the command (`-m harness.cli --local_rank=1 stage ...`);
    after it works as well, in either spelling; it becomes LOCAL_RANK."""
    monkeypatch.setenv("LOCAL_RANK", "0")  # so that teardown removes what apply_local_rank sets (a bare delenv of an
    monkeypatch.delenv("LOCAL_RANK")       # absent variable records nothing, and LOCAL_RANK=1 reached later tests)
    argv = ["--local_rank=1", *command] if where == "before" else [*command, "--local-rank", "1"]
    args = build_parser().parse_args(argv)
    apply_local_rank(args)
    assert os.environ["LOCAL_RANK"] == "1" and args.handler is not None


def test_local_rank_is_refused_where_it_cannot_apply(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match="--local_rank=1 disagrees with LOCAL_RANK=0"):
        apply_local_rank(build_parser().parse_args(["--local_rank=1", "stage", "distill", "JOB"]))
    with pytest.raises(ConfigError, match="runs in one process"):
        apply_local_rank(build_parser().parse_args(["--local_rank=0", "info", "JOB"]))


def test_the_launcher_is_checked_and_each_gives_its_command(tmp_path):
    from tests.pipeline import tiny_job

    with pytest.raises(ConfigError, match="Bad value 'mpirun' for run.launcher. Allowed: torchrun, deepspeed"):
        tiny_job(tmp_path / "setting", tmp_path / "run", "run.launcher=mpirun")
    job = tiny_job(tmp_path / "setting", tmp_path / "run", "deepspeed.world_size=2", "run.launcher=deepspeed")
    cmd = distill_command(job, ["JOB"])
    assert cmd[1:4] == ["-m", "deepspeed.launcher.runner", "--num_gpus=2"] and "--module" in cmd
    assert cmd[-4:] == ["harness.cli", "stage", "distill", "JOB"]
    job.run.launcher = "torchrun"
    assert "--standalone" in distill_command(job, ["JOB"])
