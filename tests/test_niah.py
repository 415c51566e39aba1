"""Needle in a haystack: exact prompt lengths and needle depths, scoring, resume, and real models end to end."""

from __future__ import annotations

import copy
import csv
import hashlib
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import harness
from harness.data.embedded import embedded_subset_path
from harness.decoding import candidate_logprobs, candidate_scores
from harness.eval import niah
from harness.eval.niah import KINDS, NiahGrid, build_sample, is_correct, rank_of_true, run_niah, snap_window
from harness.student import RecurrentCache
from tests.pipeline import tiny_tokenizer
from tests.tiny import tiny_llama

# What the needle sentences say, as a reader of the prompt would find them (not niah's own templates' code).
NEEDLE_PATTERNS = {
    "passkey": r"The pass key is (\d{7})\. Remember it\. \1 is the pass key\.",
    "uuid": r"The special magic UUID for [a-z]+-[a-z]+ is: "
            r"([0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12})\.",
    "kv": r"The secret word for [a-z]+-[a-z]+ is ([a-z]+)\.",
}


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf: Path, smollm2_cache: Path):
    from harness.teacher import load_tokenizer

    return load_tokenizer(str(smollm2_gguf), cache_dir=smollm2_cache)


@pytest.fixture(scope="module")
def tiny_tok():
    return tiny_tokenizer()


def find_all(haystack: list[int], needle: list[int]) -> list[int]:
    return [i for i in range(len(haystack) - len(needle) + 1) if haystack[i:i + len(needle)] == needle]


# ---------------------------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("kind", KINDS)
def test_prompt_has_the_requested_length_and_the_needle_sits_at_the_requested_depth(smollm2_tokenizer, kind):
    tok = smollm2_tokenizer
    essays = "\n\n".join(json.loads(line)["text"] for line in open(embedded_subset_path("essays")))
    grid = NiahGrid(prompt="chat")
    for length in (256, 1000, 4096):
        for depth in (0.0, 0.1, 0.33, 0.5, 0.9, 1.0):
            s = build_sample(tok, grid, kind, length, depth, index=1)
            assert len(s.input_ids) == s.context_length == length
            needle_ids = tok(s.needle.text, add_special_tokens=False).input_ids
            assert find_all(s.input_ids, needle_ids) == [s.needle_offset]  # there, once, where it says
            assert re.search(NEEDLE_PATTERNS[kind], tok.decode(needle_ids)).group(1) == s.value
            prose = s.input_ids[s.haystack_start:s.needle_offset] + s.input_ids[s.needle_offset + len(needle_ids):
                                                                               s.haystack_end]
            exact = round(depth * len(prose))
            moved = s.needle_offset - s.haystack_start - exact
            assert abs(moved) <= snap_window(len(prose)), (length, depth, moved)
            assert abs(s.needle_depth - depth) <= max(niah.DEPTH_SNAP, niah.MIN_SNAP_TOKENS / len(prose)) + 1e-9
            if depth in (0.0, 1.0):
                assert moved == 0
            else:  # the needle does not split a word of the prose
                at = s.needle_offset - s.haystack_start
                before, after = tok.decode(prose[at - 1:at]), tok.decode(prose[at:at + 1])
                assert before[-1:].isspace() or after[:1].isspace(), (before, after)
            # the haystack is real essay prose, and the prompt is the chat template with the question at the end
            assert tok.decode(prose[:12]).strip() in essays
            text = tok.decode(s.input_ids)
            assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\n" + niah.INSTRUCTION in text
            assert text.endswith(f"{s.needle.question}<|im_end|>\n<|im_start|>assistant\n{s.needle.answer_prefix}")


def test_long_prompts_beyond_the_default_grid_are_exact_too(smollm2_tokenizer):
    s = build_sample(smollm2_tokenizer, NiahGrid(haystack="wikipedia"), "kv", 16384, 0.75, 0)
    assert s.context_length == 16384
    assert abs(s.needle_depth - 0.75) <= niah.DEPTH_SNAP


def test_plain_prompt_for_a_tokenizer_without_chat_template(tiny_tok, tmp_path):
    text = tmp_path / "prose.txt"
    text.write_text(" ".join(["The river ran past the old mill. It was a cold winter."] * 200))
    grid = NiahGrid(haystack=str(text))
    s = build_sample(tiny_tok, grid, "passkey", 512, 0.5, 0)
    assert s.prompt_mode == "plain" and len(s.input_ids) == 512
    decoded = tiny_tok.decode(s.input_ids)
    assert decoded.startswith(niah.INSTRUCTION + "The river")
    assert decoded.endswith("Question: What is the pass key?\nAnswer: The pass key is")
    # at depth 0.5 of prose made of whole sentences, the needle starts a sentence
    before = tiny_tok.decode(s.input_ids[:s.needle_offset])
    assert before.endswith(".") and abs(s.needle_depth - 0.5) <= niah.DEPTH_SNAP
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        build_sample(tiny_tok, NiahGrid(haystack=str(text), prompt="chat"), "passkey", 512, 0.5, 0)


def test_the_default_prompt_is_plain_text_even_when_the_tokenizer_has_a_chat_template(smollm2_tokenizer):
    from harness.config import NiahConfig

    assert NiahConfig().prompt == NiahGrid().prompt == "plain"  # the job's default and the library's agree
    for mode in ("plain", "chat", "auto"):
        s = build_sample(smollm2_tokenizer, NiahGrid(prompt=mode), "kv", 512, 0.5, 0)
        text = smollm2_tokenizer.decode(s.input_ids)
        assert len(s.input_ids) == 512 and s.prompt_mode == ("plain" if mode == "plain" else "chat")
        if mode == "plain":  # no turn markers: instruction, prose, then the question as text
            assert "<|im_start|>" not in text and "<|im_end|>" not in text
            assert text.startswith(niah.INSTRUCTION)
            assert text.endswith(f"\n\nQuestion: {s.needle.question}\nAnswer: {s.needle.answer_prefix}")
        else:
            assert text.startswith("<|im_start|>system\n") and "<|im_start|>assistant\n" in text
        assert text.count(s.needle.text.strip()) == 1


