"""Layer ranking (harness/ranking.py): the one-layer replacement is checked against the teacher itself and against a
hand-written forward, the stage-1 cost against `harness transfer`'s step-0 MSE (itself checked against stage 1's
first logged loss), a teacher built with one sharp attention layer ranks it first under both measures, and parts
merge into the whole ranking; the Slurm plan is rendered and its scripts run here with bash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from harness.cli import main
from harness.config import ConfigError
from harness.ranking import (MixerAsAttention, costliest_layers, kl_per_token, log_probs, merge_ranking, rank_layers,
                             ranking_dir, ranking_order, replaced_attention, write_part)
from harness.transfer import AttentionProbe, transfer_report
from tests.pipeline import make_setting, tiny_job
from tests.test_submit import recording_sbatch

SHARP, MILD = 2, 1  # the sharp layer after the mild one: neither index order nor depth favours it


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranking")
    make_setting(root / "setting")
    return root


def job_in(root: Path, run: str, *overrides: str):
    return tiny_job(root / "setting", root / run, "data.validation_tokens=512", *overrides)


def rank_and_merge(job, measure: str = "stage1", groups=None) -> dict:
    for layers in groups or [None]:
        write_part(job, rank_layers(job, measure=measure, layers=layers, sequences=2, seq_len=32, progress=False))
    return json.loads(merge_ranking(job, measure).read_text())


@pytest.fixture(scope="module")
def sharp_teacher(root):
    """The tiny teacher made so that linear attention copies all but two layers exactly: q = k = 0 gives uniform
    causal attention, which linear_attn (elu+1 features, normalised) reproduces; layer MILD keeps its random q/k
    (mildly non-uniform attention), layer SHARP has q and k scaled by 8, so its softmax is near one-hot on some
    earlier key, which no linear mixer copies. Every o_proj is scaled by 10 and the final norm by 20, alike for all
    layers, so that attention matters to the logits and the next-token distributions are peaked."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, _ = make_setting(root / "setting")
    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            a.o_proj.weight.mul_(10)
            if i == SHARP:
                a.q_proj.weight.mul_(8)
                a.k_proj.weight.mul_(8)
            elif i != MILD:
                a.q_proj.weight.zero_()
                a.k_proj.weight.zero_()
        model.model.norm.weight.mul_(20)
    out = root / "sharp-teacher"
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------------ the measures


@pytest.mark.parametrize("measure", ["stage1", "kl"])
def test_a_sharp_layer_ranks_first_and_a_mildly_non_uniform_one_second(root, sharp_teacher, measure):
    job = job_in(root, f"sharp-{measure}", f"teacher.source={sharp_teacher}", "student.mixer=linear_attn")
    ranking = rank_and_merge(job, measure)
    costs = {r["layer"]: r["cost"] for r in ranking["layers"]}
    assert ranking["order"][:2] == [SHARP, MILD], costs
    uniform = [l for l in costs if l not in (SHARP, MILD)]
    assert costs[SHARP] > 10 * costs[MILD] and costs[MILD] > 1e-3
    assert all(abs(costs[l]) < 1e-6 for l in uniform)  # copied exactly: the teacher's uniform attention
    assert {r["weights"] for r in ranking["layers"]} == {"init"} and ranking["measure"] == measure
    assert costliest_layers(job, 1) == [SHARP] and costliest_layers(job, 2) == sorted([SHARP, MILD])
    # a hybrid of the same run keeps the costliest layer: stages 1-2 plan no group for it
    from harness.stages.common import job_layer_groups, kept_attention_layers

    hybrid = job_in(root, f"sharp-{measure}", f"teacher.source={sharp_teacher}", "student.mixer=linear_attn",
                    "student.attention_layers=auto:1")
    assert kept_attention_layers(hybrid) == [SHARP]
    assert SHARP not in sum(job_layer_groups(hybrid, 2), [])
    # the teacher spelled as a relative path is the same teacher; another teacher's ranking is refused
    relative = job_in(root, f"sharp-{measure}", f"teacher.source={os.path.relpath(sharp_teacher)}",
                      "student.mixer=linear_attn", "student.attention_layers=auto:1")
    assert kept_attention_layers(relative) == [SHARP]
    other = job_in(root, f"sharp-{measure}", "student.mixer=linear_attn", "student.attention_layers=auto:1")
    with pytest.raises(ConfigError, match=r"ranks the .* layers of teacher"):
        kept_attention_layers(other)
    # 'auto:K:MEASURE' takes a ranking by that measure only, and names the command that writes the other
    named = job_in(root, f"sharp-{measure}", f"teacher.source={sharp_teacher}", "student.mixer=linear_attn",
                   f"student.attention_layers=auto:1:{measure}")
    assert kept_attention_layers(named) == [SHARP]
    unlike = "kl" if measure == "stage1" else "stage1"
    wrong = job_in(root, f"sharp-{measure}", f"teacher.source={sharp_teacher}", "student.mixer=linear_attn",
                   f"student.attention_layers=auto:1:{unlike}")
    with pytest.raises(ConfigError, match=rf"ranks the layers by {measure}, but .* asks for a {unlike} ranking: "
                                          rf".*--rank-layers JOB --rank-by {unlike}"):
        kept_attention_layers(wrong)


