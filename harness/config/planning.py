"""The token-to-step plan: each stage's token budget, tokens per optimizer step, steps and warmup steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from harness.config.job import JobConfig
from harness.config.training import POST_TRAINING, STAGES, StageConfig


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


def pipeline_stages(job: JobConfig) -> tuple[str, ...]:
    """The training stages `harness run` and `harness submit` run, in order: the three of the pretraining pipeline,
    then SFT with stages.sft.enabled."""
    return (*STAGES, POST_TRAINING) if job.stages.sft.enabled else STAGES


def plan_sft(job: JobConfig) -> Optional[StagePlan]:
    """SFT's plan with stages.sft.tokens, as stage 3 on instructions is planned: a step takes deepspeed.world_size x
    micro_batch_size x grad_accum conversations of at most instructions.seq_len tokens, so these are the fewest steps
    the budget can take (the stage counts its real steps from the tokenised conversations). None without
    stages.sft.tokens: one pass over the training conversations, whose steps only the data can tell."""
    cfg = job.stages.sft
    if cfg.tokens is None:
        return None
    per_step = job.deepspeed.world_size * cfg.micro_batch_size * cfg.grad_accum * job.instructions.seq_len
    steps = cfg.tokens // per_step
    return StagePlan(POST_TRAINING, steps * per_step if steps else cfg.tokens, per_step, steps,
                     int(steps * cfg.warmup_fraction))


def requested_tokens(job: JobConfig, stage: str) -> int:
    """A pipeline stage's token budget as asked: stages.<stage>.tokens, else its share of budget.total_tokens."""
    cfg: StageConfig = getattr(job.stages, stage)
    if cfg.tokens is not None:
        return cfg.tokens
    return int(job.budget.total_tokens * job.budget.split[STAGES.index(stage)])


def reads_instructions(job: JobConfig, stage: str) -> bool:
    """Whether `stage` trains on the chat data of `instructions` rather than on data.source."""
    return stage == "sft" or (stage == "distill" and job.stages.distill.data == "instructions")