def test_samples_are_deterministic_and_differ_between_indices_and_seeds(smollm2_tokenizer):
    grid = NiahGrid()
    a = build_sample(smollm2_tokenizer, grid, "uuid", 512, 0.25, 0)
    assert a == build_sample(smollm2_tokenizer, grid, "uuid", 512, 0.25, 0)
    assert a.value != build_sample(smollm2_tokenizer, grid, "uuid", 512, 0.25, 1).value
    assert a.input_ids != build_sample(smollm2_tokenizer, NiahGrid(seed=1), "uuid", 512, 0.25, 0).input_ids


@pytest.mark.parametrize("kwargs, message", [
    ({"kinds": ["needle"]}, r"unknown needle kind 'needle'; choose from \('passkey', 'uuid', 'kv'\)"),
    ({"depths": [50]}, r"depth 50 is not a fraction in \[0, 1\]"),
    ({"lengths": [0]}, r"lengths must hold positive integers, got 0"),
    ({"lengths": [256, 256]}, "duplicates"),
    ({"prompt": "fancy"}, r"unknown NIAH prompt mode 'fancy'; choose from \('auto', 'chat', 'plain'\)"),
    ({"haystack": "novels"}, r"unknown NIAH haystack 'novels': use one of \('essays', 'wikipedia'\)"),
    ({"samples": 0}, "samples must hold positive integers"),
    ({"distractors": 0}, "distractors must hold positive integers"),
    ({"distractors": 21}, r"distractors=21 is above 20"),
])
def test_bad_grid_settings_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NiahGrid(**kwargs)


def test_the_grid_and_the_jobs_niah_settings_share_their_choices():
    from harness.config import NiahConfig
    from harness.config_choices import NeedleKind, NiahPrompt

    assert niah.KINDS == NeedleKind.values() == ("passkey", "uuid", "kv")
    assert niah.PROMPT_MODES == NiahPrompt.values()
    assert NiahGrid().kinds == NiahConfig().kinds and NiahGrid().prompt == NiahConfig().prompt


def test_the_jobs_niah_settings_check_the_distractors_and_the_prompt():
    from harness.config import ConfigError, EvalConfig, NiahConfig, check_eval

    check_eval(EvalConfig(niah=NiahConfig(distractors=20, prompt="chat")))
    for bad, message in ((NiahConfig(distractors=0), "eval.niah.distractors=0 must lie in 1..20"),
                         (NiahConfig(prompt="fancy"), "eval.niah.prompt")):
        with pytest.raises(ConfigError, match=message):
            check_eval(EvalConfig(niah=bad))
    assert NiahConfig().distractors == NiahGrid().distractors == niah.DEFAULT_DISTRACTORS


def test_too_short_length_says_the_minimum(smollm2_tokenizer):
    with pytest.raises(ValueError, match=r"NIAH length 64 is too short .* use lengths >= \d+"):
        build_sample(smollm2_tokenizer, NiahGrid(), "uuid", 64, 0.5, 0)
    with pytest.raises(ValueError, match="unknown needle kind 'number'"):
        build_sample(smollm2_tokenizer, NiahGrid(), "number", 256, 0.5, 0)


def test_scoring_is_whole_word_match_in_the_answer_line():
    assert is_correct("4829173", " 4829173.")
    assert is_correct("4829173", "\n\n  it is 4829173, as said.\nmore")
    assert is_correct("lantern", " Lantern.")
    assert is_correct("e3e70682-c209-4cac-a29f-6fbed82c07cd", " E3E70682-C209-4CAC-A29F-6FBED82C07CD")
    assert not is_correct("4829173", " 48291730")
    assert not is_correct("4829173", " 14829173")
    assert not is_correct("lantern", " lanterns")
    assert not is_correct("4829173", " I do not know.\n4829173")  # only the first non-empty line counts
    assert not is_correct("4829173", "")


# ---------------------------------------------------------------------------------------------- test doubles


class Seen:
    """A scripted model's cache: one state per batch row, built from the tokens that row has seen."""

    def __init__(self, rows: list) -> None:
        self.rows = rows

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.rows = [copy.deepcopy(row) for row in self.rows for _ in range(repeats)]


