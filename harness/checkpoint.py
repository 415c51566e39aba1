"""Checkpoints that never lose work: atomic, verified, pruned, multi-process aware.

Layout of one stage's checkpoint directory (`root`)::

    root/step-00000100/          a complete checkpoint (whatever the writer put there)
    root/step-00000100/manifest.json   step, tokens, meta, time, world_size, {file: {size, sha256}}
    root/latest                  text: the name of the newest complete checkpoint (for people and tools)
    root/COMPLETE.json           the stage's final marker (`mark_complete`)
    root/.tmp-*                  a save in progress, or one a crash interrupted (ignored, then removed)

A save fills `root/.tmp-step-{step}-{random}`, writes the manifest last, fsyncs, and renames the directory
to `root/step-{step}` in one `os.rename`, so a `step-*` directory either is complete or was never renamed.
`latest_valid` trusts nothing it has not checked: it scans `step-*` newest first, and skips (with a
`CheckpointWarning` naming it) any whose manifest is missing or whose files do not match it: by size, or with
`verify="sha256"` also by the sha256 of every file (hashed in parallel threads, and shared across ranks).
`resume` is what a stage calls to continue: the newest checkpoint that passes sha256 *and* loads. A checkpoint
that verifies but fails to load is moved aside to `bad-step-*` (kept for inspection, out of the way of the next
save of that step) and the previous one is tried.

Under torch.distributed every rank calls `save` (and `latest_valid`, `resume`, `mark_complete`) together: rank 0
picks the temporary directory and broadcasts its name, every rank's `writer` fills it (DeepSpeed ZeRO-3 writes
one shard per rank), the ranks hash the files between them, and rank 0 writes the manifest and renames. All
ranks must see `root` on one shared file system.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import secrets
import shutil
import socket
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import numpy as np
import torch
import torch.distributed as dist

from harness.failpoints import failpoint
from harness.files import atomic_write_text, fsync_dir

MANIFEST = "manifest.json"
COMPLETE = "COMPLETE.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
BAD_PREFIX = "bad-"  # a checkpoint that verified but failed to load, moved aside by `resume`
_STEP_RE = re.compile(r"^step-(\d{8,})$")
_CHUNK = 8 << 20
FULL_BELOW = 64 << 20  # bytes free under which a failed write is reported as a full disk
_AHEAD = 4  # chunks the kernel is asked to read ahead of the one being hashed

Verify = Literal["size", "sha256"]
# Failures during a load that are not the checkpoint's fault: `resume` raises them instead of trying older ones.
NOT_THE_CHECKPOINT: tuple[type[BaseException], ...] = (MemoryError, torch.OutOfMemoryError)


class CheckpointError(RuntimeError):
    """A save failed (on any rank); the previous checkpoints are untouched."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (corrupt or incomplete) or moved aside."""


class CheckpointCostWarning(UserWarning):
    """Saving checkpoints takes a large share of the wall time (they are written too often for their size)."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint as its manifest describes it."""

    path: Path
    step: int
    tokens: int
    meta: dict[str, Any] = field(default_factory=dict)
    time: float = 0.0
    world_size: int = 1
    files: dict[str, dict[str, Any]] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------- distributed


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist_on() else 0


def _broadcast(obj: Any, collective: bool) -> Any:
    """Rank 0's `obj` on every rank (identity when not collective)."""
    if not collective:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_gather(obj: Any, collective: bool) -> list[Any]:
    if not collective:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _on_all(fn: Callable[[], Any], collective: bool, what: str,
            explain: Optional[Callable[[], str]] = None) -> list[Any]:
    """Run `fn` on every rank; return every rank's result, or raise CheckpointError on all ranks if any failed
    (with `explain()` added to each rank's error).

    Failures are gathered rather than raised at once so that no rank is left waiting in a collective.
    """
    result, err = None, None
    try:
        result = fn()
    except Exception as e:
        err = f"{type(e).__name__}: {e}" + (f" ({explain()})" if explain else "")
        if not collective:
            raise CheckpointError(f"{what} failed: {err}") from e
    gathered = _all_gather((result, err), collective)
    failed = [f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e]
    if failed:
        raise CheckpointError(f"{what} failed: " + "; ".join(failed))
    return [r for r, _ in gathered]


