"""Stages 1 and 2 (per-layer alignment of layer groups) and the merge, on a tiny random Llama teacher (CPU).

Run directories: A trains stage 1 as one group [0..3] and stage 2 as [0,1] + [2,3]; B the other way round.
Grouping must not matter, so A and B must hold the same weights, bit for bit.
"""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from harness.checkpoint import CheckpointWarning
from harness.config import ConfigError, load_job
from harness.mixers import MIXERS
from harness.observe import NonFiniteLoss
from harness import losses as losses_mod
from harness.stages import align as align_mod
from harness.stages.align import WEIGHTS, align_group, init_mixer, layer_seed
from harness.stages.common import group_dir
from harness.stages.merge import MERGE_JSON, merge_student
from harness.student import build_student, student_config
from tests.tiny import tiny_llama

EOS = "<|endoftext|>"
WORDS = ("the of and to in a is that for it as was with be by on not he this are or his from at which but have an "
         "river city music history science garden window mountain language teacher market winter summer village "
         "library station engine theory painting harbour forest kingdom island bridge century").split()
STEPS = 24  # optimizer steps per group and stage, each of 2 micro-batches x 2 sequences x 32 tokens


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory) -> Path:
    """A 4-layer random Llama whose vocabulary is a tiny BPE tokenizer's, saved with that tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(_documents(200, seed=9), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS)
    path = tmp_path_factory.mktemp("teacher")
    tiny_llama(num_layers=4, hidden=32, heads=4, kv_heads=2, vocab=len(tokenizer), tie=True).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 80))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _documents(300, seed=1)))
    return path


@pytest.fixture(scope="module")
def make_job(teacher_dir, corpus_file, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")

    def make(out: Path, *extra: str):
        per_step = 2 * 2 * 32
        return load_job(None, [
            f"teacher.source={teacher_dir}", f"data.source={corpus_file}", "data.seq_len=32",
            "data.validation_tokens=256", f"data.cache_dir={cache}", "data.num_proc=1", f"output_dir={out}",
            "budget.total_tokens=4096", "run.device=cpu", "run.log_every_steps=1", "seed=3",
            *(f"stages.{s}.{k}={v}" for s in ("align_mixer", "align_hidden")
              for k, v in (("micro_batch_size", 2), ("grad_accum", 2), ("tokens", STEPS * per_step),
                           ("lr", 1e-2), ("weight_decay", 0.01), ("grad_clip", 0.5))),
            *extra])

    return make


@pytest.fixture(scope="module")
def runs(make_job, tmp_path_factory):
    """Two run directories trained with different groupings (see the module docstring)."""
    a, b = make_job(tmp_path_factory.mktemp("A")), make_job(tmp_path_factory.mktemp("B"))
    align_group(a, "align_mixer", [0, 1, 2, 3])
    for g in ([0, 1], [2, 3]):
        align_group(b, "align_mixer", g)
        align_group(a, "align_hidden", g)
    align_group(b, "align_hidden", [0, 1, 2, 3])
    return a, b


def weights(job, stage, layers) -> dict[str, torch.Tensor]:
    return load_file(group_dir(job, stage, layers) / WEIGHTS)


def metrics(job, stage, layers) -> list[dict]:
    lines = (group_dir(job, stage, layers) / "metrics.jsonl").read_text().splitlines()
    keep = ("loss", "lr", "grad_norm", "step")  # not the wall-clock fields
    return [{k: v for k, v in json.loads(x).items() if k.startswith(keep) or k == "tokens"} for x in lines]


def teacher_model(job):
    from harness.stages.common import load_job_teacher

    return load_job_teacher(job, torch.device("cpu")).model


# ------------------------------------------------------------------------------------------ training


def held_out_losses(job, stage: str, layers: list[int], trained: dict | None = None,
                    loss: str = "mse") -> dict[int, float]:
    """Per-layer `loss` on 8 validation sequences, of the group's initial modules or of `trained` weights."""
    from harness.data import prepare_job_corpus
    from harness.stages.common import load_job_teacher
    from harness.teacher import capture_activations

    teacher = load_job_teacher(job, torch.device("cpu"))
    group = align_mod.build_group(job, stage, layers, teacher, student_config(teacher.config, job.student.mixer, {}))
    for key, module in group.items():
        prefix = f"model.layers.{key}." + ("mixer." if stage == "align_mixer" else "")
        if trained is not None:
            module.load_state_dict({k[len(prefix):]: v for k, v in trained.items() if k.startswith(prefix)})
    corpus = prepare_job_corpus(job, teacher.tokenizer, max_positions=512)
    ids = next(corpus.validation_batches(8))["input_ids"]
    acts = capture_activations(teacher.model, ids, layers=layers, kinds=align_mod.KINDS[stage])
    with torch.no_grad():
        return {l: float(align_mod.layer_loss(group[str(l)], stage, acts, l, loss=loss)) for l in layers}


