# Sourced by the plain-engine step scripts (step_plain.sh, step_fused.sh): one GPU, the stage-3 bench command of
# the plain engine (Gated DeltaNet, 2048 tokens, one profiled step), and the two shapes (SMALL= / LARGE= for a
# CPU rehearsal).
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
bench=(python3 -m harness.cli bench --mixer gated_deltanet --seq 2048 --warmup 3 --profile-steps 1 --engine plain
       --student-ds-config ds_configs/zero2.json)
small=${SMALL:-135M}
large=${LARGE:-1.7B}
