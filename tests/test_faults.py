"""Fault injection on the tiny CPU pipeline (issue 49): every fault ends in a resume that completes with exactly what
an uninterrupted run gives, or in a clear refusal with nothing lost.

Here: SIGKILL and SIGTERM inside stage 1, stage 2, the merge and the evaluation; a full disk during stage 1 (a
small tmpfs filled up where the test runs as root and may mount, else an injected ENOSPC); a rerun with changed
settings; an export onto a folder of someone else's files and onto the run itself. Processes are stopped at exact
points through harness.failpoints (a checkpoint just saved, the merge's folder written but not renamed, a NIAH sample
saved), not by timing.

Elsewhere, on the same tiny pipeline: SIGKILL and SIGTERM inside stage 3 and `harness run`, two runs on one
directory, a killed merge's leftovers (tests/test_signals.py, tests/test_distill.py); a corrupted (same size) and a
truncated newest checkpoint (tests/test_resume_fallback.py, tests/test_checkpoint.py); crafted pickles
(tests/test_safe_load.py); the fresh-cache deadlock (tests/test_mixed_corpus.py).

One uninterrupted run is the reference (module fixture: stages 1-2 and the merge in this process, stage 3 and the
evaluation as processes); each test continues a copy of it from where its fault strikes.
"""

from __future__ import annotations

import errno
import hashlib
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
from omegaconf import OmegaConf
from safetensors.torch import load_file

from harness.preempt import REQUEUE_EXIT
from tests.pipeline import REPO, finish, job_file, reference_run, run, start

# 64 tokens a step, a checkpoint every 2 steps: stage 1 and 2 take 12 steps each, stage 3 16
SETTING = ["budget.split=[0.3,0.3,0.4]", "run.layer_groups=1", "data.validation_tokens=128",
           "run.checkpoint_every_tokens=128", "eval.enabled=true", "eval.tasks=[]", "eval.teacher=false",
           "eval.niah.lengths=[256]", "eval.niah.depths=[0.0,0.5,1.0]", "eval.niah.kinds=[passkey]",
           "eval.niah.samples=2", "eval.perplexity_tokens=128"]
TOTAL = 2560
GROUP = "layers-00-03"
LATER = {"align_mixer": ["align_mixer", "align_hidden", "merged", "distill", "student", "eval", "eval.yaml"],
         "align_hidden": ["align_hidden", "merged", "distill", "student", "eval", "eval.yaml"],
         "merge": ["merged", "distill", "student", "eval", "eval.yaml"],
         "eval": ["eval"]}


def wait_for_pause(proc: subprocess.Popen, marker: Path, log: Path) -> None:
    deadline = time.time() + 300
    while not marker.exists():
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.time() < deadline, f"{marker.name} not reached in 300 s"
        time.sleep(0.05)


def same_tensors(a: Path, b: Path) -> bool:
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def tree_digest(root: Path, skip: tuple[str, ...] = ("logs", ".run.lock", ".preempt-request")) -> dict[str, str]:
    """sha256 of every file under `root` but `skip` (what a refused command must leave as it was)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and p.relative_to(root).parts[0] not in skip}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run: stages 1-2 and the merge in this process (its signal handlers kept), stage 3 and the
    evaluation as `harness` processes."""
    root = tmp_path_factory.mktemp("faults")
    out, _ = reference_run(root, *SETTING, total=TOTAL)
    run("eval", "job", str(out / "eval.yaml"), log=root / "eval.log")
    return out


def continued(reference: Path, tmp_path: Path, fault_in: str) -> tuple[Path, Path]:
    """A copy of the reference run without what `fault_in` and the parts after it made, and its job file."""
    out = tmp_path / "run"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("logs", *LATER[fault_in]), symlinks=True)
    (out / "logs").mkdir()
    job = job_file(reference.parent, out, *SETTING, total=TOTAL)
    if fault_in == "eval":  # the spec names the reference's folders: point it at the copy
        spec = OmegaConf.load(reference / "eval.yaml")
        spec.checkpoint, spec.output_dir = str(out / "student"), str(out / "eval")
        spec.job = str(out / "job.yaml")
        (out / "eval.yaml").write_text(OmegaConf.to_yaml(spec))
    return out, job


def stage_args(stage: str, job: Path) -> list[str]:
    return ["stage", stage.replace("_", "-"), str(job), "--layers", "0-3"]


# -------------------------------------------------------------------------------------------- stages 1 and 2


@pytest.mark.parametrize("stage, sig", [("align_mixer", signal.SIGKILL), ("align_mixer", signal.SIGTERM),
                                        ("align_hidden", signal.SIGKILL), ("align_hidden", signal.SIGTERM)])
