"""data.mix: weighted sources and synthetic recall generators (harness.data.mix, harness.data.generators).

Shares within one sequence at every prefix of every stage's slice, determinism, exact resume, a one-entry or empty mix
equal to data.source alone, generator determinism and options, no NIAH template in generated text, the per-source
accounting of `harness data prepare`, and a stage-1 group trained on a mix. CPU, a tiny BPE tokenizer, seconds.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from harness.config import ConfigError
from harness.data import DataError, prepare_job_corpus, prepare_summary
from harness.data.budget import short_label
from harness.data.generators import GENERATORS, WORDS, Draw, make_generator
from harness.data.mix import MixedCorpus, validation_source_label
from harness.data.mix_schedule import MixSchedule, interleave, period_shares
from tests.pipeline import documents, make_setting, tiny_job, tiny_tokenizer

WEIGHTS = {"90/10": (0.9, 0.1), "50/30/20": (0.5, 0.3, 0.2)}


@pytest.fixture(scope="module")
def setting(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mix")
    make_setting(root)
    return root


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def second_corpus(setting) -> Path:
    path = setting / "second.jsonl"
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in documents(300, seed=5)))
    return path


def entries(setting: Path, second: Path, weights: tuple[float, ...]) -> str:
    """A data.mix override: the tiny corpus, then kv_recall (and for three weights a second file) ."""
    items = [f"{{source: {setting / 'corpus.jsonl'}, weight: {weights[0]}}}",
             f"{{source: 'generator:kv_recall', weight: {weights[1]}, options: {{pairs: [2, 6]}}}}"]
    if len(weights) == 3:
        items.append(f"{{source: {second}, weight: {weights[2]}, text_field: body}}")
    return "data.mix=[" + ", ".join(items) + "]"


def mix_job(setting: Path, second: Path, weights: tuple[float, ...], *extra: str, cache: str = "cache"):
    return tiny_job(setting, setting / "out", "data.source=embedded", entries(setting, second, weights),
                    f"data.cache_dir={setting / cache}", *extra)


def stage_rows(corpus, job, stage: str, world: int = 1, mbs: int = 2, accum: int = 1) -> list[tuple]:
    """(stream position, source, sample index, token ids) of every row a stage's loaders hand out, in stream order."""
    rows = []
    loaders = [corpus.stage_stream(stage, job).loader(r, world, mbs, accum) for r in range(world)]
    for batches in zip(*loaders):
        for b in batches:
            rows += [(int(p), int(s), int(i), tuple(ids.tolist())) for p, s, i, ids in
                     zip(b["stream_position"], b.get("source", [0] * len(b["input_ids"])), b["sample_index"],
                         b["input_ids"])]
    return sorted(rows)


# ------------------------------------------------------------------------------------------------ the schedule


@pytest.mark.parametrize("weights", [(0.9, 0.1), (0.5, 0.3, 0.2), (1, 1, 1), (0.97, 0.01, 0.01, 0.01), (0.3333, 0.6667),
                                     (3, 2, 2, 1, 1, 0.5, 0.25)])
def test_schedule_gives_each_source_its_share_within_one_at_every_prefix(weights):
    sched = MixSchedule.from_weights(weights)
    shares = np.array(sched.shares) / sched.period
    assert np.allclose(shares, np.array(weights) / sum(weights), atol=1e-4)
    n = 3 * sched.period + 7
    src, _ = sched.locate(np.arange(n))
    counts = np.cumsum(src[:, None] == np.arange(len(weights))[None, :], axis=0)
    err = np.abs(counts - np.arange(1, n + 1)[:, None] * shares[None, :])
    assert err.max() < 1, err.max()
    for m in (0, 1, sched.period - 1, sched.period, 2 * sched.period + 3):  # counts() agrees with the pattern
        assert (sched.counts(m) == (counts[m - 1] if m else 0)).all()


def test_schedule_ranks_count_each_source_in_order():
    sched = MixSchedule.from_weights([0.5, 0.3, 0.2])
    src, rank = sched.locate(np.arange(95))
    for s in range(3):
        assert rank[src == s].tolist() == list(range(int((src == s).sum())))


