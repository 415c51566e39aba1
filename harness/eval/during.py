"""Evaluations along stage 3: snapshots every `eval.every_tokens`, evaluated beside training, into a history.

With eval.during.at_start, a fresh stage 3 (rank 0) first marks RUN_DIR/merged, the student before any stage-3
step, at 0 tokens (the mark says keep: the evaluator never deletes it). Then, when its token count crosses a multiple
N of eval.every_tokens (and at its end):
    1. exports the checkpoint it just wrote into a Hugging Face snapshot, RUN_DIR/eval/snapshots/tokens-N
       (a copy, so that checkpoint pruning cannot take it away);
    2. marks it: RUN_DIR/eval/pending/tokens-N.json (harness.eval.history.mark_for_evaluation);
    3. starts the evaluator (`launch_evaluator`) without waiting: `harness eval marks RUN_DIR` as a Slurm job
       (same partition and account, one GPU if stage 3 has GPUs) when stage 3 runs under Slurm, else as a
       background process on the CPU, or on GPU $HARNESS_EVAL_GPU when set (training holds the others).
The evaluator (`evaluate_pending`) takes a lock, evaluates every pending mark with the small grid of
RUN_DIR/eval-during.yaml (each task's own, harness.eval.tasks: EvalTask.for_during; results in
RUN_DIR/eval/during/tokens-N/), appends the report to RUN_DIR/eval/history.jsonl, clears the mark and (unless
eval.during.keep_snapshots) deletes the snapshot.
A crash anywhere leaves the mark, so the next evaluator picks it up; a resumed stage 3 does not mark a count
twice (`history.handled_tokens`). `harness report` draws the history against tokens (harness.eval.curves).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from harness import preempt
from harness.eval import history
from harness.eval.spec import EvalSpec, load_eval_spec

DURING_SPEC = "eval-during.yaml"
LOCK_FILE = "evaluator.lock"


def snapshot_dir(run_dir: Path, tokens: int) -> Path:
    return history.eval_dir(run_dir) / "snapshots" / f"tokens-{tokens:012d}"


def write_during_spec(job, run_dir: Path) -> Path:
    """RUN_DIR/eval-during.yaml: the job's evaluation spec set to each task's small grid of eval.during
    (EvalTask.for_during: fewer benchmarks and examples, NIAH lengths and samples, perplexity tokens; no chat samples,
    nor by default any other task); its checkpoint is filled in per snapshot."""
    from omegaconf import OmegaConf

    from harness.eval.spec import spec_from_job
    from harness.eval.tasks import tasks

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    job_yaml = run_dir / "job.yaml"
    job_yaml.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    spec = spec_from_job(job, run_dir / "merged", job_yaml)
    for task in tasks():
        task.for_during(spec, job.eval.during)
    spec.output_dir = str((history.eval_dir(run_dir) / history.RESULTS_DIR).resolve())
    spec.teacher_cache = str((history.eval_dir(run_dir) / history.RESULTS_DIR / "teacher").resolve())
    path = run_dir / DURING_SPEC
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(spec)))
    return path


def snapshot_and_mark(run_dir: Path, tokens: int, step: int, checkpoint: Path, *, params: Optional[int]) -> Path:
    """Export `checkpoint` as the snapshot for `tokens` and mark it for evaluation (rank 0 only)."""
    from harness.export import export_checkpoint

    dest = snapshot_dir(run_dir, tokens)
    if not (dest / "config.json").is_file():
        export_checkpoint(checkpoint, dest, merged=Path(run_dir) / "merged", force=True)
    return history.mark_for_evaluation(run_dir, tokens, step, dest, params=params)


def launch_evaluator(run_dir: Path) -> str:
    """Start `harness eval marks RUN_DIR` without waiting: a Slurm job under Slurm, else a background process."""
    run_dir = Path(run_dir).resolve()
    log = run_dir / "logs" / "eval-during.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "harness.cli", "eval", "marks", str(run_dir)]
    if os.environ.get("SLURM_JOB_ID") and shutil.which("sbatch"):
        import torch

        options = [f"--job-name=eval-marks-{run_dir.name}", "--nodes=1", "--ntasks=1", f"--output={log}",
                   "--open-mode=append", f"--wrap={' '.join(command)}"]
        options += [f"--partition={os.environ['SLURM_JOB_PARTITION']}"] if os.environ.get("SLURM_JOB_PARTITION") else []
        options += [f"--account={os.environ['SLURM_JOB_ACCOUNT']}"] if os.environ.get("SLURM_JOB_ACCOUNT") else []
        options += ["--gpus-per-node=1"] if torch.cuda.is_available() else []
        out = subprocess.run(["sbatch", "--parsable", *options], capture_output=True, text=True)
        if out.returncode == 0:
            return f"slurm job {out.stdout.strip()}"
    with open(log, "a") as handle:
        proc = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("HARNESS_EVAL_GPU", "")})
    return f"process {proc.pid}"


def evaluate_pending(run_dir: Path, *, wait: bool = False, progress: bool = True) -> list[int]:
    """Evaluate every pending mark (oldest first) under the run's evaluator lock; returns the token counts done.

    Without `wait`, another evaluator holding the lock makes this return at once: that one re-scans the marks
    after releasing its lock, so a mark written meanwhile is not orphaned.
    """
    run_dir = Path(run_dir)
    preempt.install_handler()  # SIGTERM / SIGUSR1: exit REQUEUE_EXIT at once; the mark in flight stays pending
    done: list[int] = []
    while history.pending_marks(run_dir):
        lock_path = history.eval_dir(run_dir) / LOCK_FILE
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                return done
            for mark in history.pending_marks(run_dir):
                evaluate_mark(run_dir, mark, progress=progress)
                done.append(mark["tokens"])
    return done


def evaluate_mark(run_dir: Path, mark: dict, *, progress: bool = True) -> dict:
    """One snapshot with the during-training spec: results, a history entry, the mark cleared."""
    from harness.eval.job import run_eval_spec

    tokens = int(mark["tokens"])
    spec: EvalSpec = load_eval_spec(Path(run_dir) / DURING_SPEC)
    spec.checkpoint = str(mark["checkpoint"])
    spec.output_dir = str(Path(spec.output_dir) / f"tokens-{tokens:012d}")
    report = run_eval_spec(spec, progress=progress)
    entry = history.make_entry(tokens, int(mark["step"]), mark["checkpoint"], report, params=mark.get("params"))
    history.append_entry(history.eval_dir(run_dir), entry)
    history.clear_mark(run_dir, tokens)
    if not mark.get("keep") and not spec_keeps_snapshots(run_dir):
        shutil.rmtree(mark["checkpoint"], ignore_errors=True)
    return entry


def spec_keeps_snapshots(run_dir: Path) -> bool:
    from omegaconf import OmegaConf

    job = OmegaConf.load(Path(run_dir) / "job.yaml")
    return bool(OmegaConf.select(job, "eval.during.keep_snapshots", default=False))


class DuringTraining:
    """Stage 3's side of it: which token counts are due, and marking them (rank 0) once the checkpoint exists."""

    def __init__(self, job, rank: int, params: Optional[int] = None) -> None:
        from harness.stages.common import run_dir

        self.every = job.eval.every_tokens if job.eval.enabled else 0
        self.at_start = bool(self.every and job.eval.during.at_start)
        self.run = run_dir(job)
        self.rank, self.params = rank, params
        self.done = history.handled_tokens(self.run) if self.every else set()
        if self.every and rank == 0:
            write_during_spec(job, self.run)

    def due(self, tokens_before: int, tokens_after: int) -> list[int]:
        if not self.every:
            return []
        return history.due_evaluations(tokens_before, tokens_after, self.every, self.done)

    def mark_start(self, tokens: int) -> None:
        """With eval.during.at_start, before a fresh stage 3's first step (tokens 0, not handled yet): mark the merged
        student, RUN_DIR/merged, for evaluation at 0 tokens (kept after it: stage 3 and the final evaluation read it)
        and start the evaluator."""
        if not self.at_start or tokens != 0 or 0 in self.done:
            return
        self.done.add(0)
        if self.rank != 0:
            return
        history.mark_for_evaluation(self.run, 0, 0, self.run / "merged", params=self.params, keep=True)
        where = launch_evaluator(self.run)
        print(f"[harness] evaluation of the merged student (0 stage-3 tokens) started ({where})", flush=True)

    def mark(self, counts: list[int], step: int, checkpoint: Path) -> None:
        """Snapshot the checkpoint for each count (normally one) and start the evaluator, without waiting."""
        self.done.update(counts)
        if self.rank != 0 or not counts:
            return
        for tokens in counts:
            snapshot_and_mark(self.run, tokens, step, checkpoint, params=self.params)
        where = launch_evaluator(self.run)
        print(f"[harness] evaluation of the snapshot at {counts[-1]:,} tokens started ({where})", flush=True)
