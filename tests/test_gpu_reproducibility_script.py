"""scripts/gpu_reproducibility.py on the tiny CPU setting: a step-0 student built from the job, scored twice in one
process and once more in another, compares bit for bit (the CPU path is deterministic), and a changed repeat is
reported with its difference and the first greedy token that differs."""

from __future__ import annotations

import json

import torch
from omegaconf import OmegaConf

from tests.pipeline import tiny_job


def test_two_scorings_of_one_student_compare_bitwise_and_a_changed_one_does_not(tmp_path, capsys):
    from tests.pipeline import load_script

    script = load_script("gpu_reproducibility")
    job = tiny_job(tmp_path / "setting", tmp_path / "run", "student.attention_layers=[1]")
    job_path = tmp_path / "job.yaml"
    job_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    common = ["--student", str(tmp_path / "student"), "--batch", "2", "--seq-len", "80", "--prompt-len", "16",
              "--new-tokens", "6", "--device", "cpu", "--dtype", "float32"]
    script.main(["score", str(job_path), *common, "--build", "--out", str(tmp_path / "a")])
    script.main(["score", str(job_path), *common, "--repeats", "1", "--out", str(tmp_path / "b")])
    facts = json.loads((tmp_path / "a" / "scores.json").read_text())
    assert len(facts["logits_sha256"]) == 2 and facts["weights_sha256"]
    assert (tmp_path / "student" / "config.json").is_file()

    result = script.compare(script.argparse.Namespace(runs=[str(tmp_path / "a"), str(tmp_path / "b")], json=None))
    assert result["same_weights"] and len(result["pairs"]) == 3  # a#0-a#1, a#0-b#0, a#1-b#0
    assert all(p["bitwise"] and p["max_abs_logprob_diff"] == 0 and p["generated_equal"] for p in result["pairs"])

    saved = torch.load(tmp_path / "b" / "scores.pt")  # one repeat changed: a logit moved, a greedy token differs
    saved[0]["tail_logprobs"][0, -1, 5] += 0.5
    saved[0]["generated"][1, 3] += 1
    torch.save(saved, tmp_path / "b" / "scores.pt")
    facts_b = json.loads((tmp_path / "b" / "scores.json").read_text())
    facts_b["logits_sha256"] = ["0" * 64]
    (tmp_path / "b" / "scores.json").write_text(json.dumps(facts_b))
    capsys.readouterr()
    result = script.compare(script.argparse.Namespace(runs=[str(tmp_path / "a"), str(tmp_path / "b")],
                                                      json=str(tmp_path / "cmp.json")))
    changed = [p for p in result["pairs"] if p["b"] == "b#0"]
    assert all(not p["bitwise"] and p["max_abs_logprob_diff"] == 0.5 and not p["generated_equal"] for p in changed)
    assert all(p["first_differing_token"] == [None, 3] for p in changed)
    assert "| a#0 | b#0 | False | 0.5 |" in capsys.readouterr().out
    assert json.loads((tmp_path / "cmp.json").read_text())["pairs"][0]["bitwise"]
