"""What every stage shares: the run directory layout, layer ranges and groups, device choice, the job's teacher,
and what the training stages (stage 3, SFT) read, how they weight their micro-batches' losses, and how they
checkpoint, resume and report their engine.

Run directory (job.output_dir):

    align_mixer/layers-00-03/   stage 1, one folder per layer group: checkpoints/, metrics.jsonl, tb/,
                                weights.safetensors (the group's trained parameters), COMPLETE.json
    align_hidden/layers-00-03/  stage 2, the same
    merged/                     the student assembled from the stage-2 groups (Hugging Face format)
    distill/                    stage 3: checkpoints/, metrics.jsonl, tb/, COMPLETE.json
    student/                    the final student (Hugging Face format)
    job.yaml                    the resolved job (the evaluation reads its held-out text)
    eval.yaml                   the evaluation job spec for the final student (harness/eval/spec.py)
    eval/                       its results: student/, teacher/, report.md, report.json; with eval.every_tokens
                                also history.jsonl, during/ (each snapshot's results), pending/, snapshots/
    eval-during.yaml            the spec of the evaluations along stage 3
    sft/                        SFT (post-training): checkpoints/, metrics.jsonl, tb/, checkpoints/COMPLETE.json
    student-sft/                the fine-tuned student (Hugging Face format, tokenizer + chat template)
    job-sft.yaml, eval-sft.yaml the resolved SFT job and the evaluation spec of student-sft (results in eval-sft/)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from harness.checkpoint import CheckpointInfo, CheckpointManager, restore_rng, rng_path, save_rng
from harness.config import PER_LAYER as PER_LAYER_STAGES, ConfigError, JobConfig, auto_layer_count, auto_layer_measure
from harness.data.errors import DataError
from harness.engine import PlainEngine
from harness.export import TAG

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_dir(job: JobConfig) -> Path:
    return Path(job.output_dir)


def group_name(layers: list[int]) -> str:
    return f"layers-{layers[0]:02d}-{layers[-1]:02d}"


def group_dir(job: JobConfig, stage: str, layers: list[int]) -> Path:
    if stage not in PER_LAYER_STAGES:
        raise ValueError(f"stage '{stage}' is not a per-layer stage ({', '.join(PER_LAYER_STAGES)})")
    return run_dir(job) / stage / group_name(layers)


def parse_layers(spec: str, num_layers: int) -> list[int]:
    """'0-9' / '3' / '0-3,8-9' -> sorted layer indices, each checked against the teacher's depth."""
    layers: set[int] = set()
    try:
        for part in filter(None, (p.strip() for p in spec.split(","))):
            lo, _, hi = part.partition("-")
            start, end = int(lo), int(hi) if hi else int(lo)
            if end < start:
                raise ValueError
            layers.update(range(start, end + 1))
    except ValueError:
        raise ConfigError(f"--layers '{spec}' is not a layer range: use e.g. 0-9, 4 or 0-3,8-9.") from None
    if not layers:
        raise ConfigError(f"--layers '{spec}' names no layer.")
    outside = sorted(x for x in layers if x < 0 or x >= num_layers)
    if outside:
        raise ConfigError(
            f"--layers '{spec}' names layer(s) {outside} outside the model: the student has {num_layers} layers "
            f"(0-{num_layers - 1})."
        )
    return sorted(layers)


def layer_groups(num_layers: int, groups: int, kept: Collection[int] = ()) -> list[list[int]]:
    """Split the layers 0..num_layers-1 that stages 1-2 train (all but `kept`, the layers that keep softmax
    attention) into `groups` groups of near-equal size, each a contiguous range of them (a range of the depth
    less the kept layers in it). No layer trained: no group."""
    kept = set(kept)
    trained = [l for l in range(num_layers) if l not in kept]
    if not trained:
        return []
    groups = max(1, min(groups, len(trained)))
    base, extra = divmod(len(trained), groups)
    out, start = [], 0
    for g in range(groups):
        size = base + (1 if g < extra else 0)
        out.append(trained[start:start + size])
        start += size
    return out


