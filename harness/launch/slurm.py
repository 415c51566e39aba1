"""`harness submit`: the pipeline as Slurm jobs with dependencies, rendered from the templates in slurm/.

    align_mixer   job array, one task per layer group
    align_hidden  job array, afterok on the whole align_mixer array
    merge         afterok on align_hidden
    distill       afterok on merge; --nodes N: srun starts one launcher per node (torchrun, or deepspeed with
                  --no_ssh and a hostfile of the allocation), or the deepspeed launcher on the first node reaches
                  every node over pdsh/ssh (--node-launch ssh); rendezvous on the first node
    eval          afterok on distill (with eval.enabled): `harness eval job RUN_DIR/eval.yaml` on one GPU
    sft           with stages.sft.enabled, afterok on eval (or distill): `harness stage sft`, launched as distill
    eval_sft      afterok on sft (with eval.enabled): `harness eval job RUN_DIR/eval-sft.yaml`, which ends with the
                  comparison of the distilled and the post-trained student (it reads eval's report)

Every job waits for the one before it, the order of `harness run`: SFT after the stage-3 evaluation, so that the
post-trained student's evaluation finds the distilled student's report to compare with.

`harness submit JOB --rank-layers` plans the layer ranking instead (`plan_ranking`): `rank`, a job array of
`harness transfer --rank-layers` (one task per layer group), and `rank_merge` after it; ids in rank-jobs.json.

Finished stages are left out (their COMPLETE markers), so re-submitting a run submits only what is left.
The job ids are recorded in RUN_DIR/slurm/jobs.json, the rendered scripts in RUN_DIR/slurm/*.sbatch.

Every value rendered into a script is quoted where it lands: `shlex.quote` in shell lines (paths, the job file,
overrides, the python path), Slurm's own quoting in `#SBATCH` lines (`sbatch_value`; a value there cannot hold
a newline), and the job name is checked against `NAME_PATTERN`, `--time` against Slurm's formats.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from string import Template
from typing import Optional, Sequence

from harness.config import ConfigError, JobConfig
from harness.stages.common import kept_attention_layers, layer_groups, num_student_layers, run_dir

TEMPLATES = Path(__file__).resolve().parents[2] / "slurm"

# Runs COMMAND in the background so that the batch shell can take Slurm's early USR1: it touches the preemption
# file the training loops watch (harness/preempt.py); a stage that checkpointed and exited with REQUEUE_EXIT
# is requeued and resumes from that checkpoint. torchrun reports a worker's exit code as its own failure, so a
# failure after the preemption request is requeued too; the stopped file (touched by a process that stopped
# cleanly) tells the log whether the checkpoint was written or the rerun resumes from an older one.
# {preempt_dir} is shell-quoted (shlex.quote) by whoever formats it.
REQUEUE_WRAPPER = """export HARNESS_PREEMPT_FILE={preempt_dir}/preempt-"$SLURM_JOB_ID"
export HARNESS_STOPPED_FILE={preempt_dir}/stopped-"$SLURM_JOB_ID"
rm -f "$HARNESS_PREEMPT_FILE" "$HARNESS_STOPPED_FILE"
trap 'touch "$HARNESS_PREEMPT_FILE"' USR1 TERM  # Slurm's warning signal, and the TERM of a time limit or preemption
{command} &
child=$!
while kill -0 "$child" 2>/dev/null; do wait "$child" || true; done
rc=0; wait "$child" || rc=$?
if [ "$rc" -eq {requeue_exit} ] || {{ [ "$rc" -ne 0 ] && [ -e "$HARNESS_PREEMPT_FILE" ]; }}; then
  if [ "$rc" -eq {requeue_exit} ] || [ -e "$HARNESS_STOPPED_FILE" ]; then
    echo "[harness] preempted: requeueing job $SLURM_JOB_ID"
  else
    echo "[harness] job $SLURM_JOB_ID failed (exit $rc) while stopping, before its checkpoint was complete" >&2
    echo "[harness] requeueing it anyway: it resumes from its newest complete checkpoint" >&2
  fi
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$rc"
"""


NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
NAME_CHARACTERS = "letters, digits and . _ - + (starting with a letter or digit)"
# Slurm's --time forms: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds, or no limit
TIME_PATTERN = re.compile(r"\d+(:\d+){0,2}|\d+-\d+(:\d+){0,2}|(?i:unlimited|infinite)")
TIME_FORMS = ("MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES, "
              "DAYS-HOURS:MINUTES:SECONDS, or UNLIMITED / INFINITE (e.g. 90, 2:00:00, 1-12:00:00)")
BARE = re.compile(r"[\w@%+=:,./-]+")  # characters that need no quoting, in a shell or an #SBATCH line
EXTRA_OPTION = re.compile(r"(-[A-Za-z]|--[A-Za-z][\w-]*)(?:([= ])(.+))?", re.DOTALL)


def check_name(name: str) -> str:
    """The job's `name` becomes the Slurm job names (NAME-align_mixer, ...): NAME_PATTERN only."""
    if not NAME_PATTERN.fullmatch(name):
        raise ConfigError(f"The job's name {name!r} cannot name Slurm jobs: `name` may hold only {NAME_CHARACTERS}. "
                          "Rename the job (name=... after the job file, or in the YAML) and submit again.")
    return name


