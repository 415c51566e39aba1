"""Token budgets: the stages read consecutive, disjoint slices of one global stream of sequences.

Stage k (align_mixer, align_hidden, distill) reads stream positions [start_k, start_k + n_k) with
start_0 = 0 and start_{k+1} = start_k + n_k, where n_k = the stage's planned tokens / seq_len
(`harness.config.plan_stages`: the split of budget.total_tokens, or stages.<stage>.tokens, rounded
down to whole optimizer steps). Position p reads training sequence perm_e[p mod N] of epoch
e = p // N (N = training sequences), so slices stay disjoint as long as the total fits in one epoch;
beyond it the corpus repeats, which needs data.allow_repeat. Counts here are exact, not estimates.
A stage that trains on the chat data instead (stages.distill.data=instructions) reads no sequence here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from harness.data.errors import DataError


@dataclass(frozen=True)
class StageBudget:
    """One stage's slice of the stream. `tokens` = sequences x seq_len, exactly what the stage reads."""

    stage: str
    requested_tokens: int
    steps: int
    tokens_per_step: int
    sequences: int
    tokens: int
    start: int  # first stream position
    first_epoch: int
    last_epoch: int

    @property
    def end(self) -> int:
        return self.start + self.sequences

    @property
    def repeats(self) -> bool:
        """Whether this stage reads sequences a second time (an epoch beyond the first)."""
        return self.last_epoch > 0


@dataclass(frozen=True)
class BudgetReport:
    source: str
    seq_len: int
    train_sequences: int
    validation_tokens: int
    allow_repeat: bool
    stages: tuple[StageBudget, ...]

    @property
    def train_tokens(self) -> int:
        return self.train_sequences * self.seq_len

    @property
    def total_sequences(self) -> int:
        return sum(s.sequences for s in self.stages)

    @property
    def total_tokens(self) -> int:
        return sum(s.tokens for s in self.stages)

    @property
    def repeat_factor(self) -> float:
        """Passes over the training split the stages need (<= 1: no repeat)."""
        return self.total_sequences / self.train_sequences

    @property
    def needs_repeat(self) -> bool:
        return self.total_sequences > self.train_sequences

    def stage(self, name: str) -> StageBudget:
        for s in self.stages:
            if s.stage == name:
                return s
        raise KeyError(f"no stage '{name}'; stages: {', '.join(s.stage for s in self.stages)}")

    def check(self) -> None:
        """Raise DataError when the stages need more text than the corpus has and repeat is not allowed."""
        if not self.needs_repeat or self.allow_repeat:
            return
        first = next(s for s in self.stages if s.repeats)
        raise DataError(
            f"The corpus is too small for the budget: the stages need {self.total_tokens:,} tokens "
            f"({self.total_sequences:,} sequences of {self.seq_len}) but the training split of '{self.source}' holds "
            f"{self.train_tokens:,} tokens ({self.train_sequences:,} sequences). Training would pass over it "
            f"{self.repeat_factor:.2f} times: from stage {first.stage} on, the same sequences are read again, in a "
            f"new seeded order per pass, so each is seen up to {math.ceil(self.repeat_factor)} times and later "
            "stages train on text earlier stages already used. Set data.allow_repeat=true to accept that, or give "
            "a larger data.source, or lower budget.total_tokens (or stages.<stage>.tokens)."
        )

    def format(self) -> str:
        """A plain-text table of the slices and totals."""
        lines = [f"# data budget ({self.source}, seq_len {self.seq_len})",
                 f"  training split: {self.train_sequences:,} sequences = {self.train_tokens:,} tokens; "
                 f"validation: {self.validation_tokens:,} tokens",
                 f"  {'stage':<14}{'requested':>15}{'steps':>9}{'sequences':>12}{'tokens':>15}{'positions':>24}"
                 f"{'epochs':>9}"]
        for s in self.stages:
            pos = f"[{s.start:,}, {s.end:,})"
            epochs = f"{s.first_epoch}-{s.last_epoch}" if s.sequences else "-"
            lines.append(f"  {s.stage:<14}{s.requested_tokens:>15,}{s.steps:>9,}{s.sequences:>12,}{s.tokens:>15,}"
                         f"{pos:>24}{epochs:>9}")
        verdict = (f"needs {self.repeat_factor:.2f} passes: "
                   + ("allowed (data.allow_repeat)" if self.allow_repeat else "NOT allowed (set data.allow_repeat)")
                   if self.needs_repeat else f"fits: uses {self.repeat_factor:.1%} of the training split")
        lines.append(f"  total: {self.total_sequences:,} sequences = {self.total_tokens:,} tokens; {verdict}")
        return "\n".join(lines)


def budget_report(job: Any, corpus: Any) -> BudgetReport:
    """Each stage's slice of `corpus`'s training stream under `job`'s budget (see module docstring)."""
    from harness.config import STAGES, plan_stages, reads_instructions

    seq_len, n = corpus.seq_len, corpus.train.num_sequences
    stages, start = [], 0
    for plan, fraction in zip(plan_stages(job), job.budget.split):
        cfg = getattr(job.stages, plan.stage)
        requested = cfg.tokens if cfg.tokens is not None else int(job.budget.total_tokens * fraction)
        # a stage on the chat data (stages.distill.data=instructions) reads nothing of this stream
        sequences = 0 if reads_instructions(job, plan.stage) else plan.steps * plan.tokens_per_step // seq_len
        last = (start + sequences - 1) // n if sequences else start // n
        stages.append(StageBudget(plan.stage, requested, plan.steps, plan.tokens_per_step, sequences,
                                  sequences * seq_len, start, start // n, last))
        start += sequences
    assert [s.stage for s in stages] == list(STAGES)
    val = corpus.validation.num_tokens if corpus.validation is not None else 0
    return BudgetReport(corpus.source, seq_len, n, val, bool(job.data.allow_repeat), tuple(stages))
