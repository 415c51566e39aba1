"""`harness run`: every stage in order on this machine, as separate processes, skipping finished work.

Stages 1 and 2 run one process per layer group (run.layer_groups), run.parallel_groups at a time, each pinned
to one GPU when there are GPUs; then the merge; then stage 3 as deepspeed.world_size processes under torchrun or
the deepspeed launcher (run.launcher; gloo on CPU, nccl on GPUs); then, with eval.enabled, the evaluation job on RUN_DIR/eval.yaml. Every stage resumes from its newest valid checkpoint, so re-running the same
command after a crash continues where it stopped. Each process's output goes to run_dir/logs/, and the wall time of
each part to run_dir/logs/timings.jsonl.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from harness.config import JobConfig
from harness.stages.common import PER_LAYER_STAGES, default_count, group_name, job_layer_groups, run_dir


class StageFailed(RuntimeError):
    """A stage process exited with an error; the message names its log."""


class StagePreempted(StageFailed):
    """A stage process checkpointed and exited on a preemption request ($HARNESS_PREEMPT_FILE, Slurm's USR1)."""


def stage_error(what: str, code: int, where: str, stopped: Path) -> StageFailed:
    """The error for a stage process that exited with `code`. Preempted: the requeue code, or a failure while a
    preemption is requested after the process marked its stop as clean (`stopped`, its $HARNESS_STOPPED_FILE:
    torchrun reports a worker's requeue exit as its own exit 1). A failure during the stop itself (a checkpoint
    write that ran out of disk) is a failure: the rerun would resume from an older checkpoint, or start over."""
    from harness import preempt

    if code == preempt.REQUEUE_EXIT or (code != 0 and preempt.requested() and stopped.exists()):
        return StagePreempted(f"{what} stopped on a preemption request after writing a checkpoint; run the same "
                              "command again to resume")
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
    """Run stages 1-3 (skipping complete ones) and return the final student's directory."""
    out = run_dir(job)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    groups = job_layer_groups(job, default_count(job.run.layer_groups, 2))  # none holds a kept attention layer
    for stage in PER_LAYER_STAGES:
        with timed(job, stage, groups=len(groups), parallel=default_count(job.run.parallel_groups, 2),
                   gpus=len(_gpus())):
            run_groups(job, stage, groups, job_path, overrides)
    with timed(job, "merge"):
        run_merge(job, job_path, overrides)
    with timed(job, "distill", world=job.deepspeed.world_size):
        run_distill(job, job_path, overrides)
    print(loss_summary(job), flush=True)
    if job.eval.enabled:
        with timed(job, "eval"):
            run_eval(job)
    if job.eval.enabled and job.eval.every_tokens:  # the evaluations along stage 3 that are still pending
        _run_logged(cli_command("eval", "marks", str(out), "--wait"), out / "logs" / "eval-during.log",
                    "evaluations along stage 3")
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
    """The evaluation job on the final student (logs/eval.log); skipped when its report is newer than the spec."""
    out = run_dir(job)
    spec, report = out / "eval.yaml", out / "eval" / "report.md"
    if report.is_file() and report.stat().st_mtime >= spec.stat().st_mtime:
        print(f"[harness] eval: already complete, report in {report}", flush=True)
        return
    print(f"[harness] eval: {spec} (progress in {out / 'logs' / 'eval.log'})", flush=True)
    _run_logged(cli_command("eval", "job", str(spec)), out / "logs" / "eval.log", "eval")
    print(report.read_text(), flush=True)


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
        free_gpus = [g for g in gpus if g not in {r[3] for r in running}]
        while todo and len(running) < slots and (not gpus or free_gpus):
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
    from harness.stages.merge import MERGE_JSON, merged_dir

    if (merged_dir(job) / MERGE_JSON).is_file():
        print("[harness] merge: already complete", flush=True)
        return
    _run_logged(cli_command("stage", "merge", *job_args(job_path, overrides)), run_dir(job) / "logs" / "merge.log",
                "merge")


def run_distill(job: JobConfig, job_path: str, overrides: list[str]) -> None:
    if (run_dir(job) / "distill" / "checkpoints" / "COMPLETE.json").exists():
        print("[harness] distill: already complete", flush=True)
        return
    world = job.deepspeed.world_size
    cmd = distill_command(job, job_args(job_path, overrides))
    print(f"[harness] distill on {world} process(es): {' '.join(cmd)}", flush=True)
    marker = stopped_marker(run_dir(job) / "logs" / "distill.log")
    env = with_stopped_marker(dict(os.environ), marker)
    if not _gpus():
        env["DS_ACCELERATOR"] = "cpu"
    result = subprocess.run(cmd, env=env)
    if result.returncode != 0:
        raise stage_error("distill", result.returncode, f"its output is above, metrics in {run_dir(job) / 'distill'}",
                          marker)


def distill_command(job: JobConfig, args: list[str]) -> list[str]:
    """Stage 3 on this machine: one plain process, or deepspeed.world_size processes under run.launcher."""
    world = job.deepspeed.world_size
    stage = ["-m", "harness.cli", "stage", "distill", *args]
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
    handle = open(log, "a")
    handle.write(f"$ {' '.join(cmd)}\n")
    handle.flush()
    return subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env)


def _run_logged(cmd: list[str], log: Path, what: str) -> None:
    proc = _spawn(cmd, log, None)
    if proc.wait() != 0:
        raise stage_error(what, proc.returncode, f"see {log}:\n{_tail(log)}", stopped_marker(log))
    print(f"[harness] {what} done", flush=True)


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