# The layer ranking (harness/ranking.py writes it; `auto:K` kept layers are read from it here)
RANKING_DIR, RANKING_JSON = "ranking", "layer_ranking.json"
RANK_COMMAND = "harness transfer --rank-layers JOB"  # how the errors tell the user to write the ranking


def ranking_dir(job: JobConfig) -> Path:
    return run_dir(job) / RANKING_DIR


def costliest_layers(job: JobConfig, k: int, measure: Optional[str] = None) -> list[int]:
    """The `k` costliest layers of the job's ranking (RUN/ranking/layer_ranking.json), sorted by index: the layers a
    hybrid student keeps as the teacher's attention. ConfigError when the file is missing, is another teacher's,
    ranks by another measure than `measure` (None: any), or k is outside 0..layers."""
    path = ranking_dir(job) / RANKING_JSON
    if not path.is_file():
        raise ConfigError(f"No layer ranking at {path}: write it with `{RANK_COMMAND}` (or `harness submit JOB "
                          "--rank-layers` on Slurm), then choose the layers from it.")
    from harness.teacher import teacher_identity

    ranking = json.loads(path.read_text())
    n = num_student_layers(job)
    teacher = teacher_identity(job.teacher.source)
    if teacher_identity(str(ranking.get("teacher"))) != teacher or ranking.get("teacher_layers") != n:
        raise ConfigError(f"{path} ranks the {ranking.get('teacher_layers')} layers of teacher "
                          f"'{ranking.get('teacher')}', not the {n} of this job's '{job.teacher.source}'; rank again "
                          f"with `{RANK_COMMAND}`.")
    if measure is not None and ranking.get("measure") != measure:
        raise ConfigError(f"{path} ranks the layers by {ranking.get('measure')}, but student.attention_layers="
                          f"{job.student.attention_layers} asks for a {measure} ranking: write it with "
                          f"`{RANK_COMMAND} --rank-by {measure}`.")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= n:
        raise ConfigError(f"K={k!r} costliest layers: K must be an integer from 0 to the teacher's {n} layers.")
    return sorted(ranking["order"][:k])


def kept_attention_layers(job: JobConfig) -> list[int]:
    """The layers of the job's student that keep the teacher's softmax attention, sorted: student.attention_layers,
    each checked against the student's depth (the teacher's, after teacher.num_layers), or with 'auto:K' the K
    costliest layers of the job's layer ranking (`costliest_layers`). Every stage, planner and
    builder reads them here."""
    k = auto_layer_count(job.student.attention_layers)
    if k is not None:  # read from the layer ranking when needed, not at load_job: the ranking runs on this job too
        return costliest_layers(job, k, auto_layer_measure(job.student.attention_layers))
    layers = sorted(job.student.attention_layers)
    if not layers:
        return []
    n = num_student_layers(job)
    outside = [l for l in layers if not 0 <= l < n]
    if outside:
        raise ConfigError(f"student.attention_layers={list(job.student.attention_layers)} names layer(s) {outside} "
                          f"outside the student: it has {n} layers (0-{n - 1}).")
    return layers


def job_layer_groups(job: JobConfig, groups: int) -> list[list[int]]:
    """The job's stage-1/2 layer groups (`layer_groups` of its student, less its kept attention layers)."""
    return layer_groups(num_student_layers(job), groups, kept_attention_layers(job))


def apply_run_determinism(job: JobConfig) -> bool:
    """run.deterministic: torch's deterministic algorithms in this process from here on; True when on. Called
    before the stage's first matmul (cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it creates its handle)."""
    if not job.run.deterministic:
        return False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    return True


