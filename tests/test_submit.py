"""`harness submit`: the rendered Slurm scripts and their dependency graph (as text), and that --dry-run shows
exactly what is submitted (sbatch replaced by a recorder here; tests/slurm runs a real Slurm)."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from harness.cli import main
from harness.config import ConfigError
from harness.launch.slurm import SlurmOptions, dependency_graph, plan_jobs, submit
from tests.pipeline import tiny_job

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def job_and_path(tmp_path):
    job = tiny_job(tmp_path / "setting", tmp_path / "run", "run.layer_groups=2", "deepspeed.world_size=8",
                   "eval.enabled=true")
    path = tmp_path / "job.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    return job, path


def recording_sbatch(tmp_path: Path, monkeypatch, first_id: int):
    """Put an `sbatch` on PATH that records each call (its argv and the script it was given) and prints job ids
    first_id, first_id + 1, ...; returns a function that reads the records back, in call order."""
    calls, recorder = tmp_path / "calls.jsonl", tmp_path / "sbatch"
    recorder.write_text(f"""#!/usr/bin/env python3
import json, os, sys
n = sum(1 for _ in open({str(calls)!r})) if os.path.exists({str(calls)!r}) else 0
with open({str(calls)!r}, 'a') as f:
    f.write(json.dumps({{"argv": sys.argv[1:], "script": open(sys.argv[-1]).read()}}) + "\\n")
