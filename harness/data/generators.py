"""Synthetic in-context recall text for data.mix: documents in which copying from the context pays.

A mix entry `{source: 'generator:NAME', weight: W, options: {...}}` names one of GENERATORS:

  repeat_span  natural paragraphs (the embedded Wikipedia text by default) in which a random span of words is
               repeated verbatim later, after a gap of D words; no marker says where
  kv_recall    a list of key-value lines in one of several formats, a blank line, then several of its keys again,
               each followed by its value (associative recall, several queries per context)
  copy         a random string of words, pseudo-words, letters or digits, a cue of punctuation only, then the same
               string again

Each generator is a class with typed options (an `Options` dataclass: every field documented, its default the
generator's default) and `document(i) -> str`. Document i is a pure function of (options, i): its draws come from
`Draw(NAME, options.seed, i)`, which uses only `random.Random(str).random()`, the one draw whose sequence Python
promises to keep across releases. So any prefix of the documents is the same whatever how many are made, and a token
store of more documents holds the tokens of fewer as its prefix (harness.data.mix sizes a generator's store to
the budget). `fingerprint()` (generator, version, every option, the text a repeat_span reads) goes into the token
cache key and the store's meta.json, so changed options give a new store.

None of them uses the NIAH evaluation's formats (harness.eval.niah): no instruction or question, no "Question:" or
"Answer:", no needle sentence or answer primer ("The pass key is", "The secret word for ...", "The special magic
UUID for ..."), no adjective-noun key, no word of its key and value lists, no 7-digit number or UUID value.
tests/test_data_mix.py renders thousands of documents of every generator under varied options to check it.
"""

from __future__ import annotations

import json
import os
import random
import re
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from harness.data.errors import DataError

# Words of kv_recall keys and values and of copy strings; none is a word of the NIAH keys or values
# (harness.eval.niah._ADJECTIVES, _NOUNS: tests/test_data_mix.py checks).
WORDS = tuple("""
apple bread chair cloud river stone table tiger train music paper pencil window garden bottle copper cotton dragon
engine forest guitar hammer jacket kitten lemon mirror nickel orange pepper planet rabbit rocket salmon silver spider
summer ticket tomato turtle valley velvet wagon winter yellow zebra almond bamboo cactus cherry circus desert eagle
fabric ginger harvest igloo jungle koala lizard mango napkin pirate quartz radish saucer tablet umbrella vessel walrus
yogurt acorn bishop carpet doctor goblet hazel insect jersey kernel locket magnet nectar onion pillow rubber sister
violet button cellar dinner finger hollyhock mitten peanut puzzle rocker sandal tender timber wallet basil cedar
clover daisy fennel garlic lentil maple nutmeg poppy rhubarb sorrel thyme tulip willow badger beaver camel ferret
gerbil hamster jackal lemur mole otter panda parrot raven salamander seal shrimp squid swan weasel bucket chisel
funnel hinge ladle mallet nozzle pliers pulley rivet shovel sickle stapler trowel wrench banjo cello drum flute harp
oboe piano tuba ukulele zither
""".split())

CONSONANTS, VOWELS = "bdfgklmnprstvz", "aeiou"
LETTERS, DIGITS = "abcdefghijklmnopqrstuvwxyz", "0123456789"


