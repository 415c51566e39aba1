"""Stages 1 and 2: per-layer alignment of a layer group to the teacher's activations (one process per group).

Stage 1 (align_mixer): the student mixer of layer l reads the teacher's normalised input to layer l
(`attn_input`) and is trained to output the teacher's attention output before the residual (`attn_output`,
o_proj's output). Only mixer parameters exist in the group, so only they train.
Stage 2 (align_hidden): the student block l (norms + mixer + MLP), initialised from the teacher's norms and
MLP and the stage-1 mixer of layer l, reads the teacher's h_l (`hidden_in`) and is trained to output h_{l+1}
(`hidden_out`). The whole block trains.

Loss: stages.<stage>.loss per layer, `alignment_mse` (the mean over batch, tokens and hidden features, fp32) by
default, or `alignment_l2` (the per-token Euclidean norm of the difference, averaged). The optimised
objective is the *sum* of the group's per-layer losses, so that layer l's gradient is that of its own loss
whatever the group holds; the logged `loss` is their mean. Stage 1 may add a matrix-orientation term per layer
(`stages.align_mixer.mixing_weight`, `mixing_loss`), logged apart as `loss/mixing_<layer>`.

Group independence: a group's results depend only on its layers, not on how the model was cut into groups.
- Every group reads the same data in the same order (the stage's whole stream, rank 0 of world 1).
- Gradients are clipped per layer: each layer's parameters are clipped separately to stage.grad_clip
  (a norm over the whole group would couple layers, and the result would depend on the grouping).
- New mixer parameters of layer l (gates, decays, short convolutions) are drawn by
  `reset_new_parameters()` with torch seeded by `layer_seed(job.seed, l)`. This is what `build_student`
  gives for that layer with the same RNG state; build_student itself draws all layers from one stream,
  whose position at layer l depends on the depth of the (truncated) teacher, i.e. on the grouping.
- Then, before stage 1 trains, each mixer's output scale is fitted to the teacher's attention heads
  (`fit_output_scales`, `student.options.output_scale`) on the first micro-batch of the stage's stream, which every
  group reads alike. `harness transfer` measures the mixers at exactly this start (docs/TRANSFER.md).
So groups [0, 1] and [2, 3] give bit-for-bit the weights of group [0..3] (on CPU).

Run-directory files of a group (`group_dir(job, stage, layers)`): checkpoints/step-*/state.pt, metrics.jsonl,
tb/, weights.safetensors (the group's parameters under their student names, float32) and COMPLETE.json.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from harness.checkpoint import CheckpointInfo, CheckpointManager, capture_rng, file_digest, restore_rng
from harness.config import ConfigError, JobConfig
from harness import preempt
from harness.data.errors import DataError
from harness.plain_engine import decays
from harness.files import atomic_file
from harness.losses import alignment_loss
from harness.mixers import Mixer, MixerShape, mixer_class, mixer_options, resolved_options, saved_options
from harness.observe import RunLogger, check_finite
from harness.schedule import build_scheduler
from harness.stages.common import (PER_LAYER_STAGES, apply_run_determinism, group_dir, kept_attention_layers,
                                   load_job_teacher, num_student_layers, resolve_device, run_dir, teacher_dtype)
from harness.student import FIT_KINDS, StudentBlock, attach_teacher_rope, fit_output_scales, rope_for, student_config
from harness.teacher import capture_activations

WEIGHTS = "weights.safetensors"
STATE = "state.pt"
# How the error messages tell the user to produce a missing stage (the CLI's spelling).
STAGE_COMMAND = "harness stage {stage} JOB --layers {layers}"
KINDS = {"align_mixer": ("attn_input", "attn_output"), "align_hidden": ("hidden_in", "hidden_out")}
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")

__all__ = ["align_group", "check_group", "group_complete", "find_group_weights", "missing_layers", "missing_error",
           "read_layer_tensors", "init_mixer", "layer_seed", "STAGE_COMMAND", "WEIGHTS"]


# ------------------------------------------------------------------------------------------ groups on disk


def check_group(job: JobConfig, stage: str, layers: list[int]) -> list[int]:
    """The sorted layers a group trains, or ConfigError: stage 1 or 2, a contiguous range inside the student, less
    the layers that keep softmax attention (`kept_attention_layers`: no stage-1/2 group trains them), which a
    range may span."""
    if stage not in PER_LAYER_STAGES:
        raise ConfigError(f"Stage '{stage}' is not a per-layer stage; use one of {', '.join(PER_LAYER_STAGES)}.")
    chosen = sorted(set(int(l) for l in layers))
    if not chosen:
        raise ConfigError(f"A layer group of {stage} needs at least one layer.")
    n = num_student_layers(job)
    outside = [l for l in chosen if not 0 <= l < n]
    if outside:
        raise ConfigError(f"Layer(s) {outside} of the {stage} group are outside the model: the student has {n} "
                          f"layers (0-{n - 1}).")
    kept = set(kept_attention_layers(job))
    if any(l not in chosen and l not in kept for l in range(chosen[0], chosen[-1] + 1)):
        raise ConfigError(f"A layer group must be a contiguous range (its folder is named by its first and last "
                          f"layer); got {chosen}. Run one group per range instead.")
    trained = [l for l in chosen if l not in kept]
    if not trained:
        raise ConfigError(f"Layer(s) {chosen} keep the teacher's softmax attention (student.attention_layers): "
                          f"{stage} trains no kept layer. Name layers of mixers.")
    return trained


def group_complete(job: JobConfig, stage: str, layers: list[int]) -> bool:
    """Whether the group finished: COMPLETE.json and weights.safetensors in its folder."""
    gdir = group_dir(job, stage, layers)
    return CheckpointManager(gdir).is_complete() and (gdir / WEIGHTS).is_file()


def find_group_weights(job: JobConfig, stage: str) -> dict[int, Path]:
    """layer -> the weights.safetensors of a complete `stage` group holding that layer's keys.

    Groups are found by their files' keys, not their names, so a later stage may be grouped differently.
    When several complete groups hold a layer (the run was regrouped), the most recently completed wins.
    """
    found: dict[int, tuple[float, Path]] = {}
    root = run_dir(job) / stage
    for gdir in sorted(root.glob("layers-*")) if root.is_dir() else []:
        done_at = _complete_time(gdir)
        if done_at is None or not (gdir / WEIGHTS).is_file():
            continue
        with safe_open(gdir / WEIGHTS, framework="pt") as f:
            held = {int(m.group(1)) for k in f.keys() if (m := _LAYER_KEY.match(k))}
        for layer in held:
            if layer in found and found[layer][1] != gdir / WEIGHTS:
                warnings.warn(f"layer {layer} of {stage} is in {found[layer][1]} and {gdir / WEIGHTS}; "
                              "using the most recently completed", stacklevel=2)
            if layer not in found or done_at >= found[layer][0]:
                found[layer] = (done_at, gdir / WEIGHTS)
    return {layer: path for layer, (_, path) in sorted(found.items())}


def missing_layers(job: JobConfig, stage: str, layers: list[int]) -> list[int]:
    """The layers of `layers` that no complete `stage` group holds."""
    have = find_group_weights(job, stage)
    return [l for l in layers if l not in have]


def missing_error(stage: str, missing: list[int], needed_by: str) -> ConfigError:
    spans = _spans(missing)
    return ConfigError(
        f"{needed_by} needs the {stage} weights of layer(s) {missing}, which no complete {stage} group holds. "
        f"Run {stage} for them first, e.g. `{STAGE_COMMAND.format(stage=stage.replace('_', '-'), layers=spans)}`."
    )


def _spans(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the --layers spelling)."""
    out, start = [], None
    for i, l in enumerate(layers):
        start = l if start is None else start
        if i + 1 == len(layers) or layers[i + 1] != l + 1:
            out.append(f"{start}-{l}" if l != start else f"{l}")
            start = None
    return ",".join(out)


