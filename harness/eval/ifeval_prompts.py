"""The prompts of the instruction-following evaluation (harness.eval.tasks.ifeval): IFEval-style requests written
for this harness, each with 1 to 3 verifiable instructions that if-verifiable's IFEval checkers score
(harness.eval.verifiable).

Google's IFEval prompt set is a Hugging Face dataset, not reachable offline, so the prompts are made here from two
hand-written parts: requests (WRITING_REQUESTS: short writing tasks on everyday, science, history and work topics;
YES_NO_QUESTIONS for the one instruction that wants a fixed yes/no answer) and, per instruction id, sentences
that state the instruction (PHRASES), filled with arguments drawn from small hand-written pools (`_draw`). A fixed
seed picks, for prompt i, request i (cycling), how many instructions (1, 2 or 3 in turn), and which: the least used
ids so far that conflict with none already chosen (the library's conflict table and EXTRA_CONFLICTS), ties broken by
the seeded generator. Every 12th prompt is a yes/no question with the constrained-response instruction alone.
`prompt_set()` is therefore the same list on every machine and Python version; `prompt_set_digest()` names it, and
results record it, so that two runs pair only over the same prompts.

Held apart from training: the training data's format constraints (harness.data.format_instructions) are phrased
in other words, no request is built from a training source, and every prompt is among the evaluation texts of the
13-gram check (harness.data.mixed.evaluation_texts) that every offline training subset passes.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable

SEED = 53
PROMPTS = 150
YES_NO_EVERY = 12  # every 12th prompt: a yes/no question with detectable_format:constrained_response alone
COUNTS = (1, 2, 3, 2)  # instructions per prompt, in turn (1.75 on average, as IFEval's 1.54 and IFBench's ~1.6)

WRITING_REQUESTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold to a ten-year-old.",
    "Write a product description for a reusable water bottle made of bamboo.",
    "Describe a typical day in the life of a medieval blacksmith.",
    "Write a letter to a neighbour asking them to water your plants while you travel.",
    "Give advice to a student who is nervous about their first job interview.",
    "Summarise the causes of the French Revolution for a history class.",
    "Write a poem about the first snowfall of winter.",
    "Explain why the sky looks red at sunset.",
    "Write a review of an imaginary restaurant that serves only soup.",
    "Describe the water cycle and why it matters for farming.",
    "Write a speech for a school principal welcoming students back after the summer.",
    "Plan a three-day walking trip through a mountain region for a family.",
    "Explain the difference between weather and climate.",
    "Write a cover letter for a job as a museum guide.",
    "Describe how bees make honey.",
    "Write a dialogue between a cat and a dog arguing about who is the better pet.",
    "Give tips for keeping a small vegetable garden on a balcony.",
    "Explain how a bicycle gear system works.",
    "Write a diary entry of a sailor crossing the Atlantic in the year 1850.",
    "Describe the benefits and risks of working from home.",
    "Write an advertisement for a town library's summer reading club.",
    "Explain what a budget is and how a teenager could start one.",
    "Write a fairy tale about a clockmaker who can stop time for one minute a day.",
    "Describe the life cycle of a butterfly.",
    "Write a complaint to a train company about a cancelled journey.",
    "Explain how vaccines help the body fight disease.",
    "Write a guide to making a simple loaf of bread at home.",
    "Describe the city you would build on the Moon.",
    "Write a thank-you note to a teacher who helped you learn to read.",
    "Explain why recycling paper saves energy.",
    "Write a news report about a lost dog that found its way home after a month.",
    "Give a beginner an overview of how to play chess.",
    "Describe the sounds of a busy market in the early morning.",
    "Write a limerick about a forgetful wizard.",
    "Explain how rainbows form.",
    "Write a proposal for adding more trees to a school playground.",
    "Describe what makes a good team captain.",
    "Write the opening scene of a mystery set on a night train.",
    "Explain what causes the seasons on Earth.",
    "Write an email inviting colleagues to a farewell lunch for a retiring manager.",
    "Describe how to care for a pet goldfish.",
    "Explain how a volcano erupts.",
    "Write a song about a long road trip with friends.",
    "Give reasons why people should learn a second language.",
    "Describe the inside of an old attic full of forgotten things.",
    "Explain how compound interest works with a simple example.",
    "Write a tourist brochure for an imaginary island with purple beaches.",
    "Describe the role of the heart in the human body.",
    "Write a bedtime story about a cloud that is afraid of heights.",
    "Explain the rules of a game you invent that uses only a ball and a wall.",
    "Write a short biography of an imaginary inventor from the 1800s.",
    "Describe how to prepare for a long hike in hot weather.",
    "Explain why the Moon has phases.",
    "Write a motivational message for runners before a marathon.",
    "Describe a robot that helps elderly people at home.",
    "Write a recipe for a vegetable soup that children will like.",
    "Explain how electricity reaches a house from a power station.",
    "Write a story about two friends who build a raft.",
    "Describe the advantages of travelling by train instead of by plane.",
    "Explain how a seed grows into a plant.",
    "Write a welcome message for new members of a chess club.",
    "Describe an ideal weekend in a small seaside town.",
    "Explain what a map scale is and how to use one.",
)
YES_NO_QUESTIONS = (
    "Is it a good idea to drink water during a long run?",
    "Can penguins fly?",
    "Should children learn to swim at a young age?",
    "Is the Sun a star?",
    "Would you recommend reading before going to sleep?",
    "Is it safe to look directly at the Sun?",
    "Do plants need light to grow?",
    "Is a tomato a fruit?",
    "Should a city build more bicycle lanes?",
    "Can sound travel through space?",
    "Is it useful to write a shopping list before going to the shop?",
    "Do whales breathe air?",
    "Is it wise to back up important files?",
)

# One or two sentences per instruction id; {placeholders} are the instruction's arguments (see `_draw`).
PHRASES: dict[str, tuple[str, ...]] = {
    "keywords:existence": ("Make sure the words {w0} and {w1} appear in your answer.",
                           "Use the words {w0} and {w1} somewhere in the text."),
    "keywords:frequency": ("Use the word {keyword} {relation} {frequency} times.",
                           "The word {keyword} should occur {relation} {frequency} times in what you write."),
    "keywords:forbidden_words": ("Do not use the words {w0} or {w1}.",
                                 "Avoid the words {w0} and {w1} entirely."),
    "keywords:letter_frequency": ("The letter {letter} should appear {let_relation} {let_frequency} times in your "
                                  "response.",),
    "language:response_language": ("Write your whole answer in {language_name}; no other language is allowed.",
                                   "Respond only in {language_name}."),
    "length_constraints:number_paragraphs": ("Write exactly {num_paragraphs} paragraphs, separated from each other "
                                             "by the markdown divider ***.",),
    "length_constraints:number_words": ("Your response should contain {relation} {num_words} words.",
                                        "Use {relation} {num_words} words."),
    "length_constraints:nth_paragraph_first_word": (
        "Write {num_paragraphs} paragraphs separated by two new lines, and start paragraph {nth_paragraph} with "
        "the word {first_word}.",),
    "detectable_content:number_placeholders": (
        "Include at least {num_placeholders} placeholders in square brackets, like [name].",
        "Leave at least {num_placeholders} placeholders in square brackets, such as [date], for the reader to "
        "fill in."),
    "detectable_content:postscript": ("End with a postscript that starts with {postscript_marker}",
                                      "Add a postscript at the end, starting with {postscript_marker}"),
    "detectable_format:number_bullet_lists": (
        "Format your answer as exactly {num_bullets} markdown bullet points, each on its own line starting with "
        "'* '.",),
    "detectable_format:constrained_response": (
        "Reply with exactly one of these: My answer is yes. / My answer is no. / My answer is maybe.",),
    "detectable_format:number_highlighted_sections": (
        "Highlight at least {num_highlights} parts of your answer with markdown, for example *highlighted part*.",),
    "detectable_format:multiple_sections": (
        "Divide your answer into {num_sections} sections, each starting with {section_spliter} X, like "
        "{section_spliter} 1.",),
    "detectable_format:json_format": ("Give your entire output as JSON; you may wrap it in markdown ticks ```.",),
    "detectable_format:title": ("Give your answer a title wrapped in double angular brackets, like <<my title>>.",),
    "combination:two_responses": ("Give two different answers, separated by six asterisks: ******.",),
    "combination:repeat_prompt": ("First repeat the request above word for word, without changing anything, then "
                                  "give your answer (do not say anything before the repeated request; this "
                                  "sentence is not part of the request).",),
    "startend:end_checker": ('Finish your response with the exact phrase "{end_phrase}" and write nothing after it.',
                             'End your answer with this exact phrase: "{end_phrase}". Nothing may follow it.'),
    "change_case:english_capital": ("Your whole response must be in English and in capital letters only.",),
    "change_case:english_lowercase": ("Write your whole response in English using lowercase letters only; no "
                                      "capital letters at all.",),
    "punctuation:no_comma": ("Do not use any commas in your response.",
                             "Write without a single comma."),
    "startend:quotation": ("Put double quotation marks around your entire response.",),
}

# Pairs the library's conflict table allows that no response can satisfy (the section marker "Section"/"SECTION"
# breaks an all-lowercase or all-capital response) or that make an odd request (an English first word in an answer
# in another language).
EXTRA_CONFLICTS = frozenset({
    frozenset({"change_case:english_lowercase", "detectable_format:multiple_sections"}),
    frozenset({"change_case:english_capital", "detectable_format:multiple_sections"}),
    frozenset({"language:response_language", "length_constraints:nth_paragraph_first_word"}),
})

LANGUAGES = {"fr": "French", "es": "Spanish", "de": "German", "it": "Italian", "pt": "Portuguese"}
KEYWORDS = ("river", "lantern", "harvest", "compass", "orchard", "ladder", "meadow", "whistle", "canvas", "pebble",
            "timber", "beacon")
FREQUENT_WORDS = ("light", "path", "time", "water", "home", "story")
FORBIDDEN = ("very", "really", "basically", "literally", "stuff", "nice")
END_PHRASES = ("Is there anything else I can help with?", "Any other questions?", "That is all for now.",
               "Thank you for reading.")
RELATIONS = ("less than", "at least")


@dataclass(frozen=True)
class IfevalPrompt:
    """One prompt: its id, its text, and its instructions (ids of if-verifiable's IFEval registry and their
    arguments, one mapping per id)."""

    id: str
    prompt: str
    instruction_ids: tuple[str, ...]
    kwargs: tuple[dict, ...] = field(default=())

    def as_dict(self) -> dict:
        return {"id": self.id, "prompt": self.prompt, "instruction_ids": list(self.instruction_ids),
                "kwargs": [dict(k) for k in self.kwargs]}


def _draw(instruction_id: str, rng: random.Random) -> dict[str, Any]:
    """The arguments of one instruction, drawn from the pools above."""
    draws: dict[str, Callable[[], dict[str, Any]]] = {
        "keywords:existence": lambda: {"keywords": sorted(rng.sample(KEYWORDS, 2))},
        "keywords:frequency": lambda: {"keyword": rng.choice(FREQUENT_WORDS), "frequency": rng.randint(2, 4),
                                       "relation": rng.choice(RELATIONS)},
        "keywords:forbidden_words": lambda: {"forbidden_words": sorted(rng.sample(FORBIDDEN, 2))},
        "keywords:letter_frequency": lambda: rng.choice((
            {"letter": rng.choice("eaost"), "let_frequency": rng.randint(8, 20), "let_relation": "at least"},
            {"letter": rng.choice("zxj"), "let_frequency": rng.randint(2, 4), "let_relation": "less than"})),
        "language:response_language": lambda: {"language": rng.choice(sorted(LANGUAGES))},
        "length_constraints:number_paragraphs": lambda: {"num_paragraphs": rng.randint(2, 4)},
        "length_constraints:number_words": lambda: rng.choice((
            {"num_words": rng.choice((60, 80, 100, 150, 200)), "relation": "at least"},
            {"num_words": rng.choice((50, 80, 100, 150)), "relation": "less than"})),
        "length_constraints:nth_paragraph_first_word": lambda: _nth_paragraph(rng),
        "detectable_content:number_placeholders": lambda: {"num_placeholders": rng.randint(2, 3)},
        "detectable_content:postscript": lambda: {"postscript_marker": rng.choice(("P.S.", "P.P.S"))},
        "detectable_format:number_bullet_lists": lambda: {"num_bullets": rng.randint(2, 5)},
        "detectable_format:number_highlighted_sections": lambda: {"num_highlights": rng.randint(2, 3)},
        "detectable_format:multiple_sections": lambda: {"section_spliter": rng.choice(("Section", "SECTION")),
                                                        "num_sections": rng.randint(2, 4)},
        "startend:end_checker": lambda: {"end_phrase": rng.choice(END_PHRASES)},
    }
    return draws[instruction_id]() if instruction_id in draws else {}


def _nth_paragraph(rng: random.Random) -> dict[str, Any]:
    n = rng.randint(2, 4)
    return {"num_paragraphs": n, "nth_paragraph": rng.randint(1, n),
            "first_word": rng.choice(("first", "today", "imagine", "however", "finally", "often"))}


def _phrase(instruction_id: str, args: dict[str, Any], rng: random.Random) -> str:
    """The sentence that states one instruction with its arguments."""
    values = dict(args)
    for i, word in enumerate(args.get("keywords") or args.get("forbidden_words") or []):
        values[f"w{i}"] = word
    if "language" in args:
        values["language_name"] = LANGUAGES[args["language"]]
    return rng.choice(PHRASES[instruction_id]).format(**values)


def _compatible(candidate: str, chosen: list[str]) -> bool:
    return not any(c == candidate or _conflict(c, candidate) for c in chosen)


def _conflict(a: str, b: str) -> bool:
    from harness.eval.verifiable import conflicting

    return conflicting(a, b) or frozenset({a, b}) in EXTRA_CONFLICTS


def _choose(count: int, uses: dict[str, int], request: str, rng: random.Random) -> list[str]:
    """`count` mutually compatible ids, the least used first (ties: the generator's order)."""
    chosen: list[str] = []
    order = sorted(uses, key=lambda i: (uses[i], rng.random()))
    for candidate in order:
        if len(chosen) == count:
            break
        if not _compatible(candidate, chosen):
            continue
        if candidate == "punctuation:no_comma" and "combination:repeat_prompt" in chosen and "," in request:
            continue  # the repeated request would hold a comma
        if candidate == "combination:repeat_prompt" and "punctuation:no_comma" in chosen and "," in request:
            continue
        chosen.append(candidate)
    for i in chosen:
        uses[i] += 1
    return chosen


def _one_prompt(index: int, request: str, ids: list[str], rng: random.Random) -> IfevalPrompt:
    ids = sorted(ids, key=lambda i: i == "combination:repeat_prompt")  # the repeat instruction comes last
    args = [_draw(i, rng) for i in ids]
    sentences = [request] + [_phrase(i, a, rng) for i, a in zip(ids, args) if i != "combination:repeat_prompt"]
    if "combination:repeat_prompt" in ids:
        to_repeat = " ".join(sentences)
        args[-1] = {"prompt_to_repeat": to_repeat}
        sentences.append(_phrase("combination:repeat_prompt", {}, rng))
    return IfevalPrompt(f"if{index:03d}", " ".join(sentences), tuple(ids), tuple(args))


@lru_cache(maxsize=1)
def prompt_set() -> tuple[IfevalPrompt, ...]:
    """The PROMPTS prompts, always the same (see the module docstring)."""
    from harness.eval.verifiable import check_instructions, instruction_ids

    rng = random.Random(SEED)
    uses = {i: 0 for i in instruction_ids() if i != "detectable_format:constrained_response"}
    prompts, writing, questions = [], 0, 0
    for index in range(PROMPTS):
        if index % YES_NO_EVERY == YES_NO_EVERY - 1:
            request, ids = YES_NO_QUESTIONS[questions % len(YES_NO_QUESTIONS)], ["detectable_format:constrained_response"]
            questions += 1
        else:
            request = WRITING_REQUESTS[writing % len(WRITING_REQUESTS)]
            ids = _choose(COUNTS[writing % len(COUNTS)], uses, request, rng)
            writing += 1
        prompt = _one_prompt(index, request, ids, rng)
        check_instructions(prompt.instruction_ids, prompt.kwargs, f"ifeval prompt {prompt.id}")
        prompts.append(prompt)
    return tuple(prompts)


def prompt_set_digest() -> str:
    """sha256 (first 16 hex digits) of the prompt set as JSON: which prompts a result was made with."""
    text = json.dumps([p.as_dict() for p in prompt_set()], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def prompt_texts() -> list[str]:
    """Every prompt's text (with its instructions' arguments, e.g. end phrases): the evaluation texts of the 13-gram
    check."""
    texts = []
    for p in prompt_set():
        texts.append(p.prompt)
        texts.extend(str(v) for args in p.kwargs for v in args.values() if isinstance(v, str) and len(v.split()) > 1)
    return texts
