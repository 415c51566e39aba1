#!/usr/bin/env bash
# Does stage 3's step repeat bit for bit, and what does keeping attention layers cost it? The 135M stage-3 step
# bench (same seed, same random batches) of the pure gated_deltanet student and of the hybrid keeping the teacher's
# attention in LAYERS, one process after another on one GPU with a shared Triton cache, in the order ORDER gives
# (default: pure, hybrid, hybrid; the speeds form a side-by-side pair, each after its warm-up steps, and the two
# hybrids say whether its step repeats; three processes fit one 10-minute call). Two trainings of one hybrid job diverged in stage 3 only
# (docs/results/retrieval-135m/README.md, "The lease of 2026-12-06 (evening)"); the pure student's step repeated
# bit for bit in seven processes (docs/BENCHMARKS.md, issue 51 alternating). From the repository root:
#
#   bash scripts/device/step_repeat.sh          # on the device, carrying .devbundle (and the kernel cache unpacked)
#   DEVBUNDLE= PY=.venv/bin/python SHAPE="--shape tiny --device cpu --seq 64" MICRO=2 STEPS=2 WARMUP=0 LAYERS=1 \
#     ORDER="hybrid hybrid" bash scripts/device/step_repeat.sh   # CPU rehearsal (tests/test_step_repeat_script.py)
#
# Each process gets T seconds (the first T0). Writes $OUT/NN-KIND.json and .log for each and $OUT/summary.txt: the
# machine, the arguments, one line per process (exit code, wall time, tokens/s, peak memory) and, per kind, whether
# its processes' losses and gradient norms are bit-identical at every step (else the first step that differs).
# ORDER="strict strict" (a second call): the hybrid under torch.use_deterministic_algorithms(True), which makes
# torch's flash attention backward order its sums: whether that makes it repeat, and at what cost.
# ORDER="compiled pure compiled pure": the pure student with its blocks compiled (--compile-student, issue 51)
# against the eager one, alternating in one call.
# ORDER="pieces pure pieces pure": the pure student with `--option pieces=compiled` (the short convolution and the
# gated norm as compiled PyTorch forms instead of fla's kernels; benchmarks/mixer_pieces.py times them alone); norm:
# `--option pieces=compiled-norm` (only the norm compiled, the pair the pieces' H100 micro-bench found fastest); qkv:
# `--option fused_qkv=true` (one q/k/v matmul); fast: norm and qkv. pure pins `fused_qkv=false` (the step as measured
# before fused_qkv became the default); default: whatever the options' defaults are. hidden: default plus stage 3's
# per-layer hidden-state term at weight HIDDEN (0.1; the teacher then runs uncompiled): what the term costs.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/bench_env.sh"  # DEVBUNDLE, OUT, TRITON_CACHE_DIR, PY
ORDER=${ORDER:-pure hybrid hybrid}
LAYERS=${LAYERS:-18,23}
SHAPE=${SHAPE:---shape 135M --seq 2048}
ARGS="bench --what step $SHAPE --mixer gated_deltanet --engine plain --teacher-placement replicated --micro-batch ${MICRO:-32} --steps ${STEPS:-10} --warmup ${WARMUP:-3} --profile-steps 0"
for kind in $ORDER; do
  case $kind in pure|default|hybrid|strict|compiled|pieces|norm|qkv|fast|hidden) ;; *) echo "ORDER has $kind: allowed are pure, default, hybrid, strict, compiled, pieces, norm, qkv, fast, hidden"; exit 2 ;; esac
