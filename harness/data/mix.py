"""Data mixtures (data.mix): weighted sources interleaved at the level of packed sequences.

Each entry of data.mix is prepared on its own, as data.source would be: a natural source gets its cached token store
(harness.data.corpus.build_store, the same store data.source would use) and its training split; a generator
('generator:NAME', harness.data.generators) gets a store of its documents made to the budget's measure, so that its
split holds exactly the sequences the stages read from it, each once. The mix is a corpus with the interface of
harness.data.corpus.Corpus (stage streams, loaders, validation batches, a budget report), so the stages read it as
they read one source.

Interleaving. The weights, normalised, become integer shares a_s of a period of P positions (exact when every weight
has at most four decimals, e.g. 0.9 / 0.1 -> 9, 1 of 10; else rounded to P = 10,000 by largest remainders; the shares
used are reported). One period is the order of sources that Tijdeman's algorithm for the chairman assignment problem
(1980) gives: at every prefix of n positions, every source s has been chosen within 1 - 1/(2k-2) < 1 times of
n * a_s / P (k sources), and exactly a_s times in a whole period. The schedule starts again at the first position of
every stage, so in every stage's slice of the stream, at every point, each source has its share within one sequence.
An entry's stage_weights give a stage its own weights (0: that stage does not read the entry), so its own schedule
(harness.data.mix_schedule.StageSchedules); a mix without them has one schedule for all stages.

Order. The r-th position of a stage reads source s = pattern[r mod P], and within s the sequence of rank
base_s + (r // P) * a_s + (occurrences of s in pattern[:r mod P]), base_s being what s gave the stages before (under
their own schedules). Rank k of source s reads training sequence perm_e[k mod N_s] of s, e = k // N_s, perm_e seeded
by (seed_s, e) as for a single source: seed_0 = job.seed for the first entry (a one-entry mix reads what data.source
alone reads), a splitmix64 hash of (job.seed, s) for the others. All of it is arithmetic on the position, so a
loader's state (sequences consumed) resumes a mix exactly, and two builds give the same stream.

Validation. When data.validation_source names no entry of the mix, it is validated on (its head); when it names a
natural entry, that entry's head is held out; when it is null, the head of the first entry that is not a generator is
held out (whole documents, never trained on, as for data.source). Synthetic text is never validated on.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from harness.data.budget import BudgetReport, SourceBudget, StageBudget, share_label, short_label, stage_slices
from harness.data.errors import DataError
from harness.data.generators import Generator, RepeatSpan
from harness.data.loader import validation_batches
from harness.data.mix_schedule import GENERATOR_PREFIX, MixEntry, MixSchedule, StageSchedules, parse_mix, part_seed
from harness.data.order import EpochOrder
from harness.data.packing import PackedSplit, cu_seqlens
from harness.data.sources import SourceSpec, parse_source
from harness.data.store import TokenStore
from harness.data.tokenise import BATCH_DOCS, cache_key, encode_documents, new_writer, store_meta

def source_needs(job: Any, schedules: StageSchedules) -> np.ndarray:
    """int64 [k]: the sequences each source gives all stages of `job` together."""
    return sum((schedules.counts(s.stage, s.sequences) for s in stage_slices(job, job.data.seq_len)),
               np.zeros(len(schedules.first.shares), dtype=np.int64))


def stage_shares(schedules: StageSchedules, index: int) -> tuple[float, ...]:
    """Entry `index`'s share of each pretraining stage (0 where its stage reads no mix)."""
    return tuple(s.shares[index] / s.period if s is not None else 0.0 for s in schedules.by_stage.values())