class ScriptedLM:
    """A causal LM double: each row's state sees its tokens one by one (`push`) and says what it expects next
    (`expect`, a small value), which `render` turns into logits [B, T, V] all at once; so the logits at a
    position depend on that position and the ones before only. It takes the calls a transformers causal LM
    takes (input_ids, cache, use_cache, logits_to_keep) and greedy-decodes in `generate`. Subclasses define the
    state (`new_state`) and `render`."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def new_state(self):
        raise NotImplementedError

    def render(self, expected: list[list]) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, input_ids: torch.Tensor, cache: Seen | None = None, use_cache: bool = False,
                 logits_to_keep: int = 0, **kwargs) -> SimpleNamespace:
        cache = cache or Seen([self.new_state() for _ in range(input_ids.shape[0])])
        assert len(cache.rows) == input_ids.shape[0]
        keep = logits_to_keep or input_ids.shape[1]
        expected = []
        for state, row in zip(cache.rows, input_ids.tolist()):
            expected.append([])
            for position, token in enumerate(row):
                state.push(token)
                if position >= len(row) - keep:
                    expected[-1].append(state.expect())
        return SimpleNamespace(logits=self.render(expected), cache=cache)

    def generate(self, input_ids: torch.Tensor, attention_mask=None, generation_config=None, stopping_criteria=(),
                 **kwargs) -> torch.Tensor:
        assert input_ids.shape[0] == 1 and bool(attention_mask.all())  # batch 1, no padding
        state, ids = self.new_state(), input_ids[0].tolist()
        for token in ids:
            state.push(token)
        eos = generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [eos])
        for _ in range(generation_config.max_new_tokens):
            ids.append(int(self.render([[state.expect()]])[0, 0].argmax()))
            state.push(ids[-1])
            if ids[-1] in eos or any(bool(c(torch.tensor([ids]), None).all()) for c in stopping_criteria):
                break
        return torch.tensor([ids])


class Uniform(ScriptedLM):
    """Ignores everything: the same logits (zeros) after any context."""

    class State:
        def push(self, token: int) -> None:
            pass

        def expect(self) -> None:
            return None

    def new_state(self):
        return Uniform.State()

    def render(self, expected: list[list]) -> torch.Tensor:
        return torch.zeros(len(expected), len(expected[0]), self.vocab)


class Bigram(ScriptedLM):
    """Ignores the context but the last token: fixed random logits for each previous token (a random rank-8
    bigram table, E[previous] @ F.T)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        super().__init__(vocab)
        generator = torch.Generator().manual_seed(seed)
        self.e, self.f = (torch.randn(vocab, 8, generator=generator) for _ in range(2))

    class State:
        def __init__(self) -> None:
            self.last = 0

        def push(self, token: int) -> None:
            self.last = token

        def expect(self) -> int:
            return self.last

    def new_state(self):
        return Bigram.State()

    def render(self, expected: list[list]) -> torch.Tensor:
        return self.e[torch.tensor(expected)] @ self.f.T


class Copier(ScriptedLM):
    """Reads the context: an induction copier. After a context of up to 8 tokens seen before (the longest such
    suffix, its latest occurrence) it puts all probability on the token that followed it then; else uniform.
    After a question's answer primer ("The pass key is") it therefore copies the needle's value."""

    class State:
        def __init__(self, longest: int = 8) -> None:
            self.longest, self.tokens = longest, []
            self.follow: list[dict] = [{} for _ in range(longest + 1)]  # follow[m][last m tokens] = next token

        def push(self, token: int) -> None:
            for m in range(1, min(self.longest, len(self.tokens)) + 1):
                self.follow[m][tuple(self.tokens[-m:])] = token
            self.tokens.append(token)

        def expect(self) -> int | None:
            for m in range(min(self.longest, len(self.tokens)), 0, -1):
                if (nxt := self.follow[m].get(tuple(self.tokens[-m:]))) is not None:
                    return nxt
            return None

        def __deepcopy__(self, memo):  # keys are tuples of ints: copying the dicts is enough
            state = Copier.State(self.longest)
            state.tokens, state.follow = list(self.tokens), [dict(d) for d in self.follow]
            return state

    def new_state(self):
        return Copier.State()

    def render(self, expected: list[list]) -> torch.Tensor:
        logits = torch.zeros(len(expected), len(expected[0]), self.vocab)
        hits = [(b, j, t) for b, row in enumerate(expected) for j, t in enumerate(row) if t is not None]
        if hits:
            b, j, t = map(torch.tensor, zip(*hits))
            logits[b, j, t] = 40.0
        return logits


class Reader(Uniform):
    """A `generate()` double that reads the prompt and answers with the needle's value (or not).

    mode: "echo" answers right, "silent" never does, "off_by_one" gives a different number of the same shape,
    "half" answers right for about half of the samples (by a hash of the value).
    fail_after: raise after this many calls (an interrupted evaluation).
    """

    def __init__(self, tokenizer, mode: str = "echo", fail_after: int | None = None):
        super().__init__(len(tokenizer))  # its likelihood score: Uniform's, chance
        self.tokenizer, self.mode, self.fail_after, self.calls = tokenizer, mode, fail_after, 0

    def generate(self, input_ids: torch.Tensor, attention_mask=None, generation_config=None, **kwargs):
        assert input_ids.shape[0] == 1 and bool(attention_mask.all())  # batch 1, no padding
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise RuntimeError("interrupted")
        self.calls += 1
        prompt = self.tokenizer.decode(input_ids[0].tolist())
        values = [m.group(1) for p in NEEDLE_PATTERNS.values() for m in re.finditer(p, prompt)]
        assert len(values) == 1, values
        value = values[0]
        if self.mode == "silent" or (self.mode == "half" and int(hashlib.sha256(value.encode()).hexdigest(), 16) % 2):
            answer = " I do not know."
        elif self.mode == "off_by_one":
            answer = " " + value[:-1] + str((int(value[-1], 16) + 1) % 10) if value[-1].isdigit() else " " + value + "s"
        else:
            answer = f" {value}.\n"
        new = self.tokenizer(answer, add_special_tokens=False, return_tensors="pt").input_ids
        return torch.cat([input_ids, new], dim=1)


class ProseFirst(Copier):
    """The copier with a prose prior: one token (" the") 10 logits above whatever it copies, after any context.
    It ranks the needle's value first among the candidates (the same prior lowers every one alike) and never
    starts it: the 2,048-token failures of docs/results/retrieval-135m/ in miniature."""

    def __init__(self, vocab: int, prose_token: int) -> None:
        super().__init__(vocab)
        self.prose_token = prose_token

    def render(self, expected: list[list]) -> torch.Tensor:
        logits = super().render(expected)
        logits[..., self.prose_token] = 50.0
        return logits


SMALL = dict(lengths=[256, 384], depths=[0.0, 0.5, 1.0], kinds=["passkey", "uuid", "kv"], samples=2)


