"""The copy score on text as an evaluation task: how much of a string's second showing a model predicts, on documents
of the harness's `generator:copy` (harness.data.generators.Copy: a random string of words, pseudo-words, letter or
digit groups, a cue of punctuation or whitespace, the string again), for student and teacher.

The copy probe (`copy`, harness.eval.copy) shows random token ids twice with nothing between them; a model that
learned to copy only after a cue (the toy teacher of scripts/toy_teacher.py, trained on generator:copy documents)
scores 0 there while it copies text. This task reads the format such a model learned. Per document, one forward
pass (teacher-forced, greedy: the argmax of the logits before each token):

    second showing  hits among the second showing's tokens after its first `skip` (where the cue's tokenisation can
                    differ from the first showing's): the document's last n = len(tokens of the string) - skip tokens
    first showing   hits among the first showing's same n tokens: what the model guesses without a copy to read

A document whose string has fewer than skip + 2 tokens, or whose tokens do not split into two showings, is left out.
Each score is the mean over documents of hits / n, with a 95% bootstrap interval over documents; each document is
an example (`doc/<index>`), so two runs scored on the same documents are paired. No chance level: the scores stay
out of the recovery table. Drawn along stage 3 as `text_copy_second_showing`.

Settings: the spec's section `text_copy:`, from the job's eval.text_copy (harness.config.TextCopyConfig): on by
default (64 short forward passes per model), along stage 3 the first during_documents; null: off.

Results per model: text_copy.jsonl (a header with what every record depends on: the label, seed, length, skip; then
one record per document: its index, the digest of its text, n and the hits of each showing; resumable: a re-run keeps
the records there, a record whose document text differs or a different header is an error saying how to start over)
and text_copy.json (the scores, the settings, the documents scored and the digest of their texts).

scripts/text_copy_score.py scores model folders with the same functions (documents, score_document).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

from harness.config import ConfigError, TextCopyConfig
from harness.eval.records import append_record, changed_settings, resume_lines
from harness.eval.tasks.base import Score, ScoredTask, TaskResults
from harness.files import atomic_write_text

RECORDS_FILE, JSON_FILE = "text_copy.jsonl", "text_copy.json"
FORMAT = 1  # the layout of the records file; bump when documents or scoring change
SECOND, FIRST = "second showing", "first showing"


class TextCopyTask(ScoredTask):
    name, title = "text_copy", "Copy on text (generator:copy documents: string, cue, string)"
    run_order = 26  # beside the copy probe: cheap
    curve_scores = {SECOND: True}

    settings = TextCopyConfig

    def for_during(self, spec: Any, during: Any) -> None:
        """Along stage 3: the first `during_documents` documents."""
        settings = self.settings_of(spec)
        if settings is not None:
            settings.documents = min(settings.documents, settings.during_documents)

    def run(self, model: Any, tokenizer: Any, settings: TextCopyConfig, out_dir: Path, *, label: str, device: Any,
            progress: bool, spec: Any) -> dict:
        """Score the documents without a record yet, then write text_copy.json."""
        docs = documents(settings.documents, settings.seed, tuple(settings.length))
        header = {"format": FORMAT, "label": label, "seed": settings.seed, "length": list(settings.length),
                  "skip": settings.skip}
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        records = load_records(out / RECORDS_FILE, header, docs)
        todo = [i for i in range(len(docs)) if i not in records]
        for record in score_documents(model, tokenizer, docs, todo, settings.skip, device):
            append_record(out / RECORDS_FILE, record)
            records[record["index"]] = record
        if progress and todo:
            print(f"[text_copy] {label}: {len(todo)} documents scored", flush=True)
        result = summary([records[i] for i in range(len(docs))], header, docs)
        atomic_write_text(out / JSON_FILE, json.dumps(result, indent=1) + "\n")
        return result

    def summarise(self, folder: Path) -> Optional[TaskResults]:
        """The two scores over the documents text_copy.json names, with each document's value."""
        from harness.eval.formatting import read_json

        result, path = read_json(Path(folder) / JSON_FILE), Path(folder) / RECORDS_FILE
        if result is None or not path.is_file():
            return None
        by_index = {r["index"]: r for r in _records(path)}
        records = [by_index[i] for i in result["indices"] if i in by_index]
        return results_of(records, result["settings"])


# --------------------------------------------------------------------------------------------- documents, scoring


def documents(n: int, seed: int, length: tuple[int, int]) -> list[str]:
    """The first n generator:copy documents of `seed`: a string of length[0]..length[1] units, a cue, the string
    again (document i depends only on seed, length and i)."""
    from harness.data.generators import make_generator

    gen = make_generator("copy", {"seed": seed, "length": list(length), "copies": [1, 1]})
    return [gen.document(i) for i in range(n)]


def digest(texts: list[str]) -> str:
    """sha256 (first 16 hex digits) of texts as JSON: which documents a result was made with."""
    return hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode()).hexdigest()[:16]


