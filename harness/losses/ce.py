"""Next-token cross-entropy (`ce`): the student's loss on the data's own next tokens, at temperature 1."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from harness.losses.base import TokenLoss


class CrossEntropy(TokenLoss):
    """CE = logsumexp(s) - s[y] per predicted token. It always uses the plain softmax: temperature must be 1."""

    name = "ce"
    needs_teacher = False

    def __init__(self, weight: float = 1.0, temperature: float = 1.0):
        if temperature != 1.0:
            raise ValueError(f"loss 'ce' is computed at temperature 1, not {temperature}")
        super().__init__(weight, temperature)

    def chunk(self, s: Tensor, t: Optional[Tensor], y: Tensor, need_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
        lse = torch.logsumexp(s, dim=-1, keepdim=True)
        total = lse.squeeze(1) - s.gather(1, y[:, None]).squeeze(1)
        if not need_grad:
            return total, None
        grad = (s - lse).exp_()  # d CE / d s = softmax(s) - onehot(y)
        grad.scatter_add_(1, y[:, None], grad.new_full((grad.shape[0], 1), -1.0))
        return total, grad
