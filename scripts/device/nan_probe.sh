#!/usr/bin/env bash
# One device call (runs 18): scripts/device/nan_probe.py at 1.7B, eager teacher, 5 steps.
set -u
source "${DEVBUNDLE:-.devbundle}/setup.sh"
out=${OUT:-device-out}/nan_probe
mkdir -p "$out"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONPATH=$PWD:$PWD/scripts/device:${PYTHONPATH:-}
timeout 300 python3 scripts/device/nan_probe.py "$out/18-probe.json" --steps 5 ${EXTRA:-} 2>&1 | grep -v Warning | tail -12 | cut -c1-1500
