"""Named points where a fault-injection test makes a process fail or wait; inert unless $HARNESS_FAILPOINTS is set.

The fault suite (tests/test_faults.py) must hit a process at exact moments (a merge between writing its folder
and renaming it, a checkpoint while it is written) that are too short to reach by polling from outside. The code
marks such moments with `failpoint(NAME)`; the environment of a process under test arms some of them:

    HARNESS_FAILPOINTS="merge.saved=pause"           touch $HARNESS_FAILPOINTS_DIR/NAME, then wait (at most
                                                     PAUSE_S) for the test to signal or kill the process, or to
                                                     touch NAME.continue there (the process goes on)
    HARNESS_FAILPOINTS="checkpoint.write=enospc@3"   raise OSError(ENOSPC) the 3rd time the point is reached
                                                     (without @N: every time)

Several points are separated by commas. With HARNESS_FAILPOINTS_ONLY="stage sft" they are armed only in a process
whose command line holds those words (the variables reach every process `harness run` starts; this picks one stage
of them). A pause writes the paused process's pid into its NAME file (the test that kills it reads it there).
Nothing else reads the variables; unset, a failpoint costs a dict lookup.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path
from typing import Optional

ENV, DIR_ENV, ONLY_ENV = "HARNESS_FAILPOINTS", "HARNESS_FAILPOINTS_DIR", "HARNESS_FAILPOINTS_ONLY"
PAUSE_S = 120.0
_hits: dict[str, int] = {}


def armed() -> dict[str, str]:
    """{point: action} from $HARNESS_FAILPOINTS; none in a process whose command line lacks $HARNESS_FAILPOINTS_ONLY."""
    only = os.environ.get(ONLY_ENV)
    if only and only not in " ".join(sys.argv[1:]):
        return {}
    spec = os.environ.get(ENV, "")
    return dict(item.strip().split("=", 1) for item in spec.split(",") if "=" in item)


def failpoint(name: str) -> None:
    """Fail or wait here when $HARNESS_FAILPOINTS arms `name` (module docstring); otherwise do nothing."""
    if ENV not in os.environ:
        return
    action = armed().get(name)
    if action is None:
        return
    _hits[name] = _hits.get(name, 0) + 1
    kind, _, nth = action.partition("@")
    if nth and int(nth) != _hits[name]:
        return
    if kind == "pause":
        _pause(name)
    elif kind == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (failpoint {name})")
    else:
        raise ValueError(f"{ENV}: unknown action '{action}' for {name} (pause, enospc, enospc@N)")


def _pause(name: str) -> None:
    """Announce the pause (a file named after the point, holding this process's pid) and sleep until a signal ends the process, a preemption
    request arrives (which the process then honours where it would have) or the test lets it go on (NAME.continue);
    at most PAUSE_S."""
    from harness import preempt

    folder: Optional[str] = os.environ.get(DIR_ENV)
    if folder:  # written whole before it appears: a test that sees the file reads the pid
        Path(folder, f".{name}.tmp").write_text(str(os.getpid()))
        os.replace(Path(folder, f".{name}.tmp"), Path(folder, name))
    deadline = time.monotonic() + PAUSE_S
    go = Path(folder, f"{name}.continue") if folder else None
    while time.monotonic() < deadline and not preempt.pending() and not (go and go.exists()):
        time.sleep(0.05)
