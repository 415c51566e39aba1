"""Job config: defaults, YAML + overrides, clear errors (exit code 2 from the CLI), the step plan."""

from __future__ import annotations

import re

import pytest

from harness.cli import main
from harness.config import ConfigError, JobConfig, load_job, plan_stages
from tests.tiny import tiny_llama


@pytest.fixture()
def tiny_dir(tmp_path):
    tiny_llama().save_pretrained(tmp_path / "teacher")
    return str(tmp_path / "teacher")


@pytest.fixture()
def job_file(tmp_path, tiny_dir):
    path = tmp_path / "job.yaml"
    path.write_text(f"name: t\nteacher:\n  source: {tiny_dir}\nbudget:\n  total_tokens: 10000000\n")
    return path


def test_yaml_and_overrides_merge(job_file):
    job = load_job(job_file, ["student.mixer=gla", "stages.distill.lr=3e-4", "student.options.rope=true"])
    assert job.name == "t" and job.student.mixer == "gla"
    assert job.stages.distill.lr == pytest.approx(3e-4)
    assert job.student.options == {"rope": True}
    assert job.output_dir == "runs/t"


def test_every_field_has_a_description():
    from dataclasses import fields, is_dataclass

    def walk(node, prefix=""):
        for f in fields(node):
            assert f.metadata.get("help"), f"{prefix}{f.name} has no description"
            value = getattr(node, f.name)
            if is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")

    walk(JobConfig())