def _complete_time(gdir: Path) -> Optional[float]:
    try:
        return float(json.loads((gdir / "COMPLETE.json").read_text())["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_layer_tensors(path: Path, prefix: str) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file whose names start with `prefix`, with the prefix stripped."""
    with safe_open(path, framework="pt") as f:
        return {k[len(prefix):]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}


# ------------------------------------------------------------------------------------------ building


def layer_seed(seed: int, layer: int) -> int:
    """The torch seed under which layer `layer`'s new mixer parameters are drawn."""
    return seed * 100_003 + layer


def init_mixer(teacher_layer: nn.Module, config: Any, layer: int, seed: int) -> Mixer:
    """Layer `layer`'s stage-1 mixer before its output scale is fitted (`fit_output_scales`): the teacher
    attention's Q/K/V/O, new parameters drawn under `layer_seed(seed, layer)` (fp32). Equals build_student's mixer
    for that layer given the same RNG state at its reset_new_parameters(), which redraws every parameter the
    teacher lacks."""
    options = mixer_options(config.mixer, config.mixer_options)
    mixer = mixer_class(config.mixer)(MixerShape.from_config(config), options, layer).float()
    attach_teacher_rope(mixer, config)
    mixer.transfer_from_attention(teacher_layer.self_attn)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(layer_seed(seed, layer))
        mixer.reset_new_parameters()
    return mixer


def init_block(stage1: dict[int, Path], teacher_layer: nn.Module, config: Any, layer: int) -> StudentBlock:
    """Layer `layer`'s stage-2 block: the teacher's norms and MLP, the stage-1 mixer from `stage1[layer]`
    (see find_group_weights), in fp32."""
    if layer not in stage1:
        raise missing_error("align_mixer", [layer], f"align_hidden (layer {layer})")
    block = StudentBlock(config, layer).float()
    for name in ("input_layernorm", "post_attention_layernorm", "mlp"):
        getattr(block, name).load_state_dict(getattr(teacher_layer, name).state_dict())
    mixer_state = read_layer_tensors(stage1[layer], f"model.layers.{layer}.mixer.")
    result = block.mixer.load_state_dict(mixer_state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ConfigError(f"{stage1[layer]} does not match the {config.mixer} mixer of layer {layer} (missing "
                          f"{result.missing_keys}, unexpected {result.unexpected_keys}); was stage 1 run with "
                          "another student.mixer or student.options? (docs/TRANSFER.md, 'Compatibility', for runs "
                          "begun under older defaults)")
    return block


def first_batch(job: JobConfig, corpus: Any) -> torch.Tensor:
    """The first micro-batch of stage 1's stream (input_ids `[b, T]`): what `fit_output_scales` fits on, the same
    for every layer group (each reads the stage's whole stream)."""
    cfg = job.stages.align_mixer
    return next(iter(corpus.stage_stream("align_mixer", job).loader(0, 1, cfg.micro_batch_size, 1)))["input_ids"]


def build_group(job: JobConfig, stage: str, layers: list[int], teacher: Any, config: Any) -> nn.ModuleDict:
    """str(layer) -> the module that trains for that layer (a Mixer in stage 1, a StudentBlock in stage 2);
    `config` is the student's HarnessConfig."""
    t_layers = teacher.model.model.layers
    if stage == "align_mixer":
        return nn.ModuleDict({str(l): init_mixer(t_layers[l], config, l, job.seed) for l in layers})
    stage1 = find_group_weights(job, "align_mixer")
    return nn.ModuleDict({str(l): init_block(stage1, t_layers[l], config, l) for l in layers})


def student_state_dict(group: nn.ModuleDict, stage: str) -> dict[str, torch.Tensor]:
    """The group's tensors under their names in HarnessForCausalLM (contiguous CPU copies)."""
    sub = ".mixer." if stage == "align_mixer" else "."
    return {f"model.layers.{key}{sub}{name}": t.detach().to("cpu").contiguous()
            for key, module in group.items() for name, t in module.state_dict().items()}


def param_groups(group: nn.ModuleDict, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups per layer: decay where `decays` says (matrices), none on the rest."""
    out = []
    for key, module in group.items():
        decay, plain = [], []
        for name, p in module.named_parameters():
            (decay if decays(name, p) else plain).append(p)
        out += [{"params": ps, "weight_decay": wd, "layer": int(key)}
                for ps, wd in ((decay, weight_decay), (plain, 0.0)) if ps]
    return out


# ------------------------------------------------------------------------------------------ training


def layer_loss(module: nn.Module, stage: str, acts: Any, layer: int, rope: Any = None,
               loss: str = "mse") -> torch.Tensor:
    """The alignment loss `loss` (stages.<stage>.loss) of one layer's module on the teacher's activations
    (fp32 scalar)."""
    src, dst = KINDS[stage]
    x = getattr(acts, src)[layer].float()
    y, _ = module(x, position_embeddings=rope) if stage == "align_mixer" else module(x, rope)
    return alignment_loss(loss)(y, getattr(acts, dst)[layer])


def mixing_loss(mixer: nn.Module, teacher_attention: Any, x: torch.Tensor, tokens: int) -> torch.Tensor:
    """The matrix-orientation term (stages.align_mixer.mixing_weight): on the first `tokens` tokens of the layer
    input x `[B, T, hidden]`, 1 - cos(A_t, P_t) between each query row of the mixer's mixing matrix A
    (harness.probes.MixerProbe: its reference path with one-hot values) and of the teacher's softmax attention P
    (harness.probes.AttentionProbe) over the row's keys, averaged over batch, heads and rows (fp32 scalar). A
    cosine, not a squared distance: a gated mixer's A is bounded by its scale (unit q and k times head_dim^-0.5)
    and normalised after it, so only its direction can match P."""
    from harness.probes import MixerProbe

    x = x[:, :tokens].float()
    positions = torch.arange(x.shape[1], device=x.device)[None]
    with torch.no_grad():  # the teacher's projections in their own dtype (a bf16 teacher), the scores in fp32
        target = teacher_attention.mixing(x.to(teacher_attention.attn.q_proj.weight.dtype), positions).float()
    got = MixerProbe(mixer).mixing(x, positions)
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril()
    got = got.masked_fill(~causal, 0.0)  # the teacher's rows are zero above the diagonal already
    return 1 - torch.nn.functional.cosine_similarity(got, target, dim=-1, eps=1e-12).mean()


def backward_layers(group: nn.ModuleDict, stage: str, acts: Any, rope: Any, scale: float,
                    autocast: Any = contextlib.nullcontext(), loss: str = "mse",
                    mixing: Optional[tuple[float, int, dict[int, Any]]] = None
                    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Backward of scale x each layer's loss, one layer at a time (its graph is freed before the next, and
    layer l's gradient is that of its own loss); the forward runs under `autocast`. `mixing` (weight, tokens,
    {layer: the teacher's AttentionProbe}) adds weight x stage 1's matrix-orientation term to each layer's objective.
    Returns the unscaled, detached alignment losses and matrix-orientation terms per layer (no terms without
    `mixing`)."""
    losses, terms = {}, {}
    for key, module in group.items():
        with autocast:
            value = layer_loss(module, stage, acts, int(key), rope, loss)
        objective = value
        if mixing is not None:
            weight, tokens, probes = mixing
            term = mixing_loss(module, probes[int(key)], getattr(acts, KINDS[stage][0])[int(key)], tokens)
            objective = value + weight * term
            terms[int(key)] = term.detach()
        (objective * scale).backward()
        losses[int(key)] = value.detach()
    return losses, terms


def clip_per_layer(group: nn.ModuleDict, max_norm: float) -> dict[int, float]:
    """Clip each layer's gradients separately (max_norm 0: no clipping); returns the pre-clip norms."""
    limit = max_norm if max_norm > 0 else float("inf")
    return read_per_layer({int(k): torch.nn.utils.clip_grad_norm_(m.parameters(), limit) for k, m in group.items()})


def read_per_layer(values: dict[int, torch.Tensor]) -> dict[int, float]:
    """Per-layer scalars on the device as floats, read in one transfer (each separate read waits for the device,
    which then idles while the host queues the next layer's work)."""
    return dict(zip(values, torch.stack(list(values.values())).tolist())) if values else {}


def stage_autocast(job: JobConfig, device: torch.device) -> Any:
    """The autocast stages 1-2 run their modules under: teacher.dtype on a GPU (fp32 masters), none on a CPU."""
    dtype = teacher_dtype(job, device)
    if device.type == "cuda" and dtype != torch.float32:
        return torch.autocast("cuda", dtype=dtype)
    return contextlib.nullcontext()


def _write_weights(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    with atomic_file(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


@dataclass
class _Run:
    """What one group's training holds; `losses` are the last step's per-layer losses."""

    job: JobConfig
    stage: str
    layers: list[int]
    gdir: Path
    teacher: Any
    group: nn.ModuleDict
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loader: Any
    ckpts: CheckpointManager
    identity: dict[str, Any]
    step: int = 0
    losses: dict[int, float] = field(default_factory=dict)


def align_group(job: JobConfig, stage: str, layers: list[int], *, device: Optional[torch.device] = None,
                stop_after_steps: Optional[int] = None) -> Path:
    """Train one layer group of stage `stage` ('align_mixer' or 'align_hidden'); return its folder.

    Resumes from the group's newest valid checkpoint (exactly: same weights and losses as an uninterrupted
    run) and returns at once if the group is complete. The optimiser is AdamW (betas 0.9/0.95, no decay on
    norms, biases, A_log, dt_bias) on the stage's LR schedule; the loss is the sum of the per-layer MSEs
    (each the mean over batch, tokens and features) and gradients are clipped per layer (module docstring).
    Stage 2 raises ConfigError naming the layers stage 1 has not produced. A non-finite loss raises
    NonFiniteLoss before the optimizer step, with no checkpoint written after the last good one.
    `stop_after_steps` (tests): return without completing after that many optimizer steps of this call.
    """
    layers = check_group(job, stage, layers)
    gdir = group_dir(job, stage, layers)
    if group_complete(job, stage, layers):
        check_made_under(CheckpointManager(gdir).complete_meta() or {}, job, gdir)
        return gdir
    if stage == "align_hidden" and (missing := missing_layers(job, "align_mixer", layers)):
        raise missing_error("align_mixer", missing, f"align_hidden for layers {_spans(layers)}")
    preempt.install_handler()
    run = _setup(job, stage, layers, gdir, device or resolve_device(job))
    resumed = _restore(run)
    if not _train(run, resumed, stop_after_steps):
        return gdir
    _finish(run)
    return gdir


def _setup(job: JobConfig, stage: str, layers: list[int], gdir: Path, device: torch.device) -> _Run:
    """The teacher prefix, this stage's loader (rank 0 of 1), the group's modules, optimizer and schedule."""
    from harness.data import prepare_job_corpus

    cfg = getattr(job.stages, stage)
    teacher = load_job_teacher(job, device, up_to_layer=layers[-1] + 1)
    if teacher.tokenizer is None:
        raise ConfigError(f"teacher.source='{job.teacher.source}' has no tokenizer files; the data needs one.")
    corpus = prepare_job_corpus(job, teacher.tokenizer, max_positions=teacher.config.max_position_embeddings)
    loader = corpus.stage_stream(stage, job).loader(0, 1, cfg.micro_batch_size, cfg.grad_accum)
    # One process per group: the step count is the stream's, = plan_stages' when deepspeed.world_size is 1.
    total_steps = loader.steps
    torch.manual_seed(job.seed)
    apply_run_determinism(job)  # run.deterministic
    config = student_config(teacher.model.config, job.student.mixer, dict(job.student.options))
    group = build_group(job, stage, layers, teacher, config).to(device).train()
    if stage == "align_mixer":  # before training, and again on resume (the checkpoint then overwrites it)
        ids = first_batch(job, corpus).to(device)
        acts = capture_activations(teacher.model, ids, layers=layers, kinds=FIT_KINDS)
        fit_output_scales({int(k): m for k, m in group.items()}, acts, rope_for(config, device)(ids),
                          stage_autocast(job, device))
    optimizer = torch.optim.AdamW(param_groups(group, cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
    identity = {"stage": stage, "layers": layers, "mixer": job.student.mixer,
                "options": resolved_options(job.student.mixer, job.student.options), "total_steps": total_steps}
    return _Run(job, stage, layers, gdir, teacher, group, optimizer, build_scheduler(optimizer, cfg, total_steps),
                loader, CheckpointManager(gdir / "checkpoints", keep_last=job.run.keep_last), identity)


def _restore(run: _Run) -> Optional[CheckpointInfo]:
    """Load the newest checkpoint whose files match their sha256 and that loads (weights, optimizer, schedule, data
    position, RNG), if any. A corrupt one is skipped, one that fails to load is moved aside to bad-step-*, each
    with a CheckpointWarning, for the previous one (`CheckpointManager.resume`); one written by another run raises
    ConfigError."""
    return run.ckpts.resume(lambda found: _load(run, found), collective=False, fatal=(ConfigError, DataError))


def _load(run: _Run, latest: CheckpointInfo) -> None:
    """Load one checkpoint into the group's modules, optimizer, schedule, loader and the RNG."""
    _check_identity(latest.meta, run.identity, run.gdir)
    state = torch.load(latest.path / STATE, map_location="cpu", weights_only=True)
    try:
        run.group.load_state_dict(state["model"])
    except RuntimeError as err:
        raise ConfigError(f"The checkpoint {latest.path} does not fit this group's mixers ({str(err).splitlines()[0]}"
                          f" ...): was it written under other student.options? (docs/TRANSFER.md, 'Compatibility', "
                          "for runs begun under older defaults)") from err
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.loader.load_state_dict(state["data"])
    restore_rng(state["rng"])
    run.step, run.losses = latest.step, {int(k): v for k, v in latest.meta.get("losses", {}).items()}


def _save(run: _Run) -> None:
    def writer(path: Path) -> None:
        torch.save({"model": run.group.state_dict(), "optimizer": run.optimizer.state_dict(),
                    "scheduler": run.scheduler.state_dict(), "data": run.loader.state_dict(), "rng": capture_rng()},
                   path / STATE)

    meta = {**run.identity, "losses": {str(l): v for l, v in run.losses.items()}}
    run.ckpts.save(run.step, run.loader.tokens_consumed, writer, meta=meta, collective=False)


def _train(run: _Run, resumed: Optional[CheckpointInfo], stop_after_steps: Optional[int]) -> bool:
    """Train to the end of the stage; checkpoints every run.checkpoint_every_tokens tokens and at the end.
    False when stopped early by `stop_after_steps`."""
    job, cfg = run.job, getattr(run.job.stages, run.stage)
    device = next(run.group.parameters()).device
    total_steps = run.identity["total_steps"]
    rope = rope_for(student_config(run.teacher.model.config, job.student.mixer, dict(job.student.options)), device)
    autocast = stage_autocast(job, device)
    every, done_here, saved_at = job.run.checkpoint_every_tokens, 0, run.step if resumed else -1
    mixing = None
    if run.stage == "align_mixer" and cfg.mixing_weight:
        from harness.probes import AttentionProbe

        mixing = (cfg.mixing_weight, cfg.mixing_tokens,
                  {l: AttentionProbe.of_teacher(run.teacher.model, l) for l in run.layers})
    name = f"{run.stage}/{run.gdir.name}"
    with RunLogger(run.gdir, stage=name, total_tokens=run.loader.tokens_total,
                   start_step=resumed.step if resumed else None, start_tokens=run.loader.tokens_consumed) as log:
        if resumed:
            log.write(f"{name}: resuming from {resumed.path} (step {run.step}/{total_steps})")
        while run.step < total_steps:
            lr, tokens_before = run.scheduler.get_last_lr()[0], run.loader.tokens_consumed
            sums, term_sums = dict.fromkeys(run.layers, 0.0), dict.fromkeys(run.layers, 0.0)
            for _ in range(cfg.grad_accum):
                ids = next(run.loader)["input_ids"].to(device)
                acts = capture_activations(run.teacher.model, ids, layers=run.layers, kinds=KINDS[run.stage])
                losses, terms = backward_layers(run.group, run.stage, acts, rope(ids), 1 / cfg.grad_accum, autocast,
                                                cfg.loss, mixing)
                read, read_terms = read_per_layer(losses), read_per_layer(terms)
                for l in run.layers:
                    sums[l] += read[l]
                    term_sums[l] += read_terms.get(l, 0.0)
            run.losses = {l: v / cfg.grad_accum for l, v in sums.items()}
            logged_terms = {f"loss/mixing_{l:02d}": v / cfg.grad_accum for l, v in term_sums.items()} if mixing else {}
            mean = check_finite(sum(run.losses.values()) / len(run.losses), run.step + 1,
                               run.loader.tokens_consumed)
            norms = clip_per_layer(run.group, cfg.grad_clip)
            run.optimizer.step()
            run.scheduler.step()
            run.optimizer.zero_grad(set_to_none=True)
            run.step, done_here, tokens = run.step + 1, done_here + 1, run.loader.tokens_consumed
            if run.step % job.run.log_every_steps == 0 or run.step == total_steps:
                log.log(run.step, tokens, loss=mean, lr=lr, **{f"loss/layer_{l:02d}": v for l, v in run.losses.items()},
                        **logged_terms,
                        **{f"grad_norm/layer_{l:02d}": v for l, v in norms.items()})
            if every and tokens // every > tokens_before // every:
                _save(run)
                saved_at = run.step
            if preempt.requested() and run.step < total_steps:
                if saved_at != run.step:
                    _save(run)
                log.write(f"{name}: preempted at step {run.step}; checkpoint written, exiting to be requeued")
                raise preempt.Preempted()
            if stop_after_steps is not None and done_here >= stop_after_steps:
                return False
        if saved_at != run.step:
            _save(run)
    return True


def _finish(run: _Run) -> None:
    """weights.safetensors (atomically), then COMPLETE.json with the final losses."""
    path = run.gdir / WEIGHTS
    _write_weights(path, {k: v.float() for k, v in student_state_dict(run.group, run.stage).items()},
                   {"stage": run.stage, "layers": _spans(run.layers), "mixer": run.job.student.mixer})
    CheckpointManager(run.gdir).mark_complete({
        **run.identity, "losses": {str(l): v for l, v in run.losses.items()},
        "loss": sum(run.losses.values()) / len(run.losses), "tokens": run.loader.tokens_consumed,
        "steps": run.step, "weights": WEIGHTS, "sha256": file_digest(path)["sha256"],
    }, collective=False)


def check_made_under(record: dict[str, Any], job: JobConfig, where: Path) -> None:
    """Refuse a finished group (the meta of its COMPLETE.json, `record`) made under another mixer or other mixer options than the
    job's: its weights belong to that network. A record without a new option was made under its old value."""
    if record.get("mixer") != job.student.mixer:
        raise ConfigError(f"{where} was made for student.mixer={record.get('mixer')}, not {job.student.mixer}: use "
                          "the job that made it, another output_dir, or delete the folder to redo it.")
    now = resolved_options(job.student.mixer, job.student.options)
    then = asdict(saved_options(job.student.mixer, record.get("options")))
    changed = {k: (then[k], now[k]) for k in now if then.get(k) != now[k] and k != "backend"}
    if changed:
        keep = " ".join(f"student.options.{k}={_spell(old)}" for k, (old, _) in changed.items())
        raise ConfigError(
            f"{where} was made under other student.options than the job's ("
            + "; ".join(f"{k}: {old!r} then, {new!r} now" for k, (old, new) in changed.items())
            + f"). Its weights belong to that network: add `{keep}` to continue the run as it began (docs/TRANSFER.md, "
            "'Compatibility'), or use another output_dir.")


def _spell(value: Any) -> str:
    """An option value as a command-line override spells it."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _check_identity(saved: dict[str, Any], now: dict[str, Any], gdir: Path) -> None:
    """Refuse to resume a checkpoint written under another mixer, options, layers or step count."""
    if "options" in saved and "mixer" in saved:  # options as saved: a missing init option had its old value
        saved = {**saved, "options": asdict(saved_options(saved["mixer"], saved["options"]))}
    changed = [k for k, v in now.items() if k in saved and saved[k] != v]
    if changed:
        detail = "; ".join(f"{k}: saved {saved[k]!r}, now {now[k]!r}" for k in changed)
        raise ConfigError(f"The checkpoints in {gdir / 'checkpoints'} were written by a different run ({detail}). "
                          "Use the job that wrote them, another output_dir, or delete that folder to start over.")