def check_time(value: str) -> str:
    """--time in one of Slurm's forms (TIME_FORMS)."""
    if not TIME_PATTERN.fullmatch(value):
        raise ConfigError(f"--time {value!r} is not a Slurm time limit. Allowed forms: {TIME_FORMS}.")
    return value


def sbatch_value(value: str, what: str) -> str:
    """`value` as one argument of an #SBATCH line: bare when it is plain, else in double quotes with \\, " and #
    escaped (sbatch reads quotes and backslashes in #SBATCH lines, and an unescaped # starts a comment). A line
    break cannot be carried: refused, naming `what`."""
    if any(c in value for c in "\n\r\0"):
        raise ConfigError(f"{what} {value!r} holds a line break, which cannot go into an #SBATCH line; remove it.")
    if BARE.fullmatch(value):
        return value
    return '"' + re.sub(r'(["\\#])', r"\\\1", value) + '"'


def sbatch_path(path: Path, what: str) -> str:
    """A folder for an #SBATCH --output pattern: `%` doubled (Slurm reads %j, %a, ... in it), then `sbatch_value`.
    A backslash would switch Slurm's %-patterns off for the whole file name: refused."""
    if "\\" in str(path):
        raise ConfigError(f"{what} {str(path)!r} holds a backslash, which Slurm's log file patterns do not allow; "
                          "use a folder without one.")
    return sbatch_value(str(path).replace("%", "%%"), what)


def sbatch_option(option: str) -> str:
    """An --sbatch-option as an #SBATCH line's text: `--name=value`, `--name value`, `-x value` or a bare flag;
    the value quoted by `sbatch_value`."""
    found = EXTRA_OPTION.fullmatch(option)
    if not found:
        raise ConfigError(f"--sbatch-option {option!r} is not an sbatch option; write it as --name=value (e.g. "
                          "--sbatch-option=--qos=high) or as a flag (--sbatch-option=--exclusive).")
    name, sep, value = found.groups()
    return name if value is None else f"{name}{sep}{sbatch_value(value, '--sbatch-option')}"


@dataclass
class SlurmOptions:
    """What the cluster needs to know; every field maps to an sbatch option or the launch geometry. The values
    that go into #SBATCH lines are checked on construction (ConfigError)."""

    partition: Optional[str] = None
    account: Optional[str] = None
    time: Optional[str] = None
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 2
    mem: Optional[str] = None
    layers_per_task: int = 0  # 0: one array task per run.layer_groups group
    launcher: Optional[str] = None  # stage 3's launcher, torchrun or deepspeed; None: the job's run.launcher
    node_launch: str = "srun"  # how a deepspeed stage 3 reaches the nodes: srun (one launcher each) or ssh (pdsh)
    signal_seconds: int = 300  # USR1 this long before the time limit: checkpoint and requeue
    extra: list[str] = field(default_factory=list)  # further #SBATCH lines, e.g. "--qos=high"

    def __post_init__(self) -> None:
        if self.time:
            check_time(self.time)
        self.resources(0)  # refuses what cannot go into an #SBATCH line

    def resources(self, gpus: int) -> str:
        lines = [f"#SBATCH --{k}={sbatch_value(v, f'--{k}')}"
                 for k, v in (("partition", self.partition), ("account", self.account), ("time", self.time),
                              ("mem", self.mem)) if v]
        if gpus:
            lines.append(f"#SBATCH --gpus-per-node={gpus}")
        lines += [f"#SBATCH {sbatch_option(opt)}" for opt in self.extra]
        return "\n".join(lines)