def test_period_shares_are_exact_or_rounded_to_the_period():
    assert period_shares([0.9, 0.1]) == (9, 1) and period_shares([0.5, 0.3, 0.2]) == (5, 3, 2)
    assert period_shares([2, 6]) == (1, 3) and period_shares([1 / 3, 2 / 3]) == (1, 2)
    rounded = period_shares([0.123456, 0.876544])  # more than 4 decimals: rounded to a period of 10,000, reduced
    assert 10_000 % sum(rounded) == 0 and abs(rounded[0] / sum(rounded) - 0.123456) <= 1e-4
    with pytest.raises(DataError, match="below 1/10,000"):
        period_shares([1e-6, 1])
    assert interleave([9, 1]).tolist().count(1) == 1


# ------------------------------------------------------------------------------------------------ the mixed stream


@pytest.mark.parametrize("name", WEIGHTS)
def test_every_stage_slice_has_each_share_within_one_sequence(setting, second_corpus, tokenizer, name):
    weights = WEIGHTS[name]
    job = mix_job(setting, second_corpus, weights)
    corpus = prepare_job_corpus(job, tokenizer)
    assert isinstance(corpus, MixedCorpus)
    report = corpus.budget(job)
    shares = np.array(weights) / sum(weights)
    for si, stage in enumerate(("align_mixer", "align_hidden", "distill")):
        rows = stage_rows(corpus, job, stage)
        assert [r[0] for r in rows] == list(range(report.stage(stage).start, report.stage(stage).start + len(rows)))
        src = np.array([r[1] for r in rows])
        counts = np.cumsum(src[:, None] == np.arange(len(weights))[None, :], axis=0)
        err = np.abs(counts - np.arange(1, len(rows) + 1)[:, None] * shares[None, :])
        assert len(rows) > 20 and err.max() < 1, (stage, err.max())
        assert tuple(counts[-1]) == tuple(s.stage_sequences[si] for s in report.sources)
    # every source reads its own split in its own seeded order, without repeats inside the budget
    everything = [r for st in ("align_mixer", "align_hidden", "distill") for r in stage_rows(corpus, job, st, world=2)]
    for s in range(len(weights)):
        seen = [r[2] for r in everything if r[1] == s]
        assert len(seen) == len(set(seen))
    # the rows hold the sources' tokens: a kv_recall row decodes to key-value lines
    kv = next(r for r in everything if r[1] == 1)
    assert re.search(r"(: |= |-> |\t|\| |\": \")", tokenizer.decode(list(kv[3])))


def staged_job(setting: Path, corpus_weights: str, kv_weights: str, *extra: str):
    """A mix of the tiny corpus and kv_recall, each entry with the given `weight: .., stage_weights: {..}` text."""
    mix = (f"data.mix=[{{source: {setting / 'corpus.jsonl'}, {corpus_weights}}}, "
           f"{{source: 'generator:kv_recall', {kv_weights}, options: {{pairs: [2, 6]}}}}]")
    return tiny_job(setting, setting / "out", "data.source=embedded", mix, f"data.cache_dir={setting / 'cache'}",
                    *extra)


def test_stage_weights_give_each_stage_its_own_shares(setting, tokenizer):
    """Copy-style data in stages 1-2 only: kv_recall at half of align_mixer and align_hidden and none of distill.
    Each stage's slice keeps its own shares within one sequence at every point; each source reads on from where the
    stages before left it (no sequence twice); a generator is made to exactly what the stages read of it."""
    from harness.data.mix import plan_summary

    job = staged_job(setting, "weight: 0.5, stage_weights: {distill: 1}", "weight: 0.5, stage_weights: {distill: 0}")
    corpus = prepare_job_corpus(job, tokenizer)
    report = corpus.budget(job)
    wanted = {"align_mixer": 0.5, "align_hidden": 0.5, "distill": 0.0}
    everything = []
    for si, (stage, kv_share) in enumerate(wanted.items()):
        rows = stage_rows(corpus, job, stage)
        src = np.array([r[1] for r in rows])
        kv = np.cumsum(src == 1)
        assert len(rows) > 10 and np.abs(kv - np.arange(1, len(rows) + 1) * kv_share).max() < 1, stage
        assert [s.stage_sequences[si] for s in report.sources] == [int((src == 0).sum()), int((src == 1).sum())]
        everything += rows
    for s in (0, 1):
        seen = [r[2] for r in everything if r[1] == s]
        assert len(seen) == len(set(seen))  # each source's ranks go on across stages: no sequence read twice
    assert report.sources[1].available == sum(report.sources[1].stage_sequences)  # made to measure
    assert [s.share_label for s in report.sources] == ["50/50/100%", "50/50/0%"]
    assert report.sources[0].share is None and "50/50/0%" in report.format()
    assert "50/50/0%" in plan_summary(job) and "align_mixer 2 positions per period" in corpus.describe()
    # a resumed stage after the first (its base counts the stages before under their own schedule) reads the same
    full = stage_rows(corpus, job, "align_hidden")
    ld = corpus.stage_stream("align_hidden", job).loader(0, 1, 2)
    first = [int(p) for _ in range(3) for p in next(ld)["stream_position"]]
    again = prepare_job_corpus(job, tokenizer).stage_stream("align_hidden", job).loader(0, 1, 2)
    again.load_state_dict(ld.state_dict())
    rest = [int(p) for b in again for p in b["stream_position"]]
    assert first + rest == [r[0] for r in full]