def test_a_reader_of_the_needle_scores_100_and_others_score_0(smollm2_tokenizer, tmp_path):
    grid = NiahGrid(**SMALL)
    cells = len(grid.kinds) * len(grid.lengths) * len(grid.depths)
    right = run_niah(Reader(smollm2_tokenizer), smollm2_tokenizer, grid, tmp_path / "echo", label="echo",
                     progress=False)
    assert right["overall"] == 1.0 and all(c["accuracy"] == 1.0 for c in right["cells"])
    assert right["by_length"] == {"256": 1.0, "384": 1.0} and right["by_kind"] == dict.fromkeys(grid.kinds, 1.0)
    for mode in ("silent", "off_by_one"):
        wrong = run_niah(Reader(smollm2_tokenizer, mode), smollm2_tokenizer, grid, tmp_path / mode, label=mode,
                         progress=False)
        assert wrong["overall"] == 0.0 and all(c["correct"] == 0 for c in wrong["cells"]), mode

    out = tmp_path / "echo"
    saved = json.loads((out / "niah.json").read_text())
    assert saved == right
    assert set(saved) >= {"label", "grid", "overall", "by_length", "by_kind", "cells"}
    assert len(saved["cells"]) == cells and saved["grid"]["lengths"] == [256, 384] and saved["label"] == "echo"
    assert set(saved["cells"][0]) >= {"kind", "length", "depth", "samples", "correct", "accuracy"}
    assert saved["prompt_mode"] == "plain" and saved["max_position_embeddings"] is None
    rows = list(csv.DictReader(open(out / "niah.csv")))
    assert len(rows) == cells and rows[0]["kind"] == "passkey" and float(rows[0]["accuracy"]) == 1.0
    assert (out / "niah_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in open(out / "niah_cells.jsonl")][1:]
    assert len(records) == cells * grid.samples and all(r["context_length"] == r["length"] for r in records)


def test_an_interrupted_evaluation_resumes_where_it_stopped(smollm2_tokenizer, tmp_path):
    grid = NiahGrid(**SMALL)
    total = len(niah.grid_keys(grid))
    whole = run_niah(Reader(smollm2_tokenizer, "half"), smollm2_tokenizer, grid, tmp_path / "whole", label="m",
                     progress=False)
    assert 0.0 < whole["overall"] < 1.0  # a mixed result, so that equality below means something

    out = tmp_path / "resumed"
    with pytest.raises(RuntimeError, match="interrupted"):
        run_niah(Reader(smollm2_tokenizer, "half", fail_after=7), smollm2_tokenizer, grid, out, label="m",
                 progress=False)
    assert len((out / "niah_cells.jsonl").read_text().splitlines()) == 1 + 7
    assert not (out / "niah.json").exists()
    with open(out / "niah_cells.jsonl", "a") as f:  # a crash in the middle of writing a line
        f.write('{"kind": "passkey", "len')
    second = Reader(smollm2_tokenizer, "half")
    assert run_niah(second, smollm2_tokenizer, grid, out, label="m", progress=False) == whole
    assert second.calls == total - 7  # the finished samples were not recomputed
    keys = [(r["kind"], r["length"], r["depth"], r["index"])
            for r in map(json.loads, (out / "niah_cells.jsonl").read_text().splitlines()[1:])]
    assert len(keys) == len(set(keys)) == total

    third = Reader(smollm2_tokenizer, "half")  # all done: nothing to compute
    assert run_niah(third, smollm2_tokenizer, grid, out, label="m", progress=False) == whole and third.calls == 0
    bigger = NiahGrid(**{**SMALL, "lengths": [256, 384, 512]})  # a longer length reuses the others
    fourth = Reader(smollm2_tokenizer, "half")
    run_niah(fourth, smollm2_tokenizer, bigger, out, label="m", progress=False)
    assert fourth.calls == total // 2


def test_resuming_with_other_settings_is_refused_unless_overwriting(smollm2_tokenizer, tmp_path):
    grid = NiahGrid(**{**SMALL, "kinds": ["kv"], "samples": 1})
    run_niah(Reader(smollm2_tokenizer), smollm2_tokenizer, grid, tmp_path, label="m", progress=False)
    other = NiahGrid(**{**SMALL, "kinds": ["kv"], "samples": 1, "seed": 3})
    with pytest.raises(ValueError, match=r"other NIAH settings \(seed: saved 0, now 3\).*overwrite=True"):
        run_niah(Reader(smollm2_tokenizer), smollm2_tokenizer, other, tmp_path, label="m", progress=False)
    with pytest.raises(ValueError, match="label: saved 'm', now 'n'"):
        run_niah(Reader(smollm2_tokenizer), smollm2_tokenizer, grid, tmp_path, label="n", progress=False)
    again = Reader(smollm2_tokenizer)
    result = run_niah(again, smollm2_tokenizer, other, tmp_path, label="m", progress=False, overwrite=True)
    assert again.calls == len(niah.grid_keys(other)) and result["grid"]["seed"] == 3


# ---------------------------------------------------------------------------------------------- likelihood

VALUE_FORMATS = {"passkey": r"[1-9]\d{6}", "kv": r"[a-z]+",
                 "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"}
LIKELIHOOD_FIELDS = ("distractors", "logprobs", "candidate_tokens", "rank", "top1")


def n_tokens(tokenizer, value: str) -> int:
    return len(tokenizer(" " + value, add_special_tokens=False).input_ids)


@pytest.mark.parametrize("kind", KINDS)
def test_distractors_are_deterministic_distinct_and_of_the_needles_format(smollm2_tokenizer, kind):
    tok, grid = smollm2_tokenizer, NiahGrid()
    seen = set()
    for length, depth, index in [(256, 0.0, 0), (512, 0.5, 1), (1024, 1.0, 2), (256, 0.5, 3), (384, 0.25, 4)]:
        s = build_sample(tok, grid, kind, length, depth, index)
        values = s.distractors
        assert len(values) == grid.distractors == 9 and len(set(values)) == 9 and s.value not in values
        assert values == niah.sample_distractors(tok, grid, kind, length, depth, index)  # from the cell's seed
        assert values != niah.sample_distractors(tok, NiahGrid(seed=1), kind, length, depth, index)
        assert all(re.fullmatch(VALUE_FORMATS[kind], v) for v in values)
        seen.add(values)
        counts = [n_tokens(tok, v) for v in values]
        if kind == "kv":  # the needle's own word list, minus what the question names; its token count first
            assert all(v in niah._NOUNS and v not in s.needle.key for v in values)
            same = [w for w in niah._NOUNS if w not in s.needle.key and w != s.value
                    and n_tokens(tok, w) == n_tokens(tok, s.value)]
            assert counts.count(n_tokens(tok, s.value)) == min(9, len(same))
        else:
            assert counts == [n_tokens(tok, s.value)] * 9
    assert len(seen) == 5  # each sample has its own


def test_rank_of_true_shares_ties_so_that_indistinguishable_candidates_score_chance():
    assert rank_of_true([-1.0, -2.0, -3.0]) == (1.0, 1.0)
    assert rank_of_true([-2.0, -1.0, -3.0]) == (2.0, 0.0)
    assert rank_of_true([-3.0, -1.0, -2.0]) == (3.0, 0.0)
    assert rank_of_true([-1.0] * 4) == (2.5, 0.25)  # k alike: mean rank (k + 1) / 2, top1 1 / k
    assert rank_of_true([-1.0, -1.0 + 1e-6, -5.0]) == (1.5, 0.5)  # within TIE_TOLERANCE
    assert rank_of_true([-1.0, -1.0 + 1e-6, 0.0]) == (2.5, 0.0)
    assert rank_of_true([-1.0, -1.0 + 1e-3, -5.0]) == (2.0, 0.0)  # beyond it
    assert rank_of_true([math.nan, -1.0]) == (2.0, 0.0)  # a broken score never wins
    assert rank_of_true([-math.inf, -math.inf, -1.0]) == (2.5, 0.0)


def full_forward_logprobs(model, prompt: list[int], candidates: list[list[int]]) -> list[float]:
    """The reference: one uncached forward over prompt + candidate per candidate."""
    scores = []
    for cand in candidates:
        with torch.no_grad():
            lp = model(input_ids=torch.tensor([prompt + cand])).logits[0].float().log_softmax(-1)
        scores.append(sum(lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(cand)))
    return scores


def test_candidate_logprobs_from_one_cached_prompt_equal_full_forwards(tiny_tok):
    teacher = tiny_llama(num_layers=2, hidden=64, heads=4, kv_heads=2, vocab=len(tiny_tok), seed=0)
    models = {"llama": teacher,
              "gated_deltanet": harness.build_student(teacher, "gated_deltanet", backend="reference").eval(),
              "gla rope": harness.build_student(teacher, "gla", backend="reference", rope=True).eval()}
    prompt = tiny_tok("The river ran past the old mill. It was a cold winter. The pass key is").input_ids
    candidates = [[5, 9, 11], [7], [5, 9, 12, 13, 14], [30, 31], [5, 9, 11]]  # shared prefixes, lengths 1 to 5
    for name, model in models.items():
        got = candidate_logprobs(model, prompt, candidates)
        assert got == pytest.approx(full_forward_logprobs(model, prompt, candidates), abs=1e-4), name
        assert got[0] == pytest.approx(got[4], abs=1e-6) and len(set(round(x, 3) for x in got[:4])) == 4, name
        _, steps = candidate_scores(model, prompt, candidates)  # the first candidate's distribution at each token
        with torch.no_grad():
            full = model(input_ids=torch.tensor([prompt + candidates[0]])).logits[0].float().log_softmax(-1)
        assert steps.shape == (3, len(tiny_tok))
        torch.testing.assert_close(steps, full[len(prompt) - 1:len(prompt) + 2], atol=1e-4, rtol=0, msg=name)
        _, alone = candidate_scores(model, prompt, [[7], [8]])
        torch.testing.assert_close(alone, full[len(prompt) - 1:len(prompt)], atol=1e-4, rtol=0, msg=name)


def test_the_value_starts_at_its_first_token_that_is_not_blank(smollm2_tokenizer):
    tok = smollm2_tokenizer
    for value, start in (("4096358", 1), ("728b80b5-1fc1", 1), ("b494ec5d-c32", 0), ("cobweb", 0)):
        ids = niah.continuation_ids(tok, value)
        assert niah.value_start(tok, ids) == start, (value, [tok.decode([i]) for i in ids])
    blank = tok(" ", add_special_tokens=False).input_ids
    assert niah.value_start(tok, blank * 2) == 1  # nothing but blanks: the last position


def test_a_copier_scores_100_on_both_scores_with_either_prompt(smollm2_tokenizer, tmp_path):
    for prompt in ("plain", "chat"):
        grid = NiahGrid(**SMALL, prompt=prompt)
        result = run_niah(Copier(len(smollm2_tokenizer)), smollm2_tokenizer, grid, tmp_path / prompt,
                          label="copier", progress=False)
        assert result["prompt_mode"] == prompt
        assert result["overall"] == 1.0 and result["likelihood"]["overall"] == 1.0, prompt
        assert all(c["accuracy"] == c["likelihood_accuracy"] == c["mean_rank"] == 1.0 for c in result["cells"])
        assert result["likelihood"]["by_length"] == {"256": 1.0, "384": 1.0}
        assert result["likelihood"]["by_depth"] == {"0.0": 1.0, "0.5": 1.0, "1.0": 1.0}
        records = [json.loads(line) for line in open(tmp_path / prompt / "niah_cells.jsonl")][1:]
        assert all(r["logprobs"][0] > -1e-3 > max(r["logprobs"][1:]) for r in records)  # the value, surely
        assert result["likelihood"]["first_token_top1"] == 1.0 and result["likelihood"]["first_token_gap"] == 0.0
        assert all(r["first_token_rank"] == 1 and r["value"].startswith(r["first_token_top"].strip())
                   for r in records)
        assert result["likelihood"]["value_token_top1"] == 1.0 and all(r["value_token_rank"] == 1 for r in records)
        assert {r["value_token_position"] for r in records if r["kind"] == "passkey"} == {1}  # " " then a digit
        assert all(r["value_token_position"] == (1 if r["value"][0].isdigit() else 0) for r in records)
        assert all(r["value"].startswith(r["value_token_top"].strip()) for r in records if r["kind"] == "kv")


class DigitsAsZero(Copier):
    """The copier, but where it would copy a digit it writes 0: it starts every pass key (the lone space token
    that starts a number) and never its first digit."""

    def __init__(self, tokenizer) -> None:
        super().__init__(len(tokenizer))
        self.digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
        self.zero = tokenizer.convert_tokens_to_ids("0")

    def render(self, expected: list[list]) -> torch.Tensor:
        return super().render([[self.zero if t in self.digits else t for t in row] for row in expected])


def test_the_value_token_tells_a_started_number_from_the_value_itself(smollm2_tokenizer, tmp_path):
    """A model that answers every pass key with a number, but not the value's: the first-token score (the lone
    space) says it starts the answer, the value-token score (the first digit) that it never picks the value."""
    tok = smollm2_tokenizer
    grid = NiahGrid(**{**SMALL, "kinds": ["passkey"]})
    result = run_niah(DigitsAsZero(tok), tok, grid, tmp_path, label="zeros", progress=False)
    lik = result["likelihood"]
    records = [json.loads(line) for line in open(tmp_path / "niah_cells.jsonl")][1:]
    assert not any(r["value"].startswith("0") for r in records)
    assert result["overall"] == 0.0 and lik["first_token_top1"] == 1.0
    assert lik["value_token_top1"] == 0.0 and lik["value_token_top1_by_length"] == {"256": 0.0, "384": 0.0}
    assert {(r["value_token_position"], r["value_token_top"]) for r in records} == {(1, "0")}
    assert lik["value_token_gap"] == pytest.approx(40.0, abs=1e-3)


def test_the_first_token_score_tells_a_value_ranked_first_from_one_decoding_starts(smollm2_tokenizer, tmp_path):
    """A model whose prose prior outweighs its copying ranks every value first among its candidates (likelihood
    100%), answers none (exact 0%), and the first-token score says why: another token is its first choice, by
    the prior's 10 nats. A model that ignores the context (all tokens tied) never has the value as a sure start."""
    tok = smollm2_tokenizer
    the = tok(" the", add_special_tokens=False).input_ids
    assert len(the) == 1
    grid = NiahGrid(**{**SMALL, "kinds": ["passkey", "uuid"]})
    result = run_niah(ProseFirst(len(tok), the[0]), tok, grid, tmp_path / "prose", label="prose", progress=False)
    lik = result["likelihood"]
    assert result["overall"] == 0.0 and lik["overall"] == 1.0
    assert lik["first_token_top1"] == 0.0 and lik["first_token_top1_by_length"] == {"256": 0.0, "384": 0.0}
    assert lik["first_token_gap"] == pytest.approx(10.0, abs=1e-3)
    records = [json.loads(line) for line in open(tmp_path / "prose" / "niah_cells.jsonl")][1:]
    assert {(r["first_token_rank"], r["first_token_top"]) for r in records} == {(2, " the")}
    flat = run_niah(Uniform(len(tok)), tok, grid, tmp_path / "uniform", label="uniform", progress=False)
    assert flat["likelihood"]["first_token_top1"] == 0.0 and flat["likelihood"]["first_token_gap"] == 0.0
    rows = [json.loads(line) for line in open(tmp_path / "uniform" / "niah_cells.jsonl")][1:]
    assert {r["first_token_rank"] for r in rows} == {len(tok)}  # every token as likely: ranked behind them all


def test_first_token_fields_rank_the_value_over_the_vocabulary(tiny_tok):
    logprobs = torch.tensor([-3.0, -1.0, -2.0, -1.0, -5.0]).log_softmax(-1)
    fields = niah.first_token_fields(tiny_tok, logprobs, 2)
    assert fields["first_token_rank"] == 3 and fields["first_token_gap"] == pytest.approx(1.0)
    assert fields["first_token_top"] == tiny_tok.decode([1])
    assert niah.first_token_fields(tiny_tok, logprobs, 1)["first_token_rank"] == 2  # tied with token 3
    alone = torch.tensor([-3.0, 0.0, -2.0]).log_softmax(-1)
    assert niah.first_token_fields(tiny_tok, alone, 1) == {"first_token_rank": 1, "first_token_gap": 0.0,
                                                            "first_token_top": tiny_tok.decode([1])}


def test_a_model_that_ignores_the_context_scores_chance_exactly(smollm2_tokenizer, tmp_path):
    grid = NiahGrid(**{**SMALL, "kinds": ["passkey", "uuid"]})  # their distractors always match in tokens
    result = run_niah(Uniform(len(smollm2_tokenizer)), smollm2_tokenizer, grid, tmp_path, label="uniform",
                      progress=False)
    lik = result["likelihood"]
    assert lik["candidates"] == 10 and lik["chance"] == 0.1 and lik["chance_rank"] == 5.5
    assert lik["same_token_count"] == 1.0
    assert lik["overall"] == pytest.approx(0.1, abs=1e-12) and lik["mean_rank"] == 5.5
    assert all(c["likelihood_accuracy"] == pytest.approx(0.1) and c["mean_rank"] == 5.5 for c in result["cells"])
    assert result["overall"] == 0.0  # nor does it answer


def test_a_context_free_bigram_model_scores_chance_within_binomial_tolerance(smollm2_tokenizer, tmp_path):
    grid = NiahGrid(lengths=[256], depths=[0.0, 0.5, 1.0], kinds=list(KINDS), samples=30, max_new_tokens=2)
    result = run_niah(Bigram(len(smollm2_tokenizer)), smollm2_tokenizer, grid, tmp_path, label="bigram",
                      progress=False)
    lik, n = result["likelihood"], len(niah.grid_keys(grid))
    k, p = lik["candidates"], lik["chance"]
    assert abs(lik["overall"] - p) < 4 * math.sqrt(p * (1 - p) / n), lik["overall"]  # 270 samples: 2.7%..17.3%
    assert abs(lik["mean_rank"] - lik["chance_rank"]) < 4 * math.sqrt((k * k - 1) / 12 / n), lik["mean_rank"]
    records = [json.loads(line) for line in open(tmp_path / "niah_cells.jsonl")][1:]
    assert all(r["top1"] in (0.0, 1.0) for r in records)  # no ties: it does tell candidates apart
    assert len({r["rank"] for r in records}) == k  # every rank occurs


def test_records_without_the_likelihood_score_keep_their_answers_and_are_only_scored(smollm2_tokenizer, tmp_path):
    grid = NiahGrid(**{**SMALL, "kinds": ["passkey", "kv"]})
    first = run_niah(Reader(smollm2_tokenizer, "half"), smollm2_tokenizer, grid, tmp_path, label="m", progress=False)
    assert 0.0 < first["overall"] < 1.0
    path = tmp_path / "niah_cells.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    old = [lines[0]] + [{k: v for k, v in r.items() if k not in LIKELIHOOD_FIELDS} for r in lines[1:]]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))  # as written before the likelihood score
    again = Reader(smollm2_tokenizer, "silent")  # would answer wrong: the saved answers must be kept
    assert run_niah(again, smollm2_tokenizer, grid, tmp_path, label="m", progress=False) == first
    assert again.calls == 0
    fewer = Reader(smollm2_tokenizer, "silent")
    four = run_niah(fewer, smollm2_tokenizer, NiahGrid(**{**SMALL, "kinds": ["passkey", "kv"], "distractors": 4}),
                    tmp_path, label="m", progress=False)
    assert fewer.calls == 0 and four["overall"] == first["overall"]
    assert four["likelihood"]["chance"] == 0.2 and four["likelihood"]["overall"] == pytest.approx(0.2)
    without_first = [lines[0]] + [{k: v for k, v in r.items() if not k.startswith(("first_token_", "value_token_"))}
                                  for r in lines[1:]]
    path.write_text("".join(json.dumps(r) + "\n" for r in without_first))  # as written before the first-token fields
    later = Reader(smollm2_tokenizer, "silent")
    assert run_niah(later, smollm2_tokenizer, grid, tmp_path, label="m", progress=False) == first
    assert later.calls == 0
    without_value = [lines[0]] + [{k: v for k, v in r.items() if not k.startswith("value_token_")} for r in lines[1:]]
    path.write_text("".join(json.dumps(r) + "\n" for r in without_value))  # first-token fields, no value-token ones
    later = Reader(smollm2_tokenizer, "silent")
    assert run_niah(later, smollm2_tokenizer, grid, tmp_path, label="m", progress=False) == first
    assert later.calls == 0


def test_the_report_shows_both_scores_by_length_and_reads_older_niah_files(smollm2_tokenizer, tmp_path):
    from harness.eval.report import build_report, compare, markdown, write_report

    tok, grid = smollm2_tokenizer, NiahGrid(**{**SMALL, "kinds": ["passkey"]})
    run_niah(Copier(len(tok)), tok, grid, tmp_path / "student", label="s", progress=False)
    run_niah(Uniform(len(tok)), tok, grid, tmp_path / "teacher", label="t", progress=False)
    report = build_report(tmp_path / "student", tmp_path / "teacher", label="run")
    student, teacher = report["niah"]["student"], report["niah"]["teacher"]
    assert student["likelihood"]["by_length"] == {"256": 1.0, "384": 1.0} and student["likelihood"]["chance"] == 0.1
    assert teacher["likelihood"]["overall"] == pytest.approx(0.1) and teacher["likelihood"]["mean_rank"] == 5.5
    assert student["prompt_mode"] == teacher["prompt_mode"] == "plain"
    md = markdown(report)
    assert "## Needle in a haystack (exact match)" in md and "## Needle in a haystack (likelihood)" in md
    assert "| model | 256 | 384 | overall | chance | mean rank |" in md
    assert "| student | 100.0% | 100.0% | 100.0% | 10.0% | 1 |" in md
    assert "| teacher | 10.0% | 10.0% | 10.0% | 10.0% | 5.5 |" in md
    assert "| teacher | 0.0% | 0.0% | 0.0% |" in md  # its exact match
    assert "| value's first token is the model's first choice | 256 | 384 | overall |" in md
    assert "| student | 100.0% | 100.0% | 100.0% |" in md and "| teacher | 0.0% | 0.0% | 0.0% |" in md
    value_table = md.split("| value's first character token is the model's first choice | 256 | 384 "
                           "| overall |")[1].split("\n\n")[0]
    assert "| student | 100.0% | 100.0% | 100.0% |" in value_table and "| teacher | 0.0% | 0.0% | 0.0% |" in value_table
    assert "NIAH prompts: plain." in md and "Warning" not in md
    write_report(report, tmp_path / "out")
    assert (tmp_path / "out" / "niah_by_length.png").stat().st_size > 1000

    # a niah.json from before the likelihood score: its exact match is reported, its likelihood row left out
    old = json.loads((tmp_path / "teacher" / "niah.json").read_text())
    del old["likelihood"]
    old["cells"] = [{k: v for k, v in c.items() if k not in ("likelihood_accuracy", "mean_rank")}
                    for c in old["cells"]]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "niah.json").write_text(json.dumps(old))
    older = build_report(tmp_path / "student", tmp_path / "old", label="older")
    assert older["niah"]["teacher"]["likelihood"] is None and older["niah"]["teacher"]["overall"] == 0.0
    md = markdown(older)
    assert "| teacher | 0.0% | 0.0% | 0.0% |" in md and "| teacher | 10.0%" not in md
    assert "| student | 100.0% | 100.0% | 100.0% | 10.0% | 1 |" in md
    table = (compare([report, older], tmp_path / "cmp")).read_text()
    assert "NIAH lik. student | NIAH lik. teacher" in table
    # no benchmarks (both recovery averages '-'), no perplexity here
    assert "| run | - | - | 100.0% | 0.0% | 100.0% | 10.0% | - |" in table
    assert "| older | - | - | 100.0% | 0.0% | 100.0% | - | - |" in table
    from harness.eval.curves import METRICS, TEACHER  # learning curves read it from the reports too

    assert METRICS["niah_likelihood"][0](report) == 1.0 and TEACHER["niah_likelihood"](report) == pytest.approx(0.1)
    assert TEACHER["niah_likelihood"](older) is None
    assert (tmp_path / "cmp" / "niah_by_length.png").stat().st_size > 1000

    # a teacher scored with chat prompts beside a student with plain ones: flagged
    run_niah(Uniform(len(tok)), tok, NiahGrid(**{**SMALL, "kinds": ["passkey"], "prompt": "chat"}), tmp_path / "chat",
             label="t", progress=False)
    mixed = markdown(build_report(tmp_path / "student", tmp_path / "chat", label="mixed"))
    assert "**Warning:** these NIAH results used different prompt modes (student: plain, teacher: chat)" in mixed


