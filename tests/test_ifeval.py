"""The instruction-following evaluation (harness.eval.tasks.ifeval): its prompt set, its scorer through if-verifiable's
checkers, and the task in the evaluation job, the report, the paired differences and the curves.

The scorer is tested against the library, not against this harness: for every instruction the prompt set uses
(each id with each of its arguments), a response written here to follow it scores 100% (prompt and instruction
level, strict and loose) and one written to break it scores 0%. The job test runs a tiny student and teacher on
three prompts with a few new tokens each (plain prompts: the tiny tokenizer has no chat template).
"""

from __future__ import annotations

import json

import pytest

from harness.cli import main as harness_main
from harness.config import ConfigError
from harness.eval import curves, tasks
from harness.eval.ifeval_prompts import EXTRA_CONFLICTS, IfevalPrompt, prompt_set, prompt_set_digest, prompt_texts
from harness.eval.spec import load_eval_spec, write_eval_spec
from harness.eval.tasks.ifeval import (INSTRUCTION_LOOSE, INSTRUCTION_STRICT, PROMPT_LOOSE, PROMPT_STRICT,
                                       RECORDS_FILE, results_of, score)
from harness.eval.verifiable import OFFLINE_ONLY, check_instructions, conflicting, follow, instruction_ids
from tests.pipeline import eval_run, tiny_job

LANGUAGE_SAMPLES = {
    "fr": "Ceci est une réponse écrite entièrement en français pour vérifier la langue du texte et rien d'autre.",
    "es": "Esta es una respuesta escrita completamente en español para comprobar el idioma del texto y nada más.",
    "de": "Dies ist eine Antwort, die vollständig auf Deutsch geschrieben ist, um die Sprache des Textes zu prüfen.",
    "it": "Questa è una risposta scritta interamente in italiano per verificare la lingua del testo e nient'altro.",
    "pt": "Esta é uma resposta escrita inteiramente em português para verificar o idioma do texto e mais nada.",
}


def following(iid: str, kw: dict) -> str:
    """A response written to follow instruction `iid` with arguments `kw`."""
    n = kw.get("num_paragraphs") or kw.get("num_bullets") or kw.get("num_highlights") or kw.get("num_sections") \
        or kw.get("num_placeholders") or 0
    at_least = "at least" in (kw.get("relation"), kw.get("let_relation"))
    return {
        "keywords:existence": lambda: " ".join(kw.get("keywords", [])) + " appear in this calm reply.",
        "keywords:frequency": lambda: (f"{kw.get('keyword')} " * kw.get("frequency", 0) if at_least else "") + "end",
        "keywords:forbidden_words": lambda: "a calm reply without those words",
        "keywords:letter_frequency": lambda: (kw.get("letter", "") * kw.get("let_frequency", 0) if at_least else "")
        + " ok",
        "language:response_language": lambda: LANGUAGE_SAMPLES.get(kw.get("language"), ""),
        "length_constraints:number_paragraphs": lambda: " *** ".join(f"Paragraph {i} is here." for i in range(n)),
        "length_constraints:number_words": lambda: "word " * kw.get("num_words", 0) if at_least else "a few words",
        "length_constraints:nth_paragraph_first_word": lambda: "\n\n".join(
            f"{kw.get('first_word')} begins this." if i + 1 == kw.get("nth_paragraph") else "Plain paragraph."
            for i in range(n)),
        "detectable_content:number_placeholders": lambda: " ".join(f"[slot {i}]" for i in range(n)),
        "detectable_content:postscript": lambda: f"Main text.\n\n{kw.get('postscript_marker')} A note.",
        "detectable_format:number_bullet_lists": lambda: "\n".join(f"* point {i}" for i in range(n)),
        "detectable_format:constrained_response": lambda: "My answer is yes.",
        "detectable_format:number_highlighted_sections": lambda: " ".join(f"*part {i}*" for i in range(n)),
        "detectable_format:multiple_sections": lambda: "\n".join(f"{kw.get('section_spliter')} {i + 1}\ncontent"
                                                                 for i in range(n)),
        "detectable_format:json_format": lambda: '{"answer": "yes"}',
        "detectable_format:title": lambda: "<<A title>>\nSome text.",
        "combination:two_responses": lambda: "First answer.\n******\nSecond answer.",
        "combination:repeat_prompt": lambda: f"{kw.get('prompt_to_repeat')}\nMy answer.",
        "startend:end_checker": lambda: f"Some text. {kw.get('end_phrase')}",
        "change_case:english_capital": lambda: "THIS IS A FULL ENGLISH SENTENCE WRITTEN IN CAPITAL LETTERS TODAY.",
        "change_case:english_lowercase": lambda: "this is a full english sentence written in lowercase letters today.",
        "punctuation:no_comma": lambda: "a sentence without any commas",
        "startend:quotation": lambda: '"a quoted reply"',
    }[iid]()