@pytest.mark.parametrize("stage", ["align_mixer", "align_hidden"])
def test_alignment_reduces_every_layers_mse(runs, stage):
    _, b = runs
    layers = [0, 1, 2, 3]
    before = held_out_losses(b, stage, layers)
    after = held_out_losses(b, stage, layers, {**weights(b, stage, [0, 1]), **weights(b, stage, [2, 3])}
                            if stage == "align_mixer" else weights(b, stage, layers))
    assert all(after[l] < before[l] for l in layers), (before, after)
    # stage 2 starts from stage 1's mixers, close to the teacher already: less left to gain in 8 steps
    assert sum(after.values()) < (0.8 if stage == "align_mixer" else 0.9) * sum(before.values()), (before, after)
    rows = metrics(b, stage, [0, 1] if stage == "align_mixer" else layers)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    last = rows[-1]
    names = [k for k in last if k.startswith("loss/layer_")]
    assert last["loss"] == pytest.approx(sum(last[k] for k in names) / len(names))
    assert all(k.replace("loss", "grad_norm") in last for k in names) and last["lr"] > 0


def test_groups_train_only_their_layers(runs):
    a, _ = runs
    teacher = teacher_model(a)
    student = build_student(teacher, a.student.mixer)
    names = set(student.state_dict())
    w1, w2 = weights(a, "align_mixer", [0, 1, 2, 3]), weights(a, "align_hidden", [2, 3])
    # stage 1: exactly the mixers of its layers; stage 2: exactly its layers' blocks
    assert set(w1) == {k for k in names if ".mixer." in k}
    assert set(w2) == {k for k in names if k.startswith(("model.layers.2.", "model.layers.3."))}
    assert all(v.dtype == torch.float32 for v in w1.values())
    t = teacher.model.layers[1].self_attn
    assert not torch.equal(w1["model.layers.1.mixer.q_proj.weight"], t.q_proj.weight)  # it trained
    # stage 2 starts from stage 1's mixer and the teacher's MLP, and trains the whole block
    assert not torch.equal(w2["model.layers.2.mlp.up_proj.weight"], teacher.model.layers[2].mlp.up_proj.weight)
    assert not torch.equal(w2["model.layers.2.mixer.q_proj.weight"], w1["model.layers.2.mixer.q_proj.weight"])
    summary = json.loads((group_dir(a, "align_hidden", [2, 3]) / "COMPLETE.json").read_text())["meta"]
    assert summary["steps"] == STEPS and summary["tokens"] == STEPS * 128 and set(summary["losses"]) == {"2", "3"}


def test_grouping_does_not_change_the_weights(runs):
    a, b = runs
    for stage, whole, parts in (("align_mixer", a, b), ("align_hidden", b, a)):
        one = weights(whole, stage, [0, 1, 2, 3])
        split = {**weights(parts, stage, [0, 1]), **weights(parts, stage, [2, 3])}
        assert set(one) == set(split)
        for k in one:
            assert torch.equal(one[k], split[k]), (stage, k)
        rows_one = metrics(whole, stage, [0, 1, 2, 3])
        rows_split = metrics(parts, stage, [2, 3])
        assert [r["loss/layer_03"] for r in rows_one] == [r["loss/layer_03"] for r in rows_split]


def test_merge_assembles_the_stage2_weights(runs):
    a, _ = runs
    out = merge_student(a)
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(out)
    state = student.state_dict()
    for g in ([0, 1], [2, 3]):
        for k, v in weights(a, "align_hidden", g).items():
            assert torch.equal(state[k], v), k
    teacher = teacher_model(a)
    assert torch.equal(state["model.embed_tokens.weight"], teacher.model.embed_tokens.weight)
    record = json.loads((out / MERGE_JSON).read_text())
    assert [g["layers"] for g in record["groups"]] == [[0, 1], [2, 3]]
    assert all(len(g["sha256"]) == 64 for g in record["groups"])
    assert (out / "tokenizer.json").is_file()
    mtime = (out / MERGE_JSON).stat().st_mtime_ns
    assert merge_student(a) == out and (out / MERGE_JSON).stat().st_mtime_ns == mtime  # idempotent


