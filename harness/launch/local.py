"""`harness run`: every stage in order on this machine, as separate processes, skipping finished work.

Stages 1 and 2 run one process per layer group (run.layer_groups), run.parallel_groups at a time, each pinned
to one GPU when there are GPUs; then the merge; then stage 3 as deepspeed.world_size processes under torchrun or
the deepspeed launcher (run.launcher; gloo on CPU, nccl on GPUs); then, with eval.enabled, the evaluation job on
RUN_DIR/eval.yaml; then, with stages.sft.enabled, SFT as stage 3 runs (its processes, its launcher) and, with
eval.enabled, the evaluation of RUN_DIR/eval-sft.yaml, which ends with the distilled and the post-trained student side
by side (RUN_DIR/eval-sft/comparison/). Every stage resumes from its newest valid checkpoint, so re-running the same
command after a crash continues where it stopped. Each process's output goes to run_dir/logs/, and the wall time of
each part to run_dir/logs/timings.jsonl.

Supervision (`supervised`). A run holds RUN_DIR/.run.lock (flock, with its pid, host and start time) for its whole
life and shares it with the processes it starts, so a second `harness run` on the same directory is refused
(RunDirInUse, exit 2) until the first and all its stage processes are gone; the kernel drops the lock with its
last holder, so a lock file left by a killed run blocks nothing. Stage processes do not take the lock.
Each stage process is started in its own session (the launcher alone decides what reaches it) with
PR_SET_PDEATHSIG=SIGTERM (Linux): if `harness run` is killed, its children get the preemption request and stop
with their work saved. Signals to `harness run` (alone or with its process group):
  - SIGTERM or SIGUSR1, the first one: a preemption request. The run touches $HARNESS_PREEMPT_FILE (RUN_DIR's own
    .preempt-request when none is set), which every training loop polls once per optimizer step, and sends SIGTERM
    to its single-process children (the merge and the evaluation, which do not poll, stop at once; a stage still
    loading stops at once). A multi-process stage 3 gets the file only: torchrun would forward a SIGTERM and kill
    its workers after its 30-s shutdown timeout, the file has no limit. The run starts nothing new, waits for its
    children to stop and exits with REQUEUE_EXIT (85), saying that re-running resumes.
  - SIGINT, or any signal after the first: interrupted. Every child gets SIGTERM, STOP_GRACE_S to stop, then SIGKILL
    with every process below it (torchrun's workers); one more signal kills them at once. Exit 130.
Any other way out (a failing stage, an error in the launcher) stops the children the same way: none is left running.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

from harness.config import JobConfig
from harness.stages.common import PER_LAYER_STAGES, default_count, group_name, job_layer_groups, run_dir


class StageFailed(RuntimeError):
    """A stage process exited with an error; the message names its log."""


class StagePreempted(StageFailed):
    """A stage process checkpointed and exited on a preemption request ($HARNESS_PREEMPT_FILE, Slurm's USR1)."""


class RunDirInUse(RuntimeError):
    """Another `harness run` holds the run directory's lock; the message names its pid and host."""


class RunInterrupted(KeyboardInterrupt):
    """`harness run` got SIGINT, or a second stop signal: its children were stopped without waiting for them."""


RUN_LOCK = ".run.lock"
PREEMPT_FILE = ".preempt-request"  # RUN_DIR's own $HARNESS_PREEMPT_FILE, when the environment sets none
STOP_GRACE_S = 30  # after SIGTERM, how long an interrupted run waits for a child before SIGKILL
PR_SET_PDEATHSIG = 1


def stage_error(what: str, code: int, where: str, stopped: Path) -> StageFailed:
    """The error for a stage process that exited with `code`. Preempted: the requeue code, or a failure while a
    preemption is requested after the process marked its stop as clean (`stopped`, its $HARNESS_STOPPED_FILE:
    torchrun reports a worker's requeue exit as its own exit 1). A failure during the stop itself (a checkpoint
    write that ran out of disk) is a failure: the rerun would resume from an older checkpoint, or start over."""
    from harness import preempt

    if code == preempt.REQUEUE_EXIT or (code != 0 and preempt.requested() and stopped.exists()):
        return StagePreempted(f"{what} stopped on a preemption request with its work saved (a checkpoint); run the "
                              "same command again to resume")
    if code in (-signal.SIGTERM, -signal.SIGUSR1) and preempt.requested():  # the signal came before its handler
        return StagePreempted(f"{what} stopped on a preemption request while it was starting, before it had done "
                              "any work; run the same command again to resume")
    if preempt.requested():
        return StageFailed(f"{what} failed (exit {code}) while stopping on a preemption request, before it had "
                           f"written its checkpoint; a rerun resumes from its newest complete checkpoint; {where}")
    return StageFailed(f"{what} failed (exit {code}); {where}")


def stopped_marker(log: Path) -> Path:
    """The file a process started with this log touches when it stops cleanly on a preemption request."""
    return log.with_suffix(".stopped")


def with_stopped_marker(env: dict[str, str], marker: Path) -> dict[str, str]:
    from harness.preempt import STOPPED_FILE_ENV

    marker.unlink(missing_ok=True)
    return {**env, STOPPED_FILE_ENV: str(marker)}


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "harness.cli", *args]


