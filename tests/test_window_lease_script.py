"""scripts/device/window_lease.sh rehearsed on the CPU (its header's rehearsal: no bundle, no GPU tests, the tiny
shape): each of its benches runs the real `harness bench` step with the mixer options it names, and the archive a
device call brings back holds every result."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_window_lease_benches_each_form_and_packs_them(tmp_path):
    env = {**os.environ, "DEVBUNDLE": "", "TESTS": "", "PY": sys.executable, "STEPS": "1", "WARMUP": "0",
           "SHAPE": "--shape tiny --device cpu --seq 64", "MICRO": "2", "MICRO32": "1",
           "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", "scripts/device/window_lease.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("plain-m2", "window16-kernel-m2", "window16-blockwise-m2", "window16-kernel-m32"):
        assert f"{name}: exit 0" in done.stdout, done.stdout
    with tarfile.open(tmp_path / "out/window-lease.tgz") as archive:
        archive.extractall(tmp_path / "back", filter="data")
    options = {path.stem: json.loads(path.read_text())["step"][0]["options"]
               for path in (tmp_path / "back/bench").glob("*.json")}
    assert options == {"plain-m2": {}, "window16-kernel-m2": {"window": 16},
                       "window16-blockwise-m2": {"window": 16, "window_backend": "blockwise"},
                       "window16-kernel-m32": {"window": 16}}
