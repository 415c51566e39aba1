"""Stage 3 on one GPU through NCCL, as `harness run` starts it for deepspeed.world_size 1 (one plain process, its
one-process group on an in-memory store): train, validate, checkpoint, export; then a preemption request
checkpoints, exits for requeue (85) and resumes; under both student engines (deepspeed.student_engine: DeepSpeed,
and the plain one with bf16 weights and fp32 masters). Skipped without CUDA. NCCL reduces only device tensors, so this
catches host tensors handed to a collective (the loss sums, the preemption flag), which gloo on the CPU accepts:
stage 3 failed at its first step on the H200 for that reason.

    source .devbundle/setup.sh && python3 -m pytest -q tests/gpu/test_stages_one_gpu.py
"""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from harness.preempt import REQUEUE_EXIT  # noqa: E402
from tests.gpu.test_distill_two_gpus import GPU, run_stage3  # noqa: E402
from tests.test_distill import losses, write_job  # noqa: E402


def metric_rows(out):
    return [json.loads(line) for line in (out / "distill" / "metrics.jsonl").read_text().splitlines()]


ENGINES = pytest.mark.parametrize("engine", ["deepspeed", "plain"])


@ENGINES
def test_stage3_on_one_gpu_trains_validates_and_exports(tmp_path, engine):
    out = tmp_path / "one"
    run_stage3(write_job(tmp_path, out, *GPU, "deepspeed.world_size=1", f"deepspeed.student_engine={engine}"), 1,
               torchrun=False)
    a = losses(out)
    assert len(a) >= 5 and a[max(a)] < a[min(a)]
    assert any("val_ce" in r for r in metric_rows(out))
    assert (out / "student" / "model.safetensors").exists()


@ENGINES
def test_preemption_on_one_gpu_checkpoints_exits_for_requeue_and_resumes(tmp_path, monkeypatch, engine):
    whole, out = tmp_path / "whole", tmp_path / "preempted"
    settings = (*GPU, "deepspeed.world_size=1", f"deepspeed.student_engine={engine}")
    run_stage3(write_job(tmp_path, whole, *settings), 1, torchrun=False)
    job_path = write_job(tmp_path, out, *settings)
    flag = tmp_path / "preempt-flag"
    flag.touch()
    monkeypatch.setenv("HARNESS_PREEMPT_FILE", str(flag))
    run_stage3(job_path, 1, expect=REQUEUE_EXIT, torchrun=False)
    assert [p.name for p in (out / "distill" / "checkpoints").glob("step-*")] == ["step-00000001"]
    flag.unlink()
    run_stage3(job_path, 1, torchrun=False)
    a, b = losses(whole), losses(out)
    assert a.keys() == b.keys()
    for step in a:  # GPU kernels are not bitwise deterministic across processes
        assert b[step] == pytest.approx(a[step], rel=1e-2), (step, a[step], b[step])
