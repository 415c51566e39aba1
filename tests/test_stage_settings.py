"""harness.stage_settings: a rerun into a run directory whose stages were computed with other settings is refused,
naming the keys (issue 49: `harness run JOB stages.distill.lr=1e-2` after a run at 1e-4 exited 0 with the old student
and a job.yaml that said 0.01)."""

from __future__ import annotations

import json

import pytest

from harness.config import ConfigError, load_job
from harness.stage_settings import (PIPELINE, check_settings, has_reusable_work, is_free, record_path,
                                    stage_settings)


def job_at(run, *overrides):
    return load_job(None, [f"output_dir={run}", "budget.total_tokens=4096000", *overrides])


def finish(run, stage):
    """Leave the files that make `stage`'s work reusable."""
    where = {"align_mixer": "align_mixer/layers-00-01/COMPLETE.json", "align_hidden": "align_hidden/layers-00-01/COMPLETE.json",
             "merge": "merged/MERGE.json", "distill": "distill/checkpoints/step-00000004/manifest.json",
             "sft": "sft/checkpoints/COMPLETE.json"}[stage]
    (run / where).parent.mkdir(parents=True, exist_ok=True)
    (run / where).write_text("{}")


def test_a_fresh_run_records_every_stage_and_a_rerun_with_the_same_settings_passes(tmp_path):
    run = tmp_path / "run"
    check_settings(job_at(run), PIPELINE)
    assert all(record_path(run, s).is_file() for s in PIPELINE)
    for stage in PIPELINE:
        finish(run, stage)
    check_settings(job_at(run, "run.keep_last=5", "eval.limit=3", "run.device=cpu"), PIPELINE)  # free keys


def test_a_changed_setting_of_a_stage_with_work_is_refused_naming_key_and_values(tmp_path):
    run = tmp_path / "run"
    check_settings(job_at(run), PIPELINE)
    for stage in PIPELINE:
        finish(run, stage)
    with pytest.raises(ConfigError) as err:
        check_settings(job_at(run, "stages.distill.lr=1e-2", "student.mixer=kda", "student.options.rope=true"),
                       PIPELINE)
    text = str(err.value)
    assert "student.options.rope ((unset) recorded, true now)" in text
    assert "stages.distill.lr (0.0001 recorded, 0.01 now)" in text
    assert "student.mixer (gated_deltanet recorded, kda now)" in text
    assert "align_mixer differs" in text and "distill differs" in text
    assert "output_dir=" in text and "run.accept_changed_settings=true" in text
    assert json.loads(record_path(run, "distill").read_text())["settings"]["stages.distill.lr"] == 1e-4  # unchanged


def test_a_change_is_recorded_freely_while_the_stage_has_no_work_yet(tmp_path):
    run = tmp_path / "run"
    check_settings(job_at(run), PIPELINE)
    finish(run, "align_mixer")  # stage 1 done, stage 3 not started: its settings may still change
    check_settings(job_at(run, "stages.distill.lr=1e-2"), PIPELINE)
    assert json.loads(record_path(run, "distill").read_text())["settings"]["stages.distill.lr"] == 1e-2
    with pytest.raises(ConfigError, match="align_mixer differs in stages.align_mixer.lr"):
        check_settings(job_at(run, "stages.align_mixer.lr=1e-2"), PIPELINE)


def test_accepting_a_change_keeps_the_old_settings_in_the_history(tmp_path, capsys):
    run = tmp_path / "run"
    check_settings(job_at(run), ["distill"])
    finish(run, "distill")
    check_settings(job_at(run, "stages.distill.lr=1e-2", "run.accept_changed_settings=true"), ["distill"])
    record = json.loads(record_path(run, "distill").read_text())
    assert record["settings"]["stages.distill.lr"] == 1e-2
    assert record["history"][0]["settings"]["stages.distill.lr"] == 1e-4
    assert "continuing under the new ones" in capsys.readouterr().err
    check_settings(job_at(run, "stages.distill.lr=1e-2"), ["distill"])  # now the recorded settings


def test_a_run_from_before_the_records_is_checked_against_its_job_yaml(tmp_path):
    from omegaconf import OmegaConf

    run = tmp_path / "run"
    run.mkdir()
    (run / "job.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(job_at(run))))
    finish(run, "distill")
    with pytest.raises(ConfigError, match="stages.distill.lr"):
        check_settings(job_at(run, "stages.distill.lr=1e-2"), ["distill"])


def test_each_stage_depends_only_on_its_own_and_the_shared_keys():
    job = load_job(None, [])
    assert "stages.distill.lr" in stage_settings(job, "distill") and "stages.distill.lr" not in stage_settings(job, "align_mixer")
    assert "deepspeed.world_size" in stage_settings(job, "distill") and "deepspeed.world_size" not in stage_settings(job, "merge")
    assert "instructions.seq_len" not in stage_settings(job, "distill")
    assert "instructions.seq_len" in stage_settings(load_job(None, ["stages.distill.data=instructions"]), "distill")
    assert "data.seq_len" not in stage_settings(job, "sft") and "stages.sft.lr" in stage_settings(job, "sft")
    assert all(is_free(k) for k in ("run.keep_last", "eval.niah.lengths", "output_dir", "student.options.backend",
                                    "student.options.fused_qkv"))
    options = stage_settings(load_job(None, ["student.options.rope=true", "student.options.backend=reference",
                                             "student.options.fused_qkv=false"]), "align_mixer")["student.options"]
    assert options == {"rope": True}  # one value: an added option differs; the backend and fused_qkv may change
    assert not any(is_free(k) for k in ("stages.distill.lr", "student.options.rope", "data.seq_len", "seed"))


def test_rank_nonzero_checks_but_never_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    check_settings(job_at(tmp_path / "run"), PIPELINE)
    assert not (tmp_path / "run" / "settings").exists()
    assert not has_reusable_work(tmp_path / "run", "distill")


def test_turning_post_training_on_reuses_a_finished_pipeline_and_adds_sft_to_the_checked_stages(tmp_path):
    """stages.sft.enabled says whether the pipeline goes on to SFT, not how anything is computed: a finished run
    rerun with it on is accepted, and its SFT settings are then recorded and checked like every stage's."""
    from harness.stage_settings import pipeline_of

    run = tmp_path / "run"
    check_settings(job_at(run), pipeline_of(job_at(run)))
    for stage in PIPELINE:
        finish(run, stage)
    tuned = job_at(run, "stages.sft.enabled=true")
    assert pipeline_of(job_at(run)) == PIPELINE and pipeline_of(tuned) == (*PIPELINE, "sft")
    check_settings(tuned, pipeline_of(tuned))
    assert record_path(run, "sft").is_file() and is_free("stages.sft.enabled") and not is_free("stages.sft.lr")
    finish(run, "sft")
    with pytest.raises(ConfigError, match=r"sft differs in stages.sft.lr \(5e-05 recorded, 0.001 now\)"):
        check_settings(job_at(run, "stages.sft.enabled=true", "stages.sft.lr=1e-3"), pipeline_of(tuned))
