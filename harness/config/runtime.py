"""The job's `deepspeed:` and `run:` sections: how stage 3 holds teacher and student, and the processes, devices,
checkpoints, logging and launcher of a run."""

from __future__ import annotations

from dataclasses import dataclass

from harness.config.fields import POSITIVE, at_least_zero, described
from harness.config_choices import Device, Launcher, StudentEngine, TeacherPlacement


@dataclass
class DeepSpeedConfig:
    student_config: str = described("ds_configs/zero3.json", "DeepSpeed config file for the student.")
    teacher_config: str = described(
        "ds_configs/zero3_teacher.json", "DeepSpeed config file for the teacher (used when it is placed 'zero3')."
    )
    teacher_placement: TeacherPlacement = described(
        TeacherPlacement.auto,
        "How stage 3 holds the frozen teacher: 'zero3' (a ZeRO-3 inference engine from teacher_config: "
        "sharded over the processes, each layer gathered at every forward), 'replicated' (a plain bf16 copy on "
        "every device: no gathers, no hooks; faster while it fits) or 'auto' (replicated when its weights take at "
        "most 10% of one device's memory, e.g. SmolLM2-1.7B's 3.4 GB on an H200, else zero3)."
    )
    world_size: int = described(
        1, "Data-parallel processes of stage 3 (GPUs, or CPU processes); the per-layer stages run one process "
        "per layer group. The token-to-step plan and the data slices follow it.", rule=POSITIVE
    )
    student_engine: StudentEngine = described(
        StudentEngine.deepspeed,
        "The student engine of stage 3 and SFT: 'deepspeed' (ZeRO as student_config says) or 'plain' (no DeepSpeed: "
        "torch's fused AdamW on fp32 master copies of bf16 weights, as DeepSpeed's bf16 mode keeps them, with "
        "student_config's optimizer settings, clipping and skipped steps as DeepSpeed does them; skips DeepSpeed's "
        "per-tensor optimizer loop, ~70 ms of host time per step for the 135M student on an H200). With world_size "
        "> 1, 'plain' is torch's DistributedDataParallel, gradients reduced in fp32 into the masters while the "
        "backward runs: each process holds the whole student and its optimizer state (~16 bytes per parameter), "
        "so use it only where that fits a device; ZeRO shards them. Its checkpoints (ds/plain_engine.pt: they "
        "resume on any number of processes, those of earlier harness versions too) are not DeepSpeed's: a run "
        "keeps the engine it started with; export and evaluation read both."
    )


@dataclass
class RunConfig:
    device: Device = described(Device.auto, "Where stages run: auto (cuda when available, else cpu), cpu or cuda.")
    layer_groups: int = described(
        0, "Layer groups of stages 1 and 2 (one process each, run in parallel); 0: one per GPU, or 2 on a CPU.",
        rule=at_least_zero("the default")
    )
    parallel_groups: int = described(
        0, "Layer-group processes run at once by `harness run`; 0: one per GPU, or 2 on a CPU.",
        rule=at_least_zero("the default")
    )
    checkpoint_every_tokens: int = described(
        0, "Write a checkpoint every N tokens of a stage (and always at its end); 0: only at the end.",
        rule=at_least_zero("only at the end")
    )
    keep_last: int = described(2, "Checkpoints kept per stage (older ones are deleted).", rule=POSITIVE)
    log_every_steps: int = described(10, "Optimizer steps between metric log lines.", rule=POSITIVE)
    validate_every_steps: int = described(
        0, "Stage 3 validation (held-out CE, KL, perplexity: val_* in metrics.jsonl and TensorBoard) every N optimizer "
        "steps, and always at the end; 0: at the end only. Each costs one pass over data.validation_tokens.",
        rule=at_least_zero("at the end only")
    )
    max_skipped_steps_in_a_row: int = described(
        20, "Stop stage 3 or SFT when this many optimizer steps in a row were skipped for a non-finite gradient "
        "(the weights stopped changing; skipped_steps and grad_norm are in metrics.jsonl); 0: never stop.",
        rule=at_least_zero("never stop")
    )
    launcher: Launcher = described(
        Launcher.torchrun, "What `harness run` starts stage 3 with when deepspeed.world_size > 1: 'torchrun' "
        "(--standalone, a free port of its own) or 'deepspeed' (the DeepSpeed launcher, --num_gpus world_size on "
        "this machine). `harness submit` renders the same launcher per node. Both pass the ranks in LOCAL_RANK, "
        "RANK and WORLD_SIZE; the deepspeed launcher also passes --local_rank."
    )
    collective_timeout_s: int = described(
        1800, "Seconds a collective of stage 3 or SFT may wait for the other processes before it fails (the "
        "process group's timeout): how long a process waits for a peer that died or hangs before it exits with "
        "an error.", rule=POSITIVE
    )
    accept_changed_settings: bool = described(
        False, "Continue a run directory whose finished or started stages were computed with other settings than "
        "this job's (each stage records them in RUN_DIR/settings/STAGE.json; a rerun with different ones is "
        "refused, naming the keys). true keeps the earlier work as it is and continues under the new settings, "
        "which are then recorded beside the old; the results mix both. The safe way out is a new output_dir."
    )
    deterministic: bool = described(
        False, "Training stages run under torch.use_deterministic_algorithms(True) (and cuBLAS's fixed workspace), "
        "so that a job trained twice on the same GPU kind gives the same weights bit for bit. Without it a hybrid "
        "student's softmax layers (torch's attention backward) make two trainings part within a few steps; the "
        "pure student repeats anyway. Measured on an H100 (docs/results/step_repeat_h100_2026-12-06): the 135M "
        "2-of-30 hybrid's stage-3 step repeats with it at 0.82 of the throughput. An op with no deterministic "
        "form stops the stage with torch's error naming it."
    )
