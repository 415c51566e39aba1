"""The decay gate of the gated delta rules at a chosen granularity: how many key channels share one gate.

Gated DeltaNet has one log decay per head and token (g `[B, T, H]`), KDA one per key channel (g `[B, T, H, K]`).
The option `decay_group_size` G sets it on both: each head has K / G gates, each shared by G consecutive key
channels (G = K, or 0: one per head, Gated DeltaNet's; G = 1: one per channel, KDA's). The gate's projection makes
H x K / G logits per token and dt_bias has one entry per gate; A_log stays one per head. A gate per head runs as
g `[B, T, H]` (fla's chunk_gated_delta_rule); finer gates are expanded to their channels and run as KDA's
recurrence (decay per channel, then the delta rule: fla's chunk_kda). docs/RECURRENCES.md, "Decay granularity".
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

import torch

DECAY_GROUP_HELP = ("Key channels that share one decay gate (Gated DeltaNet <-> KDA): 0 or head_dim: one gate per "
                    "head (Gated DeltaNet's); 1: one per key channel (KDA's); a divisor of head_dim in between, e.g. "
                    "16: head_dim / 16 gates per head. The gate's projection and dt_bias get one output per gate, "
                    "A_log stays per head; all keep their authors' init (docs/TRANSFER.md).")


def decay_group_field(default: int) -> Any:
    """The `decay_group_size` option of a mixer, with its default granularity (0: per head, 1: per channel)."""
    return field(default=default, metadata={"help": DECAY_GROUP_HELP})


def check_decay_group_size(value: int) -> None:
    """A ValueError naming the value unless it is an int >= 0 (whether it divides head_dim is checked when the
    mixer is built: `gates_per_head`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"decay_group_size={value!r} must be an integer >= 0 (0: one gate per head)")


def gates_per_head(group_size: int, head_dim: int) -> int:
    """Decay gates per head for `decay_group_size` on heads of head_dim key channels; a ValueError naming the value
    and the allowed ones unless it divides head_dim."""
    check_decay_group_size(group_size)
    size = group_size or head_dim
    if head_dim % size:
        allowed = [d for d in range(1, head_dim + 1) if head_dim % d == 0]
        raise ValueError(f"decay_group_size={group_size} does not divide head_dim={head_dim}; allowed: 0 (one gate "
                         f"per head) or one of {', '.join(map(str, allowed))}")
    return head_dim // size


def expand_decay(g: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Per-gate log decays `[B, T, H, n]` -> the recurrence's g: `[B, T, H]` when n == 1 (one gate per head), else
    `[B, T, H, head_dim]`, each gate's value on its head_dim / n consecutive channels."""
    gates = g.shape[-1]
    if gates == 1:
        return g.squeeze(-1)
    return g if gates == head_dim else g.repeat_interleave(head_dim // gates, dim=-1)
