"""What a long run shows and records: metrics.jsonl, TensorBoard, a progress bar, throughput, MFU (`setup_mfu`
gives a stage's logger the FLOP figures of harness.flops).

`RunLogger` writes on rank 0 only; on other ranks every call is a no-op, so the training loop calls it
unconditionally. Files under `out_dir`:

    metrics.jsonl   one JSON object per `log` call: {"stage", "step", "tokens", "time", <scalars>}
    tb/             TensorBoard event files, scalars tagged "<stage>/<name>" against the step

Resuming: construct with `start_step` (the step of the checkpoint resumed from) and `start_tokens`.
metrics.jsonl is then kept, minus every line with step > start_step (those steps are about to be redone),
so after the run the file holds exactly what an uninterrupted run would have logged (wall-clock fields
aside). TensorBoard is told the same with `purge_step=start_step + 1` (old event files stay on disk; their
later steps are hidden). Without `start_step` the run is fresh: metrics.jsonl is started empty and
TensorBoard hides every earlier event (`purge_step=0`).
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm import tqdm

from harness.files import atomic_write_text
from harness.flops import measured_peak, mfu, resolve_peak

METRICS = "metrics.jsonl"


class NonFiniteLoss(FloatingPointError):
    """The loss became NaN or infinite; the run stops and its last good checkpoint stays the newest."""

    def __init__(self, value: float, step: int, tokens: int) -> None:
        self.value, self.step, self.tokens = value, step, tokens
        super().__init__(
            f"loss is {value} at step {step} ({tokens:,} tokens); stopping without saving, so the last good "
            f"checkpoint is kept as the newest. Resume from it with a lower learning rate or check the data."
        )


class TooManySkippedSteps(FloatingPointError):
    """The engine skipped optimizer step after optimizer step for a non-finite gradient: the run stopped training."""

    def __init__(self, in_a_row: int, step: int, tokens: int) -> None:
        self.in_a_row, self.step, self.tokens = in_a_row, step, tokens
        super().__init__(
            f"{in_a_row} optimizer steps in a row were skipped for a non-finite gradient (up to step {step}, "
            f"{tokens:,} tokens): the weights have not changed since. Stopping; grad_norm and skipped_steps are in "
            f"metrics.jsonl. Resume from the last checkpoint with a lower learning rate or check the data (e.g. a token "
            f"whose teacher embedding is all zero: the student build warns about those), or "
            f"raise run.max_skipped_steps_in_a_row (0: never stop).")


class SkippedStepWatch:
    """Counts the optimizer steps skipped in a row (from the engine's running total, `skipped_steps`) and raises
    `TooManySkippedSteps` at `limit` (0: never). Every rank sees the same total (the gradients are reduced before the
    check), so every rank raises together."""

    def __init__(self, limit: int, skipped_so_far: int = 0) -> None:
        self.limit, self.last, self.in_a_row = limit, skipped_so_far, 0

    def check(self, skipped: int, step: int, tokens: int) -> None:
        """Call once per optimizer step with the engine's total of skipped steps."""
        self.in_a_row = self.in_a_row + (skipped - self.last) if skipped > self.last else 0
        self.last = skipped
        if self.limit and self.in_a_row >= self.limit:
            raise TooManySkippedSteps(self.in_a_row, step, tokens)


def check_finite(loss: float | torch.Tensor, step: int, tokens: int) -> float:
    """Return `loss` as a float, or raise `NonFiniteLoss` (the caller must not save after it).

    Under data parallelism the loss differs per rank: reduce it first (or reduce a non-finite flag), so
    that every rank raises together rather than one rank leaving the others in a collective.
    """
    value = float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else float(loss)
    if not math.isfinite(value):
        raise NonFiniteLoss(value, step, tokens)
    return value


# ----------------------------------------------------------------------------------------- throughput


def peak_memory_bytes() -> int:
    """Peak memory of this process: CUDA's max allocated if CUDA is in use, else the peak RSS."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB, macOS bytes


class Throughput:
    """Tokens/s over a sliding window of `update` calls, and MFU when the FLOP figures are given.

    `peak_flops` is the datasheet peak of all devices together (`mfu`, the usual definition: harness.flops),
    `measured_peak_flops` the measured matmul peak of all devices (`mfu_measured_peak`, docs/BENCHMARKS.md
    says which tables used it). `update(tokens)` takes the cumulative token count (as the training loop keeps it), so a resumed
    run measures only what it processes itself.
    """

    def __init__(
        self, window: int = 20, flops_per_token: Optional[float] = None, peak_flops: Optional[float] = None,
        measured_peak_flops: Optional[float] = None,
    ) -> None:
        if window < 2:
            raise ValueError("window must hold at least 2 updates")
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.measured_peak_flops = measured_peak_flops
        self._points: deque[tuple[float, int]] = deque(maxlen=window)

    def update(self, tokens: int, now: Optional[float] = None) -> None:
        self._points.append((time.perf_counter() if now is None else now, int(tokens)))

    @property
    def tokens_per_s(self) -> Optional[float]:
        """None until two updates span some time (the first step of a run or of a resume has no rate: a 0.0 there
        would read as a measurement to anyone who takes a median of the log)."""
        if len(self._points) < 2:
            return None
        (t0, n0), (t1, n1) = self._points[0], self._points[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    @property
    def mfu(self) -> Optional[float]:
        """Against the datasheet peak; None without FLOP figures or before there is a rate."""
        return self._mfu(self.peak_flops)

    @property
    def mfu_measured_peak(self) -> Optional[float]:
        """Against the measured matmul peak; None without FLOP figures or before there is a rate."""
        return self._mfu(self.measured_peak_flops)

    def _mfu(self, peak: Optional[float]) -> Optional[float]:
        rate = self.tokens_per_s
        if not self.flops_per_token or rate is None:
            return None
        return mfu(rate, self.flops_per_token, peak)

    def summary(self) -> dict[str, float]:
        """Scalars for a log line: tokens_per_s, mfu and mfu_measured_peak (each once known), peak_mem_gib."""
        out = {"peak_mem_gib": peak_memory_bytes() / 2**30}
        for key, value in (("tokens_per_s", self.tokens_per_s), ("mfu", self.mfu),
                           ("mfu_measured_peak", self.mfu_measured_peak)):
            if value is not None:
                out[key] = value
        return out


def setup_mfu(logger: "RunLogger", device: torch.device, world: int, flops_per_token: float, stage: str) -> None:
    """MFU in a stage's logs over all `world` ranks' tokens: `mfu` against the datasheet dense bf16 peak
    (harness.flops.resolve_peak; $HARNESS_PEAK_FLOPS overrides) and `mfu_measured_peak` against the matmul peak
    measured on this GPU model. A GPU without a datasheet figure gets a log line naming it, and no `mfu`."""
    tp = logger.throughput
    tp.flops_per_token = flops_per_token
    peak, measured = resolve_peak(device), measured_peak(device)
    tp.peak_flops = peak.flops * world if peak.flops else None
    tp.measured_peak_flops = measured * world if measured else None
    if peak.flops is None and device.type == "cuda":
        logger.write(f"{stage}: {peak.source}")


# ----------------------------------------------------------------------------------------- logger


def _scalar(value: Any) -> float | int | str | bool | None:
    """A JSON- and TensorBoard-friendly value (tensors and numpy scalars become Python numbers)."""
    if isinstance(value, torch.Tensor):
        return value.detach().float().item()
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl (none if it does not exist), skipping a line a crash cut short."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _truncate_metrics(path: Path, start_step: Optional[int]) -> None:
    """Keep the lines with step <= start_step (none for a fresh run); drop a line a crash cut short."""
    kept: list[str] = []
    if start_step is not None and path.exists():
        for line in path.read_text().splitlines():
            try:
                if int(json.loads(line)["step"]) <= start_step:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                continue
    atomic_write_text(path, "".join(k + "\n" for k in kept))


def seconds_since_process_start() -> Optional[float]:
    """Wall seconds since this process was created (psutil, which DeepSpeed requires), or None where unknown."""
    try:
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # no psutil, or no process table: the start-up figures are left out
        return None


class RunLogger:
    """Rank-0 logging of one stage: metrics.jsonl (one flushed line per call), TensorBoard, tqdm bar.

    The first line a logger writes also carries where the process's time went before it: `startup_setup_s`
    (process start to this logger: imports, teacher, student, data, engine) and `startup_first_log_s` (process
    start to that line: also the first logged steps, where a GPU compiles and autotunes its kernels)."""

    def __init__(
        self,
        out_dir: Path | str,
        stage: str,
        rank: int = 0,
        total_tokens: int = 0,
        enabled_tensorboard: bool = True,
        start_step: Optional[int] = None,
        start_tokens: int = 0,
        show_progress: bool = True,
        throughput: Optional[Throughput] = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.stage = stage
        self.rank = rank
        self.enabled = rank == 0
        self.throughput = throughput or Throughput()
        self._setup_s = seconds_since_process_start()
        self._logged = False
        self._file = None
        self._tb = None
        self.bar = tqdm(
            total=total_tokens or None,
            initial=start_tokens,
            unit="tok",
            unit_scale=True,
            desc=stage,
            dynamic_ncols=True,
            mininterval=1.0 if sys.stderr.isatty() else 60.0,  # a Slurm log is not a terminal: fewer lines
            disable=not (self.enabled and show_progress),
        )
        if not self.enabled:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(self.metrics_path, start_step)
        self._file = open(self.metrics_path, "a")
        if enabled_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = 0 if start_step is None else start_step + 1  # hides older runs' events at >= purge
            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tb"), purge_step=purge)

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / METRICS

    def log(self, step: int, tokens: int, **scalars: Any) -> None:
        """Record `scalars` at `step` / `tokens` and advance the bar to `tokens` (no-op off rank 0).

        Unless given, tokens_per_s and peak_mem_gib (and mfu) come from the logger's `Throughput`, which
        starts measuring at the first call (so model set-up does not count; that call's line has no tokens_per_s).
        """
        if not self.enabled:
            return
        self.throughput.update(tokens)
        values = {k: _scalar(v) for k, v in {**self.throughput.summary(), **scalars}.items()}
        record = {"stage": self.stage, "step": int(step), "tokens": int(tokens), "time": time.time(), **values}
        if not self._logged and self._setup_s is not None:
            record.update(startup_setup_s=round(self._setup_s, 1),
                          startup_first_log_s=round(seconds_since_process_start() or 0.0, 1))
        self._logged = True
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for name, v in values.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"{self.stage}/{name}", v, global_step=step)
            self._tb.add_scalar(f"{self.stage}/tokens", tokens, global_step=step)
            self._tb.flush()
        self.bar.update(max(0, int(tokens) - self.bar.n))
        rate = values.get("tokens_per_s")
        postfix = {"tok/s": f"{rate:.3g}" if isinstance(rate, (int, float)) else "-"}
        if isinstance(values.get("loss"), (int, float)):
            postfix = {"loss": f"{values['loss']:.4g}", **postfix}
        self.bar.set_postfix(postfix, refresh=False)

    def write(self, message: str) -> None:
        """Print a line above the progress bar (rank 0 only)."""
        if self.enabled:
            tqdm.write(message)

    def close(self) -> None:
        self.bar.close()
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
