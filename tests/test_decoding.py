"""harness.decoding's greedy loop gives exactly the tokens of transformers' `generate` for every mixer (stop
tokens, the length cap and a text criterion included), and NIAH / chat samples go through it for students. The
CUDA-graph path is checked against this eager loop in tests/gpu/test_decoding_gpu.py."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

import harness
from harness.decoding import GraphedStep, graphable, greedy_decode
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


def test_greedy_decode_rejects_a_batch(teacher):
    student = harness.build_student(teacher, "gla").eval()
    with pytest.raises(ValueError, match="batch of 2"):
        greedy_decode(student, torch.ones(2, 4, dtype=torch.long), 3)


def test_graphs_need_a_cuda_student_without_rope(teacher, monkeypatch):
    from harness import decoding

    student = harness.build_student(teacher, "gated_deltanet").eval()
    assert not graphable(student) and not graphable(teacher)  # on the CPU; a teacher is never graphed here
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
    from harness import decoding
    from harness.eval.niah import greedy_ids

    calls = []
    real = decoding.greedy_decode
    monkeypatch.setattr(decoding, "greedy_decode", lambda *a, **k: calls.append(1) or real(*a, **k))

    class Tok:
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids)) + ("\n" if len(ids) >= 3 else "")

    student = harness.build_student(teacher, "deltanet").eval()
    ids = torch.randint(3, teacher.config.vocab_size, (1, 9))
    new = greedy_ids(student, Tok(), ids, 10, [], lambda text: "\n" in text)
    assert calls and new == greedy_decode(student, ids, 10)[:3]
    assert greedy_ids(teacher, Tok(), ids, 10, [], lambda text: "\n" in text) == hf_greedy(teacher, ids, 10, [])[:3]
