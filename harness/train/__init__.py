"""The one training loop of stage 3, SFT and the step bench (`Trainer`, trainer.py) and what it does between
optimizer steps (hooks.py: checkpoints, validation, evaluation snapshots, preemption, logging, the NaN and
skipped-step guards). The engines it drives are harness.engine's (`StudentEngine`: DeepSpeed, or the plain engine)."""

from harness.train.hooks import (Checkpointer, Checkpointing, EvalSnapshots, FiniteLoss, Logging, Preemption,
                                 SkippedSteps, StopAfter, Validation, held_out_losses, held_out_validation,
                                 stage_hooks)
from harness.train.trainer import Hook, LossSums, NoClock, StepContext, StopTraining, Trainer, TrainState

__all__ = ["Checkpointer", "Checkpointing", "EvalSnapshots", "FiniteLoss", "Hook", "Logging", "LossSums", "NoClock",
           "Preemption", "SkippedSteps", "StepContext", "StopAfter", "StopTraining", "TrainState", "Trainer",
           "Validation", "held_out_losses", "held_out_validation", "stage_hooks"]
