"""The kernel bench (`bench_kernels`; CUDA only): for each mixer, one bf16 layer with `backend=kernel` (fla /
mlstm_kernels Triton kernels) against its PyTorch reference (fp32 and bf16) on the same input: output and
gradient errors and the median forward+backward time of each, speedup = reference bf16 ms / kernel ms
(the layer report of docs/KERNELS.md); the same for the recurrence alone
(`recurrence_speedup`: the layer's `_mix` on fixed q, k, v, without the projections that both paths share), and a
profile of the kernel layer (`kernel_profile`: device-busy ms, GPU busy share, aten operators, top operators).
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from harness.bench.machine import GIB, synchronize
from harness.bench.profiling import comm_from_events, profiled, top_ops
from harness.bench.shapes import canonical_shape, shape_config


def layer_shape(shape: str):
    """The MixerShape of a teacher shape's attention (the head layout the mixers keep)."""
    from harness.mixers import MixerShape

    return MixerShape.from_config(shape_config(shape))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def build_layer(name: str, shape, backend: str, dtype: torch.dtype, seed: int = 0, device: str = "cuda"):
    """One mixer layer with new parameters at their init and Q/K/V/O ~ N(0, 1/hidden)."""
    from harness.mixers import mixer_class, mixer_options

    torch.manual_seed(seed)
    layer = mixer_class(name)(shape, mixer_options(name, {"backend": backend}))
    layer.reset_new_parameters()
    with torch.no_grad():  # realistic scale for the copied projections
        for proj in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
            proj.weight.normal_(0, shape.hidden_size**-0.5)
    return layer.to(device, dtype)


def fwd_bwd(layer: nn.Module, x: torch.Tensor):
    x = x.detach().requires_grad_(True)
    y, _ = layer(x)
    y.float().square().mean().backward()
    return y, x.grad


def median_ms(fn: Callable[[], Any], device: torch.device, reps: int = 10, warmup: int = 2) -> float:
    """Median ms of `fn()` over `reps` after `warmup` calls (CUDA events; perf_counter on a CPU)."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def layer_pass(layer: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """forward+backward of the whole layer (projections, recurrence, gates, norms), gradients reset first."""

    def once():
        layer.zero_grad(set_to_none=True)
        fwd_bwd(layer, x)

    return once


def time_fwd_bwd(layer: nn.Module, x: torch.Tensor, reps: int = 10) -> float:
    """Median forward+backward ms of the whole layer."""
    return median_ms(layer_pass(layer, x), x.device, reps)


def recurrence_pass(layer: nn.Module, x: torch.Tensor, backend: str) -> Callable[[], None]:
    """forward+backward of the layer's recurrence alone (`_mix`: its gates, feature maps, normaliser and the
    recurrence itself) on fixed q, k, v from the layer's projections, without projections or output norm."""
    with torch.no_grad():
        q, k, v, _ = layer.project_qkv(x, None, False)
    qkv = [t.detach().contiguous().requires_grad_(True) for t in (q, k, v)]

    def once():
        layer.zero_grad(set_to_none=True)
        for t in qkv:
            t.grad = None
        o, _ = layer._mix(x, *qkv, None, backend)
        o.float().square().mean().backward()

    return once


def profile_pass(fn: Callable[[], Any], device: torch.device, reps: int = 3, n: int = 10) -> dict[str, Any]:
    """torch.profiler over `reps` calls of `fn`: device-kernel busy ms per call (CUDA), aten operators launched,
    and the operators with the most self device time (self CPU time on a CPU)."""
    cuda = device.type == "cuda"
    fn()
    synchronize(device)
    prof = profiled(lambda _: fn(), device, reps)
    ops = top_ops(prof.key_averages(), reps, n)
    key, by = ("self_device_ms", "by_self_device") if cuda else ("self_cpu_ms", "by_self_cpu")
    out = {"aten_calls": ops["aten_calls_per_step"],
           "top_ops": [{"name": r["name"][:90], "calls": r["calls"], "ms": round(r[key], 4)} for r in ops[by]],
           "top_ops_by": key}
    if cuda:
        out["device_busy_ms"] = comm_from_events(prof.events(), True, reps)["compute_kernel_ms"]
    return out


