"""What verifying a checkpoint's sha256 on resume costs, at the size of a 1.7B student's stage-3 checkpoint.

    python benchmarks/checkpoint_hash.py --out docs/results/checkpoint_hash_DATE.json
    python benchmarks/checkpoint_hash.py --world 1 --scale 0.1 --dir /tmp/ckbench       # one rank's layout, 10%

1. Layout: a small model is saved by DeepSpeed under the student's config (`--ds-config`, default
   ds_configs/zero3.json; bf16 as on a GPU) in a subprocess, and each file's bytes per parameter are measured
   (ZeRO-3: 12.0 B/param in the optimizer states, fp32 master weights and two Adam moments; the module states are
   partitioned, a few KB). `--bytes-per-param` skips this.
2. Files: a checkpoint of `--params` parameters (default: the gated_deltanet student of SmolLM2-1.7B,
   1,815,778,304) as `--world` ranks write it (each rank's ZeRO files, scaled by `--scale`, plus its RNG state and
   data.json) is saved under `--dir` with `CheckpointManager.save`, which hashes and fsyncs it for the manifest.
3. Verification, timed: sha256 in one thread (`verify_checkpoint(threads=1)`); in the threads `resume` uses
   (`default_hash_threads`: one per file, at most one per core, at most 8); and `--ranks` gloo processes on this
   machine sharing the files as ranks do (`latest_valid(verify="sha256")` under torch.distributed, each rank its
   share of the cores). Each the median of `--repeat`, "cold" (the files' pages dropped from the page cache with
   posix_fadvise DONTNEED first: as after a restart, or on a file system without a local cache) and "warm" (again
   at once: what of the files the page cache holds). Also sha256 from memory (the CPU's rate, no I/O).
4. The files are deleted. With less than twice their size free under `--dir`, `--scale` is lowered to fit and
   every time is extrapolated linearly to the full size (`*_full_s`); the JSON and the table say so.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date, timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STUDENT_1_7B = 1_815_778_304  # gated_deltanet student of SmolLM2-1.7B (docs/BENCHMARKS.md, tests/test_flops.py)
BLOCK = 64 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=STUDENT_1_7B)
    parser.add_argument("--world", type=int, default=8, help="Ranks that wrote the checkpoint (files per kind).")
    parser.add_argument("--ranks", type=int, default=2, help="gloo processes that share the verification.")
    parser.add_argument("--scale", type=float, default=1.0, help="Write this fraction of the sizes.")
    parser.add_argument("--repeat", type=int, default=1, help="Time each verification this often (the median).")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--ds-config", default="ds_configs/zero3.json")
    parser.add_argument("--bytes-per-param", type=float, default=None, help="Skip the layout measurement.")
    parser.add_argument("--out", type=Path, default=None, help="Write the results as JSON (and Markdown beside).")
    parser.add_argument("--layout-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layout_only:
        print(json.dumps(deepspeed_layout(args.ds_config)))
        return
    result = run(args)
    table = markdown(result)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table + "\n")


def run(args: argparse.Namespace) -> dict:
    """Measure the layout, write the checkpoint, time the verifications, delete it; the results as a dict."""
    layout = ({"zero_pp_rank_0_mp_rank_00_optim_states.pt": args.bytes_per_param} if args.bytes_per_param
              else measure_layout(args.ds_config))
    full = planned_files(layout, args.params, args.world, 1.0)
    scale = fitting_scale(args.scale, sum(full.values()), args.dir)
    files = planned_files(layout, args.params, args.world, scale)
    work = Path(tempfile.mkdtemp(prefix="checkpoint-hash-", dir=args.dir))
    meta = machine(args, work)
    try:
        saved = save_checkpoint(work, files)
        timings = time_verifications(saved["path"], args.ranks, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    timings["sha256_from_memory"] = memory_rates()
    meta["load_average_after"] = os.getloadavg()
    return {"meta": meta, "layout_bytes_per_param": layout, "scale": scale, "bytes": sum(files.values()),
            "bytes_full": sum(full.values()), "files": len(files), "largest_file": max(files.values()),
            "save": saved["times"], "verify": timings}


# ----------------------------------------------------------------------------------------- layout


def deepspeed_layout(ds_config: str) -> dict[str, float]:
    """Bytes per parameter of each file DeepSpeed writes for a 2.1M-parameter model under `ds_config` (bf16, one
    CPU process over gloo), by file name."""
    import importlib

    import torch

    os.environ.update(DS_ACCELERATOR="cpu", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # a C++ build ZeRO does not need
    with tempfile.TemporaryDirectory() as tmp:
        deepspeed.init_distributed("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1,
                                   timeout=timedelta(seconds=60))
        cfg = json.loads((REPO / ds_config).read_text())
        cfg["optimizer"]["params"].pop("fused", None)  # no fused AdamW on a CPU; the states are the same
        cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, bf16={"enabled": True})
        model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])
        n = sum(p.numel() for p in model.parameters())
        engine = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)[0]
        engine.backward(engine(torch.randn(2, 512, dtype=torch.bfloat16)).float().pow(2).mean())
        engine.step()
        engine.save_checkpoint(f"{tmp}/ck", tag="ds")
        return {p.name: p.stat().st_size / n for p in sorted(Path(tmp, "ck", "ds").iterdir())}


def measure_layout(ds_config: str) -> dict[str, float]:
    """`deepspeed_layout` in a subprocess (DeepSpeed's globals stay out of this one)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29541"}
    done = subprocess.run([sys.executable, __file__, "--layout-only", "--ds-config", ds_config], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"measuring DeepSpeed's layout failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def planned_files(layout: dict[str, float], params: int, world: int, scale: float) -> dict[str, int]:
    """File -> bytes of a checkpoint of `params` parameters written by `world` ranks: each per-rank file of the
    layout (`zero_pp_rank_0_*`) once per rank with 1/world of its bytes, others once, each rank's RNG state (the
    size `save_rng` writes) and data.json."""
    files: dict[str, int] = {}
    for name, per_param in layout.items():
        size = int(per_param * params * scale)
        if "zero_pp_rank_0_" in name:
            files.update({f"ds/{name.replace('zero_pp_rank_0_', f'zero_pp_rank_{r}_')}": size // world
                          for r in range(world)})
        else:
            files[f"ds/{name}"] = size
    rng = rng_file_size()
    files.update({f"rng_state_rank{r:05d}.pt": rng for r in range(world)})
    files["data.json"] = 400
    return files


def rng_file_size() -> int:
    from harness.checkpoint import save_rng

    with tempfile.TemporaryDirectory() as tmp:
        return save_rng(Path(tmp)).stat().st_size


def fitting_scale(asked: float, full_bytes: int, where: Path) -> float:
    """`asked`, lowered so that twice the files fit in the free space under `where` (said on stderr)."""
    free = shutil.disk_usage(where).free
    if 2 * asked * full_bytes <= free:
        return asked
    scale = free / (2 * full_bytes)
    print(f"only {free / 1e9:.1f} GB free under {where}: writing {scale:.3f} of the {full_bytes / 1e9:.1f} GB "
          "and extrapolating the times linearly", file=sys.stderr)
    return scale


# ----------------------------------------------------------------------------------------- writing


def save_checkpoint(root: Path, files: dict[str, int]) -> dict:
    """Save `files` (random bytes) as step 1 under root/checkpoints with CheckpointManager.save; the path and how
    long the writing and the save's hashing + fsync took."""
    from harness.checkpoint import CheckpointManager

    block = os.urandom(BLOCK)
    wrote = {}

    def writer(tmp: Path) -> None:
        began = time.perf_counter()
        for rel, size in files.items():
            write_file(tmp / rel, size, block)
        wrote["write_s"] = time.perf_counter() - began

    began = time.perf_counter()
    info = CheckpointManager(root / "checkpoints", keep_last=1).save(1, 1, writer)
    total = time.perf_counter() - began
    return {"path": str(info.path), "times": {**wrote, "hash_fsync_commit_s": total - wrote["write_s"]}}


def write_file(path: Path, size: int, block: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        left = size
        while left > 0:
            left -= f.write(block[:min(left, len(block))])


# ----------------------------------------------------------------------------------------- timing


def drop_cache(path: Path) -> None:
    """Ask the kernel to drop the page cache of every file under `path` (clean pages: the save fsynced them)."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def time_verifications(path: str, ranks: int, repeat: int) -> dict:
    """Cold and warm seconds (the median of `repeat`) of each way to verify the checkpoint at `path` (each must
    find it valid)."""
    from harness.checkpoint import default_hash_threads, read_manifest

    checkpoint = Path(path)
    threads = default_hash_threads(len(read_manifest(checkpoint).files))
    ways = {"one_thread": lambda: timed_verify(checkpoint, 1), f"threads_{threads}": lambda: timed_verify(checkpoint),
            f"ranks_{ranks}": lambda: ranks_verify(checkpoint, ranks)}
    runs: dict[str, list[float]] = {}
    for _ in range(repeat):  # the ways take turns, so that a busy moment of a shared machine hits them alike
        for name, seconds in ways.items():
            for pass_ in ("cold", "warm"):
                if pass_ == "cold":
                    drop_cache(checkpoint)
                runs.setdefault(f"{name}_{pass_}_s", []).append(seconds())
    return {**{k: statistics.median(v) for k, v in runs.items()}, "every_run_s": runs}


def timed_verify(checkpoint: Path, threads: int | None = None) -> float:
    """Seconds of `verify_checkpoint(sha256)` in `threads` threads (None: the default)."""
    from harness.checkpoint import verify_checkpoint

    began = time.perf_counter()
    problem = verify_checkpoint(checkpoint, "sha256", threads=threads)
    if problem:
        raise SystemExit(f"the checkpoint was found invalid: {problem}")
    return time.perf_counter() - began


def ranks_verify(checkpoint: Path, ranks: int) -> float:
    """Seconds of `latest_valid(verify="sha256")` in `ranks` gloo processes (rank 0's, from a barrier after the
    processes started)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_worker, args=(ranks, str(checkpoint.parent), tmp), nprocs=ranks, join=True)
        found = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]
    if {f["step"] for f in found} != {1}:
        raise SystemExit(f"the ranks found steps {[f['step'] for f in found]}, not the checkpoint of step 1")
    return found[0]["seconds"]


def _rank_worker(rank: int, ranks: int, root: str, tmp: str) -> None:
    import torch.distributed as dist

    from harness.checkpoint import CheckpointManager

    os.environ["LOCAL_WORLD_SIZE"] = str(ranks)  # each rank's share of the cores, as under torchrun
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=ranks,
                            timeout=timedelta(seconds=600))
    try:
        dist.barrier()
        began = time.perf_counter()
        info = CheckpointManager(root).latest_valid(verify="sha256")
        seconds = time.perf_counter() - began
        Path(tmp, f"rank{rank}.json").write_text(json.dumps({"step": info.step if info else None,
                                                             "seconds": seconds}))
    finally:
        dist.destroy_process_group()


