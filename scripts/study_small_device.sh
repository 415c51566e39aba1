#!/usr/bin/env bash
# The small study (docs/STUDY.md) on a lent, offline GPU machine, from the repository root there.
#
#   bash scripts/study_small_device.sh setup    # once per machine, after the payload pieces are in /tmp/carry
#   bash scripts/study_small_device.sh lanes    # every run call: resumes what the last call left, then archives
#   bash scripts/study_small_device.sh start    # or: the lanes in a process session of their own, which runs on
#   bash scripts/study_small_device.sh watch    #   between calls; each call then waits for them and archives
#   bash scripts/study_small_device.sh stop     # ends detached lanes (and their GPU tests), e.g. to start a fixed job
#   bash scripts/study_small_device.sh kernels  # the compiled kernels into $OUT, for a later machine (below)
#   bash scripts/study_small_device.sh exec CMD...  # CMD in the lanes' environment (payload cache, lm-eval, offline
#                                               # hub), e.g. `exec python3 -m harness.cli eval niah RUNS/x/student`
#
# `lanes` runs LANES (default: four lanes, two per GPU: stage 3 keeps one job's GPU busy only about half the time,
# and greedy NIAH decoding at batch 1 is bound by the host; lanes naming one GPU of under SHARE_GPU_MIN_GIB, default
# 100, are joined into one lane that runs their jobs in turn: two 135M stage 3s do not fit an H100) until STOP_AT
# seconds, when it touches $HARNESS_PREEMPT_FILE so every stage checkpoints and exits; whatever still runs at KILL_AT
# is killed. Then it writes the reports, metrics and logs of every run so far (no checkpoints or weights) to
# $OUT/study-small.tar.xz.
# GPU_TESTS="pytest arguments" also runs those GPU tests on the last GPU beside the lanes (log: RUNS/gpu_tests.log,
# copied to $OUT); the lanes' end does not wait for them (`watch` says when they still run). `start` fails (exit 5)
# while lanes it started earlier still run, so that `start && watch` never waits on lanes it did not start.
# GPU_TESTS is split on spaces: a quoted filter goes through PYTEST_ADDOPTS, e.g. PYTEST_ADDOPTS="-k 'kda or mlstm'".
# HARNESS_DECODE_GRAPHS=0 makes the evaluations decode eagerly (harness/decoding.py).
# A job with `student.attention_layers: auto:K` (a hybrid) is ranked first, once: `harness transfer --rank-layers`
# with RANK_ARGS (default "--sequences 8 --seq-len 2048"), into the run's ranking/ (it comes back with the results),
# by the measure that its `auto:K:MEASURE` names (`--rank-by` defaults to it).
# `start` + `watch` (detached lanes): no preemption and resume at each call's end. The device tool leaves a process
# session of its own running when the call returns, so the lanes go on while the next call comes (it must come
# within the machine's 30 s, as for `lanes`) and stage 3 loses nothing at the boundary; `watch` returns as soon as
# every lane has finished (LANES_FINISHED), else WATCH_FOR seconds (default 570) into its call, archiving as `lanes`;
# while it waits it also archives every ARCHIVE_EVERY seconds (default 60), so that a call the device tool cuts off at
# its limit (the session's device time running out before WATCH_FOR) still brings back what had run by then.
# SEED (default .cache/study-seed, if the setup call carries it) is copied into RUNS by `setup`, e.g. a teacher's cached
# evaluation: a path carried in one call and not the next is removed on the machine, so runs must not be carried.
# RUNS (default runs/study-small) is where the runs go and what comes back; OVERRIDES (default none) are job
# overrides given to every run, e.g. OVERRIDES="eval.enabled=false" with RUNS=runs/transfer-small for the
# transfer-fidelity runs of docs/TRANSFER.md. The payload may leave out lm-eval (evalsite) when nothing evaluates.
# A lane's job JOB is the file jobs/*/smollm2-135m-JOB.yaml (e.g. gla-small in jobs/study-small/, gla-50m in
# jobs/study-small-50m/, gated_deltanet-50m-paper in jobs/paper-recipe/). It may carry a tag, JOB/TAG (e.g.
# gated_deltanet-small/authors): the run is NAME-TAG, with the tag's overrides (tag_overrides below) after OVERRIDES.
# PREPARE (default: one small-study job) lists the jobs whose corpora `setup` tokenises: one per corpus and seq_len,
# e.g. PREPARE="jobs/study-small-50m/smollm2-135m-gla-50m.yaml jobs/paper-recipe/smollm2-135m-gated_deltanet-50m-paper.yaml".
# Compiled kernels: a `watch` that finds every lane finished also writes $OUT/kernel-cache.tar.xz, the Triton and
# TileLang caches the bundle keeps in .cache/triton and .cache/tilelang, and $OUT/inductor-cache.tar.xz, torch.compile's
# cache (the compiled teacher, ~1 min a stage-3 process cold), kept in .cache/inductor (`kernels` writes them on demand; the first
# `watch` that sees a lane's stage 3 begun writes it once too, so a lease cut short keeps the training kernels), unless it
# exceeds KERNEL_CACHE_MAX_BYTES (default 16,000,000: a file the device tool returns). Carried beside the payload
# pieces into /tmp/carry on a later machine (same image, any Hopper GPU), `setup` unpacks it, so that the stages
# start from compiled kernels instead of compiling them again.
set -u
S=${RUNS:-runs/study-small}
D=${DEVICE_TMP:-/tmp}  # where the pieces arrive (carry/) and the payload unpacks (hc/, evalsite/)
DEFAULT_LANES=("0:gated_deltanet-small kda-small" "0:deltanet-small gla-small"
               "1:linear_attn-small mlstm-small" "1:retnet-small linear_attn-small-seed2")

