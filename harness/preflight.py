"""Checks of a job against the files it names, before any weights load.

`harness.config.validate` checks a job on its own; `preflight` checks it against the world: that its output_dir
can be written, and that the teacher it names (its config alone, `harness.teacher.teacher_config`: no weights) has
the layers and positions the job asks for. The commands that start work call it first (`harness run`, `harness
stage ...`, `harness submit`, and `harness info` without the output check), so that a mistake is one paragraph
(ConfigError, exit 2) in seconds rather than a traceback after the teacher has loaded. The stages keep their own
checks (e.g. harness.data.corpus.check_seq_len) for callers that skip this one.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from harness.config import PER_LAYER, STAGES, ConfigError, JobConfig, reads_instructions


def preflight(job: JobConfig, *, writes_output: bool, stages: Sequence[str] = STAGES) -> None:
    """Raise ConfigError (or TeacherLoadError for a damaged teacher) unless `job` can run `stages` (by default the
    pipeline's three; 'sft' for post-training; none for the merge): with `writes_output`, output_dir must be a
    directory this process can create and write in; teacher.num_layers must not exceed the teacher's layers, and no
    sequence length a stage trains at may exceed its positions (max_position_embeddings)."""
    if writes_output:
        check_output_dir(job.output_dir)
    check_against_teacher(job, stages)


# ------------------------------------------------------------------------------------------- output_dir


def check_output_dir(output_dir: str) -> None:
    """ConfigError unless `output_dir` is a directory, or can be made one, in which this process can write: it is
    no file, no file lies on its path, and a probe file can be created and removed in it (or in the nearest folder
    of it that exists)."""
    path = Path(output_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"output_dir='{output_dir}' is a file, not a directory; choose another output_dir, or move "
                          "the file away.")
    existing = _nearest_existing(path)
    if not existing.is_dir():
        raise ConfigError(f"output_dir='{output_dir}' lies under '{existing}', which is a file, so no directory can "
                          "be made there; choose another output_dir.")
    problem = _write_problem(existing)
    if problem:
        where = "it" if existing == path else f"'{existing}', the part of its path that exists,"
        raise ConfigError(f"output_dir='{output_dir}' cannot be written: {where} {problem}; choose an output_dir on "
                          "a writable file system (one this user may write to).")


def _nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _write_problem(folder: Path) -> str | None:
    """Why no file can be created in `folder` (a probe file made and removed at once), or None if one can."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".harness-probe-", dir=folder)
    except OSError as err:
        return _why(err)
    os.close(fd)
    os.unlink(probe)
    return None


def _why(err: OSError) -> str:
    """An OSError of creating a file, as a phrase."""
    if err.errno == errno.EROFS:
        return "is on a read-only file system"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "is not writable by this user (permission denied)"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "is on a full file system (no space left, or the quota is reached)"
    return f"refuses a new file ({os.strerror(err.errno) if err.errno else err})"


# ------------------------------------------------------------------------------------------- the teacher


def check_against_teacher(job: JobConfig, stages: Sequence[str] = STAGES) -> None:
    """ConfigError when teacher.num_layers exceeds the teacher's layers, when a length that `stages` train at
    (data.seq_len, instructions.seq_len) exceeds the teacher's max_position_embeddings, or when stage 2 is asked of
    a teacher whose extra layer norms it does not copy (`check_stage2_parts`); TeacherLoadError when the teacher's
    config sets what a student would not carry (`harness.teacher.check_teacher_config`). Reads the config only."""
    from harness.teacher import check_teacher_config, teacher_config

    config = teacher_config(job.teacher.source)
    source = f"teacher.source='{job.teacher.source}'"
    check_teacher_config(config, job.teacher.source)
    check_stage2_parts(config, source, stages)
    layers = config.num_hidden_layers
    if job.teacher.num_layers and job.teacher.num_layers > layers:
        raise ConfigError(f"teacher.num_layers={job.teacher.num_layers} but the teacher ({source}) has {layers} "
                          f"layers; set teacher.num_layers to at most {layers}, or null to keep them all.")
    positions = getattr(config, "max_position_embeddings", None)
    for key, length in trained_lengths(job, stages).items():
        if positions is not None and length > positions:
            raise ConfigError(f"{key}={length} exceeds the teacher's max_position_embeddings={positions} ({source}): "
                              f"it has no positions beyond those; set {key} to at most {positions}.")


# What stage 2 (harness.stages.align.init_block) copies from a teacher layer into its block besides the mixer.
STAGE2_COPIED_PARTS = ("input_layernorm", "post_attention_layernorm", "mlp")


def check_stage2_parts(config: object, source: str, stages: Sequence[str]) -> None:
    """ConfigError when `stages` hold align_hidden and the teacher's layers have parts stage 2 does not copy into its
    blocks (Gemma 2/3's pre_feedforward_layernorm and post_feedforward_layernorm): the blocks would train, and the
    merge keep, those norms at their initial values instead of the teacher's."""
    from harness.teacher_families import family_of

    missed = sorted(family_of(config).extra_layer_parts - set(STAGE2_COPIED_PARTS))
    if "align_hidden" in stages and missed:
        raise ConfigError(f"stage align_hidden cannot run on {source}, a '{config.model_type}' teacher: its layers' "
                          f"{', '.join(missed)} are not among the parts stage 2 copies into its blocks "
                          f"({', '.join(STAGE2_COPIED_PARTS)}), so it would train, and the merge keep, them at their "
                          "initial values. A student of this teacher is built by harness.build_student (hybrids, "
                          "evaluation, harness transfer); the pipeline needs stage 2 to copy every part.")


def trained_lengths(job: JobConfig, stages: Sequence[str]) -> dict[str, int]:
    """The sequence lengths `stages` train and validate at, by key: data.seq_len for the stages on text,
    instructions.seq_len for those on chat data (stage 3 with stages.distill.data=instructions, SFT)."""
    lengths: dict[str, int] = {}
    for stage in stages:
        if stage == "sft" or (stage == "distill" and reads_instructions(job, stage)):
            lengths["instructions.seq_len"] = job.instructions.seq_len
        elif stage in PER_LAYER or stage == "distill":
            lengths["data.seq_len"] = job.data.seq_len
    return lengths