def memory_rates(gib: int = 2) -> dict:
    """GB/s of sha256 over `gib` GiB already in memory, in one thread and in one per core."""
    data = os.urandom(BLOCK)
    rounds = gib * (1 << 30) // BLOCK

    def digest(_: int) -> str:
        h = hashlib.sha256()
        for _ in range(rounds):
            h.update(data)
        return h.hexdigest()

    cores = len(os.sched_getaffinity(0))
    out = {}
    for threads in sorted({1, cores}):
        began = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(digest, range(threads)))
        out[f"threads_{threads}_GBps"] = threads * rounds * BLOCK / 1e9 / (time.perf_counter() - began)
    return out


# ----------------------------------------------------------------------------------------- report


def machine(args: argparse.Namespace, work: Path) -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    usage = shutil.disk_usage(work)
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]), "date": date.today().isoformat(),
            "host": platform.node(), "cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
            "disk": f"{usage.total / 1e9:.0f} GB file system of {work}", "python": platform.python_version(),
            "torch": torch.__version__, "params": args.params, "world": args.world, "ranks": args.ranks,
            "repeat": args.repeat,
            "load_average_before": os.getloadavg()}


def markdown(r: dict) -> str:
    """The results as a Markdown table: the median and the best of the runs (on a shared machine the best is the
    least disturbed), and the median extrapolated to the full size."""
    grow = r["bytes_full"] / r["bytes"]
    gb = r["bytes"] / 1e9
    every = r["verify"].get("every_run_s", {})
    lines = [f"{r['files']} files, {gb:.2f} GB written (largest {r['largest_file'] / 1e9:.2f} GB)"
             + (f", scale {r['scale']:.3f}: full size {r['bytes_full'] / 1e9:.2f} GB" if grow > 1.0001 else ""),
             "", "| what | seconds (median) | best | GB/s (median) | seconds at full size |", "|---|---|---|---|---|"]
    for name, s in {**r["save"], **r["verify"]}.items():
        if isinstance(s, (int, float)):
            best = min(every.get(name, [s]))
            lines.append(f"| {name.removesuffix('_s')} | {s:.1f} | {best:.1f} | {gb / s:.2f} | {s * grow:.1f} |")
    rates = ", ".join(f"{k}: {v:.2f}" for k, v in r["verify"]["sha256_from_memory"].items())
    lines += ["", f"sha256 from memory (GB/s): {rates}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
