"""harness.decoding's greedy loop gives exactly the tokens of transformers' `generate` for every mixer (stop
tokens, the length cap and a text criterion included), its batched form gives each prompt's batch-1 tokens, and
NIAH / chat samples go through it for students. The CUDA-graph path is checked against this eager loop in
tests/gpu/test_decoding_gpu.py."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import harness
from harness import decoding
from harness.decoding import GraphedStep, graph_blocker, graphable, greedy_decode, greedy_decode_batch
from harness.mixers import MIXERS
from tests.tiny import tiny_llama


@pytest.fixture(scope="module")
def teacher():
    torch.manual_seed(0)
    return tiny_llama()


def hf_greedy(model, ids, max_new, stop):
    model.generation_config.eos_token_id = None  # generate would fill an unset eos from the model's config (id 2)
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, num_beams=1, eos_token_id=stop or None,
                              pad_token_id=0)
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)[0,
                                                                                                    ids.shape[1]:].tolist()


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_greedy_decode_equals_generate(teacher, mixer):
    torch.manual_seed(1)
    student = harness.build_student(teacher, mixer, chunk_size=8).eval()
    ids = torch.randint(3, teacher.config.vocab_size, (1, 21))
    free = greedy_decode(student, ids, 12)
    assert free == hf_greedy(student, ids, 12, [])
    assert len(free) == 12
    stop = [free[5]]  # a token it will produce: both end right after its first occurrence, the stop included
    stopped = greedy_decode(student, ids, 12, stop_ids=stop)
    assert stopped == hf_greedy(student, ids, 12, stop) and stopped[-1] == free[5]
    assert greedy_decode(student, ids, 12, done=lambda new: len(new) >= 4) == free[:4]


MIXER_CASES = [(m, False) for m in sorted(MIXERS)] + [(m, True) for m in ("gla", "gated_deltanet", "mlstm")]
LENGTHS = (5, 13, 22, 9)  # chunk_size 8: shorter and longer than a chunk, unsorted


def random_student(teacher, mixer, rope):
    torch.manual_seed(1)
    model = harness.build_student(teacher, mixer, chunk_size=8, rope=rope).eval()
    for layer in model.model.layers:  # random conv taps: the identity init would hide a wrong conv tail
        if hasattr(layer.mixer, "qkv_conv"):
            layer.mixer.qkv_conv.reset_parameters("random")
    return model


@pytest.mark.parametrize("mixer,rope", MIXER_CASES)
def test_batched_greedy_decode_gives_each_prompts_batch_1_tokens(teacher, mixer, rope):
    """Prompts of different lengths decoded together: each row's tokens are greedy_decode's for that prompt alone,
    also when the rows stop at different steps (a stop token, a per-row `done`, the length cap)."""
    student = random_student(teacher, mixer, rope)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, teacher.config.vocab_size, (n,), generator=gen) for n in LENGTHS]
    alone = [greedy_decode(student, p[None], 12) for p in prompts]
    assert greedy_decode_batch(student, prompts, 12) == alone
    assert greedy_decode_batch(student, [p.tolist() for p in prompts], 12) == alone  # lists of ids too
    stop = [alone[0][2], alone[1][7]]
    stopped = [greedy_decode(student, p[None], 12, stop_ids=stop) for p in prompts]
    assert len({len(s) for s in stopped}) > 1, "the rows must end at different steps for this check to mean anything"
    assert greedy_decode_batch(student, prompts, 12, stop_ids=stop) == stopped

    def done(new):  # depends on the row's own tokens: each row ends at its own step
        return len(new) >= 2 and new[-1] % 3 == 0

    ended = [greedy_decode(student, p[None], 12, done=done) for p in prompts]
    assert len({len(e) for e in ended}) > 1
    assert greedy_decode_batch(student, prompts, 12, done=done) == ended


def test_rotary_steps_read_positions_from_the_cache(teacher, monkeypatch):
    """After left-padded prompts a rotary student's steps take no mask: each row's position is tracked in the
    cache on the device and advanced by the step (what a CUDA graph replays), and the tokens are `generate`'s for
    each prompt alone."""
    student = random_student(teacher, "gla", True)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    alone = [hf_greedy(student, torch.tensor([p]), 6, []) for p in prompts]  # generate: positions from its mask
    steps = []
    forward = student.forward

    def spy(ids, **kw):
        cache = kw.get("cache")
        if ids.shape[1] == 1:
            steps.append((kw.get("attention_mask"), cache.positions.tolist()))
        return forward(ids, **kw)

    monkeypatch.setattr(student, "forward", spy)
    assert greedy_decode_batch(student, prompts, 6) == alone
    assert [mask for mask, _ in steps] == [None] * 5
    assert [positions for _, positions in steps] == [[3 + i, 7 + i] for i in range(5)]


def test_batched_decoding_stops_once_every_row_has(teacher, monkeypatch):
    """One unpadded prefill per prompt, then batched steps until the last row ends, not one more: row 0 ends at
    its first token (a stop token), row 1 after four, so three steps of two rows run."""
    student = random_student(teacher, "retnet", False)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    free = greedy_decode_batch(student, prompts, 8)
    assert free[0][0] not in free[1][:4]
    calls = []
    forward = student.forward
    monkeypatch.setattr(student, "forward", lambda ids, **kw: calls.append(tuple(ids.shape)) or forward(ids, **kw))
    out = greedy_decode_batch(student, prompts, 20, stop_ids=[free[0][0]], done=lambda new: len(new) >= 4)
    assert out == [free[0][:1], free[1][:4]]
    assert calls == [(1, 3), (1, 5), (2, 1), (2, 1), (2, 1)]


def test_greedy_decode_rejects_a_batch(teacher):
    student = harness.build_student(teacher, "gla").eval()
    with pytest.raises(ValueError, match="batch of 2"):
        greedy_decode(student, torch.ones(2, 4, dtype=torch.long), 3)


def test_graphs_need_a_cuda_student(teacher, monkeypatch):
    student = harness.build_student(teacher, "gated_deltanet").eval()
    assert not graphable(student) and not graphable(teacher)  # on the CPU; a teacher is never graphed here
    rotary = harness.build_student(teacher, "gated_deltanet", rope=True).eval()
    assert graph_blocker(rotary) == "it is not on a CUDA device"  # its positions live in the cache
    with pytest.raises(ValueError, match="CUDA"):
        GraphedStep(student, None)
    asked = []
    monkeypatch.setattr(decoding, "graphable", lambda model: asked.append(model) or False)
    ids = torch.randint(3, teacher.config.vocab_size, (1, 5))
    greedy_decode(student, ids, 3)
    assert asked, "graphs are on by default"
    monkeypatch.setenv("HARNESS_DECODE_GRAPHS", "0")
    asked.clear()
    greedy_decode(student, ids, 3)
    assert not asked, "HARNESS_DECODE_GRAPHS=0 turns them off"


def test_niah_and_chat_samples_decode_students_through_the_loop(teacher, monkeypatch):
    from harness.decoding import greedy_ids

    calls = []
    real = decoding.greedy_decode_batch
    monkeypatch.setattr(decoding, "greedy_decode_batch", lambda *a, **k: calls.append(1) or real(*a, **k))

    class Tok:
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids)) + ("\n" if len(ids) >= 3 else "")

    student = harness.build_student(teacher, "deltanet").eval()
    ids = torch.randint(3, teacher.config.vocab_size, (1, 9))
    new = greedy_ids(student, Tok(), ids, 10, [], lambda text: "\n" in text)
    assert calls and new == greedy_decode(student, ids, 10)[:3]
    assert greedy_ids(teacher, Tok(), ids, 10, [], lambda text: "\n" in text) == hf_greedy(teacher, ids, 10, [])[:3]
