"""The job's `eval:` section: what the evaluation job runs on the final student (benchmarks, the NIAH grid,
perplexity, chat samples) and the small evaluation along stage 3."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from harness.config.fields import FRACTION, POSITIVE, Rule, at_least_zero, check_fields, described, each
from harness.config_choices import NeedleKind, NiahPrompt

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


def check_eval(ev: EvalConfig) -> None:
    """The field checks of a job's `eval:` section (also those of an eval spec)."""
    check_fields(ev, "eval.")
