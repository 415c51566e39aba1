"""Fixed-length packed sequences over a token store, and their document boundaries.

A split is a run of whole sequences of `seq_len` tokens starting at a token offset of the store:
sequence i is tokens[offset + i*T : offset + (i+1)*T]. Documents run across sequence edges (no padding,
nothing dropped inside the split). A batch of sequences comes with its document boundaries in two forms:

  doc_start   bool [B, T]: True where a document begins inside the row, and at t = 0 of every row
              (a row's first token starts a new segment for a recurrent mixer: the previous row is
              another sample)
  cu_seqlens  int32 [S + 1]: segment offsets into the flattened batch (B*T tokens, row-major), the
              varlen convention of flash-attn and fla (`cu_seqlens` with B = 1): 0, ..., B*T.
              A segment ends at a row end or just before a document's first token.

The end-of-document token belongs to the document it ends; the next document starts after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from harness.data.store import TokenStore


@dataclass(frozen=True)
class PackedSplit:
    """`num_sequences` sequences of `seq_len` tokens, starting at token `offset` of `store`."""

    store: TokenStore
    offset: int
    num_sequences: int
    seq_len: int
    name: str = "train"

    @property
    def num_tokens(self) -> int:
        return self.num_sequences * self.seq_len

    def tokens(self, indices: np.ndarray) -> np.ndarray:
        """Token ids of sequences `indices` (int64 [B]) as int64 [B, T], copied out of the memmap."""
        starts = self.offset + np.asarray(indices, dtype=np.int64) * self.seq_len
        return np.stack([self.store.tokens[s : s + self.seq_len] for s in starts]).astype(np.int64)

    def doc_starts(self, indices: np.ndarray) -> np.ndarray:
        """bool [B, T]: True at t = 0 and wherever a document begins inside each row."""
        indices = np.asarray(indices, dtype=np.int64)
        mask = np.zeros((len(indices), self.seq_len), dtype=bool)
        mask[:, 0] = True
        row_starts = self.offset + indices * self.seq_len
        lo = np.searchsorted(self.store.doc_starts, row_starts, side="right")
        hi = np.searchsorted(self.store.doc_starts, row_starts + self.seq_len, side="left")
        for row, (a, b) in enumerate(zip(lo, hi)):
            mask[row, self.store.doc_starts[a:b] - row_starts[row]] = True
        return mask

    def batch(self, indices: np.ndarray) -> dict[str, torch.Tensor]:
        """The sequences `indices` as a training batch.

        Returns input_ids long [B, T], doc_start bool [B, T], cu_seqlens int32 [S + 1] over the
        flattened B*T tokens, and sample_index long [B] (the sequences' indices in this split).
        """
        indices = np.asarray(indices, dtype=np.int64)
        starts = self.doc_starts(indices)
        return {
            "input_ids": torch.from_numpy(self.tokens(indices)),
            "doc_start": torch.from_numpy(starts),
            "cu_seqlens": torch.from_numpy(cu_seqlens(starts)),
            "sample_index": torch.from_numpy(indices.copy()),
        }

    def describe(self) -> str:
        return (f"{self.name}: {self.num_sequences:,} sequences x {self.seq_len} = {self.num_tokens:,} tokens "
                f"(from token {self.offset:,} of {self.store.path.name})")


def cu_seqlens(doc_start: np.ndarray) -> np.ndarray:
    """Segment offsets (int32 [S + 1]) of a [B, T] doc_start mask, over the flattened B*T tokens."""
    flat = np.flatnonzero(doc_start.reshape(-1))
    return np.append(flat, doc_start.size).astype(np.int32)


def segment_ids(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Segment number of every flattened token (long [total]) from cu_seqlens; handy for masks."""
    ids = torch.zeros(total, dtype=torch.long)
    ids[cu[1:-1].long()] = 1
    return ids.cumsum(0)