def compare_layer(name: str, layout: str, batch: int, seq: int, reference_reps: int = 3, *,
                  backend: str = "kernel", device: str = "cuda", profile: bool = True) -> dict[str, Any]:
    """Kernel (bf16) vs reference (fp32 oracle, and bf16 floor) for one mixer at one head layout, on CUDA: the
    whole layer's errors and times, the recurrence's times alone (`recurrence_pass`), and with `profile` where
    the kernel layer's time goes (`profile_pass`). (`backend`/`device` exist for the CPU test of this code:
    backend=reference, device=cpu.)"""
    shape = layer_shape(layout)
    kernel = build_layer(name, shape, backend, torch.bfloat16, device=device)
    ref = build_layer(name, shape, "reference", torch.float32, device=device)
    ref.load_state_dict({k: v.float() for k, v in kernel.state_dict().items()})
    torch.manual_seed(1)
    x = torch.randn(batch, seq, shape.hidden_size, device=device, dtype=torch.bfloat16)
    t0 = time.time()
    yk, gxk = fwd_bwd(kernel, x)
    first_call_s = time.time() - t0
    yr, gxr = fwd_bwd(ref, x.float())
    grads = {n: rel(p.grad, dict(ref.named_parameters())[n].grad)
             for n, p in kernel.named_parameters() if p.grad is not None}
    row = {
        "mixer": name, "layout": layout, "batch": batch, "seq": seq,
        "out_rel_err": rel(yk, yr), "dx_rel_err": rel(gxk, gxr),
        "max_param_grad_rel_err": max(grads.values()), "worst_param": max(grads, key=grads.get),
        "kernel_first_call_s": first_call_s,
    }
    ref_bf16 = build_layer(name, shape, "reference", torch.bfloat16, device=device)
    ref_bf16.load_state_dict(kernel.state_dict())
    yb, gxb = fwd_bwd(ref_bf16, x)  # the bf16 floor: the PyTorch reference run on bf16 weights and inputs
    row["ref_bf16_out_rel_err"], row["ref_bf16_dx_rel_err"] = rel(yb, yr), rel(gxb, gxr)
    del yr, gxr, yb, gxb
    row["kernel_ms"] = time_fwd_bwd(kernel, x)
    row["reference_bf16_ms"] = time_fwd_bwd(ref_bf16, x, reps=reference_reps)
    row["speedup"] = row["reference_bf16_ms"] / row["kernel_ms"]
    dev = torch.device(device)
    row["recurrence_kernel_ms"] = median_ms(recurrence_pass(kernel, x, backend), dev)
    row["recurrence_reference_ms"] = median_ms(recurrence_pass(ref_bf16, x, "reference"), dev, reference_reps)
    row["recurrence_speedup"] = row["recurrence_reference_ms"] / row["recurrence_kernel_ms"]
    if profile:
        prof = profile_pass(layer_pass(kernel, x), dev)
        if "device_busy_ms" in prof:  # below 1: the host, not the GPU, sets the layer's time
            prof["gpu_busy"] = prof["device_busy_ms"] / row["kernel_ms"]
        row["kernel_profile"] = prof
    if torch.device(device).type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / GIB
    return row


def bench_kernels(layouts: Sequence[str] = ("1.7B",), mixers: Optional[Sequence[str]] = None, *, batch: int = 8,
                  seq: int = 2048, variants: Sequence[str] = (), max_seconds: float = 1e9,
                  on_row: Optional[Callable[[dict], None]] = None) -> list[dict[str, Any]]:
    """`compare_layer` for every mixer (and NAME@CASE=ROUTE variant, run with $HARNESS_FLA_ROUTES set) at each
    layout; one failing row is recorded with its error and does not stop the others. CUDA only."""
    from harness.mixers import MIXERS

    if not torch.cuda.is_available():
        raise RuntimeError("the kernel bench needs CUDA: the fla / mlstm_kernels kernels are Triton (GPU only)")
    began = time.time()
    mixers = list(mixers or MIXERS)
    layouts = [canonical_shape(x) for x in layouts]
    plan = [(layouts[0], spec) for spec in [*mixers, *filter(None, variants)]]
    plan += [(layout, spec) for layout in layouts[1:] for spec in mixers]
    rows: list[dict[str, Any]] = []
    saved_routes = os.environ.get("HARNESS_FLA_ROUTES")
    try:
        for layout, spec in plan:
            if time.time() - began > max_seconds:
                row = {"mixer": spec, "layout": layout, "error": "not run: --max-seconds reached"}
            else:
                name, _, routes = spec.partition("@")
                os.environ["HARNESS_FLA_ROUTES"] = routes
                torch.cuda.reset_peak_memory_stats()
                try:
                    row = compare_layer(name, layout, batch, seq)
                except Exception as err:  # noqa: BLE001 - one failing mixer must not hide the others
                    row = {"layout": layout, "error": f"{type(err).__name__}: {err}",
                           "trace": traceback.format_exc(limit=6)}
                row["mixer"] = spec
                torch.cuda.empty_cache()
            rows.append(row)
            if on_row is not None:
                on_row(row)
    finally:
        if saved_routes is None:
            os.environ.pop("HARNESS_FLA_ROUTES", None)
        else:
            os.environ["HARNESS_FLA_ROUTES"] = saved_routes
    return rows
