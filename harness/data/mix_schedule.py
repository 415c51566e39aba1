"""The data.mix schedule and entries, read from the job alone (no data): the integer shares of a period and Tijdeman's
interleaving of it (harness.data.mix's module docstring says why and what it guarantees), each entry parsed into a
natural source's spec or a generator with its options. Apart from harness.data.mix so that the job config can check
a mix (harness.config) without importing what reads and packs data."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from harness.data.errors import DataError
from harness.data.generators import Generator, make_generator
from harness.data.order import epoch_key
from harness.data.sources import SourceSpec, parse_source

GENERATOR_PREFIX = "generator:"
MAX_PERIOD = 10_000  # positions of one schedule period at most (shares exact to 1e-4)


# ------------------------------------------------------------------------------------------------ the schedule


def period_shares(weights: Sequence[float]) -> tuple[int, ...]:
    """Integer shares of one period, proportional to `weights`, in lowest terms (see the module docstring). A weight
    of 0 gets share 0 (a source that a stage does not read); the others' shares are what they would be without it."""
    if any(float(w) == 0 for w in weights):
        read = [i for i, w in enumerate(weights) if float(w) != 0]
        if not read:
            raise DataError("every data.mix weight is 0: give at least one source a positive weight.")
        out = [0] * len(weights)
        for i, share in zip(read, period_shares([weights[i] for i in read])):
            out[i] = share
        return tuple(out)
    exact = [Fraction(repr(float(w))) for w in weights]  # 0.9 -> 9/10, not the float's binary value
    fractions = [w / sum(exact) for w in exact]
    period = math.lcm(*(f.denominator for f in fractions))
    if period <= MAX_PERIOD:
        return tuple(int(f * period) for f in fractions)
    raw = [f * MAX_PERIOD for f in fractions]
    shares = [math.floor(r) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: (shares[i] - raw[i], i))  # largest remainder first
    for i in by_remainder[:MAX_PERIOD - sum(shares)]:
        shares[i] += 1
    if min(shares) == 0:
        low = [f"{float(w):g}" for w, s in zip(weights, shares) if s == 0]
        raise DataError(f"data.mix weight(s) {', '.join(low)} are below 1/{MAX_PERIOD:,} of the total; give each "
                        "source a larger weight or leave it out.")
    common = math.gcd(*shares)
    return tuple(s // common for s in shares)


def interleave(shares: Sequence[int]) -> np.ndarray:
    """One period (int64 [sum(shares)]) of sources: Tijdeman's algorithm. At position t (1-based) the eligible
    sources are those with t * a_s / P - c_s >= 1/(2k-2) (c_s: chosen so far); of them, the one whose deficit would
    first exceed 1 - 1/(2k-2), i.e. the least (c_s + 1 - 1/(2k-2)) / a_s (ties: the lower index). Integer arithmetic.
    Sources of share 0 are left out (k counts the others), so they change nothing of the others' order."""
    if 0 in shares:
        read = np.array([i for i, a in enumerate(shares) if a > 0], dtype=np.int64)
        return read[interleave([shares[i] for i in read])]
    k, period = len(shares), sum(shares)
    if k == 1:
        return np.zeros(period, dtype=np.int64)
    m = 2 * k - 2
    counts = [0] * k
    out = np.empty(period, dtype=np.int64)
    for t in range(1, period + 1):
        best = -1
        for s, a in enumerate(shares):
            if m * (t * a - period * counts[s]) < period:  # not eligible
                continue
            if best < 0 or (m * (counts[s] + 1) - 1) * shares[best] < (m * (counts[best] + 1) - 1) * a:
                best = s
        out[t - 1] = best
        counts[best] += 1
    return out


@dataclass(frozen=True)
class MixSchedule:
    """Which source each position of a stage reads: a period of `pattern` repeated."""

    shares: tuple[int, ...]  # a_s: positions of source s per period
    pattern: np.ndarray  # int64 [P]: the source at each position of a period
    before: np.ndarray  # int64 [k, P + 1]: occurrences of each source in pattern[:j]

    @classmethod
    def from_weights(cls, weights: Sequence[float]) -> "MixSchedule":
        shares = period_shares(weights)
        pattern = interleave(shares)
        before = np.zeros((len(shares), len(pattern) + 1), dtype=np.int64)
        before[:, 1:] = np.cumsum(pattern[None, :] == np.arange(len(shares))[:, None], axis=1)
        return cls(shares, pattern, before)

    @property
    def period(self) -> int:
        return len(self.pattern)

    def counts(self, n: int) -> np.ndarray:
        """int64 [k]: the sequences each source gives the first `n` positions of a stage."""
        return (n // self.period) * np.asarray(self.shares, dtype=np.int64) + self.before[:, n % self.period]

    def locate(self, r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, rank within the stage's part of that source) of positions `r` of a stage (int64 arrays)."""
        q, j = np.divmod(np.asarray(r, dtype=np.int64), self.period)
        source = self.pattern[j]
        return source, q * np.asarray(self.shares, dtype=np.int64)[source] + self.before[source, j]


@dataclass(frozen=True)
class StageSchedules:
    """The schedule of each pretraining stage: one for all of them unless an entry's stage_weights differ; None for a
    stage where every entry's weight is 0 (an error once that stage reads any sequence)."""

    by_stage: dict[str, Optional[MixSchedule]]

    @classmethod
    def from_entries(cls, entries: Sequence["MixEntry"]) -> "StageSchedules":
        from harness.config.training import STAGES

        made: dict[tuple[float, ...], MixSchedule] = {}
        by_stage: dict[str, Optional[MixSchedule]] = {}
        for stage in STAGES:
            weights = tuple(e.weight_in(stage) for e in entries)
            if not any(weights):
                by_stage[stage] = None
                continue
            if weights not in made:
                made[weights] = MixSchedule.from_weights(weights)
            by_stage[stage] = made[weights]
        return cls(by_stage)

    @property
    def uniform(self) -> bool:
        """Whether every stage reads the sources in the same shares (no entry's stage_weights change them)."""
        shares = {s.shares for s in self.by_stage.values() if s is not None}
        return len(shares) == 1 and None not in self.by_stage.values()

    @property
    def first(self) -> MixSchedule:
        return next(s for s in self.by_stage.values() if s is not None)

    def of(self, stage: str) -> MixSchedule:
        """The schedule of `stage`; DataError when no entry has a positive weight there."""
        sched = self.by_stage[stage]
        if sched is None:
            raise DataError(f"Stage {stage} reads the data mix, but every data.mix entry has weight 0 there: give one "
                            f"a positive weight (weight, or stage_weights: {{{stage}: W}}).")
        return sched

    def counts(self, stage: str, n: int) -> np.ndarray:
        """int64 [k]: the sequences each source gives the first `n` positions of `stage` (zeros for n = 0)."""
        if n == 0:
            return np.zeros(len(self.first.shares), dtype=np.int64)
        return self.of(stage).counts(n)


def part_seed(seed: int, index: int) -> int:
    """The order seed of mix entry `index`: job.seed for the first, a splitmix64 hash of (seed, index) for others."""
    return seed if index == 0 else int(epoch_key(seed, index))


# ------------------------------------------------------------------------------------------------ entries


@dataclass(frozen=True)
class MixEntry:
    """One data.mix entry, parsed (nothing read): a natural source's spec, or a generator's name and options."""

    label: str  # the source as written
    weight: float
    spec: Optional[SourceSpec] = None
    generator_name: Optional[str] = None
    options: dict = field(default_factory=dict)  # a generator's options, every one resolved
    text_field: Optional[str] = None
    stage_weights: dict = field(default_factory=dict)  # stage -> its weight there, instead of `weight`

    def weight_in(self, stage: str) -> float:
        return float(self.stage_weights.get(stage, self.weight))

    @property
    def generator(self) -> bool:
        return self.generator_name is not None

    @property
    def identity(self) -> str:
        """What makes two entries the same source (duplicates are refused)."""
        what = [self.generator_name, self.options] if self.generator else [repr(self.spec), self.text_field]
        return json.dumps(what, sort_keys=True, default=str)

    def make_generator(self, key: str, cache_dir: Path | None = None) -> Generator:
        return make_generator(str(self.generator_name), self.options, key, cache_dir)


def parse_mix_entry(entry: Any, key: str) -> MixEntry:
    """Parse a harness.config.MixSourceConfig (DataError naming `key` and what is allowed)."""
    source = entry.source.strip()
    stage_weights = parse_stage_weights(entry, key)
    if source.startswith(GENERATOR_PREFIX):
        name = source[len(GENERATOR_PREFIX):]
        if entry.text_field is not None:
            raise DataError(f"{key}.text_field='{entry.text_field}': a generator makes its own text; leave text_field "
                            "null (its options are in options).")
        gen = make_generator(name, entry.options, key)
        return MixEntry(source, float(entry.weight), None, name, gen.options_dict(), None, stage_weights)
    if entry.options:
        raise DataError(f"{key}.options={dict(entry.options)}: options are for generators ('generator:NAME'), not for "
                        f"'{source}'; remove them.")
    spec = parse_source(source, f"{key}.source")
    return MixEntry(source, float(entry.weight), spec, None, {}, entry.text_field, stage_weights)


def parse_stage_weights(entry: Any, key: str) -> dict[str, float]:
    """An entry's stage_weights, checked: pretraining stages only, each weight >= 0, and some stage reads the entry."""
    from harness.config.training import STAGES

    weights = {str(k): float(v) for k, v in (getattr(entry, "stage_weights", None) or {}).items()}
    for stage, w in weights.items():
        if stage not in STAGES:
            raise DataError(f"{key}.stage_weights has '{stage}': the stages that read data.mix are "
                            f"{', '.join(STAGES)}.")
        if not math.isfinite(w) or w < 0:
            raise DataError(f"{key}.stage_weights.{stage}={w:g} must be >= 0 (0: that stage does not read it).")
    if not any(weights.get(stage, float(entry.weight)) > 0 for stage in STAGES):
        raise DataError(f"{key} ({entry.source}) has weight 0 in every stage: give it a positive weight (or a positive "
                        "stage_weights entry), or leave it out.")
    return weights


def parse_mix(data: Any) -> list[MixEntry]:
    return [parse_mix_entry(e, f"data.mix[{i}]") for i, e in enumerate(data.mix)]
