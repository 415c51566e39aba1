"""LR schedules: exact values at the phase boundaries, monotonicity, short stages, the LambdaLR wiring."""

from __future__ import annotations

import pickle

import pytest
import torch

from harness.config import DistillConfig, StageConfig
from harness.schedule import build_scheduler, decay_steps_for, lr_multiplier


def curve(schedule: str, total: int, warmup: int, decay: float = 0.2, min_ratio: float = 0.1) -> list[float]:
    return [
        lr_multiplier(s, total, schedule=schedule, warmup_steps=warmup, decay_fraction=decay, min_lr_ratio=min_ratio)
        for s in range(total)
    ]


@pytest.mark.parametrize("schedule", ["wsd", "cosine", "constant"])
def test_warmup_is_linear_from_first_step_to_peak(schedule):
    lr = curve(schedule, total=100, warmup=4)
    assert lr[:4] == [0.25, 0.5, 0.75, 1.0]


def test_wsd_phases():
    lr = curve("wsd", total=100, warmup=10, decay=0.2, min_ratio=0.1)
    assert all(v == 1.0 for v in lr[9:80])  # warmup end through the last stable step
    assert lr[80] == pytest.approx(1.0 - 0.9 / 20)  # first decay step
    assert lr[90] == pytest.approx(1.0 - 0.9 * 11 / 20)
    assert lr[99] == 0.1  # final step: exactly min_lr_ratio
    decay = lr[79:]
    assert all(a > b for a, b in zip(decay, decay[1:]))


def test_cosine_phases():
    lr = curve("cosine", total=101, warmup=10, min_ratio=0.1)
    assert lr[9] == lr[10] == 1.0  # warmup end, then the cosine's start
    assert lr[55] == pytest.approx(0.55)  # halfway through the 90 post-warmup intervals
    assert lr[100] == 0.1
    post = lr[10:]
    assert all(a > b for a, b in zip(post, post[1:]))


def test_constant_is_flat_after_warmup():
    lr = curve("constant", total=50, warmup=5, min_ratio=0.1)
    assert all(v == 1.0 for v in lr[4:])


@pytest.mark.parametrize("schedule", ["wsd", "cosine", "constant"])
def test_no_warmup_and_warmup_monotonic(schedule):
    lr = curve(schedule, total=30, warmup=0)
    assert lr[0] == 1.0
    assert all(a >= b for a, b in zip(lr, lr[1:]))
    warm = curve(schedule, total=30, warmup=6)[:6]
    assert all(a < b for a, b in zip(warm, warm[1:]))


def test_single_step_stage():
    assert curve("wsd", total=1, warmup=0) == [0.1]
    assert curve("cosine", total=1, warmup=0) == [0.1]
    assert curve("constant", total=1, warmup=0) == [1.0]
    assert curve("wsd", total=1, warmup=1) == [0.1]  # warmup and decay overlap: the smaller applies


def test_decay_step_count_and_past_the_end():
    assert decay_steps_for(30, 0.1) == 3  # not 4: 0.1 * 30 is 3.0000000000000004 in floats
    assert decay_steps_for(10, 0.25) == 3
    assert decay_steps_for(5, 0.0) == 0
    assert curve("wsd", total=10, warmup=0, decay=0.0) == [1.0] * 10
    kw = dict(schedule="wsd", warmup_steps=0, decay_fraction=0.2, min_lr_ratio=0.1)
    assert lr_multiplier(15, 10, **kw) == 0.1


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="schedule"):
        lr_multiplier(0, 10, schedule="linear", warmup_steps=0, decay_fraction=0.2, min_lr_ratio=0.1)
    with pytest.raises(ValueError, match="total_steps"):
        lr_multiplier(0, 0, schedule="wsd", warmup_steps=0, decay_fraction=0.2, min_lr_ratio=0.1)


def test_build_scheduler_drives_the_optimizer():
    param = torch.nn.Parameter(torch.zeros(1))
    cfg = DistillConfig(lr=2e-4, schedule="wsd", warmup_fraction=0.1, decay_fraction=0.5, min_lr_ratio=0.2)
    opt = torch.optim.AdamW([param], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, total_steps=20)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = curve("wsd", total=20, warmup=2, decay=0.5, min_ratio=0.2)
    assert seen == pytest.approx([cfg.lr * m for m in expected])
    assert seen[-1] == pytest.approx(cfg.lr * 0.2)
    pickle.dumps(sched.state_dict())  # goes into checkpoints


def test_build_scheduler_from_default_stage_config():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    build_scheduler(opt, StageConfig(), total_steps=1)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # default wsd, 1 step: straight to min_lr_ratio
