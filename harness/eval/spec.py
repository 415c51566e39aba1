"""The evaluation job spec (`RUN_DIR/eval.yaml`): what `harness eval EVAL.yaml` runs on one student.

Stage 3 writes it from the job's `eval:` section (`write_eval_spec`), next to the run's resolved job
(`RUN_DIR/job.yaml`, which the held-out perplexity reads); SFT writes `RUN_DIR/eval-sft.yaml` for the post-trained
student the same way (`write_sft_eval_spec`: the same settings, the teacher's results shared, and a comparison with
the distilled student's evaluation). It is a typed OmegaConf structure like the job
config, so a hand-written or edited spec is validated the same way (`load_eval_spec`), and it may be
overridden on the command line (`harness eval RUN/eval.yaml limit=20 niah.lengths=[256,512]`).

Each registered evaluation task (harness.eval.tasks) reads its settings from the spec: the built-in ones from the
fields below (tasks/limit/batch_size, niah, perplexity_tokens, chat_samples), every other one from its own section
`<name>:`, which `spec_class()` adds to EvalSpec (null there: the task does not run). A key that is neither a field
nor a registered task is refused, naming both.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.config import (ConfigError, EvalConfig, JobConfig, NiahConfig, bad_choice, check_fields, choice_of_field,
                            described, to_yaml)
from harness.config_choices import Device, Dtype
from harness.eval.tasks import describe_tasks, tasks


@dataclass
class EvalSpec:
    label: str = described("student", "Name of the evaluated model in reports (the run name).")
    checkpoint: str = described("???", "The student: a Hugging Face folder (RUN_DIR/student).")
    teacher: Optional[str] = described(
        None, "Teacher source (as in teacher.source) scored as the recovery baseline; null: no teacher."
    )
    teacher_num_layers: Optional[int] = described(None, "Keep only the teacher's first N layers (as in training).")
    mixer: Optional[str] = described(None, "The student's mixer (for reports).")
    job: Optional[str] = described(None, "The run's resolved job.yaml: its corpus' held-out slice gives perplexity.")
    output_dir: str = described("???", "Where results go: OUTPUT_DIR/student/, OUTPUT_DIR/report.md, ...")
    teacher_cache: Optional[str] = described(
        None, "Where the teacher's results are kept and shared between runs with the same teacher and settings; "
        "null: OUTPUT_DIR/teacher."
    )
    teacher_dir: Optional[str] = described(
        None, "The teacher's result folder as it is (no key appended), shared with another evaluation of this run: "
        "the post-trained student's spec names the distilled student's OUTPUT_DIR/teacher, so the teacher is scored "
        "once for both; null: teacher_cache decides."
    )
    compare_to: Optional[str] = described(
        None, "Another evaluation's OUTPUT_DIR to compare with (the post-trained student's spec names RUN_DIR/eval, "
        "the distilled student's): after the report, both side by side with the paired differences this student - "
        "that one, in OUTPUT_DIR/comparison/ (as `harness report A B --pairs A:B`); null: no comparison."
    )
    device: Device = described(Device.auto, "auto (cuda if available), cpu or cuda.")
    dtype: Dtype = described(Dtype.auto, "Weights' dtype for student and teacher: auto (bfloat16 on CUDA, float32 on "
                           "CPU), float32, bfloat16 or float16.")
    tasks: list[str] = described(help="lm-eval tasks; empty: no benchmarks.", factory=list)
    limit: Optional[int] = described(None, "Examples per benchmark task (lm-eval --limit); null: all.")
    batch_size: int = described(8, "lm-eval batch size.")
    generation_batch_size: int = described(
        1, "Prompts decoded together in NIAH, chat samples and lm-eval generation (eval.generation_batch_size)."
    )
    niah: NiahConfig = described(help="The needle-in-a-haystack grid; lengths [] skips NIAH.", factory=NiahConfig)
    perplexity_tokens: Optional[int] = described(
        262144, "Held-out tokens for perplexity; 0 skips it; null: the whole held-out slice."
    )
    chat_samples: bool = described(True, "Greedy answers to a few fixed chat prompts (harness.eval.chat_samples).")


_SPEC_CLASSES: dict[tuple, type] = {}


def spec_class() -> type:
    """EvalSpec with a section `<name>:` per registered task that declares a settings dataclass (EvalTask.
    spec_fields); EvalSpec itself while there is none (the built-in tasks read EvalSpec's own fields)."""
    own = {f.name for f in fields(EvalSpec)}
    extra = [f for task in tasks() for f in task.spec_fields() if f[0] not in own]
    key = tuple((name, hint) for name, hint, _ in extra)
    if not extra:
        return EvalSpec
    if key not in _SPEC_CLASSES:
        cls = dataclasses.make_dataclass("EvalSpec", extra, bases=(EvalSpec,))
        cls.__module__, cls.__doc__ = __name__, EvalSpec.__doc__
        _SPEC_CLASSES[key] = cls
    return _SPEC_CLASSES[key]


def spec_from_job(job: JobConfig, student_dir: Path, job_yaml: Optional[Path] = None) -> EvalSpec:
    """The spec for a finished run's student: the job's `eval:` section plus where things are."""
    ev: EvalConfig = job.eval
    out = Path(job.output_dir).resolve() / "eval"
    cls = spec_class()
    sections = {task.name: task.settings_from_job(ev) for task in tasks() if _field(cls, task.name)}
    return cls(
        label=job.name,
        checkpoint=str(Path(student_dir).resolve()),
        teacher=job.teacher.source if ev.teacher else None,
        teacher_num_layers=job.teacher.num_layers,
        mixer=job.student.mixer,
        job=str(job_yaml.resolve()) if job_yaml else None,
        output_dir=str(out),
        tasks=list(ev.tasks),
        limit=ev.limit,
        batch_size=ev.batch_size,
        generation_batch_size=ev.generation_batch_size,
        niah=NiahConfig(**OmegaConf.to_container(OmegaConf.structured(ev.niah))),
        perplexity_tokens=ev.perplexity_tokens,
        chat_samples=ev.chat_samples,
        teacher_cache=str(Path(ev.teacher_cache).resolve()) if ev.teacher_cache else None,
        **sections,
    )


def _field(cls: type, name: str) -> Optional[dataclasses.Field]:
    """The field `name` that spec_class() adds to EvalSpec for a task (None for EvalSpec's own fields)."""
    if any(f.name == name for f in fields(EvalSpec)):
        return None
    return next((f for f in fields(cls) if f.name == name), None)


def write_eval_spec(job: JobConfig, student_dir: Path) -> Path:
    """RUN_DIR/job.yaml (the resolved job) and RUN_DIR/eval.yaml (the spec) for the evaluation job."""
    run = Path(job.output_dir)
    job_yaml = run / "job.yaml"
    job_yaml.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    path = run / "eval.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(spec_from_job(job, student_dir, job_yaml))))
    return path


SFT_EVAL_SPEC, SFT_EVAL_DIR = "eval-sft.yaml", "eval-sft"  # the post-trained student's spec and results
COMPARISON_DIR = "comparison"  # OUTPUT_DIR/comparison: the spec's student beside compare_to's


def sft_spec_from_job(job: JobConfig, student_dir: Path, job_yaml: Optional[Path] = None) -> EvalSpec:
    """The spec of the post-trained student (RUN_DIR/student-sft): the job's `eval:` section, as for the distilled
    student, labelled NAME-sft, results in RUN_DIR/eval-sft/; the teacher's results are those of the distilled
    student's evaluation (the job's eval.teacher_cache, else RUN_DIR/eval/teacher), and the report is compared with
    that evaluation's (compare_to: RUN_DIR/eval)."""
    run = Path(job.output_dir).resolve()
    spec = spec_from_job(job, student_dir, job_yaml)
    spec.label, spec.output_dir, spec.compare_to = f"{job.name}-sft", str(run / SFT_EVAL_DIR), str(run / "eval")
    if spec.teacher is not None and spec.teacher_cache is None:
        spec.teacher_dir = str(run / "eval" / "teacher")
    return spec


def write_sft_eval_spec(job: JobConfig, student_dir: Path) -> Path:
    """RUN_DIR/job-sft.yaml (the resolved job SFT ran with) and RUN_DIR/eval-sft.yaml (`sft_spec_from_job`)."""
    run = Path(job.output_dir)
    job_yaml = run / "job-sft.yaml"
    job_yaml.write_text(to_yaml(job))
    path = run / SFT_EVAL_SPEC
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(sft_spec_from_job(job, student_dir, job_yaml))))
    return path