def job_args(job_path: Optional[str], overrides: list[str]) -> list[str]:
    return ([job_path] if job_path else []) + list(overrides)


def run_pipeline(job: JobConfig, job_path: str, overrides: list[str]) -> Path:
    """Run stages 1-3 and their evaluation, then SFT and its evaluation with stages.sft.enabled (skipping complete
    ones) under the run lock; return the distilled student's directory."""
    out = run_dir(job)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    with supervised(out):
        return _run_stages(job, job_path, overrides)


def _run_stages(job: JobConfig, job_path: str, overrides: list[str]) -> Path:
    from harness.stage_settings import check_settings, pipeline_of

    out = run_dir(job)
    check_settings(job, pipeline_of(job))  # under the run lock: what RUN_DIR holds must be this job's work
    groups = job_layer_groups(job, default_count(job.run.layer_groups, 2))  # none holds a kept attention layer
    for stage in PER_LAYER_STAGES:
        with timed(job, stage, groups=len(groups), parallel=default_count(job.run.parallel_groups, 2),
                   gpus=len(_gpus())):
            run_groups(job, stage, groups, job_path, overrides)
    with timed(job, "merge"):
        run_merge(job, job_path, overrides)
    with timed(job, "distill", world=job.deepspeed.world_size):
        run_training(job, "distill", job_path, overrides)
    print(loss_summary(job), flush=True)
    if job.eval.enabled:
        with timed(job, "eval"):
            run_eval(job)
    if job.eval.enabled and job.eval.every_tokens:  # the evaluations along stage 3 that are still pending
        _run_logged(cli_command("eval", "marks", str(out), "--wait"), out / "logs" / "eval-during.log",
                    "evaluations along stage 3")
    if job.stages.sft.enabled:
        with timed(job, "sft", world=job.deepspeed.world_size):
            run_training(job, "sft", job_path, overrides)
        if job.eval.enabled:
            with timed(job, "eval-sft"):
                run_sft_eval(job)
    return out / "student"


