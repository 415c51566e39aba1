#!/usr/bin/env bash
# The small study (docs/STUDY.md) on a lent, offline GPU machine, from the repository root there.
#
#   bash scripts/study_small_device.sh setup    # once per machine, after the payload pieces are in /tmp/carry
#   bash scripts/study_small_device.sh lanes    # every run call: resumes what the last call left, then archives
#
# `lanes` runs LANES (default: four lanes, two per GPU: stage 3 keeps one job's GPU busy only about half the time,
# and greedy NIAH decoding at batch 1 is bound by the host) until STOP_AT seconds, when it touches
# $HARNESS_PREEMPT_FILE so every stage checkpoints and exits; whatever still runs at KILL_AT is killed. Then it
# writes the reports, metrics and logs of every run so far (no checkpoints or weights) to $OUT/study-small.tar.xz.
# GPU_TESTS="pytest arguments" also runs those GPU tests on the last GPU beside the lanes (log: $OUT/gpu_tests.log).
# HARNESS_DECODE_GRAPHS=0 makes the evaluations decode eagerly (harness/decoding.py).
# A job with `student.attention_layers: auto:K` (a hybrid) is ranked first, once: `harness transfer --rank-layers`
# with RANK_ARGS (default "--sequences 8 --seq-len 2048"), into the run's ranking/ (it comes back with the results).
# RUNS (default runs/study-small) is where the runs go and what comes back; OVERRIDES (default none) are job
# overrides given to every run, e.g. OVERRIDES="eval.enabled=false" with RUNS=runs/transfer-small for the
# transfer-fidelity runs of docs/TRANSFER.md. The payload may leave out lm-eval (evalsite) when nothing evaluates.
# A lane's job JOB is the file jobs/*/smollm2-135m-JOB.yaml (e.g. gla-small in jobs/study-small/, gla-50m in
# jobs/study-small-50m/, gated_deltanet-50m-paper in jobs/paper-recipe/). It may carry a tag, JOB/TAG (e.g.
# gated_deltanet-small/authors): the run is NAME-TAG, with the tag's overrides (tag_overrides below) after OVERRIDES.
# PREPARE (default: one small-study job) lists the jobs whose corpora `setup` tokenises: one per corpus and seq_len,
# e.g. PREPARE="jobs/study-small-50m/smollm2-135m-gla-50m.yaml jobs/paper-recipe/smollm2-135m-gated_deltanet-50m-paper.yaml".
set -u
S=${RUNS:-runs/study-small}
STOP_AT=${STOP_AT:-520}
KILL_AT=${KILL_AT:-555}
DEFAULT_LANES=("0:gated_deltanet-small kda-small" "0:deltanet-small gla-small"
               "1:linear_attn-small mlstm-small" "1:retnet-small linear_attn-small-seed2")

setup() {
  (cd /tmp/carry && cat study-payload.part-* >study-payload.tar.xz && sha256sum -c study-payload.sha256 \
     && tar -C /tmp -xJf study-payload.tar.xz) || exit 4
  rm -rf /tmp/carry
  source .devbundle/setup.sh || exit 4
  export HARNESS_CACHE=/tmp/hc HF_HUB_OFFLINE=1 PYTHONPATH=$PYTHONPATH:/tmp/evalsite
  if [ -d /tmp/evalsite ]; then python3 -c "import lm_eval" || exit 4; fi
  python3 -c "import harness; harness.load_teacher('smollm2-135m-instruct-gguf')" || exit 4
  local job
  for job in ${PREPARE:-jobs/study-small/smollm2-135m-gla-small.yaml}; do  # one job per corpus and seq_len
    python3 -m harness.cli data prepare "$job" >/tmp/prepare.log 2>&1 || { tail -n 20 /tmp/prepare.log; exit 4; }
    tail -n 7 /tmp/prepare.log
  done
  touch /tmp/hc/.ready
}

tag_overrides() {  # the job overrides of a lane tag
  case $1 in
    "") ;;
    authors) echo "student.options.gate_init=random student.options.output_scale=none" ;;  # before docs/TRANSFER.md
    authors-delta) echo "student.options.conv_init=random student.options.gate_init=random" \
                        "student.options.output_scale=none student.options.qkv_activation=silu" ;;
    seed2) echo "seed=2" ;;  # seed noise: another init draw and data order
    *) echo "unknown lane tag '$1'" >&2; return 1 ;;
  esac
}

