"""Evaluation tasks behind one interface (harness.eval.tasks).

A toy task defined in this module, registered through the public registry function and nowhere else, with a
tiny settings dataclass and per-example scores: it reaches the evaluation spec (eval.yaml) and the job's results,
report.json and report.md (its own section, and its recovery score as a row of the recovery table), and the
paired differences of `harness report --baseline`. Two tiny students (different seeds) of the tiny pipeline
teacher, no other task: a few seconds on a CPU.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
from omegaconf import OmegaConf
import torch

from harness.cli import main as harness_main
from harness.config import POSITIVE, ConfigError, CopyConfig, StateConfig, described, load_job
from harness.eval import curves, tasks
from harness.eval.spec import load_eval_spec, write_eval_spec
from harness.eval.tasks import Score, ScoredTask, TaskResults
from tests.pipeline import eval_run, tiny_job

TOY_FILE = "toy_examples.jsonl"


@dataclass
class ToySettings:
    examples: int = described(6, "Examples scored per model.", rule=POSITIVE)
    offset: int = described(3, "The first token id of the examples' prompts.")


class ToyTask(ScoredTask):
    """Per example i, the model's greedy next token after two fixed tokens: "even" (1 when the token id is even,
    chance 1/2: a recovery score) and "token" (the token id itself: a plain value, paired on its own)."""

    name = "toy"
    title = "Toy parity"
    settings = ToySettings
    curve_scores = {"even": True}

    def run(self, model: Any, tokenizer: Any, settings: ToySettings, out_dir: Path, *, label: str, device: Any,
            progress: bool, spec: Any) -> None:
        path = Path(out_dir) / TOY_FILE
        done = {json.loads(line)["id"] for line in path.read_text().splitlines()} if path.is_file() else set()
        with torch.no_grad(), open(path, "a") as out:
            for i in range(settings.examples):
                if f"ex{i}" in done:  # resumable: what is saved is kept
                    continue
                ids = torch.tensor([[settings.offset + i, settings.offset + 2 * i + 1]], device=device)
                token = int(model(input_ids=ids).logits[0, -1].argmax())
                out.write(json.dumps({"id": f"ex{i}", "token": token, "offset": settings.offset}) + "\n")

    def summarise(self, folder: Path) -> Optional[TaskResults]:
        path = Path(folder) / TOY_FILE
        if not path.is_file():
            return None
        records = [json.loads(line) for line in path.read_text().splitlines()]
        even = {r["id"]: float(r["token"] % 2 == 0) for r in records}
        token = {r["id"]: float(r["token"]) for r in records}
        return TaskResults([Score("even", sum(even.values()) / len(even), len(even), chance=0.5, recovery=True),
                            Score("token", sum(token.values()) / len(token), len(token), unit="value")],
                           {"even": even, "token": token}, {"offset": records[0]["offset"]})


@pytest.fixture
def toy():
    task = tasks.register_task(ToyTask())
    yield task
    tasks.unregister_task("toy")


def test_the_registry_lists_the_built_in_tasks():
    assert tasks.task_names()[:8] == ("benchmarks", "niah", "perplexity", "chat_samples", "copy", "text_copy", "state",
                                      "ifeval")
    assert [t.name for t in tasks.tasks_in_run_order()][:8] == ["perplexity", "niah", "copy", "text_copy",
                                                                "chat_samples", "ifeval", "state", "benchmarks"]
    with pytest.raises(ConfigError, match="Unknown evaluation task 'nope'. The registered tasks: benchmarks "
                                          r"\(tasks, limit, batch_size\), niah \(niah\)"):
        tasks.get_task("nope")
    with pytest.raises(ValueError, match="registered already"):
        tasks.register_task(tasks.get_task("niah").__class__())


def test_eval_job_help_lists_every_registered_task_in_run_order(toy, capsys):
    with pytest.raises(SystemExit):
        harness_main(["eval", "job", "--help"])
    out = capsys.readouterr().out
    lines = out.split("in the order they run:\n")[1].split("\n\n")[0].splitlines()
    assert [line.split()[0] for line in lines] == [t.name for t in tasks.tasks_in_run_order()]
    by_name = {line.split()[0]: line for line in lines}
    assert "toy" in by_name  # a task registered from outside is listed too
    assert by_name["ifeval"].endswith("(off unless asked)") and not by_name["copy"].endswith("(off unless asked)")


def test_a_toy_task_runs_is_reported_and_paired(toy, tmp_path, capsys):
    a, b = eval_run(tmp_path, "run-a", 0), eval_run(tmp_path, "run-b", 1)
    assert "toy:\n  examples: 6\n  offset: 3\n" in (a / "eval.yaml").read_text()  # its section of the spec
    for run in (a, b):
        assert harness_main(["eval", str(run / "eval.yaml")]) == 0
    out = a / "eval"
    assert sorted(p.name for p in (out / "student").iterdir()) == [TOY_FILE]  # no other task ran
    assert len((out / "teacher" / TOY_FILE).read_text().splitlines()) == 6
    report = json.loads((out / "report.json").read_text())
    even = report["toy"]["student"]["scores"]["even"]
    assert even["n"] == 6 and even["chance"] == 0.5 and report["toy"]["teacher"]["settings"] == {"offset": 3}
    row = report["tasks"]["toy/even"]  # a recovery score: a row of the recovery table, with its paired interval
    assert row["student"] == even["value"] and row["chance"] == 0.5 and row["intervals"] is None
    assert report["niah"] is None and report["perplexity"] is None and report["limit"] is None
    md = (out / "report.md").read_text()
    assert "## Toy parity" in md and "| token | 6 | - |" in md and "| toy/even | even | 6 | 0.5 |" in md

    assert harness_main(["report", str(a), str(b), "--out", str(tmp_path / "cmp"), "--baseline", "run-a"]) == 0
    text = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "### run-b (B) - run-a (A)" in text and "| toy/even (even) | 6 |" in text
    assert "| Toy parity: token | 6 |" in text and "## Toy parity\n\n| model | even | token |" in text
    paired = json.loads((tmp_path / "cmp" / "comparison.json").read_text())["paired"][0]
    token = next(r for r in paired["rows"] if r["metric"] == "Toy parity: token")
    b_report = json.loads((b / "eval" / "report.json").read_text())
    assert token["diff"] == pytest.approx(b_report["toy"]["student"]["scores"]["token"]["value"]
                                          - report["toy"]["student"]["scores"]["token"]["value"])
    assert token["ci"] is not None and token["n"] == 6
    assert curves.METRICS["toy_even"][0](report) == even["value"]  # curves may draw it along stage 3


def test_toy_settings_are_checked_and_a_null_section_skips_the_task(toy, tmp_path):
    run = eval_run(tmp_path, "run-a", 0)
    spec = load_eval_spec(run / "eval.yaml", ["toy.examples=2"])
    assert spec.toy.examples == 2 and tasks.get_task("toy").wanted(spec)
    assert not tasks.get_task("toy").wanted(load_eval_spec(run / "eval.yaml", ["toy=null"]))
    with pytest.raises(ConfigError, match="toy.examples=0 must be a positive number"):
        load_eval_spec(run / "eval.yaml", ["toy.examples=0"])


def test_an_unknown_task_in_a_spec_is_one_paragraph_naming_the_tasks(toy, tmp_path):
    run = eval_run(tmp_path, "run-a", 0)
    bad = tmp_path / "bad.yaml"
    bad.write_text((run / "eval.yaml").read_text().replace("toy:", "toyy:"))
    for path, overrides in ((bad, []), (run / "eval.yaml", ["toyy.examples=2"])):
        with pytest.raises(ConfigError) as err:
            load_eval_spec(path, overrides)
        message = str(err.value)
        assert "\n" not in message and "'toyy'" in message and "toy (toy)" in message, message
        assert "niah (niah), perplexity (perplexity_tokens, job)" in message
    tasks.unregister_task("toy")  # without the task its section is unknown too
    with pytest.raises(ConfigError, match="'toy' in .* is neither a setting of an evaluation spec nor a registered"):
        load_eval_spec(run / "eval.yaml")


class OwnTeacherToy(ToyTask):
    """The toy task, its teacher results kept in the run's own OUTPUT_DIR/teacher (teacher_shared = False)."""

    name = "own"
    teacher_shared = False