@contextmanager
def timed(job: JobConfig, what: str, **facts):
    """Wall time of one part of `harness run`, printed and appended to RUN_DIR/logs/timings.jsonl (with `facts`:
    layer groups, GPUs, processes), so that runs on different machines can be compared (a part that was already
    complete and skipped is recorded too, with its few seconds). A part that stops early is recorded with its
    `outcome` (preempted / failed / interrupted), so that a part's wall time over several attempts is the sum of
    its lines."""
    start, outcome = time.time(), "done"
    try:
        yield
    except BaseException as err:
        outcome = ("preempted" if isinstance(err, StagePreempted) else
                   "interrupted" if isinstance(err, KeyboardInterrupt) else "failed")
        raise
    finally:
        seconds = time.time() - start
        print(f"[harness] {what}: {seconds:.1f} s wall" + ("" if outcome == "done" else f" ({outcome})"), flush=True)
        record = {"part": what, "seconds": round(seconds, 3), "outcome": outcome,
                  "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **facts}
        with open(run_dir(job) / "logs" / "timings.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def run_eval(job: JobConfig) -> None:
    """The evaluation job on the distilled student (logs/eval.log); skipped when its report is newer than the spec."""
    out = run_dir(job)
    refresh_eval_spec(job)
    evaluate("eval", out / "eval.yaml", [out / "eval" / "report.md"], out / "logs" / "eval.log")


def run_sft_eval(job: JobConfig) -> None:
    """The evaluation job on the post-trained student (logs/eval-sft.log), ending with its comparison with the
    distilled student's evaluation; skipped when its report and the comparison are newer than the spec."""
    from harness.eval.spec import COMPARISON_DIR, SFT_EVAL_DIR, SFT_EVAL_SPEC

    out = run_dir(job)
    refresh_eval_spec(job, sft=True)
    results = out / SFT_EVAL_DIR
    evaluate("eval-sft", out / SFT_EVAL_SPEC, [results / "report.md", results / COMPARISON_DIR / "comparison.md"],
             out / "logs" / "eval-sft.log")


def evaluate(what: str, spec: Path, results: list[Path], log: Path) -> None:
    """`harness eval job SPEC` as a logged process, unless every file of `results` is newer than the spec; then
    prints the first of them (the report)."""
    from harness.eval.spec import results_current

    if results_current(spec, results):
        print(f"[harness] {what}: already complete, report in {results[0]}", flush=True)
        return
    print(f"[harness] {what}: {spec} (progress in {log})", flush=True)
    _run_logged(cli_command("eval", "job", str(spec)), log, what)
    print(results[0].read_text(), flush=True)


def refresh_eval_spec(job: JobConfig, sft: bool = False) -> None:
    """Rewrite RUN_DIR/eval.yaml (and job.yaml), or with `sft` RUN_DIR/eval-sft.yaml (and job-sft.yaml), when the
    job's `eval:` section no longer gives the spec on disk: a rerun of a finished run with other evaluation settings
    then evaluates again (reusing the results that still apply) instead of reporting the old evaluation as done."""
    from omegaconf import OmegaConf

    from harness.eval.spec import (SFT_EVAL_SPEC, sft_spec_from_job, spec_from_job, write_eval_spec,
                                   write_sft_eval_spec)

    out = run_dir(job)
    name, student, job_yaml = ("eval-sft", "student-sft", "job-sft.yaml") if sft else ("eval", "student", "job.yaml")
    spec = out / (SFT_EVAL_SPEC if sft else "eval.yaml")
    wanted = (sft_spec_from_job if sft else spec_from_job)(job, out / student, out / job_yaml)
    if spec.is_file() and spec.read_text() != OmegaConf.to_yaml(OmegaConf.structured(wanted)):
        print(f"[harness] {name}: the job's eval settings differ from RUN_DIR/{spec.name}; rewriting it, so the "
              "evaluation runs again (finished results that still apply are reused)", flush=True)
        (write_sft_eval_spec if sft else write_eval_spec)(job, out / student)


def loss_summary(job: JobConfig) -> str:
    """First and last logged training loss of every stage (and group), from the metrics files."""
    from harness.observe import read_metrics

    lines = ["[harness] losses (first -> last logged):"]
    for metrics in sorted(run_dir(job).glob("*/*/metrics.jsonl")) + [run_dir(job) / "distill" / "metrics.jsonl"]:
        rows = read_metrics(metrics)
        losses = [r["loss"] for r in rows if isinstance(r.get("loss"), (int, float))]
        val = [r for r in rows if "val_ppl" in r]
        if losses:
            where = metrics.parent.relative_to(run_dir(job))
            extra = f", validation perplexity {val[-1]['val_ppl']:.2f}" if val else ""
            lines.append(f"  {str(where):<28} {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} log lines{extra}")
    return "\n".join(lines)


def run_groups(job: JobConfig, stage: str, groups: list[list[int]], job_path: str, overrides: list[str]) -> None:
    """One process per unfinished layer group, at most run.parallel_groups at a time."""
    from harness import preempt
    from harness.stages.align import group_complete

    todo = [g for g in groups if not group_complete(job, stage, g)]
    done = len(groups) - len(todo)
    print(f"[harness] {stage}: {len(groups)} layer groups, {done} already complete", flush=True)
    gpus = _gpus()
    slots = default_count(job.run.parallel_groups, 2)
    running: list[tuple[subprocess.Popen, list[int], Path, Optional[str]]] = []
    while todo or running:
        if not running:
            check_not_stopped(stage)
        free_gpus = [g for g in gpus if g not in {r[3] for r in running}]
        while todo and len(running) < slots and (not gpus or free_gpus) and not stop_requested():
            layers = todo.pop(0)
            gpu = free_gpus.pop(0) if gpus else None
            log = run_dir(job) / "logs" / f"{stage}-{group_name(layers)}.log"
            spec = f"{layers[0]}-{layers[-1]}"
            cmd = cli_command("stage", stage.replace("_", "-"), *job_args(job_path, overrides), "--layers", spec)
            running.append((_spawn(cmd, log, gpu), layers, log, gpu))
        time.sleep(0.5)
        for item in list(running):
            proc, layers, log, _ = item
            if proc.poll() is None:
                continue
            running.remove(item)
            if proc.returncode != 0:
                error = stage_error(f"{stage} layers {layers[0]}-{layers[-1]}", proc.returncode,
                                    f"see {log}:\n{_tail(log)}", stopped_marker(log))
                for other in running:  # on a stop request every group checkpoints on its own: let them finish
                    other[0].wait() if preempt.requested() else other[0].terminate()
                raise error
            print(f"[harness] {stage} layers {layers[0]}-{layers[-1]} done", flush=True)


def run_merge(job: JobConfig, job_path: str, overrides: list[str]) -> None:
    """The merge as its own process, unless its result is already there (a resumed run starts no process)."""
    from harness.stages.merge import MERGE_JSON, merged_dir, remove_leftovers

    remove_leftovers(job)  # temporary folders of a killed merge (this run holds the run lock: no merge of its own)
    if (merged_dir(job) / MERGE_JSON).is_file():
        print("[harness] merge: already complete", flush=True)
        return
    _run_logged(cli_command("stage", "merge", *job_args(job_path, overrides)), run_dir(job) / "logs" / "merge.log",
                "merge")


def run_training(job: JobConfig, stage: str, job_path: str, overrides: list[str]) -> None:
    """Stage 3 ('distill') or SFT ('sft') on deepspeed.world_size processes, unless its COMPLETE.json is there."""
    if (run_dir(job) / stage / "checkpoints" / "COMPLETE.json").exists():
        print(f"[harness] {stage}: already complete", flush=True)
        return
    world = job.deepspeed.world_size
    cmd = distill_command(job, job_args(job_path, overrides), stage)
    print(f"[harness] {stage} on {world} process(es): {' '.join(cmd)}", flush=True)
    marker = stopped_marker(run_dir(job) / "logs" / f"{stage}.log")
    env = with_stopped_marker(dict(os.environ), marker)
    if not _gpus():
        env["DS_ACCELERATOR"] = "cpu"
    check_not_stopped(stage)
    proc = start_child(cmd, env, polls_only=world > 1)  # the file, not a signal, for torchrun (module docstring)
    if proc.wait() != 0:
        raise stage_error(stage, proc.returncode, f"its output is above, metrics in {run_dir(job) / stage}", marker)


def distill_command(job: JobConfig, args: list[str], stage_name: str = "distill") -> list[str]:
    """Stage 3 (or SFT, `stage_name` 'sft') on this machine: one plain process, or deepspeed.world_size processes
    under run.launcher."""
    world = job.deepspeed.world_size
    stage = ["-m", "harness.cli", "stage", stage_name, *args]
    if world == 1:
        return [sys.executable, *stage]
    if job.run.launcher == "deepspeed":
        # the launcher has no standalone mode: a port free now (another job could take it before the rendezvous)
        return [sys.executable, "-m", "deepspeed.launcher.runner", _deepspeed_slots(world),
                f"--master_port={free_port()}", "--module", *stage[1:]]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", *stage]


def _deepspeed_slots(world: int) -> str:
    """The launcher's device selection. Given --num_gpus it drops CUDA_VISIBLE_DEVICES and takes GPUs 0 .. N-1, so
    under CUDA_VISIBLE_DEVICES the visible GPUs are named instead."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    gpus = _gpus() if visible else []
    return f"--include=localhost:{','.join(gpus[:world])}" if gpus else f"--num_gpus={world}"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpus() -> list[str]:
    """The GPUs this process may use, named as a child's CUDA_VISIBLE_DEVICES must name them: the entries of this
    process's own CUDA_VISIBLE_DEVICES when it has one (under CUDA_VISIBLE_DEVICES=1, a child pinned to "0" would
    land on physical GPU 0), else 0 .. count - 1."""
    import torch

    count = torch.cuda.device_count()
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return visible[:count] if visible else [str(i) for i in range(count)]


def _spawn(cmd: list[str], log: Path, gpu: Optional[str]) -> subprocess.Popen:
    env = with_stopped_marker(dict(os.environ), stopped_marker(log))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    with open(log, "a") as handle:
        handle.write(f"$ {' '.join(cmd)}\n")
        handle.flush()
        return start_child(cmd, env, stdout=handle)


def _run_logged(cmd: list[str], log: Path, what: str) -> None:
    check_not_stopped(what)
    proc = _spawn(cmd, log, None)
    if proc.wait() != 0:
        raise stage_error(what, proc.returncode, f"see {log}:\n{_tail(log)}", stopped_marker(log))
    print(f"[harness] {what} done", flush=True)


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ---- supervision: the run lock, the children, the signals (module docstring) ----

@dataclass
class _Child:
    proc: subprocess.Popen
    polls_only: bool  # asked to stop through $HARNESS_PREEMPT_FILE only (torchrun, the deepspeed launcher)


@dataclass
class _Supervisor:
    lock_fd: int
    children: list[_Child] = field(default_factory=list)
    stop: Optional[str] = None  # the signal that asked this run to stop for requeue
    stopping: bool = False  # the children are being stopped: a further signal kills them at once
    hurry: bool = False


_SUPERVISOR: Optional[_Supervisor] = None
_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@contextmanager
def supervised(out: Path) -> Iterator[_Supervisor]:
    """The block runs under the run lock, with this module's signal handlers and $HARNESS_PREEMPT_FILE set; on
    the way out no child is left running. A stop request turns the block's end into StagePreempted."""
    global _SUPERVISOR
    sup = _Supervisor(take_run_lock(out))
    preempt_env = os.environ.get("HARNESS_PREEMPT_FILE")
    if preempt_env is None:  # our own file: one left by an earlier stopped run must not stop this one
        (out / PREEMPT_FILE).unlink(missing_ok=True)
        os.environ["HARNESS_PREEMPT_FILE"] = str((out / PREEMPT_FILE).resolve())
    previous = {sig: signal.signal(sig, _on_signal) for sig in _SIGNALS}
    _SUPERVISOR = sup
    try:
        yield sup
    except StagePreempted as err:
        if sup.stop:
            raise StagePreempted(f"harness run stopped on a preemption request ({sup.stop}) and exits for requeue: "
                                 f"{err}") from None
        raise
    finally:
        stop_children(sup)
        _SUPERVISOR = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if preempt_env is None:
            os.environ.pop("HARNESS_PREEMPT_FILE", None)
            (out / PREEMPT_FILE).unlink(missing_ok=True)
        os.close(sup.lock_fd)


def take_run_lock(out: Path) -> int:
    """Hold RUN_DIR/.run.lock (its descriptor), or raise RunDirInUse naming the holder."""
    from harness.files import LockHeld, hold_lock

    note = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        return hold_lock(out / RUN_LOCK, json.dumps(note))
    except LockHeld as held:
        raise RunDirInUse(in_use_message(out, held.note)) from None


def in_use_message(out: Path, note: str) -> str:
    """Why a second run on `out` is refused, from the holder's note (JSON: pid, host, since)."""
    try:
        holder = json.loads(note)
        pid, host, since = int(holder["pid"]), str(holder["host"]), str(holder["since"])
    except (ValueError, KeyError, TypeError):
        return (f"{out} is in use by another harness run (its lock file {out / RUN_LOCK} does not say which); wait "
                "for it to end, or stop it with SIGTERM (it checkpoints and exits for requeue).")
    gone = host == socket.gethostname() and not Path(f"/proc/{pid}").exists() and sys.platform.startswith("linux")
    who = f"harness run (pid {pid} on host {host} since {since})"
    if gone:
        return (f"{out} is in use by the stage processes of {who}, which has exited: they hold the run's lock while "
                "they stop with their work saved. Wait a little and run again; two runs on one directory would do "
                "all the work twice and overwrite each other's files.")
    return (f"{out} is in use by {who}; wait for it or stop it (`kill -TERM {pid}` on {host} checkpoints its stages "
            "and exits for requeue; running the same command then resumes). Two runs on one directory would do all "
            "the work twice and overwrite each other's files.")


def stop_requested() -> bool:
    """Whether this `harness run` was asked to stop (its own signal handler)."""
    return bool(_SUPERVISOR and _SUPERVISOR.stop)


def check_not_stopped(what: str) -> None:
    """Raise StagePreempted instead of starting `what` after a stop request."""
    if stop_requested():
        raise StagePreempted(f"{what} was not started; every stage process that had started stopped with its work "
                             "saved; run the same command again to resume")


def start_child(cmd: list[str], env: dict[str, str], *, stdout=None, polls_only: bool = False) -> subprocess.Popen:
    """Start a stage process (module docstring: own session, death signal, the run lock shared) and register it, with
    the stop signals blocked meanwhile so that no child can escape registration."""
    sup = _SUPERVISOR
    if sup is None:  # not under `harness run` (a test, a notebook)
        return subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT if stdout else None, env=env)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT if stdout else None, env=env,
                                start_new_session=True, pass_fds=(sup.lock_fd,), preexec_fn=_child_setup(old_mask))
        sup.children.append(_Child(proc, polls_only))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    if sup.stop and not polls_only:  # the request came while it started
        _signal_group(proc.pid, signal.SIGTERM)
    return proc


