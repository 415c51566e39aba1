"""Seeded, numpy-version-independent orders over the sequences of a split.

A training stream is an endless list of positions 0, 1, 2, ...; position p reads sequence
`permutation(n, seed, epoch=p // n)[p % n]` of an n-sequence split. The permutation is the argsort of
a splitmix64 hash of the indices, not `numpy.random.Generator.permutation`, because numpy does not
promise that a Generator's streams stay the same across releases, and a resumed run may meet another
numpy than the run that saved the checkpoint.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser applied elementwise to a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MUL1
        z = (z ^ (z >> np.uint64(27))) * _MUL2
        return z ^ (z >> np.uint64(31))


def epoch_key(seed: int, epoch: int) -> np.uint64:
    """One 64-bit key per (seed, epoch); distinct seeds and epochs give unrelated orders."""
    s = mix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    return mix64(s ^ np.array([epoch], dtype=np.uint64))[0]


def permutation(n: int, seed: int, epoch: int = 0) -> np.ndarray:
    """A permutation of range(n) fixed by (seed, epoch). Returns int64 [n]."""
    keys = mix64(np.arange(n, dtype=np.uint64) ^ epoch_key(seed, epoch))
    return np.argsort(keys, kind="stable").astype(np.int64)


class EpochOrder:
    """Maps stream positions to split indices, caching the last two epochs' permutations."""

    def __init__(self, n: int, seed: int, shuffle: bool = True) -> None:
        if n <= 0:
            raise ValueError(f"an order needs at least one sequence, got n={n}")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self._cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._cache:
            if len(self._cache) >= 2:
                self._cache.pop(min(self._cache))
            self._cache[epoch] = permutation(self.n, self.seed, epoch)
        return self._cache[epoch]

    def indices(self, positions: np.ndarray) -> np.ndarray:
        """Split indices (int64, same shape) read at stream `positions` (int64, >= 0)."""
        positions = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            return positions % self.n
        epochs, offsets = np.divmod(positions, self.n)
        out = np.empty_like(positions)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            out[mask] = self._perm(int(epoch))[offsets[mask]]
        return out
