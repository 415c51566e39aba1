"""Verifiable instructions, checked by the IFEval checkers of the PyPI library `if-verifiable` 0.1.2 (Google's
IFEval instruction classes, Apache-2.0): which instruction ids run offline, which pairs conflict, and whether a
response follows each instruction of a prompt, strictly and loosely.

    INSTRUCTION_IDS                       the ids of the library's IFEval registry usable here (see OFFLINE_ONLY)
    check_instructions(ids, kwargs)       ValueError naming an unknown id, a kwarg the checker lacks or one it
                                          would draw at random (a checker fills unset arguments with random values)
    conflicting(a, b)                     whether two ids may not share a prompt (the library's conflict table,
                                          made symmetric as IFEval does)
    follow(prompt, ids, kwargs, response) -> one Verdict (strict, loose) per instruction

Strict: the checker on the response as it is. Loose: the checker on any of IFEval's eight variants of the response
(without its first and/or last line, without markdown asterisks). Both come from the library's
`evaluate_instructions`; an empty response follows no instruction (the library then returns no results at all,
which here counts as a miss per instruction). langdetect, which the language and case checkers call, draws random
numbers: its seed is fixed (DetectorFactory.seed = 0) so that the same response gets the same verdict every time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

LIBRARY = "if-verifiable==0.1.2"
# the two checkers that load NLTK's punkt sentence tokenizer, a data download from GitHub (not PyPI): not offline
OFFLINE_ONLY = {
    "length_constraints:number_sentences": "counts sentences with NLTK's punkt model (nltk.download, not on PyPI)",
    "change_case:capital_word_frequency": "tokenises words with NLTK's punkt model (nltk.download, not on PyPI)",
}


@dataclass(frozen=True)
class Verdict:
    """Whether a response follows one instruction: strictly (as it is) and loosely (IFEval's relaxed variants)."""

    instruction_id: str
    strict: bool
    loose: bool


@lru_cache(maxsize=1)
def _registry() -> dict[str, Any]:
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_DICT

    return dict(INSTRUCTION_DICT)


@lru_cache(maxsize=1)
def _conflicts() -> dict[str, frozenset[str]]:
    """The library's INSTRUCTION_CONFLICTS made symmetric (A conflicts with B -> B with A; each with itself), on a
    copy: the library's own table is left as it is."""
    from if_verifiable.ifeval.instructions_registry import INSTRUCTION_CONFLICTS

    table = {k: set(v) | {k} for k, v in INSTRUCTION_CONFLICTS.items()}
    for key, others in list(table.items()):
        for other in others:
            table.setdefault(other, {other}).add(key)
    return {k: frozenset(v) for k, v in table.items()}


def instruction_ids() -> tuple[str, ...]:
    """The IFEval instruction ids of the library that run offline, in the library's order."""
    return tuple(i for i in _registry() if i not in OFFLINE_ONLY)


def conflicting(a: str, b: str) -> bool:
    """Whether instructions `a` and `b` may not be given together (the library's conflict table)."""
    return b in _conflicts().get(a, frozenset({a}))


def _checker(instruction_id: str, kwargs: Mapping[str, Any], prompt: str = "") -> Any:
    """The library's checker of `instruction_id`, built with `kwargs` (and the prompt, where it takes one)."""
    checker = _registry()[instruction_id](instruction_id)
    checker.build_description(**{k: v for k, v in kwargs.items() if v is not None})
    args = checker.get_instruction_args()
    if args and "prompt" in args:
        checker.build_description(prompt=prompt)
    return checker


def check_instructions(ids: Sequence[str], kwargs: Sequence[Mapping[str, Any]], where: str = "") -> None:
    """ValueError naming `where` when an id is not usable here, `kwargs` does not hold one mapping per id, a key is
    no argument of its checker, or an argument is left for the checker to draw at random."""
    usable = instruction_ids()
    if len(ids) != len(kwargs):
        raise ValueError(f"{where}: {len(ids)} instruction ids but {len(kwargs)} kwargs mappings (one per id).")
    for instruction_id, args in zip(ids, kwargs):
        if instruction_id not in usable:
            why = OFFLINE_ONLY.get(instruction_id, "not an IFEval instruction id of " + LIBRARY)
            raise ValueError(f"{where}: instruction '{instruction_id}' cannot be checked here ({why}). Usable: "
                             f"{', '.join(usable)}.")
        try:
            built = _checker(instruction_id, args).get_instruction_args() or {}
        except TypeError as err:
            raise ValueError(f"{where}: {instruction_id} takes no such argument ({err}).") from None
        drawn = sorted(k for k in built if args.get(k) is None or args.get(k) in ([], ""))
        if drawn:
            raise ValueError(f"{where}: {instruction_id} leaves {', '.join(drawn)} unset; its checker would draw them "
                             "at random. Give every argument.")


def follow(prompt: str, ids: Sequence[str], kwargs: Sequence[Mapping[str, Any]], response: str) -> list[Verdict]:
    """Whether `response` follows each instruction of a prompt (ids with their kwargs), by the library's checkers."""
    import langdetect
    from if_verifiable.common import evaluate_instructions

    langdetect.DetectorFactory.seed = 0
    results, _ = evaluate_instructions(response=response, instruction_id_list=list(ids),
                                       kwargs_list=[dict(k) for k in kwargs], prompt=prompt,
                                       instruction_registry=_registry())
    if not results:  # an empty response: the library scores it 0 and returns no per-instruction results
        return [Verdict(i, False, False) for i in ids]
    if [r.instruction_id for r in results] != list(ids):
        raise ValueError(f"if-verifiable skipped instructions of {list(ids)} (unknown ids); check_instructions first.")
    return [Verdict(r.instruction_id, bool(r.strict_pass), bool(r.loose_pass)) for r in results]
