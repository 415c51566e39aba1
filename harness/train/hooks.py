"""What the training loop does between optimizer steps, one hook per concern (`harness.train.trainer.Hook`), and the
list a training stage runs (`stage_hooks`), in this order after each step:

    FiniteLoss      a NaN or infinite step loss stops the run (NonFiniteLoss) before anything is saved
    SkippedSteps    run.max_skipped_steps_in_a_row optimizer steps skipped in a row stop it (TooManySkippedSteps)
    Validation      held-out losses every N steps (val_<term>, val_ppl) and at the end
    Logging         metrics.jsonl / TensorBoard / progress bar every run.log_every_steps and at the last step:
                    "loss" and every term by name, lr, grad_norm, skipped_steps, and what the hooks before added
    Checkpointing   every run.checkpoint_every_tokens and at the end
    EvalSnapshots   stage 3's evaluations along training (eval.every_tokens): a checkpoint, then a snapshot mark
                    (and, before the first step of a fresh stage 3, a mark of the merged student: eval.during.at_start)
    Preemption      a preemption request (SIGTERM / SIGUSR1 / the preempt file, agreed by all ranks): checkpoint,
                    then exit for requeue (Preempted)
    StopAfter       tests: stop after N steps as if the process died there

A checkpoint is written at most once per step (`Checkpointer.save`), whichever hook asks first. At the end (the
data spent) the same hooks validate, log, checkpoint and mark the last snapshot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from harness import preempt
from harness.checkpoint import CheckpointManager
from harness.config import RunConfig
from harness.observe import RunLogger, SkippedStepWatch, check_finite
from harness.stages.common import grad_norm, save_checkpoint, skipped_steps
from harness.train.trainer import Hook, StepContext, StopTraining, Trainer, TrainState


class Checkpointer:
    """A stage's checkpoints (engine, loader position, RNG: harness.stages.common.save_checkpoint), one per step."""

    def __init__(self, ckpts: CheckpointManager, engine: Any, loader: Any) -> None:
        self.ckpts, self.engine, self.loader = ckpts, engine, loader

    def save(self, ctx: StepContext) -> None:
        if not ctx.saved:
            save_checkpoint(self.ckpts, self.engine, self.loader, ctx.step, ctx.tokens)
            ctx.saved = True

    def latest(self) -> Path:
        return self.ckpts.latest_valid().path


class FiniteLoss(Hook):
    def after_step(self, trainer: Trainer, ctx: StepContext) -> None:
        check_finite(ctx.losses["loss"], ctx.step, ctx.tokens)  # the same value on every rank: all raise together


class SkippedSteps(Hook):
    def __init__(self, limit: int, engine: Any) -> None:
        self.watch = SkippedStepWatch(limit, skipped_steps(engine))

    def after_step(self, trainer: Trainer, ctx: StepContext) -> None:
        self.watch.check(skipped_steps(trainer.engine), ctx.step, ctx.tokens)


class Validation(Hook):
    """`validate()` (held-out losses, see `held_out_losses`) every `every` steps but the last, and at the end."""

    def __init__(self, validate: Callable[[], dict[str, float]], every: int) -> None:
        self.validate, self.every = validate, every

    def after_step(self, trainer: Trainer, ctx: StepContext) -> None:
        if self.every and ctx.step % self.every == 0 and not ctx.last:  # the end validates, whatever the multiple
            ctx.scalars.update(self.validate())

    def at_end(self, trainer: Trainer, ctx: StepContext) -> None:
        ctx.scalars.update(self.validate())


class Logging(Hook):
    """A log line every `every` steps and at the last (the step's losses, the names of its terms as `loss_terms`, lr,
    gradient norm, skipped steps and the scalars of the hooks before), a line of those scalars alone at other steps
    that have some, one at the end. `loss_terms` tells readers of metrics.jsonl (harness.eval.training) which of a
    line's values are loss terms."""

    def __init__(self, logger: RunLogger, every: int) -> None:
        self.logger, self.every = logger, every

    def after_step(self, trainer: Trainer, ctx: StepContext) -> None:
        engine = trainer.engine
        if ctx.step % self.every == 0 or ctx.last:
            terms = [name for name in ctx.losses if name != "loss"]
            self.logger.log(ctx.step, ctx.tokens, **ctx.losses, loss_terms=terms, lr=engine.get_lr()[0],
                            grad_norm=grad_norm(engine), skipped_steps=skipped_steps(engine), **ctx.scalars)
        elif ctx.scalars:
            self.logger.log(ctx.step, ctx.tokens, **ctx.scalars)

    def at_end(self, trainer: Trainer, ctx: StepContext) -> None:
        self.logger.log(ctx.step, ctx.tokens, **ctx.scalars)


