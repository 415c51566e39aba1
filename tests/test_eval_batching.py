"""Greedy generation in batches (eval.generation_batch_size) gives the results of batch 1: NIAH on the tiny
pipeline (per-sample outputs, scores and niah.json) and chat samples, for a student without rotary embeddings,
one with them, and the teacher (left-padded `generate`). lm-eval's generate_until in batches: tests/test_bench.py;
the decoding loop itself: tests/test_decoding.py."""

from __future__ import annotations

import json

import pytest
import torch

import harness
from harness.eval.chat_samples import generate_chat_samples, generate_response, prompt_ids, stop_ids
from harness.decoding import greedy_ids, greedy_ids_batch
from harness.eval.niah import NiahGrid, build_sample, run_niah
from tests.pipeline import tiny_tokenizer
from tests.tiny import tiny_llama

MODELS = ("gated_deltanet", "gla-rope", "teacher")
GRID = dict(lengths=[256, 320], depths=[0.0, 1.0], kinds=["passkey", "kv"], samples=2, max_new_tokens=12)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def make_model(name: str, tok, stop_after_prompt: list[int] | None = None):
    """The tiny teacher or a student of it (random conv taps); with `stop_after_prompt`, the model's EOS becomes
    the third token it generates after that prompt, so that its answers end at different steps."""
    model = tiny_llama(num_layers=2, hidden=64, heads=4, kv_heads=2, vocab=len(tok), seed=0)
    if name == "teacher":  # larger weights: at the default init its answers repeat one token whatever the prompt
        torch.manual_seed(5)
        with torch.no_grad():
            for weight in (p for p in model.parameters() if p.dim() == 2):
                weight.normal_(0, 0.2)
    else:
        mixer, _, rope = name.partition("-")
        torch.manual_seed(1)
        model = harness.build_student(model, mixer, chunk_size=16, backend="reference", rope=bool(rope)).eval()
        for layer in model.model.layers:
            if hasattr(layer.mixer, "qkv_conv"):
                layer.mixer.qkv_conv.reset_parameters("random")
    model.generation_config.eos_token_id = None
    if stop_after_prompt is not None:
        model.generation_config.eos_token_id = greedy_ids_batch(model, tok, [stop_after_prompt], 4, [])[0][2]
    return model


def cells(path) -> dict:
    """niah_cells.jsonl's records by sample key (the header line left out)."""
    records = [json.loads(line) for line in open(path / "niah_cells.jsonl")][1:]
    return {(r["kind"], r["length"], r["depth"], r["index"]): r for r in records}


@pytest.mark.parametrize("name", MODELS)
def test_greedy_ids_batch_cuts_each_row_where_it_ends_alone(tok, name):
    """A text criterion that ends rows at different steps (a teacher's `generate` goes on for the rows not done
    and pads the done ones): each row is what greedy_ids gives for its prompt alone."""
    model = make_model(name, tok)
    grid = NiahGrid(**GRID)
    prompts = [build_sample(tok, grid, kind, length, 0.0, 0).input_ids[-n:] for kind, length, n in
               [("kv", 256, 200), ("passkey", 320, 37), ("kv", 320, 120), ("passkey", 256, 64)]]

    def done(text):
        return len(text) >= 9

    alone = [greedy_ids(model, tok, torch.tensor([p]), 12, [], done) for p in prompts]
    assert len({len(a) for a in alone}) > 1 and all(len(a) < 12 for a in alone)
    for r in range(len(prompts)):  # every row first once: a row's end must not end the others
        assert greedy_ids_batch(model, tok, prompts[r:] + prompts[:r], 12, [], done) == alone[r:] + alone[:r]


@pytest.mark.parametrize("name", MODELS)
def test_niah_in_batches_equals_niah_at_batch_1(tok, name, tmp_path):
    grid = NiahGrid(**GRID)
    model = make_model(name, tok, build_sample(tok, grid, "kv", 256, 1.0, 0).input_ids)
    one = run_niah(model, tok, grid, tmp_path / "one", label="m", progress=False)
    three = run_niah(model, tok, grid, tmp_path / "three", label="m", progress=False, generation_batch_size=3)
    assert three == one
    alone, batched = cells(tmp_path / "one"), cells(tmp_path / "three")
    assert len(alone) == 16 and batched == alone  # outputs, exact matches, log-probs and ranks, sample by sample
    outputs = [r["output"] for r in alone.values()]
    assert len({len(o) for o in outputs}) > 2, "answers of different lengths (rows ending at different steps)"


