"""Stage 1 under each init variant, on the CPU: the measurements behind docs/TRANSFER.md's "Stage 1" table.

For each (mixer, variant): `harness stage align-mixer` of the small-study job on a few layers, with a short budget,
then `harness transfer` on the same layers (held-out sequences; the "stage1" rows read the weights just trained).
Writes one JSON with the stage-1 training losses (first and last logged, per layer) and both transfer reports.

    .venv/bin/python scripts/transfer_sweep.py --out docs/results/transfer/stage1_135m.json
    .venv/bin/python scripts/transfer_sweep.py --mixers gated_deltanet --layers 14-15 --steps 40 --out /tmp/x.json

Every run is a plain CLI call (printed before it starts), so any row can be re-run by hand.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import yaml

from harness.mixers import mixer_options

# What each mixer is compared under: the authors' init as the harness had it before docs/TRANSFER.md (the first
# entry), single changes, and today's defaults ("": no override). Spelt out in full, so that a row keeps its meaning
# when a default changes (each row also records its resolved options).
AUTHORS = {"conv": "conv_init=random,gate_init=random,output_scale=none,qkv_activation=silu",
           "gate": "gate_init=random,output_scale=none", "plain": "output_scale=none"}
VARIANTS = {
    "linear_attn": ["output_scale=none", "", "rope=true"],
    "retnet": [AUTHORS["gate"], "output_scale=none", "", "rope=true", "rope=true,rope_theta=10000", "gate_init=random"],
    "gla": [AUTHORS["gate"], "output_scale=none", "", "rope=true", "gate_init=random"],
    "deltanet": ["conv_init=random,output_scale=none,qkv_activation=silu", "output_scale=none,qkv_activation=silu",
                 "qkv_activation=silu", "", "rope=true,qkv_activation=silu", "short_conv=false"],
    "gated_deltanet": [AUTHORS["conv"], "gate_init=random,output_scale=none,qkv_activation=silu",
                       "output_scale=none,qkv_activation=silu", "qkv_activation=silu", "",
                       "rope=true,qkv_activation=silu", "gate_init=random", "short_conv=false"],
    "kda": [AUTHORS["conv"], "gate_init=random,output_scale=none,qkv_activation=silu",
            "output_scale=none,qkv_activation=silu", "qkv_activation=silu", "", "gate_init=random", "rope=true"],
    "mlstm": [AUTHORS["gate"], "output_scale=none", "", "rope=true", "gate_init=random"],
    # the authors' init (the extra Householder steps' k, v random, as fla's layers draw them), the extra steps'
    # k, v copied from the teacher's, the defaults (random), and quieter extra steps (beta ~0.018) under either
    "deltaproduct": [AUTHORS["conv"] + ",householder_kv_init=random", "householder_kv_init=copy", "",
                     "householder_kv_init=copy,householder_beta_bias=-4", "householder_beta_bias=-4"],
    # MambaInLlama's init (random conv with SiLU, random z, D = 1, no fitted scale); LoLCATs' released configs
    "mamba2": [AUTHORS["conv"] + ",d_init=one", "d_init=one", "", "qkv_activation=silu,d_init=one"],
    "hedgehog": ["feature_init=random,output_scale=none", "feature_init=random", ""],
    # fla-org/hybrid-distillation's GSA student (fla's layer: SiLU on q, k, v and the read, scale 1, no gate bias),
    # the slots' decays all alike (fla's init) with the harness's other choices, the defaults (spread decays)
    "gsa": ["qkv_activation=silu,output_activation=silu,qk_scale=one,slot_decay_init=uniform,output_scale=none",
            "slot_decay_init=uniform", ""],
    # RADLADS' init (its gate, no fitted scale, a0 = 0: a = 1/2), a = 1/2 alone, the defaults (a ~0.12), a nearly off
    # (~0.018), RWKV-7's (fla's) decay schedule under a = 1/2 and the default, RoPE (RADLADS')
    "rwkv7": ["gate_init=random,output_scale=none,iclr_bias=0", "iclr_bias=0", "", "iclr_bias=-4",
              "decay_init=rwkv7,iclr_bias=0", "decay_init=rwkv7", "rope=true,iclr_bias=0"],
}


def harness(*args: str) -> None:
    cmd = [sys.executable, "-m", "harness.cli", *args]  # the checkout's harness (run from the repository root)
    print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def losses(metrics: Path) -> dict[str, list[float]]:
    """layer -> [first, last] logged stage-1 training loss."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    keys = sorted(k for k in rows[0] if k.startswith("loss/layer_"))
    return {k.split("_")[-1]: [rows[0][k], rows[-1][k]] for k in keys}


