"""The stage-3 bench (`bench_step`): the stage-3 distillation step as `harness.stages.distill` runs it, through the
same code: the student (`harness.student.build_student`) wrapped in `DistillModel`, the teacher in `TeacherBody`,
both engines built by `harness.engine` (DeepSpeed ZeRO-3 from `ds_configs/zero3.json` / `zero3_teacher.json` by
default; bf16 on a GPU, fp32 over gloo on a CPU), and each optimizer step is `harness.train.Trainer.train_step`
with stage 3's forward (`harness.stages.distill.DistillForward`): per micro-step the teacher forward, the student
forward + chunked CE/KL loss under a gather of the teacher head, `engine.backward`, `engine.step`; per optimizer
step the reduction of the loss terms and their one read to the host.
Teachers are the SmolLM2 shapes (135M / 360M / 1.7B, or `tiny`) with random weights: a step's time does not
depend on the values, but whether it trained does, so every step's loss and the engine's skipped optimizer steps
are recorded (`losses_each`, `skipped_steps`) and a row with a non-finite loss or a skipped step is marked
(`health`) and meets no target. `--teacher SOURCE` takes a real one. ``zero3=False`` (``--engine plain``) runs
the same step on stage 3's plain engine (deepspeed.student_engine=plain, `harness.plain_engine.PlainEngine`: torch's
fused AdamW on fp32 master copies of the bf16 weights on CUDA; under torchrun torch's DDP, gradients reduced in
fp32).

Reported: tokens/s (input tokens, `micro_batch x seq_len x world` per micro-step, over the measured steps'
wall time), MFU = tokens/s x (6 N_student + 2 N_teacher) / (peak x world) by the usual definition: the peak is
the GPU's datasheet dense bf16 figure (harness.flops; `mfu_measured_peak` divides by the measured 8192^3 matmul
peak instead, see harness.flops), N every distinct parameter, embeddings included, a tied head
once (dense FLOPs only: the mixers' recurrences and the teacher's attention scores are not counted), peak
memory (CUDA max allocated after the models and engines are built, i.e. the training steps' peak; on a CPU the
process's peak RSS), and the breakdown of a step in ms and %:

  teacher_forward      the teacher engine's forward (under ZeRO-3 it includes gathering its layers)
  gather_teacher_head  `gathered([teacher head])` and the student engine's forward prologue
  student_forward      the student body: embeddings .. final norm (includes ZeRO-3 gathers of its layers)
  loss                 the chunked CE + KL: gathers the student head (ZeRO-3), fp32 logits of both heads
                       chunk by chunk, and the gradient w.r.t. the student hidden states and head, which
                       `harness.losses.distill_loss` computes inside its forward (so it is not in backward)
  backward             `engine.backward`: the student body's backward, including ZeRO-3 re-gathers and the
                       gradient reduce-scatter (DeepSpeed overlaps it with compute: not separable here)
  optimizer            `engine.step`: gradient clipping (global norm), AdamW, parameter update
  other                engine epilogues, releasing the teacher head, the step's reduction of the loss terms and
                       their read to the host (a sync)

The phases are stamps taken at fixed points of the step (CUDA events on the compute stream on a GPU,
`time.perf_counter` on a CPU, where execution is synchronous), chained so that they add up to the step.
**Communication** cannot be cut out of those phases: ZeRO-3 gathers and reduce-scatters run on their own
stream inside the forward and backward. A separate profiler pass (`profile_steps`, torch.profiler) measures
it: `comm.comm_ms` is the busy time of communication per step (the union of NCCL kernels on a GPU, of
c10d/gloo ops on a CPU) and, on a GPU, `comm.exposed_ms` the part of it with no compute kernel running at the
same time (what communication adds to the step at most). Both are already inside the phases above.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from harness import flops
from harness.bench.machine import GIB, resolve_device, resolve_dtype, synchronize
from harness.bench.phases import PhaseClock, summarise_phases
from harness.bench.profiling import comm_from_events, profiled, top_ops
from harness.bench.shapes import build_pair, canonical_shape, count_params
from harness.flops import flops_per_token, mfu, resolve_measured_peak

REPO = Path(__file__).resolve().parents[2]


def _instrument(model: nn.Module, clock: PhaseClock) -> list[Any]:
    """Stamps at the student body's start, the loss head's start and end (prepended: before DeepSpeed's own
    pre-forward hooks, so the ZeRO-3 gather of the student head is charged to the loss)."""
    body, head = model.student.model, model.loss_head
    return [
        body.register_forward_pre_hook(lambda m, a: clock.mark("gather_teacher_head"), prepend=True),
        head.register_forward_pre_hook(lambda m, a: clock.mark("student_forward"), prepend=True),
        head.register_forward_hook(lambda m, a, o: clock.mark("loss")),
    ]


@dataclass
class _StepParts:
    s_engine: Any
    t_engine: Any
    model: nn.Module
    teacher_head: nn.Parameter


def _ds_config_path(path: Optional[str], default: str) -> str:
    p = Path(path or default)
    if not p.is_absolute() and not p.exists() and (REPO / p).exists():
        p = REPO / p
    return str(p)


def _build_engines(model: nn.Module, teacher: nn.Module, cfg: Any, world: int, bf16: bool, steps: int,
                   student_ds: Optional[str], teacher_ds: Optional[str], teacher_placement: str = "auto",
                   student_engine: str = "deepspeed", device: Optional[torch.device] = None
                   ) -> tuple[_StepParts, str]:
    """The engines exactly as harness.stages.distill.distill builds them -> (parts, teacher placement)."""
    from harness import engine
    from harness.config import JobConfig
    from harness.schedule import build_scheduler
    from harness.stages.distill import TeacherBody

    job = JobConfig()
    job.deepspeed.student_config = _ds_config_path(student_ds, job.deepspeed.student_config)
    job.deepspeed.teacher_config = _ds_config_path(teacher_ds, job.deepspeed.teacher_config)
    job.deepspeed.teacher_placement = teacher_placement
    s_engine = engine.student_engine(model, engine.student_ds_config(job, cfg, world, bf16),
                                     lambda opt: build_scheduler(opt, cfg, steps), student_engine, device)
    t_body = TeacherBody(teacher, layer_outputs=cfg.hidden_weight > 0)
    t_engine, placement = engine.build_teacher(t_body, job, cfg, world, s_engine.device, bf16)
    return _StepParts(s_engine, t_engine, model, t_body.teacher.lm_head.weight), placement


def _trainer(parts: _StepParts, grad_accum: int, world: int, clock: PhaseClock):
    """Stage 3's loop (`harness.train.Trainer`) on stage 3's forward, with the bench's clock: its `train_step` is the
    step this bench times."""
    from harness.stages.distill import DistillForward
    from harness.train import Trainer

    forward = DistillForward(parts.s_engine, parts.t_engine, parts.teacher_head, clock)
    return Trainer(parts.s_engine, forward, grad_accum=grad_accum, world=world, clock=clock)


def _batches(batches: list[torch.Tensor]):
    """The bench's micro-batches, round and round: what a text loader gives stage 3 (input ids only)."""
    for k in itertools.count():
        yield {"input_ids": batches[k % len(batches)]}


