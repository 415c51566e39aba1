# Sourced by the device bench scripts (bench51_alternate.sh, step_repeat.sh): the bundle (DEVBUNDLE, default
# .devbundle; empty for a CPU rehearsal), OUT made absolute, one Triton cache shared by the processes, PY.
DEVBUNDLE=${DEVBUNDLE-.devbundle}
[ -z "$DEVBUNDLE" ] || source "$DEVBUNDLE/setup.sh" || exit 4
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
PY=${PY:-python3}