class Draw:
    """Seeded draws that stay the same across Python releases: every draw is built on `random.Random.random()`,
    seeded with a string (sha512, also stable), never on randint/choice/shuffle, whose algorithms may change."""

    def __init__(self, *parts: Any) -> None:
        self._rng = random.Random("|".join(str(p) for p in parts))

    def int(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi], uniform."""
        return lo + min(int(self._rng.random() * (hi - lo + 1)), hi - lo)

    def range(self, bounds: Sequence[int]) -> int:
        return self.int(bounds[0], bounds[1])

    def choice(self, items: Sequence[Any]) -> Any:
        return items[self.int(0, len(items) - 1)]

    def sample(self, items: Sequence[Any], k: int) -> list:
        """k distinct items in random order (a partial Fisher-Yates shuffle)."""
        pool = list(items)
        for i in range(k):
            j = self.int(i, len(pool) - 1)
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:k]


def pseudo_word(d: Draw, syllables: tuple[int, int] = (2, 3)) -> str:
    """2-3 consonant-vowel syllables ("tafimo"): a word no list holds, and never one of NIAH's (each of those has a
    consonant cluster, a double vowel or a final consonant)."""
    return "".join(d.choice(CONSONANTS) + d.choice(VOWELS) for _ in range(d.range(syllables)))


def number(d: Draw, digits: tuple[int, int]) -> str:
    """A number of `digits` digits (no leading zero)."""
    n = d.range(digits)
    return d.choice(DIGITS[1:]) + "".join(d.choice(DIGITS) for _ in range(n - 1))


def code(d: Draw) -> str:
    """Two or three capitals, a dash and two to four digits: "QX-482"."""
    return "".join(d.choice(LETTERS.upper()) for _ in range(d.int(2, 3))) + "-" + number(d, (2, 4))


# ----------------------------------------------------------------------------------------------- options

def option(default: Any, help: str, kind: str = "value", allowed: Sequence[str] = (), low: int = 0) -> Any:
    """An options field: its default, description, and how a given value is read (kind: 'value' as it is, 'int', 'range'
    (an int n or [lo, hi], lo >= low), 'choices' (a non-empty list of `allowed` names) or 'cues')."""
    value = tuple(default) if isinstance(default, list) else default
    return field(default=value, metadata={"help": help, "kind": kind, "allowed": tuple(allowed), "low": low})


def read_options(cls: type, given: Mapping[str, Any], key: str) -> Any:
    """The options dataclass `cls` from the mapping `given` (missing keys take their defaults); DataError naming
    `key`.KEY and what is allowed for an unknown key or a bad value."""
    names = {f.name: f for f in fields(cls)}
    unknown = [k for k in given if k not in names]
    if unknown:
        listed = ", ".join(f"{f.name} (default {_shown(f.default)})" for f in fields(cls))
        raise DataError(f"{key}.options has no option '{unknown[0]}'. Options: {listed}.")
    values = {name: _read_value(f, given[name], f"{key}.options.{name}") for name, f in names.items() if name in given}
    return cls(**values)


def _read_value(f: Any, value: Any, key: str) -> Any:
    kind, meta = f.metadata["kind"], f.metadata
    if kind == "int":
        return _whole(value, key, meta["low"])
    if kind == "range":
        return _range(value, key, meta["low"])
    if kind == "choices":
        return _choices(value, key, meta["allowed"])
    if kind == "cues":
        return _cues(value, key)
    if not isinstance(value, type(f.default)):
        raise DataError(f"{key}={value!r} must be a {type(f.default).__name__}, like the default {_shown(f.default)}.")
    return value


def _whole(value: Any, key: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise DataError(f"{key}={value!r} must be a whole number >= {low}.")
    return value


def _range(value: Any, key: str, low: int) -> tuple[int, int]:
    """An int n (the range [n, n]) or [lo, hi] with low <= lo <= hi."""
    pair = [value, value] if isinstance(value, int) and not isinstance(value, bool) else value
    ok = (isinstance(pair, (list, tuple)) and len(pair) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) for v in pair) and low <= pair[0] <= pair[1])
    if not ok:
        raise DataError(f"{key}={value!r} must be a whole number >= {low}, or a range [lo, hi] with {low} <= lo <= hi.")
    return int(pair[0]), int(pair[1])


def _choices(value: Any, key: str, allowed: Sequence[str]) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or any(v not in allowed for v in items) \
            or len(set(items)) != len(items):
        raise DataError(f"{key}={value!r} must be a non-empty list of distinct names from: {', '.join(allowed)}.")
    return tuple(items)


def _cues(value: Any, key: str) -> tuple[str, ...]:
    """Non-empty strings without a letter or digit: a cue says 'again' by layout, never in words."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items or \
            any(not isinstance(c, str) or not c or re.search(r"[^\W_]", c) for c in items):
        raise DataError(f"{key}={value!r} must be a non-empty list of non-empty strings of punctuation and whitespace "
                        "only (no letter or digit: a cue is never an instruction), e.g. ['\\n\\n', ' | '].")
    return tuple(items)


