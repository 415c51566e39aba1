"""Hybrid students (`student.attention_layers`): the kept layers are the teacher's softmax attention bit for bit (an
all-kept student is the teacher), the mixed cache decodes as full forwards do, padding is exact, a saved hybrid
reloads as one, and stages 1-2 leave kept layers to the teacher while stage 3 trains them."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GenerationConfig

import harness
from harness.attention import KVState
from harness.config import ConfigError, load_job
from harness.decoding import GraphedStep, graph_blocker, graphable, greedy_decode_batch
from harness.flops import model_flops_per_token
from harness.launch.slurm import SlurmOptions, plan_jobs
from harness.mixers import MixerState
from harness.mixers.contract import padded, real
from harness.stages.align import check_group
from harness.stages.common import job_layer_groups, kept_attention_layers, layer_groups
from harness.student import AttentionBlock, RecurrentCache, StudentBlock, count_parameters
from tests.pipeline import tiny_job
from tests.test_run import harness_cli
from tests.tiny import TINY_FAMILIES, tiny_llama

ATOL = 1e-5
GEN = GenerationConfig(max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)


def hybrid(teacher, mixer="gla", kept=(1,), **options):
    torch.manual_seed(1)
    model = harness.build_student(teacher, mixer, attention_layers=list(kept), chunk_size=8, backend="reference",
                                  **options).eval()
    model.generation_config.eos_token_id = None  # generate every token asked for (compared with greedy steps)
    return model


@pytest.fixture(scope="module")
def teacher():
    return tiny_llama(num_layers=3)


@pytest.fixture(scope="module")
def prompts():
    torch.manual_seed(3)
    return [torch.randint(3, 97, (n,)) for n in (5, 13, 22)]


# ---------------------------------------------------------------- the kept layers are the teacher's


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_kept_layers_hold_the_teachers_tensors_bit_for_bit(family):
    t = TINY_FAMILIES[family](num_layers=3)
    s = hybrid(t, kept=(0, 2))
    keys = s.state_dict().keys()
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "model.layers.1.mixer.q_proj.weight" in keys
    for i in (0, 2):
        assert isinstance(s.model.layers[i], AttentionBlock)
        ours, theirs = s.model.layers[i].state_dict(), t.model.layers[i].state_dict()
        assert set(ours) == set(theirs)
        for name, tensor in theirs.items():
            assert torch.equal(ours[name], tensor), name
    assert isinstance(s.model.layers[1], StudentBlock)


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_a_student_keeping_every_layer_is_the_teacher(family):
    """Grouped KV heads (qwen2: one KV head for five), biases, q/k norms, Mistral's sliding window (8 < 24 tokens)."""
    t = TINY_FAMILIES[family](num_layers=3).float()
    s = hybrid(t, kept=(0, 1, 2))
    ids = torch.randint(3, 97, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(s(ids).logits, t(ids).logits, atol=ATOL, rtol=0)
    assert count_parameters(s) == count_parameters(t)
    # flops count the kept attention as the teacher's: 6 N + 2 N with the same N
    assert model_flops_per_token(s, t) == 8 * count_parameters(t)


def test_kept_layers_use_the_teachers_rotary_not_the_mixers_theta(teacher):
    s = hybrid(teacher, "gla", kept=(0, 1, 2), rope=True, rope_theta=500.0)
    ids = torch.randint(3, 97, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(s(ids).logits, teacher(ids).logits, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- the mixed cache


def greedy_by_full_forwards(model, ids, n):
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


@pytest.mark.parametrize("mixer,rope", [("gla", False), ("gated_deltanet", False), ("mlstm", True)])
def test_mixed_cache_generate_equals_greedy_full_forwards(teacher, mixer, rope):
    s = hybrid(teacher, mixer, rope=rope)
    ids = torch.randint(3, 97, (1, 11))
    out = s.generate(ids, generation_config=GEN)
    assert torch.equal(out, greedy_by_full_forwards(s, ids, GEN.max_new_tokens))
    cache = RecurrentCache(3)
    with torch.no_grad():
        s(ids, cache=cache, use_cache=True)
    assert isinstance(cache.states[1], KVState) and cache.states[1].length == 11
    assert all(isinstance(cache.states[i], MixerState) for i in (0, 2))
    kv, total = cache.kv_bytes(), cache.state_bytes()
    with torch.no_grad():
        s(out[:, 11:12], cache=cache, use_cache=True)
    assert cache.kv_bytes() == kv * 12 // 11 and cache.state_bytes() - cache.kv_bytes() == total - kv


def test_a_sliding_window_layer_caches_only_its_window_and_decodes_as_full_forwards(prompts):
    """Mistral's window (8): the kept layer's cache holds the last 7 columns, and decoding past the window (prompts
    of 5 to 22 tokens, alone and left-padded together) still gives the tokens of full forwards."""
    t = TINY_FAMILIES["mistral"](num_layers=3).float()
    s = hybrid(t, "gated_deltanet")
    for p in prompts:
        out = s.generate(p[None], generation_config=GEN)
        assert torch.equal(out, greedy_by_full_forwards(s, p[None], GEN.max_new_tokens))
    cache = RecurrentCache(3)
    with torch.no_grad():
        s(prompts[2][None], cache=cache, use_cache=True)
        assert cache.states[1].length == 7
        s(prompts[2][None, :1], cache=cache, use_cache=True)
    assert cache.states[1].length == 7
    ids, mask = padded(prompts, "left")
    out = s.generate(input_ids=ids, attention_mask=mask, generation_config=GEN)[:, ids.shape[1]:]
    batched = greedy_decode_batch(s, prompts, GEN.max_new_tokens, graphs=False)
    for row, p in enumerate(prompts):
        alone = greedy_by_full_forwards(s, p[None], GEN.max_new_tokens)[0, len(p):]
        assert torch.equal(out[row], alone) and batched[row] == alone.tolist()


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_hybrid_rows_compute_what_they_compute_alone(teacher, prompts, side):
    s = hybrid(teacher, "gated_deltanet", rope=True)
    ids, mask = padded(prompts, side)
    with torch.no_grad():
        batch = s(ids, attention_mask=mask).logits
        unmasked = s(ids).logits
        for row, p in enumerate(prompts):
            torch.testing.assert_close(real(batch[row], len(p), side), s(p[None]).logits[0], atol=ATOL, rtol=0)
    if side == "left":  # the comparison can fail: without the mask the padding is attended to
        n = len(prompts[0])
        assert (real(unmasked[0], n, side) - real(batch[0], n, side)).abs().max() > 1e-3


def test_left_padded_generate_gives_each_row_its_own_tokens(teacher, prompts):
    s = hybrid(teacher, "gla")
    ids, mask = padded(prompts, "left")
    out = s.generate(input_ids=ids, attention_mask=mask, generation_config=GEN)[:, ids.shape[1]:]
    for row, p in enumerate(prompts):
        alone = s.generate(p[None], generation_config=GEN)[0, len(p):]
        assert torch.equal(out[row], alone)


def test_greedy_decode_batch_of_a_hybrid_equals_each_prompt_alone(teacher, prompts):
    s = hybrid(teacher, "gated_deltanet")
    together = greedy_decode_batch(s, prompts, 8)
    for p, tokens in zip(prompts, together):
        assert tokens == s.generate(p[None], generation_config=GEN)[0, len(p):].tolist()


def test_cache_reordering_moves_kv_and_mixer_states_alike(teacher, prompts):
    s = hybrid(teacher, "gla")
    ids = torch.stack([prompts[1][:8], prompts[2][:8]])
    nxt = torch.tensor([[5], [7]])

    def prefilled() -> RecurrentCache:
        cache = RecurrentCache(3)
        s(ids, cache=cache, use_cache=True)
        return cache

    with torch.no_grad():
        want = s(nxt, cache=prefilled()).logits
        cache = prefilled()
        cache.reorder_cache(torch.tensor([1, 0]))
        torch.testing.assert_close(s(nxt.flip(0), cache=cache).logits, want.flip(0), atol=ATOL, rtol=0)
        cache = prefilled()
        cache.batch_repeat_interleave(2)
        assert cache.states[1].k.shape[0] == 4 and cache.states[0].tensors()[0].shape[0] == 4
        torch.testing.assert_close(s(nxt.repeat_interleave(2, 0), cache=cache).logits,
                                   want.repeat_interleave(2, 0), atol=ATOL, rtol=0)
        cache = prefilled()
        cache.batch_select_indices(torch.tensor([1]))
        torch.testing.assert_close(s(nxt[1:], cache=cache).logits, want[1:], atol=ATOL, rtol=0)


def test_a_saved_hybrid_reloads_as_one(teacher, tmp_path):
    s = hybrid(teacher, "gated_deltanet", kept=(0, 2))
    s.save_pretrained(tmp_path / "student")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "student").eval()
    assert back.config.attention_layers == [0, 2]
    assert [type(b).__name__ for b in back.model.layers] == ["AttentionBlock", "StudentBlock", "AttentionBlock"]
    ids = torch.randint(3, 97, (1, 12))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, s(ids).logits)


def test_a_hybrid_under_a_sliding_window_is_not_graphed_and_says_why():
    s = hybrid(TINY_FAMILIES["mistral"](num_layers=3).float(), "gated_deltanet")
    assert not graphable(s) and "sliding window" in graph_blocker(s)
    cache = RecurrentCache(3)
    with torch.no_grad():
        s(torch.tensor([[4, 5]]), cache=cache, use_cache=True)
    with pytest.raises(ValueError, match="sliding window"):
        GraphedStep(s, cache)


def test_a_full_context_hybrid_is_kept_from_graphs_only_by_the_device(teacher):
    s = hybrid(teacher)
    assert graph_blocker(s) == "it is not on a CUDA device"


@pytest.mark.parametrize("mixer,rope", [("gla", False), ("gated_deltanet", True)])
def test_fixed_kv_steps_compute_what_growing_ones_do(teacher, prompts, mixer, rope):
    """A left-padded batch (prompts of 5, 13, 22 tokens) prefilled, then 6 steps: the FixedKVState (keys written in
    place, padding and unwritten room hidden by `valid`, positions from the cache) gives the logits of the growing
    KVState with the prompts' mask. rope: the mixers' rotary reads the cache's positions too."""
    s = hybrid(teacher, mixer, rope=rope)
    ids, mask = padded(prompts, "left")
    steps = torch.randint(3, 97, (len(prompts), 6), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        grow, fixed = RecurrentCache(3), RecurrentCache(3)
        s(ids, attention_mask=mask, cache=grow, use_cache=True)
        s(ids, attention_mask=mask, cache=fixed, use_cache=True)
        fixed.fix_kv(6, mask)
        assert fixed.positions.tolist() == [len(p) for p in prompts] and fixed.capacity == ids.shape[1] + 6
        kv_room = fixed.kv_bytes()
        for j in range(6):
            mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], 1)
            want = s(steps[:, j:j + 1], attention_mask=mask, cache=grow).logits
            got = s(steps[:, j:j + 1], cache=fixed).logits
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert fixed.kv_bytes() == kv_room  # written in place: nothing allocated per step
        assert fixed.positions.tolist() == [len(p) + 6 for p in prompts]
        with pytest.raises(ValueError, match="room"):
            s(steps[:, :1], cache=fixed)


