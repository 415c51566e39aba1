"""A run's evaluation history during stage 3: which token counts are due, marks for the evaluator, results.

Stage 3 evaluates its student every `every` tokens without stopping: the training loop asks `due_evaluations`
which multiples of `every` the last step crossed, checkpoints, and leaves a mark per due count
(`mark_for_evaluation`); a separate evaluator consumes the marks (`pending_marks`), evaluates the checkpoint,
appends the report to the history (`append_entry`) and clears the mark (`clear_mark`).

    RUN_DIR/eval/history.jsonl            one JSON line per evaluated checkpoint (see `make_entry`)
    RUN_DIR/eval/pending/tokens-<N>.json  a checkpoint waiting for evaluation: tokens, step, checkpoint, time

Crash safety. A mark is written to a temporary file, fsynced and renamed, so it exists whole or not at all.
A history line is appended with one write, then fsynced; a line torn by a crash (or any line that is not a
JSON object with integer tokens) is skipped on read, and the next append starts on a fresh line so it never
glues itself to the torn one. An evaluation re-run after a resume may append the same token count again: on
read, entries are deduplicated by tokens (the last one wins) and sorted by tokens.

Resume. The set of token counts already handled is `handled_tokens(run_dir)` (history and pending marks);
passing it as `done` to `due_evaluations` means a replayed step never marks a count twice.

The module itself uses only the standard library (no torch, no matplotlib).
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Optional

from harness.files import atomic_write_text, fsync_dir

HISTORY_FILE = "history.jsonl"
PENDING_DIR = "pending"
EVAL_DIR = "eval"
RESULTS_DIR = "during"  # EVAL_DIR/during/tokens-N: each evaluation along stage 3's results, its report among them


# --------------------------------------------------------------------------------------------- helpers


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _is_count(value: Any) -> bool:
    """A non-negative int (bool excluded)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _atomic_write_json(path: Path, obj: Any) -> None:
    """Write `obj` as JSON so that readers see the old file, the new one, or none; never a partial one."""
    atomic_write_text(path, json.dumps(obj, indent=1))


def eval_dir(run_dir: str | Path) -> Path:
    """RUN_DIR/eval: where the history and the pending marks live."""
    return Path(run_dir) / EVAL_DIR


def snapshot_reports(run_dir: str | Path) -> dict[int, Path]:
    """The report.json of each evaluation along stage 3 that finished (RUN_DIR/eval/during/tokens-N/), by N."""
    found = {}
    for report in (eval_dir(run_dir) / RESULTS_DIR).glob("tokens-*/report.json"):
        count = report.parent.name.removeprefix("tokens-")
        if count.isdigit():
            found[int(count)] = report
    return dict(sorted(found.items()))


# --------------------------------------------------------------------------------------------- when