# ---------------------------------------------------------------------------------------------- real models


def test_tiny_student_generates_and_scores_with_its_recurrent_state(tiny_tok, tmp_path, monkeypatch):
    teacher = tiny_llama(num_layers=2, hidden=64, heads=4, kv_heads=2, vocab=len(tiny_tok), seed=0)
    student = harness.build_student(teacher, "gated_deltanet", backend="reference").eval()
    calls: list[tuple[int, int, int]] = []  # (rows, tokens fed, tokens the cache had seen)
    caches: list[object] = []
    forward = student.forward

    def spy(input_ids=None, cache=None, **kwargs):
        calls.append((input_ids.shape[0], input_ids.shape[1], cache.seen_tokens if cache is not None else 0))
        out = forward(input_ids=input_ids, cache=cache, **kwargs)
        caches.append(out.cache)
        return out

    monkeypatch.setattr(student, "forward", spy)
    grid = NiahGrid(lengths=[512, 1024], depths=[0.0, 1.0], kinds=["passkey", "kv"], samples=1, max_new_tokens=6)
    result = run_niah(student, tiny_tok, grid, tmp_path, label="tiny-gdn", progress=False)
    assert len(result["cells"]) == 8 and 0.0 <= result["overall"] <= 1.0
    assert 0.0 <= result["likelihood"]["overall"] <= 1.0 and 1.0 <= result["likelihood"]["mean_rank"] <= 10.0
    assert result["prompt_mode"] == "plain" and result["max_position_embeddings"] is None
    assert not any(c["beyond_max_positions"] for c in result["cells"])  # students have no position limit
    assert all(isinstance(cache, RecurrentCache) for cache in caches)
    lengths = sorted(c["length"] for c in result["cells"])
    # per sample, two prefills of the whole prompt (generation, likelihood) on a new state ...
    assert sorted(n for rows, n, seen in calls if seen == 0) == sorted(2 * lengths)
    assert all(rows == 1 for rows, n, seen in calls if seen == 0)
    # ... then one-token greedy steps on the state the first started ...
    steps = [(n, seen) for rows, n, seen in calls if seen and rows == 1]
    assert steps and all(n == 1 and seen >= 512 for n, seen in steps)
    # ... and one forward of all ten candidates (but their last tokens) on the second's, repeated
    scoring = [(rows, n, seen) for rows, n, seen in calls if rows > 1]
    assert sorted(seen for _, _, seen in scoring) == lengths and all(rows == 10 for rows, _, _ in scoring)
    records = [json.loads(line) for line in open(tmp_path / "niah_cells.jsonl")][1:]
    assert len(records) == 8 and all(isinstance(r["output"], str) for r in records)
    assert all(n == max(r["candidate_tokens"]) - 1 for (_, n, _), r in zip(scoring, records))


