"""The copy probe as an evaluation task (harness.eval.copy does the work): teacher-forced greedy copy accuracy on
random token sequences shown twice, per length, and each layer's induction and previous-token scores, for student
and teacher.

Settings: the spec's section `copy:`, from the job's eval.copy (harness.config.CopyConfig; by default with the
induction scores on, for the lengths up to 512; null: off). Results: copy.json and copy_sequences.jsonl per model
(resumable). Scores: copy accuracy after the first token of the copy, over all lengths and per length, each sequence
an example (paired between runs that drew the same sequences); drawn along stage 3 as `copy`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from harness.config import CopyConfig, default_copy_settings
from harness.eval.tasks.base import Score, ScoredTask, TaskResults

ALL = "after first"  # the score over every length's sequences


class CopyTask(ScoredTask):
    name, title = "copy", "In-context copy (random tokens shown twice)"
    run_order = 25
    curve_scores = {ALL: True}

    settings = CopyConfig

    def default_settings(self) -> Any:
        return default_copy_settings()

    def for_during(self, spec: Any, during: Any) -> None:
        """Along stage 3: the shorter lengths, no induction scores (cheap next to training)."""
        settings = self.settings_of(spec)
        if settings is not None:
            settings.lengths = [n for n in settings.lengths if n <= 256] or settings.lengths[:1]
            settings.induction = False

    def run(self, model: Any, tokenizer: Any, settings: Any, out_dir: Path, *, label: str, device: Any,
            progress: bool, spec: Any) -> Optional[dict]:
        """evaluate_copy on the lengths whose rows the model's vocabulary can draw without repeats (a small test
        vocabulary cannot hold 2048 distinct ids): the others are left out with a warning, as is the task if none
        fits."""
        import dataclasses
        import warnings

        from harness.eval.copy import evaluate_copy, token_range, vocabulary_size

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # evaluate_copy warns about a small vocabulary itself
            usable = token_range(settings, vocabulary_size(model, tokenizer),
                                 list(getattr(tokenizer, "all_special_ids", []) or [])).size - settings.gap
        lengths = [n for n in settings.lengths if n <= usable]
        if lengths != list(settings.lengths):
            warnings.warn(f"copy probe: lengths {[n for n in settings.lengths if n > usable]} need more distinct ids "
                          f"than the vocabulary's {usable + settings.gap} usable ones; left out", stacklevel=2)
        if not lengths:
            return None
        settings = dataclasses.replace(settings, lengths=lengths)
        return evaluate_copy(model, tokenizer, settings, out_dir, device=device, label=label, progress=progress)

    def report_fields(self, student_dir: Path, teacher_dir: Optional[Path]) -> dict:
        """The scores (ScoredTask), and beside each side's the per-layer scores of its copy.json (`layers`)."""
        fields = super().report_fields(student_dir, teacher_dir)
        for side, folder in (("student", student_dir), ("teacher", teacher_dir)):
            entry = fields.get(self.name, {}).get(side)
            layers = layer_scores(folder) if folder is not None else None
            if entry is not None and layers:
                entry["layers"] = layers
        return fields

    def markdown(self, report: dict) -> list[str]:
        section = self._section(report)
        rows = [(side, section.get(side)) for side in ("student", "teacher")]
        return super().markdown(report) + layer_tables([(name, s) for name, s in rows if s])

    def comparison_sections(self, reports: list[dict]) -> list[str]:
        return super().comparison_sections(reports) + layer_tables(self.comparison_rows(reports))

    def summarise(self, folder: Path) -> Optional[TaskResults]:
        """copy.json's accuracy after the first token, over all lengths and per length, with each sequence's value."""
        from harness.eval.copy import JSON_FILE, SEQUENCES_FILE
        from harness.eval.formatting import read_json

        result, lines = read_json(Path(folder) / JSON_FILE), Path(folder) / SEQUENCES_FILE
        if result is None or not lines.is_file():
            return None
        records = [json.loads(line) for line in lines.read_text().splitlines()[1:] if line.strip()]
        after = {f"{r['length']}/{r['index']}": r["hits"][1:].count("1") / (len(r["hits"]) - 1)
                 for r in records if str(r["length"]) in result["lengths"]}
        if not after:
            return None
        lengths = result["lengths"]
        chance = next(iter(lengths.values()))["chance"]
        scores = [Score(ALL, sum(after.values()) / len(after), len(after), chance=chance)]
        examples = {ALL: after}
        for length, entry in lengths.items():
            name = f"after first, {length} tokens"
            ci = entry.get("copy_acc_after_first_ci")
            scores.append(Score(name, entry["copy_acc_after_first"], entry["n"], tuple(ci) if ci else None,
                                entry["chance"]))
            examples[name] = {k: v for k, v in after.items() if k.split("/")[0] == length}
        settings = result["settings"]
        return TaskResults(scores, examples, {k: settings.get(k) for k in ("seed", "gap", "token_low", "token_high",
                                                                          "prefix", "sequences")})


SCORES_BY_LAYER = (("induction", "induction score"), ("previous_token", "previous-token score"))


def layer_scores(folder: Path) -> Optional[dict]:
    """Per length of copy.json's `induction` section, each score's largest head per layer and its chance:
    {length: {"induction": {"chance": c, "max": [...]}, "previous_token": {...}}}; None without the section."""
    from harness.eval.copy import JSON_FILE
    from harness.eval.formatting import read_json

    result = read_json(Path(folder) / JSON_FILE)
    if not result or not result.get("induction"):
        return None
    out = {}
    for length, entry in result["induction"].items():
        out[length] = {"induction": {"chance": entry["chance"], "max": [x["max"] for x in entry["layers"]]}}
        prev = entry.get("previous_token")
        if prev:
            out[length]["previous_token"] = {"chance": prev["chance"], "max": [x["max"] for x in prev["layers"]]}
    return out


def layer_tables(rows: list[tuple[str, dict]]) -> list[str]:
    """Markdown: for the shortest length every row scored per layer, one table per score (a row per model, a column
    per layer: the largest head's score); nothing when no row has per-layer scores."""
    rows = [(name, side["layers"]) for name, side in rows if side.get("layers")]
    if not rows:
        return []
    length = min({int(k) for _, layers in rows for k in layers})
    rows = [(name, layers[str(length)]) for name, layers in rows if str(length) in layers]
    lines = []
    for key, title in SCORES_BY_LAYER:
        scored = [(name, by[key]) for name, by in rows if key in by]
        if not scored:
            continue
        width = max(len(by["max"]) for _, by in scored)
        chance = scored[0][1]["chance"]  # the same sequences for every model
        lines += [f"### {title.capitalize()} per layer ({length}-token copies; the largest head; chance {chance:.3f})",
                  "",
                  "| model | " + " | ".join(str(i) for i in range(width)) + " |", "|" + "---|" * (1 + width)]
        lines += [f"| {name} | " + " | ".join(f"{v:.2f}" for v in by["max"]) + " |" for name, by in scored]
        lines.append("")
    return lines
