"""Recovery statistics: chance levels, chance-normalised recovery and paired bootstrap intervals over examples.

The raw recovery student / teacher rewards nothing when the teacher is near chance (a 2-choice task at 0.505:
any student "recovers" ~100%). The normalised recovery measures the part of the teacher's gain over chance
that the student keeps:

    recovery_norm = (student - chance) / (teacher - chance)        defined only when teacher > chance

chance is the expected score of guessing: the mean of 1/n_choices over the examples of a multiple-choice task
(n_choices may vary per example, as in ARC), 0 for a generative or non-choice task (LAMBADA, GSM8K).

Intervals: a paired bootstrap over examples. Each resample draws n example indices with replacement, the same
indices for the student and the teacher (their errors are correlated: both find the same examples hard), and
recomputes both means, the chance level and the normalised recovery; the interval is the 2.5-97.5 percentile
range. The draws are seeded by (seed, the task's name), so a report is the same every time and a task's
interval does not depend on the other tasks. A task whose teacher's interval reaches down to chance is shown
but left out of the normalised average: its recovery divides by a gain that may be zero.

    chance_level(choices)                   -> mean over examples of 1/n (0 where n = 0)
    normalised_recovery(s, t, chance)       -> (s - chance) / (t - chance), None unless t > chance
    paired_bootstrap(columns, stream=...)   -> (k, samples) resampled means, one index set per resample
    percentile_interval(draws)              -> (low, high), NaN draws ignored
    teacher_at_chance(t, chance, ci, se)    -> (at chance?, basis: bootstrap / stderr / score)
    task_recovery(...)                      -> one task's statistics and its normalised draws
    average_recovery(rows, draws)           -> the normalised average over the tasks above chance, its interval
    difference(a, b, stream=...)            -> run B - run A over the same examples, with its paired interval
    paired_row(a, b, draws, n, note)        -> one metric's row of the paired differences (harness.eval.paired)
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Optional

import numpy as np

BOOTSTRAP_SAMPLES = 1000
BOOTSTRAP_SEED = 0
LEVEL = 0.95
Z_95 = 1.959963984540054  # the normal quantile of 0.975: the interval an lm-eval stderr gives
_CELLS = 2_000_000  # resampled indices per chunk (bounds memory for tasks with ~10^4 examples)

Interval = tuple[float, float]


def chance_level(choices: Sequence[int]) -> float:
    """The expected score of guessing: the mean over examples of 1/n (n answer choices; n = 0 counts 0)."""
    if not choices:
        raise ValueError("chance_level needs at least one example.")
    return float(np.mean([1.0 / n if n > 0 else 0.0 for n in choices]))


def normalised_recovery(student: Optional[float], teacher: Optional[float],
                        chance: Optional[float]) -> Optional[float]:
    """(student - chance) / (teacher - chance); None when a value is missing or the teacher is not above chance."""
    if student is None or teacher is None or chance is None or teacher <= chance:
        return None
    return (student - chance) / (teacher - chance)


def paired_bootstrap(columns: np.ndarray, *, samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED,
                     stream: str = "") -> np.ndarray:
    """Resampled means: for `columns` (k quantities x n examples) a (k, samples) array whose column b holds the
    means of every row over resample b's n indices, drawn with replacement and shared by all rows (paired).

    The generator is seeded by (seed, crc32(stream)): the same inputs give the same draws.
    """
    columns = np.asarray(columns, dtype=float)
    if columns.ndim != 2 or columns.shape[1] == 0:
        raise ValueError(f"columns must be a (quantities, examples) array with examples, got {columns.shape}.")
    rng = np.random.default_rng([seed, zlib.crc32(stream.encode())])
    n = columns.shape[1]
    chunk = max(1, _CELLS // n)
    out = np.empty((columns.shape[0], samples))
    for start in range(0, samples, chunk):
        idx = rng.integers(0, n, size=(min(chunk, samples - start), n))
        out[:, start:start + len(idx)] = columns[:, idx].mean(axis=2)
    return out


def normalised_draws(means: np.ndarray) -> np.ndarray:
    """Per resample (rows of `means`: student, teacher, chance), the normalised recovery; NaN where the
    resampled teacher is not above the resampled chance."""
    student, teacher, chance = means
    gain = teacher - chance
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(gain > 0, (student - chance) / gain, np.nan)


def percentile_interval(draws: np.ndarray, level: float = LEVEL) -> Optional[Interval]:
    """The central `level` percentile interval of `draws` (NaNs ignored); None when no draw is finite."""
    finite = np.asarray(draws, dtype=float)
    finite = finite[np.isfinite(finite)]
    if finite.size == 0:
        return None
    tail = 100 * (1 - level) / 2
    low, high = np.percentile(finite, [tail, 100 - tail])
    return float(low), float(high)


def teacher_at_chance(teacher: Optional[float], chance: Optional[float], interval: Optional[Interval] = None,
                      stderr: Optional[float] = None) -> tuple[Optional[bool], Optional[str]]:
    """Whether the teacher is not clearly above chance, and on what basis: its bootstrap interval's low end is
    at or below chance ("bootstrap"); without an interval, teacher - 1.96 stderr ("stderr", lm-eval's normal
    approximation); without either, the teacher's score itself ("score"). (None, None) if a value is missing."""
    if teacher is None or chance is None:
        return None, None
    if interval is not None:
        return interval[0] <= chance, "bootstrap"
    if stderr is not None and math.isfinite(stderr):
        return teacher - Z_95 * stderr <= chance, "stderr"
    return teacher <= chance, "score"