class StudentToy(ToyTask):
    """The toy task on the student only."""

    name = "alone"
    sides = ("student",)


def test_sides_and_unshared_teacher_results_go_where_they_belong(toy, tmp_path):
    from harness.eval.job import run_eval_spec, teacher_results_dir

    tasks.register_task(OwnTeacherToy())
    tasks.register_task(StudentToy())
    try:
        run = eval_run(tmp_path, "run-a", 0)
        spec = load_eval_spec(run / "eval.yaml", [f"teacher_cache={tmp_path / 'cache'}", "toy.examples=2",
                                                  "own.examples=3", "alone.examples=4"])
        report = run_eval_spec(spec, progress=False)
    finally:
        tasks.unregister_task("own")
        tasks.unregister_task("alone")
    shared, own = teacher_results_dir(spec), run / "eval" / "teacher"
    assert sorted(p.name for p in shared.iterdir()) == [TOY_FILE] and sorted(p.name for p in own.iterdir()) == [TOY_FILE]
    assert len((shared / TOY_FILE).read_text().splitlines()) == 2 and len((own / TOY_FILE).read_text().splitlines()) == 3
    assert report["own"]["teacher"]["scores"]["even"]["n"] == 3 and report["toy"]["teacher"]["scores"]["even"]["n"] == 2
    assert report["alone"]["teacher"] is None and report["alone"]["student"]["scores"]["even"]["n"] == 4


