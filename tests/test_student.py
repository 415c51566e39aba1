"""Students built from tiny GQA teachers: weight transfer, HF save/load, recurrent generation."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import harness
from harness.mixers import MIXERS
from harness.student import RecurrentCache, count_parameters
from tests.tiny import tiny_llama


@pytest.fixture(scope="module")
def teacher():
    return tiny_llama(num_layers=2, hidden=64, heads=4, kv_heads=2)


def randomize_new_parameters(student):
    """Gates away from their init so that tests see every parameter."""
    torch.manual_seed(5)
    with torch.no_grad():
        for layer in student.model.layers:
            for n, p in layer.mixer.named_parameters():
                if not n.startswith(("q_proj", "k_proj", "v_proj", "o_proj")):
                    p.add_(0.2 * torch.randn_like(p))


@pytest.mark.parametrize("name", list(MIXERS))
def test_weight_transfer_copies_bit_for_bit(teacher, name):
    student = harness.build_student(teacher, name, backend="reference")
    n_rep = teacher.config.num_attention_heads // teacher.config.num_key_value_heads
    d = teacher.config.head_dim
    assert torch.equal(student.model.embed_tokens.weight, teacher.model.embed_tokens.weight)
    assert torch.equal(student.model.norm.weight, teacher.model.norm.weight)
    assert student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()  # tied
    for t, s in zip(teacher.model.layers, student.model.layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            assert torch.equal(getattr(s, norm).weight, getattr(t, norm).weight)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(s.mlp, proj).weight, getattr(t.mlp, proj).weight)
        assert torch.equal(s.mixer.q_proj.weight, t.self_attn.q_proj.weight)
        assert torch.equal(s.mixer.o_proj.weight, t.self_attn.o_proj.weight)
        for proj in ("k_proj", "v_proj"):
            sw = getattr(s.mixer, proj).weight.view(-1, d, t.self_attn.q_proj.in_features)
            tw = getattr(t.self_attn, proj).weight.view(-1, d, t.self_attn.q_proj.in_features)
            for j in range(sw.shape[0]):
                assert torch.equal(sw[j], tw[j // n_rep]), f"{proj} head {j}"


@pytest.mark.parametrize("name", list(MIXERS))
def test_save_load_gives_identical_logits(teacher, name, tmp_path):
    student = harness.build_student(teacher, name, backend="reference")
    randomize_new_parameters(student)
    ids = torch.randint(3, 97, (2, 21))
    with torch.no_grad():
        before = student(ids).logits
    student.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == "HarnessForCausalLM"
    assert loaded.config.mixer == name
    with torch.no_grad():
        after = loaded(ids).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize("name", list(MIXERS))
def test_greedy_generate_with_state_equals_repeated_full_forwards(teacher, name):
    student = harness.build_student(teacher, name, backend="reference").eval()
    randomize_new_parameters(student)
    prompt = torch.randint(3, 97, (1, 13))
    new = 12
    with torch.no_grad():
        out = student.generate(prompt, max_new_tokens=new, do_sample=False, min_new_tokens=new,
                               pad_token_id=0, eos_token_id=None)
        ids = prompt
        for _ in range(new):
            nxt = student(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    assert out.shape[1] == prompt.shape[1] + new
    assert torch.equal(out, ids)


def test_rope_student_generates_consistently(teacher):
    student = harness.build_student(teacher, "gla", backend="reference", rope=True).eval()
    randomize_new_parameters(student)
    prompt = torch.randint(3, 97, (1, 9))
    with torch.no_grad():
        out = student.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0, eos_token_id=None)
        ids = prompt
        for _ in range(6):
            ids = torch.cat([ids, student(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(out, ids)


@pytest.mark.parametrize("name,rope", [("gated_deltanet", False), ("gla", True)])
def test_generate_from_inputs_embeds_equals_generate_from_ids(teacher, name, rope):
    """generate(inputs_embeds=...) (prompt embeddings, as multimodal and soft-prompt callers pass them) returns the
    tokens generate(input_ids=...) adds, also for a left-padded batch."""
    student = harness.build_student(teacher, name, backend="reference", rope=rope).eval()
    randomize_new_parameters(student)
    ids = torch.randint(3, 97, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # row 1 is a 7-token prompt, left-padded
    kw = dict(max_new_tokens=6, do_sample=False, min_new_tokens=6, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        from_ids = student.generate(input_ids=ids, attention_mask=mask, **kw)[:, ids.shape[1]:]
        embeds = student.get_input_embeddings()(ids)
        from_embeds = student.generate(inputs_embeds=embeds, attention_mask=mask, **kw)
    assert from_embeds.shape == (2, 6)
    assert torch.equal(from_embeds, from_ids)


def test_decoding_state_does_not_grow_with_context(teacher):
    student = harness.build_student(teacher, "gated_deltanet", backend="reference").eval()
    cache = RecurrentCache(student.config.num_hidden_layers)
    sizes = []
    with torch.no_grad():
        student(torch.randint(3, 97, (1, 8)), cache=cache, use_cache=True)
        for _ in range(3):
            student(torch.randint(3, 97, (1, 40)), cache=cache, use_cache=True)
            sizes.append(cache.state_bytes())
    assert cache.seen_tokens == 8 + 3 * 40
    assert len(set(sizes)) == 1 and sizes[0] > 0


def test_parameter_count_adds_only_the_new_parameters(teacher):
    student = harness.build_student(teacher, "deltanet")
    attn = teacher.model.layers[0].self_attn
    kv_extra = 2 * (attn.q_proj.out_features - attn.k_proj.out_features) * attn.k_proj.in_features
    new = sum(p.numel() for n, p in student.named_parameters() if ".mixer." in n and not any(
        k in n for k in ("q_proj", "k_proj", "v_proj", "o_proj")))
    layers = teacher.config.num_hidden_layers
    assert count_parameters(student) == count_parameters(teacher) + layers * kv_extra + new


def test_unknown_mixer_is_refused_before_building(teacher):
    with pytest.raises(ValueError, match="valid mixers"):
        harness.build_student(teacher, "transformer")


def test_partial_recompute_checkpoints_only_the_chosen_blocks_and_keeps_the_gradients():
    """enable_recompute(0.25) on 8 blocks recomputes 2, spread over the depth: those blocks run their forward
    twice per step (once more in backward), the others once, and every gradient equals the plain run's."""
    student = harness.build_student(tiny_llama(num_layers=8, hidden=64, heads=4, kv_heads=2), "gated_deltanet")
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))

    def grads_and_calls(fraction):
        model = harness.build_student(tiny_llama(num_layers=8, hidden=64, heads=4, kv_heads=2), "gated_deltanet")
        model.load_state_dict(student.state_dict())
        chosen = model.enable_recompute(fraction) if fraction else []
        model.train()
        calls = [0] * 8
        for i, block in enumerate(model.model.layers):
            block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        model(ids).logits.float().square().mean().backward()
        return chosen, calls, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    chosen, calls, grads = grads_and_calls(0.25)
    assert chosen == [2, 6]
    assert calls == [2 if i in chosen else 1 for i in range(8)]
    _, plain_calls, plain = grads_and_calls(None)
    assert plain_calls == [1] * 8 and grads.keys() == plain.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, plain[name], rtol=1e-5, atol=1e-7, msg=name)
    assert grads_and_calls(1.0)[0] == list(range(8))
    with pytest.raises(ValueError, match="fraction=0"):
        student.enable_recompute(0)


