"""harness.preflight: a job checked against its output_dir and its teacher's config before any weights load, and
the commands that call it (one paragraph, exit 2)."""

from __future__ import annotations

import errno
import os
import subprocess
import types
from pathlib import Path

import pytest

from harness.cli import main
from harness.config import ConfigError, load_job
from harness.preflight import check_output_dir, preflight, trained_lengths
from tests.pipeline import make_setting


@pytest.fixture(scope="module")
def setting(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny pipeline's 4-layer teacher (max_position_embeddings 512) and corpus."""
    return make_setting(tmp_path_factory.mktemp("setting"))


@pytest.fixture()
def job_args(setting, tmp_path) -> list[str]:
    """A job file (a name only) and the overrides that point it at the tiny teacher, its corpus and tmp_path/run."""
    teacher, corpus = setting
    (tmp_path / "job.yaml").write_text("name: preflight\n")
    return [str(tmp_path / "job.yaml"), f"teacher.source={teacher}", f"data.source={corpus}", "data.seq_len=32",
            "data.validation_tokens=256", f"data.cache_dir={tmp_path / 'cache'}", "budget.total_tokens=40960",
            f"output_dir={tmp_path / 'run'}", "run.device=cpu", "eval.enabled=false",
            *(f"stages.{s}.micro_batch_size=2" for s in ("align_mixer", "align_hidden", "distill"))]


@pytest.fixture()
def no_weights(monkeypatch):
    """Loading a teacher fails the test: preflight must refuse the job before any weights load."""
    import harness.teacher

    def refuse(*args, **kwargs):
        raise AssertionError("a teacher was loaded before the job was checked")

    monkeypatch.setattr(harness.teacher, "load_teacher", refuse)


def one_paragraph(capsys) -> str:
    """The stderr of a command that exited 2: one line, 'error: ...'."""
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err[len("error: "):].strip()


# ------------------------------------------------------------------------------------------- output_dir


def test_an_output_dir_that_is_a_file_is_refused(job_args, tmp_path, capsys, no_weights):
    (tmp_path / "taken").write_text("not a directory")
    assert main(["run", *job_args, f"output_dir={tmp_path / 'taken'}"]) == 2
    assert one_paragraph(capsys).startswith(f"output_dir='{tmp_path / 'taken'}' is a file, not a directory")
    with pytest.raises(ConfigError, match=f"lies under '{tmp_path / 'taken'}', which is a file"):
        check_output_dir(str(tmp_path / "taken" / "run"))


def _mount_read_only(folder: Path) -> bool:
    """Mount an empty read-only tmpfs on `folder`; False where this process may not mount."""
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture()
def read_only_dir(tmp_path, monkeypatch):
    """(a folder no file can be created in, the phrase preflight gives for it). Not root: chmod 0o555 (EACCES).
    Root ignores modes: a read-only tmpfs mounted on the folder (EROFS) where `mount` works, else harness.preflight's
    probe is patched to fail as on a read-only file system."""
    folder = tmp_path / "locked"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder, "is not writable by this user (permission denied)"
        folder.chmod(0o755)
        return
    if _mount_read_only(folder):
        try:
            yield folder, "is on a read-only file system"
        finally:
            subprocess.run(["umount", str(folder)], check=False, timeout=30)
        return
    import harness.preflight

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(harness.preflight, "tempfile", types.SimpleNamespace(mkstemp=read_only))
    yield folder, "is on a read-only file system"


def test_an_output_dir_that_cannot_be_written_is_refused(job_args, read_only_dir, capsys, no_weights):
    folder, why = read_only_dir
    out = folder / "runs" / "a"
    assert main(["stage", "align-mixer", *job_args, f"output_dir={out}", "--layers", "0"]) == 2
    assert one_paragraph(capsys) == (f"output_dir='{out}' cannot be written: '{folder}', the part of its path that "
                                     f"exists, {why}; choose an output_dir on a writable file system (one this user "
                                     "may write to).")
    with pytest.raises(ConfigError, match=f"output_dir='{folder}' cannot be written: it {why}"):
        check_output_dir(str(folder))


def test_the_probe_names_each_cause_and_leaves_nothing(tmp_path, monkeypatch):
    import harness.preflight

    check_output_dir(str(tmp_path / "new" / "run"))  # a writable parent: nothing made, nothing left
    assert list(tmp_path.iterdir()) == []
    for code, phrase in ((errno.EROFS, "read-only file system"), (errno.EACCES, "permission denied"),
                         (errno.ENOSPC, "full file system")):
        def fail(*args, code=code, **kwargs):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(harness.preflight, "tempfile", types.SimpleNamespace(mkstemp=fail))
        with pytest.raises(ConfigError, match=phrase):
            check_output_dir(str(tmp_path))


# ------------------------------------------------------------------------------------------- the teacher


def test_seq_len_beyond_the_teachers_positions_is_refused_before_it_loads(job_args, capsys, no_weights):
    longer = ["data.seq_len=1024", "budget.total_tokens=1e6"]
    assert main(["stage", "align-mixer", *job_args, *longer, "--layers", "0"]) == 2
    assert one_paragraph(capsys).startswith("data.seq_len=1024 exceeds the teacher's max_position_embeddings=512 "
                                            "(teacher.source=")
    assert main(["run", *job_args, *longer]) == 2
    assert "data.seq_len=1024 exceeds" in one_paragraph(capsys)


def test_chat_lengths_are_checked_where_a_stage_trains_on_chat(job_args, capsys, no_weights):
    assert main(["stage", "sft", *job_args, "instructions.seq_len=1024"]) == 2
    assert one_paragraph(capsys).startswith("instructions.seq_len=1024 exceeds the teacher's "
                                            "max_position_embeddings=512")
    assert main(["stage", "distill", *job_args, "stages.distill.data=instructions",
                 "instructions.seq_len=1024"]) == 2
    assert "instructions.seq_len=1024 exceeds" in one_paragraph(capsys)
    assert main(["info", *job_args, "instructions.seq_len=1024"]) == 0  # text stages only: its default is unused


def test_trained_lengths_follow_the_stages(job_args):
    job = load_job(job_args[0], job_args[1:])
    assert trained_lengths(job, ("align_mixer", "align_hidden", "distill")) == {"data.seq_len": 32}
    assert trained_lengths(job, ("sft",)) == {"instructions.seq_len": 2048}
    assert trained_lengths(job, ()) == {}
    chat = load_job(job_args[0], [*job_args[1:], "stages.distill.data=instructions"])
    assert trained_lengths(chat, ("align_mixer", "distill")) == {"data.seq_len": 32, "instructions.seq_len": 2048}


def test_more_teacher_layers_than_it_has_are_refused(job_args, capsys, no_weights):
    """Before: stages.common.num_student_layers took min(100, 4) without a word."""
    assert main(["info", *job_args, "teacher.num_layers=100"]) == 2
    assert one_paragraph(capsys).startswith("teacher.num_layers=100 but the teacher (teacher.source=")
    assert main(["stage", "merge", *job_args, "teacher.num_layers=5"]) == 2
    assert "has 4 layers; set teacher.num_layers to at most 4, or null" in one_paragraph(capsys)
    job = load_job(job_args[0], [*job_args[1:], "teacher.num_layers=4"])
    preflight(job, writes_output=True)


def test_a_damaged_teacher_is_one_paragraph_before_anything_runs(job_args, setting, tmp_path, capsys):
    import shutil

    teacher = Path(shutil.copytree(setting[0], tmp_path / "teacher"))
    (teacher / "config.json").write_text('{"model_type": "llama",')
    assert main(["info", *job_args, f"teacher.source={teacher}"]) == 2
    assert one_paragraph(capsys).startswith(f"The teacher's {teacher / 'config.json'} is not valid JSON")


def test_info_checks_nothing_it_would_write(job_args, tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    assert main(["info", *job_args, f"output_dir={tmp_path / 'taken'}"]) == 0
    assert "# stage plan" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["eval", "niah"], ["eval", "bench"], ["eval", "ppl", "--text", "notes.txt"]])
