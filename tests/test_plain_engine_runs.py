"""Stage 3 on the plain engine (deepspeed.student_engine=plain, harness.plain_engine) on the tiny CPU pipeline:

- two processes (torch DDP over gloo, gradients reduced in fp32 by its communication hook, checkpoints written by
  rank 0) equal one process at the same global batch: the losses, validations and weights that stage 3 of the code
  before harness.train gave on one process (tests/test_train_loop.py's BEFORE);
- two processes killed with SIGKILL after a checkpoint and rerun end bit for bit as the uninterrupted two;
- a checkpoint in the format of the plain engine before harness.train (its optimizer state numbered) resumes exactly,
  and one that does not fit the student is refused naming its file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.test_distill import REPO, launch, student_weights, write_job
from tests.test_train_loop import PLAIN, assert_as_before, distill, rows

TWO = [*PLAIN, "deepspeed.world_size=2", "run.validate_every_steps=4", "run.checkpoint_every_tokens=256"]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """An uninterrupted stage 3 on two processes at micro-batch 2 (the pinned run's micro-batch 2 x 2 accumulated)."""
    tmp = tmp_path_factory.mktemp("two")
    out = tmp / "run"
    launch(write_job(tmp, out, *TWO), world=2)
    return out


def test_two_processes_of_the_plain_engine_equal_one_at_the_same_global_batch(two_processes):
    assert_as_before("distill", rows(two_processes), student_weights(two_processes))
    assert len(list((two_processes / "distill" / "checkpoints").glob("step-*/ds/plain_engine.pt"))) == 2


def test_two_processes_killed_after_a_checkpoint_then_rerun_end_as_uninterrupted(two_processes, tmp_path):
    """SIGKILL to the launcher and both workers (one process group) once a checkpoint is complete, then the same
    command again: the same lines (losses, gradient norms, validations) and the same weights, bit for bit."""
    killed = tmp_path / "killed"
    job_path = write_job(tmp_path, killed, *TWO)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "harness.cli",
           "stage", "distill", str(job_path)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    ckpts = killed / "distill" / "checkpoints"
    deadline = time.time() + 300
    while not any((p / "manifest.json").exists() for p in ckpts.glob("step-*")) and time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (killed / "student").exists()
    launch(job_path, world=2)
    fields = ("step", "tokens", "loss", "ce", "kl", "grad_norm", "lr", "val_ce", "val_kl", "val_ppl")
    assert [{k: r.get(k) for k in fields} for r in rows(killed)] == \
        [{k: r.get(k) for k in fields} for r in rows(two_processes)]
    a, b = student_weights(killed), student_weights(two_processes)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------ checkpoints of the engine before


def as_before(checkpoint: Path) -> None:
    """Rewrites a plain-engine checkpoint as the plain engine before harness.train wrote it (its optimizer's
    parameters numbered in the optimizer's order, not named) and its manifest entry to match."""
    from harness.checkpoint import file_digest

    path = checkpoint / "ds" / "plain_engine.pt"
    state = torch.load(path, weights_only=True)
    names = [name for group in state["optimizer"]["param_groups"] for name in group["params"]]
    number = {name: i for i, name in enumerate(names)}
    state["optimizer"]["state"] = {number[k]: v for k, v in state["optimizer"]["state"].items()}
    for group in state["optimizer"]["param_groups"]:
        group["params"] = [number[name] for name in group["params"]]
    torch.save(state, path)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["ds/plain_engine.pt"] = file_digest(path)
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def test_a_checkpoint_of_the_plain_engine_before_resumes_exactly(tmp_path, one_process_group):
    """A run stopped after step 5 (as if killed there), its step-4 checkpoint rewritten in the format of the plain
    engine before harness.train, rerun: it resumes there (steps 1-4 not redone) and ends as the run of the code before
    would have (the pinned losses, validations and weights). Both runs in this process."""
    extra = [*PLAIN, "stages.distill.grad_accum=2", "run.validate_every_steps=4",
             "run.checkpoint_every_tokens=256"]  # 128 tokens per step: checkpoints at steps 2, 4, ...
    old = tmp_path / "old"
    job_path = write_job(tmp_path, old, *extra)
    distill(job_path, stop_after_steps=5)
    ckpts = sorted((old / "distill" / "checkpoints").glob("step-*"))
    assert [p.name for p in ckpts] == ["step-00000002", "step-00000004"]
    as_before(ckpts[-1])
    assert isinstance(next(iter(torch.load(ckpts[-1] / "ds" / "plain_engine.pt", weights_only=True)
                                ["optimizer"]["state"])), int)
    before = rows(old)[:4]  # steps 1-4 (step 4's with its validation)
    distill(job_path)
    assert rows(old)[:4] == before  # resumed at step 4 (its lines kept, wall-clock times too), not from the start
    assert_as_before("distill", rows(old), student_weights(old))


def test_a_plain_engine_checkpoint_that_does_not_fit_is_refused_by_name(tmp_path):
    from harness.config import ConfigError
    from harness.engine import PlainEngine
    from harness.export import TAG

    def engine(width: int) -> PlainEngine:
        return PlainEngine(torch.nn.Linear(width, 2), {}, lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: 1.0), torch.device("cpu"))

    engine(3).save_checkpoint(str(tmp_path), TAG)
    state_file = tmp_path / TAG / "plain_engine.pt"
    with pytest.raises(ConfigError, match=f"checkpoint file {state_file} .* does not fit this run's student: weight "
                                          r"is \(2, 3\) there and \(2, 4\) here.*start the stage afresh"):
        engine(4).load_checkpoint(str(tmp_path), TAG)
    state = torch.load(state_file, weights_only=True)
    del state["module"]["bias"]
    torch.save(state, state_file)
    with pytest.raises(ConfigError, match="it holds no bias"):
        engine(3).load_checkpoint(str(tmp_path), TAG)
