"""Every job file in jobs/ is a valid job (typed, validated) and the study covers 3 scales x the built-in mixers."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.config import load_job, plan_stages
from harness.mixers import MIXERS as REGISTERED

MIXERS = REGISTERED.builtins  # the study's mixers (plug-ins installed here are not)
JOBS = sorted((Path(__file__).resolve().parents[1] / "jobs").rglob("*.yaml"))


@pytest.mark.parametrize("path", JOBS, ids=[p.name for p in JOBS])
def test_job_file_is_valid(path, tiny_llama_dir):
    """Valid as written; a job whose teacher a script makes under runs/ (jobs/retrieval-toy/: scripts/toy_teacher.py)
    is validated with a stand-in teacher folder there."""
    from omegaconf import OmegaConf

    made = str(OmegaConf.load(path).get("teacher", {}).get("source", "")).startswith("runs/")
    job = load_job(path, [f"teacher.source={tiny_llama_dir}"] if made else [])
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
    from tests.pipeline import load_script

    root = Path(__file__).resolve().parents[1]
    gen = load_script("make_study_jobs")
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


def _generator():
    from tests.pipeline import load_script

    return load_script("make_study_jobs")


def _as_dict(job) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(job))


def test_the_50m_study_is_one_recipe_and_matches_its_generator():
    """jobs/study-small-50m/: the seven mixers, gated_deltanet's second seed, its authors'-init ablation, its
    hybrids (2 layers kept, by either ranking measure) and its decay-gate granularity sweep, one
    recipe at >= 50M tokens on the mixed corpus; the files are what scripts/make_study_jobs.py writes."""
    from harness.transfer import authors_options

    root, gen = Path(__file__).resolve().parents[1], _generator()
    folder = root / "jobs" / "study-small-50m"
    expected = gen.study_50m_jobs()
    assert {p.name: p.read_text() for p in folder.glob("*.yaml")} == expected
    base = "smollm2-135m-gated_deltanet-50m"
    assert set(expected) == {f"smollm2-135m-{m}-50m.yaml" for m in MIXERS} | {
        f"{base}-seed2.yaml", f"{base}-authors-init.yaml", f"{base}-hybrid2.yaml", f"{base}-hybrid2-kl.yaml",
        f"{base}-decay16.yaml", f"{base}-decay1.yaml"}
    jobs = {name: load_job(folder / name) for name in expected}
    # the gate-granularity sweep (issue 52): the plain job (unset: one gate per head), 16 key channels, one
    assert [jobs[f"{base}{s}.yaml"].student.options.get("decay_group_size") for s in ("", "-decay16", "-decay1")] == [
        None, 16, 1]

    def recipe(job):
        d = _as_dict(job)
        for key in ("name", "output_dir", "seed"):
            d.pop(key)
        d.pop("student")
        return d

    hybrids = {f"{base}-hybrid2.yaml": "auto:2:stage1", f"{base}-hybrid2-kl.yaml": "auto:2:kl"}
    assert {n: jobs[n].student.attention_layers for n in hybrids} == hybrids
    assert all(j.student.attention_layers == [] for n, j in jobs.items() if n not in hybrids)

    first = jobs[f"{base}.yaml"]
    assert all(recipe(job) == recipe(first) for job in jobs.values())
    assert first.data.source == "embedded:mixed" and first.budget.total_tokens >= 50_000_000
    # embedded:mixed holds 50,246,597 tokens; at seq_len 2048, after the held-out 262,144, its training split is
    # 24,405 sequences = 49,981,440 tokens (`harness data prepare`): the stages take 49,938,432, nothing repeats
    assert 0.99 * 50_000_000 <= sum(p.tokens for p in plan_stages(first)) <= 49_981_440
    assert jobs[f"{base}-seed2.yaml"].seed == 1 and sum(j.seed for j in jobs.values()) == 1
    ablation = jobs[f"{base}-authors-init.yaml"].student
    assert {k: ablation.options[k] for k in authors_options("gated_deltanet")} == \
        authors_options("gated_deltanet")


def _ours_for(paper_name: str) -> Path:
    root = Path(__file__).resolve().parents[1]
    stem = paper_name.removesuffix("-paper.yaml")
    return root / "jobs" / ("study-small-50m" if stem.endswith("-50m") else "study") / f"{stem}.yaml"


PAPER_JOBS = sorted((Path(__file__).resolve().parents[1] / "jobs" / "paper-recipe").glob("*.yaml"))


@pytest.mark.parametrize("path", PAPER_JOBS, ids=[p.name for p in PAPER_JOBS])
def test_a_paper_recipe_job_differs_from_ours_only_by_the_authors_settings(path):
    """Each jobs/paper-recipe/ file is its counterpart of ours with the authors' context, learning rates, losses and
    init (jobs/paper-recipe/README.md), and the same tokens per step."""
    from harness.transfer import authors_options

    paper, ours = load_job(path), load_job(_ours_for(path.name))
    assert paper.data.seq_len == 512 and ours.data.seq_len == 2048
    s = paper.stages
    assert (s.align_mixer.lr, s.align_hidden.lr, s.distill.lr) == (2e-4, 2e-3, 3e-4)
    assert (s.align_mixer.loss, s.align_hidden.loss) == ("mse", "l2")
    assert (s.distill.ce_weight, s.distill.kl_weight, s.distill.temperature) == (1.0, 512.0, 1.0)
    assert {k: paper.student.options[k] for k in authors_options(paper.student.mixer)} == \
        authors_options(paper.student.mixer)
    assert [p.tokens_per_step for p in plan_stages(paper)] == [p.tokens_per_step for p in plan_stages(ours)]
    a, b = _as_dict(paper), _as_dict(ours)
    for d in (a, b):
        for key in ("name", "output_dir"):
            d.pop(key)
        d["student"].pop("options")
        d["data"].pop("seq_len")
        d["eval"].pop("teacher_cache")
        for stage in ("align_mixer", "align_hidden", "distill"):
            for key in ("lr", "loss", "micro_batch_size", "ce_weight", "kl_weight", "temperature"):
                d["stages"][stage].pop(key, None)
    assert a == b


def test_every_mixer_and_scale_has_a_paper_recipe_job():
    names = {p.name for p in PAPER_JOBS}
    assert {f"smollm2-{s}-{m}-3b-paper.yaml" for s in ("135m", "360m", "1.7b") for m in MIXERS} <= names
    assert "smollm2-135m-gated_deltanet-50m-paper.yaml" in names


def _flat(d: dict) -> dict:
    """A job's sections one level deep: {"name": ..., "budget.split": ..., ...}."""
    return {f"{k}.{sub}" if isinstance(v, dict) else k: (v[sub] if isinstance(v, dict) else v)
            for k, v in d.items() for sub in (v if isinstance(v, dict) else [None])}