def _child_setup(mask) -> Callable[[], None]:
    """What a child runs between fork and exec: the launcher's signal mask undone, and (Linux) SIGTERM when the
    launcher dies (the function is looked up here, in the parent)."""
    parent = os.getpid()
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl

    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
            if os.getppid() != parent:  # the launcher died before the death signal was set
                os.kill(os.getpid(), signal.SIGTERM)

    return setup


def _on_signal(signum, frame) -> None:  # noqa: ARG001
    """The launcher's handler (module docstring): a first SIGTERM / SIGUSR1 asks for a stop for requeue; SIGINT or
    a later signal interrupts; a signal while the children are being stopped kills them at once."""
    from harness import preempt

    sup, name = _SUPERVISOR, signal.Signals(signum).name
    if sup is None:
        return
    if sup.stopping:
        sup.hurry = True
        return
    if signum == signal.SIGINT or sup.stop:
        raise RunInterrupted(name)
    sup.stop = name
    preempt.request()
    try:
        Path(os.environ["HARNESS_PREEMPT_FILE"]).touch()
    except (KeyError, OSError):
        pass  # the children still get SIGTERM; torchrun's workers do not: see the message
    preempt.say(f"[harness] {name}: preemption requested; asking every stage process to checkpoint and stop, then "
                "exiting for requeue (a second signal or Ctrl-C stops them without waiting)")
    for child in sup.children:
        if not child.polls_only and child.proc.poll() is None:
            _signal_group(child.proc.pid, signal.SIGTERM)