def test_stage_weights_equal_to_the_weight_change_nothing(setting, tokenizer):
    """stage_weights that repeat `weight` in every stage give the plain mix's stream and fingerprint (a mix without
    stage_weights keeps the fingerprint its loader states were saved with); different ones change the fingerprint."""
    plain = staged_job(setting, "weight: 0.75", "weight: 0.25")
    same = staged_job(setting, "weight: 0.75, stage_weights: {align_mixer: 0.75, distill: 0.75}",
                      "weight: 0.25, stage_weights: {align_hidden: 0.25}")
    other = staged_job(setting, "weight: 0.75", "weight: 0.25, stage_weights: {distill: 0.5}")
    a, b, c = (prepare_job_corpus(j, tokenizer) for j in (plain, same, other))
    assert a.fingerprint == b.fingerprint != c.fingerprint
    for stage in ("align_mixer", "align_hidden", "distill"):
        assert stage_rows(a, plain, stage) == stage_rows(b, same, stage)
    # the stages before it read the same positions of the same sources, and the same text of the natural one (a
    # generator's split is made to what all stages read of it, so its order follows the whole budget)
    before, after = stage_rows(a, plain, "align_mixer"), stage_rows(c, other, "align_mixer")
    assert [r[:2] for r in before] == [r[:2] for r in after]
    assert [r for r in before if r[1] == 0] == [r for r in after if r[1] == 0]
    assert stage_rows(a, plain, "distill") != stage_rows(c, other, "distill")


def test_a_stage_with_no_weight_is_refused_when_it_reads_the_mix(setting, tokenizer):
    job = staged_job(setting, "weight: 1, stage_weights: {align_hidden: 0}",
                     "weight: 1, stage_weights: {align_hidden: 0}")
    with pytest.raises(DataError, match="Stage align_hidden reads the data mix, but every data.mix entry has weight 0"):
        prepare_job_corpus(job, tokenizer)


def test_period_shares_leave_zero_weights_out():
    assert period_shares([0.5, 0, 0.5]) == (1, 0, 1) and period_shares([0, 3]) == (0, 1)
    sched = MixSchedule.from_weights([0.9, 0, 0.1])
    assert sched.pattern.tolist() == [2 * s for s in MixSchedule.from_weights([0.9, 0.1]).pattern.tolist()]
    two = MixSchedule.from_weights([0.9, 0.1]).counts(25).tolist()
    assert sched.counts(25).tolist() == [two[0], 0, two[1]] and sum(two) == 25
    with pytest.raises(DataError, match="every data.mix weight is 0"):
        period_shares([0, 0])


def test_two_builds_give_the_same_stream(setting, second_corpus, tokenizer):
    weights = WEIGHTS["50/30/20"]
    a_job, b_job = (mix_job(setting, second_corpus, weights, cache=c) for c in ("cache-a", "cache-b"))
    a, b = prepare_job_corpus(a_job, tokenizer), prepare_job_corpus(b_job, tokenizer)
    assert a.fingerprint == b.fingerprint
    for pa, pb in zip(a.parts, b.parts):
        assert pa.train.store.path != pb.train.store.path
        assert (np.asarray(pa.train.store.tokens) == np.asarray(pb.train.store.tokens)).all()
    for stage in ("align_mixer", "distill"):
        assert stage_rows(a, a_job, stage) == stage_rows(b, b_job, stage)
    other = mix_job(setting, second_corpus, weights, "seed=1", cache="cache-a")
    assert stage_rows(prepare_job_corpus(other, tokenizer), other, "distill") != stage_rows(a, a_job, "distill")


