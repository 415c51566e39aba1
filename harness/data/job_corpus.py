"""A job's corpus: its one source (harness.data.corpus) or its data.mix (harness.data.mix), prepared for the
whole budget and checked; and what `harness data prepare` prints of it."""

from __future__ import annotations

import os
from typing import Any

from harness.assets import cache_root
from harness.data.corpus import prepare_corpus
from harness.data.errors import DataError
from harness.data.mix import mix_sources, prepare_mixed_corpus


def prepare_job_corpus(job: Any, tokenizer: Any, *, max_positions: int | None = None,
                       cache_dir: str | os.PathLike[str] | None = None, check: bool = True) -> Any:
    """prepare_corpus for a whole job: streams read what the budget needs; the budget is checked.

    With data.mix, a harness.data.mix.MixedCorpus (the same interface): every source prepared on its own, the
    generators made to the budget's measure. Raises DataError when the stages need a repeat and data.allow_repeat is
    off (unless check=False).
    """
    from harness.config import plan_stages, reads_instructions

    if job.data.mix:
        corpus = prepare_mixed_corpus(job, tokenizer, max_positions=max_positions, cache_dir=cache_dir)
    else:
        needed = sum(p.steps * p.tokens_per_step for p in plan_stages(job) if not reads_instructions(job, p.stage))
        corpus = prepare_corpus(job.data, tokenizer, seed=int(job.seed), max_positions=max_positions,
                                stream_tokens=needed, cache_dir=cache_dir)
    if check:
        corpus.budget(job).check()
    return corpus


def prepare_summary(job: Any, tokenizer: Any, *, max_positions: int | None = None,
                    cache_dir: str | os.PathLike[str] | None = None) -> str:
    """What `harness data prepare JOB` prints: prepares the job's corpus, describes it and its budget (with data.mix
    also each source's sequences per stage, what it holds and its passes, and a generated document of each generator).

    Raises DataError carrying the same text when the budget needs a repeat that is not allowed.
    """
    corpus = prepare_job_corpus(job, tokenizer, max_positions=max_positions, cache_dir=cache_dir, check=False)
    report = corpus.budget(job)
    text = f"{corpus.describe()}\n{report.format()}"
    if job.data.mix:
        text = "\n".join(t for t in (text, corpus.examples()) if t)
    if "embedded:mixed" in mix_sources(job.data):
        from harness.data.mixed import mixed_summary

        root = cache_root(cache_dir if cache_dir is not None else job.data.cache_dir)
        text = f"{mixed_summary(root)}\n{text}"
    try:
        report.check()
    except DataError as err:
        raise DataError(f"{text}\n\n{err}") from None
    return text
