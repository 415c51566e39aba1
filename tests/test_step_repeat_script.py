"""scripts/device/step_repeat.sh rehearsed on the CPU (its header's rehearsal: no bundle, the tiny shape): each process
runs the real `harness bench` step of the pure student or the hybrid, and the summary says whether a kind's processes
repeat bit for bit (the CPU does) and where two kinds' losses part."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, order: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "DEVBUNDLE": "", "PY": sys.executable, "STEPS": "2", "WARMUP": "0", "MICRO": "2",
           "SHAPE": "--shape tiny --device cpu --seq 64 --option chunk_size=16", "LAYERS": "1", "ORDER": order,
           "OUT": str(tmp_path / "out")}
    return subprocess.run(["bash", "scripts/device/step_repeat.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_step_repeats_bit_for_bit_on_the_cpu_and_the_hybrid_is_its_own_step(tmp_path):
    done = _run(tmp_path, "hybrid pure hybrid strict")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (tmp_path / "out/summary.txt").read_text()
    assert "hybrid: --attention-layers 1 | order: hybrid pure hybrid" in summary, summary
    for tag in ("01-hybrid", "02-pure", "03-hybrid", "04-strict"):
        assert f"{tag} exit 0" in summary and "tokens/s" in summary.split(tag)[1].splitlines()[0], summary
    assert "hybrid: process 2 against process 1 over 2 steps: bit-identical at every step" in summary, summary
    assert "pure: 1 finished process(es), nothing to compare" in summary, summary
    strict = json.loads((tmp_path / "out/04-strict.json").read_text())["step"][0]
    assert strict["attention_layers"] == [1] and "error" not in strict  # the CPU step has deterministic ops only
    rows = [json.loads((tmp_path / f"out/{tag}.json").read_text())["step"][0] for tag in ("01-hybrid", "02-pure")]
    assert rows[0]["attention_layers"] == [1] and rows[1]["attention_layers"] == []
    assert rows[0]["losses_each"] != rows[1]["losses_each"]


def test_an_unknown_kind_is_refused_by_name_before_anything_runs(tmp_path):
    done = _run(tmp_path, "pure window", timeout=60)
    assert done.returncode == 2 and "ORDER has window: allowed are pure, hybrid, strict" in done.stdout, done.stdout