@pytest.mark.parametrize("world", [1, 2])
def test_resume_mid_stage_reproduces_the_uninterrupted_stream(setting, second_corpus, tokenizer, world):
    job = mix_job(setting, second_corpus, WEIGHTS["50/30/20"])
    corpus = prepare_job_corpus(job, tokenizer)
    full = stage_rows(corpus, job, "distill", world=world, mbs=2, accum=3)
    loaders = [corpus.stage_stream("distill", job).loader(r, world, 2, 3) for r in range(world)]
    first = []
    for _ in range(7 * 3):  # 7 optimizer steps
        for ld in loaders:
            b = next(ld)
            first += [(int(p), int(s), int(i), tuple(x.tolist())) for p, s, i, x in
                      zip(b["stream_position"], b["source"], b["sample_index"], b["input_ids"])]
    state = loaders[0].state_dict()
    assert all(ld.state_dict() == state for ld in loaders) and state["consumed_sequences"] == 7 * 3 * world * 2
    again = prepare_job_corpus(job, tokenizer)  # a new process: the corpus prepared anew
    rest = []
    for r in range(world):
        ld = again.stage_stream("distill", job).loader(r, world, 2, 3)
        ld.load_state_dict(state)
        rest += [(int(p), int(s), int(i), tuple(x.tolist())) for b in ld for p, s, i, x in
                 zip(b["stream_position"], b["source"], b["sample_index"], b["input_ids"])]
    assert sorted(first + rest) == full
    # a state from another mix is refused
    other = mix_job(setting, second_corpus, (0.4, 0.4, 0.2))
    ld = prepare_job_corpus(other, tokenizer).stage_stream("distill", other).loader(0, world, 2, 3)
    with pytest.raises(DataError, match="does not match this run's data.*corpus"):
        ld.load_state_dict(state)


def test_empty_mix_and_one_entry_mix_read_what_data_source_reads(setting, tokenizer):
    plain = tiny_job(setting, setting / "out")
    empty = tiny_job(setting, setting / "out", "data.mix=[]")
    one = tiny_job(setting, setting / "out", "data.source=embedded",
                   f"data.mix=[{{source: {setting / 'corpus.jsonl'}, weight: 3}}]")
    a, b, c = (prepare_job_corpus(j, tokenizer) for j in (plain, empty, one))
    assert not isinstance(b, MixedCorpus) and a.fingerprint == b.fingerprint and a.store.path == b.store.path
    assert c.store.path == a.store.path  # the same token store: tokenised once for both
    for stage in ("align_mixer", "align_hidden", "distill"):
        rows_a = [r[2:] for r in stage_rows(a, plain, stage)]
        assert rows_a == [r[2:] for r in stage_rows(b, empty, stage)] == [r[2:] for r in stage_rows(c, one, stage)]
    assert (next(a.validation_batches(4))["input_ids"] == next(c.validation_batches(4))["input_ids"]).all()


def test_validation_is_the_head_of_the_first_natural_source_or_the_one_named(setting, second_corpus, tokenizer):
    weights = WEIGHTS["50/30/20"]
    job = mix_job(setting, second_corpus, weights)
    corpus = prepare_job_corpus(job, tokenizer)
    plain = prepare_job_corpus(tiny_job(setting, setting / "out", f"data.cache_dir={setting / 'cache'}"), tokenizer)
    assert corpus.validation.store.path == corpus.parts[0].train.store.path
    assert (np.asarray(corpus.validation.tokens(np.arange(8))) == plain.validation.tokens(np.arange(8))).all()
    assert corpus.parts[0].train.offset == plain.train.offset > 0 and corpus.parts[2].train.offset == 0
    named = mix_job(setting, second_corpus, weights, f"data.validation_source={second_corpus}")
    c2 = prepare_job_corpus(named, tokenizer)
    assert c2.validation.store.path == c2.parts[2].train.store.path and c2.parts[2].train.offset > 0
    assert c2.parts[0].train.offset == 0  # the first source now trains on all of its text
    assert "data.mix[2]" in c2.describe()
    # what the perplexity result names as its text: the held-out entry, not data.source (which a mix leaves unused)
    assert validation_source_label(job.data) == str(setting / "corpus.jsonl")
    assert validation_source_label(named.data) == str(second_corpus)
    plain_job = tiny_job(setting, setting / "out")
    assert validation_source_label(plain_job.data) == str(plain_job.data.source)


