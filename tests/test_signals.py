"""Signals and concurrency on the tiny CPU pipeline (harness/preempt.py, harness/launch/local.py): SIGTERM is a
preemption request like SIGUSR1 (checkpoint, exit 85, resume exactly); `harness run` passes a stop request on to its
children, waits for them and exits 85 itself, leaving no process behind; a second `harness run` on the same
directory is refused; the leftovers of a killed merge are removed by the next merge.

One uninterrupted run (module fixture: stages 1-2 and the merge in this process, stage 3 as its own process) is the
reference; each test continues a copy of it from its merged student, so that only stage 3 runs again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.launch.local import process_start, process_tree
from harness.preempt import REQUEUE_EXIT
from tests.pipeline import REPO, finish, job_file, reference_run, run, start

# stage 3: 20 steps of 64 tokens, a checkpoint every 2 steps: a signal after the first one lands mid-stage
SETTING = ["budget.split=[0.05,0.05,0.9]", "run.layer_groups=1", "data.validation_tokens=128",
           "run.checkpoint_every_tokens=128"]
TOTAL = 1440


def checkpoints(out: Path) -> list[int]:
    return sorted(int(p.parent.name.split("-")[1])
                  for p in (out / "distill" / "checkpoints").glob("step-*/manifest.json"))


def wait_for_checkpoint(proc: subprocess.Popen, out: Path, log: Path) -> None:
    deadline = time.time() + 400
    while not checkpoints(out):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.time() < deadline, "no stage-3 checkpoint in 400 s"
        time.sleep(0.05)


def alive(tree: dict[int, int]) -> list[int]:
    return [pid for pid, started in tree.items() if process_start(pid) == started]


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "distill" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def assert_same_student(out: Path, reference: Path) -> None:
    assert losses(out) == losses(reference)
    a, b = load_file(out / "student" / "model.safetensors"), load_file(reference / "student" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run of the whole pipeline: its run directory (this process's signal handlers kept)."""
    out, _ = reference_run(tmp_path_factory.mktemp("signals"), *SETTING, total=TOTAL)
    return out


def continued(reference: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the reference run up to its merged student (its stale .run.lock included), and its job file."""
    out = tmp_path / "run"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("distill", "student", "eval.yaml", "logs"),
                    symlinks=True)
    (out / "logs").mkdir()
    return out, job_file(reference.parent, out, *SETTING, total=TOTAL)


def test_sigterm_to_a_stage_3_process_checkpoints_exits_for_requeue_and_resumes_exactly(reference, tmp_path):
    out, job = continued(reference, tmp_path)
    log = tmp_path / "distill.log"
    proc = start("stage", "distill", str(job), log=log)
    wait_for_checkpoint(proc, out, log)
    proc.send_signal(signal.SIGTERM)
    code, output = finish(proc, log)
    assert code == REQUEUE_EXIT, output[-3000:]
    stopped_at = int(output.split("distill: preempted at step ")[1].split(";")[0])
    assert checkpoints(out)[-1] == stopped_at and not (out / "student").exists()
    run("stage", "distill", str(job), log=tmp_path / "rerun.log")
    assert_same_student(out, reference)


def test_sigterm_to_harness_run_alone_stops_its_children_then_a_rerun_resumes_and_a_second_run_is_refused(
        reference, tmp_path):
    out, job = continued(reference, tmp_path)
    log = tmp_path / "run.log"
    proc = start("run", str(job), log=log)
    wait_for_checkpoint(proc, out, log)
    tree = process_tree(proc.pid)
    assert len(tree) >= 2  # harness run and its stage 3
    os.kill(proc.pid, signal.SIGTERM)  # the launcher alone, not its process group
    code, output = finish(proc, log)
    assert code == REQUEUE_EXIT, output[-3000:]
    assert "stopped on a preemption request (SIGTERM)" in output and "run the same command again" in output
    assert not alive(tree), f"left running: {alive(tree)}"
    assert checkpoints(out) and not (out / "student").exists()

    rerun = start("run", str(job), log=tmp_path / "rerun.log")
    wait_for_lock_holder(out, rerun)
    os.kill(rerun.pid, signal.SIGSTOP)  # the launcher holds still (its stage goes on): the second run meets it
    try:
        second = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(job)], cwd=REPO, text=True,
                                capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        os.kill(rerun.pid, signal.SIGCONT)
    assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
    assert f"pid {rerun.pid} on host " in second.stderr and "kill -TERM" in second.stderr
    code, output = finish(rerun, tmp_path / "rerun.log")
    assert code == 0, output[-3000:]
    assert_same_student(out, reference)


def wait_for_lock_holder(out: Path, proc: subprocess.Popen) -> None:
    """Until `proc` holds the run lock (its pid in the lock file)."""
    deadline = time.time() + 300
    while True:
        try:
            if json.loads((out / ".run.lock").read_text())["pid"] == proc.pid:
                return
        except (OSError, ValueError, KeyError):
            pass
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)


def test_sigusr1_to_harness_run_stops_it_for_requeue_with_no_child_left(reference, tmp_path):
    out, job = continued(reference, tmp_path)
    log = tmp_path / "run.log"
    proc = start("run", str(job), log=log)
    wait_for_checkpoint(proc, out, log)
    first = checkpoints(out)[-1]
    tree = process_tree(proc.pid)
    os.kill(proc.pid, signal.SIGUSR1)
    code, output = finish(proc, log)
    assert code == REQUEUE_EXIT, output[-3000:]  # not killed by the signal
    assert "stopped on a preemption request (SIGUSR1)" in output
    assert not alive(tree), f"left running: {alive(tree)}"
    assert checkpoints(out)[-1] >= first and not (out / "student").exists()


def test_the_leftover_of_a_killed_merge_is_removed_by_the_next_merge(reference, tmp_path):
    from harness.config import load_job
    from harness.files import hold_lock
    from harness.stages.merge import MERGE_LOCK, merge_student, remove_leftovers

    out, job_path = continued(reference, tmp_path)
    shutil.rmtree(out / "merged")
    leftover = out / ".merged.tmp-killed"  # what a SIGKILL during the merge's save leaves
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"half a model")
    job = load_job(str(job_path), [])
    fd = hold_lock(out / MERGE_LOCK)  # a merge at work: its temporary folder may be the one found
    try:
        assert remove_leftovers(job) == [] and leftover.is_dir()
    finally:
        os.close(fd)
    merge_student(job)
    assert not leftover.exists() and (out / "merged" / "MERGE.json").is_file()
    a = load_file(out / "merged" / "model.safetensors")
    b = load_file(reference / "merged" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_run_lock_names_its_holder_and_ends_with_it(tmp_path):
    from harness.files import LockHeld, hold_lock
    from harness.launch.local import RUN_LOCK, RunDirInUse, take_run_lock

    fd = take_run_lock(tmp_path)
    try:
        with pytest.raises(RunDirInUse, match=f"pid {os.getpid()} on host"):
            take_run_lock(tmp_path)
    finally:
        os.close(fd)
    assert (tmp_path / RUN_LOCK).is_file()
    os.close(take_run_lock(tmp_path))  # the file stayed; the lock went with its holder
    (tmp_path / "other.lock").write_text("left by a process that died")
    fd = hold_lock(tmp_path / "other.lock", "mine")
    try:
        with pytest.raises(LockHeld) as held:
            hold_lock(tmp_path / "other.lock")
        assert held.value.note == "mine"
    finally:
        os.close(fd)
