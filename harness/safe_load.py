"""Load a checkpoint file without executing code from it.

`torch.load(weights_only=False)` unpickles whatever a file names: a crafted file runs any code its author chose
(a `ds/plain_engine.pt` that ran a shell command on `harness export`). Run directories are copied and shared, so a
checkpoint is a file from someone else, and every checkpoint load in harness goes through here:

- `safe_load(path)`: `torch.load(weights_only=True)`: tensors, dicts, lists, tuples, numbers, strings and the few
  torch types torch itself allows, plus only the globals passed in `allow`, and those only during this load
  (`torch.serialization.safe_globals`, not a process-wide `add_safe_globals`). A file that needs any other global
  raises `UnsafeCheckpointError`, naming the file and the global; nothing from it is run.
- `deepspeed_globals()`: what a DeepSpeed checkpoint holds besides tensors and plain data (its optimizer states
  file pickles the loss scaler, the ZeRO stage enum and, under ZeRO-1/2, fragment addresses; fp16 runs the dynamic
  loss scaler). Found by saving real ZeRO-0/1/2/3 checkpoints (bf16 and fp32) and listing them with
  `torch.serialization.get_unsafe_globals_in_checkpoint`.
- `use_safe_loading(engine)`: a DeepSpeed engine whose checkpoint engine loads through `safe_load` (DeepSpeed
  0.19's `TorchCheckpointEngine.load` passes weights_only=False).
- `zero_to_fp32_loads_safely()`: a context in which `deepspeed.utils.zero_to_fp32` (the ZeRO checkpoint ->
  fp32 weights consolidation; it too passes weights_only=False) loads through `safe_load`.

The file formats do not change: what harness and DeepSpeed wrote before loads as it did.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import types
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from harness.config import ConfigError


class UnsafeCheckpointError(ConfigError, pickle.UnpicklingError):
    """A checkpoint file holds something other than tensors and plain data: it is not unpickled. A ConfigError, so
    the command line reports it in one paragraph and exits 2."""


def deepspeed_globals() -> list[Any]:
    """The classes a DeepSpeed checkpoint pickles besides tensors and plain data (see the module doc).
    Each is rebuilt from plain values (an enum member, a small record of numbers); none runs code on load."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: str | Path, map_location: Any = None, allow: Sequence[Any] = (), **kwargs: Any) -> Any:
    """`torch.load(path, weights_only=True)` with the globals `allow` permitted for this load only; a file needing
    anything else raises `UnsafeCheckpointError` (other failures, e.g. a truncated file, pass through as they are).
    `kwargs` go to torch.load (mmap=...); a weights_only in them is ignored."""
    kwargs.pop("weights_only", None)
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(path, map_location=map_location, weights_only=True, **kwargs)
    except pickle.UnpicklingError as err:
        if "Weights only load failed" not in str(err):
            raise
        raise UnsafeCheckpointError(_refusal(path, str(err))) from None


def _refusal(path: str | Path, message: str) -> str:
    """One paragraph: which file, which global it asked for, what to do."""
    found = re.search(r"GLOBAL (\S+)", message)
    what = f" (it names {found.group(1)})" if found else ""
    return (f"Checkpoint file {path} holds something other than tensors and plain data{what}, and will not be "
            "unpickled: loading it could run code written into the file. harness writes only tensors, plain "
            "values and DeepSpeed's own state into checkpoints, so this file was made or changed elsewhere. Use a "
            "checkpoint written by harness (resume from an earlier step-* directory, or start the stage afresh); "
            "load a file you trust yourself with torch.load(weights_only=False) only if you know who wrote it.")


def load_deepspeed_file(path: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """`safe_load` of a file DeepSpeed wrote: its few own classes allowed (`deepspeed_globals`)."""
    return safe_load(path, map_location=map_location, allow=deepspeed_globals(), **kwargs)


class SafeLoadingCheckpointEngine:
    """Wraps a DeepSpeed checkpoint engine: saving, committing and everything else unchanged (delegated), `load`
    through `safe_load` with `deepspeed_globals()`. DeepSpeed calls `engine.checkpoint_engine.load` for every file
    of `load_checkpoint` (model states, ZeRO optimizer states of each rank, MoE experts); it checks no types."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (e.g. while being copied): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_deepspeed_file(path, map_location)


def use_safe_loading(engine: Any) -> Any:
    """Make a DeepSpeed engine load its checkpoints through `safe_load`; returns the engine."""
    if not isinstance(engine.checkpoint_engine, SafeLoadingCheckpointEngine):
        engine.checkpoint_engine = SafeLoadingCheckpointEngine(engine.checkpoint_engine)
    return engine


class _SafeTorch(types.ModuleType):
    """torch as `zero_to_fp32` sees it inside `zero_to_fp32_loads_safely`: every name torch's own but `load`."""

    load = staticmethod(load_deepspeed_file)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def zero_to_fp32_loads_safely() -> Iterator[None]:
    """Within this context `deepspeed.utils.zero_to_fp32` loads files through `safe_load`: its module-level name
    `torch` is replaced by a stand-in whose `load` is safe (every other attribute is torch's), and restored on exit.
    Scoped to that one module: other code's torch.load is untouched. Not for concurrent use from several threads."""
    from deepspeed.utils import zero_to_fp32

    original, zero_to_fp32.torch = zero_to_fp32.torch, _SafeTorch("torch")
    try:
        yield
    finally:
        zero_to_fp32.torch = original