def test_a_small_natural_source_needs_allow_repeat(setting, second_corpus, tokenizer):
    job = mix_job(setting, second_corpus, (0.2, 0.7, 0.1), "budget.total_tokens=400000")
    with pytest.raises(DataError, match=f"'{re.escape(str(second_corpus))}' is read for .* passes.*allow_repeat"):
        prepare_job_corpus(job, tokenizer)
    job = mix_job(setting, second_corpus, (0.2, 0.7, 0.1), "budget.total_tokens=400000", "data.allow_repeat=true")
    report = prepare_job_corpus(job, tokenizer).budget(job)
    gen = report.sources[1]
    assert gen.generator and gen.available == gen.sequences and report.needs_repeat


def test_a_streamed_source_reads_what_its_share_needs(setting, second_corpus, tokenizer):
    job = mix_job(setting, second_corpus, (0.5, 0.3, 0.2), "data.streaming=true", "data.shuffle_buffer=50",
                  cache="cache-stream")
    corpus = prepare_job_corpus(job, tokenizer)
    report = corpus.budget(job)
    for i, (part, src) in enumerate(zip(corpus.parts, report.sources)):
        assert src.sequences <= part.train.num_sequences  # enough was read for its share
        if not src.generator:  # a stream asks for its share (+1%) and, for the first source, the held-out head
            held = 8 if i == 0 else 0
            asked = int(src.sequences * 32 * 1.01) + (held + 1) * 32
            assert part.train.store.meta["source"]["streaming"] and part.train.store.path.name.endswith(f"-{asked}")
    assert len(stage_rows(corpus, job, "distill")) == report.stage("distill").sequences


# ------------------------------------------------------------------------------------------------ generators


def texts_file(tmp_path: Path, n: int = 60) -> Path:
    path = tmp_path / "paragraphs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(n, seed=7)))
    return path


def all_generators(texts: Path) -> dict[str, list]:
    """Generators under varied options, for the checks below."""
    span = {"text": str(texts), "first_document": 0}
    return {
        "repeat_span": [make_generator("repeat_span", {**span, **o}) for o in
                        ({}, {"span_words": [2, 6], "distance_words": [0, 8], "max_words": 40, "seed": 3},
                         {"span_words": 40, "distance_words": [100, 300], "seed": 1})],
        "kv_recall": [make_generator("kv_recall", o) for o in
                      ({}, {"pairs": 1, "queries": 1, "key_kinds": ["number"], "value_kinds": ["code"]},
                       {"pairs": [30, 60], "queries": [10, 30], "formats": ["json", "pipe"], "seed": 9},
                       {"key_kinds": ["word"], "value_kinds": ["word", "pseudo"], "number_digits": [1, 3]})],
        "copy": [make_generator("copy", o) for o in
                 ({}, {"length": [1, 4], "copies": [1, 3]}, {"length": 200, "units": ["letters", "digits"], "seed": 2},
                  {"cues": ["~~", "\n\n>>\n\n"], "units": "words"})],
    }


def test_generators_are_deterministic_and_take_their_options(tmp_path):
    texts = texts_file(tmp_path)
    for name, gens in all_generators(texts).items():
        again = make_generator(name, gens[0].options_dict())
        assert [gens[0].document(i) for i in range(50)] == [again.document(i) for i in range(50)]
        assert [gens[0].document(i) for i in range(50)] != [gens[1].document(i) for i in range(50)]
        assert gens[0].fingerprint() != gens[1].fingerprint()  # a new token store for new options
        seeded = make_generator(name, {**gens[0].options_dict(), "seed": 11})
        assert seeded.document(3) != gens[0].document(3)
    kv = make_generator("kv_recall", {"pairs": 5, "queries": 3, "formats": ["arrow"]})
    listed, asked = kv.document(0).split("\n\n")
    lines = listed.split("\n")
    assert len(lines) == 5 and len(set(x.split(" -> ")[0] for x in lines)) == 5
    assert len(asked.split("\n")) == 3 and set(asked.split("\n")) <= set(lines)
    cp = make_generator("copy", {"length": 10, "cues": [" || "], "copies": 2})
    parts = cp.document(4).split(" || ")
    assert len(parts) == 3 and parts[0] == parts[1] == parts[2] and len(parts[0].split()) == 10
    rs = make_generator("repeat_span", {"text": str(texts), "first_document": 0, "span_words": 5,
                                        "distance_words": 7})
    for i in range(20):
        words = rs.document(i).split()
        hits = [j for j in range(len(words) - 16) if words[j:j + 5] == words[j + 12:j + 17]]
        assert hits, rs.document(i)  # the span, then 7 words, then the span again