print({first_id} + n)
""")
    recorder.chmod(recorder.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    return lambda: [json.loads(line) for line in calls.read_text().splitlines()]


def test_multi_node_rendering_and_graph(job_and_path):
    job, path = job_and_path
    opts = SlurmOptions(partition="gpu", account="proj", time="2:00:00", nodes=2, gpus_per_node=4)
    planned = plan_jobs(job, str(path), ["stages.distill.lr=3e-4"], opts, python="python3")
    assert [p.stage for p in planned] == ["align_mixer", "align_hidden", "merge", "distill", "eval"]
    align, hidden, merge, distill, evaluation = (p.script for p in planned)
    assert "#SBATCH --array=0-1" in align and "GROUPS_=(0-1 2-3)" in align
    assert "stage align-mixer" in align and "stages.distill.lr=3e-4" in align and '--layers "$LAYERS"' in align
    assert "#SBATCH --gpus-per-node=1" in align and "#SBATCH --partition=gpu" in align
    assert "#SBATCH --account=proj" in merge and "stage merge" in merge
    assert "#SBATCH --nodes=2" in distill and "#SBATCH --gpus-per-node=4" in distill
    assert "--nnodes=2 --nproc_per_node=4" in distill and "scontrol show hostnames" in distill
    assert "srun" in distill and 'rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"' in distill
    spec = (Path(job.output_dir) / "eval.yaml").resolve()
    assert f"-m harness.cli eval job {spec}" in evaluation and "#SBATCH --gpus-per-node=1" in evaluation
    assert "#SBATCH --nodes=1" in evaluation and "--signal=B:USR1@" in evaluation and "--requeue" in evaluation
    graph = dependency_graph(planned)
    assert "align_hidden (array of 2) after align_mixer succeeds" in graph
    assert "distill after merge succeeds" in graph and "eval after distill succeeds" in graph


def test_deepspeed_multi_node_rendering(job_and_path):
    """run.launcher=deepspeed: srun starts one deepspeed launcher per node (--no_ssh, node rank from Slurm, a
    hostfile of the allocation); --node-launch ssh runs one launcher that reaches the nodes over pdsh, the ranks'
    environment passed in DS_ENV_FILE."""
    job, path = job_and_path
    job.run.launcher = "deepspeed"
    distill = next(p.script for p in plan_jobs(job, str(path), ["a=b c"], SlurmOptions(nodes=2, gpus_per_node=4),
                                                 python="python3") if p.stage == "distill")
    hostfile = f'{(Path(job.output_dir) / "slurm").resolve()}/hostfile-"$SLURM_JOB_ID"'
    assert f"export HOSTFILE={hostfile}" in distill and "sed 's/$/ slots=4/' > \"$HOSTFILE\"" in distill
    assert ("srun --kill-on-bad-exit=1 bash -c 'exec python3 -m deepspeed.launcher.runner --hostfile \"$HOSTFILE\" "
            "--master_addr=\"$MASTER_ADDR\" --master_port=\"$MASTER_PORT\" --no_ssh --node_rank=\"$SLURM_NODEID\" --module "
            "harness.cli stage distill") in distill
    assert "torch.distributed.run" not in distill and "one deepspeed launcher per node" in distill
    ssh = next(p.script for p in plan_jobs(job, str(path), [], SlurmOptions(nodes=8, node_launch="ssh"),
                                             python="python3") if p.stage == "distill")
    assert "srun" not in ssh and "\npython3 -m deepspeed.launcher.runner --hostfile" in ssh and "--no_ssh" not in ssh
    assert 'export DS_ENV_FILE=' in ssh and "HARNESS_PREEMPT_FILE=" in ssh
    assert 'DS_ACCELERATOR=cpu > "$DS_ENV_FILE"' in ssh
    with pytest.raises(ConfigError, match="--node-launch ssh is the deepspeed launcher's pdsh mode"):
        plan_jobs(job, str(path), [], SlurmOptions(nodes=8, node_launch="ssh", launcher="torchrun"))
    with pytest.raises(ConfigError, match="Bad launcher 'mpirun' for stage 3. Allowed: torchrun, deepspeed"):
        plan_jobs(job, str(path), [], SlurmOptions(nodes=8, launcher="mpirun"))


def test_the_rendered_deepspeed_srun_command_gives_each_node_its_rank(job_and_path, tmp_path):
    """The srun line of the deepspeed rendering, run with srun and python replaced by recorders: each node's shell
    expands its own $SLURM_NODEID, the batch shell none."""
    job, path = job_and_path
    job.run.launcher = "deepspeed"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", 'shift; for n in 0 1; do SLURM_NODEID=$n "$@"; done'), ("python3", 'echo "$*"')):
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    distill = next(p.script for p in plan_jobs(job, str(path), [], SlurmOptions(nodes=2, gpus_per_node=4),
                                                 python="python3") if p.stage == "distill")
    line = next(x for x in distill.splitlines() if x.startswith("srun "))[:-2]  # without the trailing " &"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOSTFILE": "/h", "MASTER_ADDR": "n0",
           "MASTER_PORT": "29507"}
    ran = subprocess.run(["bash", "-c", line], capture_output=True, text=True, env=env, timeout=30)
    assert ran.returncode == 0, ran.stderr
    assert [x.split(" --module")[0].split()[-1] for x in ran.stdout.splitlines()] == ["--node_rank=0", "--node_rank=1"]
    assert "--hostfile /h --master_addr=n0 --master_port=29507" in ran.stdout


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_stage_3_jobs_sharing_a_node_rendezvous_on_ports_of_their_own(job_and_path, launcher):
    """The rendered script's MASTER_PORT line, run by bash for several job ids: one port per job id, the same on
    every node of a job, between 29500 and the ephemeral ports (a fixed port made two jobs on one node collide)."""
    job, path = job_and_path
    job.run.launcher = launcher
    distill = next(p.script for p in plan_jobs(job, str(path), [], SlurmOptions(nodes=2, gpus_per_node=4),
                                                 python="python3") if p.stage == "distill")
    line = next(x for x in distill.splitlines() if x.startswith("export MASTER_ADDR="))
    ports = []
    for job_id in ("1", "2", "1999", "2001", "48213"):
        ran = subprocess.run(["bash", "-c", f'{line}; echo "$MASTER_PORT"'], capture_output=True, text=True,
                             env={**os.environ, "SLURM_JOB_ID": job_id, "FIRST_NODE": "n0"}, timeout=30)
        assert ran.returncode == 0, ran.stderr
        ports.append(int(ran.stdout))
    assert ports == [29501, 29502, 31499, 29501, 29713]  # 29500 + id % 2000
    assert all(29500 <= p < 32768 for p in ports)


def test_world_size_must_match_the_allocation(job_and_path):
    job, path = job_and_path
    with pytest.raises(ConfigError, match="deepspeed.world_size=8"):
        plan_jobs(job, str(path), [], SlurmOptions(nodes=1, gpus_per_node=4))


def test_finished_stages_are_left_out(job_and_path):
    job, path = job_and_path
    from harness.checkpoint import CheckpointManager

    (Path(job.output_dir) / "merged").mkdir(parents=True)
    (Path(job.output_dir) / "merged" / "MERGE.json").write_text("{}")
    for stage in ("align_mixer", "align_hidden"):
        for group in ("layers-00-01", "layers-02-03"):
            d = Path(job.output_dir) / stage / group
            CheckpointManager(d).mark_complete({"steps": 1}, collective=False)
            (d / "weights.safetensors").write_text("")
    planned = plan_jobs(job, str(path), [], SlurmOptions(nodes=2, gpus_per_node=4))
    assert [p.stage for p in planned] == ["distill", "eval"] and planned[0].depends_on is None
    CheckpointManager(Path(job.output_dir) / "distill" / "checkpoints").mark_complete({"steps": 1}, collective=False)
    planned = plan_jobs(job, str(path), [], SlurmOptions(nodes=2, gpus_per_node=4))
    assert [p.stage for p in planned] == ["eval"] and planned[0].depends_on is None
    (Path(job.output_dir) / "eval.yaml").write_text("{}")
    (Path(job.output_dir) / "eval").mkdir()
    (Path(job.output_dir) / "eval" / "report.json").write_text("{}")
    assert plan_jobs(job, str(path), [], SlurmOptions(nodes=2, gpus_per_node=4)) == []


def test_post_training_follows_the_stage_3_evaluation_and_its_own_evaluation_follows_it(job_and_path, tmp_path,
                                                                                       monkeypatch):
    """stages.sft.enabled: SFT launched as stage 3 (--nodes x --gpus-per-node processes) after the stage-3
    evaluation, then the post-trained student's evaluation, each afterok on the one before; finished ones left out."""
    from harness.checkpoint import CheckpointManager

    job, path = job_and_path
    job.stages.sft.enabled = True
    out = Path(job.output_dir)
    opts = SlurmOptions(nodes=2, gpus_per_node=4)
    planned = plan_jobs(job, str(path), [], opts, python="python3")
    assert [p.stage for p in planned] == ["align_mixer", "align_hidden", "merge", "distill", "eval", "sft", "eval_sft"]
    distill, sft, evaluation, after = (next(p.script for p in planned if p.stage == s)
                                       for s in ("distill", "sft", "eval", "eval_sft"))
    assert "#SBATCH --job-name=job-distill" in distill and "# Stage 3 on 2 node(s) x 4 process(es)" in distill
    assert "#SBATCH --job-name=job-sft" in sft and "/sft-%j.log" in sft and "#SBATCH --nodes=2" in sft
    assert "--nnodes=2 --nproc_per_node=4" in sft and f"-m harness.cli stage sft {path.resolve()}" in sft
    assert "stage distill" not in sft and "# SFT (post-training of RUN_DIR/student) on 2 node(s)" in sft
    assert "#SBATCH --job-name=job-eval\n" in evaluation and "The evaluation job on the distilled student" in evaluation
    assert "#SBATCH --job-name=job-eval_sft" in after and "/eval_sft-%j.log" in after
    assert f"-m harness.cli eval job {(out / 'eval-sft.yaml').resolve()}" in after
    assert "#SBATCH --gpus-per-node=1" in after and "#SBATCH --nodes=1" in after
    graph = dependency_graph(planned)
    assert "sft after eval succeeds" in graph and "eval_sft after sft succeeds" in graph

    records_of = recording_sbatch(tmp_path, monkeypatch, first_id=200)
    submit(job, planned)
    assert [r["argv"][1] for r in records_of()][-2:] == ["--dependency=afterok:204", "--dependency=afterok:205"]

    CheckpointManager(out / "distill" / "checkpoints").mark_complete({"steps": 1}, collective=False)
    (out / "merged").mkdir(parents=True)
    (out / "merged" / "MERGE.json").write_text("{}")
    for stage in ("align_mixer", "align_hidden"):
        for group in ("layers-00-01", "layers-02-03"):
            CheckpointManager(out / stage / group).mark_complete({"steps": 1}, collective=False)
            (out / stage / group / "weights.safetensors").write_text("")
    for spec, results in (("eval.yaml", ["eval/report.json"]),
                          ("eval-sft.yaml", ["eval-sft/report.json", "eval-sft/comparison/comparison.json"])):
        (out / spec).write_text("{}")
        for result in results:
            (out / result).parent.mkdir(parents=True, exist_ok=True)
            (out / result).write_text("{}")
    assert [(p.stage, p.depends_on) for p in plan_jobs(job, str(path), [], opts)] == [("sft", None),
                                                                                      ("eval_sft", "sft")]
    CheckpointManager(out / "sft" / "checkpoints").mark_complete({"steps": 1}, collective=False)
    assert plan_jobs(job, str(path), [], opts) == []  # everything finished (the SFT evaluation's reports too)
    (out / "eval-sft" / "comparison" / "comparison.json").unlink()  # the comparison missing: evaluated again
    assert [(p.stage, p.depends_on) for p in plan_jobs(job, str(path), [], opts)] == [("eval_sft", None)]
    job.eval.enabled = False
    assert plan_jobs(job, str(path), [], opts) == []