def _shown(value: Any) -> str:
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def options_help(cls: type) -> list[tuple[str, Any, str]]:
    """(name, default, description) of each option of the options dataclass `cls`."""
    return [(f.name, f.default, f.metadata["help"]) for f in fields(cls)]


# ----------------------------------------------------------------------------------------------- generators


class Generator:
    """Base of the generators: `name`, `version` (bump when documents change), `Options`, `document(i)`."""

    name = ""
    version = 1
    Options: type = object

    def __init__(self, options: Any, cache_dir: Path | None = None) -> None:
        self.options = options
        self.cache_dir = cache_dir

    def document(self, index: int) -> str:
        raise NotImplementedError

    def draw(self, index: int) -> Draw:
        return Draw(self.name, self.options.seed, index)

    def fingerprint(self) -> dict:
        """What decides the documents: generator, version and every option (the token cache key hashes it)."""
        return {"kind": "generator", "name": self.name, "version": self.version, "options": self.options_dict()}

    def options_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self.options).items()}

    def check(self, key: str) -> None:
        """Raise DataError for options that cannot work together (each alone was checked when read)."""


FORMATS: dict[str, Callable[[str, str], str]] = {
    "colon": lambda k, v: f"{k}: {v}",
    "equals": lambda k, v: f"{k} = {v}",
    "arrow": lambda k, v: f"{k} -> {v}",
    "tab": lambda k, v: f"{k}\t{v}",
    "pipe": lambda k, v: f"| {k} | {v} |",
    "json": lambda k, v: json.dumps({k: v}),
}
ITEM_KINDS = ("word", "pseudo", "number", "code")


@dataclass(frozen=True)
class KvRecallOptions:
    seed: int = option(0, "Seed of the documents (job.seed orders them, as for any source).", "int")
    pairs: tuple[int, int] = option([4, 32], "Key-value lines per document: a number or a range [lo, hi].", "range",
                                    low=1)
    queries: tuple[int, int] = option([1, 8], "Keys asked again after the list (distinct, in random order; at most the "
                                      "document's pairs).", "range", low=1)
    key_kinds: tuple[str, ...] = option(["word", "pseudo", "code"], "Kinds of keys, one drawn per document: word (a "
                                        "common noun), pseudo (a made-up word), number, code ('QX-482').", "choices",
                                        ITEM_KINDS)
    value_kinds: tuple[str, ...] = option(["number", "word", "pseudo", "code"], "Kinds of values, one drawn per "
                                          "document.", "choices", ITEM_KINDS)
    formats: tuple[str, ...] = option(list(FORMATS), "Line formats, one drawn per document: colon 'k: v', equals "
                                      "'k = v', arrow 'k -> v', tab, pipe '| k | v |', json '{\"k\": \"v\"}'.",
                                      "choices", tuple(FORMATS))
    number_digits: tuple[int, int] = option([2, 6], "Digits of a number key or value.", "range", low=1)


class KvRecall(Generator):
    """Associative recall: PAIRS lines 'key SEP value', a blank line, then QUERIES of those lines again (each key
    followed by its value), e.g. "cedar: 4071\\nplum: 93\\n\\nplum: 93". Keys are distinct within a document."""

    name = "kv_recall"
    Options = KvRecallOptions

    def document(self, index: int) -> str:
        o, d = self.options, self.draw(index)
        pairs = d.range(o.pairs)
        queries = min(d.range(o.queries), pairs)
        key_kind, value_kind, fmt = d.choice(o.key_kinds), d.choice(o.value_kinds), FORMATS[d.choice(o.formats)]
        keys = self._distinct(d, key_kind, pairs)
        lines = [fmt(k, self._item(d, value_kind)) for k in keys]
        asked = d.sample(range(pairs), queries)
        return "\n".join(lines) + "\n\n" + "\n".join(lines[i] for i in asked)

    def _item(self, d: Draw, kind: str) -> str:
        if kind == "word":
            return d.choice(WORDS)
        if kind == "pseudo":
            return pseudo_word(d)
        if kind == "number":
            return number(d, self.options.number_digits)
        return code(d)

    def _distinct(self, d: Draw, kind: str, n: int) -> list[str]:
        if kind == "word":
            return d.sample(WORDS, n)
        seen: dict[str, None] = {}
        while len(seen) < n:  # check() makes sure enough distinct items exist
            seen[self._item(d, kind)] = None
        return list(seen)

    def check(self, key: str) -> None:
        o = self.options
        room = {"word": len(WORDS), "pseudo": 70 ** 2, "code": 26 ** 2 * 90,
                "number": 9 * 10 ** (o.number_digits[1] - 1)}
        short = [k for k in o.key_kinds if room[k] < 2 * o.pairs[1]]
        if short:
            raise DataError(f"{key}.options: pairs up to {o.pairs[1]} need more distinct '{short[0]}' keys than there "
                            f"are ({room[short[0]]:,}); lower pairs or use other key_kinds.")


