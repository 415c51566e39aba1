"""Two memory-bound pieces of the delta-rule mixers, forward + backward, three ways each (CUDA).

The 135M stage-3 profile put fla's gated-norm backward at ~29 ms and its short convolution's backward at ~21 ms
of a ~390 ms step (docs/BENCHMARKS.md, "Where the time goes now"), several times their memory traffic. This
times each at the stage-3 shape of a 135M student (micro-batch 32 x 2048, 9 heads of 64, q/k/v convolved
together: 1,728 channels):

- norm: `HeadRMSNorm`'s gated RMSNorm, norm(o) * silu(gate) per head: fla's `rms_norm_gated` (mixer option
  `pieces: fla`, the default), the PyTorch form (~8 elementwise operators), and that form under `torch.compile`
  (`pieces: compiled`);
- conv: `ShortConv`'s depthwise causal convolution (width 4) + SiLU: fla's `causal_conv1d` (`pieces: fla`), the
  same as four shifted multiply-adds in PyTorch (`harness.mixers.base.causal_conv_shifted`), and those under
  `torch.compile` (`pieces: compiled`);

and writes the median milliseconds of forward + backward, the bytes each must move at least, and the largest
difference from the PyTorch result (per output and gradient) to `--out` (JSON, with the command and the GPU).
One layer's figures; the 135M student has 30 such layers.

    PYTHONPATH=. python benchmarks/mixer_pieces.py --out pieces.json   # from the repository root
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from harness.mixers.base import causal_conv_shifted, compiled, gated_rms_norm


def norm_eager(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """norm(o) * silu(gate), the PyTorch form `HeadRMSNorm` runs off the kernel backend (and compiles)."""
    return gated_rms_norm(o, gate, weight, 1e-5, "silu")


def norm_fla(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    return rms_norm_gated(o, gate, weight, None, activation="swish", eps=1e-5)


def conv_eager(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu(depthwise causal conv(x)) as shifted multiply-adds, the form the `compiled` pieces run."""
    return causal_conv_shifted(x, weight, None, "silu")


def norm_compiled(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What `HeadRMSNorm` runs under `pieces: compiled`."""
    return compiled(gated_rms_norm)(o, gate, weight, 1e-5, "silu")


def conv_compiled(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What `ShortConv` runs under `pieces: compiled`."""
    return compiled(causal_conv_shifted)(x, weight, None, "silu")


def conv_fla(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d(x, weight=weight, bias=None, activation="silu")[0]


def time_fwd_bwd(fn, inputs: list[torch.Tensor], dy: torch.Tensor, repeats: int):
    """Median ms of fn's forward + backward over `repeats` (after three warm-ups), and [output, *gradients]."""
    times, out = [], None
    for i in range(repeats + 3):
        for t in inputs:
            t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y = fn(*inputs)
        y.backward(dy)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
        out = [y.detach()] + [t.grad.clone() for t in inputs]
    times.sort()
    return times[len(times) // 2], out


def run_case(name: str, ways: dict, inputs: list[torch.Tensor], dy: torch.Tensor, repeats: int) -> dict:
    results, reference = {}, None
    for way, fn in ways.items():
        ms, out = time_fwd_bwd(fn, inputs, dy, repeats)
        reference = out if reference is None else reference
        diff = [float((a.float() - b.float()).abs().max()) for a, b in zip(out, reference)]
        results[way] = {"ms_fwd_bwd": round(ms, 3), "max_abs_diff_vs_eager": diff}
        print(f"{name:5s} {way:9s} {ms:8.3f} ms   max |diff| vs eager (y, grads): "
              + " ".join(f"{d:.3g}" for d in diff), flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="sequences (default 32: stage 3's micro-batch)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--heads", type=int, default=9, help="heads (135M: 9)")
    parser.add_argument("--head-dim", type=int, default=64, help="head dimension (135M: 64)")
    parser.add_argument("--repeats", type=int, default=20, help="timed repetitions after three warm-ups")
    parser.add_argument("--out", default=None, help="JSON file for the results (default: print only)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("mixer_pieces: needs a CUDA GPU", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16, grad=True):
        t = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
        return t.requires_grad_() if grad else t

    b, t, h, d = args.batch, args.seq, args.heads, args.head_dim
    norm_in = [rand(b, t, h, d), rand(b, t, h, d), (1 + 0.1 * rand(d, dtype=torch.float32, grad=False)).requires_grad_()]
    conv_in = [rand(b, t, 3 * h * d), (0.5 * rand(3 * h * d, 4, dtype=torch.float32, grad=False)).requires_grad_()]
    record = {"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "shape": {"batch": b, "seq": t, "heads": h, "head_dim": d}, "cases": {}}
    n = b * t * h * d
    record["cases"]["norm"] = {
        "least_bytes_fwd_bwd": 8 * n * 2,  # o, gate -> y; o, gate, dy -> do, dgate: eight bf16 tensors
        "results": run_case("norm", {"eager": norm_eager, "fla": norm_fla,
                                     "compiled": norm_compiled},
                            norm_in, rand(b, t, h, d, grad=False), args.repeats)}
    record["cases"]["conv"] = {
        "least_bytes_fwd_bwd": 5 * 3 * n * 2,  # x -> y; x, dy -> dx (+ the tiny dw): five bf16 tensors
        "results": run_case("conv", {"eager": conv_eager, "fla": conv_fla,
                                     "compiled": conv_compiled},
                            conv_in, rand(b, t, 3 * h * d, grad=False), args.repeats)}
    for case in record["cases"].values():
        case["least_ms_at_3.35TBps"] = round(case["least_bytes_fwd_bwd"] / 3.35e12 * 1e3, 3)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