def measure(mixer: str, variant: str, seed: int, args: argparse.Namespace, micro: int) -> dict:
    """Stage 1 of one (mixer, variant, seed), then the transfer report on its layers: one JSON row."""
    job = f"jobs/study-small/smollm2-135m-{mixer}-small.yaml"
    options = [f"student.options.{kv}" for kv in variant.split(",") if kv]
    if not Path(job).is_file():  # a mixer without a study job: gated_deltanet's with the mixer swapped
        job, options = "jobs/study-small/smollm2-135m-gated_deltanet-small.yaml", [f"student.mixer={mixer}", *options]
    slug = variant.replace(",", "+").replace("=", "-") or "default"
    run = Path(args.work) / mixer / f"{slug}-seed{seed}"
    common = [job, f"seed={seed}", "teacher.dtype=float32", f"data.seq_len={args.seq_len}", f"output_dir={run}",
              f"stages.align_mixer.tokens={args.steps * micro * args.seq_len}",
              f"stages.align_mixer.micro_batch_size={micro}", "run.log_every_steps=1", *options]
    start = time.time()
    harness("stage", "align-mixer", *common, "--layers", args.layers)
    seconds = time.time() - start
    harness("transfer", *common, "--layers", args.layers, "--sequences", "4", "--seq-len", str(args.seq_len),
            "--out", str(run / "transfer"))
    report = json.loads((run / "transfer" / "transfer.json").read_text())
    group = next((run / "align_mixer").glob("layers-*"))
    resolved = asdict(mixer_options(mixer, {k: yaml.safe_load(v) for k, _, v in (kv.partition("=") for kv in
                                                                                 variant.split(",") if kv)}))
    return {"mixer": mixer, "variant": variant or "default", "options": resolved, "seed": seed,
            "layers": args.layers, "steps": args.steps,
            "seq_len": args.seq_len, "micro_batch": micro, "stage1_seconds": round(seconds, 1),
            "train_loss": losses(group / "metrics.jsonl"), "transfer": report["rows"]}


def table(runs: list[dict]) -> str:
    """docs/TRANSFER.md's stage-1 table: per (mixer, variant), held-out MSE at init and after stage 1 (mean over the
    layers, then over seeds; +- half the spread of the seeds), and the stage's first and last training loss."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["mixer"], r["variant"]), []).append(r)
    lines = ["| mixer | variant | seeds | held-out MSE at init | after stage 1 | training loss, step 1 -> last |",
             "|---|---|---|---|---|---|"]
    def order(key: tuple[str, str]) -> tuple[int, int]:  # as VARIANTS lists them
        mixer, variant = key
        listed = [v or "default" for v in VARIANTS.get(mixer, [])]
        return (list(VARIANTS).index(mixer) if mixer in VARIANTS else len(VARIANTS),
                listed.index(variant) if variant in listed else len(listed))

    for (mixer, variant), rs in sorted(groups.items(), key=lambda item: order(item[0])):
        def mean_over_layers(r, when):
            vals = [x["mse"] for x in r["transfer"] if x["when"] == when]
            return sum(vals) / len(vals)
        init = [mean_over_layers(r, "init") for r in rs]
        after = [mean_over_layers(r, "stage1") for r in rs]
        first = [sum(v[0] for v in r["train_loss"].values()) / len(r["train_loss"]) for r in rs]
        last = [sum(v[1] for v in r["train_loss"].values()) / len(r["train_loss"]) for r in rs]
        spread = f" +- {(max(after) - min(after)) / 2:.3f}" if len(rs) > 1 else ""
        label = f"{variant} (authors)" if variant == (VARIANTS.get(mixer) or [None])[0] else variant
        lines.append(f"| {mixer} | {label} | {len(rs)} | {sum(init) / len(init):.3f} | "
                     f"{sum(after) / len(after):.3f}{spread} | {sum(first) / len(first):.3f} -> "
                     f"{sum(last) / len(last):.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mixers", default=",".join(VARIANTS), help="Comma list (default: every mixer listed).")
    p.add_argument("--layers", default="14-15", help="Stage-1 layer group (default 14-15).")
    p.add_argument("--steps", type=int, default=40, help="Stage-1 optimizer steps (default 40).")
    p.add_argument("--seq-len", type=int, default=512, help="data.seq_len (default 512).")
    p.add_argument("--seeds", default="0,1", help="job.seed values of the first two variants of each mixer (the "
                   "authors' init and the first single change; each seed also reshuffles the data); the other variants "
                   "run under the first seed only (default 0,1).")
    p.add_argument("--work", default="/tmp/transfer_sweep", help="Run directories (default /tmp/transfer_sweep).")
    p.add_argument("--out", required=True, help="The JSON to write (rewritten after every run).")
    p.add_argument("--table", action="store_true", help="Only print the Markdown table of --out's runs.")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(Path(args.out).read_text())["runs"]))
        return 0
    out, results = Path(args.out), []
    if out.is_file():
        results = json.loads(out.read_text())["runs"]
    done = {(r["mixer"], r["variant"], r["seed"]) for r in results}
    seeds = [int(x) for x in args.seeds.split(",")]
    for mixer in args.mixers.split(","):
        runs = [(v, s) for i, v in enumerate(VARIANTS[mixer]) for s in (seeds if i < 2 or v == "" else seeds[:1])]
        for variant, seed in runs:
            if (mixer, variant or "default", seed) not in done:
                results.append(measure(mixer, variant, seed, args, micro=4))
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps({"command": " ".join(sys.argv), "runs": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
