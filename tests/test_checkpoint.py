"""Checkpoints: atomic save, verified load with fallback (size, sha256, a load that fails), pruning, completion marker,
RNG, 2 ranks, ZeRO-3."""

from __future__ import annotations

import json
import random
import re
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.checkpoint import (
    COMPLETE,
    LATEST,
    MANIFEST,
    CheckpointCostWarning,
    CheckpointError,
    CheckpointManager,
    CheckpointWarning,
    capture_rng,
    hash_shares,
    load_rng,
    restore_rng,
    rng_path,
    save_rng,
    verify_checkpoint,
)


def _writer(payload: dict[str, torch.Tensor]):
    def write(d: Path) -> None:
        torch.save(payload, d / "model.pt")
        (d / "sub").mkdir()
        (d / "sub" / "data_state.json").write_text(json.dumps({"position": 123}))

    return write


def _save(mgr: CheckpointManager, step: int, **meta) -> None:
    mgr.save(step, step * 1000, _writer({"w": torch.full((4,), float(step))}), meta or None)


def test_round_trip_manifest_and_latest_pointer(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "ck", keep_last=3)
    assert mgr.latest_valid() is None
    info = mgr.save(7, 7000, _writer({"w": torch.arange(5.0)}), {"stage": "distill", "lr": 1e-3})

    assert info.path == tmp_path / "ck" / "step-00000007"
    assert (tmp_path / "ck" / LATEST).read_text().strip() == "step-00000007"
    manifest = json.loads((info.path / MANIFEST).read_text())
    assert set(manifest["files"]) == {"model.pt", "sub/data_state.json"}
    for rel, entry in manifest["files"].items():
        assert entry["size"] == (info.path / rel).stat().st_size and len(entry["sha256"]) == 64

    got = mgr.latest_valid(verify="sha256")
    assert got is not None and (got.step, got.tokens, got.meta) == (7, 7000, {"stage": "distill", "lr": 1e-3})
    assert torch.equal(torch.load(got.path / "model.pt")["w"], torch.arange(5.0))
    assert not [p for p in mgr.root.iterdir() if p.name.startswith(".tmp-")]


def test_saving_too_often_for_the_checkpoint_size_warns_once(tmp_path: Path) -> None:
    """A save that takes most of the time between saves is named, with the setting that spaces them out."""
    import time
    import warnings

    def slow_writer(d: Path) -> None:
        time.sleep(0.2)
        torch.save({"w": torch.zeros(4)}, d / "model.pt")

    mgr = CheckpointManager(tmp_path / "ck", keep_last=1)
    mgr.costly_seconds = 0.1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in (1, 2, 3):  # back to back: each save is ~100% of the time since the previous one
            mgr.save(step, step, slow_writer)
    costly = [w for w in seen if issubclass(w.category, CheckpointCostWarning)]
    assert len(costly) == 1 and "run.checkpoint_every_tokens" in str(costly[0].message)
    assert "step 2" in str(costly[0].message)

    spaced = CheckpointManager(tmp_path / "ck2", keep_last=1)
    spaced.costly_seconds = 0.1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in (1, 2):
            spaced.save(step, step, slow_writer)
            time.sleep(2.0)  # training between saves: the save is ~10% of the interval
    assert not [w for w in seen if issubclass(w.category, CheckpointCostWarning)]


def test_keep_last_prunes_oldest(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        _save(mgr, step)
    assert [s for s, _ in mgr.step_dirs()] == [4, 5]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-00000004", "step-00000005"]
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, keep_last=0)


def test_half_written_tmp_dir_is_ignored_and_cleaned(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=2)
    _save(mgr, 1)
    crashed = tmp_path / ".tmp-step-00000002-deadbeef"  # a save killed before its rename
    crashed.mkdir()
    (crashed / "model.pt").write_bytes(b"half")

    assert mgr.latest_valid(clean_tmp=False).step == 1
    assert crashed.exists()
    assert mgr.latest_valid().step == 1
    assert not crashed.exists()


