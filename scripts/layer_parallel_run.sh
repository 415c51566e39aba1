#!/usr/bin/env bash
# Issue 9's measurement on one multi-GPU node: the whole pipeline (`harness run`) at the 1.7B shape with the
# per-layer stages as N parallel layer-group jobs (one per GPU) and stage 3 on N GPUs ("par"), or the same N
# groups one after another and stage 3 on one GPU ("seq"), with the same global batch (8 sequences of 2048).
# The teacher has SmolLM2-1.7B's shape with random weights and the real tokenizer (the weights are not available
# offline: timing, not quality); the corpus is synthetic.
#
#   bash scripts/layer_parallel_run.sh par|seq [SECONDS] [GPUS] [KEY=VALUE ...]
#
# SECONDS (default 500): after this long the run is asked to stop ($HARNESS_PREEMPT_FILE): the running stage
# writes a checkpoint and exits 85, and the same command resumes it, so the run fits device calls of 10 minutes.
# GPUS (default: all visible). KEY=VALUE: more job overrides (a CPU rehearsal: SHAPE=135M, GPUS=2, shorter
# sequences and budget). Writes under /tmp/{par,seq}; copies run.log, timings.jsonl, distill-metrics.jsonl and
# logs.tgz (group metrics and log tails) to $OUT/MODE (or ./layer-parallel-out/MODE): four files, as the device
# tool returns at most eight per call. Needs .carry/smollm2-tokenizer (docs/BENCHMARKS.md, command 2).
set -uo pipefail
mode=${1:?usage: layer_parallel_run.sh par|seq [SECONDS] [GPUS]}
seconds=${2:-500}
gpus=${3:-$(nvidia-smi -L 2>/dev/null | wc -l)}
shift $(( $# < 3 ? $# : 3 ))
shape=${SHAPE:-1.7B}
teacher=/tmp/teacher-$shape
[ "$mode" = par ] || [ "$mode" = seq ] || { echo "mode must be par or seq, got '$mode'" >&2; exit 2; }
[ "$gpus" -ge 1 ] 2>/dev/null && [ $((8 % gpus)) -eq 0 ] || { echo "GPUS must divide 8, got '$gpus'" >&2; exit 2; }
out=${OUT:-layer-parallel-out}/$mode
mkdir -p "$out"

[ -f "$teacher/config.json" ] || python3 scripts/make_shape_teacher.py --shape "$shape" \
    --tokenizer .carry/smollm2-tokenizer --out "$teacher" > /tmp/make-teacher.log 2>&1 || { tail /tmp/make-teacher.log; exit 1; }
[ -f /tmp/corpus.jsonl ] || python3 -c "import json; from tests.pipeline import documents; \
open('/tmp/corpus.jsonl', 'w').writelines(json.dumps({'text': d}) + '\n' for d in documents(120000, seed=1))"

# checkpoint_every_tokens=0: a checkpoint only at each stage's end and on the stop request (quickstart's 20,480
# tokens made the 1.7B layer groups save 3-10 GB every step, which tripled their step time: BENCHMARKS.md)
job=(jobs/quickstart.yaml teacher.source="$teacher" teacher.num_layers=null teacher.dtype=auto
     data.source=/tmp/corpus.jsonl data.seq_len=2048 data.validation_tokens=65536
     budget.total_tokens=4194304 "budget.split=[0.25,0.25,0.5]" run.checkpoint_every_tokens=0
     stages.align_mixer.micro_batch_size=8 stages.align_hidden.micro_batch_size=8
     run.layer_groups="$gpus" eval.enabled=false output_dir=/tmp/$mode)
if [ "$mode" = par ]; then
  job+=(run.parallel_groups="$gpus" deepspeed.world_size="$gpus" stages.distill.micro_batch_size=$((8 / gpus)))
else
  job+=(run.parallel_groups=1 deepspeed.world_size=1 stages.distill.micro_batch_size=8)
fi
job+=("$@")

# The two runs do not fit on the 128 GiB disk of nvidia-h200-x2 together (~60 GB each: the groups' stage-end
# checkpoints, the merged student, stage 3's 25 GB checkpoint and the export); seq's stop checkpoint once ran out
# of space. The other mode's results were copied to $OUT when it ended.
other=$([ "$mode" = par ] && echo seq || echo par)
rm -rf "/tmp/$other"
rm -f /tmp/harness-stop
(sleep "$seconds"; touch /tmp/harness-stop) & timer=$!
start=$(date +%s)
HARNESS_PREEMPT_FILE=/tmp/harness-stop python3 -m harness.cli run "${job[@]}" > "$out/run.log" 2>&1
rc=$?
kill "$timer" 2>/dev/null
echo "$mode: exit $rc after $(( $(date +%s) - start )) s$([ $rc -eq 85 ] && echo ': stopped with a checkpoint; run the same command again to resume')"
tail -3 "$out/run.log"
cp /tmp/$mode/logs/timings.jsonl "$out/" 2>/dev/null && cat "$out/timings.jsonl"
cp /tmp/$mode/distill/metrics.jsonl "$out/distill-metrics.jsonl" 2>/dev/null
rm -rf /tmp/$mode-tails && mkdir -p /tmp/$mode-tails
for f in /tmp/$mode/logs/*.log; do [ -f "$f" ] && tail -c 3000 "$f" > "/tmp/$mode-tails/$(basename "$f")"; done
tar czf "$out/logs.tgz" /tmp/$mode-tails /tmp/$mode/align_*/*/metrics.jsonl 2>/dev/null
exit $rc
