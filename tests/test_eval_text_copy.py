"""The copy score on text (harness.eval.tasks.text_copy): generator:copy documents, the second showing beside the
first, as an evaluation task.

A stub model that copies by construction (at each position it predicts the token one string's length back: the
first showing's token for every token of the second) scores 100% on the second showing; one whose logits are
constant scores 0%. The records resume, a changed setting is refused naming it, the scores reach report.json,
report.md, the paired differences and the curves, and a job's eval.text_copy reaches the spec (null: off).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from harness.cli import main as harness_main
from harness.config import ConfigError, TextCopyConfig, load_job
from harness.data.generators import CopyOptions
from harness.eval import curves, tasks
from harness.eval.spec import load_eval_spec, write_eval_spec
from harness.eval.tasks.text_copy import FIRST, JSON_FILE, RECORDS_FILE, SECOND, documents
from tests.pipeline import eval_run, tiny_job, tiny_tokenizer

SETTINGS = dict(documents=10, seed=3, length=[6, 12], skip=2)


def string_of(doc: str) -> str:
    """The string a copy document shows twice (found here from the generator's cues, not by the task)."""
    return next(doc.partition(c)[0] for c in sorted(CopyOptions().cues, key=len, reverse=True)
                if doc.partition(c)[1] and doc.partition(c)[0] == doc.partition(c)[2])


class Copier(torch.nn.Module):
    """Predicts, at each position, the token `shift - 1` positions back, where shift = the document's tokens minus
    its string's (the distance between a token of the second showing and the same token of the first): a model that
    reads the copy from its context, for the documents it was given. Counts its forward passes."""

    def __init__(self, tokenizer, docs: list[str]):
        super().__init__()
        self.vocab, self.calls, self.shifts = len(tokenizer), 0, {}
        for doc in docs:
            ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
            self.shifts[tuple(ids)] = len(ids) - len(tokenizer(string_of(doc), add_special_tokens=False)["input_ids"])

    def forward(self, input_ids):
        self.calls += 1
        shift = self.shifts[tuple(input_ids[0].tolist())]
        target = torch.roll(input_ids, shifts=shift - 1, dims=1)
        logits = torch.zeros((*input_ids.shape, self.vocab)).scatter_(2, target[..., None], 1.0)
        return SimpleNamespace(logits=logits)


class Constant(torch.nn.Module):
    """The same logits everywhere: the argmax is always token 0 (the tiny tokenizer's end-of-text)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, input_ids):
        logits = torch.zeros((*input_ids.shape, self.vocab))
        logits[..., 0] = 1.0
        return SimpleNamespace(logits=logits)


class Knower(torch.nn.Module):
    """Predicts the document's token j (from position j - 1) right only where pick(len(ids), tokens of the string)
    holds j, token 0 elsewhere: which positions the scores read."""

    def __init__(self, tokenizer, docs: list[str], pick):
        super().__init__()
        self.vocab, self.known = len(tokenizer), {}
        for doc in docs:
            ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
            half = len(tokenizer(string_of(doc), add_special_tokens=False)["input_ids"])
            self.known[tuple(ids)] = pick(len(ids), half)

    def forward(self, input_ids):
        ids = input_ids[0].tolist()
        logits = torch.zeros((*input_ids.shape, self.vocab))
        logits[..., 0] = 1.0
        for j in self.known[tuple(ids)]:
            logits[0, j - 1, ids[j]] = 2.0
        return SimpleNamespace(logits=logits)


def run(model, tokenizer, out: Path, **changes) -> dict:
    task = tasks.get_task("text_copy")
    settings = TextCopyConfig(**{**SETTINGS, **changes})
    return task.run(model, tokenizer, settings, out, label="m", device="cpu", progress=False, spec=None)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def docs():
    return documents(12, SETTINGS["seed"], tuple(SETTINGS["length"]))


def test_a_copier_scores_every_second_showing_and_a_constant_model_nothing(tok, docs, tmp_path):
    copier = Copier(tok, docs)
    result = run(copier, tok, tmp_path / "copier")
    assert result["scores"][SECOND] == {"value": 1.0, "n": 10} and result["scores"][FIRST]["value"] < 0.5
    assert copier.calls == 10 and result["left_out"] == [] and result["indices"] == list(range(10))
    constant = run(Constant(len(tok)), tok, tmp_path / "constant")
    assert constant["scores"][SECOND]["value"] == 0.0 and constant["scores"][FIRST]["value"] == 0.0
    records = [json.loads(line) for line in (tmp_path / "copier" / RECORDS_FILE).read_text().splitlines()]
    assert records[0]["header"] == {"format": 1, "label": "m", "seed": 3, "length": [6, 12], "skip": 2}
    assert all(r["second"] == r["n"] >= 2 for r in records[1:])  # n: the string's tokens - skip


@pytest.mark.parametrize("pick, second, first", [
    (lambda size, half: [size - 1], 1, 0),  # the document's last token: the second showing's last
    (lambda size, half: [size - (half - 2)], 1, 0),  # the second showing's first scored token (skip 2)
    (lambda size, half: [size - (half - 2) - 1], 0, 0),  # the one before it: unscored
    (lambda size, half: [half - 1], 0, 1),  # the first showing's last token
    (lambda size, half: [2], 0, 1),  # the first showing's first scored token
    (lambda size, half: [1, half], 0, 0),  # the one before it, and the cue's first token
], ids=["last", "second-first-scored", "second-unscored", "first-last", "first-first-scored", "first-unscored"])
def test_the_scores_read_the_last_tokens_of_each_showing_after_skip(tok, docs, tmp_path, pick, second, first):
    run(Knower(tok, docs, pick), tok, tmp_path)
    records = [json.loads(line) for line in (tmp_path / RECORDS_FILE).read_text().splitlines()[1:]]
    assert [(r["second"], r["first"]) for r in records] == [(second, first)] * 10


def test_a_string_too_short_to_score_past_skip_is_left_out(tok, docs, tmp_path):
    shortest = min(len(tok(string_of(d), add_special_tokens=False)["input_ids"]) for d in docs[:10])
    copier = Copier(tok, docs)
    result = run(copier, tok, tmp_path, skip=shortest - 1)  # n = 1 for the shortest string: too few to score
    assert result["left_out"] and result["scores"][SECOND]["n"] == 10 - len(result["left_out"])
    assert copier.calls == result["scores"][SECOND]["n"]  # no forward pass for a document left out


def test_records_resume_extend_and_a_changed_setting_is_refused(tok, docs, tmp_path):
    copier = Copier(tok, docs)
    run(copier, tok, tmp_path, documents=8)
    before = (tmp_path / RECORDS_FILE).read_bytes()
    again = run(copier, tok, tmp_path, documents=8)
    assert copier.calls == 8 and (tmp_path / RECORDS_FILE).read_bytes() == before and again["scores"][SECOND]["n"] == 8
    more = run(copier, tok, tmp_path, documents=12)  # only the new documents are scored
    assert copier.calls == 12 and more["scores"][SECOND]["n"] == 12
    with pytest.raises(ConfigError, match=r"skip: saved 2, now 3\).* delete the file to start over"):
        run(copier, tok, tmp_path, skip=3)
    with pytest.raises(ConfigError, match=r"seed: saved 3, now 4"):
        run(copier, tok, tmp_path, seed=4)
    lines = (tmp_path / RECORDS_FILE).read_text().splitlines()
    lines[3] = json.dumps({**json.loads(lines[3]), "sha": "0" * 16})  # a document whose text changed since
    (tmp_path / RECORDS_FILE).write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=r"documents \[2\]: their text differs"):
        run(copier, tok, tmp_path)


def test_scores_reach_the_report_markdown_and_the_paired_differences(tok, docs, tmp_path):
    task = tasks.get_task("text_copy")
    run(Copier(tok, docs), tok, tmp_path / "a")
    run(Constant(len(tok)), tok, tmp_path / "b")
    run(Constant(len(tok)), tok, tmp_path / "other", seed=5)
    report = task.report_fields(tmp_path / "a", tmp_path / "b")
    second = report["text_copy"]["student"]["scores"][SECOND]
    assert second["value"] == 1.0 and second["interval"] == [1.0, 1.0] and second["recovery"] is False
    assert report["text_copy"]["teacher"]["scores"][SECOND]["value"] == 0.0
    assert report["text_copy"]["student"]["settings"]["seed"] == 3 and task.recovery_scores(tmp_path / "a") == {}
    md = "\n".join(task.markdown(report))
    assert "| second showing | 10 | - | 100.0% [100.0, 100.0] | 0.0% [0.0, 0.0] |" in md
    a, b, other = (SimpleNamespace(label=f, data={"text_copy": task.pairing(tmp_path / f, {})})
                   for f in ("a", "b", "other"))
    rows = {r["metric"]: r for r in task.paired_rows(a, b, samples=200, seed=0)}
    row = rows[f"{task.title}: {SECOND}"]
    assert row["diff"] == -1.0 and row["n"] == 10 and f"{task.title}: {FIRST}" in rows
    assert task.example_differences(a, b) == []
    assert any("text_copy seed (3 against 5)" in d for d in task.example_differences(a, other))
    assert curves.METRICS["text_copy_second_showing"][0]({"text_copy": report["text_copy"]}) == 1.0


def test_the_task_runs_in_the_evaluation_job_for_student_and_teacher_and_is_compared(tmp_path):
    setting = "text_copy={documents: 4, length: [6, 10]}"
    runs = [eval_run(tmp_path, name, seed) for name, seed in (("run-a", 0), ("run-b", 1))]
    for r in runs:
        assert harness_main(["eval", str(r / "eval.yaml"), setting]) == 0
    out = runs[0] / "eval"
    assert sorted(p.name for p in (out / "student").iterdir()) == [JSON_FILE, RECORDS_FILE]
    assert (out / "teacher" / JSON_FILE).is_file()
    report = json.loads((out / "report.json").read_text())
    assert report["text_copy"]["teacher"]["scores"][SECOND]["n"] == 4
    assert "## Copy on text" in (out / "report.md").read_text() and "text_copy/" not in json.dumps(report["tasks"])
    assert harness_main(["report", *map(str, runs), "--out", str(tmp_path / "cmp"), "--baseline", "run-a"]) == 0
    text = (tmp_path / "cmp" / "comparison.md").read_text()
    assert f"| {tasks.get_task('text_copy').title}: {SECOND} | 4 |" in text


# ---------------------------------------------------------------------------------------------- eval.text_copy


def _spec(root: Path, *overrides: str):
    out = root / "run"
    job = tiny_job(root, out, *overrides)
    (out / "student").mkdir(parents=True, exist_ok=True)
    path = write_eval_spec(job, out / "student")
    return job, path, tasks.get_task("text_copy").settings_of(load_eval_spec(path))


def test_a_job_runs_the_task_by_default_and_along_stage_3_on_fewer_documents(tmp_path):
    from harness.eval.during import write_during_spec

    job, path, settings = _spec(tmp_path)
    assert settings == TextCopyConfig() and (settings.documents, settings.seed, settings.length) == (64, 7, [8, 32])
    assert OmegaConf.load(path)["text_copy"]["skip"] == 2
    during = OmegaConf.load(write_during_spec(job, tmp_path / "run"))
    assert during.text_copy.documents == 32 and job.eval.text_copy.documents == 64


def test_eval_text_copy_of_a_job_reaches_the_spec_and_null_turns_it_off(tmp_path):
    _, path, settings = _spec(tmp_path / "on", "eval.text_copy={documents: 4}")
    assert settings.documents == 4 and settings.skip == 2 and settings.length == [8, 32]
    _, path, settings = _spec(tmp_path / "off", "eval.text_copy=null")
    assert settings is None and OmegaConf.load(path)["text_copy"] is None
    assert not tasks.get_task("text_copy").wanted(load_eval_spec(path))


@pytest.mark.parametrize("override, message", [
    ("eval.text_copy.length=[8,4]", r"eval\.text_copy\.length=\[8, 4\] must be two numbers of units"),
    ("eval.text_copy.length=[8]", r"eval\.text_copy\.length=\[8\] must be two numbers of units"),
    ("eval.text_copy.skip=0", r"eval\.text_copy\.skip=0 must be at least 1"),
    ("eval.text_copy.documents=0", r"eval\.text_copy\.documents=0 must be a positive number"),
])
def test_bad_text_copy_settings_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_job(None, [override])
