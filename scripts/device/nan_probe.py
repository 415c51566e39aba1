"""Issue 8, runs 18: the first three 1.7B stage-3 steps' gradients grow ~100x per block on the way down (runs 17),
with the same weights as the fourth step, whose gradients do not. This re-computes, at each step, two backward
passes the step just ran, on the tensors it ran them on:
  - the final RMSNorm (PyTorch), again in float32;
  - the last block, again (its forward and backward on the captured input and output gradient).
A difference between the step's result and the re-computation at the same step points at state, not arithmetic.

    python scripts/device/nan_probe.py OUT.json [--steps 5] [--layers N] [--device cuda]
"""
import json

import torch

from harness.bench import shapes, step
from harness.config import DistillConfig
from harness.stages.distill import DistillModel
from nan_where import arguments, stat


def main():
    a = arguments(__doc__).parse_args()
    dev = torch.device(a.device)
    cfg = DistillConfig(micro_batch_size=a.micro_batch, grad_accum=1, schedule="constant", warmup_fraction=0.0,
                        compile_teacher=False)
    teacher, student = shapes.build_pair(a.shape, "gated_deltanet", layers=a.layers, device=dev,
                                       teacher_dtype=torch.bfloat16, seed=0)
    model = DistillModel(student, cfg.ce_weight, cfg.kl_weight, cfg.temperature)
    parts, _ = step._build_engines(model, teacher, cfg, 1, True, a.steps, None, None, "replicated", "plain", dev)
    del teacher
    eng = parts.s_engine
    g = torch.Generator(device="cpu").manual_seed(1000)
    vocab = parts.teacher_head.shape[0]
    batches = [torch.randint(0, vocab, (a.micro_batch, a.seq), generator=g).to(dev) for _ in range(4)]
    norm, last = student.model.norm, student.model.layers[-1]
    cap = {}

    def keep(name):
        return lambda g: cap.__setitem__(name, g.detach().clone())

    def norm_pre(_m, args):
        cap["norm_x"] = args[0].detach().clone()
        args[0].register_hook(keep("norm_dx"))

    def norm_fwd(_m, _args, out):
        out.register_hook(keep("norm_dy"))

    def last_pre(_m, args):
        cap["last_x"] = args[0].detach().clone()
        args[0].register_hook(keep("last_dx"))

    def last_fwd(_m, _args, out):
        out[0].register_hook(keep("last_dy"))

    for hook, fn in ((norm.register_forward_pre_hook, norm_pre), (norm.register_forward_hook, norm_fwd),
                     (last.register_forward_pre_hook, last_pre), (last.register_forward_hook, last_fwd)):
        hook(fn)
    res = []
    for k in range(a.steps):
        cap.clear()
        with torch.no_grad():
            t_hidden = parts.t_engine(batches[k % 4])
        losses = eng(batches[k % 4], t_hidden, parts.teacher_head, None)
        eng.backward(losses.total)
        row = {"step": k, "loss": float(losses.total.detach())}
        # the final norm again, in float32
        x = cap["norm_x"].float().requires_grad_()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.float()
        (dx_ref,) = torch.autograd.grad(y, x, cap["norm_dy"].float())
        row["norm"] = {"dy": stat(cap["norm_dy"]), "dx_step": stat(cap["norm_dx"]), "dx_fp32_again": stat(dx_ref),
                       "max_abs_diff": float((cap["norm_dx"].float() - dx_ref).abs().nan_to_num(0, 0, 0).max()),
                       "weight": stat(norm.weight), "x_rms_min": float(x.pow(2).mean(-1).sqrt().min())}
        rms = x.detach().pow(2).mean(-1).sqrt()
        tok = cap["norm_dx"].float().nan_to_num(0, 0, 0).abs().amax(-1)
        b, t = divmod(int(tok.argmax()), tok.shape[1])
        small = (rms < 1e-2).nonzero().tolist()
        ids = batches[k % 4]
        row["where"] = {"largest_dx_at": [b, t], "token_id": int(ids[b, t]), "rms_there": float(rms[b, t]),
                        "tokens_rms_below_1e-2": small[:10], "their_ids": [int(ids[i, j]) for i, j in small[:10]],
                        "pad_token_id": student.config.pad_token_id, "position0_ids": ids[:, 0].tolist()}
        # the last block again, same input and output gradient
        xb = cap["last_x"].clone().requires_grad_()
        out, _ = last(xb)
        (dxb,) = torch.autograd.grad(out, xb, cap["last_dy"])
        (dxb2,) = torch.autograd.grad(last(xb)[0], xb, cap["last_dy"])
        row["last_block"] = {"dy": stat(cap["last_dy"]), "dx_step": stat(cap["last_dx"]), "dx_again": stat(dxb),
                             "dx_again2": stat(dxb2),
                             "step_vs_again": float((cap["last_dx"].float() - dxb.float()).abs().nan_to_num(0, 0, 0).max())}
        eng.step()
        row["skipped"] = eng.skipped_steps
        print(json.dumps(row), flush=True)
        res.append(row)
    with open(a.out, "w") as f:
        json.dump({"args": vars(a), "steps": res}, f)


if __name__ == "__main__":
    main()
