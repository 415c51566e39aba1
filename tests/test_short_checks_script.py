"""scripts/device/short_checks.sh rehearsed on the CPU (SMALL=1, no bundle): the `align` part runs the stage-1
step benchmark and the `hidden` part the stage-3 step bench with and without the hidden-state term, each writing
what a device call brings back; an unknown part is refused by name."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, *parts: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEVBUNDLE": "", "SMALL": "1", "PY": sys.executable, "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", "scripts/device/short_checks.sh", *parts], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_align_and_hidden_parts_write_their_results(tmp_path):
    done = _run(tmp_path, "align", "hidden")
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    align = json.loads((out / "align_step.json").read_text())  # stage 1's step, phase by phase (one step)
    assert set(align["median_ms"]) == {"capture", "layers", "clip", "optimizer", "step"} and align["tokens_per_s"] > 0
    assert sum(v for k, v in align["median_ms"].items() if k != "step") == pytest.approx(align["median_ms"]["step"])
    # the hidden kind: the default student plus 0.1 x the term, on the same first batch; compared with no other kind
    default, hidden = (json.loads((out / f"step_{k}.json").read_text())["step"][0] for k in ("default", "hidden"))
    assert default["hidden_weight"] == 0.0 and hidden["hidden_weight"] == 0.1
    assert hidden["losses_each"][0] > default["losses_each"][0]
    summary = (out / "short_checks.txt").read_text()
    assert "align: " in summary and "hidden: " in summary and "code: harness/ sha256" in summary, summary
    assert "hidden against" not in (out / "step_hidden_summary.txt").read_text()


def test_an_unknown_part_is_refused_by_name(tmp_path):
    done = _run(tmp_path, "window")
    assert done.returncode == 2 and "unknown part window: allowed are align, hidden, quadratic" in done.stdout
