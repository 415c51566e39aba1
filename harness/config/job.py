"""The whole job: `JobConfig`, one field per section of a job file."""

from __future__ import annotations

from dataclasses import dataclass

from harness.config.data import DataConfig, InstructionsConfig
from harness.config.evaluation import EvalConfig
from harness.config.fields import described
from harness.config.models import StudentConfig, TeacherConfig
from harness.config.runtime import DeepSpeedConfig, RunConfig
from harness.config.training import BudgetConfig, StagesConfig


@dataclass
class JobConfig:
    name: str = described("job", "Run name, used in output paths and logs.")
    output_dir: str = described("runs/${name}", "Directory for checkpoints, logs and the exported student.")
    seed: int = described(0, "Seed for initialisation and data order.")
    teacher: TeacherConfig = described(help="The teacher model.", factory=TeacherConfig)
    student: StudentConfig = described(help="The student's token mixer.", factory=StudentConfig)
    data: DataConfig = described(help="Training and validation text.", factory=DataConfig)
    instructions: InstructionsConfig = described(
        help="Chat-formatted instruction data for SFT and instruction-aware distillation.", factory=InstructionsConfig
    )
    budget: BudgetConfig = described(help="Token budget and its split over the stages.", factory=BudgetConfig)
    stages: StagesConfig = described(help="Per-stage optimisation settings.", factory=StagesConfig)
    deepspeed: DeepSpeedConfig = described(help="DeepSpeed configuration files.", factory=DeepSpeedConfig)
    run: RunConfig = described(help="Processes, devices, checkpoints and logging of a run.", factory=RunConfig)
    eval: EvalConfig = described(help="What the evaluation job does with the final student.", factory=EvalConfig)