def bench_step(shape: str = "135M", mixer: str = "gated_deltanet", *, micro_batch: int = 8, seq_len: int = 2048,
               steps: int = 20, warmup: int = 3, grad_accum: int = 1, dtype: Optional[str | torch.dtype] = None,
               device: Optional[str | torch.device] = None, zero3: bool = True, teacher_source: Optional[str] = None,
               layers: Optional[int] = None, options: Optional[dict] = None,
               student_ds_config: Optional[str] = None, teacher_ds_config: Optional[str] = None,
               peak_flops: Optional[float] = None, measure_peak: bool = False, profile_steps: int = 2,
               gradient_checkpointing: bool = False, recompute_fraction: float = 1.0,
               teacher_placement: str = "auto", compile_teacher: bool = True, compile_student: bool = False,
               seed: int = 0, attention_layers: Sequence[int] = (), hidden_weight: float = 0.0) -> dict[str, Any]:
    """Time `steps` optimizer steps of stage 3 (after `warmup`) for one teacher shape and mixer (a hybrid with the
    teacher's softmax attention kept in `attention_layers`); see the module
    docstring for what each field means. With zero3, joins (or creates) the process group as stage 3 does
    (`harness.engine.setup_distributed`): under torchrun every rank calls this and the world is the group's.
    Returns a JSON-ready dict (the same on every rank)."""
    from harness import loss_kernel
    from harness.config import DistillConfig
    from harness.engine import compile_student_blocks, compiles_student, compiles_teacher
    from harness.stages.distill import DistillModel
    from harness.losses import token_losses

    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    world, rank = 1, 0
    if zero3 or "RANK" in os.environ:  # under torchrun the plain engine runs data parallel
        from harness.engine import setup_distributed

        rank, world = setup_distributed(device)  # without torchrun: a group of one process
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = DistillConfig(micro_batch_size=micro_batch, grad_accum=grad_accum, schedule="constant",
                        warmup_fraction=0.0, compile_teacher=compile_teacher, compile_student=compile_student,
                        hidden_weight=hidden_weight)
    optimizer_steps = warmup + steps + max(profile_steps, 0)
    shape_name = "custom" if teacher_source else canonical_shape(shape)

    teacher, student = build_pair(shape, mixer, options=options, source=teacher_source, layers=layers,
                                  device=device, teacher_dtype=dtype, seed=seed, attention_layers=attention_layers)
    if gradient_checkpointing:  # stages.distill.gradient_checkpointing (_fraction)
        student.enable_recompute(recompute_fraction)
    student_compiled = compiles_student(cfg, "deepspeed" if zero3 else "plain", device)
    if student_compiled:  # stages.distill.compile_student
        compile_student_blocks(student)
    n_student, n_teacher = count_params(student), count_params(teacher)
    fpt = flops_per_token(n_student, n_teacher)
    vocab = teacher.config.vocab_size
    row: dict[str, Any] = {
        "shape": shape_name, "teacher": teacher_source or f"SmolLM2-{shape_name} shape, random weights",
        "mixer": mixer, "options": dict(options or {}), "attention_layers": sorted(attention_layers),
        "hidden_weight": hidden_weight,
        "engine": "zero3" if zero3 else "plain",
        "layers": teacher.config.num_hidden_layers, "micro_batch": micro_batch, "seq_len": seq_len,
        "grad_accum": grad_accum, "gradient_checkpointing": gradient_checkpointing,
        "recompute_fraction": recompute_fraction if gradient_checkpointing else 0.0, "world": world,
        "dtype": str(dtype).removeprefix("torch."), "device": str(device), "steps": steps, "warmup": warmup,
        "n_student": n_student, "n_teacher": n_teacher, "flops_per_token": fpt,
        "flops_per_token_formula": f"6 x {n_student:,} + 2 x {n_teacher:,} = {fpt:,.0f}",
    }
    model = DistillModel(student, token_losses(cfg.loss_terms()), hidden_weight=cfg.hidden_weight)
    bf16 = dtype == torch.bfloat16
    parts, row["teacher_placement"] = _build_engines(
        model, teacher, cfg, world, bf16, optimizer_steps, student_ds_config, teacher_ds_config,
        teacher_placement if zero3 else "replicated", "deepspeed" if zero3 else "plain", device)
    dev = parts.s_engine.device
    row["teacher_compiled"] = compiles_teacher(cfg, row["teacher_placement"], dev)
    row["student_compiled"] = student_compiled
    row["loss_kernel"] = "triton" if loss_kernel.available(torch.empty(0, device=dev)) else "torch"
    if zero3:
        row["engine"] = f"zero{parts.s_engine.zero_optimization_stage()}"  # ZeRO stage of the student's config
        row["ds_configs"] = [_ds_config_path(student_ds_config, "ds_configs/zero3.json")]
        if row["teacher_placement"] == "zero3":
            row["ds_configs"].append(_ds_config_path(teacher_ds_config, "ds_configs/zero3_teacher.json"))
    del teacher, student
    clock = PhaseClock(dev)
    handles = _instrument(model, clock)
    g = torch.Generator(device="cpu").manual_seed(seed + 1000 + rank)
    batches = _batches([torch.randint(0, vocab, (micro_batch, seq_len), generator=g).to(dev) for _ in range(4)])
    trainer = _trainer(parts, grad_accum, world, clock)

    if dev.type == "cuda":
        row["mem_after_build_gib"] = torch.cuda.memory_allocated(dev) / GIB
        torch.cuda.reset_peak_memory_stats(dev)
    totals: list[float] = []  # each optimizer step's loss (its per-token mean), warm-up included
    norms: list[Optional[float]] = []  # each optimizer step's gradient norm (before clipping), as stage 3 logs it

    def run(n_steps: int) -> dict[str, float]:
        last: dict[str, float] = {}
        for _ in range(n_steps):
            last = trainer.train_step(batches)
            clock.step_done()
            totals.append(last["loss"])
            norm = parts.s_engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
        return last

    try:
        run(warmup)
        synchronize(dev)
        clock.start()
        t0 = time.perf_counter()
        losses = run(steps)
        synchronize(dev)
        wall = time.perf_counter() - t0
        clock.stop()
        per_step = clock.steps()
        row["losses_last"] = {"total": losses.pop("loss"), **losses}  # the last step's total and every term
        row.update(training_health(totals, getattr(parts.s_engine, "skipped_steps", None)))
        row["grad_norms_each"] = norms  # a norm that grows step by step before a NaN is divergence, not a kernel
        row.update(_peak_memory(dev, world))
        if profile_steps > 0:  # the plain engine too: its top operators
            row["comm"] = _profile_comm(trainer, batches, dev, profile_steps)
            row["top_ops"] = row["comm"].pop("top_ops", None)
        elif not zero3 and world == 1:
            row["comm"] = {"comm_ms": 0.0, "method": "plain engine: one process, no communication"}
    finally:
        for h in handles:
            h.remove()
    row.update(_rate_fields(per_step, wall, steps, micro_batch * seq_len * grad_accum * world, world,
                            row.get("comm", {})))
    row.update(mfu_fields(dev, dtype, row["tokens_per_s"], fpt, world, peak_flops, measure_peak))
    row["notes"] = list(NOTES)
    return row