def stop_children(sup: _Supervisor) -> None:
    """Stop every child still running: SIGTERM to each one's process group (a preemption request), STOP_GRACE_S (or
    until another signal), then SIGKILL to each and to every process below it."""
    from harness import preempt

    running = [c.proc for c in sup.children if c.proc.poll() is None]
    if not running:
        return
    sup.stopping = True
    preempt.say(f"[harness] stopping {len(running)} stage process(es): SIGTERM, then SIGKILL after {STOP_GRACE_S} s "
                "(signal again to kill them now)")
    tree = {pid: start for proc in running for pid, start in process_tree(proc.pid).items()}
    for proc in running:
        _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and not sup.hurry and any(p.poll() is None for p in running):
        time.sleep(0.1)
    for proc in running:
        tree.update(process_tree(proc.pid) if proc.poll() is None else {})
    for pid, start in tree.items():
        if process_start(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    for proc in running:
        proc.wait()


def _signal_group(pid: int, sig: int) -> None:
    """`sig` to the process group a child leads (its session: itself and what it started there)."""
    try:
        os.killpg(pid, sig)
    except OSError:  # gone already
        pass


def _proc_stat(pid: int) -> Optional[list[str]]:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def process_start(pid: int) -> Optional[int]:
    """A live process's start time (clock ticks since boot: tells a pid from its reuse), or None (Linux /proc)."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields and fields[0] != "Z" else None


def process_tree(root: int) -> dict[int, int]:
    """{pid: start time} of `root` and every live process below it (Linux /proc; {} elsewhere)."""
    below: dict[int, list[int]] = {}
    starts = {}
    for entry in Path("/proc").glob("[0-9]*") if Path("/proc").is_dir() else ():
        fields = _proc_stat(int(entry.name))
        if fields and fields[0] != "Z":
            below.setdefault(int(fields[1]), []).append(int(entry.name))
            starts[int(entry.name)] = int(fields[19])
    tree, frontier = {}, [root] if root in starts else []
    while frontier:
        pid = frontier.pop()
        tree[pid] = starts[pid]
        frontier += [child for child in below.get(pid, []) if child not in tree]
    return tree
