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


def test_small_study_is_one_recipe_and_matches_its_generator():
    """jobs/study-small/: the seven mixers and a second seed of linear_attn, identical but for mixer, seed and
    name; the files are what scripts/make_study_jobs.py writes; the budget fits the embedded corpus."""
    import importlib.util

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("make_study_jobs", root / "scripts" / "make_study_jobs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    expected = gen.small_jobs()
    folder = root / "jobs" / "study-small"
    assert {p.name: p.read_text() for p in folder.glob("*.yaml")} == expected
    names = {f"smollm2-135m-{m}-small.yaml" for m in MIXERS} | {"smollm2-135m-linear_attn-small-seed2.yaml"}
    assert set(expected) == names
    jobs = {name: load_job(folder / name) for name in names}
    seeds = {name: job.seed for name, job in jobs.items()}
    assert seeds["smollm2-135m-linear_attn-small-seed2.yaml"] == 1 and sum(seeds.values()) == 1

    def recipe(job):  # everything but what distinguishes the jobs
        from omegaconf import OmegaConf

        d = OmegaConf.to_container(OmegaConf.structured(job))
        for key in ("name", "output_dir", "seed"):
            d.pop(key)
        d["student"].pop("mixer")
        return d

    first = next(iter(jobs.values()))
    assert all(recipe(job) == recipe(first) for job in jobs.values())
    assert first.teacher.source == "smollm2-135m-instruct-gguf" and first.teacher.num_layers is None
    assert first.data.source == "embedded" and first.deepspeed.world_size == 1
    # the embedded Wikipedia corpus holds 9,055,005 tokens; at seq_len 2048, after the held-out 262,144 tokens,
    # its training split is 4,293 sequences = 8,792,064 tokens (`harness data prepare`): no stage may repeat it
    assert sum(p.tokens for p in plan_stages(first)) <= 8_792_064
    assert all(p.steps >= 30 for p in plan_stages(first))
