"""scripts/device/bench51_alternate.sh rehearsed on the CPU (its header's rehearsal: no bundle, the tiny shape), with
a copy of this checkout's own harness standing in for the code before the loop: each process runs the real
`harness bench` step from the folder its ORDER entry names, and the summary says which code each one imported."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_alternating_bench_runs_each_code_in_order_and_summarises_it(tmp_path):
    before = tmp_path / "before"
    shutil.copytree(ROOT / "harness", before / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "ds_configs", before / "ds_configs")
    env = {**os.environ, "DEVBUNDLE": "", "PY": sys.executable, "STEPS": "1", "WARMUP": "0", "MICRO": "2",
           "SHAPE": "--shape tiny --device cpu --seq 64", "ORDER": "before loop", "BEFORE": str(before),
           "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", "scripts/device/bench51_alternate.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (tmp_path / "out/summary.txt").read_text()
    assert "order: before loop" in summary, summary
    for tag in ("01-before", "02-loop"):
        assert f"{tag} exit 0" in summary and "tokens/s" in summary.split(tag)[1].splitlines()[0], summary
    assert f"before imports {before / 'harness'}\n" in summary, summary  # each code from its own folder
    assert f"loop imports {ROOT / 'harness'}\n" in summary, summary
    steps = [json.loads((tmp_path / f"out/{tag}.json").read_text())["step"][0] for tag in ("01-before", "02-loop")]
    assert steps[0]["losses_each"] == steps[1]["losses_each"]  # the same code on the CPU: the same losses


def test_an_unknown_order_entry_is_refused_by_name_before_anything_runs(tmp_path):
    env = {**os.environ, "DEVBUNDLE": "", "PY": sys.executable, "ORDER": "before later", "BEFORE": str(tmp_path / "nowhere"),
           "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", "scripts/device/bench51_alternate.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "ORDER has later: allowed are warm, before, loop" in done.stdout, done.stdout
