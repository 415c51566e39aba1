"""DeepSpeed set-up for stage 3: process group, ZeRO-3 configs, the student and teacher engines, export.

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
from typing import Any, Callable, Optional

import torch
from torch import nn

from harness.config import ConfigError, JobConfig, StageConfig
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


def decays(name: str, param: nn.Parameter) -> bool:
    """Whether AdamW weight decay applies: to matrices, not to norms, biases, A_log or dt_bias."""
    return param.ndim >= 2 and "norm" not in name and name.rsplit(".", 1)[-1] not in ("A_log", "dt_bias")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices only (see `decays`)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def student_engine(model: nn.Module, config: dict[str, Any], scheduler: Callable, kind: str = "deepspeed",
                   device: Optional[torch.device] = None):
    """The student's training engine: DeepSpeed's (ZeRO per `config`), or `PlainEngine` (data parallel)."""
    if kind == "plain":
        return PlainEngine(model, config, scheduler, device or device_for())
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, _weight_decay(config)),
                                      config=config, lr_scheduler=scheduler)
    return use_safe_loading(engine)  # its checkpoints load with weights_only=True (harness/safe_load.py)


class PlainEngine:
    """The part of DeepSpeed's engine API that stage 3 uses, in plain PyTorch (deepspeed.student_engine=plain),
    with DeepSpeed's numerics: torch's AdamW with the DeepSpeed config's settings
    (fused on a GPU); when the config enables bf16, a bf16 module whose fp32 master copies (taken from the bf16
    values, as DeepSpeed takes them) hold the gradients, accumulated in fp32, and the optimizer state; gradient
    accumulation (the loss divided by the accumulation steps) and clipping as DeepSpeed does them. Why: DeepSpeed's
    optimizer step loops over the parameter tensors in Python (9,918 operators for the 135M student,
    scripts/zero_step_ops.py), ~80 ms of a ~430 ms step on the H200; this one issues a few multi-tensor kernels.
    (Its first version kept fp32 weights under autocast: a cast per weight per forward and fp32 loss matmuls
    without tensor cores made its 135M step slower than ZeRO-2's; docs/BENCHMARKS.md, runs 7.)

    Under a process group of several processes it is plain data parallelism: every process holds the whole model
    and optimizer (what fits one device), the weights start from rank 0's, and at each accumulation boundary the
    fp32 master gradients are averaged over the processes (as DeepSpeed averages its data-parallel gradients)
    before clipping; rank 0 alone writes the checkpoint file, which every process reads on resume."""

    STATE_FILE = "plain_engine.pt"

    def __init__(self, model: nn.Module, config: dict[str, Any], scheduler: Callable, device: torch.device) -> None:
        self.bf16 = bool(config.get("bf16", {}).get("enabled", False))
        self.module, self.device = model.to(device), device
        if self.bf16:  # parameters only, as DeepSpeed casts them: buffers (e.g. rotary inv_freq) stay fp32
            for p in self.module.parameters():
                p.data = p.data.to(torch.bfloat16)
        groups = param_groups(self.module, _weight_decay(config))
        self.params = [p for g in groups for p in g["params"]]
        self.names: dict[int, list[str]] = {}  # every name of a parameter: tied weights have several
        for name, p in self.module.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), []).append(name)
        if self.bf16:
            self.masters = [p.detach().float() for p in self.params]
            for m in self.masters:
                m.grad = torch.zeros_like(m)
            by_id = {id(p): m for p, m in zip(self.params, self.masters)}
            groups = [{**g, "params": [by_id[id(p)] for p in g["params"]]} for g in groups]
        else:
            self.masters = self.params
        params = dict(config.get("optimizer", {}).get("params", {}))
        fused = {"fused": True} if device.type == "cuda" else {}
        self.optimizer = torch.optim.AdamW(groups, lr=params.get("lr", 1e-3),
                                           betas=tuple(params.get("betas", (0.9, 0.999))),
                                           eps=params.get("eps", 1e-8), **fused)
        self.scheduler = scheduler(self.optimizer)
        self.grad_accum = int(config.get("gradient_accumulation_steps", 1))
        self.clip = float(config.get("gradient_clipping", 0.0))
        self.micro_steps = 0
        self.skipped_steps = 0  # optimizer steps left out for a non-finite gradient (DeepSpeed's name)
        self._grad_norm: Optional[torch.Tensor] = None
        self.rank, self.world = 0, _world()
        if self.world > 1:
            self.rank = torch.distributed.get_rank()
            self._start_from_rank0()

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum if self.grad_accum > 1 else loss).backward()
        if self.bf16:
            self._accumulate_into_masters()

    def _accumulate_into_masters(self) -> None:
        """Moves the bf16 gradients into the fp32 masters' (a window's first micro-step overwrites them, zeroing
        those without a gradient; later ones add) and frees them."""
        first = self.micro_steps % self.grad_accum == 0
        pairs = [(m.grad, p.grad) for m, p in zip(self.masters, self.params) if p.grad is not None]
        if pairs:
            fp32, bf16 = map(list, zip(*pairs))
            (torch._foreach_copy_ if first else torch._foreach_add_)(fp32, bf16)
        if first and len(pairs) < len(self.params):
            torch._foreach_zero_([m.grad for m, p in zip(self.masters, self.params) if p.grad is None])
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def _start_from_rank0(self) -> None:
        """Every process starts from rank 0's weights (and masters), as DeepSpeed broadcasts its model."""
        for p in self.params:
            torch.distributed.broadcast(p.data, src=0)
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.copy_(p)

    def _average_gradients(self) -> None:
        """The mean of the processes' master gradients, in place, reduced ALL_REDUCE_BUCKET elements at a time."""
        grads = [m.grad if m.grad is not None else torch.zeros_like(m) for m in self.masters]
        for m, g in zip(self.masters, grads):
            m.grad = g  # a process whose micro-batches left a weight without gradient still joins the reduction
        for bucket in _buckets(grads, ALL_REDUCE_BUCKET):
            flat = torch._utils._flatten_dense_tensors(bucket)
            torch.distributed.all_reduce(flat)
            flat.div_(self.world)
            torch._foreach_copy_(bucket, torch._utils._unflatten_dense_tensors(flat, bucket))

    def step(self) -> None:
        if self.is_gradient_accumulation_boundary():
            if self.world > 1:
                self._average_gradients()
            with_grad = [m for m in self.masters if m.grad is not None]
            self._grad_norm = torch.nn.utils.get_total_norm([m.grad for m in with_grad])
            if torch.isfinite(self._grad_norm):  # one host sync per optimizer step
                if self.clip > 0:  # (takes the parameters, whose .grad it scales)
                    torch.nn.utils.clip_grads_with_norm_(with_grad, self.clip, self._grad_norm)
                self.optimizer.step()
                self.scheduler.step()
                if self.bf16:
                    with torch.no_grad():
                        torch._foreach_copy_(self.params, self.masters)
            else:
                self._skip_step()
            if not self.bf16:
                self.optimizer.zero_grad(set_to_none=True)
        self.micro_steps += 1

    def _skip_step(self) -> None:
        """A non-finite gradient: no update and no scheduler step, as DeepSpeed's bf16 and fp16 optimizers skip
        (`check_grad_overflow`); stage 3 logs the count (skipped_steps) and the gradient norm (inf / nan). The
        warning names the parameters whose gradients are not finite."""
        self.skipped_steps += 1
        if self.rank == 0:
            bad = [self.names[id(p)][0] for p, m in zip(self.params, self.masters)
                   if m.grad is not None and not bool(torch.isfinite(m.grad).all())]
            warnings.warn(f"plain engine: skipped optimizer step {self.micro_steps // self.grad_accum} "
                          f"({self.skipped_steps} skipped so far): the gradient norm is {float(self._grad_norm)}; "
                          f"non-finite gradients in {len(bad)} parameter(s): {', '.join(bad[:8])}"
                          f"{' ...' if len(bad) > 8 else ''}", RuntimeWarning, stacklevel=3)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        return None if self._grad_norm is None else float(self._grad_norm)

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state with every trained parameter as its fp32 master: what export reads."""
        state = self.module.state_dict()
        for p, m in zip(self.params, self.masters):
            state.update({name: m.detach() for name in self.names[id(p)] if name in state})
        return state

    def save_checkpoint(self, save_dir: str, tag: str) -> None:
        """Rank 0 writes the state (every process holds the same); the others write nothing."""
        if self.rank != 0:
            return
        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.fp32_state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict(), "micro_steps": self.micro_steps,
                    "skipped_steps": self.skipped_steps},
                   path / self.STATE_FILE)

    def load_checkpoint(self, load_dir: str, tag: str) -> None:
        """The state `save_checkpoint` wrote (tensors and plain values only: loaded with weights_only=True)."""
        state = safe_load(Path(load_dir) / tag / self.STATE_FILE, map_location=self.device)
        self.module.load_state_dict(state["module"])
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if m is not p:
                    m.copy_(state["module"][self.names[id(p)][0]])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.micro_steps = state["micro_steps"]
        self.skipped_steps = state.get("skipped_steps", 0)  # absent from checkpoints before it was counted


ALL_REDUCE_BUCKET = 2**26  # elements (256 MB of fp32) per all-reduce of PlainEngine's gradients


def _buckets(tensors: list[torch.Tensor], size: int) -> list[list[torch.Tensor]]:
    """Consecutive groups of tensors of one dtype with at most `size` elements each (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    total = size
    for t in tensors:
        if total + t.numel() > size or (out and out[-1][0].dtype != t.dtype):
            out.append([])
            total = 0
        out[-1].append(t)
        total += t.numel()
    return out


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


def compile_decoder_layers(body: nn.Module) -> int:
    """torch.compile every decoder layer of a replicated teacher (`TeacherBody`: body.teacher.model.layers) in
    place; returns how many. Layer by layer rather than the whole model: the layers share one compiled graph
    (one compilation per process, not one per layer) and the model's mask and rotary set-up stay eager."""
    layers = body.teacher.model.layers
    for layer in layers:
        layer.compile()
    return len(layers)


def compiles_teacher(stage: StageConfig, placement: str, device: torch.device) -> bool:
    """Whether stage 3 compiles the teacher's layers: a replicated teacher on a GPU, with compile_teacher on."""
    return placement == "replicated" and device.type == "cuda" and getattr(stage, "compile_teacher", False)


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


def _weight_decay(config: dict[str, Any]) -> float:
    return float(config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0))


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
