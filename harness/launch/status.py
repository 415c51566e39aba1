"""`harness status RUN_DIR`: each stage's state (complete, running, Slurm state), its progress in tokens, and the
log of anything that failed."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Optional

def stage_rows(run: Path) -> list[dict]:
    """One row per stage (and per layer group of the per-layer stages), read from the run directory, in the order the
    pipeline runs them: SFT (post-training) and its evaluation once SFT has started or `harness run` / `harness
    submit` recorded its settings (stages.sft.enabled)."""
    rows = []
    for stage in ("align_mixer", "align_hidden"):
        groups = sorted((run / stage).glob("layers-*")) if (run / stage).is_dir() else []
        rows += [_progress_row(f"{stage}/{g.name}", g, g / "COMPLETE.json") for g in groups]
    merged = run / "merged" / "MERGE.json"
    rows.append({"stage": "merge", "done": merged.is_file(), "tokens": None})
    rows.append(_progress_row("distill", run / "distill", run / "distill" / "checkpoints" / "COMPLETE.json"))
    if (run / "eval.yaml").is_file():
        rows.append({"stage": "eval", "done": (run / "eval" / "report.json").is_file(), "tokens": None})
    if (run / "sft").is_dir() or (run / "settings" / "sft.json").is_file():  # started, or a run that will start it
        rows.append(_progress_row("sft", run / "sft", run / "sft" / "checkpoints" / "COMPLETE.json"))
    if (run / "eval-sft.yaml").is_file():
        done = (run / "eval-sft" / "report.json").is_file() and (run / "eval-sft" / "comparison").is_dir()
        rows.append({"stage": "eval-sft", "done": done, "tokens": None})
    return rows


def _progress_row(name: str, folder: Path, complete: Path) -> dict:
    tokens = None
    from harness.observe import read_metrics

    rows = read_metrics(folder / "metrics.jsonl")
    if rows:
        tokens = rows[-1].get("tokens")
    return {"stage": name, "done": complete.is_file(), "tokens": tokens}


def slurm_states(run: Path) -> dict[str, list[tuple[str, str, str]]]:
    """stage -> [(job id, state, reason)] for the jobs recorded by `harness submit` (array tasks expanded)."""
    record = run / "slurm" / "jobs.json"
    if not record.is_file():
        return {}
    out: dict[str, list[tuple[str, str, str]]] = {}
    for stage, job_id in json.loads(record.read_text())["jobs"].items():
        out[stage] = _scontrol(job_id)
    return out


def _scontrol(job_id: str) -> list[tuple[str, str, str]]:
    try:
        text = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return [(job_id, "UNKNOWN (no scontrol)", "")]
    found = []
    for block in filter(None, text.split("\n\n")):
        jid = _field(block, "JobId")
        task = _field(block, "ArrayTaskId")
        state, reason = _field(block, "JobState") or "?", _field(block, "Reason") or ""
        found.append((f"{job_id}_{task}" if task else (jid or job_id), state, reason))
    return found or [(job_id, "UNKNOWN (purged or not found)", "")]


def _field(block: str, key: str) -> Optional[str]:
    m = re.search(rf"\b{key}=(\S+)", block)
    return m.group(1) if m else None


def failed_logs(run: Path) -> list[Path]:
    """Logs of stage processes that ended with a Python error (a traceback in the log)."""
    logs = sorted((run / "logs").glob("*.log")) if (run / "logs").is_dir() else []
    return [p for p in logs if "Traceback (most recent call last)" in p.read_text(errors="replace")]


def render(run: Path) -> str:
    lines = [f"# run {run}"]
    for row in stage_rows(run):
        state = "complete" if row["done"] else ("in progress" if row["tokens"] else "not started")
        tokens = f", {row['tokens']:,} tokens" if row["tokens"] else ""
        lines.append(f"  {row['stage']:<28} {state}{tokens}")
    slurm = slurm_states(run)
    if slurm:
        lines.append("# slurm")
        for stage, jobs in slurm.items():
            for job_id, state, reason in jobs:
                why = f" ({reason})" if reason and reason != "None" else ""
                lines.append(f"  {stage:<14} {job_id:<14} {state}{why}")
    failed = failed_logs(run)
    if failed:
        lines.append("# failed (log)")
        lines += [f"  {p}" for p in failed]
    return "\n".join(lines)