def resolve_device(job: JobConfig) -> torch.device:
    want = job.run.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device=cuda but no CUDA device is visible; use run.device=cpu or auto.")
    if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def default_count(configured: int, cpu_default: int) -> int:
    """A run.* count where 0 means: one per visible GPU, or `cpu_default` without GPUs."""
    if configured:
        return configured
    return torch.cuda.device_count() or cpu_default


def num_student_layers(job: JobConfig) -> int:
    from harness.teacher import teacher_config

    n = teacher_config(job.teacher.source).num_hidden_layers
    return min(n, job.teacher.num_layers) if job.teacher.num_layers else n


def teacher_dtype(job: JobConfig, device: Optional[torch.device] = None) -> torch.dtype:
    """teacher.dtype as a torch dtype; `auto` is bfloat16 on a CUDA device (`device`, else the job's) and
    float32 on a CPU, where bf16 matmuls are slow and the tests compare in float32."""
    if job.teacher.dtype != "auto":
        return DTYPES[job.teacher.dtype]
    return torch.bfloat16 if (device or resolve_device(job)).type == "cuda" else torch.float32


def load_job_teacher(job: JobConfig, device: Optional[torch.device] = None, up_to_layer: Optional[int] = None):
    """The job's teacher, truncated to teacher.num_layers (and further to layers < up_to_layer when a layer
    group needs only a prefix), frozen, in teacher.dtype (see `teacher_dtype`), on `device`."""
    from harness.teacher import load_teacher

    teacher = load_teacher(job.teacher.source, dtype=teacher_dtype(job, device))
    keep = job.teacher.num_layers or teacher.num_layers
    if up_to_layer is not None:
        keep = min(keep, up_to_layer)
    truncate(teacher.model, keep)
    if device is not None:
        teacher.model.to(device)
    return teacher


def truncate(model: Any, num_layers: int) -> None:
    """Keep the first `num_layers` decoder layers of a Llama-style model (its config follows)."""
    if num_layers < len(model.model.layers):
        model.model.layers = model.model.layers[:num_layers]
        model.config.num_hidden_layers = num_layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:num_layers]


@dataclass
class StageData:
    """What a training stage reads: its loader, planned steps and tokens, and held-out batches (or None).

    validation(batch_size, rank, world) yields batches with input_ids, labels (-100: no loss) and valid [b].
    """

    loader: Any
    steps: int
    tokens: int
    validation: Optional[Callable[[int, int, int], Iterator[dict]]]


def chat_data(job: JobConfig, stage: str, cfg: Any, tokens: Optional[int], tokenizer: Any,
              max_positions: Optional[int], rank: int, world: int) -> StageData:
    """A stage on the chat data of `instructions` (stage 3 with data=instructions, or SFT): steps from the data."""
    from harness.data.chat import plan_chat_steps, prepare_chat_data

    data = prepare_chat_data(job, tokenizer, max_positions=max_positions)
    per_step = world * cfg.micro_batch_size * cfg.grad_accum
    own = stage == "sft" or cfg.tokens is not None
    key = f"stages.{stage}.tokens" if own else "stage 3's share of budget.total_tokens (budget.split[2])"
    steps = plan_chat_steps(data, job.seed, per_step, tokens, job.instructions.allow_repeat, key)
    loader = data.loader(stage, job.seed, rank, world, cfg.micro_batch_size, cfg.grad_accum, steps)
    return StageData(loader, steps, loader.tokens_total, data.validation_batches if len(data.validation) else None)


def token_scale(tokens: int, step_tokens: int, world: int, grad_accum: int) -> float:
    """Weight of a micro-batch's per-token mean loss so that the step's gradient is the per-token mean over all
    `step_tokens` tokens of the step: DeepSpeed divides by grad_accum and averages over the world."""
    return tokens * world * grad_accum / max(step_tokens, 1)


def scaled(loss: torch.Tensor, scale: float) -> torch.Tensor:
    return loss if scale == 1.0 else loss * scale  # 1.0 (text: equal micro-batches) keeps the graph unchanged