def due_evaluations(tokens_done_before: int, tokens_done_after: int, every: int, done: Iterable[int] = ()) -> list[int]:
    """The multiples of `every` in (tokens_done_before, tokens_done_after] that are not in `done`, ascending.

    Called once per optimizer step with the token counts before and after it: a multiple is due in the step
    that reaches or passes it, so each fires exactly once over an uninterrupted run. After a resume the
    replayed steps cross the same multiples again; `done` (see `handled_tokens`) holds those already marked
    or evaluated, and they are not returned again. Token 0 is never due (the interval is open on the left).
    A step longer than `every` tokens crosses several multiples and returns all of them.
    """
    for name, value in (("tokens_done_before", tokens_done_before), ("tokens_done_after", tokens_done_after)):
        if not _is_count(value):
            raise ValueError(f"{name} must be a non-negative int, got {value!r}.")
    if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
        raise ValueError(f"every must be a positive int (tokens between evaluations), got {every!r}.")
    if tokens_done_after < tokens_done_before:
        raise ValueError(f"tokens_done_after={tokens_done_after} is less than tokens_done_before="
                         f"{tokens_done_before}: token counts only grow.")
    done = set(done)
    first = (tokens_done_before // every + 1) * every
    return [t for t in range(first, tokens_done_after + 1, every) if t not in done]


def handled_tokens(run_dir: str | Path) -> set[int]:
    """Token counts already evaluated (in the history) or waiting (a pending mark): the `done` of a resume."""
    return {e["tokens"] for e in read_history(eval_dir(run_dir))} | {m["tokens"] for m in pending_marks(run_dir)}


# --------------------------------------------------------------------------------------------- marks


def mark_path(run_dir: str | Path, tokens: int) -> Path:
    """RUN_DIR/eval/pending/tokens-<N>.json."""
    return eval_dir(run_dir) / PENDING_DIR / f"tokens-{tokens}.json"


def mark_for_evaluation(run_dir: str | Path, tokens: int, step: int, checkpoint_path: str | Path,
                        **extra: Any) -> Path:
    """Mark the checkpoint at `tokens` for evaluation: RUN_DIR/eval/pending/tokens-<N>.json, written atomically.

    The file holds {"tokens", "step", "checkpoint" (absolute path), "time", **extra} (extra: anything the
    evaluator needs, e.g. mixer or params; JSON-serialisable). Marking the same count again replaces the mark.
    """
    if not _is_count(tokens):
        raise ValueError(f"tokens must be a non-negative int, got {tokens!r}.")
    if not _is_count(step):
        raise ValueError(f"step must be a non-negative int, got {step!r}.")
    clash = {"tokens", "step", "checkpoint", "time"} & set(extra)
    if clash:
        raise ValueError(f"extra fields {sorted(clash)} would overwrite the mark's own fields.")
    path = mark_path(run_dir, tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    mark = {"tokens": tokens, "step": step, "checkpoint": str(Path(checkpoint_path).resolve()), "time": _now(),
            **extra}
    _atomic_write_json(path, mark)
    return path


def _read_mark(path: Path) -> Optional[dict]:
    try:
        mark = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return mark if isinstance(mark, dict) and _is_count(mark.get("tokens")) else None


def pending_marks(run_dir: str | Path) -> list[dict]:
    """The pending marks, ascending by tokens, each as written plus "path" (its file).

    Temporary files of an interrupted write (dot-prefixed) and unreadable files are not marks and are skipped.
    """
    folder = eval_dir(run_dir) / PENDING_DIR
    if not folder.is_dir():
        return []
    marks = []
    for path in folder.glob("tokens-*.json"):
        mark = _read_mark(path)
        if mark is not None:
            marks.append({**mark, "path": str(path)})
    return sorted(marks, key=lambda m: m["tokens"])


def clear_mark(run_dir: str | Path, tokens: int) -> bool:
    """Remove the mark for `tokens` (after its entry is in the history); False if there was none."""
    path = mark_path(run_dir, tokens)
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    fsync_dir(path.parent)
    return True


# --------------------------------------------------------------------------------------------- history


def make_entry(tokens: int, step: int, checkpoint: str | Path, report: dict, *, label: Optional[str] = None,
               mixer: Optional[str] = None, params: Optional[int] = None, time: Optional[str] = None) -> dict:
    """One history entry: the evaluated checkpoint, where it was in training, and its report.

    `report` is what harness.eval.report.build_report returns; `params` is the student's parameter count
    (for recovery against scale); `label` defaults to the report's label, `mixer` to the report's mixer.
    """
    entry = {"tokens": tokens, "step": step, "checkpoint": str(checkpoint),
             "label": label if label is not None else report.get("label"),
             "mixer": mixer if mixer is not None else report.get("mixer"),
             "params": params, "report": report, "time": time or _now()}
    _check_entry(entry)
    return entry


def _check_entry(entry: dict) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"A history entry is a dict, got {type(entry).__name__}.")
    if not _is_count(entry.get("tokens")):
        raise ValueError(f"entry['tokens'] must be a non-negative int, got {entry.get('tokens')!r}.")
    if not _is_count(entry.get("step")):
        raise ValueError(f"entry['step'] must be a non-negative int, got {entry.get('step')!r}.")
    if not isinstance(entry.get("report"), dict):
        raise ValueError(f"entry['report'] must be a report dict (build_report), got {entry.get('report')!r:.80}.")
    params = entry.get("params")
    if params is not None and (not _is_count(params) or params == 0):
        raise ValueError(f"entry['params'] must be a positive int or None, got {params!r}.")


def history_path(run_eval_dir: str | Path) -> Path:
    """RUN_DIR/eval/history.jsonl for run_eval_dir = RUN_DIR/eval."""
    return Path(run_eval_dir) / HISTORY_FILE


def history_folder(path: str | Path) -> Path:
    """The folder of a run's history: `path` itself when it holds history.jsonl (RUN_DIR/eval given), else
    RUN_DIR/eval (RUN_DIR given)."""
    path = Path(path)
    return path if history_path(path).is_file() else eval_dir(path)


def append_entry(run_eval_dir: str | Path, entry: dict) -> Path:
    """Append `entry` as one line of RUN_DIR/eval/history.jsonl and force it to disk; returns the file.

    The line goes out in a single write under an advisory lock (best effort: some shared file systems have
    none), preceded by a newline if the file does not end with one (a line torn by a crash), then fsync.
    A missing "time" is filled in. Appending a token count already present is allowed: readers keep the last.
    """
    _check_entry(entry)
    entry = {**entry, "time": entry.get("time") or _now()}
    line = (json.dumps(entry) + "\n").encode()
    path = history_path(run_eval_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    created = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        _lock(fd)
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)  # releases the lock
    if created:
        fsync_dir(path.parent)
    return path


def _lock(fd: int) -> None:
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)
    except (ImportError, OSError):
        pass


