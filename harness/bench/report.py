"""The bench's results as Markdown (environment, step table and breakdown, kernel table, decode table, targets)
and as files: OUT (JSON) and OUT.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from harness.bench.phases import PHASES
from harness.bench.recurrences import to_markdown as recurrence_markdown
from harness.bench.targets import collect_targets
from harness.files import atomic_write_text


def _fmt(v: Any, spec: str = ".3g") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _bytes(n: Optional[int]) -> str:
    if not n:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _recompute_label(row: dict[str, Any]) -> str:
    """'' without recomputation, '+ckpt' for every block, '+ckpt0.25' for a share."""
    if not row.get("gradient_checkpointing"):
        return ""
    fraction = row.get("recompute_fraction", 1.0)
    return "+ckpt" if fraction >= 1.0 else f"+ckpt{fraction:g}"


MFU_LEGEND = ("MFU = tokens/s x (6 N_student + 2 N_teacher) / (world x the GPU's datasheet dense bf16 peak, "
              "e.g. 989 TFLOP/s for an H100 / H200 SXM; or --peak-flops / $HARNESS_PEAK_FLOPS); MFU (measured "
              "peak): the same over the measured 8192^3 bf16 matmul peak (788 TFLOP/s on our H200). "
              "Each row's peaks and their sources are in the JSON.")


def markdown(results: dict[str, Any]) -> str:
    """The results as Markdown: environment, step table + breakdown, kernel table, decode table, targets."""
    meta = results.get("meta", {})
    lines = [f"`{meta.get('command', '')}`", "",
             f"{meta.get('gpu') or meta.get('device')} x {meta.get('world', 1)}; torch {meta.get('torch')}, "
             f"triton {meta.get('triton')}, fla {meta.get('fla')}, deepspeed {meta.get('deepspeed')}, "
             f"transformers {meta.get('transformers')}; {meta.get('date')}", ""]
    steps = results.get("step") or []
    if steps:
        lines += ["### Stage-3 step", "",
                  "| shape | mixer | engine | teacher | batch x seq x world | tokens/s | MFU | MFU (measured peak) | "
                  "peak GiB | step ms | " + " | ".join(PHASES) + " | comm ms (exposed) | GPU busy |",
                  "|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(PHASES) + "---|---|"]
        for r in steps:
            if "error" in r:
                lines.append(f"| {r.get('shape')} | {r.get('mixer')} | error: {r['error'][:100]} |")
                continue
            pct = r["breakdown_pct"]
            ms = r["breakdown_ms"]
            phases = " | ".join(f"{ms.get(p, 0):.1f} ({pct.get(p, 0):.0f}%)" for p in PHASES)
            comm = r.get("comm", {})
            comm_s = "-" if "comm_ms" not in comm else (
                f"{comm['comm_ms']:.1f}" + (f" ({comm['exposed_ms']:.1f})" if "exposed_ms" in comm else ""))
            m = " | ".join("-" if r.get(k) is None else f"{100 * r[k]:.1f}%" for k in ("mfu", "mfu_measured_peak"))
            engine = r["engine"] + _recompute_label(r)
            busy = "-" if r.get("gpu_busy") is None else f"{100 * r['gpu_busy']:.0f}%"
            lines.append(f"| {r['shape']} | {r['mixer']} | {engine} | {r.get('teacher_placement', '-')} | "
                         f"{r['micro_batch']} x {r['seq_len']} x "
                         f"{r['world']} | {r['tokens_per_s']:,.0f} | {m} | {r['peak_mem_gib']:.1f} | "
                         f"{r['step_ms']:.1f} | {phases} | {comm_s} | {busy} |")
        lines += ["", MFU_LEGEND, ""]
        lines += [f"**{r['shape']} {r['mixer']}: no MFU: {r['peak_flops_source']}**" for r in steps
                  if "error" not in r and r.get("mfu") is None and str(r.get("device", "")).startswith("cuda")]
        lines += [f"**{r['shape']} {r['mixer']}: {r['health']}** (losses per step: {r['losses_each']})" for r in steps
                  if "health" in r] + [""]
    kernels = results.get("kernels") or []
    if kernels:
        lines += ["### Kernels vs PyTorch reference (forward + backward)", "", kernel_table(kernels), ""]
    recurrences = results.get("recurrences")
    if recurrences:
        table = recurrence_markdown(recurrences).replace("# Kernel vs reference", "### Recurrences: every fla route vs "
                                                         "the float32 reference", 1)
        lines += [table, ""]
    decodes = results.get("decode") or []
    if decodes:
        lines += decode_table(decodes) + [""]
    targets = results.get("targets") or []
    if targets:
        lines += ["### Targets", "", "| target | value | met |", "|---|---|---|"]
        lines += [f"| {t['target']} ({t.get('where', '')}) | {_fmt(t['value'], '.4g')} | "
                  f"{'yes' if t['met'] else 'NO'} |" for t in targets]
        lines.append("")
    return "\n".join(lines)


def decode_table(decodes: list[dict[str, Any]]) -> list[str]:
    """The decode bench's Markdown lines: per shape, mixer, batch and context, ms per step (one token per row) and
    tokens/s (batch / time per step), the student graphed and eager, the teacher, and their state sizes."""
    lines = ["### Decoding (ms per step of one token per row; tokens/s = batch x steps / s)", "",
             "| shape | mixer | batch | context | student ms/step | student eager | teacher ms/step | "
             "student tokens/s | teacher tokens/s | teacher / student | student state | teacher KV cache |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in decodes:
        head = f"| {d.get('shape')} | {d.get('mixer')} | {d.get('batch', 1)} |"
        if "error" in d:
            lines.append(f"{head} error: {d['error'][:100]} |")
            continue
        for r in d["rows"]:
            s, e, t = r.get("student", {}), r.get("student_eager", {}), r.get("teacher", {})
            graph = " (graph)" if s.get("cuda_graph") else ""
            lines.append(f"{head} {r['context']} | {_fmt(s.get('ms_per_token'), '.2f')}{graph} | "
                         f"{_fmt(e.get('ms_per_token'), '.2f')} | {_fmt(t.get('ms_per_token'), '.2f')} | "
                         f"{_fmt(s.get('tokens_per_s'), '.0f')} | {_fmt(t.get('tokens_per_s'), '.0f')} | "
                         f"{_fmt(r.get('speedup'), '.2f')} | {_bytes(s.get('state_bytes'))}{_kv_note(s)} | "
                         f"{_bytes(t.get('state_bytes'))} |")
        lines.append(f"{head} flatness (longest / shortest) | {_fmt(d.get('student_flatness'), '.2f')} | "
                     f"{_fmt(d.get('student_eager_flatness'), '.2f')} | {_fmt(d.get('teacher_flatness'), '.2f')} "
                     "||||||")
    return lines


def _kv_note(student: dict[str, Any]) -> str:
    """' (KV x, y per token)' for a hybrid student's row (its kept attention layers' keys and values), else ''."""
    if student.get("kv_bytes") is None:
        return ""
    return f" (KV {_bytes(student['kv_bytes'])}, {_fmt(student.get('kv_bytes_per_token'), '.0f')} B per token)"


def kernel_table(rows: list[dict[str, Any]]) -> str:
    """The layer report's Markdown table (errors, bf16 floor, times, speedup; the recurrence alone; GPU busy)."""
    lines = ["| mixer | layout | out err | dx err | max param-grad err (param) | bf16-reference out / dx err | "
             "kernel ms | reference ms | speedup | recurrence kernel / reference ms | recurrence speedup | "
             "GPU busy |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mixer']} | {r['layout']} | error: {r['error'][:80]} |||||||||||")
            continue
        busy = (r.get("kernel_profile") or {}).get("gpu_busy")
        lines.append(f"| {r['mixer']} | {r['layout']} | {r['out_rel_err']:.2e} | {r['dx_rel_err']:.2e} | "
                     f"{r['max_param_grad_rel_err']:.2e} ({r['worst_param']}) | "
                     f"{r['ref_bf16_out_rel_err']:.1e} / {r['ref_bf16_dx_rel_err']:.1e} | {r['kernel_ms']:.2f} | "
                     f"{r['reference_bf16_ms']:.2f} | {r['speedup']:.1f}x | {r['recurrence_kernel_ms']:.2f} / "
                     f"{r['recurrence_reference_ms']:.2f} | {r['recurrence_speedup']:.1f}x | "
                     f"{'-' if busy is None else f'{busy:.0%}'} |")
    return "\n".join(lines)


def write_results(results: dict[str, Any], out: Path | str) -> tuple[Path, Path]:
    """results -> OUT (JSON, written atomically) and OUT with suffix .md (the Markdown tables)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results["targets"] = collect_targets(results)
    atomic_write_text(out, json.dumps(results, indent=1, default=str))
    md = out.with_suffix(".md")
    md.write_text(markdown(results) + "\n")
    return out, md