@dataclass
class PlannedJob:
    stage: str
    script: str
    depends_on: Optional[str] = None  # the stage whose success this job waits for
    tasks: int = 1


def plan_jobs(job: JobConfig, job_path: str, overrides: list[str], opts: SlurmOptions,
              python: str = sys.executable, workdir: Optional[Path] = None) -> list[PlannedJob]:
    """The sbatch scripts of the stages still to run, in dependency order."""
    from harness.checkpoint import CheckpointManager
    from harness.eval.spec import SFT_EVAL_SPEC
    from harness.stages.align import group_complete

    if opts.nodes < 1 or opts.cpus_per_task < 1 or opts.gpus_per_node < 0 or opts.layers_per_task < 0:
        raise ConfigError("--nodes and --cpus-per-task must be >= 1, --gpus-per-node and --layers-per-task >= 0.")
    launcher = check_launch(opts, job)
    check_name(job.name)
    procs = opts.nodes * max(1, opts.gpus_per_node)
    if procs != job.deepspeed.world_size:
        raise ConfigError(
            f"Stage 3 would run {procs} processes (--nodes {opts.nodes} x {max(1, opts.gpus_per_node)} per node) "
            f"but deepspeed.world_size={job.deepspeed.world_size}; make them equal (the data slices follow it)."
        )
    out = run_dir(job)
    job_args = " ".join(shlex.quote(a) for a in ([str(Path(job_path).resolve())] if job_path else []) + overrides)
    py = shlex.quote(python)
    folder, where = (out / "slurm").resolve(), (workdir or Path.cwd()).resolve()
    if launcher == "deepspeed" and opts.node_launch == "ssh":
        check_pdsh_paths(python=python, workdir=where, run_dir=folder)
    common = dict(name=job.name, log_dir=sbatch_path((out / "logs").resolve(), "The run's log folder"),
                  cpus_per_task=opts.cpus_per_task, workdir=shlex.quote(str(where)),
                  signal_seconds=opts.signal_seconds)

    def launch(command: str) -> str:
        from harness.preempt import REQUEUE_EXIT

        return REQUEUE_WRAPPER.format(preempt_dir=shlex.quote(str(folder)), command=command,
                                      requeue_exit=REQUEUE_EXIT)

    groups = task_groups(job, opts)
    planned: list[PlannedJob] = []
    previous: Optional[str] = None
    for stage in ("align_mixer", "align_hidden"):
        todo = [g for g in groups if not group_complete(job, stage, g)]
        if todo:
            specs = " ".join(f"{g[0]}-{g[-1]}" for g in todo)
            command = f'{py} -m harness.cli stage {stage.replace("_", "-")} {job_args} --layers "$LAYERS"'
            script = _render("align.sbatch", stage=stage, groups=specs, last_task=len(todo) - 1,
                             resources=opts.resources(1 if opts.gpus_per_node else 0), launch=launch(command),
                             **common)
            planned.append(PlannedJob(stage, script, previous, len(todo)))
            previous = stage
    if previous is not None or not (out / "merged" / "MERGE.json").is_file():
        script = _render("merge.sbatch", resources=opts.resources(0),
                         launch=launch(f"{py} -m harness.cli stage merge {job_args}"), **common)
        planned.append(PlannedJob("merge", script, previous))
        previous = "merge"

    def training(stage: str, title: str) -> PlannedJob:  # stage 3 or SFT on --nodes nodes
        how, prepare, command = distill_launch(opts, launcher, py, f"-m harness.cli stage {stage} {job_args}", folder)
        script = _render("distill.sbatch", stage=stage, title=title, nodes=opts.nodes,
                         procs_per_node=max(1, opts.gpus_per_node), port=PORT, ports=PORTS, how=how, prepare=prepare,
                         resources=opts.resources(opts.gpus_per_node), launch=launch(command), **common)
        return PlannedJob(stage, script, previous)

    def evaluation(stage: str, spec: Path, about: str, then: str = "") -> PlannedJob:  # on one GPU
        command = f"{py} -m harness.cli eval job {shlex.quote(str(spec.resolve()))}{then}"
        script = _render("eval.sbatch", stage=stage, about=about, launch=launch(command),
                         resources=opts.resources(1 if opts.gpus_per_node else 0), **common)
        return PlannedJob(stage, script, previous)

    if not CheckpointManager(out / "distill" / "checkpoints").is_complete():
        planned.append(training("distill", "Stage 3"))
        previous = "distill"
    if job.eval.enabled and not _eval_complete(out):
        marks = f" && {py} -m harness.cli eval marks {shlex.quote(str(out.resolve()))} --wait"  # those still pending
        then = marks if job.eval.every_tokens else ""
        planned.append(evaluation("eval", out / "eval.yaml", EVAL_ABOUT, then))
        previous = "eval"
    if job.stages.sft.enabled and not CheckpointManager(out / "sft" / "checkpoints").is_complete():
        planned.append(training("sft", "SFT (post-training of RUN_DIR/student)"))
        previous = "sft"
    if job.stages.sft.enabled and job.eval.enabled and (previous == "sft" or not _sft_eval_complete(out)):
        planned.append(evaluation("eval_sft", out / SFT_EVAL_SPEC, SFT_EVAL_ABOUT))
    return planned


