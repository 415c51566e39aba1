"""The targets a bench row is checked against (bf16, seq 2048): the 135M gated_deltanet step >= 150k tokens/s on
one H200; the 1.7B step >= 40% MFU (datasheet peak) with peak memory <= 80 GiB at micro-batch 8 x 2048; every
mixer's kernel >= 5x its reference at the 1.7B layout; the student's decoding flat in context (`FLAT_TOLERANCE`).
A step row whose steps did not train meets none. Baselines, results and commands: docs/BENCHMARKS.md.
"""

from __future__ import annotations

from typing import Any

FLAT_TOLERANCE = 1.25  # decoding is "flat in context" when ms/token at 32k is within 25% of that at 1k


def step_targets(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets that apply to a step row (bf16, seq 2048, the named shape / mixer)."""
    out: list[dict[str, Any]] = []
    if row.get("dtype") != "bfloat16" or row.get("seq_len") != 2048 or "tokens_per_s" not in row:
        return out
    if "health" in row:  # a step that did not train: its speed is no evidence
        return [{"target": "the timed steps trained (finite losses, no skipped step)", "value": row["health"],
                 "met": False}]
    if row["shape"] == "135M" and row["mixer"] == "gated_deltanet" and row.get("world") == 1:
        out.append({"target": "135M gated_deltanet >= 150k tokens/s on one H200", "value": row["tokens_per_s"],
                    "met": row["tokens_per_s"] >= 150_000})
    if row["shape"] == "1.7B" and row.get("micro_batch") == 8:
        if row.get("mfu") is not None:
            out.append({"target": "1.7B >= 40% MFU (datasheet peak)", "value": row["mfu"],
                        "met": row["mfu"] >= 0.40})
        if row.get("peak_mem_kind", "").startswith("torch.cuda"):
            out.append({"target": "1.7B peak memory <= 80 GiB at micro-batch 8 x 2048", "value": row["peak_mem_gib"],
                        "met": row["peak_mem_gib"] <= 80})
    return out


def kernel_targets(row: dict[str, Any]) -> list[dict[str, Any]]:
    if row.get("layout") != "1.7B" or "speedup" not in row:
        return []
    return [{"target": "kernel >= 5x reference at the 1.7B layout", "value": row["speedup"],
             "met": row["speedup"] >= 5.0}]


def decode_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    f = result.get("student_flatness")
    if f is None or result.get("shape") == "tiny":
        return []
    return [{"target": f"student ms/token flat in context (longest / shortest <= {FLAT_TOLERANCE})", "value": f,
             "met": f <= FLAT_TOLERANCE}]


def collect_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in results.get("step") or []:
        out += [dict(t, where=f"{r.get('shape')} {r.get('mixer')}") for t in step_targets(r)]
    for r in results.get("kernels") or []:
        out += [dict(t, where=f"{r.get('mixer')} {r.get('layout')}") for t in kernel_targets(r)]
    for d in results.get("decode") or []:
        ctx = [r["context"] for r in d.get("rows") or []]
        where = (f"{d.get('shape')} {d.get('mixer')}, batch {d.get('batch', 1)}"
                 + (f", contexts {ctx[0]}..{ctx[-1]}" if ctx else ""))
        out += [dict(t, where=where) for t in decode_targets(d)]
    return out
