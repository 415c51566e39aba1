"""`validate`: every check of a job that needs no model. `check_fields` checks each field on its own; the rules
here tie fields together or need the data sources, the mixers or the file system."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harness.config.data import DataConfig, InstructionsConfig
from harness.config.fields import ConfigError, check_fields
from harness.config.job import JobConfig
from harness.config.planning import plan_stages, reads_instructions
from harness.config.training import DISTILL_LOSSES, STAGES, DistillConfig, StageConfig


def validate(job: JobConfig) -> None:
    """Check every setting that can be checked without loading a model; raise ConfigError.

    `check_fields` checks each field on its own (its Rule); what follows are the rules that tie fields
    together or need the data, the mixers or the file system."""
    from harness.mixers import MIXERS, mixer_options

    check_fields(job)
    if job.student.mixer not in MIXERS:
        failed = MIXERS.failed().get(job.student.mixer)
        why = f" It is a plug-in that failed to load: {failed}." if failed else ""
        raise ConfigError(
            f"Unknown mixer '{job.student.mixer}' at student.mixer. Valid mixers: {', '.join(MIXERS)}.{why}"
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
    _check_mixing_term(job)
    d = job.stages.distill
    _check_distill_losses(d)
    _check_instructions(job.instructions)
    _check_post_training(job)
    _check_teacher_source(job.teacher.source)
    for plan in plan_stages(job):
        if plan.steps < 1 and not reads_instructions(job, plan.stage):  # conversation stages: checked on the data
            raise ConfigError(
                f"Stage {plan.stage} has {plan.tokens} tokens, fewer than one optimizer step needs "
                f"({plan.tokens_per_step} = world_size {job.deepspeed.world_size} x micro_batch_size x "
                f"grad_accum x seq_len {job.data.seq_len}). Raise budget.total_tokens or shrink the batch."
            )


def _check_post_training(job: JobConfig) -> None:
    """SFT in the pipeline tunes the pipeline's own student, so it names no other."""
    sft = job.stages.sft
    if sft.enabled and sft.student:
        raise ConfigError(f"stages.sft.enabled=true runs SFT on this pipeline's own student (RUN_DIR/student), but "
                          f"stages.sft.student='{sft.student}' names another. Set stages.sft.student=null to tune the "
                          "pipeline's student, or stages.sft.enabled=false and tune that student with `harness stage "
                          "sft`.")


def _check_mixing_term(job: JobConfig) -> None:
    """The matrix-orientation term is stage 1's, and reads the mixer's q and k without RoPE."""
    if job.stages.align_hidden.mixing_weight:
        raise ConfigError(f"stages.align_hidden.mixing_weight={job.stages.align_hidden.mixing_weight}: the "
                          "matrix-orientation term is stage 1's (stages.align_mixer.mixing_weight); stage 2 aligns "
                          "whole blocks. Set it to 0.")
    from harness.mixers import mixer_options

    if job.stages.align_mixer.mixing_weight and mixer_options(job.student.mixer, job.student.options).rope:
        raise ConfigError(f"stages.align_mixer.mixing_weight={job.stages.align_mixer.mixing_weight} with "
                          "student.options.rope=true: the term reads mixers without RoPE only. Set one of them off.")


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
    from harness.data.mix_schedule import StageSchedules, parse_mix_entry

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
    StageSchedules.from_entries(parsed)  # every positive weight gets a share of its stage's schedule
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