def test_the_long_budget_jobs_are_the_50m_study_at_twice_its_tokens():
    """jobs/long-budget-135m/ (issue 50 item 4): what scripts/make_study_jobs.py writes; each is its mixer's 50M
    study job but for the total (stages 1 and 2 plan the study's tokens, stage 3 the rest), the corpus read about
    twice, the evaluation along stage 3 and where its runs go."""
    root, gen = Path(__file__).resolve().parents[1], _generator()
    folder = root / "jobs" / "long-budget-135m"
    expected = gen.long_budget_jobs()
    assert {p.name: p.read_text() for p in folder.glob("*.yaml")} == expected
    assert set(expected) == {f"smollm2-135m-{m}-100m.yaml" for m in ("gated_deltanet", "gla", "linear_attn", "kda")}
    for name in expected:
        long = load_job(folder / name)
        study = load_job(root / "jobs" / "study-small-50m" / name.replace("-100m", "-50m"))
        a, b = _flat(_as_dict(long)), _flat(_as_dict(study))
        assert {k for k in a if a[k] != b[k]} == {"name", "output_dir", "budget.split", "budget.total_tokens",
                                                  "data.allow_repeat", "eval.every_tokens", "eval.teacher_cache"}
        plan, study_plan = plan_stages(long), plan_stages(study)
        assert [p.tokens for p in plan[:2]] == [p.tokens for p in study_plan[:2]]
        assert plan[2].tokens >= 2 * study_plan[2].tokens and long.eval.every_tokens == 25_000_000
