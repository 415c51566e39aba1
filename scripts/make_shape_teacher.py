"""Write a random-weight teacher of a SmolLM2 shape (135M / 360M / 1.7B, as `harness bench --shape`) as a Hugging
Face folder, with the tokenizer of a real teacher: what `harness run` needs to time the per-layer stages and stage
3 at a size whose weights are not available offline (issue 9: the 1.7B pipeline on several GPUs). The numbers
such a teacher gives are about time and memory, not quality.

    python scripts/make_shape_teacher.py --shape 1.7B --out /tmp/teacher-1.7b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from harness.bench.shapes import build_teacher  # noqa: E402
from harness.teacher import load_tokenizer  # noqa: E402


def make_shape_teacher(shape: str, tokenizer_source: str, out: Path, dtype: torch.dtype = torch.bfloat16,
                       seed: int = 0) -> Path:
    """Random weights of `shape` (seeded) in `dtype` and `tokenizer_source`'s tokenizer, saved under `out`."""
    src = Path(tokenizer_source)
    if src.is_dir() and not (src / "config.json").is_file():  # a tokenizer folder alone (save_pretrained)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(src)
    else:
        tokenizer = load_tokenizer(tokenizer_source)
    model = build_teacher(shape, device="cpu", dtype=dtype, seed=seed)
    if len(tokenizer) > model.config.vocab_size:
        raise SystemExit(f"the tokenizer of {tokenizer_source} has {len(tokenizer)} tokens, more than the "
                         f"{model.config.vocab_size} rows of the {shape} shape's embedding")
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.bos_token_id = tokenizer.bos_token_id
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, help="135M, 360M, 1.7B (or tiny).")
    p.add_argument("--tokenizer", default="smollm2-135m-instruct-gguf",
                   help="Teacher source whose tokenizer to copy, or a folder holding a saved tokenizer alone. Default: "
                   "the SmolLM2-135M-Instruct GGUF of the quickstart, whose 49,152-token vocabulary all SmolLM2 sizes "
                   "share.")
    p.add_argument("--out", required=True, type=Path, help="Folder to write.")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = make_shape_teacher(args.shape, args.tokenizer, args.out, seed=args.seed)
    print(f"wrote a random {args.shape} teacher with {args.tokenizer}'s tokenizer to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