def _peak_memory(dev: torch.device, world: int) -> dict[str, Any]:
    """Peak memory of the steps so far: CUDA's max allocated (and reserved) on a GPU, the process's peak RSS on a
    CPU; over several ranks the largest (the one that has to fit)."""
    if dev.type == "cuda":
        out = {"peak_mem_bytes": int(torch.cuda.max_memory_allocated(dev)),
               "peak_mem_reserved_bytes": int(torch.cuda.max_memory_reserved(dev)),
               "peak_mem_kind": "torch.cuda.max_memory_allocated over warmup + measured steps"}
    else:
        from harness.observe import peak_memory_bytes

        out = {"peak_mem_bytes": peak_memory_bytes(),
               "peak_mem_kind": "peak RSS of the process (ru_maxrss), models and set-up included"}
    if world > 1:
        t = torch.tensor([float(out["peak_mem_bytes"])], dtype=torch.float64, device=dev)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        out["peak_mem_bytes"] = int(t.item())
        out["peak_mem_kind"] += ", max over ranks"
    out["peak_mem_gib"] = out["peak_mem_bytes"] / GIB
    return out


def _rate_fields(per_step: list[dict[str, float]], wall: float, steps: int, tokens_per_step: int, world: int,
                 comm: dict[str, Any]) -> dict[str, Any]:
    """Tokens per step and per second, the step's time (mean and each) and its breakdown by phase, and the GPU's
    busy share (the profiled pass's kernel time over the measured step)."""
    step_ms = wall * 1e3 / max(steps, 1)
    tps = tokens_per_step * steps / wall if wall > 0 else 0.0
    breakdown = summarise_phases(per_step)
    return {
        "tokens_per_step": tokens_per_step, "step_ms": step_ms, "step_ms_each": [sum(s.values()) for s in per_step],
        "tokens_per_s": tps, "tokens_per_s_per_device": tps / world,
        "breakdown_ms": breakdown["ms"], "breakdown_pct": breakdown["pct"], "breakdown_sum_ms": breakdown["sum_ms"],
        # well below 1 = the host cannot feed the GPU
        "gpu_busy": comm["compute_kernel_ms"] / step_ms if step_ms > 0 and "compute_kernel_ms" in comm else None,
    }