def test_a_signal_inside_a_layer_stage_then_a_rerun_gives_the_uninterrupted_group(reference, tmp_path, stage, sig):
    out, job = continued(reference, tmp_path, stage)
    log, pauses = tmp_path / "stage.log", tmp_path / "pauses"
    pauses.mkdir()
    proc = start(*stage_args(stage, job), log=log, failpoints="checkpoint.saved=pause@1", pauses=pauses)
    wait_for_pause(proc, pauses / "checkpoint.saved", log)
    proc.send_signal(sig)
    code, output = finish(proc, log)
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else REQUEUE_EXIT), output[-3000:]
    gdir = out / stage / GROUP
    assert not (gdir / "COMPLETE.json").exists() and list((gdir / "checkpoints").glob("step-*/manifest.json"))
    run(*stage_args(stage, job), log=tmp_path / "rerun.log")
    assert same_tensors(gdir / "weights.safetensors", reference / stage / GROUP / "weights.safetensors")
    done, want = (json.loads((d / "COMPLETE.json").read_text())["meta"] for d in (gdir, reference / stage / GROUP))
    assert done["losses"] == want["losses"] and done["steps"] == want["steps"]


# -------------------------------------------------------------------------------------------- the merge


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_signal_inside_the_merge_then_a_rerun_gives_the_uninterrupted_student(reference, tmp_path, sig):
    out, job = continued(reference, tmp_path, "merge")
    log, pauses = tmp_path / "merge.log", tmp_path / "pauses"
    pauses.mkdir()
    proc = start("stage", "merge", str(job), log=log, failpoints="merge.saved=pause", pauses=pauses)
    wait_for_pause(proc, pauses / "merge.saved", log)
    proc.send_signal(sig)
    code, output = finish(proc, log)
    leftovers = list(out.glob(".merged.tmp-*"))
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL and len(leftovers) == 1  # what the next merge must clear
    else:
        assert code == REQUEUE_EXIT and leftovers == [], output[-3000:]
    assert not (out / "merged").exists()
    run("stage", "merge", str(job), log=tmp_path / "rerun.log")
    assert not list(out.glob(".merged.tmp-*"))
    assert same_tensors(out / "merged" / "model.safetensors", reference / "merged" / "model.safetensors")


# -------------------------------------------------------------------------------------------- the evaluation


def student_results(eval_dir: Path) -> dict:
    niah = json.loads((eval_dir / "student" / "niah.json").read_text())
    ppl = json.loads((eval_dir / "student" / "perplexity.json").read_text())
    return {"niah": {k: v for k, v in niah.items() if "time" not in k},
            "perplexity": {k: v for k, v in ppl.items() if "time" not in k}}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_signal_inside_the_evaluation_then_a_rerun_gives_the_uninterrupted_results(reference, tmp_path, sig):
    out, _ = continued(reference, tmp_path, "eval")
    log, pauses = tmp_path / "eval.log", tmp_path / "pauses"
    pauses.mkdir()
    proc = start("eval", "job", str(out / "eval.yaml"), log=log, failpoints="niah.sample_saved=pause@2",
                 pauses=pauses)
    wait_for_pause(proc, pauses / "niah.sample_saved", log)
    proc.send_signal(sig)
    code, output = finish(proc, log)
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else REQUEUE_EXIT), output[-3000:]
    cells = (out / "eval" / "student" / "niah_cells.jsonl").read_text().splitlines()
    assert len(cells) == 3 and not (out / "eval" / "report.md").exists()  # the header and two samples were kept
    rerun = run("eval", "job", str(out / "eval.yaml"), log=tmp_path / "rerun.log")
    assert (out / "eval" / "report.md").is_file(), rerun[-2000:]
    assert student_results(out / "eval") == student_results(reference / "eval")


# -------------------------------------------------------------------------------------------- a full disk


def _mount_tmpfs(folder: Path, size: str) -> bool:
    """A small tmpfs on `folder`; False where this process may not mount one."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    return done.returncode == 0


def _fill(folder: Path) -> Path:
    """Fill the file system of `folder` to the last byte (a file written, unbuffered, until ENOSPC)."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 16, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError as err:
                assert err.errno == errno.ENOSPC
    return filler


