"""Mixer layers on the GPU: kernel path vs PyTorch reference, errors and forward+backward times.

For every mixer and each teacher head layout (SmolLM2-135M: hidden 576, 9 heads; SmolLM2-1.7B: hidden
2048, 32 heads; head_dim 64; 360M also available), one bf16 layer is run with backend=kernel and its fp32 copy
with backend=reference on the same input. Reported: relative errors ||a-b||/||b|| of the output and of all
parameter gradients, and the median forward+backward time of each path at batch x seq_len.

The measurement itself lives in harness.bench.kernels (`compare_layer`, `bench_kernels`), which `harness bench --what
kernels` runs too; this script keeps its own output files (layer_report.json, layer_report.md).

    python scripts/gpu_layer_report.py --out OUT_DIR [--batch 4 --seq 2048 --mixers gla,kda]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.mixers import MIXERS  # noqa: E402
from harness.bench.kernels import bench_kernels  # noqa: E402
from harness.bench.machine import environment  # noqa: E402
from harness.bench.report import kernel_table  # noqa: E402

DEFAULT_LAYOUTS = ("135M", "1.7B")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--mixers", default=",".join(MIXERS))
    ap.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS), help="135M, 360M, 1.7B (comma list)")
    ap.add_argument("--variants", default="", help="extra rows NAME@CASE=ROUTE run with HARNESS_FLA_ROUTES set")
    ap.add_argument("--max-seconds", type=float, default=1e9, help="start no new row after this long")
    args = ap.parse_args()
    began = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    meta = {"gpu": env["gpu"], "torch": env["torch"], "python": env["python"], "command": " ".join(sys.argv)}
    meta.update({k: env[k] for k in ("triton", "fla", "mlstm_kernels", "transformers")})
    rows: list[dict] = []

    def on_row(row: dict) -> None:
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        (out / "layer_report.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    bench_kernels(args.layouts.split(","), args.mixers.split(","), batch=args.batch, seq=args.seq,
                  variants=list(filter(None, args.variants.split(","))),
                  max_seconds=args.max_seconds - (time.time() - began), on_row=on_row)
    (out / "layer_report.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = kernel_table(rows)
    (out / "layer_report.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