NOTES = [  # what every row's fields mean, written into each row
    "tokens = input tokens (micro_batch x seq_len x grad_accum x world per step)",
    "mfu = tokens/s x flops_per_token / (world x datasheet dense bf16 peak); mfu_measured_peak: the same "
    "over the measured matmul peak (harness.flops)",
    "flops_per_token counts dense FLOPs only: 6 x student params + 2 x teacher params (embeddings "
    "included, a tied head once; no attention scores, no recurrences)",
    "loss includes the logits' gradient (computed in the loss forward); backward is the body's",
    "communication is inside teacher_forward / student_forward / loss / backward; see comm",
]


def resolve_peak(device: torch.device, override: Optional[float] = None) -> tuple[Optional[float], str]:
    """(peak FLOP/s per device of `mfu`, where it came from): --peak-flops, else $HARNESS_PEAK_FLOPS or the
    GPU's datasheet dense bf16 peak (harness.flops.resolve_peak, as stage 3 logs MFU); an unknown GPU or a CPU:
    None, and the source says why and what to pass."""
    if override:
        return float(override), "--peak-flops"
    peak = flops.resolve_peak(device)
    return peak.flops, peak.source


def mfu_fields(device: torch.device, dtype: torch.dtype, tokens_per_s: float, flops_per_tok: float, world: int,
               override: Optional[float] = None, measure: bool = False) -> dict[str, Any]:
    """A step row's MFU fields: `mfu` against the datasheet peak (or --peak-flops / $HARNESS_PEAK_FLOPS) and
    `mfu_measured_peak` against the measured matmul peak, each with its per-device peak and source."""
    peak, source = resolve_peak(device, override)
    measured, measured_source = resolve_measured_peak(device, dtype, measure)
    return {"peak_flops_per_device": peak, "peak_flops_source": source,
            "mfu": mfu(tokens_per_s, flops_per_tok, peak, world),
            "measured_peak_flops_per_device": measured, "measured_peak_source": measured_source,
            "mfu_measured_peak": mfu(tokens_per_s, flops_per_tok, measured, world)}