def test_mixer_init_is_build_students_for_the_same_rng():
    teacher = tiny_llama(num_layers=3, hidden=32, heads=4, kv_heads=2, vocab=64)
    for name in MIXERS:
        student = build_student(teacher, name)
        config = student_config(teacher.config, name, {})
        for l in range(3):
            mine = init_mixer(teacher.model.layers[l], config, l, seed=7)
            theirs = student.model.layers[l].mixer
            torch.manual_seed(layer_seed(7, l))
            theirs.reset_new_parameters()
            ref = theirs.state_dict()
            assert all(torch.equal(v, ref[k]) for k, v in mine.state_dict().items()), (name, l)


def test_rope_mixer_trains_and_merges(make_job, tmp_path):
    job = make_job(tmp_path, "student.options.rope=true", "teacher.num_layers=1",
                   *(f"stages.{s}.tokens=256" for s in ("align_mixer", "align_hidden")))
    for stage in ("align_mixer", "align_hidden"):
        align_group(job, stage, [0])
    from transformers import AutoModelForCausalLM

    student = AutoModelForCausalLM.from_pretrained(merge_student(job))
    from harness.mixers import resolved_options

    assert student.config.mixer_options == resolved_options(job.student.mixer, {"rope": True})  # every option
    assert student.config.num_hidden_layers == 1
    assert torch.isfinite(student(torch.arange(20)[None]).logits).all()


# ------------------------------------------------------------------------------------------ resume


def test_killed_group_resumes_exactly(runs, make_job, tmp_path):
    _, b = runs
    job = make_job(tmp_path, "run.checkpoint_every_tokens=256")  # a checkpoint every 2 steps
    gdir = align_group(job, "align_mixer", [0, 1], stop_after_steps=3)
    assert not (gdir / "COMPLETE.json").exists()
    assert sorted(p.name for p in (gdir / "checkpoints").glob("step-*")) == ["step-00000002"]
    align_group(job, "align_mixer", [0, 1])
    ref = weights(b, "align_mixer", [0, 1])
    got = weights(job, "align_mixer", [0, 1])
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    assert metrics(job, "align_mixer", [0, 1]) == metrics(b, "align_mixer", [0, 1])


