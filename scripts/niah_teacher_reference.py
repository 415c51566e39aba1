"""NIAH reference numbers of the SmolLM2-135M-Instruct teacher (the packaged GGUF, fp32, CPU), the baseline a
linearised student is compared with. Run from the repository root:

    .venv/bin/python scripts/niah_teacher_reference.py            # the grid below, ~10 min on 2 CPU cores
    .venv/bin/python scripts/niah_teacher_reference.py --lengths 256,512 --samples 1   # a quick look

Samples go to --work-dir (niah_cells.jsonl, so an interrupted run resumes; niah.csv, niah_heatmap.png);
the summary, with how it was measured, to --out (docs/results/niah_teacher_smollm2_135m.json by default).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from harness.eval.niah import KINDS, NiahGrid, run_niah
from harness.teacher import SMOLLM2_ALIAS, load_teacher

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="256,512,1024,2048", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1], comma-separated")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"needle kinds, comma-separated, from {KINDS}")
    p.add_argument("--samples", type=int, default=2, help="samples per (kind, length, depth) cell")
    p.add_argument("--haystack", default="essays", help="essays, wikipedia, or a .jsonl/.txt path")
    p.add_argument("--prompt", default="auto", help="plain, chat or auto (the reference numbers: auto, i.e. chat)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "niah" / "teacher-smollm2-135m")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "niah_teacher_smollm2_135m.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    grid = NiahGrid(lengths=[int(x) for x in args.lengths.split(",")],
                    depths=[float(x) for x in args.depths.split(",")],
                    kinds=args.kinds.split(","), samples=args.samples, haystack=args.haystack,
                    prompt=args.prompt)
    teacher = load_teacher(SMOLLM2_ALIAS)
    start = time.time()
    result = run_niah(teacher.model, teacher.tokenizer, grid, args.work_dir, label="SmolLM2-135M-Instruct (teacher)")
    measured = {
        "what": "NIAH accuracy of the SmolLM2-135M-Instruct teacher (Q4_1 GGUF dequantised to fp32), greedy, "
                "batch 1; harness.eval.niah defines prompts, needles and scoring",
        "teacher": SMOLLM2_ALIAS,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "measured_at": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "torch_threads": torch.get_num_threads()},
        "seconds_this_run": round(time.time() - start, 1),  # excludes samples resumed from the work dir
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({**measured, **result}, indent=2) + "\n")
    print(f"overall {result['overall']:.3f}; by length {result['by_length']}; by kind {result['by_kind']}")
    print(f"wrote {args.out} (samples and heatmap in {args.work_dir})")


if __name__ == "__main__":
    main()
