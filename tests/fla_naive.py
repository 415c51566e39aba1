"""Shared by the recurrence tests: fla's naive (PyTorch) reference modules, and the chunked-against-step comparison."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def fla_naive(module: str):
    """fla's naive reference module `fla/ops/MODULE/naive.py` (MODULE may hold a slash, e.g.
    "generalized_delta_rule/dplr"), loaded from its file: importing fla itself needs triton."""
    spec = importlib.util.find_spec("fla")  # fla-core is a pinned dependency: its absence is a failure
    assert spec is not None and spec.submodule_search_locations, "fla-core is not installed"
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / module / "naive.py"
    assert path.exists(), f"{path} missing"
    loader = importlib.util.spec_from_file_location(f"_fla_naive_{module.replace('/', '_')}", path)
    mod = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(mod)
    return mod


def assert_runs_match(first, second) -> None:
    """Two runs of one recurrence, each (outputs, gradients): outputs within rtol 1e-4 / atol 1e-5, gradients within
    1e-4 / 1e-4 (the chunked form against the step-by-step one)."""
    (out1, grads1), (out2, grads2) = first, second
    for a, b in zip(out1, out2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for a, b in zip(grads1, grads2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
