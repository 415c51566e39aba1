"""`harness bench` on the CPU: FLOP and MFU arithmetic, parameter counts of the SmolLM2 shapes, the phase
breakdown, the communication measure, and tiny end-to-end step / decode benches (plain, and DeepSpeed ZeRO-3
with one and two gloo processes) writing JSON with every field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaForCausalLM

from harness import flops
from harness.bench import cli
from harness.bench.decode import bench_decode
from harness.bench.kernels import bench_kernels, compare_layer
from harness.bench.phases import PHASES, PhaseClock, summarise_phases
from harness.bench.profiling import comm_from_events, top_ops
from harness.bench.report import kernel_table, markdown
from harness.bench.shapes import SHAPES, build_pair, count_params, llama_param_count, shape_config
from harness.bench.step import bench_step, mfu_fields, resolve_peak, training_health
from harness.bench.targets import decode_targets, kernel_targets, step_targets
from harness.flops import flops_per_token, mfu

REPO = Path(__file__).resolve().parents[1]

# Published sizes of the SmolLM2 teachers (tied embeddings counted once).
SMOLLM2_PARAMS = {"135M": 134_515_008, "360M": 361_821_120, "1.7B": 1_711_376_384}


@pytest.fixture
def one_thread():
    """Two busy cores shared with other processes: one intra-op thread keeps tiny models fast and steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _meta_pair(shape: str, mixer: str):
    from harness.student import HarnessForCausalLM, student_config

    cfg = shape_config(shape)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg), HarnessForCausalLM(student_config(cfg, mixer, {}))


def _subprocess_env() -> dict:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
            "CUDA_VISIBLE_DEVICES": ""}


# ------------------------------------------------------------------------------------------ arithmetic


@pytest.mark.parametrize("shape", list(SMOLLM2_PARAMS))
def test_teacher_shapes_have_the_smollm2_parameter_counts(shape):
    cfg = shape_config(shape)
    teacher, _ = _meta_pair(shape, "linear_attn")
    assert count_params(teacher) == llama_param_count(cfg) == SMOLLM2_PARAMS[shape]


def test_flops_per_token_is_six_student_plus_two_teacher():
    teacher, student = _meta_pair("135M", "linear_attn")
    # independent count: linear_attn keeps q, o and expands k, v from 3 to 9 heads of 64 (576 x 384 more each)
    n_student = SMOLLM2_PARAMS["135M"] + 30 * 2 * 576 * (576 - 192)
    assert count_params(student) == n_student == 147_786_048
    assert flops_per_token(count_params(student), count_params(teacher)) == 6 * n_student + 2 * 134_515_008
    # stage 3's own figure (harness.stages.distill) agrees on unsharded models
    from harness.stages.distill import _flops_per_token

    assert _flops_per_token(student, teacher) == flops_per_token(n_student, SMOLLM2_PARAMS["135M"])


def test_count_params_reads_zero3_partitioned_sizes():
    """ZeRO-3 leaves partitioned parameters with numel() 0 and the true size in ds_numel."""
    lin = torch.nn.Linear(4, 3, bias=False)
    lin.weight.data = torch.empty(0)
    lin.weight.ds_numel = 12
    emb = torch.nn.Embedding(5, 2)
    model = torch.nn.ModuleDict({"a": lin, "b": emb})
    assert count_params(model) == 12 + 10