@pytest.mark.parametrize("name, options, message", [
    ("kv_recall", {"pair": 3}, r"has no option 'pair'. Options: seed \(default 0\), pairs \(default \[4, 32\]\)"),
    ("kv_recall", {"pairs": [5, 2]}, r"options.pairs=\[5, 2\] must be a whole number >= 1, or a range"),
    ("kv_recall", {"formats": ["yaml"]}, r"options.formats=\['yaml'\] must be a non-empty list of distinct names from"),
    ("kv_recall", {"pairs": 200, "key_kinds": ["word"]}, "need more distinct 'word' keys"),
    ("copy", {"cues": ["Answer:"]}, "punctuation and whitespace only"),
    ("copy", {"length": 0}, "must be a whole number >= 1"),
    ("repeat_span", {"text": "embedded:essays"}, "never embedded:essays"),
    ("repeat_span", {"span_words": 600, "distance_words": 600}, "exceed max_words=1024"),
    ("lookup", {}, "no such generator. Generators: generator:repeat_span, generator:kv_recall, generator:copy"),
])
def test_bad_generator_options_name_the_key_and_what_is_allowed(name, options, message):
    with pytest.raises(DataError, match=message):
        make_generator(name, options, "data.mix[1]")


def test_draws_use_only_random_random():
    """Draw builds every draw on random.Random(str).random(), whose sequence Python keeps across releases."""
    d, rng = Draw("x", 0, 1), random.Random("x|0|1")
    assert [d.int(3, 9) for _ in range(20)] == [3 + min(int(rng.random() * 7), 6) for _ in range(20)]
    assert d.choice("abc") == "abc"[min(int(rng.random() * 3), 2)]


def niah_strings(tokenizer) -> tuple[set[str], set[tuple[str, ...]]]:
    """The NIAH evaluation's fixed phrasings (from harness.eval.niah itself) and its prompts' 13-grams."""
    from harness.eval.niah import INSTRUCTION, KINDS, make_needle, prompt_frame

    fixed, grams = {INSTRUCTION.strip()} | {s.strip() + "." for s in INSTRUCTION.split(".") if s.strip()}, set()
    for kind in KINDS:
        for i in range(200):
            n = make_needle(kind, random.Random(i))
            fixed |= {n.text.strip(), n.question, n.answer_prefix}
            pieces = [n.text, n.question, n.answer_prefix]
            tail = tokenizer.decode(prompt_frame(tokenizer, n, "plain")[1])
            pieces.append(tail.replace(n.question, "\x00").replace(n.answer_prefix, "\x00"))
            for piece in pieces:  # the template around the key and value: "The pass key is", "Question:", ...
                for fragment in re.split(re.escape(n.value) + ("|" + re.escape(n.key) if n.key else "") + "|\x00",
                                         piece):
                    if len(fragment.split()) >= 2 or (fragment.strip().endswith(":") and len(fragment.strip()) > 5):
                        fixed.add(fragment.strip())  # not a bare "is:"
            words = (INSTRUCTION + " " + n.text + " " + tail).lower().split()
            grams |= {tuple(words[j:j + 13]) for j in range(len(words) - 12)}
    return {f for f in fixed if f}, grams


