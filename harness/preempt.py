"""Preemption: a stage checkpoints and exits with REQUEUE_EXIT when asked, and its Slurm job requeues itself.

Slurm sends the batch script SIGUSR1 some time before the job's limit (`--signal=B:USR1@N`); the script
touches $HARNESS_PREEMPT_FILE, which every training loop checks once per optimizer step (a file, not a signal,
because torchrun and srun do not forward SIGUSR1 to the workers). A USR1 that reaches the Python process
directly does the same. The loop then writes a checkpoint and exits with REQUEUE_EXIT; the batch script sees
that code and runs `scontrol requeue`, and the requeued job resumes from the checkpoint.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

REQUEUE_EXIT = 85
# Set by `harness run` for each process it starts: the file a process touches when it stops on a preemption request
# with its work saved. torchrun reports any worker's exit as its own exit 1, so the launcher cannot tell a clean
# stop (exit 85) from a failure during the stop (e.g. a checkpoint write that ran out of disk) by the code alone.
STOPPED_FILE_ENV = "HARNESS_STOPPED_FILE"
_signalled = False


def install_handler() -> None:
    """Treat a SIGUSR1 delivered to this process as a preemption request (main thread only)."""

    def handler(signum, frame):  # noqa: ARG001
        global _signalled
        _signalled = True

    try:
        signal.signal(signal.SIGUSR1, handler)
    except ValueError:  # not the main thread: the file still works
        pass


def requested() -> bool:
    """Whether this process should checkpoint and stop (local view; see `agreed`)."""
    path = os.environ.get("HARNESS_PREEMPT_FILE")
    return _signalled or bool(path and Path(path).exists())


def agreed() -> bool:
    """`requested()` on any rank, agreed by every rank (a collective under torch.distributed)."""
    import torch

    flag = requested()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        from harness.engine import all_reduce_host

        flag = bool(all_reduce_host(torch.tensor([int(flag)]), torch.distributed.ReduceOp.MAX).item())
    return flag


def mark_stopped() -> None:
    """Tell the launcher (through $HARNESS_STOPPED_FILE, when it set one) that this process stops on a preemption
    request with its work saved."""
    path = os.environ.get(STOPPED_FILE_ENV)
    if path:
        Path(path).touch()


class Preempted(SystemExit):
    """Raised after the checkpoint is written: the process exits with REQUEUE_EXIT (and marks the stop as clean)."""

    def __init__(self) -> None:
        mark_stopped()
        super().__init__(REQUEUE_EXIT)


@contextmanager
def exit_when_requested(poll_seconds: float = 2.0) -> Iterator[threading.Thread]:
    """For work that saves as it goes (the evaluation job: one line per NIAH sample, one file per task): while
    the block runs, a daemon thread exits the process with REQUEUE_EXIT as soon as preemption is requested. Only
    the item in flight is lost; the requeued job resumes after the last saved one. The watch ends with the block,
    so a command run inside a longer-lived process (`harness.cli.main([...])` from Python, a test) leaves no
    thread behind that could end that process later."""
    install_handler()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if requested():
                print("[harness] preemption requested: exiting for requeue; finished results are saved", flush=True)
                mark_stopped()
                os._exit(REQUEUE_EXIT)
            done.wait(poll_seconds)

    thread = threading.Thread(target=watch, name="preempt-watch", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        done.set()
        thread.join()
