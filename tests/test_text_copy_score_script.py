"""scripts/text_copy_score.py (copy accuracy on copy documents): a model that copies by construction scores 100% on
the second showing, one that ignores the context scores its first-showing rate there too, the string's tokens are
found behind each cue (harness.eval.tasks.text_copy holds the scoring the script imports), and a run folder
expands to its merged student, snapshots and student."""

from __future__ import annotations

import pytest
import torch

from harness.eval.tasks.text_copy import _string_tokens
from tests.pipeline import load_script, tiny_tokenizer


def script():
    return load_script("text_copy_score")


class Copier(torch.nn.Module):
    """Predicts, at each position of the document's second showing, the token `half + extra` positions back."""

    def __init__(self, back: int, vocab: int):
        super().__init__()
        self.back, self.vocab = back, vocab

    def forward(self, input_ids):
        logits = torch.zeros((*input_ids.shape, self.vocab))
        target = torch.roll(input_ids, shifts=self.back - 1, dims=1)
        logits.scatter_(2, target[..., None], 1.0)
        return type("Out", (), {"logits": logits})


def test_a_copier_scores_every_scored_token_and_a_blind_model_none():
    m, tok = script(), tiny_tokenizer()
    docs = m.documents(12, seed=3, length=(6, 12))
    for doc in docs:
        ids = tok(doc, add_special_tokens=False)["input_ids"]
        half = _string_tokens(tok, doc)
        copier = Copier(len(ids) - half, len(tok))  # the second showing's tokens sit len - half after the first's
        second, _ = m.score_document(copier, tok, doc, skip=2, device="cpu")
        assert second == 1.0, doc
        blind = Copier(1, len(tok))  # predicts the token it was given: no copy
        assert m.score_document(blind, tok, doc, skip=2, device="cpu")[0] < 0.5


def test_the_string_is_found_behind_any_cue():
    tok = tiny_tokenizer()
    for cue in ("\n\n", " | ", " || ", " // ", "\n--\n"):
        doc = "river city music" + cue + "river city music"
        assert _string_tokens(tok, doc) == len(tok("river city music", add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match="not a string"):
        _string_tokens(tok, "river city music")


def test_a_run_folder_expands_to_merged_snapshots_and_student(tmp_path):
    m = script()
    for sub in ("merged", "eval/snapshots/tokens-000000000020", "eval/snapshots/tokens-000000000010", "student"):
        (tmp_path / sub).mkdir(parents=True)
        (tmp_path / sub / "config.json").write_text("{}")
    names = [p.split(str(tmp_path))[1] for p in m.expand(str(tmp_path))]
    assert names == ["/merged", "/eval/snapshots/tokens-000000000010", "/eval/snapshots/tokens-000000000020",
                     "/student"]
    assert m.expand("some-teacher") == ["some-teacher"]


def test_the_interval_holds_the_mean():
    lo, hi = script().bootstrap([0.0, 0.5, 1.0, 1.0, 0.25])
    assert lo <= 0.55 <= hi and 0.0 <= lo < hi <= 1.0


def test_pairs_give_b_minus_a_over_the_documents_both_scored():
    m = script()
    rows = [{"model": "a", "per_document": {"0": 0.2, "1": 0.4, "2": 0.3, "5": 1.0}},
            {"model": "b", "per_document": {"0": 0.5, "1": 0.6, "2": 0.7}}]
    (d,) = m.paired(rows, ["a:b"])
    assert d["model_a"] == "a" and d["model_b"] == "b" and d["n"] == 3  # document 5 is a's alone
    assert d["diff"] == pytest.approx((0.3 + 0.2 + 0.4) / 3)
    lo, hi = d["ci"]
    assert 0.2 - 1e-9 <= lo <= d["diff"] <= hi <= 0.4 + 1e-9 and d["excludes_zero"]  # the smallest and largest differences
    assert "+30.0 pts" in m.markdown([], [d])
    with pytest.raises(SystemExit, match="scored models"):
        m.paired(rows, ["a:c"])
