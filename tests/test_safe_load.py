"""Checkpoints load without running code from them (harness/safe_load.py): a crafted pickle in a checkpoint (an
object whose __reduce__ runs a shell command) is refused with UnsafeCheckpointError naming the file, on the plain
engine's resume and export and on DeepSpeed's (engine.load_checkpoint and zero_to_fp32's consolidation), and the
command never runs; real checkpoints of the plain engine and of DeepSpeed ZeRO-3 and ZeRO-2 still resume exactly.
The DeepSpeed part runs in its own process (DeepSpeed sets up a process group):

    python -m tests.test_safe_load OUT_DIR      (the DeepSpeed checks; the test calls it)
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.config import ConfigError
from harness.safe_load import UnsafeCheckpointError, deepspeed_globals, safe_load

ROOT = Path(__file__).resolve().parents[1]


class Evil:
    """Unpickling it runs `touch MARKER` (what a crafted checkpoint can do under weights_only=False)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def craft(path: Path, marker: Path, state: dict | None = None) -> Path:
    """A checkpoint file at `path`: `state` (default: a tensor) with an Evil object inside."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**(state or {"module": {"w": torch.ones(2)}}), "evil": Evil(marker)}, path)
    return path


def test_the_crafted_file_runs_its_command_under_weights_only_false(tmp_path):
    """The premise: what these tests refuse would run a command if loaded the old way."""
    marker = tmp_path / "MARKER"
    torch.load(craft(tmp_path / "evil.pt", marker), weights_only=False)
    assert marker.exists()


def test_safe_load_refuses_a_crafted_file_naming_it(tmp_path):
    marker = tmp_path / "MARKER"
    path = craft(tmp_path / "evil.pt", marker)
    with pytest.raises(UnsafeCheckpointError) as caught:
        safe_load(path)
    message = str(caught.value)
    assert f"Checkpoint file {path} holds something other than tensors and plain data" in message
    assert "posix.system" in message and "will not be unpickled" in message and "\n" not in message
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, pickle.UnpicklingError)
    assert not marker.exists()


def test_safe_load_lets_other_failures_through(tmp_path):
    """A truncated file is not called unsafe: torch's own error, unchanged."""
    path = tmp_path / "cut.pt"
    torch.save({"w": torch.ones(100)}, path)
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(Exception) as caught:
        safe_load(path)
    assert not isinstance(caught.value, UnsafeCheckpointError)


def plain_engine(bf16: bool = True):
    from harness.engine import PlainEngine
    from harness.schedule import lr_multiplier

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    config = {"bf16": {"enabled": bf16}, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "optimizer": {"params": {"lr": 1e-2, "weight_decay": 0.1}}}
    # the scheduler stage 3 builds: a LambdaLR over a functools.partial (its state holds the partial's __dict__)
    schedule = functools.partial(lr_multiplier, total_steps=10, schedule="cosine", warmup_steps=2,
                                 decay_fraction=1.0, min_lr_ratio=0.1)
    return PlainEngine(model, config, lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
                       torch.device("cpu"))


def plain_steps(engine, steps: int) -> list[float]:
    losses = []
    for step in range(steps):
        for micro in range(2):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + micro)).to(torch.bfloat16)
            loss = engine(x).float().square().mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def test_a_plain_engine_checkpoint_resumes_exactly_through_weights_only(tmp_path):
    whole = plain_engine()
    plain_steps(whole, 2)
    whole.save_checkpoint(str(tmp_path), "ds")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "ds" / "plain_engine.pt") == []
    after = plain_steps(whole, 2)
    resumed = plain_engine()
    resumed.load_checkpoint(str(tmp_path), "ds")
    assert plain_steps(resumed, 2) == after
    assert resumed.micro_steps == whole.micro_steps and resumed.get_lr() == whole.get_lr()
    assert all(torch.equal(a, b) for a, b in zip(resumed.masters, whole.masters))


def test_a_crafted_plain_engine_file_is_refused_on_resume_and_export(tmp_path, capsys):
    from harness.cli import main
    from harness.engine import consolidated_state_dict

    marker = tmp_path / "MARKER"
    ckpt = tmp_path / "run" / "distill" / "checkpoints" / "step-00000001"
    state = craft(ckpt / "ds" / "plain_engine.pt", marker)
    (ckpt / "manifest.json").write_text("{}")
    merged = tmp_path / "run" / "merged"
    merged.mkdir()
    (merged / "config.json").write_text("{}")
    with pytest.raises(UnsafeCheckpointError, match=f"Checkpoint file {state} holds something other"):
        plain_engine().load_checkpoint(str(ckpt), "ds")
    with pytest.raises(UnsafeCheckpointError, match="will not be unpickled"):
        consolidated_state_dict(ckpt, "ds")
    assert main(["export", str(ckpt), str(tmp_path / "student")]) == 2
    err = capsys.readouterr().err
    assert f"Checkpoint file {state} holds something other than tensors and plain data" in err
    assert not marker.exists() and not (tmp_path / "student").exists()