def test_greedy_decode_batch_of_a_rotary_hybrid_equals_full_forwards(teacher, prompts):
    s = hybrid(teacher, "gated_deltanet", rope=True)
    together = greedy_decode_batch(s, prompts, 8)
    for p, tokens in zip(prompts, together):
        assert tokens == greedy_by_full_forwards(s, p[None], 8)[0, len(p):].tolist()


# ---------------------------------------------------------------- configuration and stages


def test_config_refuses_duplicates_and_layers_outside_the_student(tmp_path):
    with pytest.raises(ConfigError, match=r"names layer\(s\) \[1\] more than once"):
        load_job(None, ["student.attention_layers=[1,3,1]"])
    with pytest.raises(ConfigError, match=r"student.attention_layers=\[-2\] must be a list of layer indices >= 0"):
        load_job(None, ["student.attention_layers=[-2]"])
    job = tiny_job(tmp_path / "setting", tmp_path / "run", "student.attention_layers=[2,4]")
    with pytest.raises(ConfigError, match=r"layer\(s\) \[4\] outside the student: it has 4 layers"):
        kept_attention_layers(job)
    job = tiny_job(tmp_path / "setting", tmp_path / "run", "student.attention_layers=[3,1]")
    assert kept_attention_layers(job) == [1, 3]


