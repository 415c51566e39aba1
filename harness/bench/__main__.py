"""`python -m harness.bench ARGS` = `harness bench ARGS`."""

import sys

from harness.bench.cli import main

sys.exit(main())
