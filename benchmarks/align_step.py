"""Stage 1's step, phase by phase: the teacher's activation capture, the layers' forwards and backwards, the per-layer
clip and the optimizer step, on a random teacher of the given shape (CUDA; a CPU rehearsal with tiny arguments).

The copy50 run's stage 1 trained ~59,000 tokens/s on an H100 at micro-batch 8 x 2048 while its stage 3 ran ~150,000
at micro-batch 32 (docs/results/retrieval-135m/); the layers' part alone ran ~99,000 on an H100 in
docs/results/short_checks_h100_2026-12-07/ (where the layers on several CUDA streams, a removed option, ran no
faster: 98,600 / 97,200 / 92,200 on 2 / 4 / 8 streams). This times each phase of `harness.stages.align`'s own step
(`capture_activations`, `backward_layers`, `clip_per_layer`, AdamW) over `--steps` steps after `--warmup`, each phase
between two device synchronisations, and writes the median milliseconds of each and the tokens per second of the
whole step (with the command and the device) to `--out`.

    PYTHONPATH=. python benchmarks/align_step.py --out align_step.json          # 135M, 30 layers, 8 x 2048
    PYTHONPATH=. python benchmarks/align_step.py --device cpu --layers 2 --batch 1 --seq 64 --steps 1 --warmup 0 \\
        --option chunk_size=16 --option backend=reference --out /tmp/a.json      # a CPU rehearsal
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def build(shape: str, mixer: str, options: dict, layers: int, device: torch.device, seed: int = 0):
    """(teacher, the stage-1 group of every layer, the student config) for a random teacher of `shape`, in the
    teacher dtype stage 1 uses on that device (bf16 on a GPU)."""
    from harness.bench.shapes import build_teacher
    from harness.stages.align import init_mixer
    from harness.student import student_config

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher = build_teacher(shape, layers=layers, device=device, dtype=dtype, seed=seed)
    config = student_config(teacher.config, mixer, options)
    group = torch.nn.ModuleDict({str(l): init_mixer(teacher.model.layers[l], config, l, seed)
                                 for l in range(layers)}).to(device).train()
    return teacher, group, config


def measure(args) -> dict:
    from harness.bench.cli import _parse_options
    from harness.stages.align import KINDS, backward_layers, clip_per_layer, param_groups
    from harness.student import rope_for
    from harness.teacher import capture_activations

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    options = _parse_options(args.option)  # `harness bench`'s own KEY=VALUE parsing
    teacher, group, config = build(args.shape, args.mixer, options, args.layers, device)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, teacher.config.vocab_size, (args.batch, args.seq), generator=g).to(device)
    rope = rope_for(config, device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    optimizer = torch.optim.AdamW(param_groups(group, 0.0), lr=1e-3, betas=(0.9, 0.95))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    layers = list(range(args.layers))
    phases: dict[str, list[float]] = {"capture": [], "layers": [], "clip": [], "optimizer": [], "step": []}
    for i in range(args.warmup + args.steps):
        sync()
        t = [time.perf_counter()]
        acts = capture_activations(teacher, ids, layers=layers, kinds=KINDS["align_mixer"])
        sync(); t.append(time.perf_counter())
        backward_layers(group, "align_mixer", acts, rope(ids), 1.0, autocast, "mse")
        sync(); t.append(time.perf_counter())
        clip_per_layer(group, 1.0)
        sync(); t.append(time.perf_counter())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(); t.append(time.perf_counter())
        if i >= args.warmup:
            for name, a, b in zip(("capture", "layers", "clip", "optimizer"), t, t[1:]):
                phases[name].append((b - a) * 1e3)
            phases["step"].append((t[-1] - t[0]) * 1e3)
    median = {k: statistics.median(v) if v else None for k, v in phases.items()}
    tokens_per_s = args.batch * args.seq / (median["step"] / 1e3) if median["step"] else None
    print(f"{args.shape} {args.mixer} {args.batch} x {args.seq}, {args.layers} layers: "
          f"{tokens_per_s or 0:,.0f} tokens/s; ms " + ", ".join(f"{k} {v or 0:.1f}" for k, v in median.items()),
          flush=True)
    return {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu", "shape": args.shape, "mixer": args.mixer, "options": options, "layers": args.layers,
            "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
            "median_ms": median, "tokens_per_s": tokens_per_s,
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="135M", help="Teacher shape (random weights). Default 135M.")
    parser.add_argument("--mixer", default="gated_deltanet")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="A mixer option.")
    parser.add_argument("--layers", type=int, default=30, help="Layers in the group (default 30: one job's).")
    parser.add_argument("--batch", type=int, default=8, help="Micro-batch (stage 1's default 8).")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default=None, help="Default: cuda where there is one, else cpu.")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = measure(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
