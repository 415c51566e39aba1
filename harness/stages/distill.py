"""Stage 3: end-to-end distillation under DeepSpeed ZeRO-3: the student sharded, the teacher sharded too or, while
it is small against a device (deepspeed.teacher_placement), a frozen copy per device.

loss = ce_weight * CE(next token) + kl_weight * tau^2 * KL(teacher || student at temperature tau), each
averaged per predicted token; or the weighted terms of stages.distill.losses (kl, reverse_kl, ce). The loss is a
harness.losses.ChunkedLoss: chunked, no whole-batch fp32 logits, ce and kl in one fused pass. The loss of an
optimizer step is the mean over all its predicted tokens, on all ranks and micro-batches together (each
micro-batch's mean is weighted by its share of the step's tokens, `token_scale`), so N processes at micro-batch
b give the losses of one at micro-batch N*b. On text (packed sequences, no padding) every micro-batch has the
same number of tokens and the weights are 1.

stages.distill.data=instructions is instruction-aware distillation: the student learns from the teacher on
the chat data of `instructions` (harness.data.chat: one conversation per row, right-padded), with CE and KL on
the assistant tokens only (labels -100 elsewhere); the budget counts conversation tokens.

Run under a launcher (`torchrun`, `deepspeed`, `srun`) or as one plain process. Resumable: the newest valid
checkpoint (model, optimizer, scheduler, data position, RNG) is picked up; the end writes the student in
Hugging Face format (run_dir/student), the evaluation spec (run_dir/eval.yaml) and COMPLETE.json.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from harness import preempt
from harness.checkpoint import CheckpointManager
from harness.config import ConfigError, JobConfig, plan_stages, requested_tokens
from harness.engine import all_reduce_host, gathered
from harness.eval.spec import write_eval_spec
from harness.export import export_checkpoint
from harness.flops import model_flops_per_token, setup_mfu
from harness.losses import ChunkedLoss, DistillLosses, TokenLoss, token_losses
from harness.observe import RunLogger, SkippedStepWatch, check_finite
from harness.stages.common import (StageData, chat_data, grad_norm, load_job_teacher, resolve_device,
                                   resume_checkpoint, run_dir, save_checkpoint, scaled, skipped_steps, step_means,
                                   token_scale)

_flops_per_token = model_flops_per_token  # the name tests/test_perf.py imports from here


class LossHead(nn.Module):
    """Owns the student's output-head weight (shared with lm_head / the tied embedding) so that ZeRO-3 gathers
    it when the loss runs, and computes the chunked distillation loss of `terms` from the final hidden states."""

    def __init__(self, weight: nn.Parameter, terms: Sequence[TokenLoss]):
        super().__init__()
        self.weight = weight
        self.loss = ChunkedLoss(terms)

    def forward(self, hidden, teacher_hidden, teacher_weight, labels) -> DistillLosses:
        return self.loss(hidden, self.weight, labels, teacher_hidden, teacher_weight)


class DistillModel(nn.Module):
    """The trained module: the student body plus the loss head over `terms` (the job's: `job_loss_terms`)."""

    def __init__(self, student, terms: Sequence[TokenLoss]):
        super().__init__()
        self.student = student
        self.loss_head = LossHead(student.lm_head.weight, terms)

    def forward(self, input_ids, teacher_hidden, teacher_weight, labels=None) -> DistillLosses:
        hidden = self.student.model(input_ids)
        return self.loss_head(hidden, teacher_hidden, teacher_weight, input_ids if labels is None else labels)


class TeacherBody(nn.Module):
    """The teacher without its head: input ids -> final (normed) hidden states."""

    def __init__(self, teacher_model):
        super().__init__()
        self.teacher = teacher_model

    def forward(self, input_ids):
        # no KV cache: transformers builds one by default, and a compiled layer would recompile for each cache layer
        return self.teacher.model(input_ids=input_ids, use_cache=False).last_hidden_state


def job_loss_terms(job: JobConfig) -> list[TokenLoss]:
    """Stage 3's loss terms: stages.distill.losses, or the list its ce_weight, kl_weight and temperature stand for."""
    return token_losses(job.stages.distill.loss_terms())


def text_data(job: JobConfig, tokenizer: Any, max_positions: int, rank: int, world: int) -> StageData:
    """Stage 3 on data.source: its slice of the packed text stream and the held-out text."""
    from harness.data import prepare_job_corpus

    cfg = job.stages.distill
    plan = next(p for p in plan_stages(job) if p.stage == "distill")
    corpus = prepare_job_corpus(job, tokenizer, max_positions=max_positions)
    loader = corpus.stage_stream("distill", job).loader(rank, world, cfg.micro_batch_size, cfg.grad_accum)

    def validation(batch_size: int, rank: int, world: int) -> Iterator[dict]:
        for batch in corpus.validation_batches(batch_size, rank, world):
            batch["labels"] = batch["input_ids"].masked_fill(~batch["valid"][:, None], -100)  # last batch's padding
            yield batch

    return StageData(loader, plan.steps, plan.tokens, validation if corpus.validation is not None else None)


def distill(job: JobConfig, *, stop_after_steps: Optional[int] = None) -> Path:
    """Run (or resume, or skip if complete) stage 3 in this process; returns run_dir/student."""
    from harness import engine
    from harness.student import HarnessForCausalLM

    device = resolve_device(job)
    preempt.install_handler()
    rank, world = engine.setup_distributed(device, job.run.collective_timeout_s)
    if world != job.deepspeed.world_size:
        raise ConfigError(
            f"Stage 3 runs on {world} process(es) but deepspeed.world_size={job.deepspeed.world_size}: the data "
            "slices and the step plan follow deepspeed.world_size, so set it to the number of processes."
        )
    out = run_dir(job) / "distill"
    ckpts = CheckpointManager(out / "checkpoints", keep_last=job.run.keep_last)
    if ckpts.is_complete():
        return run_dir(job) / "student"
    cfg = job.stages.distill
    bf16 = device.type == "cuda"
    torch.manual_seed(job.seed)

    teacher = load_job_teacher(job)
    merged = run_dir(job) / "merged"
    if not (merged / "config.json").is_file():
        raise ConfigError(f"Stage 3 needs the merged student at {merged}: run the per-layer stages and "
                          f"`harness stage merge` first (or `harness run`).")
    student = HarnessForCausalLM.from_pretrained(merged, dtype=torch.float32)
    if cfg.gradient_checkpointing:
        student.enable_recompute(cfg.gradient_checkpointing_fraction)
    max_positions = teacher.config.max_position_embeddings
    if cfg.data == "instructions":  # the budget as asked: conversation rows are not full rows of seq_len
        data = chat_data(job, "distill", cfg, requested_tokens(job, "distill"), teacher.tokenizer, max_positions,
                         rank, world)
    else:
        data = text_data(job, teacher.tokenizer, max_positions, rank, world)
    loader, steps = data.loader, data.steps

    from harness.schedule import build_scheduler

    from harness.eval.during import DuringTraining
    from harness.student import count_parameters

    params = count_parameters(student)
    model = DistillModel(student, job_loss_terms(job))
    s_engine = engine.student_engine(model, engine.student_ds_config(job, cfg, world, bf16),
                                     lambda opt: build_scheduler(opt, cfg, steps), job.deepspeed.student_engine,
                                     device)
    t_body = TeacherBody(teacher.model)
    t_engine, placement = engine.build_teacher(t_body, job, cfg, world, s_engine.device, bf16)
    teacher_head = t_body.teacher.lm_head.weight

    step, tokens = resume_checkpoint(ckpts, s_engine, loader)
    logger = RunLogger(out, "distill", rank=rank, total_tokens=data.tokens,
                       start_step=step if step else None, start_tokens=tokens)
    logger.write(f"distill: teacher {placement} ({job.deepspeed.teacher_placement}), {world} process(es)")
    setup_mfu(logger, device, world, model_flops_per_token(student, teacher.model), "distill")
    every = job.run.checkpoint_every_tokens
    next_ckpt = (tokens // every + 1) * every if every else None
    during, tokens_before = DuringTraining(job, rank, params), tokens  # evaluations along stage 3 (eval.every_tokens)
    sums = torch.zeros(3, dtype=torch.float64)  # total, ce, kl x tokens over this step's micro-batches
    skips = SkippedStepWatch(job.run.max_skipped_steps_in_a_row, skipped_steps(s_engine))
    validate_every = job.run.validate_every_steps
    try:
        for batch in loader:
            ids = batch["input_ids"].to(s_engine.device)
            labels = batch["labels"].to(ids.device) if "labels" in batch else None
            with torch.no_grad():
                t_hidden = t_engine(ids)
            with gathered([teacher_head]):
                losses = s_engine(ids, t_hidden, teacher_head, labels)
            step_tokens = batch.get("step_targets", losses.tokens * world * cfg.grad_accum)
            boundary = s_engine.is_gradient_accumulation_boundary()  # before step(), which advances the micro-step
            s_engine.backward(scaled(losses.total, token_scale(losses.tokens, step_tokens, world, cfg.grad_accum)))
            s_engine.step()
            sums += torch.tensor([losses.total.item(), losses.ce.item(), losses.kl.item()],
                                 dtype=torch.float64) * losses.tokens
            if not boundary:
                continue
            step, tokens = step + 1, loader.tokens_consumed
            means = step_means(sums, step_tokens)
            sums.zero_()
            check_finite(means[0], step, tokens)
            skips.check(skipped_steps(s_engine), step, tokens)
            val = {}  # the end of the stage validates below, whatever the multiple
            if validate_every and step % validate_every == 0 and step < steps:
                val = _validate(data, cfg.micro_batch_size, s_engine, t_engine, teacher_head, rank, world)
            if step % job.run.log_every_steps == 0 or step == steps:
                logger.log(step, tokens, loss=means[0], ce=means[1], kl=means[2],
                           lr=s_engine.get_lr()[0], grad_norm=grad_norm(s_engine),
                           skipped_steps=skipped_steps(s_engine), **val)
            elif val:
                logger.log(step, tokens, **val)
            saved = False
            if next_ckpt is not None and tokens >= next_ckpt and step < steps:
                save_checkpoint(ckpts, s_engine, loader, step, tokens)
                next_ckpt, saved = next_ckpt + every, True
            due, tokens_before = during.due(tokens_before, tokens), tokens
            if due and step < steps:
                if not saved:
                    save_checkpoint(ckpts, s_engine, loader, step, tokens)
                    saved = True
                during.mark(due, step, ckpts.latest_valid().path)
            if step < steps and preempt.agreed():
                if not saved:
                    save_checkpoint(ckpts, s_engine, loader, step, tokens)
                logger.write(f"distill: preempted at step {step}; checkpoint written, exiting to be requeued")
                raise preempt.Preempted()
            if stop_after_steps is not None and step >= stop_after_steps:
                return out  # tests: a crash after this step
        save_checkpoint(ckpts, s_engine, loader, step, tokens)
        if during.every and tokens not in during.done:  # the end of the curve, whatever the multiple
            during.mark([tokens], step, ckpts.latest_valid().path)
        logger.log(step, tokens, **_validate(data, cfg.micro_batch_size, s_engine, t_engine, teacher_head, rank,
                                             world))
    finally:
        logger.close()
    student_dir = export_student(job, ckpts, rank)
    ckpts.mark_complete({"step": step, "tokens": tokens})
    return student_dir


@torch.no_grad()
def _validate(data: StageData, batch_size: int, s_engine, t_engine, teacher_head, rank, world) -> dict[str, float]:
    """Validation CE / KL / perplexity on the held-out split (per-token means over all ranks)."""
    if data.validation is None:
        return {}
    s_engine.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    for batch in data.validation(batch_size, rank, world):
        ids = batch["input_ids"].to(s_engine.device)
        labels = batch["labels"].to(ids.device)  # -100 off the targets and on the padding rows of the last batch
        t_hidden = t_engine(ids)  # outside the gather: the teacher's own forward releases its (tied) head
        with gathered([teacher_head]):  # every rank runs every batch: ZeRO-3 gathers are collectives
            losses = s_engine(ids, t_hidden, teacher_head, labels)
        n = float(losses.tokens)
        sums += torch.tensor([losses.ce.item() * n, losses.kl.item() * n, n], dtype=torch.float64)
    sums = all_reduce_host(sums)
    s_engine.train()
    ce, kl = (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()
    return {"val_ce": ce, "val_kl": kl, "val_ppl": float(torch.tensor(ce).exp())}


def export_student(job: JobConfig, ckpts: CheckpointManager, rank: int) -> Path:
    """Consolidate the newest checkpoint into a Hugging Face student (run_dir/student) and write eval.yaml."""
    info = ckpts.latest_valid()
    dest = run_dir(job) / "student"
    if rank == 0:
        export_checkpoint(info.path, dest, merged=run_dir(job) / "merged", force=True)
        write_eval_spec(job, dest)
    torch.distributed.barrier()
    return dest