def _on_rank0(fn: Callable[[], Any], collective: bool, what: str) -> Any:
    """Run `fn` on rank 0 only; every rank gets its result, or raises CheckpointError if it failed."""
    result, err = None, None
    if not collective or dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:
            if not collective:
                raise CheckpointError(f"{what} failed: {type(e).__name__}: {e}") from e
            err = f"{type(e).__name__}: {e}"
    result, err = _broadcast((result, err), collective)
    if err:
        raise CheckpointError(f"{what} failed: rank 0: {err}")
    return result


def _attempt(load: Callable[[CheckpointInfo], None], info: CheckpointInfo, collective: bool,
             fatal: tuple[type[BaseException], ...]) -> Optional[str]:
    """Run `load(info)` on every rank; None if it succeeded on all, else each failed rank's error. An exception
    of a `fatal` type is raised again on its rank, and as CheckpointError on the others."""
    error, raised = None, None
    try:
        load(info)
    except fatal as e:
        error, raised = _describe(e), e
    except Exception as e:
        error = _describe(e)
    gathered = _all_gather((error, raised is not None), collective)
    if raised is not None:
        raise raised
    stopped = [f"rank {r}: {e}" for r, (e, f) in enumerate(gathered) if f]
    if stopped:
        raise CheckpointError(f"loading checkpoint {info.path} stopped on another rank: " + "; ".join(stopped))
    failed = [(f"rank {r}: " if collective else "") + e for r, (e, _) in enumerate(gathered) if e]
    return "; ".join(failed) or None


def _describe(e: BaseException, limit: int = 400) -> str:
    """An exception as `Type: first line of its message`, cut at `limit` characters."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:limit]}{' ...' if len(first) > limit else ''}"


# ----------------------------------------------------------------------------------------- file helpers


def file_digest(path: Path, sha256: bool = True, fsync: bool = False) -> dict[str, Any]:
    """Size (and sha256) of a file; with `fsync`, also forces its data to disk."""
    entry: dict[str, Any] = {"size": path.stat().st_size}
    if sha256 or fsync:
        with open(path, "rb") as f:
            if sha256:
                entry["sha256"] = _sha256_of(f)
            if fsync:
                os.fsync(f.fileno())
    return entry


def _sha256_of(f: Any) -> str:
    """The sha256 of an open binary file, read _CHUNK bytes at a time while the kernel is asked to read the next
    _AHEAD chunks (posix_fadvise WILLNEED): reading a cold file and hashing it overlap (4.3 GB cold on a 2-core VM:
    ~4.0 s against ~7.5 s without; docs/BENCHMARKS.md)."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    offset = 0
    _advise(f.fileno(), 0, _CHUNK * _AHEAD)
    while n := f.readinto(buf):
        offset += n
        _advise(f.fileno(), offset + _CHUNK * (_AHEAD - 1), _CHUNK)
        h.update(view[:n])
    return h.hexdigest()


def _advise(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start reading a file's range (a hint: nothing where posix_fadvise is missing)."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass


def disk_space(path: Path) -> str:
    """Free space where `path` is, for a failed write's message: a full disk often shows only as a short write
    (torch.save: "unexpected pos ...")."""
    try:
        usage = shutil.disk_usage(path if path.exists() else path.parent)
    except OSError as e:
        return f"free space unknown: {e}"
    text = f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB on the file system of {path}"
    if usage.free < FULL_BELOW:
        text += ": the disk is full; make room (or raise the quota) and run the same command again to resume"
    return text


def _list_files(directory: Path) -> list[str]:
    """Every regular file under `directory` except the manifest, as sorted posix paths relative to it."""
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and not p.is_symlink() and p.relative_to(directory).as_posix() != MANIFEST
    )


def _step_of(path: Path) -> Optional[int]:
    m = _STEP_RE.match(path.name)
    return int(m.group(1)) if m and path.is_dir() else None