def test_niah_batches_hold_several_lengths_and_resume(tok, tmp_path, monkeypatch):
    """16 samples at batch 5: batches of 5, 5, 5, 1 taken by length (one mixes 256 and 320); a rerun at another
    batch size generates nothing."""
    from harness.eval import niah

    grid = NiahGrid(**GRID)
    model = make_model("gated_deltanet", tok)
    sizes = []
    real = niah.generate_answers
    monkeypatch.setattr(niah, "generate_answers", lambda m, t, prompts, *a: sizes.append(sorted(map(len, prompts)))
                        or real(m, t, prompts, *a))
    run_niah(model, tok, grid, tmp_path, label="m", progress=False, generation_batch_size=5)
    assert sizes == [[256] * 5, [256] * 3 + [320] * 2, [320] * 5, [320]]
    sizes.clear()
    run_niah(model, tok, grid, tmp_path, label="m", progress=False, generation_batch_size=2)
    assert sizes == []
    with pytest.raises(ValueError, match="generation_batch_size=0"):
        run_niah(model, tok, grid, tmp_path, label="m", progress=False, generation_batch_size=0)


@pytest.mark.parametrize("name", MODELS)
def test_chat_samples_in_batches_equal_batch_1(tok, name, tmp_path):
    model = make_model(name, tok, prompt_ids(tok, "Hi! How are you today?", "plain"))
    one = generate_chat_samples(model, tok, None, tmp_path / "one", label="m", max_new_tokens=16)
    four = generate_chat_samples(model, tok, None, tmp_path / "four", label="m", max_new_tokens=16,
                                 generation_batch_size=4)
    assert four == one
    assert json.loads((tmp_path / "four" / "chat_samples.json").read_text()) == one
    for sample in one["samples"]:  # in prompt order, each the answer to its prompt alone
        alone = generate_response(model, tok, prompt_ids(tok, sample["prompt"], "plain"), max_new_tokens=16,
                                  stop=stop_ids(model, tok), plain=True)
        assert sample == {"prompt": sample["prompt"], **alone}
    assert {s["stopped"] for s in one["samples"]} == {"end_of_turn", "max_new_tokens"}
    assert len({s["tokens"] for s in one["samples"]}) > 1


def test_the_evaluation_job_passes_generation_batch_size_everywhere(tmp_path, monkeypatch):
    """eval.generation_batch_size reaches the spec (and is checked there), then NIAH, chat samples and lm-eval's
    generation batch."""
    from harness.config import ConfigError, load_job
    from harness.eval import chat_samples, job, lm_eval_tasks, niah
    from harness.eval.spec import load_eval_spec, spec_from_job

    spec = spec_from_job(load_job(None, ["eval.generation_batch_size=4", "eval.tasks=[gsm8k]"]), tmp_path)
    assert spec.generation_batch_size == 4
    seen = {}
    monkeypatch.setattr(niah, "run_niah", lambda *a, **k: seen.setdefault("niah", k["generation_batch_size"]))
    monkeypatch.setattr(chat_samples, "generate_chat_samples",
                        lambda *a, **k: seen.setdefault("chat", k["generation_batch_size"]))
    monkeypatch.setattr(lm_eval_tasks, "run_benchmarks",
                        lambda *a, **k: seen.setdefault("bench", k["generate_batch_size"]))
    spec.job = None  # no perplexity
    spec.copy = spec.text_copy = None  # nor the copy probe and the copy on text, which need a model (no generation)
    job.evaluate_model(None, None, spec, tmp_path / "out", label="m", device=torch.device("cpu"), progress=False)
    assert seen == {"niah": 4, "chat": 4, "bench": 4}
    path = tmp_path / "eval.yaml"
    path.write_text(f"checkpoint: {tmp_path}\noutput_dir: {tmp_path}\n")
    assert load_eval_spec(path, ["generation_batch_size=2"]).generation_batch_size == 2
    with pytest.raises(ConfigError, match="generation_batch_size=0 must be a positive number"):
        load_eval_spec(path, ["generation_batch_size=0"])
