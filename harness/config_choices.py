"""The allowed values of the job config's choice fields, as string enums that OmegaConf checks at merge.

A field typed with one of these enums (e.g. `schedule: Schedule`) takes the plain strings of the job files:
OmegaConf turns 'cosine' into `Schedule.cosine` when it merges, and refuses a value that is no member, naming
the key. Each member is named as its value, because OmegaConf looks members up by name and writes
`member.name` into the YAML it dumps (`RUN_DIR/job.yaml`, `eval.yaml`), so names and values must not differ.
Members are `str`s: `job.stages.distill.schedule == "cosine"` holds, f-strings and json write the value.

This module imports nothing of the harness, so that light modules (the config) and heavy ones (the NIAH
evaluation, which loads torch) share one definition of each choice.
"""

from __future__ import annotations

from enum import StrEnum


class Choice(StrEnum):
    """A config choice; `values()` are its allowed strings, in the order the help texts list them."""

    @classmethod
    def values(cls) -> tuple[str, ...]:
        return tuple(member.value for member in cls)


class Dtype(Choice):
    """teacher.dtype, and the eval spec's dtype."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Device(Choice):
    """run.device, and the eval spec's device."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Schedule(Choice):
    """stages.<stage>.schedule: the learning-rate schedules of harness.schedule."""

    wsd = "wsd"
    cosine = "cosine"
    constant = "constant"


class AlignLoss(Choice):
    """stages.align_mixer.loss and stages.align_hidden.loss: the keys of harness.losses.ALIGNMENT_LOSSES."""

    mse = "mse"
    l2 = "l2"


class DistillLoss(Choice):
    """stages.distill.losses[i].name: the terms of harness.losses.TOKEN_LOSSES."""

    kl = "kl"
    reverse_kl = "reverse_kl"
    ce = "ce"


class DistillData(Choice):
    """stages.distill.data: what stage 3 trains on."""

    text = "text"
    instructions = "instructions"


class TeacherPlacement(Choice):
    """deepspeed.teacher_placement: how stage 3 holds the teacher (harness.engine.teacher_replicated)."""

    auto = "auto"
    zero3 = "zero3"
    replicated = "replicated"


class StudentEngine(Choice):
    """deepspeed.student_engine: the student engine of stage 3 and SFT (harness.engine.student_engine): DeepSpeed, or
    'plain' (harness.plain_engine: torch's fused AdamW on fp32 masters, DistributedDataParallel)."""

    deepspeed = "deepspeed"
    plain = "plain"


class Launcher(Choice):
    """run.launcher: what starts stage 3's processes (harness.launch.local, harness.launch.slurm)."""

    torchrun = "torchrun"
    deepspeed = "deepspeed"


class TextSampling(Choice):
    """data.txt_sample_by: what one document of a plain-text file is."""

    document = "document"
    paragraph = "paragraph"
    line = "line"


class NeedleKind(Choice):
    """eval.niah.kinds: the needles of harness.eval.niah."""

    passkey = "passkey"
    uuid = "uuid"
    kv = "kv"


class NiahPrompt(Choice):
    """eval.niah.prompt: how harness.eval.niah frames its prompts."""

    auto = "auto"
    chat = "chat"
    plain = "plain"


class Haystack(Choice):
    """The embedded prose that eval.niah.haystack and eval.state.text may name (each may also be a file path instead):
    the RULER data of harness.data.embedded."""

    essays = "essays"
    wikipedia = "wikipedia"