def _remove_dir(path: Path) -> None:
    """Delete a directory by first renaming it to a `.tmp-` name, so a crash never leaves half a `step-*`."""
    doomed = path.with_name(f"{TMP_PREFIX}delete-{path.name}-{secrets.token_hex(4)}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def read_manifest(path: Path) -> CheckpointInfo:
    """Parse `path/manifest.json` (raises OSError/ValueError/KeyError when missing or malformed)."""
    m = json.loads((path / MANIFEST).read_text())
    return CheckpointInfo(
        path=path,
        step=int(m["step"]),
        tokens=int(m["tokens"]),
        meta=dict(m.get("meta", {})),
        time=float(m.get("time", 0.0)),
        world_size=int(m.get("world_size", 1)),
        files=dict(m["files"]),
    )


def verify_checkpoint(path: Path, verify: Verify = "size", threads: Optional[int] = None) -> Optional[str]:
    """None if `path` is a complete checkpoint whose files match its manifest, else what is wrong.

    With `verify="sha256"` every file that has a digest in the manifest is hashed, `threads` files at a time
    (None: `default_hash_threads`)."""
    info, problem = _read_and_size(path)
    if info is not None and verify == "sha256":
        problem = _first(_digest_problems(path, info.files, list(info.files), threads))
    return problem


def _read_and_size(path: Path) -> tuple[Optional[CheckpointInfo], Optional[str]]:
    """(the manifest, None) if it is readable and every file it lists is there with its size, else (None, what is
    wrong)."""
    try:
        info = read_manifest(path)
    except FileNotFoundError:
        return None, "no manifest.json (never completed)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"unreadable manifest.json ({e})"
    problem = _size_problem(info)
    return (None, problem) if problem else (info, None)


def _size_problem(info: CheckpointInfo) -> Optional[str]:
    """What is missing or has the wrong size among the manifest's files (None: all there)."""
    for rel, want in info.files.items():
        f = info.path / rel
        if not f.is_file():
            return f"missing file {rel}"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{rel} has {size} bytes, manifest says {want['size']}"
    return None


def default_hash_threads(files: int) -> int:
    """Threads to hash `files` files with: one per file, at most one per core this rank may use (the cores
    this process may run on, divided among the ranks of the node, `LOCAL_WORLD_SIZE`), at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(files, cores // local, 8))


def _digest_problem(path: Path, rel: str, want: dict[str, Any]) -> Optional[str]:
    """None if `path/rel` has the sha256 `want` records (or records none), else what is wrong."""
    if "sha256" not in want:
        return None
    try:
        got = file_digest(path / rel, sha256=True)["sha256"]
    except OSError as e:
        return f"{rel} could not be read ({type(e).__name__}: {e})"
    if got != want["sha256"]:
        return f"{rel} does not match its sha256 in the manifest (same size, different bytes: the file is corrupt)"
    return None


def _digest_problems(path: Path, files: dict[str, dict[str, Any]], mine: list[str],
                     threads: Optional[int] = None) -> list[str]:
    """The sha256 problems of the files `mine` (of the manifest's `files`), hashed in parallel threads: hashlib
    and file reads release the GIL, so the threads hash on as many cores. In the order of `mine`."""
    n = threads or default_hash_threads(len(mine))
    if n <= 1 or len(mine) <= 1:
        found = [_digest_problem(path, rel, files[rel]) for rel in mine]
    else:
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="sha256") as pool:
            found = list(pool.map(lambda rel: _digest_problem(path, rel, files[rel]), mine))
    return [p for p in found if p]


def _first(problems: list[str]) -> Optional[str]:
    return problems[0] if problems else None


def hash_shares(files: dict[str, dict[str, Any]], world: int) -> list[list[str]]:
    """The manifest's files that have a sha256, split among `world` ranks by size (largest first, each to the
    rank with the fewest bytes so far): the same split on every rank, since it depends on the manifest only."""
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    for rel in sorted((r for r, e in files.items() if "sha256" in e), key=lambda r: (-files[r]["size"], r)):
        rank = load.index(min(load))
        shares[rank].append(rel)
        load[rank] += files[rel]["size"]
    return shares


# ----------------------------------------------------------------------------------------- manager


class CheckpointManager:
    """Atomic, verified checkpoints of one stage under `root`, keeping the newest `keep_last`.

    Every method that changes the directory (and `latest_valid`, `resume`) is collective when torch.distributed
    is initialised (override with `collective=`): all ranks must call it in the same order.
    """

    def __init__(self, root: Path | str, keep_last: int = 2, hash_files: bool = True,
                 hash_threads: Optional[int] = None) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 (got {keep_last}): the newest checkpoint is never pruned")
        self.root = Path(root)
        self.keep_last = keep_last
        self.hash_files = hash_files
        self.hash_threads = hash_threads  # files hashed at once per rank by sha256 checks (None: the default)
        # Warn (once) when a save takes over `costly_share` of the time since the previous one ended and at
        # least `costly_seconds`: a 1.7B layer group's 10 GB state, saved every step, tripled its step time.
        self.costly_share, self.costly_seconds = 0.25, 2.0
        self._last_end: Optional[float] = None
        self._cost_warned = False

    # -- paths

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def step_dirs(self) -> list[tuple[int, Path]]:
        """All `step-*` directories (complete or not), oldest first."""
        if not self.root.is_dir():
            return []
        found = ((_step_of(p), p) for p in self.root.iterdir())
        return sorted((s, p) for s, p in found if s is not None)

    # -- save

    def save(
        self,
        step: int,
        tokens: int,
        writer: Callable[[Path], None],
        meta: Optional[dict[str, Any]] = None,
        collective: Optional[bool] = None,
    ) -> CheckpointInfo:
        """Write a checkpoint for `step` atomically and return it (on every rank).

        `writer(tmp_dir)` fills the directory on every rank (e.g. `engine.save_checkpoint(tmp_dir, tag=...)`
        plus per-rank RNG and data state). A checkpoint already at `step` is replaced; checkpoints at later
        steps belong to an abandoned future (a resume from an earlier one) and are moved aside to
        `stale-step-*`, never deleted.
        """
        coll = _dist_on() if collective is None else collective
        rank = dist.get_rank() if coll else 0
        world = dist.get_world_size() if coll else 1
        began = time.monotonic()

        def make_tmp() -> Path:
            self.root.mkdir(parents=True, exist_ok=True)
            path = self.root / f"{TMP_PREFIX}step-{step:08d}-{secrets.token_hex(4)}"
            path.mkdir()
            return path

        tmp: Path = _on_rank0(make_tmp, coll, f"creating the directory for step {step}")

        def fill() -> None:
            tmp.mkdir(parents=True, exist_ok=True)  # already there on a shared file system
            writer(tmp)
            failpoint("checkpoint.write")  # tests/test_faults.py: a full disk while the files are written

        def digest_my_share(files: list[str]) -> dict[str, dict[str, Any]]:
            # Every rank hashes (and fsyncs) its share of the files: a ZeRO-3 checkpoint is large.
            return {rel: file_digest(tmp / rel, sha256=self.hash_files, fsync=True) for rel in files[rank::world]}

        try:
            _on_all(fill, coll, f"writing step {step}", lambda: disk_space(tmp))
            files: list[str] = _on_rank0(lambda: _list_files(tmp), coll, f"listing step {step}")
            shares = _on_all(lambda: digest_my_share(files), coll, f"hashing step {step}")
            entries = {rel: entry for share in shares for rel, entry in share.items()}
            info = _on_rank0(
                lambda: self._commit(tmp, step, tokens, meta or {}, world, entries), coll, f"committing step {step}"
            )
            if rank == 0:
                self._note_cost(step, began, time.monotonic())
            failpoint("checkpoint.saved")  # tests/test_faults.py: a signal right after a checkpoint
            return info
        finally:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # gone already when the commit renamed it

    def _note_cost(self, step: int, began: float, ended: float) -> None:
        took, last, self._last_end = ended - began, self._last_end, ended
        if last is None or self._cost_warned or took < self.costly_seconds:
            return
        share = took / max(ended - last, 1e-9)
        if share > self.costly_share:
            self._cost_warned = True
            warnings.warn(
                f"saving checkpoint step {step} under {self.root} took {took:.1f} s, {share:.0%} of the "
                f"{ended - last:.1f} s since the previous save: checkpoints this frequent slow the stage down. "
                "Raise run.checkpoint_every_tokens (0: only at the end of the stage and on preemption).",
                CheckpointCostWarning, stacklevel=3,
            )

    def _commit(
        self, tmp: Path, step: int, tokens: int, meta: dict[str, Any], world: int, files: dict[str, Any]
    ) -> CheckpointInfo:
        """Rank 0: manifest, fsync, rename, latest pointer, prune."""
        now = time.time()
        manifest = {
            "step": step,
            "tokens": tokens,
            "meta": meta,
            "time": now,
            "world_size": world,
            "host": socket.gethostname(),
            "files": files,
        }
        with open(tmp / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        for d in sorted({(tmp / rel).parent for rel in files} | {tmp}, key=lambda p: -len(p.parts)):
            fsync_dir(d)

        for s, p in self.step_dirs():
            if s > step:
                stale = p.with_name(f"stale-{p.name}-{secrets.token_hex(4)}")
                warnings.warn(
                    f"checkpoint {p} is newer than the step being saved ({step}); moved aside to {stale.name}",
                    CheckpointWarning,
                    stacklevel=5,
                )
                os.rename(p, stale)

        final = self.step_dir(step)
        if final.exists():
            _remove_dir(final)  # a re-save of the same step; the one just written replaces it
        os.rename(tmp, final)
        fsync_dir(self.root)
        atomic_write_text(self.root / LATEST, final.name + "\n")
        try:
            self._prune(step)
        except OSError as e:  # the new checkpoint is safe; too many old ones is not worth failing for
            warnings.warn(f"pruning {self.root} failed: {e}", CheckpointWarning, stacklevel=5)
        return CheckpointInfo(final, step, tokens, meta, now, world, files)

    def _prune(self, newest: int) -> None:
        complete = [p for s, p in self.step_dirs() if s <= newest and (p / MANIFEST).is_file()]
        for p in complete[: -self.keep_last]:
            _remove_dir(p)

    # -- load

    def latest_valid(
        self, verify: Verify = "size", clean_tmp: bool = True, collective: Optional[bool] = None
    ) -> Optional[CheckpointInfo]:
        """The newest checkpoint whose manifest exists and whose files match it (by size, or with
        `verify="sha256"` also by digest), or None.

        Skipped checkpoints raise a `CheckpointWarning` naming them. With `clean_tmp`, leftover `.tmp-*`
        directories (saves a crash interrupted) are removed: pass False from a process that reads
        checkpoints while another one may be writing them. Under torch.distributed rank 0 lists and size-checks,
        the ranks hash a share of the files each (`hash_shares`) and gather what they found, so every rank gets
        the same answer.
        """
        coll = _dist_on() if collective is None else collective
        return self._newest(verify, clean_tmp, coll, set())[0]

    def _newest(self, verify: Verify, clean_tmp: bool, coll: bool,
                exclude: set[Path]) -> tuple[Optional[CheckpointInfo], list[str]]:
        """(the newest checkpoint not in `exclude` that passes `verify`, or None; "path: problem" of each one
        skipped on the way, also added to `exclude`). Collective when `coll`; the loop is the same on every rank,
        since it runs on rank 0's listing and on gathered hashes."""
        rank = dist.get_rank() if coll else 0

        def listing() -> list[tuple[Path, Optional[CheckpointInfo], Optional[str]]]:
            if clean_tmp:
                self.clean_tmp()
            return [(path, *_read_and_size(path)) for _, path in reversed(self.step_dirs()) if path not in exclude]

        skipped = []
        for path, info, problem in _on_rank0(listing, coll, f"finding the latest checkpoint in {self.root}"):
            if info is not None and verify == "sha256":
                problem = self._shared_sha256_problem(info, coll)
            if info is not None and problem is None:
                return info, skipped
            skipped.append(f"{path}: {problem}")
            exclude.add(path)
            if rank == 0:
                warnings.warn(f"skipping checkpoint {path}: {problem}. Trying the previous checkpoint; this one is "
                              "left where it is, and a new save of its step replaces it.",
                              CheckpointWarning, stacklevel=4)
        return None, skipped

    def _shared_sha256_problem(self, info: CheckpointInfo, coll: bool) -> Optional[str]:
        """The first sha256 problem among `info`'s files, each rank hashing its share in parallel threads;
        every rank gets the same answer (a rank whose hashing raised reports that as the problem)."""
        rank, world = (dist.get_rank(), dist.get_world_size()) if coll else (0, 1)
        try:
            mine = _digest_problems(info.path, info.files, hash_shares(info.files, world)[rank], self.hash_threads)
        except Exception as e:  # never skip the gather below: the other ranks are in it
            mine = [f"hashing on rank {rank} failed ({type(e).__name__}: {e})"]
        return _first([p for share in _all_gather(mine, coll) for p in share])

    def resume(self, load: Callable[[CheckpointInfo], None], verify: Verify = "sha256",
               collective: Optional[bool] = None,
               fatal: tuple[type[BaseException], ...] = ()) -> Optional[CheckpointInfo]:
        """Load the newest checkpoint that passes `verify` and that `load(info)` loads on every rank; return it,
        or None when the stage starts afresh.

        A checkpoint that fails verification is skipped (`latest_valid`). One that verifies but whose `load`
        raises on any rank is moved aside to `bad-step-*` (kept for inspection, out of the way of the next save
        of its step), with a CheckpointWarning naming it and the error, and the previous one is tried: the ranks
        gather each other's outcome, so all move on together and none waits in a collective. An exception of a
        type in `fatal` (the run is configured unlike the checkpoint: not its fault) or in NOT_THE_CHECKPOINT is
        raised on every rank instead. When checkpoints existed but none verified, a CheckpointWarning says that
        the stage starts afresh. When a load failed and no older checkpoint loads, CheckpointError: the failed
        loads may have changed the model or optimizer, so only a fresh process may start afresh.
        """
        coll = _dist_on() if collective is None else collective
        rank = dist.get_rank() if coll else 0
        exclude: set[Path] = set()
        skipped, moved = [], []
        while True:
            info, passed_over = self._newest(verify, True, coll, exclude)
            skipped += passed_over
            if info is None:
                break
            error = _attempt(load, info, coll, fatal + NOT_THE_CHECKPOINT)
            if error is None:
                return info
            exclude.add(info.path)
            moved.append(self._move_aside(info.path, error, coll))
        if moved:
            raise CheckpointError(
                f"No checkpoint under {self.root} could be loaded: {' '.join(moved)} A failed load may have "
                "changed this process's model or optimizer, so the stage does not start afresh in it: run the stage "
                "again to start it afresh (rename a bad-step-* directory back to step-* to try it again).")
        if skipped and rank == 0:
            warnings.warn(f"no checkpoint under {self.root} could be trusted ({'; '.join(skipped)}): the stage "
                          "STARTS AFRESH from step 0 and redoes the work they held.", CheckpointWarning, stacklevel=2)
        return None

    def _move_aside(self, path: Path, error: str, coll: bool) -> str:
        """Rank 0 renames a checkpoint that failed to load to `bad-step-*` and warns; returns what happened."""

        def rename() -> str:
            bad = path.with_name(f"{BAD_PREFIX}{path.name}-{secrets.token_hex(4)}")
            try:
                os.rename(path, bad)
                where = f"moved aside to {bad} for inspection"
            except OSError as e:
                where = f"could not be moved aside ({e}); a new save of its step replaces it"
            said = f"checkpoint {path} passed its checks but failed to load ({error}); it {where}."
            warnings.warn(f"{said} Trying the previous checkpoint.", CheckpointWarning, stacklevel=5)
            return said

        return _on_rank0(rename, coll, f"moving {path} aside")

    def clean_tmp(self) -> list[Path]:
        """Remove `.tmp-*` directories left by interrupted saves; returns what was removed."""
        if not self.root.is_dir():
            return []
        removed = [p for p in self.root.iterdir() if p.name.startswith(TMP_PREFIX) and p.is_dir()]
        for p in removed:
            shutil.rmtree(p, ignore_errors=True)
        return removed

    # -- stage completion

    def mark_complete(self, meta: Optional[dict[str, Any]] = None, collective: Optional[bool] = None) -> None:
        """Write `root/COMPLETE.json` atomically (rank 0), so that a rerun skips this stage."""

        def write() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.root / COMPLETE, json.dumps({"time": time.time(), "meta": meta or {}}, indent=1))

        _on_rank0(write, _dist_on() if collective is None else collective, f"marking {self.root} complete")

    def is_complete(self) -> bool:
        return self.complete_meta() is not None

    def complete_meta(self) -> Optional[dict[str, Any]]:
        """The meta passed to `mark_complete`, or None if the stage has not completed."""
        try:
            return dict(json.loads((self.root / COMPLETE).read_text())["meta"])
        except (OSError, ValueError, KeyError, TypeError):
            return None


# ----------------------------------------------------------------------------------------- RNG state


def capture_rng() -> dict[str, Any]:
    """This process's RNG states (python, numpy, torch CPU, every CUDA device), loadable with weights_only."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what `capture_rng` captured (CUDA states only when both sides have CUDA)."""
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    """random.setstate needs tuples; a serialiser may hand back lists."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def rng_path(directory: Path, rank: Optional[int] = None) -> Path:
    """Where rank `rank` (default: this rank) keeps its RNG state inside a checkpoint directory."""
    return Path(directory) / f"rng_state_rank{_rank() if rank is None else rank:05d}.pt"


def save_rng(directory: Path) -> Path:
    """Write this rank's RNG state into `directory` (call from a checkpoint writer)."""
    path = rng_path(directory)
    torch.save(capture_rng(), path)
    return path


def load_rng(directory: Path) -> None:
    """Restore this rank's RNG state from a checkpoint directory."""
    restore_rng(torch.load(rng_path(directory), weights_only=True))
