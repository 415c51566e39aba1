"""The mixer contract's GPU property (harness.mixers.contract.kernel_matches_reference) for every registered mixer:
the kernel backend in bf16 no farther from the fp32 reference than the reference run in bf16. The CPU properties:
tests/test_mixer_contract.py. Skipped without CUDA.

    source .devbundle/setup.sh && python3 -m pytest -q tests/gpu/test_mixer_contract_gpu.py
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from harness.mixers import MIXERS  # noqa: E402
from harness.mixers.contract import PASS, run_contract  # noqa: E402


@pytest.mark.parametrize("name", list(MIXERS))
def test_kernel_matches_reference_for_every_registered_mixer(name):
    (outcome,) = run_contract(name, only=["kernel_matches_reference"])
    assert outcome.status == PASS, outcome.detail