@pytest.mark.parametrize(
    "override, needle",
    [
        (["student.mixr=gla"], "Unknown key 'student.mixr'.*Allowed keys under 'student': mixer, options"),
        (["stages.distill.lr=fast"], "Bad value for 'stages.distill.lr'"),
        (["student.mixer=mamba"], "Unknown mixer 'mamba'.*linear_attn, retnet, gla, deltanet, gated_deltanet, kda, mlstm"),
        (["student.options.expand_v=2"], "unknown option.*expand_v.*Allowed"),
        (["teacher.source=/nonexistent/model"], "does not exist"),
        (["budget.split=[0.5,0.5,0.5]"], "sum to 1"),
        (["budget.total_tokens=1000"], "fewer than one optimizer step"),
        (["stages.align_mixer.schedule=linear"], "Allowed: wsd, cosine, constant"),
        (["student.mixer"], "not of the form key=value"),
        (["deepspeed.teacher_placement=sharded"], "teacher_placement.*Allowed: auto, zero3, replicated"),
        (["deepspeed.student_engine=torch"], "student_engine.*Allowed: deepspeed, plain"),
        (["teacher.dtype=fp8"], "teacher.dtype.*auto, float32, bfloat16, float16"),
        (["stages.align_hidden.loss=l1"], "Bad value 'l1' for stages.align_hidden.loss. Allowed: mse, l2"),
        (["stages.distill.loss=l2"], "Unknown key 'stages.distill.loss'"),
        (["stages.distill.gradient_checkpointing_fraction=0"], "gradient_checkpointing_fraction=0.* must lie in"),
        (["stages.distill.losses=[{name: jsd}]"],
         r"Bad value 'jsd' for stages.distill.losses\[\*\].name. Allowed: kl, reverse_kl, ce."),
        (["stages.distill.losses=[{name: kl}]", "stages.distill.kl_weight=2", "stages.distill.temperature=3"],
         "stages.distill.losses and stages.distill.kl_weight=2.0, stages.distill.temperature=3.0 are both set"),
        (["stages.distill.losses=[{nam: kl}]"], "Bad entry in stages.distill.losses.*: Key 'nam' not in.*keys: name, weight"),
        (["stages.distill.losses=[{name: ce, temperature: 2}]"], r"losses\[0\].temperature=2.0: .* 1 for ce"),
        (["stages.distill.losses=[{name: kl}, {name: kl}]"], "each term at most once"),
        (["stages.distill.losses=[{name: kl, weight: 0}]"], "at least one with a weight > 0"),
    ],
)
def test_bad_input_gives_clear_error(job_file, override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_job(job_file, override)


def test_distill_losses_list_and_the_old_keys_give_one_list(job_file):
    from harness.config import DISTILL_LOSSES, LossTermConfig
    from harness.losses import TOKEN_LOSSES

    listed = load_job(job_file, ["stages.distill.losses=[{name: kl, weight: 0.5, temperature: 2}, {name: ce}]"])
    old = load_job(job_file, ["stages.distill.kl_weight=0.5", "stages.distill.temperature=2"])
    want = [LossTermConfig("kl", 0.5, 2.0), LossTermConfig("ce", 1.0, 1.0)]
    assert listed.stages.distill.loss_terms() == old.stages.distill.loss_terms() == want
    assert old.stages.distill.losses == []
    reverse = load_job(job_file, ["stages.distill.losses=[{name: reverse_kl, weight: 2}]"])
    assert reverse.stages.distill.loss_terms() == [LossTermConfig("reverse_kl", 2.0, 1.0)]
    assert sorted(DISTILL_LOSSES) == sorted(TOKEN_LOSSES)


def test_teacher_dtype_auto_is_bf16_on_a_gpu_and_fp32_on_a_cpu(job_file):
    """The default: stages 1-2 autocast to the teacher's dtype, and fp32 on a GPU would run them without tensor
    cores (seen on an H200: ~2k tokens/s for a 1.7B layer group). An explicit dtype wins everywhere."""
    import torch

    from harness.stages.common import teacher_dtype

    job = load_job(job_file, [])
    assert job.teacher.dtype == "auto"
    assert teacher_dtype(job, torch.device("cuda", 0)) == torch.bfloat16
    assert teacher_dtype(job, torch.device("cpu")) == torch.float32
    assert teacher_dtype(load_job(job_file, ["run.device=cpu"])) == torch.float32
    pinned = load_job(job_file, ["teacher.dtype=float32"])
    assert teacher_dtype(pinned, torch.device("cuda", 0)) == torch.float32


def test_cli_exits_2_with_one_paragraph(job_file, capsys):
    assert main(["info", str(job_file), "student.mixer=mamba"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Unknown mixer 'mamba'") and err.count("\n") == 1


def test_missing_job_file_exits_2(capsys):
    assert main(["info", "no/such/job.yaml"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_step_plan_arithmetic(job_file):
    job = load_job(job_file, ["data.seq_len=128", "deepspeed.world_size=2", "stages.distill.grad_accum=4",
                              "stages.distill.micro_batch_size=2"])
    plans = {p.stage: p for p in plan_stages(job)}
    d = plans["distill"]
    assert d.tokens_per_step == 2 * 2 * 4 * 128
    assert d.steps == int(10_000_000 * 0.921) // d.tokens_per_step
    assert d.tokens == d.steps * d.tokens_per_step
    assert plans["align_mixer"].steps == int(10_000_000 * 0.026) // (8 * 128)  # one process per layer group


def test_info_prints_counts_and_plan(job_file, capsys):
    assert main(["info", str(job_file), "student.mixer=kda"]) == 0
    out = capsys.readouterr().out
    assert "teacher:" in out and "student (kda):" in out and "distill" in out


def test_every_choice_is_named_as_its_value():
    """OmegaConf looks choices up by member name and writes `member.name` into the YAML it dumps."""
    from harness.config_choices import Choice

    assert len(Choice.__subclasses__()) >= 10
    for choice in Choice.__subclasses__():
        assert [m.name for m in choice] == list(choice.values()), choice


def test_a_bad_choice_fails_when_omegaconf_merges():
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    schema = OmegaConf.structured(JobConfig)
    with pytest.raises(ValidationError, match="'mpirun'.*torchrun, deepspeed"):
        OmegaConf.merge(schema, {"run": {"launcher": "mpirun"}})
    with pytest.raises(ValidationError, match="'needle'.*passkey, uuid, kv"):
        OmegaConf.merge(schema, {"eval": {"niah": {"kinds": ["kv", "needle"]}}})


def test_choices_compare_as_strings_and_are_saved_as_plain_strings(job_file, tmp_path):
    from harness.config import to_yaml
    from harness.config_choices import NeedleKind, Schedule

    job = load_job(job_file, ["stages.distill.schedule=cosine", "eval.niah.kinds=[kv,uuid]"])
    assert job.stages.distill.schedule is Schedule.cosine and job.stages.distill.schedule == "cosine"
    assert job.eval.niah.kinds == [NeedleKind.kv, NeedleKind.uuid] == ["kv", "uuid"]
    assert f"{job.stages.distill.schedule}" == "cosine"
    text = to_yaml(job)
    assert "    schedule: cosine\n" in text and "    kinds:\n    - kv\n    - uuid\n" in text
    saved = tmp_path / "saved.yaml"
    saved.write_text(text)
    assert to_yaml(load_job(saved)) == text


def test_bad_choice_in_the_job_file_names_key_and_allowed_values(job_file, capsys):
    job_file.write_text(job_file.read_text() + "stages:\n  distill:\n    schedule: linear\n")
    assert main(["info", str(job_file)]) == 2
    assert capsys.readouterr().err == ("error: Bad value 'linear' for stages.distill.schedule. "
                                       "Allowed: wsd, cosine, constant.\n")


@pytest.mark.parametrize("override, message", [
    (["data.seq_len=0"], "data.seq_len=0 must be a positive number."),
    (["stages.align_hidden.decay_fraction=1.5"], "stages.align_hidden.decay_fraction=1.5 must lie in [0, 1]."),
    (["stages.sft.lr=0"], "stages.sft.lr=0.0 must be a positive number."),  # SftConfig's own default, its base's rule
    (["run.keep_last=0"], "run.keep_last=0 must be a positive number."),
    (["eval.generation_batch_size=0"], "eval.generation_batch_size=0 must be a positive number."),
    (["run.layer_groups=-1"], "run.layer_groups=-1 must be >= 0 (0: the default)."),
    (["eval.niah.depths=[0.5,1.5]"], "Bad value 1.5 in eval.niah.depths: each must lie in [0, 1] (50% is 0.5)."),
    (["budget.split=[0.5,0.5]"], "budget.split=[0.5, 0.5] must be three non-negative fractions"),
    (["instructions.messages_field=''"], "instructions.messages_field='' must name the field holding the messages"),
])
def test_a_field_out_of_its_range_names_the_value_and_the_range(job_file, override, message):
    with pytest.raises(ConfigError) as err:
        load_job(job_file, override)
    assert str(err.value).startswith(message)


def test_fields_built_in_code_are_checked_like_merged_ones():
    from harness.config import DataConfig, check_fields

    check_fields(JobConfig())
    with pytest.raises(ConfigError, match=r"^Bad value 'word' for data.txt_sample_by. Allowed: document, paragraph, line.$"):
        check_fields(DataConfig(txt_sample_by="word"), "data.")
    with pytest.raises(ConfigError, match=r"^data.shuffle_buffer=0 must be a positive number.$"):
        check_fields(DataConfig(shuffle_buffer=0), "data.")


def test_overrides_may_follow_the_options_and_anything_else_unknown_is_an_error(capsys):
    from harness.cli import build_parser, parse_args_with_late_overrides

    parser = build_parser()
    args = parse_args_with_late_overrides(parser, ["info", "jobs/quickstart.yaml", "seed=3", "--explain",
                                                   "student.mixer=gla"])
    assert args.explain and args.overrides == ["seed=3", "student.mixer=gla"]
    with pytest.raises(SystemExit) as stop:
        parse_args_with_late_overrides(parser, ["info", "jobs/quickstart.yaml", "--explain", "--bogus", "seed=3"])
    assert stop.value.code == 2 and "unrecognized arguments: --bogus seed=3" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["overrides", "yaml"])
def test_a_whole_number_written_as_a_float_is_taken_for_an_int_field(job_file, where):
    """YAML and the command line read 1e9 as a float; OmegaConf alone refuses a float for an int field."""
    values = {"budget.total_tokens": "1e9", "data.seq_len": "2.56e2", "stages.distill.tokens": "2.5e7",
              "eval.niah.lengths": "[256, 1e3]"}
    if where == "overrides":
        job = load_job(job_file, [f"{k}={v}" for k, v in values.items()])
    else:
        job_file.write_text(f"teacher:\n  source: {load_job(job_file).teacher.source}\nbudget:\n  total_tokens: 1e9\n"
                            "data:\n  seq_len: 2.56e2\nstages:\n  distill:\n    tokens: 2.5e7\n"
                            "eval:\n  niah:\n    lengths: [256, 1e3]\n")
        job = load_job(job_file)
    assert job.budget.total_tokens == 1_000_000_000 and type(job.budget.total_tokens) is int
    assert job.data.seq_len == 256 and job.stages.distill.tokens == 25_000_000
    assert job.eval.niah.lengths == [256, 1000]


@pytest.mark.parametrize("override, message", [
    ("budget.total_tokens=2.5", "budget.total_tokens=2.5 (on the command line) must be a whole number"),
    ("data.seq_len=1e-3", "data.seq_len=0.001 (on the command line) must be a whole number"),
    ("eval.niah.lengths=[256,300.5]", "eval.niah.lengths[1]=300.5 (on the command line) must be a whole number"),
    ("budget.total_tokens=.inf", "budget.total_tokens=inf (on the command line) must be a whole number"),
])
def test_a_fraction_for_an_int_field_is_refused_naming_the_key(job_file, override, message):
    with pytest.raises(ConfigError) as err:
        load_job(job_file, [override])
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("override, key", [
    ("stages.distill.lr=inf", "stages.distill.lr=inf"),
    ("stages.align_mixer.lr=nan", "stages.align_mixer.lr=nan"),
    ("stages.distill.weight_decay=-inf", "stages.distill.weight_decay=-inf"),  # a field without a Rule of its own
    ("stages.sft.grad_clip=inf", "stages.sft.grad_clip=inf"),
    ("budget.split=[0.1,0.2,.inf]", r"budget.split=\[0.1, 0.2, inf\]"),
    ("stages.distill.losses=[{name: kl, weight: .inf}]", r"stages.distill.losses\[0\].weight=inf"),
])
def test_every_float_field_must_be_finite(job_file, override, key):
    with pytest.raises(ConfigError, match=f"^{key} must be a finite number"):
        load_job(job_file, [override])


def test_cli_refuses_inf_with_exit_2_and_takes_1e9(job_file, capsys):
    assert main(["info", str(job_file), "stages.distill.lr=inf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: stages.distill.lr=inf must be a finite number") and err.count("\n") == 1
    assert main(["info", str(job_file), "budget.total_tokens=1e9"]) == 0
    assert "total_tokens: 1000000000" in capsys.readouterr().out


def _plan_row(out: str, stage: str) -> list[int]:
    """tokens, tokens/step, steps, warmup of `stage` in `harness info`'s stage plan."""
    row = next(line for line in out.splitlines() if re.match(rf"^\s+{stage}\s+[\d,]+\s", line))
    return [int(x.replace(",", "")) for x in row.split()[1:]]


@pytest.mark.parametrize("total", [10_000_000, 300_000_000, 3_000_000_000])
def test_stage_one_gets_its_tokens_whatever_the_total_and_info_prints_the_steps(job_file, total, capsys):
    over = [f"budget.total_tokens={total}", "data.seq_len=128", "stages.align_mixer.tokens=2000000"]
    plans = {p.stage: p for p in plan_stages(load_job(job_file, over))}
    per_step = 8 * 128  # micro_batch_size x grad_accum x seq_len
    assert plans["align_mixer"].steps == 2_000_000 // per_step and plans["align_mixer"].tokens == 1953 * per_step
    assert plans["distill"].steps == int(total * 0.921) // per_step  # the others keep their shares
    assert main(["info", str(job_file), *over]) == 0
    assert _plan_row(capsys.readouterr().out, "align_mixer")[:3] == [1953 * per_step, per_step, 1953]
    # holding the total fixed while moving tokens into stage 1: every stage's tokens set
    fixed = load_job(job_file, [*over, "stages.align_hidden.tokens=1000000", f"stages.distill.tokens={7_000_000}",
                                "budget.total_tokens=10000000"])
    assert sum(p.tokens for p in plan_stages(fixed)) <= 10_000_000


def test_info_shows_a_data_mix(job_file, capsys):
    mix = ("data.mix=[{source: embedded, weight: 0.9}, {source: 'generator:kv_recall', weight: 0.1, "
           "options: {pairs: 8}}]")
    assert main(["info", str(job_file), mix, "--explain"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"mix:\n\s+- source: embedded\n\s+weight: 0.9", out)
    assert "source: generator:kv_recall" in out and "pairs: 8" in out and "  data.mix: Train on a weighted" in out


def test_info_shows_the_post_training_plan_only_when_the_pipeline_runs_it(job_file, capsys):
    """stages.sft.enabled: `harness info` adds SFT's row (stage 3 on instructions' arithmetic: world x micro-batch x
    grad_accum conversations of at most instructions.seq_len tokens a step), or one pass without stages.sft.tokens,
    and checks SFT's length against the teacher's positions."""
    from harness.config import pipeline_stages, plan_sft

    tuned = ["stages.sft.enabled=true", "stages.sft.tokens=100000", "instructions.seq_len=512",
             "stages.sft.micro_batch_size=4", "stages.sft.grad_accum=2", "deepspeed.world_size=2"]
    plan = plan_sft(load_job(job_file, tuned))
    assert plan.tokens_per_step == 2 * 4 * 2 * 512 and plan.steps == 100000 // 8192 == 12
    assert plan.tokens == 12 * 8192 and plan.warmup_steps == int(12 * 0.05)
    assert pipeline_stages(load_job(job_file, tuned))[-1] == "sft" and "sft" not in pipeline_stages(load_job(job_file))
    assert main(["info", str(job_file), *tuned]) == 0
    out = capsys.readouterr().out
    assert f"  {'sft':<14}{98304:>16,}{8192:>14,}{12:>10,}{0:>8,}" in out and "RUN_DIR/student-sft" in out
    assert main(["info", str(job_file), "stages.sft.enabled=true", "instructions.seq_len=512"]) == 0
    assert "sft           one pass over the training conversations" in capsys.readouterr().out
    assert main(["info", str(job_file), "stages.sft.enabled=true"]) == 2  # SFT's length checked against the teacher
    assert "instructions.seq_len=2048 exceeds the teacher's max_position_embeddings=512" in capsys.readouterr().err
    assert main(["info", str(job_file)]) == 0
    assert "\n  sft " not in capsys.readouterr().out
    with pytest.raises(ConfigError, match="stages.sft.enabled=true runs SFT on this pipeline's own student"):
        load_job(job_file, ["stages.sft.enabled=true", "stages.sft.student=/some/student"])