def breaking(iid: str, kw: dict) -> str:
    """A response written to break instruction `iid` with arguments `kw`, also under IFEval's loose variants (one line,
    no asterisks where they would count)."""
    n = kw.get("num_paragraphs") or 0
    at_least = "at least" in (kw.get("relation"), kw.get("let_relation"))
    return {
        "keywords:existence": lambda: "a sentence that names none of them",
        "keywords:frequency": lambda: "none here" if at_least else f"{kw.get('keyword')} " * kw.get("frequency", 0),
        "keywords:forbidden_words": lambda: " ".join(kw.get("forbidden_words", [])),
        "keywords:letter_frequency": lambda: "xyz" if at_least else kw.get("letter", "") * kw.get("let_frequency", 0),
        "language:response_language": lambda: "This reply is written in plain English for the test and nothing else.",
        "length_constraints:number_paragraphs": lambda: " *** ".join(f"Paragraph {i}." for i in range(n + 1)),
        "length_constraints:number_words": lambda: "too short" if at_least else "word " * kw.get("num_words", 0),
        "length_constraints:nth_paragraph_first_word": lambda: "\n\n".join("Plain paragraph." for _ in range(n)),
        "detectable_content:number_placeholders": lambda: "no slots here",
        "detectable_content:postscript": lambda: "main text only",
        "detectable_format:number_bullet_lists": lambda: "no bullets here",
        "detectable_format:constrained_response": lambda: "Yes.",
        "detectable_format:number_highlighted_sections": lambda: "nothing marked",
        "detectable_format:multiple_sections": lambda: "no parts",
        "detectable_format:json_format": lambda: "not json at all",
        "detectable_format:title": lambda: "no title here",
        "combination:two_responses": lambda: "only one response",
        "combination:repeat_prompt": lambda: "My answer first.",
        "startend:end_checker": lambda: "Some text that ends otherwise.",
        "change_case:english_capital": lambda: "this is lowercase english text for the test.",
        "change_case:english_lowercase": lambda: "This Is Mixed Case English Text For The Test.",
        "punctuation:no_comma": lambda: "a, b",
        "startend:quotation": lambda: "not quoted",
    }[iid]()


def single_instructions() -> list[IfevalPrompt]:
    """Every instruction of the prompt set (id and arguments) once, as a prompt of its own."""
    seen, out = set(), []
    for p in prompt_set():
        for iid, kw in zip(p.instruction_ids, p.kwargs):
            key = (iid, json.dumps(kw, sort_keys=True))
            if key not in seen:
                seen.add(key)
                out.append(IfevalPrompt(f"one{len(out)}", p.prompt, (iid,), (kw,)))
    return out


# ---------------------------------------------------------------------------------------------- the prompt set


def test_the_prompt_set_is_fixed_valid_and_uses_every_offline_checker():
    prompts = prompt_set()
    assert len(prompts) == 150 and len({p.id for p in prompts}) == 150 and len({p.prompt for p in prompts}) == 150
    assert prompt_set_digest() == prompt_set_digest() and len(prompt_texts()) >= 150
    used = {i: 0 for i in instruction_ids()}
    for p in prompts:
        assert 1 <= len(p.instruction_ids) <= 3
        check_instructions(p.instruction_ids, p.kwargs, p.id)  # every argument given: no checker draws at random
        for a in p.instruction_ids:
            used[a] += 1
            assert not any(a != b and (conflicting(a, b) or frozenset({a, b}) in EXTRA_CONFLICTS)
                           for b in p.instruction_ids), p
    assert min(used.values()) >= 10 and not set(used) & set(OFFLINE_ONLY)
    repeat = [p for p in prompts if "combination:repeat_prompt" in p.instruction_ids]
    assert repeat and all(p.prompt.startswith(p.kwargs[-1]["prompt_to_repeat"]) for p in repeat)
    with pytest.raises(ValueError, match="leaves keywords unset"):
        check_instructions(["keywords:existence"], [{}], "x")
    with pytest.raises(ValueError, match="cannot be checked here .*punkt"):
        check_instructions(["length_constraints:number_sentences"], [{"num_sentences": 3, "relation": "at least"}])


def test_the_scorer_gives_full_marks_to_followed_and_none_to_broken_instructions():
    """Through if-verifiable's checkers: 100% for responses written to follow each instruction, 0% for ones that
    break it, at the prompt and the instruction level, strict and loose; an empty response follows nothing."""
    singles = single_instructions()
    assert {p.instruction_ids[0] for p in singles} == set(instruction_ids())
    for make, expected in ((following, 1.0), (breaking, 0.0)):
        records = [{"id": p.id, **score(p, make(p.instruction_ids[0], p.kwargs[0]))} for p in singles]
        wrong = [(p.instruction_ids[0], p.kwargs[0]) for p, r in zip(singles, records)
                 if r["strict"] + r["loose"] != [bool(expected)] * 2]
        assert not wrong, f"{make.__name__}: {wrong}"
        results = results_of(records, {})
        for name in (PROMPT_STRICT, PROMPT_LOOSE, INSTRUCTION_STRICT, INSTRUCTION_LOOSE):
            assert results.score(name).value == expected and results.score(name).n == len(singles)
    two = prompt_set()[10]
    assert [v.strict for v in follow(two.prompt, two.instruction_ids, two.kwargs, "")] == [False] * 3