def results_current(spec: Path, results: Sequence[Path]) -> bool:
    """Whether every file of `results` exists and is at least as new as the spec it was made from."""
    return spec.is_file() and all(r.is_file() and r.stat().st_mtime >= spec.stat().st_mtime for r in results)


def load_eval_spec(path: str | Path, overrides: Optional[list[str]] = None) -> EvalSpec:
    """Read and validate an eval spec; ConfigError (one paragraph, exit 2 in the CLI) on bad input."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Evaluation spec '{path}' does not exist (stage 3 writes RUN_DIR/eval.yaml).")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(spec_class()), OmegaConf.load(path),
                                 OmegaConf.from_dotlist(list(overrides or [])))
        spec: EvalSpec = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_explain_omegaconf(err, path)) from None
    except yaml.YAMLError as err:  # an override's value that is no YAML (`key={a:1}` wants `key={a: 1}`)
        raise ConfigError(f"An override of {path} is no valid YAML ({' '.join(str(err).split())}): "
                          f"{' '.join(overrides or [])}.") from None
    except ConfigError:
        raise
    except ValueError as err:  # a task's settings dataclass that checks itself (__post_init__)
        raise ConfigError(f"Bad evaluation spec {path}: {err}") from None
    _validate(spec, path)
    return spec


def _explain_omegaconf(err: OmegaConfBaseException, path: Path) -> str:
    key = getattr(err, "full_key", None) or ""
    if "not in" in str(getattr(err, "msg", err)) and "." not in key:
        return unknown_key(key, path)
    choice = choice_of_field(spec_class(), key)
    if choice is None:
        return f"Bad evaluation spec {path}: {err}".replace("\n", " ")
    return bad_choice(_job_key(key), getattr(err, "value", "?"), choice, f" in {path}")


def unknown_key(key: str, path: Any) -> str:
    """The one-paragraph error for a top-level key of a spec that is neither a setting nor a registered task."""
    settings = ", ".join(f.name for f in fields(EvalSpec))
    return (f"'{key}' in {path} is neither a setting of an evaluation spec nor a registered evaluation task. The "
            f"tasks (and the spec keys that hold their settings): {describe_tasks()}. The settings: {settings}.")


def _job_key(key: str) -> str:
    """The job's name for a spec key: the settings the spec copies from the job's `eval:` section are named
    eval.KEY, as `check_eval` names them."""
    key = key.split("[")[0]
    return f"eval.{key}" if key.split(".")[0] in {f.name for f in fields(EvalConfig)} else key


def _validate(spec: EvalSpec, path: Path) -> None:
    from harness.config import check_eval  # the same checks as a job's eval: section

    check_eval(EvalConfig(tasks=spec.tasks, limit=spec.limit, batch_size=spec.batch_size,
                           generation_batch_size=spec.generation_batch_size, niah=spec.niah,
                           perplexity_tokens=spec.perplexity_tokens))
    for task in tasks():
        settings = getattr(spec, task.name, None) if _field(type(spec), task.name) else None
        if settings is not None:
            check_fields(settings, f"{task.name}.")
    if not Path(spec.checkpoint).is_dir():
        raise ConfigError(f"checkpoint '{spec.checkpoint}' in {path} is not a folder (a student in HF format).")
    if spec.job is not None and not Path(spec.job).is_file():
        raise ConfigError(f"job '{spec.job}' in {path} does not exist (set job: null to skip perplexity).")
