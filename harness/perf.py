"""`harness bench`: throughput, MFU, memory and where the time goes in a stage-3 step; kernel and decoding speed.

Three measurements (``--what step,kernels,decode``), each a list of rows in one JSON file plus a Markdown table:

* **step** (`bench_step`): the stage-3 distillation step as `harness.stages.distill` runs it: the student
  (`harness.student.build_student`) wrapped in `DistillModel`, the teacher in `TeacherBody`, both DeepSpeed
  ZeRO-3 engines built by `harness.engine` from `ds_configs/zero3.json` / `zero3_teacher.json` (bf16 on a GPU,
  fp32 over gloo on a CPU), one micro-step = teacher forward, student forward + chunked CE/KL loss under a
  gather of the teacher head, `engine.backward`, `engine.step`, and the per-step `.item()` of the losses.
  Teachers are the SmolLM2 shapes (135M / 360M / 1.7B, or `tiny`) with random weights: a step's time does not
  depend on the values, but whether it trained does, so every step's loss and the engine's skipped optimizer steps
  are recorded (`losses_each`, `skipped_steps`) and a row with a non-finite loss or a skipped step is marked
  (`health`) and meets no target. `--teacher SOURCE` takes a real one. ``zero3=False`` (``--engine plain``) runs
  the same step on stage 3's `PlainEngine` (deepspeed.student_engine=plain: torch's fused AdamW on fp32 master copies of
  the bf16 weights on CUDA; data parallel under torchrun, averaging the gradients at each step).

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
    other                engine epilogues, releasing the teacher head, the losses' `.item()` (a sync)

  The phases are stamps taken at fixed points of the step (CUDA events on the compute stream on a GPU,
  `time.perf_counter` on a CPU, where execution is synchronous), chained so that they add up to the step.
  **Communication** cannot be cut out of those phases: ZeRO-3 gathers and reduce-scatters run on their own
  stream inside the forward and backward. A separate profiler pass (`profile_steps`, torch.profiler) measures
  it: `comm.comm_ms` is the busy time of communication per step (the union of NCCL kernels on a GPU, of
  c10d/gloo ops on a CPU) and, on a GPU, `comm.exposed_ms` the part of it with no compute kernel running at the
  same time (what communication adds to the step at most). Both are already inside the phases above.

* **kernels** (`bench_kernels`; CUDA only): for each mixer, one bf16 layer with `backend=kernel` (fla /
  mlstm_kernels Triton kernels) against its PyTorch reference (fp32 and bf16) on the same input: output and
  gradient errors and the median forward+backward time of each, speedup = reference bf16 ms / kernel ms
  (`scripts/gpu_layer_report.py` is a front end to the same code); the same for the recurrence alone
  (`recurrence_speedup`: the layer's `_mix` on fixed q, k, v, without the projections that both paths share), and a
  profile of the kernel layer (`kernel_profile`: device-busy ms, GPU busy share, aten operators, top operators).

* **decode** (`bench_decode`): greedy decoding, batch 1: prefill a context of random tokens, then time
  `new_tokens` one-token steps; the student keeps a `RecurrentCache` (fixed-size state), the teacher a KV
  cache (grows with the context). Reported per context: ms/token, tokens/s, prefill ms, state / KV-cache bytes;
  flatness = ms/token at the longest context / at the shortest (1.0 = flat).

Targets (issue 8; bf16, seq 2048): 135M gated_deltanet step >= 150k tokens/s on one H200 (naive baseline:
26k tok/s at 4.6% MFU, 76 GiB); 1.7B step >= 40% MFU (datasheet peak) with peak memory <= 80 GiB at micro-batch
8 x 2048; every mixer's kernel >= 5x its reference at the 1.7B layout. Results and commands: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import inspect
import json
import math
import os
import platform
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn

from harness import flops
from harness.files import atomic_write_text
from harness.flops import flops_per_token, mfu, resolve_measured_peak

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30

# ------------------------------------------------------------------------------------------------ shapes

_SMOLLM2_COMMON = dict(
    vocab_size=49152, head_dim=64, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5,
    tie_word_embeddings=True, attention_bias=False, mlp_bias=False, initializer_range=0.02,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)

# SmolLM2 teachers as LlamaConfig keyword arguments (HuggingFaceTB/SmolLM2-{135M,360M,1.7B} config.json).
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, hidden_act="silu", max_position_embeddings=8192,
                 rms_norm_eps=1e-5, tie_word_embeddings=True, initializer_range=0.02,
                 rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}),
    "135M": dict(_SMOLLM2_COMMON, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3,
                 rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}),
    "360M": dict(_SMOLLM2_COMMON, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                 num_attention_heads=15, num_key_value_heads=5,
                 rope_parameters={"rope_theta": 100000.0, "rope_type": "default"}),
    "1.7B": dict(_SMOLLM2_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                 num_attention_heads=32, num_key_value_heads=32,
                 rope_parameters={"rope_theta": 130000.0, "rope_type": "default"}),
}


def canonical_shape(name: str) -> str:
    """'135m', 'smollm2-135m', '1.7b' ... -> the SHAPES key; ValueError listing the shapes otherwise."""
    key = name.strip().lower().removeprefix("smollm2-").removeprefix("smollm2_")
    for shape in SHAPES:
        if shape.lower() == key:
            return shape
    raise ValueError(f"unknown shape '{name}'; choose one of {', '.join(SHAPES)} (or pass --teacher SOURCE)")


def shape_config(shape: str, layers: Optional[int] = None):
    """The LlamaConfig of a teacher shape (sdpa attention), optionally cut to its first `layers` layers."""
    from transformers import LlamaConfig

    kw = dict(SHAPES[canonical_shape(shape)])
    if layers:
        kw["num_hidden_layers"] = min(int(layers), kw["num_hidden_layers"])
    return LlamaConfig(**kw, attn_implementation="sdpa")


def llama_param_count(config: Any) -> int:
    """Closed-form parameter count of a Llama causal LM (tied head counted once), from its config alone."""
    h, i, n = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or h // heads
    attn = h * heads * d * 2 + h * kv * d * 2  # q, o; k, v
    if getattr(config, "attention_bias", False):
        attn += heads * d + 2 * kv * d + h
    per_layer = attn + 3 * h * i + 2 * h  # q k v o, gate/up/down, two RMSNorms
    embed = config.vocab_size * h
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return embed + n * per_layer + h + head


def count_params(model: nn.Module) -> int:
    """Distinct parameters (tied ones once), also under ZeRO-3 (see harness.student.count_parameters)."""
    from harness.student import count_parameters

    return count_parameters(model)


# ------------------------------------------------------------------------------------------ FLOPs and MFU


# flops_per_token (6 N_student + 2 N_teacher), mfu, the GPUs' datasheet peaks and the measured matmul peak
# (measure_matmul_peak, resolve_measured_peak) live in harness.flops.


def resolve_peak(device: torch.device, override: Optional[float] = None) -> tuple[Optional[float], str]:
    """(peak FLOP/s per device of `mfu`, where it came from): --peak-flops, else $HARNESS_PEAK_FLOPS or the
    GPU's datasheet dense bf16 peak (harness.flops.resolve_peak, as stage 3 logs MFU); an unknown GPU or a CPU:
    None, and the source says why and what to pass."""
    if override:
        return float(override), "--peak-flops"
    peak = flops.resolve_peak(device)
    return peak.flops, peak.source


# ------------------------------------------------------------------------------------------------ helpers


def _sync(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _dtype(name: Optional[str | torch.dtype], device: torch.device) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
    if name not in table:
        raise ValueError(f"dtype '{name}' is not one of bf16, fp32, auto")
    return table[name]


def _device(device: Optional[str | torch.device]) -> torch.device:
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return d


def _version(module: str) -> str:
    try:
        mod = __import__(module)
        return str(getattr(mod, "__version__", "unknown"))
    except Exception as err:  # noqa: BLE001 - report, never fail
        return f"unavailable: {type(err).__name__}"


def _driver_version() -> Optional[str]:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: Optional[torch.device] = None, argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Where and with what the numbers were taken: command, date, GPU, library versions."""
    device = _device(device)
    meta: dict[str, Any] = {
        "command": " ".join(["harness", "bench", *argv]) if argv is not None else " ".join(sys.argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpu_threads": torch.get_num_threads(),
        "driver": _driver_version() if device.type == "cuda" else None,
    }
    for mod in ("torch", "triton", "fla", "deepspeed", "transformers", "mlstm_kernels"):
        meta[mod] = _version(mod)
    return meta


def _free(*objs: Any) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# -------------------------------------------------------------------------------------- building the pair


def build_teacher(shape: str = "135M", *, source: Optional[str] = None, layers: Optional[int] = None,
                  device: Optional[str | torch.device] = None, dtype: torch.dtype = torch.float32,
                  seed: int = 0) -> nn.Module:
    """A frozen Llama teacher in eval mode on `device`: random weights of a SHAPES config (built directly on the
    device: no download, no CPU initialisation of a 1.7B model), or the real `source` (harness.load_teacher),
    cut to `layers` layers if given."""
    device = _device(device)
    if source:
        from harness.stages.common import truncate
        from harness.teacher import load_teacher

        model = load_teacher(source, dtype=dtype).model
        if layers:
            truncate(model, int(layers))
        model.to(device)
    else:
        from transformers import LlamaForCausalLM

        torch.manual_seed(seed)
        with torch.device(device):
            model = LlamaForCausalLM(shape_config(shape, layers))
        fill_zero_embedding_rows(model)
        model.to(dtype)
    model.eval()
    model.requires_grad_(False)
    return model


@torch.no_grad()
def fill_zero_embedding_rows(model: nn.Module) -> None:
    """Gives a freshly initialised teacher's zeroed padding_idx row the other rows' random values, as a trained
    teacher's rows have: a zero row leaves the student's hidden state exactly zero at that token, and the
    RMSNorms' backward then overflows (runs 16-18; harness.student.warn_zero_embedding_rows)."""
    from harness.student import zero_embedding_rows

    weight = model.get_input_embeddings().weight
    for row in zero_embedding_rows(weight):
        weight[row].normal_(0.0, model.config.initializer_range)


def build_pair(shape: str = "135M", mixer: str = "gated_deltanet", *, options: Optional[dict] = None,
               source: Optional[str] = None, layers: Optional[int] = None,
               device: Optional[str | torch.device] = None, teacher_dtype: torch.dtype = torch.float32,
               seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(teacher in `teacher_dtype`, fp32 student) as stage 3 starts from: the student is built from the fp32
    teacher by `harness.student.build_student` (weights copied, new parameters at their authors' init)."""
    from harness.student import build_student

    device = _device(device)
    teacher = build_teacher(shape, source=source, layers=layers, device=device, dtype=torch.float32, seed=seed)
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs (a 1.7B student on a CPU takes a while)
        student = build_student(teacher, mixer, **(options or {}))
    teacher.to(teacher_dtype)
    return teacher, student


# -------------------------------------------------------------------------------------------- phase clock

PHASES = ("teacher_forward", "gather_teacher_head", "student_forward", "loss", "backward", "optimizer", "other")


class PhaseClock:
    """Stamps at fixed points of a step; the interval ending at a stamp is charged to that stamp's phase.

    On CUDA a stamp is an event recorded on the current stream (read after a synchronize), so intervals are
    the stream's time between the points; on a CPU it is `time.perf_counter()` (execution is synchronous).
    Stamps form one chain, so a step's phases add up to the time from its first stamp to its last.
    """

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.enabled = False
        self._stamps: list[tuple[str, Any]] = []
        self._bounds: list[int] = []  # index of the last stamp of each step

    def mark(self, phase: str) -> None:
        if not self.enabled:
            return
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._stamps.append((phase, ev))
        else:
            self._stamps.append((phase, time.perf_counter()))

    def start(self) -> None:
        """Begin measuring: the first stamp of the chain (its own interval is not charged)."""
        self.enabled = True
        self._stamps, self._bounds = [], []
        self.mark("start")

    def step_done(self) -> None:
        if self.enabled:
            self._bounds.append(len(self._stamps) - 1)

    def stop(self) -> None:
        self.enabled = False

    def steps(self) -> list[dict[str, float]]:
        """ms per phase for each completed step (call after a synchronize)."""
        out: list[dict[str, float]] = []
        prev = 0
        for end in self._bounds:
            phases: dict[str, float] = {}
            for i in range(prev + 1, end + 1):
                name, stamp = self._stamps[i]
                before = self._stamps[i - 1][1]
                ms = before.elapsed_time(stamp) if self.cuda else (stamp - before) * 1e3
                phases[name] = phases.get(name, 0.0) + ms
            out.append(phases)
            prev = end
        return out


def summarise_phases(per_step: list[dict[str, float]]) -> dict[str, Any]:
    """Mean ms per phase over the steps, their % of the mean step, and the sum of the phases."""
    n = max(len(per_step), 1)
    names = [p for p in PHASES if any(p in s for s in per_step)] + sorted(
        {k for s in per_step for k in s} - set(PHASES))
    ms = {p: sum(s.get(p, 0.0) for s in per_step) / n for p in names}
    total = sum(ms.values())
    pct = {p: (100.0 * v / total if total > 0 else 0.0) for p, v in ms.items()}
    return {"ms": ms, "pct": pct, "sum_ms": total}


def _instrument(model: nn.Module, clock: PhaseClock) -> list[Any]:
    """Stamps at the student body's start, the loss head's start and end (prepended: before DeepSpeed's own
    pre-forward hooks, so the ZeRO-3 gather of the student head is charged to the loss)."""
    body, head = model.student.model, model.loss_head
    return [
        body.register_forward_pre_hook(lambda m, a: clock.mark("gather_teacher_head"), prepend=True),
        head.register_forward_pre_hook(lambda m, a: clock.mark("student_forward"), prepend=True),
        head.register_forward_hook(lambda m, a, o: clock.mark("loss")),
    ]


# -------------------------------------------------------------------------------------- communication

COMM_PATTERN = re.compile(r"nccl|gloo|c10d::|all_?gather|reduce_?scatter|all_?reduce|broadcast|record_param_comms",
                          re.IGNORECASE)


def _union_us(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _subtract(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of the (merged, sorted) intervals `a` not covered by the merged, sorted `b`."""
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def comm_from_events(events: Iterable[Any], cuda: bool, steps: int) -> dict[str, Any]:
    """Communication per step from profiler events (FunctionEvent-like: name, device_type, time_range).

    CUDA: comm = union of NCCL kernels; compute = union of the other device kernels; exposed = comm not covered
    by compute. CPU: comm = union of c10d / gloo / collective ops (no compute/comm overlap is measured there).
    """
    from torch.autograd import DeviceType

    comm, compute = [], []
    for e in events:
        rng = getattr(e, "time_range", None)
        if rng is None:
            continue
        on_device = getattr(e, "device_type", DeviceType.CPU) != DeviceType.CPU
        if cuda and not on_device:
            continue
        if not cuda and on_device:
            continue
        is_comm = ("nccl" in e.name.lower()) if cuda else bool(COMM_PATTERN.search(e.name))
        (comm if is_comm else compute).append((float(rng.start), float(rng.end)))
    comm_u = _union_us(comm)
    steps = max(steps, 1)
    out: dict[str, Any] = {"comm_ms": _length(comm_u) / 1e3 / steps, "comm_events": len(comm)}
    if cuda:
        compute_u = _union_us(compute)
        out["compute_kernel_ms"] = _length(compute_u) / 1e3 / steps
        out["exposed_ms"] = _length(_subtract(comm_u, compute_u)) / 1e3 / steps
        out["method"] = ("torch.profiler: union of NCCL kernel intervals per step (comm_ms), of other kernels "
                         "(compute_kernel_ms), and NCCL time with no other kernel running (exposed_ms)")
    else:
        out["method"] = "torch.profiler: union of c10d/gloo collective op intervals on the CPU per step"
    return out


def top_ops(averages: Iterable[Any], steps: int, n: int = 25) -> dict[str, Any]:
    """Where a profiled step's host and device time go, per step: the operators (and DeepSpeed / module hooks
    named by record_function) with the most self CPU time and the most self device time, and how many operators
    the host launched (a step whose kernels leave the GPU idle is bound by that count times the per-op cost)."""
    steps = max(steps, 1)
    rows = []
    for a in averages:
        dev_us = float(getattr(a, "self_device_time_total", 0.0) or getattr(a, "self_cuda_time_total", 0.0) or 0.0)
        rows.append({"name": a.key, "calls": a.count / steps, "self_cpu_ms": a.self_cpu_time_total / 1e3 / steps,
                     "self_device_ms": dev_us / 1e3 / steps})
    aten = [r for r in rows if r["name"].startswith("aten::")]
    return {
        "aten_calls_per_step": sum(r["calls"] for r in aten),
        "self_cpu_ms_per_step": sum(r["self_cpu_ms"] for r in rows),
        "by_self_cpu": sorted(rows, key=lambda r: -r["self_cpu_ms"])[:n],
        "by_self_device": sorted(rows, key=lambda r: -r["self_device_ms"])[:n],
    }


# ------------------------------------------------------------------------------------------ step bench


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
    t_body = TeacherBody(teacher)
    t_engine, placement = engine.build_teacher(t_body, job, cfg, world, s_engine.device, bf16)
    return _StepParts(s_engine, t_engine, model, t_body.teacher.lm_head.weight), placement


def _micro_step(parts: _StepParts, ids: torch.Tensor, clock: PhaseClock) -> list[float]:
    """One micro-step of stage 3 (the body of the loop in harness.stages.distill.distill), with stamps. The engine
    accumulates, clips and steps at the boundary, as in stage 3."""
    from harness.engine import gathered

    with torch.no_grad():
        t_hidden = parts.t_engine(ids)
    clock.mark("teacher_forward")
    with gathered([parts.teacher_head]):  # body pre-hook: gather_teacher_head; loss hooks: student_forward, loss
        losses = parts.s_engine(ids, t_hidden, parts.teacher_head, None)
    clock.mark("other")
    parts.s_engine.backward(losses.total)
    clock.mark("backward")
    parts.s_engine.step()
    clock.mark("optimizer")
    values = [losses.total.item(), losses.ce.item(), losses.kl.item()]  # stage 3 logs these: a sync per step
    clock.mark("other")
    return values


def bench_step(shape: str = "135M", mixer: str = "gated_deltanet", *, micro_batch: int = 8, seq_len: int = 2048,
               steps: int = 20, warmup: int = 3, grad_accum: int = 1, dtype: Optional[str | torch.dtype] = None,
               device: Optional[str | torch.device] = None, zero3: bool = True, teacher_source: Optional[str] = None,
               layers: Optional[int] = None, options: Optional[dict] = None,
               student_ds_config: Optional[str] = None, teacher_ds_config: Optional[str] = None,
               peak_flops: Optional[float] = None, measure_peak: bool = False, profile_steps: int = 2,
               gradient_checkpointing: bool = False, recompute_fraction: float = 1.0,
               teacher_placement: str = "auto", compile_teacher: bool = True, seed: int = 0) -> dict[str, Any]:
    """Time `steps` optimizer steps of stage 3 (after `warmup`) for one teacher shape and mixer; see the module
    docstring for what each field means. With zero3, joins (or creates) the process group as stage 3 does
    (`harness.engine.setup_distributed`): under torchrun every rank calls this and the world is the group's.
    Returns a JSON-ready dict (the same on every rank)."""
    from harness import loss_kernel
    from harness.config import DistillConfig
    from harness.engine import compiles_teacher
    from harness.stages.distill import DistillModel

    device = _device(device)
    dtype = _dtype(dtype, device)
    world, rank = 1, 0
    if zero3 or "RANK" in os.environ:  # under torchrun the plain engine runs data parallel
        from harness.engine import setup_distributed

        rank, world = setup_distributed(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg = DistillConfig(micro_batch_size=micro_batch, grad_accum=grad_accum, schedule="constant",
                        warmup_fraction=0.0, compile_teacher=compile_teacher)
    micro_steps = (warmup + steps) * grad_accum + max(profile_steps, 0)
    shape_name = "custom" if teacher_source else canonical_shape(shape)

    teacher, student = build_pair(shape, mixer, options=options, source=teacher_source, layers=layers,
                                  device=device, teacher_dtype=dtype, seed=seed)
    if gradient_checkpointing:  # stages.distill.gradient_checkpointing (_fraction)
        student.enable_recompute(recompute_fraction)
    n_student, n_teacher = count_params(student), count_params(teacher)
    fpt = flops_per_token(n_student, n_teacher)
    vocab = teacher.config.vocab_size
    row: dict[str, Any] = {
        "shape": shape_name, "teacher": teacher_source or f"SmolLM2-{shape_name} shape, random weights",
        "mixer": mixer, "options": dict(options or {}), "engine": "zero3" if zero3 else "plain",
        "layers": teacher.config.num_hidden_layers, "micro_batch": micro_batch, "seq_len": seq_len,
        "grad_accum": grad_accum, "gradient_checkpointing": gradient_checkpointing,
        "recompute_fraction": recompute_fraction if gradient_checkpointing else 0.0, "world": world,
        "dtype": str(dtype).removeprefix("torch."), "device": str(device), "steps": steps, "warmup": warmup,
        "n_student": n_student, "n_teacher": n_teacher, "flops_per_token": fpt,
        "flops_per_token_formula": f"6 x {n_student:,} + 2 x {n_teacher:,} = {fpt:,.0f}",
    }
    model = DistillModel(student, cfg.ce_weight, cfg.kl_weight, cfg.temperature)
    bf16 = dtype == torch.bfloat16
    parts, row["teacher_placement"] = _build_engines(
        model, teacher, cfg, world, bf16, micro_steps, student_ds_config, teacher_ds_config,
        teacher_placement if zero3 else "replicated", "deepspeed" if zero3 else "plain", device)
    dev = parts.s_engine.device
    row["teacher_compiled"] = compiles_teacher(cfg, row["teacher_placement"], dev)
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
    batches = [torch.randint(0, vocab, (micro_batch, seq_len), generator=g).to(dev) for _ in range(4)]

    if dev.type == "cuda":
        row["mem_after_build_gib"] = torch.cuda.memory_allocated(dev) / GIB
        torch.cuda.reset_peak_memory_stats(dev)
    k = 0

    totals: list[float] = []  # each optimizer step's last total loss, warm-up included
    norms: list[Optional[float]] = []  # each optimizer step's gradient norm (before clipping), as stage 3 logs it

    def run(n_steps: int) -> list[float]:
        nonlocal k
        last: list[float] = []
        for _ in range(n_steps):
            for _ in range(grad_accum):
                last = _micro_step(parts, batches[k % len(batches)], clock)
                k += 1
            clock.step_done()
            totals.append(last[0])
            norm = parts.s_engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
        return last

    try:
        run(warmup)
        _sync(dev)
        clock.start()
        t0 = time.perf_counter()
        losses = run(steps)
        _sync(dev)
        wall = time.perf_counter() - t0
        clock.stop()
        per_step = clock.steps()
        row["losses_last"] = dict(zip(("total", "ce", "kl"), losses))
        row.update(training_health(totals, getattr(parts.s_engine, "skipped_steps", None)))
        row["grad_norms_each"] = norms  # a norm that grows step by step before a NaN is divergence, not a kernel
        if dev.type == "cuda":
            row["peak_mem_bytes"] = int(torch.cuda.max_memory_allocated(dev))
            row["peak_mem_reserved_bytes"] = int(torch.cuda.max_memory_reserved(dev))
            row["peak_mem_kind"] = "torch.cuda.max_memory_allocated over warmup + measured steps"
        else:
            from harness.observe import peak_memory_bytes

            row["peak_mem_bytes"] = peak_memory_bytes()
            row["peak_mem_kind"] = "peak RSS of the process (ru_maxrss), models and set-up included"
        if world > 1:  # the largest rank's peak (the one that has to fit)
            t = torch.tensor([float(row["peak_mem_bytes"])], dtype=torch.float64, device=dev)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            row["peak_mem_bytes"] = int(t.item())
            row["peak_mem_kind"] += ", max over ranks"
        row["peak_mem_gib"] = row["peak_mem_bytes"] / GIB
        if profile_steps > 0:  # the plain engine too: its top operators
            row["comm"] = _profile_comm(parts, batches, dev, profile_steps)
            row["top_ops"] = row["comm"].pop("top_ops", None)
        elif not zero3 and world == 1:
            row["comm"] = {"comm_ms": 0.0, "method": "plain engine: one process, no communication"}
    finally:
        for h in handles:
            h.remove()
    tokens_per_step = micro_batch * seq_len * grad_accum * world
    step_ms = wall * 1e3 / max(steps, 1)
    tps = tokens_per_step * steps / wall if wall > 0 else 0.0
    breakdown = summarise_phases(per_step)
    row.update({
        "tokens_per_step": tokens_per_step, "step_ms": step_ms, "step_ms_each": [sum(s.values()) for s in per_step],
        "tokens_per_s": tps, "tokens_per_s_per_device": tps / world,
        **mfu_fields(dev, dtype, tps, fpt, world, peak_flops, measure_peak),
        "breakdown_ms": breakdown["ms"], "breakdown_pct": breakdown["pct"], "breakdown_sum_ms": breakdown["sum_ms"],
        # kernel time (profiled pass) over the measured step: well below 1 = the host cannot feed the GPU
        "gpu_busy": (row["comm"]["compute_kernel_ms"] / step_ms
                     if step_ms > 0 and "compute_kernel_ms" in row.get("comm", {}) else None),
        "notes": [
            "tokens = input tokens (micro_batch x seq_len x grad_accum x world per step)",
            "mfu = tokens/s x flops_per_token / (world x datasheet dense bf16 peak); mfu_measured_peak: the same "
            "over the measured matmul peak (harness.flops)",
            "flops_per_token counts dense FLOPs only: 6 x student params + 2 x teacher params (embeddings "
            "included, a tied head once; no attention scores, no recurrences)",
            "loss includes the logits' gradient (computed in the loss forward); backward is the body's",
            "communication is inside teacher_forward / student_forward / loss / backward; see comm",
        ],
    })
    return row


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


def profiled(fn: Callable[[int], Any], device: torch.device, reps: int):
    """torch.profiler (CPU, and CUDA on a GPU) over `fn(0) .. fn(reps - 1)`, synchronised at the end."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(reps):
            fn(i)
        _sync(device)
    return prof


def _profile_comm(parts: _StepParts, batches: list[torch.Tensor], dev: torch.device, n: int) -> dict[str, Any]:
    clock = PhaseClock(dev)  # disabled: no stamps
    try:
        _sync(dev)
        t0 = time.perf_counter()
        prof = profiled(lambda i: _micro_step(parts, batches[i % len(batches)], clock), dev, n)
        out = comm_from_events(prof.events(), dev.type == "cuda", n)
        out["profiled_step_ms"] = (time.perf_counter() - t0) * 1e3 / n
        out["profiled_steps"] = n
        out["top_ops"] = top_ops(prof.key_averages(), n)
        return out
    except Exception as err:  # noqa: BLE001 - the profiler pass is auxiliary
        return {"error": f"{type(err).__name__}: {err}"}


# ------------------------------------------------------------------------------------------ kernel bench


def layer_shape(shape: str):
    """The MixerShape of a teacher shape's attention (the head layout the mixers keep)."""
    from harness.mixers import MixerShape

    return MixerShape.from_config(shape_config(shape))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||."""
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def build_layer(name: str, shape, backend: str, dtype: torch.dtype, seed: int = 0, device: str = "cuda"):
    """One mixer layer with new parameters at their init and Q/K/V/O ~ N(0, 1/hidden)."""
    from harness.mixers import mixer_class, mixer_options

    torch.manual_seed(seed)
    layer = mixer_class(name)(shape, mixer_options(name, {"backend": backend}))
    layer.reset_new_parameters()
    with torch.no_grad():  # realistic scale for the copied projections
        for proj in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj):
            proj.weight.normal_(0, shape.hidden_size**-0.5)
    return layer.to(device, dtype)


def fwd_bwd(layer: nn.Module, x: torch.Tensor):
    x = x.detach().requires_grad_(True)
    y, _ = layer(x)
    y.float().square().mean().backward()
    return y, x.grad


def median_ms(fn: Callable[[], Any], device: torch.device, reps: int = 10) -> float:
    """Median ms of `fn()` over `reps` after 2 warm-ups (CUDA events; perf_counter on a CPU)."""
    cuda = device.type == "cuda"
    for _ in range(2):
        fn()
    _sync(device)
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def layer_pass(layer: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """forward+backward of the whole layer (projections, recurrence, gates, norms), gradients reset first."""

    def once():
        layer.zero_grad(set_to_none=True)
        fwd_bwd(layer, x)

    return once


def time_fwd_bwd(layer: nn.Module, x: torch.Tensor, reps: int = 10) -> float:
    """Median forward+backward ms of the whole layer."""
    return median_ms(layer_pass(layer, x), x.device, reps)


def recurrence_pass(layer: nn.Module, x: torch.Tensor, backend: str) -> Callable[[], None]:
    """forward+backward of the layer's recurrence alone (`_mix`: its gates, feature maps, normaliser and the
    recurrence itself) on fixed q, k, v from the layer's projections, without projections or output norm."""
    with torch.no_grad():
        q, k, v, _ = layer.project_qkv(x, None, False)
    qkv = [t.detach().contiguous().requires_grad_(True) for t in (q, k, v)]

    def once():
        layer.zero_grad(set_to_none=True)
        for t in qkv:
            t.grad = None
        o, _ = layer._mix(x, *qkv, None, backend)
        o.float().square().mean().backward()

    return once


def profile_pass(fn: Callable[[], Any], device: torch.device, reps: int = 3, n: int = 10) -> dict[str, Any]:
    """torch.profiler over `reps` calls of `fn`: device-kernel busy ms per call (CUDA), aten operators launched,
    and the operators with the most self device time (self CPU time on a CPU)."""
    cuda = device.type == "cuda"
    fn()
    _sync(device)
    prof = profiled(lambda _: fn(), device, reps)
    ops = top_ops(prof.key_averages(), reps, n)
    key, by = ("self_device_ms", "by_self_device") if cuda else ("self_cpu_ms", "by_self_cpu")
    out = {"aten_calls": ops["aten_calls_per_step"],
           "top_ops": [{"name": r["name"][:90], "calls": r["calls"], "ms": round(r[key], 4)} for r in ops[by]],
           "top_ops_by": key}
    if cuda:
        out["device_busy_ms"] = comm_from_events(prof.events(), True, reps)["compute_kernel_ms"]
    return out


def compare_layer(name: str, layout: str, batch: int, seq: int, reference_reps: int = 3, *,
                  backend: str = "kernel", device: str = "cuda", profile: bool = True) -> dict[str, Any]:
    """Kernel (bf16) vs reference (fp32 oracle, and bf16 floor) for one mixer at one head layout, on CUDA: the
    whole layer's errors and times, the recurrence's times alone (`recurrence_pass`), and with `profile` where
    the kernel layer's time goes (`profile_pass`). (`backend`/`device` exist for the CPU test of this code:
    backend=reference, device=cpu.)"""
    shape = layer_shape(layout)
    kernel = build_layer(name, shape, backend, torch.bfloat16, device=device)
    ref = build_layer(name, shape, "reference", torch.float32, device=device)
    ref.load_state_dict({k: v.float() for k, v in kernel.state_dict().items()})
    torch.manual_seed(1)
    x = torch.randn(batch, seq, shape.hidden_size, device=device, dtype=torch.bfloat16)
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
    ref_bf16 = build_layer(name, shape, "reference", torch.bfloat16, device=device)
    ref_bf16.load_state_dict(kernel.state_dict())
    yb, gxb = fwd_bwd(ref_bf16, x)  # the bf16 floor: the PyTorch reference run on bf16 weights and inputs
    row["ref_bf16_out_rel_err"], row["ref_bf16_dx_rel_err"] = rel(yb, yr), rel(gxb, gxr)
    del yr, gxr, yb, gxb
    row["kernel_ms"] = time_fwd_bwd(kernel, x)
    row["reference_bf16_ms"] = time_fwd_bwd(ref_bf16, x, reps=reference_reps)
    row["speedup"] = row["reference_bf16_ms"] / row["kernel_ms"]
    dev = torch.device(device)
    row["recurrence_kernel_ms"] = median_ms(recurrence_pass(kernel, x, backend), dev)
    row["recurrence_reference_ms"] = median_ms(recurrence_pass(ref_bf16, x, "reference"), dev, reference_reps)
    row["recurrence_speedup"] = row["recurrence_reference_ms"] / row["recurrence_kernel_ms"]
    if profile:
        prof = profile_pass(layer_pass(kernel, x), dev)
        if "device_busy_ms" in prof:  # below 1: the host, not the GPU, sets the layer's time
            prof["gpu_busy"] = prof["device_busy_ms"] / row["kernel_ms"]
        row["kernel_profile"] = prof
    if torch.device(device).type == "cuda":
        row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / GIB
    return row


def bench_kernels(layouts: Sequence[str] = ("1.7B",), mixers: Optional[Sequence[str]] = None, *, batch: int = 8,
                  seq: int = 2048, variants: Sequence[str] = (), max_seconds: float = 1e9,
                  on_row: Optional[Callable[[dict], None]] = None) -> list[dict[str, Any]]:
    """`compare_layer` for every mixer (and NAME@CASE=ROUTE variant, run with $HARNESS_FLA_ROUTES set) at each
    layout; one failing row is recorded with its error and does not stop the others. CUDA only."""
    from harness.mixers import MIXERS

    if not torch.cuda.is_available():
        raise RuntimeError("the kernel bench needs CUDA: the fla / mlstm_kernels kernels are Triton (GPU only)")
    began = time.time()
    mixers = list(mixers or MIXERS)
    layouts = [canonical_shape(x) for x in layouts]
    plan = [(layouts[0], spec) for spec in [*mixers, *filter(None, variants)]]
    plan += [(layout, spec) for layout in layouts[1:] for spec in mixers]
    rows: list[dict[str, Any]] = []
    saved_routes = os.environ.get("HARNESS_FLA_ROUTES")
    try:
        for layout, spec in plan:
            if time.time() - began > max_seconds:
                row = {"mixer": spec, "layout": layout, "error": "not run: --max-seconds reached"}
            else:
                name, _, routes = spec.partition("@")
                os.environ["HARNESS_FLA_ROUTES"] = routes
                torch.cuda.reset_peak_memory_stats()
                try:
                    row = compare_layer(name, layout, batch, seq)
                except Exception as err:  # noqa: BLE001 - one failing mixer must not hide the others
                    row = {"layout": layout, "error": f"{type(err).__name__}: {err}",
                           "trace": traceback.format_exc(limit=6)}
                row["mixer"] = spec
                torch.cuda.empty_cache()
            rows.append(row)
            if on_row is not None:
                on_row(row)
    finally:
        if saved_routes is None:
            os.environ.pop("HARNESS_FLA_ROUTES", None)
        else:
            os.environ["HARNESS_FLA_ROUTES"] = saved_routes
    return rows


def kernel_table(rows: list[dict[str, Any]]) -> str:
    """The layer report's Markdown table (errors, bf16 floor, times, speedup; the recurrence alone; GPU busy)."""
    lines = ["| mixer | layout | out err | dx err | max param-grad err (param) | bf16-reference out / dx err | "
             "kernel ms | reference ms | speedup | recurrence kernel / reference ms | recurrence speedup | "
             "GPU busy |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mixer']} | {r['layout']} | error: {r['error'][:80]} |||||||||||")
            continue
        busy = (r.get("kernel_profile") or {}).get("gpu_busy")
        lines.append(f"| {r['mixer']} | {r['layout']} | {r['out_rel_err']:.2e} | {r['dx_rel_err']:.2e} | "
                     f"{r['max_param_grad_rel_err']:.2e} ({r['worst_param']}) | "
                     f"{r['ref_bf16_out_rel_err']:.1e} / {r['ref_bf16_dx_rel_err']:.1e} | {r['kernel_ms']:.2f} | "
                     f"{r['reference_bf16_ms']:.2f} | {r['speedup']:.1f}x | {r['recurrence_kernel_ms']:.2f} / "
                     f"{r['recurrence_reference_ms']:.2f} | {r['recurrence_speedup']:.1f}x | "
                     f"{'-' if busy is None else f'{busy:.0%}'} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ decode bench


def _kv_cache_bytes(cache: Any) -> Optional[int]:
    """Bytes held by a transformers KV cache (DynamicCache layers' keys/values), None if not readable."""
    total, found = 0, False
    for layer in getattr(cache, "layers", None) or []:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
                found = True
    return total if found else None


def _output_cache(out: Any) -> Any:
    """The KV cache of a transformers output: `cache` (transformers >= 5.2x) or `past_key_values`."""
    for name in ("cache", "past_key_values"):
        value = out.get(name) if hasattr(out, "get") else getattr(out, name, None)
        if value is not None:
            return value
    raise RuntimeError("the teacher returned no KV cache (use_cache=True)")


@torch.no_grad()
def decode_timing(model: nn.Module, ids: torch.Tensor, new_tokens: int, warmup_tokens: int = 2,
                  recurrent: bool = True, graphs: bool = False) -> dict[str, Any]:
    """Prefill `ids`, then `warmup_tokens` + `new_tokens` greedy one-token steps; ms per timed token.

    recurrent: a harness student with a RecurrentCache; else a transformers model with its KV cache.
    graphs: the student's step captured as a CUDA graph (harness.decoding; capture time reported apart).
    The timed loop does not synchronize per token (the argmax feeds the next step on the device).
    """
    from harness.decoding import GraphedStep
    from harness.student import RecurrentCache

    dev = ids.device
    _sync(dev)
    t0 = time.perf_counter()
    if recurrent:
        cache = RecurrentCache(model.config.num_hidden_layers)
        out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
    else:
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = _output_cache(out)
        cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(dev)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    graphed, capture_ms = None, None
    if recurrent and graphs:
        t0 = time.perf_counter()
        graphed = GraphedStep(model, cache)
        _sync(dev)
        capture_ms = (time.perf_counter() - t0) * 1e3

    def step(tok: torch.Tensor) -> torch.Tensor:
        nonlocal cache
        if graphed is not None:
            return graphed(tok).argmax(-1, keepdim=True)
        if recurrent:
            o = model(tok, cache=cache, use_cache=True)
        else:
            o = model(input_ids=tok, use_cache=True, **{cache_kw: cache})
            cache = _output_cache(o)
        return o.logits[:, -1].argmax(-1, keepdim=True)

    for _ in range(warmup_tokens):
        nxt = step(nxt)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        nxt = step(nxt)
    _sync(dev)
    ms = (time.perf_counter() - t0) * 1e3 / max(new_tokens, 1)
    state = cache.state_bytes() if recurrent else _kv_cache_bytes(cache)
    return {"ms_per_token": ms, "tokens_per_s": ids.shape[0] * 1e3 / ms if ms > 0 else 0.0,
            "prefill_ms": prefill_ms, "state_bytes": state, "cuda_graph": graphed is not None,
            **({"graph_capture_ms": capture_ms} if graphed is not None else {})}


def bench_decode(shape: str = "135M", mixer: str = "gated_deltanet", *, contexts: Sequence[int] = (1024, 8192, 32768),
                 new_tokens: int = 64, warmup_tokens: int = 4, batch: int = 1,
                 dtype: Optional[str | torch.dtype] = None, device: Optional[str | torch.device] = None,
                 teacher_source: Optional[str] = None, layers: Optional[int] = None,
                 options: Optional[dict] = None, teacher: bool = True, seed: int = 0) -> dict[str, Any]:
    """Per-token decoding time of the student (recurrent state) and the teacher (KV cache) at each context.
    On CUDA the student is timed with its step as a CUDA graph (`student`, as NIAH decodes) and eagerly
    (`student_eager`); elsewhere `student` is eager.

    Returns {"shape", "mixer", ..., "rows": [{context, student: {...}, teacher: {...}, speedup}],
    "student_flatness", "teacher_flatness"} with flatness = ms/token at the longest context / at the shortest.
    Contexts beyond the teacher's max_position_embeddings are timed all the same (rope extrapolates; the
    numbers are about time, not quality) and flagged.
    """
    device = _device(device)
    dtype = _dtype(dtype, device)
    t_model, student = build_pair(shape, mixer, options=options, source=teacher_source, layers=layers,
                                  device=device, teacher_dtype=dtype, seed=seed)
    student.to(dtype).eval()
    from harness.decoding import graphable

    graphs = graphable(student)
    vocab, max_pos = t_model.config.vocab_size, t_model.config.max_position_embeddings
    g = torch.Generator(device="cpu").manual_seed(seed + 7)
    warm = torch.randint(0, vocab, (batch, 64), generator=g).to(device)
    for model, recurrent in ((student, True), (t_model, False)):  # first calls (Triton compiles) untimed
        if recurrent or teacher:
            decode_timing(model, warm, 2, 1, recurrent=recurrent)
    rows = []
    for ctx in sorted(int(c) for c in contexts):
        ids = torch.randint(0, vocab, (batch, ctx), generator=g).to(device)
        row: dict[str, Any] = {"context": ctx}
        runs = [("student", student, True, graphs)] + ([("student_eager", student, True, False)] if graphs else [])
        for label, model, recurrent, graphed in runs + [("teacher", t_model, False, False)]:
            if label == "teacher" and not teacher:
                continue
            try:
                row[label] = decode_timing(model, ids, new_tokens, warmup_tokens, recurrent=recurrent, graphs=graphed)
            except Exception as err:  # noqa: BLE001 - e.g. out of memory at the longest context
                row[label] = {"error": f"{type(err).__name__}: {err}"}
            _free()
        if ctx > max_pos:
            row["teacher_beyond_trained_context"] = True
        s, t = row.get("student", {}), row.get("teacher", {})
        if "ms_per_token" in s and "ms_per_token" in t and s["ms_per_token"] > 0:
            row["speedup"] = t["ms_per_token"] / s["ms_per_token"]
        rows.append(row)
    out: dict[str, Any] = {
        "shape": "custom" if teacher_source else canonical_shape(shape), "mixer": mixer,
        "options": dict(options or {}), "layers": t_model.config.num_hidden_layers, "batch": batch,
        "dtype": str(dtype).removeprefix("torch."), "device": str(device), "new_tokens": new_tokens, "rows": rows,
    }
    for label in ("student", "student_eager", "teacher"):
        if any(label in r for r in rows):
            out[f"{label}_flatness"] = flatness([r.get(label, {}).get("ms_per_token") for r in rows])
    _free(t_model, student)
    return out


def flatness(ms_per_token: Sequence[Optional[float]]) -> Optional[float]:
    """ms/token at the longest context over the shortest (inputs ordered by context); None if either is missing."""
    vals = list(ms_per_token)
    if len(vals) < 2 or not vals[0] or not vals[-1]:
        return None
    return vals[-1] / vals[0]


# -------------------------------------------------------------------------------------------- targets

FLAT_TOLERANCE = 1.25  # decoding is "flat in context" when ms/token at 32k is within 25% of that at 1k


def step_targets(row: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue-8 targets that apply to a step row (bf16, seq 2048, the named shape / mixer)."""
    out: list[dict[str, Any]] = []
    if row.get("dtype") != "bfloat16" or row.get("seq_len") != 2048 or "tokens_per_s" not in row:
        return out
    if "health" in row:  # a step that did not train: its speed is no evidence
        return [{"target": "the timed steps trained (finite losses, no skipped step)", "value": row["health"],
                 "met": False}]
    if row["shape"] == "135M" and row["mixer"] == "gated_deltanet" and row.get("world") == 1:
        out.append({"target": "135M gated_deltanet >= 150k tokens/s on one H200", "value": row["tokens_per_s"],
                    "met": row["tokens_per_s"] >= 150_000})
    if row["shape"] == "1.7B" and row.get("micro_batch") == 8:
        if row.get("mfu") is not None:
            out.append({"target": "1.7B >= 40% MFU (datasheet peak)", "value": row["mfu"],
                        "met": row["mfu"] >= 0.40})
        if row.get("peak_mem_kind", "").startswith("torch.cuda"):
            out.append({"target": "1.7B peak memory <= 80 GiB at micro-batch 8 x 2048", "value": row["peak_mem_gib"],
                        "met": row["peak_mem_gib"] <= 80})
    return out


def kernel_targets(row: dict[str, Any]) -> list[dict[str, Any]]:
    if row.get("layout") != "1.7B" or "speedup" not in row:
        return []
    return [{"target": "kernel >= 5x reference at the 1.7B layout", "value": row["speedup"],
             "met": row["speedup"] >= 5.0}]


def decode_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    f = result.get("student_flatness")
    if f is None or result.get("shape") == "tiny":
        return []
    return [{"target": f"student ms/token flat in context (longest / shortest <= {FLAT_TOLERANCE})", "value": f,
             "met": f <= FLAT_TOLERANCE}]


# ------------------------------------------------------------------------------------------ reporting


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _bytes(n: Optional[int]) -> str:
    if not n:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _recompute_label(row: dict[str, Any]) -> str:
    """'' without recomputation, '+ckpt' for every block, '+ckpt0.25' for a share."""
    if not row.get("gradient_checkpointing"):
        return ""
    fraction = row.get("recompute_fraction", 1.0)
    return "+ckpt" if fraction >= 1.0 else f"+ckpt{fraction:g}"


MFU_LEGEND = ("MFU = tokens/s x (6 N_student + 2 N_teacher) / (world x the GPU's datasheet dense bf16 peak, "
              "e.g. 989 TFLOP/s for an H100 / H200 SXM; or --peak-flops / $HARNESS_PEAK_FLOPS); MFU (measured "
              "peak): the same over the measured 8192^3 bf16 matmul peak (788 TFLOP/s on our H200). "
              "Each row's peaks and their sources are in the JSON.")


def markdown(results: dict[str, Any]) -> str:
    """The results as Markdown: environment, step table + breakdown, kernel table, decode table, targets."""
    meta = results.get("meta", {})
    lines = [f"`{meta.get('command', '')}`", "",
             f"{meta.get('gpu') or meta.get('device')} x {meta.get('world', 1)}; torch {meta.get('torch')}, "
             f"triton {meta.get('triton')}, fla {meta.get('fla')}, deepspeed {meta.get('deepspeed')}, "
             f"transformers {meta.get('transformers')}; {meta.get('date')}", ""]
    steps = results.get("step") or []
    if steps:
        lines += ["### Stage-3 step", "",
                  "| shape | mixer | engine | teacher | batch x seq x world | tokens/s | MFU | MFU (measured peak) | "
                  "peak GiB | step ms | " + " | ".join(PHASES) + " | comm ms (exposed) | GPU busy |",
                  "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(PHASES) + "---|---|"]
        for r in steps:
            if "error" in r:
                lines.append(f"| {r.get('shape')} | {r.get('mixer')} | error: {r['error'][:100]} |")
                continue
            pct = r["breakdown_pct"]
            ms = r["breakdown_ms"]
            phases = " | ".join(f"{ms.get(p, 0):.1f} ({pct.get(p, 0):.0f}%)" for p in PHASES)
            comm = r.get("comm", {})
            comm_s = "-" if "comm_ms" not in comm else (
                f"{comm['comm_ms']:.1f}" + (f" ({comm['exposed_ms']:.1f})" if "exposed_ms" in comm else ""))
            m = " | ".join("-" if r.get(k) is None else f"{100 * r[k]:.1f}%" for k in ("mfu", "mfu_measured_peak"))
            engine = r["engine"] + _recompute_label(r)
            busy = "-" if r.get("gpu_busy") is None else f"{100 * r['gpu_busy']:.0f}%"
            lines.append(f"| {r['shape']} | {r['mixer']} | {engine} | {r.get('teacher_placement', '-')} | "
                         f"{r['micro_batch']} x {r['seq_len']} x "
                         f"{r['world']} | {r['tokens_per_s']:,.0f} | {m} | {r['peak_mem_gib']:.1f} | "
                         f"{r['step_ms']:.1f} | {phases} | {comm_s} | {busy} |")
        lines += ["", MFU_LEGEND, ""]
        lines += [f"**{r['shape']} {r['mixer']}: no MFU: {r['peak_flops_source']}**" for r in steps
                  if "error" not in r and r.get("mfu") is None and str(r.get("device", "")).startswith("cuda")]
        lines += [f"**{r['shape']} {r['mixer']}: {r['health']}** (losses per step: {r['losses_each']})" for r in steps
                  if "health" in r] + [""]
    kernels = results.get("kernels") or []
    if kernels:
        lines += ["### Kernels vs PyTorch reference (forward + backward)", "", kernel_table(kernels), ""]
    decodes = results.get("decode") or []
    if decodes:
        lines += ["### Decoding (batch 1, ms per token)", "",
                  "| shape | mixer | context | student ms/token | student eager | teacher ms/token | teacher / student | "
                  "student state | teacher KV cache |", "|---|---|---|---|---|---|---|---|---|"]
        for d in decodes:
            if "error" in d:
                lines.append(f"| {d.get('shape')} | {d.get('mixer')} | error: {d['error'][:100]} |")
                continue
            for r in d["rows"]:
                s, e, t = r.get("student", {}), r.get("student_eager", {}), r.get("teacher", {})
                mib = lambda x: _bytes(x.get("state_bytes"))  # noqa: E731
                graph = " (graph)" if s.get("cuda_graph") else ""
                lines.append(f"| {d['shape']} | {d['mixer']} | {r['context']} | {_fmt(s.get('ms_per_token'), '.2f')}"
                             f"{graph} | {_fmt(e.get('ms_per_token'), '.2f')} | {_fmt(t.get('ms_per_token'), '.2f')} | "
                             f"{_fmt(r.get('speedup'), '.2f')} | {mib(s)} | {mib(t)} |")
            lines.append(f"| {d['shape']} | {d['mixer']} | flatness (longest / shortest) | "
                         f"{_fmt(d.get('student_flatness'), '.2f')} | {_fmt(d.get('student_eager_flatness'), '.2f')} | "
                         f"{_fmt(d.get('teacher_flatness'), '.2f')} |||| ")
        lines.append("")
    targets = results.get("targets") or []
    if targets:
        lines += ["### Targets", "", "| target | value | met |", "|---|---|---|"]
        lines += [f"| {t['target']} ({t.get('where', '')}) | {_fmt(t['value'], '.4g')} | "
                  f"{'yes' if t['met'] else 'NO'} |" for t in targets]
        lines.append("")
    return "\n".join(lines)


def collect_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in results.get("step") or []:
        out += [dict(t, where=f"{r.get('shape')} {r.get('mixer')}") for t in step_targets(r)]
    for r in results.get("kernels") or []:
        out += [dict(t, where=f"{r.get('mixer')} {r.get('layout')}") for t in kernel_targets(r)]
    for d in results.get("decode") or []:
        ctx = [r["context"] for r in d.get("rows") or []]
        where = f"{d.get('shape')} {d.get('mixer')}" + (f", contexts {ctx[0]}..{ctx[-1]}" if ctx else "")
        out += [dict(t, where=where) for t in decode_targets(d)]
    return out


def write_results(results: dict[str, Any], out: Path | str) -> tuple[Path, Path]:
    """results -> OUT (JSON, written atomically) and OUT with suffix .md (the Markdown tables)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results["targets"] = collect_targets(results)
    atomic_write_text(out, json.dumps(results, indent=1, default=str))
    md = out.with_suffix(".md")
    md.write_text(markdown(results) + "\n")
    return out, md


# -------------------------------------------------------------------------------------------------- CLI

WHAT = ("step", "kernels", "decode")

DESCRIPTION = """\
Benchmark the stage-3 distillation step, the mixer kernels and decoding; print Markdown tables and write
JSON (+ the same tables next to it as .md).

  step     the stage-3 step exactly as `harness stage distill` runs it (DistillModel + TeacherBody under
           DeepSpeed ZeRO-3 from ds_configs/, bf16 on GPUs), with random-weight SmolLM2 teachers of the chosen
           shape. Reports tokens/s, MFU = tokens/s x (6 N_student + 2 N_teacher) / (peak x world) with the
           GPU's datasheet dense bf16 peak (and beside it against the measured matmul peak), peak GPU
           memory, and where a step's time goes: teacher_forward, gather_teacher_head, student_forward, loss
           (chunked CE + KL including the logits' gradient), backward, optimizer, other. ZeRO-3 communication
           overlaps compute inside the forward/backward phases; a short torch.profiler pass reports its busy
           time per step and the part not hidden behind compute ("exposed", GPU only).
  kernels  each mixer's Triton kernel vs its PyTorch reference at the shape's head layout, forward+backward
           (CUDA only; errors against the fp32 reference too).
  decode   greedy decoding at batch 1 after contexts of 1k / 8k / 32k tokens: the student's recurrent step
           vs the teacher's KV-cache step, ms per token; flatness = ms/token at the longest / shortest.

Several processes: `torchrun --standalone --nproc_per_node 8 -m harness.cli bench ...` (the step runs on
every rank, MFU divides by world x peak; kernels and decode run on rank 0). Triton compiles each kernel
shape on first use (30-150 s): keep one shape per process on a fresh machine, and TRITON_CACHE_DIR.
Exit status: 0, or 1 when a measurement failed (its error is in the table and the JSON), 2 for bad arguments.
Numbers, targets and the commands used: docs/BENCHMARKS.md.
"""

EPILOG = """\
examples:
  harness bench --shape 135M --mixer gated_deltanet --micro-batch 8 --seq 2048 --steps 20 --out results.json
  harness bench --shape 1.7B --mixer kda --what step --out bench/1.7b-kda.json
  harness bench --shape 1.7B --what kernels --mixer all --out bench/kernels-1.7b.json
  harness bench --shape 135M --mixer gated_deltanet --what decode --contexts 1024,8192,32768 --out dec.json
  harness bench --shape tiny --device cpu --engine plain --micro-batch 2 --seq 64 --steps 3   # smoke test
  harness bench --teacher smollm2-135m-instruct-gguf --mixer gla --layers 4 --device cpu --seq 128
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`harness bench` on the CLI's subparsers (sets handler=run_cli)."""
    p = subparsers.add_parser("bench", help="Throughput, MFU, memory and time breakdown of stage 3; kernel and "
                              "decoding speed.", description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    configure_parser(p)
    p.set_defaults(handler=run_cli)
    return p


def configure_parser(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("what to measure")
    what.add_argument("--what", default="step",
                      help="Comma list of step, kernels, decode, or 'all' (kernels only where CUDA is). Default: step.")
    what.add_argument("--shape", default="135M",
                      help="Teacher shape(s), comma list: tiny, 135M, 360M, 1.7B (SmolLM2 configs, random weights). "
                      "For kernels, the head layout(s).")
    what.add_argument("--mixer", default="gated_deltanet",
                      help="Mixer(s), comma list, or 'all' (see `harness mixers`).")
    what.add_argument("--teacher", default=None, metavar="SOURCE",
                      help="A real teacher instead of --shape (HF folder, .gguf, alias, hub id).")
    what.add_argument("--layers", type=int, default=None, help="Keep only the first N layers (quick runs).")
    what.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                      help="Mixer option, e.g. --option backend=reference --option chunk_size=64 (repeatable).")
    step = p.add_argument_group("step")
    step.add_argument("--micro-batch", type=int, default=8, help="Sequences per device per micro-step. Default 8.")
    step.add_argument("--seq", type=int, default=2048, help="Tokens per sequence. Default 2048.")
    step.add_argument("--grad-accum", type=int, default=1, help="Micro-steps per optimizer step. Default 1.")
    step.add_argument("--steps", type=int, default=20, help="Measured optimizer steps. Default 20.")
    step.add_argument("--warmup", type=int, default=3, help="Unmeasured steps first (compilation, allocator). "
                      "Default 3.")
    step.add_argument("--engine", choices=("zero3", "plain"), default="zero3",
                      help="zero3: DeepSpeed engines as in stage 3 (default; the ZeRO stage is --student-ds-config's); "
                      "plain: stage 3's deepspeed.student_engine=plain (torch's fused AdamW on fp32 master copies of "
                      "the bf16 weights; data parallel under torchrun) with a replicated teacher.")
    step.add_argument("--student-ds-config", default=None, help="DeepSpeed config of the student (default "
                      "ds_configs/zero3.json; ds_configs/zero3_offload.json for CPU offload).")
    step.add_argument("--teacher-ds-config", default=None, help="Default ds_configs/zero3_teacher.json.")
    step.add_argument("--teacher-placement", choices=("auto", "zero3", "replicated"), default="auto",
                      help="The teacher as stage 3 holds it (deepspeed.teacher_placement): a ZeRO-3 engine, a plain "
                      "copy per device, or auto (replicated when it takes <= 10%% of a device). Default auto.")
    step.add_argument("--peak-flops", type=float, default=None,
                      help="Per-device peak FLOP/s for mfu (default: $HARNESS_PEAK_FLOPS, else the GPU's datasheet "
                      "dense bf16 peak, e.g. 989e12 for an H100 / H200 SXM; a GPU not in harness.flops gets no mfu "
                      "and says so).")
    step.add_argument("--measure-peak", action="store_true", help="Measure the matmul peak of mfu_measured_peak now "
                      "(8192^3 bf16 matmul; default: the figure measured before for this GPU, else measured now on "
                      "CUDA).")
    step.add_argument("--grad-ckpt", action="store_true",
                      help="Recompute student blocks in backward (stages.distill.gradient_checkpointing): less "
                      "activation memory for more time.")
    step.add_argument("--grad-ckpt-fraction", type=float, default=None, metavar="F",
                      help="With --grad-ckpt (implied): recompute only this share of the blocks, spread evenly "
                      "(stages.distill.gradient_checkpointing_fraction). Default 1.0.")
    step.add_argument("--eager-teacher", action="store_true",
                      help="Run the replicated teacher eagerly (stages.distill.compile_teacher=false); by default "
                      "its decoder layers are compiled on a GPU.")
    step.add_argument("--profile-steps", type=int, default=2,
                      help="Extra steps under torch.profiler to measure communication (0: skip). Default 2.")
    dec = p.add_argument_group("decode")
    dec.add_argument("--contexts", default="1024,8192,32768", help="Context lengths. Default 1024,8192,32768.")
    dec.add_argument("--new-tokens", type=int, default=64, help="Timed tokens per context. Default 64.")
    dec.add_argument("--no-teacher-decode", action="store_true", help="Time the student only.")
    ker = p.add_argument_group("kernels")
    ker.add_argument("--kernel-batch", type=int, default=None, help="Batch of the layer bench (default --micro-batch).")
    ker.add_argument("--variants", default="", help="Extra kernel rows NAME@CASE=ROUTE ($HARNESS_FLA_ROUTES).")
    ker.add_argument("--max-seconds", type=float, default=1e9, help="Kernels: start no new row after this long.")
    gen = p.add_argument_group("general")
    gen.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                     help="auto: bf16 on CUDA, fp32 on a CPU (as stage 3).")
    gen.add_argument("--device", default="auto", help="auto, cuda or cpu.")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--out", default=None, help="JSON file to write (and OUT.md). Default: print only.")


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _parse_options(items: list[str]) -> dict[str, Any]:
    opts = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--option '{item}' is not KEY=VALUE")
        opts[key.strip()] = _parse_value(value.strip())
    return opts


def run_cli(args: argparse.Namespace, argv: Optional[Sequence[str]] = None) -> int:
    """Run what `args` ask; print the Markdown tables (rank 0) and write --out."""
    from harness.config import ConfigError
    from harness.mixers import MIXERS

    if args.what == "all":  # the kernels need CUDA; elsewhere 'all' is what can run
        what = list(WHAT) if torch.cuda.is_available() else ["step", "decode"]
    else:
        what = _split(args.what)
    bad = sorted(set(what) - set(WHAT))
    if bad:
        raise ConfigError(f"--what {','.join(bad)}: choose from {', '.join(WHAT)} (comma list) or all")
    mixers = list(MIXERS) if args.mixer == "all" else _split(args.mixer)
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown:
        raise ConfigError(f"--mixer {','.join(unknown)}: choose from {', '.join(MIXERS)} or all")
    try:
        shapes = [args.teacher] if args.teacher else [canonical_shape(s) for s in _split(args.shape)]
        options = _parse_options(args.option)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    device = _device(args.device)
    argv = list(argv) if argv is not None else sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else []
    results: dict[str, Any] = {"meta": environment(device, argv)}
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    results["meta"]["world"] = world

    def save() -> None:
        if rank == 0 and args.out:
            write_results(results, args.out)

    if "kernels" in what and not torch.cuda.is_available():
        raise ConfigError("--what kernels needs CUDA: the fla / mlstm_kernels kernels are Triton (GPU only)")
    if "step" in what:
        results["step"] = []
        for shape in shapes:
            for mixer in mixers:
                kw = dict(micro_batch=args.micro_batch, seq_len=args.seq, steps=args.steps, warmup=args.warmup,
                          grad_accum=args.grad_accum, dtype=args.dtype, device=device, zero3=args.engine == "zero3",
                          layers=args.layers, options=options, student_ds_config=args.student_ds_config,
                          teacher_ds_config=args.teacher_ds_config, peak_flops=args.peak_flops,
                          measure_peak=args.measure_peak, profile_steps=args.profile_steps,
                          gradient_checkpointing=args.grad_ckpt or args.grad_ckpt_fraction is not None,
                          recompute_fraction=1.0 if args.grad_ckpt_fraction is None else args.grad_ckpt_fraction,
                          teacher_placement=args.teacher_placement, compile_teacher=not args.eager_teacher,
                          seed=args.seed)
                if args.teacher:
                    kw["teacher_source"] = args.teacher
                try:
                    row = bench_step(shape if not args.teacher else "custom", mixer, **kw)
                except Exception as err:  # noqa: BLE001 - record and go on with the next combination
                    if world > 1:
                        raise  # a rank failing alone would leave the others in a collective
                    row = {"shape": shape, "mixer": mixer, "error": f"{type(err).__name__}: {err}",
                           "trace": traceback.format_exc(limit=8)}
                _free()  # the engines of this combination (one combination per process is leaner still)
                results["step"].append(row)
                if rank == 0:
                    print(json.dumps({k: v for k, v in row.items() if k not in ("trace", "step_ms_each")},
                                     default=str), flush=True)
                    _say_why_no_mfu(row)
                save()
    if rank == 0 and "kernels" in what:
        layouts = [s for s in shapes if s in SHAPES and s != "tiny"] or ["1.7B"]
        results["kernels"] = []

        def on_row(row: dict) -> None:  # saved as rows arrive: a time-limited call keeps what finished
            results["kernels"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
            save()

        bench_kernels(layouts, mixers, batch=args.kernel_batch or args.micro_batch, seq=args.seq,
                      variants=_split(args.variants), max_seconds=args.max_seconds, on_row=on_row)
    if rank == 0 and "decode" in what:
        results["decode"] = []
        contexts = [int(c) for c in _split(args.contexts)]
        for shape in shapes:
            for mixer in mixers:
                try:
                    res = bench_decode(shape if not args.teacher else "custom", mixer, contexts=contexts,
                                       new_tokens=args.new_tokens, dtype=args.dtype, device=device,
                                       teacher_source=args.teacher, layers=args.layers, options=options,
                                       teacher=not args.no_teacher_decode, seed=args.seed)
                except Exception as err:  # noqa: BLE001
                    res = {"shape": shape, "mixer": mixer, "error": f"{type(err).__name__}: {err}",
                           "trace": traceback.format_exc(limit=8)}
                results["decode"].append(res)
                print(json.dumps(res, default=str), flush=True)
                save()
    if rank == 0:
        results["targets"] = collect_targets(results)
        print(markdown(results))
        save()
        if args.out:
            print(f"[harness bench] wrote {args.out} and {Path(args.out).with_suffix('.md')}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    failed = [r for part in ("step", "kernels", "decode") for r in results.get(part) or [] if "error" in r]
    if failed and rank == 0:
        print(f"[harness bench] {len(failed)} measurement(s) failed; their errors are in the table and the JSON",
              file=sys.stderr)
    untrained = [r for r in results.get("step") or [] if "health" in r]
    if untrained and rank == 0:
        print(f"[harness bench] {len(untrained)} step measurement(s) did not train ({untrained[0]['health']}); "
              "their speed meets no target", file=sys.stderr)
    return 1 if failed or untrained else 0


def _say_why_no_mfu(row: dict[str, Any]) -> None:
    """On stderr: a GPU step row without `mfu` names the GPU and what to pass (a CPU row stays quiet)."""
    if "error" not in row and row.get("mfu") is None and str(row.get("device", "")).startswith("cuda"):
        print(f"[harness bench] {row['shape']} {row['mixer']}: {row['peak_flops_source']}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m harness.perf ARGS` = `harness bench ARGS`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="harness bench", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure_parser(parser)
    args = parser.parse_args(argv)
    from harness.config import ConfigError

    try:
        return run_cli(args, argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
