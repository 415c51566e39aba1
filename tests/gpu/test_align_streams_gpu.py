"""stages.align_mixer.streams on a GPU: stage 1's step with the layers on 4 CUDA streams computes what one stream
computes (benchmarks/align_streams.py's comparison, at a small shape: losses equal, gradients no further from one
stream's than a second one-stream step is). Skipped without CUDA.

    source .devbundle/setup.sh && python3 -m pytest -q tests/gpu/test_align_streams_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mixer", ["gated_deltanet", "gla"])
def test_layers_on_streams_compute_what_one_stream_computes(tmp_path, mixer):
    out = tmp_path / "a.json"
    done = subprocess.run([sys.executable, "benchmarks/align_streams.py", "--mixer", mixer, "--layers", "6",
                           "--batch", "2", "--seq", "512", "--counts", "1,1,4", "--steps", "2", "--warmup", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    serial, again, streamed = json.loads(out.read_text())["rows"]
    assert streamed["streams_used"] == 4
    assert streamed["largest_loss_difference"] <= again["largest_loss_difference"]
    assert streamed["largest_grad_difference"] <= again["largest_grad_difference"]
