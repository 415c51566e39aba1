"""Post-training: supervised fine-tuning (SFT) of a distilled student on chat-formatted instructions.

loss = next-token CE on the assistant tokens only: each assistant message's content and the end-of-turn token
after it, as the chat template renders them (the teacher tokenizer's template, or instructions.chat_template;
harness.data.chat marks the tokens). The loss of an optimizer step is the mean over all its assistant tokens on
all ranks and micro-batches (each micro-batch's mean weighted by its share, harness.stages.common.token_scale),
so the result does not depend on how the step is split over processes. A batch row holds one conversation,
right-padded to the longest of its micro-batch: the student's causal recurrences carry no state from one
conversation into another, and padding, which comes after the real tokens, changes none of their outputs.

The student (stages.sft.student, default RUN_DIR/student: what stage 3 wrote) trains under DeepSpeed ZeRO-3
like stage 3 (harness.engine: the job's deepspeed.student_config, torch AdamW, bf16 on GPUs, fp32 over gloo on
CPUs, deepspeed.world_size processes under torchrun/deepspeed/srun), with no teacher. Budget: stages.sft.tokens
conversation tokens (template included, padding not), the most whole steps that fit; null: one pass over the
training conversations. Resumable exactly like stage 3 (model, optimizer, scheduler, loader position, RNG in
atomic checkpoints every run.checkpoint_every_tokens; a preemption request checkpoints and exits for requeue).

Writes (RUN_DIR = output_dir):
    sft/            checkpoints/, metrics.jsonl (loss, lr, grad_norm, tokens/s; val_ce, val_ppl at the end), tb/,
                    checkpoints/COMPLETE.json
    student-sft/    the fine-tuned student in Hugging Face format, with the tokenizer and the chat template used
    job-sft.yaml    the resolved job
    eval-sft.yaml   the evaluation spec of student-sft (`harness eval`; results in eval-sft/; the teacher's
                    results are shared with stage 3's evaluation through eval/teacher)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from harness import preempt
from harness.checkpoint import CheckpointManager
from harness.config import ConfigError, JobConfig, to_yaml
from harness.engine import all_reduce_host
from harness.export import export_checkpoint
from harness.flops import dense_flops_per_token, setup_mfu
from harness.losses import DistillLosses, lm_loss
from harness.observe import RunLogger, SkippedStepWatch, check_finite
from harness.stages.common import (StageData, chat_data, grad_norm, resolve_device, resume_checkpoint, run_dir,
                                   save_checkpoint, scaled, skipped_steps, step_means, token_scale)

STAGE = "sft"


class SftHead(nn.Module):
    """Owns the student's output-head weight (tied to the embedding) so that ZeRO-3 gathers it for the loss, and
    computes the chunked CE over the labelled (assistant) tokens from the final hidden states."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> DistillLosses:
        return lm_loss(hidden, self.weight, labels)


class SftModel(nn.Module):
    """The trained module: the student body plus the loss head (names 'student.*' as in stage 3's checkpoints)."""

    def __init__(self, student: nn.Module):
        super().__init__()
        self.student = student
        self.loss_head = SftHead(student.lm_head.weight)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> DistillLosses:
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


def sft(job: JobConfig, *, stop_after_steps: Optional[int] = None) -> Path:
    """Run (or resume, or skip if complete) SFT in this process; returns RUN_DIR/student-sft."""
    from harness import engine
    from harness.schedule import build_scheduler
    from harness.student import HarnessForCausalLM
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
    tokenizer = load_tokenizer(job.teacher.source)
    student = HarnessForCausalLM.from_pretrained(source, dtype=torch.float32)
    data = chat_data(job, STAGE, cfg, cfg.tokens, tokenizer, student.config.max_position_embeddings, rank, world)
    model = SftModel(student)
    s_engine = engine.student_engine(model, engine.student_ds_config(job, cfg, world, device.type == "cuda"),
                                     lambda opt: build_scheduler(opt, cfg, data.steps))
    step, tokens = resume_checkpoint(ckpts, s_engine, data.loader)
    logger = RunLogger(sft_dir(job), STAGE, rank=rank, total_tokens=data.tokens,
                       start_step=step if step else None, start_tokens=tokens)
    from harness.student import count_parameters

    setup_mfu(logger, device, world, dense_flops_per_token(count_parameters(student)), STAGE)  # no teacher
    try:
        step, tokens = _train(job, data, s_engine, ckpts, logger, step, tokens, world, stop_after_steps)
        if stop_after_steps is not None and step < data.steps:
            return sft_dir(job)  # tests: a crash after this step
        save_checkpoint(ckpts, s_engine, data.loader, step, tokens)
        logger.log(step, tokens, **_validate(data, cfg.micro_batch_size, s_engine, rank, world))
    finally:
        logger.close()
    student_dir = export_sft_student(job, ckpts, source, tokenizer, data.loader.data.template, rank)
    ckpts.mark_complete({"step": step, "tokens": tokens})
    return student_dir


