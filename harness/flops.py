"""FLOPs per token, per-GPU peaks and MFU, by the usual definition (torchtitan, flame, most papers).

    MFU = tokens/s (all devices) x FLOPs per token / (world x datasheet dense bf16 peak of one device)

FLOPs per token of stage 3 (`flops_per_token`): 6 N_student + 2 N_teacher: forward + backward of the student
(2 + 4 FLOPs per parameter and token), forward of the teacher (2). N is `harness.student.count_parameters`:
every distinct parameter, embeddings included, a tied head counted once (SmolLM2 ties them: the one matrix is
the output head's matmul, 2 V h FLOPs per token forward; the input lookup does no matmul). Dense terms only:
the teacher's attention scores (4 L s h per token forward, non-causal count as in PaLM's 12 L s h for training:
0.14 GFLOP at 135M and 0.40 GFLOP at 1.7B, seq 2048, against 1.22 and 14.3 GFLOP for 6N + 2N) and the students'
recurrences are not counted, so MFU understates the work done. A hybrid student's kept softmax-attention layers
(student.attention_layers) count as the teacher's do: their parameters (K/V at the KV heads), not a mixer's.
SFT counts 6 N_student (`dense_flops_per_token`).
`harness.observe.setup_mfu` gives a stage's logger these figures (this module does not import harness.observe).

The peak (`resolve_peak`): $HARNESS_PEAK_FLOPS (FLOP/s per device) when set, else the NVIDIA datasheet's dense
(no 2:4 sparsity) bf16 tensor-core figure for the GPU that `torch.cuda.get_device_name` names
(`DATASHEET_PEAK_FLOPS`, matched by `gpu_model`). A GPU not in the table has no peak, and the caller says so
instead of using another GPU's figure; a CPU has none either.

A second, named quantity (the denominator of docs/BENCHMARKS.md's older figures): `MEASURED_PEAK_FLOPS`, an 8192^3 bf16
`torch.matmul` measured on our H200 (788 TFLOP/s, 0.797 of the datasheet's 989); `harness bench` reports
`mfu_measured_peak` against it beside `mfu` (`resolve_measured_peak`: that figure, or a fresh
`measure_matmul_peak`). MFU by the datasheet = MFU by the measured peak x 788 / 989.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Optional

import torch

PEAK_ENV = "HARNESS_PEAK_FLOPS"

# Dense bf16 tensor-core FLOP/s per GPU: half of the datasheets' "with sparsity" figures (H100 / H200 product
# pages and datasheets, A100 datasheet: 1,979 / 1,513 / 1,671 / 624 TFLOPS with sparsity).
DATASHEET_PEAK_FLOPS: dict[str, float] = {
    "H100 SXM": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200 SXM": 989e12,
    "H200 NVL": 835e12,
    "A100": 312e12,  # SXM4 and PCIe, 40 and 80 GB alike
}

# torch.cuda.get_device_name after `_normalise` -> model. Whole-name matches, so that a GH200, H800, A800 or a
# MIG slice ("NVIDIA H200 MIG 1g.18gb") is unknown rather than taken for a GPU whose figure is not its own.
_MEM = r"(?: \d+gb)?"
GPU_NAME_PATTERNS: tuple[tuple[str, str], ...] = (
    (rf"h100(?: sxm5?)?{_MEM} hbm3e?|h100 sxm5?{_MEM}", "H100 SXM"),  # "NVIDIA H100 80GB HBM3"
    (rf"h100{_MEM} pcie{_MEM}", "H100 PCIe"),  # "NVIDIA H100 PCIe"
    (rf"h100 nvl{_MEM}", "H100 NVL"),  # "NVIDIA H100 NVL"
    (rf"h200(?: sxm5?)?{_MEM}(?: hbm3e)?", "H200 SXM"),  # "NVIDIA H200"
    (rf"h200 nvl{_MEM}", "H200 NVL"),  # "NVIDIA H200 NVL"
    (r"a100(?: (?:sxm4?|pcie|\d+gb))+", "A100"),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"
)

# bf16 dense matmul peak measured on our GPUs (8192^3 torch.matmul on random data; docs/BENCHMARKS.md): the
# denominator of `mfu_measured_peak`, by the raw device name.
MEASURED_PEAK_FLOPS: dict[str, float] = {"NVIDIA H200": 788e12}


@dataclass(frozen=True)
class Peak:
    """A per-device peak FLOP/s and where it came from; `flops` None = unknown, `source` then says why."""

    flops: Optional[float]
    source: str


def _normalise(device_name: str) -> str:
    """'NVIDIA A100-SXM4-80GB' -> 'a100 sxm4 80gb': lower case, no vendor prefix, '-' / '_' as spaces."""
    name = re.sub(r"[-_\s]+", " ", device_name.strip().lower())
    return name.removeprefix("nvidia ").strip()


def gpu_model(device_name: str) -> Optional[str]:
    """The `DATASHEET_PEAK_FLOPS` key of a `torch.cuda.get_device_name` string, or None for a GPU not listed."""
    name = _normalise(device_name)
    return next((model for pattern, model in GPU_NAME_PATTERNS if re.fullmatch(pattern, name)), None)


def datasheet_peak(device_name: str) -> Optional[float]:
    """Dense bf16 datasheet FLOP/s of the named GPU, or None when it is not in the table."""
    model = gpu_model(device_name)
    return DATASHEET_PEAK_FLOPS[model] if model else None


def unknown_gpu_message(device_name: str) -> str:
    """What to tell the user when a GPU has no datasheet peak here."""
    return (f"no datasheet dense bf16 peak for GPU {device_name!r} (known: {', '.join(DATASHEET_PEAK_FLOPS)}), "
            f"so no MFU: pass --peak-flops (harness bench) or set {PEAK_ENV} to its peak FLOP/s per device")


def _device_name(device: torch.device) -> Optional[str]:
    return torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else None


def resolve_peak(device: torch.device, device_name: Optional[str] = None) -> Peak:
    """The peak of `mfu`: $HARNESS_PEAK_FLOPS, else the datasheet figure of this GPU; unknown GPU or CPU: None
    with the reason. `device_name` stands in for torch.cuda.get_device_name (tests, other tools)."""
    if os.environ.get(PEAK_ENV):
        return Peak(float(os.environ[PEAK_ENV]), f"${PEAK_ENV}")
    name = device_name or _device_name(device)
    if name is None:
        return Peak(None, f"no MFU on CPU (set {PEAK_ENV} or pass --peak-flops to give a peak)")
    model = gpu_model(name)
    if model is None:
        return Peak(None, unknown_gpu_message(name))
    return Peak(DATASHEET_PEAK_FLOPS[model], f"datasheet dense bf16 peak of {model} ({name!r}): "
                f"{DATASHEET_PEAK_FLOPS[model] / 1e12:.0f} TFLOP/s")


def peak_flops(device: torch.device) -> Optional[float]:
    """Per-device peak FLOP/s of `mfu` (`resolve_peak`), or None when unknown."""
    return resolve_peak(device).flops


def measured_peak(device: torch.device, device_name: Optional[str] = None) -> Optional[float]:
    """The matmul peak measured on this GPU model (`MEASURED_PEAK_FLOPS`), or None."""
    name = device_name or _device_name(device)
    return MEASURED_PEAK_FLOPS.get(name) if name else None


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: Optional[int] = None,
                        reps: int = 20) -> float:
    """FLOP/s of an n^3 matmul on random data (median of `reps`): 8192 in `dtype` on CUDA, 1024 on a CPU."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    n = n or (8192 if cuda else 1024)
    dtype = dtype if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / sorted(times)[len(times) // 2]


def resolve_measured_peak(device: torch.device, dtype: torch.dtype,
                          measure: bool = False) -> tuple[Optional[float], str]:
    """(peak FLOP/s per device of `mfu_measured_peak`, where it came from): a fresh matmul measurement
    (--measure-peak), else the figure measured before for this GPU (`MEASURED_PEAK_FLOPS`), else a
    measurement on CUDA; on a CPU without --measure-peak: None."""
    if measure:
        return measure_matmul_peak(device, dtype), f"measured now ({_matmul_desc(device, dtype)})"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = measured_peak(device, name)
        if known:
            return known, f"harness.flops.MEASURED_PEAK_FLOPS[{name!r}] = {known:.3g} (8192^3 bf16 matmul)"
        return measure_matmul_peak(device, dtype), f"measured now ({_matmul_desc(device, dtype)})"
    return None, "none on CPU (pass --measure-peak)"


def _matmul_desc(device: torch.device, dtype: torch.dtype) -> str:
    return "8192^3 bf16 matmul" if device.type == "cuda" and dtype == torch.bfloat16 else \
        ("8192^3 matmul" if device.type == "cuda" else "1024^3 fp32 matmul")


def _sync(device: torch.device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def dense_flops_per_token(n_params: int, training: bool = True) -> float:
    """The usual 6N (forward + backward) or 2N (forward only) estimate, without attention terms (SFT: 6 N)."""
    return (6.0 if training else 2.0) * n_params


def flops_per_token(n_student: int, n_teacher: int) -> float:
    """Stage-3 FLOPs per token: 6 N_student (forward + backward) + 2 N_teacher (forward only), dense only."""
    return 6.0 * n_student + 2.0 * n_teacher


def model_flops_per_token(student: torch.nn.Module, teacher: torch.nn.Module) -> float:
    """`flops_per_token` of two models, N = `harness.student.count_parameters` (embeddings in, tied once)."""
    from harness.student import count_parameters

    return flops_per_token(count_parameters(student), count_parameters(teacher))


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops_per_device: Optional[float],
        world: int = 1) -> Optional[float]:
    """Model FLOPs utilisation (0..1): `tokens_per_s` (global, all devices) x FLOPs/token over the peak of all
    `world` devices; None when the peak is unknown."""
    if not peak_flops_per_device:
        return None
    return tokens_per_s * flops_per_tok / (peak_flops_per_device * world)
