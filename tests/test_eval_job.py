"""The evaluation job (`harness eval EVAL.yaml`) and the recovery report (`harness report`) on a tiny setting.

A tiny student (gated_deltanet, random weights) made from the tiny pipeline teacher, saved in HF format;
its spec asks for two offline benchmark tasks, a one-length NIAH grid and held-out perplexity. The report's
ratios are checked against the per-task result files the evaluations wrote.
"""

from __future__ import annotations

import fcntl
import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness.assets import sha256_file
from harness.cli import main as harness_main
from harness.config import ConfigError
from harness.eval import job as eval_job
from harness.eval.spec import EvalSpec, load_eval_spec, spec_from_job
from tests.pipeline import student_run

TASKS = ["piqa", "arc_easy"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding a tiny student and its job, as stage 3 leaves it (eval.yaml included)."""
    root = tmp_path_factory.mktemp("eval_job")
    return student_run(root, root / "run", "eval.enabled=true", "eval.chat_samples=true",
                       f"eval.tasks=[{','.join(TASKS)}]", "eval.limit=4", "eval.batch_size=2", "eval.niah.lengths=[256]",
                       "eval.niah.depths=[0.0,1.0]", "eval.niah.kinds=[passkey]", "eval.niah.samples=1",
                       "eval.perplexity_tokens=128", "name=tiny-run", seed=0)


def _spec(run: Path, **changes) -> EvalSpec:
    spec = load_eval_spec(run / "eval.yaml")
    for key, value in changes.items():
        setattr(spec, key, value)
    return spec


def test_spec_carries_the_jobs_eval_section(run):
    spec = load_eval_spec(run / "eval.yaml")
    assert spec.label == "tiny-run" and spec.mixer == "gated_deltanet"
    assert Path(spec.checkpoint) == (run / "student").resolve() and Path(spec.job) == (run / "job.yaml").resolve()
    assert spec.tasks == TASKS and spec.limit == 4 and spec.niah.lengths == [256] and spec.perplexity_tokens == 128
    assert spec.teacher is not None and Path(spec.output_dir) == (run / "eval").resolve()
    overridden = load_eval_spec(run / "eval.yaml", ["limit=2", "niah.samples=3"])
    assert overridden.limit == 2 and overridden.niah.samples == 3


def test_bad_specs_are_one_paragraph_errors(run, tmp_path, capsys):
    with pytest.raises(ConfigError, match="does not exist"):
        load_eval_spec(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="Allowed: auto, cpu, cuda"):
        load_eval_spec(run / "eval.yaml", ["device=tpu"])
    with pytest.raises(ConfigError, match="eval.niah.kinds"):
        load_eval_spec(run / "eval.yaml", ["niah.kinds=[needle]"])
    bad = tmp_path / "bad.yaml"
    bad.write_text(OmegaConf.to_yaml({**OmegaConf.to_container(OmegaConf.load(run / "eval.yaml")),
                                      "checkpoint": str(tmp_path / "missing")}))
    assert harness_main(["eval", str(bad)]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_eval_job_writes_results_and_a_report_whose_ratios_match(run, capsys):
    assert harness_main(["eval", str(run / "eval.yaml")]) == 0
    printed = capsys.readouterr().out
    out = run / "eval"
    report = json.loads((out / "report.json").read_text())
    assert "# Evaluation: tiny-run (gated_deltanet)" in printed and (out / "report.md").read_text() in printed
    student, teacher = out / "student", out / "teacher"
    for side in (student, teacher):
        for name in ("bench.json", "bench_examples.json", "niah.json", "niah.csv", "niah_heatmap.png",
                     "perplexity.json", "chat_samples.json"):
            assert (side / name).is_file(), side / name
    bench_s = json.loads((student / "bench.json").read_text())["tasks"]
    bench_t = json.loads((teacher / "bench.json").read_text())["tasks"]
    assert list(report["tasks"]) == TASKS
    ratios = []
    for task in TASKS:
        row = report["tasks"][task]
        assert row["student"] == bench_s[task]["score"] and row["teacher"] == bench_t[task]["score"]
        assert row["n"] == 4 and row["metric"] == bench_s[task]["metric"]
        assert row["chance"] == bench_t[task]["chance"] and row["intervals"] is None  # per-example results paired
        if bench_t[task]["score"]:
            assert row["recovery"] == pytest.approx(bench_s[task]["score"] / bench_t[task]["score"])
            ratios.append(row["recovery"])
        else:
            assert row["recovery"] is None
    assert report["average"]["recovery"] == (pytest.approx(sum(ratios) / len(ratios)) if ratios else None)
    assert report["average"]["student"] == pytest.approx(sum(bench_s[t]["score"] for t in TASKS) / len(TASKS))
    ppl_s = json.loads((student / "perplexity.json").read_text())["ppl"]
    ppl_t = json.loads((teacher / "perplexity.json").read_text())["ppl"]
    assert report["perplexity"]["ratio"] == pytest.approx(ppl_s / ppl_t)
    niah_s = json.loads((student / "niah.json").read_text())
    assert report["niah"]["student"]["by_length"] == niah_s["by_length"] and list(niah_s["by_length"]) == ["256"]
    assert (out / "niah_by_length.png").stat().st_size > 1000
    checkpoint = Path(OmegaConf.load(run / "eval.yaml").checkpoint)  # which bytes were scored
    assert report["student_weights_sha256"] == {"model.safetensors": sha256_file(checkpoint / "model.safetensors")}
    chat = json.loads((student / "chat_samples.json").read_text())
    assert "## Chat samples" in printed and all(sample["prompt"] in printed for sample in chat["samples"])


def test_a_rerun_reuses_every_result(run, monkeypatch):
    """After a finished evaluation nothing is recomputed (the same path resumes an interrupted one)."""
    spec = _spec(run)
    eval_job.run_eval_spec(spec, progress=False)
    kept = ("niah_cells.jsonl", "bench.json", "perplexity.json", "chat_samples.json", "text_copy.jsonl")  # niah.json,
    before = {p: p.stat().st_mtime_ns for p in (run / "eval").rglob("*") if p.name in kept}  # the report: re-summarised
    assert len(before) == 10

    def fail(*args, **kwargs):
        raise AssertionError("recomputed")

    monkeypatch.setattr("harness.eval.niah.generate_answers", fail)
    monkeypatch.setattr("harness.eval.lm_eval_tasks.evaluate_task", fail)
    monkeypatch.setattr("harness.eval.perplexity.perplexity", fail)
    monkeypatch.setattr("harness.eval.tasks.text_copy.document_hits", fail)
    eval_job.run_eval_spec(spec, progress=False)
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_teacher_results_are_shared_through_the_cache(run, tmp_path, monkeypatch):
    cache = tmp_path / "teachers"
    first = _spec(run, teacher_cache=str(cache), output_dir=str(tmp_path / "a"), tasks=["piqa"])
    eval_job.run_eval_spec(first, progress=False)
    teacher_dirs = [p for p in cache.iterdir() if p.is_dir()]
    assert len(teacher_dirs) == 1 and eval_job.teacher_results_dir(first) == teacher_dirs[0]
    lock_file = teacher_dirs[0].with_name(teacher_dirs[0].name + ".lock")
    calls = []
    real = eval_job.evaluate_model

    def spy(model, tokenizer, spec, out, **kwargs):
        if kwargs["label"] == "teacher":  # concurrent evaluations sharing the cache take turns on its lock
            with open(lock_file) as f, pytest.raises(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        calls.append((kwargs["label"], out))
        return real(model, tokenizer, spec, out, **kwargs)

    monkeypatch.setattr(eval_job, "evaluate_model", spy)
    monkeypatch.setattr("harness.eval.niah.generate_answers", None)  # the teacher must not generate again
    second = _spec(run, teacher_cache=str(cache), output_dir=str(tmp_path / "b"), tasks=["piqa"],
                   niah=first.niah)
    second.niah.lengths = []  # the student of the second run skips NIAH; the teacher's is cached anyway
    eval_job.run_eval_spec(second, progress=False)
    assert [c[1] for c in calls if c[0] == "teacher"] == [teacher_dirs[0]]
    other = _spec(run, teacher_cache=str(cache), limit=3)
    assert eval_job.teacher_results_dir(other) != teacher_dirs[0]  # a different limit: other teacher numbers


def test_the_jobs_teacher_cache_reaches_the_spec(run, tmp_path):
    from harness.config import load_job

    job = load_job(run / "job.yaml", [f"eval.teacher_cache={tmp_path / 'shared'}"])
    assert spec_from_job(job, run / "student").teacher_cache == str((tmp_path / "shared").resolve())
    assert spec_from_job(load_job(run / "job.yaml"), run / "student").teacher_cache is None


def test_report_command_single_and_comparison(run, tmp_path, capsys):
    eval_job.run_eval_spec(_spec(run), progress=False)
    assert harness_main(["report", str(run)]) == 0
    assert "## Benchmarks" in capsys.readouterr().out
    second = json.loads((run / "eval" / "report.json").read_text())
    second.update(label="other-run", mixer="kda")
    other = tmp_path / "other" / "eval"
    other.mkdir(parents=True)
    (other / "report.json").write_text(json.dumps(second))
    assert harness_main(["report", str(run), str(tmp_path / "other"), "--out", str(tmp_path / "cmp")]) == 0
    table = capsys.readouterr().out
    assert "tiny-run [gated_deltanet]" in table and "other-run [kda]" in table
    for name in ("comparison.md", "comparison.json", "recovery.png", "niah_by_length.png"):
        assert (tmp_path / "cmp" / name).is_file(), name
    assert harness_main(["report", str(tmp_path / "nowhere")]) == 2
    assert "harness eval" in capsys.readouterr().err


def test_spec_from_job_without_teacher(run):
    from harness.config import load_job

    job = load_job(str(run / "job.yaml"), ["eval.teacher=false"])
    spec = spec_from_job(job, run / "student")
    assert spec.teacher is None and spec.job is None