def test_auto_attention_layers_are_spelled_auto_k_and_need_a_ranking(root):
    from harness.config import auto_layer_count, auto_layer_measure
    from harness.stages.common import kept_attention_layers

    for bad in ("auto:two", "auto", "first:2", "auto:2:mse", "auto:2:kl:kl", "auto:kl"):
        with pytest.raises(ConfigError, match=r"student.attention_layers.*'auto:K'.*stage1, kl"):
            job_in(root, "auto-bad", f"student.attention_layers={bad}")
    for spelled, k, measure in (("auto:3", 3, None), ("auto:2:kl", 2, "kl"), ("auto:0:stage1", 0, "stage1")):
        layers = job_in(root, "auto-good", f"student.attention_layers={spelled}").student.attention_layers
        assert (auto_layer_count(layers), auto_layer_measure(layers)) == (k, measure)
    assert auto_layer_count([1, 2]) is None and auto_layer_measure([1, 2]) is None
    with pytest.raises(ConfigError, match=r"wrong kind for its field"):  # `auto:` reads as a mapping {auto: null}
        job_in(root, "auto-bad", "student.attention_layers=auto:")
    job = job_in(root, "auto-unranked", "student.attention_layers=auto:2")  # loads: the ranking is read when needed
    with pytest.raises(ConfigError, match=r"No layer ranking at .*harness transfer"):
        kept_attention_layers(job)


class TeacherAttentionAsMixer(torch.nn.Module):
    """The teacher's own attention (harness.transfer.AttentionProbe, an independent softmax) behind a mixer's call
    convention `(x, position_embeddings=...) -> (y, state)`; counts its calls."""

    def __init__(self, model, layer: int):
        super().__init__()
        self.probe, self.calls = AttentionProbe.of_teacher(model, layer), 0
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # MixerAsAttention reads the dtype of a parameter

    def forward(self, x, position_embeddings=None):
        self.calls += 1
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        return self.probe.output(x, positions), None


def test_kl_is_zero_with_no_layer_or_the_teachers_own_attention_standing_in(root):
    from harness.stages.common import load_job_teacher

    job = job_in(root, "kl-zero")
    model = load_job_teacher(job).model
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    teacher = log_probs(model, ids)
    with replaced_attention(model, 1, None):
        assert kl_per_token(teacher, log_probs(model, ids)) == 0.0
    for layer in range(model.config.num_hidden_layers):
        original = model.model.layers[layer].self_attn
        copy = TeacherAttentionAsMixer(model, layer)
        with replaced_attention(model, layer, MixerAsAttention(copy)):
            assert model.model.layers[layer].self_attn is not original
            kl = kl_per_token(teacher, log_probs(model, ids))
        assert copy.calls == 1 and model.model.layers[layer].self_attn is original
        assert abs(kl) < 1e-7, (layer, kl)  # float32 log-probabilities: rounding at ~1e-8
    zero = TeacherAttentionAsMixer(model, 2)
    zero.forward = lambda x, position_embeddings=None: (torch.zeros_like(x), None)
    with replaced_attention(model, 2, MixerAsAttention(zero)):  # the stand-in is what runs: dropping it costs
        assert kl_per_token(teacher, log_probs(model, ids)) > 1e-4
    first = model.model.layers[0].self_attn
    with pytest.raises(RuntimeError, match="inside"), replaced_attention(model, 0, MixerAsAttention(zero)):
        raise RuntimeError("inside")
    assert model.model.layers[0].self_attn is first
    assert torch.equal(log_probs(model, ids), teacher)  # restored after the failure too


