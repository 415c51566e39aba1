"""The lm-eval benchmarks as an evaluation task (harness.eval.lm_eval_tasks does the work).

Settings: the spec's `tasks` (lm-eval task names; [] skips), `limit`, `batch_size` and the spec-wide
`generation_batch_size`. Results: bench.json and bench_examples.json per model. Every benchmark is a row of the
recovery table (harness.eval.report), so its report, comparison and paired differences are the recovery
table's; the task itself adds the benchmark limit to report.json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from harness.eval.formatting import read_json
from harness.eval.tasks.base import EvalTask, Score, TaskResults

BENCH_FILE = "bench.json"


class BenchmarksTask(EvalTask):
    name = "benchmarks"
    title = "Benchmarks"
    spec_keys = ("tasks", "limit", "batch_size")
    run_order = 40  # the longest part last: a preempted evaluation keeps the cheap ones

    def settings_of(self, spec: Any) -> list[str]:
        return list(spec.tasks)

    def wanted(self, spec: Any) -> bool:
        return bool(spec.tasks)

    def cache_key(self, spec: Any) -> dict:
        return {"limit": spec.limit}

    def for_during(self, spec: Any, during: Any) -> None:
        spec.tasks, spec.limit = list(during.tasks), during.limit

    def run(self, model: Any, tokenizer: Any, settings: list[str], out_dir: Path, *, label: str, device: Any,
            progress: bool, spec: Any) -> dict:
        from harness.eval.lm_eval_tasks import run_benchmarks

        return run_benchmarks(model, tokenizer, settings, out_dir, label=label, limit=spec.limit,
                              batch_size=spec.batch_size, device=str(device), progress=progress,
                              generate_batch_size=spec.generation_batch_size)

    def summarise(self, folder: Path) -> Optional[TaskResults]:
        """Each benchmark's primary metric (a recovery score), its per-example scores keyed 'leaf:doc_id'."""
        bench = read_json(Path(folder) / BENCH_FILE)
        if bench is None:
            return None
        examples = self.recovery_examples(folder)
        scores = [Score(name, e.get("score"), e.get("n"), chance=e.get("chance"), recovery=True, unit="score")
                  for name, e in bench.get("tasks", {}).items()]
        by_example = {name: {f"{leaf}:{doc}": float(x) for leaf, entry in ex["by_task"].items()
                             for doc, x in zip(entry["doc_id"], entry["score"])} for name, ex in examples.items()}
        return TaskResults(scores, by_example, {"limit": bench.get("limit"), "offline": bench.get("offline")})

    def report_fields(self, student_dir: Path, teacher_dir: Optional[Path]) -> dict:
        bench_s, bench_t = read_json(student_dir / BENCH_FILE), _bench(teacher_dir)
        return {"limit": (bench_s or bench_t or {}).get("limit")}

    def recovery_scores(self, folder: Optional[Path]) -> dict[str, dict]:
        bench = _bench(folder)
        return {} if bench is None else dict(bench.get("tasks", {}))

    def recovery_examples(self, folder: Optional[Path]) -> dict[str, dict]:
        from harness.eval.lm_eval_tasks import read_examples

        return read_examples(folder, _bench(folder)) if folder is not None else {}


def _bench(folder: Optional[Path]) -> Optional[dict]:
    return read_json(Path(folder) / BENCH_FILE) if folder is not None else None
