"""The `harness` command. Every subcommand takes a job YAML and dotted overrides (key=value)."""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Optional

from harness.config import ConfigError

DESCRIPTION = """\
Linearize a pretrained Transformer: replace every attention block of a teacher with a linear-time
mixer (linear_attn, retnet, gla, deltanet, gated_deltanet, kda, mlstm) and train the student by
per-layer alignment and distillation.

A job is a YAML file (see jobs/); any field can be overridden on the command line with a dotted
key=value, e.g.

  harness info jobs/quickstart.yaml student.mixer=gla stages.distill.lr=3e-4
"""


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    try:
        return args.handler(args) or 0
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harness", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    info = sub.add_parser(
        "info",
        help="Show a job's resolved config, parameter counts and per-stage token-to-step plan.",
        description="Resolve a job (YAML + overrides), validate it without loading any weights, and print the "
        "config, the teacher's and student's parameter counts and how each stage's tokens become steps.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  harness info jobs/quickstart.yaml student.mixer=kda\n"
        "  harness info jobs/quickstart.yaml --explain     # every field with its description",
    )
    _add_job_args(info)
    info.add_argument("--explain", action="store_true", help="List every config field with its description.")
    info.set_defaults(handler=cmd_info)

    mixers = sub.add_parser("mixers", help="List the seven mixers and their options.",
                            description="List the mixers and each one's options with defaults and descriptions.")
    mixers.set_defaults(handler=cmd_mixers)
    return parser


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="Job YAML file, e.g. jobs/quickstart.yaml.")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="Dotted overrides, e.g. student.mixer=gla.")


def cmd_info(args: argparse.Namespace) -> int:
    from harness.config import load_job, plan_stages, to_yaml

    job = load_job(args.job, args.overrides)
    print(to_yaml(job).rstrip())
    if args.explain:
        print("\n# fields")
        for key, help_text in _walk_help():
            print(f"  {key}: {help_text}")
    teacher_n, student_n = parameter_counts(job)
    print("\n# parameters")
    print(f"  teacher: {teacher_n:,}")
    print(f"  student ({job.student.mixer}): {student_n:,}")
    print("\n# stage plan (tokens per step = world_size x micro_batch_size x grad_accum x seq_len)")
    print(f"  {'stage':<14}{'tokens':>16}{'tokens/step':>14}{'steps':>10}{'warmup':>8}")
    for p in plan_stages(job):
        print(f"  {p.stage:<14}{p.tokens:>16,}{p.tokens_per_step:>14,}{p.steps:>10,}{p.warmup_steps:>8,}")
    return 0


def cmd_mixers(args: argparse.Namespace) -> int:
    from harness.mixers import MIXERS, describe_options

    for name, cls in MIXERS.items():
        doc = (sys.modules[cls.__module__].__doc__ or "").strip().split("\n\n")[0]
        print(f"{name}\n" + textwrap.indent(textwrap.fill(" ".join(doc.split()), 96), "    "))
        for opt, default, help_text in describe_options(name):
            print(f"      {opt} = {default!r}: {help_text}")
    return 0


def _walk_help(prefix: str = "", node=None):
    from dataclasses import fields, is_dataclass

    from harness.config import JobConfig

    node = node if node is not None else JobConfig()
    for f in fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        yield key, f.metadata.get("help", "")
        if is_dataclass(value):
            yield from _walk_help(key + ".", value)


def parameter_counts(job) -> tuple[int, int]:
    """Teacher and student parameter counts from the teacher's config alone (models built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness.student import HarnessForCausalLM, count_parameters, student_config
    from harness.teacher import teacher_config

    cfg = teacher_config(job.teacher.source)
    if job.teacher.num_layers:
        cfg.num_hidden_layers = min(job.teacher.num_layers, cfg.num_hidden_layers)
    with torch.device("meta"):
        teacher = AutoModelForCausalLM.from_config(cfg)
        student = HarnessForCausalLM(student_config(cfg, job.student.mixer, job.student.options))
    return count_parameters(teacher), count_parameters(student)


if __name__ == "__main__":
    sys.exit(main())
