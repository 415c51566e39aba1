"""harness.flops: MFU by the datasheet dense bf16 peak, GPU names as torch reports them, unknown GPUs named,
$HARNESS_PEAK_FLOPS, and the measured-matmul figure kept beside it."""

from __future__ import annotations

import pytest
import torch

from harness import flops
from harness.flops import Peak, datasheet_peak, gpu_model, mfu, resolve_peak

# torch.cuda.get_device_name strings and the datasheet model each one is
KNOWN = [
    ("NVIDIA H200", "H200 SXM", 989e12),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835e12),
    ("NVIDIA H200 NVL", "H200 NVL", 835e12),
    ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
    ("NVIDIA A100-SXM4-40GB", "A100", 312e12),
    ("NVIDIA A100-PCIE-40GB", "A100", 312e12),
    ("NVIDIA A100 80GB PCIe", "A100", 312e12),
]
# GPUs with no figure here, some of them one letter away from a listed one
UNKNOWN = ["NVIDIA GH200 480GB", "NVIDIA H800", "NVIDIA A800-SXM4-80GB", "NVIDIA H200 MIG 1g.18gb",
           "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "NVIDIA L40S", "Tesla V100-SXM2-16GB", "NVIDIA H20"]


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(flops.PEAK_ENV, raising=False)


@pytest.mark.parametrize("name, model, peak", KNOWN)
def test_device_names_map_to_their_datasheet_peak(name, model, peak, no_env):
    assert gpu_model(name) == model and datasheet_peak(name) == peak
    got = resolve_peak(torch.device("cuda", 0), device_name=name)
    assert got.flops == peak and "datasheet" in got.source and model in got.source


@pytest.mark.parametrize("name", UNKNOWN)
def test_an_unknown_gpu_has_no_peak_and_the_reason_names_it(name, no_env):
    assert gpu_model(name) is None and datasheet_peak(name) is None
    got = resolve_peak(torch.device("cuda", 0), device_name=name)
    assert got.flops is None
    assert repr(name) in got.source and "--peak-flops" in got.source and "HARNESS_PEAK_FLOPS" in got.source


def test_mfu_by_the_datasheet_peak_against_a_hand_calculation(no_env):
    """Runs 19's 1.7B plain-engine step: 30,480 tokens/s, gated_deltanet student 1,815,778,304 parameters,
    teacher 1,711,376,384. 6 x 1,815,778,304 + 2 x 1,711,376,384 = 14,317,422,592 FLOPs per token;
    x 30,480 = 4.3639e14 FLOP/s; / 989e12 = 44.12% (/ 788e12, the measured matmul peak: 55.38%)."""
    fpt = flops.flops_per_token(1_815_778_304, 1_711_376_384)
    assert fpt == 14_317_422_592
    peak = resolve_peak(torch.device("cuda", 0), device_name="NVIDIA H200").flops
    assert peak == 989e12
    assert mfu(30_480, fpt, peak) == pytest.approx(0.441249, abs=1e-6)
    measured = flops.measured_peak(torch.device("cuda", 0), device_name="NVIDIA H200")
    assert measured == 788e12 and mfu(30_480, fpt, measured) == pytest.approx(0.553801, abs=1e-6)
    # two devices: the global tokens/s over twice the peak
    assert mfu(2 * 30_480, fpt, peak, world=2) == pytest.approx(mfu(30_480, fpt, peak))
    assert mfu(30_480, fpt, None) is None


def test_harness_peak_flops_overrides_the_datasheet_and_gives_unknown_gpus_a_peak(monkeypatch):
    monkeypatch.setenv(flops.PEAK_ENV, "1.5e15")
    for name in ("NVIDIA H200", "NVIDIA L40S"):
        assert resolve_peak(torch.device("cuda", 0), device_name=name) == Peak(1.5e15, "$HARNESS_PEAK_FLOPS")
    assert flops.peak_flops(torch.device("cpu")) == 1.5e15


def test_no_mfu_on_cpu(no_env):
    got = resolve_peak(torch.device("cpu"))
    assert got.flops is None and "CPU" in got.source
    assert flops.peak_flops(torch.device("cpu")) is None
    assert flops.measured_peak(torch.device("cpu")) is None


def test_the_measured_peak_is_only_for_the_gpu_it_was_measured_on():
    assert flops.measured_peak(torch.device("cuda", 0), device_name="NVIDIA H200") == 788e12
    assert flops.measured_peak(torch.device("cuda", 0), device_name="NVIDIA H200 NVL") is None
    assert flops.measured_peak(torch.device("cuda", 0), device_name="NVIDIA H100 80GB HBM3") is None


def test_model_flops_per_token_counts_embeddings_and_a_tied_head_once():
    """N = count_parameters: the tied embedding / head matrix once, everything else too."""
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied
    student = torch.nn.ModuleDict({"emb": emb, "head": head, "mix": torch.nn.Linear(4, 4)})  # 40 + 20
    teacher = torch.nn.ModuleDict({"emb": torch.nn.Embedding(10, 4), "norm": torch.nn.LayerNorm(4)})  # 40 + 8
    assert flops.model_flops_per_token(student, teacher) == 6 * 60 + 2 * 48


class _Logger:
    """RunLogger's throughput and write(), nothing else."""

    def __init__(self) -> None:
        from harness.observe import Throughput

        self.throughput, self.lines = Throughput(), []

    def write(self, message: str) -> None:
        self.lines.append(message)


def test_stage_logs_mfu_by_the_datasheet_and_names_an_unknown_gpu(monkeypatch, no_env):
    """harness.stages.distill.setup_mfu, as stage 3 and SFT call it: both peaks over all ranks on an H200,
    a log line naming the GPU (and no `mfu`) on an unknown one, silence on a CPU."""
    from harness.stages.distill import setup_mfu

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    log = _Logger()
    setup_mfu(log, cuda, 4, 1.4e10, "distill")
    tp = log.throughput
    assert (tp.flops_per_token, tp.peak_flops, tp.measured_peak_flops) == (1.4e10, 4 * 989e12, 4 * 788e12)
    assert log.lines == []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    log = _Logger()
    setup_mfu(log, cuda, 1, 1.4e10, "sft")
    assert log.throughput.peak_flops is None and log.throughput.measured_peak_flops is None
    assert len(log.lines) == 1 and log.lines[0].startswith("sft: ") and "'NVIDIA L40S'" in log.lines[0]
    assert "HARNESS_PEAK_FLOPS" in log.lines[0]
    log.throughput.update(0, now=0.0)
    log.throughput.update(1000, now=1.0)
    assert "mfu" not in log.throughput.summary()
    monkeypatch.setenv(flops.PEAK_ENV, "5e14")
    log = _Logger()
    setup_mfu(log, cuda, 2, 1.4e10, "distill")
    assert log.throughput.peak_flops == 1e15 and log.lines == []
    monkeypatch.delenv(flops.PEAK_ENV)
    log = _Logger()
    setup_mfu(log, torch.device("cpu"), 1, 1.4e10, "distill")
    assert log.throughput.peak_flops is None and log.lines == []
