"""`harness bench`: throughput, MFU, memory and where the time goes in a stage-3 step; kernel and decoding speed.

Four measurements (``--what step,kernels,recurrences,decode``), each in one JSON file plus a Markdown table:

  step      `harness.bench.step.bench_step`: the stage-3 distillation step as `harness stage distill` runs it
            (tokens/s, MFU, peak memory, the time of each phase, communication)
  kernels   `harness.bench.kernels.bench_kernels` (CUDA only): each mixer layer's Triton kernel path against
            its PyTorch reference (errors, forward+backward times, the recurrence alone, a profile)
  recurrences `harness.bench.recurrences.measure_errors` (CUDA only): every fla route of each recurrence case
            on raw inputs against the float32 reference, errors against the limits and times (also the case
            library of tests/gpu/test_kernels.py)
  decode    `harness.bench.decode.bench_decode`: greedy decoding per token, the student's recurrent state
            against the teacher's KV cache, across context lengths

The other modules: `shapes` (the SmolLM2 teacher shapes, parameter counts, the teacher/student pair),
`machine` (device, dtype, the environment record), `phases` (the step's phase clock), `profiling`
(torch.profiler passes: communication and top operators), `targets` (the targets a row meets or not),
`report` (Markdown and the JSON/.md files) and `cli` (`harness bench`, also `python -m harness.bench`).
FLOPs per token, GPU peaks and MFU are in `harness.flops`. Results and commands: docs/BENCHMARKS.md.
"""