COPY_UNITS = ("words", "pseudo", "letters", "digits")


@dataclass(frozen=True)
class CopyOptions:
    seed: int = option(0, "Seed of the documents.", "int")
    length: tuple[int, int] = option([8, 64], "Units of the string (words, pseudo-words, letter or digit groups).",
                                     "range", low=1)
    units: tuple[str, ...] = option(list(COPY_UNITS), "What the string is made of, one drawn per document: words, "
                                    "pseudo (made-up words), letters (groups of 2-6), digits (groups of 1-4).",
                                    "choices", COPY_UNITS)
    cues: tuple[str, ...] = option(["\n\n", "\n", " | ", " || ", " // ", " ;; ", "\n--\n"], "Separators between the "
                                   "string and its copies, one drawn per document: punctuation and whitespace only.",
                                   "cues")
    copies: tuple[int, int] = option([1, 1], "Copies after the string.", "range", low=1)


class Copy(Generator):
    """A random string, a cue, and the string again (COPIES times): "tafimo rekusa ... || tafimo rekusa ...".
    Text drawn here and tokenised by the teacher's tokenizer, with a cue between the copies: not the format of the
    copy probe (`harness eval copy`: random token ids and their repetition)."""

    name = "copy"
    Options = CopyOptions

    def document(self, index: int) -> str:
        o, d = self.options, self.draw(index)
        unit, cue = d.choice(o.units), d.choice(o.cues)
        text = " ".join(self._unit(d, unit) for _ in range(d.range(o.length)))
        return cue.join([text] * (1 + d.range(o.copies)))

    @staticmethod
    def _unit(d: Draw, unit: str) -> str:
        if unit == "words":
            return d.choice(WORDS)
        if unit == "pseudo":
            return pseudo_word(d)
        if unit == "letters":
            return "".join(d.choice(LETTERS) for _ in range(d.int(2, 6)))
        return "".join(d.choice(DIGITS) for _ in range(d.int(1, 4)))


TEXTS = ("embedded:wikipedia", "embedded:mixed")


@dataclass(frozen=True)
class RepeatSpanOptions:
    seed: int = option(0, "Seed of the documents.", "int")
    text: str = option("embedded:wikipedia", "Where the paragraphs come from: 'embedded:wikipedia', 'embedded:mixed' "
                       "or a local .jsonl file (one document per line, in text_field).")
    text_field: str = option("text", "The text field of a .jsonl text.")
    first_document: int = option(20000, "Documents of `text` before this one are never used: they hold the validation "
                                 "head when the same text is a natural source of the mix (checked when prepared).",
                                 "int")
    span_words: tuple[int, int] = option([8, 64], "Words in the repeated span.", "range", low=1)
    distance_words: tuple[int, int] = option([0, 512], "Words between the span's end and its repetition.", "range")
    max_words: int = option(1024, "Words of natural text per document, at most (at least span + distance: following "
                            "documents of `text` are joined with a blank line until there are enough).", "int", low=2)