def task_recovery(name: str, student: Optional[float], teacher: Optional[float], chance: Optional[float],
                  paired: Optional[np.ndarray] = None, teacher_stderr: Optional[float] = None, *,
                  alone: tuple[Optional[Sequence[float]], Optional[Sequence[float]]] = (None, None),
                  samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> tuple[dict, Optional[np.ndarray]]:
    """One task's chance, normalised recovery, 95% intervals and at-chance verdict, and its normalised draws.

    paired: the per-example (student score, teacher score, chance) columns, a (3, n) array over the same
    examples in the same order, or None. Without it, `alone` may hold either side's own per-example scores,
    which give that side's interval (so a teacher with per-example results is still judged by its interval);
    the normalised interval needs `paired`, and is given only when the teacher is above chance (else it would
    divide by a gain that may be zero).
    """
    row: dict = {"chance": chance, "recovery_norm": normalised_recovery(student, teacher, chance)}
    means = None if paired is None else paired_bootstrap(paired, samples=samples, seed=seed, stream=name)
    for i, key in enumerate(("student_ci", "teacher_ci")):
        one = means[i] if means is not None else _resampled(alone[i], name, samples, seed)
        row[key] = None if one is None else percentile_interval(one)
    row["at_chance"], row["at_chance_basis"] = teacher_at_chance(teacher, chance, row["teacher_ci"], teacher_stderr)
    draws = normalised_draws(means) if means is not None and row["at_chance"] is False else None
    row["recovery_norm_ci"] = None if draws is None else percentile_interval(draws)
    return row, draws


def _resampled(scores: Optional[Sequence[float]], name: str, samples: int, seed: int) -> Optional[np.ndarray]:
    """One side's resampled means over its own examples (None without any)."""
    if scores is None or len(scores) == 0:
        return None
    return paired_bootstrap(np.asarray(scores, dtype=float)[None], samples=samples, seed=seed, stream=name)[0]


def average_recovery(rows: Mapping[str, dict], draws: Mapping[str, Optional[np.ndarray]]) -> dict:
    """The mean normalised recovery over the tasks with one whose teacher is above chance, and its interval.

    The interval resamples every included task (independently: different examples) and averages their draws;
    it is None unless every included task has draws. Also names the tasks left out: "excluded" (teacher at
    chance) and "no_chance" (chance level unknown, e.g. older result files of a task with varying choices).
    """
    included = [n for n, r in rows.items() if r.get("recovery_norm") is not None and r.get("at_chance") is False]
    result: dict = {"recovery_norm": None, "recovery_norm_ci": None, "norm_tasks": included,
                    "excluded": [n for n, r in rows.items() if r.get("at_chance")],
                    "no_chance": [n for n, r in rows.items() if r.get("chance") is None
                                  and r.get("student") is not None and r.get("teacher") is not None]}
    if not included:
        return result
    result["recovery_norm"] = float(np.mean([rows[n]["recovery_norm"] for n in included]))
    if all(draws.get(n) is not None for n in included):
        result["recovery_norm_ci"] = percentile_interval(np.mean([draws[n] for n in included], axis=0))
    return result


def paired_row(a: Optional[float], b: Optional[float], draws: Optional[np.ndarray], n: Optional[int],
               note: Optional[str] = None) -> dict:
    """One metric's A, B, B - A, interval (from `draws`, the replicate differences) and whether it excludes 0."""
    diff = None if a is None or b is None else b - a
    ci = None if draws is None else percentile_interval(draws)
    excludes = None if ci is None else bool(ci[0] > 0 or ci[1] < 0)
    return {"a": a, "b": b, "diff": diff, "ci": ci, "excludes_zero": excludes, "n": n,
            "note": note if ci is None else None}


def difference(a: Sequence[float], b: Sequence[float], *, stream: str, samples: int = BOOTSTRAP_SAMPLES,
               seed: int = BOOTSTRAP_SEED) -> dict:
    """B - A of two runs' per-example scores over the same examples in the same order: both means, their
    difference, and its paired bootstrap interval (one index set per replicate, applied to both)."""
    if len(a) != len(b) or not len(a):
        raise ValueError(f"a paired difference needs scores of the same examples, got {len(a)} and {len(b)}.")
    columns = np.array([a, b], dtype=float)
    means = paired_bootstrap(columns, samples=samples, seed=seed, stream=stream)
    return paired_row(float(columns[0].mean()), float(columns[1].mean()), means[1] - means[0], columns.shape[1])