def test_mfu_arithmetic_on_known_numbers(monkeypatch):
    from harness.observe import mfu as observe_mfu

    fpt = flops_per_token(158_260_188, 134_515_008)  # 135M gated_deltanet student and its teacher
    assert fpt == 1_218_591_144
    # 150k tokens/s at the H200's datasheet 989 TFLOP/s: 150e3 * 1.2186e9 / 989e12 = 18.5%
    assert mfu(150_000, fpt, 989e12) == pytest.approx(150_000 * fpt / 989e12) == pytest.approx(0.18482, abs=1e-5)
    assert mfu(150_000, fpt, 989e12) == observe_mfu(150_000, fpt, 989e12)
    # 8 devices: global tokens/s over 8 peaks
    assert mfu(8 * 20_000, fpt, 989e12, world=8) == pytest.approx(mfu(20_000, fpt, 989e12))
    assert mfu(1.0, fpt, None) is None
    # a bench row on an H200: mfu over the datasheet peak, mfu_measured_peak over the 788 TFLOP/s matmul
    monkeypatch.delenv("HARNESS_PEAK_FLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    row = mfu_fields(torch.device("cuda", 0), torch.bfloat16, 150_000, fpt, 1)
    assert row["peak_flops_per_device"] == 989e12 and "datasheet" in row["peak_flops_source"]
    assert row["measured_peak_flops_per_device"] == 788e12 and "MEASURED_PEAK_FLOPS" in row["measured_peak_source"]
    assert row["mfu"] == pytest.approx(0.18482, abs=1e-5)
    assert row["mfu_measured_peak"] == pytest.approx(0.23196, abs=1e-5)  # the figure before issue 25


def test_peak_resolution(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv("HARNESS_PEAK_FLOPS", raising=False)
    assert resolve_peak(cpu, override=5e12) == (5e12, "--peak-flops")
    value, source = resolve_peak(cpu)
    assert value is None and "CPU" in source
    assert flops.resolve_measured_peak(cpu, torch.float32)[0] is None
    # a GPU with no datasheet figure: no mfu, and the reason names it and what to pass
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    value, source = resolve_peak(cuda)
    assert value is None and "'NVIDIA L40S'" in source and "--peak-flops" in source and "HARNESS_PEAK_FLOPS" in source
    assert resolve_peak(cuda, override=362e12) == (362e12, "--peak-flops")
    monkeypatch.setenv("HARNESS_PEAK_FLOPS", "1.5e12")
    assert resolve_peak(cpu) == (1.5e12, "$HARNESS_PEAK_FLOPS")
    assert resolve_peak(cuda) == (1.5e12, "$HARNESS_PEAK_FLOPS")
    measured, source = flops.resolve_measured_peak(cpu, torch.float32, measure=True)
    assert measured > 1e6 and source.startswith("measured now")


def test_markdown_names_a_gpu_without_a_peak_and_shows_both_mfu_columns(monkeypatch):
    monkeypatch.delenv("HARNESS_PEAK_FLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda device, dtype: 300e12)
    base = {"shape": "135M", "mixer": "gla", "engine": "plain", "teacher_placement": "replicated", "micro_batch": 8,
            "seq_len": 2048, "world": 1, "tokens_per_s": 100_000.0, "peak_mem_gib": 20.0, "step_ms": 163.8,
            "breakdown_ms": {}, "breakdown_pct": {}, "device": "cuda:0"}
    row = {**base, **mfu_fields(torch.device("cuda", 0), torch.bfloat16, 100_000.0, 1.2e9, 1)}
    assert row["mfu"] is None and row["mfu_measured_peak"] == pytest.approx(0.4)
    text = markdown({"step": [row]})
    assert "| 100,000 | - | 40.0% |" in text and "MFU (measured peak)" in text
    assert "135M gla: no MFU: no datasheet dense bf16 peak for GPU 'NVIDIA L40S'" in text
    h200 = {**base, "mfu": 0.441, "mfu_measured_peak": 0.554}
    assert "| 100,000 | 44.1% | 55.4% |" in markdown({"step": [h200]})
    assert "no MFU" not in markdown({"step": [h200]})


def test_phase_summary_adds_up():
    steps = [{"teacher_forward": 10.0, "student_forward": 20.0, "loss": 5.0, "backward": 40.0, "optimizer": 5.0,
              "other": 0.0}, {"teacher_forward": 12.0, "student_forward": 18.0, "loss": 5.0, "backward": 44.0,
                              "optimizer": 1.0, "other": 0.0}]
    s = summarise_phases(steps)
    assert s["sum_ms"] == pytest.approx(80.0)
    assert s["ms"]["teacher_forward"] == 11.0 and s["ms"]["backward"] == 42.0
    assert sum(s["pct"].values()) == pytest.approx(100.0)
    assert s["pct"]["backward"] == pytest.approx(52.5)


def test_phase_clock_chains_marks_on_cpu():
    clock = PhaseClock(torch.device("cpu"))
    clock.mark("ignored")  # before start: nothing recorded
    clock.start()
    for _ in range(2):
        time.sleep(0.01)
        clock.mark("teacher_forward")
        time.sleep(0.02)
        clock.mark("backward")
        clock.step_done()
    steps = clock.steps()
    assert len(steps) == 2
    assert all(s["teacher_forward"] >= 9 and s["backward"] >= 19 for s in steps)


def _ev(name: str, start: float, end: float, device: bool):
    from torch.autograd import DeviceType

    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                           device_type=DeviceType.CUDA if device else DeviceType.CPU)


def test_comm_from_profiler_events():
    # GPU: comm kernels 0-100 and 50-150 (union 150 us), compute 0-60 and 120-200 -> exposed 60-120 = 60 us
    events = [_ev("ncclDevKernel_AllGather_RING_LL", 0, 100, True), _ev("ncclKernel_ReduceScatter", 50, 150, True),
              _ev("ampere_bf16_gemm", 0, 60, True), _ev("elementwise_kernel", 120, 200, True),
              _ev("aten::mm", 0, 1000, False)]
    out = comm_from_events(events, cuda=True, steps=2)
    assert out["comm_ms"] == pytest.approx(0.150 / 2)
    assert out["compute_kernel_ms"] == pytest.approx(0.140 / 2)
    assert out["exposed_ms"] == pytest.approx(0.060 / 2)
    # CPU: c10d / gloo ops (nested ones not double counted), device events ignored
    events = [_ev("c10d::_allgather_base_", 0, 30, False), _ev("gloo:all_gather", 5, 25, False),
              _ev("aten::mm", 30, 90, False), _ev("c10d::allreduce_", 100, 110, False)]
    out = comm_from_events(events, cuda=False, steps=1)
    assert out["comm_ms"] == pytest.approx(0.040) and out["comm_events"] == 3


def test_targets_apply_to_matching_rows_only():
    row = {"shape": "135M", "mixer": "gated_deltanet", "dtype": "bfloat16", "seq_len": 2048, "world": 1,
           "micro_batch": 8, "tokens_per_s": 160_000.0}
    assert [t["met"] for t in step_targets(row)] == [True]
    big = {"shape": "1.7B", "mixer": "kda", "dtype": "bfloat16", "seq_len": 2048, "world": 1, "micro_batch": 8,
           "tokens_per_s": 9_000.0, "mfu": 0.35, "peak_mem_gib": 70.0,
           "peak_mem_kind": "torch.cuda.max_memory_allocated over warmup + measured steps"}
    assert [(t["target"].split()[1], t["met"]) for t in step_targets(big)] == [(">=", False), ("peak", True)]
    assert step_targets({**row, "dtype": "float32"}) == []
    assert kernel_targets({"layout": "1.7B", "speedup": 6.4})[0]["met"]
    assert not kernel_targets({"layout": "1.7B", "speedup": 3.0})[0]["met"]
    assert decode_targets({"shape": "135M", "student_flatness": 1.1})[0]["met"]


def test_a_step_that_did_not_train_meets_no_target():
    """runs 8 and 15 timed the plain engine at 1.7B with NaN losses; such a row meets nothing and says why."""
    big = {"shape": "1.7B", "mixer": "gated_deltanet", "dtype": "bfloat16", "seq_len": 2048, "world": 1,
           "micro_batch": 8, "tokens_per_s": 34_000.0, "mfu": 0.62, "peak_mem_gib": 74.0,
           "peak_mem_kind": "torch.cuda.max_memory_allocated over warmup + measured steps"}
    healthy = training_health([11.2, 10.9, 10.1], skipped=0)
    assert healthy == {"losses_each": [11.2, 10.9, 10.1], "losses_finite": True, "skipped_steps": 0}
    assert all(t["met"] for t in step_targets({**big, **healthy}))
    nan = training_health([11.2, float("nan"), float("nan")], skipped=None)
    assert "loss not finite from step 1" in nan["health"]
    skipped = training_health([11.2, 11.2, 11.1], skipped=2)
    assert "2 optimizer step(s) skipped" in skipped["health"] and skipped["losses_finite"]
    for bad in (nan, skipped):
        targets = step_targets({**big, **bad})
        assert [t["met"] for t in targets] == [False] and targets[0]["value"] == bad["health"]
        assert bad["health"] in markdown({"step": [{**big, **bad, "engine": "plain", "step_ms": 1.0,
                                                    "breakdown_ms": {}, "breakdown_pct": {}}]})


# ------------------------------------------------------------------------------------ end-to-end benches

STEP_FIELDS = ("shape", "mixer", "engine", "micro_batch", "seq_len", "world", "dtype", "n_student", "n_teacher",
               "flops_per_token", "tokens_per_step", "step_ms", "tokens_per_s", "tokens_per_s_per_device",
               "peak_flops_per_device", "peak_flops_source", "mfu", "measured_peak_flops_per_device",
               "measured_peak_source", "mfu_measured_peak", "flops_per_token_formula", "peak_mem_bytes", "peak_mem_gib",
               "peak_mem_kind", "breakdown_ms", "breakdown_pct", "breakdown_sum_ms", "comm", "losses_last")


def _check_step_row(row: dict, peak: float) -> None:
    missing = [k for k in STEP_FIELDS if k not in row]
    assert not missing, missing
    assert set(row["breakdown_ms"]) == set(PHASES)
    # the phases are a chain of stamps: they add up to the measured step (wall time / steps)
    assert row["breakdown_sum_ms"] == pytest.approx(row["step_ms"], rel=0.05)
    assert row["tokens_per_step"] == row["micro_batch"] * row["seq_len"] * row["grad_accum"] * row["world"]
    assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / (row["step_ms"] / 1e3), rel=1e-6)
    assert row["flops_per_token"] == 6 * row["n_student"] + 2 * row["n_teacher"]
    assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / (peak * row["world"]))
    assert row["peak_mem_bytes"] > 0
    for k in ("total", "ce", "kl"):
        assert row["losses_last"][k] == row["losses_last"][k]  # finite, not NaN
    assert row["losses_finite"] and len(row["losses_each"]) == row["warmup"] + row["steps"]
    assert len(row["grad_norms_each"]) == len(row["losses_each"]) and all(n > 0 for n in row["grad_norms_each"])