def test_deepspeed_checkpoints_load_with_weights_only_and_crafted_ones_are_refused(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "tests.test_safe_load", str(tmp_path)], cwd=ROOT, timeout=300,
                          env={**env, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"zero3", "zero2"}
    for stage, found in results.items():
        assert found["resumed_losses"] == found["losses"], stage  # a resume continues bit for bit
        assert found["same_weights"], stage
        for kind in ("model_states", "optim_states"):
            for where in ("load_checkpoint", "consolidated_state_dict"):
                refusal = found["refused"][kind][where]
                assert refusal["error"] == "UnsafeCheckpointError", (stage, kind, where, refusal)
                assert f"{kind}.pt holds something other than tensors and plain data" in refusal["message"]
    assert not list(tmp_path.rglob("MARKER*")), "a crafted checkpoint ran its command"


# ------------------------------------------------------------------------- the DeepSpeed process (subprocess)


def _ds_engine(stage: int):
    from harness.engine import student_engine
    from tests.test_engine import ds_config
    from tests.tiny import tiny_llama

    config = ds_config()
    config["zero_optimization"]["stage"] = stage
    torch.manual_seed(0)
    return student_engine(tiny_llama(tie=True).train(), config,
                          lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), "deepspeed",
                          torch.device("cpu"))


def _ds_steps(engine, steps: int, first: int) -> list[float]:
    from tests.test_engine import ACCUM, MICRO_BATCH, SEQ

    losses = []
    for step in range(first, first + steps):
        for micro in range(ACCUM):
            ids = torch.randint(0, 97, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(step * 7 + micro))
            loss = torch.nn.functional.cross_entropy(engine(ids).logits.float().flatten(0, 1),
                                                     ids.roll(-1, 1).flatten())
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _attempt(action) -> dict:
    try:
        action()
    except Exception as err:  # noqa: BLE001 - the test reads which error it was
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None, "message": ""}


def _crafted_copies(ckpt: Path, out: Path, stage: int) -> dict[str, Path]:
    """Copies of the checkpoint tag 'mid', each with one file (model states, optimizer states) crafted."""
    copies = {}
    for kind in ("model_states", "optim_states"):
        copy = out / f"crafted-{stage}-{kind}"
        shutil.copytree(ckpt, copy)
        (target,) = (copy / "mid").glob(f"*{kind}.pt")
        state = safe_load(target, map_location="cpu", allow=deepspeed_globals())
        craft(target, out / f"MARKER-{stage}-{kind}", state)
        copies[kind] = copy
    return copies


def run_deepspeed(out: Path) -> None:
    """ZeRO-3 and ZeRO-2: train, save 'mid', train on; a fresh engine loads 'mid' and trains the same steps; then
    the crafted copies are loaded both ways."""
    from harness.engine import consolidated_state_dict, setup_distributed

    setup_distributed(torch.device("cpu"))
    results = {}
    for stage in (3, 2):
        ckpt = out / f"zero{stage}"
        engine = _ds_engine(stage)
        _ds_steps(engine, 1, 0)
        engine.save_checkpoint(str(ckpt), "mid")
        losses = _ds_steps(engine, 1, 1)
        engine.save_checkpoint(str(ckpt), "end")
        resumed = _ds_engine(stage)
        resumed.load_checkpoint(str(ckpt), "mid")
        found = {"losses": losses, "resumed_losses": _ds_steps(resumed, 1, 1)}
        resumed.save_checkpoint(str(ckpt), "resumed")
        end, again = consolidated_state_dict(ckpt, "end"), consolidated_state_dict(ckpt, "resumed")
        found["same_weights"] = end.keys() == again.keys() and all(torch.equal(end[k], again[k]) for k in end)
        found["refused"] = {kind: {
            "load_checkpoint": _attempt(lambda: _ds_engine(stage).load_checkpoint(str(copy), "mid")),
            "consolidated_state_dict": _attempt(lambda: consolidated_state_dict(copy, "mid")),
        } for kind, copy in _crafted_copies(ckpt, out, stage).items()}
        results[f"zero{stage}"] = found
    (out / "results.json").write_text(json.dumps(results))


if __name__ == "__main__":
    run_deepspeed(Path(sys.argv[1]))
