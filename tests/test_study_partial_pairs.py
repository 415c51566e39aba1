"""scripts/study_partial_pairs.py on the study's committed partial mlstm run: its numbers against hand values."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "docs/results/study-small-50m/partial/smollm2-135m-mlstm-50m"


def test_partial_run_pairs_match_hand_values():
    out = subprocess.run([sys.executable, str(ROOT / "scripts/study_partial_pairs.py"), str(RUN),
                          "--runs", str(ROOT / "docs/results/study-small-50m/runs")],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    # piqa: (0.628 - 0.5) / (0.662 - 0.5) = 79.0%; arc_easy: (0.408 - 0.25033) / (0.472 - 0.25033) = 71.1%
    assert "piqa: score 0.628, teacher 0.662, chance 0.500, normalised recovery 79.0%" in out
    assert "arc_easy: score 0.408, teacher 0.472, chance 0.250, normalised recovery 71.1%" in out
    # NIAH likelihood overall: 20 of 72 prompts for mlstm (27.8%) against 35 of 72 (48.6%) for gated_deltanet
    block = out.split("# smollm2-135m-mlstm-50m - smollm2-135m-gated_deltanet-50m\n")[1].split("\n\n")[0]
    assert block.splitlines()[0].startswith("NIAH likelihood overall: 48.6 -> 27.8, -20.8 points [")