def test_plain_step_bench_on_cpu(one_thread):
    row = bench_step("tiny", "gated_deltanet", micro_batch=2, seq_len=32, steps=2, warmup=1, device="cpu",
                     zero3=False, peak_flops=1e12, options={"chunk_size": 16})
    _check_step_row(row, 1e12)
    assert row["mfu_measured_peak"] is None and "CPU" in row["measured_peak_source"]  # no --measure-peak
    assert row["engine"] == "plain" and row["world"] == 1 and row["comm"]["comm_ms"] == 0.0
    teacher, student = build_pair("tiny", "gated_deltanet", device="cpu", options={"chunk_size": 16})
    assert (row["n_student"], row["n_teacher"]) == (count_params(student), count_params(teacher))
    assert row["breakdown_ms"]["backward"] > 0 and row["breakdown_ms"]["student_forward"] > 0


def test_step_bench_trains_the_hybrid_it_is_given(one_thread):
    """--attention-layers: the bench's step is that hybrid's (the kept layer is softmax attention, counted in the
    student's parameters, trained with the rest), not the pure student's."""
    kw = dict(micro_batch=2, seq_len=32, steps=2, warmup=1, device="cpu", zero3=False, peak_flops=1e12,
              options={"chunk_size": 16})
    pure, hybrid = bench_step("tiny", "gated_deltanet", **kw), bench_step("tiny", "gated_deltanet", attention_layers=[1],
                                                                           **kw)
    _check_step_row(hybrid, 1e12)
    assert (pure["attention_layers"], hybrid["attention_layers"]) == ([], [1])
    _, student = build_pair("tiny", "gated_deltanet", device="cpu", options={"chunk_size": 16}, attention_layers=[1])
    assert student.config.kept_layers() == {1} and hybrid["n_student"] == count_params(student) != pure["n_student"]
    assert hybrid["losses_each"] != pure["losses_each"]


