"""Needle-in-a-haystack (NIAH): can a model retrieve one fact hidden at depth d of a long real-prose context?

The grid (`NiahGrid`) is needle kind x prompt length x depth x sample. One sample is one prompt, built by
token ids so that its length is exact (`build_sample`):

    head       the instruction (INSTRUCTION), inside the chat template's user turn when the prompt is "chat"
    haystack   real prose (the embedded Paul Graham essays or Wikipedia paragraphs, see harness.data.embedded)
               with the needle sentence spliced in at the requested depth
    tail       the question, the end of the chat turn and the assistant header ("chat"), then an answer primer
               ("The pass key is") that the model continues

`length` is the number of tokens of the whole prompt (head + haystack + tail, chat template tokens included),
exactly: every part is tokenised on its own and the ids are concatenated, so nothing re-tokenises across the
seams (the seams are "\\n\\n" and a leading space, where BPE tokenisers split anyway).

Depth d is a fraction of the prose: the needle's first token sits after round(d * P) of the P prose tokens,
moved to the nearest sentence start (after . ! ? and whitespace), else the nearest word start, within
`snap_window(P)` = max(3% of P, 2) tokens, so that the needle reads as its own sentence (the original NIAH
test snaps to a period too) and never splits a word. The actual depth, `NiahSample.needle_depth`, is therefore
within snap_window(P) / P of the requested one (3 percentage points from ~70 prose tokens up).
d = 0 puts the needle first in the haystack and d = 1 last, right before the question.

Needle kinds (KINDS):
    passkey  " The pass key is 4829173. Remember it. 4829173 is the pass key."     (7-digit number)
    uuid     " The special magic UUID for amber-falcon is: e3e70682-c209-4cac-a29f-6fbed82c07cd."
    kv       " The secret word for amber-falcon is lantern."                          (key-value fact)

Randomness is a pure function of (seed, ...): the prose of sample i starts at the same document for every
kind, length and depth (a longer prompt extends a shorter one's prose, which isolates length and depth), and
the needle's key and value depend on (seed, kind, length, depth, i).

Prompt mode: "plain" (the default) frames the question as text, "Question: ...\\nAnswer: The pass key is",
after the instruction and the prose, with no chat template: students distilled on prose never saw chat turns,
and a chat-format question would test instruction following too. "chat" renders the instruction, prose and
question as one user turn of the tokenizer's chat template (it needs one), then the assistant header; "auto"
picks "chat" when the tokenizer has a template, else "plain". Student and teacher of one report are scored with
the same mode (the evaluation job passes eval.niah.prompt to both).

Decoding: greedy, `generation_batch_size` samples at a time (1 by default; eval.generation_batch_size), taken
in order of length so that a batch holds one length (`harness.decoding.greedy_ids_batch`: students step their
recurrent state, teachers `generate()` with their KV cache). Each sample stops where it would alone: at an EOS
token (the tokenizer's and the model's generation config's), at the end of the first non-empty line, or after
`max_new_tokens`.

Exact match (`is_correct`): the new tokens are decoded (special tokens skipped); the answer is the first non-empty
line of that text, stripped (`answer_line`; generation stops once that line is complete). The sample is
correct iff the needle value occurs in the answer as a whole word, case-insensitively: not preceded or
followed by a letter or digit ("4829173." and "it is 4829173" count, "48291730" and a value on a later line do
not). Cell accuracy = correct /
samples; `overall`, `by_length`, `by_kind` and `by_depth` are means over samples (every cell has the same
number of samples, so they are also means over cells).

Likelihood score (teacher-forced, no generation): exact match of a generated needle is too coarse for small
models (0% everywhere says nothing about the mixer), so each sample also ranks its true value among
`grid.distractors` (default 9) other values of the same kind (`make_distractors`): 7-digit numbers, UUID4s, or
the other words of the kv word list for that key, drawn deterministically from the sample's own seed as the
true value was drawn, so that a model that does not read the context cannot tell them apart. Each candidate
is scored as the continuation " VALUE" of the same prompt, by the sum of its tokens' log-probabilities
(`candidate_scores`: one forward over the prompt, its cache repeated per candidate, one batched forward of
the candidates). The distractors have the true value's token count wherever the kind has enough such values
(passkeys and UUIDs always do with SmolLM2's tokenizer; a kv word of a rare token count may not); else the
nearest counts fill in and the sum is still not length-normalised (`same_token_count` in niah.json says how
often every candidate had one count). `rank_of_true`: rank 1 = best, ties within TIE_TOLERANCE share the mean
rank; top1 = 1 if the true value is first, 1 / (1 + tied) when it ties at the top, so that a model that scores
all candidates alike gets chance exactly: 1 / (1 + distractors), 10% by default; the chance rank is
(2 + distractors) / 2. Accuracy = mean top1, reported overall and by length, kind and depth beside exact match.

First token (from the same forward): the rank of the value's first token among the whole vocabulary at the
answer's start (`first_token_fields`); first-token top-1 = the share of samples where it is the model's most
likely token. The likelihood score compares the value with other values only; this says whether greedy decoding
starts the value at all, or starts prose, a restated question or a newline instead. Value token: the same at the
value's first token that carries a character of it (`value_start`: after the lone space token that starts a number,
its first digit), teacher-forced on the value's tokens before it: whether the model picks the value itself once
the answer has started.

Position limits: a model whose config has `max_position_embeddings` (a rope teacher; students are recurrent
and have none) is still scored at longer prompts, with a warning and `beyond_max_positions: true` on those
cells: how a teacher degrades past its trained length is what a linearised student is compared with.

Outputs in `out_dir`:
    niah_cells.jsonl   a header line (the settings a sample depends on), then one line per finished sample
                       (key, value, model output, correct, needle offset and depth; distractors, logprobs and
                       candidate_tokens with the true value first, rank, top1; first_token_rank, _gap and
                       _top; value_token_position, _rank, _gap and _top). A rerun skips every sample
                       already there, so an interrupted evaluation resumes; records are keyed on (kind, length,
                       depth, index), so changing lengths / depths / kinds / samples reuses the overlap, while a
                       change of label, haystack, prompt mode, seed, max_new_tokens or tokenizer is an error
                       (pass overwrite=True to start over). A record without the likelihood or first-token
                       fields (written before them) or with other distractors keeps its answer and gets only
                       those.
    niah.json          see `harness.eval.niah_summary.summarise` (label, grid, overall, by_length, by_kind,
                       by_depth, likelihood, cells, ...)
    niah.csv           one row per (kind, length, depth) cell, both scores
    niah_heatmap.png   exact-match accuracy, depth (rows) x length (columns): one panel per kind, plus their mean
                       when there are several kinds
    niah_likelihood_heatmap.png   the same for the likelihood accuracy

The essays carry no license grant (see harness.data.embedded); they are read, not redistributed, here, as in
the original NIAH test. `haystack="wikipedia"` (CC BY-SA) is the alternative; any .jsonl ({"text": ...} per
line) or .txt file works too.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
import random
import re
import uuid
import warnings
import weakref
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
from tqdm.auto import tqdm

from harness.config_choices import Haystack, NeedleKind, NiahPrompt
from harness.decoding import candidate_scores, check_batch_size, greedy_ids_batch, length_batches, stop_token_ids
from harness.eval.niah_summary import TIE_TOLERANCE, plot_heatmap, summarise, write_csv, write_json
from harness.eval.records import append_record, changed_settings, resume_lines
from harness.failpoints import failpoint

KINDS = NeedleKind.values()  # one definition with the job config's eval.niah.kinds
PROMPT_MODES = NiahPrompt.values()
HAYSTACKS = Haystack.values()
DEPTH_SNAP = 0.03  # the needle may move this fraction of the prose from its exact depth, to start a sentence
MIN_SNAP_TOKENS = 2  # ... or this many tokens, whichever is more (short prompts have few sentence ends)
MIN_PROSE_TOKENS = 32  # below this a "depth" means little
FORMAT_VERSION = 1  # bump when prompts, needles or scoring change, so that old records are not mixed in
CELLS_FILE, JSON_FILE, CSV_FILE, HEATMAP_FILE = "niah_cells.jsonl", "niah.json", "niah.csv", "niah_heatmap.png"
LIKELIHOOD_HEATMAP_FILE = "niah_likelihood_heatmap.png"
DEFAULT_DISTRACTORS = 9  # the likelihood score's chance level is 1 / (1 + distractors): 10%
MAX_DISTRACTORS = 20  # the kv needle's word list leaves 38 other words for a key; stay well below
MAX_DISTRACTOR_DRAWS = 2000  # values drawn per sample while looking for ones of the value's token count

INSTRUCTION = ("There is an important piece of information hidden inside a lot of irrelevant text. "
               "Find it and memorise it. I will quiz you about it afterwards.\n\n")
_SENTENCE_ENDS = (".", "!", "?", '."', '?"', '!"', ".\u201d")
_SEAM = "\n\n"  # between documents of the haystack, and between the haystack and the question
_MARK = "\x00HAYSTACK\x00"  # stands for the haystack when rendering the chat template
_PROBE = "Tokenizer fingerprint: 0123456789 The quick brown fox. <|im_start|>\n\n \u00e9t\u00e9"
_ADJECTIVES = ("amber", "brisk", "calm", "dusty", "eager", "faded", "gentle", "hollow", "icy", "jolly", "keen",
               "lively", "misty", "noble", "olive", "proud", "quiet", "rusty", "silent", "tidy", "upper", "vivid",
               "wary", "young", "zesty", "bold", "crisp", "dark", "early", "fierce", "golden", "hidden")
_NOUNS = ("falcon", "harbor", "lantern", "meadow", "violin", "pebble", "compass", "orchard", "glacier", "tunnel",
          "saddle", "kettle", "beacon", "canyon", "thimble", "anchor", "blanket", "cobweb", "dolphin", "ember",
          "feather", "garnet", "helmet", "island", "jigsaw", "ladder", "marble", "needle", "oyster", "parcel",
          "quarry", "ribbon", "spindle", "trumpet", "walnut", "zephyr", "basket", "candle", "donkey", "emerald")


# ---------------------------------------------------------------------------------------------- the grid


@dataclass
class NiahGrid:
    """What a NIAH evaluation covers; every (kind, length, depth) cell gets `samples` prompts.

    lengths:        prompt lengths in tokens (instruction + haystack + question, chat template included).
    depths:         needle depths as fractions of the haystack prose, 0.0 (first) to 1.0 (last).
    kinds:          needle kinds, from KINDS: "passkey" (7-digit number), "uuid", "kv" (a word for a key).
    samples:        prompts per (kind, length, depth) cell, each with its own prose start and needle value.
    haystack:       "essays" (Paul Graham, the classic NIAH prose), "wikipedia" (HotpotQA/SQuAD paragraphs),
                    or the path of a .jsonl ({"text": ...} per line) or .txt file.
    prompt:         "plain" (no chat template; for students distilled on prose), "chat" (the tokenizer's chat
                    template) or "auto" (chat if the tokenizer has a template, else plain).
    seed:           seeds prose starts and needle values; the same seed gives the same prompts.
    max_new_tokens: generation budget per sample; a UUID alone is ~32 SmolLM2 tokens.
    distractors:    other values of the needle's kind scored beside the true one by the likelihood score
                    (chance: 1 / (1 + distractors)); at most MAX_DISTRACTORS.
    """

    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096, 8192])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    samples: int = 3
    haystack: str = "essays"
    prompt: str = "plain"
    seed: int = 0
    max_new_tokens: int = 48
    distractors: int = DEFAULT_DISTRACTORS

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting; normalise lists (e.g. from OmegaConf) to plain ones."""
        self.lengths = [_positive_int("lengths", x) for x in self.lengths]
        self.depths = [_depth(x) for x in self.depths]
        self.kinds = [str(k) for k in self.kinds]
        for name, values in (("lengths", self.lengths), ("depths", self.depths), ("kinds", self.kinds)):
            if not values:
                raise ValueError(f"NiahGrid.{name} is empty; give at least one value")
            if len(set(values)) != len(values):
                raise ValueError(f"NiahGrid.{name} has duplicates: {values}")
        for kind in self.kinds:
            _check_kind(kind)
        self.samples = _positive_int("samples", self.samples)
        self.max_new_tokens = _positive_int("max_new_tokens", self.max_new_tokens)
        self.distractors = _positive_int("distractors", self.distractors)
        if self.distractors > MAX_DISTRACTORS:
            raise ValueError(f"NiahGrid.distractors={self.distractors} is above {MAX_DISTRACTORS} (the kv needle "
                             "has too few other words of a kind for more)")
        if self.prompt not in PROMPT_MODES:
            raise ValueError(f"unknown NIAH prompt mode {self.prompt!r}; choose from {PROMPT_MODES}")
        if self.haystack not in HAYSTACKS and not Path(self.haystack).is_file():
            raise ValueError(f"unknown NIAH haystack {self.haystack!r}: use one of {HAYSTACKS} or the path of an "
                             "existing .jsonl ({\"text\": ...} per line) or .txt file")
        self.seed = int(self.seed)


