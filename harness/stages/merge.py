"""Assemble the student from the stage-2 layer groups: run_dir/merged (Hugging Face format) + MERGE.json.

The student is built from the (teacher.num_layers-truncated) teacher by `build_student` (torch seeded by
job.seed), so embeddings, final norm and head are the teacher's; every decoder layer is then replaced by the
stage-2 weights that hold it (found by their keys, whatever the grouping), but for the layers that keep softmax
attention (student.attention_layers), which no stage-1/2 group trains: they stay the teacher's, bit for bit. It is saved in float32, whatever
teacher.dtype, so that the fp32 weights the groups trained are kept exactly.

A merge holds RUN_DIR/.merge.lock while it works and writes its folder under a temporary name
(RUN_DIR/.merged.tmp-*) only then, so a temporary folder found while holding the lock is a leftover of a merge that
was killed (SIGKILL): it is removed before the merge starts (`remove_leftovers`; `harness run` does the same when no
merge runs). SIGTERM or SIGUSR1 stops a merge at once (exit REQUEUE_EXIT: it has no checkpoint, it is short),
removing its temporary folder.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Collection
from pathlib import Path

import torch

from harness import preempt
from harness.checkpoint import CheckpointManager, file_digest
from harness.config import ConfigError, JobConfig
from harness.failpoints import failpoint
from harness.files import LockHeld, atomic_dir, file_lock, hold_lock
from harness.mixers import resolved_options
from harness.stages.align import check_made_under, find_group_weights, missing_error, read_layer_tensors
from harness.stages.common import kept_attention_layers, load_job_teacher, num_student_layers, run_dir
from harness.student import HarnessForCausalLM, build_student

MERGED = "merged"
MERGE_JSON = "MERGE.json"
MERGE_LOCK = ".merge.lock"

__all__ = ["merge_student", "merged_dir", "remove_leftovers", "MERGED", "MERGE_JSON"]


def merged_dir(job: JobConfig) -> Path:
    return run_dir(job) / MERGED


def merge_student(job: JobConfig) -> Path:
    """Build run_dir/merged from the complete stage-2 groups and return it (at once if it already exists).

    Raises ConfigError naming the layers no complete align_hidden group holds. Written atomically: a temporary
    sibling folder (model, tokenizer, MERGE.json with each group file's sha256) renamed into place, under the merge
    lock (a second merge waits, then finds the folder made); leftovers of a killed merge are removed first.
    """
    dest = merged_dir(job)
    if (dest / MERGE_JSON).is_file():
        return dest
    with preempt.handling(), file_lock(run_dir(job) / MERGE_LOCK):
        _remove_temporaries(dest)
        if not (dest / MERGE_JSON).is_file():
            _merge(job, dest)
    return dest


def remove_leftovers(job: JobConfig) -> list[Path]:
    """Remove the temporary folders of killed merges (RUN_DIR/.merged.tmp-*) unless a merge holds the merge lock
    now (then they may be its own, and it removes the others itself); returns those removed."""
    try:
        fd = hold_lock(run_dir(job) / MERGE_LOCK)
    except LockHeld:
        return []
    try:
        return _remove_temporaries(merged_dir(job))
    finally:
        os.close(fd)


def _remove_temporaries(dest: Path) -> list[Path]:
    """Remove `dest`'s temporary siblings (`harness.files.atomic_dir`); only while holding the merge lock."""
    found = sorted(dest.parent.glob(f".{dest.name}.tmp-*"))
    for tmp in found:
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"[harness] merge: removed {tmp}, left by a merge that was killed", flush=True)
    return found


def _merge(job: JobConfig, dest: Path) -> None:
    """Build the student from the stage-2 groups and save it atomically to `dest`."""
    n, kept = num_student_layers(job), kept_attention_layers(job)
    files = {l: p for l, p in find_group_weights(job, "align_hidden").items() if l < n and l not in kept}
    missing = [l for l in range(n) if l not in files and l not in kept]
    if missing:
        raise missing_error("align_hidden", missing, "merge")
    for path in sorted(set(files.values())):
        check_made_under(CheckpointManager(path.parent).complete_meta() or {}, job, path.parent)
    teacher = load_job_teacher(job, torch.device("cpu"))
    torch.manual_seed(job.seed)
    student = build_student(teacher, job.student.mixer, attention_layers=kept, **dict(job.student.options)).float()
    load_layers(student, files, kept)
    groups = sorted(set(files.values()))
    record = {
        "time": time.time(), "num_layers": n, "mixer": job.student.mixer,
        "options": resolved_options(job.student.mixer, job.student.options), "attention_layers": kept,
        "teacher": job.teacher.source,
        "groups": [{"file": str(p.relative_to(run_dir(job))), "layers": [l for l, q in files.items() if q == p],
                    "sha256": file_digest(p)["sha256"]} for p in groups],
    }
    _save_atomically(student, teacher.tokenizer, record, dest)


def load_layers(student: HarnessForCausalLM, files: dict[int, Path], kept: Collection[int] = ()) -> None:
    """Copy layer l's tensors from files[l] into `student`; raise if any layer tensor is left uncovered, but for the
    `kept` softmax-attention layers, which keep the teacher's tensors that build_student copied."""
    params = student.state_dict()
    for layer, path in files.items():
        prefix = f"model.layers.{layer}."
        tensors = read_layer_tensors(path, prefix)
        want = {k[len(prefix):] for k in params if k.startswith(prefix)}
        if set(tensors) != want:
            raise ConfigError(f"{path} does not hold exactly the tensors of student layer {layer} (missing "
                              f"{sorted(want - set(tensors))}, unexpected {sorted(set(tensors) - want)}); was stage "
                              "2 run with another student.mixer or student.options? (docs/TRANSFER.md, "
                              "'Compatibility', for runs begun under older defaults)")
        with torch.no_grad():
            for name, t in tensors.items():
                params[prefix + name].copy_(t)
    covered = {int(m.group(1)) for k in params if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if covered - set(files) - set(kept):
        raise ConfigError(f"student layers {sorted(covered - set(files) - set(kept))} have no stage-2 weights")


def _save_atomically(student: HarnessForCausalLM, tokenizer, record: dict, dest: Path) -> None:
    if dest.exists():  # a folder without MERGE.json is not ours to trust (an interrupted copy): replace it
        shutil.rmtree(dest)
    with atomic_dir(dest, kept_if=MERGE_JSON) as tmp:  # another process that merged first keeps its folder
        student.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / MERGE_JSON).write_text(json.dumps(record, indent=1))
        failpoint("merge.saved")  # the folder is written, not yet renamed (tests/test_faults.py)
