"""Post-training: supervised fine-tuning (SFT) of a distilled student on chat-formatted instructions.

loss = next-token CE on the assistant tokens only: each assistant message's content and the end-of-turn token
after it, as the chat template renders them (the teacher tokenizer's template, or instructions.chat_template;
harness.data.chat marks the tokens). The loss of an optimizer step is the mean over all its assistant tokens on
all ranks and micro-batches (each micro-batch's mean weighted by its share, harness.stages.common.token_scale),
so the result does not depend on how the step is split over processes. A batch row holds one conversation,
right-padded to the longest of its micro-batch: the student's causal recurrences carry no state from one
conversation into another, and padding, which comes after the real tokens, changes none of their outputs.

The student (stages.sft.student, default RUN_DIR/student: what stage 3 wrote) trains on stage 3's engine and loop
(harness.engine: deepspeed.student_engine, DeepSpeed ZeRO per deepspeed.student_config or harness.plain_engine;
torch AdamW, bf16 on GPUs, fp32 over gloo on CPUs, deepspeed.world_size processes under torchrun/deepspeed/srun;
harness.train's `Trainer`), with no teacher. Budget: stages.sft.tokens
conversation tokens (template included, padding not), the most whole steps that fit; null: one pass over the
training conversations. Resumable exactly like stage 3 (model, optimizer, scheduler, loader position, RNG in
atomic checkpoints every run.checkpoint_every_tokens; a preemption request checkpoints and exits for requeue).

Writes (RUN_DIR = output_dir):
    sft/            checkpoints/, metrics.jsonl (loss, ce, lr, grad_norm, tokens/s; val_ce, val_ppl at the end), tb/,
                    checkpoints/COMPLETE.json
    student-sft/    the fine-tuned student in Hugging Face format, with the tokenizer and the chat template used
    job-sft.yaml    the resolved job
    eval-sft.yaml   the evaluation spec of student-sft (`harness eval`; harness.eval.spec.sft_spec_from_job): the
                    job's eval settings, results in eval-sft/, the teacher's results those of stage 3's evaluation
                    (eval.teacher_cache, else eval/teacher), and eval-sft/comparison/: the distilled student (eval/)
                    and the tuned one side by side with paired differences

With stages.sft.enabled, `harness run` and `harness submit` run this stage after stage 3 and its evaluation, and
the evaluation of eval-sft.yaml after it (harness.launch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from harness import preempt
from harness.checkpoint import CheckpointManager
from harness.config import ConfigError, JobConfig
from harness.eval.spec import write_sft_eval_spec
from harness.export import export_checkpoint
from harness.flops import dense_flops_per_token
from harness.losses import LossTerms, lm_loss
from harness.observe import RunLogger, setup_mfu
from harness.stages.common import apply_run_determinism, chat_data, resolve_device, resume_checkpoint, run_dir
from harness.train import Checkpointer, Trainer, TrainState, held_out_validation, stage_hooks

STAGE = "sft"


class SftHead(nn.Module):
    """Owns the student's output-head weight (tied to the embedding) so that ZeRO-3 gathers it for the loss, and
    computes the chunked CE over the labelled (assistant) tokens from the final hidden states."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> LossTerms:
        return lm_loss(hidden, self.weight, labels)


class SftModel(nn.Module):
    """The trained module: the student body plus the loss head (names 'student.*' as in stage 3's checkpoints)."""

    def __init__(self, student: nn.Module):
        super().__init__()
        self.student = student
        self.loss_head = SftHead(student.lm_head.weight)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> LossTerms:
        return self.loss_head(self.student.model(input_ids), labels)


def sft_dir(job: JobConfig) -> Path:
    return run_dir(job) / STAGE


def source_student(job: JobConfig) -> Path:
    """The student SFT starts from: stages.sft.student, else RUN_DIR/student; ConfigError if it is not there."""
    path = Path(job.stages.sft.student).expanduser() if job.stages.sft.student else run_dir(job) / "student"
    if not (path / "config.json").is_file():
        where = "stages.sft.student" if job.stages.sft.student else "RUN_DIR/student (stage 3's output)"
        raise ConfigError(f"SFT needs a student in Hugging Face format at {path} ({where}): run stage 3 first "
                          "(`harness run` or `harness stage distill`) or set stages.sft.student to a student folder.")
    return path