def test_corrupt_newest_checkpoint_falls_back(runs, make_job, tmp_path):
    _, b = runs
    job = make_job(tmp_path, "run.checkpoint_every_tokens=256", "run.keep_last=3")
    gdir = align_group(job, "align_mixer", [2, 3], stop_after_steps=4)
    newest = gdir / "checkpoints" / "step-00000004" / "state.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.warns(CheckpointWarning, match="step-00000004"):
        align_group(job, "align_mixer", [2, 3])
    ref, got = weights(b, "align_mixer", [2, 3]), weights(job, "align_mixer", [2, 3])
    assert all(torch.equal(got[k], ref[k]) for k in ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert align_group(job, "align_mixer", [2, 3]) == gdir  # complete: returns at once


def test_nan_loss_stops_without_a_checkpoint(make_job, tmp_path, monkeypatch):
    job = make_job(tmp_path, "run.checkpoint_every_tokens=256")
    calls = {"n": 0}
    real = losses_mod.alignment_mse

    def poisoned(pred, target):
        calls["n"] += 1
        loss = real(pred, target)
        return loss * float("nan") if calls["n"] > 2 * 2 * 2 else loss  # step 3: 2 micro x 2 layers per step

    monkeypatch.setitem(losses_mod.ALIGNMENT_LOSSES, "mse", poisoned)
    with pytest.raises(NonFiniteLoss, match="step 3"):
        align_group(job, "align_mixer", [0, 1])
    gdir = group_dir(job, "align_mixer", [0, 1])
    assert sorted(p.name for p in (gdir / "checkpoints").glob("step-*")) == ["step-00000002"]
    assert not (gdir / WEIGHTS).exists() and not (gdir / "COMPLETE.json").exists()


def test_stage2_trains_on_the_l2_norm_when_asked(runs, make_job, tmp_path):
    """stages.align_hidden.loss=l2 (the paper authors' stage 2): the group trains on the per-token norm of the
    difference, which its metrics log and training lowers, and which is not what the MSE run optimised."""
    import shutil
    a, _ = runs
    job = make_job(tmp_path, "stages.align_hidden.loss=l2")
    shutil.copytree(group_dir(a, "align_mixer", [0, 1, 2, 3]), group_dir(job, "align_mixer", [0, 1, 2, 3]))
    align_group(job, "align_hidden", [0, 1])
    before = held_out_losses(job, "align_hidden", [0, 1], loss="l2")
    after = held_out_losses(job, "align_hidden", [0, 1], weights(job, "align_hidden", [0, 1]), loss="l2")
    # a norm, not its square: the 0.9 of the MSE test above is about 0.95 here
    assert all(after[l] < 0.95 * before[l] for l in (0, 1)), (before, after)
    l2_rows, mse_rows = metrics(job, "align_hidden", [0, 1]), metrics(a, "align_hidden", [0, 1])
    assert l2_rows[0]["loss"] != pytest.approx(mse_rows[0]["loss"], rel=1e-3)
    mse_after = held_out_losses(job, "align_hidden", [0, 1], weights(job, "align_hidden", [0, 1]))
    assert mse_after != held_out_losses(a, "align_hidden", [0, 1], weights(a, "align_hidden", [0, 1]))


# ------------------------------------------------------------------------------------------ errors


def test_layers_outside_the_model(make_job, tmp_path):
    job = make_job(tmp_path)
    with pytest.raises(ConfigError, match=r"outside the model: the student has 4 layers \(0-3\)"):
        align_group(job, "align_mixer", [3, 4])
    with pytest.raises(ConfigError, match="contiguous"):
        align_group(job, "align_mixer", [0, 2])
    job2 = make_job(tmp_path, "teacher.num_layers=2")
    with pytest.raises(ConfigError, match="has 2 layers"):
        align_group(job2, "align_hidden", [2])


def test_stage2_needs_stage1(runs, make_job, tmp_path):
    job = make_job(tmp_path)
    with pytest.raises(ConfigError, match=r"layer\(s\) \[0, 1\].*harness stage align-mixer JOB --layers 0-1"):
        align_group(job, "align_hidden", [0, 1])
    with pytest.raises(ConfigError, match=r"align_hidden.*\[0, 1, 2, 3\]"):
        merge_student(job)
    # a stage-1 group covering only part of the layers: the rest is named
    (tmp_path / "align_mixer").mkdir()
    src = group_dir(runs[1], "align_mixer", [2, 3])
    import shutil

    shutil.copytree(src, group_dir(job, "align_mixer", [2, 3]))
    with pytest.raises(ConfigError, match=r"layer\(s\) \[1\].*--layers 1`"):
        align_group(job, "align_hidden", [1, 2])


def test_groups_made_under_other_options_are_refused_with_the_overrides_that_continue_them(runs, make_job, tmp_path):
    """A finished group records every mixer option it was made under; one from before the init options existed
    records none of them, so it was made under their old values: a job with today's defaults refuses it (its
    weights belong to another network) and names the overrides that continue the run as it began."""
    import shutil

    from harness.mixers import LEGACY_OPTION_VALUES, resolved_options

    a, _ = runs
    job = make_job(tmp_path)
    for stage, groups in (("align_mixer", [[0, 1, 2, 3]]), ("align_hidden", [[0, 1], [2, 3]])):
        for layers in groups:
            dst = group_dir(job, stage, layers)
            shutil.copytree(group_dir(a, stage, layers), dst)
            record = json.loads((dst / "COMPLETE.json").read_text())
            assert record["meta"]["options"] == resolved_options(a.student.mixer, a.student.options)
            record["meta"]["options"] = {}  # as written before 2026-12-01
            (dst / "COMPLETE.json").write_text(json.dumps(record))
    keep = [f"student.options.{k}={v}" for k, v in LEGACY_OPTION_VALUES.items()
            if k in resolved_options(job.student.mixer)]
    assert len(keep) == 4  # gated_deltanet has all four
    for attempt in (lambda: align_group(job, "align_mixer", [0, 1, 2, 3]), lambda: merge_student(job)):
        with pytest.raises(ConfigError, match="made under other student.options") as err:
            attempt()
        assert all(k in str(err.value) for k in keep), str(err.value)
    legacy = make_job(tmp_path, *keep)
    assert align_group(legacy, "align_mixer", [0, 1, 2, 3]) == group_dir(job, "align_mixer", [0, 1, 2, 3])
    with pytest.raises(ConfigError, match="student.mixer=gated_deltanet, not retnet"):
        align_group(make_job(tmp_path, "student.mixer=retnet"), "align_mixer", [0, 1, 2, 3])


# ------------------------------------------------------------------------------------------ matrix orientation


def test_mixing_term_is_the_distance_to_the_teachers_attention_probabilities(teacher_dir):
    """mixing_loss against a hand computation: 1 - the mean row cosine between the teacher's softmax rows from
    transformers' eager attention (output_attentions) and the mixing matrix of an identity-feature, unnormalised
    linear_attn mixer, A_ts = (q_t . k_s) / sqrt(d) for s <= t, from its own projections."""
    from transformers import AutoModelForCausalLM

    from harness.probes import AttentionProbe

    model = AutoModelForCausalLM.from_pretrained(teacher_dir, attn_implementation="eager").eval()
    config = student_config(model.config, "linear_attn", {"feature_map": "identity", "normalize": False})
    mixer = init_mixer(model.model.layers[1], config, 1, seed=0).float()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    inputs = {}
    hook = model.model.layers[1].input_layernorm.register_forward_hook(lambda m, a, o: inputs.update(x=o.detach()))
    with torch.no_grad():
        probs = model(input_ids=ids, output_attentions=True).attentions[1][:, :, :8, :8]  # [B, H, 8, 8]
    hook.remove()
    x = inputs["x"]
    got = align_mod.mixing_loss(mixer, AttentionProbe.of_teacher(model, 1), x, tokens=8)

    h, d = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    q = mixer.q_proj(x[:, :8]).unflatten(-1, (h, d)).transpose(1, 2)  # [B, H, 8, d]
    k = mixer.k_proj(x[:, :8]).unflatten(-1, (h, d)).transpose(1, 2)  # the teacher's KV heads expanded at transfer
    a = (q @ k.transpose(-1, -2)) * d ** -0.5
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    a = a.masked_fill(~causal, 0.0)
    cos = (a * probs).sum(-1) / (a.norm(dim=-1) * probs.norm(dim=-1))
    assert got.item() == pytest.approx(1 - cos.mean().item(), rel=1e-4)
    assert 0.0 < got.item() < 2.0


def test_stage1_with_the_mixing_term_logs_it_and_moves_the_mixer_towards_the_teachers_attention(make_job, tmp_path):
    """mixing_weight > 0: each layer's term is logged apart (loss/mixing_NN), the logged alignment loss of the first
    step is the plain run's (same start, same batch), and the term falls further than under the output loss
    alone."""
    bf16 = "teacher.dtype=bfloat16"  # as the studies' teachers: the term reads the teacher in its own dtype
    plain = make_job(tmp_path / "plain", bf16, "stages.align_mixer.mixing_tokens=16")
    mixed = make_job(tmp_path / "mixed", bf16, "stages.align_mixer.mixing_weight=5.0",
                     "stages.align_mixer.mixing_tokens=16")
    align_group(plain, "align_mixer", [1])
    align_group(mixed, "align_mixer", [1])
    rows, plain_rows = metrics(mixed, "align_mixer", [1]), metrics(plain, "align_mixer", [1])
    assert all("loss/mixing_01" in r for r in rows) and not any("loss/mixing_01" in r for r in plain_rows)
    assert rows[0]["loss/layer_01"] == pytest.approx(plain_rows[0]["loss/layer_01"], rel=1e-5)

    from harness.data import prepare_job_corpus
    from harness.stages.common import load_job_teacher
    from harness.teacher import capture_activations
    from harness.probes import AttentionProbe

    teacher = load_job_teacher(mixed, torch.device("cpu"))
    ids = next(prepare_job_corpus(mixed, teacher.tokenizer, max_positions=512).validation_batches(8))["input_ids"]
    x = capture_activations(teacher.model, ids, layers=[1], kinds=("attn_input",)).attn_input[1].float()
    probe = AttentionProbe.of_teacher(teacher.model, 1)

    def term(job, trained: bool) -> float:
        group = align_mod.build_group(job, "align_mixer", [1], teacher,
                                      student_config(teacher.config, job.student.mixer, {}))
        if trained:
            prefix = "model.layers.1.mixer."
            group["1"].load_state_dict({k[len(prefix):]: v for k, v in weights(job, "align_mixer", [1]).items()
                                        if k.startswith(prefix)})
        with torch.no_grad():
            return float(align_mod.mixing_loss(group["1"], probe, x, 16))

    start, after_plain, after_mixed = term(plain, False), term(plain, True), term(mixed, True)
    assert after_mixed < 0.8 * start and after_mixed < after_plain, (start, after_plain, after_mixed)


@pytest.mark.parametrize("overrides, message", [
    (("stages.align_hidden.mixing_weight=1.0",), "is stage 1's"),
    (("stages.align_mixer.mixing_weight=1.0", "student.options.rope=true"), "without RoPE only"),
    (("stages.align_mixer.mixing_weight=-1",), "mixing_weight"),
])
def test_a_mixing_term_the_stage_cannot_apply_is_refused_by_name(make_job, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        make_job(tmp_path, *overrides)