def _train(job: JobConfig, data: StageData, s_engine: Any, ckpts: CheckpointManager, logger: RunLogger, step: int,
           tokens: int, world: int, stop_after_steps: Optional[int]) -> tuple[int, int]:
    """The optimizer steps left; checkpoints every run.checkpoint_every_tokens, honours preemption requests."""
    cfg, loader = job.stages.sft, data.loader
    every = job.run.checkpoint_every_tokens
    next_ckpt = (tokens // every + 1) * every if every else None
    sums = torch.zeros(1, dtype=torch.float64)  # CE x tokens over this step's micro-batches
    skips = SkippedStepWatch(job.run.max_skipped_steps_in_a_row, skipped_steps(s_engine))
    for batch in loader:
        ids = batch["input_ids"].to(s_engine.device)
        losses = s_engine(ids, batch["labels"].to(ids.device))
        boundary = s_engine.is_gradient_accumulation_boundary()  # before step(), which advances the micro-step
        s_engine.backward(scaled(losses.total, token_scale(losses.tokens, batch["step_targets"], world,
                                                           cfg.grad_accum)))
        s_engine.step()
        sums += losses.ce.item() * losses.tokens
        if not boundary:
            continue
        step, tokens = step + 1, loader.tokens_consumed
        loss = step_means(sums, batch["step_targets"])[0]
        sums.zero_()
        check_finite(loss, step, tokens)
        skips.check(skipped_steps(s_engine), step, tokens)
        if step % job.run.log_every_steps == 0 or step == data.steps:
            logger.log(step, tokens, loss=loss, lr=s_engine.get_lr()[0], grad_norm=grad_norm(s_engine),
                       skipped_steps=skipped_steps(s_engine))
        saved = False
        if next_ckpt is not None and tokens >= next_ckpt and step < data.steps:
            save_checkpoint(ckpts, s_engine, loader, step, tokens)
            next_ckpt, saved = next_ckpt + every, True
        if step < data.steps and preempt.agreed():
            if not saved:
                save_checkpoint(ckpts, s_engine, loader, step, tokens)
            logger.write(f"sft: preempted at step {step}; checkpoint written, exiting to be requeued")
            raise preempt.Preempted()
        if stop_after_steps is not None and step >= stop_after_steps:
            break
    return step, tokens


@torch.no_grad()
def _validate(data: StageData, batch_size: int, s_engine: Any, rank: int, world: int) -> dict[str, float]:
    """CE and perplexity on the assistant tokens of the held-out conversations (per-token means, all ranks)."""
    if data.validation is None:
        return {}
    s_engine.eval()
    sums = torch.zeros(2, dtype=torch.float64)
    for batch in data.validation(batch_size, rank, world):  # every rank runs every batch: ZeRO-3 collectives
        ids = batch["input_ids"].to(s_engine.device)
        losses = s_engine(ids, batch["labels"].to(ids.device))
        sums += torch.tensor([losses.ce.item() * losses.tokens, losses.tokens], dtype=torch.float64)
    sums = all_reduce_host(sums)
    s_engine.train()
    ce = (sums[0] / sums[1].clamp(min=1)).item()
    return {"val_ce": ce, "val_ppl": float(torch.tensor(ce).exp())}


def export_sft_student(job: JobConfig, ckpts: CheckpointManager, source: Path, tokenizer: Any, template: str,
                       rank: int) -> Path:
    """Consolidate the newest checkpoint into RUN_DIR/student-sft (with the tokenizer and the chat template the
    student was tuned with) and write the evaluation spec RUN_DIR/eval-sft.yaml."""
    dest = run_dir(job) / "student-sft"
    if rank == 0:
        export_checkpoint(ckpts.latest_valid(collective=False).path, dest, merged=source, force=True)
        tokenizer.chat_template = template
        tokenizer.save_pretrained(dest)
        write_sft_eval_spec(job, dest)
    torch.distributed.barrier()
    return dest


def write_sft_eval_spec(job: JobConfig, student_dir: Path) -> Path:
    """RUN_DIR/job-sft.yaml (the resolved job) and RUN_DIR/eval-sft.yaml: the job's eval settings on student-sft,
    results in RUN_DIR/eval-sft/, the teacher's results cached with stage 3's (RUN_DIR/eval/teacher)."""
    from omegaconf import OmegaConf

    from harness.eval.spec import spec_from_job

    run = run_dir(job)
    job_yaml = run / "job-sft.yaml"
    job_yaml.write_text(to_yaml(job))
    spec = spec_from_job(job, student_dir, job_yaml)
    spec.label = f"{job.name}-sft"
    spec.output_dir = str((run / "eval-sft").resolve())
    spec.teacher_cache = str((run / "eval" / "teacher").resolve())
    path = run / "eval-sft.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(spec)))
    return path
