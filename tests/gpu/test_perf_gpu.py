"""On CUDA: the throughput harness itself (parameter counts, the FLOP formula and MFU, the chain of CUDA-event
phases against wall time, CUDA peak memory, the profiler's communication measure under ZeRO-3, decoding) and
the chunked stage-3 loss against a direct fp32 computation where tests/gpu/test_losses_gpu.py does not look
(fp32 inputs with a loss mask, weights, temperature and a scaled backward; bf16 heads over several vocabulary
blocks, through stage 3's LossHead). Skipped without CUDA.

Mixers run with backend=reference here so that no Triton kernel compiles (the harness is under test, not the
kernels; `harness bench --what kernels` measures those).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("GPU perf tests need CUDA", allow_module_level=True)

from harness import flops  # noqa: E402
from harness.bench.decode import bench_decode  # noqa: E402
from harness.bench.phases import PHASES, PhaseClock  # noqa: E402
from harness.bench.shapes import build_pair, count_params, llama_param_count, shape_config  # noqa: E402
from harness.bench.step import bench_step  # noqa: E402
from harness.losses import VOCAB_BLOCK, distill_loss, kl_and_ce, tf32_matmuls  # noqa: E402
from tests.gpu.test_losses_gpu import loss_inputs  # noqa: E402
from tests.test_losses import direct_distill  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DEV = torch.device("cuda")
REF = {"backend": "reference"}


def _check_row(row: dict, peak: float) -> None:
    assert row["dtype"] == "bfloat16" and row["device"].startswith("cuda")
    assert row["flops_per_token"] == 6 * row["n_student"] + 2 * row["n_teacher"]
    assert row["tokens_per_step"] == row["micro_batch"] * row["seq_len"] * row["grad_accum"] * row["world"]
    assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / (row["step_ms"] / 1e3), rel=1e-6)
    assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / (peak * row["world"]))
    measured = row["measured_peak_flops_per_device"]  # MEASURED_PEAK_FLOPS for an H200, else measured now
    assert measured > 0 and row["mfu_measured_peak"] == pytest.approx(
        row["tokens_per_s"] * row["flops_per_token"] / (measured * row["world"]))
    # CUDA events chained through the step add up to the host's wall time per step
    assert row["breakdown_sum_ms"] == pytest.approx(row["step_ms"], rel=0.05)
    assert set(row["breakdown_ms"]) == set(PHASES)
    assert row["peak_mem_kind"].startswith("torch.cuda") and row["peak_mem_bytes"] > 0


def test_plain_step_bench_counts_flops_and_memory(monkeypatch):
    monkeypatch.delenv("HARNESS_PEAK_FLOPS", raising=False)
    kw = dict(layers=2, options=REF)
    row = bench_step("135M", "linear_attn", micro_batch=2, seq_len=256, steps=3, warmup=1, device="cuda",
                     zero3=False, **kw)
    name = torch.cuda.get_device_name()
    datasheet = flops.datasheet_peak(name)  # 989e12 on an H200
    if datasheet is None:  # a GPU not in the table: no mfu, and the source names it
        assert row["mfu"] is None and repr(name) in row["peak_flops_source"]
    else:
        _check_row(row, datasheet)
        assert "datasheet" in row["peak_flops_source"]
    teacher, student = build_pair("135M", "linear_attn", device="cuda", **kw)
    assert row["n_teacher"] == count_params(teacher) == llama_param_count(shape_config("135M", 2))
    assert row["n_student"] == count_params(student)
    assert row["n_student"] == row["n_teacher"] + 2 * 2 * 576 * (576 - 192)  # k, v expanded from 3 to 9 heads
    # fp32 student (weights, grads, 2 Adam moments) + bf16 teacher are resident during the steps
    assert row["peak_mem_bytes"] > 16 * row["n_student"] + 2 * row["n_teacher"]


def test_zero3_step_bench_and_profiler_pass(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "harness.bench", "--shape", "135M", "--layers", "2", "--mixer", "linear_attn",
           "--option", "backend=reference", "--micro-batch", "2", "--seq", "256", "--steps", "3", "--warmup", "1",
           "--peak-flops", "5e14", "--profile-steps", "2", "--out", str(out)]
    # the repository first, then what the machine's PYTHONPATH holds (the GPU image's device bundle)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))}
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(out.read_text())
    assert res["meta"]["gpu"] == torch.cuda.get_device_name()
    (row,) = res["step"]
    _check_row(row, 5e14)  # --peak-flops overrides the datasheet figure
    assert row["peak_flops_source"] == "--peak-flops"
    assert row["engine"] == "zero3" and "mem_after_build_gib" in row
    comm = row["comm"]
    assert "error" not in comm, comm
    # the profiler's device events were read: compute kernels exist, exposed comm is part of comm
    assert comm["compute_kernel_ms"] > 0
    assert 0 <= comm["exposed_ms"] <= comm["comm_ms"] + 1e-9


def test_phase_clock_on_cuda_matches_wall_time():
    clock = PhaseClock(DEV)
    a = torch.randn(2048, 2048, device=DEV)
    torch.cuda.synchronize()
    clock.start()
    t0 = time.perf_counter()
    for _ in range(3):
        for _ in range(5):
            a = (a @ a).tanh()
        clock.mark("student_forward")
        time.sleep(0.005)  # host time shows as a gap on the stream (less what the GPU still had queued)
        clock.mark("other")
        clock.step_done()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    steps = clock.steps()
    assert len(steps) == 3 and all(s["student_forward"] > 0 and s["other"] > 0.5 for s in steps)
    assert sum(sum(s.values()) for s in steps) == pytest.approx(wall, rel=0.05, abs=1.0)


def test_matmul_peak_is_plausible():
    peak = flops.measure_matmul_peak(DEV, torch.bfloat16, n=4096, reps=5)
    assert 1e13 < peak < 5e15


def test_decode_bench_on_gpu():
    res = bench_decode("135M", "linear_attn", contexts=(256, 1024), new_tokens=8, warmup_tokens=2,
                       layers=2, options=REF, device="cuda")
    small, large = res["rows"]
    assert small["student"]["ms_per_token"] > 0 and large["teacher"]["ms_per_token"] > 0
    assert small["student"]["state_bytes"] == large["student"]["state_bytes"]
    assert large["teacher"]["state_bytes"] > small["teacher"]["state_bytes"]
    assert res["student_flatness"] is not None and res["teacher_flatness"] is not None


# ------------------------------------------------------------------------------ chunked loss vs direct fp32


def test_fp32_chunked_loss_with_mask_weights_and_scaled_backward():
    """fp32 inputs (no rounding floor): a loss mask, unequal weights, tau=2, a chunk that does not divide the
    token count, and a backward of 0.25 x total (grad_accum-style scaling) all match the direct loss."""
    hs, ht, ws, wt, labels = loss_inputs(2, 300, 256, 4000, torch.float32, ignored_prefix=False)
    labels[0, :37] = -100
    mask = torch.rand(labels.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)) > 0.3
    kw = dict(ce_weight=0.5, kl_weight=2.0, temperature=2.0)
    with tf32_matmuls(False):
        out = distill_loss(hs, ht, ws, wt, labels, chunk_tokens=100, loss_mask=mask, **kw)
        got = torch.autograd.grad(0.25 * out.total, (hs, ws))
        ref_total, ref_ce, ref_kl = direct_distill(hs, ht, ws, wt, labels, loss_mask=mask, **kw)
        want = torch.autograd.grad(0.25 * ref_total, (hs, ws))
    keep = (labels[:, 1:] != -100) & mask[:, 1:]
    assert out.tokens == int(keep.sum())
    for a, b in [(out.total, ref_total), (out.ce, ref_ce), (out.kl, ref_kl)]:
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_loss_head_with_bf16_heads_over_several_vocab_blocks():
    """Stage 3's LossHead with bf16 heads wider than VOCAB_BLOCK (upcast block by block, last block partial)
    against the direct fp32 loss (test_losses_gpu uses V = one block)."""
    from harness.stages.distill import LossHead

    v = 2 * VOCAB_BLOCK + 1234
    hs, ht, ws, wt, labels = loss_inputs(2, 256, 256, v, torch.bfloat16, seed=1, ignored_prefix=False)
    head = LossHead(torch.nn.Parameter(ws.detach().clone()), kl_and_ce(ce_weight=1.0, kl_weight=1.0, temperature=1.0))
    out = head(hs, ht, wt, labels)
    out.total.backward()
    with tf32_matmuls(False):
        ref_total, ref_ce, ref_kl = direct_distill(hs, ht, ws, wt, labels, ce_weight=1.0, kl_weight=1.0,
                                                   temperature=1.0)
        want_dx, want_dw = torch.autograd.grad(ref_total, (hs, ws))
    for a, b in [(out.total, ref_total), (out.ce, ref_ce), (out.kl, ref_kl)]:
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-3, atol=1e-5)
    for a, b in [(hs.grad, want_dx), (head.weight.grad, want_dw)]:
        err = (a.float() - b.float()).norm() / b.float().norm()
        assert err < 1e-2, err