def _parse_line(line: str) -> Optional[dict]:
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) and _is_count(entry.get("tokens")) else None


def read_history(run_eval_dir: str | Path) -> list[dict]:
    """The entries of RUN_DIR/eval/history.jsonl, one per token count (the last appended), ascending by tokens.

    No file: []. Lines that are not a JSON object with integer "tokens" (a line torn by a crash) are skipped.
    """
    path = history_path(run_eval_dir)
    if not path.is_file():
        return []
    by_tokens: dict[int, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        entry = _parse_line(line) if line.strip() else None
        if entry is not None:
            by_tokens[entry["tokens"]] = entry
    return [by_tokens[t] for t in sorted(by_tokens)]


def run_name(run_dir: str | Path, history: list[dict]) -> str:
    """A run's name in plots: the label of its last entry, else the folder's name."""
    labels = [e.get("label") for e in history if e.get("label")]
    return labels[-1] if labels else Path(run_dir).resolve().name


def unique_names(names: Iterable[str]) -> list[str]:
    """The names in order, a repeated one made unique as NAME#2, NAME#3, ... (a job run twice keeps its label)."""
    out: list[str] = []
    for base in names:
        name, n = base, 1
        while name in out:
            n += 1
            name = f"{base}#{n}"
        out.append(name)
    return out


def load_histories(run_dirs: Iterable[str | Path], names: Optional[dict[str, str]] = None) -> dict[str, list[dict]]:
    """{run name: history} for several RUN_DIRs (or their eval/ folders), each folder once; names made unique
    with #2, #3, ... (two runs may share a label). names: a run's name by the RUN_DIR as given, where the caller
    has already made them unique across more runs than these."""
    folders: dict[Path, str] = {}
    for run_dir in run_dirs:
        folder = history_folder(run_dir).resolve()
        if folder not in folders:
            folders[folder] = (names or {}).get(str(run_dir)) or run_name(folder.parent, read_history(folder))
    return {name: read_history(folder) for folder, name in zip(folders, unique_names(folders.values()))}