def _is_positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= 1


def _positive_int(name: str, value: Any) -> int:
    if not _is_positive_int(value):
        raise ValueError(f"NiahGrid.{name} must hold positive integers, got {value!r}")
    return int(value)


def _depth(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value <= 1.0:
        raise ValueError(f"NIAH depth {value!r} is not a fraction in [0, 1] (write 0.5 for 50%)")
    return float(value)


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown needle kind {kind!r}; choose from {KINDS}")


def grid_keys(grid: NiahGrid) -> list[tuple[str, int, float, int]]:
    """Every sample of the grid as (kind, length, depth, index), shortest lengths first (early feedback)."""
    return [(kind, length, depth, i) for length in grid.lengths for depth in grid.depths
            for kind in grid.kinds for i in range(grid.samples)]


# ---------------------------------------------------------------------------------------------- needles


@dataclass(frozen=True)
class Needle:
    """One needle: the sentence hidden in the prose, the question about it, and the answer primer."""

    kind: str
    key: str | None  # what the question names (uuid and kv); None for the passkey
    value: str  # what the model must produce
    text: str  # the sentence spliced into the prose (with its leading space)
    question: str
    answer_prefix: str  # the start of the answer, written for the model to continue


def make_needle(kind: str, rng: random.Random) -> Needle:
    """A needle of `kind` with a random key and value drawn from `rng`."""
    _check_kind(kind)
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    value = _draw_value(kind, key, rng)
    if kind == "passkey":
        return Needle(kind, None, value, f" The pass key is {value}. Remember it. {value} is the pass key.",
                      "What is the pass key?", "The pass key is")
    if kind == "uuid":
        return Needle(kind, key, value, f" The special magic UUID for {key} is: {value}.",
                      f"What is the special magic UUID for {key}?", f"The special magic UUID for {key} is:")
    return Needle(kind, key, value, f" The secret word for {key} is {value}.",
                  f"What is the secret word for {key}?", f"The secret word for {key} is")


def _kv_words(key: str) -> list[str]:
    """The words a kv needle's value is drawn from: none that the key contains (the question names the key)."""
    return [n for n in _NOUNS if n not in key]


def _draw_value(kind: str, key: str, rng: random.Random) -> str:
    """One value of `kind` for a needle whose key is `key`: a 7-digit number, a UUID4, or a word."""
    if kind == "passkey":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return rng.choice(_kv_words(key))


def other_values(needle: Needle, rng: random.Random) -> Iterator[str]:
    """Values drawn as the needle's own was (its kind, for its key), without repeats, never the needle's value:
    endless for passkey and uuid; for kv the other words of `_kv_words(key)` in a random order."""
    if needle.kind == "kv":
        words = [w for w in _kv_words(needle.key or "") if w != needle.value]
        rng.shuffle(words)
        yield from words
        return
    seen = {needle.value}
    while True:
        value = _draw_value(needle.kind, needle.key or "", rng)
        if value not in seen:
            seen.add(value)
            yield value


def continuation_ids(tokenizer: Any, value: str) -> list[int]:
    """The tokens of `value` as the answer after the prompt's primer ("The pass key is"): " " + value."""
    return _encode(tokenizer, " " + value)


def make_distractors(tokenizer: Any, needle: Needle, n: int, rng: random.Random) -> tuple[str, ...]:
    """`n` values of the needle's kind (`other_values` from `rng`), preferring those whose continuation has as many
    tokens as the true value's: the first `n` such among up to MAX_DISTRACTOR_DRAWS draws, then (when too few
    exist, e.g. kv words of a rare length) the draws nearest in token count, in draw order."""
    target = len(continuation_ids(tokenizer, needle.value))
    draws, counts = [], []
    stream = other_values(needle, rng)
    while len(draws) < MAX_DISTRACTOR_DRAWS and counts.count(target) < n:
        chunk = [v for _, v in zip(range(64), stream)]
        if not chunk:
            break
        draws += chunk
        counts += [len(ids) for ids in tokenizer([" " + v for v in chunk], add_special_tokens=False)["input_ids"]]
    if len(draws) < n:
        raise ValueError(f"only {len(draws)} other {needle.kind} values exist for {n} distractors")
    order = sorted(range(len(draws)), key=lambda i: (abs(counts[i] - target), i))
    return tuple(draws[i] for i in order[:n])


def answer_line(continuation: str) -> str:
    """The answer in a continuation: its first non-empty line, stripped (generation stops after it)."""
    return next((line.strip() for line in continuation.splitlines() if line.strip()), "")


def is_correct(value: str, continuation: str) -> bool:
    """Whether `value` occurs in the answer line of `continuation` as a whole word (see the module docstring)."""
    pattern = r"(?<![0-9A-Za-z])" + re.escape(value) + r"(?![0-9A-Za-z])"
    return re.search(pattern, answer_line(continuation), flags=re.IGNORECASE) is not None


def _rng(seed: int, *parts: object) -> random.Random:
    # A string seed is hashed with sha512 by `random`: the same on every machine and Python run.
    return random.Random("niah|" + "|".join(str(p) for p in (seed, *parts)))


# ---------------------------------------------------------------------------------------------- prompt frame


def _encode(tokenizer: Any, text: str, special: bool = False) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def resolve_prompt_mode(tokenizer: Any, mode: str, what: str = "NIAH prompt mode") -> str:
    """"chat" or "plain" for `mode` ("auto" picks chat when the tokenizer has a chat template); `what` names the
    setting in errors (the chat samples share this)."""
    if mode not in PROMPT_MODES:
        raise ValueError(f"unknown {what} {mode!r}; choose from {PROMPT_MODES}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if mode == "chat" and not has_template:
        raise ValueError(f"{what} 'chat' needs a tokenizer with a chat template; this one has none "
                         "(use 'plain' or 'auto')")
    if mode == "auto":
        return "chat" if has_template else "plain"
    return mode


def prompt_frame(tokenizer: Any, needle: Needle, mode: str) -> tuple[list[int], list[int]]:
    """The token ids before (head) and after (tail) the haystack, for a resolved mode "chat" or "plain"."""
    if mode == "chat":
        content = INSTRUCTION + _MARK + _SEAM + needle.question
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                 add_generation_prompt=True)
        if rendered.count(_MARK) != 1:
            raise ValueError("the chat template does not render the user message verbatim; use prompt='plain'")
        head, tail = rendered.split(_MARK)
        # The rendered template spells its special tokens (BOS, turn markers) as text; the tokenizer maps them.
        return _encode(tokenizer, head), _encode(tokenizer, tail + needle.answer_prefix)
    if mode != "plain":
        raise ValueError(f"prompt_frame takes a resolved mode 'chat' or 'plain', got {mode!r}")
    tail = f"{_SEAM}Question: {needle.question}\nAnswer: {needle.answer_prefix}"
    return _special_prefix(tokenizer) + _encode(tokenizer, INSTRUCTION), _encode(tokenizer, tail)


def _special_prefix(tokenizer: Any) -> list[int]:
    """The ids the tokenizer puts before a text by default (BOS for Llama-style tokenizers, often nothing)."""
    plain, full = _encode(tokenizer, "a"), _encode(tokenizer, "a", special=True)
    return full[: full.index(plain[0])] if plain and plain[0] in full else []


# ---------------------------------------------------------------------------------------------- haystack


@lru_cache(maxsize=4)
def haystack_documents(source: str) -> tuple[str, ...]:
    """The prose documents of `source` ("essays", "wikipedia", or a .jsonl / .txt path), in file order."""
    if source in HAYSTACKS:
        from harness.data.embedded import embedded_subset_path

        path = embedded_subset_path(source)
    else:
        path = Path(source)
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            texts = tuple(t for line in f if line.strip() and (t := json.loads(line).get("text", "").strip()))
    else:
        texts = tuple(t for t in [path.read_text(encoding="utf-8").strip()] if t)
    if not texts:
        raise ValueError(f"NIAH haystack {source!r} ({path}) holds no text")
    return texts


class HaystackTokens:
    """Token ids of a haystack's documents under one tokenizer, tokenised lazily and kept."""

    def __init__(self, tokenizer: Any, documents: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.documents = documents
        self.seam = _encode(tokenizer, _SEAM)
        self._ids: dict[int, list[int]] = {}
        self._text: dict[int, str] = {}

    def document(self, index: int) -> list[int]:
        if index not in self._ids:
            self._ids[index] = _encode(self.tokenizer, self.documents[index])
        return self._ids[index]

    def prose(self, start: int, count: int) -> list[int]:
        """`count` tokens of documents start, start+1, ... (wrapping around), joined by blank lines."""
        ids: list[int] = []
        for step in range(count + len(self.documents)):  # enough rounds even for one-token documents
            ids += self.document((start + step) % len(self.documents)) + self.seam
            if len(ids) >= count:
                return ids[:count]
        raise ValueError(f"the NIAH haystack tokenises to too few tokens for {count} tokens of prose")

    def text(self, token_id: int) -> str:
        """The decoded text of one token (cached)."""
        if token_id not in self._text:
            self._text[token_id] = self.tokenizer.decode([token_id])
        return self._text[token_id]

    def boundary(self, prose: list[int], at: int) -> int:
        """How cleanly a needle can start before prose[at]: 2 after a sentence end, 1 between words, else 0."""
        if at in (0, len(prose)):
            return 2
        before, after = self.text(prose[at - 1]), self.text(prose[at])
        if not (before[-1:].isspace() or after[:1].isspace()):
            return 0
        return 2 if before.rstrip().endswith(_SENTENCE_ENDS) else 1


_HAYSTACK_CACHE: "weakref.WeakKeyDictionary[Any, dict[str, HaystackTokens]]" = weakref.WeakKeyDictionary()


def haystack_tokens(tokenizer: Any, source: str) -> HaystackTokens:
    """The (cached, per tokenizer) HaystackTokens of `source`."""
    try:
        per_source = _HAYSTACK_CACHE.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: no cache
        per_source = {}
    if source not in per_source:
        per_source[source] = HaystackTokens(tokenizer, haystack_documents(source))
    return per_source[source]


def snap_window(prose_tokens: int) -> int:
    """How far (in tokens) the needle may move from its exact depth: max(DEPTH_SNAP * prose, MIN_SNAP_TOKENS)."""
    return max(int(DEPTH_SNAP * prose_tokens), MIN_SNAP_TOKENS)


def needle_position(prose: list[int], depth: float, boundary: Callable[[list[int], int], int]) -> int:
    """Where in `prose` the needle starts: the sentence start nearest to round(depth * len(prose)) within
    `snap_window`, else the nearest word start there, else exactly there (ties go to the earlier position)."""
    target = round(depth * len(prose))
    window = snap_window(len(prose))
    nearby = sorted(range(max(target - window, 0), min(target + window, len(prose)) + 1),
                    key=lambda at: (abs(at - target), at))
    for cleanest in (2, 1):
        for at in nearby:
            if boundary(prose, at) >= cleanest:
                return at
    return target


# ---------------------------------------------------------------------------------------------- samples


@dataclass(frozen=True)
class NiahSample:
    """One NIAH prompt and what it hides.

    input_ids[haystack_start:haystack_end] is the haystack (prose with the needle);
    input_ids[needle_offset:needle_offset + needle_tokens] is the needle sentence;
    needle_depth = (needle_offset - haystack_start) / prose tokens, the actual depth (see DEPTH_SNAP);
    distractors are the other values the likelihood score ranks the true one against (`sample_distractors`).
    """

    kind: str
    length: int  # the requested prompt length
    depth: float  # the requested depth
    index: int
    input_ids: list[int]
    needle: Needle
    needle_offset: int
    needle_tokens: int
    needle_depth: float
    haystack_start: int
    haystack_end: int
    prompt_mode: str  # "chat" or "plain"
    distractors: tuple[str, ...] = ()

    @property
    def value(self) -> str:
        return self.needle.value

    @property
    def context_length(self) -> int:
        """The prompt's length in tokens (equal to `length`)."""
        return len(self.input_ids)


def sample_needle(grid: NiahGrid, kind: str, length: int, depth: float, index: int) -> Needle:
    """The needle of sample `index` of cell (kind, length, depth): a function of the grid's seed and the key."""
    return make_needle(kind, _rng(grid.seed, "needle", kind, length, depth, index))


def sample_distractors(tokenizer: Any, grid: NiahGrid, kind: str, length: int, depth: float,
                       index: int) -> tuple[str, ...]:
    """The `grid.distractors` other values of that sample's needle, drawn from the cell's own seed."""
    needle = sample_needle(grid, kind, length, depth, index)
    return make_distractors(tokenizer, needle, grid.distractors,
                            _rng(grid.seed, "distractors", kind, length, depth, index))


def build_sample(tokenizer: Any, grid: NiahGrid, kind: str, length: int, depth: float, index: int) -> NiahSample:
    """The prompt of sample `index` of cell (kind, length, depth) under `grid` (see the module docstring)."""
    _check_kind(kind)
    length, depth = _positive_int("lengths", length), _depth(depth)
    mode = resolve_prompt_mode(tokenizer, grid.prompt)
    needle = sample_needle(grid, kind, length, depth, index)
    head, tail = prompt_frame(tokenizer, needle, mode)
    needle_ids = _encode(tokenizer, needle.text)
    prose_tokens = length - len(head) - len(tail) - len(needle_ids)
    if prose_tokens < MIN_PROSE_TOKENS:
        frame = len(head) + len(tail) + len(needle_ids)
        raise ValueError(f"NIAH length {length} is too short for a {kind} needle with this tokenizer and "
                         f"{mode} prompt: instruction, question and needle take {frame} tokens, leaving "
                         f"{prose_tokens} of prose; use lengths >= {frame + MIN_PROSE_TOKENS}")
    hay = haystack_tokens(tokenizer, grid.haystack)
    start = _rng(grid.seed, "haystack", index).randrange(len(hay.documents))
    prose = hay.prose(start, prose_tokens)
    at = needle_position(prose, depth, hay.boundary)
    ids = head + prose[:at] + needle_ids + prose[at:] + tail
    assert len(ids) == length, (len(ids), length)
    return NiahSample(kind=kind, length=length, depth=depth, index=index, input_ids=ids, needle=needle,
                      needle_offset=len(head) + at, needle_tokens=len(needle_ids), needle_depth=at / prose_tokens,
                      haystack_start=len(head), haystack_end=length - len(tail), prompt_mode=mode,
                      distractors=sample_distractors(tokenizer, grid, kind, length, depth, index))


# ---------------------------------------------------------------------------------------------- generation


def _answer_line_done(text: str) -> bool:
    """The answer line is complete: a non-empty line followed by a newline (only it is scored)."""
    return "\n" in text.lstrip()


@torch.no_grad()
def generate_answer(model: Any, tokenizer: Any, input_ids: list[int], max_new_tokens: int,
                    device: str | torch.device = "cpu") -> str:
    """Greedy continuation of one unpadded prompt, decoded without special tokens (`generate_answers`)."""
    return generate_answers(model, tokenizer, [input_ids], max_new_tokens, device)[0]


@torch.no_grad()
def generate_answers(model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int,
                     device: str | torch.device = "cpu") -> list[str]:
    """Greedy continuations of `prompts`, decoded together (`greedy_ids_batch`), each decoded without special
    tokens. Generation stops at EOS, after `max_new_tokens`, or once the answer line is complete (only it is
    scored)."""
    news = greedy_ids_batch(model, tokenizer, prompts, max_new_tokens, stop_token_ids(model, tokenizer),
                            _answer_line_done, device)
    return [tokenizer.decode(new, skip_special_tokens=True) for new in news]


# ---------------------------------------------------------------------------------------------- likelihood


def rank_of_true(scores: list[float]) -> tuple[float, float]:
    """(rank, top1) of scores[0], the true value's, among all `scores` (higher is better).

    Scores within TIE_TOLERANCE of the true one tie with it (non-finite scores count as -inf). rank: 1 +
    the number of higher scores + half the number of tied ones (the mean rank over the tie, so that a model that
    scores every candidate alike gets (k + 1) / 2 of k). top1: 1 when no other is higher or tied, 1 / (1 + tied)
    when none is higher (a tie at the top is shared), else 0: a model that cannot tell candidates apart scores
    exactly chance, 1 / k.
    """
    clean = [s if math.isfinite(s) else -math.inf for s in scores]
    true, others = clean[0], clean[1:]
    ties = [s == true or abs(s - true) <= TIE_TOLERANCE for s in others]
    tied, higher = sum(ties), sum(s > true and not tie for s, tie in zip(others, ties))
    return 1 + higher + tied / 2, (1 / (1 + tied) if higher == 0 else 0.0)


def likelihood_record(model: Any, tokenizer: Any, sample: NiahSample, device: str | torch.device) -> dict:
    """The likelihood fields of one sample's record: its distractors, every candidate's log-prob and token count
    (the true value first), and the true value's rank and top1 (`rank_of_true`); where the answer starts
    (`first_token_fields`): whether the value's first token is the model's own first choice; and the same at the
    value's first token that carries a character of it (`value_start`; value_token_*, with value_token_position),
    after the value's tokens before it (a lone space), teacher-forced."""
    values = [sample.value, *sample.distractors]
    ids = [continuation_ids(tokenizer, v) for v in values]
    scores, steps = candidate_scores(model, sample.input_ids, ids, device)
    rank, top1 = rank_of_true(scores)
    at = value_start(tokenizer, ids[0])
    return {"distractors": list(sample.distractors), "logprobs": [round(x, 6) for x in scores],
            "candidate_tokens": [len(x) for x in ids], "rank": rank, "top1": top1,
            **first_token_fields(tokenizer, steps[0], ids[0][0]), "value_token_position": at,
            **first_token_fields(tokenizer, steps[at], ids[0][at], prefix="value_token")}


def value_start(tokenizer: Any, value_ids: list[int]) -> int:
    """The position of the value's first token that carries a character of it, not only the space before it: 0
    for most values; 1 for a value that starts with a digit in SmolLM2's tokenizer, whose numbers start with a
    lone space token. The last position when every token is blank."""
    for j, token in enumerate(value_ids):
        if tokenizer.decode([token]).strip():
            return j
    return len(value_ids) - 1


def first_token_fields(tokenizer: Any, next_logprobs: torch.Tensor, value_token: int, *,
                       prefix: str = "first_token") -> dict:
    """One teacher-forced step of the answer: PREFIX_rank, the rank of the value's token among the whole
    vocabulary (1 = the model's most likely next token, what greedy decoding picks; ties count against it);
    PREFIX_gap, how many nats the most likely token is above it (0 at rank 1); PREFIX_top, the most likely
    token's text. At the answer's start (first_token_*) a value ranked first among its candidates can still lose
    here to prose. (With SmolLM2's tokenizer a value that starts with a digit starts with a lone space token, the
    same for every such value: there first_token_* says whether the model starts an answer of that form, and
    value_token_* whether it then picks the value's own first digit.)"""
    true = next_logprobs[value_token]
    top = int(next_logprobs.argmax())
    others_as_likely = int((next_logprobs >= true).sum()) - 1  # a tie is no sure start: greedy may pick the other
    return {f"{prefix}_rank": 1 + others_as_likely, f"{prefix}_gap": round(float(next_logprobs[top] - true), 6),
            f"{prefix}_top": tokenizer.decode([top])}


def position_limit(model: Any) -> int | None:
    """The trained context of a position-limited model (a rope teacher); None for recurrent students."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) == "harness_student":
        return None
    return getattr(config, "max_position_embeddings", None)


# ---------------------------------------------------------------------------------------------- records


def _key(record: dict) -> tuple[str, int, float, int]:
    return record["kind"], int(record["length"]), float(record["depth"]), int(record["index"])


def run_header(tokenizer: Any, grid: NiahGrid, label: str) -> dict:
    """The settings every record depends on; a resumed run must match them."""
    probe = json.dumps([_encode(tokenizer, _PROBE), len(tokenizer), getattr(tokenizer, "chat_template", None)])
    return {"niah_format": FORMAT_VERSION, "label": label, "haystack": grid.haystack,
            "prompt": resolve_prompt_mode(tokenizer, grid.prompt), "seed": grid.seed,
            "max_new_tokens": grid.max_new_tokens,
            "tokenizer": hashlib.sha256(probe.encode()).hexdigest()[:16]}


def load_records(path: Path, header: dict, overwrite: bool = False) -> dict[tuple, dict]:
    """Finished samples in `path` by key, after checking its header; a new file gets `header` written.

    A last line cut short by a crash is dropped. A header that differs from `header` raises ValueError
    naming the settings that changed, unless `overwrite` (then the file starts over).
    """
    saved, lines = resume_lines(path, header, overwrite)
    detail = changed_settings(saved, header)
    if detail:
        raise ValueError(f"{path} was written with other NIAH settings ({detail}). Use another out_dir, delete "
                         "the file, or pass overwrite=True to start over.")
    records = {}
    for n, line in enumerate(lines, start=2):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {n} is not JSON ({err}); delete the file to start over") from err
        records[_key(record)] = record
    return records


def sample_record(sample: NiahSample, output: str) -> dict:
    """What is kept of one generated sample (with `likelihood_record`'s fields: one line of niah_cells.jsonl)."""
    return {"kind": sample.kind, "length": sample.length, "depth": sample.depth, "index": sample.index,
            "value": sample.value, "output": output, "correct": is_correct(sample.value, output),
            "context_length": sample.context_length, "needle_offset": sample.needle_offset,
            "needle_depth": round(sample.needle_depth, 6)}


def is_complete(record: Optional[dict], distractors: tuple[str, ...]) -> bool:
    """Whether a saved record has both scores, its likelihood against these `distractors` and the first- and
    value-token fields (records written before the likelihood score or those fields, or with another number of
    distractors, lack them: only they are then computed, the generated answer kept)."""
    return (record is not None and "top1" in record and "value_token_rank" in record
            and record.get("distractors") == list(distractors))


# ---------------------------------------------------------------------------------------------- run


def run_niah(model: Any, tokenizer: Any, grid: NiahGrid, out_dir: str | os.PathLike[str], *, label: str,
             device: str | torch.device = "cpu", progress: bool = True, overwrite: bool = False,
             generation_batch_size: int = 1) -> dict:
    """Evaluate `model` on every sample of `grid`, resuming from out_dir/niah_cells.jsonl; return niah.json.

    `model` is anything with a transformers-style `generate(input_ids=, attention_mask=, generation_config=)`
    and a forward with a cache (see `candidate_scores`): HarnessForCausalLM, LlamaForCausalLM, a test double;
    nn.Modules are put in eval mode on `device`. Writes niah_cells.jsonl (one line per finished sample, flushed),
    then niah.json, niah.csv, niah_heatmap.png and niah_likelihood_heatmap.png. A rerun computes only what
    niah_cells.jsonl lacks: the samples not there, and the likelihood score of records written without it (or
    against other distractors), whose generated answers are kept. `generation_batch_size` samples of one length
    (or neighbouring lengths) are generated together (`greedy_ids_batch`), then scored and written one by one.
    """
    grid.validate()
    check_batch_size(generation_batch_size)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = run_header(tokenizer, grid, label)
    records = load_records(out / CELLS_FILE, header, overwrite)
    keys = grid_keys(grid)
    todo = [k for k in keys if not is_complete(records.get(k), sample_distractors(tokenizer, grid, *k))]
    for kind in grid.kinds:  # fail now, not hours in, when a length is too short for the frame and needle
        for length in grid.lengths:
            build_sample(tokenizer, grid, kind, length, grid.depths[0], 0)
    limit = position_limit(model)
    _warn_beyond_limit(grid, limit, label)
    if isinstance(model, torch.nn.Module):
        model.to(device).eval()
    with tqdm(total=len(keys), initial=len(keys) - len(todo), desc=f"NIAH {label}", unit="sample",
              disable=not progress, dynamic_ncols=True) as bar:
        for batch in length_batches([k[1] for k in todo], generation_batch_size):
            for key, record in evaluate_samples(model, tokenizer, grid, [todo[i] for i in batch], records, device):
                append_record(out / CELLS_FILE, record)
                failpoint("niah.sample_saved")  # tests/test_faults.py stops the evaluation here
                records[key] = record
                bar.update()
                bar.set_postfix(length=key[1], **_tally(records, keys))
    result = summarise(records, grid, label, header["prompt"], limit)
    write_json(result, out / JSON_FILE)
    write_csv(result, out / CSV_FILE)
    plot_heatmap(result, out / HEATMAP_FILE)
    plot_heatmap(result, out / LIKELIHOOD_HEATMAP_FILE, metric="likelihood_accuracy")
    return result


def evaluate_samples(model: Any, tokenizer: Any, grid: NiahGrid, keys: list[tuple[str, int, float, int]],
                     saved: dict[tuple, dict], device: str | torch.device) -> Iterator[tuple[tuple, dict]]:
    """(key, record) of samples `keys`, in order: the ones without a `saved` record generated together (exact
    match), then each scored (likelihood); a saved record (one without a current likelihood score) keeps its
    generated answer and is only scored."""
    samples = [build_sample(tokenizer, grid, *key) for key in keys]
    fresh = [i for i, key in enumerate(keys) if saved.get(key) is None]
    outputs = generate_answers(model, tokenizer, [samples[i].input_ids for i in fresh], grid.max_new_tokens, device)
    answers = dict(zip(fresh, outputs))
    for i, (sample, key) in enumerate(zip(samples, keys)):
        record = saved.get(key) or sample_record(sample, answers[i])
        yield key, {**record, **likelihood_record(model, tokenizer, sample, device)}


def _tally(records: dict[tuple, dict], keys: list[tuple]) -> dict[str, str]:
    """The progress bar's running scores over the finished samples: exact matches and likelihood top1s."""
    done = [records[k] for k in keys if k in records and "top1" in records[k]]
    return {"correct": f"{sum(bool(r['correct']) for r in done)}/{len(done)}",
            "top1": f"{sum(r['top1'] for r in done):.1f}/{len(done)}"}


def _warn_beyond_limit(grid: NiahGrid, limit: int | None, label: str) -> None:
    beyond = [n for n in grid.lengths if limit is not None and n > limit]
    if beyond:
        warnings.warn(f"NIAH {label}: lengths {beyond} exceed the model's max_position_embeddings ({limit}); "
                      "they are scored anyway and marked beyond_max_positions", stacklevel=3)
