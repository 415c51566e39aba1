"""Learning-rate schedules as multipliers of the peak LR, indexed by optimizer step (LambdaLR-style).

`step` is the 0-based index of the optimizer step about to be taken: LambdaLR evaluates the multiplier
for step 0 at construction and for step k after the k-th `scheduler.step()`. A stage of `total_steps`
steps trains at steps 0 .. total_steps - 1.

- warmup: linear, the first step at 1/warmup_steps of the peak and step warmup_steps - 1 at the peak
  (no step is wasted at LR 0).
- wsd (warmup-stable-decay): the peak until the last ceil(decay_fraction * total_steps) steps, then a
  linear decay whose last step is exactly min_lr_ratio. Linear, not 1-sqrt: Hagele et al. (2024) report
  1-sqrt somewhat better for pretraining, but nothing here has measured it for distillation, and the
  linear shape is the conventional default whose values are easy to check.
- cosine: after warmup, a half cosine from the peak (first step after warmup) to min_lr_ratio (last step).
- constant: warmup, then the peak (min_lr_ratio unused).
When warmup and decay overlap (very short stages), the smaller of the two multipliers applies.
"""

from __future__ import annotations

import functools
import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from harness.config import StageConfig
from harness.config_choices import Schedule

__all__ = ["lr_multiplier", "warmup_steps_for", "decay_steps_for", "build_scheduler"]


def warmup_steps_for(total_steps: int, warmup_fraction: float) -> int:
    """Warmup steps of a stage, as `harness.config.plan_stages` counts them (rounded down)."""
    return int(total_steps * warmup_fraction)


def decay_steps_for(total_steps: int, decay_fraction: float) -> int:
    """WSD decay steps: ceil(decay_fraction * total_steps), so any positive fraction decays at least one
    step (the tolerance keeps float noise such as 0.1 * 30 = 3.0000000000000004 from adding a step)."""
    return min(total_steps, math.ceil(decay_fraction * total_steps - 1e-9))


def lr_multiplier(
    step: int,
    total_steps: int,
    *,
    schedule: str,
    warmup_steps: int,
    decay_fraction: float,
    min_lr_ratio: float,
) -> float:
    """Multiplier of the peak LR for optimizer step `step` (0-based) of a `total_steps`-step stage.

    Steps past the end keep the final value.
    """
    _check(total_steps, schedule, warmup_steps, decay_fraction, min_lr_ratio)
    warm = (step + 1) / warmup_steps if step < warmup_steps else 1.0
    if schedule == "constant":
        return warm
    if schedule == "wsd":
        decay_steps = decay_steps_for(total_steps, decay_fraction)
        progress = (step - (total_steps - decay_steps) + 1) / decay_steps if decay_steps else 0.0
        shape = 1.0 - _clamp01(progress)
    else:  # cosine: from the first step after warmup (peak) to the last (min_lr_ratio)
        span = total_steps - warmup_steps - 1
        progress = (step - warmup_steps) / span if span > 0 else 1.0
        shape = 0.5 * (1.0 + math.cos(math.pi * _clamp01(progress)))
    # Written so that shape 1 gives exactly 1.0 and shape 0 exactly min_lr_ratio.
    after = 1.0 if shape == 1.0 else min_lr_ratio + (1.0 - min_lr_ratio) * shape
    return min(warm, after)


def build_scheduler(optimizer: Optimizer, stage_cfg: StageConfig, total_steps: int) -> LambdaLR:
    """A LambdaLR over the stage's optimizer steps; the optimizer's LR must be the stage's peak LR."""
    settings = dict(
        schedule=stage_cfg.schedule,
        warmup_steps=warmup_steps_for(total_steps, stage_cfg.warmup_fraction),
        decay_fraction=stage_cfg.decay_fraction,
        min_lr_ratio=stage_cfg.min_lr_ratio,
    )
    _check(total_steps, **settings)
    # A partial (not a lambda) so that the scheduler's state_dict can be pickled with a checkpoint.
    return LambdaLR(optimizer, functools.partial(lr_multiplier, total_steps=total_steps, **settings))


def _clamp01(x: float) -> float:
    return min(max(x, 0.0), 1.0)


def _check(total_steps: int, schedule: str, warmup_steps: int, decay_fraction: float, min_lr_ratio: float) -> None:
    if schedule not in Schedule.values():
        raise ValueError(f"Unknown schedule '{schedule}'; allowed: {', '.join(Schedule.values())}")
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
    if not 0.0 <= decay_fraction <= 1.0 or not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"decay_fraction={decay_fraction} and min_lr_ratio={min_lr_ratio} must lie in [0, 1]")