class SftForward:
    """SFT's micro-step forward, batch -> LossTerms: the student engine's body and CE head on the assistant tokens."""

    def __init__(self, s_engine: Any) -> None:
        self.s_engine = s_engine

    def __call__(self, batch: dict) -> LossTerms:
        ids = batch["input_ids"].to(self.s_engine.device)
        return self.s_engine(ids, batch["labels"].to(ids.device))


def sft(job: JobConfig, *, stop_after_steps: Optional[int] = None) -> Path:
    """Run (or resume, or skip if complete) SFT in this process; returns RUN_DIR/student-sft."""
    from harness import engine
    from harness.schedule import build_scheduler
    from harness.student import HarnessForCausalLM, count_parameters
    from harness.teacher import load_tokenizer

    ckpts = CheckpointManager(sft_dir(job) / "checkpoints", keep_last=job.run.keep_last)
    if ckpts.is_complete():
        return run_dir(job) / "student-sft"
    source, cfg = source_student(job), job.stages.sft
    device = resolve_device(job)
    preempt.install_handler()
    rank, world = engine.setup_distributed(device, job.run.collective_timeout_s)
    if world != job.deepspeed.world_size:
        raise ConfigError(f"SFT runs on {world} process(es) but deepspeed.world_size={job.deepspeed.world_size}: the "
                          "data slices and the step plan follow deepspeed.world_size, so set it to the number of "
                          "processes.")
    torch.manual_seed(job.seed)
    deterministic = apply_run_determinism(job)
    tokenizer = load_tokenizer(job.teacher.source)
    student = HarnessForCausalLM.from_pretrained(source, dtype=torch.float32)
    data = chat_data(job, STAGE, cfg, cfg.tokens, tokenizer, student.config.max_position_embeddings, rank, world)
    ds_config = engine.student_ds_config(job, cfg, world, device.type == "cuda")
    s_engine = engine.student_engine(SftModel(student), ds_config, lambda opt: build_scheduler(opt, cfg, data.steps),
                                     job.deepspeed.student_engine, device)
    forward = SftForward(s_engine)
    state = TrainState(*resume_checkpoint(ckpts, s_engine, data.loader))
    logger = RunLogger(sft_dir(job), STAGE, rank=rank, total_tokens=data.tokens,
                       start_step=state.step if state.step else None, start_tokens=state.tokens)
    if deterministic:
        logger.write(f"{STAGE}: torch's deterministic algorithms on (run.deterministic)")
    setup_mfu(logger, device, world, dense_flops_per_token(count_parameters(student)), STAGE)  # no teacher
    validate = held_out_validation(s_engine, forward, data, cfg.micro_batch_size, rank, world)
    hooks = stage_hooks(STAGE, job.run, engine=s_engine, logger=logger,
                        checkpointer=Checkpointer(ckpts, s_engine, data.loader), tokens=state.tokens,
                        validate=validate, stop_after=stop_after_steps)  # validated at the end only
    trainer = Trainer(s_engine, forward, grad_accum=cfg.grad_accum, world=world, hooks=hooks)
    try:
        state = trainer.train(data.loader, state, data.steps)
    finally:
        logger.close()
    if state.stopped:
        return sft_dir(job)  # tests: a crash after this step
    student_dir = export_sft_student(job, ckpts, source, tokenizer, data.loader.data.template, rank)
    ckpts.mark_complete({"step": state.step, "tokens": state.tokens})
    return student_dir


def export_sft_student(job: JobConfig, ckpts: CheckpointManager, source: Path, tokenizer: Any, template: str,
                       rank: int) -> Path:
    """Consolidate the newest checkpoint into RUN_DIR/student-sft (with the tokenizer and the chat template the
    student was tuned with) and write the evaluation spec RUN_DIR/eval-sft.yaml (and job-sft.yaml)."""
    dest = run_dir(job) / "student-sft"
    if rank == 0:
        export_checkpoint(ckpts.latest_valid(collective=False).path, dest, merged=source, force=True)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(dest)
        write_sft_eval_spec(job, dest)
    torch.distributed.barrier()
    return dest

