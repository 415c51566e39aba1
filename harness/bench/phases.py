"""The phase clock of the step bench: stamps at fixed points of a step (CUDA events or `time.perf_counter`),
chained so that the phases of a step add up to the step, and their mean over the measured steps."""

from __future__ import annotations

import time
from typing import Any

import torch

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