def test_real_smollm2_teacher_on_a_small_grid(smollm2_teacher, tmp_path):
    grid = NiahGrid(lengths=[256, 512], depths=[0.0, 1.0], kinds=["passkey", "kv"], samples=1)
    result = run_niah(smollm2_teacher.model, smollm2_teacher.tokenizer, grid, tmp_path, label="smollm2-135m",
                      progress=False)
    lik = result["likelihood"]
    records = [json.loads(line) for line in open(tmp_path / "niah_cells.jsonl")][1:]
    matched = [r for r in records if r["correct"]]
    print(f"\nSmolLM2-135M-Instruct NIAH (plain prompts): exact match {result['overall']:.2f}, by length "
          f"{result['by_length']}, by kind {result['by_kind']}; likelihood {lik['overall']:.2f} (chance "
          f"{lik['chance']:.2f}), mean rank {lik['mean_rank']:.2f}, by length {lik['by_length']}; exact matches "
          f"ranked first: {sum(r['top1'] == 1.0 for r in matched)}/{len(matched)}")
    assert result["prompt_mode"] == "plain" and result["max_position_embeddings"] == 8192
    assert len(result["cells"]) == 8 and 0.0 <= result["overall"] <= 1.0
    assert all(r["output"].strip() for r in records)  # the teacher answered something each time
    # it reads the needle: far above the chance a model that ignores the context gets
    assert lik["overall"] >= max(result["overall"], 3 * lik["chance"])
