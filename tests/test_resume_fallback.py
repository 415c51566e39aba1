"""Resuming past a broken checkpoint, at the stage level (issue 49): a newest checkpoint corrupted without changing
its size (bytes flipped in the middle of DeepSpeed's optim_states.pt) is skipped by its sha256; one that sha256
cannot fault but that fails to load (its manifest rewritten to match a broken file) is moved aside to bad-step-*.
Either way the stage resumes from the previous checkpoint and ends exactly like an uninterrupted run: stage 3
under DeepSpeed in subprocesses, stages 1-2 in this process. The unit tests are in tests/test_checkpoint.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.checkpoint import CheckpointWarning
from harness.export import TAG
from harness.stages.align import WEIGHTS, align_group
from harness.stages.common import group_dir
from tests.pipeline import tiny_job
from tests.test_checkpoint import _break_and_rehash, _flip_middle
from tests.test_distill import REPO, launch, losses, student_weights, write_job

OPTIM = f"{TAG}/zero_pp_rank_0_mp_rank_00_optim_states.pt"  # the file of the report


def _stop_after(job_path: Path, steps: int) -> None:
    """Stage 3 in a subprocess that returns after `steps` optimizer steps, without a final checkpoint (a crash)."""
    code = ("from harness.config import load_job\nfrom harness.stages.distill import distill\n"
            f"distill(load_job({str(job_path)!r}, []), stop_after_steps={steps})")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_stage3_resumes_past_corrupt_checkpoints_and_ends_as_uninterrupted(tmp_path):
    """Checkpoints at steps 2, 4, 6: step 6 corrupt at the same size (skipped by sha256), step 4 broken under a
    matching digest (fails to load, moved aside): the rerun resumes from step 2 and ends as the uninterrupted run."""
    extra = ["run.checkpoint_every_tokens=128", "run.keep_last=3"]  # 64 tokens per step: checkpoints at 2, 4, 6
    whole = tmp_path / "whole"
    launch(write_job(tmp_path, whole, *extra))

    broken = tmp_path / "broken"
    job_path = write_job(tmp_path, broken, *extra)
    _stop_after(job_path, 7)
    ckpts = broken / "distill" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-00000002", "step-00000004", "step-00000006"]
    _flip_middle(ckpts / "step-00000006" / OPTIM)
    _break_and_rehash(ckpts / "step-00000004", OPTIM)
    output = launch(job_path)
    assert f"skipping checkpoint {ckpts / 'step-00000006'}: {OPTIM} does not match its sha256" in output, output[-3000:]
    assert f"checkpoint {ckpts / 'step-00000004'} passed its checks but failed to load" in output, output[-3000:]
    assert len(list(ckpts.glob("bad-step-00000004-*"))) == 1  # kept for inspection; steps 4.. were saved anew
    assert losses(broken) == losses(whole)
    a, b = student_weights(broken), student_weights(whole)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _weights(job) -> dict[str, torch.Tensor]:
    return load_file(group_dir(job, "align_mixer", [0, 1]) / WEIGHTS)


@pytest.mark.parametrize("break_it", ["flip", "rehash"])
def test_stage1_group_resumes_past_a_corrupt_newest_checkpoint(tmp_path, break_it):
    def job(name: str):
        return tiny_job(tmp_path / "setting", tmp_path / name, "run.checkpoint_every_tokens=128", "run.keep_last=3")

    align_group(job("whole"), "align_mixer", [0, 1])
    broken = job("broken")
    gdir = align_group(broken, "align_mixer", [0, 1], stop_after_steps=5)  # checkpoints at steps 2 and 4
    newest = gdir / "checkpoints" / "step-00000004"
    if break_it == "flip":
        _flip_middle(newest / "state.pt")
        expected = r"skipping checkpoint \S*step-00000004: state\.pt does not match its sha256"
    else:
        _break_and_rehash(newest, "state.pt")
        expected = r"step-00000004 passed its checks but failed to load \(RuntimeError: .*\); it moved aside"
    with pytest.warns(CheckpointWarning, match=expected):
        align_group(broken, "align_mixer", [0, 1])
    a, b = _weights(broken), _weights(job("whole"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(list((gdir / "checkpoints").glob("bad-step-*"))) == (break_it == "rehash")


def test_a_zero_checkpoint_of_another_world_size_is_a_configuration_error_not_a_bad_checkpoint(tmp_path):
    """DeepSpeed cannot split ZeRO optimizer states anew: a checkpoint of 2 processes, resumed by 1, raises
    ConfigError naming both, and stays where it is (no fallback past a good checkpoint)."""
    import json

    from harness.checkpoint import CheckpointManager
    from harness.config import ConfigError
    from harness.stages.common import resume_checkpoint

    class ZeroEngine:  # the part of DeepSpeed's engine that the check reads
        def zero_optimization(self) -> bool:
            return True

        def load_checkpoint(self, *args, **kwargs):
            raise AssertionError("not reached")

    mgr = CheckpointManager(tmp_path, keep_last=2)
    mgr.save(1, 64, lambda d: (d / "data.json").write_text("{}"), collective=False)
    manifest = tmp_path / "step-00000001" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "world_size": 2}))
    with pytest.raises(ConfigError, match=r"written by 2 process\(es\) and this run has 1: DeepSpeed cannot split"):
        resume_checkpoint(mgr, ZeroEngine(), loader=None)
    assert [s for s, _ in mgr.step_dirs()] == [1]
