"""The state probe as an evaluation task (harness.eval.state does the work): per mixer layer of a student, the
recurrent state's norm and effective rank along the context, and, for student and teacher, retrieval (exact match
and likelihood) against the distance between needle and question.

Settings: the spec's section `state:`, from the job's eval.state (harness.config.StateConfig, the defaults of
`harness eval state`): off unless the job (eval.state) or the spec asks for it, e.g.
`harness eval RUN/eval.yaml 'state={samples: 4}'`. Results: state.json, state_retrieval.jsonl (resumable), state.md
and state_curves.png per model. Scores: likelihood and exact-match retrieval at each distance, each sample an example
(paired between runs); the likelihood at the longest distance drawn along stage 3 as `state`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from harness.config import StateConfig
from harness.eval.tasks.base import Score, ScoredTask, TaskResults


class StateTask(ScoredTask):
    name, title = "state", "State along the context and retrieval against distance"
    run_order = 35
    runs_by_default = False  # a job asks for it (minutes of a student on a CPU; seconds on a GPU)
    teacher_shared = True
    curve_scores = {"likelihood, all distances": True}

    settings = StateConfig

    def for_during(self, spec: Any, during: Any) -> None:
        """Along stage 3: two samples per distance."""
        settings = self.settings_of(spec)
        if settings is not None:
            settings.samples = min(settings.samples, 2)

    def run(self, model: Any, tokenizer: Any, settings: Any, out_dir: Path, *, label: str, device: Any,
            progress: bool, spec: Any) -> dict:
        from harness.eval.state import evaluate_state

        return evaluate_state(model, tokenizer, settings, out_dir, device=device, label=label, progress=progress)

    def summarise(self, folder: Path) -> Optional[TaskResults]:
        """Retrieval per distance (likelihood top-1 and exact match) with each sample's value."""
        from harness.eval.formatting import read_json
        from harness.eval.state import JSON_FILE, RECORDS_FILE

        result, lines = read_json(Path(folder) / JSON_FILE), Path(folder) / RECORDS_FILE
        retrieval = (result or {}).get("retrieval")
        if not retrieval or not lines.is_file():
            return None
        records = [json.loads(line) for line in lines.read_text().splitlines()[1:] if line.strip()]
        key = lambda r: f"{r['kind']}/{r['distance']}/{r['index']}"  # noqa: E731
        top1 = {key(r): float(r["top1"]) for r in records if "top1" in r}
        exact = {key(r): float(bool(r["correct"])) for r in records}
        scores = [Score("likelihood, all distances", sum(top1.values()) / max(len(top1), 1), len(top1),
                        chance=retrieval["chance"])]
        examples = {"likelihood, all distances": top1}
        for point in retrieval["by_distance"]:
            d = point["distance"]
            mine = lambda values: {k: v for k, v in values.items() if k.split("/")[1] == str(d)}  # noqa: E731
            for what, values, ci in (("likelihood", top1, point.get("likelihood_ci")),
                                     ("exact", exact, point.get("exact_ci"))):
                name = f"{what}, {d} tokens apart"
                scores.append(Score(name, point[what], point["samples"], tuple(ci) if ci else None,
                                    retrieval["chance"] if what == "likelihood" else None))
                examples[name] = mine(values)
        return TaskResults(scores, examples, {k: retrieval.get(k) for k in ("length", "kinds", "distances",
                                                                           "samples", "distractors")})
