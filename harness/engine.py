"""Engines of stage 3 and SFT: process group, DeepSpeed configs, the student engine behind one interface
(`StudentEngine`: DeepSpeed ZeRO, or harness.plain_engine's for deepspeed.student_engine=plain: torch's fused AdamW
and DistributedDataParallel), the teacher (a ZeRO-3 inference engine or a frozen copy per device), export of either
engine's checkpoints.

The same code runs on GPUs (nccl, bf16) and on CPUs (gloo, fp32), as CI runs it. CPU pitfalls handled here
(see DESIGN.md): DeepSpeed's shared-memory all-reduce JIT build is skipped, the optimizer is torch's AdamW
(`torch_adam`, no FusedAdam build; `fused` picks its one-kernel step, on CPUs too), and the process group gets a
finite timeout.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from harness.config import ConfigError, JobConfig, StageConfig
# the plain engine, and the AdamW groups both engines use (importable from here too)
from harness.plain_engine import PlainEngine, param_groups, weight_decay
from harness.safe_load import safe_load, use_safe_loading, zero_to_fp32_loads_safely



_TORN_DOWN = False  # set once this process has destroyed a process group (see exit_after_teardown)


def teardown_distributed() -> None:
    """Destroy the process group before the interpreter exits: a gloo group left alive can abort the process at
    shutdown ("terminate called without an active exception", SIGABRT) after all the work is done."""
    global _TORN_DOWN
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        _TORN_DOWN = True


def exit_after_teardown(code: int) -> None:
    """End a stage-3 / SFT process right away, skipping the interpreter's own teardown, once its process group
    is gone and its results are written. Destroying the group is not enough: at interpreter exit a thread of
    DeepSpeed / gloo can still be joinable and abort the process ("terminate called without an active
    exception", SIGABRT) after the student and COMPLETE.json were written - seen about one run in ten on 2 CPU
    cores, in a resumed stage 3 under Slurm - and torchrun then reports the finished stage as failed. Files are
    closed by then (metrics, checkpoints: fsynced); stdout and stderr are flushed here. No-op otherwise."""
    if _TORN_DOWN:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def setup_distributed(device: torch.device, timeout_s: int = 1800) -> tuple[int, int]:
    """Join (or create, for a plain single process) the process group; returns (rank, world_size)."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    alone = "RANK" not in os.environ  # a plain `python` run: a one-process group
    if alone:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    # DeepSpeed 0.19 calls collectives torch 2.13 marks deprecated, once per step: keep the logs readable
    warnings.filterwarnings("ignore", message=r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
                            category=FutureWarning)
    import deepspeed

    # ZeRO does not need DeepSpeed's shm all-reduce, whose JIT C++ build costs 30-120 s on first use
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda *a, **k: None
    if not torch.distributed.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if alone:
            # An in-process store, not a TCP one on a "free" port: that port is only free until another job on the
            # host takes it (EADDRINUSE seen with six single-GPU runs started at once on one machine).
            torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0,
                                                 world_size=1, timeout=timedelta(seconds=timeout_s))
        deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s),
                                   auto_mpi_discovery=False)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def all_reduce_host(values: torch.Tensor, op=None) -> torch.Tensor:
    """All-reduce a small host tensor (loss sums, flags) over the process group and return it on the host.
    NCCL only reduces device tensors ("No backend type associated with device type cpu"), so under NCCL the
    values travel through this rank's GPU; gloo reduces them in place. Without a process group: unchanged."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    op = torch.distributed.ReduceOp.SUM if op is None else op
    on_device = torch.distributed.get_backend() == "nccl"
    t = values.to(torch.device("cuda", torch.cuda.current_device())) if on_device else values.clone()
    torch.distributed.all_reduce(t, op=op)
    return t.cpu()


def read_ds_config(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"DeepSpeed config '{path}' does not exist (deepspeed.student_config / teacher_config).")
    return json.loads(p.read_text())


def student_ds_config(job: JobConfig, stage: StageConfig, world: int, bf16: bool) -> dict[str, Any]:
    """The student's DeepSpeed config: the file's ZeRO settings with the job's batch, LR, clipping, precision."""
    cfg = copy.deepcopy(read_ds_config(job.deepspeed.student_config))
    cfg["train_micro_batch_size_per_gpu"] = stage.micro_batch_size
    cfg["gradient_accumulation_steps"] = stage.grad_accum
    cfg["train_batch_size"] = stage.micro_batch_size * stage.grad_accum * world
    cfg["gradient_clipping"] = stage.grad_clip
    cfg["bf16"] = {"enabled": bf16}
    opt = cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})
    opt.setdefault("params", {}).update(lr=stage.lr, weight_decay=stage.weight_decay)
    return cfg


def teacher_ds_config(job: JobConfig, stage: StageConfig, world: int, bf16: bool) -> dict[str, Any]:
    cfg = copy.deepcopy(read_ds_config(job.deepspeed.teacher_config))
    cfg["train_micro_batch_size_per_gpu"] = stage.micro_batch_size
    cfg["gradient_accumulation_steps"] = 1
    cfg["train_batch_size"] = stage.micro_batch_size * world
    cfg["bf16"] = {"enabled": bf16}
    cfg.pop("optimizer", None)
    return cfg


class StudentEngine(Protocol):
    """What the training loop (harness.train.Trainer) asks of a student engine: DeepSpeed's engine as it is, and
    `PlainEngine` (deepspeed.student_engine=plain). One call of `step()` per micro-step; the engine knows where its
    accumulation windows end."""

    device: torch.device
    skipped_steps: int  # optimizer steps left out so far for a non-finite gradient

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def train(self) -> Any: ...
    def eval(self) -> Any: ...
    def is_gradient_accumulation_boundary(self) -> bool: ...
    def backward(self, loss: torch.Tensor) -> Any: ...
    def step(self) -> Any: ...
    def get_lr(self) -> list[float]: ...
    def get_global_grad_norm(self) -> Optional[float]: ...
    def save_checkpoint(self, save_dir: str, tag: str) -> Any: ...
    def load_checkpoint(self, load_dir: str, tag: str) -> Any: ...


