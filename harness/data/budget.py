"""Token budgets: the stages read consecutive, disjoint slices of one global stream of sequences.

Stage k (align_mixer, align_hidden, distill) reads stream positions [start_k, start_k + n_k) with
start_0 = 0 and start_{k+1} = start_k + n_k, where n_k = the stage's planned tokens / seq_len
(`harness.config.plan_stages`: the split of budget.total_tokens, or stages.<stage>.tokens, rounded
down to whole optimizer steps). Position p reads training sequence perm_e[p mod N] of epoch
e = p // N (N = training sequences), so slices stay disjoint as long as the total fits in one epoch;
beyond it the corpus repeats, which needs data.allow_repeat. Counts here are exact, not estimates.
A stage that trains on the chat data instead (stages.distill.data=instructions) reads no sequence here.
With data.mix the report also has one SourceBudget per source (harness.data.mix): its sequences per stage, what it
holds and the passes it needs; a repeat is then judged per source.
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
class SourceBudget:
    """One data.mix source's part of the stream: its sequences in each stage and the sequences it holds."""

    label: str  # the entry's source, e.g. 'embedded' or 'generator:kv_recall'
    weight: float
    stage_shares: tuple[float, ...]  # its exact fraction of each stage's sequences (the schedules', harness.data.mix)
    stage_sequences: tuple[int, ...]  # per stage, in STAGES order
    available: int  # sequences of its training split (a generator's is made to the budget's measure)
    generator: bool

    @property
    def share(self) -> float | None:
        """Its fraction of every stage's sequences, or None when stage_weights make it differ by stage."""
        return self.stage_shares[0] if len(set(self.stage_shares)) == 1 else None

    @property
    def share_label(self) -> str:
        return share_label(self.stage_shares)

    @property
    def sequences(self) -> int:
        return sum(self.stage_sequences)

    @property
    def passes(self) -> float:
        """Passes over its training split the stages need (<= 1: no repeat)."""
        return self.sequences / self.available

    @property
    def repeats(self) -> bool:
        return self.sequences > self.available


@dataclass(frozen=True)
class BudgetReport:
    source: str
    seq_len: int
    train_sequences: int
    validation_tokens: int
    allow_repeat: bool
    stages: tuple[StageBudget, ...]
    sources: tuple[SourceBudget, ...] = ()  # data.mix only

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
        """Passes over the training split the stages need (<= 1: no repeat); with a mix, the most of any natural source
        (a generator's text is made to measure), or of any source when one repeats."""
        if self.sources:
            natural = [s.passes for s in self.sources if not s.generator or self.needs_repeat]
            return max(natural or [s.passes for s in self.sources])
        return self.total_sequences / self.train_sequences

    @property
    def needs_repeat(self) -> bool:
        if self.sources:
            return any(s.repeats for s in self.sources)
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
        if self.sources:
            raise DataError(self._mix_repeat_message(first.stage))
        raise DataError(
            f"The corpus is too small for the budget: the stages need {self.total_tokens:,} tokens "
            f"({self.total_sequences:,} sequences of {self.seq_len}) but the training split of '{self.source}' holds "
            f"{self.train_tokens:,} tokens ({self.train_sequences:,} sequences). Training would pass over it "
            f"{self.repeat_factor:.2f} times: from stage {first.stage} on, the same sequences are read again, in a "
            f"new seeded order per pass, so each is seen up to {math.ceil(self.repeat_factor)} times and later "
            "stages train on text earlier stages already used. Set data.allow_repeat=true to accept that, or give "
            "a larger data.source, or lower budget.total_tokens (or stages.<stage>.tokens)."
        )

    def _mix_repeat_message(self, first_stage: str) -> str:
        short = [s for s in self.sources if s.repeats]
        listed = "; ".join(f"'{s.label}' is read for {s.sequences:,} sequences of {self.seq_len} but holds "
                           f"{s.available:,} ({s.passes:.2f} passes)" for s in short)
        return (f"A source of data.mix is too small for the budget: {listed}. From stage {first_stage} on, its "
                "sequences are read again, in a new seeded order per pass, and later stages train on text earlier "
                "stages already used. Set data.allow_repeat=true to accept that, or give that source more text or "
                "less weight, or lower budget.total_tokens (or stages.<stage>.tokens).")

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
        where = "a natural source's training split (at most)" if self.sources else "the training split"
        verdict = (f"needs {self.repeat_factor:.2f} passes: "
                   + ("allowed (data.allow_repeat)" if self.allow_repeat else "NOT allowed (set data.allow_repeat)")
                   if self.needs_repeat else f"fits: uses {self.repeat_factor:.1%} of {where}")
        lines.append(f"  total: {self.total_sequences:,} sequences = {self.total_tokens:,} tokens; {verdict}")
        if self.sources:
            lines += self._format_sources()
        return "\n".join(lines)

    def _format_sources(self) -> list[str]:
        """The mix's per-source table: weight, exact share, sequences per stage, tokens, what it holds, passes."""
        names = [s.stage for s in self.stages]
        lines = ["# data mix: sequences per source and stage (each stage: every source within one sequence of its "
                 "share at every point)",
                 f"  {'source':<28}{'weight':>8}{'share':>12}" + "".join(f"{n:>14}" for n in names)
                 + f"{'tokens':>15}{'holds':>12}{'passes':>8}"]
        for s in self.sources:
            holds = f"{s.available:,}" + ("*" if s.generator else "")
            lines.append(f"  {short_label(s.label, 27):<28}{s.weight:>8g}{s.share_label:>12}"
                         + "".join(f"{n:>14,}" for n in s.stage_sequences)
                         + f"{s.sequences * self.seq_len:>15,}{holds:>12}{s.passes:>8.2f}")
        if any(s.generator for s in self.sources):
            lines.append("  * a generator's documents are made to the budget's measure (deterministic: a larger "
                         "budget extends them)")
        return lines