def plan_summary(job: Any) -> str:
    """Each data.mix source's sequences and tokens per stage, from the job alone (no data read): what `harness info`
    can print beside its stage plan. Empty without a mix."""
    if not job.data.mix:
        return ""
    entries, seq_len = parse_mix(job.data), job.data.seq_len
    schedules = StageSchedules.from_entries(entries)
    slices = stage_slices(job, seq_len)
    lines = ["# data mix plan: sequences (tokens) per source and stage; each within one sequence of its share",
             f"  {'source':<28}{'share':>12}" + "".join(f"{s.stage:>24}" for s in slices)]
    for i, e in enumerate(entries):
        cells = [f"{n:,} ({n * seq_len:,})" for n in (int(schedules.counts(s.stage, s.sequences)[i]) for s in slices)]
        lines.append(f"  {short_label(e.label, 27):<28}{share_label(stage_shares(schedules, i)):>12}"
                     + "".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ the corpus


@dataclass
class MixPart:
    """A prepared mix entry: its training split and, for a generator, the generator."""

    entry: MixEntry
    share: int  # of the first stage's period (every stage's unless stage_weights differ)
    train: PackedSplit
    generator: Optional[Generator] = None


@dataclass
class MixedCorpus:
    """data.mix prepared: the parts, the schedule and the validation split (interface of harness.data.Corpus)."""

    source: str
    seq_len: int
    parts: tuple[MixPart, ...]
    schedules: StageSchedules
    validation: Optional[PackedSplit]
    validation_from: str
    primary: int  # the part that `train` and `store` stand for: validation's, else the first natural one

    @property
    def train(self) -> PackedSplit:
        return self.parts[self.primary].train

    @property
    def store(self) -> TokenStore:
        return self.train.store

    @property
    def fingerprint(self) -> str:
        """Identifies the mixed stream exactly (every part's store, offset and size, the shares); in loader states."""
        parts = "|".join(f"{p.train.store.key}:{p.train.offset}:{p.train.num_sequences}:{p.share}" for p in self.parts)
        if not self.schedules.uniform:  # per-stage shares (a mix without stage_weights keeps its fingerprint)
            parts += "|stages:" + ";".join(f"{st}={s.shares if s is not None else None}"
                                           for st, s in self.schedules.by_stage.items())
        return hashlib.sha256(f"mix|{self.seq_len}|{parts}".encode()).hexdigest()[:16]

    def budget(self, job: Any) -> BudgetReport:
        return mix_budget_report(job, self)

    def stage_stream(self, stage: str, job: Any) -> "MixedStageStream":
        """The mixed stream slice of `stage`, seeded by job.seed; DataError when a source repeats unallowed."""
        self.budget(job).check()
        slices = stage_slices(job, self.seq_len)
        at = [s.stage for s in slices].index(stage)
        base = sum((self.schedules.counts(s.stage, s.sequences) for s in slices[:at]),
                   np.zeros(len(self.parts), dtype=np.int64))
        s = slices[at]
        return MixedStageStream(tuple(p.train for p in self.parts), self.schedules.of(stage), stage, s.start,
                                s.sequences, int(job.seed), self.fingerprint, base)

    def validation_batches(self, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[dict]:
        if self.validation is None:
            raise DataError("This corpus has no validation split (data.validation_tokens=0).")
        return validation_batches(self.validation, batch_size, rank, world)

    def describe(self) -> str:
        schedules = [f"{stage}{s.period} positions per period, shares {', '.join(map(str, s.shares))}"
                     for stage, s in self._distinct_schedules()]
        lines = [f"# corpus {self.source} (schedule: {'; '.join(schedules)})"]
        for i, p in enumerate(self.parts):
            st = p.train.store
            share = share_label(stage_shares(self.schedules, i))
            lines.append(f"  [{i}] {p.entry.label} (weight {p.entry.weight:g}{self._stage_weights(p)}, share {share}): "
                         f"store {st.path} "
                         f"({st.n_docs:,} documents, {st.n_tokens:,} tokens, end-of-document "
                         f"{st.meta['eos_token']!r} = {st.eos_id})\n      {p.train.describe()}")
        val = self.validation.describe() if self.validation is not None else "validation: none"
        return "\n".join(lines + [f"  {val}; {self.validation_from}"])

    def _distinct_schedules(self) -> list[tuple[str, MixSchedule]]:
        """(prefix, schedule): one with no prefix when every stage has the same, else each stage's."""
        if self.schedules.uniform:
            return [("", self.schedules.first)]
        return [(f"{stage} ", s) for stage, s in self.schedules.by_stage.items() if s is not None]

    @staticmethod
    def _stage_weights(part: MixPart) -> str:
        w = part.entry.stage_weights
        return (", in " + ", ".join(f"{k} {v:g}" for k, v in w.items())) if w else ""

    def examples(self, chars: int = 240) -> str:
        """The first document of each generator, cut to `chars` characters (what `harness data prepare` shows)."""
        out = []
        for p in self.parts:
            if p.generator is not None:
                text = p.generator.document(0)
                out.append(f"  {p.entry.label} document 0: {text[:chars]!r}{' ...' if len(text) > chars else ''}")
        return "\n".join(["# generated text (first document of each generator)", *out]) if out else ""


@dataclass
class MixedStageStream:
    """Stream positions [start, start + length) of a mix: the interface of harness.data.loader.StageStream."""

    splits: tuple[PackedSplit, ...]
    schedule: MixSchedule
    stage: str
    start: int
    length: int
    seed: int
    corpus_fingerprint: str
    base: np.ndarray  # int64 [k]: sequences each source gave the stages before this one
    _orders: dict = field(default_factory=dict, repr=False)

    @property
    def seq_len(self) -> int:
        return self.splits[0].seq_len

    @property
    def num_tokens(self) -> int:
        return self.length * self.seq_len

    def loader(self, rank: int, world: int, micro_batch_size: int, grad_accum: int = 1) -> Any:
        from harness.data.loader import PackedLoader

        return PackedLoader(self, rank, world, micro_batch_size, grad_accum)

    def order(self, source: int) -> EpochOrder:
        if source not in self._orders:
            self._orders[source] = EpochOrder(self.splits[source].num_sequences, part_seed(self.seed, source))
        return self._orders[source]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index in that source's training split) of absolute stream `positions` (int64 arrays)."""
        source, rank = self.schedule.locate(np.asarray(positions, dtype=np.int64) - self.start)
        rank = rank + self.base[source]
        index = np.empty_like(rank)
        for s in np.unique(source):
            mask = source == s
            index[mask] = self.order(int(s)).indices(rank[mask])
        return source, index

    def batch(self, positions: np.ndarray) -> dict[str, torch.Tensor]:
        """A training batch (harness.data.packing.PackedSplit.batch) of the sequences at `positions`; sample_index is
        each row's index in its source's split and `source` (long [B]) its data.mix entry."""
        source, index = self.locate(positions)
        tokens = np.empty((len(index), self.seq_len), dtype=np.int64)
        starts = np.empty((len(index), self.seq_len), dtype=bool)
        for s in np.unique(source):
            mask = source == s
            tokens[mask] = self.splits[s].tokens(index[mask])
            starts[mask] = self.splits[s].doc_starts(index[mask])
        return {"input_ids": torch.from_numpy(tokens), "doc_start": torch.from_numpy(starts),
                "cu_seqlens": torch.from_numpy(cu_seqlens(starts)), "sample_index": torch.from_numpy(index),
                "source": torch.from_numpy(source.copy())}


def mix_budget_report(job: Any, corpus: MixedCorpus) -> BudgetReport:
    """Each stage's slice of the mixed stream and each source's sequences per stage (harness.data.budget)."""
    seq_len, schedules = corpus.seq_len, corpus.schedules
    available = np.array([p.train.num_sequences for p in corpus.parts], dtype=np.int64)
    stages, per_stage, base = [], [], np.zeros(len(corpus.parts), dtype=np.int64)
    for s in stage_slices(job, seq_len):
        counts = schedules.counts(s.stage, s.sequences)
        used = counts > 0
        first = int((base[used] // available[used]).min()) if used.any() else 0
        last = int(((base + counts - 1)[used] // available[used]).max()) if used.any() else 0
        stages.append(StageBudget(s.stage, s.requested_tokens, s.steps, s.tokens_per_step, s.sequences,
                                  s.sequences * seq_len, s.start, first, last))
        per_stage.append(counts)
        base = base + counts
    sources = tuple(SourceBudget(p.entry.label, p.entry.weight, stage_shares(schedules, i),
                                 tuple(int(c[i]) for c in per_stage), int(available[i]), p.entry.generator)
                    for i, p in enumerate(corpus.parts))
    val = corpus.validation.num_tokens if corpus.validation is not None else 0
    return BudgetReport(corpus.source, seq_len, int(available.sum()), val, bool(job.data.allow_repeat),
                        tuple(stages), sources)


# ------------------------------------------------------------------------------------------------ preparing


def prepare_mixed_corpus(job: Any, tokenizer: Any, *, max_positions: int | None = None,
                         cache_dir: Any = None) -> MixedCorpus:
    """Prepare every source of job.data.mix, the schedule and the validation split (see the module docstring)."""
    from harness.assets import cache_root
    from harness.data.corpus import check_seq_len
    from harness.data.tokenise import resolve_eos

    data, seq_len = job.data, job.data.seq_len
    check_seq_len(seq_len, max_positions)
    root = cache_root(cache_dir if cache_dir is not None else data.cache_dir)
    entries = parse_mix(data)
    schedules = StageSchedules.from_entries(entries)
    needs = source_needs(job, schedules)
    eos = resolve_eos(tokenizer, data.eos_token)
    n_val = math.ceil(data.validation_tokens / seq_len) if data.validation_tokens > 0 else 0
    val_spec = parse_source(data.validation_source, "data.validation_source") if data.validation_source else None
    held = held_out_entry(entries, val_spec)
    parts, validation = [], None
    for i, e in enumerate(entries):
        if e.generator:
            parts.append(_generator_part(e, i, int(needs[i]), schedules.first.shares[i], tokenizer, eos, root,
                                         seq_len))
            continue
        store = _natural_store(e, data, tokenizer, eos, root, int(job.seed), int(needs[i]),
                               n_val if i == held else 0)
        from harness.data.corpus import split_store

        train, val = split_store(store, seq_len, n_val if i == held else 0, e.spec)
        parts.append(MixPart(e, schedules.first.shares[i], train))
        validation = val if i == held else validation
    if held is None and val_spec is not None and n_val:
        from harness.data.corpus import validation_split

        validation = validation_split(val_spec, data, tokenizer, eos, root=root, seed=int(job.seed), n_val=n_val)
    check_repeat_span_text(parts, validation, entries[held].spec if held is not None else val_spec, n_val * seq_len)
    label = "mix of " + ", ".join(f"{e.label} {e.weight:g}" for e in entries)
    primary = held if held is not None else next((i for i, e in enumerate(entries) if not e.generator), 0)
    return MixedCorpus(label, seq_len, tuple(parts), schedules, validation, _validation_from(entries, held, val_spec),
                       primary)


def held_out_entry(entries: Sequence[MixEntry], val_spec: Optional[SourceSpec]) -> Optional[int]:
    """The entry whose head is held out for validation: the one data.validation_source names, else (null) the first
    natural one; None when validation comes from elsewhere or no entry is natural."""
    if val_spec is not None:
        return next((i for i, e in enumerate(entries) if e.spec == val_spec), None)
    return next((i for i, e in enumerate(entries) if not e.generator), None)


def validation_source_label(data: Any) -> str:
    """The source that a job's held-out text comes from, as written: data.validation_source, else (a mix) the entry
    whose head is held out, else data.source."""
    if data.validation_source:
        return str(data.validation_source)
    if getattr(data, "mix", None):
        entries = parse_mix(data)
        held = held_out_entry(entries, None)
        return entries[held].label if held is not None else "no natural source to hold out"
    return str(data.source)


def _validation_from(entries: Sequence[MixEntry], held: Optional[int], val_spec: Optional[SourceSpec]) -> str:
    if held is not None:
        return f"the held-out head of data.mix[{held}] '{entries[held].label}' (never trained on)"
    if val_spec is not None:
        return f"from data.validation_source, {val_spec.describe()}"
    return "no natural source to hold out"


def _natural_store(e: MixEntry, data: Any, tokenizer: Any, eos: tuple[str, int], root: Path, seed: int, needed: int,
                   held_out: int) -> TokenStore:
    """The token store of a natural entry: build_store with the entry's source and text field; a stream reads what the
    budget takes from it (+1%) and the held-out head."""
    from harness.data.corpus import STREAM_MARGIN, build_store

    own = replace(data, source=e.label, text_field=e.text_field or data.text_field, mix=[])
    target = int(needed * data.seq_len * (1 + STREAM_MARGIN)) + (held_out + 1) * data.seq_len
    return build_store(e.spec, own, tokenizer, eos, root=root, seed=seed, target_tokens=target)


def _generator_part(e: MixEntry, index: int, needed: int, share: int, tokenizer: Any, eos: tuple[str, int],
                    root: Path, seq_len: int) -> MixPart:
    """A generator's part: a store of at least `needed` sequences of its documents, split to exactly that many (at
    least one), so the stages read each generated sequence once."""
    key = f"data.mix[{index}]"
    gen = e.make_generator(key, root)
    if isinstance(gen, RepeatSpan):
        gen.check_text(key)
    n = max(needed, 1)
    store = generator_store(gen, tokenizer, eos, root=root, target_tokens=n * seq_len)
    return MixPart(e, share, PackedSplit(store, 0, n, seq_len, "train"), gen)


def generator_store(gen: Generator, tokenizer: Any, eos: tuple[str, int], *, root: Path,
                    target_tokens: int) -> TokenStore:
    """The cached store of `gen`'s documents 0, 1, ... holding at least `target_tokens` tokens. Folder:
    <root>/data/tokens/generator-NAME-<key>-<tokens asked>, key = hash(gen.fingerprint(), tokenizer, eos id); any
    folder of the key with enough tokens serves (its tokens start with those of fewer documents)."""
    from harness.data.corpus import cached_store

    fp = gen.fingerprint()
    key = cache_key(fp, tokenizer, eos[1])

    def write(tmp: Path) -> None:
        writer = new_writer(tmp, tokenizer)
        documents = write_documents(gen, tokenizer, eos[1], writer, target_tokens)
        writer.close(store_meta(key, fp, tokenizer, eos, {"generator": gen.name, "options": gen.options_dict(),
                                                          "documents": documents, "exhausted": False}))

    return cached_store(root / "data" / "tokens", f"generator-{gen.name}-{key}", True, target_tokens, write)


def write_documents(gen: Generator, tokenizer: Any, eos_id: int, writer: Any, target_tokens: int) -> int:
    """Tokenise `gen`'s documents into `writer` until it holds `target_tokens`, in batches of 16, 32, ... up to
    BATCH_DOCS documents; returns how many documents were written (whole batches: the count depends only on the
    target, and a larger target writes the same documents first)."""
    done, size = 0, 16
    with tqdm(total=target_tokens, desc=f"generating generator:{gen.name}", unit="tok", unit_scale=True) as bar:
        while writer.n_tokens < target_tokens:
            texts = [gen.document(i) for i in range(done, done + size)]
            values, lengths = encode_documents(texts, tokenizer, "text", eos_id, f"generator:{gen.name}")
            writer.append(values, lengths)
            bar.update(len(values))
            done, size = done + size, min(2 * size, BATCH_DOCS)
    return done


def check_repeat_span_text(parts: Sequence[MixPart], validation: Optional[PackedSplit],
                           val_spec: Optional[SourceSpec], val_tokens: int) -> None:
    """DataError when a repeat_span generator would take paragraphs of the text that validation holds out: it reads
    documents from options.first_document on, which must be past every document of the validation head."""
    if validation is None or val_spec is None:
        return
    held_docs = int(np.searchsorted(validation.store.doc_starts, val_tokens, side="left"))
    for i, p in enumerate(parts):
        gen = p.generator
        if isinstance(gen, RepeatSpan) and _same_text(parse_source(gen.options.text), val_spec) \
                and gen.options.first_document < held_docs:
            raise DataError(f"data.mix[{i}] (generator:repeat_span) takes documents of '{gen.options.text}' from "
                            f"options.first_document={gen.options.first_document} on, but validation holds out its "
                            f"first {held_docs:,} documents: raise first_document to at least {held_docs}, or lower "
                            "data.validation_tokens, so that no validation text is trained on.")


def _same_text(a: SourceSpec, b: SourceSpec) -> bool:
    """Whether two specs read the same documents (files compared by their resolved paths)."""
    if a.kind == "files" and b.kind == "files":
        return [str(Path(f).resolve()) for f in a.files] == [str(Path(f).resolve()) for f in b.files]
    return a == b


def mix_sources(data: Any) -> list[str]:
    """The natural sources a job reads (data.source, or the mix's natural entries) and data.validation_source."""
    sources = [e.source for e in data.mix if not e.source.startswith(GENERATOR_PREFIX)] if data.mix else [data.source]
    if data.mix:  # a repeat_span's text
        sources += [e.options.get("text", "embedded:wikipedia") for e in data.mix
                    if e.source.strip() == "generator:repeat_span"]
    return sources + ([data.validation_source] if data.validation_source else [])
