"""scripts/layer_copy_after_stage1.py (one layer trained by stage 1, then scored on the copy probe) read against the
ranking it runs: each row's copy accuracy and its removed-layer floor are the teacher's minus the ranking part's
costs, a trained row reads its stage-1 run's last loss, and the Markdown states the teacher and the floor."""

from __future__ import annotations

import json

import pytest

from harness.config import load_job
from harness.ranking import rank_layers
from tests.pipeline import job_file, load_script, make_setting


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("layer-copy")
    make_setting(root / "setting")
    return root


def test_rows_are_the_rankings_costs_and_the_markdown_names_the_floor(setting):
    s = load_script("layer_copy_after_stage1")
    job = job_file(setting, setting / "job", "data.validation_tokens=512", total=40_960)
    work = setting / "work"
    init = s.measure(str(job), 1, 0, 0, work, "cpu", sequences=8, lengths=(8, 16))
    trained = s.measure(str(job), 1, 1024, 0, work, "cpu", sequences=8, lengths=(16,))
    assert [r["copy_length"] for r in init] == [8, 16] and [r["weights"] for r in init + trained] == ["init"] * 2 + [
        "stage1"]
    run = work / f"{job.stem}-L1-t0-s0"
    reference = rank_layers(load_job(str(job), [f"output_dir={run}", "run.device=cpu", "seed=0"]), measure="copy",
                            layers=[1], sequences=8, seq_len=32, progress=False)
    teacher, costs = reference["data"]["teacher_copy_acc"], reference["layers"]["1"]
    assert init[1]["teacher_copy_acc"] == pytest.approx(teacher)
    assert init[1]["copy_acc"] == pytest.approx(teacher - costs["cost"])
    assert init[1]["removed_copy_acc"] == pytest.approx(teacher - costs["removed_cost"])
    assert trained[0]["removed_copy_acc"] == pytest.approx(init[1]["removed_copy_acc"])  # the same prompts
    logged = [json.loads(line) for line in (work / f"{job.stem}-L1-t1024-s0" / "align_mixer" / "layers-01-01" /
                                            "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert trained[0]["stage1_last_loss"] == pytest.approx([r["loss/layer_01"] for r in logged][-1])
    md = s.markdown(init + trained, "python scripts/layer_copy_after_stage1.py ...")
    assert (f"With layer 1's attention removed instead (its output zero: what a mixer that gives the layer back "
            f"nothing scores): {100 * init[0]['removed_copy_acc']:.1f}% at 8 tokens, "
            f"{100 * init[1]['removed_copy_acc']:.1f}% at 16 tokens.") in md
    assert md.count("| stage1 |") == 1 and md.count("| init |") == 2


def test_the_data_column_names_stage_ones_sources_and_weights(setting):
    """A job whose mix gives copy documents to stage 1 only is described by what stage 1 reads."""
    s = load_script("layer_copy_after_stage1")
    corpus = setting / "setting" / "corpus.jsonl"
    mix = (f"data.mix=[{{source: {corpus}, weight: 0.5, stage_weights: {{distill: 1}}}}, "
           "{source: 'generator:copy', weight: 0.5, stage_weights: {distill: 0}}]")
    staged = job_file(setting, setting / "job-staged", "data.source=embedded", mix, total=40_960)
    assert s.data_of(str(staged)) == f"0.5 {corpus} + 0.5 generator:copy"
    later_mix = f"data.mix=[{{source: {corpus}}}, {{source: 'generator:copy', stage_weights: {{align_mixer: 0}}}}]"
    later = job_file(setting, setting / "job-later", "data.source=embedded", later_mix, total=40_960)
    assert s.data_of(str(later)) == f"1.0 {corpus}"
