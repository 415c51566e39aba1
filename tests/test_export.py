"""harness.export's destination rules: an export never deletes what it did not write (issue 49: `harness export
CKPT DEST` emptied a folder of notes, and with DEST = the run directory replaced the whole run by the student)."""

from __future__ import annotations

import pytest

from harness.export import EXPORT_JSON, ExportRefused, check_destination, swap_in


def test_a_missing_or_empty_destination_or_an_earlier_export_is_accepted(tmp_path):
    check_destination(tmp_path / "new", force=False)
    (tmp_path / "empty").mkdir()
    check_destination(tmp_path / "empty", force=False)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / EXPORT_JSON).write_text("{}")
    (earlier / "model.safetensors").write_bytes(b"x")
    check_destination(earlier, force=False)


def test_a_folder_of_someone_elses_files_is_refused_unless_forced(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "ideas.md").write_text("mine")
    with pytest.raises(ExportRefused, match="not empty and is not an earlier export.*--force"):
        check_destination(notes, force=False)
    check_destination(notes, force=True)
    assert (notes / "ideas.md").read_text() == "mine"


@pytest.mark.parametrize("marker", ["job.yaml", "distill", "merged", "manifest.json", "checkpoints"])
def test_a_run_directory_or_checkpoint_is_refused_even_when_forced(tmp_path, marker):
    run = tmp_path / "run"
    (run / marker).mkdir(parents=True) if "." not in marker else (run.mkdir(), (run / marker).write_text("x"))
    with pytest.raises(ExportRefused, match="never replaces it, not even with --force"):
        check_destination(run, force=True)


def test_a_folder_above_the_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "somewhere" / "deep" / "step-00000004"
    ckpt.mkdir(parents=True)
    with pytest.raises(ExportRefused, match="holds"):
        check_destination(tmp_path / "somewhere", force=True, keep=(ckpt,))


def test_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ExportRefused, match="is a file"):
        check_destination(tmp_path / "f", force=True)


def test_swap_in_replaces_the_old_export_only_once_the_new_one_is_in_place(tmp_path, monkeypatch):
    import os

    dest, new = tmp_path / "student", tmp_path / ".student.tmp"
    dest.mkdir()
    (dest / "old").write_text("old")
    new.mkdir()
    (new / "new").write_text("new")
    swap_in(new, dest)
    assert (dest / "new").is_file() and not (dest / "old").exists() and not new.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["student"]

    again = tmp_path / ".again"
    again.mkdir()
    real_rename = os.rename

    def failing(src, dst):  # the new folder cannot be moved in: the old export must come back
        if str(src) == str(again):
            raise OSError("no room")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError):
        swap_in(again, dest)
    assert (dest / "new").read_text() == "new"


def test_leftovers_of_a_killed_export_are_removed_but_not_a_live_ones(tmp_path):
    import os
    import socket
    import subprocess

    from harness.export import remove_leftovers

    dead = subprocess.Popen(["true"])
    dead.wait()
    host = socket.gethostname()
    gone = tmp_path / f".student.tmp-{host}-{dead.pid}-abcd"
    live = tmp_path / f".student.tmp-{host}-{os.getpid()}-abcd"
    other_host = tmp_path / f".student.replaced-elsewhere-{dead.pid}-abcd"
    for p in (gone, live, other_host):
        p.mkdir()
    assert remove_leftovers(tmp_path / "student") == [gone]
    assert live.is_dir() and other_host.is_dir() and not gone.exists()