def test_the_copy_and_state_probes_run_in_the_evaluation_job_and_are_reported_and_paired(tmp_path):
    """issue 50: the copy probe (on by default) and the state probe (when the spec asks) run in the evaluation job for
    student and teacher, with their sections in report.md, their scores in report.json, paired rows in a comparison
    and curves along stage 3."""
    probes = ["copy={lengths: [16, 32], sequences: 3, induction: true}",
              "state={length: 256, sequences: 1, positions: [16, 256], samples: 2, distances: [32], kinds: [passkey]}"]
    runs = [eval_run(tmp_path, name, seed) for name, seed in (("run-a", 0), ("run-b", 1))]
    for run in runs:
        assert harness_main(["eval", str(run / "eval.yaml"), *probes]) == 0
    out = runs[0] / "eval"
    assert {"copy.json", "copy_sequences.jsonl", "state.json", "state_retrieval.jsonl"} <= {
        p.name for p in (out / "student").iterdir()}
    assert (out / "teacher" / "copy.json").is_file() and (out / "teacher" / "state_retrieval.jsonl").is_file()
    report = json.loads((out / "report.json").read_text())
    copy_scores = report["copy"]["student"]["scores"]
    assert copy_scores["after first"]["n"] == 6 and set(copy_scores) == {"after first", "after first, 16 tokens",
                                                                          "after first, 32 tokens"}
    assert report["state"]["teacher"]["scores"]["likelihood, 32 tokens apart"]["n"] == 2
    md = (out / "report.md").read_text()
    assert "## In-context copy" in md and "## State along the context" in md
    # each layer's largest-head induction and previous-token scores of copy.json, for student and teacher
    for side in ("student", "teacher"):
        probe = json.loads((out / side / "copy.json").read_text())["induction"]["16"]
        layers = report["copy"][side]["layers"]["16"]
        assert layers["induction"]["max"] == [e["max"] for e in probe["layers"]]
        assert layers["previous_token"]["max"] == [e["max"] for e in probe["previous_token"]["layers"]]
        assert layers["induction"]["chance"] == probe["chance"] and len(layers["induction"]["max"]) >= 2
    row = "| student | " + " | ".join(f"{v:.2f}" for v in report["copy"]["student"]["layers"]["16"]["induction"]["max"])
    assert "### Induction score per layer (16-token copies; the largest head" in md and row + " |" in md
    assert "### Previous-token score per layer (16-token copies" in md and "| teacher | " in md.split("per layer")[1]
    assert harness_main(["report", *map(str, runs), "--out", str(tmp_path / "cmp"), "--baseline", "run-a"]) == 0
    text = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "In-context copy (random tokens shown twice): after first | 6 |" in text
    table = text.split("### Induction score per layer")[1].split("###")[0]
    assert all(f"| {name} " in table for name in ("run-a", "run-b", "teacher")), table
    assert curves.METRICS["copy_after_first"][0](report) == copy_scores["after first"]["value"]


# ---------------------------------------------------------------------------------------------- eval.copy, eval.state


COPY_TODAY = {"lengths": [64, 256, 1024, 2048], "gap": 0, "sequences": 8, "token_low": 1000, "token_high": 20000,
              "seed": 0, "induction": True, "induction_max_length": 512, "batch_size": 4, "position_buckets": 8}


def _spec_file(root: Path, *overrides: str) -> tuple[Path, Any]:
    """RUN/eval.yaml written from a tiny job with `overrides`, its student folder made (an eval spec names one)."""
    out = root / "run"
    job = tiny_job(root, out, *overrides)
    (out / "student").mkdir(parents=True, exist_ok=True)
    return write_eval_spec(job, out / "student"), job


