"""Stage 3: end-to-end distillation. The student on the engine of deepspeed.student_engine (DeepSpeed ZeRO as
deepspeed.student_config says, or the plain engine: harness.plain_engine); the teacher sharded by ZeRO-3 or, while
it is small against a device (deepspeed.teacher_placement), a frozen copy per device.

loss = ce_weight * CE(next token) + kl_weight * tau^2 * KL(teacher || student at temperature tau), each
averaged per predicted token; or the weighted terms of stages.distill.losses (kl, reverse_kl, ce); plus, with
stages.distill.hidden_weight, that weight times the per-layer hidden-state term (`hidden_term`). The loss is a
harness.losses.ChunkedLoss: chunked, no whole-batch fp32 logits, ce and kl in one fused pass. The loop is
harness.train's `Trainer` (the one of SFT and the step bench) with the stage's hooks: the loss of an optimizer step
is the mean over all its predicted tokens, on all ranks and micro-batches together, so N processes at micro-batch
b give the losses of one at micro-batch N*b, and every term is logged under its name (loss, kl, ce, reverse_kl;
val_<term> for the held-out text). On text (packed sequences, no padding) every micro-batch has the same number of
tokens and the weights are 1.

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
from harness.engine import gathered
from harness.eval.spec import write_eval_spec
from harness.export import export_checkpoint
from harness.flops import model_flops_per_token
from harness.losses import ChunkedLoss, LossTerms, RelativeMSE, TokenLoss, token_losses
from harness.losses.token_weights import copy_token_weights
from harness.observe import RunLogger, setup_mfu
from harness.stages.common import (StageData, apply_run_determinism, chat_data, load_job_teacher, resolve_device,
                                   resume_checkpoint, run_dir)
from harness.train import Checkpointer, NoClock, Trainer, TrainState, held_out_validation, stage_hooks

_flops_per_token = model_flops_per_token  # the name tests/test_perf.py imports from here


class LossHead(nn.Module):
    """Owns the student's output-head weight (shared with lm_head / the tied embedding) so that ZeRO-3 gathers
    it when the loss runs, and computes the chunked distillation loss of `terms` from the final hidden states."""

    def __init__(self, weight: nn.Parameter, terms: Sequence[TokenLoss]):
        super().__init__()
        self.weight = weight
        self.loss = ChunkedLoss(terms)

    def forward(self, hidden, teacher_hidden, teacher_weight, labels, token_weight=None) -> LossTerms:
        return self.loss(hidden, self.weight, labels, teacher_hidden, teacher_weight, token_weight=token_weight)


class DistillModel(nn.Module):
    """The trained module: the student body plus the loss head over `terms` (the job's: `job_loss_terms`), and with
    `hidden_weight` > 0 the per-layer hidden-state term (`hidden_term`) against the teacher's layer outputs."""

    def __init__(self, student, terms: Sequence[TokenLoss], hidden_weight: float = 0.0):
        super().__init__()
        self.student = student
        self.loss_head = LossHead(student.lm_head.weight, terms)
        self.hidden_weight = float(hidden_weight)

    def forward(self, input_ids, teacher_hidden, teacher_weight, labels=None, token_weight=None,
                teacher_layers=None, position_mask=None) -> LossTerms:
        """teacher_layers: the teacher's layer outputs (with hidden_weight > 0); position_mask: None, or `[B, T]`
        nonzero at the positions the hidden-state term compares (a chat batch's attention_mask: not its padding)."""
        layers = [] if teacher_layers is not None else None
        hidden = self.student.model(input_ids, layer_outputs=layers)
        losses = self.loss_head(hidden, teacher_hidden, teacher_weight, input_ids if labels is None else labels,
                                token_weight)
        if teacher_layers is None:
            return losses
        return with_hidden_term(losses, hidden_term(layers, teacher_layers, position_mask), self.hidden_weight)


def hidden_term(student_layers: Sequence[torch.Tensor], teacher_layers: Sequence[torch.Tensor],
                position_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The mean over layers of each student layer output's relative squared error against the teacher's (fp32;
    `harness.losses.RelativeMSE`), over the positions `position_mask` keeps (all where None)."""
    if len(student_layers) != len(teacher_layers):
        raise ValueError(f"hidden-state term: {len(student_layers)} student layer outputs against "
                         f"{len(teacher_layers)} of the teacher")
    keep = None if position_mask is None else position_mask.to(student_layers[0].device).bool()
    errors = []
    for s, t in zip(student_layers, teacher_layers):
        if keep is not None:
            s, t = s[keep], t[keep]
        errors.append(_relative_mse(s, t))
    return torch.stack(errors).mean()


_relative_mse = RelativeMSE()


def with_hidden_term(losses: LossTerms, value: torch.Tensor, weight: float) -> LossTerms:
    """`losses` with weight x value added to the trained total and value logged as the term 'hidden'."""
    return LossTerms(losses.total + weight * value, {**losses.terms, "hidden": value.detach().float()}, losses.tokens)


class TeacherBody(nn.Module):
    """The teacher without its head: input ids -> final (normed) hidden states; with `layer_outputs`, (those, the
    list of each decoder layer's output), recorded by one bound method hooked on every layer: a compiled layer
    traces it and the layers still share one graph (tests/test_hidden_term.py), which a closure per layer index (as
    `harness.teacher.capture_activations` hooks) would not."""

    def __init__(self, teacher_model, layer_outputs: bool = False):
        super().__init__()
        self.teacher = teacher_model
        self.layer_outputs = layer_outputs
        self._recorded: list[torch.Tensor] = []
        if layer_outputs:
            for layer in teacher_model.model.layers:
                layer.register_forward_hook(self._record)

    def _record(self, module, args, output) -> None:
        self._recorded.append(output[0] if isinstance(output, (tuple, list)) else output)

    def forward(self, input_ids):
        self._recorded = []
        # no KV cache: transformers builds one by default, and a compiled layer would recompile for each cache layer
        last = self.teacher.model(input_ids=input_ids, use_cache=False).last_hidden_state
        if not self.layer_outputs:
            return last
        layers, self._recorded = self._recorded, []
        return last, layers


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


class DistillForward:
    """Stage 3's micro-step forward, batch -> LossTerms: the teacher's hidden states (no gradient), then the student
    engine's body and loss head under a gather of the teacher's head (a ZeRO-3 collective: every rank enters). What
    the step bench times too; `clock` stamps the teacher's phase (harness.train.trainer). copy_weight
    (stages.distill.copy_weight) weights the loss on the batch's copy tokens (harness.losses.token_weights)."""

    def __init__(self, s_engine: Any, t_engine: Any, teacher_head: nn.Parameter, clock: Any = None,
                 copy_weight: float = 1.0, copy_ngram: int = 3) -> None:
        self.s_engine, self.t_engine, self.teacher_head = s_engine, t_engine, teacher_head
        self.clock = clock or NoClock()
        self.copy_weight, self.copy_ngram = float(copy_weight), int(copy_ngram)

    def __call__(self, batch: dict) -> LossTerms:
        ids = batch["input_ids"].to(self.s_engine.device)
        labels = batch["labels"].to(ids.device) if "labels" in batch else None  # -100: no target
        with torch.no_grad():
            t_hidden = self.t_engine(ids)  # outside the gather: the teacher's own forward releases its (tied) head
        self.clock.mark("teacher_forward")
        weight = None if self.copy_weight == 1.0 else copy_token_weights(ids, self.copy_weight, self.copy_ngram)
        with gathered([self.teacher_head]):
            if isinstance(t_hidden, tuple):  # stages.distill.hidden_weight: the teacher's layer outputs too
                t_hidden, t_layers = t_hidden
                return self.s_engine(ids, t_hidden, self.teacher_head, labels, weight, t_layers,
                                     batch.get("attention_mask"))
            return self.s_engine(ids, t_hidden, self.teacher_head, labels, weight)


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
    deterministic = apply_run_determinism(job)

    teacher = load_job_teacher(job)
    merged = run_dir(job) / "merged"
    if not (merged / "config.json").is_file():
        raise ConfigError(f"Stage 3 needs the merged student at {merged}: run the per-layer stages and "
                          f"`harness stage merge` first (or `harness run`).")
    student = HarnessForCausalLM.from_pretrained(merged, dtype=torch.float32)
    if cfg.gradient_checkpointing:
        student.enable_recompute(cfg.gradient_checkpointing_fraction)
    compiled = engine.compiles_student(cfg, job.deepspeed.student_engine, device)
    if compiled:
        engine.compile_student_blocks(student)
    max_positions = teacher.config.max_position_embeddings
    if cfg.data == "instructions":  # the budget as asked: conversation rows are not full rows of seq_len
        data = chat_data(job, "distill", cfg, requested_tokens(job, "distill"), teacher.tokenizer, max_positions,
                         rank, world)
    else:
        data = text_data(job, teacher.tokenizer, max_positions, rank, world)

    from harness.eval.during import DuringTraining
    from harness.schedule import build_scheduler
    from harness.student import count_parameters

    params = count_parameters(student)
    model = DistillModel(student, job_loss_terms(job), hidden_weight=cfg.hidden_weight)
    s_engine = engine.student_engine(model, engine.student_ds_config(job, cfg, world, bf16),
                                     lambda opt: build_scheduler(opt, cfg, data.steps), job.deepspeed.student_engine,
                                     device)
    t_body = TeacherBody(teacher.model, layer_outputs=cfg.hidden_weight > 0)
    t_engine, placement = engine.build_teacher(t_body, job, cfg, world, s_engine.device, bf16)
    forward = DistillForward(s_engine, t_engine, t_body.teacher.lm_head.weight,
                             copy_weight=job.stages.distill.copy_weight, copy_ngram=job.stages.distill.copy_ngram)

    state = TrainState(*resume_checkpoint(ckpts, s_engine, data.loader))
    logger = RunLogger(out, "distill", rank=rank, total_tokens=data.tokens,
                       start_step=state.step if state.step else None, start_tokens=state.tokens)
    logger.write(f"distill: teacher {placement} ({job.deepspeed.teacher_placement}), {world} process(es)"
                 + (", student blocks compiled" if compiled else "")
                 + (", torch's deterministic algorithms on (run.deterministic)" if deterministic else ""))
    setup_mfu(logger, device, world, model_flops_per_token(student, teacher.model), "distill")
    validate = held_out_validation(s_engine, forward, data, cfg.micro_batch_size, rank, world)
    hooks = stage_hooks("distill", job.run, engine=s_engine, logger=logger,
                        checkpointer=Checkpointer(ckpts, s_engine, data.loader), tokens=state.tokens,
                        validate=validate, validate_every=job.run.validate_every_steps,
                        during=DuringTraining(job, rank, params), stop_after=stop_after_steps)
    trainer = Trainer(s_engine, forward, grad_accum=cfg.grad_accum, world=world, hooks=hooks)
    try:
        state = trainer.train(data.loader, state, data.steps)
    finally:
        logger.close()
    if state.stopped:
        return out  # tests: a crash after this step
    student_dir = export_student(job, ckpts, rank)
    ckpts.mark_complete({"step": state.step, "tokens": state.tokens})
    return student_dir


def export_student(job: JobConfig, ckpts: CheckpointManager, rank: int) -> Path:
    """Consolidate the newest checkpoint into a Hugging Face student (run_dir/student) and write eval.yaml."""
    info = ckpts.latest_valid()
    dest = run_dir(job) / "student"
    if rank == 0:
        export_checkpoint(info.path, dest, merged=run_dir(job) / "merged", force=True)
        write_eval_spec(job, dest)
    torch.distributed.barrier()
    return dest

