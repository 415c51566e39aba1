"""Every job file in jobs/ is a valid job (typed, validated) and the study covers 3 scales x 7 mixers."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.config import load_job, plan_stages
from harness.mixers import MIXERS

JOBS = sorted((Path(__file__).resolve().parents[1] / "jobs").rglob("*.yaml"))


@pytest.mark.parametrize("path", JOBS, ids=[p.name for p in JOBS])
def test_job_file_is_valid(path):
    job = load_job(path)
    assert all(p.steps >= 1 for p in plan_stages(job))


def test_study_grid_is_complete():
    names = {p.stem for p in JOBS}
    for scale in ("135m", "360m", "1.7b"):
        for mixer in MIXERS:
            assert f"smollm2-{scale}-{mixer}-3b" in names
    for mixer in MIXERS:
        assert f"smollm2-1.7b-{mixer}-10b" in names
    job = load_job(Path("jobs/study/smollm2-1.7b-kda-10b.yaml"))
    assert job.budget.total_tokens == 10_000_000_000 and job.student.mixer == "kda"