def test_dry_run_shows_what_is_submitted(job_and_path, tmp_path, capsys, monkeypatch):
    job, path = job_and_path
    args = ["submit", str(path), "--nodes", "2", "--gpus-per-node", "4", "--partition", "gpu"]
    assert main(args + ["--dry-run"]) == 0
    shown = capsys.readouterr().out
    records_of = recording_sbatch(tmp_path, monkeypatch, first_id=100)
    assert main(args) == 0
    records = records_of()
    assert [r["argv"][1:-1] for r in records] == [[], ["--dependency=afterok:100", "--kill-on-invalid-dep=no"],
                                                  ["--dependency=afterok:101", "--kill-on-invalid-dep=no"],
                                                  ["--dependency=afterok:102", "--kill-on-invalid-dep=no"],
                                                  ["--dependency=afterok:103", "--kill-on-invalid-dep=no"]]
    for r in records:
        assert r["script"] in shown  # the dry run printed exactly the submitted script
    saved = json.loads((Path(job.output_dir) / "slurm" / "jobs.json").read_text())
    assert saved["jobs"] == {"align_mixer": "100", "align_hidden": "101", "merge": "102", "distill": "103",
                             "eval": "104"}


@pytest.mark.parametrize("stage, requeued, says", [
    ('touch "$HARNESS_STOPPED_FILE"; exit 85', True, "preempted: requeueing job 7"),
    # torchrun's exit 1 for a worker that stopped cleanly on the request
    ('touch "$HARNESS_PREEMPT_FILE" "$HARNESS_STOPPED_FILE"; exit 1', True, "preempted: requeueing job 7"),
    # a failure while stopping (seen on the H200: the stop's checkpoint ran out of disk) is requeued, and says so
    ('touch "$HARNESS_PREEMPT_FILE"; exit 1', True, "failed (exit 1) while stopping, before its checkpoint"),
    ("exit 3", False, ""),
])
def test_the_requeue_wrapper_requeues_a_preempted_stage_and_says_whether_it_had_checkpointed(
        tmp_path, stage, requeued, says):
    from harness.launch.slurm import REQUEUE_WRAPPER
    from harness.preempt import REQUEUE_EXIT

    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$*" >> "{calls}"\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    script = REQUEUE_WRAPPER.format(preempt_dir=tmp_path, command=f"sh -c '{stage}'", requeue_exit=REQUEUE_EXIT)
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7"})
    assert result.returncode == (0 if requeued else 3), result.stderr
    assert (calls.read_text() if calls.exists() else "") == ("requeue 7\n" if requeued else "")
    assert says in result.stdout + result.stderr


