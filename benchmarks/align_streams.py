"""Stage 1's step with the group's layers on several CUDA streams (`stages.align_mixer.streams`) against one after
another: the same losses and gradients, and the tokens per second of each.

Stage 1 trains every layer's mixer on the teacher's activations at micro-batch 8 x 2048; the copy50 run's stage 1
ran ~59,000 tokens/s on an H100 where its stage 3 ran ~150,000 at micro-batch 32 (docs/results/retrieval-135m/),
one layer's recurrence kernels filling a fraction of the GPU. This builds the stage-1 group of a random teacher of
the given shape (`harness.stages.align`'s own `init_mixer`, `capture_activations`, `backward_layers`,
`clip_per_layer`, AdamW), then for each stream count: one step from the same weights, compared with one stream's
losses and gradients (bit for bit, and the largest difference), and the median of `--steps` timed steps (after
`--warmup`). Writes JSON with the command, the device and the rows to `--out`.

    PYTHONPATH=. python benchmarks/align_streams.py --out align_streams.json          # 135M, 30 layers, 8 x 2048
    PYTHONPATH=. python benchmarks/align_streams.py --device cpu --layers 2 --batch 1 --seq 64 --counts 1,2 \\
        --steps 1 --warmup 0 --option chunk_size=16 --out /tmp/a.json                   # a CPU rehearsal
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch


def build(shape: str, mixer: str, options: dict, layers: int, device: torch.device, seed: int = 0):
    """(teacher, the stage-1 group of every layer, the student config) for a random teacher of `shape`."""
    from harness.bench.shapes import build_teacher
    from harness.stages.align import init_mixer
    from harness.student import student_config

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    teacher = build_teacher(shape, layers=layers, device=device, dtype=dtype, seed=seed)
    config = student_config(teacher.config, mixer, options)
    group = torch.nn.ModuleDict({str(l): init_mixer(teacher.model.layers[l], config, l, seed)
                                 for l in range(layers)}).to(device).train()
    return teacher, group, config


def one_step(group, acts, rope, autocast, streams, optimizer) -> tuple[dict, dict]:
    """One stage-1 optimizer step as `harness.stages.align._train` takes it -> (losses, gradients before the step)."""
    from harness.stages.align import backward_layers, clip_per_layer

    losses, _ = backward_layers(group, "align_mixer", acts, rope, 1.0, autocast, "mse", None, streams)
    grads = {n: p.grad.detach().clone() for n, p in group.named_parameters() if p.grad is not None}
    clip_per_layer(group, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {l: float(v) for l, v in losses.items()}, grads


def measure(args) -> dict:
    from harness.stages.align import KINDS, layer_streams, param_groups
    from harness.student import rope_for
    from harness.teacher import capture_activations

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    options = dict(kv.split("=", 1) for kv in args.option)
    options = {k: _value(v) for k, v in options.items()}
    teacher, group, config = build(args.shape, args.mixer, options, args.layers, device)
    start = copy.deepcopy(group.state_dict())
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, teacher.config.vocab_size, (args.batch, args.seq), generator=g).to(device)
    acts = capture_activations(teacher, ids, layers=list(range(args.layers)), kinds=KINDS["align_mixer"])
    rope = rope_for(config, device)(ids)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows, reference = [], None
    for count in [int(c) for c in args.counts.split(",")]:
        group.load_state_dict(start)
        optimizer = torch.optim.AdamW(param_groups(group, 0.0), lr=1e-3, betas=(0.9, 0.95))
        streams = layer_streams(count, device)
        losses, grads = one_step(group, acts, rope, autocast, streams, optimizer)
        if reference is None:
            reference = (losses, grads)
        loss_diff = max(abs(losses[l] - reference[0][l]) for l in losses)
        grad_diff = max((grads[n].float() - reference[1][n].float()).abs().max().item() for n in grads)
        times = []
        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            one_step(group, acts, rope, autocast, streams, optimizer)
            sync()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        step_s = statistics.median(times) if times else None
        rows.append({"streams": count, "streams_used": len(streams) or 1, "step_ms": step_s and step_s * 1e3,
                     "tokens_per_s": step_s and args.batch * args.seq / step_s,
                     "identical_to_first": loss_diff == 0.0 and grad_diff == 0.0,
                     "largest_loss_difference": loss_diff, "largest_grad_difference": grad_diff,
                     "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None})
        print(f"streams {count}: {rows[-1]['tokens_per_s'] or 0:,.0f} tokens/s, step {rows[-1]['step_ms'] or 0:.1f} ms, "
              f"identical to the first: {rows[-1]['identical_to_first']} (loss {loss_diff:.2e}, grad {grad_diff:.2e})",
              flush=True)
    return {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else "cpu", "shape": args.shape, "mixer": args.mixer, "options": options, "layers": args.layers,
            "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup, "rows": rows}


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="135M", help="Teacher shape (random weights). Default 135M.")
    parser.add_argument("--mixer", default="gated_deltanet")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="A mixer option.")
    parser.add_argument("--layers", type=int, default=30, help="Layers in the group (default 30: one job's).")
    parser.add_argument("--batch", type=int, default=8, help="Micro-batch (stage 1's default 8).")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--counts", default="1,2,4,8", help="Stream counts, comma-separated; the first is the "
                        "reference the others are compared with. Default 1,2,4,8.")
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
