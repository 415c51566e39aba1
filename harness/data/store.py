"""A tokenised corpus on disk: one flat, memory-mapped token array plus document start offsets.

Layout of a store folder (written once, atomically, then read-only):
  tokens.bin       every document's token ids followed by the end-of-document id, concatenated;
                   raw little-endian uint16 (vocabularies up to 65,536 ids) or uint32
  doc_starts.npy   int64 [n_docs]: offset in tokens.bin of each document's first token (first is 0)
  meta.json        counts, dtype, eos id, the source and tokenizer fingerprints, build time

Documents never share tokens: document d occupies [doc_starts[d], doc_starts[d+1]) and its last token
is the end-of-document id. Nothing here depends on the sequence length, so one store serves any
`data.seq_len`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.data.errors import DataError

STORE_FORMAT = 1
TOKENS_FILE, STARTS_FILE, META_FILE = "tokens.bin", "doc_starts.npy", "meta.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype holding ids 0..vocab_size-1: uint16 up to 65,536 ids, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass
class TokenStore:
    """A read-only view of a store folder. `tokens` is a np.memmap [n_tokens]; nothing is loaded eagerly."""

    path: Path
    tokens: np.ndarray
    doc_starts: np.ndarray
    meta: dict

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "TokenStore":
        path = Path(path)
        meta = json.loads((path / META_FILE).read_text())
        if meta.get("format") != STORE_FORMAT:
            raise DataError(f"Token store {path} has format {meta.get('format')}, expected {STORE_FORMAT}; delete it.")
        tokens = np.memmap(path / TOKENS_FILE, dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["n_tokens"],))
        starts = np.load(path / STARTS_FILE, mmap_mode="r")
        return cls(path, tokens, starts, meta)

    @property
    def n_tokens(self) -> int:
        return int(self.meta["n_tokens"])

    @property
    def n_docs(self) -> int:
        return int(self.meta["n_docs"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["eos_id"])

    @property
    def key(self) -> str:
        """The cache key (source + tokenizer + eos fingerprint) this store was built for."""
        return str(self.meta["key"])


class StoreWriter:
    """Appends documents (flat token values + per-document lengths) to a new store folder."""

    def __init__(self, folder: Path, dtype: np.dtype) -> None:
        self.folder, self.dtype = folder, dtype
        self._tokens = open(folder / TOKENS_FILE, "wb")
        self._lengths: list[np.ndarray] = []
        self.n_tokens = 0
        self.n_docs = 0

    def append(self, values: np.ndarray, lengths: np.ndarray) -> None:
        """Add documents: `values` [sum(lengths)] token ids (eos included), `lengths` [n_docs] > 0."""
        if len(values) and int(values.max()) > np.iinfo(self.dtype).max:
            raise DataError(f"token id {int(values.max())} does not fit the store's {self.dtype}")
        self._tokens.write(np.ascontiguousarray(values, dtype=self.dtype).tobytes())
        self._lengths.append(np.asarray(lengths, dtype=np.int64))
        self.n_tokens += int(len(values))
        self.n_docs += int(len(lengths))

    def close(self, meta: dict) -> dict:
        """Flush tokens.bin, write doc_starts.npy and meta.json; returns the full meta."""
        self._tokens.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        starts = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], out=starts[1:])
        np.save(self.folder / STARTS_FILE, starts)
        full = {**meta, "format": STORE_FORMAT, "dtype": self.dtype.name, "n_tokens": self.n_tokens,
                "n_docs": self.n_docs}
        (self.folder / META_FILE).write_text(json.dumps(full, indent=2, sort_keys=True))
        return full


@contextlib.contextmanager
def building(dest: Path) -> Iterator[Path]:
    """A temporary sibling folder of `dest` that is renamed to `dest` on success and removed on failure."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; a shared cache should be readable by others
    try:
        yield tmp
        if dest.exists():  # another process finished first: keep its copy
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
