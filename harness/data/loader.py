"""Deterministic, sharded, exactly resumable loaders over a stage's slice of the stream.

Geometry: world size w, micro-batch b, gradient accumulation a. Within a stage the loader hands out
micro-batches in global order: after `consumed` sequences (all ranks together), rank r's next
micro-batch is the stream positions start + consumed + r*b + [0, b), and consumed grows by w*b per
micro-step. So the w ranks of one micro-step read w disjoint, adjacent blocks; together they cover the
stream in order. The loader stops after the last whole optimizer step (floor(n / (w*b*a)) steps).

The whole state is `consumed` (plus identity checks): `state_dict()` after step k holds k*w*b*a, the
same on every rank. `load_state_dict` resumes at the next position, so no sample is seen twice or
skipped; the geometry may even change between runs (positions are global).
Batches are built on the calling thread from a memory map (no worker processes, no prefetch), so a
state saved after a step counts exactly the batches that step used. The loader asks its stream for the
batch at given positions (`stream.batch`), so a data.mix stream (harness.data.mix) resumes the same way.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from harness.data.errors import DataError
from harness.data.order import EpochOrder
from harness.data.packing import PackedSplit

STATE_VERSION = 1


@dataclass
class StageStream:
    """Stream positions [start, start + length) of `split`, in the seeded order of `seed`."""

    split: PackedSplit
    stage: str
    start: int
    length: int
    seed: int
    corpus_fingerprint: str
    _order: EpochOrder | None = field(default=None, repr=False)

    @property
    def order(self) -> EpochOrder:
        if self._order is None:
            self._order = EpochOrder(self.split.num_sequences, self.seed)
        return self._order

    @property
    def seq_len(self) -> int:
        return self.split.seq_len

    @property
    def num_tokens(self) -> int:
        return self.length * self.split.seq_len

    def indices(self, positions: np.ndarray) -> np.ndarray:
        """Training-split indices (int64) at absolute stream `positions` (int64)."""
        return self.order.indices(positions)

    def batch(self, positions: np.ndarray) -> dict[str, torch.Tensor]:
        """The sequences at absolute stream `positions` as a batch (harness.data.packing.PackedSplit.batch).
        A data.mix stream (harness.data.mix.MixedStageStream) has the same interface."""
        return self.split.batch(self.indices(positions))

    def loader(self, rank: int, world: int, micro_batch_size: int, grad_accum: int = 1) -> "PackedLoader":
        return PackedLoader(self, rank, world, micro_batch_size, grad_accum)


class PackedLoader:
    """Iterator of micro-batches for one rank (see the module docstring for the order).

    Each item: input_ids long [b, T], doc_start bool [b, T], cu_seqlens int32 [S + 1] (flattened b*T),
    sample_index long [b] (indices in the training split), stream_position long [b].
    """

    def __init__(self, stream: StageStream, rank: int, world: int, micro_batch_size: int, grad_accum: int = 1) -> None:
        if world < 1 or not 0 <= rank < world:
            raise DataError(f"rank {rank} is not in [0, world={world}).")
        if micro_batch_size < 1 or grad_accum < 1:
            raise DataError(f"micro_batch_size={micro_batch_size} and grad_accum={grad_accum} must be >= 1.")
        self.stream, self.rank, self.world = stream, rank, world
        self.micro_batch_size, self.grad_accum = micro_batch_size, grad_accum
        self.per_micro_step = world * micro_batch_size
        self.steps = stream.length // (self.per_micro_step * grad_accum)
        self.limit = self.steps * self.per_micro_step * grad_accum  # sequences the stage will read
        self.consumed = 0

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __len__(self) -> int:
        """Micro-batches left for this rank."""
        return max(0, (self.limit - self.consumed) // self.per_micro_step)

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.consumed + self.per_micro_step > self.limit:
            raise StopIteration
        b = self.micro_batch_size
        positions = self.stream.start + self.consumed + self.rank * b + np.arange(b, dtype=np.int64)
        batch = self.stream.batch(positions)
        batch["stream_position"] = torch.from_numpy(positions)
        self.consumed += self.per_micro_step
        return batch

    # ------------------------------------------------------------------ counters
    @property
    def sequences_consumed(self) -> int:
        """Sequences handed out on all ranks together since the stage began."""
        return self.consumed

    @property
    def tokens_consumed(self) -> int:
        """Tokens handed out on all ranks together since the stage began (exact: no padding)."""
        return self.consumed * self.stream.seq_len

    @property
    def tokens_total(self) -> int:
        """Tokens the stage reads in its whole steps, all ranks."""
        return self.limit * self.stream.seq_len

    @property
    def step(self) -> int:
        """Completed optimizer steps."""
        return self.consumed // (self.per_micro_step * self.grad_accum)

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        """The loader's position and the identity of what it reads; the same on every rank."""
        s = self.stream
        return {"version": STATE_VERSION, "stage": s.stage, "corpus": s.corpus_fingerprint, "seed": s.seed,
                "seq_len": s.seq_len, "start": s.start, "length": s.length,
                "consumed_sequences": self.consumed, "tokens_consumed": self.tokens_consumed,
                "world": self.world, "micro_batch_size": self.micro_batch_size, "grad_accum": self.grad_accum}

    def load_state_dict(self, state: dict) -> None:
        """Resume after the position in `state`; raise DataError if it was saved for other data."""
        s = self.stream
        expected = {"version": STATE_VERSION, "stage": s.stage, "corpus": s.corpus_fingerprint, "seed": s.seed,
                    "seq_len": s.seq_len, "start": s.start, "length": s.length}
        wrong = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if wrong:
            detail = "; ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in wrong.items())
            raise DataError(f"The loader state in the checkpoint does not match this run's data ({detail}). "
                            "Resume with the same data.*, seed and budget as the run that saved it.")
        consumed = int(state["consumed_sequences"])
        if not 0 <= consumed <= s.length:
            raise DataError(f"Saved loader position {consumed} is outside the stage's {s.length} sequences.")
        self.consumed = consumed


