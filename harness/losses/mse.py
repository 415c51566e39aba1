"""The alignment losses of stages 1 and 2 (`stages.align_*.loss`): mean squared error and the per-token L2 norm.

Stage 1 compares the student mixer's output with the teacher's attention output (o_proj, before the residual);
stage 2 compares the student block's output with the teacher's h_{l+1}. Both compute in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from harness.losses.base import AlignmentLoss


class MSE(AlignmentLoss):
    """Mean squared error: the mean over every element (batch, tokens and hidden features)."""

    name = "mse"

    def compute(self, pred: Tensor, target: Tensor) -> Tensor:
        return F.mse_loss(pred, target, reduction="mean")


class L2(AlignmentLoss):
    """The Euclidean norm (not squared) of the difference over the last (hidden) axis, averaged over the others.

    This is the stage-2 loss of the paper authors' public release (`stages.align_hidden.loss=l2`,
    jobs/paper-recipe/). Unlike MSE, its gradient per token has unit norm whatever the size of the error, so large
    and small errors pull equally hard.
    """

    name = "l2"

    def compute(self, pred: Tensor, target: Tensor) -> Tensor:
        return torch.linalg.vector_norm(pred - target, ord=2, dim=-1).mean()


class RelativeMSE(AlignmentLoss):
    """Each token's squared error over its target's squared norm (over the last axis), averaged over the tokens: 0
    where equal, 1 where a token is predicted as 0.

    Stage 3's per-layer hidden-state term (`stages.distill.hidden_weight`). Per token, because the residual stream
    grows with depth and a few tokens carry norms ~100x the median (SmolLM2-135M's first token of a row: 24,886
    against 170 after layer 15), which would otherwise outweigh the rest of the row. Not a stage-1/2 loss.
    """

    name = "rel_mse"

    def compute(self, pred: Tensor, target: Tensor) -> Tensor:
        tiny = torch.finfo(torch.float32).tiny
        return ((pred - target).square().sum(-1) / target.square().sum(-1).clamp_min(tiny)).mean()


alignment_mse = MSE()
alignment_l2 = L2()
ALIGNMENT_LOSSES = {loss.name: loss for loss in (alignment_mse, alignment_l2)}


def alignment_loss(name: str):
    """The stage-1/2 loss called `name` (a key of ALIGNMENT_LOSSES): called as loss(pred, target)."""
    if name not in ALIGNMENT_LOSSES:
        raise ValueError(f"alignment loss '{name}' is not one of {sorted(ALIGNMENT_LOSSES)}")
    return ALIGNMENT_LOSSES[name]
