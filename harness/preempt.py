"""Preemption: a stage checkpoints and exits with REQUEUE_EXIT when asked, and its Slurm job requeues itself.

Slurm sends the batch script SIGUSR1 some time before the job's limit (`--signal=B:USR1@N`); the script
touches $HARNESS_PREEMPT_FILE, which every training loop checks once per optimizer step (a file, not a signal,
because torchrun and srun do not forward SIGUSR1 to the workers). A USR1 that reaches the Python process
directly does the same. The loop then writes a checkpoint and exits with REQUEUE_EXIT; the batch script sees
that code and runs `scontrol requeue`, and the requeued job resumes from the checkpoint.

SIGTERM (what `kill`, `timeout`, schedulers and `harness run` send) is the same request as SIGUSR1. When it arrives
decides what happens (`install_handler`):
  - before the process first polls for a request (`requested`, `agreed`: a training loop polls after each
    optimizer step; the merge and `harness eval marks` never poll), it exits at once with REQUEUE_EXIT: there is
    nothing to save beyond the checkpoint it resumed from, so loading a large teacher is not waited for. The exit
    is an exception (`Preempted`) raised where the process is, so temporary files and folders are removed
    (`harness.files.atomic_dir`, the merge's folder) and locks released;
  - after, it only sets the flag: the loop finishes the step, writes its checkpoint and exits with REQUEUE_EXIT.
A process of stage 3 under torchrun gets the SIGTERM that the agent forwards when it is signalled itself; the agent
then waits --shutdown-timeout (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default) for its workers and kills them:
the step in flight and the checkpoint must fit in that time, or the rerun resumes from the checkpoint before.
`harness run` asks its stage 3 through $HARNESS_PREEMPT_FILE instead, which has no such limit (launch/local.py).
"""

from __future__ import annotations

import os
import signal
import sys
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
_polled = False  # the process has polled for a request: a signal now only sets the flag
_raised = False  # a signal before the first poll has already raised Preempted
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)  # both are a preemption request


def _on_signal(signum, frame) -> None:  # noqa: ARG001
    """SIGUSR1 / SIGTERM: set the flag; before the first poll, also exit at once (module docstring)."""
    global _signalled, _raised
    _signalled = True
    if not _polled and not _raised:
        _raised = True
        say(f"[harness] {signal.Signals(signum).name}: preemption requested; exiting for requeue at once (nothing "
            "unsaved is lost: a rerun resumes from what this process resumed from or saved)")
        raise Preempted()


def say(line: str) -> None:
    """Write a line to stderr from a signal handler: straight to the descriptor, since the handler may run inside
    a buffered write of the main thread (a print there fails with 'reentrant call')."""
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode(errors="replace"))
    except (OSError, ValueError):
        pass


def install_handler() -> dict[int, object]:
    """Treat SIGUSR1 and SIGTERM delivered to this process as a preemption request (main thread only; elsewhere the
    file still works). Returns the handlers it replaced (`restore_handlers`). Called first thing by every stage
    process (before its teacher loads), so that a request while it loads is honoured too."""
    previous = {}
    for sig in SIGNALS:
        try:
            previous[sig] = signal.signal(sig, _on_signal)
        except ValueError:  # not the main thread
            pass
    return previous


def restore_handlers(previous: dict[int, object]) -> None:
    """Put back the handlers `install_handler` replaced (a command run inside a longer-lived process)."""
    for sig, handler in previous.items():
        if handler is not None:  # None: a handler not set from Python, which cannot be put back
            signal.signal(sig, handler)


@contextmanager
def handling() -> Iterator[None]:
    """`install_handler` for the block, the previous handlers after it."""
    previous = install_handler()
    try:
        yield
    finally:
        restore_handlers(previous)


def _requested_now() -> bool:
    path = os.environ.get("HARNESS_PREEMPT_FILE")
    return _signalled or bool(path and Path(path).exists())


def pending() -> bool:
    """Whether a request has arrived, without counting as a poll (`requested` does)."""
    return _requested_now()


def requested() -> bool:
    """Whether this process should checkpoint and stop (local view; see `agreed`). The first call marks the point
    from which a signal waits for the next poll instead of ending the process at once."""
    global _polled
    _polled = True
    return _requested_now()


def request() -> None:
    """Record a request made by other means than this module's handler (`harness run`'s own handler)."""
    global _signalled
    _signalled = True


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
    previous = install_handler()  # the watch does not poll through `requested`: a signal ends the process at once
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if _requested_now():
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
        restore_handlers(previous)