def test_a_full_disk_during_a_stage_fails_clearly_and_the_rerun_with_room_resumes_exactly(reference, tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = _mount_tmpfs(disk, "32m")
    proc = None
    try:
        out = disk / "run"
        job = job_file(reference.parent, out, *SETTING, total=TOTAL)
        log, pauses = tmp_path / "stage.log", tmp_path / "pauses"
        pauses.mkdir()
        if mounted:  # a real full disk: the tmpfs is filled while the stage waits after its first checkpoint
            proc = start(*stage_args("align_mixer", job), log=log, failpoints="checkpoint.saved=pause@1",
                         pauses=pauses)
            wait_for_pause(proc, pauses / "checkpoint.saved", log)
            filler = _fill(disk)
            (pauses / "checkpoint.saved.continue").touch()
        else:  # the second checkpoint's write fails as a full disk would
            proc = start(*stage_args("align_mixer", job), log=log, failpoints="checkpoint.write=enospc@2",
                         pauses=pauses)
        code, output = finish(proc, log)
        assert code == 1, output[-3000:]
        assert "error: writing step 4 failed" in output and "Traceback" not in output, output[-3000:]
        assert ("the disk is full" if mounted else "No space left on device") in output, output[-3000:]
        ckpts = out / "align_mixer" / GROUP / "checkpoints"
        assert [p.name for p in ckpts.glob("step-*")] == ["step-00000002"]  # the last good one stays
        assert not [p for p in ckpts.iterdir() if p.name.startswith(".tmp-")]  # the failed save is cleaned up
        if mounted:
            filler.unlink()
        run(*stage_args("align_mixer", job), log=tmp_path / "rerun.log")
        gdir = out / "align_mixer" / GROUP
        assert same_tensors(gdir / "weights.safetensors", reference / "align_mixer" / GROUP / "weights.safetensors")
    finally:
        if proc is not None and proc.poll() is None:  # a failed assertion above: the stage may still wait at its failpoint
            proc.kill()
            proc.wait()
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)


# -------------------------------------------------------------------------------------------- refusals


def test_a_rerun_with_changed_settings_is_refused_and_changes_nothing(reference, tmp_path):
    from harness.config import load_job
    from harness.stage_settings import PIPELINE, check_settings

    out = tmp_path / "run"
    shutil.copytree(reference, out, ignore=shutil.ignore_patterns("logs"), symlinks=True)
    job = job_file(reference.parent, out, *SETTING, total=TOTAL)
    check_settings(load_job(str(job), []), PIPELINE)  # the records `harness run` keeps (the reference ran in-process)
    before = tree_digest(out)
    done = subprocess.run([sys.executable, "-m", "harness.cli", "run", str(job), "stages.distill.lr=1e-2",
                           "student.options.rope=true"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "stages.distill.lr (0.0001 recorded, 0.01 now)" in done.stderr
    assert "student.options.rope" in done.stderr and "run.accept_changed_settings=true" in done.stderr
    assert tree_digest(out) == before


def test_export_refuses_a_folder_of_notes_and_the_run_itself_and_writes_a_new_folder(reference, tmp_path, capsys):
    from harness.assets import sha256_file
    from harness.cli import main

    checkpoint = sorted((reference / "distill" / "checkpoints").glob("step-*"))[-1]
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "ideas.md").write_text("mine")
    before = tree_digest(reference)
    assert main(["export", str(checkpoint), str(notes)]) == 2
    assert "--force" in capsys.readouterr().err and (notes / "ideas.md").read_text() == "mine"
    assert main(["export", str(checkpoint), str(reference), "--force"]) == 2
    assert "not even with --force" in capsys.readouterr().err and tree_digest(reference) == before
    new = tmp_path / "student"
    assert main(["export", str(checkpoint), str(new)]) == 0
    assert main(["export", str(checkpoint), str(new)]) == 0  # an earlier export is replaced
    exported = json.loads((new / "EXPORT.json").read_text())
    assert exported["step"] == int(checkpoint.name.split("-")[1])
    # two exports of one checkpoint are the same bytes (the stage's own export of its last checkpoint, and this one)
    assert exported["weights_sha256"] == {"model.safetensors": sha256_file(new / "model.safetensors")}
    assert exported["weights_sha256"] == json.loads((reference / "student" / "EXPORT.json").read_text())["weights_sha256"]
    assert same_tensors(new / "model.safetensors", reference / "student" / "model.safetensors")


def test_failpoints_arm_only_the_process_named_and_a_pause_names_its_pid(tmp_path, monkeypatch):
    """HARNESS_FAILPOINTS_ONLY picks one stage among the processes `harness run` starts (all inherit the variables);
    a pause writes its pid where the test that kills it reads it."""
    from harness import failpoints

    monkeypatch.setenv("HARNESS_FAILPOINTS", "checkpoint.saved=enospc,merge.saved=pause")
    monkeypatch.setenv("HARNESS_FAILPOINTS_ONLY", "stage sft")
    monkeypatch.setenv("HARNESS_FAILPOINTS_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["harness/cli.py", "stage", "distill", "job.yaml"])
    failpoints.failpoint("checkpoint.saved")  # not armed in stage 3
    monkeypatch.setattr(sys, "argv", ["harness/cli.py", "stage", "sft", "job.yaml"])
    with pytest.raises(OSError, match="No space left on device"):
        failpoints.failpoint("checkpoint.saved")
    (tmp_path / "merge.saved.continue").touch()  # go on at once
    failpoints.failpoint("merge.saved")
    assert (tmp_path / "merge.saved").read_text() == str(os.getpid())
