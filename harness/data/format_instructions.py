"""The offline instruction subset `embedded:format`: questions of `embedded:qa` asked with verifiable format
constraints, answered with their gold answers rendered so that they satisfy them.

Each constraint (CONSTRAINTS) is an instruction of if-verifiable's IFEval registry with its arguments, stated in
words of this module (not the evaluation's: harness.eval.ifeval_prompts phrases its instructions otherwise) and a
rendering of the answer that follows it: lowercase, capitals, double quotes, a closing phrase, a postscript, a
title in << >>, a JSON object, one markdown bullet, the answer in *asterisks*, the question repeated first, a yes/no
formula (BoolQ only), a word limit, no commas. Example i takes conversation i of a fixed shuffle of the qa subset,
one constraint (odd i) or two that conflict with neither the library's conflict table nor each other's rendering
(even i), drawn by a seeded generator among those that fit the answer. The reply starts from the gold answer as a
sentence ("The answer is C) darwin."; BoolQ's "Yes."/"No." as they are) and each constraint's rendering is applied
in a fixed order. Every example is then checked with the library's checkers (harness.eval.verifiable.follow,
strict): an example that fails one is left out and counted, so the subset is correct by construction.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

FORMAT_EXAMPLES = 8000
SEED = 0
END_PHRASES = ("Hope this helps.", "I hope that answers your question.", "Let me know if anything is unclear.")
NOTES = ("Good luck with your studies.", "Questions like this are fun to think about.", "Feel free to ask another.")


@dataclass(frozen=True)
class Constraint:
    """One format constraint: its instruction id (if-verifiable's IFEval registry), the sentences that ask for it
    ({placeholders}: its arguments), its arguments, where it may be used, and how a reply is made to follow it."""

    instruction_id: str
    phrases: tuple[str, ...]
    order: int  # renderings are applied by ascending order
    render: Callable[[str, dict, str], str]  # (reply, arguments, the question) -> the reply that follows it
    draw: Callable[[random.Random], dict] = lambda rng: {}
    fits: Callable[[str, str], bool] = lambda reply, origin: True  # (the gold reply, its origin)


def _is_boolq(origin: str) -> bool:
    return origin.startswith("qa:boolq:")


CONSTRAINTS = (
    Constraint("detectable_format:title", ("Begin with a short title in double angle brackets, e.g. <<Answer>>.",),
               10, lambda r, a, q: f"<<Answer>>\n\n{r}"),
    Constraint("detectable_format:number_bullet_lists", ("Give the answer as a single markdown bullet starting with "
                                                         "'* '.",),
               10, lambda r, a, q: f"* {r}", lambda rng: {"num_bullets": 1}),
    Constraint("detectable_format:number_highlighted_sections", ("Mark the answer itself in *asterisks*.",),
               5, lambda r, a, q: f"*{r}*", lambda rng: {"num_highlights": 1}),  # before a title: one line
    Constraint("combination:repeat_prompt", ("Before answering, copy my question above exactly as written.",),
               20, lambda r, a, q: f"{q}\n\n{r}"),
    Constraint("detectable_content:postscript", ("After the answer, add a short note that starts with "
                                                 "{postscript_marker}",),
               30, lambda r, a, q: f"{r}\n\n{a['postscript_marker']} {NOTES[len(r) % len(NOTES)]}",
               lambda rng: {"postscript_marker": rng.choice(("P.S.", "P.P.S"))}),
    Constraint("startend:end_checker", ('End your reply with: "{end_phrase}"', 'Your last words must be '
                                        '"{end_phrase}"'),
               40, lambda r, a, q: f"{r} {a['end_phrase']}", lambda rng: {"end_phrase": rng.choice(END_PHRASES)}),
    Constraint("startend:quotation", ("Wrap your reply in double quotes.", "Put the whole reply inside double quotes."),
               50, lambda r, a, q: f'"{r}"'),
    Constraint("change_case:english_lowercase", ("Reply in lowercase letters only.",
                                                 "Use no capital letters in your reply."),
               60, lambda r, a, q: r.lower()),
    Constraint("change_case:english_capital", ("Reply in uppercase letters only.", "Write the reply in all caps."),
               60, lambda r, a, q: r.upper()),
    Constraint("detectable_format:json_format", ('Reply with a JSON object whose "answer" key holds the answer.',),
               70, lambda r, a, q: json.dumps({"answer": r}, ensure_ascii=False)),
    Constraint("detectable_format:constrained_response", ('Say only "My answer is yes." or "My answer is no."',),
               70, lambda r, a, q: "My answer is yes." if r.startswith("Yes") else "My answer is no.",
               fits=lambda reply, origin: _is_boolq(origin)),
    Constraint("length_constraints:number_words", ("Keep the reply under {num_words} words.",),
               80, lambda r, a, q: r, lambda rng: {"num_words": rng.choice((20, 30, 40)), "relation": "less than"},
               fits=lambda reply, origin: len(reply.split()) < 12),
    Constraint("punctuation:no_comma", ("No commas, please.", "Do not put any commas in the reply."),
               80, lambda r, a, q: r, fits=lambda reply, origin: "," not in reply),
)
BY_ID = {c.instruction_id: c for c in CONSTRAINTS}
# renderings that break each other: the opening quote mark moves a bullet's '* ' off the start of its line, and a
# bullet's '* ' before a highlight's '*' reads as an empty highlight ("* *") followed by an unclosed one
RENDERING_CONFLICTS = frozenset({frozenset({"detectable_format:number_bullet_lists", "startend:quotation"}),
                                 frozenset({"detectable_format:number_bullet_lists",
                                            "detectable_format:number_highlighted_sections"})})


def _compatible(a: str, b: str) -> bool:
    from harness.eval.verifiable import conflicting

    return not conflicting(a, b) and frozenset({a, b}) not in RENDERING_CONFLICTS


def _pick(count: int, reply: str, question: str, origin: str, rng: random.Random) -> list[Constraint]:
    """Up to `count` compatible constraints that fit the example, drawn by `rng`."""
    fitting = [c for c in CONSTRAINTS if c.fits(reply, origin)
               and not (c.instruction_id == "punctuation:no_comma" and "," in question)]
    rng.shuffle(fitting)
    chosen: list[Constraint] = []
    for c in fitting:
        if len(chosen) < count and all(_compatible(c.instruction_id, d.instruction_id) for d in chosen):
            chosen.append(c)
    return chosen


def _sentence(reply: str, origin: str) -> str:
    """The gold reply as the sentence the renderings start from."""
    return reply if _is_boolq(origin) else f"The answer is {reply.rstrip('.')}."


def format_example(conv: dict, count: int, rng: random.Random) -> tuple[dict, list[str], list[dict]]:
    """One constrained conversation from a qa conversation: (conversation, instruction ids, their arguments)."""
    question, reply = conv["messages"][0]["content"], conv["messages"][1]["content"]
    return constrained(conv, _pick(count, reply, question, conv["origin"], rng), rng)


def constrained(conv: dict, chosen: list[Constraint], rng: random.Random) -> tuple[dict, list[str], list[dict]]:
    """A qa conversation asked with the `chosen` constraints (their arguments and wording drawn by `rng`) and its
    reply rendered to follow them: (conversation, instruction ids, their arguments)."""
    question, reply = conv["messages"][0]["content"], conv["messages"][1]["content"]
    chosen = sorted(chosen, key=lambda c: c.order)
    args = [c.draw(rng) for c in chosen]
    for i, c in enumerate(chosen):
        if c.instruction_id == "combination:repeat_prompt":
            args[i] = {"prompt_to_repeat": question}
    asks = " ".join(rng.choice(c.phrases).format(**a) for c, a in zip(chosen, args))
    response = _sentence(reply, conv["origin"])
    for c, a in zip(chosen, args):
        response = c.render(response, a, question)
    user = f"{question}\n\n{asks}"
    return ({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": response}],
             "origin": "format:" + conv["origin"]}, [c.instruction_id for c in chosen], args)


def format_conversations(qa: list[dict], examples: int = FORMAT_EXAMPLES, seed: int = SEED) -> tuple[list[dict], dict]:
    """Up to `examples` constrained conversations from `qa` (in a fixed shuffle), each checked with if-verifiable;
    and their counts per instruction id, with the examples left out because a check failed."""
    from harness.data.order import permutation
    from harness.eval.verifiable import LIBRARY, follow

    rng = random.Random(seed)
    convs, used, failed = [], {}, {}
    for n, i in enumerate(permutation(len(qa), seed)[:examples]):
        conv, ids, args = format_example(qa[int(i)], 1 + n % 2, rng)
        messages = conv["messages"]
        verdicts = follow(messages[0]["content"], ids, args, messages[1]["content"])
        if not all(v.strict for v in verdicts):
            for v in verdicts:
                if not v.strict:
                    failed[v.instruction_id] = failed.get(v.instruction_id, 0) + 1
            continue
        convs.append(conv)
        for instruction_id in ids:
            used[instruction_id] = used.get(instruction_id, 0) + 1
    return convs, {"checker": LIBRARY, "drawn": min(examples, len(qa)), "seed": seed,
                   "by_instruction": dict(sorted(used.items())), "left_out_failed_check": dict(sorted(failed.items()))}

