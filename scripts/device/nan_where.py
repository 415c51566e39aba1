"""Where the first stage-3 steps' non-finite gradients come from (issue 8, runs 16): at 1.7B both engines skip the
first three optimizer steps for a non-finite gradient and train from the fourth on, with the same weights and the
same batches. This runs the bench's stage-3 step (plain engine, harness.bench's own builders) and, per step, records
  - every parameter's gradient: non-finite element count (nan, inf) and the largest finite magnitude;
  - per block, forward: the largest magnitude of the mixer's and the block's outputs;
  - per block, backward: the gradient reaching the block's output, the mixer's output and the mixer's input.

    python scripts/device/nan_where.py OUT.json [--shape 1.7B] [--steps 5] [--no-compile] [--layers N]
"""
import argparse
import json
import time

import torch

from harness.bench import shapes, step
from harness.config import DistillConfig
from harness.stages.distill import DistillModel


def stat(t: torch.Tensor) -> dict:
    t = t.detach()
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    return {"nan": nan, "inf": inf, "amax": float(t.float().nan_to_num(0, 0, 0).abs().max())} if t.numel() else {}


def hooks(student, record):
    """Forward hooks that record output magnitudes and hang a gradient hook on each output."""
    def watch(name):
        def fwd(_m, _args, out):
            t = out[0] if isinstance(out, tuple) else out
            record["fwd"][name] = stat(t)
            if t.requires_grad:
                t.register_hook(lambda g: record["bwd"].__setitem__(name, stat(g)))
        return fwd

    hs = []
    for i, block in enumerate(student.model.layers):
        hs.append(block.register_forward_hook(watch(f"{i}.out")))
        hs.append(block.mixer.register_forward_hook(watch(f"{i}.mixer_out")))
        hs.append(block.input_layernorm.register_forward_hook(watch(f"{i}.mixer_in")))
        hs.append(block.mlp.register_forward_hook(watch(f"{i}.mlp_out")))
    hs.append(student.model.norm.register_forward_hook(watch("final_norm")))
    return hs


def run(shape, steps, compile_teacher, layers, micro_batch, seq, dev):
    cfg = DistillConfig(micro_batch_size=micro_batch, grad_accum=1, schedule="constant", warmup_fraction=0.0,
                        compile_teacher=compile_teacher)
    teacher, student = shapes.build_pair(shape, "gated_deltanet", layers=layers, device=dev,
                                       teacher_dtype=torch.bfloat16, seed=0)
    model = DistillModel(student, cfg.ce_weight, cfg.kl_weight, cfg.temperature)
    parts, _ = step._build_engines(model, teacher, cfg, 1, True, steps, None, None, "replicated", "plain", dev)
    del teacher
    eng = parts.s_engine
    g = torch.Generator(device="cpu").manual_seed(1000)
    vocab = parts.teacher_head.shape[0]
    batches = [torch.randint(0, vocab, (micro_batch, seq), generator=g).to(dev) for _ in range(4)]
    names = [eng.names[id(p)][0] for p in eng.params]
    out = []
    for k in range(steps):
        record = {"fwd": {}, "bwd": {}}
        hs = hooks(student, record)
        t0 = time.time()
        with torch.no_grad():
            t_hidden = parts.t_engine(batches[k % 4])
        record["teacher_hidden"] = stat(t_hidden)
        losses = eng(batches[k % 4], t_hidden, parts.teacher_head, None)
        eng.backward(losses.total)
        for h in hs:
            h.remove()
        grads = {n: stat(m.grad) for n, m in zip(names, eng.masters) if m.grad is not None}
        record["bad_params"] = {n: s for n, s in grads.items() if s["nan"] or s["inf"]}
        record["grad_amax_top"] = sorted(((s["amax"], n) for n, s in grads.items()), reverse=True)[:8]
        eng.step()
        record.update(step=k, loss=float(losses.total.detach()), grad_norm=eng.get_global_grad_norm(),
                      skipped=eng.skipped_steps, seconds=time.time() - t0)
        record["bwd_bad"] = {n: s for n, s in record["bwd"].items() if s.get("nan") or s.get("inf")}
        print(json.dumps({k: record[k] for k in ("step", "loss", "grad_norm", "skipped", "seconds")}),
              "bad params", len(record["bad_params"]), "bad grads", sorted(record["bwd_bad"]), flush=True)
        out.append(record)
    del parts, model, student, eng
    torch.cuda.empty_cache()
    return out


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options both diagnostics take (nan_where.py, nan_probe.py)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--shape", default="1.7B")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    return ap


def main():
    ap = arguments(__doc__)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    dev = torch.device(a.device)
    res = run(a.shape, a.steps, not a.no_compile, a.layers, a.micro_batch, a.seq, dev)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "steps": res}, f)


if __name__ == "__main__":
    main()
