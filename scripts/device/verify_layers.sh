#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (~9 min): the GPU layer tests still owed by issue 8's fusions, split over the
# two GPUs. GPU 1: the fused gated norm's own test first, then the gla and deltanet layers; GPU 0: the
# gated_deltanet, kda and mlstm layers (linear_attn and retnet passed in runs 6). Each layer test compiles its own
# Triton kernels (60-150 s), which is why the whole file does not fit one call.
#
#   bash scripts/device/verify_layers.sh        (from the repository root, .devbundle carried)
#
# Writes $OUT/verify/gpu{0,1}-tests.log and prints their summaries.
set -u
source "${DEVBUNDLE:-.devbundle}/setup.sh"  # DEVBUNDLE: another set-up script's folder (a CPU rehearsal)
out=${OUT:-device-out}/verify
mkdir -p "$out"
tests=(python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mixer_layers.py)
(
  export CUDA_VISIBLE_DEVICES=1
  timeout 200 "${tests[@]}" -k fused > "$out/gpu1-tests.log" 2>&1
  timeout 340 "${tests[@]}" -k "135M-2048 and (gla or (deltanet and not gated))" >> "$out/gpu1-tests.log" 2>&1
) &
CUDA_VISIBLE_DEVICES=0 timeout 540 "${tests[@]}" -k "135M-2048 and (gated_deltanet or kda or mlstm)" \
  > "$out/gpu0-tests.log" 2>&1
wait
for f in "$out"/gpu0-tests.log "$out"/gpu1-tests.log; do echo "== $f"; grep -E "passed|failed|error|skipped|no tests ran" "$f" | tail -n 4; done
