"""Stage 3: end-to-end distillation under DeepSpeed ZeRO-3, teacher and student both sharded.

loss = ce_weight * CE(next token) + kl_weight * tau^2 * KL(teacher || student at temperature tau), each
averaged per predicted token (harness.losses.distill_loss: chunked, no whole-batch fp32 logits). Data-parallel
ranks average their per-token means; every rank has the same number of tokens (packed sequences, no padding),
so that is the global per-token mean: N processes at micro-batch b give the losses of one at micro-batch N*b.

Run under a launcher (`torchrun`, `deepspeed`, `srun`) or as one plain process. Resumable: the newest valid
checkpoint (model, optimizer, scheduler, data position, RNG) is picked up; the end writes the student in
Hugging Face format (run_dir/student), the evaluation spec (run_dir/eval.yaml) and COMPLETE.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from harness import preempt
from harness.checkpoint import CheckpointManager, load_rng, save_rng
from harness.config import ConfigError, JobConfig, plan_stages
from harness.engine import gathered
from harness.eval.spec import write_eval_spec
from harness.losses import DistillLosses, distill_loss
from harness.observe import RunLogger, check_finite, dense_flops_per_token
from harness.stages.common import load_job_teacher, resolve_device, run_dir

TAG = "ds"  # DeepSpeed's tag inside each step-* checkpoint directory


class LossHead(nn.Module):
    """Owns the student's output-head weight (shared with lm_head / the tied embedding) so that ZeRO-3 gathers
    it when the loss runs, and computes the chunked distillation loss from the final hidden states."""

    def __init__(self, weight: nn.Parameter, ce_weight: float, kl_weight: float, temperature: float):
        super().__init__()
        self.weight = weight
        self.ce_weight, self.kl_weight, self.temperature = ce_weight, kl_weight, temperature

    def forward(self, hidden, teacher_hidden, teacher_weight, labels) -> DistillLosses:
        return distill_loss(hidden, teacher_hidden, self.weight, teacher_weight, labels, ce_weight=self.ce_weight,
                            kl_weight=self.kl_weight, temperature=self.temperature)


class DistillModel(nn.Module):
    """The trained module: the student body plus the loss head."""

    def __init__(self, student, ce_weight: float, kl_weight: float, temperature: float):
        super().__init__()
        self.student = student
        self.loss_head = LossHead(student.lm_head.weight, ce_weight, kl_weight, temperature)

    def forward(self, input_ids, teacher_hidden, teacher_weight, labels=None) -> DistillLosses:
        hidden = self.student.model(input_ids)
        return self.loss_head(hidden, teacher_hidden, teacher_weight, input_ids if labels is None else labels)


class TeacherBody(nn.Module):
    """The teacher without its head: input ids -> final (normed) hidden states."""

    def __init__(self, teacher_model):
        super().__init__()
        self.teacher = teacher_model

    def forward(self, input_ids):
        return self.teacher.model(input_ids=input_ids).last_hidden_state


def distill(job: JobConfig, *, stop_after_steps: Optional[int] = None) -> Path:
    """Run (or resume, or skip if complete) stage 3 in this process; returns run_dir/student."""
    from harness import engine
    from harness.data import prepare_job_corpus
    from harness.student import HarnessForCausalLM

    device = resolve_device(job)
    preempt.install_handler()
    rank, world = engine.setup_distributed(device)
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
    plan = next(p for p in plan_stages(job) if p.stage == "distill")
    bf16 = device.type == "cuda"
    torch.manual_seed(job.seed)

    teacher = load_job_teacher(job)
    merged = run_dir(job) / "merged"
    if not (merged / "config.json").is_file():
        raise ConfigError(f"Stage 3 needs the merged student at {merged}: run the per-layer stages and "
                          f"`harness stage merge` first (or `harness run`).")
    student = HarnessForCausalLM.from_pretrained(merged, dtype=torch.float32)
    corpus = prepare_job_corpus(job, teacher.tokenizer, max_positions=teacher.config.max_position_embeddings)
    loader = corpus.stage_stream("distill", job).loader(rank, world, cfg.micro_batch_size, cfg.grad_accum)

    from harness.schedule import build_scheduler

    model = DistillModel(student, cfg.ce_weight, cfg.kl_weight, cfg.temperature)
    s_engine = engine.student_engine(model, engine.student_ds_config(job, cfg, world, bf16),
                                     lambda opt: build_scheduler(opt, cfg, plan.steps))
    t_body = TeacherBody(teacher.model)
    t_engine = engine.teacher_engine(t_body, engine.teacher_ds_config(job, cfg, world, bf16))
    teacher_head = t_body.teacher.lm_head.weight

    step, tokens = _resume(ckpts, s_engine, loader)
    logger = RunLogger(out, "distill", rank=rank, total_tokens=plan.tokens,
                       start_step=step if step else None, start_tokens=tokens)
    logger.throughput.flops_per_token = _flops_per_token(student, teacher.model)
    peak = peak_flops(device)
    logger.throughput.peak_flops = peak * world if peak else None  # MFU over all ranks' tokens
    every = job.run.checkpoint_every_tokens
    next_ckpt = (tokens // every + 1) * every if every else None
    sums = torch.zeros(3, dtype=torch.float64)  # total, ce, kl over this optimizer step's micro-batches
    try:
        for batch in loader:
            ids = batch["input_ids"].to(s_engine.device)
            with torch.no_grad():
                t_hidden = t_engine(ids)
            with gathered([teacher_head]):
                losses = s_engine(ids, t_hidden, teacher_head)
            s_engine.backward(losses.total)
            s_engine.step()
            sums += torch.tensor([losses.total.item(), losses.ce.item(), losses.kl.item()], dtype=torch.float64)
            if not s_engine.is_gradient_accumulation_boundary():
                continue
            step, tokens = step + 1, loader.tokens_consumed
            means = _mean_over_ranks(sums / cfg.grad_accum)
            sums.zero_()
            check_finite(means[0], step, tokens)
            if step % job.run.log_every_steps == 0 or step == plan.steps:
                logger.log(step, tokens, loss=means[0], ce=means[1], kl=means[2],
                           lr=s_engine.get_lr()[0], grad_norm=_grad_norm(s_engine))
            saved = False
            if next_ckpt is not None and tokens >= next_ckpt and step < plan.steps:
                _save(ckpts, s_engine, loader, step, tokens)
                next_ckpt, saved = next_ckpt + every, True
            if step < plan.steps and preempt.agreed():
                if not saved:
                    _save(ckpts, s_engine, loader, step, tokens)
                logger.write(f"distill: preempted at step {step}; checkpoint written, exiting to be requeued")
                raise preempt.Preempted()
            if stop_after_steps is not None and step >= stop_after_steps:
                return out  # tests: a crash after this step
        _save(ckpts, s_engine, loader, step, tokens)
        logger.log(step, tokens, **_validate(job, corpus, s_engine, t_engine, teacher_head, rank, world))
    finally:
        logger.close()
    student_dir = export_student(job, ckpts, rank)
    ckpts.mark_complete({"step": step, "tokens": tokens})
    return student_dir


def _resume(ckpts: CheckpointManager, s_engine, loader) -> tuple[int, int]:
    info = ckpts.latest_valid()
    if info is None:
        return 0, 0
    s_engine.load_checkpoint(str(info.path), tag=TAG)
    loader.load_state_dict(json.loads((info.path / "data.json").read_text()))
    load_rng(info.path)
    return info.step, info.tokens


def _save(ckpts: CheckpointManager, s_engine, loader, step: int, tokens: int) -> None:
    def writer(tmp: Path) -> None:
        s_engine.save_checkpoint(str(tmp), tag=TAG)
        if torch.distributed.get_rank() == 0:
            (tmp / "data.json").write_text(json.dumps(loader.state_dict()))
        save_rng(tmp)

    ckpts.save(step, tokens, writer)


def _mean_over_ranks(values: torch.Tensor) -> list[float]:
    t = values.clone()
    torch.distributed.all_reduce(t)
    return (t / torch.distributed.get_world_size()).tolist()


def _grad_norm(s_engine) -> float:
    norm = s_engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")


# bf16 dense matmul peak measured on our GPUs (8192^3 torch.matmul on random data; DESIGN.md)
MEASURED_PEAK_FLOPS = {"NVIDIA H200": 788e12}


def peak_flops(device: torch.device) -> Optional[float]:
    """Per-device peak FLOP/s for MFU: $HARNESS_PEAK_FLOPS, else the measured figure for this GPU, else None."""
    import os

    if os.environ.get("HARNESS_PEAK_FLOPS"):
        return float(os.environ["HARNESS_PEAK_FLOPS"])
    if device.type == "cuda":
        return MEASURED_PEAK_FLOPS.get(torch.cuda.get_device_name(device))
    return None


def _flops_per_token(student, teacher) -> float:
    from harness.student import count_parameters

    return 6 * count_parameters(student) + 2 * count_parameters(teacher)


@torch.no_grad()
def _validate(job, corpus, s_engine, t_engine, teacher_head, rank, world) -> dict[str, float]:
    """Validation CE / KL / perplexity on the held-out split (per-token means over all ranks)."""
    if corpus.validation is None:
        return {}
    s_engine.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    for batch in corpus.validation_batches(job.stages.distill.micro_batch_size, rank, world):
        ids = batch["input_ids"].to(s_engine.device)
        labels = ids.masked_fill(~batch["valid"].to(ids.device)[:, None], -100)  # padding rows of the last batch
        t_hidden = t_engine(ids)  # outside the gather: the teacher's own forward releases its (tied) head
        with gathered([teacher_head]):  # every rank runs every batch: ZeRO-3 gathers are collectives
            losses = s_engine(ids, t_hidden, teacher_head, labels)
        n = float(losses.tokens)
        sums += torch.tensor([losses.ce.item() * n, losses.kl.item() * n, n], dtype=torch.float64)
    torch.distributed.all_reduce(sums)
    s_engine.train()
    ce, kl = (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()
    return {"val_ce": ce, "val_kl": kl, "val_ppl": float(torch.tensor(ce).exp())}


def export_student(job: JobConfig, ckpts: CheckpointManager, rank: int) -> Path:
    """Consolidate the newest checkpoint into a Hugging Face student (run_dir/student) and write eval.yaml."""
    info = ckpts.latest_valid()
    dest = run_dir(job) / "student"
    if rank == 0:
        export_checkpoint(info.path, dest, merged=run_dir(job) / "merged")
        write_eval_spec(job, dest)
    torch.distributed.barrier()
    return dest


def export_checkpoint(checkpoint: Path, dest: Path, merged: Path) -> Path:
    """A stage-3 checkpoint directory -> a consolidated fp32 Hugging Face student at `dest` (atomically)."""
    import shutil

    from harness.engine import consolidated_state_dict
    from harness.student import HarnessForCausalLM

    state = consolidated_state_dict(checkpoint, TAG, prefix="student.")
    student = HarnessForCausalLM.from_pretrained(merged, dtype=torch.float32)
    missing, unexpected = student.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not student.config.tie_word_embeddings]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {checkpoint} does not fit the student: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    student.save_pretrained(tmp)
    for name in merged.iterdir():  # the tokenizer files saved with the merged student
        if name.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(name, tmp / name.name)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest
