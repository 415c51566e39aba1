"""The evaluation job: `harness eval RUN_DIR/eval.yaml` runs what the spec asks on the student and its teacher.

For each model (the student, then the teacher unless the spec has none) it runs every registered evaluation task
(harness.eval.tasks) that the spec asks for and that runs on that side, cheap ones first: by default the
held-out perplexity, the NIAH grid, the chat samples, the lm-eval tasks. Results land in

    OUTPUT_DIR/student/      perplexity.json, niah.json (+ .csv, heatmap, niah_cells.jsonl), bench.json, ...
    TEACHER_DIR/             the same for the teacher (TEACHER_DIR: see `teacher_results_dir`)
    OUTPUT_DIR/report.md     teacher recovery, NIAH by length, perplexity, ... (harness.eval.report)
    OUTPUT_DIR/report.json
    OUTPUT_DIR/comparison/   with compare_to (the post-trained student's spec): that evaluation and this one side by
                             side, with paired differences (harness.eval.paired.side_by_side)

Everything resumes: each task keeps what it finished (NIAH samples and benchmark tasks already on disk are kept,
perplexity is recomputed only if its settings changed); so a killed or preempted evaluation re-run with the same
command finishes the rest. The teacher's results depend only on the teacher and the settings, so runs sharing a
teacher can share them through `teacher_cache` (the study does): the first run computes them, the others reuse
them. A task whose teacher results may not be shared (EvalTask.teacher_shared) keeps them in OUTPUT_DIR/teacher.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from harness.eval.formatting import PERPLEXITY_FILE  # noqa: F401  (scripts/study_seed.py reads it from here)
from harness.eval.spec import COMPARISON_DIR, EvalSpec
from harness.eval.tasks import EvalTask, tasks, tasks_in_run_order
from harness.files import file_lock


def resolve(spec: EvalSpec) -> tuple[torch.device, torch.dtype]:
    """The device and weights' dtype the spec asks for ('auto': CUDA and bfloat16 when there is a GPU)."""
    from harness.config import ConfigError

    if spec.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible; use device=cpu or auto.")
    cuda = spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if spec.dtype == "auto":
        return device, torch.bfloat16 if cuda else torch.float32
    return device, getattr(torch, spec.dtype)


def teacher_results_dir(spec: EvalSpec) -> Path:
    """Where the teacher's results go: the spec's teacher_dir when it names one, else TEACHER_CACHE/<name>-<key>, or
    OUTPUT_DIR/teacher without a cache.

    The key hashes what the teacher's numbers depend on beyond what each result file checks itself (NIAH
    samples are keyed by kind/length/depth, benchmark tasks by name): teacher, layers, dtype, limit, NIAH prose,
    prompt mode and perplexity text. Grids and task lists may differ between runs; the overlap is reused.
    """
    if spec.teacher_dir is not None:
        return Path(spec.teacher_dir)
    if spec.teacher_cache is None:
        return Path(spec.output_dir) / "teacher"
    digest = hashlib.sha256(json.dumps(teacher_cache_key(spec), sort_keys=True).encode()).hexdigest()[:12]
    name = Path(str(spec.teacher)).name.replace(".gguf", "") or "teacher"
    return Path(spec.teacher_cache) / f"{name}-{digest}"


def teacher_cache_key(spec: EvalSpec) -> dict:
    """What names a teacher's cached results (teacher_results_dir hashes it): the teacher, its layers and dtype, and
    what each task's teacher results depend on beyond its own files' checks (EvalTask.cache_key: the benchmark
    limit, the NIAH prose and prompt mode, the perplexity's text; only "perplexity" depends on the data)."""
    key = {"teacher": spec.teacher, "num_layers": spec.teacher_num_layers, "dtype": spec.dtype}
    for task in tasks():
        if task.runs_on("teacher") and task.teacher_shared:
            key.update(task.cache_key(spec))
    return key


