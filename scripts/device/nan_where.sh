#!/usr/bin/env bash
# One device call on nvidia-h200 (<= 10 min), for issue 8 (runs 17): where the first 1.7B steps' non-finite
# gradients come from (scripts/device/nan_where.py), with the compiled teacher (as the bench runs) and without.
#   bash scripts/device/nan_where.sh     (from the repository root, .devbundle carried)
set -u
source "${DEVBUNDLE:-.devbundle}/setup.sh"
out=${OUT:-device-out}/nan_where
mkdir -p "$out"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
timeout 280 python3 scripts/device/nan_where.py "$out/17-compiled.json" --steps 5 ${EXTRA:-} 2>&1 | grep -v Warning | tail -8
timeout 200 python3 scripts/device/nan_where.py "$out/17-eager.json" --steps 4 --no-compile ${EXTRA:-} 2>&1 | grep -v Warning | tail -6