setup() {
  (cd "$D/carry" && cat study-payload.part-* >study-payload.tar.xz && sha256sum -c study-payload.sha256 \
     && tar -C "$D" -xJf study-payload.tar.xz) || exit 4
  kernels_in
  rm -rf "$D/carry"
  source .devbundle/setup.sh || exit 4
  export HARNESS_CACHE="$D/hc" HF_HUB_OFFLINE=1 PYTHONPATH=$PYTHONPATH:$D/evalsite \
         TORCHINDUCTOR_CACHE_DIR="$PWD/.cache/inductor"
  if [ -d "$D/evalsite" ]; then python3 -c "import lm_eval" || exit 4; fi
  python3 -c "import harness; harness.load_teacher('smollm2-135m-instruct-gguf')" || exit 4
  local job
  for job in ${PREPARE:-jobs/study-small/smollm2-135m-gla-small.yaml}; do  # one job per corpus and seq_len
    python3 -m harness.cli data prepare "$job" >"$D/prepare.log" 2>&1 || { tail -n 20 "$D/prepare.log"; exit 4; }
    tail -n 7 "$D/prepare.log"
  done
  local seed=${SEED:-.cache/study-seed}
  if [ -d "$seed" ]; then mkdir -p "$S" && cp -rn "$seed"/. "$S"/; fi
  touch "$D/hc/.ready"
}

kernels_in() {  # an earlier lease's compiled kernels, carried beside the pieces; a bad archive only costs the compiles
  local name archive
  mkdir -p .cache
  for name in kernel-cache inductor-cache; do
    archive="$D/carry/$name.tar.xz"
    [ -f "$archive" ] || continue
    if tar -C .cache -xJf "$archive" 2>/dev/null; then
      echo "$name: $(tar -tJf "$archive" | grep -vc '/$') files from $archive"
    else
      echo "$name $archive unreadable: the kernels compile afresh"
    fi
  done
  return 0
}

kernels() {  # the Triton and TileLang caches into $OUT/kernel-cache.tar.xz and torch.compile's (Inductor's) into
  # $OUT/inductor-cache.tar.xz, each if a returned file may be that large
  pack kernel-cache triton tilelang
  pack inductor-cache inductor
}

