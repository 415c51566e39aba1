"""Mixer layers on the GPU: kernel path vs PyTorch reference, errors and forward+backward times.

For every mixer and each teacher head layout (SmolLM2-135M: hidden 576, 9 heads; SmolLM2-1.7B: hidden
2048, 32 heads; head_dim 64), one bf16 layer is run with backend=kernel and its fp32 copy with
backend=reference on the same input. Reported: relative errors ||a-b||/||b|| of the output and of all
parameter gradients, and the median forward+backward time of each path at batch x seq_len.

    python scripts/gpu_layer_report.py --out OUT_DIR [--batch 4 --seq 2048 --mixers gla,kda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.mixers import MIXERS, MixerShape, mixer_class, mixer_options  # noqa: E402

LAYOUTS = {
    "135M": MixerShape(hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64),
    "1.7B": MixerShape(hidden_size=2048, num_heads=32, num_kv_heads=32, head_dim=64),
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def build(name: str, shape: MixerShape, backend: str, dtype, seed: int = 0):
    torch.manual_seed(seed)
    layer = mixer_class(name)(shape, mixer_options(name, {"backend": backend}))
    layer.reset_new_parameters()
    with torch.no_grad():  # realistic scale for the copied projections
        for proj in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
            proj.weight.normal_(0, shape.hidden_size**-0.5)
    return layer.to("cuda", dtype)


def fwd_bwd(layer, x):
    x = x.detach().requires_grad_(True)
    y, _ = layer(x)
    y.float().square().mean().backward()
    return y, x.grad


def time_fwd_bwd(layer, x, reps: int = 10) -> float:
    for _ in range(2):
        layer.zero_grad(set_to_none=True)
        fwd_bwd(layer, x)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        layer.zero_grad(set_to_none=True)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fwd_bwd(layer, x)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def compare(name: str, layout: str, batch: int, seq: int) -> dict:
    shape = LAYOUTS[layout]
    kernel = build(name, shape, "kernel", torch.bfloat16)
    ref = build(name, shape, "reference", torch.float32)
    ref.load_state_dict({k: v.float() for k, v in kernel.state_dict().items()})
    torch.manual_seed(1)
    x = torch.randn(batch, seq, shape.hidden_size, device="cuda", dtype=torch.bfloat16)
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
    ref_bf16 = build(name, shape, "reference", torch.bfloat16)
    ref_bf16.load_state_dict(kernel.state_dict())
    yb, gxb = fwd_bwd(ref_bf16, x)  # the bf16 floor: the PyTorch reference run on bf16 weights and inputs
    row["ref_bf16_out_rel_err"], row["ref_bf16_dx_rel_err"] = rel(yb, yr), rel(gxb, gxr)
    del yr, gxr, yb, gxb
    row["kernel_ms"] = time_fwd_bwd(kernel, x)
    row["reference_bf16_ms"] = time_fwd_bwd(ref_bf16, x, reps=3)
    row["speedup"] = row["reference_bf16_ms"] / row["kernel_ms"]
    row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mixers", default=",".join(MIXERS))
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--variants", default="", help="extra rows NAME@CASE=ROUTE run with HARNESS_FLA_ROUTES set")
    ap.add_argument("--max-seconds", type=float, default=1e9, help="start no new row after this long")
    args = ap.parse_args()
    began = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    layouts = args.layouts.split(",")
    plan = [(layouts[0], spec) for spec in args.mixers.split(",") + list(filter(None, args.variants.split(",")))]
    plan += [(layout, spec) for layout in layouts[1:] for spec in args.mixers.split(",")]
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
            "command": " ".join(sys.argv)}
    for mod in ("triton", "fla", "mlstm_kernels", "transformers"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception as err:
            meta[mod] = f"unavailable: {err}"
    for layout, spec in plan:
        if time.time() - began > args.max_seconds:
            rows.append({"mixer": spec, "layout": layout, "error": "not run: --max-seconds reached"})
            continue
        name, _, routes = spec.partition("@")
        os.environ["HARNESS_FLA_ROUTES"] = routes
        torch.cuda.reset_peak_memory_stats()
        try:
            row = compare(name, layout, args.batch, args.seq)
        except Exception as err:  # one failing mixer must not hide the others
            row = {"layout": layout, "error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc(limit=6)}
        row["mixer"] = spec
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        (out / "layer_report.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        torch.cuda.empty_cache()
    (out / "layer_report.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = ["| mixer | layout | out err | dx err | max param-grad err (param) | bf16-reference out / dx err | "
             "kernel ms | reference ms | speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mixer']} | {r['layout']} | error: {r['error'][:80]} ||||||||")
        else:
            lines.append(f"| {r['mixer']} | {r['layout']} | {r['out_rel_err']:.2e} | {r['dx_rel_err']:.2e} | "
                         f"{r['max_param_grad_rel_err']:.2e} ({r['worst_param']}) | "
                         f"{r['ref_bf16_out_rel_err']:.1e} / {r['ref_bf16_dx_rel_err']:.1e} | {r['kernel_ms']:.2f} | "
                         f"{r['reference_bf16_ms']:.2f} | {r['speedup']:.1f}x |")
    (out / "layer_report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