def test_a_job_without_eval_copy_or_eval_state_writes_the_copy_probe_with_induction_and_no_state_probe(tmp_path):
    path, job = _spec_file(tmp_path)
    written = OmegaConf.to_container(OmegaConf.load(path))
    assert written["copy"] == COPY_TODAY and written["state"] is None
    spec = load_eval_spec(path)
    assert tasks.get_task("copy").wanted(spec) and not tasks.get_task("state").wanted(spec)
    resolved = (path.parent / "job.yaml").read_text()
    assert "  copy:\n    lengths:\n    - 64\n" in resolved and "  state: null\n" in resolved


def test_eval_copy_and_eval_state_of_a_job_reach_eval_yaml_and_the_tasks_settings(tmp_path):
    path, job = _spec_file(tmp_path, "eval.copy.lengths=[64]",
                           "eval.state={length: 512, samples: 3, distances: [32, 128], kinds: [kv]}")
    written = OmegaConf.to_container(OmegaConf.load(path))
    assert written["copy"] == {**COPY_TODAY, "lengths": [64]}
    assert written["state"]["length"] == 512 and written["state"]["samples"] == 3
    assert written["state"]["distances"] == [32, 128] and written["state"]["kinds"] == ["kv"]
    spec = load_eval_spec(path)
    copy, state = tasks.get_task("copy").settings_of(spec), tasks.get_task("state").settings_of(spec)
    assert copy.lengths == [64] and copy.induction is True
    assert (state.length, state.samples, state.distances, state.kinds) == (512, 3, [32, 128], ["kv"])
    assert state.text == "essays" and state.every == 0  # the keys the job leaves out: the probe's defaults
    assert load_job(None, ["eval.state={}"]).eval.state == StateConfig()


def test_eval_copy_null_turns_the_copy_probe_off(tmp_path):
    path, _ = _spec_file(tmp_path, "eval.copy=null")
    assert OmegaConf.load(path)["copy"] is None
    assert not tasks.get_task("copy").wanted(load_eval_spec(path))


@pytest.mark.parametrize("override, message", [
    ("eval.copy.lengths=[1]", r"Bad value 1 in eval\.copy\.lengths: each must be at least 2\."),
    ("eval.copy.lengths=[64,64]", r"eval\.copy\.lengths=\[64, 64\] must name at least one length, each once\."),
    ("eval.copy.token_low=30000", r"eval\.copy\.token_low=30000 must be below eval\.copy\.token_high=20000"),
    ("eval.state={length: 512, positions: [600]}",
     r"eval\.state\.positions \[600\] lie beyond eval\.state\.length=512"),
    ("eval.state={kinds: [needle]}", r"Bad value 'needle' for eval\.state\.kinds\. Allowed: passkey, uuid, kv\."),
    ("eval.state.text=/nowhere/prose.txt", r"eval\.state\.text='/nowhere/prose\.txt' is no NIAH haystack: use one of "),
])
def test_bad_copy_or_state_settings_of_a_job_are_refused_naming_the_key(override, message, capsys):
    with pytest.raises(ConfigError, match=message):
        load_job(None, [override])
    assert harness_main(["info", str(Path(__file__).resolve().parents[1] / "jobs" / "quickstart.yaml"), override]) == 2
    assert re.search(message, capsys.readouterr().err)
    with pytest.raises(ConfigError, match=r"Bad value 1 in copy\.lengths"):  # outside a job: the spec's key
        CopyConfig(lengths=[1])


def test_the_evaluations_along_stage_3_shorten_the_jobs_probes_and_leave_the_teacher_cache_key(tmp_path):
    from harness.eval.during import write_during_spec
    from harness.eval.job import teacher_cache_key
    from harness.eval.spec import spec_from_job

    job = tiny_job(tmp_path, tmp_path / "run", "eval.copy.lengths=[64,128,512]", "eval.copy.induction=true",
                   "eval.state={samples: 5}")
    during = OmegaConf.load(write_during_spec(job, tmp_path / "run"))
    assert list(during["copy"].lengths) == [64, 128] and during["copy"].induction is False and during.state.samples == 2
    assert job.eval.copy.lengths == [64, 128, 512] and job.eval.state.samples == 5  # the job itself is untouched
    plain = tiny_job(tmp_path, tmp_path / "run")
    student = tmp_path / "run" / "student"
    assert teacher_cache_key(spec_from_job(job, student)) == teacher_cache_key(spec_from_job(plain, student))