pack() {  # pack NAME DIR...: the existing .cache/DIRs into $OUT/NAME.tar.xz, unless over KERNEL_CACHE_MAX_BYTES
  local name=$1 dirs=() max=${KERNEL_CACHE_MAX_BYTES:-16000000} size d
  shift
  for d; do [ -d ".cache/$d" ] && dirs+=("$d"); done
  [ ${#dirs[@]} -gt 0 ] || { echo "no $name in .cache/{$(IFS=,; echo "$*")}"; return 0; }
  mkdir -p "$OUT"
  tar -C .cache -I 'xz -T0 -6' -cf "$OUT/$name.tar.xz.part" "${dirs[@]}" || { rm -f "$OUT/$name.tar.xz.part"; return 0; }
  size=$(stat -c %s "$OUT/$name.tar.xz.part")
  if [ "$size" -gt "$max" ]; then
    rm -f "$OUT/$name.tar.xz.part"
    echo "$name is $size bytes, over KERNEL_CACHE_MAX_BYTES ($max): not kept"
  else
    mv "$OUT/$name.tar.xz.part" "$OUT/$name.tar.xz"
    echo "$name: $OUT/$name.tar.xz ($size bytes; carry it beside a later lease's pieces)"
  fi
}

kernels_once() {  # the kernels once a lane's stage 3 has begun (stages 1-3 compiled), once per machine: a lease
  # that ends before the lanes do still brings back the training kernels, not only a finished one's
  [ -f "$S/.kernels_returned" ] && return 0
  compgen -G "$S/*/distill/metrics.jsonl" >/dev/null || return 0
  echo "stage 3 has begun:"; kernels
  [ -f "$OUT/kernel-cache.tar.xz" ] && touch "$S/.kernels_returned"
  return 0
}

tag_overrides() {  # the job overrides of a lane tag
  case $1 in
    "") ;;
    authors) echo "student.options.gate_init=random student.options.output_scale=none" ;;  # before docs/TRANSFER.md
    authors-delta) echo "student.options.conv_init=random student.options.gate_init=random" \
                        "student.options.output_scale=none student.options.qkv_activation=silu" ;;
    seed2) echo "seed=2" ;;  # seed noise: another init draw and data order
    lr3e-4) echo "stages.distill.lr=3.0e-4" ;;  # stage 3 at 3x the 12M jobs' 1e-4 (the toy's lr lever, issue 50)
    lr1e-3) echo "stages.distill.lr=1.0e-3" ;;  # 10x: the rate at which the toy's student copies again
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
    # the evaluations along stage 3 share the lane's GPU (HARNESS_EVAL_GPU): on the host's CPU, where harness puts
    # them by default, one took over 5 min for its perplexity alone and was unfinished when the lease ended
    # shellcheck disable=SC2086 # OVERRIDES and extra are lists of key=value words
    if CUDA_VISIBLE_DEVICES=$gpu HARNESS_EVAL_GPU=${HARNESS_EVAL_GPU-$gpu} python3 -m harness.cli run "$file" ${OVERRIDES:-} \
         $extra name="$n" output_dir="$S/$n"; then
      touch "$S/$n/DONE"
    else
      echo "lane $gpu: $n stopped or failed (rc $?) at ${SECONDS}s"
    fi
  done
}

environment() {  # the installed bundle and the payload's cache; every lane inherits it
  source .devbundle/setup.sh || exit 4
  test -f "$D/hc/.ready" || { echo "fresh machine: carry the payload again and run setup"; exit 3; }
  export HARNESS_CACHE="$D/hc" PYTHONPATH=$PYTHONPATH:$D/evalsite HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
         HARNESS_PREEMPT_FILE="$D/stop" S OVERRIDES TORCHINDUCTOR_CACHE_DIR="$PWD/.cache/inductor"
  export -f lane tag_overrides
  mkdir -p "$S"
}

