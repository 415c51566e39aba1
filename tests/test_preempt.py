"""harness.preempt's watch for work that saves as it goes: inside the block a preemption request ends the process
with the requeue code; after the block nothing is left watching (a command run inside a test or a notebook must
not end that process later). SIGTERM and SIGUSR1 are preemption requests: before a process first polls they end it
at once (requeue code), after it they wait for its next poll."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.preempt import REQUEUE_EXIT, exit_when_requested

REPO = Path(__file__).resolve().parents[1]


def test_a_request_inside_the_block_exits_with_the_requeue_code(tmp_path):
    flag = tmp_path / "stop"
    code = ("import time; from pathlib import Path; from harness.preempt import exit_when_requested\n"
            "with exit_when_requested(poll_seconds=0.05):\n"
            f"    Path({str(flag)!r}).touch(); time.sleep(30)\n"
            "print('not reached')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO), "HARNESS_PREEMPT_FILE": str(flag)})
    assert proc.returncode == REQUEUE_EXIT, proc.stderr
    assert "preemption requested" in proc.stdout and "not reached" not in proc.stdout


def test_nothing_watches_after_the_block(tmp_path, monkeypatch):
    flag = tmp_path / "stop"
    monkeypatch.setenv("HARNESS_PREEMPT_FILE", str(flag))
    with exit_when_requested(poll_seconds=0.05) as watcher:
        assert watcher.is_alive()
    assert not watcher.is_alive()
    flag.touch()
    time.sleep(0.3)  # a watcher left behind would have ended this process by now


# harness/preempt.py alone (standard library only): a subprocess that starts in well under a second
LOAD_PREEMPT = ("import importlib.util, sys, time\n"
                f"spec = importlib.util.spec_from_file_location('preempt', {str(REPO / 'harness' / 'preempt.py')!r})\n"
                "preempt = importlib.util.module_from_spec(spec); spec.loader.exec_module(preempt)\n")


def signalled(tmp_path: Path, body: str, sig: int) -> tuple[subprocess.CompletedProcess, float]:
    """Run `body` after loading preempt.py; once it touches READY, send it `sig`; (result, seconds to exit)."""
    import signal

    ready = tmp_path / "ready"
    env = {**os.environ, "HARNESS_STOPPED_FILE": str(tmp_path / "stopped")}
    env.pop("HARNESS_PREEMPT_FILE", None)
    code = LOAD_PREEMPT + f"READY = {str(ready)!r}\n" + body
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    deadline = time.time() + 60
    while not ready.exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.01)
    sent = time.time()
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.time() - sent


def test_sigterm_before_the_first_poll_exits_for_requeue_at_once(tmp_path):
    """A stage still loading (its teacher, its data) has nothing to save: it stops at once, marked as a clean stop."""
    import signal

    body = "preempt.install_handler()\nopen(READY, 'w').close()\ntime.sleep(60)\nprint('not reached')\n"
    result, seconds = signalled(tmp_path, body, signal.SIGTERM)
    assert result.returncode == REQUEUE_EXIT and seconds < 10, result.stderr
    assert "SIGTERM: preemption requested" in result.stderr and "not reached" not in result.stdout
    assert (tmp_path / "stopped").exists()


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_after_the_first_poll_a_signal_waits_for_the_next_poll(tmp_path, name):
    """A training loop that has polled finishes its step and checkpoints before it stops."""
    import signal

    body = ("preempt.install_handler()\nassert not preempt.requested()\nopen(READY, 'w').close()\n"
            "while not preempt.requested():\n    time.sleep(0.01)\nprint('checkpoint, then exit')\n")
    result, _ = signalled(tmp_path, body, getattr(signal, name))
    assert result.returncode == 0 and "checkpoint, then exit" in result.stdout, result.stderr


def test_the_watch_puts_the_signal_handlers_back(tmp_path, monkeypatch):
    import signal

    monkeypatch.delenv("HARNESS_PREEMPT_FILE", raising=False)
    originals = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR1)}

    def mine(signum, frame):  # noqa: ARG001  (not preempt's: an earlier in-process stage may have left that one)
        pass

    try:
        for sig in originals:
            signal.signal(sig, mine)
        with exit_when_requested(poll_seconds=0.05):
            assert all(signal.getsignal(sig) is not mine for sig in originals)
        assert all(signal.getsignal(sig) is mine for sig in originals)
    finally:
        for sig, handler in originals.items():
            signal.signal(sig, handler)