class Checkpointing(Hook):
    """A checkpoint each time the tokens pass a multiple of `every` (0: none) but at the last step, and at the end."""

    def __init__(self, checkpointer: Checkpointer, every: int, tokens: int) -> None:
        self.checkpointer, self.every = checkpointer, every
        self.next = (tokens // every + 1) * every if every else None

    def after_step(self, trainer: Trainer, ctx: StepContext) -> None:
        if self.next is not None and ctx.tokens >= self.next and not ctx.last:
            self.checkpointer.save(ctx)
            self.next += self.every

    def at_end(self, trainer: Trainer, ctx: StepContext) -> None:
        self.checkpointer.save(ctx)


class EvalSnapshots(Hook):
    """Stage 3's evaluations along training (harness.eval.during.DuringTraining): at the start of a fresh stage the
    merged student (eval.during.at_start), at each due token count a checkpoint and a snapshot mark, at the end the
    last point of the curve, whatever the multiple."""

    def __init__(self, during: Any, checkpointer: Checkpointer, tokens: int) -> None:
        self.during, self.checkpointer, self.before = during, checkpointer, tokens

    def at_start(self, trainer: Trainer, state: TrainState) -> None:
        self.during.mark_start(state.tokens)

    def after_step(self, trainer: Trainer, ctx: StepContext) -> None:
        due, self.before = self.during.due(self.before, ctx.tokens), ctx.tokens
        if due and not ctx.last:
            self.checkpointer.save(ctx)
            self.during.mark(due, ctx.step, self.checkpointer.latest())

    def at_end(self, trainer: Trainer, ctx: StepContext) -> None:
        if self.during.every and ctx.tokens not in self.during.done:
            self.during.mark([ctx.tokens], ctx.step, self.checkpointer.latest())


class Preemption(Hook):
    """A preemption request that every rank agrees on: a checkpoint of this step, then `Preempted` (exit 85)."""

    def __init__(self, checkpointer: Checkpointer, logger: RunLogger, stage: str) -> None:
        self.checkpointer, self.logger, self.stage = checkpointer, logger, stage

    def after_step(self, trainer: Trainer, ctx: StepContext) -> None:
        if not ctx.last and preempt.agreed():
            self.checkpointer.save(ctx)
            self.logger.write(f"{self.stage}: preempted at step {ctx.step}; checkpoint written, exiting to be requeued")
            raise preempt.Preempted()


class StopAfter(Hook):
    """Tests: stop after `steps` optimizer steps (None: never), before the last, without the end hooks."""

    def __init__(self, steps: Optional[int]) -> None:
        self.steps = steps

    def after_step(self, trainer: Trainer, ctx: StepContext) -> None:
        if self.steps is not None and ctx.step >= self.steps and not ctx.last:
            raise StopTraining()


@torch.no_grad()
def held_out_losses(engine: Any, forward: Callable[[dict], Any], batches: Iterable[dict]) -> dict[str, float]:
    """Each loss term's per-token mean over the held-out `batches` of all ranks (val_<term>), and val_ppl =
    exp(val_ce). Every rank runs every batch (ZeRO-3 gathers are collectives); the engine is in eval mode meanwhile."""
    engine.eval()
    names: tuple[str, ...] = ()
    sums: Optional[torch.Tensor] = None
    for batch in batches:
        losses = forward(batch)
        values = torch.stack([*losses.terms.values(), losses.total.new_ones(())]).double() * losses.tokens
        sums = values if sums is None else sums + values
        names = tuple(losses.terms)
    engine.train()
    if sums is None:
        return {}
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(sums)
    *totals, count = sums.tolist()
    means = {f"val_{name}": total / max(count, 1) for name, total in zip(names, totals)}
    if "val_ce" in means:
        means["val_ppl"] = float(torch.tensor(means["val_ce"]).exp())
    return means


def held_out_validation(engine: Any, forward: Callable[[dict], Any], data: Any, batch_size: int, rank: int,
                        world: int) -> Optional[Callable[[], dict[str, float]]]:
    """The validation of a stage's held-out data (harness.stages.common.StageData.validation: batches of
    `batch_size` per rank), or None when the stage has none."""
    if data.validation is None:
        return None
    return lambda: held_out_losses(engine, forward, data.validation(batch_size, rank, world))


def stage_hooks(stage: str, run: RunConfig, *, engine: Any, logger: RunLogger, checkpointer: Checkpointer,
                tokens: int, validate: Optional[Callable[[], dict[str, float]]] = None, validate_every: int = 0,
                during: Any = None, stop_after: Optional[int] = None) -> list[Hook]:
    """The hooks of a training stage in their order (module docstring); `tokens`: where the stage resumed."""
    hooks: list[Hook] = [FiniteLoss(), SkippedSteps(run.max_skipped_steps_in_a_row, engine)]
    if validate is not None:
        hooks.append(Validation(validate, validate_every))
    hooks += [Logging(logger, run.log_every_steps), Checkpointing(checkpointer, run.checkpoint_every_tokens, tokens)]
    if during is not None:
        hooks.append(EvalSnapshots(during, checkpointer, tokens))
    return hooks + [Preemption(checkpointer, logger, stage), StopAfter(stop_after)]