def student_engine(model: nn.Module, config: dict[str, Any], scheduler: Callable, kind: str = "deepspeed",
                   device: Optional[torch.device] = None) -> StudentEngine:
    """The student's training engine (deepspeed.student_engine): DeepSpeed's, ZeRO as `config` says ('deepspeed'),
    or `PlainEngine` with the config's optimizer, clipping and precision ('plain': torch's fused AdamW, DDP)."""
    if kind == "plain":
        return PlainEngine(model, config, scheduler, device or device_for())
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, weight_decay(config)),
                                      config=config, lr_scheduler=scheduler)
    return use_safe_loading(engine)  # its checkpoints load with weights_only=True (harness/safe_load.py)


def teacher_engine(model: nn.Module, config: dict[str, Any]):
    """The teacher as a ZeRO-3 inference engine: sharded parameters, no optimizer, eval mode."""
    import deepspeed

    for p in model.parameters():
        p.requires_grad_(False)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return use_safe_loading(engine)


REPLICATE_FRACTION = 0.10  # 'auto' replicates a teacher whose weights take at most this share of a device


def teacher_replicated(placement: str, teacher: nn.Module, device: torch.device, bf16: bool) -> bool:
    """Whether stage 3 holds the teacher as a plain copy per device (deepspeed.teacher_placement); 'auto' decides
    by size against this device's memory, and every rank takes the most cautious answer (all ranks must agree:
    building a ZeRO-3 engine is a collective)."""
    if placement != "auto":
        return placement == "replicated"
    nbytes = sum(p.numel() for p in teacher.parameters()) * (2 if bf16 else 4)
    if device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
    else:
        capacity = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(_world(), 1)
    fits = torch.tensor([1.0 if nbytes <= REPLICATE_FRACTION * capacity else 0.0], device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(fits, op=torch.distributed.ReduceOp.MIN)
    return bool(fits.item())


def replicated_teacher(model: nn.Module, device: torch.device, bf16: bool) -> nn.Module:
    """The teacher as a plain frozen module on this device (bf16 on a GPU): what every rank runs by itself."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.to(device=device, dtype=torch.bfloat16 if bf16 else torch.float32).eval()


def _compile_each(layers: nn.ModuleList) -> int:
    """torch.compile each module of `layers` in place (Module.compile: same parameters and state-dict names);
    returns how many."""
    for layer in layers:
        layer.compile()
    return len(layers)


def compile_decoder_layers(body: nn.Module) -> int:
    """torch.compile every decoder layer of a replicated teacher (`TeacherBody`: body.teacher.model.layers) in
    place; returns how many. Layer by layer rather than the whole model: the layers share one compiled graph
    (one compilation per process, not one per layer) and the model's mask and rotary set-up stay eager."""
    return _compile_each(body.teacher.model.layers)


def compiles_teacher(stage: StageConfig, placement: str, device: torch.device) -> bool:
    """Whether stage 3 compiles the teacher's layers: a replicated teacher on a GPU, with compile_teacher on."""
    return placement == "replicated" and device.type == "cuda" and getattr(stage, "compile_teacher", False)


def compile_student_blocks(student: nn.Module) -> int:
    """torch.compile every block of a student (`HarnessForCausalLM`: student.model.layers) in place; returns how
    many. Blocks of one class share one compiled graph; embedding, rotary set-up, final norm and head stay eager."""
    return _compile_each(student.model.layers)


def compiles_student(stage: StageConfig, engine_kind: str, device: torch.device) -> bool:
    """Whether stage 3 compiles the student's blocks: the plain engine on a GPU, with compile_student on (DeepSpeed's
    ZeRO hooks gather parameters around each submodule, which a compiled block would trace through)."""
    return engine_kind == "plain" and device.type == "cuda" and getattr(stage, "compile_student", False)


def build_teacher(model: nn.Module, job: JobConfig, stage: StageConfig, world: int, device: torch.device,
                  bf16: bool) -> tuple[nn.Module, str]:
    """The teacher of stage 3 as placed by deepspeed.teacher_placement -> (callable module, 'replicated'|'zero3')."""
    if teacher_replicated(job.deepspeed.teacher_placement, model, device, bf16):
        teacher = replicated_teacher(model, device, bf16)
        if compiles_teacher(stage, "replicated", device):
            compile_decoder_layers(teacher)
        return teacher, "replicated"
    return teacher_engine(model, teacher_ds_config(job, stage, world, bf16)), "zero3"


def _world() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def gathered(params: list[nn.Parameter]):
    """Context in which ZeRO-3-partitioned `params` hold their full data (a collective: every rank enters)."""
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def consolidated_state_dict(checkpoint_dir: Path, tag: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """fp32 weights of a ZeRO checkpoint (any number of ranks) or a `PlainEngine` one, with `prefix` stripped
    from the names. Every file loads with weights_only=True (harness/safe_load.py)."""
    plain = Path(checkpoint_dir) / tag / PlainEngine.STATE_FILE
    if plain.is_file():
        state = safe_load(plain, map_location="cpu", mmap=True)["module"]  # not the optimizer
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        with zero_to_fp32_loads_safely():
            state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def device_for(rank_device: Optional[str] = None) -> torch.device:
    if rank_device:
        return torch.device(rank_device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
