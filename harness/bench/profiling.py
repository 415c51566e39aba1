"""torch.profiler passes and what the bench reads from them: communication per step (busy and exposed time) and
the operators with the most host and device time."""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import torch

from harness.bench.machine import synchronize

COMM_PATTERN = re.compile(r"nccl|gloo|c10d::|all_?gather|reduce_?scatter|all_?reduce|broadcast|record_param_comms",
                          re.IGNORECASE)


def _union_us(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of the (merged, sorted) intervals `a` not covered by the merged, sorted `b`."""
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def comm_from_events(events: Iterable[Any], cuda: bool, steps: int) -> dict[str, Any]:
    """Communication per step from profiler events (FunctionEvent-like: name, device_type, time_range).

    CUDA: comm = union of NCCL kernels; compute = union of the other device kernels; exposed = comm not covered
    by compute. CPU: comm = union of c10d / gloo / collective ops (no compute/comm overlap is measured there).
    """
    from torch.autograd import DeviceType

    comm, compute = [], []
    for e in events:
        rng = getattr(e, "time_range", None)
        if rng is None:
            continue
        on_device = getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU
        if cuda and not on_device:
            continue
        if not cuda and on_device:
            continue
        is_comm = ("nccl" in e.name.lower()) if cuda else bool(COMM_PATTERN.search(e.name))
        (comm if is_comm else compute).append((float(rng.start), float(rng.end)))
    comm_u = _union_us(comm)
    steps = max(steps, 1)
    out: dict[str, Any] = {"comm_ms": _length(comm_u) / 1e3 / steps, "comm_events": len(comm)}
    if cuda:
        compute_u = _union_us(compute)
        out["compute_kernel_ms"] = _length(compute_u) / 1e3 / steps
        out["exposed_ms"] = _length(_subtract(comm_u, compute_u)) / 1e3 / steps
        out["method"] = ("torch.profiler: union of NCCL kernel intervals per step (comm_ms), of other kernels "
                         "(compute_kernel_ms), and NCCL time with no other kernel running (exposed_ms)")
    else:
        out["method"] = "torch.profiler: union of c10d/gloo collective op intervals on the CPU per step"
    return out


def top_ops(averages: Iterable[Any], steps: int, n: int = 25) -> dict[str, Any]:
    """Where a profiled step's host and device time go, per step: the operators (and DeepSpeed / module hooks
    named by record_function) with the most self CPU time and the most self device time, and how many operators
    the host launched (a step whose kernels leave the GPU idle is bound by that count times the per-op cost)."""
    steps = max(steps, 1)
    rows = []
    for a in averages:
        dev_us = float(getattr(a, "self_device_time_total", 0.0) or getattr(a, "self_cuda_time_total", 0.0) or 0.0)
        rows.append({"name": a.key, "calls": a.count / steps, "self_cpu_ms": a.self_cpu_time_total / 1e3 / steps,
                     "self_device_ms": dev_us / 1e3 / steps})
    aten = [r for r in rows if r["name"].startswith("aten::")]
    return {
        "aten_calls_per_step": sum(r["calls"] for r in aten),
        "self_cpu_ms_per_step": sum(r["self_cpu_ms"] for r in rows),
        "by_self_cpu": sorted(rows, key=lambda r: -r["self_cpu_ms"])[:n],
        "by_self_device": sorted(rows, key=lambda r: -r["self_device_ms"])[:n],
    }


def profiled(fn: Callable[[int], Any], device: torch.device, reps: int):
    """torch.profiler (CPU, and CUDA on a GPU) over `fn(0) .. fn(reps - 1)`, synchronised at the end."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(reps):
            fn(i)
        synchronize(device)
    return prof