def _run_cli(args: list[str], world: int = 1) -> subprocess.CompletedProcess:
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               "-m", "harness.bench", *args]
    else:
        cmd = [sys.executable, "-m", "harness.bench", *args]
    proc = subprocess.run(cmd, env=_subprocess_env(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def test_zero3_step_and_decode_bench_write_json(tmp_path):
    out = tmp_path / "bench.json"
    proc = _run_cli(["--shape", "tiny", "--mixer", "gla", "--device", "cpu", "--what", "step,decode",
                     "--micro-batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1", "--peak-flops", "1e12",
                     "--contexts", "8,32", "--new-tokens", "3", "--decode-batches", "1,2", "--option", "chunk_size=16",
                     "--out", str(out)])
    res = json.loads(out.read_text())
    meta = res["meta"]
    for key in ("command", "date", "gpu", "device", "torch", "triton", "fla", "deepspeed", "transformers", "world"):
        assert key in meta, key
    assert meta["command"].startswith("harness bench --shape tiny")
    (row,) = res["step"]
    _check_step_row(row, 1e12)
    assert row["engine"] == "zero3" and row["world"] == 1 and row["options"] == {"chunk_size": 16}
    assert row["teacher_placement"] == "replicated"  # auto: a tiny teacher is copied, not sharded
    assert "comm_ms" in row["comm"] and row["comm"]["profiled_steps"] == 2
    ops = row["top_ops"]
    assert ops["aten_calls_per_step"] > 100 and ops["by_self_cpu"][0]["self_cpu_ms"] > 0
    assert [d["batch"] for d in res["decode"]] == [1, 2]
    for dec in res["decode"]:
        assert [r["context"] for r in dec["rows"]] == [8, 32]
        for r in dec["rows"]:
            for who in ("student", "teacher"):
                assert r[who]["tokens_per_s"] == pytest.approx(dec["batch"] * 1e3 / r[who]["ms_per_token"])
    one, two = (d["rows"][0]["student"]["state_bytes"] for d in res["decode"])
    assert two == 2 * one > 0  # the whole batch's recurrent state
    md = out.with_suffix(".md").read_text()
    assert "Stage-3 step" in md and "Decoding" in md and "| tiny | gla | zero3 | replicated |" in md
    assert "| tiny | gla | 2 | 32 |" in md
    assert "tokens/s" in proc.stdout


def test_zero3_two_processes(tmp_path):
    out = tmp_path / "bench2.json"
    _run_cli(["--shape", "tiny", "--mixer", "linear_attn", "--device", "cpu", "--micro-batch", "2", "--seq", "32",
              "--steps", "2", "--warmup", "1", "--peak-flops", "1e12", "--profile-steps", "1",
              "--teacher-placement", "zero3", "--out", str(out)], world=2)
    (row,) = json.loads(out.read_text())["step"]
    _check_step_row(row, 1e12)
    assert row["teacher_placement"] == "zero3" and len(row["ds_configs"]) == 2
    assert row["world"] == 2 and row["tokens_per_step"] == 2 * 32 * 2
    assert row["tokens_per_s_per_device"] == pytest.approx(row["tokens_per_s"] / 2)
    assert row["comm"]["comm_ms"] > 0 and row["comm"]["comm_events"] > 0  # gloo all-gathers between the two


def test_decode_bench_per_token_times_and_state_sizes(one_thread):
    res = bench_decode("tiny", "gated_deltanet", contexts=(32, 8), new_tokens=4, warmup_tokens=1, device="cpu")
    rows = res["rows"]
    assert [r["context"] for r in rows] == [8, 32]  # sorted
    for r in rows:
        for who in ("student", "teacher"):
            assert r[who]["ms_per_token"] > 0 and r[who]["tokens_per_s"] > 0 and r[who]["prefill_ms"] > 0
        assert r["speedup"] == pytest.approx(r["teacher"]["ms_per_token"] / r["student"]["ms_per_token"])
    # the recurrent state is fixed in size; the KV cache grows with the context
    assert rows[0]["student"]["state_bytes"] == rows[1]["student"]["state_bytes"] > 0
    assert rows[1]["teacher"]["state_bytes"] > rows[0]["teacher"]["state_bytes"] > 0
    assert res["student_flatness"] == pytest.approx(rows[1]["student"]["ms_per_token"] /
                                                    rows[0]["student"]["ms_per_token"])
    assert res["teacher_flatness"] is not None


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_help_and_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "MFU" in text and "--micro-batch" in text and "--what" in text and "examples:" in text
    assert cli.main(["--what", "speed"]) == 2
    assert cli.main(["--mixer", "transformer"]) == 2
    assert cli.main(["--shape", "7B"]) == 2
    if not torch.cuda.is_available():
        assert cli.main(["--what", "kernels"]) == 2
        assert cli.main(["--what", "recurrences"]) == 2
    err = capsys.readouterr().err
    assert "choose from" in err
    if not torch.cuda.is_available():
        assert "--what recurrences needs CUDA" in err


def test_recurrence_rows_appear_in_the_bench_markdown():
    from harness.bench import recurrences
    from harness.bench.report import markdown

    row = {"shape": "smollm2-135m", "H": 9, "K": 64, "V": 64, "B": 4, "T": 2048, "case": "kda", "variant": "auto",
           "route": "chunk_kda", "errors": {"o": 2e-3, "state": 3e-3, "dq": 5e-3}, "failed": {},
           "kernel_fwd_ms": 1.0, "kernel_fwbw_ms": 3.0, "reference_fwbw_ms": 30.0}
    bad = {**row, "case": "gla", "route": "chunk_gla", "errors": {"o": 0.5, "state": 1e-3}, "failed": {"o": 0.5}}
    report = {"environment": {"fla": "x"}, "tolerances": recurrences.TOL, "B": 4, "results": [row, bad]}
    text = markdown({"meta": {}, "recurrences": report})
    assert "### Recurrences: every fla route vs the float32 reference" in text
    assert "| smollm2-135m | 2048 | kda | auto | chunk_kda | yes |" in text and "10.0x" in text
    assert "| gla | auto | chunk_gla | NO: o 5.0e-01 |" in text
    assert recurrences.failures(bad["errors"], "gla") == {"o": 0.5}
    assert set(recurrences.LAYOUT_OF_SHAPE.values()) <= set(recurrences.SHAPES)


def test_add_parser_wires_a_bench_subcommand():
    import argparse

    parser = argparse.ArgumentParser(prog="harness")
    cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--shape", "1.7B", "--mixer", "kda", "--micro-batch", "8", "--seq", "2048",
                              "--steps", "20", "--out", "r.json", "--what", "step,kernels,decode"])
    assert args.handler is cli.run_cli and args.shape == "1.7B" and args.micro_batch == 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_kernel_bench_needs_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        bench_kernels(["135M"], ["gla"])