done
{ command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || uname -m; } >"$OUT/summary.txt"
echo "args: $ARGS | hybrid: --attention-layers $LAYERS | order: $ORDER | code: $CODE" >>"$OUT/summary.txt"
i=0
for kind in $ORDER; do
  i=$((i + 1)); tag=$(printf '%02d-%s' "$i" "$kind")
  if [ "$i" = 1 ]; then t=${T0:-240}; else t=${T:-150}; fi
  case $kind in
    pure) extra="--option fused_qkv=false" ;;  # three q/k/v matmuls, fla's pieces: the student as measured before 2026-12-07
    default) extra="" ;;  # the pure student under the options' defaults (fused_qkv on since 2026-12-07)
    compiled) extra="--compile-student" ;;  # the pure student, its blocks compiled (stages.distill.compile_student)
    pieces) extra="--option pieces=compiled" ;;  # the pure student, its conv and gated norm compiled
    norm) extra="--option pieces=compiled-norm" ;;  # the pure student, its gated norm compiled, fla's conv
    qkv) extra="--option fused_qkv=true" ;;  # the pure student, q/k/v projected by one matmul
    fast) extra="--option pieces=compiled-norm --option fused_qkv=true" ;;  # the fastest pieces and one matmul
    hidden) extra="--hidden-weight ${HIDDEN:-0.1}" ;;  # the defaults plus stage 3's per-layer hidden-state term
    *) extra="--attention-layers $LAYERS" ;;
  esac
  start=$SECONDS
  if [ "$kind" = strict ]; then  # the hybrid under torch's deterministic algorithms (an error where an op has none)
    CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout "$t" $PY -c 'import sys, torch; torch.use_deterministic_algorithms(True); from harness.cli import main; sys.exit(main(sys.argv[1:]))' \
      $ARGS $extra --out "$OUT/$tag.json" >"$OUT/$tag.log" 2>&1
  else
    timeout "$t" $PY -m harness.cli $ARGS $extra --out "$OUT/$tag.json" >"$OUT/$tag.log" 2>&1
  fi
  rc=$?
  got=$($PY -c "import json,sys; s=json.load(open(sys.argv[1]))['step'][0]; print(round(s['tokens_per_s']), 'tokens/s', round(s['peak_mem_bytes'] / 2**30, 1), 'GiB')" "$OUT/$tag.json" 2>/dev/null)
  echo "$tag exit $rc, ${SECONDS}s in, $((SECONDS - start)) s: ${got:-no result}" | tee -a "$OUT/summary.txt"
done
$PY - "$OUT" $ORDER <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path
out, order = Path(sys.argv[1]), sys.argv[2:]
firsts = {}
for i, k in enumerate(order, 1):
    path = out / f"{i:02d}-{k}.json"
    if k not in firsts and path.is_file():
        row = json.loads(path.read_text())["step"][0]
        if "losses_each" in row:
            firsts[k] = row
family = {"hybrid": "hybrid", "strict": "hybrid", "hidden": "hidden"}  # the others: the pure student, its loss
bases = {}
for kind, row in firsts.items():  # each kind's losses against the first kind of its model's, step by step
    base_kind = bases.setdefault(family.get(kind, "pure"), kind)
    if base_kind != kind:
        diffs = [abs(a - b) / abs(b) for a, b in zip(row["losses_each"], firsts[base_kind]["losses_each"])]
        print(f"{kind} against {base_kind}: losses' largest relative difference over {len(diffs)} steps "
              f"{max(diffs):.2e}")
for kind in dict.fromkeys(order):
    rows = []
    for i, k in enumerate(order, 1):
        path = out / f"{i:02d}-{k}.json"
        if k == kind and path.is_file():
            rows += json.loads(path.read_text())["step"][:1]
    rows = [r for r in rows if "losses_each" in r]
    if len(rows) < 2:
        print(f"{kind}: {len(rows)} finished process(es), nothing to compare")
        continue
    first = rows[0]
    for n, row in enumerate(rows[1:], 2):
        steps = list(zip(first["losses_each"], row["losses_each"], first["grad_norms_each"], row["grad_norms_each"]))
        differs = [s for s, (a, b, ga, gb) in enumerate(steps) if a != b or ga != gb]
        verdict = "bit-identical at every step" if not differs else f"first differs at step {differs[0]}"
        print(f"{kind}: process {n} against process 1 over {len(steps)} steps: {verdict}")
EOF