def test_the_replaced_forward_is_the_hand_written_one(root):
    """A mixer with RoPE of its own (rope_theta unlike the teacher's) in layer 2: the model's forward equals one
    written out here, the mixer reading the normalised hidden state and its own position embeddings."""
    from harness.stages.align import init_mixer
    from harness.stages.common import load_job_teacher
    from harness.student import rope_for, student_config

    job = job_in(root, "by-hand", "student.mixer=gla", "student.options.rope=true", "student.options.rope_theta=500")
    model = load_job_teacher(job).model
    config = student_config(model.config, job.student.mixer, dict(job.student.options))
    mixer, rope = init_mixer(model.model.layers[2], config, 2, job.seed).eval(), rope_for(config, torch.device("cpu"))
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = model.model.embed_tokens(ids)
        positions = torch.arange(24)[None].expand(2, -1)
        teacher_rope = model.model.rotary_emb(h, positions)
        for i, layer in enumerate(model.model.layers):
            if i == 2:
                h = h + mixer(layer.input_layernorm(h), position_embeddings=rope(ids))[0]
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            else:
                h = layer(h, position_embeddings=teacher_rope, attention_mask=None)
        by_hand = torch.log_softmax(model.lm_head(model.model.norm(h)).float(), -1)
        with replaced_attention(model, 2, MixerAsAttention(mixer, rope)):
            replaced = log_probs(model, ids)
    torch.testing.assert_close(replaced, by_hand, rtol=1e-5, atol=1e-5)
    assert kl_per_token(log_probs(model, ids), replaced) > 1e-4


def test_the_stage1_cost_is_the_transfer_reports_step0_mse_then_the_stage1_weights(root):
    """Before stage 1, each layer's cost is `harness transfer`'s init mse on the same sequences (that one is stage 1's
    first logged loss, tests/test_transfer.py); once stage 1 finished a group, its layers use the trained weights."""
    from harness.stages.align import align_group

    job = job_in(root, "stage1", "budget.total_tokens=8192")
    before = rank_layers(job, sequences=2, seq_len=32, progress=False)
    report = transfer_report(job, mixers=[job.student.mixer], sequences=2, seq_len=32, progress=False)
    init = {r["layer"]: r["mse"] for r in report["rows"] if r["when"] == "init"}
    assert {int(l): v["cost"] for l, v in before["layers"].items()} == pytest.approx(init, rel=1e-6)
    align_group(job, "align_mixer", [0, 1])
    after = rank_layers(job, sequences=2, seq_len=32, progress=False)
    assert [after["layers"][str(l)]["weights"] for l in range(4)] == ["stage1", "stage1", "init", "init"]
    report = transfer_report(job, mixers=[job.student.mixer], sequences=2, seq_len=32, progress=False)
    trained = {r["layer"]: r["mse"] for r in report["rows"] if r["when"] == "stage1"}
    assert {l: after["layers"][str(l)]["cost"] for l in (0, 1)} == pytest.approx(trained, rel=1e-6)
    assert all(after["layers"][str(l)] == before["layers"][str(l)] for l in (2, 3))
    assert all(after["layers"][str(l)]["cost"] < before["layers"][str(l)]["cost"] for l in (0, 1))


# ------------------------------------------------------------------------------------------ files


@pytest.mark.parametrize("measure", ["stage1", "kl"])
def test_the_ranking_is_deterministic(root, measure):
    files = []
    for run in ("det-a", "det-b"):
        job = job_in(root, f"{run}-{measure}")
        rank_and_merge(job, measure)
        files.append({p.name: p.read_bytes() for p in ranking_dir(job).glob("layer_ranking.*")})
    assert set(files[0]) == {"layer_ranking.json", "layer_ranking.md"} and files[0] == files[1]
    ranking = json.loads(files[0]["layer_ranking.json"])
    costs = {r["layer"]: r["cost"] for r in ranking["layers"]}
    assert ranking["order"] == sorted(costs, key=lambda l: -costs[l])  # costliest first
    assert ranking["data"] == {"origin": "validation split", "sequences": 2, "seq_len": 32} and ranking["seed"] == 0
    assert [r["rank"] for r in sorted(ranking["layers"], key=lambda r: r["rank"])] == [1, 2, 3, 4]


def test_ties_are_broken_by_layer_index():
    assert ranking_order({3: 1.0, 0: 2.0, 2: 1.0, 1: 2.0, 4: float("nan")}) == [0, 1, 2, 3, 4]