def test_no_generated_document_uses_a_niah_template(tmp_path, tokenizer):
    from harness.eval.niah import _ADJECTIVES, _NOUNS

    fixed, grams = niah_strings(tokenizer)
    assert {"The pass key is", "Question:", "Answer:", "What is the pass key?"} <= fixed  # the harvest found them
    assert not (set(WORDS) & (set(_ADJECTIVES) | set(_NOUNS)))
    niah_key = re.compile(r"\b(" + "|".join(_ADJECTIVES) + r")-(" + "|".join(_NOUNS) + r")\b", re.IGNORECASE)
    templates = re.compile("|".join(re.escape(f.lower()) for f in sorted(fixed, key=len)))
    rendered = 0
    for name, gens in all_generators(texts_file(tmp_path, 400)).items():
        per = 2000 // len(gens) + 1
        for g in gens:
            for i in range(per):
                doc = g.document(i)
                low = doc.lower()
                hit = templates.search(low)
                assert hit is None, (name, i, hit, doc[:300])
                assert not niah_key.search(doc), (name, i, doc[:300])
                words = low.split()
                assert not {tuple(words[j:j + 13]) for j in range(len(words) - 12)} & grams
                rendered += 1
    assert rendered >= 3 * 2000


# ------------------------------------------------------------------------------------------------ reporting, config


def test_data_prepare_prints_each_sources_accounting(setting, second_corpus, tokenizer, monkeypatch, capsys):
    from harness.cli import main

    job = mix_job(setting, second_corpus, WEIGHTS["50/30/20"])
    text = prepare_summary(job, tokenizer)
    report = prepare_job_corpus(job, tokenizer).budget(job)
    assert "# data mix: sequences per source and stage" in text
    for s in report.sources:
        row = next(line for line in text.splitlines() if line.strip().startswith(short_label(s.label, 27)))
        assert f"{s.share:.2%}" in row and f"{s.sequences * 32:,}" in row and f"{s.available:,}" in row
    assert "generator:kv_recall document 0:" in text
    # the command itself (the embedded corpus's summary stubbed: it would download it into this cache)
    monkeypatch.setattr("harness.data.embedded_summary", lambda cache_dir=None: "# embedded corpus: (not built here)")
    job_file = setting / "mix.yaml"
    job_file.write_text(f"teacher:\n  source: {setting / 'teacher'}\ndata:\n  seq_len: 32\n  validation_tokens: 256\n"
                        f"  cache_dir: {setting / 'cache'}\n  num_proc: 1\nbudget:\n  total_tokens: 40960\n")
    assert main(["data", "prepare", str(job_file), entries(setting, second_corpus, WEIGHTS["50/30/20"]),
                 *(f"stages.{s}.micro_batch_size=2" for s in ("align_mixer", "align_hidden", "distill"))]) == 0
    out = capsys.readouterr().out
    assert "# data mix: sequences per source and stage" in out and "generator:kv_recall" in out
    assert text.splitlines()[-8:] == out.strip().splitlines()[-8:]


def test_the_mix_plan_needs_no_data_and_matches_the_report(setting, second_corpus, tokenizer):
    from harness.data.mix import plan_summary

    job = mix_job(setting, second_corpus, WEIGHTS["50/30/20"])
    text = plan_summary(job)
    for s in prepare_job_corpus(job, tokenizer).budget(job).sources:
        row = next(line for line in text.splitlines() if line.strip().startswith(short_label(s.label, 27)))
        assert [f"{n:,} ({n * 32:,})" for n in s.stage_sequences] == re.findall(r"[\d,]+ \([\d,]+\)", row)
    assert plan_summary(tiny_job(setting, setting / "out")) == ""