def share_label(stage_shares: tuple[float, ...]) -> str:
    """A mix source's share: '12.50%' when every stage has the same, else each stage's, e.g. '50/50/0%'."""
    if len(set(stage_shares)) == 1:
        return f"{stage_shares[0]:.2%}"
    return "/".join(f"{x * 100:.0f}" for x in stage_shares) + "%"


def short_label(label: str, width: int) -> str:
    """`label` in at most `width` characters: its end kept (a path's file name), '...' before it when cut."""
    return label if len(label) <= width else "..." + label[-(width - 3):]


@dataclass(frozen=True)
class StageSlice:
    """A stage's plan and its slice [start, start + sequences) of the stream, before any corpus is known."""

    stage: str
    requested_tokens: int
    steps: int
    tokens_per_step: int
    sequences: int
    start: int


def stage_slices(job: Any, seq_len: int) -> list[StageSlice]:
    """Each pipeline stage's planned steps and stream slice under `job`'s budget (see module docstring)."""
    from harness.config import STAGES, plan_stages, reads_instructions

    slices, start = [], 0
    for plan, fraction in zip(plan_stages(job), job.budget.split):
        cfg = getattr(job.stages, plan.stage)
        requested = cfg.tokens if cfg.tokens is not None else int(job.budget.total_tokens * fraction)
        # a stage on the chat data (stages.distill.data=instructions) reads nothing of this stream
        sequences = 0 if reads_instructions(job, plan.stage) else plan.steps * plan.tokens_per_step // seq_len
        slices.append(StageSlice(plan.stage, requested, plan.steps, plan.tokens_per_step, sequences, start))
        start += sequences
    assert [s.stage for s in slices] == list(STAGES)
    return slices


def budget_report(job: Any, corpus: Any) -> BudgetReport:
    """Each stage's slice of `corpus`'s training stream under `job`'s budget (see module docstring)."""
    seq_len, n = corpus.seq_len, corpus.train.num_sequences
    stages = []
    for s in stage_slices(job, seq_len):
        last = (s.start + s.sequences - 1) // n if s.sequences else s.start // n
        stages.append(StageBudget(s.stage, s.requested_tokens, s.steps, s.tokens_per_step, s.sequences,
                                  s.sequences * seq_len, s.start, s.start // n, last))
    val = corpus.validation.num_tokens if corpus.validation is not None else 0
    return BudgetReport(corpus.source, seq_len, n, val, bool(job.data.allow_repeat), tuple(stages))
