"""The settings each stage's results depend on: recorded in the run directory, checked on every rerun.

A rerun of a job into an output directory that already holds a stage's work reuses that work (a finished stage is
skipped, a started one resumes). That is right only when the work was computed with the job's settings, so each
stage records the settings that change what it computes in `RUN_DIR/settings/STAGE.json` when it starts, and a
later run whose settings differ for a stage that has reusable work is refused with a `ConfigError` that names the
keys, their recorded and new values, and the ways out (another output_dir, the old values, or
`run.accept_changed_settings=true`).

What a stage's record holds: the job's `seed`, `teacher.*`, `student.*`, `data.*` and `budget.*` (every stage of
the pipeline, since each starts from the one before it), the stage's own `stages.STAGE.*`, and for stage 3 and SFT
also `deepspeed.*` (the global batch and the engine) and the chat data (`instructions.*`, for SFT and for stage 3
on instructions). SFT, which tunes a finished student and may come from a job file of its own, records only
`seed`, `teacher.*`, `instructions.*`, `stages.sft.*` and `deepspeed.*`. `FREE_KEYS` may change on resume by
design (where the run lives, how often it checkpoints and logs, devices, processes, speed-only switches, the
evaluation, whether the pipeline goes on to SFT); the README lists them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import is_dataclass
from pathlib import Path
from typing import Any, Iterable, Optional

from harness.config import ConfigError, JobConfig

SETTINGS_DIR = "settings"
PIPELINE = ("align_mixer", "align_hidden", "merge", "distill")  # what `harness run` and `harness submit` run
STAGES = (*PIPELINE, "sft")  # and SFT after them with stages.sft.enabled (`pipeline_of`)
GLOBAL_SECTIONS = ("seed", "teacher", "student", "data", "budget")
# Keys (or key prefixes ending in '.') that may differ between the run that did the work and a rerun.
FREE_KEYS = (
    "name", "output_dir", "run.", "eval.", "data.num_proc", "data.cache_dir", "student.options.backend",
    "student.options.fused_qkv",
    "stages.sft.enabled", "deepspeed.teacher_placement", "deepspeed.teacher_config", "stages.distill.gradient_checkpointing",
    "stages.distill.gradient_checkpointing_fraction", "stages.distill.compile_teacher",
    "stages.distill.compile_student",
)
# Files whose presence means a stage has work a rerun would reuse (globs under RUN_DIR).
REUSABLE_WORK = {
    "align_mixer": ("align_mixer/*/checkpoints/step-*", "align_mixer/*/COMPLETE.json", "align_mixer/*/weights.safetensors"),
    "align_hidden": ("align_hidden/*/checkpoints/step-*", "align_hidden/*/COMPLETE.json",
                     "align_hidden/*/weights.safetensors"),
    "merge": ("merged/MERGE.json", "merged/config.json"),
    "distill": ("distill/checkpoints/step-*", "distill/checkpoints/COMPLETE.json", "student/config.json"),
    "sft": ("sft/checkpoints/step-*", "sft/checkpoints/COMPLETE.json", "student-sft/config.json"),
}


def job_settings(job: JobConfig) -> dict[str, Any]:
    """Every field of the resolved job as a flat {dotted key: value}: sections flattened, a free-form mapping
    (student.options) kept whole as one value so that an option added or removed is a difference too, lists as
    lists, enums as their names; the free parts of a mapping (FREE_KEYS, e.g. student.options.backend) left out."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(OmegaConf.structured(job), resolve=True, enum_to_str=True)
    return dict(_flatten(job, tree))


