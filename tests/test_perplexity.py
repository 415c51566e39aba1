"""Perplexity: exp(mean NLL) computed directly, windowing, text files, and a job's held-out slice."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.eval.perplexity import (PerplexityError, perplexity, perplexity_of_job_heldout,
                                     perplexity_of_text_file, windows_of)
from harness.student import build_student
from tests.pipeline import documents, tiny_job
from tests.tiny import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=2, hidden=64, heads=4, kv_heads=2, vocab=97, seed=0)


def direct_nll(model, ids: torch.Tensor) -> tuple[float, int]:
    """Summed NLL over ids[1:] given the tokens before, by an explicit gather of log-softmax."""
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[None]).logits[0].double(), -1)
    return float(-logp[torch.arange(len(ids) - 1), ids[1:]].sum()), len(ids) - 1


def test_perplexity_is_exp_mean_nll(model):
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (60,))
    result = perplexity(model, ids, seq_len=128, progress=False)
    nll, n = direct_nll(model, ids)
    assert result["tokens"] == n == 59 and result["windows"] == 1
    assert result["nll"] == pytest.approx(nll / n, rel=1e-6)
    assert result["ppl"] == pytest.approx(math.exp(nll / n), rel=1e-6)
    with torch.no_grad():  # transformers' own shifted mean CE agrees
        assert result["nll"] == pytest.approx(float(model(ids[None], labels=ids[None]).loss), rel=1e-5)


def test_windows_predict_every_token_once(model):
    torch.manual_seed(2)
    ids = torch.randint(0, 97, (94,))
    windows = windows_of(ids, 32)
    assert [len(w) for w in windows] == [32, 32, 32]  # starts 0, 31, 62: 31 predictions each
    assert sum(len(w) - 1 for w in windows) == len(ids) - 1
    result = perplexity(model, ids, seq_len=32, progress=False)
    parts = [direct_nll(model, w) for w in windows]
    assert result["tokens"] == 93
    assert result["nll"] == pytest.approx(sum(p[0] for p in parts) / 93, rel=1e-6)
    # rows of a 2-D input are separate sequences; batching them does not change the result
    rows = torch.randint(0, 97, (5, 32))
    one = perplexity(model, rows, seq_len=32, batch_size=1, progress=False)
    three = perplexity(model, rows, seq_len=32, batch_size=3, progress=False)
    assert one["tokens"] == three["tokens"] == 5 * 31 and one["sequences"] == 5
    assert three["nll"] == pytest.approx(one["nll"], rel=1e-5)
    assert one["nll"] == pytest.approx(sum(direct_nll(model, r)[0] for r in rows) / 155, rel=1e-6)


def test_bad_inputs(model):
    with pytest.raises(PerplexityError, match="seq_len=1"):
        perplexity(model, torch.arange(10), seq_len=1, progress=False)
    with pytest.raises(PerplexityError, match="No sequence"):
        perplexity(model, [torch.tensor([3])], seq_len=8, progress=False)


def test_text_files(tmp_path):
    from tests.pipeline import tiny_tokenizer

    tok = tiny_tokenizer()
    lm = tiny_llama(num_layers=1, vocab=len(tok), seed=3)
    docs = documents(4, seed=5)
    (tmp_path / "a.txt").write_text("\n".join(docs))
    result = perplexity_of_text_file(lm, tok, tmp_path / "a.txt", seq_len=16, progress=False)
    direct = perplexity(lm, torch.tensor(tok("\n".join(docs))["input_ids"]), seq_len=16, progress=False)
    assert result["nll"] == pytest.approx(direct["nll"]) and result["tokens"] == direct["tokens"]
    with open(tmp_path / "b.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    per_doc = perplexity_of_text_file(lm, tok, tmp_path / "b.jsonl", seq_len=16, progress=False)
    assert per_doc["sequences"] == 4
    assert per_doc["tokens"] == sum(len(tok(d)["input_ids"]) - 1 for d in docs)
    capped = perplexity_of_text_file(lm, tok, tmp_path / "a.txt", seq_len=16, max_tokens=20, progress=False)
    assert capped["tokens"] == 19


def test_job_heldout_is_disjoint_and_scored(tmp_path):
    """The held-out rows precede the training split, which starts at a document boundary; their perplexity
    is perplexity() of exactly those rows (what stage 3 reports as val_ppl)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.data import prepare_job_corpus

    job = tiny_job(tmp_path / "setting", tmp_path / "run")
    teacher_dir = Path(job.teacher.source)
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    corpus = prepare_job_corpus(job, tok, check=False)
    val, train = corpus.validation, corpus.train
    assert val.offset == 0 and val.num_tokens == job.data.validation_tokens == 256
    assert train.offset >= val.num_tokens and train.offset in set(corpus.store.doc_starts.tolist())
    held_docs = {int(np.searchsorted(corpus.store.doc_starts, t, side="right")) for t in (0, val.num_tokens - 1)}
    first_train_doc = int(np.searchsorted(corpus.store.doc_starts, train.offset, side="right"))
    assert max(held_docs) < first_train_doc  # no document in both

    student = build_student(AutoModelForCausalLM.from_pretrained(teacher_dir), "gated_deltanet", chunk_size=16)
    result = perplexity_of_job_heldout(student, job, tokenizer=tok, progress=False)
    rows = torch.from_numpy(val.tokens(np.arange(val.num_sequences)))
    assert result["tokens"] == val.num_sequences * (job.data.seq_len - 1)
    assert result["nll"] == pytest.approx(perplexity(student, rows, seq_len=job.data.seq_len, progress=False)["nll"])
    assert result["nll"] == pytest.approx(sum(direct_nll(student, r)[0] for r in rows) / result["tokens"], rel=1e-5)
    capped = perplexity_of_job_heldout(student, job, tokenizer=tok, max_tokens=64, progress=False)
    assert capped["windows"] == 2