def test_parts_merge_into_the_whole_ranking(root):
    whole = rank_and_merge(job_in(root, "whole"))
    job = job_in(root, "parts")
    stale = rank_layers(job, layers=[0, 1], sequences=1, seq_len=32, progress=False)  # an older ranking's part
    write_part(job, stale)
    write_part(job, rank_layers(job, layers=[0, 1], sequences=2, seq_len=32, progress=False))
    with pytest.raises(ConfigError, match=r"lack layer\(s\) \[2, 3\].*--layers 2-3"):
        merge_ranking(job)
    assert merge_ranking(job, require_all=False) is None and not (ranking_dir(job) / "layer_ranking.json").exists()
    write_part(job, rank_layers(job, layers=[2, 3], sequences=2, seq_len=32, progress=False))
    merged = json.loads(merge_ranking(job).read_text())
    assert merged == whole
    assert sorted(p.name for p in (ranking_dir(job) / "parts" / "stage1").iterdir()) == ["layers-00-01.json",
                                                                                       "layers-02-03.json"]
    with pytest.raises(ConfigError, match=r"No kl ranking parts .*--rank-by kl"):
        merge_ranking(job, "kl")


def test_costliest_layers_names_what_is_missing_and_bad_k(root):
    job = job_in(root, "costliest")
    path = ranking_dir(job) / "layer_ranking.json"
    with pytest.raises(ConfigError, match=rf"No layer ranking at {path}.*harness transfer --rank-layers JOB"):
        costliest_layers(job, 2)
    ranking = rank_and_merge(job)
    costs = {r["layer"]: r["cost"] for r in ranking["layers"]}
    for k in range(5):
        top = sorted(costs, key=costs.get, reverse=True)[:k]
        assert costliest_layers(job, k) == sorted(top)
    for bad in (-1, 5, True, "2", 1.0):
        with pytest.raises(ConfigError, match=r"K must be an integer from 0 to the teacher's 4 layers"):
            costliest_layers(job, bad)
    other = job_in(root, "costliest", "teacher.num_layers=3")  # the same run directory, a shallower teacher
    with pytest.raises(ConfigError, match="ranks the 4 layers of teacher .* not the 3"):
        costliest_layers(other, 1)


# ------------------------------------------------------------------------------------------ CLI and Slurm


