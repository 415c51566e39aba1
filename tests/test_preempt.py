"""harness.preempt's watch for work that saves as it goes: inside the block a preemption request ends the process
with the requeue code; after the block nothing is left watching (a command run inside a test or a notebook must
not end that process later)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

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
