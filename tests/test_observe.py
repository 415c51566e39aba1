"""Run observation: metrics.jsonl, resume truncation, TensorBoard, progress bar, throughput, non-finite loss."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from harness.flops import dense_flops_per_token
from harness.observe import (
    METRICS,
    NonFiniteLoss,
    RunLogger,
    SkippedStepWatch,
    Throughput,
    TooManySkippedSteps,
    check_finite,
    mfu,
    peak_memory_bytes,
)


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_line_written_and_flushed_per_call(tmp_path: Path) -> None:
    logger = RunLogger(tmp_path, "distill", rank=0, total_tokens=1000, enabled_tensorboard=False)
    logger.log(1, 100, loss=torch.tensor(2.5), lr=1e-3)
    rows = _lines(tmp_path / METRICS)  # read while the logger is still open: nothing waits for close()
    assert len(rows) == 1
    assert rows[0]["step"] == 1 and rows[0]["tokens"] == 100 and rows[0]["stage"] == "distill"
    assert rows[0]["loss"] == 2.5 and rows[0]["lr"] == 1e-3
    assert "tokens_per_s" not in rows[0]  # one point is no rate: no 0.0 for a median to take as measured
    logger.log(2, 200, loss=2.0)
    rows = _lines(tmp_path / METRICS)
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["tokens_per_s"] > 0
    assert logger.bar.n == 200
    logger.close()


def test_the_first_line_says_where_the_process_time_went_before_it(tmp_path: Path) -> None:
    """startup_setup_s: process start to the logger; startup_first_log_s: to the first line (the first steps too);
    only the first line carries them, measured against psutil's process start."""
    import psutil

    before = time.time() - psutil.Process().create_time()
    logger = RunLogger(tmp_path, "distill", rank=0, total_tokens=1000, enabled_tensorboard=False)
    after = time.time() - psutil.Process().create_time()
    time.sleep(0.3)
    logger.log(1, 100, loss=2.5)
    logger.log(2, 200, loss=2.0)
    logger.close()
    first, second = _lines(tmp_path / METRICS)
    assert before - 0.1 <= first["startup_setup_s"] <= after + 0.1
    assert first["startup_first_log_s"] >= first["startup_setup_s"] + 0.25
    assert "startup_setup_s" not in second and "startup_first_log_s" not in second


def test_resume_drops_later_lines_and_fresh_run_truncates(tmp_path: Path) -> None:
    with RunLogger(tmp_path, "s", total_tokens=1000, enabled_tensorboard=False) as logger:
        for step in range(1, 6):
            logger.log(step, step * 100, loss=1.0 / step)
    with open(tmp_path / METRICS, "a") as f:
        f.write('{"step": 6, "tok')  # a line a crash cut short

    # Resumed from the checkpoint at step 3: steps 4 and 5 (and the torn line) will be redone.
    with RunLogger(tmp_path, "s", total_tokens=1000, start_step=3, start_tokens=300, enabled_tensorboard=False) as lg:
        assert lg.bar.n == 300
        assert [r["step"] for r in _lines(tmp_path / METRICS)] == [1, 2, 3]
        lg.log(4, 400, loss=0.25)
    assert [r["step"] for r in _lines(tmp_path / METRICS)] == [1, 2, 3, 4]

    with RunLogger(tmp_path, "s", total_tokens=1000, enabled_tensorboard=False):
        assert (tmp_path / METRICS).read_text() == ""


def test_tensorboard_event_file_written(tmp_path: Path) -> None:
    with RunLogger(tmp_path, "align_mixer", total_tokens=10) as logger:
        logger.log(1, 5, loss=0.5)
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def scalars() -> list[tuple[int, float]]:
        acc = EventAccumulator(str(tmp_path / "tb"))
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars("align_mixer/loss")]

    assert scalars() == [(1, 0.5)]

    with RunLogger(tmp_path, "align_mixer", total_tokens=10) as logger:  # a fresh run, dies after step 3
        for step in (1, 2, 3):
            logger.log(step, 3 * step, loss=2.0 ** (1 - step))
    assert scalars() == [(1, 1.0), (2, 0.5), (3, 0.25)]
    with RunLogger(tmp_path, "align_mixer", total_tokens=10, start_step=2, start_tokens=6) as logger:
        logger.log(3, 9, loss=0.125)  # resumed from step 2: TensorBoard shows the redone step 3 only
    assert scalars() == [(1, 1.0), (2, 0.5), (3, 0.125)]