def document_hits(model: Any, tokenizer: Any, doc: str, skip: int, device: Any) -> Optional[tuple[int, int, int]]:
    """(n, hits on the second showing's last n tokens, hits on the first showing's same n tokens), greedy and
    teacher-forced in one forward pass (`model(input_ids=x).logits`); None, with no forward pass, when the string is
    too short to score past `skip` tokens or the tokens do not split into two showings."""
    import torch

    if skip < 1:
        raise ValueError(f"skip={skip}: at least 1 (a showing's first token has no token before it to read).")
    ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
    half = _string_tokens(tokenizer, doc)
    n = half - skip
    if n < 2 or 2 * half > len(ids) + 2:
        return None
    with torch.no_grad():
        guess = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].argmax(-1).cpu()
    right = guess == torch.tensor(ids[1:])  # right[j]: token j + 1 predicted
    second = right[len(ids) - 1 - n:]  # the last n tokens
    first = right[half - 1 - n: half - 1]  # the first showing's last n tokens (before the cue)
    return n, int(second.sum()), int(first.sum())


def score_document(model: Any, tokenizer: Any, doc: str, skip: int, device: Any) -> Optional[tuple[float, float]]:
    """(accuracy on the second showing's last tokens, on the first showing's same tokens): document_hits as
    fractions; None when the document is left out."""
    found = document_hits(model, tokenizer, doc, skip, device)
    return None if found is None else (found[1] / found[0], found[2] / found[0])


def _string_tokens(tokenizer: Any, doc: str) -> int:
    """Tokens of the string alone (the document is string + cue + string; the cue has no letters or digits)."""
    from harness.data.generators import CopyOptions

    for cue in sorted(CopyOptions().cues, key=len, reverse=True):
        a, sep, b = doc.partition(cue)
        if sep and a == b:
            return len(tokenizer(a, add_special_tokens=False)["input_ids"])
    raise ValueError(f"not a string + cue + string document: {doc[:60]!r}")


def score_documents(model: Any, tokenizer: Any, docs: list[str], indices: list[int], skip: int, device: Any):
    """Yield a record per document of `indices` (one forward pass each, the model in eval mode on `device`); a
    document left out gets n = 0."""
    import torch

    if indices and isinstance(model, torch.nn.Module):
        model.to(device).eval()
    for i in indices:
        n, second, first = document_hits(model, tokenizer, docs[i], skip, device) or (0, 0, 0)
        yield {"index": i, "sha": digest([docs[i]]), "n": n, "second": second, "first": first}


# --------------------------------------------------------------------------------------------- results


def results_of(records: list[dict], settings: dict) -> Optional[TaskResults]:
    """The two scores over the records with n > 0 (mean over documents of hits / n); None when there is none."""
    scored = [r for r in records if r["n"] > 0]
    if not scored:
        return None
    examples = {name: {f"doc/{r['index']}": r[key] / r["n"] for r in scored}
                for name, key in ((SECOND, "second"), (FIRST, "first"))}
    scores = [Score(name, sum(values.values()) / len(values), len(values)) for name, values in examples.items()]
    keys = ("seed", "documents", "length", "skip", "digest")
    return TaskResults(scores, examples, {k: settings.get(k) for k in keys})


def summary(records: list[dict], header: dict, docs: list[str]) -> dict:
    """text_copy.json: the settings (with the documents' count and digest), the indices scored, the two scores and
    how many documents were left out."""
    settings = {**header, "documents": len(docs), "digest": digest(docs)}
    results = results_of(records, settings)
    return {"label": header["label"], "settings": settings, "indices": [r["index"] for r in records],
            "left_out": [r["index"] for r in records if r["n"] == 0],
            "scores": {s.name: {"value": s.value, "n": s.n} for s in results.scores} if results else {}}


def load_records(path: Path, header: dict, docs: list[str]) -> dict[int, dict]:
    """The records in `path` by document index after checking its header and each kept record's document digest;
    a new file gets `header` written. A last line cut short by a crash is dropped; a different header or a record
    of another document text raises ConfigError naming what changed and how to start over."""
    saved, lines = resume_lines(path, header)
    detail = changed_settings(saved, header)
    records = [json.loads(line) for line in lines if line.strip()]
    stale = [r["index"] for r in records if r["index"] < len(docs) and r["sha"] != digest([docs[r["index"]]])]
    if stale and not detail:
        detail = f"documents {stale[:5]}: their text differs from the one scored (generator:copy changed)"
    if detail:
        raise ConfigError(f"{path} holds copy scores made otherwise ({detail}). Use another output folder or delete "
                          "the file to start over.")
    return {r["index"]: r for r in records if r["index"] < len(docs)}


def _records(path: Path) -> list[dict]:
    """The records of a records file (the header line left out; a last line cut short ignored)."""
    lines = path.read_text(encoding="utf-8").split("\n")[1:-1]
    return [json.loads(line) for line in lines if line.strip()]
