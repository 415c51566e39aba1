"""Checkpoint export: a stage-3 or SFT checkpoint directory -> a consolidated fp32 Hugging Face student.

Stage 3 and SFT export their newest checkpoint at their end, the evaluations along stage 3 export snapshots
(harness.eval.during), and `harness export` exports any checkpoint by hand. A checkpoint holds the engine's
state under the DeepSpeed tag `TAG`; the student's config and tokenizer files come from the merged student
(or whichever student the stage started from).

An export never deletes what it did not write: it writes `EXPORT.json` beside the student, and replaces an existing
destination only when that is an earlier export (or with `force`, any folder that is not part of a run), swapping
the new folder in before the old one is removed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch

from harness.config import ConfigError

TAG = "ds"  # DeepSpeed's tag inside each step-* checkpoint directory
EXPORT_JSON = "EXPORT.json"  # written into every export: what it was exported from
# What marks a folder as (part of) a run directory or a checkpoint, which no export may replace.
RUN_MARKERS = ("job.yaml", "eval.yaml", "manifest.json", "COMPLETE.json", "merged", "distill", "align_mixer",
               "align_hidden", "checkpoints", "logs", "settings")


class ExportRefused(ConfigError):
    """The destination holds something an export must not replace."""


def export_checkpoint(checkpoint: Path, dest: Path, merged: Path, *, force: bool = False) -> Path:
    """A stage-3 checkpoint directory -> a consolidated fp32 Hugging Face student at `dest` (atomically).

    `dest` may be missing, empty, or an earlier export (it holds EXPORT.json); with `force` also any other folder
    that is not a run directory (`check_destination`). The stages pass `force` for the folders they own
    (RUN_DIR/student, snapshots), which runs written before EXPORT.json existed hold without it."""
    from harness.engine import consolidated_state_dict
    from harness.student import HarnessForCausalLM

    check_destination(dest, force=force, keep=(checkpoint, merged))
    state = consolidated_state_dict(checkpoint, TAG, prefix="student.")
    student = HarnessForCausalLM.from_pretrained(merged, dtype=torch.float32)
    missing, unexpected = student.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not student.config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {checkpoint} does not fit the student: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-{_owner()}-", dir=dest.parent))
    try:
        student.save_pretrained(tmp)
        for name in merged.iterdir():  # the tokenizer files saved with the merged student
            if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(name, tmp / name.name)
        (tmp / EXPORT_JSON).write_text(json.dumps({**_provenance(checkpoint, merged),
                                                   "weights_sha256": weights_sha256(tmp)}, indent=1))
        tmp.chmod(0o755)
        swap_in(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once swapped in
    return dest


def weights_sha256(folder: Path) -> dict[str, str]:
    """{file name: sha256} of a Hugging Face model folder's weight files: which bytes an evaluation scored."""
    from harness.assets import sha256_file

    return {p.name: sha256_file(p) for p in sorted(Path(folder).glob("*.safetensors"))}


def _provenance(checkpoint: Path, merged: Path) -> dict:
    manifest = {}
    try:
        manifest = json.loads((checkpoint / "manifest.json").read_text())
    except (OSError, ValueError):
        pass
    return {"checkpoint": str(checkpoint.resolve()), "step": manifest.get("step"), "tokens": manifest.get("tokens"),
            "config_from": str(merged.resolve()), "exported_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def check_destination(dest: Path, *, force: bool, keep: tuple[Path, ...] = ()) -> None:
    """Refuse (ExportRefused) a destination an export must not replace: a file; a run directory, a checkpoint or
    a folder holding one of `keep` (the checkpoint, the merged student), even with `force`; and, without `force`,
    any non-empty folder that is not an earlier export."""
    if not dest.exists():
        return
    if not dest.is_dir():
        raise ExportRefused(f"Export destination '{dest}' is a file; give a folder that does not exist yet (or an "
                            "earlier export to replace).")
    here = dest.resolve()
    inside = [p for p in keep if here == p.resolve() or here in p.resolve().parents]
    found = [m for m in RUN_MARKERS if (dest / m).exists()]
    if inside or found:
        what = f"holds {inside[0]}" if inside else f"is part of a run or a checkpoint (it holds {', '.join(found)})"
        raise ExportRefused(f"Export destination '{dest}' {what}; an export never replaces it, not even with "
                            f"--force. Give a new folder, e.g. '{dest / 'student-export'}'.")
    if force or (dest / EXPORT_JSON).is_file() or not any(dest.iterdir()):
        return
    raise ExportRefused(f"Export destination '{dest}' is not empty and is not an earlier export (no {EXPORT_JSON} "
                        "in it); nothing was written. Give a new or empty folder, or pass --force to replace the "
                        "folder and everything in it.")


def swap_in(new: Path, dest: Path) -> None:
    """Rename the finished folder `new` to `dest`; an existing `dest` is first renamed aside and removed only after
    the new one is in place, so that a crash leaves the old export or the new, never neither."""
    old = None
    if dest.exists():
        old = dest.with_name(f".{dest.name}.replaced-{_owner()}-{secrets.token_hex(4)}")
        os.rename(dest, old)
    try:
        os.rename(new, dest)
    except BaseException:
        if old is not None:
            os.rename(old, dest)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _owner() -> str:
    """HOST-PID of this process, in the names of an export's temporary folders."""
    return f"{socket.gethostname()}-{os.getpid()}"


def remove_leftovers(dest: Path) -> list[Path]:
    """Remove the temporary folders (`.NAME.tmp-HOST-PID-*`, `.NAME.replaced-HOST-PID-*`) that exports of `dest`
    killed on this host left behind: those whose process is gone. Returns what was removed."""
    host = socket.gethostname()
    removed = []
    for kind in ("tmp", "replaced"):
        for path in dest.parent.glob(f".{dest.name}.{kind}-{host}-*"):
            pid = path.name[len(f".{dest.name}.{kind}-{host}-"):].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
