"""`harness run` end to end on the tiny CPU setting: all stages, the student loads with transformers, and a
second run skips everything that is finished."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

import harness  # noqa: F401  (registers the student classes)
from tests.pipeline import make_setting, tiny_job

REPO = Path(__file__).resolve().parents[1]


def harness_cli(*args: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **extra_env}
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)


TINY_EVAL = ["eval.enabled=true", "eval.tasks=[piqa]", "eval.limit=2", "eval.niah.lengths=[256]",
             "eval.niah.depths=[0.5]", "eval.niah.kinds=[kv]", "eval.niah.samples=1", "eval.perplexity_tokens=64"]
TINY_DURING = ["eval.every_tokens=256", "eval.during.tasks=[piqa]", "eval.during.limit=2",
               "eval.during.niah_lengths=[256]", "eval.during.perplexity_tokens=64"]


def test_a_run_stopped_in_stage_1_resumes_evaluates_along_stage_3_and_a_rerun_skips_everything(tmp_path):
    """One run's whole life, shared by the properties of a local run (each a full pipeline of its own would cost
    ~40 s of process start-up on a CI core): a preemption request during stage 1 stops it with both layer groups
    checkpointed and the requeue exit; the rerun resumes and goes to the end, every part timed, evaluating
    snapshots of stage 3 into the run's history beside training and the final student, whose report and curves
    `harness report` draws; a third run skips every finished part and evaluates nothing twice."""
    from harness.eval import history
    from harness.preempt import REQUEUE_EXIT

    out = tmp_path / "run"
    job = tiny_job(tmp_path / "setting", out, "budget.split=[0.1,0.1,0.8]", "run.layer_groups=2",
                   "run.parallel_groups=2", "data.validation_tokens=128", *TINY_EVAL, *TINY_DURING,
                   "eval.during.at_start=true", total=1280)
    job_path = tmp_path / "job.yaml"
    job_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))

    flag = tmp_path / "stop"
    flag.touch()  # set for the run only, not in this process: in-process tests may watch for it
    stopped = harness_cli("run", str(job_path), HARNESS_PREEMPT_FILE=str(flag))
    assert stopped.returncode == REQUEUE_EXIT, stopped.stderr[-3000:]
    assert "stopped on a preemption request" in stopped.stderr and "run the same command again" in stopped.stderr
    assert "align_mixer: " in stopped.stdout and "(preempted)" in stopped.stdout
    for group in ("layers-00-01", "layers-02-03"):  # both groups checkpointed (neither was killed by the other)
        assert list((out / "align_mixer" / group / "checkpoints").glob("step-*")), group

    resumed = harness_cli("run", str(job_path))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    for stage in ("align_mixer", "align_hidden"):
        for group in ("layers-00-01", "layers-02-03"):
            assert (out / stage / group / "weights.safetensors").is_file()
    assert "losses (first -> last logged)" in resumed.stdout and "distill" in resumed.stdout
    # the stopped attempt's wall time is kept: a part's time over several attempts is the sum of its lines
    timings = [json.loads(line) for line in (out / "logs" / "timings.jsonl").read_text().splitlines()]
    assert [(t["part"], t["outcome"]) for t in timings] == [
        ("align_mixer", "preempted"), ("align_mixer", "done"), ("align_hidden", "done"), ("merge", "done"),
        ("distill", "done"), ("eval", "done")]
    assert all(t["seconds"] > 0 for t in timings)
    assert timings[1]["groups"] == 2 and timings[1]["parallel"] == 2
    assert "[harness] align_mixer: " in resumed.stdout and " s wall" in resumed.stdout
    assert "# Evaluation:" in resumed.stdout and "| piqa | acc_norm | 2 |" in resumed.stdout
    assert (out / "eval" / "report.json").is_file() and (out / "eval" / "teacher" / "niah.json").is_file()
    spec = OmegaConf.load(out / "eval.yaml")
    student = AutoModelForCausalLM.from_pretrained(spec.checkpoint)
    ids = torch.randint(1, 300, (1, 12))
    assert torch.isfinite(student(ids).logits).all()

    entries = history.read_history(out / "eval")
    # stage 3 trains 1024 tokens at 64 per step: the merged student at its start (eval.during.at_start), snapshots
    # at 256, 512, 768, and the end (1024)
    log = (out / "logs" / "eval-during.log").read_text()
    assert [e["tokens"] for e in entries] == [0, 256, 512, 768, 1024], log
    assert [e["step"] for e in entries] == [0, 4, 8, 12, 16]
    assert entries[0]["checkpoint"] == str((out / "merged").resolve()) and (out / "merged" / "config.json").is_file()
    assert not history.pending_marks(out) and not list((out / "eval" / "snapshots").glob("tokens-*"))
    for e in entries:
        assert e["report"]["tasks"]["piqa"]["n"] == 2 and e["params"] > 0 and e["mixer"] == "gated_deltanet"
        assert e["report"]["perplexity"]["student"] > 1
    ppl = [e["report"]["perplexity"]["student"] for e in entries]
    assert ppl[-1] < ppl[0]  # training lowers held-out perplexity along the curve

    report = harness_cli("report", str(out), "--out", str(tmp_path / "curves"), "--plateau-threshold", "0.01")
    assert report.returncode == 0, report.stderr[-2000:]
    curves = json.loads((tmp_path / "curves" / "curves.json").read_text())
    run = next(iter(curves["runs"].values()))
    assert run["metrics"]["perplexity"]["tokens"] == [0, 256, 512, 768, 1024]
    assert (tmp_path / "curves" / "curve_perplexity.png").stat().st_size > 1000
    assert "5 evaluations" in report.stdout

    again = harness_cli("run", str(job_path))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "align_mixer: 2 layer groups, 2 already complete" in again.stdout
    assert "align_hidden: 2 layer groups, 2 already complete" in again.stdout
    for part in ("merge", "distill", "eval"):
        assert f"{part}: already complete" in again.stdout
    assert [e["tokens"] for e in history.read_history(out / "eval")] == [0, 256, 512, 768, 1024]


def test_run_reports_a_failing_group_and_its_log(tmp_path):
    out = tmp_path / "run"
    job = tiny_job(tmp_path / "setting", out, "budget.split=[0.1,0.1,0.8]", "run.layer_groups=2", total=1280)
    job_path = tmp_path / "job.yaml"
    job_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    # a stage-1 group can not start: its folder is a file
    (out / "align_mixer").mkdir(parents=True)
    (out / "align_mixer" / "layers-02-03").write_text("not a directory")
    result = harness_cli("run", str(job_path))
    assert result.returncode == 1
    assert "align_mixer layers 2-3 failed" in result.stderr and "align_mixer-layers-02-03.log" in result.stderr


def test_layer_groups_are_pinned_to_the_gpus_this_process_may_use(monkeypatch):
    from harness.launch import local

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert local._gpus() == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # e.g. two studies sharing a node, one per GPU pair
    assert local._gpus() == ["3", "5"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert local._gpus() == ["1"]


def test_a_stage_that_fails_while_preemption_is_requested_counts_as_preempted_only_if_it_marked_its_stop(
        tmp_path, monkeypatch):
    """torchrun turns a worker's requeue exit (85) into its own exit 1 (seen on the H200: a preempted stage 3 under
    torchrun exited 1), so under a preemption request `harness run` reads exit 1 as a clean stop when the process
    touched its $HARNESS_STOPPED_FILE, and as a failure when it did not (seen on the H200: the stop's checkpoint
    write ran out of disk, and the run said it had written a checkpoint)."""
    from harness.launch.local import StageFailed, StagePreempted, stage_error, stopped_marker
    from harness.preempt import REQUEUE_EXIT

    flag, marker = tmp_path / "stop", stopped_marker(tmp_path / "distill.log")
    monkeypatch.setenv("HARNESS_PREEMPT_FILE", str(flag))
    assert type(stage_error("distill", 1, "see above", marker)) is StageFailed
    assert type(stage_error("distill", REQUEUE_EXIT, "see above", marker)) is StagePreempted
    flag.touch()
    try:
        failed_stop = stage_error("distill", 1, "see above", marker)
        assert type(failed_stop) is StageFailed and "before it had written its checkpoint" in str(failed_stop)
        marker.touch()
        assert type(stage_error("distill", 1, "see above", marker)) is StagePreempted
    finally:
        flag.unlink()


def test_a_process_marks_its_clean_stop_for_the_launcher(tmp_path, monkeypatch):
    from harness.launch.local import stopped_marker, with_stopped_marker
    from harness.preempt import REQUEUE_EXIT, Preempted

    marker = stopped_marker(tmp_path / "align_mixer-layers-00-01.log")
    marker.touch()  # left by an earlier attempt: starting a process clears it
    env = with_stopped_marker({}, marker)
    assert not marker.exists()
    monkeypatch.setenv("HARNESS_STOPPED_FILE", env["HARNESS_STOPPED_FILE"])
    assert Preempted().code == REQUEUE_EXIT and marker.exists()


def test_a_stage_killed_by_the_stop_signal_before_its_handler_counts_as_preempted(tmp_path, monkeypatch):
    """`harness run` passes SIGTERM on; a stage process still importing (no handler yet) dies of it, with nothing
    done: a clean stop, not a failure. Without a stop request the same death is a failure."""
    import signal

    from harness.launch.local import StageFailed, StagePreempted, stage_error, stopped_marker

    marker, flag = stopped_marker(tmp_path / "merge.log"), tmp_path / "stop"
    monkeypatch.setenv("HARNESS_PREEMPT_FILE", str(flag))
    assert type(stage_error("merge", -signal.SIGTERM, "see its log", marker)) is StageFailed
    flag.touch()
    assert type(stage_error("merge", -signal.SIGTERM, "see its log", marker)) is StagePreempted
    assert type(stage_error("merge", -signal.SIGKILL, "see its log", marker)) is StageFailed


def test_a_rerun_with_other_eval_settings_rewrites_the_spec_so_the_evaluation_runs_again(tmp_path):
    """A finished run's eval.yaml is written at the end of stage 3; a rerun of the finished run with another `eval:`
    section must not find the old report newer than the old spec and call the evaluation done."""
    from harness.eval.spec import write_eval_spec
    from harness.launch.local import refresh_eval_spec

    out = tmp_path / "run"
    job = tiny_job(tmp_path, out, "eval.limit=4")
    (out / "student").mkdir(parents=True)
    spec = write_eval_spec(job, out / "student")
    os.utime(spec, (1, 1))
    refresh_eval_spec(job)
    assert spec.stat().st_mtime == 1  # the same settings: left as it was
    refresh_eval_spec(tiny_job(tmp_path, out, "eval.limit=8"))
    assert spec.stat().st_mtime > 1 and "limit: 8" in spec.read_text()


def test_run_with_post_training_runs_sft_and_both_evaluations_and_resumes_after_a_kill_inside_sft(tmp_path):
    """stages.sft.enabled: `harness run` goes on after stage 3 and its evaluation to SFT, the post-trained student's
    evaluation (the teacher's results shared with the first) and the two students side by side with paired
    differences. SFT is killed (SIGKILL) right after its first checkpoint: the run fails, and the rerun skips
    everything finished and resumes SFT from that checkpoint (each step logged once) to the end."""
    import signal
    import time

    from transformers import AutoTokenizer

    from tests.test_sft import TEMPLATE, conversations

    root = tmp_path / "setting"
    teacher_dir, _ = make_setting(root)
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)  # an instruct teacher: its tokenizer has a chat template
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(teacher_dir)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(160, seed=3)))
    out = tmp_path / "run"
    job = tiny_job(root, out, "name=tiny", "budget.split=[0.1,0.1,0.8]", "run.layer_groups=1",
                   "run.parallel_groups=1", "data.validation_tokens=128", "run.checkpoint_every_tokens=256",
                   "stages.sft.enabled=true", f"instructions.source={chats}", "instructions.seq_len=96",
                   "instructions.validation_conversations=8", "stages.sft.micro_batch_size=2", "stages.sft.lr=3e-3",
                   "stages.sft.tokens=800", "eval.enabled=true", "eval.tasks=[]", "eval.copy=null",
                   "eval.niah.lengths=[256]", "eval.niah.depths=[0.5]", "eval.niah.kinds=[kv]",
                   "eval.niah.samples=1", "eval.perplexity_tokens=64", total=640)
    job_path = tmp_path / "job.yaml"
    job_path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))

    pauses, log = tmp_path / "pauses", tmp_path / "first.log"
    pauses.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HARNESS_FAILPOINTS": "checkpoint.saved=pause@1",
           "HARNESS_FAILPOINTS_ONLY": "stage sft", "HARNESS_FAILPOINTS_DIR": str(pauses)}
    env.pop("HARNESS_PREEMPT_FILE", None)
    with open(log, "w") as handle:
        first = subprocess.Popen([sys.executable, "-m", "harness.cli", "run", str(job_path)], cwd=REPO, env=env,
                                 stdout=handle, stderr=subprocess.STDOUT)
    try:
        marker, deadline = pauses / "checkpoint.saved", time.time() + 600
        while not marker.exists():
            assert first.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert (out / "eval" / "report.json").is_file()  # SFT comes after the distilled student's evaluation
        os.kill(int(marker.read_text()), signal.SIGKILL)  # the SFT process, paused right after its checkpoint
        assert first.wait(timeout=120) == 1
    finally:
        if first.poll() is None:
            first.kill()
    output = log.read_text()
    assert "sft failed (exit -9)" in output, output[-3000:]
    saved = [int(p.name.split("-")[1]) for p in (out / "sft" / "checkpoints").glob("step-*")]
    assert saved and not (out / "student-sft").exists()

    second = harness_cli("run", str(job_path))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    for done in ("merge", "distill", "eval"):
        assert f"{done}: already complete" in second.stdout
    steps = [json.loads(line)["step"] for line in (out / "sft" / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    complete = json.loads((out / "sft" / "checkpoints" / "COMPLETE.json").read_text())
    assert max(saved) < complete["meta"]["step"]  # killed inside SFT, before its last step
    assert steps == list(range(1, complete["meta"]["step"] + 1))  # resumed from the checkpoint: nothing redone
    timings = [(t["part"], t["outcome"])
               for t in map(json.loads, (out / "logs" / "timings.jsonl").read_text().splitlines())]
    assert timings[:6] == [("align_mixer", "done"), ("align_hidden", "done"), ("merge", "done"), ("distill", "done"),
                           ("eval", "done"), ("sft", "failed")]
    assert timings[-2:] == [("sft", "done"), ("eval-sft", "done")]

    after = json.loads((out / "eval-sft" / "report.json").read_text())
    assert Path(after["student_dir"]) == (out / "eval-sft" / "student").resolve()
    assert Path(after["teacher_dir"]) == (out / "eval" / "teacher").resolve()  # the teacher was scored once
    assert not (out / "eval-sft" / "teacher").exists() and after["label"] == "tiny-sft"
    comparison = (out / "eval-sft" / "comparison" / "comparison.md").read_text()
    assert "### tiny-sft (B) - tiny (A)" in comparison and "| NIAH exact match, overall | 1 |" in comparison
    assert "No paired differences" not in comparison
    pairs = json.loads((out / "eval-sft" / "comparison" / "comparison.json").read_text())["paired"]
    assert [r["label"] for r in json.loads((out / "eval-sft" / "comparison" / "comparison.json").read_text())["runs"]] \
        == ["tiny", "tiny-sft"] and pairs[0]["shared_teacher"]
    assert "before and after side by side" in second.stdout
