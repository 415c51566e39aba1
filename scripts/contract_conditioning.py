"""How well conditioned is the contract's kernel_matches_reference comparison? (CPU only, float64 as the truth.)

harness.mixers.contract.kernel_matches_reference compares a kernel student with the reference student in fp32, and
with the reference run in bf16 (the "bf16 floor"). On an H100 (2026-12-05, docs/results/contract-h100-2026-12-05),
at the inputs it then used (x ~ N(0, 1), new parameters 0.2 off their init: this script's defaults; the property
now uses --scale 0.1 --std 0.05, which this script's --sweep chose) kda, mlstm and mamba2 failed, and some floors
were 0.45 (mlstm dk_proj) and 1.3 (mamba2 dD). This script runs the
SAME reference student (the contract's Subject, tiny_teacher, weights and x; its `_layer_run` and `relative`) on
CPU in float64, float32 and bfloat16, and three emulations of the kernel backend's "fp32" run, whose q, k, v are
bf16: harness.mixers.kernels._compute_dtype maps float32 to bfloat16 for every fla route and for mlstm_kernels, so
only the gates, beta and the state stay float32. Columns, each ||a - b|| / ||b|| against the float64 run:

    fp32      reference in float32
    bf16      reference in bfloat16: the contract's floor
    qkv16     float32 model, q, k, v rounded to bf16 where the kernel path casts them (before and after the delta
              rules' L2 norm), their gradients rounded to bf16 on the way back (the kernel returns dq, dk, dv so)
    qkv16f    the same, forward rounding only
    qkvh      the same with fp16 (11 significant bits, unit roundoff 2^-11 = TF32's; bf16's is 2^-8), forward only

Then `gate_identity`: the error the kernels' way of forming the decay gate's gradient (dG = q.dq - k.dk, reverse
cumsum) adds when dq and dk carry bf16-size errors. For mlstm, `mlstm_conventions`: the reference against the
kernel's backward convention (normaliser and stabiliser held constant). --sweep: the bf16 floor, qkv16 and the
gate identity's error at other inputs (x scaled, T=128, other seeds, smaller offsets of the new parameters).

float64 needs the mixers' and recurrences' .float() upcasts (float32 by design) to leave float64 alone:
torch.Tensor.float is patched to keep float64 tensors as they are, for this script only (float32 and bfloat16
tensors are unaffected). Usage, from the repository root (about 20 s, and 3 min for --sweep, on one CPU thread):

    PYTHONPATH=. .venv/bin/python scripts/contract_conditioning.py [MIXER ...] [--seed S --length T --scale A --std D]
    PYTHONPATH=. .venv/bin/python scripts/contract_conditioning.py --sweep [MIXER ...]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from harness.mixers import contract, dispatch, recurrence
from harness.mixers.contract import Subject, _layer_run, relative, tiny_teacher
from harness.student import rope_for

_float = torch.Tensor.float


def _float_keeping_double(self, *args, **kwargs):
    return self if self.dtype == torch.float64 else _float(self, *args, **kwargs)


torch.Tensor.float = _float_keeping_double  # the float64 run stays float64 through the mixers' upcasts

MIXERS = ("gated_deltanet", "kda", "mlstm", "mamba2")
_CHUNKS = {"chunk_gated_delta": recurrence.chunk_gated_delta, "chunk_mlstm": recurrence.chunk_mlstm}


def contract_students(name: str, seed: int, std: float = 0.2):
    """The reference student of kernel_matches_reference, built as the contract builds it: run_contract's
    Subject(name, {}, seed), the one-layer 576-wide teacher, then the kernel student (its new parameters drawn
    first) whose state the reference student loads. std: the random offsets of the new parameters
    (contract.perturb_new_parameters; the contract's 0.2 unless told)."""
    perturb = contract.perturb_new_parameters
    contract.perturb_new_parameters = lambda student, s: perturb(student, s, std=std)
    try:
        subject = Subject(name, {}, seed=seed)
        teacher = tiny_teacher(num_layers=1, hidden=576, heads=9, kv_heads=3, seed=subject.seed)
        kernel_student = subject.student(teacher, backend="kernel")
        reference_student = subject.student(teacher, backend="reference")
        reference_student.load_state_dict(kernel_student.state_dict())
    finally:
        contract.perturb_new_parameters = perturb
    return reference_student


def contract_x(seed: int, length: int = 512, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(2, 512, 576, generator=torch.Generator().manual_seed(seed + 2))  # the contract's x
    return x[:, :length] * scale


def _round_qkv(dtype: torch.dtype, grads_too: bool):
    """Patch the reference recurrences so that q, k, v are rounded to `dtype` on entry (q and k of the delta rules
    before their L2 norm as well, as the kernel path casts, then normalises, then stores in bf16); with grads_too their
    gradients are rounded on the way back as well (as a kernel returns dq, dk, dv in its compute dtype), else the
    rounding is forward only (fp16's range would flush the tiny gradients of mean(y^2)). Returns the undo."""
    def rnd(t):
        if grads_too:
            return t.to(dtype).to(t.dtype)
        return t + (t.detach().to(dtype).to(t.dtype) - t.detach())

    def wrap(fn):
        def rounded(q, k, v, *args, **kwargs):
            return fn(rnd(q), rnd(k), rnd(v), *args, **kwargs)
        return rounded

    def undo():
        for attr, fn in _CHUNKS.items():
            setattr(recurrence, attr, fn)
        dispatch.l2norm = _L2NORM

    for attr, fn in _CHUNKS.items():
        setattr(recurrence, attr, wrap(fn))
    dispatch.l2norm = lambda t: _L2NORM(rnd(t))  # the kernel casts q, k before its in-kernel L2 norm too
    return undo


_L2NORM = dispatch.l2norm
EMULATIONS = {"qkv16": (torch.bfloat16, True), "qkv16f": (torch.bfloat16, False), "qkvh": (torch.float16, False)}


def runs(student, x: torch.Tensor, emulate: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for label, dtype in (("fp64", torch.float64), ("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[label] = _layer_run(copy.deepcopy(student).to(dtype=dtype), x.to(dtype))
    if emulate:
        for label, (rounding, grads_too) in EMULATIONS.items():
            undo = _round_qkv(rounding, grads_too)
            try:
                out[label] = _layer_run(copy.deepcopy(student).to(dtype=torch.float32), x.float())
            finally:
                undo()
    return out


def _revcumsum(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """Reverse cumulative sum over the token axis (1) of `[B, T, ...]`, restarting every `chunk` tokens."""
    b, length = t.shape[:2]
    blocks = t.reshape(b, length // chunk, chunk, *t.shape[2:])
    return blocks.flip(2).cumsum(2).flip(2).reshape(t.shape)


def gate_identity(student, x: torch.Tensor, name: str) -> dict[str, float]:
    """What the kernels' way of forming the decay gate's gradient costs at bf16-size errors in dq and dk.

    fla (chunk_kda, chunk_gated_delta_rule, chunk_simple_gla) and mlstm_kernels do not differentiate the gate
    directly: they rebuild the gradient of the cumulative log decay from the identity dG_t = q_t * dq_t - k_t * dk_t
    (+ terms at the chunk's end), summed over channels for a per-head gate, then reverse-cumsum it: within chunks of
    64 (fla: fla/ops/kda/chunk_bwd.py:300, chunk_intra.py:571/674, fla/ops/common/chunk_o.py:316, then
    chunk_local_cumsum(reverse=True)), or over the whole sequence (mlstm_kernels:
    torch/chunkwise/triton_limit_chunk/chunkwise_gates.py:29-31, from dq, dk it stores in bf16,
    bw_parallel.py:54-55). Exact in exact arithmetic; each term is large where the true dG is small, so errors of
    relative size u in dq, dk leave an absolute error ~ u |q dq| in dG. Emulated on the float64 reference: dq, dk
    (exact) rounded to bf16, the identity's change (q (dq~ - dq) - k (dk~ - dk)) reverse-cumsummed as the kernel
    does and pushed back to the parameters through the gate's own graph. Returns ||delta grad|| / ||grad|| for the
    parameters the gate reaches. A model of fla's error (its dq, dk are fp32 sums of bf16 products, their error is
    of that size, not that rounding); for mlstm_kernels it is the rounding it does, on top of its own."""
    model = copy.deepcopy(student).to(dtype=torch.float64)
    mixer = model.model.layers[0].mixer
    seen: dict[str, torch.Tensor] = {}

    def capture(fn):
        def run(q, k, v, a, b, *args, **kwargs):
            for key, t in zip(("q", "k", "a", "b"), (q, k, a, b)):
                if t is not None:
                    t.retain_grad()
                    seen[key] = t
            return fn(q, k, v, a, b, *args, **kwargs)
        return run

    for attr, fn in _CHUNKS.items():
        setattr(recurrence, attr, capture(fn))
    try:
        x = x.double().requires_grad_(True)
        y, _ = mixer(x, position_embeddings=rope_for(model.config, x.device)(x[..., 0]))
        y.square().mean().backward(retain_graph=True)
    finally:
        for attr, fn in _CHUNKS.items():
            setattr(recurrence, attr, fn)
    q, k = seen["q"], seen["k"]
    dq_err = q.grad.to(torch.bfloat16).double() - q.grad
    dk_err = k.grad.to(torch.bfloat16).double() - k.grad
    term_q, term_k = q.detach() * dq_err, k.detach() * dk_err
    params = {n: p for n, p in mixer.named_parameters() if p.grad is not None}
    if name == "mlstm":  # a = i, b = f (pre-activations); dlogf from the whole sequence, di = k . dk
        i, f = seen["a"], seen["b"]
        d_logf = _revcumsum((term_q - term_k).sum(-1), x.shape[1])
        outputs, grads = [f, i], [d_logf * torch.sigmoid(-f.detach()), term_k.sum(-1)]
    else:  # a = g: per channel (kda) or per head (gated_deltanet, mamba2), within chunks of 64
        g = seen["a"]
        term = term_q - term_k
        outputs, grads = [g], [_revcumsum(term if g.dim() == 4 else term.sum(-1), 64)]
    deltas = torch.autograd.grad(outputs, list(params.values()), grad_outputs=grads, allow_unused=True)
    return {f"d{n}": relative(p.grad + dl, p.grad) for (n, p), dl in zip(params.items(), deltas)
            if dl is not None and dl.abs().sum() > 0}


def mlstm_conventions(student, x: torch.Tensor) -> dict[str, dict[str, float]]:
    """mLSTM, float64: the reference's gradients against the kernel's backward convention, the normaliser
    max(|n.q|, exp(-m)) + eps and the stabiliser m held constant (mlstm_kernels' hand-written backward; see
    harness/mixers/kernels.py, kernel_mlstm), which is exact only through a scale-invariant norm per (token, head)
    (mlstm.py _output: LayerNorm, eps=1e-6). Also the spread of the per-(token, head) variance of h that LayerNorm
    sees, to compare with that eps."""
    def detached_chunk(q, k, v, i, f, *, scale, initial_state=None, chunk_size=64, eps=1e-6):
        # recurrence.chunk_mlstm with m and the normaliser detached once formed
        (batch, length, heads, dk), dtype = q.shape, v.dtype
        q, k, v = (recurrence._to_chunks(t, chunk_size) for t in (q, k, v))
        q = q * scale
        cumf = recurrence._to_chunks(torch.nn.functional.logsigmoid(f.float()), chunk_size).cumsum(-1)
        logi = recurrence._to_chunks(i, chunk_size, pad_value=-float("inf"))
        state = recurrence._mlstm_initial(initial_state, batch, heads, dk, v.shape[-1], q)
        (c0, n0, m0), final = recurrence._mlstm_pass_states(k, v, logi, cumf, state)
        mask = recurrence._causal(chunk_size, False, q.device)
        logd = (cumf.unsqueeze(-1) - cumf.unsqueeze(-2) + logi.unsqueeze(-2)).masked_fill(~mask, -float("inf"))
        m_inter = cumf + m0.unsqueeze(-1)
        m = torch.maximum(m_inter, logd.max(-1).values).detach()
        weights = (q @ k.transpose(-1, -2)) * (logd - m.unsqueeze(-1)).exp()
        q_inter = q * (m_inter - m).exp().unsqueeze(-1)
        num = q_inter @ c0 + weights @ v
        den = (q_inter @ n0.unsqueeze(-1)).squeeze(-1) + weights.sum(-1)
        h = num / (torch.maximum(den.abs(), (-m).exp()) + eps).detach().unsqueeze(-1)
        return recurrence._from_chunks(h, length, dtype), final

    ln = torch.nn.functional.layer_norm
    variances = []

    def ln_watched(t, shape, *args, **kwargs):
        variances.append(t.detach().var(-1, unbiased=False).flatten())
        return ln(t, shape, *args, **kwargs)

    x64 = x.double()
    model = copy.deepcopy(student).to(dtype=torch.float64)
    torch.nn.functional.layer_norm = ln_watched
    try:
        base = _layer_run(copy.deepcopy(model), x64)
    finally:
        torch.nn.functional.layer_norm = ln
    recurrence.chunk_mlstm = detached_chunk
    try:
        run = _layer_run(copy.deepcopy(model), x64)
    finally:
        recurrence.chunk_mlstm = _CHUNKS["chunk_mlstm"]
    var = torch.cat(variances)
    return {"kernel convention vs reference": {what: relative(run[what], base[what]) for what in base},
            "h variance per (token, head), quantiles": {f"q{p:g}": float(var.quantile(p))
                                                        for p in (0.0, 0.01, 0.1, 0.5)}}


def errors(result: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, float]]:
    truth = result["fp64"]
    return {label: {what: relative(r[what], truth[what]) for what in truth}
            for label, r in result.items() if label != "fp64"}


def table(name: str, errs: dict[str, dict[str, float]]) -> None:
    labels = list(errs)
    print(f"\n## {name}: relative error vs float64")
    print(f"{'tensor':<28}" + "".join(f"{lab:>10}" for lab in labels))
    for what in next(iter(errs.values())):
        print(f"{what:<28}" + "".join(f"{errs[lab][what]:>10.2e}" for lab in labels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mixers", nargs="*", default=list(MIXERS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--scale", type=float, default=1.0, help="x is the contract's x times this")
    parser.add_argument("--std", type=float, default=0.2, help="offsets of the new parameters (contract: 0.2)")
    parser.add_argument("--sweep", action="store_true",
                        help="the bf16 floor, qkv16 and the gate identity's error at several inputs instead")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not args.sweep:
        for name in args.mixers:
            start = time.time()
            student = contract_students(name, args.seed, args.std)
            x = contract_x(args.seed, args.length, args.scale)
            errs = errors(runs(student, x))
            setting = f"seed {args.seed}, T={args.length}, x*{args.scale}, std {args.std}"
            table(f"{name} ({setting}; {time.time() - start:.0f} s)", errs)
            gate = gate_identity(student, x, name)
            print("gate gradient by the kernels' identity, dq and dk rounded to bf16: "
                  + ", ".join(f"{w} {e:.2e}" for w, e in gate.items()))
            if name == "mlstm":
                for label, numbers in mlstm_conventions(student, x).items():
                    worst = sorted(numbers.items(), key=lambda kv: -kv[1])[:6] if "vs" in label \
                        else numbers.items()
                    print(f"mlstm {label}: " + ", ".join(f"{w} {e:.2e}" for w, e in worst))
        return
    settings = [(0, 512, 1.0, 0.2), (0, 512, 0.5, 0.2), (0, 512, 0.25, 0.2), (0, 128, 1.0, 0.2), (1, 512, 1.0, 0.2),
                (2, 512, 1.0, 0.2), (0, 512, 1.0, 0.05), (0, 512, 0.25, 0.05), (0, 512, 0.1, 0.05),
                (1, 512, 0.1, 0.05)]
    for name in args.mixers:
        rows = []
        for seed, length, scale, std in settings:
            student = contract_students(name, seed, std)
            x = contract_x(seed, length, scale)
            errs = errors(runs(student, x))
            gate = gate_identity(student, x, name)
            rows.append((f"s{seed} T{length} x*{scale} std{std}", errs, gate))
        whats = [w for w in rows[0][1]["bf16"] if not w.startswith(("do_", "dg_", "dz_", "dv_", "dnorm", "dogate"))]
        print(f"\n## {name}: bf16 vs fp64 | qkv16 vs fp64 | the identity's gate error (the same emulation)")
        print(f"{'setting':<22}" + "".join(f"{w[:20]:>21}" for w in whats))
        for label, errs, gate in rows:
            cells = [f"{errs['bf16'][w]:.1e}|{errs['qkv16'][w]:.0e}" + (f"|{gate[w]:.0e}" if w in gate else "")
                     for w in whats]
            print(f"{label:<22}" + "".join(f"{c:>21}" for c in cells))
            worst32 = max(errs["fp32"].values())
            if worst32 > 1e-3:
                print(f"{'':<22}fp32 vs fp64 worst {worst32:.1e}")

if __name__ == "__main__":
    main()
