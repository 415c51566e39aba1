"""What every loss term is: a `Loss` named as job configs name it, of one of two kinds.

- `AlignmentLoss` (stages 1 and 2, mse.py): a student tensor against the teacher's tensor of the same shape;
  autograd takes the gradient.
- `TokenLoss` (stage 3 and SFT: kl.py, ce.py): a weighted next-token term on the fp32 logits of a chunk of
  predicted tokens, returning its sum over the chunk and, when asked, its gradient with respect to the student's
  logits, so that `harness.losses.chunked.ChunkedLoss` never keeps a chunk's logits for the backward pass.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional

from torch import Tensor

IGNORE_INDEX = -100  # a label that is no training target


class Loss(ABC):
    """A loss term, called `name` in a job's config."""

    name: ClassVar[str]


class AlignmentLoss(Loss):
    """A loss between a prediction and a target of one shape (no broadcasting), returned as an fp32 scalar."""

    def __call__(self, pred: Tensor, target: Tensor) -> Tensor:
        if pred.shape != target.shape:
            raise ValueError(f"alignment loss '{self.name}': pred {tuple(pred.shape)} and target "
                             f"{tuple(target.shape)} differ")
        return self.compute(pred.float(), target.float())

    @abstractmethod
    def compute(self, pred: Tensor, target: Tensor) -> Tensor:
        """The loss of two fp32 tensors of one shape."""


class TokenLoss(Loss):
    """A next-token term with its `weight` in the trained sum and the softmax `temperature` it compares at.

    needs_teacher: whether `chunk` reads the teacher's logits.
    """

    needs_teacher: ClassVar[bool]

    def __init__(self, weight: float = 1.0, temperature: float = 1.0):
        if weight < 0:
            raise ValueError(f"loss '{self.name}': weight={weight} must be >= 0")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0")
        self.weight, self.temperature = float(weight), float(temperature)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(weight={self.weight}, temperature={self.temperature})"

    @abstractmethod
    def chunk(self, s: Tensor, t: Optional[Tensor], y: Tensor, need_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
        """(the term's value on each of the chunk's c rows [c] fp32, the gradient of their sum d sum / d s [c, V] fp32,
        or None if not need_grad). Per row, so that `ChunkedLoss` can weight rows (stages.distill.copy_weight).

        s, t: [c, V] fp32 student and teacher logits (t None without a teacher), y: [c] target ids. Neither s nor t
        is written to: several terms read the same chunk.
        """