def test_instruction_level_counts_instructions_not_prompts():
    """Two prompts, one with three instructions all followed, one with one broken: instruction level 3/4, prompt
    level 1/2; the instruction-level interval bootstraps prompts (a ratio within [0.6, 1])."""
    records = [{"id": "a", "strict": [True, True, True], "loose": [True, True, True]},
               {"id": "b", "strict": [False], "loose": [True]}]
    results = results_of(records, {})
    assert results.score(PROMPT_STRICT).value == 0.5 and results.score(INSTRUCTION_STRICT).value == 0.75
    assert results.score(INSTRUCTION_LOOSE).value == 1.0 and results.score(INSTRUCTION_STRICT).n == 4
    low, high = results.score(INSTRUCTION_STRICT).interval
    assert 0.0 <= low <= 0.75 <= high <= 1.0
    assert set(results.examples[INSTRUCTION_STRICT]) == {"a/0", "a/1", "a/2", "b/0"}


# ---------------------------------------------------------------------------------------------- the job


def test_ifeval_is_off_by_default_and_a_job_turns_it_on(tmp_path):
    from omegaconf import OmegaConf

    from harness.eval.during import write_during_spec

    plain = tiny_job(tmp_path, tmp_path / "plain")
    assert plain.eval.ifeval is None
    (tmp_path / "plain" / "student").mkdir(parents=True)
    spec = load_eval_spec(write_eval_spec(plain, tmp_path / "plain" / "student"))
    assert not tasks.get_task("ifeval").wanted(spec)
    job = tiny_job(tmp_path, tmp_path / "on", "eval.ifeval={max_new_tokens: 64, during_prompts: 5}")
    (tmp_path / "on" / "student").mkdir(parents=True)
    spec = load_eval_spec(write_eval_spec(job, tmp_path / "on" / "student"))
    settings = tasks.get_task("ifeval").settings_of(spec)
    assert settings.max_new_tokens == 64 and settings.prompts is None and settings.prompt == "auto"
    during = OmegaConf.load(write_during_spec(job, tmp_path / "on"))
    assert during.ifeval.prompts == 5 and job.eval.ifeval.prompts is None
    with pytest.raises(ConfigError, match=r"eval\.ifeval\.max_new_tokens=0 must be a positive number"):
        tiny_job(tmp_path, tmp_path / "bad", "eval.ifeval={max_new_tokens: 0}")


def test_ifeval_runs_in_the_evaluation_job_resumes_and_is_reported_and_paired(tmp_path):
    """Run A with its teacher, run B without (the comparison takes A's): two prompts, three new tokens each."""
    setting = "ifeval={prompts: 2, max_new_tokens: 3}"
    runs = [eval_run(tmp_path, "run-a", 0), eval_run(tmp_path, "run-b", 1, "eval.teacher=false")]
    for run in runs:
        assert harness_main(["eval", str(run / "eval.yaml"), setting]) == 0
    out = runs[0] / "eval"
    lines = (out / "student" / RECORDS_FILE).read_text().splitlines()
    header, records = json.loads(lines[0])["header"], [json.loads(line) for line in lines[1:]]
    assert header["prompt_set"] == prompt_set_digest() and header["prompt_mode"] == "plain"
    assert [r["id"] for r in records] == ["if000", "if001"] and all(r["tokens"] <= 3 for r in records)
    report = json.loads((out / "report.json").read_text())
    scores = report["ifeval"]["student"]["scores"]
    assert scores[PROMPT_STRICT]["n"] == 2 and scores[INSTRUCTION_STRICT]["n"] == sum(len(r["strict"]) for r in records)
    assert report["ifeval"]["teacher"]["scores"][PROMPT_LOOSE]["n"] == 2 and "ifeval/" not in json.dumps(report["tasks"])
    assert "## Instruction following" in (out / "report.md").read_text()
    before = (out / "student" / RECORDS_FILE).read_bytes()  # resumed: nothing answered twice
    assert harness_main(["eval", str(runs[0] / "eval.yaml"), setting]) == 0
    assert (out / "student" / RECORDS_FILE).read_bytes() == before
    assert harness_main(["eval", str(runs[0] / "eval.yaml"), "ifeval={prompts: 2, max_new_tokens: 4}"]) == 2
    assert harness_main(["report", *map(str, runs), "--out", str(tmp_path / "cmp"), "--baseline", "run-a"]) == 0
    text = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "Instruction following (IFEval-style prompts, if-verifiable checkers): prompt-level strict | 2 |" in text
    assert curves.METRICS["ifeval_prompt_level_strict"][0](report) == scores[PROMPT_STRICT]["value"]