gpu_gib() {  # GPU $1's memory in GiB (whole), or nothing where nvidia-smi does not say
  local mib
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i "$1" 2>/dev/null | head -n 1 | tr -d ' ')
  [[ $mib =~ ^[0-9]+$ ]] && echo $((mib / 1024))
}

join_small_gpu_lanes() {  # lane specs (stdin, one a line) -> the same, with the lanes that share a GPU of under
  # SHARE_GPU_MIN_GIB (default 100) joined into one lane that runs their jobs one after another: two stage-3 lanes
  # of a 135M job (~51 GiB each, and an evaluation beside one) do not fit an 80 GB H100 (2026-12-07)
  local min=${SHARE_GPU_MIN_GIB:-100} spec gpu gib order=() i
  declare -A jobs=()
  while IFS= read -r spec; do
    [ -n "$spec" ] || continue
    gpu=${spec%%:*}
    gib=$(gpu_gib "$gpu")
    if [ -n "$gib" ] && [ "$gib" -lt "$min" ] && [ -n "${jobs[$gpu]+x}" ]; then
      echo "lanes: GPU $gpu has $gib GiB (< $min): ${spec#*:} runs after ${jobs[$gpu]} in one lane" >&2
      jobs[$gpu]="${jobs[$gpu]} ${spec#*:}"
      continue
    fi
    [ -n "${jobs[$gpu]+x}" ] && gpu="$gpu#${#order[@]}"  # a second lane on a large GPU keeps its own
    jobs[$gpu]=${spec#*:}
    order+=("$gpu")
  done
  for i in "${order[@]}"; do echo "${i%%#*}:${jobs[$i]}"; done
}

run_lanes() {  # every lane at once (and GPU_TESTS beside them) until the lanes end or KILL_AT seconds pass
  local specs=("${DEFAULT_LANES[@]}") pids=() i=0 spec limit=${KILL_AT:-}
  [ -n "${LANES:-}" ] && IFS=';' read -r -a specs <<<"$LANES"
  mapfile -t specs < <(printf '%s\n' "${specs[@]}" | join_small_gpu_lanes 2>"$S/lanes.joined")
  [ -s "$S/lanes.joined" ] && cat "$S/lanes.joined"
  if [ -n "${GPU_TESTS:-}" ]; then  # not waited for here: the lanes' end is what `watch` waits for
    # shellcheck disable=SC2086 # GPU_TESTS is a list of pytest arguments
    CUDA_VISIBLE_DEVICES=$(nvidia-smi -L | tail -n 1 | cut -d: -f1 | tr -dc 0-9) \
      ${limit:+timeout $((limit - SECONDS))} python3 -m pytest -q $GPU_TESTS >"$S/gpu_tests.log" 2>&1 &
  fi
  for spec in "${specs[@]}"; do
    ${limit:+timeout $((limit - SECONDS))} bash -c "lane ${spec%%:*} ${spec#*:}" >>"$S/lane$i.log" 2>&1 &
    pids+=($!)
    i=$((i + 1))
  done
  wait "${pids[@]}"
}

archive() {  # the reports, metrics and logs of every run so far (no checkpoints or weights) into $OUT
  mkdir -p "$OUT"
  tail -n 2 "$S"/lane*.log
  [ -f "$S/gpu_tests.log" ] && cp "$S/gpu_tests.log" "$OUT/"
  ls "$S"/*/DONE 2>/dev/null
  for t in "$S"/*/logs/timings.jsonl; do [ -f "$t" ] && echo "$t: $(tr '\n' ' ' <"$t" | cut -c1-400)"; done
  local top=${S#runs/} rc=0
  (cd runs && find "$top" -regex "$top/[^/]*/\(student\|merged\|student-sft\)" -prune \
     -o \( -name checkpoints -o -name tb -o -name snapshots \) -prune -o -type f ! -name '*.safetensors' -print \
     | tar -cJf "$OUT/$top.tar.xz.part" -T -) || rc=$?
  # never half an archive; but GNU tar exits 1 when a file changed while it was read (a log or result still being
  # written by the lanes), and that archive is whole: keeping the older one would drop every result since
  if [ "$rc" -le 1 ]; then mv "$OUT/$top.tar.xz.part" "$OUT/$top.tar.xz"; else rm -f "$OUT/$top.tar.xz.part"; fi
  ls -l "$OUT"
}

lanes() {  # one call's share: preempt at STOP_AT (checkpoints), kill at KILL_AT, archive
  environment
  STOP_AT=${STOP_AT:-520} KILL_AT=${KILL_AT:-555}
  rm -f "$D/stop"
  # the sleep dies with its subshell, so that a call whose lanes end early returns at once
  (trap 'kill $! 2>/dev/null; exit' TERM; sleep $((STOP_AT - SECONDS)) & wait $!; touch "$D/stop") &
  local stopper=$!
  run_lanes
  kill $stopper 2>/dev/null
  wait  # the GPU tests, bounded by KILL_AT
  archive
}

start() {  # the lanes in a new process session: the device tool leaves it running when the call returns
  environment
  if [ ! -f "$S/LANES_FINISHED" ] && [ -f "$S/lanes.pid" ] && kill -0 "$(cat "$S/lanes.pid")" 2>/dev/null; then
    # a failure, so that `start && watch` does not wait on lanes that were not started by this call
    echo "lanes already running (pid $(cat "$S/lanes.pid")): \`watch\` them, or \`stop\` them and start again"
    return 5
  fi
  rm -f "$S/LANES_FINISHED" "$D/stop"
  KILL_AT='' setsid nohup bash "$0" run-lanes >"$S/lanes.out" 2>&1 </dev/null &
  echo $! >"$S/lanes.pid"
  echo "lanes started (pid $!): $S/lanes.out"
}

stop() {  # end the detached lanes and GPU tests (their whole process session); finished stages stay finished
  local pid
  pid=$(cat "$S/lanes.pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null || { echo "no lanes running"; return 0; }
  kill -- -"$pid" 2>/dev/null
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  echo "stopped the lanes (process session $pid)"
}

watch() {  # wait for the detached lanes (at most WATCH_FOR seconds into this process), archiving as it waits
  local until=${WATCH_FOR:-570} every=${ARCHIVE_EVERY:-60} last=$SECONDS
  while [ ! -f "$S/LANES_FINISHED" ] && [ "$SECONDS" -lt "$until" ]; do
    if ! kill -0 "$(cat "$S/lanes.pid" 2>/dev/null)" 2>/dev/null; then echo "lanes not running"; break; fi
    # a call cut off by the device tool's limit (the session's device time running out) still brings back $OUT
    if [ $((SECONDS - last)) -ge "$every" ]; then kernels_once; archive >/dev/null 2>&1; last=$SECONDS; fi
    sleep 1
  done
  if [ -f "$S/LANES_FINISHED" ]; then echo "all lanes finished"; kernels
  else echo "lanes still running at ${SECONDS}s"; kernels_once; fi
  pgrep -s "$(cat "$S/lanes.pid" 2>/dev/null || echo 0)" -f "pytest" >/dev/null 2>&1 && echo "GPU tests still running"
  archive
}

case "${1:-}" in
  setup) setup ;;
  lanes) lanes ;;
  start) start ;;
  watch) environment && watch ;;
  stop) stop ;;
  kernels) kernels ;;
  run-lanes) environment && run_lanes; touch "$S/LANES_FINISHED"; wait ;;  # what `start` runs, detached
  exec) shift; [ $# -gt 0 ] || { echo "usage: $0 exec COMMAND [ARGS...]"; exit 2; }; environment && exec "$@" ;;
  *) echo "usage: $0 setup|lanes|start|watch|stop|kernels|exec (see docs/STUDY.md)"; exit 2 ;;
esac