def resume_checkpoint(ckpts: CheckpointManager, s_engine, loader) -> tuple[int, int]:
    """Load the newest checkpoint whose files match their sha256 and that loads on every rank (engine, loader
    position, RNG), if any; returns (step, tokens), (0, 0) to start afresh.

    A corrupt checkpoint is skipped, and one that fails to load is moved aside to bad-step-*, each with a
    CheckpointWarning, for the previous one (`CheckpointManager.resume`); a checkpoint written under another
    configuration (engine, world size, data) raises ConfigError / DataError instead."""
    info = ckpts.resume(lambda found: load_checkpoint(found, s_engine, loader), fatal=(ConfigError, DataError))
    return (info.step, info.tokens) if info is not None else (0, 0)


def load_checkpoint(info: CheckpointInfo, s_engine, loader) -> None:
    """Load one checkpoint into the engine, the loader and this rank's RNG. The configuration checks and the small
    files (data.json, the RNG state) come first, so that most failures happen before the engine changes."""
    check_engine_matches(info.path, s_engine)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    zero = getattr(s_engine, "zero_optimization", None)  # DeepSpeed's engine: the ZeRO stage (0: none)
    if zero is not None and zero() and info.world_size != world:
        raise ConfigError(f"checkpoint {info.path} was written by {info.world_size} process(es) and this run has "
                          f"{world}: DeepSpeed cannot split ZeRO optimizer states anew. Resume with deepspeed."
                          f"world_size={info.world_size}, or start the stage afresh in another run directory.")
    loader.load_state_dict(json.loads((info.path / "data.json").read_text()))
    rng = torch.load(rng_path(info.path), weights_only=True)
    loaded = s_engine.load_checkpoint(str(info.path), tag=TAG)
    if isinstance(loaded, tuple) and loaded[0] is None:  # DeepSpeed's "nothing there": a warning, no error
        raise RuntimeError(f"DeepSpeed found no checkpoint to load in {info.path / TAG}")
    restore_rng(rng)


def check_engine_matches(checkpoint: Path, s_engine) -> None:
    """A checkpoint resumes only under the engine that wrote it (deepspeed.student_engine): the two formats differ."""
    wrote_plain = (checkpoint / TAG / PlainEngine.STATE_FILE).is_file()
    if wrote_plain != isinstance(s_engine, PlainEngine):
        wrote, runs = ("plain", "deepspeed") if wrote_plain else ("deepspeed", "plain")
        raise ConfigError(
            f"checkpoint {checkpoint} was written by deepspeed.student_engine={wrote}, but this run uses "
            f"deepspeed.student_engine={runs}. Resume with deepspeed.student_engine={wrote}, or start the stage "
            f"afresh in another run directory.")


def save_checkpoint(ckpts: CheckpointManager, s_engine, loader, step: int, tokens: int) -> None:
    """An atomic checkpoint of the engine (DeepSpeed tag TAG), the loader position (data.json) and each rank's RNG."""

    def writer(tmp: Path) -> None:
        s_engine.save_checkpoint(str(tmp), tag=TAG)
        if torch.distributed.get_rank() == 0:
            (tmp / "data.json").write_text(json.dumps(loader.state_dict()))
        save_rng(tmp)

    ckpts.save(step, tokens, writer)


def grad_norm(s_engine) -> float:
    """The last step's global gradient norm before clipping (nan where the engine has none yet)."""
    norm = s_engine.get_global_grad_norm()
    return float(norm) if norm is not None else float("nan")


def skipped_steps(s_engine) -> int:
    """Optimizer steps the engine left out so far for a non-finite gradient (DeepSpeed's and the plain engine's
    count; a rising count with grad_norm inf / nan in metrics.jsonl is a run going wrong before its loss does)."""
    return int(getattr(s_engine, "skipped_steps", 0))
