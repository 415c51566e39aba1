"""Tokenise documents with the teacher's tokenizer into a cached TokenStore.

Every document becomes its token ids (no special tokens added) followed by the end-of-document id;
empty documents are dropped. Non-streaming sources go through `datasets.Dataset.map` (batched, with
`num_proc` processes); its arrow output is flattened into tokens.bin by pyarrow, with no Python work
per token. Streaming sources are read through a seeded shuffle buffer and tokenised in batches until
a token target is reached. The store is cached under a key of (source fingerprint, tokenizer
fingerprint, end-of-document id): see harness.data.corpus.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from harness.data.errors import DataError
from harness.data.store import StoreWriter, token_dtype

if TYPE_CHECKING:
    import pyarrow as pa

BATCH_DOCS = 1000


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of everything that decides the ids: the backend's JSON (vocab, merges, normaliser...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        payload = backend.to_str()
    else:  # a slow tokenizer: fall back to datasets' pickling hash
        from datasets.fingerprint import Hasher

        payload = Hasher.hash(tokenizer)
    extra = f"{type(tokenizer).__name__}|{len(tokenizer)}"
    return hashlib.sha256((payload + extra).encode()).hexdigest()[:16]


def resolve_eos(tokenizer: Any, eos_token: str | None) -> tuple[str, int]:
    """The end-of-document token and id: `eos_token` (data.eos_token) if given, else the tokenizer's eos."""
    if eos_token is None:
        if tokenizer.eos_token is None or tokenizer.eos_token_id is None:
            raise DataError("The tokenizer has no eos_token; set data.eos_token to the token that separates documents.")
        return tokenizer.eos_token, int(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    if eos_token not in vocab:
        raise DataError(f"data.eos_token='{eos_token}' is not a token of the tokenizer (its eos_token is "
                        f"{tokenizer.eos_token!r}).")
    return eos_token, int(vocab[eos_token])


def token_ids(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids of `texts` without special tokens.

    Uses the Rust backend's `encode_batch_fast` (no character offsets: ~2x faster) when the
    tokenizer has one, else the tokenizer's ordinary call.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "encode_batch_fast"):
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def encode_documents(texts: list, tokenizer: Any, text_field: str, eos_id: int,
                     where: str = "the source") -> tuple[np.ndarray, np.ndarray]:
    """Tokenise documents: (values int32 [sum(lengths)], lengths int64 [n]), each document's ids + eos.

    Empty and None documents are dropped. The flattening runs in numpy/itertools, not per token in Python.
    """
    bad = next((t for t in texts if t is not None and not isinstance(t, str)), None)
    if bad is not None:
        raise DataError(f"Field '{text_field}' of {where} holds a {type(bad).__name__}, not text; "
                        "set data.text_field to a string field.")
    ids = [x for x in token_ids(tokenizer, [t or "" for t in texts]) if x]
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lengths.sum()))
    values = np.insert(flat, np.cumsum(lengths), np.int32(eos_id))  # eos after each document
    return values, lengths + 1


def encode_batch(batch: dict, tokenizer: Any, text_field: str, eos_id: int, where: str = "the source") -> "pa.Table":
    """datasets.map function: {text_field: [str | None]} -> a table with input_ids list<int32> (ids + eos)."""
    import pyarrow as pa

    values, lengths = encode_documents(batch[text_field], tokenizer, text_field, eos_id, where)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))})


def tokenise_dataset(ds: Any, tokenizer: Any, text_field: str, eos_id: int, writer: StoreWriter, *,
                     work_dir: Path, num_proc: int, desc: str) -> None:
    """Tokenise a datasets.Dataset with `map` and append all documents to `writer`."""
    from datasets import Features, List, Value

    num_proc = max(1, min(num_proc, -(-len(ds) // BATCH_DOCS)))  # no idle processes on small corpora
    tokenised = ds.map(
        encode_batch, batched=True, batch_size=BATCH_DOCS, num_proc=num_proc if num_proc > 1 else None,
        remove_columns=ds.column_names,
        fn_kwargs={"tokenizer": tokenizer, "text_field": text_field, "eos_id": eos_id, "where": desc},
        features=Features({"input_ids": List(Value("int32"))}), cache_file_name=str(work_dir / "tokenised.arrow"),
        new_fingerprint=hashlib.sha256(str(work_dir).encode()).hexdigest()[:16],  # skip hashing the tokenizer
        desc=f"tokenising {desc}",
    )
    column = tokenised.data.table.column("input_ids")
    for chunk in tqdm(column.chunks, desc="packing", unit="chunk", disable=len(column.chunks) < 1000):
        lengths = chunk.value_lengths().to_numpy(zero_copy_only=False)
        writer.append(chunk.flatten().to_numpy(zero_copy_only=False), lengths)
    del tokenised


def tokenise_stream(ds: Any, tokenizer: Any, text_field: str, eos_id: int, writer: StoreWriter, *,
                    target_tokens: int, seed: int, shuffle_buffer: int, desc: str) -> bool:
    """Tokenise a streaming IterableDataset through a seeded shuffle buffer until `target_tokens`.

    Returns True when the stream ran out before the target (the store then holds all of it). Rows without the text
    field (or null there) are dropped: a DataWarning at the end says how many of the rows read.
    """
    from harness.data.sources import report_missing_text

    stream = ds.shuffle(seed=seed, buffer_size=shuffle_buffer)
    bar = tqdm(total=target_tokens, desc=f"streaming {desc}", unit="tok", unit_scale=True)
    rows = missing = 0
    exhausted = True
    try:
        for batch in stream.iter(batch_size=BATCH_DOCS):
            if text_field not in batch:
                raise DataError(f"{desc} has no text field '{text_field}' (data.text_field). Its fields: "
                                f"{', '.join(batch)}.")
            texts = batch[text_field]
            rows, missing = rows + len(texts), missing + sum(t is None for t in texts)
            values, lengths = encode_documents(texts, tokenizer, text_field, eos_id, desc)
            if len(lengths):
                writer.append(values, lengths)
                bar.update(len(values))
            if writer.n_tokens >= target_tokens:
                exhausted = False
                break
    finally:
        bar.close()
    if missing:
        report_missing_text(missing, rows, text_field, desc)
    return exhausted


def store_meta(key: str, source_fp: dict, tokenizer: Any, eos: tuple[str, int], extra: dict | None = None) -> dict:
    """The meta.json content common to every store."""
    return {"key": key, "source": source_fp, "tokenizer": tokenizer_fingerprint(tokenizer),
            "tokenizer_class": type(tokenizer).__name__, "vocab_size": len(tokenizer), "eos_token": eos[0],
            "eos_id": eos[1], "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **(extra or {})}


def cache_key(source_fp: dict, tokenizer: Any, eos_id: int) -> str:
    """The token-store key: a hash of the source fingerprint, the tokenizer fingerprint and the eos id."""
    blob = json.dumps({"source": source_fp, "tokenizer": tokenizer_fingerprint(tokenizer), "eos": eos_id},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def default_num_proc() -> int:
    """All CPU cores this process may use, at most 8 (more rarely pays for the process start-up)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 8))


def new_writer(folder: Path, tokenizer: Any) -> StoreWriter:
    return StoreWriter(folder, token_dtype(len(tokenizer)))
