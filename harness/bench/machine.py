"""The machine a bench runs on: which device and dtype, waiting for it, freeing its memory, and the record of
where and with what the numbers were taken (`environment`)."""

from __future__ import annotations

import datetime as _dt
import gc
import os
import platform
import sys
from typing import Any, Optional, Sequence

import torch

GIB = 2**30


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def resolve_dtype(name: Optional[str | torch.dtype], device: torch.device) -> torch.dtype:
    """bf16 / fp32 / auto (bf16 on CUDA, fp32 on a CPU) -> the torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
    if name not in table:
        raise ValueError(f"dtype '{name}' is not one of bf16, fp32, auto")
    return table[name]


def resolve_device(device: Optional[str | torch.device]) -> torch.device:
    """auto / cuda / cpu -> the device; CUDA without an index is this rank's GPU ($LOCAL_RANK)."""
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
    device = resolve_device(device)
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


def free_memory(*objs: Any) -> None:
    """Drop `objs`, collect garbage and return cached CUDA memory."""
    del objs
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
