"""scripts/copy_with_layers_kept.py (the copy probe with a set of layers linearized at once) against the layer
ranking it extends: one layer replaced and nothing kept is the ranking's copy cost; every layer kept is the teacher;
replacing layers one by one through the script's own stack puts every teacher attention back afterwards.

The tiny teacher copies almost nothing (a random model), so the first test reads, instead of the copy accuracy, a
fingerprint of the model's logits on the probe's prompts: a value that moves with every layer replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.ranking import rank_layers
from tests.pipeline import load_script, make_setting, tiny_job


def script():
    return load_script("copy_with_layers_kept")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("kept")
    make_setting(root / "setting")
    return tiny_job(root / "setting", root / "run", "data.validation_tokens=512")


def logits_fingerprint(self, model) -> dict:
    """Stands in for CopyProbe.measure: the sum of the model's logits on the copy prompts, as both scores."""
    import torch

    with torch.no_grad():
        value = float(model(input_ids=self.ids, use_cache=False).logits.double().sum())
    return {"copy_acc": value, "nll_after_first": value}


def test_one_layer_replaced_is_the_rankings_copy_cost_and_all_kept_is_the_teacher(job, monkeypatch):
    from harness.ranking import CopyProbe

    monkeypatch.setattr(CopyProbe, "measure", logits_fingerprint)
    s = script()
    result = s.copy_with_kept(job, [0, 1], [[0], [], [0, 1], [1]], sequences=8, seq_len=32)
    ranking = rank_layers(job, measure="copy", layers=[0, 1], sequences=8, seq_len=32, progress=False)
    teacher = ranking["data"]["teacher_copy_acc"]
    assert result["teacher_copy_acc"] == pytest.approx(teacher)
    only_1, both, none, only_0 = (r["copy_acc"] for r in result["rows"])
    assert only_1 == pytest.approx(teacher - ranking["layers"]["1"]["cost"], rel=1e-6)
    assert only_0 == pytest.approx(teacher - ranking["layers"]["0"]["cost"], rel=1e-6)
    assert none == pytest.approx(teacher, rel=1e-9)
    assert len({round(v, 3) for v in (teacher, only_0, only_1, both)}) == 4  # each set is its own model
    assert [r["replaced"] for r in result["rows"]] == [[1], [0, 1], [], [0]]
    # the two layers at once is its own measurement: the model was restored between configurations
    assert both == pytest.approx(s.copy_with_kept(job, [0, 1], [[]], sequences=8, seq_len=32)["rows"][0]["copy_acc"])


def test_the_command_writes_both_files_and_names_bad_layers(job, tmp_path, capsys):
    s = script()
    assert s.parse_layers("0-2,16,18") == [0, 1, 2, 16, 18] and s.parse_layers("none") == []
    with pytest.raises(Exception, match="not a list of layers"):
        s.parse_layers("a-b")
    with pytest.raises(SystemExit, match=r"layers \[7\] are outside"):
        s.copy_with_kept(job, [0, 7], [[]], sequences=8, seq_len=32)
    from harness.config.loading import to_yaml

    job_file = tmp_path / "job.yaml"
    job_file.write_text(to_yaml(job))
    out = tmp_path / "kept"
    assert s.main([str(job_file), "--linearize", "0-1", "--keep", "none", "--keep", "1", "--seq-len", "32",
                   "--out", str(out)]) == 0
    data = json.loads(Path(f"{out}.json").read_text())
    assert [r["keep"] for r in data["rows"]] == [[], [1]] and "| 1 | 1 |" in Path(f"{out}.md").read_text()


def test_greedy_keeps_at_each_round_the_layer_that_leaves_the_lowest_nll(job):
    """Forward selection against the kept sets scored one by one: each round's choice is the candidate with the
    lowest copy NLL among those `copy_with_kept` gives for the kept set plus one layer (the real copy measure: the
    tiny teacher's NLL moves with every layer replaced), and a chosen layer is never offered again."""
    s = script()
    result = s.greedy_keep(job, [0, 1, 2, 3], 2, start=[3], sequences=8, seq_len=32, progress=False)
    assert result["start"] == [3] and len(result["rounds"]) == 1  # one layer more than the start: K = 2
    (only,) = result["rounds"]
    assert [c["layer"] for c in only["candidates"]] == [0, 1, 2]
    direct = s.copy_with_kept(job, [0, 1, 2, 3], [[0, 3], [1, 3], [2, 3]], sequences=8, seq_len=32)["rows"]
    nll = {r["keep"][0]: r["nll_after_first"] for r in direct}
    assert {c["layer"]: c["nll_after_first"] for c in only["candidates"]} == pytest.approx(nll)
    assert len({round(v, 6) for v in nll.values()}) == 3  # the candidates differ: the choice means something
    assert only["chosen"] == min(nll, key=nll.get) and only["kept"] == sorted([3, only["chosen"]])
    two = s.greedy_keep(job, [0, 1, 2, 3], 2, sequences=8, seq_len=32, progress=False)["rounds"]
    assert len(two[0]["candidates"]) == 4 and two[0]["chosen"] not in [c["layer"] for c in two[1]["candidates"]]
    with pytest.raises(SystemExit, match="must be more than the 2 layers kept"):
        s.greedy_keep(job, [0, 1, 2, 3], 2, start=[0, 1], sequences=8, seq_len=32, progress=False)


def test_the_greedy_command_writes_its_rounds(job, tmp_path):
    from harness.config.loading import to_yaml

    s = script()
    job_file = tmp_path / "job.yaml"
    job_file.write_text(to_yaml(job))
    out = tmp_path / "greedy"
    assert s.main([str(job_file), "--linearize", "0-3", "--greedy", "1", "--seq-len", "32", "--out", str(out)]) == 0
    data = json.loads(Path(f"{out}.json").read_text())
    text = Path(f"{out}.md").read_text()
    assert len(data["rounds"]) == 1 and f"| 1 | {data['rounds'][0]['chosen']} |" in text
    assert "Round 1: the 4 best of 4 candidates" in text
