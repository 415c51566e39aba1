"""Crash-safe file writes and file locks shared by checkpoints, data stores, the stages and the evaluation
(standard library only).

A file or directory written "atomically" is filled under a temporary name beside its destination and renamed
into place at the end, so that a reader (or a resumed run) sees the old content or the new, never half of it:
`atomic_file` (a file, any writer), `atomic_write_text` (a text file, fsynced), `atomic_dir` (a directory).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock (flock) on `path` for the block: concurrent processes (ranks building a data
    store, evaluations filling one shared teacher cache) take turns."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class LockHeld(OSError):
    """`hold_lock` found the lock taken; `note` is what its holder wrote into the file ('' if unreadable)."""

    def __init__(self, path: Path, note: str) -> None:
        super().__init__(f"{path} is locked by another process")
        self.path, self.note = path, note


def hold_lock(path: Path, note: str = "") -> int:
    """Take an exclusive advisory lock (flock) on `path` without waiting, write `note` into the file and return the
    open descriptor: the lock holds until that descriptor is closed in every process that has it (a child started
    with it in `pass_fds` shares it). Raises LockHeld, with the holder's note, when another holder has it. The lock
    is the kernel's and ends with its holders, so a file left behind by a process that died blocks nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LockHeld(path, read_lock_note(path)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, note.encode(), 0)
    return fd


def read_lock_note(path: Path, tries: int = 5) -> str:
    """The note in a lock file (its holder may be writing it: a few short retries while it is empty)."""
    for _ in range(tries):
        try:
            note = path.read_text(errors="replace").strip()
        except OSError:
            return ""
        if note:
            return note
        time.sleep(0.05)
    return ""


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """The block writes the yielded temporary sibling of `path` (`.NAME.partial-RANDOM`), which then replaces
    `path`; if the block fails, the temporary is removed and `path` is left as it was."""
    tmp = path.with_name(f".{path.name}.partial-{secrets.token_hex(4)}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` so that readers see the old or the new content, never a mix; the content
    and the rename are flushed to disk."""
    with atomic_file(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_dir(dest: Path, *, kept_if: Optional[str] = None, replace: bool = False) -> Iterator[Path]:
    """The block fills the yielded temporary directory beside `dest` (`.NAME.tmp-RANDOM`), which is then made
    readable by all (0755) and renamed to `dest`. With `replace`, an existing `dest` is removed first. When the
    rename fails because another process put its `dest` in place first, and that one holds the file `kept_if`,
    its directory is kept and this one discarded. The temporary never outlives the block."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        if replace:
            shutil.rmtree(dest, ignore_errors=True)
        _rename_unless_done(tmp, dest, kept_if)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _rename_unless_done(tmp: Path, dest: Path, kept_if: Optional[str]) -> None:
    """Rename `tmp` to `dest`; a failure is fine only when `dest` already holds `kept_if` (a finished copy)."""
    try:
        os.rename(tmp, dest)
    except OSError:
        if kept_if is None or not (dest / kept_if).is_file():
            raise
