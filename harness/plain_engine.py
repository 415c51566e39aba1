"""The student engine of deepspeed.student_engine=plain: no DeepSpeed; DeepSpeed's numerics with torch's fused AdamW,
and torch's DistributedDataParallel for several processes. It answers the calls of harness.engine's `StudentEngine`.

Why not DeepSpeed here: DeepSpeed's optimizer step loops over the parameter tensors in Python (9,918 operators for
the 135M student, scripts/zero_step_ops.py), ~80 ms of a ~430 ms step on an H200; this engine's step is a few
multi-tensor kernels. The module's parameters are bf16 themselves (not fp32 weights under autocast, which would cast
every weight at every forward and run the loss matmuls in fp32 without tensor cores: docs/BENCHMARKS.md, runs 7).
Why DDP and not FSDP2 (`replicate` / `fully_shard` with bf16 compute and fp32 reduction): FSDP2 keeps the fp32
parameters as the module's and casts each to bf16 at every forward, where DDP leaves the bf16 module alone and its
communication hook reduces straight into the fp32 masters.

Numerics (as DeepSpeed's bf16 mode, tests/test_engine.py compares them with ZeRO-2): with bf16 enabled in the config
the module's parameters are bf16 (buffers, e.g. rotary frequencies, stay fp32) and fp32 master copies, taken from
the bf16 values, hold the gradients, accumulated in fp32 over the micro-steps of a window, and the optimizer state;
the loss is divided by the accumulation steps; the global norm of the fp32 gradients is taken before clipping to
`gradient_clipping`; a non-finite norm skips the update and the scheduler step and is counted (`skipped_steps`),
one host sync per optimizer step.

Several processes (a process group of more than one): the module is wrapped in torch's DistributedDataParallel,
which starts every process from rank 0's weights and reduces the gradients in buckets while the backward runs. A
communication hook (`register_comm_hook`) reduces each bucket in fp32: the window's earlier micro-steps' fp32
gradients plus this micro-step's, summed over the processes and divided by their number, straight into the fp32
master gradients (DeepSpeed's data-parallel mean); micro-steps before the last of a window do not communicate
(`no_sync`). Every process holds the whole student and its optimizer state. One process (no process group, or a
group of one): the module is not wrapped and nothing communicates.

Checkpoint: one file, `plain_engine.pt`, written by rank 0 (every rank holds the same) and read by every rank, with
tensors and plain values only (loaded with weights_only=True): "module" (every parameter's fp32 master under each
of its names, and the persistent buffers), "optimizer" (torch's optimizer state dict, its parameters named by their
first name), "scheduler", "micro_steps", "skipped_steps". It resumes on any number of processes. A file whose
optimizer state numbers its parameters instead of naming them (the format of harness versions before the names) loads
the same way, its numbers read in this optimizer's order; a file that does not fit the student is refused with a
ConfigError naming it.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from harness.config import ConfigError
from harness.safe_load import safe_load

STATE_FILE = "plain_engine.pt"


def decays(name: str, param: nn.Parameter) -> bool:
    """Whether AdamW weight decay applies: to matrices, not to norms, biases, or parameters marked
    `_no_weight_decay` (`harness.mixers.no_weight_decay`: each mixer marks its own, e.g. A_log and dt_bias, as fla's
    layers do)."""
    return param.ndim >= 2 and "norm" not in name and not getattr(param, "_no_weight_decay", False)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: decay on matrices only (see `decays`)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if decays(name, p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def weight_decay(config: dict[str, Any]) -> float:
    return float(config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0))


class PlainEngine:
    """A student trained as DeepSpeed's engine trains it (engine(batch...), backward(loss), step() once per
    micro-step), in plain torch; see the module docstring."""

    STATE_FILE = STATE_FILE

    def __init__(self, model: nn.Module, config: dict[str, Any], scheduler: Callable, device: torch.device) -> None:
        self.bf16 = bool(config.get("bf16", {}).get("enabled", False))
        self.module, self.device = model.to(device), torch.device(device)
        if self.bf16:  # parameters only, as DeepSpeed casts them: buffers (e.g. rotary inv_freq) stay fp32
            for p in self.module.parameters():
                p.data = p.data.to(torch.bfloat16)
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.ddp = data_parallel(self.module, self.device, self) if self.world > 1 else None  # rank 0's weights
        groups = param_groups(self.module, weight_decay(config))
        self.params = [p for g in groups for p in g["params"]]
        self.names = first_names(self.module, self.params)
        self.masters = self._masters(groups) if self.bf16 else self.params
        self.master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        if self.bf16:
            groups = [{**g, "params": [self.master_of[id(p)] for p in g["params"]]} for g in groups]
        self.optimizer = adamw(groups, config, self.device)
        self.scheduler = scheduler(self.optimizer)
        self.grad_accum = int(config.get("gradient_accumulation_steps", 1))
        self.clip = float(config.get("gradient_clipping", 0.0))
        self.micro_steps = 0
        self.skipped_steps = 0  # optimizer steps left out for a non-finite gradient (DeepSpeed's name)
        self._grad_norm: Optional[torch.Tensor] = None

    def _masters(self, groups: list[dict[str, Any]]) -> list[torch.Tensor]:
        """fp32 copies of the bf16 parameters, each with a gradient buffer that lives as long as the engine."""
        masters = [p.detach().float() for g in groups for p in g["params"]]
        for m in masters:
            m.grad = torch.zeros_like(m)
        return masters

    # ------------------------------------------------------------------ the loop's calls

    def __call__(self, *args, **kwargs):
        return (self.ddp or self.module)(*args, **kwargs)

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.grad_accum == 0

    def window_starts(self) -> bool:
        """Whether this micro-step is the first of its accumulation window."""
        return self.micro_steps % self.grad_accum == 0

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the micro-step's loss over the accumulation steps. Alone, or before a window's last micro-step
        (no communication), the bf16 gradients go into the fp32 masters; at the last one with several processes the
        communication hook leaves their mean there."""
        reduces = self.ddp is not None and self.is_gradient_accumulation_boundary()
        quiet = self.ddp.no_sync() if self.ddp is not None and not reduces else contextlib.nullcontext()
        with quiet:
            (loss / self.grad_accum if self.grad_accum > 1 else loss).backward()
        if self.bf16:
            if not reduces:
                self._accumulate_into_masters()
            for p in self.params:
                p.grad = None

    def _accumulate_into_masters(self) -> None:
        """Moves the bf16 gradients into the fp32 masters' (a window's first micro-step overwrites them, zeroing
        those without a gradient; later ones add)."""
        first = self.window_starts()
        pairs = [(self.master_of[id(p)].grad, p.grad) for p in self.params if p.grad is not None]
        if pairs:
            fp32, bf16 = map(list, zip(*pairs))
            (torch._foreach_copy_ if first else torch._foreach_add_)(fp32, bf16)
        if first and len(pairs) < len(self.params):
            torch._foreach_zero_([self.master_of[id(p)].grad for p in self.params if p.grad is None])

    def step(self) -> None:
        """Called after every micro-step, as DeepSpeed's: at a window's end clips, steps AdamW and the scheduler
        (or skips them for a non-finite gradient norm)."""
        if self.is_gradient_accumulation_boundary():
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
        (`check_grad_overflow`); the loop logs the count (skipped_steps) and the norm (inf / nan). The warning names
        the parameters whose gradients are not finite."""
        self.skipped_steps += 1
        if self.rank == 0:
            bad = [name for name, m in zip(self.names, self.masters)
                   if m.grad is not None and not bool(torch.isfinite(m.grad).all())]
            warnings.warn(f"plain engine: skipped optimizer step {self.micro_steps // self.grad_accum} "
                          f"({self.skipped_steps} skipped so far): the gradient norm is {float(self._grad_norm)}; "
                          f"non-finite gradients in {len(bad)} parameter(s): {', '.join(bad[:8])}"
                          f"{' ...' if len(bad) > 8 else ''}", RuntimeWarning, stacklevel=3)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> Optional[float]:
        return None if self._grad_norm is None else float(self._grad_norm)

    # ------------------------------------------------------------------ state

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state with every trained parameter as its fp32 master, under each of its names (a tied weight
        has several): what export reads. The tensors are the live ones."""
        state = self.module.state_dict()
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) in self.master_of and name in state:
                state[name] = self.master_of[id(p)].detach()
        return state

    def optimizer_state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict with its parameters named (by their first name) instead of numbered."""
        saved = self.optimizer.state_dict()
        return {"state": {self.names[i]: value for i, value in saved["state"].items()},
                "param_groups": [{**g, "params": [self.names[i] for i in g["params"]]} for g in saved["param_groups"]]}

    def save_checkpoint(self, save_dir: str, tag: str) -> None:
        """Rank 0 writes `STATE_FILE` (every process holds the same); the others write nothing."""
        if self.rank != 0:
            return
        path = Path(save_dir) / tag
        path.mkdir(parents=True, exist_ok=True)
        torch.save({"module": self.fp32_state_dict(), "optimizer": self.optimizer_state_dict(),
                    "scheduler": self.scheduler.state_dict(), "micro_steps": self.micro_steps,
                    "skipped_steps": self.skipped_steps}, path / STATE_FILE)

    def load_checkpoint(self, load_dir: str, tag: str) -> None:
        """What `save_checkpoint` wrote, or the engine before it (optimizer parameters numbered, not named);
        ConfigError naming the file when it does not fit this student."""
        path = Path(load_dir) / tag / STATE_FILE
        state = safe_load(path, map_location=self.device)
        self._load_module(state["module"], path)
        self.optimizer.load_state_dict(self._numbered(state["optimizer"], path))
        self.scheduler.load_state_dict(state["scheduler"])
        self.micro_steps = state["micro_steps"]
        self.skipped_steps = state.get("skipped_steps", 0)  # absent from checkpoints before it was counted

    def _load_module(self, module: dict[str, torch.Tensor], path: Path) -> None:
        own = self.module.state_dict()
        missing = [name for name in own if name not in module]
        if missing:
            raise misfit(path, f"it holds no {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        wrong = [f"{k} is {tuple(module[k].shape)} there and {tuple(v.shape)} here" for k, v in own.items()
                 if tuple(module[k].shape) != tuple(v.shape)]
        if wrong:
            raise misfit(path, wrong[0])
        self.module.load_state_dict(module)
        with torch.no_grad():
            for name, p, m in zip(self.names, self.params, self.masters):
                if m is not p:
                    m.copy_(module[name])

    def _numbered(self, saved: dict[str, Any], path: Path) -> dict[str, Any]:
        """The saved optimizer state with its parameters numbered in this optimizer's order (named ones checked)."""
        keys = [k for g in saved["param_groups"] for k in g["params"]]
        if len(keys) != len(self.params):
            raise misfit(path, f"its optimizer holds {len(keys)} parameters and this student trains {len(self.params)}")
        position = {}
        for i, (key, name) in enumerate(zip(keys, self.names)):
            if isinstance(key, str) and key != name:
                raise misfit(path, f"its optimizer's parameter {i} is {key}, here {name}")
            position[key] = i
        numbered, start = [], 0
        for g in saved["param_groups"]:
            numbered.append({**g, "params": list(range(start, start + len(g["params"])))})
            start += len(g["params"])
        return {"state": {position[k]: v for k, v in saved["state"].items()}, "param_groups": numbered}