def load_student(spec: EvalSpec, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """The student and its tokenizer from the checkpoint folder (HF format, harness' Auto classes)."""
    import harness.student  # noqa: F401  (registers the student with the Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(spec.checkpoint, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(spec.checkpoint)


def load_teacher_for(spec: EvalSpec, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """The teacher truncated to the layers the student was made from, as in training."""
    from harness.stages.common import truncate
    from harness.teacher import load_teacher

    teacher = load_teacher(str(spec.teacher), dtype=dtype)
    if spec.teacher_num_layers:
        truncate(teacher.model, spec.teacher_num_layers)
    return teacher.model.to(device).eval(), teacher.tokenizer


def evaluate_model(model: Any, tokenizer: Any, spec: EvalSpec, out: Path, *, label: str, device: torch.device,
                   progress: bool = True, side: str = "student",
                   only: Optional[Sequence[EvalTask]] = None) -> dict:
    """Every task the spec asks for that runs on `side` (or those of `only`), into `out`; {task: its result}."""
    out.mkdir(parents=True, exist_ok=True)
    chosen = only if only is not None else [t for t in tasks_in_run_order() if t.runs_on(side)]
    results: dict[str, Any] = {}
    for task in chosen:
        if task.wanted(spec):
            results[task.name] = task.run(model, tokenizer, task.settings_of(spec), out, label=label, device=device,
                                          progress=progress, spec=spec)
    return results


def run_eval_spec(spec: EvalSpec, *, progress: bool = True) -> dict:
    """Evaluate the student (and the teacher), then write the report; returns the report."""
    from harness.eval.report import build_report, write_report
    from harness.export import weights_sha256

    device, dtype = resolve(spec)
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    student, tokenizer = load_student(spec, device, dtype)
    evaluate_model(student, tokenizer, spec, out / "student", label=spec.label, device=device, progress=progress)
    del student
    teacher_dir = None
    if spec.teacher:
        teacher_dir = teacher_results_dir(spec)
        shared = spec.teacher_cache is not None or spec.teacher_dir is not None
        # a shared folder is filled by one evaluation at a time (the others then reuse what it wrote)
        lock = file_lock(teacher_dir.with_name(teacher_dir.name + ".lock")) if shared else nullcontext()
        on_teacher = [t for t in tasks_in_run_order() if t.runs_on("teacher")]
        own = [t for t in on_teacher if not t.teacher_shared and t.wanted(spec)] if shared else []
        with lock:
            teacher, teacher_tokenizer = load_teacher_for(spec, device, dtype)
            evaluate_model(teacher, teacher_tokenizer, spec, teacher_dir, label="teacher", device=device,
                           progress=progress, side="teacher", only=[t for t in on_teacher if t not in own])
            if own:  # results that may not be shared: the run's own OUTPUT_DIR/teacher
                evaluate_model(teacher, teacher_tokenizer, spec, out / "teacher", label="teacher", device=device,
                               progress=progress, side="teacher", only=own)
            del teacher
    report = build_report(out / "student", teacher_dir, label=spec.label, mixer=spec.mixer,
                          tasks=list(spec.tasks), lengths=list(spec.niah.lengths))
    report["student_weights_sha256"] = weights_sha256(Path(spec.checkpoint))  # two evaluations: the same bytes?
    write_report(report, out)
    if spec.compare_to:
        compare_with(Path(spec.compare_to), out)
    return report


def compare_with(baseline: Path, out: Path) -> Optional[Path]:
    """OUTPUT_DIR/comparison/: the evaluation in `baseline` (A) and this one (B) side by side, with their paired
    differences B - A (harness.eval.paired.side_by_side); None, with a note, while `baseline` has no report."""
    from harness.eval.paired import side_by_side
    from harness.eval.report import REPORT_FILE

    if not (baseline / REPORT_FILE).is_file():
        print(f"[harness] no comparison with {baseline}: it has no {REPORT_FILE} yet; once it has, run this "
              "evaluation again (its finished results are reused) to write the comparison", flush=True)
        return None
    written, why = side_by_side(baseline, out, out / COMPARISON_DIR)
    print(f"[harness] comparison with {baseline}: {written}" + (f" (no paired differences: {why})" if why else ""),
          flush=True)
    return written
