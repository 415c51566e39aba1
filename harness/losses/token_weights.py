"""Per-token weights of the stage-3 loss: more weight on the tokens that in-context copying predicts.

A target token ids[j] is a *copy token* when the n-gram ending at it, (ids[j-n+1], ..., ids[j]), already occurred
earlier in the same row: a head that finds the previous occurrence of the n-1 tokens before it and copies the token
that followed predicts ids[j] exactly (the induction mechanism, Olsson et al. 2022). Natural text gives the copy
skill little signal (docs/results/retrieval-135m/); `stages.distill.copy_weight` multiplies the loss on these tokens.
Their share of the targets in 2048-token rows of embedded:wikipedia: 21% for n = 2 (common pairs such as "of the"
repeat), 8.2% for n = 3, 3.9% for n = 4 (scripts/copy_token_share.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def repeated_ngrams(input_ids: Tensor, n: int) -> Tensor:
    """[B, T] bool: True at j >= n-1 where the n-gram ids[j-n+1 .. j] equals the one ending at some earlier i of the
    same row. Each n-gram becomes one integer (dense ranks, exact for any vocabulary), then one stable sort per row
    marks the later ones of equal keys; O(n T log T)."""
    if n < 1:
        raise ValueError(f"n={n}: an n-gram has at least one token")
    ids = input_ids.long()
    rows, length = ids.shape
    repeated = torch.zeros_like(ids, dtype=torch.bool)
    count = length - n + 1  # n-grams per row
    if count < 2:
        return repeated
    span = int(ids.max().item()) + 1
    keys = ids[:, :count]
    for k in range(1, n):
        keys = torch.unique(keys * span + ids[:, k:k + count], return_inverse=True)[1]  # dense: < rows * count
    order = torch.sort(keys, dim=1, stable=True).indices  # equal keys keep their positions' order
    sorted_keys = keys.gather(1, order)
    seen_before = torch.zeros_like(sorted_keys, dtype=torch.bool)
    seen_before[:, 1:] = sorted_keys[:, 1:] == sorted_keys[:, :-1]
    repeated[:, n - 1:].scatter_(1, order, seen_before)
    return repeated


def copy_token_weights(input_ids: Tensor, copy_weight: float, n: int = 3) -> Tensor:
    """[B, T] fp32 weights aligned with the labels (as `ChunkedLoss`'s loss_mask): copy_weight where
    `repeated_ngrams(input_ids, n)` is set, 1 elsewhere."""
    weights = torch.ones(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    return weights.masked_fill_(repeated_ngrams(input_ids, n), float(copy_weight))