def test_group_planning_leaves_the_kept_layers_out(tmp_path):
    assert layer_groups(4, 2, kept=[1]) == [[0, 2], [3]]
    assert layer_groups(4, 3, kept=[0, 1, 2, 3]) == []
    assert layer_groups(4, 2) == [[0, 1], [2, 3]]
    job = tiny_job(tmp_path / "setting", tmp_path / "run", "student.attention_layers=[1]", "run.layer_groups=2")
    assert job_layer_groups(job, 2) == [[0, 2], [3]]
    assert check_group(job, "align_mixer", [0, 1, 2]) == [0, 2]  # a range may span a kept layer
    with pytest.raises(ConfigError, match="keep the teacher's softmax attention"):
        check_group(job, "align_hidden", [1])
    with pytest.raises(ConfigError, match="contiguous"):
        check_group(job, "align_mixer", [0, 3])
    path = tmp_path / "job.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    align = plan_jobs(job, str(path), [], SlurmOptions(nodes=1, gpus_per_node=1))[0].script
    assert "#SBATCH --array=0-1" in align and "GROUPS_=(0-2 3-3)" in align


def test_a_hybrid_run_skips_kept_layers_in_stages_1_2_and_trains_them_in_stage_3(tmp_path):
    """The whole pipeline on a Qwen3 teacher (q/k norms, head_dim != hidden / heads; also the teacher-family check
    of issue 28 end to end): stages 1-2 capture from it, the kept layer stays the teacher's, stage 3 trains it."""
    from tests.pipeline import make_setting, tiny_tokenizer
    from tests.tiny import tiny_qwen3

    make_setting(tmp_path / "setting")
    tok = tiny_tokenizer()
    qwen = tiny_qwen3(num_layers=4, vocab=len(tok))
    qwen.config.eos_token_id = tok.eos_token_id
    qwen.save_pretrained(tmp_path / "qwen3")
    tok.save_pretrained(tmp_path / "qwen3")
    out = tmp_path / "run"
    job = tiny_job(tmp_path / "setting", out, f"teacher.source={tmp_path / 'qwen3'}", "student.attention_layers=[1]",
                   "budget.split=[0.1,0.1,0.8]", "run.layer_groups=1", "run.parallel_groups=1", total=640)
    path = tmp_path / "job.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.structured(job)))
    done = harness_cli("run", str(path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    for stage in ("align_mixer", "align_hidden"):  # one group, spanning the kept layer
        with safe_open(out / stage / "layers-00-03" / "weights.safetensors", framework="pt") as f:
            assert {int(k.split(".")[2]) for k in f.keys()} == {0, 2, 3}
    teacher = AutoModelForCausalLM.from_pretrained(tmp_path / "qwen3")
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    final = AutoModelForCausalLM.from_pretrained(out / "student")
    assert merged.config.attention_layers == final.config.attention_layers == [1]
    theirs = teacher.model.layers[1].state_dict()
    for name, tensor in merged.model.layers[1].state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    trained = final.model.layers[1].self_attn.q_proj.weight
    assert not torch.equal(trained.float(), theirs["self_attn.q_proj.weight"].float())  # stage 3 trained it
    assert torch.isfinite(final(torch.randint(1, 300, (1, 12))).logits).all()
    assert final.model.layers[0].mixer.q_norm.weight.shape == theirs["self_attn.q_norm.weight"].shape  # Qwen3's


def test_decode_bench_reports_the_hybrids_kv_bytes_as_the_teachers_per_layer():
    from harness.bench.decode import bench_decode

    res = bench_decode("tiny", "gla", contexts=(8, 24), new_tokens=2, warmup_tokens=1, batch=2, device="cpu",
                       dtype="fp32", attention_layers=[1], options={"chunk_size": 8})
    assert res["attention_layers"] == [1] and res["layers"] == 2
    for row in res["rows"]:
        s, t = row["student"], row["teacher"]
        # one kept layer of two: half the teacher's KV cache, which holds as many tokens (the transformers cache)
        assert s["kv_bytes"] * 2 == t["state_bytes"] and s["state_bytes"] > s["kv_bytes"]
        assert s["kv_bytes_per_token"] == s["kv_bytes"] / (row["context"] + 3)  # prompt + warm-up + timed steps


def test_bench_attention_layers_argument_names_a_bad_item():
    from harness.bench.cli import _attention_layers

    assert _attention_layers("3, 17") == [3, 17] and _attention_layers("") == []
    with pytest.raises(SystemExit, match="item 'x' is not a layer index"):
        _attention_layers("3,x")
    with pytest.raises(SystemExit, match="names a layer twice"):
        _attention_layers("3,3")
