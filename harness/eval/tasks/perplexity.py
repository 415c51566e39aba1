"""Held-out perplexity as an evaluation task (harness.eval.perplexity does the work).

Settings: the spec's `perplexity_tokens` (0 skips) and `job` (the run's resolved job.yaml, whose data section
gives the held-out slice; null skips). Results: perplexity.json per model, recomputed only when its settings
(recorded in it) change. The report compares the ratio student / teacher (1.0 = as good as the teacher); the
paired differences give a plain difference (no per-document values are stored), and none between runs held out
in windows of different lengths.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from harness.eval.formatting import PERPLEXITY_FILE, fmt, heldout_comparison, read_json
from harness.eval.recovery import paired_row
from harness.eval.tasks.base import Column, Curve, EvalTask, Score, SideColumn, TaskResults
from harness.files import atomic_write_text


class PerplexityTask(EvalTask):
    name = "perplexity"
    title = "Perplexity (held-out text)"
    spec_keys = ("perplexity_tokens", "job")
    run_order = 10

    def settings_of(self, spec: Any) -> Optional[dict]:
        return perplexity_settings(spec)

    def wanted(self, spec: Any) -> bool:
        return perplexity_settings(spec) is not None

    def cache_key(self, spec: Any) -> dict:
        return {"perplexity": perplexity_settings(spec)}  # the only part of the key that depends on the data

    def for_during(self, spec: Any, during: Any) -> None:
        spec.perplexity_tokens = during.perplexity_tokens

    def run(self, model: Any, tokenizer: Any, settings: dict, out_dir: Path, *, label: str, device: Any,
            progress: bool, spec: Any) -> dict:
        import torch

        with torch.inference_mode():
            return held_out_perplexity(model, tokenizer, spec, out_dir, device=device, progress=progress)

    def summarise(self, folder: Path) -> Optional[TaskResults]:
        result = read_json(Path(folder) / PERPLEXITY_FILE)
        if result is None:
            return None
        return TaskResults([Score("perplexity", result.get("ppl"), result.get("tokens"), higher_is_better=False,
                                  unit="value")], {}, {"settings": result.get("settings")})

    def report_fields(self, student_dir: Path, teacher_dir: Optional[Path]) -> dict:
        get = lambda d: read_json(d / PERPLEXITY_FILE) if d is not None else None  # noqa: E731
        return {"perplexity": perplexity_summary(get(student_dir), get(teacher_dir))}

    def markdown(self, report: dict) -> list[str]:
        ppl = report.get("perplexity")
        if not ppl:
            return []
        return ["## Perplexity (held-out text)", "",
                f"student {fmt(ppl['student'])}, teacher {fmt(ppl['teacher'])}, ratio {fmt(ppl['ratio'])} "
                f"over {ppl['tokens']} tokens of {ppl['source']}", ""]

    def comparison_columns(self) -> list[Column]:
        return [("ppl ratio", lambda r: fmt((r.get("perplexity") or {}).get("ratio")))]

    def comparison_legend(self) -> str:
        return "ppl ratio: student / teacher perplexity"

    def score_columns(self) -> list[SideColumn]:
        return [("perplexity", lambda r, side: fmt((r.get("perplexity") or {}).get(side)))]

    def score_note(self) -> str:
        return "perplexity on the held-out text"

    def paired_rows(self, a: Any, b: Any, samples: int, seed: int) -> list[dict]:
        """Held-out perplexity B - A: a plain difference, none at all between windows of different lengths."""
        ppl = lambda run: (run.report.get("perplexity") or {}).get("student")  # noqa: E731
        if ppl(a) is None and ppl(b) is None:
            return []
        apart, note = heldout_comparison(a.report, a.student_dir, b.report, b.student_dir)
        row = {"metric": "held-out perplexity", "unit": "value",
               **paired_row(ppl(a), ppl(b), None, (a.report.get("perplexity") or {}).get("tokens"), note)}
        return [{**row, "diff": None} if apart else row]

    def curves(self) -> dict[str, Curve]:
        side = lambda r, s: (r.get("perplexity") or {}).get(s)  # noqa: E731
        return {"perplexity": Curve(lambda r: side(r, "student"), "held-out perplexity", False,
                                    lambda r: side(r, "teacher"), log_scale=True),
                "perplexity_ratio": Curve(lambda r: side(r, "ratio"), "perplexity ratio (student / teacher)", False,
                                          lambda r: 1.0)}

    def default_curves(self) -> tuple[str, ...]:
        return ("perplexity",)


def perplexity_settings(spec: Any) -> Optional[dict]:
    """What the held-out perplexity depends on: the job's data section and the token count (None: skipped)."""
    if spec.job is None or spec.perplexity_tokens == 0:
        return None
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(spec.job).get("data", {}), resolve=False)
    if not data.get("mix", True):
        del data["mix"]  # no mixture: the key of the runs made before data.mix existed, whose caches stay valid
    return {"data": data, "tokens": spec.perplexity_tokens}


def held_out_perplexity(model: Any, tokenizer: Any, spec: Any, out: Path, *, device: Any,
                        progress: bool = True) -> dict:
    """Perplexity on the run's held-out slice, reused from out/perplexity.json when its settings match."""
    from harness.config import load_job
    from harness.eval.perplexity import perplexity_of_job_heldout

    path = Path(out) / PERPLEXITY_FILE
    settings = perplexity_settings(spec)
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("settings") == settings:
            return saved
    job = load_job(spec.job)
    result = perplexity_of_job_heldout(model, job, max_tokens=spec.perplexity_tokens, tokenizer=tokenizer,
                                       device=str(device), progress=progress)
    result = {**result, "settings": settings}
    atomic_write_text(path, json.dumps(result, indent=1, default=str))
    return result


def perplexity_summary(student: Optional[dict], teacher: Optional[dict]) -> Optional[dict]:
    """Both sides' perplexity, the ratio student / teacher, and what it was over (tokens, text, window)."""
    if student is None and teacher is None:
        return None
    s, t = (student or {}).get("ppl"), (teacher or {}).get("ppl")
    either = student or teacher
    return {"student": s, "teacher": t, "ratio": s / t if s and t else None,
            "tokens": either.get("tokens"), "source": either.get("source"), "seq_len": either.get("seq_len")}

