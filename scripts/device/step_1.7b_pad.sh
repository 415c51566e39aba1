#!/usr/bin/env bash
# One device call on nvidia-h200 (<= 10 min), for issue 8 (runs 19): the 1.7B stage-3 step after the bench teacher's
# zero padding row was filled (runs 16-18 found it behind the NaN losses): the plain engine without and with 6 of 24
# blocks recomputed, then ZeRO-2, micro-batch 8, each row checked for finite losses and no skipped step.
#   bash scripts/device/step_1.7b_pad.sh     (from the repository root, .devbundle carried)
#   DEVBUNDLE=DIR LARGE=tiny EXTRA="--device cpu --seq 64 --steps 2 --warmup 1" bash scripts/device/step_1.7b_pad.sh
set -u
source "${DEVBUNDLE:-.devbundle}/setup.sh"
out=${OUT:-device-out}/pad
work=/tmp/step-1.7b-pad
mkdir -p "$out" "$work"
source scripts/device/plain_bench.sh  # CUDA_VISIBLE_DEVICES, bench=(...), small, large
timeout 220 "${bench[@]}" --shape "$large" --micro-batch 8 --steps 8 ${EXTRA:-} --out "$work/19-1.7b-plain.json" > "$work/plain.log" 2>&1
timeout 120 "${bench[@]}" --shape "$large" --micro-batch 8 --steps 8 --grad-ckpt-fraction 0.25 ${EXTRA:-} \
  --out "$work/19-1.7b-plain-ckpt.json" > "$work/ckpt.log" 2>&1
zero2=("${bench[@]/#plain/zero3}")  # --engine zero3: the DeepSpeed engine, its ZeRO stage from zero2.json
timeout 150 "${zero2[@]}" --shape "$large" --micro-batch 8 --steps 8 ${EXTRA:-} --out "$work/19-1.7b-zero2.json" > "$work/zero2.log" 2>&1
cp "$work"/*.json "$out"/ 2>/dev/null
tar czf "$out/tables-and-logs.tgz" -C "$work" $(cd "$work" && ls *.md *.log 2>/dev/null)
grep -h "^| $large \|not trained\|skipped optimizer" "$work"/*.md "$work"/*.log 2>/dev/null | cut -c1-300
python3 - "$work" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    for r in json.loads(f.read_text()).get("step", []):
        print(f.name, r.get("engine"), "tok/s", round(r.get("tokens_per_s", 0)), "mfu", r.get("mfu"), "GiB",
              r.get("peak_mem_gib"), "losses", [round(x, 3) for x in r.get("losses_each", [])],
              "skipped", r.get("skipped_steps"), r.get("health", ""), r.get("error", ""))
PY