def test_layer_comparison_code_runs_on_cpu(one_thread):
    """The kernel bench's comparison, with the reference standing in for the kernel (CUDA runs the real one)."""
    row = compare_layer("gla", "tiny", batch=1, seq=32, reference_reps=1, backend="reference", device="cpu")
    for key in ("out_rel_err", "dx_rel_err", "max_param_grad_rel_err", "ref_bf16_out_rel_err", "kernel_ms",
                "reference_bf16_ms", "speedup", "kernel_first_call_s", "recurrence_kernel_ms",
                "recurrence_reference_ms"):
        assert key in row, key
    assert row["recurrence_speedup"] == pytest.approx(row["recurrence_reference_ms"] / row["recurrence_kernel_ms"])
    prof = row["kernel_profile"]
    assert prof["aten_calls"] > 10 and prof["top_ops"] and all(op["ms"] >= 0 for op in prof["top_ops"])
    assert "gpu_busy" not in prof  # a CPU run has no device time to compare
    assert row["out_rel_err"] == pytest.approx(row["ref_bf16_out_rel_err"])  # same bf16 path both times
    assert row["kernel_ms"] > 0 and row["speedup"] == pytest.approx(row["reference_bf16_ms"] / row["kernel_ms"])
    assert "| gla | tiny |" in kernel_table([row])