# ------------------------------------------------------------------------------- values rendered into scripts


def sbatch_arguments(script: str) -> list[str]:
    """The options sbatch reads from a script's #SBATCH lines, split as Slurm's own parser splits them
    (src/sbatch/opt.c, `_get_argument`): whitespace separates, "..." and '...' group, a backslash takes the next
    character literally, an unquoted # ends the line."""
    args: list[str] = []
    for line in script.splitlines():
        if not line.startswith("#SBATCH"):
            continue
        text, i = line[len("#SBATCH"):], 0
        while i < len(text):
            while i < len(text) and text[i].isspace():
                i += 1
            arg, quote = "", None
            while i < len(text) and (quote or not text[i].isspace()):
                c = text[i]
                if c == "\\":
                    arg, i = arg + text[i + 1], i + 2
                    continue
                if quote and c == quote:
                    quote = None
                elif not quote and c in "\"'":
                    quote = c
                elif not quote and c == "#":
                    i = len(text)
                    break
                else:
                    arg += c
                i += 1
            assert quote is None, f"unmatched quote in {line!r}"
            if arg:
                args.append(arg)
    return args


def fake_cluster(bin_dir: Path, record: Path) -> dict:
    """srun, scontrol and a python that records its arguments (one ARG: line each) and HARNESS_PREEMPT_FILE."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    fakes = {
        "srun": 'while [[ "$1" == -* ]]; do shift; done; exec "$@"',
        "scontrol": 'case "$1 $2" in "show hostnames") echo n0;; "show node") echo "NodeName=n0 NodeAddr=10.0.0.1";;'
                    ' esac',
        "python3": f'{{ echo "---"; echo "PREEMPT:$HARNESS_PREEMPT_FILE"; printf "ARG:%s\\n" "$@"; }} >> {record}',
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
            "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_NODELIST": "n0", "SLURM_NODEID": "0"}


def test_paths_with_spaces_and_dollars_arrive_as_one_argument(tmp_path):
    """A run directory, job file, working folder and python path holding spaces, `$`, quotes, `;` and `%`: every script
    passes `bash -n`, sbatch reads each #SBATCH value as one argument, and run with fakes of srun, scontrol and
    python, each command gets the job file and the preemption file intact."""
    odd = "dir with space $HOME ;'\"%x"
    out, bin_dir, work = tmp_path / f"run {odd}", tmp_path / f"bin {odd}", tmp_path / f"work {odd}"
    work.mkdir()
    job = tiny_job(tmp_path / "setting", out, "run.layer_groups=2", "eval.enabled=true")
    path = tmp_path / f"job {odd}.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    (out / "slurm").mkdir(parents=True)  # as submit() makes it: the hostfile goes there
    record = tmp_path / "calls"
    env = fake_cluster(bin_dir, record)
    opts = SlurmOptions(partition="gpu a", time="1-00:00:00", extra=["--comment=a b # c", "--qos=high"])
    for launcher in ("torchrun", "deepspeed"):
        job.run.launcher = launcher
        planned = plan_jobs(job, str(path), ["stages.distill.lr=3e-4"], opts, python=str(bin_dir / "python3"),
                            workdir=work)
        assert [p.stage for p in planned] == ["align_mixer", "align_hidden", "merge", "distill", "eval"]
        for p in planned:
            assert subprocess.run(["bash", "-n"], input=p.script, text=True).returncode == 0, p.stage
            args = sbatch_arguments(p.script)
            output = next(a for a in args if a.startswith("--output="))
            assert output.startswith(f"--output={str((out / 'logs').resolve()).replace('%', '%%')}/"), output
            assert {"--partition=gpu a", "--comment=a b # c", "--qos=high", "--time=1-00:00:00"} <= set(args)
            record.unlink(missing_ok=True)
            ran = subprocess.run(["bash", "-c", p.script], capture_output=True, text=True, env=env, cwd=tmp_path,
                                 timeout=60)
            assert ran.returncode == 0, (p.stage, ran.stderr)
            calls = record.read_text().split("---\n")[1:]
            assert calls, p.stage
            for call in calls:
                lines = call.splitlines()
                assert lines[0] == f"PREEMPT:{(out / 'slurm').resolve()}/preempt-7", p.stage
                argv = [x[len("ARG:"):] for x in lines[1:]]
                wanted = str((out / "eval.yaml").resolve()) if p.stage == "eval" else str(path.resolve())
                assert wanted in argv, (p.stage, argv)
    with pytest.raises(ConfigError, match="--node-launch ssh cannot carry"):
        plan_jobs(job, str(path), [], SlurmOptions(node_launch="ssh"), python="python3", workdir=work)


@pytest.mark.parametrize("name", ["a b;$(touch X)", "a\nb", "-x", "name/with/slash", "ü"])
def test_a_job_name_outside_the_allowed_characters_is_refused(job_and_path, tmp_path, monkeypatch, capsys, name):
    job, path = job_and_path
    job.name = name
    with pytest.raises(ConfigError, match=rf"name {re.escape(repr(name))} cannot name Slurm jobs: `name` may hold "
                                          r"only letters, digits and \. _ - \+"):
        plan_jobs(job, str(path), [], SlurmOptions(nodes=2, gpus_per_node=4))
    monkeypatch.chdir(tmp_path)
    assert main(["submit", str(path), f"name={name}", "--nodes", "2", "--gpus-per-node", "4", "--dry-run"]) == 2
    assert "`name` may hold only" in capsys.readouterr().err and not (tmp_path / "X").exists()


def test_every_job_file_has_a_name_slurm_accepts():
    from harness.launch.slurm import check_name

    names = {f: OmegaConf.load(f).get("name", "job") for f in (REPO / "jobs").rglob("*.yaml")}
    assert len(names) > 50
    for f, name in names.items():
        check_name(name)


@pytest.mark.parametrize("value, ok", [
    ("90", True), ("90:30", True), ("2:00:00", True), ("1-12", True), ("1-12:30", True), ("1-12:30:00", True),
    ("UNLIMITED", True), ("infinite", True), ("banana", False), ("2h", False), ("1-", False), ("1:2:3:4", False),
    ("2:00:00\n#SBATCH --x", False), ("", True),  # empty: no limit given
])
def test_time_limits_take_slurm_forms_only(value, ok):
    if ok:
        SlurmOptions(time=value)
    else:
        with pytest.raises(ConfigError, match=f"--time {re.escape(repr(value))} is not a Slurm time limit. Allowed "
                                              "forms: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS"):
            SlurmOptions(time=value)


def test_submit_time_banana_exits_2(job_and_path, capsys):
    job, path = job_and_path
    assert main(["submit", str(path), "--nodes", "2", "--gpus-per-node", "4", "--time", "banana", "--dry-run"]) == 2
    assert "--time 'banana' is not a Slurm time limit" in capsys.readouterr().err


def test_sbatch_values_that_cannot_be_one_line_are_refused():
    with pytest.raises(ConfigError, match="--partition 'gpu\\\\n#SBATCH --x' holds a line break"):
        SlurmOptions(partition="gpu\n#SBATCH --x")
    with pytest.raises(ConfigError, match="--sbatch-option 'qos=high' is not an sbatch option"):
        SlurmOptions(extra=["qos=high"])
    assert SlurmOptions(extra=["-p gpu", "--exclusive"]).resources(0) == "#SBATCH -p gpu\n#SBATCH --exclusive"


# ------------------------------------------------------------------------------------------- without Slurm


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"/"
            for p in sorted(folder.rglob("*"))} if folder.exists() else {}


def fake_sbatch(tmp_path: Path, monkeypatch, body: str) -> None:
    """Only this sbatch on PATH (first), its body a bash script."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "sbatch").write_text(f"#!/bin/bash\n{body}\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