def job_file(job, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    return path


def test_the_cli_ranks_in_parts_merges_and_names_bad_input(root, tmp_path, capsys):
    job = job_in(root, "cli")
    path = str(job_file(job, tmp_path))
    assert main(["transfer", path, "--rank-layers", "--layers", "0-1", "--seq-len", "32"]) == 0
    assert "once every layer has one" in capsys.readouterr().out
    assert main(["transfer", path, "--rank-layers", "--layers", "2-3", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "# Layer ranking:" in out and "| rank | layer | cost | weights |" in out
    written = (ranking_dir(job) / "layer_ranking.json").read_text()
    assert main(["transfer", path, "--rank-layers", "--merge"]) == 0
    assert (ranking_dir(job) / "layer_ranking.json").read_text() == written
    assert main(["transfer", path, "--rank-layers", "--mixer", "gla"]) == 2
    assert "drop --mixer" in capsys.readouterr().err
    assert main(["transfer", path, "--merge"]) == 2
    assert "use it with --rank-layers" in capsys.readouterr().err
    assert main(["transfer", path, "--rank-layers", "--merge", "--rank-by", "kl"]) == 2
    assert "No kl ranking parts" in capsys.readouterr().err
    # without --rank-by, the measure is the one the job's 'auto:K:MEASURE' names (here kl: no parts yet)
    named = str(job_file(job_in(root, "cli", "student.attention_layers=auto:1:kl"), tmp_path / "named"))
    assert main(["transfer", named, "--rank-layers", "--merge"]) == 2
    assert "No kl ranking parts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["transfer", path, "--rank-layers", "--rank-by", "mse"])
    from harness.cli import build_parser
    from harness.ranking import MEASURES

    commands = build_parser()._subparsers._group_actions[0].choices
    for cmd in ("transfer", "submit"):  # the CLI's spelling (kept literal: --help imports no torch)
        assert tuple(next(a for a in commands[cmd]._actions if a.dest == "rank_by").choices) == MEASURES


def test_the_slurm_plan_is_an_array_per_layer_group_then_a_merge_and_its_scripts_run(root, tmp_path, capsys,
                                                                                       monkeypatch):
    from harness.launch.slurm import SlurmOptions, dependency_graph, plan_ranking

    job = job_in(root, "slurm", "run.layer_groups=2")
    path = job_file(job, tmp_path)
    planned = plan_ranking(job, str(path), ["run.layer_groups=2"], SlurmOptions(partition="gpu", gpus_per_node=1),
                           "kl", ["--sequences", "2", "--seq-len", "32"], python=sys.executable)
    assert [(p.stage, p.depends_on, p.tasks) for p in planned] == [("rank", None, 2), ("rank_merge", "rank", 1)]
    rank, merge = (p.script for p in planned)
    assert "#SBATCH --array=0-1" in rank and "GROUPS_=(0-1 2-3)" in rank and "#SBATCH --gpus-per-node=1" in rank
    assert (f"-m harness.cli transfer {path.resolve()} run.layer_groups=2 --rank-layers --rank-by kl --sequences 2 "
            '--seq-len 32 --layers "$LAYERS"') in rank
    assert "--rank-layers --rank-by kl --sequences 2 --seq-len 32 --merge" in merge and "--array" not in merge
    assert "#SBATCH --partition=gpu" in merge and "--gpus-per-node" not in merge
    assert dependency_graph(planned) == "  rank (array of 2) (no dependency)\n  rank_merge after rank succeeds"
    four = plan_ranking(job, str(path), [], SlurmOptions(layers_per_task=1))
    assert four[0].tasks == 4 and "#SBATCH --array=0-3" in four[0].script and "GROUPS_=(0-0 1-1 2-2 3-3)" in four[0].script
    # the scripts as Slurm would run them (task 0's part is written here, to keep the test short), then the merge
    write_part(job, rank_layers(job, measure="kl", layers=[0, 1], sequences=2, seq_len=32, progress=False))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    ran = subprocess.run(["bash", "-c", rank], env={**env, "SLURM_ARRAY_TASK_ID": "1"}, capture_output=True,
                         text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "layers-02-03.json" in ran.stdout
    (ranking_dir(job) / "layer_ranking.json").unlink()  # the task merged already; the merge job does it too
    ran = subprocess.run(["bash", "-c", merge], env=env, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert json.loads((ranking_dir(job) / "layer_ranking.json").read_text()) == rank_and_merge(
        job_in(root, "slurm-reference"), "kl")
    # `harness submit --rank-layers`: the dry run shows what is submitted, the merge waits for the whole array
    args = ["submit", str(path), "--rank-layers", "--rank-by", "kl", "--rank-sequences", "2"]
    assert main(args + ["--dry-run"]) == 0
    shown = capsys.readouterr().out
    named = job_file(job_in(root, "slurm", "run.layer_groups=2", "student.attention_layers=auto:1:kl"),
                     tmp_path / "named")
    assert main(["submit", str(named), "--rank-layers", "--dry-run"]) == 0  # the job's measure without --rank-by
    assert "--rank-layers --rank-by kl" in capsys.readouterr().out
    records_of = recording_sbatch(tmp_path, monkeypatch, first_id=200)
    assert main(args) == 0
    records = records_of()
    assert [r["argv"][1:-1] for r in records] == [[], ["--dependency=afterok:200", "--kill-on-invalid-dep=no"]]
    assert all(r["script"] in shown for r in records) and "--sequences 2 --layers" in records[0]["script"]
    slurm = Path(job.output_dir) / "slurm"
    assert json.loads((slurm / "rank-jobs.json").read_text())["jobs"] == {"rank": "200", "rank_merge": "201"}
    assert not (slurm / "jobs.json").exists() and not (slurm / "job.yaml").exists()  # the pipeline's record is apart


def test_the_copy_cost_is_the_teachers_copy_accuracy_minus_the_one_layer_replaced_models(root):
    """--rank-by copy: the cost of layer l is the teacher's copy accuracy minus that of the teacher with only layer l
    replaced, both on the prompts `harness eval copy` draws (recomputed here with harness.eval.copy's own scoring)."""
    from harness.eval.copy import (CopyConfig, copy_record, draw_sequences, forward_logits, prompts, token_range,
                                   tokenizer_prefix, vocabulary_size)
    from harness.ranking import start_mixers
    from harness.stages.align import first_batch, stage_autocast
    from harness.stages.common import load_job_teacher
    from harness.student import rope_for, student_config
    from harness.data import prepare_job_corpus

    job = job_in(root, "copy-rank")
    part = rank_layers(job, measure="copy", layers=[1], sequences=2, seq_len=32, progress=False)
    assert part["measure"] == "copy" and part["data"]["seq_len"] == 32 and part["data"]["sequences"] == 8

    teacher = load_job_teacher(job, torch.device("cpu"))
    model, tok = teacher.model, teacher.tokenizer
    cfg = CopyConfig(lengths=[16], sequences=8)
    rng = token_range(cfg, vocabulary_size(model, tok), list(tok.all_special_ids))
    rows = draw_sequences(cfg, 16, rng)
    ids = prompts(rows, tokenizer_prefix(tok), 16)

    def accuracy() -> float:
        logits = forward_logits(model, ids, 17)
        hits = "".join(copy_record(logits[i], rows[i, :16])["hits"][1:] for i in range(8))
        return hits.count("1") / len(hits)

    config = student_config(model.config, job.student.mixer, dict(job.student.options))
    corpus = prepare_job_corpus(job, tok, max_positions=model.config.max_position_embeddings)
    mixer, _ = start_mixers(job, model, config, [1], first_batch(job, corpus), torch.device("cpu"))[1]
    mixer.eval()
    with torch.no_grad():
        before = accuracy()
        with replaced_attention(model, 1, MixerAsAttention(mixer, rope_for(config, torch.device("cpu")),
                                                           stage_autocast(job, torch.device("cpu")))):
            after = accuracy()
        model.model.layers[1].self_attn.o_proj.weight.zero_()  # the teacher's attention with its output zero
        removed = accuracy()
    assert part["data"]["teacher_copy_acc"] == pytest.approx(before)
    assert part["layers"]["1"]["cost"] == pytest.approx(before - after)
    assert part["layers"]["1"]["removed_cost"] == pytest.approx(before - removed)


def test_the_removed_cost_is_the_kl_with_the_layers_attention_zeroed_and_the_report_shows_it(root, sharp_teacher):
    """kl: each layer's removed_cost is the KL of the teacher with that layer's o_proj zeroed (computed here on a
    copy of the teacher's weights, not through RemovedAttention); the uniform layers, which linear_attn copies
    exactly, cost nothing replaced and much removed. The stage-1 measure has no removed cost, its report no
    column."""
    from harness.stages.common import load_job_teacher
    from harness.transfer import sample_sequences
    from harness.data import prepare_job_corpus

    job = job_in(root, "removed-kl", f"teacher.source={sharp_teacher}", "student.mixer=linear_attn")
    ranking = rank_and_merge(job, "kl")
    model = load_job_teacher(job).model
    corpus = prepare_job_corpus(job, load_job_teacher(job).tokenizer,
                                max_positions=model.config.max_position_embeddings)
    ids, _ = sample_sequences(corpus, 2, 32)
    teacher = log_probs(model, ids)
    for row in ranking["layers"]:
        o_proj = model.model.layers[row["layer"]].self_attn.o_proj
        kept = o_proj.weight.detach().clone()
        with torch.no_grad():
            o_proj.weight.zero_()
            direct = kl_per_token(teacher, log_probs(model, ids))
            o_proj.weight.copy_(kept)
        assert row["removed_cost"] == pytest.approx(direct, rel=1e-5), row
        if row["layer"] not in (SHARP, MILD):
            assert abs(row["cost"]) < 1e-6 and row["removed_cost"] > 1e-3
    md = (ranking_dir(job) / "layer_ranking.md").read_text()
    assert "| rank | layer | cost | cost with the attention removed | weights |" in md
    stage1 = job_in(root, "removed-stage1")
    assert all("removed_cost" not in r for r in rank_and_merge(stage1)["layers"])
    assert "removed" not in (ranking_dir(stage1) / "layer_ranking.md").read_text()


def test_the_copy_probe_of_the_ranking_scores_a_copier_fully_and_a_contextless_model_near_zero():
    """CopyProbe (the ranking's copy measure) reads the accuracy as `harness eval copy` does: 100% for a model that
    copies by construction, ~0 for one that ignores the context (the tiny pipeline teacher copies nothing, so the
    ranking test above cannot tell these apart)."""
    from harness.ranking import CopyProbe
    from tests.test_copy import Contextless, Oracle, Tokenizer

    probe = CopyProbe.for_model(Oracle(), Tokenizer(), sequences=2, seq_len=64, device=torch.device("cpu"))
    assert probe.rows.shape == (8, 32) and probe.accuracy(Oracle()) == 1.0
    assert probe.accuracy(Contextless()) < 0.05
    # the NLL, which the kept-set search reads: ~0 for the copier (its logits put 20 on the next token)
    assert probe.measure(Oracle())["nll_after_first"] < 1e-3 < 1.0 < probe.measure(Contextless())["nll_after_first"]
