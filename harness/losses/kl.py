"""KL divergences between the teacher's and the student's next-token distributions, both softened by a temperature:
forward, KL(teacher || student) (`kl`), and reverse, KL(student || teacher) (`reverse_kl`).

Convention. KL(teacher || student) = sum_v p_t (log p_t - log p_s), both softmaxes at temperature tau, averaged
over predicted tokens and multiplied by tau^2 (Hinton et al. 2015: the gradient of the softened KL scales as
1/tau^2, so the factor keeps CE and KL balanced when tau changes). The per-token mean keeps the KL on the same
scale as the per-token CE. A common alternative, `F.kl_div(log_q, p, reduction="batchmean")` on [B, T, V] tensors,
divides the sum over all tokens by B only, which weights KL ~T times more than CE (one public linearization recipe
does this); the weights of the KL terms in this harness are relative to the per-token CE. Reverse KL follows
the same convention with the two distributions swapped.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from harness.losses.base import TokenLoss


def softened_log_probs(logits: Tensor, tau: float) -> Tensor:
    """log softmax(logits / tau) over the last axis, in a new tensor."""
    return torch.log_softmax(logits if tau == 1.0 else logits / tau, dim=-1)


class ForwardKL(TokenLoss):
    """`kl`: tau^2 KL(teacher || student) = tau^2 sum_v p (log p - log q), p = softmax(t / tau), q = softmax(s / tau).

    Mass-covering: the student is pushed up wherever the teacher puts probability.
    """

    name = "kl"
    needs_teacher = True

    def chunk(self, s: Tensor, t: Optional[Tensor], y: Tensor, need_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
        tau = self.temperature
        log_p, log_q = softened_log_probs(t, tau), softened_log_probs(s, tau)
        p = log_p.exp()
        total = (p * (log_p - log_q)).sum(-1) * tau**2
        if not need_grad:
            return total, None
        return total, log_q.exp_().sub_(p).mul_(tau)  # d(tau^2 KL)/ds = tau (q - p)


class ReverseKL(TokenLoss):
    """`reverse_kl`: tau^2 KL(student || teacher) = tau^2 sum_v q (log q - log p), softmaxes at tau as in `kl`.

    Mode-seeking: the student is pushed down wherever the teacher puts little probability, rather than spread over
    everything the teacher allows.
    """

    name = "reverse_kl"
    needs_teacher = True

    def chunk(self, s: Tensor, t: Optional[Tensor], y: Tensor, need_grad: bool) -> tuple[Tensor, Optional[Tensor]]:
        tau = self.temperature
        log_p, log_q = softened_log_probs(t, tau), softened_log_probs(s, tau)
        q = log_q.exp()
        log_ratio = log_q.sub_(log_p)
        per_row = (q * log_ratio).sum(-1, keepdim=True)
        total = per_row.squeeze(1) * tau**2
        if not need_grad:
            return total, None
        # d(tau^2 sum_v q f)/ds = tau q (f - sum_v q f), f = log q - log p (the softmax's Jacobian at s / tau)
        return total, log_ratio.sub_(per_row).mul_(q).mul_(tau)