def test_non_zero_rank_writes_nothing_and_shows_no_bar(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with RunLogger(tmp_path / "r1", "s", rank=1, total_tokens=1000) as logger:
        assert logger.bar.disable
        logger.log(1, 100, loss=1.0)
        logger.write("hello")
    assert not (tmp_path / "r1").exists()
    assert capsys.readouterr().err == ""
    with RunLogger(tmp_path / "r0", "s", rank=0, total_tokens=1000, enabled_tensorboard=False) as logger:
        assert not logger.bar.disable


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_loss_raises(bad: float) -> None:
    with pytest.raises(NonFiniteLoss, match=r"step 12 \(3,072 tokens\).*last good checkpoint is kept") as err:
        check_finite(torch.tensor(bad), step=12, tokens=3072)
    assert err.value.step == 12 and err.value.tokens == 3072
    with pytest.raises(NonFiniteLoss):
        check_finite(bad, step=1, tokens=1)
    assert check_finite(torch.tensor(1.5), step=1, tokens=1) == 1.5


def test_throughput_window_and_mfu_arithmetic() -> None:
    tp = Throughput(window=3, flops_per_token=6e9, peak_flops=1e15)
    assert tp.tokens_per_s is None and tp.mfu is None and tp.summary().keys() == {"peak_mem_gib"}
    tp.update(0, now=0.0)
    assert tp.tokens_per_s is None  # one point (e.g. the first step after a resume) is no rate yet
    for t, n in [(0.0, 0), (1.0, 1000), (2.0, 2000), (3.0, 5000)]:
        tp.update(n, now=t)
    assert tp.tokens_per_s == pytest.approx((5000 - 1000) / 2)  # window of 3 drops the first point
    assert tp.mfu == pytest.approx(2000 * 6e9 / 1e15)
    # 26k tokens/s of a 188M model at the H200's datasheet 989 TFLOP/s: 26e3 x 6 x 188e6 / 989e12 = 2.97%
    assert mfu(26_000, dense_flops_per_token(188_000_000), 989e12) == pytest.approx(0.02965, rel=1e-3)
    assert Throughput().mfu is None
    summary = tp.summary()
    assert set(summary) == {"tokens_per_s", "mfu", "peak_mem_gib"} and summary["peak_mem_gib"] > 0
    assert peak_memory_bytes() > 10 * 2**20 and math.isfinite(summary["mfu"])


def test_mfu_and_mfu_measured_peak_side_by_side(tmp_path: Path) -> None:
    """Both figures, each over its own peak, in the summary and in metrics.jsonl; only the known ones."""
    tp = Throughput(window=2, flops_per_token=1e9, peak_flops=989e12, measured_peak_flops=788e12)
    tp.update(0, now=0.0)
    tp.update(300_000, now=1.0)
    assert tp.mfu == pytest.approx(3e14 / 989e12) and tp.mfu_measured_peak == pytest.approx(3e14 / 788e12)
    assert tp.summary()["mfu_measured_peak"] == pytest.approx(0.380711, abs=1e-6)
    assert "mfu" not in Throughput(flops_per_token=1e9, measured_peak_flops=788e12).summary()
    logger = RunLogger(tmp_path, "distill", enabled_tensorboard=False, show_progress=False, throughput=Throughput(
        flops_per_token=1e9, peak_flops=989e12, measured_peak_flops=788e12))
    logger.log(1, 100)
    logger.log(2, 200)
    logger.close()
    row = _lines(tmp_path / METRICS)[-1]
    assert row["mfu_measured_peak"] == pytest.approx(row["mfu"] * 989 / 788)


def test_skipped_step_watch_stops_only_a_run_of_skips() -> None:
    watch = SkippedStepWatch(limit=3, skipped_so_far=5)  # a resumed run: 5 skipped before, not in a row now
    for step, total in enumerate([5, 6, 7, 7, 8, 9], start=1):  # two in a row, a good step, two in a row
        watch.check(total, step, step * 100)
    with pytest.raises(TooManySkippedSteps, match=r"3 optimizer steps in a row.*up to step 7, 700 tokens"):
        watch.check(10, 7, 700)
    never = SkippedStepWatch(limit=0)
    for step in range(1, 50):
        never.check(step, step, step)