def test_zero2_student_config_and_partial_recompute_are_labelled(tmp_path):
    out = tmp_path / "z2.json"
    _run_cli(["--shape", "tiny", "--mixer", "deltanet", "--device", "cpu", "--micro-batch", "2", "--seq", "32",
              "--steps", "1", "--warmup", "1", "--profile-steps", "0", "--student-ds-config", "ds_configs/zero2.json",
              "--grad-ckpt-fraction", "0.5", "--out", str(out)])
    (row,) = json.loads(out.read_text())["step"]
    assert row["engine"] == "zero2" and row["ds_configs"][0].endswith("ds_configs/zero2.json")
    assert row["gradient_checkpointing"] and row["recompute_fraction"] == 0.5
    assert "| tiny | deltanet | zero2+ckpt0.5 | replicated |" in out.with_suffix(".md").read_text()


def test_top_ops_ranks_host_and_device_time_per_step():
    class Avg:  # the fields of torch.autograd.profiler_util.FunctionEventAvg that top_ops reads
        def __init__(self, key, count, cpu_us, dev_us):
            self.key, self.count, self.self_cpu_time_total, self.self_device_time_total = key, count, cpu_us, dev_us

    res = top_ops([Avg("aten::mm", 20, 4000.0, 9000.0), Avg("aten::add", 100, 6000.0, 1000.0),
                   Avg("PreBackwardFunctionForModuleBackward", 10, 2000.0, 0.0)], steps=2, n=2)
    assert res["aten_calls_per_step"] == 60
    assert res["self_cpu_ms_per_step"] == pytest.approx(6.0)
    assert [r["name"] for r in res["by_self_cpu"]] == ["aten::add", "aten::mm"]
    assert res["by_self_device"][0] == {"name": "aten::mm", "calls": 10, "self_cpu_ms": 2.0, "self_device_ms": 4.5}


