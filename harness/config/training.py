"""The job's `budget:` and `stages:` sections: the token budget and its split, and each stage's optimisation
settings (the three pretraining stages and SFT), with the stage names the pipeline runs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from harness.config.fields import FRACTION, POSITIVE, Rule, at_least_zero, described
from harness.config_choices import AlignLoss, DistillData, DistillLoss, Schedule

STAGES = ("align_mixer", "align_hidden", "distill")  # the pretraining pipeline; `sft` is a post-training stage
POST_TRAINING = "sft"  # the stage stages.sft.enabled appends to the pipeline
PER_LAYER = STAGES[:2]  # the stages that train each layer on its own
ALIGN_LOSSES = AlignLoss.values()  # the keys of harness.losses.ALIGNMENT_LOSSES
SPLIT = Rule(lambda split: len(split) == 3 and min(split) >= 0 and math.isclose(sum(split), 1.0, abs_tol=1e-3),
             "be three non-negative fractions (align_mixer, align_hidden, distill) that sum to 1")


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
    mixing_weight: float = described(
        0.0, "Stage 1 only: weight of a matrix-orientation term (MOHAWK's stage 1) added to each layer's output loss: "
        "1 - the cosine between each query row of the mixer's mixing matrix (its PyTorch form with one-hot values: "
        "o_t = sum_s A_ts v_s) and of the teacher's softmax attention, averaged over batch, heads and rows, on the "
        "first mixing_tokens tokens of each row. Aimed at the queries a linear lookup loses; on layer 18 at 1.3M tokens it "
        "fitted the teacher's attention directions and gave no copying back (docs/results/retrieval-135m/README.md, "
        "'A stage-1 term aimed at the queries').",
        rule=at_least_zero("off: the output loss alone"),
    )
    mixing_tokens: int = described(
        256, "Leading tokens of each row the matrix-orientation term reads (its [T, T] matrices per head grow with the "
        "square of T).", rule=POSITIVE,
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
    copy_weight: float = described(
        1.0, "Weight of the loss (every term) on copy tokens: targets whose n-gram (copy_ngram tokens ending at the "
        "target) occurred earlier in the same row, which an induction head copies (harness.losses.token_weights). "
        "1: every token alike; e.g. 4 trains in-context copying four times as hard. The logged ce and kl stay "
        "unweighted means; the total is sum_i w_i (ce_weight CE_i + kl_weight KL_i) / tokens.",
        rule=Rule(lambda w: w >= 0, "be >= 0"),
    )
    copy_ngram: int = described(
        3, "With copy_weight: how many tokens ending at a target must repeat an earlier span of the row for it to be a "
        "copy token (2: a bigram, 21% of the targets of 2048-token rows of embedded:wikipedia; 3: 8.1%; 4: 3.8%).",
        rule=Rule(lambda n: n >= 2, "be >= 2"),
    )
    hidden_weight: float = described(
        0.0, "Weight of a per-layer hidden-state term added to the loss: the relative squared error of each student "
        "block's output against the teacher decoder layer's (per token: the squared distance over the teacher "
        "token's squared norm; averaged over tokens and layers; harness.losses.RelativeMSE), with the student on "
        "its own inputs. Stages "
        "1-2 align each layer on the teacher's inputs, and what they fit is lost when the layers compose "
        "(docs/results/retrieval-135m/README.md); this term trains the composition layer by layer. Logged as "
        "'hidden'. It records every teacher layer's output (about layers x micro_batch x seq_len x hidden bf16 "
        "values); with the teacher uncompiled it cost 22% of the 135M step on an H100 (docs/BENCHMARKS.md, 'The "
        "evening's short lease').",
        rule=at_least_zero("off: the next-token terms alone"),
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
    compile_student: bool = described(
        False, "On a GPU with deepspeed.student_engine=plain: compile each student block (mixer and softmax blocks "
        "alike) with torch.compile, forward and backward, to fuse the gate, cast, norm and MLP chains around the "
        "fla kernels (which run as they are: fla keeps them out of the graph). Blocks of one kind share one "
        "compiled graph. Measured slower, so off: the 135M gated_deltanet step on an H100 lost 17-19% (its "
        "student forward doubled, each block's graph broken around the kernels; docs/results/"
        "step_repeat_h100_2026-12-06). The losses may move by a rounding step. A DeepSpeed student and the CPU "
        "always run eagerly."
    )

    def loss_terms(self) -> list[LossTermConfig]:
        """The terms stage 3 trains on: `losses`, else the same list built from ce_weight, kl_weight and temperature."""
        if self.losses:
            return list(self.losses)
        return [LossTermConfig("kl", self.kl_weight, self.temperature), LossTermConfig("ce", self.ce_weight)]


@dataclass
class SftConfig(StageConfig):
    enabled: bool = described(
        False, "Post-training as a stage of the pipeline: `harness run` and `harness submit` run SFT on the distilled "
        "student (RUN_DIR/student) after stage 3 and its evaluation, then evaluate RUN_DIR/student-sft like the "
        "student (RUN_DIR/eval-sft.yaml, with eval.enabled) beside it: before and after in one comparison with "
        "paired differences (RUN_DIR/eval-sft/comparison/). false: SFT runs only as `harness stage sft`."
    )
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
        None, "The student to fine-tune (a Hugging Face folder); null: RUN_DIR/student, what stage 3 wrote. Only for "
        "`harness stage sft`: with `enabled` the pipeline tunes its own student."
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
        "`harness stage sft`, or after stage 3 in `harness run` / `harness submit` with stages.sft.enabled).",
        factory=SftConfig,
    )

