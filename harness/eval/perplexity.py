"""Perplexity of a causal LM on token sequences, a text file, or a job's held-out validation slice.

Convention: each sequence is cut into windows of at most `seq_len` tokens that overlap by one token, every
window starting from a fresh state (no context carried across windows). A window of n tokens predicts its
last n - 1 tokens from the ones before them, so every token of a sequence except its first is predicted
exactly once. perplexity = exp(mean negative log-likelihood per predicted token), in nats.

For a job's held-out slice the sequences are the validation rows of the corpus (the first
data.validation_tokens of data.source, or data.validation_source; see harness.data.corpus), each exactly
data.seq_len tokens and thus one window: the same tokens and targets as stage 3's `val_ppl`. When the rows
are the head of data.source, the training split starts at the first document boundary after them, so no
held-out document is trained on.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


class PerplexityError(ValueError):
    """Input that perplexity cannot be computed on (too short, a bad seq_len, no held-out split)."""


def perplexity(model: Any, token_ids: torch.Tensor | Iterable[Any], *, seq_len: int, device: str = "cpu",
               batch_size: int = 1, progress: bool = True) -> dict:
    """Mean next-token NLL and perplexity of `model` over `token_ids`.

    token_ids: a 1-D LongTensor (one sequence), a 2-D one (one sequence per row), or an iterable of 1-D
    sequences (tensors, arrays or lists; e.g. documents). Windows of equal length are batched
    `batch_size` at a time (no padding). Returns {"tokens": predicted tokens, "nll": mean nats/token,
    "ppl": exp(nll), "sequences", "windows", "seq_len"}.
    """
    if seq_len < 2:
        raise PerplexityError(f"seq_len={seq_len} must be at least 2 (a token and its successor).")
    if batch_size < 1:
        raise PerplexityError(f"batch_size={batch_size} must be a positive integer.")
    sequences = [s for s in _sequences(token_ids) if s.numel() >= 2]
    windows = [w for s in sequences for w in windows_of(s, seq_len)]
    if not windows:
        raise PerplexityError("No sequence of at least 2 tokens to score.")
    total = sum(w.numel() - 1 for w in windows)
    model = model.to(device).eval()
    nll = 0.0
    with torch.no_grad(), tqdm(total=total, unit="tok", desc="perplexity", disable=not progress) as bar:
        for batch in _batches(windows, batch_size):
            nll += window_nll(model, batch.to(device))
            bar.update(batch.numel() - batch.shape[0])
    mean = nll / total
    return {"tokens": total, "nll": mean, "ppl": math.exp(mean), "sequences": len(sequences),
            "windows": len(windows), "seq_len": seq_len}


def window_nll(model: Any, ids: torch.Tensor) -> float:
    """Summed NLL (nats, float64) of ids[:, 1:] given the tokens before them; ids: long [B, n]."""
    logits = model(input_ids=ids).logits[:, :-1]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1), reduction="sum")
    return float(loss.double())


def windows_of(sequence: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """Windows of at most seq_len tokens overlapping by one: each token after the first is predicted once."""
    step = seq_len - 1
    return [sequence[start:start + seq_len] for start in range(0, sequence.numel() - 1, step)]


def _sequences(token_ids: torch.Tensor | Iterable[Any]) -> Iterator[torch.Tensor]:
    if isinstance(token_ids, (torch.Tensor, np.ndarray)):
        ids = torch.as_tensor(token_ids)
        if ids.dim() == 1:
            yield ids.long()
            return
        if ids.dim() != 2:
            raise PerplexityError(f"token_ids must be 1-D or 2-D, got shape {tuple(ids.shape)}.")
        yield from ids.long()
        return
    for seq in token_ids:
        seq = torch.as_tensor(seq)
        if seq.dim() != 1:
            raise PerplexityError(f"Each sequence must be 1-D, got shape {tuple(seq.shape)}.")
        yield seq.long()


def _batches(windows: list[torch.Tensor], batch_size: int) -> Iterator[torch.Tensor]:
    """Stacks of up to batch_size consecutive windows of equal length."""
    group: list[torch.Tensor] = []
    for w in windows:
        if group and (len(group) == batch_size or w.numel() != group[0].numel()):
            yield torch.stack(group)
            group = []
        group.append(w)
    if group:
        yield torch.stack(group)


# ------------------------------------------------------------------------------------------ sources


def perplexity_of_text_file(model: Any, tokenizer: Any, path: str | os.PathLike[str], *, seq_len: int,
                            max_tokens: int | None = None, text_field: str = "text", batch_size: int = 1,
                            device: str = "cpu", progress: bool = True) -> dict:
    """Perplexity on a text file: .jsonl (one document per line, its `text_field`) or any other file as one
    plain-text document. max_tokens keeps the first tokens only. Adds "source" to perplexity()'s dict."""
    path = Path(path)
    if not path.is_file():
        raise PerplexityError(f"Text file '{path}' does not exist.")
    texts = _read_texts(path, text_field)
    sequences = _truncate([_encode(tokenizer, t) for t in texts], max_tokens)
    result = perplexity(model, sequences, seq_len=seq_len, device=device, batch_size=batch_size, progress=progress)
    return {**result, "source": str(path)}


