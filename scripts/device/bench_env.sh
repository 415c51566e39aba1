# Sourced by the device bench scripts (bench51_alternate.sh, step_repeat.sh): the bundle (DEVBUNDLE, default
# .devbundle; empty for a CPU rehearsal), OUT made absolute, one Triton cache shared by the processes, PY, and
# CODE: the code that runs, as the sha256 of harness/'s Python files (the device's copy of .git can be stale; the
# same command gives the id on any checkout: find harness -name '*.py' | LC_ALL=C sort | xargs cat | sha256sum).
DEVBUNDLE=${DEVBUNDLE-.devbundle}
[ -z "$DEVBUNDLE" ] || source "$DEVBUNDLE/setup.sh" || exit 4
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
PY=${PY:-python3}
CODE="harness/ sha256 $(find harness -name '*.py' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-12), git HEAD $(git rev-parse --short HEAD 2>/dev/null || echo none)"