def test_the_eval_commands_name_their_model_argument(command, tmp_path, capsys, no_weights):
    """Before: `harness eval niah /missing` called the student a "Teacher path"."""
    missing = tmp_path / "missing"
    assert main([*command[:2], str(missing), *command[2:]]) == 2
    assert one_paragraph(capsys).startswith(f"The model to evaluate, '{missing}', does not exist. Give a student "
                                            "folder (e.g. runs/quickstart/student) or a teacher source")


def test_a_teacher_config_the_student_would_not_carry_is_refused_before_it_loads(job_args, tmp_path, capsys,
                                                                                  no_weights):
    """A Llama config with a sliding window (transformers' Llama has none, the student would apply it): one paragraph
    naming the field, before any weights load."""
    from tests.tiny import tiny_llama

    model = tiny_llama()
    model.config.sliding_window = 4
    model.save_pretrained(tmp_path / "windowed")
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["info", *job_args, f"teacher.source={tmp_path / 'windowed'}"]) == 2
    assert "sliding_window=4 (transformers' 'llama' attention has no sliding window" in one_paragraph(capsys)


def test_stage_2_is_refused_for_a_teacher_whose_extra_norms_it_does_not_copy(job_args, tmp_path):
    """Gemma 2's pre/post_feedforward_layernorm are not among the parts stage 2 copies into its blocks: a run with
    align_hidden is refused by name; the stages that do not build blocks pass."""
    from tests.tiny import tiny_gemma2

    tiny_gemma2().save_pretrained(tmp_path / "gemma2")
    job = load_job(job_args[0], [*job_args[1:], f"teacher.source={tmp_path / 'gemma2'}"])
    with pytest.raises(ConfigError, match=r"stage align_hidden cannot run on teacher.source=.*, a 'gemma2' teacher: "
                       r"its layers' post_feedforward_layernorm, pre_feedforward_layernorm are not among the parts"):
        preflight(job, writes_output=False)
    preflight(job, writes_output=False, stages=("align_mixer", "distill"))