# ---------------------------------------------------------------------------- validation


def validation_batches(split: PackedSplit, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[dict]:
    """The validation split in a fixed order, sharded round-robin: rank r gets sequences r, r+w, ...

    Every rank yields the same number of batches of exactly `batch_size` rows (ZeRO-3 forwards are
    collective); rows past a rank's share repeat its first sequence and have valid=False. Each batch is
    a training batch plus valid bool [B]. Sum losses over valid rows only.
    """
    per_rank = math.ceil(split.num_sequences / world)
    n_batches = math.ceil(per_rank / batch_size)
    mine = np.arange(rank, split.num_sequences, world, dtype=np.int64)
    padded = np.zeros(n_batches * batch_size, dtype=np.int64)
    padded[: len(mine)] = mine
    valid = np.arange(len(padded)) < len(mine)
    for i in range(n_batches):
        rows = slice(i * batch_size, (i + 1) * batch_size)
        batch = split.batch(padded[rows])
        batch["valid"] = torch.from_numpy(valid[rows].copy())
        yield batch


# ---------------------------------------------------------------------------- timing


def time_loader(loader: PackedLoader, batches: int = 200, warmup: int = 5) -> dict:
    """Time `batches` micro-batches of `loader` (after `warmup`), then restore its position.

    Returns {"batches", "seconds", "ms_per_batch", "tokens_per_second"} (tokens of this rank).
    Compare ms_per_batch with the training step time to see whether data loading matters.
    """
    state = loader.state_dict()
    try:
        for _ in range(min(warmup, len(loader) - 1)):
            next(loader)
        t0, n, tokens = time.perf_counter(), 0, 0
        for _ in range(batches):
            try:
                batch = next(loader)
            except StopIteration:
                break
            n, tokens = n + 1, tokens + batch["input_ids"].numel()
        seconds = time.perf_counter() - t0
    finally:
        loader.load_state_dict(state)
    return {"batches": n, "seconds": seconds, "ms_per_batch": 1e3 * seconds / max(n, 1),
            "tokens_per_second": tokens / seconds if seconds > 0 else float("inf")}
