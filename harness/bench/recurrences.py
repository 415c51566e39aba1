"""The recurrence bench: GPU kernels vs the PyTorch reference, for every recurrence case of docs/RECURRENCES.md:
relative errors of outputs, final states and input gradients, and forward(+backward) times, for each fla route
of a case. Needs CUDA, fla and mlstm_kernels. A case is a registered mixer that declares its `kernel_case`
(harness.mixers.kernel_case: its route and its inputs), named after the mixer.

    harness bench --what recurrences --shape 135M,1.7B --mixer all --kernel-batch 4 --seq 2048 --out DIR/bench.json
    python -m harness.bench.recurrences --out DIR [--shapes smollm2-135m,smollm2-1.7b] [--cases all]
        [--B 4] [--T 2048] [--variants all|auto] [--reps 10] [--max-seconds 540]

Writes DIR/kernel_report.json (rewritten after every measurement, so a killed run keeps what it did) and
DIR/kernel_report.md. One process: triton compiles and autotunes each kernel once per head layout (the first
call of a case can take a minute). A failing measurement is recorded with its error; the others go on.

The kernel runs on bf16 q, k, v (gates and states float32, as the layers pass them); the reference runs in
float32 on the same values upcast, so the errors measure the kernel's own rounding.
This module is also the case library of tests/gpu/test_kernels.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from harness.bench.kernels import median_ms
from harness.mixers import MIXERS, KernelCase, kernels, recurrence
from harness.mixers.fox import forgetting_attention
from harness.mixers.path import path_attention

CUDA = torch.device("cuda")

SHAPES = {  # SmolLM2 attention head layouts (the student keeps the teacher's query heads)
    "smollm2-135m": dict(H=9, K=64, V=64),
    "smollm2-360m": dict(H=15, K=64, V=64),
    "smollm2-1.7b": dict(H=32, K=64, V=64),
}


def kernel_cases() -> dict[str, KernelCase]:
    """mixer name -> its kernel case, for every registered mixer that declares one (the cases, named after their
    mixers). Its `variants` are the routes measured: "auto", what kernel_gated_delta / kernel_mlstm pick, and the
    alternative fla routes for the same recurrence (fallbacks if "auto" turns out wrong or slow on a machine)."""
    return {name: cls.kernel_case for name, cls in MIXERS.items() if cls.kernel_case is not None}


# Relative-error limits ||kernel - ref|| / ||ref||. bf16 has a 2^-8 = 3.9e-3 relative step; fla keeps
# intermediate chunk states and the WY / intra-chunk factors in bf16 and accumulates in fp32, so outputs and
# states land at a few 1e-3 (fla's own tests allow 5e-3 .. 1e-2 against fp32 references at T <= 2048).
# Gradients pass through more bf16 round trips (dh states, dv) -> 2e-2. Gate gradients (dg, dbeta, di, df)
# are reductions over K of products of q*dq - k*dk with cancellation and reverse cumulative sums over T, so
# their relative error is larger -> 4e-2. A case may widen them (`KernelCase.tolerances`). The mLSTM's:
# mlstm_kernels (chunkwise--triton_limit_chunk) at T = 2048, H200, three seeds: h 0.79-1.1e-2, df 4.0-4.3e-2 (all
# else <= 8.5e-3). Not input rounding: the same kernel on fp32 inputs is no closer (h 1.2-1.6e-2, dq 2.4-4.3e-2), so it
# is the kernel's own arithmetic; h divides by the normaliser max(|q.n|, exp(-m)), which magnifies it where that is
# small. Behind the layer's per-head norm the kernel stays within 2x the bf16 floor (tests/gpu/test_mixer_layers.py,
# docs/KERNELS.md), so those limits document the raw kernel, not a defect.
TOL = {"out": 1e-2, "state": 1e-2, "grad": 2e-2, "gate_grad": 4e-2}
GATE_NAMES = ("g", "beta", "i", "f", "s")
DPLR_DECAY_FLOOR = -math.exp(-0.5)  # a gate rwkv7 case's g >= this (RWKV-7's bound, fla's lower_bound)
PRODUCT_STEPS = 2  # Householder steps per token of a gated_delta_product case (the deltaproduct mixer's default)
GSA_SLOTS = 64  # slots per head of a gsa case (the gsa mixer's default num_slots)


def tol_for(name: str, case: Optional[str] = None) -> float:
    tol = {**TOL, **(kernel_cases()[case].tolerances if case in kernel_cases() else {})}
    if name in ("o", "h"):
        return tol["out"]
    if name.startswith("state"):
        return tol["state"]
    if name.startswith("d") and name[1:] in GATE_NAMES:
        return tol["gate_grad"]
    return tol["grad"]


# ---------------------------------------------------------------------------------------------- inputs
def make_inputs(case: str, B: int, T: int, H: int, K: int, V: int, *, device="cuda", seed: int = 0,
                with_state: bool = False, dtype=torch.bfloat16) -> dict:
    """Leaf tensors for one case (a mixer with a kernel case) with realistic distributions, as its
    `KernelCase` says (see the mixer layers): features elu1: q, k = elu + 1 (scale 1, linear attention's default
    with its normaliser); raw: q, k ~ N(0, 1) (scale K^-0.5); l2: L2-normalised q, k; beta = sigmoid(N(0, 1));
    gate head: g = -exp(A) * softplus(x + dt_bias) (Gated DeltaNet: A ~ U(0, 16), dt ~ LogU(1e-3, 0.1),
    x ~ N(0, 0.5^2)); channel: g = logsigmoid(N(0, 1)) / 16 (GLA); head_const: g = log(1 - 2^(-5-h)) as an
    expanded constant (RetNet); ssd: k scaled by dt and g = -A dt (Mamba2's A ~ U(1, 16), dt as Gated DeltaNet's;
    scale 1); features softmax_pair: q, k = [softmax(x), softmax(-x)] of x ~ N(0, 1) `[..., K]`, so the key dim
    is 2K (scale 1, hedgehog's feature map); mLSTM i = 15 tanh((2 N - 3) / 15), f = 15 tanh((N + 4.5) / 15);
    gate slot (gsa): g = logsigmoid(N(0, 1)) / 8 and s = 1 - exp(g) `[B, T, H, GSA_SLOTS]`, two leaves as the
    kernel takes them, and states (hk `[B, H, K, M]`, hv `[B, H, M, V]`);
    dplr_delta (RWKV-7): a = -kk, b = kk * sigmoid(N(0, 1)) per channel, kk L2-normalised N(0, 1), and gate rwkv7:
    g = -exp(-0.5) sigmoid(N(0, 1)) per channel; forgetting_attn (fox) with gate forget: g = logsigmoid(N(0, 1) +
    b_h) per head, b_h from 0 to 8 over the heads (local heads and heads that hardly forget), and no state
    (`with_state` is ignored: softmax attention decodes from a KV cache, not a state); path_attn (path): w
    L2-normalised N(0, 1) and beta = 2 sigmoid(N(0, 1)) in (0, 2), float32 as fla asks, no gate and no state."""
    spec = kernel_cases()[case]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    if spec.features == "softmax_pair":
        K = 2 * K  # the feature map's [softmax, softmax] of a K-dim map

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(device)

    def leaf(x, dt):
        return x.to(dt).detach().requires_grad_(True)

    steps = (PRODUCT_STEPS,) if spec.recurrence == "gated_delta_product" else ()  # keys, values, beta
    q, k, v = randn(B, T, H, K), randn(B, T, *steps, H, K), randn(B, T, *steps, H, V)
    x = dict(case=case, recurrence=spec.recurrence, g=None, beta=None, scale=K ** -0.5)
    if spec.features == "elu1":
        q, k = F.elu(q) + 1, F.elu(k) + 1
        x["scale"] = 1.0
    elif spec.features == "softmax_pair":
        q, k = (torch.cat([t[..., :K // 2].softmax(-1), (-t[..., :K // 2]).softmax(-1)], -1) for t in (q, k))
        x["scale"] = 1.0
    elif spec.features == "l2":
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    x["q"], x["k"], x["v"] = leaf(q, dtype), leaf(k, dtype), leaf(v, dtype)
    if spec.gate == "head_const":
        heads = torch.arange(H, dtype=torch.float32, device=device)
        x["g"] = torch.log1p(-torch.pow(2.0, -5.0 - heads)).expand(B, T, H)  # constant, no grad
    elif spec.gate == "head":
        A = torch.rand(H, generator=gen).to(device) * 16
        dt = torch.exp(torch.rand(H, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).to(device)
        dt_bias = dt + torch.log(-torch.expm1(-dt))
        x["g"] = leaf(-A * F.softplus(randn(B, T, H, std=0.5) + dt_bias), torch.float32)
    elif spec.gate == "ssd":  # Mamba2: the input's dt folded into B (k), no q.k scale, as the layer passes them
        A = 1.0 + torch.rand(H, generator=gen).to(device) * 15
        dt = torch.exp(torch.rand(H, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).to(device)
        dt = F.softplus(randn(B, T, H, std=0.5) + dt + torch.log(-torch.expm1(-dt)))
        x["g"] = leaf(-A * dt, torch.float32)
        x["k"] = leaf(k * dt.unsqueeze(-1), dtype)
        x["scale"] = 1.0
    elif spec.gate == "channel":
        x["g"] = leaf(F.logsigmoid(randn(B, T, H, K)) / 16, torch.float32)
    elif spec.gate == "slot":
        g = F.logsigmoid(randn(B, T, H, GSA_SLOTS)) / 8
        x["g"], x["s"] = leaf(g, torch.float32), leaf(-torch.expm1(g), dtype)
    elif spec.gate == "rwkv7":
        x["g"] = leaf(DPLR_DECAY_FLOOR * torch.sigmoid(randn(B, T, H, K)), torch.float32)
    elif spec.gate == "forget":
        x["g"] = leaf(F.logsigmoid(randn(B, T, H) + torch.linspace(0, 8, H, device=device)), torch.float32)
    if spec.beta:
        x["beta"] = leaf(torch.sigmoid(randn(B, T, *steps, H)), torch.float32)
    if spec.recurrence == "path_attn":
        x["w"] = leaf(F.normalize(randn(B, T, H, K), dim=-1), torch.float32)
        x["beta"] = leaf(2 * torch.sigmoid(randn(B, T, H)), torch.float32)
    if spec.recurrence == "dplr_delta":
        removal = F.normalize(randn(B, T, H, K), dim=-1)
        x["a"], x["b"] = leaf(-removal, dtype), leaf(removal * torch.sigmoid(randn(B, T, H, K)), dtype)
    if spec.recurrence == "mlstm":
        x["i"] = leaf(15 * torch.tanh((2 * randn(B, T, H) - 3) / 15), torch.float32)
        x["f"] = leaf(15 * torch.tanh((randn(B, T, H) + 4.5) / 15), torch.float32)
    x["h0"] = None
    if with_state and spec.stateful:
        if spec.recurrence == "gsa":
            x["h0"] = (leaf(randn(B, H, K, GSA_SLOTS), torch.float32), leaf(randn(B, H, GSA_SLOTS, V), torch.float32))
        elif spec.recurrence == "mlstm":
            x["h0"] = (leaf(randn(B, H, K, V), torch.float32), leaf(randn(B, H, K), torch.float32),
                       leaf(randn(B, H), torch.float32))
        else:
            x["h0"] = leaf(randn(B, H, K, V), torch.float32)
    # cotangents for the backward pass: on the output and on the final state (C only for the mLSTM)
    x["do"] = randn(B, T, H, V)
    x["dS"] = ((randn(B, H, K, GSA_SLOTS), randn(B, H, GSA_SLOTS, V)) if spec.recurrence == "gsa"
               else randn(B, H, K, V) if spec.stateful else None)
    return x


def grad_inputs(x: dict) -> dict:
    """name -> tensor for every input that takes a gradient."""
    out = {n: x[n] for n in ("q", "k", "v", "w", "a", "b", "g", "beta", "i", "f", "s")
           if isinstance(x.get(n), torch.Tensor) and x[n].requires_grad}
    h0 = x.get("h0")
    if isinstance(h0, torch.Tensor):
        out["h0"] = h0
    elif h0 is not None and x["recurrence"] == "gsa":
        out["hk0"], out["hv0"] = h0
    elif h0 is not None:
        out["C0"] = h0[0]  # the kernel's backward gives n0 and m0 zero gradients (documented)
    return out


def upcast(x: dict) -> dict:
    """A float32 copy of the inputs, detached, new leaves (for the reference)."""
    y = dict(x)
    for n, t in x.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and n not in ("do", "dS"):
            if n == "g" and not t.requires_grad:
                y[n] = t.float()  # keep the expanded constant (zero strides) as it is
            else:
                y[n] = t.detach().float().requires_grad_(t.requires_grad)
    if isinstance(x.get("h0"), tuple):
        y["h0"] = tuple(t.detach().float().requires_grad_(t.requires_grad) for t in x["h0"])
    return y


# ---------------------------------------------------------------------------------------------- runners
def run_kernel(x: dict, variant: str = "auto"):
    """-> (out, state tuple) through the kernel path; variant "auto" or an fla route name."""
    if x["recurrence"] == "mlstm":
        h, (c, n, m) = kernels.kernel_mlstm(x["q"], x["k"], x["v"], x["i"], x["f"], scale=x["scale"],
                                            initial_state=x["h0"])
        return h, (c, n, m)
    if x["recurrence"] == "gsa":
        return kernels.kernel_gsa(x["q"], x["k"], x["v"], x["s"], x["g"], scale=x["scale"], initial_state=x["h0"])
    if x["recurrence"] == "forgetting_attn":
        return kernels.kernel_forgetting_attention(x["q"], x["k"], x["v"], x["g"], scale=x["scale"]), ()
    if x["recurrence"] == "path_attn":
        return kernels.kernel_path_attention(x["q"], x["k"], x["v"], x["w"], x["beta"], scale=x["scale"])[0], ()
    if x["recurrence"] == "dplr_delta":
        floor = DPLR_DECAY_FLOOR if kernel_cases()[x["case"]].gate == "rwkv7" else None
        o, s = kernels.kernel_dplr_delta(x["q"], x["k"], x["v"], x["a"], x["b"], x["g"], scale=x["scale"],
                                         initial_state=x["h0"], lower_bound=floor)
        return o, (s,)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    if x["recurrence"] == "gated_delta_product":
        o, s = kernels.kernel_gated_delta_product(*args, scale=x["scale"], initial_state=x["h0"],
                                                  route=None if variant == "auto" else variant)
        return o, (s,)
    if variant == "auto":
        o, s = kernels.kernel_gated_delta(*args, scale=x["scale"], initial_state=x["h0"])
    else:
        o, s = kernels.run_gated_delta_route(variant, *args, scale=x["scale"], initial_state=x["h0"])
    return o, (s,)


def run_reference(x: dict):
    if x["recurrence"] == "mlstm":
        h, (c, n, m) = recurrence.chunk_mlstm(x["q"], x["k"], x["v"], x["i"], x["f"], scale=x["scale"],
                                              initial_state=x["h0"])
        return h, (c, n, m)
    if x["recurrence"] == "gsa":
        return recurrence.chunk_gsa(x["q"], x["k"], x["v"], x["s"], x["g"], scale=x["scale"], initial_state=x["h0"])
    if x["recurrence"] == "forgetting_attn":
        return forgetting_attention(x["q"], x["k"], x["v"], x["g"], scale=x["scale"], chunk_size=512)[0], ()
    if x["recurrence"] == "path_attn":
        return path_attention(x["q"], x["k"], x["v"], x["w"], x["beta"], scale=x["scale"], chunk_size=64)[0], ()
    if x["recurrence"] == "dplr_delta":
        o, s = recurrence.chunk_dplr_delta(x["q"], x["k"], x["v"], x["a"], x["b"], x["g"], scale=x["scale"],
                                           initial_state=x["h0"])
        return o, (s,)
    run = recurrence.chunk_gated_delta_product if x["recurrence"] == "gated_delta_product" \
        else recurrence.chunk_gated_delta
    o, s = run(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=x["scale"], initial_state=x["h0"])
    return o, (s,)


def loss_of(x: dict, out, states) -> torch.Tensor:
    """Gated delta: <o, do> + <S_final, dS> (exercises the final-state gradient too).
    mLSTM: <LayerNorm_head(h), do>, as the layer uses h: mlstm_kernels' backward drops the normaliser's
    gradient, which is exact only behind such a scale-invariant norm, and it does not support gradients
    into the final state (kernel_mlstm refuses them). gsa: <o, do> + <hk, dS_k> + <hv, dS_v>. forgetting_attn and
    path_attn: <o, do> (no state)."""
    if x["recurrence"] == "mlstm":
        return (F.layer_norm(out.float(), (out.shape[-1],), eps=1e-6) * x["do"]).sum()
    if x["recurrence"] == "gsa":
        return (out.float() * x["do"]).sum() + sum((a.float() * b).sum() for a, b in zip(states, x["dS"]))
    if not states:
        return (out.float() * x["do"]).sum()
    return (out.float() * x["do"]).sum() + (states[0].float() * x["dS"]).sum()


def forward_backward(run: Callable, x: dict, variant: Optional[str] = None):
    """Outputs and the gradients of loss_of w.r.t. grad_inputs(x)."""
    out, states = run(x) if variant is None else run(x, variant)
    ins = grad_inputs(x)
    grads = torch.autograd.grad(loss_of(x, out, states), list(ins.values()), allow_unused=True)
    return out, states, dict(zip(ins, grads))


def rel_err(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> float:
    """||a - b|| / ||b|| in float64 (absolute ||a - b|| when b is zero); nan if either is missing/non-finite."""
    if a is None or b is None:
        return float("nan")
    a, b = a.detach().double(), b.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("nan")
    den = b.norm().item()
    num = (a - b).norm().item()
    return num / den if den > 0 else num


def compare(x: dict, variant: str = "auto") -> dict:
    """Relative errors kernel vs reference: o/h, final state(s), and d<input> for every input with a grad."""
    out_k, st_k, gr_k = forward_backward(run_kernel, x, variant)
    ref = upcast(x)
    out_r, st_r, gr_r = forward_backward(run_reference, ref)
    name = "h" if x["recurrence"] == "mlstm" else "o"
    errs = {name: rel_err(out_k, out_r)}
    state_names = {"mlstm": ("state_C", "state_n", "state_m"), "gsa": ("state_k", "state_v")}.get(x["recurrence"],
                                                                                                ("state",))
    for n, a, b in zip(state_names, st_k, st_r):
        errs[n] = rel_err(a, b)
    for n in gr_k:
        errs["d" + n] = rel_err(gr_k[n], gr_r[n])
    return errs


def failures(errs: dict, case: Optional[str] = None) -> dict:
    return {n: e for n, e in errs.items() if not (e <= tol_for(n, case))}  # nan fails too


# ---------------------------------------------------------------------------------------------- timing


def peak_mib(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def time_case(x: dict, variant: str, reps: int) -> dict:
    ref = upcast(x)

    def k_fwd():
        with torch.no_grad():
            run_kernel(x, variant)

    def k_fwbw():
        forward_backward(run_kernel, x, variant)

    def r_fwbw():
        forward_backward(run_reference, ref)

    return {
        "kernel_fwd_ms": median_ms(k_fwd, CUDA, reps=reps),
        "kernel_fwbw_ms": median_ms(k_fwbw, CUDA, reps=reps),
        "reference_fwbw_ms": median_ms(r_fwbw, CUDA, reps=max(3, reps // 3), warmup=1),
        "kernel_fwbw_peak_mib": peak_mib(k_fwbw),
        "reference_fwbw_peak_mib": peak_mib(r_fwbw),
    }


# ---------------------------------------------------------------------------------------------- report
def selected_route(x: dict, variant: str) -> str:
    if x["recurrence"] == "mlstm":
        return kernels.MLSTM_KERNEL
    if x["recurrence"] == "gsa":
        return kernels.GSA_KERNEL
    if x["recurrence"] == "forgetting_attn":
        return kernels.FOX_KERNEL
    if x["recurrence"] == "path_attn":
        return kernels.PATH_KERNEL
    if variant != "auto":
        return variant
    if x["recurrence"] == "dplr_delta":
        return kernels.DPLR_ROUTES[0]
    if x["recurrence"] == "gated_delta_product":
        return kernels.select_gated_delta_product_route(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"])
    return kernels.select_gated_delta_route(x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"])


def recurrence_header(B: int) -> dict:
    """What a recurrence report records besides its rows: the kernel environment, the limits, the batch."""
    return {"environment": kernels.kernel_environment(), "tolerances": TOL, "B": B}


LAYOUT_OF_SHAPE = {"135M": "smollm2-135m", "360M": "smollm2-360m", "1.7B": "smollm2-1.7b"}  # harness bench --shape


def measure_errors(out_dir, shapes=("smollm2-135m", "smollm2-1.7b"), cases=None, B: int = 4, Ts=(2048,),
                   variants: str = "all", reps: int = 10, max_seconds: float = float("inf"), seed: int = 0,
                   timing: bool = True, device: str = "cuda",
                   on_row: Optional[Callable[[dict], None]] = None) -> dict:
    """Errors and times for every (shape, T, case, variant) (cases None: every kernel case); writes
    kernel_report.json / .md under out_dir (None: write nothing). `on_row(row)` is called after each measurement."""
    cases = tuple(kernel_cases()) if cases is None else cases
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
    report = {**recurrence_header(B), "results": []}
    t_start = time.time()
    for shape in shapes:
        dims = SHAPES[shape]
        for T in Ts:
            for case in cases:
                for variant in (kernel_cases()[case].variants if variants == "all" else ("auto",)):
                    row = {"shape": shape, "H": dims["H"], "K": dims["K"], "V": dims["V"], "B": B, "T": T,
                           "case": case, "variant": variant}
                    if time.time() - t_start > max_seconds:
                        row["error"] = "skipped: time budget (--max-seconds) spent"
                        report["results"].append(row)
                        continue
                    t0 = time.time()
                    try:
                        x = make_inputs(case, B, T, **dims, seed=seed, device=device)
                        row["route"] = selected_route(x, variant)
                        row["errors"] = compare(x, variant)
                        row["failed"] = failures(row["errors"], case)
                        if timing:
                            row.update(time_case(x, variant, reps))
                    except Exception as exc:  # one failing case must not stop the others
                        row["error"] = f"{type(exc).__name__}: {exc}"
                        row["traceback"] = traceback.format_exc(limit=6)[-3000:]
                    finally:
                        x = None
                        if torch.cuda.is_available():
                            try:
                                torch.cuda.synchronize()
                                torch.cuda.empty_cache()
                            except Exception as exc:  # a broken CUDA context: note it, go on
                                row.setdefault("error", f"after the case: {type(exc).__name__}: {exc}")
                    row["seconds"] = round(time.time() - t0, 1)
                    report["results"].append(row)
                    print(_row_line(row), flush=True)
                    _write(out_dir, report)
                    if on_row is not None:
                        on_row(row)
    _write(out_dir, report)
    return report


def _row_line(row: dict) -> str:
    head = f"{row['shape']:>13} T={row['T']:<5} {row['case']:>15} {row['variant']:>16}"
    if "error" in row:
        return f"{head}  ERROR {row['error'][:200]}"
    errs = " ".join(f"{n}={e:.1e}" for n, e in row["errors"].items())
    timing = ""
    if "kernel_fwbw_ms" in row:
        timing = f" fwbw {row['kernel_fwbw_ms']:.2f} ms (ref {row['reference_fwbw_ms']:.1f})"
    status = "FAIL " + ",".join(row["failed"]) if row["failed"] else "ok"
    return f"{head}  [{row.get('route')}] {status}  {errs}{timing}  ({row['seconds']} s)"


def _fmt(v, spec=".1e"):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def to_markdown(report: dict) -> str:
    env = report["environment"]
    lines = ["# Kernel vs reference", "",
             "Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), "",
             "Relative errors ||kernel - ref|| / ||ref|| (kernel bf16 q/k/v, reference float32); "
             f"limits {report['tolerances']}.",
             "Times: median ms of forward+backward (B, T as listed); peak = extra MiB allocated by one fwd+bwd.", "",
             "| shape | T | case | variant | route | ok | o/h | state | worst grad | kernel fwd ms | kernel fwd+bwd ms"
             " | reference fwd+bwd ms | speed-up | kernel peak MiB | ref peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['T']} | {r['case']} | {r['variant']} | {r.get('route', '-')} | ERROR: "
                         f"{r['error'][:160].replace('|', '/')} | | | | | | | | | |")
            continue
        e = r["errors"]
        out = e.get("o", e.get("h"))
        state = max(v for n, v in e.items() if n.startswith("state"))
        grads = {n: v for n, v in e.items() if n.startswith("d")}
        worst = max(grads, key=lambda n: (grads[n] if not math.isnan(grads[n]) else float("inf"))) if grads else None
        worst_s = f"{worst} {_fmt(grads[worst])}" if worst else "-"
        ok = "yes" if not r["failed"] else "NO: " + ", ".join(f"{n} {_fmt(v)}" for n, v in r["failed"].items())
        kf, kb, rb = r.get("kernel_fwd_ms"), r.get("kernel_fwbw_ms"), r.get("reference_fwbw_ms")
        speed = f"{rb / kb:.1f}x" if kb and rb else "-"
        lines.append(f"| {r['shape']} | {r['T']} | {r['case']} | {r['variant']} | {r['route']} | {ok} | "
                     f"{_fmt(out)} | {_fmt(state)} | {worst_s} | {_fmt(kf, '.2f')} | {_fmt(kb, '.2f')} | "
                     f"{_fmt(rb, '.1f')} | {speed} | {_fmt(r.get('kernel_fwbw_peak_mib'), '.0f')} | "
                     f"{_fmt(r.get('reference_fwbw_peak_mib'), '.0f')} |")
    return "\n".join(lines) + "\n"


def _write(out_dir: Optional[Path], report: dict) -> None:
    if out_dir is None:
        return
    (out_dir / "kernel_report.json").write_text(json.dumps(report, indent=1, default=str))
    (out_dir / "kernel_report.md").write_text(to_markdown(report))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--shapes", default="smollm2-135m,smollm2-1.7b", help=f"comma list of {', '.join(SHAPES)}")
    p.add_argument("--cases", default="all", help=f"comma list of {', '.join(kernel_cases())} or all")
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", default="2048", help="sequence length(s), comma list")
    p.add_argument("--variants", default="all", choices=("all", "auto"), help="all routes per case, or the default")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--max-seconds", type=float, default=float("inf"),
                   help="start no new measurement after this many seconds (the JSON is written as it goes)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    every_case = tuple(kernel_cases())
    cases = every_case if a.cases == "all" else tuple(a.cases.split(","))
    shapes = tuple(a.shapes.split(","))
    for name, pool in (("case", every_case), ("shape", SHAPES)):
        bad = [c for c in (cases if name == "case" else shapes) if c not in pool]
        if bad:
            p.error(f"unknown {name}(s) {bad}; valid: {', '.join(pool)}")
    report = measure_errors(a.out, shapes=shapes, cases=cases, B=a.B, Ts=tuple(int(t) for t in a.T.split(",")),
                            variants=a.variants, reps=a.reps, max_seconds=a.max_seconds, timing=not a.no_timing)
    bad = [r for r in report["results"] if r.get("error") or r.get("failed")]
    print(f"{len(report['results'])} measurements, {len(bad)} failed or errored; see {a.out}/kernel_report.md")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