def test_block_norm_with_a_residual_adds_first_then_normalises_as_the_teacher_norm():
    """BlockRMSNorm's unfused form (CPU, the reference backend) is LlamaRMSNorm of residual + x, bit for bit, and
    returns that sum for the next residual; without a residual it is LlamaRMSNorm itself."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from harness.student import BlockRMSNorm

    torch.manual_seed(0)
    norm, ref = BlockRMSNorm(32, eps=1e-5).bfloat16(), LlamaRMSNorm(32, eps=1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    ref.load_state_dict(norm.state_dict())
    x, res = torch.randn(2, 5, 32).bfloat16(), torch.randn(2, 5, 32).bfloat16()
    normed, total = norm(x, residual=res)
    assert torch.equal(total, res + x)
    assert torch.equal(normed, ref(res + x))
    assert torch.equal(norm(x), ref(x))
    assert not torch.equal(normed, ref(x))  # the residual did count


def test_a_zero_embedding_row_is_named_when_the_student_is_built():
    """Such a token keeps the student's hidden state exactly zero through every block, and the norms' backward
    overflows (docs/BENCHMARKS.md, runs 16-18): the build says which ids."""
    model = tiny_llama(num_layers=1)
    with torch.no_grad():
        model.model.embed_tokens.weight[5].zero_()
    with pytest.warns(RuntimeWarning, match=r"token id\(s\) \[5\] are all zero"):
        student = harness.build_student(model, "gated_deltanet")
    ids = torch.tensor([[7, 9, 5, 11]])
    hidden = {}
    student.model.norm.register_forward_pre_hook(lambda _m, a: hidden.__setitem__("x", a[0]))
    student.model(ids)
    assert float(hidden["x"][0, 2].abs().max()) == 0.0  # what the warning is about
    assert float(hidden["x"][0, 1].abs().max()) > 0.0


@pytest.mark.parametrize("name", list(MIXERS))
def test_a_student_saved_before_the_init_options_loads_as_it_was_made(teacher, name, tmp_path):
    """A student saved before conv_init, qkv_activation, gate_init and output_scale existed (its config lacks them,
    and a swish gate had no bias) loads under those options' old values (LEGACY_OPTION_VALUES) and computes what
    it computed then: the same logits."""
    import json

    from safetensors.torch import load_file, save_file

    from harness.mixers import LEGACY_OPTION_VALUES, resolved_options

    legacy = {k: v for k, v in LEGACY_OPTION_VALUES.items() if k in resolved_options(name)}
    student = harness.build_student(teacher, name, backend="reference", **legacy)
    randomize_new_parameters(student)
    swish_bias = [n for n in student.state_dict() if n.endswith("mixer.g_proj.bias")]  # added with gate_init
    with torch.no_grad():
        for n in swish_bias:
            student.get_parameter(n).zero_()  # what the old gate without a bias computed
    ids = torch.randint(3, 97, (2, 21))
    with torch.no_grad():
        before = student(ids).logits
    student.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["mixer_options"] = {k: v for k, v in config["mixer_options"].items() if k not in legacy}
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if k not in swish_bias}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for option, value in legacy.items():
        assert getattr(loaded.model.layers[0].mixer.options, option) == value, option
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, before)