def test_mix_config_errors_name_the_entry(setting):
    gen = "{source: 'generator:copy', weight: 0.5}"
    base = ["data.source=embedded"]
    cases = [
        (["data.mix=[{source: embedded, weight: 1}]"], "data.source=.* and data.mix are both set", False),
        ([f"data.mix=[{{source: embedded, weight: 0}}, {gen}]"],
         r"data.mix\[0\] \(embedded\) has weight 0 in every stage", True),
        ([f"data.mix=[{{source: embedded, weight: -1}}, {gen}]"], r"data.mix\[0\].weight=-1.0 must be >= 0", True),
        ([f"data.mix=[{{source: embedded, stage_weights: {{stage1: 1}}}}, {gen}]"],
         r"data.mix\[0\].stage_weights has 'stage1': the stages that read data.mix are align_mixer, align_hidden, "
         "distill", True),
        ([f"data.mix=[{{source: embedded, stage_weights: {{distill: -0.5}}}}, {gen}]"],
         r"data.mix\[0\].stage_weights.distill=-0.5 must be >= 0", True),
        ([f"data.mix=[{{source: embedded, weight: 0, stage_weights: {{distill: 0}}}}, {gen}]"],
         "has weight 0 in every stage", True),
        (["data.mix=[{source: 'generator:lookup'}]"], r"data.mix\[0\].source='generator:lookup': no such generator",
         True),
        (["data.mix=[{source: embedded}, {source: 'generator:copy', options: {lenght: 3}}]"],
         r"data.mix\[1\].options has no option 'lenght'", True),
        (["data.mix=[{source: embedded, options: {pairs: 3}}]"], r"options are for generators", True),
        (["data.mix=[{source: embedded}, {source: 'generator:copy', text_field: body}]"], "leave text_field null",
         True),
        ([f"data.mix=[{gen}, {gen}]"], r"data.mix\[1\] repeats data.mix\[0\]", True),
        ([f"data.mix=[{gen}]"], "only generators, and validation never runs on synthetic text", True),
        (["data.mix=[{sourc: embedded}]"],
         r"Bad entry in data.mix.*'sourc'.*keys: source, weight, stage_weights, text_field", True),
        (["data.source=generator:copy"], "a generator is a source of data.mix only", True),
        (["data.mix=[{source: /no/such/file.jsonl}]"], r"data.mix\[0\].source='/no/such/file.jsonl' looks like", True),
    ]
    for overrides, message, reset in cases:
        with pytest.raises(ConfigError, match=message):
            tiny_job(setting, setting / "out", *(base if reset else []), *overrides)
    ok = tiny_job(setting, setting / "out", *base, f"data.mix=[{gen}]", "data.validation_tokens=0")
    assert ok.data.mix[0].options == {}


def test_repeat_span_never_reads_the_validation_head(setting, tokenizer):
    corpus = setting / "corpus.jsonl"
    mix = (f"data.mix=[{{source: {corpus}, weight: 0.8}}, {{source: 'generator:repeat_span', weight: 0.2, "
           f"options: {{text: '{corpus}', first_document: %d, span_words: [2, 4], distance_words: [0, 8]}}}}]")
    with pytest.raises(DataError, match=r"first_document=0 on, but validation holds out its first \d+ documents"):
        prepare_job_corpus(tiny_job(setting, setting / "out", "data.source=embedded", mix % 0), tokenizer)
    corpus_ok = prepare_job_corpus(tiny_job(setting, setting / "out", "data.source=embedded", mix % 100), tokenizer)
    assert corpus_ok.parts[1].train.num_sequences == corpus_ok.budget(
        tiny_job(setting, setting / "out", "data.source=embedded", mix % 100)).sources[1].sequences


def test_a_stage_one_group_trains_on_a_mix_with_generators(setting, second_corpus):
    from harness.stages.align import align_group
    from harness.stages.common import group_dir

    job = tiny_job(setting, setting / "run", "data.source=embedded", entries(setting, second_corpus, (0.7, 0.2, 0.1)),
                   f"data.cache_dir={setting / 'cache'}", "stages.align_mixer.tokens=1024")
    align_group(job, "align_mixer", [0, 1])
    rows = [json.loads(x) for x in (group_dir(job, "align_mixer", [0, 1]) / "metrics.jsonl").read_text().splitlines()]
    assert rows and rows[-1]["step"] == 1024 // (2 * 32) and all(np.isfinite(r["loss"]) for r in rows)


def test_generator_registry_and_docs_agree():
    readme = (Path(__file__).parents[1] / "docs" / "DATA.md").read_text()
    for name, cls in GENERATORS.items():
        assert f"generator:{name}" in readme
        for opt in cls.Options.__dataclass_fields__:
            assert f"`{opt}`" in readme, (name, opt)


def test_harness_info_prints_the_mix_plan(capsys):
    from harness.cli import main

    assert main(["info", "jobs/quickstart.yaml", "data.mix=[{source: embedded, weight: 0.9}, "
                 "{source: 'generator:kv_recall', weight: 0.1}]"]) == 0
    out = capsys.readouterr().out
    assert "# data mix plan" in out and "generator:kv_recall" in out and "10.00%" in out
