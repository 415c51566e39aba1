"""The training loop of stage 3, SFT and `harness bench --what step`: `Trainer`.

    forward_backward_step(batch)  one micro-step: the stage's forward (batch -> LossTerms), the backward of its
                                  token-weighted loss, the engine's step() (which steps the optimizer at the end of
                                  an accumulation window); the loss terms are summed on the device
    train_step(batches)           micro-steps up to the engine's accumulation boundary: one optimizer step; its loss
                                  terms reduced over the ranks and read to the host once (one `.tolist()`)
    train(loader, state, steps)   optimizer steps until the loader is spent, each followed by the hooks'
                                  `after_step`, then their `at_end` (harness.train.hooks: checkpoints, validation,
                                  evaluation snapshots, preemption, logging, the NaN and skipped-step guards)

The loss of an optimizer step is the per-token mean over all its predicted tokens on all ranks and micro-batches:
each micro-batch's mean is weighted by its share of the step's tokens (`token_scale`), so N processes at
micro-batch b give the losses of one process at micro-batch N*b. Every term the loss reports is logged under its
name ("loss" is the total).

A `clock` (anything with `mark(phase)`, e.g. harness.bench.phases.PhaseClock) is stamped at fixed points of a
micro-step ("other" after the forward, "backward", "optimizer") and of a step ("other" after the reduction); the
stage's forward stamps its own phases with the same clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import torch

from harness.engine import StudentEngine
from harness.losses import LossTerms
from harness.stages.common import scaled, token_scale


class Clock(Protocol):
    def mark(self, phase: str) -> None: ...


class NoClock:
    """The clock of a training run: no stamps."""

    def mark(self, phase: str) -> None:
        pass


class Hook:
    """Something the loop does once before its first step (`at_start`, with the state it resumes from), after each
    optimizer step (`after_step`) and once when the data is spent (`at_end`, not after a `StopTraining`). Hooks run
    in their list's order and share the step's `StepContext`."""

    def at_start(self, trainer: "Trainer", state: "TrainState") -> None:
        pass

    def after_step(self, trainer: "Trainer", ctx: "StepContext") -> None:
        pass

    def at_end(self, trainer: "Trainer", ctx: "StepContext") -> None:
        pass


class StopTraining(Exception):
    """Raised by a hook to end training after this step, without the end hooks (tests stop a stage early so)."""


@dataclass
class TrainState:
    """Where the stage is: optimizer steps done, tokens consumed (the loader's count), whether a hook stopped it."""

    step: int = 0
    tokens: int = 0
    stopped: bool = False


@dataclass
class StepContext:
    """One optimizer step as the hooks see it.

    losses: the step's per-token means over all ranks ("loss" and each term; empty at the end); last: the stage's
    planned last step (the end hooks checkpoint and validate there); scalars: more values for this step's log line
    (validation adds val_*); saved: whether a checkpoint of this step was written (at most one is)."""

    step: int
    tokens: int
    last: bool
    losses: dict[str, float] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)
    saved: bool = False


class LossSums:
    """The token-weighted sums of an optimizer step's loss terms, kept on the device: no host sync per micro-step."""

    def __init__(self) -> None:
        self.names: tuple[str, ...] = ()
        self.sums: Optional[torch.Tensor] = None
        self.step_tokens = 0

    def add(self, losses: LossTerms, step_tokens: int) -> None:
        values = losses.stacked().double() * losses.tokens
        self.sums = values if self.sums is None else self.sums + values
        self.names, self.step_tokens = losses.names(), step_tokens

    def reset(self) -> None:
        self.sums = None

    def means(self, world: int) -> dict[str, float]:
        """The step's per-token means over all ranks (one all-reduce, one read to the host); starts a new step."""
        sums, self.sums = self.sums, None
        if sums is None:
            return {}
        if world > 1:
            torch.distributed.all_reduce(sums)
        return dict(zip(self.names, (sums / max(self.step_tokens, 1)).tolist()))


class Trainer:
    """The loop; see the module docstring. `forward(batch) -> LossTerms` is the stage's micro-step forward (it moves
    the batch to the device, runs the teacher if any, then the engine's module); `engine` a
    harness.engine.StudentEngine; `world` the data-parallel processes; `hooks` run after each step."""

    def __init__(self, engine: StudentEngine, forward: Callable[[dict], LossTerms], *, grad_accum: int, world: int,
                 hooks: Sequence[Hook] = (), clock: Optional[Clock] = None) -> None:
        self.engine, self.forward = engine, forward
        self.grad_accum, self.world = grad_accum, world
        self.hooks = list(hooks)
        self.clock = clock or NoClock()
        self.sums = LossSums()

    def forward_backward_step(self, batch: dict) -> LossTerms:
        """One micro-step: forward, backward of the token-weighted loss, the engine's step(); terms summed."""
        losses = self.forward(batch)
        self.clock.mark("other")
        step_tokens = batch.get("step_targets", losses.tokens * self.world * self.grad_accum)
        weight = token_scale(losses.tokens, step_tokens, self.world, self.grad_accum)
        self.engine.backward(scaled(losses.total, weight))
        self.clock.mark("backward")
        self.engine.step()
        self.clock.mark("optimizer")
        self.sums.add(losses, step_tokens)
        return losses

    def train_step(self, batches: Iterator[dict]) -> Optional[dict[str, float]]:
        """Micro-steps up to the engine's accumulation boundary (one optimizer step) -> the step's loss terms
        (per-token means over all ranks); None when `batches` ran out first."""
        while True:
            batch = next(batches, None)
            if batch is None:
                self.sums.reset()  # a partial window (the loaders stop at whole steps)
                return None
            boundary = self.engine.is_gradient_accumulation_boundary()  # before step(), which advances it
            self.forward_backward_step(batch)
            if boundary:
                break
        losses = self.sums.means(self.world)
        self.clock.mark("other")
        return losses

    def train(self, loader: Iterable[dict], state: TrainState, steps: int) -> TrainState:
        """The start hooks, then optimizer steps until `loader` is spent (`steps`: the stage's plan), each followed by
        the hooks; then the end hooks, unless a hook raised `StopTraining`. `state` is where the stage resumed;
        returns where it is."""
        for hook in self.hooks:
            hook.at_start(self, state)
        batches = iter(loader)
        while (losses := self.train_step(batches)) is not None:
            state.step, state.tokens = state.step + 1, loader.tokens_consumed
            ctx = StepContext(state.step, state.tokens, state.step >= steps, losses)
            try:
                for hook in self.hooks:
                    hook.after_step(self, ctx)
            except StopTraining:
                state.stopped = True
                return state
        ctx = StepContext(state.step, state.tokens, True)
        for hook in self.hooks:
            hook.at_end(self, ctx)
        return state
