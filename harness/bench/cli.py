"""`harness bench` (and `python -m harness.bench`, same arguments): the command line of the step, kernel and
decode benches."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from harness.bench.decode import bench_decode
from harness.bench.kernels import bench_kernels
from harness.bench.machine import environment, free_memory, resolve_device
from harness.bench.recurrences import LAYOUT_OF_SHAPE, kernel_cases, measure_errors, recurrence_header
from harness.bench.report import markdown, write_results
from harness.bench.shapes import SHAPES, canonical_shape
from harness.bench.step import bench_step
from harness.bench.targets import collect_targets

WHAT = ("step", "kernels", "recurrences", "decode")
CUDA_ONLY = ("kernels", "recurrences")  # Triton kernels

DESCRIPTION = """\
Benchmark the stage-3 distillation step, the mixer kernels and decoding; print Markdown tables and write
JSON (+ the same tables next to it as .md).

  step     the stage-3 step exactly as `harness stage distill` runs it (its loop's train_step on DistillModel +
           TeacherBody under DeepSpeed ZeRO-3 from ds_configs/ or --engine plain, bf16 on GPUs), with random-weight
           SmolLM2 teachers of the chosen
           shape. Reports tokens/s, MFU = tokens/s x (6 N_student + 2 N_teacher) / (peak x world) with the
           GPU's datasheet dense bf16 peak (and beside it against the measured matmul peak), peak GPU
           memory, and where a step's time goes: teacher_forward, gather_teacher_head, student_forward, loss
           (chunked CE + KL including the logits' gradient), backward, optimizer, other. ZeRO-3 communication
           overlaps compute inside the forward/backward phases; a short torch.profiler pass reports its busy
           time per step and the part not hidden behind compute ("exposed", GPU only). With --attention-layers,
           the step of that hybrid (the teacher's attention kept in those layers, trained with the rest).
  kernels  each mixer's Triton kernel vs its PyTorch reference at the shape's head layout, forward+backward
           (CUDA only; errors against the fp32 reference too).
  recurrences  each recurrence case's fla routes (the default and the alternatives) vs the float32 PyTorch
           reference on raw q/k/v/gates at the shape's head layout: errors of outputs, states and every input
           gradient against the limits, and times (CUDA only; harness.bench.recurrences).
  decode   greedy decoding at batches 1 / 8 / 32 after contexts of 1k / 8k / 32k tokens: the student's
           recurrent step vs the teacher's KV-cache step, ms per step and tokens/s (batch x steps / s), state and
           KV-cache bytes; flatness = ms/token at the longest context / shortest, per batch. With
           --attention-layers, a hybrid student: also its KV bytes and KV bytes per token of context.

Several processes: `torchrun --standalone --nproc_per_node 8 -m harness.cli bench ...` (the step runs on
every rank, MFU divides by world x peak; kernels and decode run on rank 0). Triton compiles each kernel
shape on first use (30-150 s): keep one shape per process on a fresh machine, and TRITON_CACHE_DIR.
Exit status: 0, or 1 when a measurement failed (its error is in the table and the JSON), 2 for bad arguments.
Numbers, targets and the commands used: docs/BENCHMARKS.md.
"""

EPILOG = """\
examples:
  harness bench --shape 135M --mixer gated_deltanet --micro-batch 8 --seq 2048 --steps 20 --out results.json
  harness bench --shape 1.7B --mixer kda --what step --out bench/1.7b-kda.json
  harness bench --shape 1.7B --what kernels --mixer all --out bench/kernels-1.7b.json
  harness bench --shape 135M,1.7B --what recurrences --mixer all --kernel-batch 4 --out bench/recurrences.json
  harness bench --shape 135M --mixer gated_deltanet --what decode --contexts 1024,8192,32768 --decode-batches 1,8,32 --out dec.json
  harness bench --shape tiny --device cpu --engine plain --micro-batch 2 --seq 64 --steps 3   # smoke test
  harness bench --teacher smollm2-135m-instruct-gguf --mixer gla --layers 4 --device cpu --seq 128
"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """`harness bench` on the CLI's subparsers (sets handler=run_cli)."""
    p = subparsers.add_parser("bench", help="Throughput, MFU, memory and time breakdown of stage 3; kernel and "
                              "decoding speed.", description=DESCRIPTION, epilog=EPILOG,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    configure_parser(p)
    p.set_defaults(handler=run_cli)
    return p


def configure_parser(p: argparse.ArgumentParser) -> None:
    what = p.add_argument_group("what to measure")
    what.add_argument("--what", default="step",
                      help="Comma list of step, kernels, recurrences, decode, or 'all' (kernels and recurrences only "
                      "where CUDA is). Default: step.")
    what.add_argument("--shape", default="135M",
                      help="Teacher shape(s), comma list: tiny, 135M, 360M, 1.7B (SmolLM2 configs, random weights). "
                      "For kernels, the head layout(s).")
    what.add_argument("--mixer", default="gated_deltanet",
                      help="Mixer(s), comma list, or 'all' (see `harness mixers`).")
    what.add_argument("--teacher", default=None, metavar="SOURCE",
                      help="A real teacher instead of --shape (HF folder, .gguf, alias, hub id).")
    what.add_argument("--layers", type=int, default=None, help="Keep only the first N layers (quick runs).")
    what.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                      help="Mixer option, e.g. --option backend=reference --option chunk_size=64 (repeatable).")
    step = p.add_argument_group("step")
    step.add_argument("--micro-batch", type=int, default=8, help="Sequences per device per micro-step. Default 8.")
    step.add_argument("--seq", type=int, default=2048, help="Tokens per sequence. Default 2048.")
    step.add_argument("--grad-accum", type=int, default=1, help="Micro-steps per optimizer step. Default 1.")
    step.add_argument("--steps", type=int, default=20, help="Measured optimizer steps. Default 20.")
    step.add_argument("--warmup", type=int, default=3, help="Unmeasured steps first (compilation, allocator). "
                      "Default 3.")
    step.add_argument("--engine", choices=("zero3", "plain"), default="zero3",
                      help="zero3: DeepSpeed engines as in stage 3 (default; the ZeRO stage is --student-ds-config's); "
                      "plain: stage 3's deepspeed.student_engine=plain (torch's fused AdamW on fp32 master copies of "
                      "the bf16 weights; torch DDP under torchrun) with a replicated teacher.")
    step.add_argument("--student-ds-config", default=None, help="DeepSpeed config of the student (default "
                      "ds_configs/zero3.json; ds_configs/zero3_offload.json for CPU offload).")
    step.add_argument("--teacher-ds-config", default=None, help="Default ds_configs/zero3_teacher.json.")
    step.add_argument("--teacher-placement", choices=("auto", "zero3", "replicated"), default="auto",
                      help="The teacher as stage 3 holds it (deepspeed.teacher_placement): a ZeRO-3 engine, a plain "
                      "copy per device, or auto (replicated when it takes <= 10%% of a device). Default auto.")
    step.add_argument("--peak-flops", type=float, default=None,
                      help="Per-device peak FLOP/s for mfu (default: $HARNESS_PEAK_FLOPS, else the GPU's datasheet "
                      "dense bf16 peak, e.g. 989e12 for an H100 / H200 SXM; a GPU not in harness.flops gets no mfu "
                      "and says so).")
    step.add_argument("--measure-peak", action="store_true", help="Measure the matmul peak of mfu_measured_peak now "
                      "(8192^3 bf16 matmul; default: the figure measured before for this GPU, else measured now on "
                      "CUDA).")
    step.add_argument("--grad-ckpt", action="store_true",
                      help="Recompute student blocks in backward (stages.distill.gradient_checkpointing): less "
                      "activation memory for more time.")
    step.add_argument("--grad-ckpt-fraction", type=float, default=None, metavar="F",
                      help="With --grad-ckpt (implied): recompute only this share of the blocks, spread evenly "
                      "(stages.distill.gradient_checkpointing_fraction). Default 1.0.")
    step.add_argument("--eager-teacher", action="store_true",
                      help="Run the replicated teacher eagerly (stages.distill.compile_teacher=false); by default "
                      "its decoder layers are compiled on a GPU.")
    step.add_argument("--hidden-weight", type=float, default=0.0, metavar="W",
                      help="Add stage 3's per-layer hidden-state term at weight W (stages.distill.hidden_weight): the "
                      "teacher records every layer's output. Default 0: the next-token terms alone.")
    step.add_argument("--compile-student", action="store_true",
                      help="With --engine plain on a GPU: compile each student block with torch.compile "
                      "(stages.distill.compile_student); the first steps pay the compilation, so give --warmup "
                      "a few steps. Default: the eager student.")
    step.add_argument("--profile-steps", type=int, default=2,
                      help="Extra optimizer steps under torch.profiler to measure communication (0: skip). "
                      "Default 2.")
    dec = p.add_argument_group("decode")
    dec.add_argument("--contexts", default="1024,8192,32768", help="Context lengths. Default 1024,8192,32768.")
    dec.add_argument("--decode-batches", default="1,8,32",
                     help="Prompts decoded together (one context each, all the same length). Default 1,8,32.")
    dec.add_argument("--new-tokens", type=int, default=64, help="Timed tokens per context. Default 64.")
    dec.add_argument("--no-teacher-decode", action="store_true", help="Time the student only.")
    dec.add_argument("--attention-layers", default="", metavar="I,J",
                     help="Layers of the student that keep softmax attention (a hybrid, e.g. 3,17): the step trains "
                     "that hybrid, and decoding reports its KV bytes and KV bytes per token of context beside the "
                     "state bytes. Default: none.")
    ker = p.add_argument_group("kernels")
    ker.add_argument("--kernel-batch", type=int, default=None, help="Batch of the layer bench (default --micro-batch).")
    ker.add_argument("--variants", default="", help="Extra kernel rows NAME@CASE=ROUTE ($HARNESS_FLA_ROUTES).")
    ker.add_argument("--max-seconds", type=float, default=1e9, help="Kernels: start no new row after this long.")
    gen = p.add_argument_group("general")
    gen.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                     help="auto: bf16 on CUDA, fp32 on a CPU (as stage 3).")
    gen.add_argument("--device", default="auto", help="auto, cuda or cpu.")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--out", default=None, help="JSON file to write (and OUT.md). Default: print only.")


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _attention_layers(text: str) -> list[int]:
    """--attention-layers as distinct layer indices >= 0 (the model checks them against its depth)."""
    items = _split(text)
    bad = [item for item in items if not item.isdigit()]
    if bad:
        raise SystemExit(f"harness bench: --attention-layers item '{bad[0]}' is not a layer index >= 0 "
                         "(e.g. --attention-layers 3,17)")
    layers = [int(item) for item in items]
    if len(set(layers)) != len(layers):
        raise SystemExit(f"harness bench: --attention-layers {text} names a layer twice")
    return layers


def _decode_batches(text: str) -> list[int]:
    """--decode-batches as positive integers; a bad item is named."""
    out = []
    for item in _split(text):
        if not item.isdigit() or int(item) < 1:
            raise SystemExit(f"harness bench: --decode-batches item '{item}' is not a positive integer "
                             "(e.g. --decode-batches 1,8,32)")
        out.append(int(item))
    if not out:
        raise SystemExit("harness bench: --decode-batches is empty (e.g. --decode-batches 1,8,32)")
    return out


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _parse_options(items: list[str]) -> dict[str, Any]:
    opts = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--option '{item}' is not KEY=VALUE")
        opts[key.strip()] = _parse_value(value.strip())
    return opts


def run_cli(args: argparse.Namespace, argv: Optional[Sequence[str]] = None) -> int:
    """Run what `args` ask; print the Markdown tables (rank 0) and write --out."""
    from harness.config import ConfigError
    from harness.mixers import MIXERS

    if args.what == "all":  # the kernels need CUDA; elsewhere 'all' is what can run
        what = list(WHAT) if torch.cuda.is_available() else [w for w in WHAT if w not in CUDA_ONLY]
    else:
        what = _split(args.what)
    bad = sorted(set(what) - set(WHAT))
    if bad:
        raise ConfigError(f"--what {','.join(bad)}: choose from {', '.join(WHAT)} (comma list) or all")
    mixers = list(MIXERS) if args.mixer == "all" else _split(args.mixer)
    unknown = [m for m in mixers if m not in MIXERS]
    if unknown:
        raise ConfigError(f"--mixer {','.join(unknown)}: choose from {', '.join(MIXERS)} or all")
    try:
        shapes = [args.teacher] if args.teacher else [canonical_shape(s) for s in _split(args.shape)]
        options = _parse_options(args.option)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    device = resolve_device(args.device)
    argv = list(argv) if argv is not None else sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else []
    results: dict[str, Any] = {"meta": environment(device, argv)}
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    results["meta"]["world"] = world

    def save() -> None:
        if rank == 0 and args.out:
            write_results(results, args.out)

    needs_cuda = [w for w in what if w in CUDA_ONLY]
    if needs_cuda and not torch.cuda.is_available():
        raise ConfigError(f"--what {','.join(needs_cuda)} needs CUDA: the fla / mlstm_kernels kernels are Triton "
                          "(GPU only)")
    if "step" in what:
        _bench_steps(args, results, save, shapes, mixers, options, device, rank, world)
    if rank == 0 and "kernels" in what:
        _bench_kernels(args, results, save, shapes, mixers)
    if rank == 0 and "recurrences" in what:
        _bench_recurrences(args, results, save, shapes, mixers)
    if rank == 0 and "decode" in what:
        _bench_decodes(args, results, save, shapes, mixers, options, device)
    if rank == 0:
        results["targets"] = collect_targets(results)
        print(markdown(results))
        save()
        if args.out:
            print(f"[harness bench] wrote {args.out} and {Path(args.out).with_suffix('.md')}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    return _exit_code(results, rank)


def _bench_steps(args: argparse.Namespace, results: dict, save: Callable[[], None], shapes: list[str],
                 mixers: list[str], options: dict, device: torch.device, rank: int, world: int) -> None:
    """--what step: one stage-3 step measurement per (shape, mixer), each saved as it finishes; a failure is kept
    in its row and the next combination runs (on one rank: with several, it is raised)."""
    results["step"] = []
    for shape in shapes:
        for mixer in mixers:
            kw = dict(micro_batch=args.micro_batch, seq_len=args.seq, steps=args.steps, warmup=args.warmup,
                      grad_accum=args.grad_accum, dtype=args.dtype, device=device, zero3=args.engine == "zero3",
                      layers=args.layers, options=options, student_ds_config=args.student_ds_config,
                      teacher_ds_config=args.teacher_ds_config, peak_flops=args.peak_flops,
                      measure_peak=args.measure_peak, profile_steps=args.profile_steps,
                      gradient_checkpointing=args.grad_ckpt or args.grad_ckpt_fraction is not None,
                      recompute_fraction=1.0 if args.grad_ckpt_fraction is None else args.grad_ckpt_fraction,
                      teacher_placement=args.teacher_placement, compile_teacher=not args.eager_teacher,
                      compile_student=args.compile_student, hidden_weight=args.hidden_weight,
                      seed=args.seed, attention_layers=_attention_layers(args.attention_layers))
            if args.teacher:
                kw["teacher_source"] = args.teacher
            try:
                row = bench_step(shape if not args.teacher else "custom", mixer, **kw)
            except Exception as err:  # noqa: BLE001 - record and go on with the next combination
                if world > 1:
                    raise  # a rank failing alone would leave the others in a collective
                row = {"shape": shape, "mixer": mixer, "error": f"{type(err).__name__}: {err}",
                       "trace": traceback.format_exc(limit=8)}
            free_memory()  # the engines of this combination (one combination per process is leaner still)
            results["step"].append(row)
            if rank == 0:
                print(json.dumps({k: v for k, v in row.items() if k not in ("trace", "step_ms_each")},
                                 default=str), flush=True)
                _say_why_no_mfu(row)
            save()


def _bench_kernels(args: argparse.Namespace, results: dict, save: Callable[[], None], shapes: list[str],
                   mixers: list[str]) -> None:
    """--what kernels: each mixer's layer on its kernels against its reference, rows saved as they arrive (a
    time-limited call keeps what finished)."""
    layouts = [s for s in shapes if s in SHAPES and s != "tiny"] or ["1.7B"]
    results["kernels"] = []

    def on_row(row: dict) -> None:
        results["kernels"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        save()

    bench_kernels(layouts, mixers, batch=args.kernel_batch or args.micro_batch, seq=args.seq,
                  variants=_split(args.variants), max_seconds=args.max_seconds, on_row=on_row)


def _bench_recurrences(args: argparse.Namespace, results: dict, save: Callable[[], None], shapes: list[str],
                       mixers: list[str]) -> None:
    """--what recurrences: each mixer's recurrence kernel against its reference, rows saved as they arrive."""
    layouts = [LAYOUT_OF_SHAPE[s] for s in shapes if s in LAYOUT_OF_SHAPE] or ["smollm2-135m", "smollm2-1.7b"]
    batch = args.kernel_batch or args.micro_batch
    done: list[dict] = []

    def on_recurrence(row: dict) -> None:
        done.append(row)
        results["recurrences"] = {**recurrence_header(batch), "results": done}
        save()

    cases = [m for m in mixers if m in kernel_cases()]  # a mixer without a kernel case has no kernel to check
    results["recurrences"] = measure_errors(None, shapes=layouts, cases=cases, B=batch, Ts=(args.seq,),
                                            max_seconds=args.max_seconds, seed=args.seed, on_row=on_recurrence)


def _bench_decodes(args: argparse.Namespace, results: dict, save: Callable[[], None], shapes: list[str],
                   mixers: list[str], options: dict, device: torch.device) -> None:
    """--what decode: per-token decoding of student and teacher for each (shape, mixer, batch); a failure is kept
    in its row."""
    results["decode"] = []
    contexts = [int(c) for c in _split(args.contexts)]
    kept = _attention_layers(args.attention_layers)
    for shape, mixer, batch in itertools.product(shapes, mixers, _decode_batches(args.decode_batches)):
        try:
            res = bench_decode(shape if not args.teacher else "custom", mixer, contexts=contexts,
                               new_tokens=args.new_tokens, batch=batch, dtype=args.dtype, device=device,
                               teacher_source=args.teacher, layers=args.layers, options=options,
                               teacher=not args.no_teacher_decode, seed=args.seed, attention_layers=kept)
        except Exception as err:  # noqa: BLE001
            res = {"shape": shape, "mixer": mixer, "batch": batch, "error": f"{type(err).__name__}: {err}",
                   "trace": traceback.format_exc(limit=8)}
        results["decode"].append(res)
        print(json.dumps(res, default=str), flush=True)
        save()


def _exit_code(results: dict, rank: int) -> int:
    """1 when a measurement failed or a step measurement did not train (each said on stderr by rank 0), else 0."""
    failed = [r for part in ("step", "kernels", "decode") for r in results.get(part) or [] if "error" in r]
    failed += [r for r in (results.get("recurrences") or {}).get("results", []) if r.get("error") or r.get("failed")]
    if failed and rank == 0:
        print(f"[harness bench] {len(failed)} measurement(s) failed; their errors are in the table and the JSON",
              file=sys.stderr)
    untrained = [r for r in results.get("step") or [] if "health" in r]
    if untrained and rank == 0:
        print(f"[harness bench] {len(untrained)} step measurement(s) did not train ({untrained[0]['health']}); "
              "their speed meets no target", file=sys.stderr)
    return 1 if failed or untrained else 0


def _say_why_no_mfu(row: dict[str, Any]) -> None:
    """On stderr: a GPU step row without `mfu` names the GPU and what to pass (a CPU row stays quiet)."""
    if "error" not in row and row.get("mfu") is None and str(row.get("device", "")).startswith("cuda"):
        print(f"[harness bench] {row['shape']} {row['mixer']}: {row['peak_flops_source']}", file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m harness.bench ARGS` = `harness bench ARGS`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="harness bench", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    configure_parser(parser)
    args = parser.parse_args(argv)
    from harness.config import ConfigError

    try:
        return run_cli(args, argv)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

