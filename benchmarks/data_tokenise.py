"""Tokenisation throughput of harness.data on this machine, and the loader's cost per micro-batch.

    python benchmarks/data_tokenise.py                       # SmolLM2 tokenizer, whole embedded corpus
    python benchmarks/data_tokenise.py --docs 20000 --num-proc 1 2

For each num_proc it tokenises the embedded Wikipedia subset with `datasets.map` into a fresh token
store (as `prepare_corpus` does, caches off) and prints tokens/s; then it times the packed loader.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer folder; default: the SmolLM2 teacher's.")
    parser.add_argument("--docs", type=int, default=None, help="Tokenise only the first N documents.")
    parser.add_argument("--num-proc", type=int, nargs="+", default=[1, 2], help="datasets.map processes to try.")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()

    import datasets
    from transformers import AutoTokenizer

    from harness.data.embedded import embedded_subset_path
    from harness.data.store import TokenStore
    from harness.data.tokenise import new_writer, resolve_eos, store_meta, tokenise_dataset

    if args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        from harness.teacher import load_teacher

        tokenizer = load_teacher("smollm2-135m-instruct-gguf").tokenizer
    eos = resolve_eos(tokenizer, "<|endoftext|>" if "<|endoftext|>" in tokenizer.get_vocab() else None)
    path = embedded_subset_path("wikipedia")
    datasets.disable_progress_bars()
    store_dir = None
    with tempfile.TemporaryDirectory() as tmp:
        ds = datasets.Dataset.from_json(str(path), cache_dir=tmp)
        if args.docs:
            ds = ds.select(range(min(args.docs, len(ds))))
        chars = sum(len(t) for t in ds["text"])
        print(f"corpus: {len(ds):,} documents, {chars / 1e6:.1f} M characters; cores: {os.cpu_count()}")
        for num_proc in args.num_proc:
            folder = Path(tmp) / f"np{num_proc}"
            folder.mkdir()
            writer = new_writer(folder, tokenizer)
            t0 = time.perf_counter()
            tokenise_dataset(ds, tokenizer, "text", eos[1], writer, work_dir=folder, num_proc=num_proc, desc="bench")
            writer.close(store_meta("bench", {}, tokenizer, eos))
            seconds = time.perf_counter() - t0
            print(f"num_proc={num_proc}: {writer.n_tokens:,} tokens in {seconds:.1f} s = "
                  f"{writer.n_tokens / seconds / 1e3:,.0f} k tokens/s ({chars / seconds / 1e6:.2f} M chars/s)")
            store_dir = folder
        store = TokenStore.open(store_dir)
        time_loader_on(store, args.seq_len, args.micro_batch)


def time_loader_on(store, seq_len: int, micro_batch: int) -> None:
    from harness.data.loader import StageStream, time_loader
    from harness.data.packing import PackedSplit

    split = PackedSplit(store, 0, store.n_tokens // seq_len, seq_len)
    stream = StageStream(split, "distill", 0, split.num_sequences, seed=0, corpus_fingerprint="bench")
    result = time_loader(stream.loader(0, 1, micro_batch, 1), batches=min(500, split.num_sequences // micro_batch - 10))
    print(f"loader: micro-batch {micro_batch} x {seq_len}: {result['ms_per_batch']:.3f} ms per batch "
          f"({result['tokens_per_second'] / 1e6:.1f} M tokens/s, {result['batches']} batches)")


if __name__ == "__main__":
    main()
