"""GPU tests print each failure's traceback the moment it happens (to stderr), not only in the end-of-session
summary: on a lent machine a run can be cut off at the device's time limit, and the summary never written."""

import sys


def pytest_runtest_logreport(report):
    if report.failed:
        sys.stderr.write(f"\n=== FAILED {report.nodeid} ({report.when}) ===\n{report.longreprtext}\n")
        sys.stderr.flush()
