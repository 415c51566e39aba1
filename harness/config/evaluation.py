"""The job's `eval:` section: what the evaluation job runs on the final student (benchmarks, the NIAH grid,
perplexity, chat samples, the copy and state probes, the copy score on text, instruction following) and the small
evaluation along stage 3.

The copy and state probes' settings (`CopyConfig`, `StateConfig`) check themselves when they are built, as the
evaluation spec's sections `copy:` and `state:` and as a job's eval.copy and eval.state; `keys_under` says which
of those names their errors give.
"""

from __future__ import annotations

import numbers
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from harness.config.fields import (FRACTION, POSITIVE, ConfigError, Rule, at_least_zero, check_fields, described,
                                   each)
from harness.config_choices import Haystack, NeedleKind, NiahPrompt

DISTRACTORS = Rule(lambda n: 1 <= n <= 20,  # harness.eval.niah.MAX_DISTRACTORS
                   "lie in 1..20 (the likelihood score's chance level is 1 / (1 + distractors))")


@dataclass
class NiahConfig:
    lengths: list[int] = described(
        help="Prompt lengths in tokens (context + question, chat template included).",
        factory=lambda: [256, 512, 1024, 2048, 4096, 8192], rule=each(POSITIVE),
    )
    depths: list[float] = described(
        help="Where the needle sits in the prose, as fractions 0.0 (start) .. 1.0 (end).",
        factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0], rule=each(Rule(FRACTION.holds, "lie in [0, 1] (50% is 0.5)")),
    )
    kinds: list[NeedleKind] = described(
        help="Needle kinds: 'passkey' (7 digits), 'uuid', 'kv' (a secret word for a key).",
        factory=lambda: list(NeedleKind),
    )
    samples: int = described(3, "Samples per (kind, length, depth) cell; each has its own needle and prose.",
                             rule=POSITIVE)
    haystack: str = described(
        "essays", "The prose: 'essays', 'wikipedia' (both from the embedded RULER data) or a .txt/.jsonl path."
    )
    prompt: NiahPrompt = described(
        NiahPrompt.plain,
        "How the NIAH prompt is framed, the same for the student and its teacher (one report compares "
        "them): 'plain' (the instruction, the prose, then 'Question: ...\\nAnswer: ...' as text, no chat template: "
        "for students distilled on prose, which never saw chat turns), 'chat' (the tokenizer's chat template: for "
        "instruction-tuned students, e.g. after SFT or stages.distill.data: instructions), or 'auto' (chat if the "
        "tokenizer has a template)."
    )
    distractors: int = described(
        9, "The likelihood score ranks each needle's true value among this many other values of its kind (same "
        "format, drawn from the sample's seed), teacher-forced: chance is 1 / (1 + distractors). 1 to 20; "
        "changing it rescores saved samples without generating again.", rule=DISTRACTORS
    )


@dataclass
class DuringConfig:
    tasks: list[str] = described(help="lm-eval tasks of each evaluation along stage 3 (a small subset).",
                                 factory=lambda: ["piqa", "arc_easy", "hellaswag"])
    limit: Optional[int] = described(200, "Examples per task in each evaluation along stage 3; null: all.",
                                     rule=POSITIVE)
    niah_lengths: list[int] = described(help="NIAH lengths along stage 3 (depths and kinds: eval.niah); [] skips.",
                                        factory=lambda: [256, 1024, 4096], rule=each(POSITIVE))
    niah_samples: int = described(1, "NIAH samples per cell along stage 3.", rule=POSITIVE)
    perplexity_tokens: Optional[int] = described(65536, "Held-out tokens for perplexity along stage 3; 0 skips.")
    keep_snapshots: bool = described(False, "Keep each evaluated snapshot (RUN_DIR/eval/snapshots/) instead of "
                                     "deleting it once its evaluation is in the history.")
    at_start: bool = described(False, "Also evaluate the student as a fresh stage 3 starts (RUN_DIR/merged: stages 1-2 "
                               "done, no stage-3 step yet), the curves' point at 0 stage-3 tokens: what stages 1-2 "
                               "gave, against what stage 3 keeps of it. Needs eval.every_tokens > 0.")