def test_make_shape_teacher_writes_a_loadable_random_teacher(tmp_path, monkeypatch):
    import importlib.util

    from tests.pipeline import make_setting

    spec = importlib.util.spec_from_file_location("make_shape_teacher", REPO / "scripts" / "make_shape_teacher.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    teacher_dir, _ = make_setting(tmp_path / "setting")  # a 320-token tokenizer
    with pytest.raises(SystemExit, match="320 tokens, more than the 256 rows"):
        mod.make_shape_teacher("tiny", str(teacher_dir), tmp_path / "too-small")
    monkeypatch.setitem(SHAPES, "tiny", {**SHAPES["tiny"], "vocab_size": 320})
    out = mod.make_shape_teacher("tiny", str(teacher_dir), tmp_path / "random-tiny")
    from harness.teacher import load_teacher

    t = load_teacher(str(out))
    assert t.model.config.num_hidden_layers == 2 and t.model.config.hidden_size == 64
    assert len(t.tokenizer) == len(load_teacher(str(teacher_dir)).tokenizer)


def test_zero_step_op_count_shows_a_norm_per_parameter_tensor():
    """scripts/zero_step_ops.py (the host cost of DeepSpeed's optimizer step, docs/BENCHMARKS.md): ZeRO-2's step
    computes one gradient norm per parameter tensor, the per-tensor loop that makes a 135M student's optimizer
    phase ~80 ms on the H200."""
    out = subprocess.run([sys.executable, "scripts/zero_step_ops.py", "--shape", "tiny", "--mixer", "deltanet"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    calls = {r["op"]: r["calls"] for r in res["top"]}
    assert res["parameter_tensors"] > 10 and res["aten_calls"] > 5 * res["parameter_tensors"]
    assert calls.get("aten::linalg_vector_norm", 0) >= res["parameter_tensors"]


def test_the_bench_teachers_have_no_zero_embedding_row_and_their_pad_token_trains():
    """Hugging Face zeroes the padding row (id 2 in the SmolLM2 configs) of a new model; a zero row kept the
    student's hidden state at 0 for that token, whose gradient then grew ~100x per block and overflowed at 1.7B
    (runs 16-18). The bench's random teacher fills it, so the gradient at the pad token is like any other's."""
    from harness.student import zero_embedding_rows

    teacher, student = build_pair("135M", "gated_deltanet", layers=4, device="cpu")
    assert zero_embedding_rows(teacher.model.embed_tokens.weight) == []
    ids = torch.randint(3, 49152, (1, 32), generator=torch.Generator().manual_seed(0))
    ids[0, 5] = teacher.config.pad_token_id
    embeds = student.model.embed_tokens(ids).detach().requires_grad_()
    student.model(inputs_embeds=embeds).pow(2).mean().backward()
    per_token = embeds.grad[0].abs().amax(-1)
    others = torch.cat([per_token[:5], per_token[6:]])
    assert float(per_token[5]) < 10 * float(others.max())


@pytest.mark.parametrize("bad", ["0", "8,x", ""])
def test_decode_batches_must_be_positive_integers(bad, capsys):
    from harness.bench.cli import _decode_batches

    with pytest.raises(SystemExit, match="--decode-batches"):
        _decode_batches(bad)