def test_truncated_newest_falls_back_with_warning(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1)
    _save(mgr, 2)
    model = tmp_path / "step-00000002" / "model.pt"
    model.write_bytes(model.read_bytes()[:-10])

    with pytest.warns(CheckpointWarning, match=r"step-00000002.*model\.pt"):
        info = mgr.latest_valid()
    assert info.step == 1


def test_same_size_corruption_needs_sha256(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1)
    _save(mgr, 2)
    model = tmp_path / "step-00000002" / "model.pt"
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF
    model.write_bytes(bytes(data))

    assert mgr.latest_valid(verify="size").step == 2
    with pytest.warns(CheckpointWarning, match="step-00000002.*sha256"):
        assert mgr.latest_valid(verify="sha256").step == 1


def _flip_middle(path: Path, n: int = 8) -> None:
    """Corrupt a file without changing its size: invert `n` bytes in its middle."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))


def _break_and_rehash(checkpoint: Path, rel: str) -> None:
    """A file broken so that it cannot load, with its manifest entry rewritten to match: what sha256 cannot see
    (a writer that wrote garbage, hashed as written)."""
    from harness.checkpoint import file_digest

    path = checkpoint / rel
    path.write_bytes(path.read_bytes()[:-30] + b"\0" * 30)  # the zip's central directory is at the end
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][rel] = file_digest(path)
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def _load_model(loaded: list):
    def load(info) -> None:
        loaded.append((info.step, float(torch.load(info.path / "model.pt")["w"][0])))

    return load


def test_resume_skips_a_same_size_corruption_and_loads_the_previous(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1)
    _save(mgr, 2)
    _flip_middle(tmp_path / "step-00000002" / "model.pt")

    loaded: list = []
    with pytest.warns(CheckpointWarning, match=r"skipping checkpoint \S*step-00000002: model\.pt does not match its "
                                                r"sha256"):
        info = mgr.resume(_load_model(loaded))
    assert info.step == 1 and loaded == [(1, 1.0)]  # step 2 was never handed to the loader
    assert (tmp_path / "step-00000002").is_dir()  # left in place: the next save of step 2 replaces it


def test_resume_moves_aside_a_checkpoint_that_verifies_but_fails_to_load(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1)
    _save(mgr, 2)
    _break_and_rehash(tmp_path / "step-00000002", "model.pt")
    assert verify_checkpoint(tmp_path / "step-00000002", "sha256") is None  # sha256 cannot see it

    loaded: list = []
    with pytest.warns(CheckpointWarning, match=r"step-00000002 passed its checks but failed to load \(RuntimeError: "
                                                r".*\); it moved aside to \S*bad-step-00000002-"):
        info = mgr.resume(_load_model(loaded))
    assert info.step == 1 and loaded == [(1, 1.0)]
    bad = [p for p in tmp_path.iterdir() if p.name.startswith("bad-step-00000002-")]
    assert len(bad) == 1 and (bad[0] / "model.pt").is_file() and (bad[0] / MANIFEST).is_file()
    assert [s for s, _ in mgr.step_dirs()] == [1]
    _save(mgr, 2)  # the run goes on from step 1: its next save of step 2 does not collide
    assert mgr.latest_valid(verify="sha256").step == 2 and bad[0].is_dir()


def test_resume_starts_afresh_only_loudly_and_never_after_a_failed_load(tmp_path: Path) -> None:
    """Nothing verifies: a warning that the stage starts afresh. Nothing loads after a load failed: CheckpointError,
    since the failed load may have changed the model; the checkpoints stay, aside."""
    mgr = CheckpointManager(tmp_path / "a", keep_last=3)
    _save(mgr, 1)
    _flip_middle(mgr.root / "step-00000001" / "model.pt")
    with pytest.warns(CheckpointWarning, match="skipping .*step-00000001: model.pt does not match"), \
            pytest.warns(CheckpointWarning, match="STARTS AFRESH from step 0"):
        assert mgr.resume(_load_model([])) is None

    mgr = CheckpointManager(tmp_path / "b", keep_last=3)
    _save(mgr, 1)
    _break_and_rehash(mgr.root / "step-00000001", "model.pt")
    with pytest.warns(CheckpointWarning, match="failed to load"):
        with pytest.raises(CheckpointError, match=r"No checkpoint under .* could be loaded: checkpoint "
                                                  r"\S*step-00000001 passed its checks .* run the stage again to "
                                                  r"start it afresh"):
            mgr.resume(_load_model([]))
    assert [p.name.startswith("bad-step-00000001-") for p in mgr.root.iterdir() if p.name.startswith("bad-")] == [True]


def test_resume_raises_a_configuration_error_without_moving_anything(tmp_path: Path) -> None:
    """An error of a `fatal` type (the run is configured unlike the checkpoint) or an out-of-memory is no reason to
    give up a checkpoint: it is raised, and the checkpoint stays."""
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1)

    class Misconfigured(ValueError):
        pass

    def refuse(info) -> None:
        raise Misconfigured(f"{info.path} was written under another mixer")

    with pytest.raises(Misconfigured, match="another mixer"):
        mgr.resume(refuse, fatal=(Misconfigured,))

    def out_of_memory(info) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.OutOfMemoryError):
        mgr.resume(out_of_memory)
    assert [s for s, _ in mgr.step_dirs()] == [1] and not [p for p in tmp_path.iterdir() if p.name.startswith("bad-")]


def test_sha256_in_threads_finds_a_corrupt_file_among_many(tmp_path: Path) -> None:
    def many(d: Path) -> None:
        for i in range(12):
            (d / f"shard-{i:02d}.bin").write_bytes(bytes([i]) * (50_000 + 1000 * i))

    mgr = CheckpointManager(tmp_path, keep_last=3, hash_threads=4)
    mgr.save(1, 1, many)
    mgr.save(2, 2, many)
    _flip_middle(tmp_path / "step-00000002" / "shard-07.bin")
    assert verify_checkpoint(tmp_path / "step-00000002", "sha256", threads=4) == (
        "shard-07.bin does not match its sha256 in the manifest (same size, different bytes: the file is corrupt)")
    assert verify_checkpoint(tmp_path / "step-00000001", "sha256", threads=4) is None
    with pytest.warns(CheckpointWarning, match="shard-07.bin"):
        assert mgr.latest_valid(verify="sha256").step == 1


def test_hash_shares_balance_bytes_and_hash_every_file_once() -> None:
    files = {"optim-0.pt": {"size": 900, "sha256": "x"}, "optim-1.pt": {"size": 900, "sha256": "x"},
             "model.pt": {"size": 300, "sha256": "x"}, "rng-0.pt": {"size": 10, "sha256": "x"},
             "rng-1.pt": {"size": 10, "sha256": "x"}, "unhashed.bin": {"size": 5000}}
    shares = hash_shares(files, 2)
    assert sorted(f for share in shares for f in share) == sorted(f for f in files if f != "unhashed.bin")
    sizes = [sum(files[f]["size"] for f in share) for share in shares]
    assert sizes == [1200, 920]
    assert hash_shares(files, 1) == [["optim-0.pt", "optim-1.pt", "model.pt", "rng-0.pt", "rng-1.pt"]]
    assert hash_shares(files, 8)[7] == []  # more ranks than files: some hash nothing


def test_missing_manifest_is_skipped(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=3)
    _save(mgr, 1)
    foreign = tmp_path / "step-00000009"
    foreign.mkdir()
    (foreign / "model.pt").write_bytes(b"x" * 100)

    with pytest.warns(CheckpointWarning, match="step-00000009.*manifest"):
        assert mgr.latest_valid().step == 1


def test_failed_writer_leaves_previous_checkpoint(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=1)
    _save(mgr, 1)

    def broken(d: Path) -> None:
        (d / "model.pt").write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(CheckpointError, match="disk full") as failed:
        mgr.save(2, 2000, broken, {})
    # the free space is in the message: torch.save reports a full disk only as "unexpected pos ..."
    assert re.search(r"\(\d+\.\d GiB free of \d+\.\d GiB on the file system of ", str(failed.value))
    assert [s for s, _ in mgr.step_dirs()] == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step-00000001"]


def test_resave_replaces_and_later_steps_move_aside(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep_last=1)
    _save(mgr, 1)
    _save(mgr, 1, again=True)
    assert mgr.latest_valid().meta == {"again": True}

    mgr = CheckpointManager(tmp_path, keep_last=1)
    _save(mgr, 5)
    with pytest.warns(CheckpointWarning, match="newer"):
        _save(mgr, 3)  # resumed from an earlier checkpoint: step 5 is another future, kept aside
    assert [s for s, _ in mgr.step_dirs()] == [3]
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("stale-step-00000005")]) == 1


def test_complete_marker(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "stage1", keep_last=1)
    assert not mgr.is_complete() and mgr.complete_meta() is None
    mgr.mark_complete({"tokens": 80_000_000})
    assert mgr.is_complete() and mgr.complete_meta() == {"tokens": 80_000_000}
    assert json.loads((tmp_path / "stage1" / COMPLETE).read_text())["meta"]["tokens"] == 80_000_000


def test_rng_capture_restore(tmp_path: Path) -> None:
    def draw() -> tuple:
        return random.random(), float(np.random.rand()), torch.rand(3).tolist()

    state = capture_rng()
    first = draw()
    restore_rng(state)
    assert draw() == first

    save_rng(tmp_path)
    assert rng_path(tmp_path).name == "rng_state_rank00000.pt"
    first = draw()
    load_rng(tmp_path)
    assert draw() == first


# ----------------------------------------------------------------------------------------- 2 ranks, gloo


def _two_rank_worker(rank: int, root: str, init_file: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        mgr = CheckpointManager(root, keep_last=2)

        def write(d: Path) -> None:  # like ZeRO-3: each rank its own shard, in the same directory
            (d / f"shard-rank{rank}.bin").write_bytes(bytes([rank]) * (100 + rank))
            save_rng(d)

        info = mgr.save(3, 3000, write, {"world": 2})
        assert info.path.name == "step-00000003"  # every rank gets the result
        found = mgr.latest_valid(verify="sha256")
        assert found is not None and found.step == 3

        def fails_on_rank1(d: Path) -> None:
            if rank == 1:
                raise RuntimeError("rank 1 lost its disk")
            (d / "shard-rank0.bin").write_bytes(b"0")

        with pytest.raises(CheckpointError, match="rank 1 lost its disk"):  # raised on both ranks, no hang
            mgr.save(4, 4000, fails_on_rank1, {})
        mgr.mark_complete({"ranks": 2})
        Path(root, f"done-rank{rank}").write_text(json.dumps({"step": found.step}))
    finally:
        dist.destroy_process_group()


def test_two_ranks_gloo_share_one_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    mp.spawn(_two_rank_worker, args=(str(root), str(tmp_path / "pg_init")), nprocs=2, join=True)

    final = root / "step-00000003"
    manifest = json.loads((final / MANIFEST).read_text())
    expected = {"shard-rank0.bin", "shard-rank1.bin", "rng_state_rank00000.pt", "rng_state_rank00001.pt"}
    assert set(manifest["files"]) == expected
    assert manifest["files"]["shard-rank1.bin"]["size"] == 101 and manifest["world_size"] == 2
    assert [s for s, _ in CheckpointManager(root).step_dirs()] == [3]  # the failed step 4 left nothing
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert CheckpointManager(root).complete_meta() == {"ranks": 2}


def _two_rank_resume_worker(rank: int, root: str, init_file: str) -> None:
    """Both ranks verify (each hashing a share), fall back and fail together; what each got goes to a file."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    got: dict = {}
    try:
        mgr = CheckpointManager(root, keep_last=4)
        for step in (1, 2, 3):  # like ZeRO-3: each rank its own shard
            mgr.save(step, step, lambda d, step=step: torch.save({"w": torch.full((64,), float(step))},
                                                                 d / f"shard-rank{rank}.pt"))
        if rank == 0:  # a same-size corruption of step 3 in the file rank 1 wrote
            _flip_middle(Path(root, "step-00000003", "shard-rank1.pt"))
        dist.barrier()
        got["sha256"] = mgr.latest_valid(verify="sha256").step

        def load(info) -> None:  # step 2 fails to load on rank 1 only
            if rank == 1 and info.step == 2:
                raise RuntimeError("rank 1's shard of step 2 does not unpickle")
            torch.load(info.path / f"shard-rank{rank}.pt")

        got["resume"] = mgr.resume(load).step

        class Misconfigured(ValueError):
            pass

        def refuse_on_rank0(info) -> None:
            if rank == 0:
                raise Misconfigured("written under another mixer")

        try:
            mgr.resume(refuse_on_rank0, fatal=(Misconfigured,))
        except Exception as e:  # raised on both ranks, no hang
            got["fatal"] = f"{type(e).__name__}: {e}"
    finally:
        Path(root, f"got-rank{rank}.json").write_text(json.dumps(got))
        dist.destroy_process_group()