def training_health(totals: list[float], skipped: Optional[int]) -> dict[str, Any]:
    """Whether the timed steps trained: every step's loss finite and no optimizer step skipped for a non-finite
    gradient. A step that produces NaN can run at any speed, so its numbers meet no target (`step_targets`)."""
    finite = all(math.isfinite(x) for x in totals)
    out: dict[str, Any] = {"losses_each": totals, "losses_finite": finite, "skipped_steps": skipped}
    if not finite or skipped:
        first_bad = next((i for i, x in enumerate(totals) if not math.isfinite(x)), None)
        out["health"] = (f"not trained: {skipped or 0} optimizer step(s) skipped for a non-finite gradient; "
                         + ("losses finite" if finite else f"loss not finite from step {first_bad} (warm-up included)"))
    return out


def _profile_comm(trainer: Any, batches: Iterator[dict], dev: torch.device, n: int) -> dict[str, Any]:
    """The profiler pass over `n` optimizer steps (the clock is stopped by then: no stamps)."""
    try:
        synchronize(dev)
        t0 = time.perf_counter()
        prof = profiled(lambda i: trainer.train_step(batches), dev, n)
        out = comm_from_events(prof.events(), dev.type == "cuda", n)
        out["profiled_step_ms"] = (time.perf_counter() - t0) * 1e3 / n
        out["profiled_steps"] = n
        out["top_ops"] = top_ops(prof.key_averages(), n)
        return out
    except Exception as err:  # noqa: BLE001 - the profiler pass is auxiliary
        return {"error": f"{type(err).__name__}: {err}"}