def data_parallel(module: nn.Module, device: torch.device,
                  engine: PlainEngine) -> torch.nn.parallel.DistributedDataParallel:
    """`module` under torch's DDP (rank 0's weights and buffers on every process; buffers not broadcast at each
    forward: they do not train), its buckets reduced by `fp32_mean_hook` with the engine as state."""
    ddp = torch.nn.parallel.DistributedDataParallel(
        module, device_ids=[device.index] if device.type == "cuda" else None, **no_buffer_sync())
    ddp.register_comm_hook(engine, fp32_mean_hook)
    return ddp


def no_buffer_sync() -> dict[str, bool]:
    """DDP's argument for not broadcasting the buffers at each forward: `forward_sync_buffers` where torch has it
    (2.13; `broadcast_buffers` warns there), `broadcast_buffers` before."""
    arguments = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in arguments else "broadcast_buffers": False}


def fp32_mean_hook(engine: PlainEngine, bucket):  # unannotated: DDP checks annotations against its classes
    """DDP's reduction of one bucket (a dist.GradBucket) of the window's last micro-step (a communication hook): in
    fp32, the mean over the processes of the window's gradients, as a future. bf16: this micro-step's gradients plus
    the window's earlier ones, accumulated in the fp32 masters, summed over the processes into the masters' gradients;
    fp32: DDP's own bucket (the window's gradients, accumulated under no_sync), averaged in place."""
    world = engine.world
    if not engine.bf16:
        work = dist.all_reduce(bucket.buffer(), async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0].div_(world))
    masters = [engine.master_of[id(p)] for p in bucket.parameters()]
    flat = bucket.buffer().float()  # the bucket holds the parameters' gradients one after another
    if not engine.window_starts():
        flat += torch.cat([m.grad.reshape(-1) for m in masters])

    def into_masters(fut: torch.futures.Future) -> torch.Tensor:
        mean = fut.value()[0].div_(world)
        pieces = mean.split([m.numel() for m in masters])
        torch._foreach_copy_([m.grad for m in masters], [x.view_as(m) for x, m in zip(pieces, masters)])
        return bucket.buffer()  # DDP copies it into the bf16 gradients, which the engine then drops

    return dist.all_reduce(flat, async_op=True).get_future().then(into_masters)


def misfit(path: Path, reason: str) -> ConfigError:
    """A plain-engine checkpoint that does not fit this run's student (fatal: the checkpoint is not moved aside)."""
    return ConfigError(f"checkpoint file {path} (deepspeed.student_engine=plain) does not fit this run's student: "
                       f"{reason}. Resume it with the student and harness version that wrote it, or start the stage "
                       "afresh in another run directory.")


def first_names(module: nn.Module, params: list[torch.Tensor]) -> list[str]:
    """Each parameter's first name in `module` (a tied weight has several)."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return [names[id(p)] for p in params]


def adamw(groups: list[dict[str, Any]], config: dict[str, Any], device: torch.device) -> torch.optim.AdamW:
    """torch's AdamW with the DeepSpeed config's settings, its fused one-kernel step on a GPU."""
    params = dict(config.get("optimizer", {}).get("params", {}))
    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=params.get("lr", 1e-3), betas=tuple(params.get("betas", (0.9, 0.999))),
                             eps=params.get("eps", 1e-8), **fused)
