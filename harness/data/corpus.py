"""A tokenised, packed corpus with its training and validation splits; the entry point of harness.data.

Validation: unless data.validation_source names another source, the first documents of data.source are
held out: validation is the first ceil(validation_tokens / seq_len) sequences of the store, and the
training split starts at the first document boundary after them, so no document is in both. The head,
not the tail, is held out because it is known first (a stream can stop once the budget is read) and it
does not move when files are appended to the source.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from harness.assets import cache_root
from harness.data.budget import BudgetReport, budget_report
from harness.data.errors import DataError
from harness.data.loader import StageStream, validation_batches
from harness.data.packing import PackedSplit
from harness.data.sources import (SourceSpec, embedded_source_path, load_documents, parse_source, source_fingerprint,
                                  utf8_error)
from harness.data.store import TokenStore, building
from harness.data.tokenise import (cache_key, default_num_proc, new_writer, resolve_eos, store_meta,
                                   tokenise_dataset, tokenise_stream)
from harness.files import file_lock

STREAM_MARGIN = 0.01  # extra fraction read from a stream beyond the budget, for document edges


@dataclass
class Corpus:
    """Training and validation splits of packed `seq_len`-token sequences."""

    source: str
    seq_len: int
    store: TokenStore
    train: PackedSplit
    validation: PackedSplit | None

    @property
    def fingerprint(self) -> str:
        """Identifies the training split exactly (store key, seq_len, offsets); saved in loader states."""
        blob = f"{self.store.key}|{self.seq_len}|{self.train.offset}|{self.train.num_sequences}"
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def budget(self, job: Any) -> BudgetReport:
        """Per-stage slices and exact token counts under `job` (see harness.data.budget)."""
        return budget_report(job, self)

    def stage_stream(self, stage: str, job: Any) -> StageStream:
        """The stream slice of `stage` ('align_mixer', 'align_hidden' or 'distill'), seeded by job.seed.

        Raises DataError when the budget needs a repeat that data.allow_repeat does not allow.
        """
        report = self.budget(job)
        report.check()
        s = report.stage(stage)
        return StageStream(self.train, stage, s.start, s.sequences, int(job.seed), self.fingerprint)

    def validation_batches(self, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[dict]:
        """Batches of the validation split (see harness.data.loader.validation_batches)."""
        if self.validation is None:
            raise DataError("This corpus has no validation split (data.validation_tokens=0).")
        return validation_batches(self.validation, batch_size, rank, world)

    def describe(self) -> str:
        val = self.validation.describe() if self.validation is not None else "validation: none"
        return (f"# corpus {self.source}\n  store: {self.store.path} ({self.store.n_docs:,} documents, "
                f"{self.store.n_tokens:,} tokens, {self.store.meta['dtype']}, end-of-document "
                f"{self.store.meta['eos_token']!r} = {self.store.eos_id})\n  {self.train.describe()}\n  {val}")


# -------------------------------------------------------------------------------------- preparing


def prepare_corpus(data: Any, tokenizer: Any, *, seed: int = 0, max_positions: int | None = None,
                   stream_tokens: int | None = None, cache_dir: str | os.PathLike[str] | None = None) -> Corpus:
    """Tokenise (or reuse the cached tokens of) data.source and split it; see the module docstring.

    data: a harness.config.DataConfig. tokenizer: the teacher's (a transformers tokenizer).
    max_positions: the teacher's max_position_embeddings; data.seq_len may not exceed it.
    stream_tokens: for data.streaming, how many tokens to read (prepare_job_corpus derives it from
    the budget). seed: the streaming shuffle buffer's seed. cache_dir: overrides data.cache_dir.
    """
    if getattr(data, "mix", None):
        raise DataError("data.mix is set: a mix is prepared for a job's budget (its generators are sized to it); use "
                        "prepare_job_corpus(job, tokenizer).")
    check_seq_len(data.seq_len, max_positions)
    root = cache_root(cache_dir if cache_dir is not None else data.cache_dir)
    spec = parse_source(data.source, "data.source")
    eos = resolve_eos(tokenizer, data.eos_token)
    n_val = math.ceil(data.validation_tokens / data.seq_len) if data.validation_tokens > 0 else 0
    val_spec = parse_source(data.validation_source, "data.validation_source") if data.validation_source else None
    if val_spec is not None and val_spec == spec:
        raise DataError("data.validation_source is data.source; leave it null to hold out the head of data.source.")
    held_out = n_val if val_spec is None else 0
    target = None if stream_tokens is None else int(stream_tokens * (1 + STREAM_MARGIN)) + (held_out + 1) * data.seq_len
    store = build_store(spec, data, tokenizer, eos, root=root, seed=seed, target_tokens=target)
    train, validation = split_store(store, data.seq_len, held_out, spec)
    if val_spec is not None and n_val:
        validation = validation_split(val_spec, data, tokenizer, eos, root=root, seed=seed, n_val=n_val)
    return Corpus(data.source, data.seq_len, store, train, validation)


def validation_split(val_spec: SourceSpec, data: Any, tokenizer: Any, eos: tuple[str, int], *, root: Path, seed: int,
                     n_val: int) -> PackedSplit:
    """The first `n_val` sequences of data.validation_source (`val_spec`); DataError when it holds fewer tokens."""
    vstore = build_store(val_spec, data, tokenizer, eos, root=root, seed=seed, target_tokens=(n_val + 1) * data.seq_len)
    if vstore.n_tokens < n_val * data.seq_len:
        raise DataError(f"data.validation_source {val_spec.describe()} holds {vstore.n_tokens:,} tokens, fewer "
                        f"than data.validation_tokens={data.validation_tokens:,} needs ({n_val} sequences of "
                        f"{data.seq_len}).")
    return PackedSplit(vstore, 0, n_val, data.seq_len, "validation")


def check_seq_len(seq_len: int, max_positions: int | None) -> None:
    if seq_len < 2:
        raise DataError(f"data.seq_len={seq_len} must be at least 2 (inputs and next-token targets).")
    if max_positions is not None and seq_len > max_positions:
        raise DataError(f"data.seq_len={seq_len} exceeds the teacher's maximum of {max_positions} positions "
                        "(max_position_embeddings); choose data.seq_len <= that.")


def split_store(store: TokenStore, seq_len: int, held_out: int,
                spec: SourceSpec) -> tuple[PackedSplit, PackedSplit | None]:
    """Training split (and the first `held_out` sequences as validation); see the module docstring."""
    validation = None
    offset = 0
    if held_out:
        val_end = held_out * seq_len
        i = int(np.searchsorted(store.doc_starts, val_end, side="left"))
        offset = int(store.doc_starts[i]) if i < store.n_docs else store.n_tokens
        validation = PackedSplit(store, 0, held_out, seq_len, "validation")
        if val_end > store.n_tokens:
            raise DataError(f"{spec.describe()} holds {store.n_tokens:,} tokens, fewer than the "
                            f"{val_end:,} held out for validation (data.validation_tokens); lower it or give "
                            "more text.")
    n_train = (store.n_tokens - offset) // seq_len
    if n_train < 1:
        raise DataError(f"{spec.describe()} holds {store.n_tokens:,} tokens: after holding out "
                        f"{offset:,} for validation, not one training sequence of data.seq_len={seq_len} is left.")
    return PackedSplit(store, offset, n_train, seq_len, "train"), validation


def build_store(spec: SourceSpec, data: Any, tokenizer: Any, eos: tuple[str, int], *, root: Path, seed: int,
                target_tokens: int | None) -> TokenStore:
    """The cached TokenStore of `spec` under the teacher's tokenizer, tokenising it if needed.

    Cache folder: <root>/data/tokens/<slug>-<key>/ with key = hash(source fingerprint, tokenizer
    fingerprint, eos id); streams add '-<target tokens>' and reuse any folder holding enough tokens.
    """
    streaming = bool(data.streaming) and spec.kind in ("hub", "files")
    if streaming and target_tokens is None:
        raise DataError("data.streaming needs a token target: use prepare_job_corpus (it reads the budget) or "
                        "pass stream_tokens to prepare_corpus.")
    if spec.kind == "embedded":
        embedded_source_path(spec.name, root)
    fp = source_fingerprint(spec, data, root)
    if streaming:
        fp = {**fp, "streaming": True, "seed": seed, "shuffle_buffer": data.shuffle_buffer}
    key = cache_key(fp, tokenizer, eos[1])

    def write(tmp: Path) -> None:
        writer = new_writer(tmp, tokenizer)
        ds, text_field = load_documents(spec, data, cache_dir=root, streaming=streaming)
        extra = {}
        if streaming:
            extra["exhausted"] = _tokenise_file_stream(ds, spec, data, tokenizer, text_field, eos[1], writer,
                                                       target_tokens=target_tokens, seed=seed)
        else:
            num_proc = data.num_proc or default_num_proc()
            tokenise_dataset(ds, tokenizer, text_field, eos[1], writer, work_dir=tmp, num_proc=num_proc,
                             desc=spec.describe())
        writer.close(store_meta(key, fp, tokenizer, eos, extra))
        if writer.n_docs == 0:
            raise DataError(f"{spec.describe()} holds no text: every document in field '{text_field}' is empty "
                            "(an empty corpus).")
        for leftover in tmp.glob("tokenised*.arrow"):  # map's intermediate output; tokens.bin replaces it
            leftover.unlink()

    return cached_store(root / "data" / "tokens", f"{spec.slug()}-{key}", streaming, target_tokens, write)


def cached_store(tokens_dir: Path, name: str, streaming: bool, target_tokens: int | None,
                 write: Callable[[Path], None]) -> TokenStore:
    """The store `name` in `tokens_dir` (for a stream any `name`-<tokens> folder holding `target_tokens`, or all its
    source), else the one `write(folder)` fills, built into `name` (a stream's: `name`-<target_tokens>) under a lock
    that concurrent callers wait on, to find it there."""
    found = _find_store(tokens_dir, name, streaming, target_tokens)
    if found is not None:
        return found
    with file_lock(tokens_dir / f"{name}.lock"):
        found = _find_store(tokens_dir, name, streaming, target_tokens)
        if found is not None:
            return found
        dest = tokens_dir / (f"{name}-{target_tokens}" if streaming else name)
        with building(dest) as tmp:
            write(tmp)
    return TokenStore.open(dest)


def _tokenise_file_stream(ds: Any, spec: SourceSpec, data: Any, tokenizer: Any, text_field: str, eos_id: int,
                          writer: Any, *, target_tokens: int, seed: int) -> bool:
    """tokenise_stream; where it fails on text that is not UTF-8, the DataError naming the file, offset and line."""
    try:
        return tokenise_stream(ds, tokenizer, text_field, eos_id, writer, target_tokens=target_tokens, seed=seed,
                               shuffle_buffer=data.shuffle_buffer, desc=spec.describe())
    except DataError:
        raise
    except Exception as err:  # datasets wraps a UnicodeDecodeError of its readers in its own types
        if not _caused_by(err, UnicodeDecodeError):
            raise
        raise utf8_error(spec) or DataError(f"{spec.describe()} is not UTF-8 text ({err}); re-encode it as UTF-8, "
                                            "e.g. with `iconv -f latin1 -t utf-8`.") from None


def _caused_by(err: BaseException, kind: type) -> bool:
    """Whether `err` or an exception in its chain of causes and contexts is a `kind`."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kind):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


def _find_store(tokens_dir: Path, name: str, streaming: bool, target: int | None) -> TokenStore | None:
    """An existing store for `name`: the exact folder, or for streams any folder with enough tokens."""
    if not streaming:
        return TokenStore.open(tokens_dir / name) if (tokens_dir / name / "meta.json").is_file() else None
    pattern = re.compile(re.escape(name) + r"-\d+$")
    for folder in sorted(tokens_dir.glob(f"{name}-*")):
        if pattern.match(folder.name) and (folder / "meta.json").is_file():
            store = TokenStore.open(folder)
            if store.meta.get("exhausted") or store.n_tokens >= target:
                return store
    return None
