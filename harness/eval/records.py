"""Resumable JSON-lines record files of the evaluations (NIAH, copy, copy on text, state, ifeval): a header line
holding the settings every record depends on, then one record a line, each appended and synced as it is finished, so
that a run that stops resumes after its last whole record. Each evaluation keys its records and words its errors
itself."""

from __future__ import annotations

import json
import os
from pathlib import Path


def append_record(path: Path, record: dict) -> None:
    """`record` as one JSON line at the end of `path`, synced to disk."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def resume_lines(path: Path, header: dict, overwrite: bool = False) -> tuple[dict, list[str]]:
    """(saved header, the record lines after it) of the records file `path`, split at each newline. A last line cut
    short by a crash is cut off the file first. A file that is missing or empty (or deleted first, with
    `overwrite`) gets `header` written and gives (header, [])."""
    if overwrite and path.exists():
        path.unlink()
    raw = path.read_bytes() if path.exists() else b""
    if raw and not raw.endswith(b"\n"):  # a write interrupted mid-line
        raw = raw[: raw.rfind(b"\n") + 1]
        with open(path, "r+b") as f:
            f.truncate(len(raw))
    lines = raw.decode("utf-8").split("\n")[:-1]  # not splitlines(): a record may hold U+2028 and the like
    if not lines:
        path.write_text("")
        append_record(path, {"header": header})
        return header, []
    return json.loads(lines[0]).get("header", {}), lines[1:]


def changed_settings(saved: dict, header: dict) -> str:
    """'KEY: saved OLD, now NEW' for each key of `header` whose value `saved` does not hold, comma-separated; ''
    when none differs."""
    changed = {k: (saved.get(k), v) for k, v in header.items() if saved.get(k) != v}
    return ", ".join(f"{k}: saved {old!r}, now {new!r}" for k, (old, new) in changed.items())