CONTROLLER_DOWN = ('echo "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect '
                   'failure)" >&2; exit 1')


def test_submit_without_sbatch_says_what_to_do_and_writes_nothing(job_and_path, tmp_path, monkeypatch, capsys):
    job, path = job_and_path
    out = Path(job.output_dir)
    before = files_under(out)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert main(["submit", str(path), "--nodes", "2", "--gpus-per-node", "4"]) == 2
    err = capsys.readouterr().err
    assert "needs Slurm's `sbatch`, and there is none on PATH" in err and "harness run JOB" in err
    assert "--dry-run" in err and "login node" in err and err.count("\n") == 1  # one paragraph
    assert files_under(out) == before


def test_submit_when_no_controller_answers_leaves_nothing_behind(job_and_path, tmp_path, monkeypatch, capsys):
    job, path = job_and_path
    out = Path(job.output_dir)
    (out / "slurm").mkdir(parents=True, exist_ok=True)
    (out / "slurm" / "merge.sbatch").write_text("an earlier submission's script")
    before = files_under(out)
    fake_sbatch(tmp_path, monkeypatch, CONTROLLER_DOWN)
    assert main(["submit", str(path), "--nodes", "2", "--gpus-per-node", "4"]) == 2
    err = capsys.readouterr().err
    assert ("sbatch could not submit the align_mixer job: sbatch: error: Batch job submission failed: Unable to "
            "contact slurm controller (connect failure). Nothing was submitted") in err
    assert "login node" in err and "harness run JOB" in err and err.count("\n") == 1
    assert files_under(out) == before and not (out / "slurm" / "job.yaml").exists()
    shutil.rmtree(out / "slurm")
    before = files_under(out)
    assert main(["submit", str(path), "--nodes", "2", "--gpus-per-node", "4"]) == 2
    assert files_under(out) == before  # the folders it made are gone too


def test_a_later_sbatch_failure_records_the_jobs_already_submitted(job_and_path, tmp_path, monkeypatch, capsys):
    job, path = job_and_path
    out = Path(job.output_dir)
    count = tmp_path / "count"
    fake_sbatch(tmp_path, monkeypatch, f'echo x >> {count}; [ "$(wc -l < {count})" -le 2 ] || {{ {CONTROLLER_DOWN}; }}'
                                       f'; echo $((99 + $(wc -l < {count})))')
    assert main(["submit", str(path), "--nodes", "2", "--gpus-per-node", "4"]) == 2
    err = capsys.readouterr().err
    assert "could not submit the merge job" in err and "Submitted before it: align_mixer 100, align_hidden 101" in err
    assert f"harness submit --resume {out}" in err and "scancel 100 101" in err
    saved = json.loads((out / "slurm" / "jobs.json").read_text())
    assert saved["jobs"] == {"align_mixer": "100", "align_hidden": "101"}
    assert (out / "slurm" / "job.yaml").is_file()  # what --resume reads
