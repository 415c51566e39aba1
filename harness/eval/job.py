"""The evaluation job: `harness eval RUN_DIR/eval.yaml` runs what the spec asks on the student and its teacher.

For each model (the student, then the teacher unless the spec has none) it runs, in this order and each only if
asked: perplexity on the run's held-out text, the NIAH grid, the lm-eval tasks. Results land in

    OUTPUT_DIR/student/      perplexity.json, niah.json (+ .csv, heatmap, niah_cells.jsonl), bench.json
    TEACHER_DIR/             the same for the teacher (TEACHER_DIR: see `teacher_results_dir`)
    OUTPUT_DIR/report.md     teacher recovery, NIAH by length, perplexity (harness.eval.report)
    OUTPUT_DIR/report.json

Everything resumes: NIAH samples and benchmark tasks already on disk are kept, perplexity is recomputed only if
its settings changed; so a killed or preempted evaluation re-run with the same command finishes the rest.
The teacher's results depend only on the teacher and the settings, so runs sharing a teacher can share them
through `teacher_cache` (the study does): the first run computes them, the others reuse them.
"""

from __future__ import annotations

import hashlib
import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Optional

import torch

from harness.eval.spec import EvalSpec
from harness.files import atomic_write_text, file_lock

PERPLEXITY_FILE = "perplexity.json"


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
    """Where the teacher's results go: TEACHER_CACHE/<name>-<key>, or OUTPUT_DIR/teacher without a cache.

    The key hashes what the teacher's numbers depend on beyond what each result file checks itself (NIAH
    samples are keyed by kind/length/depth, benchmark tasks by name): teacher, layers, dtype, limit, NIAH prose,
    prompt mode and perplexity text. Grids and task lists may differ between runs; the overlap is reused.
    """
    if spec.teacher_cache is None:
        return Path(spec.output_dir) / "teacher"
    digest = hashlib.sha256(json.dumps(teacher_cache_key(spec), sort_keys=True).encode()).hexdigest()[:12]
    name = Path(str(spec.teacher)).name.replace(".gguf", "") or "teacher"
    return Path(spec.teacher_cache) / f"{name}-{digest}"


def teacher_cache_key(spec: EvalSpec) -> dict:
    """What names a teacher's cached results (teacher_results_dir hashes it); only "perplexity" depends on the data."""
    return {
        "teacher": spec.teacher, "num_layers": spec.teacher_num_layers, "dtype": spec.dtype, "limit": spec.limit,
        "haystack": spec.niah.haystack, "prompt": spec.niah.prompt, "perplexity": _perplexity_settings(spec),
    }


def _perplexity_settings(spec: EvalSpec) -> Optional[dict]:
    """What the held-out perplexity depends on: the job's data section and the token count (None: skipped)."""
    if spec.job is None or spec.perplexity_tokens == 0:
        return None
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(OmegaConf.load(spec.job).get("data", {}), resolve=False)
    return {"data": data, "tokens": spec.perplexity_tokens}


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
                   progress: bool = True) -> dict:
    """Perplexity, NIAH and benchmarks for one model into `out`; returns {part: result} for what ran."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    with torch.inference_mode():
        if _perplexity_settings(spec) is not None:
            results["perplexity"] = held_out_perplexity(model, tokenizer, spec, out, device=device, progress=progress)
    if spec.niah.lengths:
        from harness.eval.niah import NiahGrid, run_niah

        grid = NiahGrid(lengths=list(spec.niah.lengths), depths=list(spec.niah.depths), kinds=list(spec.niah.kinds),
                        samples=spec.niah.samples, haystack=spec.niah.haystack, prompt=spec.niah.prompt,
                        distractors=spec.niah.distractors)
        results["niah"] = run_niah(model, tokenizer, grid, out, label=label, device=device, progress=progress,
                                   generation_batch_size=spec.generation_batch_size)
    if spec.chat_samples:
        results["chat_samples"] = chat_samples(model, tokenizer, out, label=label, device=device,
                                               generation_batch_size=spec.generation_batch_size)
    if spec.tasks:
        from harness.eval.lm_eval_tasks import run_benchmarks

        results["bench"] = run_benchmarks(model, tokenizer, list(spec.tasks), out, label=label, limit=spec.limit,
                                          batch_size=spec.batch_size, device=str(device), progress=progress,
                                          generate_batch_size=spec.generation_batch_size)
    return results


def chat_samples(model: Any, tokenizer: Any, out: Path, *, label: str, device: torch.device,
                 generation_batch_size: int = 1) -> dict:
    """The fixed chat prompts' greedy answers, reused from out/chat_samples.json when made the same way."""
    from harness.eval.chat_samples import generate_chat_samples, load_chat_samples

    saved = load_chat_samples(out)
    if saved is not None and saved.get("label") == label:
        return saved
    return generate_chat_samples(model, tokenizer, None, out, label=label, device=str(device),
                                 generation_batch_size=generation_batch_size)


def held_out_perplexity(model: Any, tokenizer: Any, spec: EvalSpec, out: Path, *, device: torch.device,
                        progress: bool = True) -> dict:
    """Perplexity on the run's held-out slice, reused from out/perplexity.json when its settings match."""
    from harness.config import load_job
    from harness.eval.perplexity import perplexity_of_job_heldout

    path = out / PERPLEXITY_FILE
    settings = _perplexity_settings(spec)
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


def run_eval_spec(spec: EvalSpec, *, progress: bool = True) -> dict:
    """Evaluate the student (and the teacher), then write the report; returns the report."""
    from harness.eval.report import build_report, write_report

    device, dtype = resolve(spec)
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    student, tokenizer = load_student(spec, device, dtype)
    evaluate_model(student, tokenizer, spec, out / "student", label=spec.label, device=device, progress=progress)
    del student
    teacher_dir = None
    if spec.teacher:
        teacher_dir = teacher_results_dir(spec)
        # a shared cache is filled by one evaluation at a time (the others then reuse what it wrote)
        lock = file_lock(teacher_dir.with_name(teacher_dir.name + ".lock")) if spec.teacher_cache else nullcontext()
        with lock:
            teacher, teacher_tokenizer = load_teacher_for(spec, device, dtype)
            evaluate_model(teacher, teacher_tokenizer, spec, teacher_dir, label="teacher", device=device,
                           progress=progress)
            del teacher
    report = build_report(out / "student", teacher_dir, label=spec.label, mixer=spec.mixer,
                          tasks=list(spec.tasks), lengths=list(spec.niah.lengths))
    write_report(report, out)
    return report