def _flatten(node: Any, tree: dict, prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in tree.items():
        child = getattr(node, key, None)
        if is_dataclass(child):
            yield from _flatten(child, value, f"{prefix}{key}.")
        elif isinstance(value, dict):
            yield f"{prefix}{key}", {k: v for k, v in value.items() if not is_free(f"{prefix}{key}.{k}")}
        else:
            yield f"{prefix}{key}", value


def is_free(key: str) -> bool:
    """Whether `key` may change on resume (FREE_KEYS)."""
    return any(key == free or (free.endswith(".") and key.startswith(free)) for free in FREE_KEYS)


def stage_settings(job: JobConfig, stage: str) -> dict[str, Any]:
    """The settings `stage`'s results depend on (see the module docstring)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage '{stage}' (one of {', '.join(STAGES)})")
    sections = ["seed", "teacher"] if stage == "sft" else [*GLOBAL_SECTIONS]
    if stage in ("align_mixer", "align_hidden", "distill", "sft"):
        sections.append(f"stages.{stage}")
    if stage in ("distill", "sft"):
        sections.append("deepspeed")
    if stage == "sft" or (stage == "distill" and str(job.stages.distill.data) == "instructions"):
        sections.append("instructions")
    return {key: value for key, value in job_settings(job).items()
            if any(key == s or key.startswith(s + ".") for s in sections) and not is_free(key)}


def pipeline_of(job: JobConfig) -> tuple[str, ...]:
    """The stages `harness run` and `harness submit` run for `job`: PIPELINE, then SFT with stages.sft.enabled."""
    return (*PIPELINE, "sft") if job.stages.sft.enabled else PIPELINE


def stages_up_to(stage: str) -> list[str]:
    """`stage` and the pipeline stages before it (whose work it starts from); SFT alone."""
    return ["sft"] if stage == "sft" else list(PIPELINE[:PIPELINE.index(stage) + 1])


def record_path(run: Path, stage: str) -> Path:
    return Path(run) / SETTINGS_DIR / f"{stage}.json"


def has_reusable_work(run: Path, stage: str) -> bool:
    """Whether RUN_DIR holds work of `stage` that a rerun would skip or resume from."""
    return any(next(Path(run).glob(pattern), None) is not None for pattern in REUSABLE_WORK[stage])


UNSET = "(unset)"  # an option one side of a comparison does not give


def differences(recorded: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (recorded, now)} for the keys both hold with different values; two mappings (student.options) are
    compared per option, an option only one gives being UNSET on the other side. A key only one side holds is a field
    that a newer or older harness added or removed, not a change of the job."""
    changed: dict[str, tuple[Any, Any]] = {}
    for key in sorted(recorded.keys() & now.keys()):
        old, new = recorded[key], now[key]
        if isinstance(old, dict) and isinstance(new, dict):
            for sub in sorted(old.keys() | new.keys()):
                a, b = old.get(sub, UNSET), new.get(sub, UNSET)
                if _same(a, b) is False:
                    changed[f"{key}.{sub}"] = (a, b)
        elif not _same(old, new):
            changed[key] = (old, new)
    return changed


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def check_settings(job: JobConfig, stages: Iterable[str], *, write: bool = True) -> None:
    """For each of `stages`: refuse (ConfigError) when RUN_DIR holds reusable work of it computed with other
    settings than the job's, unless run.accept_changed_settings; else record the job's settings for it (with
    `write`, and only on rank 0). All differing stages are named in one message."""
    run = Path(job.output_dir)
    problems: list[str] = []
    to_write: list[tuple[str, dict]] = []
    for stage in stages:
        now = stage_settings(job, stage)
        recorded = _recorded(run, stage)
        reusable = has_reusable_work(run, stage)
        if recorded is None or not reusable:
            to_write.append((stage, _fresh_record(now, recorded, reusable)))
            continue
        changed = differences(recorded["settings"], now)
        if not changed:
            continue
        if not job.run.accept_changed_settings:
            problems.append(_describe(stage, changed))
            continue
        print(f"[harness] warning: {run} holds {stage} work computed with other settings; continuing under the "
              f"new ones (run.accept_changed_settings=true): {_changes(changed)}", file=sys.stderr, flush=True)
        history = recorded.get("history", []) + [{"settings": recorded["settings"], "until": _now()}]
        to_write.append((stage, {"settings": now, "recorded_at": _now(), "history": history}))
    if problems:
        raise ConfigError(
            f"The run directory {run} holds work computed with other settings than this job's: "
            + "; ".join(problems) + ". A rerun would reuse that work as if it had been computed with the new "
            f"settings. Either give the job a new output_dir (e.g. output_dir={run}-2), set those keys back to "
            "their recorded values, or pass run.accept_changed_settings=true to keep the earlier work and continue "
            f"under the new settings (the records in {run / SETTINGS_DIR} then keep both).")
    if write and _is_rank0():
        for stage, record in to_write:
            _write(record_path(run, stage), record)


def _recorded(run: Path, stage: str) -> Optional[dict]:
    """The stage's record, or for a run from before records existed, its RUN_DIR/job.yaml's settings (None when
    neither can be read)."""
    try:
        record = json.loads(record_path(run, stage).read_text())
        if isinstance(record.get("settings"), dict):
            return record
    except (OSError, ValueError):
        pass
    legacy = run / "job.yaml"
    if legacy.is_file() and has_reusable_work(run, stage):
        from harness.config import load_job

        try:
            return {"settings": stage_settings(load_job(legacy), stage), "from": str(legacy)}
        except (ConfigError, OSError, ValueError):
            return None
    return None


def _fresh_record(now: dict, recorded: Optional[dict], reusable: bool) -> dict:
    if recorded is None and reusable:
        print("[harness] warning: this run directory's earlier work has no record of its settings; recording the "
              "job's now (a rerun with other settings will be refused from here on)", file=sys.stderr, flush=True)
    return {"settings": now, "recorded_at": _now()}


def _describe(stage: str, changed: dict[str, tuple[Any, Any]]) -> str:
    return f"{stage} differs in {_changes(changed)}"


def _changes(changed: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{k} ({_show(old)} recorded, {_show(new)} now)" for k, (old, new) in changed.items())


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _write(path: Path, record: dict) -> None:
    from harness.files import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
