"""Typed job configuration: OmegaConf structured dataclasses, YAML + dotted overrides, validation.

A job is a YAML file whose keys mirror `JobConfig`. `load_job(path, overrides)` merges the file and
`key=value` overrides onto the typed defaults and validates the result; every problem raises
`ConfigError` with one paragraph naming the key and what is allowed. Choice fields are string enums
(harness.config_choices), so OmegaConf refuses a value that is none of them when it merges. Nothing here
loads a model.

    fields      `described` fields, their `Rule`s (POSITIVE, FRACTION, each, at_least_zero), `check_fields`,
                ConfigError, the choice helpers (choice_of_field, bad_choice)
    models      teacher: and student: (TeacherConfig, StudentConfig; 'auto:K' attention layers)
    data        data: and instructions: (DataConfig, MixSourceConfig, InstructionsConfig)
    training    budget: and stages: (BudgetConfig, StageConfig, AlignConfig, DistillConfig, SftConfig, STAGES,
                POST_TRAINING)
    runtime     deepspeed: and run: (DeepSpeedConfig, RunConfig)
    evaluation  eval: (EvalConfig, NiahConfig, DuringConfig, the copy and state probes' CopyConfig, StateConfig,
                the instruction-following evaluation's IfevalConfig, the copy score on text's TextCopyConfig)
    job         JobConfig, the sections together
    planning    the token-to-step plan (plan_stages, plan_sft, requested_tokens, reads_instructions) and the stages
                a job's pipeline runs (pipeline_stages)
    validation  validate: the checks that tie fields together or need the data, the mixers or the file system
    loading     load_job (YAML + overrides), whole_numbers, field_help, to_yaml

Every name is importable from `harness.config` itself.
"""

from harness.config.data import DataConfig, InstructionsConfig, MixSourceConfig
from harness.config.evaluation import (DISTRACTORS, CopyConfig, CopyError, DuringConfig, EvalConfig, IfevalConfig,
                                       NiahConfig, StateConfig, TextCopyConfig, check_eval, default_copy_settings,
                                       default_positions, keys_under)
from harness.config.fields import (FRACTION, POSITIVE, ConfigError, Rule, at_least_zero, bad_choice, check_fields,
                                   choice_of_field, described, each, unwrap_optional, without_index)
from harness.config.job import JobConfig
from harness.config.loading import field_help, load_job, to_yaml, whole_numbers
from harness.config.models import (AUTO_LAYERS, RANK_MEASURES, StudentConfig, TeacherConfig, auto_layer_count,
                                   auto_layer_measure)
from harness.config.planning import (StagePlan, pipeline_stages, plan_sft, plan_stages, reads_instructions,
                                     requested_tokens)
from harness.config.runtime import DeepSpeedConfig, RunConfig
from harness.config.training import (ALIGN_LOSSES, DISTILL_LOSSES, PER_LAYER, POST_TRAINING, SPLIT, STAGES,
                                     AlignConfig, BudgetConfig, DistillConfig, LossTermConfig, SftConfig, StageConfig,
                                     StagesConfig)
from harness.config.validation import validate

__all__ = [
    "ALIGN_LOSSES", "AUTO_LAYERS", "DISTILL_LOSSES", "DISTRACTORS", "FRACTION", "PER_LAYER", "POSITIVE",
    "POST_TRAINING", "RANK_MEASURES", "SPLIT", "STAGES", "AlignConfig", "BudgetConfig", "ConfigError", "CopyConfig",
    "CopyError", "DataConfig", "DeepSpeedConfig", "DistillConfig", "DuringConfig", "EvalConfig", "IfevalConfig",
    "InstructionsConfig", "JobConfig", "LossTermConfig", "MixSourceConfig", "NiahConfig", "Rule", "RunConfig",
    "SftConfig", "StageConfig", "StagePlan", "StagesConfig", "StateConfig", "StudentConfig", "TeacherConfig",
    "TextCopyConfig",
    "at_least_zero", "auto_layer_count", "auto_layer_measure", "bad_choice", "check_eval", "check_fields",
    "choice_of_field", "default_copy_settings", "default_positions", "described", "each", "field_help",
    "keys_under", "load_job", "pipeline_stages", "plan_sft", "plan_stages", "reads_instructions",
    "requested_tokens", "to_yaml", "unwrap_optional", "validate", "whole_numbers", "without_index",
]