def test_two_ranks_gloo_agree_on_which_checkpoint_to_resume(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    mp.spawn(_two_rank_resume_worker, args=(str(root), str(tmp_path / "pg_init")), nprocs=2, join=True)
    got = [json.loads((root / f"got-rank{r}.json").read_text()) for r in (0, 1)]
    assert [g["sha256"] for g in got] == [2, 2]  # step 3: rank 1 hashes the corrupt shard, rank 0 is told
    assert [g["resume"] for g in got] == [1, 1]  # step 2 failed on rank 1: both ranks moved on
    assert got[0]["fatal"] == "Misconfigured: written under another mixer"
    assert got[1]["fatal"].startswith("CheckpointError: loading checkpoint ")
    assert "stopped on another rank: rank 0: Misconfigured: written under another mixer" in got[1]["fatal"]
    assert len([p for p in root.iterdir() if p.name.startswith("bad-step-00000002-")]) == 1
    assert [s for s, _ in CheckpointManager(root).step_dirs()] == [1, 3]


# ----------------------------------------------------------------------------------------- DeepSpeed ZeRO-3


def _ds_worker(_: int, root: str, init_file: str) -> None:
    import importlib

    import deepspeed

    # The shared-memory all-reduce is a 30-120 s C++ build ZeRO does not need.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(
        "gloo", init_method=f"file://{init_file}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},  # no FusedAdam build
        "zero_optimization": {"stage": 3},
        "steps_per_print": 10**9,
    }

    def engine(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0]

    def step(e) -> float:  # batches come from the global RNG, so resuming must restore it too
        x, y = torch.randn(4, 8), torch.randn(4, 1)
        loss = torch.nn.functional.mse_loss(e(x), y)
        e.backward(loss)
        e.step()
        return loss.item()

    def write(e):
        def w(d: Path) -> None:
            e.save_checkpoint(str(d), tag="ds")
            save_rng(d)

        return w

    mgr = CheckpointManager(root, keep_last=2)
    first = engine(0)
    for i in range(2):
        step(first)
    mgr.save(2, 8, write(first), {})
    uninterrupted = [step(first) for _ in range(2)]

    resumed = engine(1)  # different initial weights: only the checkpoint can make them equal
    info = mgr.latest_valid(verify="sha256")
    assert info is not None and info.step == 2
    resumed.load_checkpoint(str(info.path), tag="ds")
    load_rng(info.path)
    after = [step(resumed) for _ in range(2)]  # the second step depends on the restored Adam moments
    assert after == uninterrupted, (after, uninterrupted)
    names = set(json.loads((info.path / MANIFEST).read_text())["files"])
    assert {"ds/zero_pp_rank_0_mp_rank_00_model_states.pt", "ds/zero_pp_rank_0_mp_rank_00_optim_states.pt"} <= names


def test_deepspeed_zero3_save_resume_matches_uninterrupted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed  # noqa: F401  (a pinned dependency)
    env = {"DS_ACCELERATOR": "cpu", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}  # fmt: skip
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # inherited by the spawned process, which keeps DeepSpeed's globals
    mp.spawn(_ds_worker, args=(str(tmp_path / "ck"), str(tmp_path / "pg_init")), nprocs=1, join=True)