_KEYS_UNDER: ContextVar[str] = ContextVar("keys_under", default="")


@contextmanager
def keys_under(prefix: str) -> Iterator[None]:
    """While it lasts, the CopyConfig and StateConfig built name their keys under `prefix` in their errors:
    `load_job` builds a job's under "eval." (eval.copy.lengths); an evaluation spec's are named as the spec holds
    them (copy.lengths)."""
    token = _KEYS_UNDER.set(prefix)
    try:
        yield
    finally:
        _KEYS_UNDER.reset(token)


class CopyError(ConfigError):
    """A copy-probe setting that does not fit the model or the saved results (the CLI shows it as one paragraph)."""


@dataclass
class CopyConfig:
    """What the copy probe covers (harness.eval.copy's docstring defines the sequences and the measures): the
    section `copy:` of an evaluation spec, and a job's eval.copy."""

    lengths: list[int] = described(
        help="Sequence lengths L in tokens; each prompt holds the sequence twice (plus the gap and the tokenizer's "
        "prefix), so 2L + gap positions. At least 2 (copy_acc_after_first needs a second token).",
        factory=lambda: [64, 256, 1024, 2048], rule=each(Rule(lambda n: n >= 2, "be at least 2")),
    )
    gap: int = described(
        0, "Random filler tokens between the two copies, drawn like the sequence (distinct from its ids). With a "
        "gap the first token of the second copy cannot be predicted by induction (see copy_acc_after_first).",
        rule=at_least_zero("the second copy follows the first directly"),
    )
    sequences: int = described(8, "Random sequences per length; the intervals are bootstrapped over them.",
                               rule=POSITIVE)
    token_low: int = described(
        1000, "Lowest token id drawn. Ids below 1000 of a BPE vocabulary are special tokens, the 256 byte tokens "
        "and the first merges (word fragments); a vocabulary ending below this falls back to every non-special id.",
        rule=at_least_zero("any id"),
    )
    token_high: int = described(
        20000, "One past the highest id drawn, clipped to the vocabulary: common merges the model has seen often.",
        rule=POSITIVE,
    )
    seed: int = described(0, "Seeds the sequences (torch's CPU generator): the same seed draws the same ids.")
    induction: bool = described(
        False, "Also compute each layer's induction score (attention mass, or share of a mixer's absolute mixing "
        "weight, on the token after the previous occurrence of the query's token) and, from the same mixing weights, "
        "its previous-token score (the same on the token before the query: the circuit's other half), for lengths "
        "up to induction_max_length.",
    )
    induction_max_length: int = described(
        512, "Induction scores only for lengths up to this: a layer's mixing matrices are (2L + gap)^2 per head and "
        "sequence, and a mixer's come from running its recurrence on 2L + gap one-hot values.", rule=POSITIVE,
    )
    batch_size: int = described(
        4, "Prompts per forward pass. Memory: the logits of the second copies, batch x (L + 1) x vocabulary.",
        rule=POSITIVE,
    )
    position_buckets: int = described(
        8, "Spans of the copy that by_position reports accuracy over (fewer when L is smaller).", rule=POSITIVE,
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Normalise lists to plain ints and raise ConfigError (a ValueError) naming the first bad setting by its key
        (copy.KEY, or eval.copy.KEY in a job: `keys_under`)."""
        key = _KEYS_UNDER.get() + "copy"
        bad = [n for n in self.lengths if isinstance(n, bool) or not isinstance(n, numbers.Integral)]
        if bad:
            raise CopyError(f"{key}.lengths holds {bad[0]!r}; lengths are whole numbers of tokens, e.g. [64, 256].")
        self.lengths = [int(n) for n in self.lengths]
        check_fields(self, f"{key}.")
        if not self.lengths or len(set(self.lengths)) != len(self.lengths):
            raise CopyError(f"{key}.lengths={self.lengths} must name at least one length, each once.")
        if self.token_low >= self.token_high:
            raise CopyError(f"{key}.token_low={self.token_low} must be below {key}.token_high={self.token_high} "
                            "(ids are drawn from [token_low, token_high)).")


@dataclass
class StateConfig:
    """What `harness.eval.state.evaluate_state` measures: the state curve (students) and the retrieval curve (every
    model). The section `state:` of an evaluation spec, and a job's eval.state."""

    text: str = described(
        "essays", "The held-out prose read for the state curve and filling the retrieval prompts: 'essays', "
        "'wikipedia' (the NIAH haystacks, embedded RULER data), or a .txt / .jsonl ({\"text\": ...} per line) path.")
    length: int = described(
        2048, "Tokens per sequence of the state curve, and the length of every retrieval prompt.", rule=POSITIVE)
    positions: list[int] = described(
        help="Token counts after which each layer's state is read (1..length). Empty: the powers of two up to "
        "length, and length itself.", factory=list, rule=each(POSITIVE))
    every: int = described(
        0, "Also read the state every N tokens (N, 2N, ... up to length); 0: only `positions`.",
        rule=Rule(lambda n: n >= 0, "be >= 0 (0: off)"))
    sequences: int = described(
        4, "Windows of `length` tokens of `text` (different starts) over which the state measures are averaged.",
        rule=POSITIVE)
    retrieval: bool = described(True, "Also measure retrieval against distance (the only part for a teacher).")
    distances: list[int] = described(
        help="Prose tokens between the needle's end and the question. Each must fit in `length` beside the "
        "instruction, needle and question (~70 tokens for a passkey with SmolLM2's tokenizer).",
        factory=lambda: [32, 128, 512, 1024, 1536], rule=each(POSITIVE))
    kinds: list[NeedleKind] = described(
        help="Needle kinds: 'passkey' (7 digits), 'kv' (a secret word for a key), 'uuid'.",
        factory=lambda: [NeedleKind.passkey, NeedleKind.kv])
    samples: int = described(
        10, "Prompts per (kind, distance); sample i has the same needle and prose at every distance.", rule=POSITIVE)
    prompt: NiahPrompt = described(
        NiahPrompt.plain, "How the question is framed, as eval.niah.prompt: 'plain', 'chat' or 'auto'.")
    distractors: int = described(
        9, "Other values of the needle's kind the likelihood score ranks the true one against.", rule=DISTRACTORS)
    max_new_tokens: int = described(24, "Greedy generation budget per retrieval sample.", rule=POSITIVE)
    generation_batch_size: int = described(
        1, "Retrieval prompts decoded together (as eval.generation_batch_size).", rule=POSITIVE)
    seed: int = described(0, "Seeds the text windows, needles, distractors and prose starts.")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ConfigError naming the first bad setting by its key (state.KEY, or eval.state.KEY in a job: `keys_under`);
        lists become plain lists of ints / strings."""
        key = _KEYS_UNDER.get() + "state"
        self.positions = [int(p) for p in self.positions]
        self.distances = [int(d) for d in self.distances]
        self.kinds = [NeedleKind(k) if k in NeedleKind.values() else k for k in self.kinds]
        check_fields(self, f"{key}.")
        for name in ("positions", "distances", "kinds"):
            values = getattr(self, name)
            if len(set(values)) != len(values):
                raise ConfigError(f"{key}.{name}={values} has duplicates; give each value once.")
        beyond = [p for p in self.positions if p > self.length]
        if beyond:
            raise ConfigError(f"{key}.positions {beyond} lie beyond {key}.length={self.length}; the state is read "
                              f"after 1..{self.length} tokens (raise length or drop them).")
        if self.retrieval and not (self.distances and self.kinds):
            raise ConfigError(f"{key}.retrieval needs at least one distance and one needle kind (or retrieval=false).")
        if self.text not in Haystack.values() and not Path(self.text).is_file():
            raise ConfigError(f"{key}.text={self.text!r} is no NIAH haystack: use one of {Haystack.values()} or the "
                              "path of an existing .jsonl ({\"text\": ...} per line) or .txt file.")

    def read_positions(self) -> list[int]:
        """The sorted positions at which the state is read (`positions`, or its default, and every `every`)."""
        chosen = set(self.positions or default_positions(self.length))
        if self.every:
            chosen |= set(range(self.every, self.length + 1, self.every))
        return sorted(chosen)


@dataclass
class IfevalConfig:
    """The instruction-following evaluation (harness.eval.tasks.ifeval: IFEval-style prompts written for the harness,
    scored by if-verifiable's IFEval checkers): the section `ifeval:` of an evaluation spec, and a job's eval.ifeval."""

    prompts: Optional[int] = described(
        None, "Score the first N prompts of the fixed set (150, harness.eval.ifeval_prompts); null: all of them.",
        rule=POSITIVE)
    max_new_tokens: int = described(
        512, "Greedy generation budget per prompt; an answer cut there is scored as it stands (IFEval asks for up "
        "to ~300 words).", rule=POSITIVE)
    prompt: NiahPrompt = described(
        NiahPrompt.auto, "How a prompt is given, the same for student and teacher: 'chat' (the tokenizer's chat "
        "template with the generation prompt, as the chat samples: for instruction-tuned students), 'plain' "
        "('User: ...\\nAssistant:' text), or 'auto' (chat when the tokenizer has a template).")
    during_prompts: int = described(
        30, "Along stage 3 (eval.every_tokens), only the first N prompts are scored (fewer when `prompts` is "
        "smaller).", rule=POSITIVE)


_TEXT_COPY_LENGTH = Rule(lambda v: len(v) == 2 and 1 <= v[0] <= v[1],
                        "be two numbers of units [lo, hi] with 1 <= lo <= hi (generator:copy's `length`)")


@dataclass
class TextCopyConfig:
    """The copy score on text (harness.eval.tasks.text_copy): documents of the harness's `generator:copy` (a random
    string of words, pseudo-words, letter or digit groups, a cue, the string again), teacher-forced greedy accuracy
    on the second showing beside the first. The section `text_copy:` of an evaluation spec, and a job's
    eval.text_copy."""

    documents: int = described(64, "Copy documents scored per model (one forward pass each); the interval is "
                               "bootstrapped over them.", rule=POSITIVE)
    seed: int = described(
        7, "Seed of the documents (generator:copy's `seed`). Jobs that train on generator:copy use other seeds "
        "(e.g. 0 for the toy teacher, 1 for its students' stage 3), so these documents are none a model saw.")
    length: list[int] = described(
        help="Units per string, [lo, hi] (generator:copy's `length`): words, pseudo-words, letter or digit groups.",
        factory=lambda: [8, 32], rule=_TEXT_COPY_LENGTH)
    skip: int = described(
        2, "Tokens at the start of each showing left unscored (the cue can change how the second showing's first "
        "tokens are split); a document whose string has fewer than skip + 2 tokens is left out.",
        rule=Rule(lambda n: n >= 1, "be at least 1 (a showing's first token has no token before it to read)"))
    during_documents: int = described(
        32, "Along stage 3 (eval.every_tokens), only the first N documents are scored (fewer when `documents` is "
        "smaller).", rule=POSITIVE)


def default_copy_settings() -> CopyConfig:
    """The copy probe that the evaluation job runs unless told otherwise: its own defaults with the induction scores
    on (eval.copy's default, and that of a spec without a `copy:` section)."""
    return CopyConfig(induction=True)


def default_positions(length: int) -> list[int]:
    """1, 2, 4, ... up to `length`, and `length` itself."""
    return sorted({2 ** i for i in range(length.bit_length()) if 2 ** i <= length} | {length})


@dataclass
class EvalConfig:
    enabled: bool = described(True, "`harness run` ends with the evaluation job (`harness eval RUN/eval.yaml`).")
    tasks: list[str] = described(
        help="lm-eval tasks (offline: piqa, arc_easy, arc_challenge, hellaswag, winogrande, lambada_openai, "
        "mmlu, gsm8k, gsm8k_cot; online any lm-eval task name). Empty: no benchmarks.",
        factory=lambda: ["piqa", "arc_easy", "arc_challenge", "hellaswag", "winogrande", "lambada_openai", "mmlu"],
    )
    limit: Optional[int] = described(None, "Examples per benchmark task (lm-eval --limit); null: all.", rule=POSITIVE)
    batch_size: int = described(8, "lm-eval batch size (right padding is exact for the recurrent students).",
                                rule=POSITIVE)
    generation_batch_size: int = described(
        1, "Prompts decoded together by greedy generation: NIAH samples, chat samples and lm-eval's generate_until "
        "(GSM8K). A student prefills each prompt alone and steps the batch through its recurrent state; a teacher "
        "generates on left-padded prompts. Each answer is cut where it would end alone: on CPU float32 the answers "
        "are those of 1; on a GPU in bfloat16 a batched matmul can round differently, so a near-tie may rarely flip "
        "a token. 1 (the default) keeps every result as at batch 1; a GPU, where batch-1 decoding is bound by "
        "kernel launches, runs a batch of 8 in about the steps of one prompt.",
        rule=POSITIVE
    )
    niah: NiahConfig = described(help="The needle-in-a-haystack grid; lengths [] skips NIAH.", factory=NiahConfig)
    perplexity_tokens: Optional[int] = described(
        262144, "Held-out corpus tokens for perplexity; 0 skips it; null: the whole held-out slice.",
        rule=at_least_zero("no perplexity")
    )
    teacher: bool = described(
        True, "Also score the teacher on the same tasks, grid and text (cached per teacher): the recovery baseline."
    )
    teacher_cache: Optional[str] = described(
        None, "A folder where the teacher's results are kept and shared by every run that evaluates the same teacher "
        "with the same settings (e.g. all jobs of a study: the teacher is scored once; concurrent evaluations take "
        "turns on it). null: each run's own RUN_DIR/eval/teacher."
    )
    chat_samples: bool = described(
        True, "Greedy answers of student and teacher to a few fixed chat prompts, shown in the report."
    )
    every_tokens: int = described(
        0, "Along stage 3: every N tokens (and at its end) snapshot the student and evaluate it with eval.during "
        "in a separate process or Slurm job, without stopping training; reports go to RUN_DIR/eval/history.jsonl "
        "(`harness report` draws them against tokens). 0: off. At least one stage-3 step's tokens."
    )
    during: DuringConfig = described(help="The small evaluation run along stage 3.", factory=DuringConfig)
    copy: Optional[CopyConfig] = described(
        help="The copy probe (`harness eval copy`: random token sequences shown twice; copy accuracy per length and, "
        "with induction, each layer's induction score), the section `copy:` of RUN/eval.yaml: lengths, gap, sequences, "
        "token_low, token_high, seed, induction, induction_max_length, batch_size, position_buckets. Default: the "
        "probe's own defaults with induction on; along stage 3 (eval.every_tokens) the lengths up to 256, without "
        "induction. null: off.",
        factory=default_copy_settings,
    )
    state: Optional[StateConfig] = described(
        None, "The state probe (`harness eval state`: each mixer layer's state norm and effective rank along the "
        "context, and retrieval against the distance between needle and question), the section `state:` of "
        "RUN/eval.yaml: text, length, positions, every, sequences, retrieval, distances, kinds, samples, prompt, "
        "distractors, max_new_tokens, generation_batch_size, seed. null (the default): off; a mapping turns it on "
        "with the probe's defaults for the keys it leaves out ({} all of them); along stage 3 at most 2 samples per "
        "distance."
    )

    ifeval: Optional[IfevalConfig] = described(
        None, "The instruction-following evaluation (`ifeval:` of RUN/eval.yaml: 150 IFEval-style prompts written "
        "for the harness, greedy answers of student and teacher scored with if-verifiable's IFEval checkers; "
        "prompt- and instruction-level accuracy, strict and loose): prompts, max_new_tokens, prompt, "
        "during_prompts. null (the default): off; a mapping turns it on with the defaults for the keys it leaves "
        "out ({} all of them); along stage 3 the first during_prompts prompts."
    )
    text_copy: Optional[TextCopyConfig] = described(
        help="The copy score on text (`text_copy:` of RUN/eval.yaml): generator:copy documents (a random string, a "
        "cue, the string again), teacher-forced greedy accuracy on the second showing beside the first, for student "
        "and teacher: documents, seed, length, skip, during_documents. Default: on with those defaults (64 short "
        "forward passes per model); along stage 3 the first during_documents documents. null: off.",
        factory=TextCopyConfig,
    )

def check_eval(ev: EvalConfig) -> None:
    """The field checks of a job's `eval:` section (also those of an eval spec)."""
    check_fields(ev, "eval.")
