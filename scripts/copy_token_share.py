"""The share of stage-3 targets that harness.losses.token_weights.repeated_ngrams flags as copy tokens (the tokens
`stages.distill.copy_weight` weights), in embedded:wikipedia rows as the pipeline prepares them: the copyweight4
job's data settings (teacher tokenizer, eos token, seed, budget) with data.source=embedded:wikipedia, at 2048 tokens
for n = 2, 3, 4 and at 256 tokens for n = 2. Measured on the first --rows rows stage 3 trains on (its stream
positions 0, 1, ...), and for comparison on every row of the training split. Run from the repository root:

    .venv/bin/python scripts/copy_token_share.py        # ~10 s on 2 CPU cores once the corpus is tokenised

A target is a row position t >= 1 (position 0 is no one's target: labels are shifted inside the loss); the share
is the flagged targets over all targets. data.allow_repeat is turned on: the job's 50M tokens pass over the 8.8M of
embedded:wikipedia several times (it only lets the budget check pass; rows and their order are as without it). If
the embedded corpus is not built yet, `harness data prepare JOB --embedded-only` builds it. The result, with how it
was measured, goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.config import load_job
from harness.data import prepare_job_corpus
from harness.losses.token_weights import repeated_ngrams
from harness.teacher import load_tokenizer, teacher_config

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "jobs" / "retrieval-135m" / "smollm2-135m-gated_deltanet-50m-copyweight4.yaml"
SOURCE = "embedded:wikipedia"
CASES = ((2048, 2), (2048, 3), (2048, 4), (256, 2))  # (row length in tokens, n)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", type=Path, default=JOB, help="the job whose data settings prepare the rows")
    p.add_argument("--rows", type=int, default=256, help="training sequences measured, from the first")
    p.add_argument("--out", type=Path,
                   default=ROOT / "docs" / "results" / "retrieval-135m" / "copy_token_share.json")
    return p.parse_args(argv)


def job_corpus(job_path: Path, seq_len: int) -> tuple[Any, Any]:
    """(job, corpus) of the job at `seq_len` tokens a row, data.source=SOURCE, repeats allowed."""
    job = load_job(str(job_path), [f"data.source={SOURCE}", f"data.seq_len={seq_len}", "data.allow_repeat=true"])
    tokenizer = load_tokenizer(job.teacher.source)
    max_positions = teacher_config(job.teacher.source).max_position_embeddings
    return job, prepare_job_corpus(job, tokenizer, max_positions=max_positions)


def stage3_rows(job: Any, corpus: Any, rows: int) -> torch.Tensor:
    """input_ids [rows, seq_len]: the first `rows` rows of stage 3's stream, in the order it trains on them."""
    stream = corpus.stage_stream("distill", job)
    if stream.length < rows:
        raise SystemExit(f"--rows {rows}: stage 3 reads only {stream.length} rows")
    return stream.batch(stream.start + np.arange(rows))["input_ids"]


def copy_share(ids: torch.Tensor, n: int) -> dict:
    """Flagged targets (positions t >= 1) of `repeated_ngrams(ids, n)`, their count and their share."""
    flagged = int(repeated_ngrams(ids, n)[:, 1:].sum())
    targets = ids.shape[0] * (ids.shape[1] - 1)
    return {"flagged": flagged, "targets": targets, "share": round(flagged / targets, 4)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.time()
    results = []
    for seq_len in sorted({length for length, _ in CASES}, reverse=True):
        job, corpus = job_corpus(args.job, seq_len)
        first = stage3_rows(job, corpus, args.rows)
        split = torch.from_numpy(corpus.train.tokens(np.arange(corpus.train.num_sequences)))
        for n in (n for length, n in CASES if length == seq_len):
            results.append({"seq_len": seq_len, "n": n, "stage3_first_rows": copy_share(first, n),
                            "training_split": copy_share(split, n)})
            print(f"{seq_len} tokens, n = {n}: {100 * results[-1]['stage3_first_rows']['share']:.1f}% of the targets "
                  f"of stage 3's first {args.rows} rows are copy tokens "
                  f"({100 * results[-1]['training_split']['share']:.1f}% over the {len(split):,} training rows)")
    measured = {
        "what": "share of the targets (row positions t >= 1) flagged by harness.losses.token_weights."
                "repeated_ngrams: the n-gram ending at the target occurred earlier in the same row",
        "job": str(args.job.resolve().relative_to(ROOT)) if args.job.resolve().is_relative_to(ROOT) else str(args.job),
        "overrides": [f"data.source={SOURCE}", "data.seq_len=<seq_len>", "data.allow_repeat=true"],
        "rows": f"stage3_first_rows: stage 3's stream positions 0..{args.rows - 1} (what it trains on first); "
                "training_split: every row of the training split",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "measured_at": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "seconds": round(time.time() - start, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**measured, "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