def _read_texts(path: Path, text_field: str) -> list[str]:
    if path.suffix != ".jsonl":
        return [path.read_text(encoding="utf-8")]
    texts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                record = json.loads(line)
                if text_field not in record:
                    raise PerplexityError(f"{path}:{number} has no field '{text_field}' (fields: {sorted(record)}).")
                texts.append(record[text_field])
    return texts


def _encode(tokenizer: Any, text: str) -> torch.Tensor:
    """Token ids of `text` with the tokenizer's usual special tokens (a BOS where the model expects one)."""
    return torch.tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.long)


def _truncate(sequences: list[torch.Tensor], max_tokens: int | None) -> list[torch.Tensor]:
    """The sequences cut to max_tokens tokens in all (None: all)."""
    if max_tokens is None:
        return sequences
    if max_tokens < 2:
        raise PerplexityError(f"max_tokens={max_tokens} must be at least 2 (or None for all).")
    kept, left = [], max_tokens
    for seq in sequences:
        if left <= 0:
            break
        kept.append(seq[:left])
        left -= kept[-1].numel()
    return kept


def perplexity_of_job_heldout(model: Any, job: Any, *, max_tokens: int | None = None, tokenizer: Any = None,
                              batch_size: int = 1, device: str = "cpu", progress: bool = True,
                              cache_dir: str | os.PathLike[str] | None = None) -> dict:
    """Perplexity on `job`'s held-out validation rows (see the module docstring), at job.data.seq_len.

    max_tokens: score only the first max(1, max_tokens // seq_len) rows. tokenizer: the teacher's (loaded
    from job.teacher.source when None). cache_dir overrides data.cache_dir. Adds "source" and "split".
    """
    from harness.data import prepare_job_corpus

    if tokenizer is None:
        from harness.teacher import load_tokenizer

        tokenizer = load_tokenizer(job.teacher.source)
    corpus = prepare_job_corpus(job, tokenizer, cache_dir=cache_dir, check=False)
    split = corpus.validation
    if split is None:
        raise PerplexityError("The job holds out no validation text (data.validation_tokens=0); set "
                              "data.validation_tokens or data.validation_source, or use a text file.")
    rows = split.num_sequences if max_tokens is None else min(split.num_sequences, max(1, max_tokens // split.seq_len))
    ids = torch.from_numpy(split.tokens(np.arange(rows)))
    result = perplexity(model, ids, seq_len=split.seq_len, device=device, batch_size=batch_size, progress=progress)
    from harness.data.mix import validation_source_label

    return {**result, "source": validation_source_label(job.data), "split": split.describe()}