EVAL_ABOUT = """The evaluation job on the distilled student: RUN_DIR/eval.yaml, written by stage 3 (perplexity, NIAH,
# benchmarks for the student and its teacher, then RUN_DIR/eval/report.md)."""
SFT_EVAL_ABOUT = """The evaluation job on the post-trained student: RUN_DIR/eval-sft.yaml, written by SFT (the same
# tasks, the teacher's results shared; RUN_DIR/eval-sft/report.md), then the distilled and the post-trained
# student side by side with paired differences (RUN_DIR/eval-sft/comparison/comparison.md)."""


def task_groups(job: JobConfig, opts: SlurmOptions, every_layer: bool = False) -> list[list[int]]:
    """The layer groups of the array tasks: --layers-per-task layers each, else run.layer_groups groups; over the
    layers stages 1-2 train (the kept attention layers are no task's), or with `every_layer` over all of them (the
    ranking measures every layer)."""
    from harness.stages.common import default_count

    n_layers = num_student_layers(job)
    kept = () if every_layer else kept_attention_layers(job)
    trained = n_layers - len(kept)
    count = -(-trained // opts.layers_per_task) if opts.layers_per_task else default_count(job.run.layer_groups, 2)
    return layer_groups(n_layers, count, kept)


RANK_RECORD = "rank-jobs.json"  # the ranking's job ids, apart from the pipeline's jobs.json (and its --resume)


def plan_ranking(job: JobConfig, job_path: str, overrides: list[str], opts: SlurmOptions, measure: str = "stage1",
                 rank_args: Sequence[str] = (), python: str = sys.executable,
                 workdir: Optional[Path] = None) -> list[PlannedJob]:
    """`harness submit --rank-layers`: the layer ranking (harness/ranking.py) as a job array, one task per layer
    group, each writing its part, then a merge job after the whole array into RUN_DIR/ranking/layer_ranking.json.
    `rank_args`: further `harness transfer` options (e.g. --sequences 8). No preemption wrapper: a task holds no
    state worth a checkpoint, and a failed one is rerun as a whole."""
    from harness.ranking import check_measure

    check_measure(measure)
    check_name(job.name)
    if opts.cpus_per_task < 1 or opts.gpus_per_node < 0 or opts.layers_per_task < 0:
        raise ConfigError("--cpus-per-task must be >= 1, --gpus-per-node and --layers-per-task >= 0.")
    out = run_dir(job)
    job_args = " ".join(shlex.quote(a) for a in ([str(Path(job_path).resolve())] if job_path else []) + overrides)
    base = (f"{shlex.quote(python)} -m harness.cli transfer {job_args} --rank-layers --rank-by "
            f"{shlex.quote(measure)}" + "".join(f" {shlex.quote(a)}" for a in rank_args))
    common = dict(name=job.name, log_dir=sbatch_path((out / "logs").resolve(), "The run's log folder"),
                  cpus_per_task=opts.cpus_per_task, workdir=shlex.quote(str((workdir or Path.cwd()).resolve())),
                  measure=measure)
    groups = task_groups(job, opts, every_layer=True)
    rank = _render("rank.sbatch", groups=" ".join(f"{g[0]}-{g[-1]}" for g in groups), last_task=len(groups) - 1,
                   resources=opts.resources(1 if opts.gpus_per_node else 0), command=f'{base} --layers "$LAYERS"',
                   **common)
    merge = _render("rank-merge.sbatch", resources=opts.resources(0), command=f"{base} --merge", **common)
    return [PlannedJob("rank", rank, None, len(groups)), PlannedJob("rank_merge", merge, "rank")]


PORT = 29500  # stage 3's rendezvous port on the first node is PORT + SLURM_JOB_ID % PORTS (distill.sbatch), so that
PORTS = 2000  # jobs sharing a node (one GPU each on a shared node) do not collide; below the ephemeral ports (32768)
NODE_LAUNCHES = ("srun", "ssh")


def check_launch(opts: SlurmOptions, job: JobConfig) -> str:
    """Stage 3's launcher (the option, else run.launcher), checked against how it is to reach the nodes."""
    from harness.config_choices import Launcher

    launcher = opts.launcher or job.run.launcher
    if launcher not in Launcher.values():
        raise ConfigError(f"Bad launcher '{launcher}' for stage 3. Allowed: {', '.join(Launcher.values())}.")
    if opts.node_launch not in NODE_LAUNCHES:
        raise ConfigError(f"Bad --node-launch '{opts.node_launch}'. Allowed: {', '.join(NODE_LAUNCHES)}.")
    if opts.node_launch == "ssh" and launcher != "deepspeed":
        raise ConfigError("--node-launch ssh is the deepspeed launcher's pdsh mode; torchrun starts one agent per "
                          "node through srun. Use --launcher deepspeed, or --node-launch srun.")
    return launcher


# The deepspeed launcher's hostfile, one line per node of the allocation, written where every node can read it.
# In ssh mode the ranks get their environment only through DS_ENV_FILE (pdsh starts them outside this shell), one
# KEY=VALUE per line. {folder} is shell-quoted (shlex.quote).
HOSTFILE = """export HOSTFILE={folder}/hostfile-"$SLURM_JOB_ID"
scontrol show hostnames "$SLURM_JOB_NODELIST" | sed 's/$/ slots={slots}/' > "$HOSTFILE"
"""
ENV_FILE = """export DS_ENV_FILE={folder}/deepspeed-env-"$SLURM_JOB_ID"
printf '%s\\n' HARNESS_PREEMPT_FILE={folder}/preempt-"$SLURM_JOB_ID" \\
  HARNESS_STOPPED_FILE={folder}/stopped-"$SLURM_JOB_ID"{accelerator} > "$DS_ENV_FILE"
"""


def check_pdsh_paths(**paths) -> None:
    """--node-launch ssh: the deepspeed runner writes the python path, the working folder and the DS_ENV_FILE
    values into the command pdsh runs on each node, unquoted or in double quotes; a path there with a space, `$`,
    a quote or a backslash would break it or expand on the node. Those paths must be BARE."""
    for what, path in paths.items():
        if not BARE.fullmatch(str(path)):
            raise ConfigError(
                f"--node-launch ssh cannot carry the {what.replace('_', ' ')} {str(path)!r}: the deepspeed launcher "
                "puts it unquoted into the command pdsh runs on every node. Use --node-launch srun (the default), "
                "or a path of letters, digits and @%+=:,./-_ only.")


def distill_launch(opts: SlurmOptions, launcher: str, py: str, target: str, folder: Path) -> tuple[str, str, str]:
    """(what the script's comment says, lines before the wrapper, the command) of a stage 3 on opts.nodes nodes."""
    procs = max(1, opts.gpus_per_node)
    srun = "srun --kill-on-bad-exit=1"
    if launcher == "torchrun":
        command = (f"{srun} {py} -m torch.distributed.run --nnodes={opts.nodes} --nproc_per_node={procs} "
                   "--rdzv_backend=c10d --rdzv_endpoint=\"$MASTER_ADDR:$MASTER_PORT\" --rdzv_id=\"$SLURM_JOB_ID\" "
                   f"{target}")
        return "srun starts one torchrun per node", "", command
    folder = shlex.quote(str(folder.resolve()))
    hostfile = HOSTFILE.format(folder=folder, slots=procs)
    runner = (f"{py} -m deepspeed.launcher.runner --hostfile \"$HOSTFILE\" --master_addr=\"$MASTER_ADDR\" "
              "--master_port=\"$MASTER_PORT\"")
    module = target.replace("-m ", "--module ", 1)
    if opts.node_launch == "srun":
        # $SLURM_NODEID differs per node: expanded by each task's own shell, not by the batch shell
        inner = f'exec {runner} --no_ssh --node_rank="$SLURM_NODEID" {module}'
        return ("srun starts one deepspeed launcher per node (--no_ssh, its node rank from Slurm)", hostfile,
                f"{srun} bash -c {shlex.quote(inner)}")
    accelerator = "" if opts.gpus_per_node else " DS_ACCELERATOR=cpu"
    env = ENV_FILE.format(folder=folder, accelerator=accelerator)
    return ("the deepspeed launcher on this node starts every node's processes over pdsh/ssh", hostfile + env,
            f"{runner} {module}")


def _eval_complete(out: Path) -> bool:
    """The evaluation's report exists and is newer than the spec it was made from."""
    from harness.eval.spec import results_current

    return results_current(out / "eval.yaml", [out / "eval" / "report.json"])


def _sft_eval_complete(out: Path) -> bool:
    """The post-trained student's report and its comparison exist and are newer than its spec."""
    from harness.eval.spec import COMPARISON_DIR, SFT_EVAL_DIR, SFT_EVAL_SPEC, results_current

    results = out / SFT_EVAL_DIR
    return results_current(out / SFT_EVAL_SPEC, [results / "report.json", results / COMPARISON_DIR / "comparison.json"])


def _render(template: str, **values) -> str:
    return Template((TEMPLATES / template).read_text()).substitute(**values)


def dependency_graph(planned: list[PlannedJob]) -> str:
    lines = []
    for p in planned:
        tasks = f" (array of {p.tasks})" if p.tasks > 1 or p.stage.startswith("align") or p.stage == "rank" else ""
        after = f" after {p.depends_on} succeeds" if p.depends_on else " (no dependency)"
        lines.append(f"  {p.stage}{tasks}{after}")
    return "\n".join(lines) if lines else "  nothing left to run"


def saved_job_path(run: Path) -> Path:
    """The resolved job a submission ran with (what `harness submit --resume RUN_DIR` reads)."""
    return run / "slurm" / "job.yaml"


def clear_blocked(run: Path) -> list[str]:
    """Before a resume: cancel the recorded jobs still pending (behind a failure, or queued: they are submitted
    again); refuse while one is running (submitting again would run its stage twice)."""
    from harness.launch.status import slurm_states

    pending, running = [], []
    for stage, jobs in slurm_states(run).items():
        for job_id, state, _ in jobs:
            if state in ("PENDING", "REQUEUED"):
                pending.append(job_id)
            elif state in ("RUNNING", "CONFIGURING", "COMPLETING"):
                running.append(f"{stage} {job_id} {state}")
    if running:
        raise ConfigError(f"Jobs of this run are still running ({'; '.join(running)}): let them finish or scancel "
                          "them before `harness submit --resume`.")
    if pending:
        subprocess.run(["scancel", *pending], capture_output=True)
    return pending


SBATCH_HELP = ("Run `harness submit` where Slurm answers (a login node of the cluster: `sinfo` lists its "
               "partitions), or start a local Slurm (slurm/local/cluster.sh), or run the pipeline on this machine "
               "with `harness run JOB`, or print the scripts without submitting them with `harness submit ... "
               "--dry-run`.")


def find_sbatch(sbatch: str = "sbatch") -> str:
    """The path of the sbatch executable; a ConfigError saying what to do when PATH has none."""
    found = shutil.which(sbatch)
    if found is None:
        raise ConfigError(f"harness submit needs Slurm's `{sbatch}`, and there is none on PATH here, so nothing was "
                          f"submitted or written. {SBATCH_HELP}")
    return found


class _Undo:
    """What a submission writes, to take back when sbatch submits none of its jobs: folders it made removed, files
    it made deleted, files it overwrote restored (newest first)."""

    def __init__(self) -> None:
        self.steps: list = []

    def mkdir(self, path: Path) -> None:
        missing = [p for p in (path, *path.parents) if not p.exists()]
        path.mkdir(parents=True, exist_ok=True)
        if missing:
            self.steps.append(lambda top=missing[-1]: shutil.rmtree(top, ignore_errors=True))

    def write(self, path: Path, text: str) -> None:
        old = path.read_text() if path.is_file() else None
        path.write_text(text)
        self.steps.append((lambda: path.unlink(missing_ok=True)) if old is None else (lambda: path.write_text(old)))

    def undo(self) -> None:
        for step in reversed(self.steps):
            step()


def _sbatch(command: str, path: Path, p: PlannedJob, ids: dict[str, str]) -> str:
    """Submit one script (afterok on its predecessor); returns its job id, or raises ConfigError quoting sbatch."""
    cmd = [command, "--parsable"]
    if p.depends_on:
        cmd += [f"--dependency=afterok:{ids[p.depends_on]}", "--kill-on-invalid-dep=no"]
    try:
        result = subprocess.run(cmd + [str(path)], capture_output=True, text=True)
    except OSError as err:
        raise ConfigError(f"sbatch could not submit the {p.stage} job: {err}.") from None
    if result.returncode != 0:
        said = " ".join(result.stderr.split()).rstrip(".") or f"exit status {result.returncode}"
        raise ConfigError(f"sbatch could not submit the {p.stage} job: {said}.")
    return result.stdout.strip().split(";")[0]


def _refused(err: ConfigError, run: Path, ids: dict[str, str], record: Path) -> ConfigError:
    """The error of a failed sbatch, in one paragraph: what was submitted before it, and what to do."""
    if not ids:
        hint = (SBATCH_HELP if "controller" in str(err).lower() else
                "Fix what sbatch names (--partition, --account, --time, --mem and --sbatch-option go to it as given; "
                "`harness submit ... --dry-run` prints the scripts) and submit again.")
        return ConfigError(f"{err} Nothing was submitted, and nothing of this submission is left in {run}. {hint}")
    done = ", ".join(f"{stage} {job_id}" for stage, job_id in ids.items())
    resume = (f"`harness submit --resume {run}` submits what is left (cancelling those still pending first), or "
              if record.name == "jobs.json" else "")
    return ConfigError(f"{err} Submitted before it: {done} (recorded in {record}); the failed job and those after "
                       f"it are not submitted. Once sbatch works, {resume}`scancel {' '.join(ids.values())}` and "
                       "submit again.")


def submit(job: JobConfig, planned: list[PlannedJob], sbatch: str = "sbatch",
           record: str = "jobs.json") -> dict[str, str]:
    """sbatch each planned job with afterok on its predecessor; record and return stage -> job id. The pipeline's
    record (jobs.json) comes with the job it ran (RUN_DIR/slurm/job.yaml, what --resume reads), written once the
    first job is in; another `record` only with its ids. Without sbatch, or when sbatch submits nothing (no
    controller answers, a bad partition...), a ConfigError says what to do and nothing written here is left; when
    a later sbatch fails, the record holds the jobs already submitted."""
    command = find_sbatch(sbatch)
    run = run_dir(job)
    folder, written, ids = run / "slurm", _Undo(), {}
    try:
        written.mkdir(folder)
        written.mkdir(run / "logs")
        for p in planned:
            path = folder / f"{p.stage}.sbatch"
            written.write(path, p.script)
            ids[p.stage] = _sbatch(command, path, p, ids)
            if len(ids) == 1 and record == "jobs.json":
                _save_job(job, run)
    except ConfigError as err:
        if not ids:
            written.undo()
        else:
            _record(folder / record, ids, [p for p in planned if p.stage in ids])
        raise _refused(err, run, ids, folder / record) from None
    _record(folder / record, ids, planned)
    return ids


def _save_job(job: JobConfig, run: Path) -> None:
    from omegaconf import OmegaConf

    saved_job_path(run).write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))


def _record(path: Path, ids: dict[str, str], planned: list[PlannedJob]) -> None:
    """The submission's record: stage -> job id, and each planned job with its script's path."""
    saved = {"jobs": ids, "planned": [asdict(p) | {"script": str(path.parent / f"{p.stage}.sbatch")} for p in planned]}
    path.write_text(json.dumps(saved, indent=1))
