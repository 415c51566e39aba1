"""Count the operators DeepSpeed's `engine.step()` issues for a student of a SmolLM2 shape, on the CPU (gloo,
float32, one process): the host-side cost of the optimizer phase of `harness bench`, which on a GPU is one kernel
launch or more per operator. Device-independent, because ZeRO's step loops over the parameter tensors in Python.

    python scripts/zero_step_ops.py --ds-config ds_configs/zero2.json [--shape 135M] [--mixer gated_deltanet]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.engine import setup_distributed, student_engine  # noqa: E402
from harness.bench.shapes import build_pair  # noqa: E402


def step_ops(ds_config: str, shape: str, mixer: str, top: int = 12) -> dict:
    setup_distributed(torch.device("cpu"))
    _, student = build_pair(shape, mixer, device="cpu")
    cfg = json.loads(Path(ds_config).read_text())
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=1,
               gradient_clipping=1.0)
    cfg["optimizer"]["params"].update(lr=1e-4, weight_decay=0.1)
    engine = student_engine(student, cfg, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    ids = torch.randint(0, student.config.vocab_size, (1, 32))
    for profiled in (False, True):  # the first step allocates the optimizer states
        engine.backward(engine(ids).logits.float().square().mean())
        if not profiled:
            engine.step()
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            began = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - began
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    return {
        "ds_config": ds_config, "shape": shape, "mixer": mixer,
        "parameter_tensors": sum(1 for p in student.parameters() if p.requires_grad),
        "aten_calls": sum(e.count for e in events), "step_s_cpu": round(seconds, 3),
        "top": [{"op": e.key, "calls": e.count} for e in sorted(events, key=lambda e: -e.count)[:top]],
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-config", default="ds_configs/zero2.json", help="The student's DeepSpeed config.")
    p.add_argument("--shape", default="135M", help="135M, 360M or 1.7B (random weights). Default 135M.")
    p.add_argument("--mixer", default="gated_deltanet", help="The student's mixer. Default gated_deltanet.")
    args = p.parse_args(argv)
    print(json.dumps(step_ops(args.ds_config, args.shape, args.mixer), indent=1))


if __name__ == "__main__":
    main()