class RepeatSpan(Generator):
    """Natural text with a span repeated: a document of `text` (from first_document on, drawn per document), a
    random span of SPAN words in it, and the same span inserted verbatim after the next DISTANCE words; the text goes
    on after it. Words are whitespace-separated and keep their own spacing, so the copy is exact text."""

    name = "repeat_span"
    Options = RepeatSpanOptions

    def document(self, index: int) -> str:
        o, d = self.options, self.draw(index)
        span, gap = d.range(o.span_words), d.range(o.distance_words)
        words = self._words(d.int(o.first_document, len(self.texts) - 1), span + gap)
        start = d.int(0, len(words) - span - gap)
        cut = start + span + gap  # every word ends with its whitespace, so the pieces join as text
        return "".join(words[:cut] + words[start:start + span] + words[cut:]).strip()

    def _words(self, first: int, need: int) -> list[str]:
        """The words of documents first, first+1, ... (wrapping to first_document) until there are `need`, capped at
        max(need, max_words); each word keeps its trailing whitespace, the last of a document a blank line."""
        words: list[str] = []
        i = first
        while len(words) < need:
            more = re.findall(r"\S+\s*", self.texts[i])
            words += more[:-1] + [more[-1].rstrip() + "\n\n"]
            i = i + 1 if i + 1 < len(self.texts) else self.options.first_document
        return words[:max(need, self.options.max_words)]

    @property
    def texts(self) -> tuple[str, ...]:
        return load_texts(*self.text_source())

    def text_source(self) -> tuple[str, str]:
        """(path of the jsonl holding the paragraphs, text field)."""
        o = self.options
        if o.text in TEXTS:
            from harness.data.sources import embedded_source_path

            from harness.assets import cache_root

            return str(embedded_source_path(o.text.partition(":")[2], cache_root(self.cache_dir))), "text"
        return str(Path(o.text).expanduser().resolve()), o.text_field

    def fingerprint(self) -> dict:
        path, _ = self.text_source()
        stat = os.stat(path)
        return {**super().fingerprint(), "text_file": [path, stat.st_size, stat.st_mtime_ns]}

    def check(self, key: str) -> None:
        o = self.options
        if o.text not in TEXTS and not (o.text.endswith(".jsonl") and Path(o.text).expanduser().is_file()):
            raise DataError(f"{key}.options.text='{o.text}' must be one of {', '.join(TEXTS)} or an existing local "
                            ".jsonl file (never embedded:essays: the NIAH haystack).")
        if o.span_words[1] + o.distance_words[1] > o.max_words:
            raise DataError(f"{key}.options: span_words up to {o.span_words[1]} plus distance_words up to "
                            f"{o.distance_words[1]} exceed max_words={o.max_words}; raise max_words or lower them.")

    def check_text(self, key: str) -> None:
        """DataError unless `text` has a document at first_document and after (reads the text)."""
        n = len(self.texts)
        if self.options.first_document >= n:
            raise DataError(f"{key}.options.first_document={self.options.first_document} is past the "
                            f"{n:,} documents of {self.options.text}; lower it (documents before it are never used).")


@lru_cache(maxsize=2)
def load_texts(path: str, text_field: str) -> tuple[str, ...]:
    """The non-empty texts of a jsonl file, in file order (the order and count of its token store's documents)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line).get(text_field)
            except (json.JSONDecodeError, AttributeError) as err:
                raise DataError(f"'{path}' line {n} is not a JSON object ({err}).") from None
            if isinstance(text, str) and text.strip():
                out.append(text)
    if not out:
        raise DataError(f"'{path}' holds no text in field '{text_field}'.")
    return tuple(out)


GENERATORS: dict[str, type[Generator]] = {g.name: g for g in (RepeatSpan, KvRecall, Copy)}


def make_generator(name: str, options: Mapping[str, Any] | None = None, key: str = "generator",
                   cache_dir: Path | str | None = None) -> Generator:
    """The generator NAME with `options` read and checked (DataError naming `key` for a bad name or option)."""
    if name not in GENERATORS:
        raise DataError(f"{key}.source='generator:{name}': no such generator. Generators: "
                        f"{', '.join('generator:' + g for g in GENERATORS)}.")
    cls = GENERATORS[name]
    gen = cls(read_options(cls.Options, dict(options or {}), key), None if cache_dir is None else Path(cache_dir))
    gen.check(key)
    return gen


def describe_generators() -> str:
    """Each generator's description and options with their defaults (for docs and `harness data prepare`)."""
    lines = []
    for name, cls in GENERATORS.items():
        lines.append(f"generator:{name}: {' '.join((cls.__doc__ or '').split())}")
        lines += [f"  {k} (default {_shown(v)}): {h}" for k, v, h in options_help(cls.Options)]
    return "\n".join(lines)
