"""scripts/device/step_repeat.sh rehearsed on the CPU (its header's rehearsal: no bundle, the tiny shape): each process
runs the real `harness bench` step of the pure student or the hybrid (plain or under torch's deterministic
algorithms), and the summary says whether a kind's processes repeat bit for bit (the CPU does)."""

import hashlib
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


def test_the_default_order_repeats_the_hybrid_bit_for_bit_on_the_cpu_and_the_strict_kind_runs_it(tmp_path):
    done = _run(tmp_path, "pure hybrid hybrid strict compiled pieces norm")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (tmp_path / "out/summary.txt").read_text()
    assert "hybrid: --attention-layers 1 | order: pure hybrid hybrid strict compiled pieces norm" in summary, summary
    code = hashlib.sha256(b"".join(path.read_bytes() for path in sorted(
        (ROOT / "harness").rglob("*.py"), key=lambda path: str(path.relative_to(ROOT))))).hexdigest()[:12]
    assert f"| code: harness/ sha256 {code}, git HEAD " in summary, summary  # the code that ran, not the .git copy
    for tag in ("01-pure", "02-hybrid", "03-hybrid", "04-strict", "05-compiled", "06-pieces", "07-norm"):
        assert f"{tag} exit 0" in summary and "tokens/s" in summary.split(tag)[1].splitlines()[0], summary
    assert "hybrid: process 2 against process 1 over 2 steps: bit-identical at every step" in summary, summary
    assert "pure: 1 finished process(es), nothing to compare" in summary, summary
    pure, hybrid, strict, compiled, pieces, norm = (json.loads((tmp_path / f"out/{tag}.json").read_text())["step"][0]
                                                    for tag in ("01-pure", "02-hybrid", "04-strict", "05-compiled",
                                                                "06-pieces", "07-norm"))
    assert pure["attention_layers"] == [] and hybrid["attention_layers"] == strict["attention_layers"] == [1]
    assert pure["losses_each"] != hybrid["losses_each"]
    assert strict["losses_each"] == hybrid["losses_each"]  # the CPU's ops are deterministic with or without the flag
    # the compiled kind is the pure student with --compile-student, which the CPU runs eagerly (a GPU compiles)
    assert compiled["attention_layers"] == [] and compiled["student_compiled"] is False
    assert not pure["student_compiled"] and compiled["losses_each"] == pure["losses_each"]
    # the pieces kind passes the mixer option (the CPU's reference backend runs the PyTorch forms either way)
    assert pieces["options"]["pieces"] == "compiled" and "pieces" not in pure["options"]
    assert pure["options"]["fused_qkv"] is False  # the step as measured before fused_qkv became the default
    assert pieces["losses_each"] == pure["losses_each"]
    assert norm["options"]["pieces"] == "compiled-norm" and norm["losses_each"] == pure["losses_each"]
    # each kind against the first of its model's: the CPU runs the same forms, so no difference
    assert "pieces against pure: losses' largest relative difference over 2 steps 0.00e+00" in summary, summary
    assert "strict against hybrid: losses' largest relative difference over 2 steps 0.00e+00" in summary, summary
    assert "hybrid against pure" not in summary and "compiled against pure" in summary, summary


def test_an_unknown_kind_is_refused_by_name_before_anything_runs(tmp_path):
    done = _run(tmp_path, "pure window", timeout=60)
    allowed = "allowed are pure, default, hybrid, strict, compiled, pieces, norm, qkv, fast, hidden"
    assert done.returncode == 2 and f"ORDER has window: {allowed}" in done.stdout, done.stdout

