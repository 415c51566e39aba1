"""Does stage 1 give a layer back the copying that linearizing it takes away? For one layer of a job: train only
that layer's mixer by stage 1 (`harness stage align-mixer --layers L`) for each token budget and seed, then score
the teacher with only that layer replaced by the trained mixer on the copy probe (`harness transfer --rank-layers
--rank-by copy --layers L`, the same prompts for every run), against the same layer at its initialisation and the
teacher itself and the teacher with that layer's attention removed (its output zero: the floor a mixer that
gives the layer back nothing sits on). Each (job, budget, seed) trains in its own run folder under --work, so
reruns skip finished work.

    .venv/bin/python scripts/layer_copy_after_stage1.py \
        --job jobs/retrieval-135m/smollm2-135m-gated_deltanet-50m-stage1-10m.yaml \
        --job jobs/retrieval-135m/smollm2-135m-gated_deltanet-50m-recall10.yaml \
        --layer 16 --tokens 327680 1310720 --seeds 0 1 --device cpu --out docs/results/retrieval-135m/layer16-stage1-copy

`--copy-lengths 16 32 64 128 256` scores every run at each copy length (docs/results/retrieval-135m/README.md,
"Copying against the copy's length"); the default is 64.

Stage 1 trains on the job's own data (`data.source` or `data.mix`) at its seq_len and learning rate; only the
token budget (stages.align_mixer.tokens), the seed and the run folder are overridden. On 2 CPU cores at 135M one
layer trains at ~650 tokens/s (the teacher's forward up to that layer is most of the cost).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness.config import load_job
from harness.data.mix_schedule import parse_mix
from harness.stages.common import group_name


def harness(*args: str) -> None:
    """Run one harness command in a subprocess (as a user would), failing loudly with its output."""
    cmd = [sys.executable, "-m", "harness.cli", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def copy_part(run: Path, layer: int) -> dict[str, Any]:
    """The copy-ranking part `harness transfer --rank-layers --rank-by copy --layers L` wrote into `run`."""
    return json.loads((run / "ranking" / "parts" / "copy" / f"{group_name([layer])}.json").read_text())


def last_stage1_loss(run: Path, layer: int) -> float | None:
    """The stage-1 loss of the last logged step (one batch), or None when stage 1 did not run."""
    path = run / "align_mixer" / group_name([layer]) / "metrics.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    key = f"loss/layer_{layer:02d}"
    losses = [r[key] for r in rows if key in r]
    return losses[-1] if losses else None


def measure(job: str, layer: int, tokens: int, seed: int, work: Path, device: str, sequences: int,
            allow_repeat: bool = False, lengths: tuple[int, ...] = (64,),
            overrides: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Train (tokens > 0) and score one run at each copy length; tokens == 0 scores the layer at its initialisation.
    `overrides` (KEY=VALUE) change the job for both, and name the run folder."""
    tag = "".join(f"-{k.rsplit('.', 1)[-1]}{v.replace('/', '_')}" for k, v in (o.split("=", 1) for o in overrides))
    run = work / f"{Path(job).stem}{tag}-L{layer}-t{tokens}-s{seed}"
    common = [f"output_dir={run}", f"run.device={device}", f"seed={seed}", *overrides]
    started = time.time()
    if tokens > 0:
        repeat = ["data.allow_repeat=true"] if allow_repeat else []
        harness("stage", "align-mixer", job, "--layers", str(layer), f"stages.align_mixer.tokens={tokens}", *repeat,
                *common)
    trained = time.time() - started
    rows, data, stage1_loss = [], data_of(job), last_stage1_loss(run, layer)
    for length in lengths:  # the probe copies seq_len // 2 tokens; each length overwrites the part, read at once
        harness("transfer", "--rank-layers", job, "--rank-by", "copy", "--layers", str(layer), "--seq-len",
                str(2 * length), "--sequences", str(sequences), *common)
        part = copy_part(run, layer)
        teacher = part["data"]["teacher_copy_acc"]
        row = {"job": job, "overrides": list(overrides), "data": data, "layer": layer, "tokens": tokens, "seed": seed,
               "weights": part["layers"][str(layer)]["weights"], "copy_length": length,
               "teacher_copy_acc": teacher, "copy_acc": teacher - part["layers"][str(layer)]["cost"],
               "removed_copy_acc": teacher - part["layers"][str(layer)]["removed_cost"],
               "stage1_last_loss": stage1_loss, "train_seconds": round(trained, 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def data_of(job: str) -> str:
    """Stage 1's data in one line: the job's source, or its mix's sources with their stage-1 weights."""
    data = load_job(job).data
    if data.mix:
        weights = [(e.weight_in("align_mixer"), e.label) for e in parse_mix(data)]
        return " + ".join(f"{w} {source}" for w, source in weights if w > 0)
    return data.source


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    teacher = {r["copy_length"]: r["teacher_copy_acc"] for r in rows}
    said = ", ".join(f"{100 * acc:.1f}% at {length} tokens" for length, acc in sorted(teacher.items()))
    removed = ", ".join(f"{100 * r['removed_copy_acc']:.1f}% at {r['copy_length']} tokens"
                        for r in sorted({r["copy_length"]: r for r in rows}.values(), key=lambda r: r["copy_length"]))
    out = [f"# Copy accuracy with only layer {rows[0]['layer']} linearized, after stage 1 of that layer alone", "",
           f"Command: `{command}`", f"Machine: {platform.node()} ({platform.machine()}, CPU), {time.strftime('%Y-%m-%d')}",
           "", f"Teacher copy accuracy on the same prompts: {said}.",
           f"With layer {rows[0]['layer']}'s attention removed instead (its output zero: what a mixer that gives the "
           f"layer back nothing scores): {removed}.", "",
           "| data | stage-1 tokens | seed | weights | last stage-1 loss | copy length | copy accuracy |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        loss = "-" if r["stage1_last_loss"] is None else f"{r['stage1_last_loss']:.3f}"
        out.append(f"| {r['data']} | {r['tokens']:,} | {r['seed']} | {r['weights']} | {loss} | {r['copy_length']} | "
                   f"{100 * r['copy_acc']:.1f}% |")
    return "\n".join(out) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--job", action="append", required=True, help="Job YAML (repeatable: one data recipe each).")
    p.add_argument("--layer", type=int, required=True, help="The layer to linearize and train (0-based).")
    p.add_argument("--tokens", type=int, nargs="+", required=True, help="Stage-1 token budgets (0: at init).")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="Seeds (the data order; the init is copied).")
    p.add_argument("--sequences", type=int, default=32, help="Copy prompts per length (default 32).")
    p.add_argument("--copy-lengths", type=int, nargs="+", default=[64],
                   help="Tokens in each copy (each shown twice; default 64). Several lengths score the same trained\n"
                        "layer at each: how its copying falls as the state must hold more (the teacher's beside it).")
    p.add_argument("--device", default="cpu", help="run.device for every command (default cpu).")
    p.add_argument("--work", type=Path, default=Path("runs/layer-copy"), help="Folder for the runs.")
    p.add_argument("--out", type=Path, required=True, help="Writes OUT.json and OUT.md.")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="A job override for every run (repeatable), e.g. stages.align_mixer.mixing_weight=4.0.")
    p.add_argument("--allow-repeat", action="store_true",
                   help="data.allow_repeat=true for the training: a stage-1 budget above the job's own makes its plan\n"
                        "read past the data in stage 3, which this script never runs (stage 1 reads the first\n"
                        "sequences either way). It is part of a run's settings: runs made without it are refused\n"
                        "with it, so give the budgets that need it a call of their own.")
    a = p.parse_args()
    if min(a.copy_lengths) < 4:
        p.error(f"--copy-lengths {min(a.copy_lengths)}: a copy needs at least 4 tokens")
    lengths = tuple(a.copy_lengths)
    bad = [o for o in a.overrides if "=" not in o]
    if bad:
        p.error(f"--set {bad[0]}: give KEY=VALUE, e.g. stages.align_mixer.mixing_weight=4.0")
    sets = tuple(a.overrides)
    rows = measure(a.job[0], a.layer, 0, 0, a.work, a.device, a.sequences, lengths=lengths, overrides=sets)
    rows += [row for job in a.job for t in a.tokens if t > 0 for s in a.seeds
             for row in measure(job, a.layer, t, s, a.work, a.device, a.sequences, a.allow_repeat, lengths, sets)]
    command = " ".join(["python", "scripts/layer_copy_after_stage1.py", *sys.argv[1:]])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps({"command": command, "machine": platform.node(), "rows": rows},
                                                     indent=1) + "\n")
    a.out.with_suffix(".md").write_text(markdown(rows, command))
    print(f"wrote {a.out.with_suffix('.json')} and {a.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