lane() {  # lane GPU JOB[/TAG]...: the jobs one after another on one GPU; a failed job does not stop the lane
  local gpu=$1 m n job tag extra file
  shift
  for m; do
    job=${m%%/*}
    tag=${m#"$job"}
    tag=${tag#/}
    extra=$(tag_overrides "$tag") || continue
    n=smollm2-135m-$job${tag:+-$tag}
    [ -f "$S/$n/DONE" ] && continue
    [ -e "$HARNESS_PREEMPT_FILE" ] && return
    file=$(ls jobs/*/smollm2-135m-"$job".yaml 2>/dev/null | head -n 1)
    [ -n "$file" ] || { echo "lane $gpu: no jobs/*/smollm2-135m-$job.yaml"; continue; }
    # a hybrid that keeps auto:K layers reads them from its layer ranking: rank first (harness/ranking.py)
    # shellcheck disable=SC2086 # OVERRIDES, extra and RANK_ARGS are lists of words
    if grep -q "attention_layers: auto:" "$file" && [ ! -f "$S/$n/ranking/layer_ranking.json" ]; then
      CUDA_VISIBLE_DEVICES=$gpu python3 -m harness.cli transfer "$file" --rank-layers ${RANK_ARGS:---sequences 8 \
        --seq-len 2048} ${OVERRIDES:-} $extra name="$n" output_dir="$S/$n" || { echo "lane $gpu: $n: ranking failed"; continue; }
    fi
    # shellcheck disable=SC2086 # OVERRIDES and extra are lists of key=value words
    if CUDA_VISIBLE_DEVICES=$gpu python3 -m harness.cli run "$file" ${OVERRIDES:-} \
         $extra name="$n" output_dir="$S/$n"; then
      touch "$S/$n/DONE"
    else
      echo "lane $gpu: $n stopped or failed (rc $?) at ${SECONDS}s"
    fi
  done
}

lanes() {
  source .devbundle/setup.sh || exit 4
  test -f /tmp/hc/.ready || { echo "fresh machine: carry the payload again and run setup"; exit 3; }
  export HARNESS_CACHE=/tmp/hc PYTHONPATH=$PYTHONPATH:/tmp/evalsite HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
         HARNESS_PREEMPT_FILE=/tmp/stop S OVERRIDES
  export -f lane tag_overrides
  rm -f /tmp/stop
  mkdir -p "$S" "$OUT"
  (sleep $((STOP_AT - SECONDS)); touch /tmp/stop) &
  local stopper=$! specs=("${DEFAULT_LANES[@]}") pids=() i=0 spec
  [ -n "${LANES:-}" ] && IFS=';' read -r -a specs <<<"$LANES"
  if [ -n "${GPU_TESTS:-}" ]; then
    # shellcheck disable=SC2086 # GPU_TESTS is a list of pytest arguments
    CUDA_VISIBLE_DEVICES=$(nvidia-smi -L | tail -n 1 | cut -d: -f1 | tr -dc 0-9) timeout $((KILL_AT - SECONDS)) \
      python3 -m pytest -q $GPU_TESTS >"$OUT/gpu_tests.log" 2>&1 &
    pids+=($!)
  fi
  for spec in "${specs[@]}"; do
    timeout $((KILL_AT - SECONDS)) bash -c "lane ${spec%%:*} ${spec#*:}" >>"$S/lane$i.log" 2>&1 &
    pids+=($!)
    i=$((i + 1))
  done
  wait "${pids[@]}"
  kill $stopper 2>/dev/null
  tail -n 2 "$S"/lane*.log
  ls "$S"/*/DONE 2>/dev/null
  for t in "$S"/*/logs/timings.jsonl; do [ -f "$t" ] && echo "$t: $(tr '\n' ' ' <"$t" | cut -c1-400)"; done
  local top=${S#runs/}
  (cd runs && find "$top" -regex "$top/[^/]*/\(student\|merged\|student-sft\)" -prune \
     -o \( -name checkpoints -o -name tb -o -name snapshots \) -prune -o -type f ! -name '*.safetensors' -print \
     | tar -cJf "$OUT/$top.tar.xz" -T -)
  ls -l "$OUT"
}

case "${1:-}" in
  setup) setup ;;
  lanes) lanes ;;
  *) echo "usage: $0 setup|lanes (see docs/STUDY.md)"; exit 2 ;;
esac
